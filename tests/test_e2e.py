"""Acceptance: train the tiny preset of the real model on the default corpus, read it back through a
real ``mlflow server`` (REST API), and resume from the checkpoint; train as an ordinary (non-root) user
in a copy of the repository with the default store."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from moelab.tracking import experiment_name, start_run
from moelab.train import fit
from tests.train.helpers import tiny_config
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

# Real training, a real mlflow server, subprocesses: 10-20 s per test.
pytestmark = pytest.mark.slow

STEPS = 60
REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(base: str, path: str, **query: str) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


@pytest.fixture
def mlflow_server(tmp_path, tracking_uri):  # noqa: F811
    """A real ``mlflow server`` on a free 127.0.0.1 port over the test's sqlite store."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    # No background job runners (GenAI evaluation jobs): they start ~8 processes this test does not need.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", tracking_uri, "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.read().strip() == b"OK":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not come up: {(tmp_path / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_tiny_train_track_serve_resume(tmp_path, tracking_uri, mlflow_server) -> None:  # noqa: F811
    cfg = tiny_config(tmp_path / "ckpt", tracking_uri, train__max_steps=STEPS, train__val_every=20,
                      train__log_every=5)
    with start_run(experiment_name("study", "00_e2e"), "study", tracking_uri=tracking_uri,
                   log_system_metrics=False) as parent:
        result = fit(cfg, parent_run_id=parent.run_id)

    losses = [r["train/loss"] for r in result.history]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: first {first:.3f}, last {last:.3f}"
    vals = [v for _, v in result.val_history]
    assert vals[-1] < vals[0]

    run = _get(mlflow_server, "/api/2.0/mlflow/runs/get", run_id=result.run_id)["run"]
    assert run["info"]["status"] == "FINISHED"
    # Nested under the study's run, in its experiment, which opens in MLflow's training view.
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert tags["mlflow.parentRunId"] == parent.run_id and tags["moelab.preset"] == "tiny"
    assert run["info"]["experiment_id"] == parent.experiment_id
    exp = _get(mlflow_server, "/api/2.0/mlflow/experiments/get", experiment_id=parent.experiment_id)["experiment"]
    assert exp["name"] == "study/00_e2e"
    assert {"key": "mlflow.experimentKind", "value": "custom_model_development"} in exp["tags"]
    # Artifacts beside the database, in the test's folder.
    assert run["info"]["artifact_uri"].startswith((tmp_path / "mlruns").as_uri() + "/"), run["info"]["artifact_uri"]
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["model.n_layers"] == str(cfg.model.n_layers) and params["data.source"] == "shakespeare"
    # Constants are params; every metric changes over the run (no single-value charts).
    assert params["run.flops_per_token_fwd"] and params["run.params_total"] and params["run.world_size"] == "1"
    for key in {m["key"] for m in run["data"]["metrics"]}:
        points = _get(mlflow_server, "/api/2.0/mlflow/metrics/get-history", run_id=result.run_id, metric_key=key,
                      max_results="1000")["metrics"]
        assert len({m["step"] for m in points}) >= 2, (key, points)
    history = _get(mlflow_server, "/api/2.0/mlflow/metrics/get-history", run_id=result.run_id,
                   metric_key="train/loss", max_results="1000")["metrics"]
    assert len(history) >= STEPS // cfg.train.log_every
    served = [m["value"] for m in sorted(history, key=lambda m: m["step"])]
    assert sum(served[-3:]) / 3 < sum(served[:3]) / 3
    artifacts = _get(mlflow_server, "/api/2.0/mlflow/artifacts/list", run_id=result.run_id)
    assert {"loss_curve.png", "metrics_table.json"} <= {f["path"] for f in artifacts["files"]}

    more = tiny_config(tmp_path / "ckpt", tracking_uri, train__max_steps=STEPS + 10, train__val_every=20,
                       train__log_every=5)
    resumed = fit(more, resume=True)
    assert [int(r["step"]) for r in resumed.history] == list(range(1, STEPS + 11))  # the whole run's history
    assert resumed.history[:STEPS] == result.history
    assert resumed.history[STEPS]["train/loss"] < first
    run2 = _get(mlflow_server, "/api/2.0/mlflow/runs/get", run_id=resumed.run_id)["run"]
    tags = {t["key"]: t["value"] for t in run2["data"]["tags"]}
    assert tags["moelab.resumed_from_run"] == result.run_id


