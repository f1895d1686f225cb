"""Triton chunked KDA (moelab/ops/kda/triton_chunk.py) against the fp32 token-by-token reference.

On a CPU machine the kernels run in the Triton interpreter (tests/conftest.py), so shapes stay
tiny; fp32 and fp16 only (the interpreter gets bf16 wrong). bf16 at real sizes is checked on the
GPU by kernels/check_kda_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from moelab.ops.kda.naive import naive_recurrent_kda
from moelab.ops.kda.triton_chunk import chunk_kda
from tests.helpers import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
G_MIN = -5.0  # the bound of the test decays (the model's default g_min)
# Relative-error bounds (o and final state, gradients) by input dtype. fp32 is held near its measured
# error (interpreter: o <= 1e-6, gradients <= 8e-6), so a constant wrong in its 4th digit (log2(e) as
# 1.443: 3e-4) fails; bf16 to the GPU targets of kernels/check_kda_gpu.py; fp16, with 3 more mantissa
# bits, to a fifth of them (measured: 2e-4 / 4e-4).
TOL = {torch.float32: (1e-5, 3e-5), torch.float16: (1e-3, 2e-3), torch.bfloat16: (5e-3, 1e-2)}
O_TOL, GRAD_TOL = TOL[torch.float32]


def _inputs(B, T, H, K, V, dtype, seed, g_min=G_MIN, h0=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    # bounded gate of the model: g = g_min * sigmoid(z), so g in (g_min, 0)
    g = g_min * torch.randn(B, T, H, K, generator=gen).sigmoid()
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen) if h0 else None
    do = torch.randn(B, T, H, V, generator=gen)
    dS = torch.randn(B, H, K, V, generator=gen)
    ins = [x.to(DEV, dtype) for x in (q, k, v, g, beta)]
    return ins, (s0.to(DEV) if h0 else None), do.to(DEV), dS.to(DEV)


def chunk(*args, mode=None, **kw):
    """``chunk_kda`` in ``mode``; bounded mode with the test inputs' bound ``G_MIN`` unless given."""
    if mode == "bounded":
        kw.setdefault("g_min", G_MIN)
    return chunk_kda(*args, mode=mode, **kw)


def _run(fn, ins, s0, do, dS, **kw):
    """Forward + backward of loss = <o, do> + <S_T, dS>; returns outputs and input gradients."""
    leaves = [x.detach().clone().requires_grad_() for x in ins]
    s = s0.detach().clone().requires_grad_() if s0 is not None else None
    o, S = fn(*leaves, initial_state=s, output_final_state=True, **kw)
    ((o.float() * do).sum() + (S * dS).sum()).backward()
    grads = [x.grad for x in leaves] + ([s.grad] if s is not None else [])
    return o, S, grads


def _reference(ins, s0, do, dS):
    return _run(naive_recurrent_kda, [x.float() for x in ins], s0, do, dS)


def _compare(ref, out, dtype=torch.float32, tol=None):
    o_tol, grad_tol = tol or TOL[dtype]
    o_r, S_r, g_r = ref
    o_t, S_t, g_t = out
    assert o_t.dtype == o_r.dtype or o_t.dtype != torch.float32
    assert S_t.dtype == torch.float32
    assert_close(o_r, o_t.float(), o_tol, "o")
    assert_close(S_r, S_t, o_tol, "final state")
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], g_r, g_t):
        assert_close(a, b.float(), grad_tol, name)


# seeded randomized sweep: (B, T, H, K, V, chunk, dtype, h0); every case runs in both modes. The
# interpreter takes 10-60 s on the larger ones: those are `slow` (make test runs them, test-fast not).
slow = pytest.mark.slow
SWEEP = [
    (1, 1, 1, 16, 16, 64, torch.float32, True),  # T = 1
    pytest.param((2, 150, 2, 32, 16, 64, torch.float32, True), marks=slow),  # B > 1, K != V, T % 64 != 0
    pytest.param((1, 70, 1, 128, 32, 64, torch.float32, False), marks=slow),  # K = 128: several K-blocks
    (1, 40, 1, 20, 40, 32, torch.float32, True),  # non-power-of-two K and V, chunk 32
    (1, 37, 2, 16, 24, 16, torch.float16, False),  # fp16, chunk 16
    pytest.param((1, 100, 1, 32, 16, 64, torch.float16, True), marks=slow),  # fp16, partial second chunk
]


