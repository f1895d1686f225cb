"""The fused intra-chunk kernel of the chunked KDA forward (``triton_fwd._kda_fwd_intra``, selected by
``intra="fused"`` of ``triton_chunk.VARIANTS``) against the fp32 reference and against the split kernels (kktr, merge,
wu) whose outputs it replaces.

Interpreter only (tests/conftest.py): fp32 and fp16; the GPU launch configs are checked for registers
and spills by kernels/aot_kda.py, not run here.
"""

from __future__ import annotations

import pytest
import torch

from moelab.ops.kda import triton_chunk as tc
from moelab.ops.kda.triton_common import LOG2E
from tests.helpers import poisoned_allocations, rel_err
from tests.ops.test_kda_triton import DEV, G_MIN, _compare, _inputs, _reference, _run, chunk, slow

# (B, T, H, K, V, chunk, dtype, h0); every case runs in both modes
CASES = [
    pytest.param((2, 150, 1, 32, 16, 64, torch.float32, True), marks=slow),  # B > 1, K != V, T % 64 != 0
    (1, 40, 2, 20, 40, 32, torch.float32, False),  # non-power-of-two K and V (padded), chunk 32, H > 1
    (1, 37, 2, 16, 24, 16, torch.float16, True),  # fp16, chunk 16 (no off-diagonal sub-tiles)
    (1, 100, 1, 32, 16, 64, torch.float16, False),  # fp16, partial second chunk
    pytest.param((1, 70, 1, 128, 32, 64, torch.float32, True), marks=slow),  # K = 128: 8 K-blocks here
]


def _id(c):
    return f"B{c[0]}T{c[1]}H{c[2]}K{c[3]}V{c[4]}C{c[5]}-{str(c[6])[6:]}-h0{int(c[7])}"


