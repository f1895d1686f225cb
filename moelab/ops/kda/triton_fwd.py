"""Forward kernels of chunked KDA: intra-chunk (scores + UT transform), state recurrence, output.

Per head and chunk of ``C`` tokens, with ``G`` the chunk-local cumsum of g (see triton_common):

* ``_kda_fwd_kkt`` + ``_kda_fwd_wu`` (the default, ``TUNING["scores"] = "tiles"``; grid ``[NT, B*H]``
  each): the same outputs as ``_kda_fwd_intra`` below, with the scores and the solve on 16-row
  sub-tile pairs in ``kkt`` (see its docstring) and the chunk-wide w, u, qg, kd products in ``wu``.
* ``_kda_fwd_intra`` (grid ``[NT, B*H]``, ``TUNING["scores"] = "chunk"``):
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

from moelab.ops.kda.triton_common import _cast, _dot, _load_G, _scores2

# Shapes are padded (triton_common): no masks. Scalar base pointers advance by int64 scalars
# (B*T*H*K can pass 2^31); tile offsets stay int32 (int64 tile arithmetic costs registers).


@triton.jit
def _kda_fwd_scores(
    q, k, g, beta, Abuf, Aqk,
    scale, T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
    BOUNDED: tl.constexpr, SCORE_BF16: tl.constexpr, IEEE: tl.constexpr,
):
    """Gated scores of one ``BC``-row sub-tile ``I`` of a chunk (grid ``[NT * C // BC, B*H]``),
    all of K at once: rows ``I`` of ``A_qk = scale lower(S(q, k))`` (``Aqk``) and
    ``A_kk = beta strict_lower(S(k, k))`` (``Abuf``, fp32), zeros right of the diagonal sub-tile.

    ``S(a, b)_ij = sum_d a_id b_jd e^{G_id - G_jd}``: for sub-tiles ``J < I`` one product on
    ``a_I e^{G_I - gn}`` and ``b_J e^{gn - G_J}`` with ``gn`` = G at the first row of ``I`` (both
    factors <= 1 whatever g is); the diagonal sub-tile as in ``_scores2`` (bounded: midpoint-shifted
    factors, one product; general: element-wise per pair). Every tile is ``[BC, K]``.
    """
    i_ci = tl.program_id(0)
    i_bh = tl.program_id(1)
    NC: tl.constexpr = C // BC
    i_c = i_ci // NC
    i_i = i_ci % NC
    i_b = i_bh // H
    i_h = i_bh % H
    rc = tl.arange(0, BC)
    cols = tl.arange(0, K)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    q += row0 * K
    k += row0 * K
    g += row0 * K
    beta += row0
    Abuf += row0 * C
    Aqk += row0 * C
    rI = i_i * BC + rc
    pI = rI[:, None] * (H * K) + cols[None, :]
    # G (log2 units) before sub-tile I: the block sums of the sub-tiles before it, in order
    offI = tl.zeros([K], dtype=tl.float32)
    for J in range(0, i_i):
        offI += tl.sum(tl.load(g + (J * BC + rc)[:, None] * (H * K) + cols[None, :]).to(tl.float32), axis=0)
    offI = offI * 1.4426950408889634
    GI = offI[None, :] + tl.cumsum(tl.load(g + pI).to(tl.float32) * 1.4426950408889634, axis=0)
    qI = tl.load(q + pI).to(tl.float32)
    kI = tl.load(k + pI).to(tl.float32)
    bI = tl.load(beta + rI * H).to(tl.float32)
    sA = rI[:, None] * (H * C)  # rows I of the [C, C] score buffers

    gn = tl.sum(tl.where((rc == 0)[:, None], GI, 0.0), axis=0)
    fI = tl.exp2(GI - gn[None, :])
    qf = _cast(qI * fI, SCORE_BF16)
    kf = _cast(kI * fI, SCORE_BF16)
    offJ = tl.zeros([K], dtype=tl.float32)
    for J in range(0, i_i):
        pJ = (J * BC + rc)[:, None] * (H * K) + cols[None, :]
        gJ = tl.load(g + pJ).to(tl.float32) * 1.4426950408889634
        GJ = offJ[None, :] + tl.cumsum(gJ, axis=0)
        offJ += tl.sum(gJ, axis=0)
        kJT = tl.trans(_cast(tl.load(k + pJ).to(tl.float32) * tl.exp2(gn[None, :] - GJ), SCORE_BF16))
        cJ = J * BC + rc
        tl.store(Aqk + sA + cJ[None, :], (_dot(qf, kJT, IEEE) * scale).to(Aqk.dtype.element_ty))
        tl.store(Abuf + sA + cJ[None, :], _dot(kf, kJT, IEEE) * bI[:, None])

    lower = rc[:, None] >= rc[None, :]
    if BOUNDED:
        Gm = tl.sum(tl.where((rc == BC // 2 - 1)[:, None], GI, 0.0), axis=0)
        up = tl.exp2(GI - Gm[None, :])
        kdT = tl.trans(_cast(kI * tl.exp2(Gm[None, :] - GI), SCORE_BF16))
        s1 = _dot(_cast(qI * up, SCORE_BF16), kdT, IEEE)
        s2 = _dot(_cast(kI * up, SCORE_BF16), kdT, IEEE)
    else:
        s1 = tl.zeros([BC, BC], dtype=tl.float32)
        s2 = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(BC):
            kj = tl.load(k + (i_i * BC + j) * (H * K) + cols).to(tl.float32)
            Gj = tl.sum(tl.where((rc == j)[:, None], GI, 0.0), axis=0)
            kje = kj[None, :] * tl.exp2(tl.where((rc >= j)[:, None], GI - Gj[None, :], float("-inf")))
            hit = rc[None, :] == j
            s1 += tl.where(hit, tl.sum(qI * kje, axis=1)[:, None], 0.0)
            s2 += tl.where(hit, tl.sum(kI * kje, axis=1)[:, None], 0.0)
    # selects, not products: bounded-mode lanes above the diagonal may hold inf
    dI = sA + rI[None, :]
    tl.store(Aqk + dI, tl.where(lower, s1 * scale, 0.0).to(Aqk.dtype.element_ty))
    tl.store(Abuf + dI, tl.where(rc[:, None] > rc[None, :], s2 * bI[:, None], 0.0))
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    for J in range(i_i + 1, NC):
        cJ = J * BC + rc
        tl.store(Aqk + sA + cJ[None, :], zero.to(Aqk.dtype.element_ty))
        tl.store(Abuf + sA + cJ[None, :], zero)


@triton.jit
def _kda_fwd_intra(
    q, k, v, g, beta, Gbuf, Abuf, Aqk, w, u, qg, kd, gl,
    scale, T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BOUNDED: tl.constexpr, STORE_G: tl.constexpr, SCORE_BF16: tl.constexpr, IEEE: tl.constexpr,
    SCORES: tl.constexpr,
):
    """See the module docstring. ``SCORES=False``: ``A_kk`` (in ``Abuf``) and ``A_qk`` were
    written by ``_kda_fwd_scores``; this kernel then does the UT transform, w, u, qg, kd, gl."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h  # (token, head) row of the chunk's first token
    q += row0 * K
    k += row0 * K
    g += row0 * K
    w += row0 * K
    qg += row0 * K
    kd += row0 * K
    Gbuf += row0 * K
    v += row0 * V
    u += row0 * V
    beta += row0
    Abuf += row0 * C
    Aqk += row0 * C
    gl += ((i_b * (T // C) + i_c).to(tl.int64) * H + i_h) * K  # [B, NT, H, K]

    b = tl.load(beta + r * H).to(tl.float32)

    A_ptrs = r[:, None] * (H * C) + cidx[None, :]
    if SCORES:
        S1 = tl.zeros([C, C], dtype=tl.float32)
        S2 = tl.zeros([C, C], dtype=tl.float32)
        for kb in range(K // BK):
            cols = kb * BK + tl.arange(0, BK)
            p = r[:, None] * (H * K) + cols[None, :]
            G = _load_G(g, r, cols, H * K)
            if STORE_G:
                # the general-mode gathers below read partner rows of G from here
                tl.store(Gbuf + p, G)
                tl.debug_barrier()
            qt = tl.load(q + p).to(tl.float32)
            kt = tl.load(k + p).to(tl.float32)
            S1, S2 = _scores2(S1, S2, qt, kt, G, k + kb * BK, Gbuf + kb * BK, H * K, BOUNDED, SCORE_BF16, IEEE, C, BC,
                              BK)
        # selects (not products) keep possible inf of masked bounded-mode lanes out
        Aq = tl.where(r[:, None] >= cidx[None, :], S1 * scale, 0.0)
        Ak = tl.where(r[:, None] > cidx[None, :], S2 * b[:, None], 0.0)
        tl.store(Aqk + A_ptrs, Aq.to(Aqk.dtype.element_ty))
        tl.store(Abuf + A_ptrs, Ak)
        tl.debug_barrier()
    elif STORE_G:
        for kb in range(K // BK):  # the backward's general-mode gathers read G from here
            cols = kb * BK + tl.arange(0, BK)
            tl.store(Gbuf + r[:, None] * (H * K) + cols[None, :], _load_G(g, r, cols, H * K))

    # (I + A_kk)^-1 on the 16x16 diagonal blocks, all blocks at once: row s of every block is
    # e_s - sum_{m<s} A_sm Tm_m, with the rows of A read back from the buffer.
    NB: tl.constexpr = C // BC
    ib = tl.arange(0, NB)
    ir = tl.arange(0, BC)
    d_ptrs = (ib[:, None, None] * BC + ir[None, :, None]) * (H * C) + ib[:, None, None] * BC + ir[None, None, :]
    Ti = tl.zeros([NB, BC, BC], dtype=tl.float32)
    for s in range(BC):
        arow = tl.load(Abuf + (ib[:, None] * BC + s) * (H * C) + ib[:, None] * BC + ir[None, :])
        new = -tl.sum(arow[:, :, None] * Ti, axis=1) + tl.where(ir[None, :] == s, 1.0, 0.0)
        Ti = tl.where(ir[None, :, None] == s, new[:, None, :], Ti)
    tl.debug_barrier()
    tl.store(Abuf + d_ptrs, Ti)
    tl.debug_barrier()
    # block-row merge, block row bi: Tm_{bi,<bi} = -Tm_{bi,bi} (A_{bi,<bi} Tm_{<bi,<bi}); rows above are final
    for bi in tl.static_range(1, NB):
        rI = bi * BC + ir
        AI = tl.load(Abuf + rI[:, None] * (H * C) + cidx[None, :])
        AI = tl.where(cidx[None, :] < bi * BC, AI, 0.0)
        Tprev = tl.where((r < bi * BC)[:, None], tl.load(Abuf + A_ptrs), 0.0)
        TII = tl.load(Abuf + rI[:, None] * (H * C) + bi * BC + ir[None, :])
        X = tl.dot(AI, Tprev, input_precision="ieee")
        Toff = -tl.dot(TII, X, input_precision="ieee")
        tl.debug_barrier()
        tl.store(Abuf + rI[:, None] * (H * C) + cidx[None, :], Toff, mask=(cidx < bi * BC)[None, :])
        tl.debug_barrier()
    Tm = tl.load(Abuf + A_ptrs)

    # w = Tm (beta k e^G); plus the decayed q and k the state / output kernels use, so that their
    # sequential chunk loops carry no cumsum or exp
    for kb in range(K // BK):
        cols = kb * BK + tl.arange(0, BK)
        p = r[:, None] * (H * K) + cols[None, :]
        G = _load_G(g, r, cols, H * K)
        Gl = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
        kt = tl.load(k + p).to(tl.float32)
        qt = tl.load(q + p).to(tl.float32)
        wt = _dot(_cast(Tm, False), _cast(kt * b[:, None] * tl.exp2(G), False), IEEE)
        tl.store(w + p, wt.to(w.dtype.element_ty))
        tl.store(kd + p, (kt * tl.exp2(Gl[None, :] - G)).to(kd.dtype.element_ty))
        tl.store(qg + p, (qt * tl.exp2(G) * scale).to(qg.dtype.element_ty))
        tl.store(gl + cols, tl.exp2(Gl))
    for vb in range(V // BV):
        cols = vb * BV + tl.arange(0, BV)
        p = r[:, None] * (H * V) + cols[None, :]
        vt = tl.load(v + p).to(tl.float32)
        ut = _dot(_cast(Tm, False), _cast(vt * b[:, None], False), IEEE)
        tl.store(u + p, ut.to(u.dtype.element_ty))


@triton.jit
def _kda_fwd_state(
    kd, gl, w, u, h0, hbuf, U, hT,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    NT = T // C
    r = tl.arange(0, C)
    d = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    h_ptrs = d[:, None] * V + cv[None, :]
    row0 = (i_b * T).to(tl.int64) * H + i_h
    kd += row0 * K
    w += row0 * K
    u += row0 * V
    U += row0 * V
    gl += ((i_b * NT).to(tl.int64) * H + i_h) * K
    hbuf += ((i_b * NT).to(tl.int64) * H + i_h) * K * V
    k_ptrs = r[:, None] * (H * K) + d[None, :]
    v_ptrs = r[:, None] * (H * V) + cv[None, :]
    if HAS_H0:
        h = tl.load(h0 + i_bh.to(tl.int64) * K * V + h_ptrs).to(tl.float32)
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    for _ in range(NT):
        tl.store(hbuf + h_ptrs, h.to(hbuf.dtype.element_ty))
        wt = tl.load(w + k_ptrs)
        kdt = tl.load(kd + k_ptrs)
        ut = tl.load(u + v_ptrs).to(tl.float32)
        glt = tl.load(gl + d)
        Ut = ut - _dot(_cast(wt, DOT_BF16), _cast(h, DOT_BF16), IEEE)
        tl.store(U + v_ptrs, Ut.to(U.dtype.element_ty))
        h = h * glt[:, None] + _dot(_cast(tl.trans(kdt), DOT_BF16), _cast(Ut, DOT_BF16), IEEE)
        kd += C * H * K
        w += C * H * K
        u += C * H * V
        U += C * H * V
        gl += H * K
        hbuf += H * K * V
    if STORE_HT:
        tl.store(hT + i_bh.to(tl.int64) * K * V + h_ptrs, h)


@triton.jit
def _kda_fwd_out(
    qg, Aqk, hbuf, U, o,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    d = tl.arange(0, K)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    qg += row0 * K
    U += row0 * V
    o += row0 * V
    Aqk += row0 * C
    hbuf += ((i_b * (T // C) + i_c).to(tl.int64) * H + i_h) * K * V
    qgt = _cast(tl.load(qg + r[:, None] * (H * K) + d[None, :]), DOT_BF16)
    A = _cast(tl.load(Aqk + r[:, None] * (H * C) + cidx[None, :]), DOT_BF16)
    for vb in range(V // BV):
        cv = vb * BV + tl.arange(0, BV)
        ht = tl.load(hbuf + d[:, None] * V + cv[None, :])
        v_ptrs = r[:, None] * (H * V) + cv[None, :]
        Ut = tl.load(U + v_ptrs)
        ot = _dot(qgt, _cast(ht, DOT_BF16), IEEE) + _dot(A, _cast(Ut, DOT_BF16), IEEE)
        tl.store(o + v_ptrs, ot.to(o.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Sub-tile intra path (TUNING["scores"] = "tiles"): the intra kernel's work on 16-row sub-tiles.
# ``_kda_fwd_kkt`` forms every (I, J) sub-tile pair of the scores with its own product (no
# masked halves), solves (I + A_kk)^-1 in registers and writes G; ``_kda_fwd_wu`` then does the
# chunk-wide w, u, qg, kd products. Same outputs as ``_kda_fwd_intra``.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _g_tile(g, rows, cols, stride):
    """A ``[BC, BK]`` tile of the log decay ``g`` (natural log), as fp32."""
    return tl.load(g + rows[:, None] * stride + cols[None, :]).to(tl.float32)


@triton.jit
def _sub_G(g, off, rows, cols, stride):
    """One ``[BC, BK]`` sub-tile of G (log2 units): ``off`` (G before the sub-tile, ``[BK]``) plus
    the cumsum of its log decay (``_g_tile``); returns G and the offset after the sub-tile."""
    gt = _g_tile(g, rows, cols, stride) * 1.4426950408889634
    return off[None, :] + tl.cumsum(gt, axis=0), off + tl.sum(gt, axis=0)


@triton.jit
def _pair(aq, ak, qf, kf, kJ, GJ, offI, SCORE_BF16: tl.constexpr, IEEE: tl.constexpr):
    """Add one K-block of the off-diagonal pair (I, J < I): ``qf = q_I e^{G_I - offI}``,
    ``kf = k_I e^{G_I - offI}`` (cast), partner ``k_J e^{offI - G_J}``; every factor <= 1."""
    kT = tl.trans(_cast(kJ * tl.exp2(offI[None, :] - GJ), SCORE_BF16))
    return aq + _dot(qf, kT, IEEE), ak + _dot(kf, kT, IEEE)


@triton.jit
def _diag(aq, ak, qI, kI, GI, offI, mid, BOUNDED: tl.constexpr, SCORE_BF16: tl.constexpr,
          IEEE: tl.constexpr, BC: tl.constexpr):
    """Add one K-block of the diagonal pair (I, I). Bounded: one product on ``x e^{G - ref}`` and
    ``k e^{ref - G}`` with ``ref = offI + mid`` (``mid = BC/2 * lower_bound`` in log2 units, the
    middle of the range G can span in the sub-tile), so every exponent is within
    ``BC/2 * |lower_bound|``. General: element-wise ``e^{G_i - G_j}``, masked to -inf for ``j > i``
    before ``exp2``."""
    if BOUNDED:
        e = GI - (offI[None, :] + mid)
        kT = tl.trans(_cast(kI * tl.exp2(-e), SCORE_BF16))
        up = tl.exp2(e)
        aq += _dot(_cast(qI * up, SCORE_BF16), kT, IEEE)
        ak += _dot(_cast(kI * up, SCORE_BF16), kT, IEEE)
    else:
        rc = tl.arange(0, BC)
        for j in range(BC):
            sel = rc[:, None] == j
            kj = tl.sum(tl.where(sel, kI, 0.0), axis=0)
            Gj = tl.sum(tl.where(sel, GI, 0.0), axis=0)
            kje = kj[None, :] * tl.exp2(tl.where((rc >= j)[:, None], GI - Gj[None, :], float("-inf")))
            hit = rc[None, :] == j
            aq += tl.where(hit, tl.sum(qI * kje, axis=1)[:, None], 0.0)
            ak += tl.where(hit, tl.sum(kI * kje, axis=1)[:, None], 0.0)
    return aq, ak


@triton.jit
def _tri_inv(A, BC: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower ``[BC, BC]`` fp32 tile, by forward substitution:
    row s is ``e_s - sum_{m<s} A_sm row_m``."""
    rc = tl.arange(0, BC)
    Ti = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for s in range(1, BC):
        a = tl.sum(tl.where(rc[:, None] == s, A, 0.0), axis=0)
        new = tl.where(rc == s, 1.0, 0.0) - tl.sum(a[:, None] * Ti, axis=0)
        Ti = tl.where(rc[:, None] == s, new[None, :], Ti)
    return Ti


@triton.jit
def _mm(a, b):
    """Exact fp32 product of two small fp32 tiles (the solve's merge)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _st(ptr, rows, cols, x, stride):
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def _tri_inv_mem(A, Ad, rc, SA: tl.constexpr, BC: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower ``[BC, BC]`` fp32 tile by forward substitution, with the
    rows of ``A`` read back from memory (``Ad``: the tile's place in ``Abuf``, written here first):
    a loaded row comes in the layout the update broadcasts it in, where a row cut out of the
    register tile would need a reduction and a layout change at each of the ``BC - 1`` steps."""
    tl.store(Ad + rc[:, None] * SA + rc[None, :], A)
    tl.debug_barrier()
    Ti = tl.where(rc[:, None] == rc[None, :], 1.0, 0.0)
    for s in range(1, BC):
        a = tl.load(Ad + s * SA + rc)
        new = tl.where(rc == s, 1.0, 0.0) - tl.sum(tl.where(rc < s, a, 0.0)[:, None] * Ti, axis=0)
        Ti = tl.where(rc[:, None] == s, new[None, :], Ti)
    tl.debug_barrier()
    return Ti


@triton.jit
def _kkt_ptrs(q, k, g, Gbuf, beta, Abuf, Aqk, i_c, i_bh, T, H: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """The kkt kernels' pointers moved to row 0 of chunk ``i_c`` of head ``i_bh``."""
    row0 = ((i_bh // H) * T + i_c * C).to(tl.int64) * H + i_bh % H
    return (q + row0 * K, k + row0 * K, g + row0 * K, Gbuf + row0 * K, beta + row0, Abuf + row0 * C,
            Aqk + row0 * C)


@triton.jit
def _kda_fwd_kkt(
    q, k, g, beta, Gbuf, Abuf, Aqk,
    scale, mid, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BOUNDED: tl.constexpr, SCORE_BF16: tl.constexpr, IEEE: tl.constexpr,
):
    """Scores, ``(I + A_kk)^-1`` and G of one chunk (grid ``[NT, B*H]``), one ``BC``-row sub-tile
    row ``I`` after the other on ``[BC, BK]`` / ``[BC, BC]`` tiles (``C // BC`` = 1, 2 or 4).

    Row I, per K-block: G_I (= G before the sub-tile, read back from ``Gbuf``, plus the cumsum of
    its g; log2 units) is written to ``Gbuf``; the diagonal pair as in ``_diag``; pairs J < I take
    both factors relative to ``offI``, G just before sub-tile I (``e^{G_I - offI} <= 1``,
    ``e^{offI - G_J} <= 1`` whatever g is), with k_J and G_J read back. Then
    ``Aqk = scale lower(S(q, k))``, ``Tm_II = (I + A_II)^-1`` by forward substitution and
    ``Tm_IJ = -Tm_II sum_{J <= M < I} A_IM Tm_MJ`` (rows M < I read back from ``Abuf``), fp32,
    zeros above the diagonal blocks.
    """
    NC: tl.constexpr = C // BC
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    q, k, g, Gbuf, beta, Abuf, Aqk = _kkt_ptrs(q, k, g, Gbuf, beta, Abuf, Aqk, i_c, i_bh, T, H, K, C)
    SK: tl.constexpr = H * K
    SA: tl.constexpr = H * C
    rc = tl.arange(0, BC)
    low = rc[:, None] >= rc[None, :]
    slow = rc[:, None] > rc[None, :]
    zt = tl.zeros([BC, BC], dtype=tl.float32)
    for si in tl.static_range(NC):
        rI = si * BC + rc
        bI = tl.load(beta + rI * H).to(tl.float32)
        dq, dk = zt, zt
        q0, k0, q1, k1, q2, k2 = zt, zt, zt, zt, zt, zt
        for kb in range(K // BK):
            cols = kb * BK + tl.arange(0, BK)
            pI = rI[:, None] * SK + cols[None, :]
            if si == 0:
                off = tl.zeros([BK], dtype=tl.float32)
            else:
                off = tl.load(Gbuf + (si * BC - 1) * SK + cols)
            GI, _ = _sub_G(g, off, rI, cols, SK)
            tl.store(Gbuf + pI, GI)
            xI = tl.load(q + pI).to(tl.float32)
            yI = tl.load(k + pI).to(tl.float32)
            dq, dk = _diag(dq, dk, xI, yI, GI, off, mid, BOUNDED, SCORE_BF16, IEEE, BC)
            if si > 0:
                f = tl.exp2(GI - off[None, :])
                qf = _cast(xI * f, SCORE_BF16)
                kf = _cast(yI * f, SCORE_BF16)
                for J in tl.static_range(si):
                    pJ = (J * BC + rc)[:, None] * SK + cols[None, :]
                    yJ = tl.load(k + pJ).to(tl.float32)
                    GJ = tl.load(Gbuf + pJ)
                    if J == 0:
                        q0, k0 = _pair(q0, k0, qf, kf, yJ, GJ, off, SCORE_BF16, IEEE)
                    elif J == 1:
                        q1, k1 = _pair(q1, k1, qf, kf, yJ, GJ, off, SCORE_BF16, IEEE)
                    else:
                        q2, k2 = _pair(q2, k2, qf, kf, yJ, GJ, off, SCORE_BF16, IEEE)
        _st(Aqk, rI, rI, tl.where(low, dq * scale, 0.0), SA)
        for J in tl.static_range(si + 1, NC):
            _st(Aqk, rI, J * BC + rc, zt, SA)
            _st(Abuf, rI, J * BC + rc, zt, SA)
        if si > 0:
            _st(Aqk, rI, rc, q0 * scale, SA)
        if si > 1:
            _st(Aqk, rI, BC + rc, q1 * scale, SA)
        if si > 2:
            _st(Aqk, rI, 2 * BC + rc, q2 * scale, SA)
        # (the barrier in _tri_inv_mem also makes this row's G visible to the next rows)
        TII = _tri_inv_mem(tl.where(slow, dk * bI[:, None], 0.0), Abuf + si * BC * SA + si * BC, rc, SA, BC)
        # block-row merge: Tm_IJ = -Tm_II sum_{J <= M < I} A_IM Tm_MJ, Tm_MJ of earlier rows from Abuf
        for J in tl.static_range(si):
            rJ = J * BC + rc
            acc = zt
            for M in tl.static_range(J, si):
                TMJ = tl.load(Abuf + (M * BC + rc)[:, None] * SA + rJ[None, :])
                if M == 0:
                    acc += _mm(k0 * bI[:, None], TMJ)
                elif M == 1:
                    acc += _mm(k1 * bI[:, None], TMJ)
                else:
                    acc += _mm(k2 * bI[:, None], TMJ)
            _st(Abuf, rI, rJ, -_mm(TII, acc), SA)
        _st(Abuf, rI, rI, TII, SA)
        tl.debug_barrier()  # row si of Tm is in Abuf


@triton.jit
def _kda_fwd_kkt_row(
    q, k, g, beta, Gbuf, Abuf, Aqk,
    scale, mid, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BOUNDED: tl.constexpr, SCORE_BF16: tl.constexpr, IEEE: tl.constexpr, G_IN: tl.constexpr = False,
):
    """One ``BC``-row sub-tile row ``si`` of a chunk (grid ``[NT * C // BC, B*H]``): G_si into
    ``Gbuf``, row si of ``Aqk``, the diagonal block ``Tm_ii = (I + A_ii)^-1`` and, as scratch for
    ``_kda_fwd_merge``, the off-diagonal blocks ``A_kk[si, J]`` (beta included, fp32) in ``Abuf``.

    The rows of a chunk run in parallel programs: a row recomputes the G of its partner sub-tiles
    from g (the chunk's earlier g rows, read twice from cache) instead of waiting for them.
    ``G_IN``: ``g`` already holds G (``triton_prep.prep_fwd_chunked``): no cumsum, and ``Gbuf`` is
    not written. Factors as in ``_kda_fwd_kkt`` (reference: G just before sub-tile si)."""
    NC: tl.constexpr = C // BC
    i_ci = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_c = i_ci // NC
    si = i_ci % NC
    q, k, g, Gbuf, beta, Abuf, Aqk = _kkt_ptrs(q, k, g, Gbuf, beta, Abuf, Aqk, i_c, i_bh, T, H, K, C)
    SK: tl.constexpr = H * K
    SA: tl.constexpr = H * C
    rc = tl.arange(0, BC)
    rI = si * BC + rc
    zt = tl.zeros([BC, BC], dtype=tl.float32)
    dq = zt
    dk = zt
    q0, k0, q1, k1, q2, k2 = zt, zt, zt, zt, zt, zt
    for kb in range(K // BK):
        cols = kb * BK + tl.arange(0, BK)
        pI = rI[:, None] * SK + cols[None, :]
        if G_IN:
            off = tl.load(g + tl.maximum(si * BC - 1, 0) * SK + cols)  # G at the row before sub-tile si
            off = tl.where(si > 0, off, 0.0)
            GI = tl.load(g + pI)
        else:
            off = tl.zeros([BK], dtype=tl.float32)
            for J in range(si):
                off += tl.sum(_g_tile(g, J * BC + rc, cols, SK), axis=0)
            off = off * 1.4426950408889634
            GI, _ = _sub_G(g, off, rI, cols, SK)
            tl.store(Gbuf + pI, GI)
        xI = tl.load(q + pI).to(tl.float32)
        yI = tl.load(k + pI).to(tl.float32)
        dq, dk = _diag(dq, dk, xI, yI, GI, off, mid, BOUNDED, SCORE_BF16, IEEE, BC)
        f = tl.exp2(GI - off[None, :])
        qf = _cast(xI * f, SCORE_BF16)
        kf = _cast(yI * f, SCORE_BF16)
        offJ = tl.zeros([BK], dtype=tl.float32)
        for J in tl.static_range(NC - 1):
            if J < si:
                pJ = (J * BC + rc)[:, None] * SK + cols[None, :]
                if G_IN:
                    GJ = tl.load(g + pJ)
                else:
                    GJ, offJ = _sub_G(g, offJ, J * BC + rc, cols, SK)
                yJ = tl.load(k + pJ).to(tl.float32)
                if J == 0:
                    q0, k0 = _pair(q0, k0, qf, kf, yJ, GJ, off, SCORE_BF16, IEEE)
                elif J == 1:
                    q1, k1 = _pair(q1, k1, qf, kf, yJ, GJ, off, SCORE_BF16, IEEE)
                else:
                    q2, k2 = _pair(q2, k2, qf, kf, yJ, GJ, off, SCORE_BF16, IEEE)
    bI = tl.load(beta + rI * H).to(tl.float32)
    _st(Aqk, rI, rI, tl.where(rc[:, None] >= rc[None, :], dq * scale, 0.0), SA)
    for J in tl.static_range(NC):
        if J < si:
            if J == 0:
                _st(Aqk, rI, rc, q0 * scale, SA)
                _st(Abuf, rI, rc, k0 * bI[:, None], SA)
            elif J == 1:
                _st(Aqk, rI, BC + rc, q1 * scale, SA)
                _st(Abuf, rI, BC + rc, k1 * bI[:, None], SA)
            else:
                _st(Aqk, rI, 2 * BC + rc, q2 * scale, SA)
                _st(Abuf, rI, 2 * BC + rc, k2 * bI[:, None], SA)
        if J > si:
            _st(Aqk, rI, J * BC + rc, zt, SA)
            _st(Abuf, rI, J * BC + rc, zt, SA)
    TII = _tri_inv_mem(tl.where(rc[:, None] > rc[None, :], dk * bI[:, None], 0.0), Abuf + si * BC * SA + si * BC,
                       rc, SA, BC)
    _st(Abuf, rI, rI, TII, SA)


@triton.jit
def _kda_fwd_merge(
    Abuf, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
):
    """Block-row merge of one chunk (grid ``[NT, B*H]``), in place in ``Abuf``:
    ``Tm_IJ = -Tm_II sum_{J <= M < I} A_IM Tm_MJ`` over J ascending (so the ``A_IM`` still to be
    read, M >= J, are not yet overwritten), rows after one another (rows M < I final)."""
    NC: tl.constexpr = C // BC
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    Abuf += row0 * C
    SA: tl.constexpr = H * C
    rc = tl.arange(0, BC)
    for si in tl.static_range(1, NC):
        rI = si * BC + rc
        TII = tl.load(Abuf + rI[:, None] * SA + rI[None, :])
        A0 = tl.load(Abuf + rI[:, None] * SA + rc[None, :])
        A1 = A0
        A2 = A0
        if si > 1:
            A1 = tl.load(Abuf + rI[:, None] * SA + (BC + rc)[None, :])
        if si > 2:
            A2 = tl.load(Abuf + rI[:, None] * SA + (2 * BC + rc)[None, :])
        tl.debug_barrier()
        for J in tl.static_range(si):
            rJ = J * BC + rc
            acc = tl.zeros([BC, BC], dtype=tl.float32)
            for M in tl.static_range(J, si):
                TMJ = tl.load(Abuf + (M * BC + rc)[:, None] * SA + rJ[None, :])
                if M == 0:
                    acc += _mm(A0, TMJ)
                elif M == 1:
                    acc += _mm(A1, TMJ)
                else:
                    acc += _mm(A2, TMJ)
            _st(Abuf, rI, rJ, -_mm(TII, acc), SA)
        tl.debug_barrier()  # row si of Tm is final


@triton.jit
def _kda_fwd_wu(
    q, k, v, Gbuf, beta, Abuf, w, u, qg, kd, gl,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IEEE: tl.constexpr, WU_BF16: tl.constexpr = False,
):
    """``w = Tm (beta k e^G)``, ``u = Tm (beta v)``, ``qg = scale q e^G``, ``kd = k e^{G_last - G}``,
    ``gl = e^{G_last}`` of one chunk (grid ``[NT, B*H]``), from G and Tm written by ``_kda_fwd_kkt``.
    ``WU_BF16``: bf16 operands (Tm rounded to bf16) for the w and u products instead of TF32."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    cidx = tl.arange(0, C)
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    q += row0 * K
    k += row0 * K
    Gbuf += row0 * K
    w += row0 * K
    qg += row0 * K
    kd += row0 * K
    v += row0 * V
    u += row0 * V
    beta += row0
    Abuf += row0 * C
    gl += ((i_b * (T // C) + i_c).to(tl.int64) * H + i_h) * K
    b = tl.load(beta + r * H).to(tl.float32)
    Tm = _cast(tl.load(Abuf + r[:, None] * (H * C) + cidx[None, :]), WU_BF16)
    for kb in range(K // BK):
        cols = kb * BK + tl.arange(0, BK)
        p = r[:, None] * (H * K) + cols[None, :]
        G = tl.load(Gbuf + p)
        Gl = tl.load(Gbuf + (C - 1) * (H * K) + cols)
        kt = tl.load(k + p).to(tl.float32)
        qt = tl.load(q + p).to(tl.float32)
        eG = tl.exp2(G)
        wt = _dot(Tm, _cast(kt * b[:, None] * eG, WU_BF16), IEEE)
        tl.store(w + p, wt.to(w.dtype.element_ty))
        tl.store(kd + p, (kt * tl.exp2(Gl[None, :] - G)).to(kd.dtype.element_ty))
        tl.store(qg + p, (qt * eG * scale).to(qg.dtype.element_ty))
        tl.store(gl + cols, tl.exp2(Gl))
    for vb in range(V // BV):
        cols = vb * BV + tl.arange(0, BV)
        p = r[:, None] * (H * V) + cols[None, :]
        vt = tl.load(v + p).to(tl.float32)
        ut = _dot(Tm, _cast(vt * b[:, None], WU_BF16), IEEE)
        tl.store(u + p, ut.to(u.dtype.element_ty))
