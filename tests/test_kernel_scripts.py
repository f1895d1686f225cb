"""The scripts under kernels/ that gate or compile still run end to end (CPU: Triton interpreter, tiny shapes):
the GPU correctness check and the AOT compile report, so a GPU session does not spend its time on a broken
harness. ``kernels/bench.py`` has its own tests (tests/test_bench.py)."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import triton
import triton.language as tl

from moelab.ops.kda import infer_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Kernel-script smokes in the interpreter: 3-70 s each.
pytestmark = pytest.mark.slow


def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_aot_report(tmp_path):
    """sm_90 compile of one kernel through ptxas (ships with the triton wheel)."""
    res = _run(["kernels/aot_kda.py", "--only", "dg"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "registers" in res.stdout and "dg" in res.stdout


def test_aot_report_infer(tmp_path):
    """``--infer``: the inference forward's intra kernel (fixed-length and packed) and its recurrence in each of its
    four uses at every launch block of 32 or more columns, each through ptxas at its launch's register cap, with
    its register count."""
    res = _run(["kernels/aot_kda.py", "--infer"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("infer ")]
    blocks = [c for c in infer_plan.LAUNCH["recur"] if 32 <= c[0] <= 128]
    assert len(lines) == 2 + 4 * len(blocks) and all("registers" in line for line in lines), res.stdout
    assert all(any(line.startswith(f"infer intra {use}") for line in lines) for use in ("fixed", "packed"))
    capped = [c for c in blocks if c[4]]  # a capped launch compiles at its cap
    assert capped and all(any(f"{c[0]}/{c[1]}/{c[2]} maxnreg={c[4]}:" in line for line in lines) for c in capped)
    assert all(any(f"infer recur {use}" in line for line in lines) for use in ("fixed", "packed", "phase 1", "phase 3"))


def test_aot_report_conv_launches_do_not_spill(tmp_path):
    """``--conv``: the ShortConv kernels at ``short_conv.LAUNCH`` (the tile backward: the 4-tap one) and
    ``SLIDE_LAUNCH`` (the one-pass backward), with and without SiLU and document positions, compile for sm_90a; the
    forward and the one-pass backward spill nothing, the tile backward at most 4 KB of spill loads a thread (64 x 64
    on 4 warps: up to 3.3 KB with Triton 3.9, yet the conv bench's fastest tile backward, below; its old 64 x 128 /
    4-warp tile spilled up to 17.6 KB and was slow)."""
    import re

    res = _run(["kernels/aot_kda.py", "--conv"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("conv ")]
    assert len(lines) == 12 and all("registers" in line for line in lines), res.stdout
    for line in lines:
        loads = int(re.search(r"(\d+) bytes spill loads", line).group(1))
        assert loads <= (4096 if line.startswith("conv bwd") else 0), line


def test_conv_default_launch_is_the_benchs_fastest_backward():
    """The op's default backward (``short_conv.bwd_row_name()``: ``SLIDE_LAUNCH`` with ``BWD_SLIDE``) is the fastest
    backward row of the committed conv bench (kernels/results/conv_h100.json, geometric mean over its runs) at its
    GPU-bound shape (B1 T32768 C1536; at B8 T4096 C512 every launch takes the host's 0.17-0.72 ms), and within 10% of
    the fastest at the other."""
    import json

    from moelab.ops import short_conv
    from moelab.studies.readme import conv_geomeans

    with open(os.path.join(ROOT, "kernels", "results", "conv_h100.json")) as f:
        shapes = conv_geomeans(json.load(f))
    name = short_conv.bwd_row_name()
    for shape, slack in (("B1-T32768-C1536", 1.0), ("k3-mini", 1.10)):
        bwd = {impl: r["fwd_bwd_ms"] for impl, r in shapes[shape].items() if impl.startswith("bwd_")}
        assert shapes[shape][name]["runs"] >= 2 and bwd[name] <= slack * min(bwd.values()), (shape, name, bwd)


def _kernel_script(name: str):
    """Import ``kernels/<name>.py`` (the folder is not a package) as a module."""
    sys.path.insert(0, os.path.join(ROOT, "kernels"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(os.path.join(ROOT, "kernels"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke runs; the GPU runs the real thing")
def test_check_kda_gate_part_smoke(tmp_path):
    """``--part gate`` runs the gate rows alone; without fla they are held to the tolerances."""
    out = tmp_path / "gate.json"
    res = _run(["kernels/check_kda_gpu.py", "--smoke", "--part", "gate", "--commit", "abc1234", "--out", str(out)],
               tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["packed_rows"] == []  # the other parts did not run
    rows = data["gate_rows"]
    assert [r["gate"] for r in rows] == ["bounded", "softplus"]
    for r in rows:
        assert r["bar"] == "tolerance" and "fla_errors" not in r
        assert r["tolerances"] == {"o": 5e-3, "dz": 5e-2, "dA_log": 5e-2, "ddt_bias": 5e-2}
        assert set(r["errors"]) == {"o", "dz", "dA_log", "ddt_bias"}
        assert all(math.isfinite(e) and e <= r["tolerances"][n] for n, e in r["errors"].items()) and r["passed"]
        assert set(r["seconds"]) == {"reference", "moelab"}
    meta = data["meta"]
    assert meta["parts"] == ["gate"] and meta["commit"] == "abc1234" and meta["complete"] and meta["passed"]
    assert meta["fla"] is None and meta["fla_autotune"] is None and "fla" in meta["gate_rule"]
    assert "gate inside the op" in res.stdout and "packed documents" not in res.stdout


def _stand_in_fla(noise: float, fail: bool = False):
    """fla's ``chunk_kda`` with the gate in the op, played by autograd through the fp32 recurrence on
    ``z + noise * N(0, 1)`` (noise 0: as exact as the reference); ``fail``: raises like a config that does not fit."""
    from moelab.ops.kda.gate import naive_kda_gate
    from moelab.ops.kda.naive import naive_recurrent_kda

    def chunk_kda(q, k, v, z, beta, *, A_log, dt_bias, output_final_state, use_gate_in_kernel, safe_gate,
                  lower_bound=None):
        assert use_gate_in_kernel and output_final_state and (lower_bound == -5.0) == safe_gate
        if fail:
            raise RuntimeError("out of resource: shared memory")
        zn = z + noise * torch.randn(z.shape, generator=torch.Generator().manual_seed(0))
        g = naive_kda_gate(zn, A_log, "bounded" if safe_gate else "softplus", lower_bound, dt_bias)
        return naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    return chunk_kda


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="moelab's op runs in the interpreter, on CPU")
def test_check_kda_gate_rows_against_fla():
    """The gate rows' bar is fla's error on the same inputs: a noisier fla lets moelab pass, an fla as exact as
    the reference makes its gate gradients fail, a failing fla call fails its row and the next row still runs."""
    ck = _kernel_script("check_kda_gpu")
    from moelab.ops.kda.triton_chunk import chunk_kda

    cases = [(1, 40, 1, 32, "bounded"), (1, 40, 1, 32, "softplus")]
    saves = []

    def run(fla):
        rows = []
        ok = ck.check_gate_grads(chunk_kda, cases, torch.float32, "cpu", False, rows, lambda: saves.append(1), fla=fla)
        return ok, rows

    ok, rows = run(_stand_in_fla(1e-2))
    assert ok and [r["passed"] for r in rows] == [True, True] and len(saves) == 2
    for r in rows:
        assert r["bar"] == "fla" and "tolerances" not in r and set(r["seconds"]) == {"reference", "moelab", "fla"}
        assert all(r["errors"][n] <= r["fla_errors"][n] for n in ("dz", "dA_log", "ddt_bias"))
    ok, rows = run(_stand_in_fla(0.0))
    assert not ok and [r["passed"] for r in rows] == [False, False]
    assert all(r["fla_errors"]["dz"] < 1e-6 < r["errors"]["dz"] for r in rows)
    ok, rows = run(_stand_in_fla(1e-2, fail=True))
    assert not ok and len(rows) == 2 and not any(r["passed"] for r in rows)
    assert all(r["bar"] == "tolerance" and r["fla_failed"].startswith("RuntimeError: out of resource") for r in rows)


@triton.jit
def _store_block(out_ptr, n, BLOCK: tl.constexpr):
    tl.store(out_ptr, BLOCK + n)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel runs in the interpreter, on CPU")
def test_pin_autotuners_keeps_first_pruned_config(monkeypatch):
    """check_kda_gpu pins fla's autotuners: an autotuner under a heuristics wrapper keeps the first
    config its own pruning leaves (here 16: the prune drops 8), and nothing is benchmarked."""
    ck = _kernel_script("check_kda_gpu")
    configs = [triton.Config({"BLOCK": b}) for b in (8, 16, 32)]
    tuned = triton.autotune(configs=configs, key=["n"],
                            prune_configs_by={"early_config_prune": lambda cs, nargs, **kw: cs[1:]})(_store_block)
    kernel = triton.heuristics({"unused": lambda args: 0})(tuned)
    mod = types.ModuleType("fakepkg.kernels")
    mod.kernel, mod.alias = kernel, tuned  # reached twice, pinned once
    monkeypatch.setitem(sys.modules, "fakepkg.kernels", mod)
    monkeypatch.setitem(sys.modules, "fakepkgother", types.SimpleNamespace(kernel=triton.autotune(configs, ["n"])(
        _store_block)))  # another package: left alone
    assert ck.pin_autotuners("fakepkg") == 1
    tuned._bench = lambda *a, **kw: pytest.fail("a pinned autotuner benchmarked")
    out = torch.zeros(1, dtype=torch.int32)
    kernel[(1,)](out, 3)
    assert out.item() == 16 + 3
