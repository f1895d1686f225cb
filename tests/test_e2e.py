"""Acceptance: train the tiny preset of the real model on the default corpus, read it back through a
real ``mlflow server`` (REST API), and resume from the checkpoint."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from moelab.train import fit
from tests.train.helpers import tiny_config
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

STEPS = 60


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
    result = fit(cfg)

    losses = [r["train/loss"] for r in result.history]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: first {first:.3f}, last {last:.3f}"
    vals = [v for _, v in result.val_history]
    assert vals[-1] < vals[0]

    run = _get(mlflow_server, "/api/2.0/mlflow/runs/get", run_id=result.run_id)["run"]
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["model.n_layers"] == str(cfg.model.n_layers) and params["data.source"] == "shakespeare"
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
    assert [int(r["step"]) for r in resumed.history] == list(range(STEPS + 1, STEPS + 11))
    assert resumed.history[0]["train/loss"] < first
    run2 = _get(mlflow_server, "/api/2.0/mlflow/runs/get", run_id=resumed.run_id)["run"]
    tags = {t["key"]: t["value"] for t in run2["data"]["tags"]}
    assert tags["moelab.resumed_from_run"] == result.run_id
