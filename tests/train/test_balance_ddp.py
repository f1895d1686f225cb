"""Two CPU ranks (gloo) under Lightning DDP: the balancer leaves identical biases on both ranks,
equal to one process fed the concatenated batch (tests/train/balance_probe.py runs the ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelab.train.balancer import BalancerCallback
from tests.helpers import assert_close
from tests.train.balance_probe import DDP_LR, Probe, batches, trainer


@pytest.mark.slow  # two spawned ranks: ~15 s
def test_two_ranks_hold_the_bias_of_the_concatenated_batch(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "tests.train.balance_probe", str(tmp_path), "2"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)
    t0, t1 = r0["trajectories"], r1["trajectories"]
    assert t0["step"].tolist() == t1["step"].tolist() == [1, 2, 3]
    assert torch.equal(t0["load"], t1["load"])  # global loads: both ranks' tokens
    assert_close(t0["bias"], t1["bias"], 0.0, "bias on rank 0 vs rank 1")
    for k, v in r0["state"].items():
        assert_close(v.float(), r1["state"][k].float(), 0.0, k)
    moved = [k for k, v in r0["state"].items() if not torch.equal(v, r0["init"][k])]
    assert any(".router." in k for k in moved) and len(moved) > len(r0["state"]) // 2, moved  # it trained
    assert r0["replicas"] == r1["replicas"] == {"bias": True, "weights": True}  # the callback's own end check

    callback = BalancerCallback()
    single = Probe(batches(3, 4), lr=DDP_LR, adam=True)
    trainer(3, callback, tmp_path / "one").fit(single)  # one process, all 4 rows per step
    one = callback.trajectories()
    assert torch.equal(one["load"], t0["load"])
    # The same updates up to the order of fp32 sums (DDP averages the two ranks' mean gradients).
    assert_close(one["bias"], t0["bias"], 1e-5, "bias of the concatenated batch")
    for k, v in single.state_dict().items():
        assert_close(v.float(), r0["state"][k].float(), 1e-4, f"{k} of the concatenated batch")
    assert one["bias"][-1].abs().amax(-1).gt(0).all()  # every router's bias moved (a sign-rule entry may net 0)
