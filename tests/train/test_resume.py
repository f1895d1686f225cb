"""Resume applies what it records, refuses what it cannot honour, never overwrites a finished run, and
trusts only checkpoints that verify."""

from __future__ import annotations

import fcntl
import json

import pytest
import torch

from moelab.train import fit
from moelab.train.module import lr_factor
from moelab.train.runner import (
    AtomicCheckpointIO,
    CheckpointError,
    RunFolderError,
    load_checkpoint,
    resume_path,
)
from tests.train.helpers import tiny_config


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _n_runs(uri: str, experiment: str) -> int:
    client = _client(uri)
    return len(client.search_runs([client.get_experiment_by_name(experiment).experiment_id]))


def test_resume_refuses_what_it_cannot_honour_and_applies_what_it_records(tmp_path, tracking_uri) -> None:
    folder = tmp_path / "run"
    base = {"train__max_steps": 4, "train__val_every": 2, "train__warmup_steps": 1}
    first = fit(tiny_config(folder, tracking_uri, **base))
    history, summary = (folder / "history.csv").read_text(), (folder / "summary.json").read_text()

    # A changed model is refused in one message listing every differing key, before MLflow hears of it.
    changed = tiny_config(folder, tracking_uri, **{**base, "train__max_steps": 8}, model__kda__gate="softplus",
                          model__d_model=96, model__kda__head_dim=48, model__mla__head_dim=48)
    with pytest.raises(CheckpointError, match=r"model.d_model: 64 -> 96.*model.kda.gate: 'bounded' -> 'softplus'"):
        fit(changed, resume=True)
    # A finished run is not resumed (and its outputs are not touched); nor is its folder reused.
    with pytest.raises(CheckpointError, match=r"nothing to resume: .*step 4 and train.max_steps=4"):
        fit(tiny_config(folder, tracking_uri, **base), resume=True)
    with pytest.raises(RunFolderError, match=r"already holds a run \(finished at step 4"):
        fit(tiny_config(folder, tracking_uri, **base))
    assert (folder / "history.csv").read_text() == history and (folder / "summary.json").read_text() == summary
    assert _n_runs(tracking_uri, "train/tiny") == 1

    # The first process "was killed" (its run left RUNNING) and left a checkpoint temp file behind.
    _client(tracking_uri).update_run(first.run_id, status="RUNNING")
    (folder / ".last.0123456789ab.tmp.ckpt").write_bytes(b"half a checkpoint")

    more = tiny_config(folder, tracking_uri, **{**base, "train__max_steps": 8}, train__lr=3e-2)
    resumed = fit(more, resume=folder)  # a run folder stands for its last.ckpt
    # Steps 5..8 ran with the new peak lr on the new schedule (the row's lr is the one for the next step).
    for row in resumed.history[4:]:
        want = 3e-2 * lr_factor(int(row["step"]), 1, 8, more.train.min_lr_ratio)
        assert row["train/lr"] == pytest.approx(want, rel=1e-6), row
    assert "lr: 0.03" in (folder / "config.yaml").read_text()
    run = _client(tracking_uri).get_run(resumed.run_id)
    assert run.data.params["train.lr"] == "0.03"
    assert run.data.tags["moelab.resume_changes"] == "train.lr: 0.003 -> 0.03, train.max_steps: 4 -> 8"
    # Closed with the status its summary.json records (finished): the one its store missed (kill -9 before a
    # summary: KILLED, tests/train/test_fit.py).
    assert _client(tracking_uri).get_run(first.run_id).info.status == "FINISHED"
    assert not list(folder.glob(".*.tmp*"))
    assert [int(r["step"]) for r in resumed.history] == list(range(1, 9))


def test_a_live_run_owns_its_folder(tmp_path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    with open(folder / "run.lock", "w") as f:
        f.write(json.dumps({"pid": 4242, "host": "elsewhere", "run_id": "abc"}))
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX)
        with pytest.raises(RunFolderError, match=r"in use by a live run \(pid 4242 on elsewhere, MLflow run abc\)"):
            fit(tiny_config(folder))


def _fake_checkpoint(path, weight: torch.Tensor) -> None:
    AtomicCheckpointIO().save_checkpoint({"moelab": {"config": {}}, "state_dict": {"w": weight},
                                          "global_step": 3}, path)


def test_damaged_checkpoints_are_named_and_an_intact_one_suggested(tmp_path) -> None:
    last, best = tmp_path / "last.ckpt", tmp_path / "best.ckpt"
    _fake_checkpoint(last, torch.randn(64, 64))
    _fake_checkpoint(best, torch.randn(64, 64))
    assert load_checkpoint(last)["global_step"] == 3

    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, inside the tensor's bytes
    last.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{last} does not match its checksum.*{best} \(step 3\) verifies"):
        load_checkpoint(last)

    last.write_bytes(bytes(data[: len(data) // 3]))  # truncated, no checksum to compare with
    (tmp_path / "last.ckpt.sha256").unlink()
    with pytest.raises(CheckpointError, match=rf"{last} is not a readable checkpoint.*--resume {best}"):
        load_checkpoint(last)

    other = tmp_path / "notes.txt"
    other.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="is not a readable checkpoint"):
        load_checkpoint(other)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="is not a moelab training checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")

    _fake_checkpoint(tmp_path / "nan.ckpt", torch.tensor([1.0, float("nan")]))
    with pytest.raises(CheckpointError, match=r"holds non-finite weights \(w\)"):
        load_checkpoint(tmp_path / "nan.ckpt")


def test_bit_flipped_checkpoint_is_not_resumed(tmp_path) -> None:
    folder = tmp_path / "run"
    fit(tiny_config(folder, None, train__max_steps=4, train__val_every=2, train__warmup_steps=1))
    last = folder / "last.ckpt"
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x01
    last.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        fit(tiny_config(folder, None, train__max_steps=6, train__val_every=2, train__warmup_steps=1), resume=True)


def test_resume_path_takes_a_run_folder(tmp_path) -> None:
    cfg = tiny_config(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "last.ckpt").write_bytes(b"x")
    assert resume_path(cfg, tmp_path / "b") == tmp_path / "b" / "last.ckpt"
    assert resume_path(cfg, None) is None
    with pytest.raises(FileNotFoundError, match="a .ckpt file or a run folder"):
        resume_path(cfg, True)
