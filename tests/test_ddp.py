"""Training under Lightning DDP, unchanged: 2 CPU processes (gloo) end with identical weights.

Lightning's DDP launcher re-runs the launching script for rank 1, so the training runs in a
subprocess (a script written to tmp_path), never inside pytest itself. MLflow is on: only rank 0
may create a run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.helpers import assert_close
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

pytestmark = pytest.mark.slow  # two training processes: ~12 s

SCRIPT = textwrap.dedent('''
    import sys
    from pathlib import Path

    import torch
    from lightning.pytorch.callbacks import Callback

    from moelab.config import load_config
    from moelab.train import fit
    from moelab.train.callbacks import StepMonitor

    out = Path(sys.argv[1])


    class DumpWeights(Callback):
        def on_train_end(self, trainer, pl_module):
            monitor = next(c for c in trainer.callbacks if isinstance(c, StepMonitor))
            state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
            torch.save({"state": state, "losses": [r["train/loss"] for r in monitor.history]},
                       out / f"rank{trainer.global_rank}.pt")


    cfg = load_config("tiny", {"train.strategy": "ddp", "train.devices": 2, "train.accelerator": "cpu",
                               "train.max_steps": 6, "train.val_every": 3, "train.ckpt_dir": str(out / "ckpt")})
    fit(cfg, callbacks=[DumpWeights()])
''')


def test_two_cpu_ranks_end_with_identical_weights(tmp_path: Path, tracking_uri: str) -> None:  # noqa: F811
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    assert r0["state"].keys() == r1["state"].keys()
    for k, v in r0["state"].items():
        if v.is_floating_point():
            assert_close(v, r1["state"][k], 0.0, k)  # DDP all-reduces gradients: bitwise equal
    # Each rank reads different batches, so their local losses differ while the weights agree.
    assert len(r0["losses"]) == len(r1["losses"]) == 6
    assert r0["losses"] != r1["losses"]
    assert (tmp_path / "ckpt" / "last.ckpt").is_file()
    # Only rank 0 talks to MLflow: one run, finished ($MLFLOW_TRACKING_URI reached the subprocess).
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("train/tiny")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["train.devices"] == "2"
