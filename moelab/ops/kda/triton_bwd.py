"""Backward kernels of chunked KDA.

The backward first reruns the forward's intra and state kernels (``Tm``, ``A_qk``, ``w``, ``u``,
``h_c``, ``U``), then:

* ``_kda_bwd_dh`` (grid ``[cdiv(V, BV), B*H]``, sequential over chunks in reverse): with ``dh``
  the gradient of the state leaving chunk c (stored per chunk),
  ``dU = A_qk^T do + (k e^{G_last-G}) dh`` and
  ``dh_c = e^{G_last} dh + qg^T do - w^T dU`` (``kd``, ``qg`` from the intra kernel); the last
  ``dh_c`` is d(initial_state).
* ``_kda_bwd_grads`` (grid ``[NT, B*H]``): everything else, per chunk, one K-block at a time
  after a first pass that completes ``dA_kk`` (it sums over all of K).
  From ``U = u - w h``: ``dw = -dU h^T``; from ``u = Tm beta v``: ``dvb = Tm^T dU``,
  ``dv = beta dvb``; from ``w = Tm (beta k e^G)``: ``dkb = Tm^T dw``; from ``Tm = (I + A_kk)^-1``:
  ``dA_kk = -strict_lower(dvb u^T + dkb w^T)``; from ``o``: ``dA_qk = lower(do U^T)``,
  ``dq += scale e^G (do h^T)``; from the state update: ``dk += e^{G_last-G} (U dh^T)``.
  The gated score gradients (``A_qk`` with q on the row side, ``A_kk`` with ``beta k``) use the
  row-side / column-side helpers of triton_common. Every term that differentiates an
  ``exp(G)`` factor lands in ``dG``; ``dg`` is its reverse cumsum within the chunk plus the
  gradient of ``G_last`` (which every g of the chunk feeds).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.ops.kda.triton_common import _cast, _colside_sum, _dot, _load_G, _rowside2


@triton.jit
def _kda_bwd_dh(
    qg, kd, gl, w, Aqk, do, dht, dhbuf, dU, dh0,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
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
    row0 = (i_b * T + T - C).to(tl.int64) * H + i_h
    qg += row0 * K
    kd += row0 * K
    w += row0 * K
    Aqk += row0 * C
    do += row0 * V
    dU += row0 * V
    gl += ((i_b * NT + NT - 1).to(tl.int64) * H + i_h) * K
    dhbuf += ((i_b * NT + NT - 1).to(tl.int64) * H + i_h) * K * V
    k_ptrs = r[:, None] * (H * K) + d[None, :]
    v_ptrs = r[:, None] * (H * V) + cv[None, :]
    A_ptrs = r[:, None] * (H * C) + cidx[None, :]
    if HAS_DHT:
        dh = tl.load(dht + i_bh.to(tl.int64) * K * V + h_ptrs).to(tl.float32)
    else:
        dh = tl.zeros([K, BV], dtype=tl.float32)
    for _ in range(NT):
        tl.store(dhbuf + h_ptrs, dh.to(dhbuf.dtype.element_ty))
        A = tl.load(Aqk + A_ptrs)
        do_t = _cast(tl.load(do + v_ptrs), DOT_BF16)
        kdt = tl.load(kd + k_ptrs)
        qgt = tl.load(qg + k_ptrs)
        wt = tl.load(w + k_ptrs)
        glt = tl.load(gl + d)
        dUt = _dot(_cast(tl.trans(A), DOT_BF16), do_t, IEEE)
        dUt += _dot(_cast(kdt, DOT_BF16), _cast(dh, DOT_BF16), IEEE)
        tl.store(dU + v_ptrs, dUt)
        dh = dh * glt[:, None]
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
        dU_t = tl.load(dU + p)
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
        tl.store(dkb + kp, dkbt)
        wt = tl.load(w + kp).to(tl.float32)
        dAk -= _dot(_cast(dkbt, False), _cast(tl.trans(wt), False), IEEE)
    dAk = tl.where(r[:, None] > cidx[None, :], dAk, 0.0)
    dAq = tl.where(r[:, None] >= cidx[None, :], dAq * scale, 0.0)
    # Both score gradients go through the per-chunk scratch: the per-K-block kernel reads them as
    # they are and TRANSPOSED (column-side terms) by pointer arithmetic. tl.trans of a tensor-core
    # result is what made the fused gradient kernel fault on Hopper with Triton 3.6 (its
    # shared-memory copy is miscompiled; fla reports the same for trans(mma) -> local_alloc).
    A_ptrs = r[:, None] * C + cidx[None, :]
    tl.store(dAs + A_ptrs, dAq)
    tl.store(dAs + C * C + A_ptrs, dAk)
    tl.store(dbv + r * H, db)


@triton.jit
def _kda_bwd_dqkg(
    q, k, g, beta, Gbuf, hbuf, dhbuf, U, do, dAs, dkb,
    dq, dk, dg, dbk,
    scale, T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BOUNDED: tl.constexpr, DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
):
    """Per K-block and chunk (grid ``[K // BK, NT, B*H]``): dq, dk, dg of the block (stored) and
    its dbeta terms (fp32 ``dbk`` ``[K // BK, B, T, H]``, summed on the host, no atomics).

    State terms: inter-chunk dq and dk, the w-path of dk and dbeta (from ``dkb``), and their dG,
    with the gradient of G_last (which every g of the chunk feeds) added to all of dg. Score
    terms: the gated scores A_qk (dAq, scale folded in) and A_kk (dAk, beta folded into the row
    side), read from the scratch ``dAs``. Then the reverse cumsum of dG."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    bo = i_k * BK
    q += row0 * K + bo
    k += row0 * K + bo
    g += row0 * K + bo
    Gbuf += row0 * K + bo
    dkb += row0 * K + bo
    dq += row0 * K + bo
    dk += row0 * K + bo
    dg += row0 * K + bo
    U += row0 * V
    do += row0 * V
    beta += row0
    dbk += i_k.to(tl.int64) * NBH * T + row0  # [K // BK, B, T, H]; B*T*H = NBH*T
    c_off = (i_b * (T // C) + i_c).to(tl.int64) * H + i_h
    hbuf += c_off * K * V + bo * V
    dhbuf += c_off * K * V + bo * V
    dAs += c_off * (2 * C * C)

    b = tl.load(beta + r * H).to(tl.float32)
    cols = tl.arange(0, BK)
    kp = r[:, None] * (H * K) + cols[None, :]
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
    G = _load_G(g, r, cols, H * K)
    Gl = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
    qt = tl.load(q + kp).to(tl.float32)
    kt = tl.load(k + kp).to(tl.float32)
    dkbt = tl.load(dkb + kp)
    eG = tl.exp2(G)
    bk = kt * b[:, None]
    dki = dkh * tl.exp2(Gl[None, :] - G)
    dqt = dqh * eG * scale
    dkt = dki + dkbt * eG * b[:, None]
    db = tl.sum(dkbt * kt * eG, axis=1)
    dG = qt * dqt - kt * dki + bk * eG * dkbt
    dGl = tl.sum(kt * dki, axis=0) + tl.exp2(Gl) * dgl

    dAq = tl.load(dAs + r[:, None] * C + cidx[None, :])
    dAk = tl.load(dAs + C * C + r[:, None] * C + cidx[None, :])
    rq, rk = _rowside2(dAq, dAk, kt, G, k, Gbuf, H * K, BOUNDED, DOT_BF16, IEEE, C, BC, BK)
    tl.store(dq + kp, (dqt + rq).to(dq.dtype.element_ty))
    dkt += rk * b[:, None]
    db += tl.sum(rk * kt, axis=1)
    dG += qt * rq + bk * rk
    cs = _colside_sum(dAq, dAk, dAs, qt, bk, G, q, k, beta, Gbuf, H * K, H, BOUNDED, DOT_BF16, IEEE, C, BC, BK)
    dkt += cs
    dG -= kt * cs
    dgt = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG + dGl[None, :]
    tl.store(dk + kp, dkt.to(dk.dtype.element_ty))
    tl.store(dg + kp, dgt.to(dg.dtype.element_ty))
    tl.store(dbk + r * H, db)


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
