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
* ``_kda_fwd_state`` (grid ``[cdiv(V, BV), B*H]``, or ``[cdiv(V, BV), N*H]`` over packed documents
  with ``VARLEN``, sequential over chunks): stores the state
  ``h_c`` entering each chunk, ``U = u - w h_c`` (the delta-rule corrected values), then
  ``h_{c+1} = e^{G_last} h_c + (k e^{G_last - G})^T U``;
* ``_kda_fwd_out`` (grid ``[NT, B*H]``): ``o = qg h_c + A_qk U`` (or, with ``OUT``, the state kernel forms
  it per chunk itself: ``triton_chunk.VARIANTS["out"]``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.ops.kda.triton_common import _cast, _dot

# Shapes are padded (triton_common): no masks. Scalar base pointers advance by int64 scalars
# (B*T*H*K can pass 2^31); tile offsets stay int32 (int64 tile arithmetic costs registers).


@triton.jit
def _kda_fwd_state(
    kd, gl, w, u, h0, hbuf, U, hT, coff, qg, Aqk, o,
    T, NBH,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr, IEEE: tl.constexpr,
    VARLEN: tl.constexpr, OUT: tl.constexpr, STORE: tl.constexpr,
):
    """OUT: also the output of each chunk, ``o = qg h_c + A_qk U`` as ``_kda_fwd_out`` forms it (the same
    operands, rounded alike). STORE: store ``h_c`` and ``U`` (``_kda_fwd_out`` reads them without OUT; with OUT
    the training forward keeps them for the backward only where ``VARIANTS["states"]`` says so, else the backward
    recomputes them)."""
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
    if OUT:
        qg += row0 * K
        Aqk += row0 * C
        o += row0 * V
        a_ptrs = r[:, None] * (H * C) + r[None, :]
    if HAS_H0:
        h = tl.load(h0 + i_bh.to(tl.int64) * K * V + h_ptrs).to(tl.float32)
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    for _ in range(NT):
        if STORE:
            tl.store(hbuf + h_ptrs, h.to(hbuf.dtype.element_ty))
        wt = tl.load(w + k_ptrs)
        kdt = tl.load(kd + k_ptrs)
        ut = tl.load(u + v_ptrs).to(tl.float32)
        glt = tl.load(gl + d)
        Ut = ut - _dot(_cast(wt, DOT_BF16), _cast(h, DOT_BF16), IEEE)
        if OUT:  # h and U rounded to the work dtype (hbuf's, U's: never stored here) as the split path's stores
            hw = _cast(h.to(hbuf.dtype.element_ty), DOT_BF16)
            ot = _dot(_cast(tl.load(qg + k_ptrs), DOT_BF16), hw, IEEE) + _dot(
                _cast(tl.load(Aqk + a_ptrs), DOT_BF16), _cast(Ut.to(U.dtype.element_ty), DOT_BF16), IEEE)
            tl.store(o + v_ptrs, ot.to(o.dtype.element_ty))
            qg += C * H * K
            Aqk += C * H * C
            o += C * H * V
        if STORE:
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
    for kb in range(K // BK):
        cols = kb * BK + tl.arange(0, BK)
        p = r[:, None] * (H * K) + cols[None, :]
        G = tl.load(Gbuf + p)
        Gl = tl.load(Gbuf + (C - 1) * (H * K) + cols)
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
