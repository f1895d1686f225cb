"""A run that fails its data check before the first step leaves no folder that holds its name.

The data module refuses a window longer than the corpus's stream only when Lightning sets it up,
after the run folder was claimed and the MLflow run opened; that run must end FAILED, and the
same name must train next time without a --resume or "already holds a run" message.
"""

from __future__ import annotations

import pytest

from moelab.model.config import ConfigError
from moelab.train import fit
from tests.train.helpers import tiny_config

# A window the config accepts (<= model.max_seq_len) but longer than the tiny corpus's streams.
TOO_LONG = {"data__seq_len": 10**6, "model__max_seq_len": 10**6, "train__max_steps": 2, "train__warmup_steps": 1,
            "train__val_every": 2}


def test_data_check_failure_leaves_no_folder_and_a_failed_run(tmp_path, tracking_uri) -> None:
    from mlflow.tracking import MlflowClient

    folder = tmp_path / "runs" / "tiny"
    with pytest.raises(ConfigError, match=r"data.seq_len=1000000 is not allowed: the val stream") as info:
        fit(tiny_config(folder, tracking_uri, **TOO_LONG))
    assert "--resume" not in str(info.value)
    assert not folder.exists()
    client = MlflowClient(tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name("train/tiny").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]

    # The name is free: a good config trains into it at once.
    done = fit(tiny_config(folder, tracking_uri, train__max_steps=2, train__warmup_steps=1, train__val_every=2))
    assert done.status == "finished" and (folder / "summary.json").is_file()


def test_a_folder_with_other_files_is_kept(tmp_path) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("kept")
    with pytest.raises(ConfigError, match=r"data.seq_len=1000000 is not allowed: the val stream"):
        fit(tiny_config(folder, **TOO_LONG))
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
