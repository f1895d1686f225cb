"""Triton chunked KDA (moelab/ops/kda/triton_chunk.py) against the fp32 token-by-token reference.

On a CPU machine the kernels run in the Triton interpreter (tests/conftest.py), so shapes stay
tiny; fp32 and fp16 only (the interpreter gets bf16 wrong). bf16 at real sizes is checked on the
GPU by kernels/check_kda_gpu.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moelab.ops.kda.naive import naive_recurrent_kda
from moelab.ops.kda.triton_chunk import chunk_kda
from tests.helpers import assert_close, poisoned_allocations

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
# interpreter takes 4-10 s on the two largest: those are `slow` (make test runs them, test-fast not).
slow = pytest.mark.slow
SWEEP = [
    (1, 1, 1, 16, 16, 64, torch.float32, True),  # T = 1
    pytest.param((2, 150, 2, 32, 16, 64, torch.float32, True), marks=slow),  # B > 1, K != V, T % 64 != 0
    pytest.param((1, 70, 1, 128, 32, 64, torch.float32, False), marks=slow),  # K = 128: several K-blocks
    (1, 40, 1, 20, 40, 32, torch.float32, True),  # non-power-of-two K and V, chunk 32
    (1, 37, 2, 16, 24, 16, torch.float16, False),  # fp16, chunk 16
    (1, 100, 1, 32, 16, 64, torch.float16, True),  # fp16, partial second chunk
]


@pytest.mark.parametrize("mode", ["bounded", "general"])
@pytest.mark.parametrize(
    "case", SWEEP, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}K{c[3]}V{c[4]}C{c[5]}-{str(c[6])[6:]}-h0{int(c[7])}")
def test_matches_reference(case, mode):
    B, T, H, K, V, C, dtype, h0 = case
    ins, s0, do, dS = _inputs(B, T, H, K, V, dtype, seed=B * 1000 + T * 7 + K + V, h0=h0)
    _compare(_reference(ins, s0, do, dS), _run(chunk, ins, s0, do, dS, mode=mode, chunk_size=C), dtype)


def test_modes_agree_and_defaults():
    """Bounded and general paths compute the same function; default scale is K**-0.5."""
    ins, s0, do, dS = _inputs(1, 65, 1, 32, 32, torch.float32, seed=3)
    a = _run(chunk, ins, s0, do, dS, mode="bounded")
    b = _run(chunk, ins, s0, do, dS, mode="general", scale=32**-0.5)
    assert_close(a[0], b[0], 1e-5, "o bounded vs general")
    for x, y in zip(a[2], b[2]):
        # 3e-5: dg is a reverse cumsum with cancelling terms; each mode is ~1e-5 from an fp64 reference
        assert_close(x, y, 3e-5, "grad bounded vs general")


@pytest.mark.parametrize("mode, want", [("bounded", True), ("general", False)])
def test_g_from_the_prep_in_bounded_mode_only(monkeypatch, mode, want):
    """The chunked prep writes G for the kkt rows in bounded mode; in general mode the kkt rows form
    it themselves (where reading it in was measured slower). Both match the reference."""
    from moelab.ops.kda import triton_chunk as tc

    calls = []
    orig = tc.prep_fwd_chunked
    monkeypatch.setattr(tc, "prep_fwd_chunked", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
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


OTHER_BWD = dict(das="fp32", du="fp32", dkb="fp32", dg="dqkg")  # the backward's non-default VARIANTS, all at once


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, dict(chains="serial", forward="infer"), OTHER_BWD],
                         ids=["default", "serial-infer", "other-bwd"])
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_bf16_on_gpu(mode, variant):
    """The real bf16 path (tensor-core products, bf16 intermediates), which the interpreter cannot run: the
    default (the backward's two chains on two streams), the chains one after the other with the inference forward
    (bounded mode), and the backward's other choices (its scratch in fp32, dg in the score kernel)."""
    from moelab.ops.kda import triton_chunk as tc

    ins, s0, do, dS = _inputs(2, 300, 4, 64, 64, torch.bfloat16, seed=7)
    with tc.launch_overrides(**variant):
        out = _run(chunk, ins, s0, do, dS, mode=mode)
    _compare(_reference(ins, s0, do, dS), out, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("chains", ["concurrent", "serial"])
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_captured_in_a_cuda_graph_equals_eager_gpu(chains, packed):
    """Forward + backward captured in one CUDA graph (what ``train.compile=graphs`` does to the step), replayed on new
    inputs copied into the captured leaves: the outputs and every gradient equal the eager op's on those inputs,
    bit for bit (the kernels are deterministic). With ``chains="concurrent"`` the backward forks a side stream off the
    capturing stream and joins it, which the capture must take; packed documents add the varlen layout."""
    from moelab.ops.kda import triton_chunk as tc

    B, T, H, D = (1, 700, 4, 64) if packed else (2, 512, 4, 64)
    cu = torch.tensor([0, 100, 357, 700], device=DEV, dtype=torch.int32) if packed else None
    # validate=False: no host reads of g or cu_seqlens (a capture takes none), as the model calls the op
    kw = dict(mode="bounded", g_min=G_MIN, output_final_state=False, validate=False) | (
        {"cu_seqlens": cu} if packed else {})

    def step(leaves, do):
        for x in leaves:
            x.grad = None
        o, _ = chunk_kda(*leaves, **kw)
        (o.float() * do).sum().backward()
        return o.detach().clone(), [x.grad.clone() for x in leaves]

    first, _, do0, _ = _inputs(B, T, H, D, D, torch.bfloat16, seed=3, h0=False)
    second, _, do1, _ = _inputs(B, T, H, D, D, torch.bfloat16, seed=4, h0=False)
    with tc.launch_overrides(chains=chains):
        leaves = [x.clone().requires_grad_() for x in first]
        do = do0.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (Triton compiles, the allocator fills)
            for _ in range(2):
                step(leaves, do)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_cap, g_cap = step(leaves, do)
        with torch.no_grad():
            for x, y in zip(leaves, second):
                x.copy_(y)
            do.copy_(do1)
        graph.replay()
        torch.cuda.synchronize()
        o_ref, g_ref = step([x.clone().requires_grad_() for x in second], do1)
    assert torch.equal(o_cap, o_ref)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], g_cap, g_ref):
        assert torch.equal(a, b), name


