"""Forward kernels of chunked KDA: intra-chunk (scores + UT transform), state recurrence, output.

Per head and chunk of ``C`` tokens, with ``G`` the chunk-local cumsum of g (see triton_common) and
16-row sub-tiles ``I``, ``J`` of the chunk:

* ``_kda_fwd_kkt_row`` (grid ``[NT * C // 16, B*H]``): one sub-tile row ``I`` per program: every
  (I, J <= I) pair of the gated scores as its own ``[16, BK] x [BK, 16]`` product,
  ``A_qk = scale * lower(sum_d q_id k_jd e^{G_id-G_jd})`` (stored),
  ``A_kk = strict_lower(beta_i sum_d k_id k_jd e^{G_id-G_jd})`` and the diagonal block
  ``Tm_II = (I + A_II)^-1`` by forward substitution;
* ``_kda_fwd_merge`` (grid ``[NT, B*H]``): the block-row merge that completes
  ``Tm = (I + A_kk)^-1`` in place (``Tm`` stays in the ``A`` buffer; the backward reads it);
* ``_kda_fwd_wu`` (grid ``[NT, B*H]``): ``w = Tm (beta k e^G)``, ``u = Tm (beta v)`` and the
  decayed ``qg = scale q e^G``, ``kd = k e^{G_last - G}``, ``gl = e^{G_last}``, so the chunk loops
  below carry no cumsum or exp;
* ``_kda_fwd_intra`` (grid ``[NT, B*H]``, ``intra="fused"`` of ``triton_chunk.VARIANTS``): the three kernels above
  in one program per chunk, the same outputs;
* ``_kda_fwd_state`` (grid ``[cdiv(V, BV), B*H]``, or ``[cdiv(V, BV), N*H]`` over packed documents
  with ``VARLEN``, sequential over chunks): stores the state
  ``h_c`` entering each chunk, ``U = u - w h_c`` (the delta-rule corrected values), then
  ``h_{c+1} = e^{G_last} h_c + (k e^{G_last - G})^T U``;
* ``_kda_fwd_out`` (grid ``[NT, B*H]``): ``o = qg h_c + A_qk U``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.ops.kda.triton_common import _cast, _dot

# Shapes are padded (triton_common): no masks. Scalar base pointers advance by int64 scalars
# (B*T*H*K can pass 2^31); tile offsets stay int32 (int64 tile arithmetic costs registers).


@triton.jit
def _kda_fwd_state(
    kd, gl, w, u, h0, hbuf, U, hT, coff,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
    VARLEN: tl.constexpr,
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
    if VARLEN:  # one packed row (B = 1); i_b is the document, its chunks are [coff[i_b], coff[i_b + 1])
        c0 = tl.load(coff + i_b).to(tl.int64)
        NT = (tl.load(coff + i_b + 1).to(tl.int64) - c0).to(tl.int32)
        row0 = c0 * C * H + i_h
        hbuf += (c0 * H + i_h) * K * V
        gl += (c0 * H + i_h) * K
    else:
        row0 = (i_b * T).to(tl.int64) * H + i_h
        gl += ((i_b * NT).to(tl.int64) * H + i_h) * K
        hbuf += ((i_b * NT).to(tl.int64) * H + i_h) * K * V
    kd += row0 * K
    w += row0 * K
    u += row0 * V
    U += row0 * V
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
def _pair(aq, ak, qf, kf, kJ, GJ, offI, IEEE: tl.constexpr):
    """Add one K-block of the off-diagonal pair (I, J < I): ``qf = q_I e^{G_I - offI}``,
    ``kf = k_I e^{G_I - offI}`` (cast), partner ``k_J e^{offI - G_J}``; every factor <= 1."""
    kT = tl.trans(_cast(kJ * tl.exp2(offI[None, :] - GJ), False))
    return aq + _dot(qf, kT, IEEE), ak + _dot(kf, kT, IEEE)


@triton.jit
def _diag(aq, ak, qI, kI, GI, offI, mid, BOUNDED: tl.constexpr, IEEE: tl.constexpr, BC: tl.constexpr):
    """Add one K-block of the diagonal pair (I, I). Bounded: one product on ``x e^{G - ref}`` and
    ``k e^{ref - G}`` with ``ref = offI + mid`` (``mid = BC/2 * lower_bound`` in log2 units, the
    middle of the range G can span in the sub-tile), so every exponent is within
    ``BC/2 * |lower_bound|``. General: element-wise ``e^{G_i - G_j}``, masked to -inf for ``j > i``
    before ``exp2``."""
    if BOUNDED:
        e = GI - (offI[None, :] + mid)
        kT = tl.trans(_cast(kI * tl.exp2(-e), False))
        up = tl.exp2(e)
        aq += _dot(_cast(qI * up, False), kT, IEEE)
        ak += _dot(_cast(kI * up, False), kT, IEEE)
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
def _kda_fwd_kkt_row(
    q, k, g, beta, Gbuf, Abuf, Aqk,
    scale, mid, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BOUNDED: tl.constexpr, IEEE: tl.constexpr, G_IN: tl.constexpr,
):
    """One ``BC``-row sub-tile row ``si`` of a chunk (grid ``[NT * C // BC, B*H]``): G_si into
    ``Gbuf``, row si of ``Aqk``, the diagonal block ``Tm_ii = (I + A_ii)^-1`` and, as scratch for
    ``_kda_fwd_merge``, the off-diagonal blocks ``A_kk[si, J]`` (beta included, fp32) in ``Abuf``.

    Pairs J < si take both factors relative to ``off``, G just before sub-tile si
    (``e^{G_si - off} <= 1``, ``e^{off - G_J} <= 1`` whatever g is, ``_pair``); the diagonal pair
    as in ``_diag``. The rows of a chunk run in parallel programs: a row recomputes the G of its
    partner sub-tiles from g (the chunk's earlier g rows, read twice from cache) instead of waiting
    for them. ``G_IN``: ``g`` already holds G (``triton_prep.prep_fwd_chunked``): no cumsum, and
    ``Gbuf`` is not written."""
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
        dq, dk = _diag(dq, dk, xI, yI, GI, off, mid, BOUNDED, IEEE, BC)
        f = tl.exp2(GI - off[None, :])
        qf = _cast(xI * f, False)
        kf = _cast(yI * f, False)
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
                    q0, k0 = _pair(q0, k0, qf, kf, yJ, GJ, off, IEEE)
                elif J == 1:
                    q1, k1 = _pair(q1, k1, qf, kf, yJ, GJ, off, IEEE)
                else:
                    q2, k2 = _pair(q2, k2, qf, kf, yJ, GJ, off, IEEE)
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
def _merge_rows(Abuf, SA: tl.constexpr, NC: tl.constexpr, BC: tl.constexpr):
    """Block-row merge of one chunk's ``[NC BC, NC BC]`` tile at ``Abuf`` (row stride ``SA``), in
    place, from ``Tm_II`` on the diagonal blocks and ``A_kk`` below them:
    ``Tm_IJ = -Tm_II sum_{J <= M < I} A_IM Tm_MJ`` over J ascending (so the ``A_IM`` still to be
    read, M >= J, are not yet overwritten), rows after one another (rows M < I final)."""
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
def _kda_fwd_merge(
    Abuf, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
):
    """Block-row merge of one chunk (grid ``[NT, B*H]``), in place in ``Abuf``: completes
    ``Tm = (I + A_kk)^-1`` from the diagonal blocks ``_kda_fwd_kkt_row`` left (``_merge_rows``)."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    row0 = (i_b * T + i_c * C).to(tl.int64) * H + i_h
    _merge_rows(Abuf + row0 * C, H * C, C // BC, BC)


@triton.jit
def _kda_fwd_wu(
    q, k, v, Gbuf, beta, Abuf, w, u, qg, kd, gl,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``w = Tm (beta k e^G)``, ``u = Tm (beta v)``, ``qg = scale q e^G``, ``kd = k e^{G_last - G}``,
    ``gl = e^{G_last}`` of one chunk (grid ``[NT, B*H]``), from G (``Gbuf``) and Tm (``Abuf``).
    Tm and its products stay fp32 (TF32 on the GPU) for bf16 inputs too: bf16 operands here raised
    o's and the final state's error (kernels/README.md, Precision)."""
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
    Tm = _cast(tl.load(Abuf + r[:, None] * (H * C) + cidx[None, :]), False)
    _wu_rows(q, k, v, Gbuf, Tm, b, w, u, qg, kd, gl, scale, r, H, K, V, C, BK, BV, IEEE)


@triton.jit
def _wu_rows(q, k, v, G_ptr, Tm, b, w, u, qg, kd, gl, scale, r, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr):
    """Given the chunk's ``Tm`` (``[C, C]`` fp32 operand) and beta ``b`` (``[C]``), with every pointer at the
    chunk's first row (G read from ``G_ptr``): store ``w = Tm (beta k e^G)``, ``kd = k e^{G_last - G}``,
    ``qg = scale q e^G``, ``gl = e^{G_last}`` per K-block of ``BK`` and ``u = Tm (beta v)`` per V-block of ``BV``
    (``_kda_fwd_wu`` and ``_kda_fwd_intra``)."""
    for kb in range(K // BK):
        cols = kb * BK + tl.arange(0, BK)
        p = r[:, None] * (H * K) + cols[None, :]
        G = tl.load(G_ptr + p)
        Gl = tl.load(G_ptr + (C - 1) * (H * K) + cols)
        kt = tl.load(k + p).to(tl.float32)
        eG = tl.exp2(G)
        wt = _dot(Tm, _cast(kt * b[:, None] * eG, False), IEEE)
        tl.store(w + p, wt.to(w.dtype.element_ty))
        tl.store(kd + p, (kt * tl.exp2(Gl[None, :] - G)).to(kd.dtype.element_ty))
        tl.store(qg + p, (tl.load(q + p).to(tl.float32) * eG * scale).to(qg.dtype.element_ty))
        tl.store(gl + cols, tl.exp2(Gl))
    for vb in range(V // BV):
        cols = vb * BV + tl.arange(0, BV)
        p = r[:, None] * (H * V) + cols[None, :]
        ut = _dot(Tm, _cast(tl.load(v + p).to(tl.float32) * b[:, None], False), IEEE)
        tl.store(u + p, ut.to(u.dtype.element_ty))


@triton.jit
def _tri_inv_blocks(Ad, SA: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr):
    """``(I + A_II)^-1`` of the ``NB`` diagonal ``[BC, BC]`` blocks of the strictly lower fp32 tile
    at ``Ad`` (row stride ``SA``), all at once as ``[NB, BC, BC]``: ``_tri_inv_mem``'s forward
    substitution with a block axis (each step reads row s of every block from memory, in the layout
    the update broadcasts it in). The caller stores the tile there and syncs first; the trailing
    barrier lets it overwrite the blocks with the result."""
    bI = tl.arange(0, NB)[:, None, None]
    m = tl.arange(0, BC)[None, :, None]
    n = tl.arange(0, BC)[None, None, :]
    Ti = tl.where(m == n, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    for s in range(1, BC):
        a = tl.load(Ad + (bI * BC + s) * SA + bI * BC + m)  # [NB, BC, 1]: A[I BC + s, I BC + m]
        new = tl.where(n == s, 1.0, 0.0) - tl.sum(tl.where(m < s, a, 0.0) * Ti, axis=1, keep_dims=True)
        Ti = tl.where(m == s, new, Ti)
    tl.debug_barrier()
    return Ti


@triton.jit
def _spread_diag(t, NC: tl.constexpr, BC: tl.constexpr):
    """The ``[NC BC, NC BC]`` block-diagonal tile whose diagonal block I holds rows ``[I BC, (I + 1) BC)``
    of the ``[NC BC, BC]`` tile ``t`` (zeros elsewhere): a broadcast and a select, no arithmetic."""
    t4 = tl.broadcast_to(tl.reshape(t, [NC, BC, 1, BC]), [NC, BC, NC, BC])
    bI = tl.arange(0, NC)[:, None, None, None]
    bJ = tl.arange(0, NC)[None, None, :, None]
    return tl.reshape(tl.where(bI == bJ, t4, 0.0), [NC * BC, NC * BC])


@triton.jit
def _kda_fwd_intra(
    q, k, v, g, beta, Gbuf, Abuf, Aqk, w, u, qg, kd, gl,
    scale, mid, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BOUNDED: tl.constexpr, IEEE: tl.constexpr, G_IN: tl.constexpr,
):
    """The whole intra-chunk pass of one chunk (grid ``[NT, B*H]``, all K channels in blocks of ``BK``):
    what ``_kda_fwd_kkt_row``, ``_kda_fwd_merge`` and ``_kda_fwd_wu`` compute, the same outputs (``Aqk``;
    ``Tm = (I + A_kk)^-1`` fp32 in ``Abuf``; w, u, qg, kd, gl; general mode also G in ``Gbuf``), in one
    launch: no ``Abuf`` round trip between kernels, no 1-warp, 16-row programs.

    The scores are products of the whole chunk, ``[C, BK] x [BK, C]`` (M = N = C: one warpgroup MMA at
    C = 64, where products 16 or 32 wide were miscompiled at 4 or 8 warps), summed over K-blocks in two
    passes, with the split kernels' references (``off_I``: G at the row before sub-tile I, 0 for the
    first):

    * pass 1, the diagonal sub-tiles. Bounded: one product of ``x e^{G - off - mid}`` and
      ``k e^{off + mid - G}``, each row and column at its own sub-tile's reference (``_diag``'s rule),
      of which only the diagonal blocks are kept (the others may overflow: a select drops them).
      General: ``_diag``'s element-wise loop over the BC columns of every sub-tile at once
      (``e^{G_i - G_j}`` masked to ``i >= j`` before ``exp2``) into ``[C, BC]``, spread onto the
      diagonal blocks after the loop (``_spread_diag``).
    * pass 2, the pairs (I, J < I): one product per later sub-tile I on one ``exp2`` tile,
      ``e^{G - off_I}`` on the rows of sub-tile I (the row side), ``e^{off_I - G}`` on the rows before
      it (the column side), -inf elsewhere, so every factor is <= 1 (``_pair``'s rule). Three quarters
      of each product's rows are zeros, and a quarter to three quarters of its columns: the price of
      M = N = C.

    Then ``Tm`` in exact fp32, in ``Abuf``, which is also the solve's scratch (a block of a register
    tile cannot be cut out cheaply; read back through pointers it comes in the layout its use wants):
    the diagonal blocks by forward substitution, all at once (``_tri_inv_blocks``), then
    ``_kda_fwd_merge``'s block-row merge (``_merge_rows``: 16 x 16 products; an exact 32 x 32 product
    took ~180 registers). Last ``w = Tm (beta k e^G)``, ``u = Tm (beta v)`` (``[C, C] x [C, BK]`` and
    ``[C, BV]``), qg, kd, gl as in ``_kda_fwd_wu``.

    General mode forms G by a cumsum over the chunk and writes it to ``Gbuf``, where the rows of other
    sub-tiles are read back; ``G_IN`` (bounded mode): ``g`` holds G, read in place. A sync
    (``tl.debug_barrier``) orders each write to ``Gbuf`` / ``Abuf`` before other threads read it, and
    each read before the overwrite."""
    NC: tl.constexpr = C // BC
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    row0 = ((i_bh // H) * T + i_c * C).to(tl.int64) * H + i_bh % H
    q += row0 * K
    k += row0 * K
    g += row0 * K
    Gbuf += row0 * K
    w += row0 * K
    qg += row0 * K
    kd += row0 * K
    v += row0 * V
    u += row0 * V
    beta += row0
    Abuf += row0 * C
    Aqk += row0 * C
    gl += (((i_bh // H) * (T // C) + i_c).to(tl.int64) * H + i_bh % H) * K
    if G_IN:
        Gs = g
    else:
        Gs = Gbuf
    SK: tl.constexpr = H * K
    SA: tl.constexpr = H * C
    r = tl.arange(0, C)
    rb = r // BC  # sub-tile of each row
    rs = r % BC
    jc = tl.arange(0, BC)
    # int32 offset tiles; a K-block enters as a scalar added to the base pointers
    pk = r[:, None] * SK + tl.arange(0, BK)[None, :]
    po = tl.maximum(rb * BC - 1, 0)[:, None] * SK + tl.arange(0, BK)[None, :]  # row before the sub-tile
    pd = (rb * BC)[:, None] * SK + tl.arange(0, BK)[None, :]  # first row of the sub-tile
    aq = tl.zeros([C, C], dtype=tl.float32)
    ak = tl.zeros([C, C], dtype=tl.float32)
    dq = tl.zeros([C, BC], dtype=tl.float32)  # general mode: A[i, rb_i BC + j] at [i, j]
    dk = tl.zeros([C, BC], dtype=tl.float32)
    # pass 1, the diagonal sub-tiles (general mode: G first)
    for kb in range(K // BK):
        c0 = kb * BK
        if G_IN:
            G = tl.load(g + c0 + pk)
        else:
            G = tl.cumsum(tl.load(g + c0 + pk).to(tl.float32) * 1.4426950408889634, axis=0)
            tl.store(Gbuf + c0 + pk, G)
            tl.debug_barrier()
        x = tl.load(q + c0 + pk).to(tl.float32)
        y = tl.load(k + c0 + pk).to(tl.float32)
        if BOUNDED:
            e = G - (tl.where(rb[:, None] > 0, tl.load(Gs + c0 + po), 0.0) + mid)
            kT = tl.trans(_cast(y * tl.exp2(-e), False))
            up = tl.exp2(e)
            aq += _dot(_cast(x * up, False), kT, IEEE)  # off the diagonal blocks: dropped below
            ak += _dot(_cast(y * up, False), kT, IEEE)
        else:
            for j in range(BC):
                pj = c0 + j * SK + pd  # row j of each row's sub-tile
                kj = tl.load(k + pj).to(tl.float32)
                Gj = tl.load(Gs + pj)
                kje = kj * tl.exp2(tl.where((rs >= j)[:, None], G - Gj, float("-inf")))
                hit = jc[None, :] == j
                dq += tl.where(hit, tl.sum(x * kje, axis=1)[:, None], 0.0)
                dk += tl.where(hit, tl.sum(y * kje, axis=1)[:, None], 0.0)
    if BOUNDED:
        same = rb[:, None] == rb[None, :]
        aq = tl.where(same, aq, 0.0)
        ak = tl.where(same, ak, 0.0)
    else:
        aq = _spread_diag(dq, NC, BC)
        ak = _spread_diag(dk, NC, BC)
    # pass 2, the pairs (si, J < si): one product per later sub-tile si, on one exp2 tile: rows of
    # sub-tile si take e^{G - off_si}, the rows before it e^{off_si - G}, the others -inf (0)
    for kb in range(K // BK if NC > 1 else 0):
        c0 = kb * BK
        G = tl.load(Gs + c0 + pk)
        x = tl.load(q + c0 + pk).to(tl.float32)
        y = tl.load(k + c0 + pk).to(tl.float32)
        for si in tl.static_range(1, NC):
            oI = tl.load(Gs + c0 + (si * BC - 1) * SK + tl.arange(0, BK))[None, :]  # off of sub-tile si
            sel = (rb == si)[:, None]
            before = r[:, None] < si * BC
            e = tl.exp2(tl.where(before, oI - G, tl.where(sel, G - oI, float("-inf"))))
            kT = tl.trans(_cast(tl.where(before, y * e, 0.0), False))
            aq += _dot(_cast(tl.where(sel, x * e, 0.0), False), kT, IEEE)
            ak += _dot(_cast(tl.where(sel, y * e, 0.0), False), kT, IEEE)
    b = tl.load(beta + r * H).to(tl.float32)
    pa = r[:, None] * SA + r[None, :]
    tl.store(Aqk + pa, tl.where(r[:, None] >= r[None, :], aq * scale, 0.0).to(Aqk.dtype.element_ty))
    tl.store(Abuf + pa, tl.where(r[:, None] > r[None, :], ak * b[:, None], 0.0))
    tl.debug_barrier()
    Ti = _tri_inv_blocks(Abuf, SA, NC, BC)
    bI = tl.arange(0, NC)[:, None, None]
    m = tl.arange(0, BC)[None, :, None]
    n = tl.arange(0, BC)[None, None, :]
    tl.store(Abuf + (bI * BC + m) * SA + bI * BC + n, Ti)
    tl.debug_barrier()
    _merge_rows(Abuf, SA, NC, BC)
    _wu_rows(q, k, v, Gs, _cast(tl.load(Abuf + pa), False), b, w, u, qg, kd, gl, scale, r, H, K, V, C, BK, BV, IEEE)