@pytest.mark.parametrize("mode", ["bounded", "general"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_intra_matches_reference(case, mode):
    """Output, final state and every gradient (the backward reads the fused kernel's Tm, A_qk, w, u,
    qg, kd, gl and, in general mode, G) within the dtype's bound of the fp32 recurrence."""
    B, T, H, K, V, C, dtype, h0 = case
    ins, s0, do, dS = _inputs(B, T, H, K, V, dtype, seed=B * 1000 + T * 7 + K + V, h0=h0)
    with tc.launch_overrides(intra="fused"):
        out = _run(chunk, ins, s0, do, dS, mode=mode, chunk_size=C)
    _compare(_reference(ins, s0, do, dS), out, dtype)


def _padded(B, T, H, K, V, C, bounded, seed, g_min=G_MIN, g=None):
    """fp32 inputs as ``_intra_pass`` gets them: padded by the op's ``_inputs`` (T to whole chunks, K and
    V to powers of two), G from the chunked prep in bounded mode."""
    ins, _, _, _ = _inputs(B, T, H, K, V, torch.float32, seed=seed, g_min=g_min, h0=False)
    if g is not None:
        ins[3] = g
    prep = tc.Prep("none", None, False, False, 1e-6)
    q, k, v, gp, beta, _ = tc._inputs(*ins, None, None, None, prep, C, None, bounded)
    return q, k, v, gp, beta


def _both(q, k, v, g, beta, bounded, C, g_min=G_MIN):
    """``_intra_pass`` with the split kernels and with the fused kernel."""
    out = {}
    for intra in tc.VARIANTS["intra"]:
        with tc.launch_overrides(intra=intra):
            out[intra] = tc._intra_pass(q, k, v, g, beta, q.shape[-1] ** -0.5, bounded, C, g_min)
    return out["split"], out["fused"]


# measured (interpreter): bounded <= 7e-8. General mode forms G itself, in the fused kernel as one cumsum
# over the chunk, in the split kernels as a sum of sub-tile sums: G differs in its last bits, and every
# e^{G_i - G_j} by |G| ulp (|G| reaches hundreds at g = -5, thousands at g = -60): <= 7e-7 on Abuf, A_qk,
# w, u, qg (3e-6 at g = -60), up to 1e-5 on kd and gl (e^{G_last - G}, e^{G_last}); against fp64 both are
# off by that much, one or the other closer (test_fused_intra_equals_split)
EQUAL_TOL = {True: 5e-7, False: 1e-5}
G_TOL = 5e-5  # general mode, kd and gl
KEYS = ("Abuf", "Aqk", "w", "u", "qg", "kd", "gl")


def _check_equal(split, fused, bounded):
    for key in KEYS if bounded else (*KEYS, "Gbuf"):
        a, b = split[key], fused[key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        assert torch.isfinite(b).all(), key
        err = rel_err(a, b)
        tol = G_TOL if not bounded and key in ("kd", "gl") else EQUAL_TOL[bounded]
        assert err <= tol, f"{key}: relative difference {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("mode", ["bounded", "general"])
@pytest.mark.parametrize("shape", [(2, 100, 2, 32, 16, 64), (1, 70, 1, 16, 32, 32), (1, 40, 1, 32, 16, 16)],
                         ids=lambda s: f"B{s[0]}T{s[1]}H{s[2]}K{s[3]}V{s[4]}C{s[5]}")
def test_fused_intra_equals_split(shape, mode):
    """fp32 inputs (exact fp32 products in both): every intermediate the forward keeps, the same dtypes
    and shapes, equal to fp32 round-off, and finite in the padded tail rows too; Tm and A_qk exactly zero
    above the diagonal. General mode: G (fp32 round-off) and kd, gl (G's round-off times |G|) also against
    fp64."""
    B, T, H, K, V, C = shape
    bounded = mode == "bounded"
    q, k, v, g, beta = _padded(B, T, H, K, V, C, bounded, seed=T + K)
    split, fused = _both(q, k, v, g, beta, bounded, C)
    _check_equal(split, fused, bounded)
    rows = torch.arange(fused["Abuf"].shape[1], device=DEV) % C
    upper = torch.arange(C, device=DEV)[None, :] > rows[:, None]  # [T, C]
    for key in ("Abuf", "Aqk"):
        assert (fused[key].permute(0, 2, 1, 3)[:, :, upper] == 0).all(), key
    if not bounded:
        Tp = g.shape[1]
        G = (g.double() * LOG2E).reshape(B, Tp // C, C, H, K).cumsum(2)
        want = {"Gbuf": G, "kd": k.double().reshape(G.shape) * torch.exp2(G[:, :, -1:] - G),
                "gl": torch.exp2(G[:, :, -1])}
        for key, ref in want.items():  # measured: G 1e-7; kd, gl 7e-6 (the split kernels' 3e-6)
            err = rel_err(ref.reshape(fused[key].shape), fused[key])
            assert err <= (5e-7 if key == "Gbuf" else 3e-5), f"{key}: relative error {err:.2e} against fp64"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's overflow in dropped entries
def test_fused_intra_equals_split_at_the_decay_bound():
    """Bounded mode with g at the floor the op accepts (``G_MIN_FLOOR``, about -5.5: the diagonal sub-tiles'
    factors reach e^44), and general mode with g = -30 / -60 on some channels: finite, and the split
    kernels' values (the off-diagonal entries of the fused diagonal products may overflow: dropped)."""
    from moelab.ops.kda.bounds import G_MIN_FLOOR

    B, T, H, K, V, C = 1, 128, 1, 32, 16, 64
    gen = torch.Generator().manual_seed(5)
    g = (G_MIN_FLOOR * (1 - 1e-3 * torch.rand(B, T, H, K, generator=gen))).to(DEV)  # in [G_MIN_FLOOR, 0)
    _check_equal(*_both(*_padded(B, T, H, K, V, C, True, seed=5, g=g), True, C, g_min=G_MIN_FLOOR), True)
    g = G_MIN * torch.rand(B, T, H, K, generator=gen).to(DEV)
    g[..., :8] = -30.0
    g[:, 10:20, :, 8:12] = -60.0
    _check_equal(*_both(*_padded(B, T, H, K, V, C, False, seed=6, g=g), False, C), False)


def test_intra_dispatch_and_override():
    """``VARIANT["intra"]`` picks the launches (split: kktr, merge, wu; fused: one ``intra``), ``launch_overrides``
    switches it and restores it (also after an error), and names the allowed values on a wrong one."""
    names = []
    orig = tc._Launcher.__call__
    assert tc.VARIANT["intra"] == "split"
    ins, s0, do, dS = _inputs(1, 40, 1, 16, 16, torch.float32, seed=3)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tc._Launcher, "__call__", lambda self, *a, **kw: names.append(self.name) or orig(self, *a, **kw))
        chunk(*ins, initial_state=s0, mode="bounded")
        assert {"kktr", "merge", "wu"} <= set(names) and "intra" not in names
        names.clear()
        with tc.launch_overrides(intra="fused"):
            chunk(*ins, initial_state=s0, mode="bounded")
        assert "intra" in names and not {"kktr", "merge", "wu"} & set(names)
    with pytest.raises(RuntimeError, match="inside"), tc.launch_overrides(intra="fused"):
        assert tc.VARIANT["intra"] == "fused"
        raise RuntimeError("inside")
    assert tc.VARIANT["intra"] == "split"
    with pytest.raises(ValueError, match=r"intra='one' is not allowed: expected one of \('split', 'fused'\)"), \
            tc.launch_overrides(intra="one"):
        pass
    assert tc.VARIANT["intra"] == "split"


def test_intra_launch_config(monkeypatch):
    """On the GPU the fused kernel runs at its ``LAUNCH`` entry for chunk 64, at 2 warps for a chunk
    below 64 (its products are C tall) or a K below the block, with its ``MAXNREG`` cap."""
    monkeypatch.setattr(tc, "_interpret", lambda: False)
    block, warps, stages = tc.LAUNCH["intra"]
    assert tc._intra.config(128, 128) == (block, warps, stages)
    assert tc._intra.config(16, 128) == (16, 2, stages)
    launches = []
    fake = type("K", (), {"__getitem__": lambda self, grid: lambda *a, **kw: launches.append((grid, kw))})()
    monkeypatch.setattr(tc._intra, "kernel", fake)
    for C in (16, 32, 64):
        tc._intra((1, 1), K=128, V=128, C=C)
        assert tc._intra.chunk == 64  # reset after the launch
    assert [kw["num_warps"] for _, kw in launches] == [2, 2, warps]
    assert all(kw["BK"] == block and kw["maxnreg"] == tc.MAXNREG["intra"] for _, kw in launches)
    assert tc.launch_configs(128, 128)["intra"] == {"BK": block, "num_warps": warps, "num_stages": stages}


@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_fused_intra_ignores_uninitialised_memory(monkeypatch, mode):
    """Every buffer the op allocates starts full of NaN (torch.empty, empty_like, new_empty): the fused
    kernel reads back only what it wrote (G in general mode, A_kk and the blocks of Tm in Abuf)."""

    ins, s0, do, dS = _inputs(1, 100, 2, 32, 16, torch.float32, seed=13)
    ref = _reference(ins, s0, do, dS)
    with poisoned_allocations(monkeypatch), tc.launch_overrides(intra="fused"):
        out = _run(chunk, ins, s0, do, dS, mode=mode)
    _compare(ref, out)