KERNELS = {"kktr", "merge", "wu", "state", "state_small", "out", "dh", "wy", "sterm", "dqkg", "dg", "dqkg_dg"}


def test_launch_overrides():
    """``launch_overrides`` swaps LAUNCH / MAXNREG entries inside its block and restores them on
    exit (also after an error); unknown kernels or malformed entries raise, naming them."""
    from moelab.ops.kda import triton_chunk as tc

    launch, maxnreg = dict(tc.LAUNCH), dict(tc.MAXNREG)
    assert set(launch) == set(tc.launch_configs(128, 128)) == KERNELS
    with tc.launch_overrides(launch={"state": [32, 2, 1]}, maxnreg={"kktr": None, "dqkg": 128}):
        assert tc.LAUNCH["state"] == (32, 2, 1) and tc.LAUNCH["out"] == launch["out"]
        assert tc.MAXNREG == {name: cap for name, cap in {**maxnreg, "dqkg": 128}.items() if name != "kktr"}
    assert tc.LAUNCH == launch and tc.MAXNREG == maxnreg
    with pytest.raises(RuntimeError, match="inside"), tc.launch_overrides(launch={"out": (128, 8, 1)}):
        raise RuntimeError("inside")
    assert tc.LAUNCH == launch
    with pytest.raises(ValueError, match="'bogus'"), tc.launch_overrides(launch={"bogus": (64, 4, 1)}):
        pass
    with pytest.raises(ValueError, match="'out'"), tc.launch_overrides(launch={"out": (64, 4)}):
        pass
    with pytest.raises(ValueError, match="'kktr'"), tc.launch_overrides(maxnreg={"kktr": 300}):
        pass
    assert tc.LAUNCH == launch and tc.MAXNREG == maxnreg
    default = dict(tc.VARIANT)
    assert default == {name: choices[0] for name, choices in tc.VARIANTS.items()}
    # chains, forward: timed on the H200; out: an H100 (kda_candidates.json, run 4); prep, states, gate_bwd: an H100
    # at the three shapes of the kda entry (kernels/results/kda_h100.json, session 44); das, du, dkb: an H100 (run 13)
    assert default == {"chains": "concurrent", "forward": "train", "out": "fused", "prep": "kept",
                       "states": "kept", "gate_bwd": "dg", "das": "bf16", "du": "bf16",
                       "dkb": "bf16", "dg": "kernel"}
    with pytest.raises(RuntimeError, match="inside"), tc.launch_overrides(forward="infer", chains=None):
        assert tc.VARIANT == {**default, "forward": "infer"}
        raise RuntimeError("inside")
    assert tc.VARIANT == default
    # a launch from a command line (check_kda_gpu.py --launch): entries by ';', a malformed one named
    assert tc.parse_launch("dqkg=32,1,2; dh=64,8,2") == {"dqkg": [32, 1, 2], "dh": [64, 8, 2]}
    assert tc.parse_launch("") == {}
    with pytest.raises(ValueError, match="'dqkg=32,x,2' is not allowed"):
        tc.parse_launch("dqkg=32,x,2")
    with pytest.raises(ValueError, match=r"chains='parallel' is not allowed: expected one of "
                                         r"\('concurrent', 'serial'\)"), tc.launch_overrides(chains="parallel"):
        pass
    with pytest.raises(ValueError, match=r"forward='fast' is not allowed"), tc.launch_overrides(forward="fast"):
        pass
    with pytest.raises(ValueError, match=r"variant speed='max' is not allowed: expected a switch of"), \
            tc.launch_overrides(speed="max"):
        pass
    assert tc.VARIANT == default
    with tc.launch_overrides(chains="serial"):  # CPU tensors run the default "concurrent" chains serially too
        ins, s0, do, dS = _inputs(1, 20, 1, 16, 16, torch.float32, seed=2)
        _compare(_reference(ins, s0, do, dS), _run(chunk, ins, s0, do, dS))
    assert tc.VARIANT == default


