"""KDA inference forward, the Triton kernels: chunk 16, no autograd graph (host side: infer_plan.py).

Per document and head, the gated delta rule of ``naive_recurrent_kda`` (naive.py)::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

with the op's prep inside: SiLU and L2 norm of q, k, the bounded gate ``g = g_min sigmoid(exp(A_log)
(z + dt_bias))``, the sigmoid of beta. Inputs are ``[B, T, H, D]``, or N documents packed in one row
(B = 1) at the offsets ``cu_seqlens [N + 1]``, the state restarting at each document.

Why chunk 16: a decay bounded by ``g_min`` keeps ``G``, the chunk-local cumsum of g, inside
``[16 g_min, 0]``, so around the fixed reference ``8 g_min`` both ``e^{G - ref}`` and ``e^{ref - G}``
stay below ``e^{8 |g_min|}``: finite in fp32 down to ``max_safe_g_min("fp32", 16)`` (about -5.55).
Each gated score matrix is then one ``[16, K] x [K, 16]`` product and ``(I + L)^-1`` one 16 x 16
inverse (``_unit_lower_inv``). Over the training op's 64-token chunks ``e^G`` spans ``e^{-320}`` at
g = -5: the scores take one product per 16-token sub-tile pair, the inverse a blockwise solve and a
merge. All of this is per chunk and independent of the state, so it runs token-parallel
(``_kda_infer_intra``); only the state recurrence is sequential (``_kda_infer_recur``; long
sequences in segments chained by ``_kda_infer_join``).

Precision: fp32 inputs take exact fp32 products (``input_precision="ieee"``, the reference use).
bf16 inputs store the intermediates in bf16 (``Ab`` in fp16 with L2-normalized keys: ``infer_plan._ab_dtype``) and the
recurrence takes bf16 operands, its state kept in fp32 between products; the intra kernel's
products take fp32 (TF32) operands. fp16 inputs keep fp32 intermediates and TF32 products. The
state, the chunk decays ``gl`` and the segment transitions are fp32 everywhere.

``G`` is kept in log2 units (times log2(e)), so ``exp2`` of a difference is the natural exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.ops.kda.triton_common import _cast, _dot
from moelab.ops.kda.triton_prep import _gate, _qk_fwd


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
def _load_zkq(z, k, q, off, mask):
    """The gate input, k and q tiles of one chunk at offsets ``off`` ``[C, BK]``, masked lanes 0."""
    return (tl.load(z + off, mask=mask, other=0.0), tl.load(k + off, mask=mask, other=0.0),
            tl.load(q + off, mask=mask, other=0.0))


@triton.jit
def _unit_lower_inv(L, IEEE: tl.constexpr, C: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[C, C]`` fp32 tile (C a power of two) by block doubling:
    with ``X`` the block-diagonal inverse at block size s, the inverse at 2s is ``X - X L_s X``,
    ``L_s`` = the entries of L in the lower-left s x s block of each 2s x 2s diagonal block
    (``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``): 4 levels of two small products
    at C = 16 instead of a 15-step substitution. Every intermediate is a block of the true inverse,
    so rounding is not amplified; the Neumann product ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` (two
    products fewer) forms powers of L whose entries reach ~1e3 when keys are correlated and the
    decay is weak, and loses fp32 accuracy on such inputs (tests/ops/test_kda_infer.py, ``hard``)."""
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
    q, k, z, beta, A_log, dt_bias, cu, coff,
    w, ab, qg, kd, Aqk, gl,
    scale, g_min, mid, eps, T, NC, NS, N, H,
    K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, LOG_N: tl.constexpr, VARLEN: tl.constexpr,
    GATE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, L2NORM: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, IEEE: tl.constexpr,
):
    """Chunk slot ``program_id(0)`` of head ``program_id(1)``, grid ``[slots, H]``: from the raw q, k, z,
    beta of one 16-token chunk (v is read by the recurrence), everything the recurrence reads, so that its
    loop carries no exp, cumsum or solve (``Ai = (I + L)^-1``, ``G_l`` = G at the chunk's last row)::

        A_qk = scale lower(sum_d q_id k_jd e^{G_id - G_jd})    L = strict_lower(beta_i sum_d k_id k_jd e^{G_id - G_jd})
        w = Ai (beta k e^G)    Ab = Ai Diag(beta)    qg = scale q e^G    kd = k e^{G_l - G}    gl = e^{G_l}

    Stored head-major, ``[H, slots * C, BK]`` (``[H, slots * C, C]`` for ``A_qk``, ``Ab``; ``gl``
    ``[H * slots + 1, BK]``), so that the recurrence reads one contiguous block per chunk. Storing
    ``Ab`` ``[C, C]`` instead of ``u = Ab v`` ``[C, V]`` spares this kernel the v read and the u write
    (the recurrence forms u from v, off its chain of products). ``mid`` is the reference
    ``C/2 * g_min`` in log2 units; ``BK`` is K padded to a power of two >= 16.

    Fixed-length rows: slot ``n NC + c`` is chunk c of row n. Packed documents (``VARLEN``) get
    consecutive slots, ``coff[n]`` the first of document n, found by a binary search (no host sync:
    the grid is the bound ``cdiv(T, C) + N``; slots past the last read and write nothing). Rows past
    a document's end load as q = k = beta = 0 and g = 0 and change nothing."""
    i_h = tl.program_id(1)
    r = tl.arange(0, C)
    ck = tl.arange(0, BK)
    km = ck < K
    pk = r[:, None] * (H * K) + ck[None, :]
    pw = r[:, None] * BK + ck[None, :]
    if VARLEN:
        last = tl.load(coff + N)  # slots in use
    else:
        last = NS
    if GATE != 0:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
    i_s = tl.program_id(0)
    # false past the slots in use (packed: the grid is their bound); fixed length, always true, but the masks
    # keep one form in both layouts: the fixed kernel's compiled schedule, as timed, depends on it
    live = i_s < last
    if VARLEN:
        n = _doc_of_slot(coff, i_s, N, LOG_N)
        t0 = tl.load(cu + n).to(tl.int64) + (i_s - tl.load(coff + n)).to(tl.int64) * C
        eos = tl.load(cu + n + 1).to(tl.int64)
    else:
        n = i_s // NC
        c = i_s % NC
        bos = n.to(tl.int64) * T
        eos = bos + T
        t0 = bos + c * C  # first token of the chunk (int64: B*T*H*K may pass 2^31)
    # a slot past the last reads no row and writes none (the interpreter cannot broadcast a scalar mask)
    rm = r < tl.where(live, eos - t0, 0)
    sm = r[:, None] < tl.where(live, C, 0)
    mk = rm[:, None] & km[None, :]
    src = t0 * H + i_h

    # every load first, in the input dtype: the reads are independent, and issued together they wait
    # out one memory latency instead of one each in a row (the kernel waits on memory latency)
    if VARLEN:
        # a chunk whose rows all lie in its document (all but a document's last) loads under one
        # mask for every row, in a branch of its own: the compiler's schedule of the row masks'
        # predicates is what separates packed from fixed-length speed (kernels/README.md)
        if eos - t0 >= C:
            x, kr, qr = _load_zkq(z, k, q, src * K + pk, (r < tl.where(live, C, 0))[:, None] & km[None, :])
        else:
            x, kr, qr = _load_zkq(z, k, q, src * K + pk, mk)
    else:
        x, kr, qr = _load_zkq(z, k, q, src * K + pk, mk)
    b = tl.load(beta + src + r * H, mask=rm, other=0.0).to(tl.float32)

    x = x.to(tl.float32)
    if GATE != 0:
        if HAS_BIAS:
            x += bias[None, :]
        x = _gate(x, a, g_min, GATE)
    # padded rows and channels: g = 0, so G stays flat there and G at the last row is G_l
    G = tl.cumsum(tl.where(mk, x, 0.0) * 1.4426950408889634, axis=0)
    Gl = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
    if BETA_SIGMOID:
        b = tl.where(rm, tl.sigmoid(b), 0.0)
    hs = (i_h * NS + i_s).to(tl.int64)  # the slot's row block in the head-major intermediates
    tl.store(gl + hs * BK + ck, tl.exp2(Gl), mask=ck < tl.where(live, BK, 0))

    # |G - mid| <= C/2 |g_min| for g in [g_min, 0]: both factors stay finite, and the entries above
    # the diagonal (which may overflow) are dropped by selects, not products. Only three [C, K] tiles
    # stay live after this block (k up, k down, q up): e^G = up 2^mid is a scalar multiple of up, so
    # neither G nor the normalised k and q outlive it (registers set how many programs share an SM)
    up = tl.exp2(G - mid)
    kn = _qk_fwd(kr.to(tl.float32), eps, SILU, L2NORM)
    kup = kn * up
    kdn = kn * tl.exp2(mid - G)
    qup = _qk_fwd(qr.to(tl.float32), eps, SILU, L2NORM) * up
    emid = tl.exp2(mid)
    # e^{G_l - G} = e^{G_l - mid} e^{mid - G}: one exp of a K-vector instead of a tile
    tl.store(kd + hs * (C * BK) + pw, (kdn * tl.exp2(Gl - mid)[None, :]).to(kd.dtype.element_ty), mask=sm)
    tl.store(qg + hs * (C * BK) + pw, (qup * (scale * emid)).to(qg.dtype.element_ty), mask=sm)
    kT = tl.trans(_cast(kdn, False))
    sk = _dot(_cast(kup, False), kT, IEEE)
    sq = _dot(_cast(qup, False), kT, IEEE)
    tl.store(Aqk + hs * (C * C) + r[:, None] * C + r[None, :],
             tl.where(r[:, None] >= r[None, :], sq * scale, 0.0).to(Aqk.dtype.element_ty), mask=sm)
    Ai = _unit_lower_inv(tl.where(r[:, None] > r[None, :], sk * b[:, None], 0.0), IEEE, C)
    tl.store(w + hs * (C * BK) + pw, _dot(Ai, kup * (b * emid)[:, None], IEEE).to(w.dtype.element_ty), mask=sm)
    # beta folded into the inverse's columns: the recurrence forms u = Ab v
    tl.store(ab + hs * (C * C) + r[:, None] * C + r[None, :], (Ai * b[None, :]).to(ab.dtype.element_ty), mask=sm)