NOBODY = 65534


@contextlib.contextmanager
def _interpreter_reachable_by_others() -> Iterator[None]:
    """Let other users traverse the folders above the interpreter and its standard library for the duration.

    Where Python lives under a root-only home (``/root/.pyenv``, as on CI), uid 65534 cannot start it at all;
    adding the search bit (not read) to those folders, and restoring their modes afterwards, lets the
    unprivileged case run instead of being skipped.
    """
    changed: dict[Path, int] = {}
    try:
        for leaf in {Path(os.path.realpath(sys.executable)), Path(sys.base_prefix).resolve()}:
            for folder in [leaf, *leaf.parents] if leaf.is_dir() else leaf.parents:
                mode = folder.stat().st_mode
                if folder not in changed and not mode & stat.S_IXOTH:
                    changed[folder] = stat.S_IMODE(mode)
                    folder.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)
        yield
    finally:
        for folder, mode in changed.items():
            folder.chmod(mode)


def _user_kwargs(user: str) -> dict:
    """subprocess arguments that run the child as ``user``: ``current``, or ``unprivileged`` (uid/gid 65534)."""
    if user == "current":
        return {}
    if os.getuid() != 0:
        pytest.skip("not root: the 'current' case already trains as an ordinary user")
    kwargs = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60, **kwargs)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"uid {NOBODY} cannot run this interpreter ({sys.executable}: {e})")
    return kwargs


@pytest.mark.parametrize("user", ["current", "unprivileged"])
def test_training_with_the_default_store_keeps_artifacts_inside_the_repository(user, mlflow_template_db) -> None:  # noqa: F811
    """The CLI with the default store (``<repo>/mlflow.db``) in a copy of the repository owned by the user who
    trains; ``unprivileged`` trains as uid 65534 when the suite runs as root."""
    with _interpreter_reachable_by_others() if user == "unprivileged" else contextlib.nullcontext():
        _train_with_the_default_store(user, mlflow_template_db)


def _train_with_the_default_store(user: str, template_db: Path) -> None:
    import tempfile

    from moelab.config import load_config
    from moelab.data import prepare

    kwargs = _user_kwargs(user)
    repo = Path(tempfile.mkdtemp(prefix="moelab-user-"))  # not under pytest's root-only tmp folder
    try:
        shutil.copytree(REPO / "moelab", repo / "moelab", ignore=shutil.ignore_patterns("__pycache__"))
        (repo / "data").mkdir()
        shutil.copy(REPO / "data" / "shakespeare.tar.xz", repo / "data")
        cache = prepare(load_config("tiny").data, progress=False).cache_dir
        shutil.copytree(cache, repo / "data" / "cache" / cache.name)
        shutil.copy(template_db, repo / "mlflow.db")
        if kwargs:
            for path in [repo, *repo.rglob("*")]:
                os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MOELAB_ROOT")}
        env.update(PYTHONPATH=str(repo), HOME=str(repo))
        proc = subprocess.run(
            [sys.executable, "-m", "moelab", "train", "--config", "tiny", "--set", "train.max_steps=2", "--set",
             "train.warmup_steps=1", "--set", "train.val_every=2", "--set", "tracking.log_system_metrics=false"],
            cwd=repo, env=env, capture_output=True, text=True, timeout=600, **kwargs)
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads((repo / "runs" / "tiny" / "summary.json").read_text())
        from mlflow.tracking import MlflowClient

        run = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}").get_run(summary["run_id"])
        assert run.info.status == "FINISHED"
        assert run.info.artifact_uri.startswith((repo / "mlruns").as_uri() + "/"), run.info.artifact_uri
        artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
        assert (artifacts / "loss_curve.png").is_file() and (artifacts / "summary.json").is_file()
    finally:
        shutil.rmtree(repo, ignore_errors=True)
