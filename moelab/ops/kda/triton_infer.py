"""KDA inference forward in Triton: chunk 16, two kernels, no autograd graph.

Same semantics as ``naive_recurrent_kda`` (moelab/ops/kda/naive.py), per document and head::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

with the op's input prep inside (optional SiLU and L2 norm of q and k, the bounded gate
``g = g_min * sigmoid(exp(A_log_h) (z + dt_bias))``, optional sigmoid of beta), an initial
state in, the final state out, and packed documents (``cu_seqlens``: the state restarts at each
document boundary). Used where no gradient is needed (prefill, evaluation); the training op is
``triton_chunk.chunk_kda``.

Why chunk 16: the training op's 64-token chunks need ``(I + A)^-1`` over 64 rows, which costs a
blockwise solve and a merge, and gated scores that cannot be one product (``e^{G}`` over 64
tokens at g = -5 spans e^{-320}). Over 16 tokens a bounded gate keeps ``G`` (the chunk-local
cumsum of g) inside ``[16 g_min, 0]``, so with a fixed reference ``ref = 8 g_min``
the factors ``e^{G - ref}`` and ``e^{ref - G}`` both stay within ``e^{8 |g_min|}`` (e^{44.4}
at the floor ``max_safe_g_min("fp32", 16)``): each score matrix is one ``[16, K] x [K, 16]``
product, and the 16x16 inverse takes 8 small products (below). All of that is per chunk and
independent of the state, so it runs token-parallel; only the state recurrence is sequential.

Kernels (bases of exponentials are 2: G is kept in log2 units, ``exp2(G)`` is ``e^{G ln 2}``):

* ``_kda_infer_intra``, grid ``[chunks, H]`` (token-parallel): loads the raw q, k, z, v, beta
  of one 16-token chunk and one head (all five reads issued before any math, so their latencies
  overlap); SiLU / L2 norm, gate, ``G``;
  ``A_qk = scale lower(sum_d q_id k_jd e^{G_id - G_jd})``,
  ``L = strict_lower(beta_i sum_d k_id k_jd e^{G_id - G_jd})``,
  ``Ai = (I + L)^-1`` by block doubling (4 levels of two small products instead of a 15-step
  substitution; see ``_unit_lower_inv``), then ``w = Ai (beta k e^G)``, ``u = Ai (beta v)``,
  ``qg = scale q e^G``, ``kd = k e^{G_last - G}``, ``gl = e^{G_last}``: everything the recurrence
  reads, so its loop carries no exp, cumsum or solve.
* ``_kda_infer_recur``, grid ``[docs * H * V-blocks]`` (head x V-block parallel, sequential over
  chunks): the state's V columns evolve independently given the K-side tiles, so each program
  owns ``BV`` of them (``LAUNCH`` picks BV so that the grid covers the GPU when there are few
  sequences and heads). It holds that slice transposed, ``hv = h^T`` ``[BV, K]``, fp32 in
  registers: ``U^T = u^T - hv w^T``, ``o^T = hv qg^T + U^T A_qk^T`` (written straight to the
  output), ``hv <- hv Diag(gl) + U^T kd``. Both quantities that the chunk loop carries from one
  product to the next (hv, U^T) are left operands, whose mma.sync layout is the accumulator's, so
  the chain from one chunk's state to the next's has no shared-memory round trip; the per-chunk
  tiles (w^T, qg^T, kd, A_qk^T) are right operands, copied to shared memory two chunks ahead by the
  software pipeline. Output and state in one pass: the chunk states are never stored (at chunk
  16 they would be ``K V / 16`` values per token).

Memory traffic and parallelism: kernels/README.md, "Inference forward".

Intermediates are stored head-major (``[H, slots * 16, Kp]``) so that the recurrence reads one
contiguous block per chunk. Documents are padded to whole chunks inside the kernels (masked
loads; padded rows have q = k = v = beta = 0 and g = 0, so they change nothing). Packed
documents get consecutive chunk slots; ``coff[n]`` is the first slot of document n, and the
intra kernel finds its document by a binary search in ``coff`` (no host sync: the grid is the
upper bound ``cdiv(T, 16) + N`` slots and programs past the last slot return at once).

Precision: fp32 inputs take exact fp32 products (``input_precision="ieee"``, the reference use);
bf16 inputs store the intermediates in bf16 and take bf16 operands in the recurrence's products
(the state stays fp32 between them), the intra kernel's products take fp32 (TF32) operands;
fp16 inputs keep fp32 intermediates and TF32 products.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import triton
import triton.language as tl

from moelab.ops.kda.bounds import max_safe_g_min
from moelab.ops.kda.gate import check_op_shapes
from moelab.ops.kda.triton_common import LOG2E, _cast, _dot
from moelab.ops.kda.triton_prep import _gate, _qk_fwd

CHUNK = 16  # tokens per chunk: the bound on |G - ref| (module docstring) is what allows 16
GATES = ("none", "bounded")
_GATE_ID = {"none": 0, "bounded": 1}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Launch configs on the GPU. The H200 sweep ``kernels/bench_kda.py --part infer --infer-sweep``
# times every candidate per kernel and shape and prints the fastest (the JSON records what ran,
# ``meta.launch``); the first sweep (kernels/results/history/kda_infer_sweep_h200_1aca9ee.json).
# intra: (num_warps, num_stages), all of K in one program: 2 warps was the fastest at all four
# shapes, 0.51 ms against 0.72 (4 warps) and 1.16 (8 warps) at B1 T8192 H64.
# recur: candidates (BV, num_warps, num_stages), widest V-block first; the op takes the first whose
# grid (sequences x heads x V-blocks) reaches the SM count, else the last: narrow V-blocks where
# there are few sequences and heads (B1 H16: 128 programs of one warp), wide ones where the grid is
# full anyway, since every V-block of a head reads the head's K-side tiles again (from L2).
# BV = 16 x num_warps: each warp owns 16 rows of the transposed state, so products chain in
# registers (``_kda_infer_recur``); wider per warp, the state and its bf16 copy spill (BV 64 at 2
# warps: 255 registers); 4 or more warps take warpgroup MMA at N = 16, the config class Triton 3.6
# miscompiled in the training op's state kernel (kernels/README.md, "Launch configs"), left to the
# sweep. Three stages: the pipeline then issues a chunk's copies two chunks ahead; with two it
# issues them at the end of the chunk before, so each chunk waited out a full memory latency.
LAUNCH: dict = {"intra": (2, 1), "recur": ((32, 2, 3), (16, 1, 3))}
_INTERP_BV = 16  # the interpreter: 16-wide V-blocks so that small test shapes take several


@contextlib.contextmanager
def launch_overrides(intra: tuple[int, int] | None = None, recur: tuple | None = None):
    """Run the op with ``LAUNCH["intra"]`` = ``(num_warps, num_stages)`` and/or ``LAUNCH["recur"]`` =
    ``((BV, num_warps, num_stages), ...)`` replaced, restored on exit (launch sweeps, A/B runs)."""
    saved = dict(LAUNCH)
    if intra is not None:
        if len(intra) != 2:
            raise ValueError(f"intra={intra!r} is not allowed: expected (num_warps, num_stages)")
        LAUNCH["intra"] = tuple(int(x) for x in intra)
    if recur is not None:
        if not recur or any(len(c) != 3 for c in recur):
            raise ValueError(f"recur={recur!r} is not allowed: expected ((BV, num_warps, num_stages), ...)")
        LAUNCH["recur"] = tuple(tuple(int(x) for x in c) for c in recur)
    try:
        yield
    finally:
        LAUNCH.clear()
        LAUNCH.update(saved)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _doc_of_slot(coff, i_s, N, LOG_N: tl.constexpr):
    """Document of chunk slot ``i_s``: the largest n in ``[0, N)`` with ``coff[n] <= i_s`` (the
    last of equal entries, so an empty document, which owns no slot, is skipped)."""
    lo = i_s * 0
    hi = lo + N - 1
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi + 1) // 2
        ok = tl.load(coff + mid) <= i_s
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _unit_lower_inv(L, IEEE: tl.constexpr, C: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[C, C]`` fp32 tile (C a power of two) by block doubling:
    with ``X`` the block-diagonal inverse at block size s, the inverse at 2s is ``X - X L_s X``,
    ``L_s`` = the entries of L in the lower-left s x s block of each 2s x 2s diagonal block
    (``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``). Every intermediate is a block
    of the true inverse, so rounding is not amplified; the Neumann product
    ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` (two products fewer) forms powers of L whose entries
    reach ~1e3 when keys are correlated and the decay is weak, and lost 1.7e-5 in fp32 on such
    inputs (tests/ops/test_kda_infer.py, ``hard``: final state) against 4.6e-7 of this form."""
    r = tl.arange(0, C)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for lvl in tl.static_range(C.bit_length() - 1):
        bi = r[:, None] >> lvl  # block index at size s = 2^lvl (no constexpr reassignment in the loop)
        bj = r[None, :] >> lvl
        sel = ((bi % 2) == 1) & (bj == bi - 1)
        X = X - _dot(_dot(X, tl.where(sel, L, 0.0), IEEE), X, IEEE)
    return X