@pytest.mark.parametrize("mode", ["bounded", "general"])
@pytest.mark.parametrize(
    "case", SWEEP, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}K{c[3]}V{c[4]}C{c[5]}-{str(c[6])[6:]}-h0{int(c[7])}")
def test_matches_reference(case, mode):
    B, T, H, K, V, C, dtype, h0 = case
    ins, s0, do, dS = _inputs(B, T, H, K, V, dtype, seed=B * 1000 + T * 7 + K + V, h0=h0)
    _compare(_reference(ins, s0, do, dS), _run(chunk, ins, s0, do, dS, mode=mode, chunk_size=C), dtype)


@slow
def test_modes_agree_and_defaults():
    """Bounded and general paths compute the same function; default scale is K**-0.5."""
    ins, s0, do, dS = _inputs(1, 65, 1, 32, 32, torch.float32, seed=3)
    a = _run(chunk, ins, s0, do, dS, mode="bounded")
    b = _run(chunk, ins, s0, do, dS, mode="general", scale=32**-0.5)
    assert_close(a[0], b[0], 1e-5, "o bounded vs general")
    for x, y in zip(a[2], b[2]):
        # 3e-5: dg is a reverse cumsum with cancelling terms; each mode is ~1e-5 from an fp64 reference
        assert_close(x, y, 3e-5, "grad bounded vs general")


def _runs_by_tuning(monkeypatch, key, values, ins, s0, do, dS, mode):
    """One forward + backward per value of ``TUNING[key]``: {value: (o, S, grads)}."""
    from moelab.ops.kda import triton_chunk as tc

    runs = {}
    for val in values:
        monkeypatch.setitem(tc.TUNING, key, val)
        runs[val] = _run(chunk, ins, s0, do, dS, mode=mode)
    return runs


def _paths_agree(monkeypatch, key, paths, pair, mode, seed):
    """Every value of ``TUNING[key]`` close to the reference at B2 T150 (a padded last chunk), the
    two of ``pair`` equal up to fp32 rounding (o 1e-5, gradients 3e-5), a bogus value refused."""
    ins, s0, do, dS = _inputs(2, 150, 2, 32, 16, torch.float32, seed=seed)
    runs = _runs_by_tuning(monkeypatch, key, paths, ins, s0, do, dS, mode)
    ref = _reference(ins, s0, do, dS)
    for path in paths:
        _compare(ref, runs[path])
    a, b = pair
    assert_close(runs[a][0], runs[b][0], 1e-5, f"o {a} vs {b}")
    for x, y in zip(runs[a][2], runs[b][2]):
        assert_close(x, y, 3e-5, f"grad {a} vs {b}")
    _refuses_bogus(monkeypatch, key, ins, s0, do, dS, mode)


def _refuses_bogus(monkeypatch, key, ins, s0, do, dS, mode):
    """An unknown ``TUNING[key]`` value raises a ValueError naming it."""
    from moelab.ops.kda import triton_chunk as tc

    monkeypatch.setitem(tc.TUNING, key, "bogus")
    with pytest.raises(ValueError, match="'bogus'"):
        _run(chunk, ins, s0, do, dS, mode=mode)


@slow
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_save_policies_agree(monkeypatch, mode):
    """Keeping the forward's intermediates for the backward (save=intra/all) gives bitwise the same
    gradients as recomputing them from the inputs (save=inputs); a bad policy is refused."""
    from moelab.ops.kda import triton_chunk as tc

    ins, s0, do, dS = _inputs(1, 130, 2, 32, 16, torch.float32, seed=11)
    runs = _runs_by_tuning(monkeypatch, "save", tc.SAVE_POLICIES, ins, s0, do, dS, mode)
    for save in ("intra", "all"):
        assert torch.equal(runs[save][0], runs["inputs"][0])
        for a, b in zip(runs[save][2], runs["inputs"][2]):
            assert torch.equal(a, b), save
    _refuses_bogus(monkeypatch, "save", ins, s0, do, dS, mode)


