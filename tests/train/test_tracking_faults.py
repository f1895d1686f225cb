"""An MLflow database that turns read-only or locked after a run started, and a full disk after the last step
(issue 41, case 7 and item 2): ``python -m moelab train`` ends with one ``error:`` line and exit 1, without
MLflow's tracebacks; the checkpoint and the run's local files are intact; a run whose final status the store
could not take is closed by the next command naming its folder.

The faults are sqlite's own: a second connection holding ``BEGIN EXCLUSIVE`` (locked), and ``PRAGMA query_only``
on MLflow's pooled connections (every write fails with sqlite's "attempt to write a readonly database", as after
``chmod a-w`` for a user who is not root; the tests may run as root, who writes a 0444 file anyway).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sqlite3
from pathlib import Path

import pytest

import moelab.train
import moelab.train.runner as runner
from moelab.cli import main
from moelab.train.runner import load_checkpoint
from tests.train.helpers import AtStep

STEPS = 6


def _args(run: Path, uri: str, *sets: str) -> list[str]:
    args = ["train", "--config", "tiny", "--set", f"train.ckpt_dir={run}", "--set", f"tracking.tracking_uri={uri}"]
    for s in (f"train.max_steps={STEPS}", "train.val_every=3", "train.log_every=1", "train.warmup_steps=1",
              "tracking.retry_timeout_s=1", "tracking.system_metrics_interval_s=0.2", *sets):
        args += ["--set", s]
    return args


def _the_error_line(err: str) -> str:
    """The one ``error:`` line of ``err``; fails on a traceback, MLflow's own log or a second error line."""
    assert "Traceback" not in err and "mlflow.store" not in err and "mlflow.system_metrics" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    notices = [line for line in err.splitlines() if line.startswith("moelab:")]
    assert len(notices) <= 1, err  # the fault is announced once when it starts, then summarised by the error line
    return lines[0]


def _with_callbacks(monkeypatch, *callbacks) -> None:
    monkeypatch.setattr(moelab.train, "fit", functools.partial(runner.fit, callbacks=list(callbacks)))


@pytest.fixture
def read_only_switch():
    """``switch(True)``: from now on every MLflow write fails as on a read-only sqlite file;
    ``switch(False)``: writable."""
    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    state = {"ro": False}

    def checkout(dbapi_connection, record, proxy) -> None:
        dbapi_connection.execute(f"PRAGMA query_only = {'ON' if state['ro'] else 'OFF'}")

    event.listen(Pool, "checkout", checkout)
    yield lambda on: state.__setitem__("ro", on)
    event.remove(Pool, "checkout", checkout)


def test_database_read_only_mid_run_one_line_then_closed_by_the_next_run(tmp_path, tracking_uri, monkeypatch,
                                                                           capfd, read_only_switch) -> None:
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    _with_callbacks(monkeypatch, AtStep(2, lambda *_: read_only_switch(True)))
    code = main(_args(run, tracking_uri))
    out, err = capfd.readouterr()
    line = _the_error_line(err)
    assert code == 1
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads(out[out.index("{\n"):]) == summary
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    assert load_checkpoint(run / "last.ckpt")["global_step"] == STEPS  # the trained model: checksum, finite weights
    run_id = summary["run_id"]
    db = tracking_uri[len("sqlite:///"):]
    assert line.startswith(f"error: training finished at step {STEPS}; {run / 'last.ckpt'} and "
                           f"{run / 'summary.json'} are intact, but the MLflow database {db} turned read-only "
                           f"during the run: not recorded: "), line
    assert "metric value(s) not sent" in line and "attempt to write a readonly database" in line, line
    assert line.endswith(f"nor the final status: the MLflow run {run_id} shows RUNNING: make the database and its "
                         f"folder writable "
                         f"(chmod u+w), then any python -m moelab train naming {run} (the same command again) marks "
                         f"it FINISHED"), line
    problems = summary["tracking_problems"]
    assert any(p.startswith("the final status FINISHED was not recorded") for p in problems), problems
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "RUNNING"

    # Writable again: the same command closes the run FINISHED, then refuses the folder as before.
    read_only_switch(False)
    monkeypatch.setattr(moelab.train, "fit", runner.fit)
    assert main(_args(run, tracking_uri)) == 2
    err = capfd.readouterr().err
    assert f"moelab: closed MLflow run {run_id} (FINISHED): its process could not record it" in err, err
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "FINISHED"
    assert load_checkpoint(run / "last.ckpt")["global_step"] == STEPS