# fused prep: (B, T, H, K, V, chunk, gate, mode, silu, dt_bias)
FUSED = [
    (1, 70, 2, 32, 16, 64, "bounded", "bounded", True, True),  # partial chunk
    (2, 40, 1, 20, 24, 32, "bounded", "general", False, False),  # non-power-of-two K and V (padded)
    (1, 50, 2, 16, 16, 16, "softplus", "general", True, True),
]


FUSED_IDS = [f"T{c[1]}K{c[3]}V{c[4]}-{c[6]}-{c[7]}-silu{int(c[8])}" for c in FUSED]


def _check_fused_prep(case, around_op=contextlib.nullcontext):
    """Gate, SiLU and L2 norm inside the op (run inside ``around_op()``) == the fp32 torch prep followed
    by the recurrence: output, final state and the gradients of every raw input (q, k, v, z, beta,
    A_log, dt_bias, h0)."""
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
        with around_op() if fused else contextlib.nullcontext():
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


@pytest.mark.parametrize("case", FUSED, ids=FUSED_IDS)
def test_fused_prep_matches_reference(case):
    _check_fused_prep(case)


@pytest.mark.parametrize("case", FUSED, ids=FUSED_IDS)
def test_fused_prep_ignores_uninitialised_memory(monkeypatch, case):
    """Every buffer the op allocates uninitialised (torch.empty, empty_like, new_empty, in the forward
    and the backward) starts full of NaN: a kernel that reads or accumulates into rows it did not write
    (padded tails, per-chunk or per-block partial sums, the dA_log rows) then turns the result NaN, where
    with a real allocator it would silently depend on what the previous user of the memory left."""
    allocs = []
    _check_fused_prep(case, lambda: poisoned_allocations(monkeypatch, allocs))
    assert len(allocs) > 20, f"the poisoning reached only {len(allocs)} allocations"