@slow
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_dqkg_paths_agree(monkeypatch, mode):
    """State terms inside the per-sub-tile gradient kernel ("fused") or in their own per-chunk
    kernel first ("split"): the same outputs and gradients up to fp32 rounding, both close to the
    reference; a bad path name is refused."""
    from moelab.ops.kda import triton_chunk as tc

    ins, s0, do, dS = _inputs(2, 150, 2, 32, 16, torch.float32, seed=17)
    runs = _runs_by_tuning(monkeypatch, "dqkg", tc.DQKG_PATHS, ins, s0, do, dS, mode)
    _compare(_reference(ins, s0, do, dS), runs["split"])
    assert torch.equal(runs["fused"][0], runs["split"][0])  # the forward does not change
    for a, b in zip(runs["fused"][2], runs["split"][2]):
        assert_close(a, b, 1e-5, "grad fused vs split")
    _refuses_bogus(monkeypatch, "dqkg", ins, s0, do, dS, mode)


@slow
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_score_paths_agree(monkeypatch, mode):
    """The three intra paths (chunk-wide scores in the intra kernel, the sub-tile score kernel, and
    the sub-tile kkt + wu kernels) compute the same outputs and gradients (fp32, exact products:
    up to rounding)."""
    from moelab.ops.kda import triton_chunk as tc

    ins, s0, do, dS = _inputs(1, 150, 2, 32, 16, torch.float32, seed=13)
    runs = _runs_by_tuning(monkeypatch, "scores", tc.SCORE_PATHS, ins, s0, do, dS, mode)
    for other in ("subtile", "tiles"):
        assert_close(runs["chunk"][0], runs[other][0], 1e-5, f"o {other}")
        for a, b in zip(runs["chunk"][2], runs[other][2]):
            assert_close(a, b, 3e-5, f"grad {other}")


@slow
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_kkt_paths_agree(monkeypatch, mode):
    """The sub-tile rows of a chunk one after the other in one kkt program ("rows") or in parallel
    programs followed by a merge ("parallel"): the same outputs and gradients up to fp32 rounding,
    both close to the reference; a bad path name is refused."""
    from moelab.ops.kda import triton_chunk as tc

    _paths_agree(monkeypatch, "kkt", tc.KKT_PATHS, ("rows", "parallel"), mode, seed=19)


@slow
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_cumsum_paths_agree(monkeypatch, mode):
    """G written by the prep ("prep") or recomputed in the kkt rows ("kernel"; "auto" picks one per
    mode): the same outputs and gradients up to fp32 rounding, all close to the reference (T = 150
    pads the last chunk); a bad value is refused."""
    from moelab.ops.kda import triton_chunk as tc

    _paths_agree(monkeypatch, "cumsum", tc.CUMSUM_PATHS, ("prep", "kernel"), mode, seed=23)


