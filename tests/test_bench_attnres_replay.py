"""``kernels/bench_attnres.py --replay``: the model's sequence of AttnRes reads, replayed through the
residual stream with stand-in sublayers (CPU: Triton interpreter, tiny sizes). The GPU run of it
compares per-step kernel time with the whole-model profile, so the structure it replays (sources
per read, slots that add, dtypes, one launch per read and direction) and its byte count are checked
here."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_attnres", os.path.join(ROOT, "kernels", "bench_attnres.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_read_bytes():
    """Every tensor once: sources 4 + 2 bytes, h written / read, dh read, the [2L + 1, N] fp32
    statistics; slot 0 adds (read + write), slot 1 is written."""
    b = _bench()
    N, D = 10, 8
    el = N * D
    fwd, bwd = b._read_bytes(N, D, [4, 2], 4, 4, 0b01, True)
    assert fwd == 6 * el + 4 * el + 5 * N * 4
    assert bwd == (4 + 4) * el + 6 * el + 5 * N * 4 + (2 * 4 + 2) * el
    assert b._read_bytes(N, D, [4, 2], 4, 4, 0b01, False)[1] == bwd - 4 * el  # c from a pass over the sources


def test_parse_errors():
    b = _bench()
    assert b._parse_spec("full") == ("full_attnres", None) and b._parse_spec("block:8") == ("block_attnres", 8)
    for bad in ("block:x", "block:0", "blocks"):
        with pytest.raises(ValueError, match=f"--replay '{bad}' is not allowed"):
            b._parse_spec(bad)
    assert b._parse_config("table") is None
    cfg = b._parse_config("4x4x4/2x8")
    assert (cfg.rows, cfg.warps, cfg.programs_per_sm, cfg.bwd) == (4, 4, 4, (2, 8))
    with pytest.raises(ValueError, match="entry '4x' is not allowed"):
        b._parse_config("4x")
    with pytest.raises(ValueError, match="LaunchConfig.rows=3"):
        b._parse_config("3x4")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke runs; the GPU runs the real thing")
def test_replay_smoke(tmp_path):
    """Full and Block (2 blocks) over 4 sublayers, with this tree's op and with an op module loaded from
    a file (a copy of it, as an older version from ``git show`` would be): one forward and one backward
    launch per read, in the sources per read that the modes define, with the slots of sources that a
    later read also reads adding, fp32 embedding + bf16 outputs, fp32 h and dh, every tensor contiguous."""
    op_copy = tmp_path / "attnres_copy.py"
    shutil.copy(os.path.join(ROOT, "moelab", "ops", "attnres.py"), op_copy)
    out = tmp_path / "replay.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "kernels/bench_attnres.py", "--smoke", "--replay", "full", "--replay",
                          "block:2", "--replay-ops", f"moelab,{op_copy}", "--replay-configs", "table,2x1/4x2",
                          "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["meta"]["all_ok"] and data["meta"]["sublayers"] == 4 and "--replay" in data["meta"]["command"]
    rows = {(r["spec"], r["op"], r["config"]): r for r in data["rows"]}
    assert set(rows) == {(s, op, c) for s in ("full", "block:2") for op, c in
                         (("moelab", "table"), ("moelab", "2x1/4x2"), (str(op_copy), "table"))}
    expect = {"full": ([1, 2, 3, 4, 5], [1, 2, 3, 4, 0]),  # every source is read again later, but in the last read
              "block:2": ([1, 2, 2, 3, 3], [1, 1, 2, 2, 0])}  # an open block's partial sum is read once
    N, D = data["meta"]["tokens"], data["meta"]["d_model"]
    b = _bench()
    for (spec, _, cfg), r in rows.items():
        assert r["ok"] and r["order_ok"] and r["launches_per_step"] == {"fwd": [5], "bwd": [5]}
        assert r["sources_per_read"] == expect[spec][0]
        assert [x["bwd_acc_slots"] for x in r["reads"]] == expect[spec][1]
        for x in r["reads"]:
            assert x["fwd_dtypes"] == "f" + "b" * (x["fwd_L"] - 1) and x["fwd_contiguous"] and x["bwd_contiguous"]
            assert (x["bwd_h_dtype"], x["bwd_dh_dtype"]) == ("f", "f")
            sizes = [4] + [2] * (x["fwd_L"] - 1)
            acc = (1 << x["bwd_acc_slots"]) - 1  # the adding slots are the first ones (the last may be a partial)
            assert (x["fwd_bytes"], x["bwd_bytes"]) == b._read_bytes(N, D, sizes, 4, 4, acc, True)
        assert r["bwd_bytes"] == sum(x["bwd_bytes"] for x in r["reads"]) and r["bwd_ms"] > 0
        if cfg == "2x1/4x2":
            tiles = {(x["fwd_rows"], x["fwd_warps"], x["bwd_rows"], x["bwd_warps"]) for x in r["reads"]}
            assert tiles == {(2, 1, 4, 2)}
    assert "replay full op=moelab launch=table" in res.stdout
