"""Backward kernels of chunked KDA.

The backward first reruns the forward's intra and state kernels (``Tm``, ``A_qk``, ``w``, ``u``,
``h_c``, ``U``), then:

* ``_kda_bwd_dh`` (grid ``[cdiv(V, BV), B*H]``, sequential over chunks in reverse): with ``dh``
  the gradient of the state leaving chunk c (stored per chunk),
  ``dU = A_qk^T do + (k e^{G_last-G}) dh`` and
  ``dh_c = e^{G_last} dh + qg^T do - w^T dU`` (``kd``, ``qg`` from the intra kernel); the last
  ``dh_c`` is d(initial_state).
* ``_kda_bwd_grads`` (grid ``[NT, B*H]``): everything else, per chunk.
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

from moelab.ops.kda.triton_common import _cast, _colside_sum, _load_G, _rowside2


@triton.jit
def _kda_bwd_dh(
    qg, kd, gl, w, Aqk, do, dht, dhbuf, dU, dh0,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BKP: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, DOT_BF16: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    d = tl.arange(0, BKP)
    m_d = d < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    m_h = m_d[:, None] & m_v[None, :]
    h_ptrs = d[:, None] * V + cv[None, :]
    if HAS_DHT:
        dh = tl.load(dht + i_bh * K * V + h_ptrs, mask=m_h, other=0.0).to(tl.float32)
    else:
        dh = tl.zeros([BKP, BV], dtype=tl.float32)
    for cc in range(NT):
        c = NT - 1 - cc
        tl.store(dhbuf + ((i_b * NT + c) * H + i_h) * K * V + h_ptrs, dh.to(dhbuf.dtype.element_ty), mask=m_h)
        t0 = i_b * T + c * C
        tp0 = i_b * NT * C + c * C
        m_r = r < T - c * C
        m_k = m_r[:, None] & m_d[None, :]
        m_u = m_r[:, None] & m_v[None, :]
        kb_ptrs = (t0 * H + i_h) * K + r[:, None] * (H * K) + d[None, :]
        vb_ptrs = (t0 * H + i_h) * V + r[:, None] * (H * V) + cv[None, :]
        A = tl.load(Aqk + (tp0 * H + i_h) * C + r[:, None] * (H * C) + cidx[None, :])
        do_t = _cast(tl.load(do + vb_ptrs, mask=m_u, other=0.0), DOT_BF16)
        kdt = tl.load(kd + kb_ptrs, mask=m_k, other=0.0)
        qgt = tl.load(qg + kb_ptrs, mask=m_k, other=0.0)
        wt = tl.load(w + kb_ptrs, mask=m_k, other=0.0)
        glt = tl.load(gl + ((i_b * NT + c) * H + i_h) * K + d, mask=m_d, other=0.0)
        dUt = tl.dot(_cast(tl.trans(A), DOT_BF16), do_t)
        dUt += tl.dot(_cast(kdt, DOT_BF16), _cast(dh, DOT_BF16))
        tl.store(dU + vb_ptrs, dUt, mask=m_u)
        dh = dh * glt[:, None]
        dh += tl.dot(_cast(tl.trans(qgt), DOT_BF16), do_t)
        dh -= tl.dot(_cast(tl.trans(wt), DOT_BF16), _cast(dUt, DOT_BF16))
    if STORE_DH0:
        tl.store(dh0 + i_bh * K * V + h_ptrs, dh, mask=m_h)


@triton.jit
def _kda_bwd_grads(
    q, k, v, g, beta, Gbuf, Abuf, w, u, hbuf, dhbuf, U, dU, do,
    dq, dk, dv, dg, dbeta, scr_q, scr_k, scr_g,
    scale, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BOUNDED: tl.constexpr, DOT_BF16: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    Tp = NT * C
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    nval = T - i_c * C
    m_r = r < nval
    t0 = i_b * T + i_c * C
    tp0 = i_b * Tp + i_c * C
    qk_base = (t0 * H + i_h) * K
    g_base = (tp0 * H + i_h) * K
    v_base = (t0 * H + i_h) * V
    h_base = ((i_b * NT + i_c) * H + i_h) * K * V
    NK: tl.constexpr = (K + BK - 1) // BK

    b = tl.load(beta + t0 * H + i_h + r * H, mask=m_r, other=0.0).to(tl.float32)
    Tm = tl.load(Abuf + (tp0 * H + i_h) * C + r[:, None] * (H * C) + cidx[None, :])

    # value-side terms: dA_qk = do U^T, dv, and the u-part of dA_kk and dbeta
    dAq = tl.zeros([C, C], dtype=tl.float32)
    dAk = tl.zeros([C, C], dtype=tl.float32)
    db = tl.zeros([C], dtype=tl.float32)
    for vb in range(tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        m_u = m_r[:, None] & (cv < V)[None, :]
        p = v_base + r[:, None] * (H * V) + cv[None, :]
        do_t = tl.load(do + p, mask=m_u, other=0.0)
        U_t = tl.load(U + p, mask=m_u, other=0.0)
        dU_t = tl.load(dU + p, mask=m_u, other=0.0)
        v_t = tl.load(v + p, mask=m_u, other=0.0).to(tl.float32)
        u_t = tl.load(u + p, mask=m_u, other=0.0).to(tl.float32)
        dAq += tl.dot(_cast(do_t, DOT_BF16), _cast(tl.trans(U_t), DOT_BF16))
        dvb = tl.dot(_cast(tl.trans(Tm), False), _cast(dU_t, False))
        tl.store(dv + p, (dvb * b[:, None]).to(dv.dtype.element_ty), mask=m_u)
        db += tl.sum(dvb * v_t, axis=1)
        dAk -= tl.dot(_cast(dvb, False), _cast(tl.trans(u_t), False))

    if NK == 1:
        dq1, dk1, dG1, dAk, db = _bwd_state_terms(
            0, q, k, g, w, hbuf, dhbuf, U, dU, do, Tm, b, dAk, db, scale, T, qk_base, v_base, h_base, r, m_r,
            H, K, V, C, BK, BV, DOT_BF16)
        dAk = tl.where(r[:, None] > cidx[None, :], dAk, 0.0)
        dAq = tl.where(r[:, None] >= cidx[None, :], dAq * scale, 0.0)
        db = _bwd_intra_terms(
            0, dq1, dk1, dG1, dAq, dAk, db, q, k, g, beta, Gbuf, dq, dk, dg, T, nval, qk_base, g_base,
            t0 * H + i_h, r, m_r, b, H, K, C, BC, BK, BOUNDED, DOT_BF16)
    else:
        for kb in range(NK):
            dq1, dk1, dG1, dAk, db = _bwd_state_terms(
                kb, q, k, g, w, hbuf, dhbuf, U, dU, do, Tm, b, dAk, db, scale, T, qk_base, v_base, h_base, r,
                m_r, H, K, V, C, BK, BV, DOT_BF16)
            p = g_base + r[:, None] * (H * K) + kb * BK + tl.arange(0, BK)[None, :]
            m_s = (kb * BK + tl.arange(0, BK) < K)[None, :]
            tl.store(scr_q + p, dq1, mask=m_s)
            tl.store(scr_k + p, dk1, mask=m_s)
            tl.store(scr_g + p, dG1, mask=m_s)
        dAk = tl.where(r[:, None] > cidx[None, :], dAk, 0.0)
        dAq = tl.where(r[:, None] >= cidx[None, :], dAq * scale, 0.0)
        tl.debug_barrier()
        for kb in range(NK):
            p = g_base + r[:, None] * (H * K) + kb * BK + tl.arange(0, BK)[None, :]
            m_s = (kb * BK + tl.arange(0, BK) < K)[None, :]
            dq1 = tl.load(scr_q + p, mask=m_s, other=0.0)
            dk1 = tl.load(scr_k + p, mask=m_s, other=0.0)
            dG1 = tl.load(scr_g + p, mask=m_s, other=0.0)
            db = _bwd_intra_terms(
                kb, dq1, dk1, dG1, dAq, dAk, db, q, k, g, beta, Gbuf, dq, dk, dg, T, nval, qk_base, g_base,
                t0 * H + i_h, r, m_r, b, H, K, C, BC, BK, BOUNDED, DOT_BF16)
    tl.store(dbeta + t0 * H + i_h + r * H, db.to(dbeta.dtype.element_ty), mask=m_r)


@triton.jit
def _bwd_state_terms(
    kb, q, k, g, w, hbuf, dhbuf, U, dU, do, Tm, b, dAk, db, scale, T, qk_base, v_base, h_base, r, m_r,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_BF16: tl.constexpr,
):
    """Terms of one K-block that involve the states h_c / dh: inter-chunk dq, dk, the w-part of
    dA_kk and dbeta, and their dG; the gradient of G_last is folded into the last row of dG."""
    cols = kb * BK + tl.arange(0, BK)
    m_c = cols < K
    m2 = m_r[:, None] & m_c[None, :]
    kp = qk_base + r[:, None] * (H * K) + cols[None, :]
    dqh = tl.zeros([C, BK], dtype=tl.float32)
    dw = tl.zeros([C, BK], dtype=tl.float32)
    dkh = tl.zeros([C, BK], dtype=tl.float32)
    dgl = tl.zeros([BK], dtype=tl.float32)
    for vb in range(tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        m_v = cv < V
        m_u = m_r[:, None] & m_v[None, :]
        p = v_base + r[:, None] * (H * V) + cv[None, :]
        hp = h_base + cols[:, None] * V + cv[None, :]
        m_h = m_c[:, None] & m_v[None, :]
        ht = tl.load(hbuf + hp, mask=m_h, other=0.0)
        dht = tl.load(dhbuf + hp, mask=m_h, other=0.0)
        do_t = tl.load(do + p, mask=m_u, other=0.0)
        U_t = tl.load(U + p, mask=m_u, other=0.0)
        dU_t = tl.load(dU + p, mask=m_u, other=0.0)
        hT_ = _cast(tl.trans(ht), DOT_BF16)
        dqh += tl.dot(_cast(do_t, DOT_BF16), hT_)
        dw += tl.dot(_cast(dU_t, DOT_BF16), hT_)
        dkh += tl.dot(_cast(U_t, DOT_BF16), _cast(tl.trans(dht), DOT_BF16))
        dgl += tl.sum(ht.to(tl.float32) * dht.to(tl.float32), axis=1)
    # loaded after the V loop to keep them out of its live range
    G = _load_G(g + qk_base, r, m_r, cols, m_c, H * K)
    Gl = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
    qt = tl.load(q + kp, mask=m2, other=0.0).to(tl.float32)
    kt = tl.load(k + kp, mask=m2, other=0.0).to(tl.float32)
    wt = tl.load(w + kp, mask=m2, other=0.0).to(tl.float32)
    eG = tl.exp2(G)
    dq1 = dqh * eG * scale
    dkb = -tl.dot(_cast(tl.trans(Tm), False), _cast(dw, False))
    dAk -= tl.dot(_cast(dkb, False), _cast(tl.trans(wt), False))
    X = kt * eG * b[:, None]
    db += tl.sum(dkb * kt * eG, axis=1)
    dki = dkh * tl.exp2(Gl[None, :] - G)
    dk1 = dki + dkb * eG * b[:, None]
    dG1 = qt * dq1 - kt * dki + X * dkb
    dGl = tl.sum(kt * dki, axis=0) + tl.exp2(Gl) * dgl
    dG1 += tl.where(r[:, None] == C - 1, dGl[None, :], 0.0)
    return dq1, dk1, dG1, dAk, db


@triton.jit
def _bwd_intra_terms(
    kb, dq1, dk1, dG1, dAq, dAk, db, q, k, g, beta, Gbuf, dq, dk, dg, T, nval, qk_base, g_base, beta_base, r, m_r,
    b, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BOUNDED: tl.constexpr, DOT_BF16: tl.constexpr,
):
    """Gradients through the gated scores A_qk (dAq, scale folded in) and A_kk (dAk, beta folded
    into the row side), then the reverse cumsum of dG; stores dq, dk, dg of one K-block."""
    cols = kb * BK + tl.arange(0, BK)
    m_c = cols < K
    m2 = m_r[:, None] & m_c[None, :]
    kp = qk_base + r[:, None] * (H * K) + cols[None, :]
    G = _load_G(g + qk_base, r, m_r, cols, m_c, H * K)
    qt = tl.load(q + kp, mask=m2, other=0.0).to(tl.float32)
    kt = tl.load(k + kp, mask=m2, other=0.0).to(tl.float32)
    bk = kt * b[:, None]
    bo = kb * BK
    rq, rk = _rowside2(dAq, dAk, kt, G, k + qk_base + bo, Gbuf + g_base + bo, H * K, nval, tl.arange(0, BK), m_c,
                       BOUNDED, DOT_BF16, C, BC)
    tl.store(dq + kp, (dq1 + rq).to(dq.dtype.element_ty), mask=m2)
    dkt = dk1 + rk * b[:, None]
    db += tl.sum(rk * kt, axis=1)
    dG = dG1 + qt * rq + bk * rk
    cs = _colside_sum(dAq, dAk, qt, bk, G, q + qk_base + bo, k + qk_base + bo, beta + beta_base,
                      Gbuf + g_base + bo, H * K, H, nval, tl.arange(0, BK), m_c, BOUNDED, DOT_BF16, C, BC)
    dkt += cs
    dG -= kt * cs
    dgt = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG
    tl.store(dk + kp, dkt.to(dk.dtype.element_ty), mask=m2)
    tl.store(dg + kp, dgt.to(dg.dtype.element_ty), mask=m2)
    return db