@pytest.mark.parametrize("mode, want", [("bounded", True), ("general", False)])
def test_cumsum_auto_picks_per_mode(monkeypatch, mode, want):
    """``cumsum="auto"`` (the default): the chunked prep writes G in bounded mode, the kkt rows
    form it themselves in general mode (where reading it in was measured slower)."""
    from moelab.ops.kda import triton_chunk as tc

    calls = []
    orig = tc.prep_fwd_chunked
    monkeypatch.setattr(tc, "prep_fwd_chunked", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    assert tc.TUNING["cumsum"] == "auto"
    ins, s0, do, dS = _inputs(1, 40, 1, 16, 16, torch.float32, seed=3)
    _compare(_reference(ins, s0, do, dS), _run(chunk, ins, s0, do, dS, mode=mode))
    assert bool(calls) == want


def test_no_final_state_and_no_state_grad():
    ins, _, do, _ = _inputs(1, 20, 1, 16, 16, torch.float32, seed=5, h0=False)
    leaves = [x.clone().requires_grad_() for x in ins]
    o, S = chunk_kda(*leaves)
    assert S is None
    (o * do).sum().backward()
    ref = [x.clone().requires_grad_() for x in ins]
    o_r, _ = naive_recurrent_kda(*ref)
    (o_r * do).sum().backward()
    assert_close(o_r, o, O_TOL, "o")
    for a, b in zip(ref, leaves):
        assert_close(a.grad, b.grad, GRAD_TOL, "grad")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter warns about the bounded overflow
def test_general_mode_survives_very_negative_decay():
    """g = -30 / -60 on some channels: the general path stays finite and exact; the bounded
    path (with the check switched off) overflows inside its diagonal sub-tiles."""
    ins, s0, do, dS = _inputs(1, 80, 1, 32, 16, torch.float32, seed=11, g_min=-1.0)
    g = ins[3].clone()
    g[..., :8] = -30.0
    g[:, 10:20, :, 8:12] = -60.0
    ins[3] = g
    # fp32 still, but channels decayed by e^-30 per token leave a state of tiny entries: measured
    # 4e-5 on the final state and dbeta, so 1e-4 here (the sweep above holds fp32 to 1e-5)
    _compare(_reference(ins, s0, do, dS), _run(chunk, ins, s0, do, dS, mode="general"), tol=(1e-4, 1e-4))
    o, _ = chunk(*ins, mode="bounded", validate=False)
    assert not torch.isfinite(o).all(), "expected the bounded fast path to overflow at g = -60"


def test_bounded_rejects_decay_below_bound():
    ins, _, _, _ = _inputs(1, 8, 1, 16, 16, torch.float32, seed=1)
    ins[3][0, 3, 0, 2] = -5.25
    with pytest.raises(ValueError, match=r"min\(g\)=-5.25.*g_min=-5"):
        chunk_kda(*ins, mode="bounded", g_min=-5.0)
    chunk_kda(*ins, mode="bounded", g_min=-5.5)  # a looser (still safe) bound accepts it
    chunk_kda(*ins, mode="general")


def test_bad_arguments_raise():
    ins, _, _, _ = _inputs(1, 8, 1, 16, 16, torch.float32, seed=2)
    with pytest.raises(ValueError, match="g_min=-8"):
        chunk_kda(*ins, mode="bounded", g_min=-8.0)  # 16 * 8 / 2 = 64 > ~44: tile overflows
    with pytest.raises(ValueError, match="mode="):
        chunk_kda(*ins, mode="fast")
    with pytest.raises(ValueError, match="chunk_size=48"):
        chunk_kda(*ins, chunk_size=48)
    pos = [x.clone() for x in ins]
    pos[3][0, 0, 0, 0] = 0.5
    with pytest.raises(ValueError, match=r"max\(g\)=0.5"):
        chunk_kda(*pos, mode="general")
    big = torch.zeros(1, 4, 1, 512, device=DEV)
    with pytest.raises(ValueError, match="K=512"):
        chunk_kda(big, big, ins[2][:, :4], big, ins[4][:, :4])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_bf16_on_gpu(mode):
    """The real bf16 path (tensor-core products, bf16 intermediates), which the interpreter cannot run."""
    ins, s0, do, dS = _inputs(2, 300, 4, 64, 64, torch.bfloat16, seed=7)
    _compare(_reference(ins, s0, do, dS), _run(chunk, ins, s0, do, dS, mode=mode), torch.bfloat16)


def test_launch_config_override(monkeypatch):
    """MOELAB_KDA_LAUNCH entries replace LAUNCH entries; unknown kernels or malformed configs raise."""
    from moelab.ops.kda import triton_chunk as tc

    monkeypatch.setattr(tc, "LAUNCH", dict(tc.LAUNCH))
    tc._launch_from_env('{"state": [64, 4, 1]}')
    assert tc.LAUNCH["state"] == (64, 4, 1)
    with pytest.raises(ValueError, match="'bogus'"):
        tc._launch_from_env('{"bogus": [64, 4, 1]}')
    with pytest.raises(ValueError, match="'out'"):
        tc._launch_from_env('{"out": [64, 4]}')
    monkeypatch.setattr(tc, "TUNING", dict(tc.TUNING))
    tc._tuning_from_env('{"scores": "chunk"}')
    assert tc.TUNING["scores"] == "chunk"
    with pytest.raises(ValueError, match="'bogus'"):
        tc._tuning_from_env('{"bogus": 1}')
    monkeypatch.setattr(tc, "MAXNREG", {})
    tc._maxnreg_from_env('{"kkt": 168}')
    assert tc.MAXNREG == {"kkt": 168}
    with pytest.raises(ValueError, match="'kkt'"):
        tc._maxnreg_from_env('{"kkt": 300}')
    cfgs = tc.launch_configs(128, 128)
    assert set(cfgs) == set(tc.LAUNCH) == {"scores", "intra", "state", "out", "dh", "wy", "dqkg", "dg", "sterm", "kkt",
                                           "kktr", "merge", "wu", "state_small"}


# fused prep: (B, T, H, K, V, chunk, gate, mode, silu, dt_bias)
FUSED = [
    (1, 70, 2, 32, 16, 64, "bounded", "bounded", True, True),  # partial chunk
    (2, 40, 1, 20, 24, 32, "bounded", "general", False, False),  # non-power-of-two K and V (padded)
    (1, 50, 2, 16, 16, 16, "softplus", "general", True, True),
]


@pytest.mark.parametrize("case", FUSED, ids=lambda c: f"T{c[1]}K{c[3]}V{c[4]}-{c[6]}-{c[7]}-silu{int(c[8])}")
def test_fused_prep_matches_reference(case):
    """Gate, SiLU and L2 norm inside the op == the fp32 torch prep followed by the recurrence,
    output, final state and the gradients of every raw input (q, k, v, z, beta, A_log, dt_bias, h0)."""
    from moelab.ops.kda.gate import kda_prep_torch

    B, T, H, K, V, C, gate, mode, silu, has_bias = case
    gen = torch.Generator().manual_seed(T + K)
    q, k, z = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    A_log = torch.randn(H, generator=gen) * 0.5
    dt_bias = torch.randn(H * K, generator=gen) if has_bias else None
    s0 = torch.randn(B, H, K, V, generator=gen)
    do, dS = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    kw = dict(gate=gate, g_min=-5.0, silu_qk=silu, l2norm_qk=True)

    def run(fused):
        leaves = [x.clone().to(DEV).requires_grad_() for x in (q, k, v, z, beta, A_log, s0)]
        bias = dt_bias.clone().to(DEV).requires_grad_() if has_bias else None
        qq, kk, vv, zz, bb, al, h0 = leaves
        if fused:
            o, S = chunk_kda(qq, kk, vv, zz, bb, initial_state=h0, output_final_state=True, mode=mode,
                             chunk_size=C, A_log=al, dt_bias=bias, **kw)
        else:
            qn, kn, g = kda_prep_torch(qq, kk, zz, al, bias, **kw)
            o, S = naive_recurrent_kda(qn, kn, vv, g, bb, initial_state=h0, output_final_state=True)
        ((o * do.to(DEV)).sum() + (S * dS.to(DEV)).sum()).backward()
        return o, S, [x.grad for x in leaves] + ([bias.grad] if has_bias else [])

    o_r, S_r, g_r = run(False)
    o_t, S_t, g_t = run(True)
    assert_close(o_r, o_t, O_TOL, "o")
    assert_close(S_r, S_t, O_TOL, "final state")
    for name, a, b in zip(["dq", "dk", "dv", "dz", "dbeta", "dA_log", "dh0", "ddt_bias"], g_r, g_t):
        assert_close(a, b, GRAD_TOL, name)


def test_fused_prep_bad_arguments():
    ins, _, _, _ = _inputs(1, 8, 2, 16, 16, torch.float32, seed=1, h0=False)
    A_log = torch.zeros(2, device=DEV)
    with pytest.raises(ValueError, match="gate='softplus' is not allowed with mode='bounded'"):
        chunk_kda(*ins, gate="softplus", A_log=A_log, mode="bounded")
    with pytest.raises(ValueError, match="needs A_log"):
        chunk_kda(*ins, gate="bounded", g_min=G_MIN)
    with pytest.raises(ValueError, match="gate='sigmoid' is not allowed"):
        chunk_kda(*ins, gate="sigmoid", A_log=A_log)
    with pytest.raises(ValueError, match="only used with gate"):
        chunk_kda(*ins, A_log=A_log)


@pytest.mark.parametrize("scores, kkt", [("chunk", "rows"), ("tiles", "rows"), ("tiles", "parallel")])
def test_launch_arguments_match_kernel_signatures(monkeypatch, scores, kkt):
    """Every launch passes exactly the kernel's parameters: the interpreter tolerates an unknown
    keyword that the GPU JIT rejects, so this catches it on a CPU machine."""
    from moelab.ops.kda import triton_chunk as tc

    seen = {}
    orig = tc._Launcher.__call__

    def check(self, grid, *args, **kw):
        names = self.kernel.arg_names
        size = self.config(kw["K"], kw["V"])[0]
        given = list(names[: len(args)]) + list(kw) + ([self.block] if self.block else [])
        assert sorted(given) == sorted(names), (self.name, sorted(set(given) ^ set(names)))
        seen[self.name] = size
        return orig(self, grid, *args, **kw)

    monkeypatch.setattr(tc._Launcher, "__call__", check)
    monkeypatch.setitem(tc.TUNING, "scores", scores)
    monkeypatch.setitem(tc.TUNING, "kkt", kkt)
    for mode in ("bounded", "general"):
        ins, s0, do, dS = _inputs(1, 40, 1, 16, 16, torch.float32, seed=1)
        _run(chunk, ins, s0, do, dS, mode=mode)
    paths = {"rows": {"kkt"}, "parallel": {"kktr", "merge"}}
    want = {"intra"} if scores == "chunk" else {"wu"} | paths[kkt]
    assert want <= set(seen)


def test_small_grid_takes_its_state_launch(monkeypatch):
    """The sequential state kernel takes its ``state_small`` launch entry when
    ``B * H * V / 32 <= SMALL_GRID`` and the regular one above; the results are the same."""
    from moelab.ops.kda import triton_chunk as tc

    names = []
    orig = tc._Launcher.__call__
    monkeypatch.setattr(tc._Launcher, "__call__",
                        lambda self, *a, **kw: names.append(self.name) or orig(self, *a, **kw))
    ins, s0, do, dS = _inputs(2, 40, 2, 16, 16, torch.float32, seed=3)
    runs = {}
    for grid in (128, 0):
        monkeypatch.setattr(tc, "SMALL_GRID", grid)
        names.clear()
        runs[grid] = _run(chunk, ins, s0, do, dS)
        small = "state_small" in names and "state" not in names
        assert small == (grid == 128), (grid, names)
    assert torch.equal(runs[128][0], runs[0][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[128][2], runs[0][2]))


def test_op_under_torch_compile():
    """A torch.compile'd caller runs the op eagerly (``torch.compiler.disable``): same output and
    gradients as calling it directly."""
    ins, s0, do, dS = _inputs(1, 40, 2, 16, 16, torch.float32, seed=23)

    def loss(*xs):
        o, S = chunk_kda(*xs, initial_state=None, output_final_state=True)
        return (o * do).sum() + (S * dS[:, :, :16, :16]).sum()

    leaves = [x.detach().clone().requires_grad_() for x in ins]
    ref = loss(*leaves)
    ref.backward()
    want = [x.grad.clone() for x in leaves]
    leaves = [x.detach().clone().requires_grad_() for x in ins]
    out = torch.compile(loss, backend="eager")(*leaves)
    out.backward()
    assert torch.equal(out, ref)
    for a, b in zip(want, [x.grad for x in leaves]):
        assert torch.equal(a, b)