@triton.jit
def _kda_infer_recur(
    w, v, ab, qg, kd, Aqk, gl, h0, o, hT, cu, coff, order,
    T, NC, NS, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr,
    IEEE: tl.constexpr, AUG: tl.constexpr, STORE_O: tl.constexpr, ORDER: tl.constexpr,
):
    """Columns ``[i_v BV, (i_v + 1) BV)`` of the state of one sequence (or document) and head, over its
    chunks, grid ``[sequences * H * V-blocks]``: the state's V columns evolve independently given the
    K-side tiles, so each program owns ``BV`` of them, held transposed in fp32 registers (``hv = h^T``,
    ``[BV, K]``)::

        u^T = v^T Ab^T    U^T = u^T - hv w^T    o^T = hv qg^T + U^T A_qk^T    hv <- hv Diag(gl) + U^T kd

    initial state in (``h0``), final state out (``hT``), output written straight to ``o``: the chunk
    states are never stored (at chunk 16 they would be ``K V / 16`` values per token). ``BVF``: V
    padded to a power of two >= 16.

    Transposed, the two quantities the loop carries from one product to the next (hv, U^T) are left
    operands, whose mma.sync layout is the accumulator's, so the chain from one chunk's state to the
    next's has no shared-memory round trip; everything loaded per chunk (w^T, qg^T, kd, A_qk^T) is a
    right operand, which the software pipeline copies to shared memory ahead of use (``num_stages``).
    u is formed from the raw v in fp32 (TF32) products, off that chain, and never rounded to bf16.

    ``AUG`` (phase 1 of the segmented recurrence, ``infer_plan.InferPlan``): the state gets ``K`` more
    columns in front, ``BK / BV`` V-blocks that start from the identity and read ``v = 0``, so the final
    state is ``[A | B]`` (``S_end = A S_start + B``), stored ``[K, K + V]`` per segment and head; no
    initial state. ``STORE_O`` false: no output, and none of the loads and products that only feed it.
    ``ORDER`` (``VARLEN``): the programs take the documents in the order ``order[0], order[1], ...``
    (longest first, ``infer_plan._longest_first``); what each program computes is unchanged."""
    NI: tl.constexpr = BK // BV if AUG else 0  # identity V-blocks
    NV: tl.constexpr = BVF // BV + NI
    VS: tl.constexpr = K + V if AUG else V  # columns of the stored final state
    pid = tl.program_id(0)
    i_v = pid % NV  # the V-blocks of one head are neighbours: they read the same K-side tiles
    i_nh = pid // NV
    n = i_nh // H
    i_h = i_nh % H
    if ORDER:
        n = tl.load(order + n)
        i_nh = n * H + i_h
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
    if AUG:
        ident = i_v < NI
        cv = tl.where(ident, i_v, i_v - NI) * BV + tl.arange(0, BV)  # the column among K, or among V
        vm = cv < tl.where(ident, K, V)
        col = cv + tl.where(ident, 0, K)  # the column of [A | B]
        h = tl.where((cv[:, None] == dk[None, :]) & vm[:, None] & ident, 1.0, 0.0)
    else:
        cv = i_v * BV + tl.arange(0, BV)
        vm = cv < V
        col = cv
    hm = vm[:, None] & (dk < K)[None, :]
    ph = i_nh.to(tl.int64) * (K * VS) + col[:, None] + dk[None, :] * VS
    if HAS_H0:
        h = tl.load(h0 + ph, mask=hm, other=0.0).to(tl.float32)
    elif not AUG:
        h = tl.zeros([BV, BK], dtype=tl.float32)
    hs = (i_h * NS + s0).to(tl.int64)
    w += hs * (C * BK)
    qg += hs * (C * BK)
    kd += hs * (C * BK)
    ab += hs * (C * C)
    Aqk += hs * (C * C)
    gl += hs * BK
    o += (bos * H + i_h) * V
    v += (bos * H + i_h) * V
    pkT = dk[:, None] + r[None, :] * BK  # [BK, C]: w^T and qg^T out of their [C, BK] chunk blocks
    pk = r[:, None] * BK + dk[None, :]
    paT = r[:, None] + r[None, :] * C  # A_qk^T: [j, i] <- A_qk[i, j]
    po = cv[:, None] + r[None, :] * (H * V)
    left = eos - bos  # tokens of the document not yet written
    if AUG:
        vrows = tl.where(ident, 0, C)  # v is read by the value blocks only
    else:
        vrows = C
    # the decay of the next chunk is loaded one chunk ahead by hand (gl has a spare slot at the
    # end): a vector operand of an element-wise product is not software-pipelined
    gn = tl.load(gl + dk)
    for _ in range(nc):
        gt = gn
        gn = tl.load(gl + BK + dk)
        wT = _cast(tl.load(w + pkT), DOT_BF16)
        if STORE_O:
            qT = _cast(tl.load(qg + pkT), DOT_BF16)
        kt = _cast(tl.load(kd + pk), DOT_BF16)
        if STORE_O:
            aT = _cast(tl.load(Aqk + paT), DOT_BF16)
        # rows past the document's end: v masked to 0 (their Ab columns are 0 too: beta = 0)
        vT = tl.load(v + po, mask=vm[:, None] & (r < tl.minimum(left, vrows))[None, :], other=0.0)
        uT = _dot(vT.to(tl.float32), tl.load(ab + paT).to(tl.float32), IEEE)
        hb = _cast(h, DOT_BF16)
        # layout changes go through shared memory behind a barrier: the decay's before the
        # chain of products, the output's after the state update, not between its two products
        h = h * gt[None, :]
        Ub = _cast(uT - _dot(hb, wT, IEEE), DOT_BF16)
        if STORE_O:
            ot = _dot(hb, qT, IEEE)
        h += _dot(Ub, kt, IEEE)
        if STORE_O:
            ot += _dot(Ub, aT, IEEE)
            tl.store(o + po, ot.to(o.dtype.element_ty), mask=vm[:, None] & (r < left)[None, :])
            qg += C * BK
            Aqk += C * C
            o += C * H * V
        left -= C
        w += C * BK
        kd += C * BK
        ab += C * C
        v += C * H * V
        gl += BK
    if STORE_HT:
        tl.store(hT + ph, h, mask=hm)


