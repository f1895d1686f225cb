"""Storage and tracking faults of ``python -m moelab train`` end in one line (what failed, what is intact, what to
do), exit 1, no traceback (issue 41 item 2): a full disk or the file-size limit during a checkpoint save keeps
the previous checkpoint and leaves no temporary file, the MLflow run ends FAILED; a locked or read-only MLflow
database at the start names the database before anything is trained."""

from __future__ import annotations

import errno
import json
import os
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelab.cli import main
from moelab.train.runner import load_checkpoint

REPO = Path(__file__).resolve().parents[2]


def _train_args(run: Path, tracking_uri: str | None, *sets: str) -> list[str]:
    args = ["train", "--config", "tiny", "--set", f"train.ckpt_dir={run}"]
    args += ["--set", f"tracking.tracking_uri={tracking_uri}"] if tracking_uri else ["--set", "tracking.enabled=false"]
    for s in sets:
        args += ["--set", s]
    return args


def _the_error_line(err: str) -> str:
    """The one ``error:`` line of ``err``; fails on a traceback or a second error line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def _temp_files(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob(".*tmp*"))


def test_disk_full_mid_save_one_line_previous_checkpoint_intact(tmp_path, tracking_uri, monkeypatch, capsys) -> None:
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if obj.get("global_step", 0) < 4:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"\0" * 4096)  # part of the file is written, then the disk is full; torch reports it like this:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed") from None

    monkeypatch.setattr(torch, "save", save)
    run = tmp_path / "run"
    code = main(_train_args(run, tracking_uri, "train.max_steps=8", "train.val_every=2", "train.warmup_steps=1"))
    line = _the_error_line(capsys.readouterr().err)
    assert code == 1
    last = run / "last.ckpt"
    assert line.startswith(f"error: cannot save checkpoint {last} at step 4: no space left on the device (ENOSPC); "
                           f"training stopped, the previous checkpoint {last} (step 2, val/loss "), line
    assert "is intact and no partial file was left; the MLflow run is marked FAILED: free space on it, then resume " \
           f"with --resume {last}" in line, line
    assert _temp_files(run) == []
    assert load_checkpoint(last)["global_step"] == 2  # checksum, finite weights
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and "no space left" in summary["error"]
    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri).get_run(summary["run_id"]).info.status == "FAILED"


@pytest.mark.slow  # a training subprocess: ~10 s
def test_file_size_limit_subprocess_one_line(tmp_path) -> None:
    from moelab.config import load_config
    from moelab.data import prepare

    prepare(load_config("tiny").data)  # the corpus cache exists before the limit applies
    run = tmp_path / "run"

    def limit() -> None:  # a tiny checkpoint is ~2.2 MB; Python ignores SIGXFSZ, so write() fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "moelab", *_train_args(run, None, "train.max_steps=4",
                                                                         "train.val_every=2", "train.warmup_steps=0")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120, preexec_fn=limit)
    line = _the_error_line(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert line == (f"error: cannot save checkpoint {run / 'last.ckpt'} at step 2: the file-size limit was reached "
                    f"(EFBIG); training stopped, no earlier checkpoint exists and no partial file was left: raise "
                    f"the file-size limit (ulimit -f), then delete {run} (it holds no checkpoint) and train again")
    assert _temp_files(run) == [] and not list(run.glob("*.ckpt"))


def test_locked_database_at_start_one_line(tmp_path, tracking_uri, capsys) -> None:
    db = tracking_uri[len("sqlite:///"):]
    holder = sqlite3.connect(db, timeout=0)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        code = main(_train_args(tmp_path / "run", f"{tracking_uri}?timeout=0.2", "train.max_steps=2",
                                "train.warmup_steps=0"))
    finally:
        holder.rollback()
        holder.close()
    line = _the_error_line(capsys.readouterr().err)
    assert code == 1
    assert line.startswith(f"error: the MLflow database {db} is locked by another process ("), line
    assert "nothing was trained or written" in line and "tracking.enabled=false" in line, line
    assert not list((tmp_path / "run").glob("*.ckpt"))


def test_read_only_database_at_start_one_line(tmp_path, tracking_uri, capsys, monkeypatch) -> None:
    # MLflow's sqlite store makes the folder of the URI's path as written (``file:/...``) relative to the working
    # directory: keep that stray folder inside the test's own.
    monkeypatch.chdir(tmp_path)
    db = tracking_uri[len("sqlite:///"):]
    os.chmod(db, 0o444)
    try:
        open(db, "a").close()
        # root writes a 0444 file anyway: open the database through sqlite's read-only URI form instead
        uri = f"sqlite:///file:{db}?mode=ro&uri=true"
    except PermissionError:
        uri = tracking_uri
    code = main(_train_args(tmp_path / "run", uri, "train.max_steps=2", "train.warmup_steps=0"))
    line = _the_error_line(capsys.readouterr().err)
    assert code == 1
    assert line.startswith(f"error: the MLflow database {db} is read-only ("), line
    assert "nothing was trained or written: make it and its folder writable" in line, line
    assert not list((tmp_path / "run").glob("*.ckpt"))