@pytest.mark.parametrize("choice", ["kept", "rerun"])
@pytest.mark.parametrize("case", FUSED, ids=FUSED_IDS)
def test_kept_and_rerun_prep_match_reference(case, choice):
    """The backward from the forward's kept prep outputs (``VARIANTS["prep"]`` "kept", the default) and from a
    second prep pass ("rerun"): the same results against the fp32 prep and recurrence, padded and partial chunks
    included (gate_bwd "prep", so the prep's backward takes the gate too)."""
    from moelab.ops.kda import triton_chunk as tc

    _check_fused_prep(case, lambda: tc.launch_overrides(prep=choice, gate_bwd="prep"))


INFER_FORWARD = [
    (1, 40, 1, 20, 40, 32, torch.float32, True),  # padded K and V, chunk 32 in the backward
    (1, 100, 1, 32, 16, 64, torch.float16, True),  # fp16, partial second chunk
    pytest.param((2, 150, 2, 32, 16, 64, torch.float32, False), marks=slow),
]


@pytest.mark.parametrize(
    "case", INFER_FORWARD, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}K{c[3]}V{c[4]}C{c[5]}-{str(c[6])[6:]}-h0{int(c[7])}")
def test_infer_forward_matches_reference(monkeypatch, case):
    """``forward="infer"``: bounded mode's training forward runs the inference kernels (chunk 16, nothing
    kept) and the backward recomputes the intra-chunk intermediates at its own chunk: output, final state and
    every gradient within the dtype's bound of the reference; general mode keeps the training forward."""
    from moelab.ops.kda import infer_plan
    from moelab.ops.kda import triton_chunk as tc

    calls = []
    real = infer_plan.kda_infer
    monkeypatch.setattr(infer_plan, "kda_infer", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    B, T, H, K, V, C, dtype, h0 = case
    ins, s0, do, dS = _inputs(B, T, H, K, V, dtype, seed=B * 1000 + T * 7 + K + V, h0=h0)
    ref = _reference(ins, s0, do, dS)
    with tc.launch_overrides(forward="infer"):
        _compare(ref, _run(chunk, ins, s0, do, dS, mode="bounded", chunk_size=C), dtype)
        assert len(calls) == 1
        _compare(ref, _run(chunk, ins, s0, do, dS, mode="general", chunk_size=C), dtype)
        assert len(calls) == 1, "general mode must keep the training forward"


@pytest.mark.parametrize("case", FUSED[:2], ids=FUSED_IDS[:2])
def test_infer_forward_ignores_uninitialised_memory(monkeypatch, case):
    """The poisoning of ``test_fused_prep_ignores_uninitialised_memory`` with ``forward="infer"`` (the
    bounded case recomputes its intermediates in the backward)."""
    from moelab.ops.kda import triton_chunk as tc

    @contextlib.contextmanager
    def poison_infer():
        with poisoned_allocations(monkeypatch), tc.launch_overrides(forward="infer"):
            yield

    _check_fused_prep(case, poison_infer)


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


def test_a_launch_that_does_not_fit_shared_memory_drops_stages(monkeypatch):
    """A multi-stage launch whose compiled kernel needs more shared memory than the GPU has (the H100's
    error at dh (64, 8, 2) with D = 256) is compiled again with fewer stages, and the stages that fit are
    kept for that shape and dtype; other resource errors, and one at a single stage, still raise."""
    from triton.runtime.errors import OutOfResources

    from moelab.ops.kda import triton_chunk as tc

    calls: list[int] = []

    class Kernel:  # what ``kernel[grid](...)`` does: fails to load above ``fits`` stages
        def __init__(self, fits: int, what: str = "shared memory"):
            self.fits, self.what = fits, what

        def __getitem__(self, grid):
            def launch(*args, num_stages: int, **kwargs):
                calls.append(num_stages)
                if num_stages > self.fits:
                    raise OutOfResources(278528, 232448, self.what)
                return num_stages
            return launch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(tc, "FITTED_STAGES", {})
    x = torch.zeros(2, dtype=torch.bfloat16)
    with tc.launch_overrides(launch={"dh": (64, 8, 3)}):
        launcher = tc._Launcher("dh", Kernel(fits=1), "BV")
        assert launcher((1,), x, K=256, V=256) == 1 and calls == [3, 2, 1]
        assert tc.FITTED_STAGES == {("dh", 64, 8, 3, 256, 256, torch.bfloat16): 1}
        calls.clear()
        assert launcher((1,), x, K=256, V=256) == 1 and calls == [1]  # remembered: compiled once
        calls.clear()
        assert tc._Launcher("dh", Kernel(fits=3), "BV")((1,), x, K=128, V=128) == 3 and calls == [3]
        with pytest.raises(OutOfResources, match="registers"):
            tc._Launcher("dh", Kernel(fits=1, what="registers"), "BV")((1,), x, K=128, V=64)
    with pytest.raises(OutOfResources, match="shared memory"), tc.launch_overrides(launch={"dh": (64, 8, 1)}):
        tc._Launcher("dh", Kernel(fits=0), "BV")((1,), x, K=64, V=64)


def test_launch_arguments_match_kernel_signatures(monkeypatch):
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
    for mode in ("bounded", "general"):
        ins, s0, do, dS = _inputs(1, 40, 1, 16, 16, torch.float32, seed=1)
        _run(chunk, ins, s0, do, dS, mode=mode)
        with tc.launch_overrides(**{name: next(c for c in choices if c != tc.VARIANT[name])
                                    for name, choices in tc.VARIANTS.items()}):
            _run(chunk, ins, s0, do, dS, mode=mode)
    assert set(seen) == KERNELS - {"state"}  # B1 H1: the state kernel's small-grid launch


@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_bf16_scratch_rounds_only_the_gradients(mode, monkeypatch):
    """``VARIANTS`` das / du / dkb at "bf16" (the backward's scratch in bf16: bf16 inputs only, so forced here on fp32
    inputs, where everything else is exact): the forward is untouched (bit for bit), and each gradient moves from the
    fp32-scratch op's by the rounding of what it reads from the scratch (~2^-9 relative, summed over a few terms:
    at most 6e-3 here), within the bf16 target against the fp32 reference."""
    from moelab.ops.kda import triton_chunk as tc

    ins, s0, do, dS = _inputs(1, 130, 2, 32, 32, torch.float32, seed=3)
    base = _run(chunk, ins, s0, do, dS, mode=mode)
    made = []

    def scratch(switch, dtype):
        made.append(switch)
        return torch.bfloat16

    monkeypatch.setattr(tc, "_scratch_dtype", scratch)
    out = _run(chunk, ins, s0, do, dS, mode=mode)
    assert sorted(made) == ["das", "dkb", "du"]
    assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])
    moved = {name: ((a - b).norm() / b.norm()).item() for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"],
                                                                             out[2], base[2])}
    assert all(0 < m < 6e-3 for m in moved.values()), moved  # each gradient reads a rounded scratch
    _compare(_reference(ins, s0, do, dS), out, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("grid", [128, 0], ids=["small-grid", "grid"])
@pytest.mark.parametrize("mode", ["bounded", "general"])
def test_fused_output_equals_the_output_kernels(mode, grid, dtype, monkeypatch):
    """``VARIANTS["out"] = "fused"``: the state kernel forms each chunk's output from the same operands, rounded
    alike, as ``_kda_fwd_out`` does from the stored chunk states (at both state launches; fp16: fp32 work buffers
    under a 16-bit output); the final state and every gradient come out bit for bit (the backward reads no
    forward output), and both match the fp32 recurrence."""
    from moelab.ops.kda import triton_chunk as tc

    monkeypatch.setattr(tc, "SMALL_GRID", grid)
    ins, s0, do, dS = _inputs(2, 100, 2, 32, 16, dtype, seed=5)
    runs = {}
    for out in ("split", "fused"):
        with tc.launch_overrides(out=out):
            runs[out] = _run(chunk, ins, s0, do, dS, mode=mode)
    (o_s, S_s, g_s), (o_f, S_f, g_f) = runs["split"], runs["fused"]
    assert_close(o_s.float(), o_f.float(), 1e-6, "o")
    assert torch.equal(S_s, S_f) and all(torch.equal(a, b) for a, b in zip(g_s, g_f))
    _compare(_reference(ins, s0, do, dS), runs["fused"], dtype)


@pytest.mark.parametrize(("mode", "out", "dtype"), [("bounded", "fused", torch.float32),
                                                     ("general", "split", torch.float16)])
def test_kept_states_equal_the_recompute(mode, out, dtype):
    """``VARIANTS["states"] = "kept"``: the forward's state kernel stores the chunk states and corrected values (with
    the fused output too) and the backward skips its recompute; the recompute forms the same numbers from the same
    inputs, so the output, the final state and every gradient come out bit for bit, with and without an initial
    state, and match the fp32 recurrence."""
    from moelab.ops.kda import triton_chunk as tc

    ins, s0, do, dS = _inputs(2, 40, 1, 16, 16, dtype, seed=7)
    kept = None  # with the initial state
    for h0 in (s0, None):
        runs = {}
        for states in ("rerun", "kept"):
            with tc.launch_overrides(out=out, states=states):
                runs[states] = _run(chunk, ins, h0, do, dS, mode=mode, chunk_size=16)  # three chunks
        (o_r, S_r, g_r), (o_k, S_k, g_k) = runs["rerun"], runs["kept"]
        assert torch.equal(o_r, o_k) and torch.equal(S_r, S_k)
        assert len(g_r) == len(g_k) and all(torch.equal(a, b) for a, b in zip(g_r, g_k))
        kept = kept or runs["kept"]
    _compare(_reference(ins, s0, do, dS), kept, dtype)


@pytest.mark.parametrize("case", [(1, 64, 2, 32, 16, 16, "bounded", "bounded", False, True),
                                  (2, 32, 1, 16, 16, 16, "softplus", "general", True, False)],
                         ids=["bounded-bias", "softplus-silu"])
def test_gate_backward_fused_into_dg(monkeypatch, case):
    """``VARIANTS["gate_bwd"] = "dg"``: the dg kernel applies the gate's backward itself (dL/dz in z's dtype, the
    fp32 sums of dA_log and dt_bias per program), so the prep's backward does q and k only. Every gradient equals
    the prep path's: dz bit for bit (the same fp32 dg and formula), dA_log and ddt_bias up to the order of their
    fp32 sums; the fp32 reference holds; a call the fused path cannot take (padded T) falls back."""
    from moelab.ops.kda import triton_chunk as tc

    _check_fused_prep(case, lambda: tc.launch_overrides(gate_bwd="dg"))
    _check_fused_prep(case, lambda: tc.launch_overrides(gate_bwd="prep"))

    @contextlib.contextmanager
    def poisoned_fused():  # every buffer the fused path allocates starts NaN: its per-program sums cover them
        with poisoned_allocations(monkeypatch, []), tc.launch_overrides(gate_bwd="dg"):
            yield
    _check_fused_prep(case, poisoned_fused)
    seen = []
    orig = tc.prep_bwd
    monkeypatch.setattr(tc, "prep_bwd", lambda *a, **kw: seen.append(a[7] is None) or orig(*a, **kw))
    B, T, H, K, V, C, gate, mode, silu, has_bias = case
    gen = torch.Generator().manual_seed(5)
    for T_run in (T, T - 5):  # T - 5: a padded last chunk, the prep path
        ins = [torch.randn(B, T_run, H, d, generator=gen).to(DEV) for d in (K, K, V, K)]
        ins.append(torch.rand(B, T_run, H, generator=gen).to(DEV))
        extra = [torch.randn(H, generator=gen).to(DEV) * 0.5] + ([torch.randn(H * K, generator=gen).to(DEV)]
                                                                   if has_bias else [])
        do = torch.randn(B, T_run, H, V, generator=gen).to(DEV)
        runs = {}
        for choice in ("prep", "dg"):
            leaves = [x.clone().requires_grad_() for x in ins + extra]
            with tc.launch_overrides(gate_bwd=choice):
                o, _ = chunk_kda(*leaves[:5], mode=mode, chunk_size=C, gate=gate, g_min=-5.0, silu_qk=silu,
                                 l2norm_qk=True, A_log=leaves[5], dt_bias=leaves[6] if has_bias else None)
                o.backward(do)
            runs[choice] = (o.detach(), [x.grad for x in leaves])
        assert seen[-2:] == [False, T_run == T]  # the fused path hands the prep's backward no dg
        (o_p, g_p), (o_d, g_d) = runs["prep"], runs["dg"]
        assert torch.equal(o_p, o_d)
        assert all(torch.equal(a, b) for a, b in zip(g_p[:5], g_d[:5]))  # dq, dk, dv, dz, dbeta
        for a, b in zip(g_p[5:], g_d[5:]):  # dA_log, ddt_bias: the same terms summed in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", [(1, 64, 2, 32, 16, 16, "bounded", "bounded", False, True),
                                  (2, 32, 1, 16, 16, 16, "softplus", "general", True, False),
                                  (1, 64, 2, 32, 16, 32, "none", "bounded", False, False)],
                         ids=["bounded-bias", "softplus-silu", "no-gate"])