@triton.jit
def _kda_infer_intra(
    q, k, v, z, beta, A_log, dt_bias, cu, coff,
    w, u, qg, kd, Aqk, gl,
    scale, g_min, mid, eps, T, NC, NS, N, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, C: tl.constexpr,
    LOG_N: tl.constexpr, VARLEN: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IEEE: tl.constexpr,
):
    """One chunk slot ``i_s`` of one head (see the module docstring). ``mid`` is the reference
    ``C/2 * g_min`` in log2 units; ``BK``, ``BVF`` are K, V padded to powers of two >= 16
    (the intermediates' widths)."""
    i_s = tl.program_id(0)
    i_h = tl.program_id(1)
    if VARLEN:
        if i_s >= tl.load(coff + N):
            return
        n = _doc_of_slot(coff, i_s, N, LOG_N)
        bos = tl.load(cu + n).to(tl.int64)
        eos = tl.load(cu + n + 1).to(tl.int64)
        c = i_s - tl.load(coff + n)
    else:
        n = i_s // NC
        c = i_s % NC
        bos = n.to(tl.int64) * T
        eos = bos + T
    t0 = bos + c * C  # first token of the chunk (int64: B*T*H*K may pass 2^31)
    r = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BVF)
    rm = r < eos - t0
    km = ck < K
    mk = rm[:, None] & km[None, :]
    src = t0 * H + i_h
    pk = r[:, None] * (H * K) + ck[None, :]

    # every load first, in the input dtype: the five reads are independent, and issued together
    # they wait out one memory latency instead of five in a row (the kernel is bound by memory)
    x = tl.load(z + src * K + pk, mask=mk, other=0.0)
    kr = tl.load(k + src * K + pk, mask=mk, other=0.0)
    qr = tl.load(q + src * K + pk, mask=mk, other=0.0)
    vr = tl.load(v + src * V + r[:, None] * (H * V) + cv[None, :], mask=rm[:, None] & (cv < V)[None, :], other=0.0)
    b = tl.load(beta + src + r * H, mask=rm, other=0.0).to(tl.float32)

    x = x.to(tl.float32)
    if GATE != 0:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if HAS_BIAS:
            x += tl.load(dt_bias + i_h * K + ck, mask=km, other=0.0).to(tl.float32)[None, :]
        x = _gate(x, a, g_min, GATE)
    # padded rows and channels: g = 0, so G stays flat there and G at the last row is G_last
    G = tl.cumsum(tl.where(mk, x, 0.0) * 1.4426950408889634, axis=0)
    Gl = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
    if BETA_SIGMOID:
        b = tl.where(rm, tl.sigmoid(b), 0.0)
    hs = (i_h * NS + i_s).to(tl.int64)  # the slot's row block in the head-major intermediates
    pw = r[:, None] * BK + ck[None, :]
    tl.store(gl + hs * BK + ck, tl.exp2(Gl))

    # |G - mid| <= C/2 |g_min| for g in [g_min, 0]: both factors stay finite, and
    # the entries above the diagonal (which may overflow) are dropped by selects, not products
    up = tl.exp2(G - mid)
    dn = tl.exp2(mid - G)
    kn = _qk_fwd(kr.to(tl.float32), eps, SILU, L2NORM)
    kdn = kn * dn
    # e^{G_last - G} = e^{G_last - mid} e^{mid - G}: one exp of a K-vector instead of a tile
    tl.store(kd + hs * (C * BK) + pw, (kdn * tl.exp2(Gl - mid)[None, :]).to(kd.dtype.element_ty))
    kT = tl.trans(_cast(kdn, False))
    sk = _dot(_cast(kn * up, False), kT, IEEE)
    Ai = _unit_lower_inv(tl.where(r[:, None] > r[None, :], sk * b[:, None], 0.0), IEEE, C)
    eG = tl.exp2(G)
    tl.store(w + hs * (C * BK) + pw, _dot(Ai, kn * b[:, None] * eG, IEEE).to(w.dtype.element_ty))

    qn = _qk_fwd(qr.to(tl.float32), eps, SILU, L2NORM)
    tl.store(qg + hs * (C * BK) + pw, (qn * eG * scale).to(qg.dtype.element_ty))
    sq = _dot(_cast(qn * up, False), kT, IEEE)
    tl.store(Aqk + hs * (C * C) + r[:, None] * C + r[None, :],
             tl.where(r[:, None] >= r[None, :], sq * scale, 0.0).to(Aqk.dtype.element_ty))
    tl.store(u + hs * (C * BVF) + r[:, None] * BVF + cv[None, :],
             _dot(Ai, vr.to(tl.float32) * b[:, None], IEEE).to(u.dtype.element_ty))


