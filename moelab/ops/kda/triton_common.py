"""Device helpers shared by the chunked KDA Triton kernels (forward and backward).

Every helper works on one chunk of ``C`` tokens held as full ``[C, *]`` register tiles. The chunk is
cut into ``C // BC`` sub-tiles of ``BC = 16`` tokens. Decays enter as ``G``: the chunk-local
cumulative sum of the log decay, **already multiplied by log2(e)**, so ``exp2(G_i - G_j)`` is the
natural ``exp(G_i - G_j)``. ``G`` is non-increasing along the chunk because ``g <= 0``.

The gated products ``sum_d a_id b_jd exp(G_id - G_jd)`` are never formed as ``exp(G) @ exp(-G)``
over the whole chunk (that overflows). Instead:

* off-diagonal sub-tile pairs (``j`` in an earlier sub-tile than ``i``) are split hierarchically:
  at level ``P`` (``C/2, C/4, ..., BC``) the chunk is cut into ``2P``-row segments and a pair
  with ``i`` in the upper and ``j`` in the lower half of one segment is formed with both factors
  taken relative to G at the last row of that lower half, so every exponent is ``<= 0`` in either
  mode; each level is one ``tl.dot`` (``log2(C/BC)`` products instead of ``C/BC - 1``);
* diagonal sub-tiles, ``BOUNDED=True``: one ``tl.dot`` on ``a * exp(G - G_mid)`` and
  ``b * exp(G_mid - G)`` with ``G_mid`` the sub-tile midpoint, exponents at most
  ``8 * |lower_bound|`` in magnitude; entries outside the diagonal sub-tiles may overflow and
  are dropped by ``tl.where`` (a select, so an inf there never meets a 0);
* diagonal sub-tiles, ``BOUNDED=False``: ``BC`` steps of element-wise ``exp(G_i - G_j)`` with the
  exponent masked to ``-inf`` where ``j > i`` BEFORE ``exp2``, so nothing can overflow whatever
  ``g`` is. The partner rows ``j`` are gathered from global memory (inputs and the fp32 ``G``
  buffer written by the intra kernel).

All kernels assume padded shapes (the wrapper pads): ``T`` a multiple of ``C``, ``K`` and ``V``
powers of two >= 16. Padded tokens have ``q = k = v = beta = 0`` and ``g = 0`` and contribute
nothing, so no load or store needs a mask (masked tile loads feeding ``tl.dot`` cost about
2.5x the registers on Hopper).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _cast(x, DOT_BF16: tl.constexpr):
    """Operand dtype for tensor-core products: bf16 for bf16 inputs, fp32 (TF32 on the GPU)
    otherwise or where precision matters. Every TF32 product goes through here too (one place
    to change the operand precision of all of them)."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``IEEE`` (fp32 inputs): exact fp32 products instead of
    TF32, so the fp32 path matches the fp32 reference to ~1e-5 (the accuracy / reference use;
    bf16 and fp16 inputs are the fast path and keep TF32 / bf16 tensor-core products)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _row(x, r, idx):
    """Row ``idx`` of the register tile ``x`` ``[C, N]`` as an ``[N]`` vector."""
    return tl.sum(tl.where(r[:, None] == idx, x, 0.0), axis=0)