def test_score_kernel_with_dg_equals_the_split_kernels(monkeypatch, case):
    """``VARIANTS["dg"] = "dqkg"``: the score kernel runs per chunk, sub-tiles last to first, and forms dg's
    reverse cumsum (and the gate's backward) itself, launching neither ``dqkg`` nor ``dg``. The output is the
    same bit for bit, dq, dk, dv, dbeta too (the same kernels' terms), dg / dz and the gate parameters up to the
    order of the fp32 sums; the fp32 reference holds (``_check_fused_prep``), NaN-poisoned buffers included."""
    from moelab.ops.kda import triton_chunk as tc

    B, T, H, K, V, C, gate, mode, silu, has_bias = case
    if gate != "none":
        _check_fused_prep(case, lambda: tc.launch_overrides(dg="dqkg"))

        @contextlib.contextmanager
        def poisoned():
            with poisoned_allocations(monkeypatch, []), tc.launch_overrides(dg="dqkg"):
                yield
        _check_fused_prep(case, poisoned)
    names = []
    orig = tc._Launcher.__call__
    monkeypatch.setattr(tc._Launcher, "__call__",
                        lambda self, *a, **kw: names.append(self.name) or orig(self, *a, **kw))
    gen = torch.Generator().manual_seed(9)
    ins = [torch.randn(B, T, H, d, generator=gen).to(DEV) for d in (K, K, V, K)]
    ins.append(torch.rand(B, T, H, generator=gen).to(DEV))
    extra = ([torch.randn(H, generator=gen).to(DEV) * 0.5] if gate != "none" else []) + (
        [torch.randn(H * K, generator=gen).to(DEV)] if has_bias else [])
    if gate == "none":
        ins[3] = -torch.rand(B, T, H, K, generator=gen).to(DEV) * 0.5  # a log decay in [-0.5, 0]
    do = torch.randn(B, T, H, V, generator=gen).to(DEV)
    runs = {}
    for choice in ("kernel", "dqkg"):
        names.clear()
        leaves = [x.clone().requires_grad_() for x in ins + extra]
        kw = dict(gate=gate, silu_qk=silu, l2norm_qk=True, A_log=leaves[5], dt_bias=leaves[6] if has_bias else None,
                  g_min=-5.0) if gate != "none" else dict(g_min=-5.0, l2norm_qk=True)
        with tc.launch_overrides(dg=choice):
            o, _ = chunk_kda(*leaves[:5], mode=mode, chunk_size=C, **kw)
            o.backward(do)
        runs[choice] = (o.detach(), [x.grad for x in leaves])
        assert ("dqkg_dg" in names) == (choice == "dqkg") and ("dqkg" in names) == ("dg" in names) == (
            choice == "kernel"), names
    (o_s, g_s), (o_f, g_f) = runs["kernel"], runs["dqkg"]
    assert torch.equal(o_s, o_f)
    for i, (a, b) in enumerate(zip(g_s, g_f)):
        if i == 3 or i >= 5:  # dg / dz, dA_log, ddt_bias: the same terms, summed in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b), i


def test_small_grid_takes_its_state_launch(monkeypatch):
    """The sequential state kernel takes its ``state_small`` launch entry when ``B * H * V / 32 <= SMALL_GRID``
    and the regular one above (the state-gradient kernel its one entry at every grid); the results are the same."""
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
        assert ("state_small" in names and "state" not in names) == (grid == 128), (grid, names)
        assert "dh" in names, names
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