@triton.jit
def _kda_infer_recur(
    w, u, qg, kd, Aqk, gl, h0, o, hT, cu, coff,
    T, NC, NS, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Columns ``[i_v BV, (i_v + 1) BV)`` of the state of one document and head, over its chunks,
    held transposed (``hv = h^T``, ``[BV, K]``): ``U^T = u^T - hv w^T``,
    ``o^T = hv qg^T + U^T A_qk^T``, ``hv <- hv Diag(gl) + U^T kd``; initial state in, final out.

    Transposed, the state and ``U^T`` are the left operands of the products that read them, so
    a product's fp32 result becomes the next product's operand in registers (the accumulator
    and left-operand layouts of mma.sync match; a right operand needs a shared-memory round trip
    each chunk), and everything loaded per chunk is a right operand, which the software pipeline
    copies to shared memory ahead of use (``num_stages``)."""
    NV: tl.constexpr = BVF // BV
    pid = tl.program_id(0)
    i_v = pid % NV  # the V-blocks of one head are neighbours: they read the same K-side tiles
    i_nh = pid // NV
    n = i_nh // H
    i_h = i_nh % H
    if VARLEN:
        bos = tl.load(cu + n).to(tl.int64)
        eos = tl.load(cu + n + 1).to(tl.int64)
        s0 = tl.load(coff + n)
        nc = tl.load(coff + n + 1) - s0
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
        s0 = n * NC
        nc = NC
    r = tl.arange(0, C)
    dk = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    vm = cv < V
    hm = vm[:, None] & (dk < K)[None, :]
    ph = i_nh.to(tl.int64) * (K * V) + cv[:, None] + dk[None, :] * V
    if HAS_H0:
        h = tl.load(h0 + ph, mask=hm, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BV, BK], dtype=tl.float32)
    hs = (i_h * NS + s0).to(tl.int64)
    w += hs * (C * BK)
    qg += hs * (C * BK)
    kd += hs * (C * BK)
    u += hs * (C * BVF)
    Aqk += hs * (C * C)
    gl += hs * BK
    o += (bos * H + i_h) * V
    pkT = dk[:, None] + r[None, :] * BK  # [BK, C]: w^T and qg^T out of their [C, BK] chunk blocks
    pk = r[:, None] * BK + dk[None, :]
    paT = r[:, None] + r[None, :] * C  # A_qk^T: [j, i] <- A_qk[i, j]
    puT = cv[:, None] + r[None, :] * BVF
    po = cv[:, None] + r[None, :] * (H * V)
    left = eos - bos  # tokens of the document not yet written
    # the decay of the next chunk is loaded one chunk ahead by hand (gl has a spare slot at the
    # end): a vector operand of an element-wise product is not software-pipelined
    gn = tl.load(gl + dk)
    for _ in range(nc):
        gt = gn
        gn = tl.load(gl + BK + dk)
        wT = _cast(tl.load(w + pkT), DOT_BF16)
        qT = _cast(tl.load(qg + pkT), DOT_BF16)
        kt = _cast(tl.load(kd + pk), DOT_BF16)
        aT = _cast(tl.load(Aqk + paT), DOT_BF16)
        uT = tl.load(u + puT).to(tl.float32)
        hb = _cast(h, DOT_BF16)
        # layout changes go through shared memory behind a barrier: the decay's before the
        # chain of products, the output's after the state update, not between its two products
        h = h * gt[None, :]
        Ub = _cast(uT - _dot(hb, wT, IEEE), DOT_BF16)
        ot = _dot(hb, qT, IEEE)
        h += _dot(Ub, kt, IEEE)
        ot += _dot(Ub, aT, IEEE)
        tl.store(o + po, ot.to(o.dtype.element_ty), mask=vm[:, None] & (r < left)[None, :])
        w += C * BK
        qg += C * BK
        kd += C * BK
        u += C * BVF
        Aqk += C * C
        gl += BK
        o += C * H * V
        left -= C
    if STORE_HT:
        tl.store(hT + ph, h, mask=hm)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the intermediates (w, u, qg, kd, A_qk): bf16 for bf16 inputs, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _dot_bf16(dtype: torch.dtype) -> bool:
    """Whether the recurrence's product operands are bf16 (bf16 inputs) rather than fp32 / TF32."""
    return dtype == torch.bfloat16


def _ieee(dtype: torch.dtype) -> bool:
    """fp32 inputs: exact fp32 products everywhere (the reference use)."""
    return dtype == torch.float32


def _recur_launch(pairs: int, Vp: int, device: torch.device) -> tuple[int, int, int]:
    """(BV, num_warps, num_stages) of the recurrence for ``pairs`` = sequences x heads (see ``LAUNCH``)."""
    if _interpret():
        return min(_INTERP_BV, Vp), 1, 1
    cands = [c for c in LAUNCH["recur"] if c[0] <= Vp] or [(16, 1, 3)]
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return next((c for c in cands if pairs * (Vp // c[0]) >= sms), cands[-1])


def _check(q, k, v, g, beta, scale, initial_state, g_min, validate, gate, A_log, dt_bias, norm_eps,
           cu_seqlens) -> int:
    """Raise ValueError for anything outside what the kernels support; returns the number of
    sequences N (B, or the number of documents with ``cu_seqlens``)."""
    if gate not in GATES:
        hint = " (the softplus gate has no lower bound: use triton_chunk.chunk_kda with mode='general')" \
            if gate == "softplus" else ""
        raise ValueError(f"gate={gate!r} is not allowed: expected one of {GATES}{hint}")
    B, T, H, K, V = check_op_shapes(q, k, v, g, beta)
    if g.dtype not in _DTYPES or beta.dtype not in _DTYPES:
        raise ValueError(f"g and beta must be bf16/fp16/fp32, got {g.dtype}, {beta.dtype}")
    if any(t.device != q.device for t in (k, v, g, beta)):
        raise ValueError(f"q, k, v, g, beta must be on one device, got {[str(t.device) for t in (q, k, v, g, beta)]}")
    floor = max_safe_g_min("fp32", CHUNK)
    if not (math.isfinite(g_min) and floor <= g_min < 0):
        raise ValueError(f"g_min={g_min} is not allowed: expected {floor:.3f} <= g_min < 0 "
                         f"(|g_min| * {CHUNK} / 2 must stay inside the exp range of a {CHUNK}-token chunk)")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale={scale} is not allowed: expected a finite number or None")
    if not (norm_eps > 0 and math.isfinite(norm_eps)):
        raise ValueError(f"norm_eps={norm_eps} is not allowed: expected a finite value > 0")
    if gate == "none":
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log / dt_bias are only used with gate='bounded', got gate='none'")
    else:
        if A_log is None or A_log.shape != (H,) or A_log.dtype not in _DTYPES or A_log.device != q.device:
            got = None if A_log is None else (tuple(A_log.shape), A_log.dtype, str(A_log.device))
            raise ValueError(f"gate='bounded' needs A_log of shape [H] = ({H},), float, on {q.device}; got {got}")
        if dt_bias is not None and (dt_bias.numel() != H * K or dt_bias.dtype not in _DTYPES
                                    or dt_bias.device != q.device):
            raise ValueError(f"dt_bias must be None or hold H*K = {H * K} floats on {q.device}; got "
                             f"{(tuple(dt_bias.shape), dt_bias.dtype, str(dt_bias.device))}")
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of N + 1 >= 2 offsets, got "
                             f"{(tuple(cu_seqlens.shape), cu_seqlens.dtype)}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on {q.device}, got {cu_seqlens.device}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the documents are packed in one row: expected B = 1, got B = {B}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and (initial_state.shape != (N, H, K, V) or initial_state.dtype not in _DTYPES
                                      or initial_state.device != q.device):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)} float on {q.device} (N = "
                         f"{'documents' if cu_seqlens is not None else 'B'}), got "
                         f"{(tuple(initial_state.shape), initial_state.dtype, str(initial_state.device))}")
    if validate:  # one host sync each
        if cu_seqlens is not None:
            cu = cu_seqlens.tolist()
            if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T = {T}, got "
                                 f"{cu if len(cu) <= 16 else cu[:8] + ['...'] + cu[-8:]}")
        if gate == "none":
            gmin, gmax = (x.item() for x in torch.aminmax(g.detach().float()))
            if gmax > 0 or gmin < g_min:
                raise ValueError(f"g must be a log decay in [g_min, 0] = [{g_min}, 0], got "
                                 f"min(g)={gmin:.4g}, max(g)={gmax:.4g}")
    return N


