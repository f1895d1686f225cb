"""Backward kernels of chunked KDA.

The forward keeps its intra-chunk intermediates (``Tm``, ``A_qk``, ``w``, ``u``, ``qg``, ``kd``,
``e^{G_last}``; G too in general mode, while bounded mode's backward reruns the chunked prep for
it), the state kernel reruns (``h_c``, ``U``), then (every kernel reads G, none recomputes it):

* ``_kda_bwd_dh`` (grid ``[cdiv(V, BV), B*H]``, or ``N*H`` documents with ``VARLEN``, sequential
  over chunks in reverse): with ``dh`` the gradient of the state leaving chunk c (stored per chunk),
  ``dU = A_qk^T do + (k e^{G_last-G}) dh`` and
  ``dh_c = e^{G_last} dh + qg^T do - w^T dU`` (``kd``, ``qg`` from the intra kernel); the last
  ``dh_c`` is d(initial_state).
* ``_kda_bwd_wy`` (grid ``[NT, B*H]``): what sums over a whole head dim. From ``U = u - w h``:
  ``dw = -dU h^T``; from ``u = Tm beta v``: ``dvb = Tm^T dU``, ``dv = beta dvb``; from
  ``w = Tm (beta k e^G)``: ``dkb = Tm^T dw`` (stored); from ``Tm = (I + A_kk)^-1``:
  ``dA_kk = -strict_lower(dvb u^T + dkb w^T)``; from ``o``: ``dA_qk = lower(do U^T)``.
* ``_kda_bwd_sterm`` (grid ``[K // BK, NT, B*H]``): the state terms per chunk
  (``dq = scale e^G (do h^T)``, ``dk = e^{G_last-G} (U dh^T)``, the w path) and d(G_last);
* ``_kda_bwd_dqkg`` (grid ``[K // BK, NT * C // 16, B*H]``): per 16-row sub-tile, adds the
  gated-score terms (``A_qk`` with q on the row side, ``A_kk`` with ``beta k``). Every term that
  differentiates an ``exp(G)`` factor lands in ``dG``; the two terms of each score pair are formed
  from the same rounded operands, so that they cancel in dg's reverse cumsum.
* ``_kda_bwd_dg``: ``dg`` is the reverse cumsum of ``dG`` within the chunk plus the gradient of
  ``G_last`` (which every g of the chunk feeds).
* ``_kda_bwd_dqkg_dg`` (grid ``[K // BK, NT, B*H]``, a candidate): the last two in one program per chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.ops.kda.triton_common import _cast, _dot, _tf32
from moelab.ops.kda.triton_prep import _gate_bwd


@triton.jit
def _kda_bwd_dh(
    qg, kd, gl, w, Aqk, do, dht, dhbuf, dU, dh0, coff,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
    VARLEN: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    NT = T // C
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    d = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    h_ptrs = d[:, None] * V + cv[None, :]
    # start at the last chunk and walk back
    if VARLEN:  # one packed row (B = 1); i_b is the document, its chunks are [coff[i_b], coff[i_b + 1])
        c1 = tl.load(coff + i_b + 1).to(tl.int64)
        NT = (c1 - tl.load(coff + i_b).to(tl.int64)).to(tl.int32)
        row0 = (c1 - 1) * C * H + i_h
        gl += ((c1 - 1) * H + i_h) * K
        dhbuf += ((c1 - 1) * H + i_h) * K * V
    else:
        row0 = (i_b * T + T - C).to(tl.int64) * H + i_h
        gl += ((i_b * NT + NT - 1).to(tl.int64) * H + i_h) * K
        dhbuf += ((i_b * NT + NT - 1).to(tl.int64) * H + i_h) * K * V
    qg += row0 * K
    kd += row0 * K
    w += row0 * K
    Aqk += row0 * C
    do += row0 * V
    dU += row0 * V
    k_ptrs = r[:, None] * (H * K) + d[None, :]
    v_ptrs = r[:, None] * (H * V) + cv[None, :]
    A_ptrs = r[:, None] * (H * C) + cidx[None, :]
    if HAS_DHT:
        dh = tl.load(dht + i_bh.to(tl.int64) * K * V + h_ptrs).to(tl.float32)
    else:
        dh = tl.zeros([K, BV], dtype=tl.float32)
    for _ in range(NT):
        tl.store(dhbuf + h_ptrs, dh.to(dhbuf.dtype.element_ty))
        kdt = tl.load(kd + k_ptrs)
        wt = tl.load(w + k_ptrs)
        glt = tl.load(gl + d)
        A = tl.load(Aqk + A_ptrs)
        do_t = _cast(tl.load(do + v_ptrs), DOT_BF16)
        dUt = _dot(_cast(tl.trans(A), DOT_BF16), do_t, IEEE)
        dUt += _dot(_cast(kdt, DOT_BF16), _cast(dh, DOT_BF16), IEEE)
        tl.store(dU + v_ptrs, dUt.to(dU.dtype.element_ty))
        dh = dh * glt[:, None]
        qgt = tl.load(qg + k_ptrs)
        dh += _dot(_cast(tl.trans(qgt), DOT_BF16), do_t, IEEE)
        dh -= _dot(_cast(tl.trans(wt), DOT_BF16), _cast(dUt, DOT_BF16), IEEE)
        qg -= C * H * K
        kd -= C * H * K
        w -= C * H * K
        Aqk -= C * H * C
        do -= C * H * V
        dU -= C * H * V
        gl -= H * K
        dhbuf -= H * K * V
    if STORE_DH0:
        tl.store(dh0 + i_bh.to(tl.int64) * K * V + h_ptrs, dh)


@triton.jit
def _kda_bwd_wy(
    v, beta, Abuf, w, u, hbuf, U, dU, do, dAs, dkb, dv, dbv,
    scale, T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
):
    """Per chunk (grid ``[NT, B*H]``): everything that sums over a whole head dim before the
    per-K-block gradients can start. Stores ``dA_qk`` and ``dA_kk`` (masked, ``scale`` folded into
    ``dA_qk``) to the scratch ``dAs`` ``[2, C, C]``, ``dv``, ``dkb = Tm^T dw`` (fp32, the gradient
    reaching ``beta k e^G`` through ``w``) and the value-side part of dbeta (fp32 ``dbv``)."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    w += row0 * K
    dkb += row0 * K
    v += row0 * V
    u += row0 * V
    U += row0 * V
    dU += row0 * V
    do += row0 * V
    dv += row0 * V
    beta += row0
    dbv += row0
    Abuf += row0 * C
    c_off = (i_b * (T // C) + i_c).to(tl.int64) * H + i_h  # (chunk, head) index
    hbuf += c_off * K * V
    dAs += c_off * (2 * C * C)

    b = tl.load(beta + r * H).to(tl.float32)
    Tm = tl.load(Abuf + r[:, None] * (H * C) + cidx[None, :])

    # value-side terms: dA_qk = do U^T, dv, and the u-part of dA_kk and dbeta
    dAq = tl.zeros([C, C], dtype=tl.float32)
    dAk = tl.zeros([C, C], dtype=tl.float32)
    db = tl.zeros([C], dtype=tl.float32)
    for vb in range(V // BV):
        p = r[:, None] * (H * V) + vb * BV + tl.arange(0, BV)[None, :]
        do_t = tl.load(do + p)
        U_t = tl.load(U + p)
        dU_t = tl.load(dU + p).to(tl.float32)
        v_t = tl.load(v + p).to(tl.float32)
        u_t = tl.load(u + p).to(tl.float32)
        dAq += _dot(_cast(do_t, DOT_BF16), _cast(tl.trans(U_t), DOT_BF16), IEEE)
        dvb = _dot(_cast(tl.trans(Tm), False), _cast(dU_t, False), IEEE)
        tl.store(dv + p, (dvb * b[:, None]).to(dv.dtype.element_ty))
        db += tl.sum(dvb * v_t, axis=1)
        dAk -= _dot(_cast(dvb, False), _cast(tl.trans(u_t), False), IEEE)
    # the w-part of dA_kk sums over all of K: dkb = Tm^T dw with dw = -dU h^T, dA_kk -= dkb w^T;
    # dkb is stored for the per-K-block kernel (recomputing it there cost three products per block)
    for kb in range(K // BK):
        cols = kb * BK + tl.arange(0, BK)
        kp = r[:, None] * (H * K) + cols[None, :]
        dkbt = _dkb_block(cols, hbuf, dU, Tm, r, H, V, C, BK, BV, DOT_BF16, IEEE)
        tl.store(dkb + kp, dkbt.to(dkb.dtype.element_ty))
        wt = tl.load(w + kp).to(tl.float32)
        dAk -= _dot(_cast(dkbt, False), _cast(tl.trans(wt), False), IEEE)
    dAk = tl.where(r[:, None] > cidx[None, :], dAk, 0.0)
    dAq = tl.where(r[:, None] >= cidx[None, :], dAq * scale, 0.0)
    # Both score gradients go through the per-chunk scratch: the per-K-block kernel reads them as
    # they are and TRANSPOSED (column-side terms) by pointer arithmetic. tl.trans of a tensor-core
    # result is what made an earlier fused gradient kernel fault on Hopper with Triton 3.6 (its
    # shared-memory copy is miscompiled; fla reports the same for trans(mma) -> local_alloc).
    A_ptrs = r[:, None] * C + cidx[None, :]
    tl.store(dAs + A_ptrs, dAq.to(dAs.dtype.element_ty))
    tl.store(dAs + C * C + A_ptrs, dAk.to(dAs.dtype.element_ty))
    tl.store(dbv + r * H, db)


@triton.jit
def _kda_bwd_dqkg(
    q, k, Gbuf, beta, dAs, dkb,
    dq, dk, dG, dbk,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BOUNDED: tl.constexpr, IEEE: tl.constexpr,
):
    """Per K-block, sub-tile and chunk (grid ``[K // BK, NT * C // BC, B*H]``): the rows ``I`` of
    one ``BC``-token sub-tile. ``_kda_bwd_sterm`` left the state terms of those rows in ``dq``
    (dq), ``dkb`` (dk) and ``dG``; this kernel adds the gated-score terms and stores dq and dk
    (final), their ``dG`` (fp32, before the reverse cumsum that ``_kda_bwd_dg`` does over the
    chunk) and the score part of dbeta (``dbk`` ``[K // BK, B, T, H]``, summed on the host). G is
    read from ``Gbuf`` (the chunk-local cumsum, log2 units, fp32), the same values in every program.

    A pair ``(i, j)``, ``i >= j``, of the gated scores puts one term ``X_ij`` into dG_i (row side)
    and ``-X_ij`` into dG_j (column side); in dg's reverse cumsum the two cancel for every token
    ``t <= j``, and what a rounding makes them differ by stays in all those dg. So each pair's two
    terms are formed from the same operands: the gated factors are rounded to TF32 (``_tf32``) before
    the product, and dG multiplies the product by those rounded factors, so that ``X_ij`` is
    ``tf32(a_i e^{G_i - ref}) A_ij tf32(b_j e^{ref - G_j})`` on both sides, up to fp32 accumulation.
    With sub-tile ``J`` of the chunk:
    * off-diagonal pairs (``J < I`` here as the row side, ``J > I`` as the column side): the
      reference of a pair is G at the first row of its later sub-tile (both factors <= 1); the
      column side takes the reference of each partner ``J``, as ``J``'s own row side does;
    * diagonal (``J = I``): bounded mode one product each side on factors shifted to G at the
      sub-tile's row ``BC // 2 - 1``; general mode element-wise ``e^{G_i - G_j}`` per pair in
      fp32 (partner rows from memory), the same number on both sides.
    Every tile is ``[BC, *]``: small enough to stay in registers (the chunk-wide version spilled).
    """
    i_k = tl.program_id(0)
    i_ci = tl.program_id(1)
    i_bh = tl.program_id(2)
    NC: tl.constexpr = C // BC
    i_c = i_ci // NC
    i_i = i_ci % NC
    q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk = _dqkg_ptrs(
        q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk, i_k, i_c, i_bh, T, NBH, H, K, C, BK)
    dGt = _dqkg_sub(q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk, i_i, H, K, C, BC, BK, BOUNDED, IEEE)
    rI = i_i * BC + tl.arange(0, BC)
    tl.store(dG + rI[:, None] * (H * K) + tl.arange(0, BK)[None, :], dGt)


@triton.jit
def _dqkg_ptrs(q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk, i_k, i_c, i_bh, T, NBH, H: tl.constexpr, K: tl.constexpr,
               C: tl.constexpr, BK: tl.constexpr):
    """The score kernels' pointers moved to K-block ``i_k`` of chunk ``i_c`` of head ``i_bh`` (row 0)."""
    row0 = ((i_bh // H) * T + i_c * C).to(tl.int64) * H + i_bh % H  # the chunk's first token
    bo = i_k * BK
    dAs += (((i_bh // H) * (T // C) + i_c).to(tl.int64) * H + i_bh % H) * (2 * C * C)  # the (chunk, head) scratch
    return (q + row0 * K + bo, k + row0 * K + bo, Gbuf + row0 * K + bo, beta + row0, dAs, dkb + row0 * K + bo,
            dq + row0 * K + bo, dk + row0 * K + bo, dG + row0 * K + bo,
            dbk + i_k.to(tl.int64) * NBH * T + row0)  # dbk [K // BK, B, T, H]; B*T*H = NBH*T


@triton.jit
def _dqkg_sub(q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk, i_i, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
              BC: tl.constexpr, BK: tl.constexpr, BOUNDED: tl.constexpr, IEEE: tl.constexpr):
    """Sub-tile ``i_i`` of one chunk and K-block (pointers from ``_dqkg_ptrs``): stores dq, dk and the score
    part of dbeta of its rows, returns their dG ``[BC, BK]`` (fp32, the state terms ``dG`` holds included)."""
    NC: tl.constexpr = C // BC
    SK: tl.constexpr = H * K
    rc = tl.arange(0, BC)
    cols = tl.arange(0, BK)
    rI = i_i * BC + rc  # this sub-tile's rows within the chunk
    pI = rI[:, None] * SK + cols[None, :]
    GI = tl.load(Gbuf + pI)
    qI = tl.load(q + pI).to(tl.float32)
    kI = tl.load(k + pI).to(tl.float32)
    bI = tl.load(beta + rI * H).to(tl.float32)
    bkI = kI * bI[:, None]
    dGt = tl.load(dG + pI)
    sA = rI[:, None] * C  # rows I of the [C, C] score gradients

    # diagonal sub-tile: rq, rk, cs start as its terms of dq, dk (through A_kk, before beta) and dk
    dP = sA + rI[None, :]  # dS[i, j], i, j in I (stored already masked to j <= i / j < i)
    tPd = rI[None, :] * C + rI[:, None]  # dS[j, i]
    if BOUNDED:
        Gm = tl.load(Gbuf + (i_i * BC + BC // 2 - 1) * SK + cols)
        up = tl.exp2(GI - Gm[None, :])
        down = tl.exp2(Gm[None, :] - GI)
        kd = _tf32(kI * down, IEEE)
        qu = _tf32(qI * up, IEEE)
        bku = _tf32(bkI * up, IEEE)
        pq = _dot(_cast(tl.load(dAs + dP), False), _cast(kd, False), IEEE)
        pk = _dot(_cast(tl.load(dAs + C * C + dP), False), _cast(kd, False), IEEE)
        pc = (_dot(_cast(tl.load(dAs + tPd), False), _cast(qu, False), IEEE)
              + _dot(_cast(tl.load(dAs + C * C + tPd), False), _cast(bku, False), IEEE))
        dGt += qu * pq + bku * pk - kd * pc
        rq = up * pq
        rk = up * pk
        cs = down * pc
    else:
        rq = tl.zeros([BC, BK], dtype=tl.float32)
        rk = tl.zeros([BC, BK], dtype=tl.float32)
        cs = tl.zeros([BC, BK], dtype=tl.float32)
        for s in range(BC):
            j = i_i * BC + s
            pj = j * SK + cols
            kj = tl.load(k + pj).to(tl.float32)
            qj = tl.load(q + pj).to(tl.float32)
            Gj = tl.load(Gbuf + pj)
            bj = tl.load(beta + j * H).to(tl.float32)
            # row side: rows i >= j of column j
            e_r = tl.exp2(tl.where((rI >= j)[:, None], GI - Gj[None, :], float("-inf")))
            aq = tl.load(dAs + rI * C + j).to(tl.float32)
            ak = tl.load(dAs + C * C + rI * C + j).to(tl.float32)
            rq += aq[:, None] * kj[None, :] * e_r
            rk += ak[:, None] * kj[None, :] * e_r
            # column side: column i <= j of row j
            e_c = tl.exp2(tl.where((rI <= j)[:, None], Gj[None, :] - GI, float("-inf")))
            cq = tl.load(dAs + j * C + rI).to(tl.float32)
            ck = tl.load(dAs + C * C + j * C + rI).to(tl.float32)
            cs += (cq[:, None] * qj[None, :] + (ck * bj)[:, None] * kj[None, :]) * e_c
        dGt += qI * rq + bkI * rk - kI * cs

    # row side, J < I, reference gI = G at the first row of I: dS_IJ (b_J e^{gI - G_J}) * e^{G_I - gI}
    gI = tl.load(Gbuf + (i_i * BC) * SK + cols)
    eI = tl.exp2(GI - gI[None, :])
    pq = tl.zeros([BC, BK], dtype=tl.float32)
    pk = tl.zeros([BC, BK], dtype=tl.float32)
    for J in range(0, i_i):
        pJ = (J * BC + rc)[:, None] * SK + cols[None, :]
        kf = _tf32(tl.load(k + pJ).to(tl.float32) * tl.exp2(gI[None, :] - tl.load(Gbuf + pJ)), IEEE)
        cJ = J * BC + rc
        pq += _dot(_cast(tl.load(dAs + sA + cJ[None, :]), False), _cast(kf, False), IEEE)
        pk += _dot(_cast(tl.load(dAs + C * C + sA + cJ[None, :]), False), _cast(kf, False), IEEE)
    dGt += _tf32(qI * eI, IEEE) * pq + _tf32(bkI * eI, IEEE) * pk
    rq += eI * pq
    rk += eI * pk

    # column side, J > I, reference gJ = G at the first row of J: dS_JI^T (a_J e^{G_J - gJ}) * e^{gJ - G_I};
    # element (i, j) of dS_JI^T is dS[j, i]
    for J in range(i_i + 1, NC):
        pJ = (J * BC + rc)[:, None] * SK + cols[None, :]
        gJ = tl.load(Gbuf + (J * BC) * SK + cols)
        eJ = tl.exp2(tl.load(Gbuf + pJ) - gJ[None, :])
        bJ = tl.load(beta + (J * BC + rc) * H).to(tl.float32)
        qf = _tf32(tl.load(q + pJ).to(tl.float32) * eJ, IEEE)
        bkf = _tf32(tl.load(k + pJ).to(tl.float32) * bJ[:, None] * eJ, IEEE)
        tP = (J * BC + rc)[None, :] * C + rI[:, None]
        pc = (_dot(_cast(tl.load(dAs + tP), False), _cast(qf, False), IEEE)
              + _dot(_cast(tl.load(dAs + C * C + tP), False), _cast(bkf, False), IEEE))
        f = tl.exp2(gJ[None, :] - GI)
        dGt -= _tf32(kI * f, IEEE) * pc
        cs += f * pc

    tl.store(dq + pI, (tl.load(dq + pI).to(tl.float32) + rq).to(dq.dtype.element_ty))
    tl.store(dk + pI, (tl.load(dkb + pI).to(tl.float32) + rk * bI[:, None] + cs).to(dk.dtype.element_ty))
    tl.store(dbk + rI * H, tl.sum(rk * kI, axis=1))
    return dGt


@triton.jit
def _kda_bwd_dqkg_dg(
    q, k, Gbuf, beta, dAs, dkb,
    dq, dk, dG, dbk,
    dGl, dg, z, A_log, dt_bias, dAp, dbp, g_min,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BOUNDED: tl.constexpr, IEEE: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """``_kda_bwd_dqkg`` and ``_kda_bwd_dg`` in one program per K-block and chunk (grid ``[K // BK, NT, B*H]``,
    ``VARIANTS["dg"] == "dqkg"``): the chunk's sub-tiles last to first, each sub-tile's dG reverse-summed
    at once with what the later sub-tiles and ``dGl`` carry in, so dG never goes back to memory; the gate's
    backward (``GATE``, ``HAS_BIAS``) and its per-program sums as in ``_kda_bwd_dg`` (``dAp`` indexed by this
    kernel's K-blocks)."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2)
    NC: tl.constexpr = C // BC
    SK: tl.constexpr = H * K
    q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk = _dqkg_ptrs(
        q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk, i_k, i_c, i_bh, T, NBH, H, K, C, BK)
    row0 = ((i_bh // H) * T + i_c * C).to(tl.int64) * H + i_bh % H
    bo = i_k * BK
    rc = tl.arange(0, BC)
    cols = tl.arange(0, BK)
    c_off = ((i_bh // H) * (T // C) + i_c).to(tl.int64) * H + i_bh % H
    carry = tl.load(dGl + c_off * K + bo + cols)  # d(G_last), which every g of the chunk feeds
    db = tl.zeros([BK], dtype=tl.float32)
    dA = tl.sum(db, axis=0)  # an fp32 scalar: a loop-carried value keeps its type
    for t in range(NC):
        i_i = NC - 1 - t
        x = _dqkg_sub(q, k, Gbuf, beta, dAs, dkb, dq, dk, dG, dbk, i_i, H, K, C, BC, BK, BOUNDED, IEEE)
        tot = tl.sum(x, axis=0)
        out = (carry + tot)[None, :] - tl.cumsum(x, axis=0) + x
        carry += tot
        p = row0 * K + bo + (i_i * BC + rc)[:, None] * SK + cols[None, :]
        if GATE != 0:
            out, dAt = _dz_rows(out, z + p, dt_bias + (i_bh % H) * K + bo + cols, A_log + i_bh % H, g_min, GATE,
                                HAS_BIAS)
            dA += dAt
            db += tl.sum(out, axis=0)
        tl.store(dg + p, out.to(dg.dtype.element_ty))
    if GATE != 0:
        tl.store(dAp + (i_k * (T // C) + i_c).to(tl.int64) * NBH + i_bh, dA)
        if HAS_BIAS:
            tl.store(dbp + ((i_c * NBH + i_bh).to(tl.int64)) * K + bo + cols, db)


@triton.jit
def _kda_bwd_sterm(
    q, k, Gbuf, beta, hbuf, dhbuf, U, do, dkb, dq, dG, dGl, dbs,
    scale, T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
):
    """State terms per K-block and chunk (grid ``[K // BK, NT, B*H]``), ``[C, BK]`` tiles:
    ``dq = scale e^G (do h^T)`` (to ``dq``), ``dk = e^{G_last-G} (U dh^T) + beta e^G dkb``
    (overwrites ``dkb``, fp32), their ``dG`` (to ``dG``), the gradient of ``G_last`` (``dGl``
    ``[B, NT, H, K]``) and the dbeta term (``dbs`` ``[K // BK, B, T, H]``), with G from ``Gbuf``.
    ``_kda_bwd_dqkg`` then adds the gated-score terms."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cols = tl.arange(0, BK)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    bo = i_k * BK
    q += row0 * K + bo
    k += row0 * K + bo
    Gbuf += row0 * K + bo
    dkb += row0 * K + bo
    dq += row0 * K + bo
    dG += row0 * K + bo
    U += row0 * V
    do += row0 * V
    beta += row0
    dbs += i_k.to(tl.int64) * NBH * T + row0
    c_off = (i_b * (T // C) + i_c).to(tl.int64) * H + i_h
    hbuf += c_off * K * V + bo * V
    dhbuf += c_off * K * V + bo * V
    dGl += c_off * K + bo

    dqh = tl.zeros([C, BK], dtype=tl.float32)
    dkh = tl.zeros([C, BK], dtype=tl.float32)
    dgl = tl.zeros([BK], dtype=tl.float32)
    for vb in range(V // BV):
        cv = vb * BV + tl.arange(0, BV)
        p = r[:, None] * (H * V) + cv[None, :]
        hp = cols[:, None] * V + cv[None, :]
        ht = tl.load(hbuf + hp)
        dht = tl.load(dhbuf + hp)
        dqh += _dot(_cast(tl.load(do + p), DOT_BF16), _cast(tl.trans(ht), DOT_BF16), IEEE)
        dkh += _dot(_cast(tl.load(U + p), DOT_BF16), _cast(tl.trans(dht), DOT_BF16), IEEE)
        dgl += tl.sum(ht.to(tl.float32) * dht.to(tl.float32), axis=1)
    # the [C, BK] operands load after the loop over V: live across it they spill (sm_90a 192 -> 136 B)
    kp = r[:, None] * (H * K) + cols[None, :]
    G = tl.load(Gbuf + kp)
    Gl = tl.load(Gbuf + (C - 1) * (H * K) + cols)
    b = tl.load(beta + r * H).to(tl.float32)
    qt = tl.load(q + kp).to(tl.float32)
    kt = tl.load(k + kp).to(tl.float32)
    dkbt = tl.load(dkb + kp).to(tl.float32)
    eG = tl.exp2(G)
    dki = dkh * tl.exp2(Gl[None, :] - G)
    dqt = dqh * eG * scale
    dkt = dki + dkbt * eG * b[:, None]
    db = tl.sum(dkbt * kt * eG, axis=1)
    dGt = qt * dqt - kt * dki + kt * b[:, None] * eG * dkbt
    part = tl.sum(kt * dki, axis=0)
    tl.store(dq + kp, dqt.to(dq.dtype.element_ty))
    tl.store(dkb + kp, dkt.to(dkb.dtype.element_ty))
    tl.store(dG + kp, dGt)
    # d(G_last): through k e^{G_last - G} and through the state's decay e^{G_last} (sum_v h dh)
    tl.store(dGl + cols, part + tl.exp2(Gl) * dgl)
    tl.store(dbs + r * H, db)


@triton.jit
def _dz_rows(dg, z, dt_bias, A_log, g_min, GATE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The gate's backward on fp32 ``dg`` rows ``[R, BK]``: ``z`` points at those rows of the gate input, ``dt_bias``
    at the block's bias columns, ``A_log`` at the head's rate; returns (dL/dz rows, their dL/dA_log sum)."""
    u = tl.load(z).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(dt_bias).to(tl.float32)[None, :]
    dz, dA = _gate_bwd(dg, u, tl.exp(tl.load(A_log).to(tl.float32)), g_min, GATE)
    return dz, tl.sum(tl.sum(dA, axis=1), axis=0)


@triton.jit
def _kda_bwd_dg(
    dG, dGl, dg, T,
    z, A_log, dt_bias, dAp, dbp, g_min, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
    GATE: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Per K-block and chunk (grid ``[K // BK, NT, B*H]``): ``dg`` = reverse cumsum of ``dG``
    within the chunk plus the gradient of ``G_last`` (``dGl`` ``[B, NT, H, K]``, from
    ``_kda_bwd_sterm``), which every g of the chunk feeds.

    ``GATE`` 1 (bounded) / 2 (softplus): the gate's backward too (``triton_prep._gate_bwd`` on the fp32 dg, as the
    prep's backward would do it from the stored dg): ``dg`` receives dL/dz in z's dtype (z ``[B, T, H, K]`` raw,
    unpadded), and this program's fp32 sums go to ``dAp [K // BK, NT, B*H]`` (dL/dA_log's terms) and, with
    ``HAS_BIAS``, ``dbp [NT, B*H, K]`` (dL/d dt_bias's)."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cols = i_k * BK + tl.arange(0, BK)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    p = r[:, None] * (H * K) + cols[None, :]
    x = tl.load(dG + row0 * K + p)
    c_off = (i_b * (T // C) + i_c).to(tl.int64) * H + i_h
    tot = tl.load(dGl + c_off * K + cols)
    out = tl.sum(x, axis=0)[None, :] - tl.cumsum(x, axis=0) + x + tot[None, :]
    if GATE != 0:
        out, dA = _dz_rows(out, z + row0 * K + p, dt_bias + i_h * K + cols, A_log + i_h, g_min, GATE, HAS_BIAS)
        tl.store(dAp + (i_k * (T // C) + i_c).to(tl.int64) * NBH + i_bh, dA)
        if HAS_BIAS:
            tl.store(dbp + ((i_c * NBH + i_bh).to(tl.int64)) * K + cols, tl.sum(out, axis=0))
    tl.store(dg + row0 * K + p, out.to(dg.dtype.element_ty))


@triton.jit
def _dkb_block(cols, hbuf, dU, Tm, r, H: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, DOT_BF16: tl.constexpr, IEEE: tl.constexpr):
    """``dkb = Tm^T dw`` for one K-block, ``dw = -dU h^T`` (gradient of ``beta k e^G`` via w)."""
    dw = tl.zeros([C, BK], dtype=tl.float32)
    for vb in range(V // BV):
        cv = vb * BV + tl.arange(0, BV)
        ht = tl.load(hbuf + cols[:, None] * V + cv[None, :])
        dUt = tl.load(dU + r[:, None] * (H * V) + cv[None, :])
        dw += _dot(_cast(dUt, DOT_BF16), _cast(tl.trans(ht), DOT_BF16), IEEE)
    return -_dot(_cast(tl.trans(Tm), False), _cast(dw, False), IEEE)
