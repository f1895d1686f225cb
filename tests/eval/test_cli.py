"""``python -m moelab eval`` on a tiny checkpoint: every task writes its JSON, passkey also an MLflow run in
``eval/<preset>``; lengths beyond the model's window run in chunks; bad lengths exit 2 with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.train import fit
from tests.train.helpers import tiny_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-run")
    return fit(tiny_config(folder, train__max_steps=2, train__val_every=2, train__warmup_steps=1)).last_checkpoint


def test_passkey_writes_json_and_an_mlflow_run(checkpoint: Path, tmp_path: Path, tracking_uri: str, capsys) -> None:
    from mlflow.tracking import MlflowClient

    out = tmp_path / "passkey.json"
    # tiny: model.max_seq_len 128, data.seq_len 64 -> 320 tokens run as five 64-token chunks
    code = main(["eval", "--ckpt", str(checkpoint), "--task", "passkey", "--lengths", "160", "320", "--depths", "0",
                 "1", "--samples", "2", "--tracking-uri", tracking_uri, "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["step"] == 2 and report["settings"]["chunk_size"] == 64
    assert report["lengths"] == [160, 320] and report["depths"] == [0.0, 1.0]
    assert len(report["accuracy"]) == 2 and all(len(row) == 2 for row in report["accuracy"])
    assert all(0.0 <= a <= 1.0 for row in report["accuracy"] for a in row)
    # what persists between chunks: 1 MLA layer x kv_latent_dim 32 x fp32 per token
    assert report["state_bytes_per_token"] == pytest.approx(128.0)
    assert json.loads(capsys.readouterr().out)["json"] == str(out)

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("eval/tiny")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "tiny-passkey" and run.info.status == "FINISHED"
    assert run.data.params["eval.lengths"] == "[160, 320]"
    history = client.get_metric_history(run.info.run_id, "passkey/acc")
    assert sorted(m.step for m in history) == [160, 320]
    assert run.data.metrics["memory/state_bytes_per_token"] == pytest.approx(128.0)


@pytest.mark.parametrize("task", ["mqar", "loss_by_position"])
def test_other_tasks_write_json(checkpoint: Path, tmp_path: Path, task: str) -> None:
    out = tmp_path / f"{task}.json"
    code = main(["eval", "--ckpt", str(checkpoint), "--task", task, "--lengths", "96", "256", "--samples", "2",
                 "--mqar-pairs", "4", "--chunk-size", "48", "--no-mlflow", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["task"] == task and report["lengths"] == [96, 256]
    if task == "mqar":
        assert len(report["accuracy"]) == 2 and all(0.0 <= a <= 1.0 for a in report["accuracy"])
    else:
        curve = report["curves"][1]
        assert curve["bin_start"][0] == 0 and curve["bin_end"][-1] == 256 and len(curve["loss"]) == len(
            curve["bin_end"])
        assert 0.0 < curve["mean_loss"] < 10.0


def test_bad_lengths_exit_2_with_the_reason(checkpoint: Path, tmp_path: Path, capsys) -> None:
    code = main(["eval", "--ckpt", str(checkpoint), "--task", "passkey", "--lengths", "40", "--no-mlflow",
                 "--out", str(tmp_path / "x.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--lengths 40 cannot hold a passkey sample" in err and "needs at least" in err
    assert not (tmp_path / "x.json").exists()