@torch.compiler.disable  # a compiled model calls the op eagerly (its kernels launch themselves)
@torch.no_grad()
def kda_infer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    g_min: float = -5.0,
    validate: bool = True,
    gate: str = "none",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    l2norm_qk: bool = False,
    silu_qk: bool = False,
    beta_sigmoid: bool = False,
    norm_eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward for inference (no autograd graph: the outputs carry no gradient).

    Inputs as for ``triton_chunk.chunk_kda`` (bounded mode), plus ``beta_sigmoid`` and ``cu_seqlens``.

    Args:
        q: ``[B, T, H, K]`` queries (raw if ``silu_qk`` / ``l2norm_qk`` are set).
        k: ``[B, T, H, K]`` keys, same dtype as q.
        v: ``[B, T, H, V]`` values, same dtype as q; bf16, fp16 or fp32 (accumulation is fp32).
        g: ``[B, T, H, K]``: with ``gate="none"`` the per-channel log decay (natural log) in
            ``[g_min, 0]``; with ``gate="bounded"`` the gate's raw input ``z``, turned into
            ``g = g_min * sigmoid(exp(A_log_h) (z + dt_bias))`` inside the op.
        beta: ``[B, T, H]`` write strength in (0, 1), or its logit with ``beta_sigmoid``.
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` state before the first token of each sequence (N = B, or
            the number of documents with ``cu_seqlens``), any float dtype; None: zeros.
        output_final_state: also return the state after the last token of each sequence.
        g_min: the bound of g (the bounded gate's floor), in
            ``[max_safe_g_min("fp32", 16), 0)`` (about -5.55 to 0).
        validate: check ``cu_seqlens`` (0 first, non-decreasing, T last) and, with ``gate="none"``,
            ``g_min <= g <= 0`` (a host sync each); with ``validate=False`` out-of-range values
            give undefined results.
        gate: ``"none" | "bounded"`` (the softplus gate is unbounded: not supported here).
        A_log: ``[H]`` log of the gate's per-head rate (``gate="bounded"`` only).
        dt_bias: ``[H * K]`` (or ``[H, K]``) per-channel gate bias, or None.
        l2norm_qk: L2-normalize q and k per head inside the op, ``x / max(||x||, norm_eps)``,
            after ``silu_qk``.
        silu_qk: apply SiLU to q and k first.
        beta_sigmoid: ``beta`` holds logits; the op applies the sigmoid.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N documents packed in one row (B = 1):
            document n is tokens ``[cu_seqlens[n], cu_seqlens[n + 1])``, and the state restarts at
            each document (from ``initial_state[n]`` or zeros). Empty documents are allowed.

    Returns:
        ``o`` ``[B, T, H, V]`` in v's dtype and the final state ``[N, H, K, V]`` fp32 (or None).
    """
    p = InferPlan(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  g_min=g_min, validate=validate, gate=gate, A_log=A_log, dt_bias=dt_bias, l2norm_qk=l2norm_qk,
                  silu_qk=silu_qk, beta_sigmoid=beta_sigmoid, norm_eps=norm_eps, cu_seqlens=cu_seqlens)
    p.intra(*p.intra_launch())
    p.recur(*p.recur_launch())
    return p.o, p.hT


class InferPlan:
    """One call of ``kda_infer``: its checked inputs, intermediates and outputs, and its two launches.

    ``kda_infer`` runs ``intra`` then ``recur`` at the configs of ``LAUNCH``; the benchmark's launch
    sweep (kernels/bench_kda.py --infer-sweep) times the two kernels of one plan apart, at other
    configs. Arguments as for ``kda_infer``; ``o`` and ``hT`` hold the outputs once both have run.
    """

    def __init__(self, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True, g_min=-5.0,
                 validate=True, gate="none", A_log=None, dt_bias=None, l2norm_qk=False, silu_qk=False,
                 beta_sigmoid=False, norm_eps=1e-6, cu_seqlens=None):
        N = _check(q, k, v, g, beta, scale, initial_state, g_min, validate, gate, A_log, dt_bias, norm_eps,
                   cu_seqlens)
        B, T, H, K = q.shape
        V = v.shape[-1]
        C = CHUNK
        Kp = max(16, triton.next_power_of_2(K))
        Vp = max(16, triton.next_power_of_2(V))
        dev = q.device
        varlen = cu_seqlens is not None
        if varlen:
            cu = cu_seqlens.to(torch.int32)
            coff = torch.zeros(N + 1, device=dev, dtype=torch.int32)
            coff[1:] = torch.cumsum(torch.div(cu[1:] - cu[:-1] + (C - 1), C, rounding_mode="floor"), 0)
            NC = 0
            NS = triton.cdiv(T, C) + N  # >= sum_n cdiv(len_n, C), known without reading cu_seqlens
        else:
            cu = coff = torch.zeros(1, device=dev, dtype=torch.int32)
            NC = triton.cdiv(T, C)
            NS = B * NC
        wd = _work_dtype(q.dtype)
        self.w, self.qg, self.kd = (torch.empty(H, NS * C, Kp, device=dev, dtype=wd) for _ in range(3))
        self.u = torch.empty(H, NS * C, Vp, device=dev, dtype=wd)
        self.Aqk = torch.empty(H, NS * C, C, device=dev, dtype=wd)
        self.gl = torch.empty(H * NS + 1, Kp, device=dev, dtype=torch.float32)  # + 1: the recurrence reads ahead
        self.o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
        self.hT = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
        self.h0 = initial_state.contiguous() if initial_state is not None else None
        self.inputs = tuple(x.contiguous() for x in (q, k, v, g, beta))
        self.A_log, self.dt_bias, self.cu, self.coff = A_log, dt_bias, cu, coff
        self.scale = K**-0.5 if scale is None else float(scale)
        self.g_min, self.norm_eps, self.gate = float(g_min), float(norm_eps), gate
        self.flags = dict(SILU=bool(silu_qk), L2NORM=bool(l2norm_qk), BETA_SIGMOID=bool(beta_sigmoid))
        self.N, self.NC, self.NS, self.varlen, self.dims = N, NC, NS, varlen, (B, T, H, K, V, Kp, Vp)

    def intra_launch(self) -> tuple[int, int]:
        """(num_warps, num_stages) of the token-parallel kernel."""
        return (1, 1) if _interpret() else LAUNCH["intra"]

    def recur_launch(self) -> tuple[int, int, int]:
        """(BV, num_warps, num_stages) of the recurrence (see ``LAUNCH``)."""
        return _recur_launch(self.N * self.dims[2], self.dims[6], self.o.device)

    def intra(self, warps: int, stages: int) -> None:
        """The token-parallel kernel: w, u, qg, kd, A_qk, gl from the inputs."""
        B, T, H, K, V, Kp, Vp = self.dims
        dummy = self.gl
        _kda_infer_intra[(self.NS, H)](
            *self.inputs, self.A_log if self.A_log is not None else dummy,
            self.dt_bias if self.dt_bias is not None else dummy, self.cu, self.coff,
            self.w, self.u, self.qg, self.kd, self.Aqk, self.gl,
            self.scale, self.g_min, (CHUNK / 2) * self.g_min * LOG2E, self.norm_eps, T, self.NC, self.NS, self.N, H,
            K=K, V=V, BK=Kp, BVF=Vp, C=CHUNK, LOG_N=max(1, self.N.bit_length()), VARLEN=self.varlen,
            GATE=_GATE_ID[self.gate], HAS_BIAS=self.dt_bias is not None, IEEE=_ieee(self.inputs[0].dtype),
            **self.flags, num_warps=warps if Kp <= 128 else 2 * warps, num_stages=stages,
        )

    def recur(self, BV: int, warps: int, stages: int) -> None:
        """The recurrence over chunks (after ``intra``): o and the final state."""
        B, T, H, K, V, Kp, Vp = self.dims
        dtype = self.inputs[0].dtype
        dummy = self.gl
        _kda_infer_recur[(self.N * H * (Vp // BV),)](
            self.w, self.u, self.qg, self.kd, self.Aqk, self.gl, self.h0 if self.h0 is not None else dummy, self.o,
            self.hT if self.hT is not None else dummy, self.cu, self.coff,
            T, self.NC, self.NS, H,
            K=K, V=V, BK=Kp, BVF=Vp, BV=BV, C=CHUNK, VARLEN=self.varlen, HAS_H0=self.h0 is not None,
            STORE_HT=self.hT is not None, DOT_BF16=_dot_bf16(dtype), IEEE=_ieee(dtype), num_warps=warps,
            num_stages=stages,
        )
