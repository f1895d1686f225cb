"""kernels/count_step_ops.py end to end on the CPU (Triton interpreter, 4 layers): the JSON holds every
mode's counts and host time and the deltas against prenorm."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow  # one subprocess with two models in the interpreter: ~10 s


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke; a GPU runs --device cuda")
def test_count_step_ops_smoke(tmp_path):
    out = tmp_path / "counts.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "kernels/count_step_ops.py", "--smoke", "--steps", "2", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"prenorm", "block_attnres:4"}
    pre, blk = rows["prenorm"], rows["block_attnres:4"]
    assert pre["reads"] == blk["reads"] == 9 and pre["triton_launches"] == 0
    assert blk["by"]["triton_launches"] == {"_attnres_fwd_kernel": 9, "_attnres_bwd_kernel": 9}
    d = blk["vs_prenorm"]
    assert d["triton_launches"] == {"delta": 18, "per_read": 2.0}
    assert d["fn_applies"]["delta"] == 9 and d["by"]["fn_applies"] == {"_DepthAttentionFn": 9}
    assert blk["attnres_host_ms"] > pre["attnres_host_ms"] > 0
    # prenorm has no op backward; the CPU stubs the launches while it times them
    assert pre["attnres_bwd_host_ms"] == 0 < blk["attnres_bwd_host_ms"] and blk["attnres_fwd_host_ms"] > 0
    assert blk["attnres_launch_host_ms"] == 0
    assert "block_attnres:4 - prenorm (9 reads)" in res.stdout