@triton.jit
def _kda_infer_join(
    M, h0, S0, soff, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
    HAS_H0: tl.constexpr,
):
    """Phase 2 of the segmented recurrence: the start states of the segments of one document and
    head (segments ``soff[n] .. soff[n + 1] - 1``), columns ``[i_v BV, (i_v + 1) BV)``:
    ``S_0 = h0`` (or 0), ``S_{s+1} = A_s S_s + B_s`` with ``[A_s | B_s]`` from phase 1 (``M``
    ``[segments, H, K, K + V]``), into ``S0`` ``[segments, H, K, V]``. Transposed like the
    recurrence, ``hv <- hv A_s^T + B_s^T``; exact fp32 products (one per segment: small next to
    the recurrences, and the start states carry the whole history of the sequence). The product
    runs over K in slices of ``KC``, the state's slice read back from the ``S0`` just written: an
    fp32 (FMA) product over all of K at once holds whole rows and columns of both operands in
    registers per thread, and spills."""
    NV: tl.constexpr = BVF // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    n = i_nh // H
    i_h = i_nh % H
    j0 = tl.load(soff + n)
    j1 = tl.load(soff + n + 1)  # > j0: every document has a segment, an empty one too
    dk = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    km = dk < K
    hm = (cv < V)[:, None] & km[None, :]
    ph = cv[:, None] + dk[None, :] * V
    if HAS_H0:
        h = tl.load(h0 + i_nh.to(tl.int64) * (K * V) + ph, mask=hm, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BV, BK], dtype=tl.float32)
    kc = tl.arange(0, KC)
    pb = K + cv[:, None] + dk[None, :] * (K + V)  # B^T: [v, d] <- B[d, v]
    js = (j0 * H + i_h).to(tl.int64)
    for _ in range(j1 - j0 - 1):  # the last segment's [A | B] is not needed
        tl.store(S0 + js * (K * V) + ph, h, mask=hm)
        tl.debug_barrier()  # the slices are read back by other threads than wrote them
        h = tl.load(M + js * (K * (K + V)) + pb, mask=hm, other=0.0)
        for c0 in tl.static_range(0, BK, KC):
            c = c0 + kc
            hc = tl.load(S0 + js * (K * V) + cv[:, None] + c[None, :] * V,
                         mask=(cv < V)[:, None] & (c < K)[None, :], other=0.0)
            # A^T rows c: [c, d] <- A[d, c]
            ac = tl.load(M + js * (K * (K + V)) + c[:, None] + dk[None, :] * (K + V),
                         mask=(c < K)[:, None] & km[None, :], other=0.0)
            h += tl.dot(hc, ac, input_precision="ieee")
        js += H
    tl.store(S0 + js * (K * V) + ph, h, mask=hm)
