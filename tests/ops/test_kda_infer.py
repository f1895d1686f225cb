"""KDA inference forward (moelab/ops/kda/infer_plan.py, kernels in triton_infer.py) against the fp32 token recurrence.

The reference is the fp32 prep (``kda_prep_torch``: SiLU, L2 norm, gate) followed by
``naive_recurrent_kda`` run on each sequence or packed document on its own, on the same
(dtype-rounded) inputs. On a CPU machine the kernels run in the Triton interpreter: fp32 and fp16
only (the interpreter gets bf16 wrong); bf16 at real sizes is in the ``gpu`` tests at the end, which
``pytest -m gpu`` runs at the launch configs the op picks at the benchmark shapes (few compiles on a
fresh Triton cache); the other configs carry ``slow`` instead.
"""

from __future__ import annotations

import functools

import pytest
import torch

from moelab.ops.kda import INFER_CHUNK, INFER_G_MIN_FLOOR, infer_plan
from moelab.ops.kda.bounds import max_safe_g_min
from moelab.ops.kda.gate import kda_prep_torch
from moelab.ops.kda.infer_plan import kda_infer
from moelab.ops.kda.naive import naive_recurrent_kda
from tests.helpers import assert_close, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: exact fp32 products, measured ~5e-7 (o) and ~3e-7 (state); fp16: ~4e-4 from the fp16
# inputs' rounding carried through fp32 intermediates; bf16 (GPU): the training op's 5e-3
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 5e-3}


def _inputs(B, T, H, K, V, dtype, seed, n_states, hard=False):
    """Random inputs; ``hard``: keys near one shared direction, decay near 0 and beta near 1, so
    ``A_kk`` has entries near 1 and every term of the 16x16 inverse's series matters."""
    gen = torch.Generator().manual_seed(seed)
    q, k, z = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=gen)
    beta_logit = torch.randn(B, T, H, generator=gen)
    if hard:
        k = torch.randn(K, generator=gen) + 0.3 * k
        z, beta_logit = z - 3.0, beta_logit + 3.0
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = 0.5 * torch.randn(H * K, generator=gen)
    s0 = torch.randn(n_states, H, K, V, generator=gen)
    return dict(q=q.to(DEV, dtype), k=k.to(DEV, dtype), v=v.to(DEV, dtype), z=z.to(DEV), beta_logit=beta_logit.to(DEV),
                A_log=A_log.to(DEV), dt_bias=dt_bias.to(DEV), s0=s0.to(DEV))


def _reference(x, s0, cu, *, gate, g_min=-5.0, silu=False, l2=True):
    """fp32 prep + token recurrence per document; ``cu``: list of offsets (None: one per batch row);
    ``x["beta"]`` if given, else ``sigmoid(x["beta_logit"])``."""
    q, k, v = (x[n].float() for n in ("q", "k", "v"))
    A_log, dt_bias = (x["A_log"], x["dt_bias"]) if gate == "bounded" else (None, None)
    qn, kn, g = kda_prep_torch(q, k, x["z"], A_log, dt_bias, gate=gate, g_min=g_min, silu_qk=silu,
                               l2norm_qk=l2)
    beta = x["beta"].float() if "beta" in x else x["beta_logit"].sigmoid()
    if cu is None:
        return naive_recurrent_kda(qn, kn, v, g, beta, initial_state=s0, output_final_state=True)
    outs, states = [], []
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        h0 = s0[n:n + 1] if s0 is not None else None
        o, S = naive_recurrent_kda(qn[:, a:b], kn[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0,
                                   output_final_state=True)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), torch.cat(states, 0)


def _run(x, s0, cu, *, gate, g_min=-5.0, silu=False, l2=True, beta_sigmoid=True, **kw):
    """The op on ``x``; ``beta_sigmoid``: it gets the logits and applies the sigmoid itself (not
    when ``x["beta"]`` is given: that is passed as is)."""
    gate_kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"]) if gate == "bounded" else {}
    if "beta" in x:
        beta, beta_sigmoid = x["beta"], False
    else:
        beta = x["beta_logit"] if beta_sigmoid else x["beta_logit"].sigmoid()
    return kda_infer(x["q"], x["k"], x["v"], x["z"], beta, initial_state=s0, gate=gate, g_min=g_min,
                     silu_qk=silu, l2norm_qk=l2, beta_sigmoid=beta_sigmoid,
                     cu_seqlens=torch.tensor(cu, device=DEV) if cu is not None else None, **gate_kw, **kw)


