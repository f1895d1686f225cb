"""moelab.tracking under faults: where artifacts go, a store outage mid-run, an unreachable server, two
first runs at once on a new database."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from moelab.tracking import TrackingError, _sqlite_dir, start_run
from moelab.train import fit
from tests.train.helpers import tiny_config

REPO = Path(__file__).resolve().parents[2]


def test_sqlite_uri_folder_is_the_database_folder(tmp_path, monkeypatch) -> None:
    assert _sqlite_dir("sqlite:////home/u/repo/mlflow.db") == Path("/home/u/repo")  # not //home/u/repo
    assert str(_sqlite_dir("sqlite:////home/u/repo/mlflow.db")).startswith("/home")
    monkeypatch.chdir(tmp_path)
    assert _sqlite_dir("sqlite:///sub/mlflow.db") == tmp_path / "sub"  # relative: from the working directory
    assert _sqlite_dir("sqlite:///:memory:") is None and _sqlite_dir("http://127.0.0.1:5000") is None


class Outage(Callback):
    """Makes every MLflow metric upload fail from step ``start`` until step ``end`` (None: for good)."""

    def __init__(self, monkeypatch, start: int, end: int | None) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.start, self.end, self.down = start, end, False
        real = MlflowClient.log_batch

        def log_batch(client, run_id, metrics=(), *args, **kwargs):
            if self.down and metrics:
                raise MlflowException("(sqlite3.OperationalError) database is locked")
            return real(client, run_id, metrics, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, "log_batch", log_batch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.start:
            self.down = True
        if trainer.global_step == self.end:
            self.down = False


def test_a_tracking_outage_does_not_stop_training(tmp_path, tracking_uri, monkeypatch, capfd) -> None:
    from mlflow.tracking import MlflowClient

    cfg = tiny_config(tmp_path / "a", tracking_uri, train__max_steps=12, train__val_every=6, train__log_every=1)
    result = fit(cfg, callbacks=[Outage(monkeypatch, 2, 9)])
    assert result.status == "finished" and "tracking_problems" not in result.summary
    client = MlflowClient(tracking_uri)
    assert client.get_run(result.run_id).info.status == "FINISHED"
    # Nothing lost: the metrics of the outage were kept and sent once the store answered again.
    assert [m.step for m in client.get_metric_history(result.run_id, "train/loss")] == list(range(1, 13))
    err = capfd.readouterr().err
    assert "failed (MlflowException: (sqlite3.OperationalError) database is locked); training continues" in err
    assert "works again" in err

    # An outage that outlasts the run: training still finishes, and summary.json says what MLflow misses.
    cfg = tiny_config(tmp_path / "b", tracking_uri, train__max_steps=4, train__val_every=2, train__log_every=1,
                      train__warmup_steps=1,
                      tracking__retry_timeout_s=1.0)
    result = fit(cfg, callbacks=[Outage(monkeypatch, 2, None)])
    assert result.status == "finished" and result.summary["steps"] == 4
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert any("not sent" in p for p in summary["tracking_problems"]), summary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_fails_fast_naming_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # what moelab must not depend on: fail fast anyway
    uri = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(TrackingError, match=rf"server {uri} does not answer"):
        fit(tiny_config(tmp_path / "run", uri))
    assert time.monotonic() - start < 30
    assert not (tmp_path / "run" / "config.yaml").exists()  # failed before anything about the run was written


RACER = textwrap.dedent('''
    import sys, time
    from pathlib import Path

    import mlflow.tracking  # the slow import first, so both processes reach the store together

    from moelab.tracking import start_run

    uri, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    ready.touch()
    while not go.exists():
        time.sleep(0.005)
    with start_run("train/race", tracking_uri=uri, log_system_metrics=False):
        pass
''')


@pytest.mark.slow  # two fresh interpreters and MLflow's schema migrations: ~20-60 s on 2 busy cores
def test_two_first_runs_at_once_on_a_new_database(tmp_path) -> None:
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(script), uri, str(tmp_path / f"ready{i}"), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("train/race").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]


def test_nested_runs_link_to_their_parent(tracking_uri) -> None:
    with start_run("study/00_demo", "parent", tracking_uri=tracking_uri, log_system_metrics=False) as parent:
        with start_run("ignored", "child", tracking_uri=tracking_uri, parent_run_id=parent.run_id,
                       log_system_metrics=False) as child:
            child.log_metrics({"x": 1.0}, step=1)
    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri).get_run(child.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert run.info.experiment_id == parent.experiment_id and run.data.metrics == {"x": 1.0}