@triton.jit
def _mid_tile(G, r, C: tl.constexpr, BC: tl.constexpr):
    """``[C, N]`` tile whose row i holds G at the midpoint row of i's sub-tile."""
    blk = r // BC
    out = tl.zeros_like(G)
    for t in tl.static_range(C // BC):
        m = _row(G, r, t * BC + BC // 2 - 1)
        out = tl.where(blk[:, None] == t, m[None, :], out)
    return out


@triton.jit
def _load_G(g_ptr, rows, cols, stride):
    """Chunk-local cumsum of a ``[C, BK]`` block of g, times log2(e), fp32."""
    gt = tl.load(g_ptr + rows[:, None] * stride + cols[None, :]).to(tl.float32)
    return tl.cumsum(gt, axis=0) * 1.4426950408889634


@triton.jit
def _split_factors(G, r, P: tl.constexpr, C: tl.constexpr):
    """Decay factors of the level-``P`` pairs: ``rf`` (rows in the upper half of a ``2P`` segment,
    ``e^{G_i - ref}``) and ``kf`` (rows in the lower half, ``e^{ref - G_j}``), ref = G at the last
    row of the lower half; both ``<= 1`` and 0 on the other half."""
    seg = r // (2 * P)
    ref = tl.zeros_like(G)
    for s in tl.static_range(C // (2 * P)):
        ref = tl.where(seg[:, None] == s, _row(G, r, s * 2 * P + P - 1)[None, :], ref)
    upper = ((r % (2 * P)) >= P)[:, None]
    rf = tl.exp2(tl.where(upper, G - ref, float("-inf")))
    kf = tl.exp2(tl.where(upper, float("-inf"), ref - G))
    return rf, kf


@triton.jit
def _same_segment(x, r, P: tl.constexpr, C: tl.constexpr):
    """Zero the entries of a ``[C, C]`` tile whose row and column lie in different ``2P`` segments
    (there the two factors of a level-``P`` product used different references)."""
    if 2 * P == C:
        return x
    else:
        return tl.where((r // (2 * P))[:, None] == (r // (2 * P))[None, :], x, 0.0)


@triton.jit
def _scores2(S1, S2, q, k, G, k_ptr, G_ptr, stride, BOUNDED: tl.constexpr, DOT_BF16: tl.constexpr,
             IEEE: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Add one K-block to ``S1_ij = sum_d q_id k_jd e^{G_id-G_jd}`` and ``S2`` (same with k for q).

    Only ``j <= i`` entries are meaningful (the caller masks); the rest are 0 here.
    ``k_ptr``/``G_ptr`` point at row 0 of the chunk, first column of the block (used by the
    general-mode gathers); ``stride`` is their row stride.
    """
    r = tl.arange(0, C)
    blk = r // BC
    cidx = tl.arange(0, C)
    for lvl in tl.static_range(3):  # P = C // (2 << lvl): C/2, C/4, ... down to BC (C <= 128)
        if C // (2 << lvl) >= BC:
            rf, kf = _split_factors(G, r, C // (2 << lvl), C)
            kT = tl.trans(_cast(k * kf, DOT_BF16))
            S1 += _same_segment(_dot(_cast(q * rf, DOT_BF16), kT, IEEE), r, C // (2 << lvl), C)
            S2 += _same_segment(_dot(_cast(k * rf, DOT_BF16), kT, IEEE), r, C // (2 << lvl), C)
    same = blk[:, None] == (cidx // BC)[None, :]
    if BOUNDED:
        Gm = _mid_tile(G, r, C, BC)
        kT = tl.trans(_cast(k * tl.exp2(Gm - G), DOT_BF16))
        rf = tl.exp2(G - Gm)
        S1 += tl.where(same, _dot(_cast(q * rf, DOT_BF16), kT, IEEE), 0.0)
        S2 += tl.where(same, _dot(_cast(k * rf, DOT_BF16), kT, IEEE), 0.0)
    else:
        cols = tl.arange(0, BK)
        for s in range(BC):
            j = blk * BC + s  # partner column of row i inside i's sub-tile
            kj = tl.load(k_ptr + j[:, None] * stride + cols[None, :]).to(tl.float32)
            Gj = tl.load(G_ptr + j[:, None] * stride + cols[None, :])
            e = tl.exp2(tl.where((j <= r)[:, None], G - Gj, float("-inf")))
            kje = kj * e
            hit = cidx[None, :] == j[:, None]
            S1 += tl.where(hit, tl.sum(q * kje, axis=1)[:, None], 0.0)
            S2 += tl.where(hit, tl.sum(k * kje, axis=1)[:, None], 0.0)
    return S1, S2