@pytest.fixture
def short_busy_timeout():
    """MLflow sets sqlite's busy timeout to 20 s on every session: 0.2 s here, so a locked store fails in 0.2 s."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    def shorten(conn, cursor, statement, parameters, context, executemany):
        return statement.replace("busy_timeout = 20000", "busy_timeout = 200"), parameters

    event.listen(Engine, "before_cursor_execute", shorten, retval=True)
    yield
    event.remove(Engine, "before_cursor_execute", shorten)


def test_database_locked_mid_run_one_line(tmp_path, tracking_uri, monkeypatch, capfd, short_busy_timeout) -> None:
    from mlflow.tracking import MlflowClient

    db = tracking_uri[len("sqlite:///"):]
    holder = sqlite3.connect(db, timeout=5, check_same_thread=False)

    def lock(*_) -> None:
        holder.execute("BEGIN EXCLUSIVE")

    run = tmp_path / "run"
    _with_callbacks(monkeypatch, AtStep(2, lock))
    try:
        code = main(_args(run, f"{tracking_uri}?timeout=0.2"))
    finally:
        holder.rollback()
        holder.close()
    line = _the_error_line(capfd.readouterr().err)
    assert code == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and load_checkpoint(run / "last.ckpt")["global_step"] == STEPS
    run_id = summary["run_id"]
    assert f"but the MLflow database {db} turned locked during the run: not recorded: " in line, line
    assert "database is locked" in line and "metric value(s) not sent" in line, line
    assert line.endswith(f"nor the final status: the MLflow run {run_id} shows RUNNING: end the process that holds "
                         f"the database locked, "
                         f"then any python -m moelab train naming {run} (the same command again) marks it FINISHED")
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "RUNNING"
    assert runner.close_unrecorded_run(run) == "FINISHED"  # the lock is gone: what the next command does first
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "FINISHED"


def test_disk_full_after_the_last_step_one_line(tmp_path, tracking_uri, monkeypatch, capfd) -> None:
    """summary.json cannot be written after training ended (ENOSPC mid-write): one line, last.ckpt intact, no
    partial file, the MLflow run FAILED."""
    from mlflow.tracking import MlflowClient

    from moelab.utils import atomic_write

    real = runner.write_json

    def write_json(path, obj) -> None:
        if Path(path).name != "summary.json":
            return real(path, obj)
        with atomic_write(path) as f:
            f.write('{"status": ')
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runner, "write_json", write_json)
    run = tmp_path / "run"
    code = main(_args(run, tracking_uri))
    line = _the_error_line(capfd.readouterr().err)
    assert code == 1
    last = run / "last.ckpt"
    assert line == (f"error: training finished at step {STEPS}, but summary.json could not be written in {run}: no "
                    f"space left on the device (ENOSPC); {last} (step {STEPS}, val/loss "
                    f"{line.split('val/loss ')[1].split(')')[0]}) holds the trained model and is intact, the files "
                    f"written before keep their previous complete version and no partial file was left; the MLflow "
                    f"run is marked FAILED: free space on it; the model needs nothing more (python -m moelab eval "
                    f"--ckpt {last})"), line
    assert load_checkpoint(last)["global_step"] == STEPS
    assert sorted(p.name for p in run.glob(".*tmp*")) == [] and not (run / "summary.json").exists()
    # written before the fault: header + a row per step
    assert (run / "history.csv").read_text().count("\n") == STEPS + 1
    run_id = load_checkpoint(last)["moelab"]["mlflow_run_id"]
    assert MlflowClient(tracking_uri).get_run(run_id).info.status == "FAILED"
