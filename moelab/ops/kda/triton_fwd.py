"""Forward kernels of chunked KDA: intra-chunk (scores + UT transform), state recurrence, output.

Per head and chunk of ``C`` tokens, with ``G`` the chunk-local cumsum of g (see triton_common):

* ``_kda_fwd_intra`` (grid ``[NT, B*H]``):
  ``A_kk = strict_lower(beta_i sum_d k_id k_jd e^{G_id-G_jd})``,
  ``A_qk = scale * lower(sum_d q_id k_jd e^{G_id-G_jd})`` (stored),
  ``Tm = (I + A_kk)^-1`` by forward substitution on the 16x16 diagonal blocks and a block-row merge,
  ``w = Tm (beta k e^G)`` and ``u = Tm (beta v)`` (stored). ``Tm`` stays in the ``A`` buffer
  (the backward reads it). Also stores ``qg = scale q e^G``, ``kd = k e^{G_last - G}`` and
  ``gl = e^{G_last}`` so the chunk loops below carry no cumsum or exp.
* ``_kda_fwd_state`` (grid ``[cdiv(V, BV), B*H]``, sequential over chunks): stores the state
  ``h_c`` entering each chunk, ``U = u - w h_c`` (the delta-rule corrected values), then
  ``h_{c+1} = e^{G_last} h_c + (k e^{G_last - G})^T U``.
* ``_kda_fwd_out`` (grid ``[NT, B*H]``): ``o = qg h_c + A_qk U``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.ops.kda.triton_common import _cast, _load_G, _scores2


@triton.jit
def _kda_fwd_intra(
    q, k, v, g, beta, Gbuf, Abuf, Aqk, w, u, qg, kd, gl,
    scale, T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BOUNDED: tl.constexpr, STORE_G: tl.constexpr, SCORE_BF16: tl.constexpr,
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
    t0 = i_b * T + i_c * C  # first token of the chunk (unpadded row index)
    tp0 = i_b * Tp + i_c * C  # same in the padded buffers
    qk_base = (t0 * H + i_h) * K
    g_base = (tp0 * H + i_h) * K
    A_base = (tp0 * H + i_h) * C
    v_base = (t0 * H + i_h) * V

    b = tl.load(beta + t0 * H + i_h + r * H, mask=m_r, other=0.0).to(tl.float32)

    S1 = tl.zeros([C, C], dtype=tl.float32)
    S2 = tl.zeros([C, C], dtype=tl.float32)
    for kb in range(tl.cdiv(K, BK)):
        cols = kb * BK + tl.arange(0, BK)
        m_c = cols < K
        G = _load_G(g + qk_base, r, m_r, cols, m_c, H * K)
        if STORE_G:
            # the general-mode gathers below read partner rows of G from here
            tl.store(Gbuf + g_base + r[:, None] * (H * K) + cols[None, :], G, mask=m_c[None, :])
            tl.debug_barrier()
        m2 = m_r[:, None] & m_c[None, :]
        qt = tl.load(q + qk_base + r[:, None] * (H * K) + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        kt = tl.load(k + qk_base + r[:, None] * (H * K) + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        S1, S2 = _scores2(S1, S2, qt, kt, G, k + qk_base + kb * BK, Gbuf + g_base + kb * BK, H * K, nval,
                          tl.arange(0, BK), m_c, BOUNDED, SCORE_BF16, C, BC)

    # selects (not products) keep possible inf of masked bounded-mode lanes out
    Aq = tl.where(r[:, None] >= cidx[None, :], S1 * scale, 0.0)
    Ak = tl.where(r[:, None] > cidx[None, :], S2 * b[:, None], 0.0)
    A_ptrs = r[:, None] * (H * C) + cidx[None, :]
    tl.store(Aqk + A_base + A_ptrs, Aq.to(Aqk.dtype.element_ty))
    tl.store(Abuf + A_base + A_ptrs, Ak)
    tl.debug_barrier()

    # (I + A_kk)^-1 on the 16x16 diagonal blocks, all blocks at once: row s of every block is
    # e_s - sum_{m<s} A_sm Tm_m, with the rows of A read back from the buffer.
    NB: tl.constexpr = C // BC
    ib = tl.arange(0, NB)
    ir = tl.arange(0, BC)
    d_ptrs = (ib[:, None, None] * BC + ir[None, :, None]) * (H * C) + ib[:, None, None] * BC + ir[None, None, :]
    Ti = tl.zeros([NB, BC, BC], dtype=tl.float32)
    for s in range(BC):
        arow = tl.load(Abuf + A_base + (ib[:, None] * BC + s) * (H * C) + ib[:, None] * BC + ir[None, :])
        new = -tl.sum(arow[:, :, None] * Ti, axis=1) + tl.where(ir[None, :] == s, 1.0, 0.0)
        Ti = tl.where(ir[None, :, None] == s, new[:, None, :], Ti)
    tl.debug_barrier()
    tl.store(Abuf + A_base + d_ptrs, Ti)
    tl.debug_barrier()
    # block-row merge: Tm_{I,<I} = -Tm_II (A_{I,<I} Tm_{<I,<I}), rows of Tm above I are final
    for I in tl.static_range(1, NB):
        rI = I * BC + ir
        m_cI = cidx < I * BC
        AI = tl.load(Abuf + A_base + rI[:, None] * (H * C) + cidx[None, :], mask=m_cI[None, :], other=0.0)
        Tprev = tl.load(Abuf + A_base + A_ptrs, mask=(r < I * BC)[:, None], other=0.0)
        TII = tl.load(Abuf + A_base + rI[:, None] * (H * C) + I * BC + ir[None, :])
        X = tl.dot(AI, Tprev, input_precision="ieee")
        Toff = -tl.dot(TII, X, input_precision="ieee")
        tl.debug_barrier()
        tl.store(Abuf + A_base + rI[:, None] * (H * C) + cidx[None, :], Toff, mask=m_cI[None, :])
        tl.debug_barrier()
    Tm = tl.load(Abuf + A_base + A_ptrs)

    # w = Tm (beta k e^G); plus the decayed q and k the state / output kernels use, so that their
    # sequential chunk loops carry no cumsum or exp
    for kb in range(tl.cdiv(K, BK)):
        cols = kb * BK + tl.arange(0, BK)
        m_c = cols < K
        m2 = m_r[:, None] & m_c[None, :]
        p = qk_base + r[:, None] * (H * K) + cols[None, :]
        G = _load_G(g + qk_base, r, m_r, cols, m_c, H * K)
        Gl = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
        kt = tl.load(k + p, mask=m2, other=0.0).to(tl.float32)
        qt = tl.load(q + p, mask=m2, other=0.0).to(tl.float32)
        wt = tl.dot(_cast(Tm, False), _cast(kt * b[:, None] * tl.exp2(G), False))
        tl.store(w + p, wt.to(w.dtype.element_ty), mask=m2)
        tl.store(kd + p, (kt * tl.exp2(Gl[None, :] - G)).to(kd.dtype.element_ty), mask=m2)
        tl.store(qg + p, (qt * tl.exp2(G) * scale).to(qg.dtype.element_ty), mask=m2)
        tl.store(gl + ((i_b * NT + i_c) * H + i_h) * K + cols, tl.exp2(Gl), mask=m_c)
    for vb in range(tl.cdiv(V, BV)):
        cols = vb * BV + tl.arange(0, BV)
        m2 = m_r[:, None] & (cols < V)[None, :]
        vt = tl.load(v + v_base + r[:, None] * (H * V) + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        ut = tl.dot(_cast(Tm, False), _cast(vt * b[:, None], False))
        tl.store(u + v_base + r[:, None] * (H * V) + cols[None, :], ut.to(u.dtype.element_ty), mask=m2)


@triton.jit
def _kda_fwd_state(
    kd, gl, w, u, h0, hbuf, U, hT,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BKP: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    d = tl.arange(0, BKP)
    m_d = d < K
    cv = i_v * BV + tl.arange(0, BV)
    m_v = cv < V
    m_h = m_d[:, None] & m_v[None, :]
    h_ptrs = d[:, None] * V + cv[None, :]
    if HAS_H0:
        h = tl.load(h0 + i_bh * K * V + h_ptrs, mask=m_h, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BKP, BV], dtype=tl.float32)
    for c in range(NT):
        tl.store(hbuf + ((i_b * NT + c) * H + i_h) * K * V + h_ptrs, h.to(hbuf.dtype.element_ty), mask=m_h)
        t0 = i_b * T + c * C
        m_r = r < T - c * C
        m_k = m_r[:, None] & m_d[None, :]
        m_u = m_r[:, None] & m_v[None, :]
        kb_ptrs = (t0 * H + i_h) * K + r[:, None] * (H * K) + d[None, :]
        vb_ptrs = (t0 * H + i_h) * V + r[:, None] * (H * V) + cv[None, :]
        wt = tl.load(w + kb_ptrs, mask=m_k, other=0.0)
        kdt = tl.load(kd + kb_ptrs, mask=m_k, other=0.0)
        ut = tl.load(u + vb_ptrs, mask=m_u, other=0.0).to(tl.float32)
        glt = tl.load(gl + ((i_b * NT + c) * H + i_h) * K + d, mask=m_d, other=0.0)
        Ut = ut - tl.dot(_cast(wt, DOT_BF16), _cast(h, DOT_BF16))
        tl.store(U + vb_ptrs, Ut.to(U.dtype.element_ty), mask=m_u)
        h = h * glt[:, None] + tl.dot(_cast(tl.trans(kdt), DOT_BF16), _cast(Ut, DOT_BF16))
    if STORE_HT:
        tl.store(hT + i_bh * K * V + h_ptrs, h, mask=m_h)


@triton.jit
def _kda_fwd_out(
    qg, Aqk, hbuf, U, o,
    T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BKP: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    d = tl.arange(0, BKP)
    m_d = d < K
    m_r = r < T - i_c * C
    t0 = i_b * T + i_c * C
    tp0 = i_b * NT * C + i_c * C
    qgt = _cast(tl.load(qg + (t0 * H + i_h) * K + r[:, None] * (H * K) + d[None, :],
                        mask=m_r[:, None] & m_d[None, :], other=0.0), DOT_BF16)
    A = _cast(tl.load(Aqk + (tp0 * H + i_h) * C + r[:, None] * (H * C) + cidx[None, :]), DOT_BF16)
    h_base = ((i_b * NT + i_c) * H + i_h) * K * V
    for vb in range(tl.cdiv(V, BV)):
        cv = vb * BV + tl.arange(0, BV)
        m_v = cv < V
        ht = tl.load(hbuf + h_base + d[:, None] * V + cv[None, :], mask=m_d[:, None] & m_v[None, :], other=0.0)
        m_u = m_r[:, None] & m_v[None, :]
        vb_ptrs = (t0 * H + i_h) * V + r[:, None] * (H * V) + cv[None, :]
        Ut = tl.load(U + vb_ptrs, mask=m_u, other=0.0)
        ot = tl.dot(qgt, _cast(ht, DOT_BF16)) + tl.dot(A, _cast(Ut, DOT_BF16))
        tl.store(o + vb_ptrs, ot.to(o.dtype.element_ty), mask=m_u)