def _check(ref, out, dtype):
    (o_r, S_r), (o_t, S_t) = ref, out
    assert o_t.dtype == dtype and S_t.dtype == torch.float32
    assert_close(o_r, o_t.float(), TOL[dtype], "o")
    assert_close(S_r, S_t, TOL[dtype], "final state")


# (B, T, H, K, V, dtype, initial state, SiLU, hard): T = 1; T not a multiple of 16 with K != V;
# non-power-of-two head dims; K = 128 (the real head dim); fp16; correlated keys (see _inputs)
CASES = [
    (1, 1, 1, 16, 16, torch.float32, True, False, False),
    (2, 37, 2, 32, 16, torch.float32, True, True, False),
    (1, 70, 1, 20, 40, torch.float32, False, False, False),
    (1, 40, 1, 128, 32, torch.float32, True, False, False),
    (2, 37, 2, 32, 16, torch.float16, True, True, False),
    (1, 48, 2, 32, 32, torch.float32, True, False, True),
    (1, 48, 2, 32, 32, torch.float16, False, False, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}K{c[3]}V{c[4]}-{str(c[5])[6:]}"
                         f"-h0{int(c[6])}-silu{int(c[7])}{'-hard' if c[8] else ''}")
def test_bounded_gate_matches_reference(case):
    B, T, H, K, V, dtype, h0, silu, hard = case
    x = _inputs(B, T, H, K, V, dtype, seed=T * 31 + K + V, n_states=B, hard=hard)
    s0 = x["s0"] if h0 else None
    _check(_reference(x, s0, None, gate="bounded", silu=silu),
           _run(x, s0, None, gate="bounded", silu=silu), dtype)


@pytest.mark.parametrize("bv", [32, 64], ids=["BV32", "BV64"])
def test_state_split_in_v_blocks(bv, monkeypatch):
    """The recurrence's V-blocks at other widths than the interpreter's 16 (the GPU takes 16, 32 or 64):
    each owns BV columns of the state, so the split must not change o or the final state."""
    monkeypatch.setattr(infer_plan, "_INTERP_BV", bv)
    x = _inputs(2, 37, 2, 32, 64, torch.float32, seed=13, n_states=2)
    _check(_reference(x, x["s0"], None, gate="bounded"), _run(x, x["s0"], None, gate="bounded"), torch.float32)


# document lengths 5, 16, 0 (empty), 27, 1, 1: chunk tails, a whole chunk, an empty document
PACKED = [0, 5, 21, 21, 48, 49, 50]


@pytest.mark.parametrize("case", [(3, 37, 20, None), (1, PACKED[-1], 32, PACKED)], ids=["fixed", "packed"])
def test_intra_writes_every_slot_in_use_and_no_other(case):
    """The intra kernel writes every row of every chunk slot in use (all of K padded, in every intermediate),
    and nothing else: packed, its grid is the bound ``cdiv(T, 16) + N`` slots, and the slots past the
    ``coff[N]`` in use must leave the buffers as they were (they start from a sentinel here). Fixed length
    (B3 T37: 3 slots per row, K = 20 padded to 32) uses every slot."""
    B, T, K, cu = case
    x = _inputs(B, T, 2, K, 16, torch.float32, seed=T + K, n_states=1)
    plan = infer_plan.InferPlan(x["q"], x["k"], x["v"], x["z"], x["beta_logit"], gate="bounded", A_log=x["A_log"],
                                dt_bias=x["dt_bias"], l2norm_qk=True, silu_qk=True, beta_sigmoid=True,
                                cu_seqlens=torch.tensor(cu, device=DEV) if cu is not None else None)
    C, H, NS = infer_plan.CHUNK, 2, plan.NS
    used = int(plan.coff[-1]) if cu is not None else NS
    assert (used, NS) == ((6, 10) if cu is not None else (9, 9))
    bufs = dict(w=plan.w, ab=plan.ab, qg=plan.qg, kd=plan.kd, Aqk=plan.Aqk)
    for t in (*bufs.values(), plan.gl):
        t.fill_(123.0)
    plan.intra()
    for name, t in bufs.items():  # [H, slots * C, width]
        assert not (t[:, :used * C] == 123.0).any(), f"{name}: a row of a slot in use was not written"
        assert (t[:, used * C:] == 123.0).all(), f"{name}: a spare slot was written"
    gl = plan.gl[:-1].view(H, NS, -1)  # [H * slots + 1, Kp]: the last row is the recurrence's read-ahead pad
    assert not (gl[:, :used] == 123.0).any() and (gl[:, used:] == 123.0).all() and (plan.gl[-1] == 123.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_packed_documents(dtype):
    x = _inputs(1, PACKED[-1], 2, 32, 32, dtype, seed=7, n_states=len(PACKED) - 1)
    ref = _reference(x, x["s0"], PACKED, gate="bounded")
    out = _run(x, x["s0"], PACKED, gate="bounded")
    _check(ref, out, dtype)
    # each document on its own through the same op: packing must not leak state across documents
    for n in range(len(PACKED) - 1):
        a, b = PACKED[n], PACKED[n + 1]
        if a == b:
            assert torch.equal(out[1][n], x["s0"][n]), "an empty document must pass its initial state through"
            continue
        one = {key: (t[:, a:b] if key in ("q", "k", "v", "z", "beta_logit") else t) for key, t in x.items()}
        o, S = _run(one, x["s0"][n:n + 1], None, gate="bounded")
        assert_close(o.float(), out[0][:, a:b].float(), TOL[dtype], f"o of document {n}")
        assert_close(S, out[1][n:n + 1], TOL[dtype], f"state of document {n}")


@pytest.mark.parametrize("seg", [0, 1], ids=["plain", "segmented"])
def test_packed_zero_state_int64_offsets_no_final_state(seg):
    cu = [0, 17, 33, 34]
    x = _inputs(1, cu[-1], 1, 16, 16, torch.float32, seed=3, n_states=len(cu) - 1)
    o, S = _run(x, None, cu, gate="bounded", output_final_state=False, segment_chunks=seg)
    assert S is None
    assert_close(_reference(x, None, cu, gate="bounded")[0], o, TOL[torch.float32], "o")


@pytest.mark.parametrize("fill", ["floor", "floor_or_zero"])
def test_decay_at_the_bound(fill):
    """g exactly at the lowest allowed bound (every channel, or mixed with g = 0): the factored
    16-token scores reach their largest exponents and must stay finite and exact."""
    lb = max_safe_g_min("fp32", 16)
    x = _inputs(1, 48, 2, 32, 32, torch.float32, seed=11, n_states=1)
    g = torch.full_like(x["z"], lb)
    if fill == "floor_or_zero":
        g = torch.where(torch.rand(g.shape, generator=torch.Generator().manual_seed(0)).to(DEV) < 0.5, g, 0.0)
    x["z"] = g
    _check(_reference(x, x["s0"], None, gate="none", g_min=lb, l2=True),
           _run(x, x["s0"], None, gate="none", g_min=lb, l2=True), torch.float32)


# Segmented recurrence (kda_infer(segment_chunks=L)): segments of L chunks run in parallel, joined by
# their state transitions. (B, T, H, K, V, initial state, L, cu_seqlens): T = 103 is 7 chunks, cut
# into 3 (L = 3) or 4 (L = 2) segments with a short last one; K = 20, V = 40: padded K identity
# columns; packed lengths 5, 65, 0, 30, 33, 1: a document shorter than a segment, an empty one, and
# (L = 2) 9 segments within a bound of 14, so the bound's spare empty segments run too.
SEG_PACKED = [0, 5, 70, 70, 100, 133, 134]
SEG_CASES = [
    (2, 103, 2, 32, 16, True, 3, None),
    (2, 103, 2, 32, 16, True, 2, None),
    (1, 100, 1, 20, 40, False, 2, None),
    (1, SEG_PACKED[-1], 2, 32, 16, True, 2, SEG_PACKED),
    (1, SEG_PACKED[-1], 2, 16, 32, False, 3, SEG_PACKED),
]


@pytest.mark.parametrize("case", SEG_CASES, ids=lambda c: f"B{c[0]}T{c[1]}K{c[3]}V{c[4]}-h0{int(c[5])}-L{c[6]}"
                         f"{'-packed' if c[7] else ''}")
def test_segmented_matches_plain_and_reference(case):
    """Segmented and plain recurrence agree to fp32 rounding (o and final state), and both match the
    fp32 token recurrence. The decay is weak (g in [-0.02, 0], given directly) so that the state
    carries across segment boundaries and a wrong join shows: checked by the initial state's share
    of the reference output."""
    B, T, H, K, V, h0, L, cu = case
    x = _inputs(B, T, H, K, V, torch.float32, seed=T + K + L, n_states=B if cu is None else len(cu) - 1)
    x["z"] = -0.02 * torch.rand(x["z"].shape, generator=torch.Generator().manual_seed(L)).to(DEV)
    s0 = x["s0"] if h0 else None
    ref = _reference(x, s0, cu, gate="none")
    if h0:
        assert rel_err(ref[0], _reference(x, None, cu, gate="none")[0]) > 0.1, "the initial state must matter"
    plain = _run(x, s0, cu, gate="none", segment_chunks=0)
    seg = _run(x, s0, cu, gate="none", segment_chunks=L)
    _check(ref, plain, torch.float32)
    _check(ref, seg, torch.float32)
    assert_close(plain[0], seg[0], 1e-5, "o, segmented vs plain")
    assert_close(plain[1], seg[1], 1e-5, "final state, segmented vs plain")


def test_segment_plan_counts():
    """The segments the plan records: per document max(1, cdiv(chunks, L)), within the grid's bound."""
    x = _inputs(1, SEG_PACKED[-1], 1, 16, 16, torch.float32, seed=0, n_states=1)
    args = (x["q"], x["k"], x["v"], x["z"], x["beta_logit"].sigmoid())
    plan = infer_plan.InferPlan(*args, gate="bounded", A_log=x["A_log"], segment_chunks=2,
                                  cu_seqlens=torch.tensor(SEG_PACKED, device=DEV))
    path = plan.path()
    assert path["segmented"] and path["segment_chunks"] == 2 and path["segments"] == [1, 3, 1, 1, 2, 1]
    assert plan.nseg >= sum(path["segments"])
    plan = infer_plan.InferPlan(*args, gate="bounded", A_log=x["A_log"], segment_chunks=0)
    assert plan.path()["segmented"] is False


@pytest.mark.parametrize("B,T,L", [(1, 103, 3), (3, 100, 2), (2, 16, 4)])
def test_fixed_length_segments_cached_equal_packed_rule(B, T, L):
    """Fixed length, the segment offsets come from a per-shape cache (host time): they equal the packed
    rule's on the same rows as documents, and a second plan of that shape reuses them."""
    x = _inputs(B, T, 1, 16, 16, torch.float32, seed=1, n_states=B)
    args = (x["q"], x["k"], x["v"], x["z"], x["beta_logit"].sigmoid())
    plan = infer_plan.InferPlan(*args, gate="bounded", A_log=x["A_log"], segment_chunks=L)
    cached = plan._segments()
    cu, coff = plan._docs()
    for got, want in zip(cached, infer_plan._segment_offsets(cu, coff, L, plan.nseg)):
        assert torch.equal(got, want)
    again = infer_plan.InferPlan(*args, gate="bounded", A_log=x["A_log"], segment_chunks=L)._segments()
    assert all(a is b for a, b in zip(cached, again))


def test_segment_rule_at_the_measured_shapes():
    """choose_segment_chunks on 132 SMs (H200) at the benchmark shapes, as the H200 segment-length sweeps
    found them fastest: B1 T32768 H16 in 256-chunk segments; B1 T8192 H64 and the other shapes, fixed and
    packed (6 documents per row), plain."""
    pick = infer_plan.choose_segment_chunks
    assert pick(1, 16, 2048, 128, 128, 132) == 256
    for seqs, H, chunks in [(1, 64, 512), (1, 96, 512), (8, 16, 256), (6, 16, 2048 // 6), (6, 64, 512 // 6),
                            (6, 96, 512 // 6), (48, 16, 256 // 6)]:
        assert pick(seqs, H, chunks, 128, 128, 132) == 0, (seqs, H, chunks)


def test_segment_rule_follows_programs_per_sm():
    """The rule in programs per SM: segmenting pays only where the plain launch holds well under
    ``V / (K + 2V)`` of saturation (SAT_COLS_PER_SM columns, 3 programs of 32 columns, per SM) and the
    sequences are long enough for at least two segments of SEG_MIN_LEN chunks; the same grid on twice
    the SMs is further from saturation, on half of them nearer."""
    pick, sat = infer_plan.choose_segment_chunks, infer_plan.SAT_COLS_PER_SM
    # 16 heads at K = V = 128: 2048 columns; saturation at 96 per SM
    assert pick(1, 16, 2048, 128, 128, 132) > 0  # 15.5 columns per SM
    assert pick(1, 16, 2048, 128, 128, 264) > 0
    assert pick(1, 16, 2048, 128, 128, 2048 * 3 // sat) == 0  # exactly at V / (K + 2V) of saturation
    assert pick(1, 16, 2 * infer_plan.SEG_MIN_LEN - 1, 128, 128, 132) == 0  # no room for two segments
    # longer sequences never go back to plain, and the segments stay at least SEG_MIN_LEN long
    lens = [pick(1, 16, n, 128, 128, 132) for n in (512, 1024, 2048, 4096, 8192)]
    assert all(L >= infer_plan.SEG_MIN_LEN for L in lens), lens
    # the model: chain steps below saturation, columns / saturation times the chain well above it
    cost = infer_plan.recur_cost
    assert cost(sat, 100, 1) == pytest.approx(100 * 2 ** (1 / 3))
    assert cost(1, 100, 1) == pytest.approx(100, rel=1e-4) and cost(10 * sat, 100, 1) == pytest.approx(1000, rel=1e-3)


def test_recurrence_launch_follows_programs_per_sm():
    """pick_recur on 132 SMs at the benchmark launches: 64-wide blocks at 4 warps, capped at 168 registers,
    once the launch holds at least 96 columns per SM (B8 T4096 H16: 124, the segmented B1 T32768 H16: 140
    and more), 32-wide at 2 warps, uncapped, below (B1 T8192 H64 / H96, plain B1 T32768 H16); blocks never
    wider than the state."""
    pick = infer_plan.pick_recur
    for cols, bv in [(64 * 128, 32), (96 * 128, 32), (16 * 128, 32), (128 * 128, 64), (9 * 16 * 128, 64),
                     (16 * 16 * 256, 64)]:
        assert pick(cols, 128, 132)[0] == bv, (cols, pick(cols, 128, 132))
    assert pick(128 * 128, 128, 132) == (64, 4, 3, 168) and pick(64 * 128, 128, 132) == (32, 2, 3, 0)
    assert pick(10**6, 32, 132)[0] == 32 and pick(10**6, 16, 132) == (16, 1, 3, 0)


def test_fp16_inverse_storage(monkeypatch):
    """The bf16 path stores ``Ab = (I + L)^-1 Diag(beta)`` in fp16 (``_ab_dtype``; the interpreter gets bf16
    inputs wrong, so forced here on fp32 inputs): within fp16 rounding of the reference on correlated keys,
    whose inverse has the largest entries."""
    monkeypatch.setattr(infer_plan, "_ab_dtype", lambda dtype, l2norm_qk: torch.float16)
    x = _inputs(1, 48, 2, 32, 32, torch.float32, seed=9, n_states=1, hard=True)
    plan = infer_plan.InferPlan(x["q"], x["k"], x["v"], x["z"], x["beta_logit"], gate="bounded", A_log=x["A_log"],
                                dt_bias=x["dt_bias"], l2norm_qk=True, beta_sigmoid=True, initial_state=x["s0"])
    assert plan.ab.dtype == torch.float16
    plan.run()
    ref = _reference(x, x["s0"], None, gate="bounded")
    assert_close(ref[0], plan.o, 2e-3, "o")
    assert_close(ref[1], plan.hT, 2e-3, "final state")


def test_inverse_dtype_rule():
    """fp16 only where its range is guaranteed (L2-normalized keys) and the work dtype is bf16 anyway."""
    f = infer_plan._ab_dtype
    assert f(torch.bfloat16, True) == torch.float16
    assert f(torch.bfloat16, False) == f(torch.float16, True) == f(torch.float32, True) == torch.float32


# longest first: packed documents of 1, 2, 0, 2, 1, 1 chunks (ties and an empty one), on the plain and the
# segmented recurrence (the segments become the documents ordered).
@pytest.mark.parametrize("case", [(PACKED, 0), (SEG_PACKED, 3)], ids=["plain", "segmented"])
def test_longest_first_equals_document_order_bit_for_bit(case, monkeypatch):
    """The recurrence's programs taking the packed documents longest first give the same o and final states
    as document order bit for bit: every program computes what it computed in document order, only its place
    in the launch changes; and the kernel does follow the order it is given (one that sends every program to
    document 0 leaves the other documents' outputs unwritten: o starts as NaN there and stays so)."""
    cu, seg = case
    x = _inputs(1, cu[-1], 2, 32, 16, torch.float32, seed=len(cu) + seg, n_states=len(cu) - 1)
    ordered = _run(x, x["s0"], cu, gate="bounded", segment_chunks=seg)
    assert_close(_reference(x, x["s0"], cu, gate="bounded")[0], ordered[0], TOL[torch.float32], "o")
    with monkeypatch.context() as m:
        m.setattr(infer_plan.InferPlan, "_order", lambda self, chunks: None)  # document order, no ORDER launch
        plain = _run(x, x["s0"], cu, gate="bounded", segment_chunks=seg)
    assert torch.equal(ordered[0], plain[0]) and torch.equal(ordered[1], plain[1])
    real = infer_plan._longest_first
    monkeypatch.setattr(infer_plan, "_longest_first", lambda chunks: torch.zeros_like(real(chunks)))
    plan = infer_plan.InferPlan(x["q"], x["k"], x["v"], x["z"], x["beta_logit"], initial_state=x["s0"],
                                A_log=x["A_log"], dt_bias=x["dt_bias"], l2norm_qk=True, beta_sigmoid=True,
                                cu_seqlens=torch.tensor(cu, device=DEV), gate="bounded", segment_chunks=seg)
    plan.o.fill_(float("nan"))  # torch.empty could hold an earlier run's o, written or not
    plan.run()
    assert plan.o[:, :cu[1]].isfinite().all() and plan.o[:, cu[1]:].isnan().any(), \
        "the recurrence ignored its program order"


@pytest.mark.parametrize("cu", [[0, 5, 21, 21, 37, 40, 77], [0, 16, 32, 33, 48, 48, 64, 80, 81]],
                         ids=["uneven", "aligned"])
def test_packed_whole_and_partial_chunks(cu):
    """Packed, a chunk whose 16 rows all lie in its document loads in a branch of its own (one mask for all
    rows), a document's last chunk with the rows past its end masked: with empty documents, documents shorter
    than a chunk and ends on and off chunk boundaries, both within the fp32 reference's tolerance."""
    x = _inputs(1, cu[-1], 2, 32, 16, torch.float32, seed=len(cu), n_states=len(cu) - 1)
    o, S = _run(x, x["s0"], cu, gate="bounded")
    ref_o, ref_S = _reference(x, x["s0"], cu, gate="bounded")
    assert_close(ref_o, o, TOL[torch.float32], "o")
    assert_close(ref_S, S, TOL[torch.float32], "final state")


def test_longest_first_order():
    """Document indices by chunk count, longest first, ties (and empty documents) in index order."""
    chunks = torch.tensor([1, 2, 0, 2, 1, 1])
    assert infer_plan._longest_first(chunks).tolist() == [1, 3, 0, 4, 5, 2]


def test_dispatcher_constants_match_the_op():
    """``moelab.ops.kda`` keeps the chunk and its g_min floor without importing Triton: they must be the op's."""
    assert INFER_CHUNK == infer_plan.CHUNK == 16
    assert INFER_G_MIN_FLOOR == max_safe_g_min("fp32", infer_plan.CHUNK)


def test_no_autograd_graph():
    x = _inputs(1, 20, 1, 16, 16, torch.float32, seed=5, n_states=1)
    x["q"].requires_grad_()
    o, S = _run(x, x["s0"], None, gate="bounded")
    assert not o.requires_grad and not S.requires_grad


def _err(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()


def test_bad_inputs_name_the_value():
    x = _inputs(1, 20, 1, 16, 16, torch.float32, seed=1, n_states=1)
    q, k, v, z, beta = x["q"], x["k"], x["v"], x["z"], x["beta_logit"].sigmoid()
    A = dict(A_log=x["A_log"])
    _err(lambda: kda_infer(q, k, v, z, beta, gate="softplus", **A), "gate='softplus'.*no lower bound")
    _err(lambda: kda_infer(q, k, v, z, beta, gate="bounded", g_min=-6.0, **A), r"g_min=-6.0.*-5.545")
    _err(lambda: kda_infer(q, k, v, z, beta, gate="bounded"), r"needs A_log of shape \[H\] = \(1,\)")
    _err(lambda: kda_infer(q, k, v, z.abs(), beta), r"g must be a log decay in \[g_min, 0\].*max\(g\)")
    _err(lambda: kda_infer(q, k, v, -z.abs() * 9, beta), r"min\(g\)")
    _err(lambda: kda_infer(q, k, v, z, beta, gate="bounded", initial_state=x["s0"][:, :, :8], **A),
         r"initial_state must be \[N, H, K, V\] = \(1, 1, 16, 16\)")
    cu = torch.tensor([0, 5, 19], device=DEV)
    _err(lambda: kda_infer(q, k, v, z, beta, gate="bounded", cu_seqlens=cu, **A), r"end at T = 20, got \[0, 5, 19\]")
    _err(lambda: kda_infer(q, k, v, z, beta, gate="bounded", cu_seqlens=cu.float(), **A), "int32/int64")
    two = [t.expand(2, *t.shape[1:]) for t in (q, k, v, z, beta)]
    _err(lambda: kda_infer(*two, gate="bounded", cu_seqlens=cu, **A), "expected B = 1, got B = 2")
    for bad in (-1, 2.0, True):
        _err(lambda bad=bad: kda_infer(q, k, v, z, beta, gate="bounded", segment_chunks=bad, **A),
             f"segment_chunks={bad!r} is not allowed")


# GPU: bf16 at D = 128. The launch configs the op picks at the benchmark shapes (pick_recur: 32-wide blocks
# below saturation, 64-wide above) run with ``-m gpu``; the rest of LAUNCH["recur"] (16-wide: only for V <= 16)
# are marked slow, not gpu, so that ``pytest -m gpu`` compiles few kernels on a fresh Triton cache.
_REP_RECUR = {32, 64}
_needs_cuda = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA device")
RECUR_PARAMS = [pytest.param(c, marks=pytest.mark.gpu if c[0] in _REP_RECUR else [pytest.mark.slow, _needs_cuda],
                             id="recur{}-{}-{}".format(*c)) for c in infer_plan.LAUNCH["recur"]]


def _gpu_inputs(packed):
    """bf16 inputs at D = 128 (fixed: B2 T1024 H16; packed: 6 documents of uneven length, one of 1 token),
    the same for both ops (zero dt_bias: fla's in-kernel gate has the same form), and their cu_seqlens (or
    None). H = 16 and T a multiple of 16, as in the benchmark, so that the kernels compiled here (Triton
    specializes integer arguments on divisibility by 16) and fla's autotuned ones are reused there."""
    B, T, H, D = (1, 3072, 16, 128) if packed else (2, 1024, 16, 128)
    cu = [0, 700, 1013, 1500, 1501, 2400, 3072] if packed else None
    x = _inputs(B, T, H, D, D, torch.bfloat16, seed=0, n_states=len(cu) - 1 if packed else B)
    x["dt_bias"] = torch.zeros_like(x["dt_bias"])
    x["z"] = x["z"].to(torch.bfloat16)
    x["beta"] = x["beta_logit"].sigmoid().to(torch.bfloat16)
    return x, cu


@functools.cache
def _gpu_reference(packed):
    """The fp32 reference on ``_gpu_inputs(packed)`` and fla ``chunk_kda``'s errors from it (None where fla
    is not importable): computed once per layout, since fla compiles and autotunes on its first call."""
    x, cu = _gpu_inputs(packed)
    ref = _reference(x, x["s0"], cu, gate="bounded")
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError:
        return ref, None
    with torch.no_grad():
        fo, fS = fla_chunk_kda(x["q"], x["k"], x["v"], x["z"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                               use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, safe_gate=True,
                               lower_bound=-5.0, initial_state=x["s0"], output_final_state=True,
                               cu_seqlens=torch.tensor(cu, device=DEV) if packed else None)
    return ref, (rel_err(ref[0], fo.float()), rel_err(ref[1], fS.float()))


def _check_gpu(packed, out):
    """bf16 result ``out`` within the training op's 5e-3 of the fp32 recurrence and at most twice fla's error."""
    (ref_o, ref_S), fla = _gpu_reference(packed)
    err_o, err_S = rel_err(ref_o, out[0].float()), rel_err(ref_S, out[1])
    print(f"moelab o {err_o:.2e} S {err_S:.2e}; fla {fla}")
    assert err_o <= TOL[torch.bfloat16] and err_S <= TOL[torch.bfloat16], (err_o, err_S)
    if fla is not None:
        assert err_o <= 2 * fla[0] and err_S <= 2 * fla[1], (err_o, err_S, fla)


@pytest.mark.parametrize("seg", [0, 8], ids=["plain", "segmented"])
@pytest.mark.parametrize("recur", RECUR_PARAMS)
@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_bf16_real_size_vs_reference_and_fla(packed, recur, seg, monkeypatch):
    """bf16 at D = 128, a recurrence launch config the op may pick, plain and segmented (8-chunk segments,
    every phase at that config): error vs the fp32 recurrence within the training op's 5e-3, and (where
    fla is importable) at most twice fla's ``chunk_kda`` error on the same inputs."""
    monkeypatch.setitem(infer_plan.LAUNCH, "recur", (recur,))
    x, cu = _gpu_inputs(packed)
    _check_gpu(packed, _run(x, x["s0"], cu, gate="bounded", segment_chunks=seg))


@pytest.mark.gpu
@pytest.mark.parametrize("seg", [0, 8], ids=["plain", "segmented"])
def test_bf16_recur_register_cap_changes_nothing(seg, monkeypatch):
    """The register cap of the 4-warp recurrence launch (``LAUNCH["recur"]``'s maxnreg, 168) changes register
    allocation and spills, never the arithmetic: o and the final state equal the uncapped run's bit for bit,
    packed, plain and segmented, at that cap and at one that spills more (128). The recurrence runs at 64/4/3
    whatever these shapes would pick."""
    x, cu = _gpu_inputs(True)
    runs = {}
    for cap in (0, 168, 128):
        monkeypatch.setitem(infer_plan.LAUNCH, "recur", ((64, 4, 3, 0, cap),))
        runs[cap] = _run(x, x["s0"], cu, gate="bounded", segment_chunks=seg)
    for cap in (168, 128):
        assert torch.equal(runs[0][0], runs[cap][0]) and torch.equal(runs[0][1], runs[cap][1]), cap
