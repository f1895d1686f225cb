"""Fused KDA input prep in Triton: SiLU + L2 norm of q and k, and the log-decay gate.

Before the chunked KDA kernels run, every layer turns its raw projections into the op's inputs::

    qn = L2Norm(SiLU(q)),  kn = L2Norm(SiLU(k))           per (b, t, h) row of K channels
    g  = g_min * Sigmoid(exp(A_log_h) * (z + dt_bias))     gate="bounded"  (K3)
       = -exp(A_log_h) * Softplus(z + dt_bias)                    gate="softplus" (Kimi Linear)
       = z                                                        gate="none"     (g given)

In torch that is a dozen element-wise and reduction kernels, each a full pass over a
``[B, T, H, K]`` tensor, plus their backward: about 5 ms of a 17.9 ms forward + backward at
B8 T4096 H16 K128 bf16 on an H200 (kernels/README.md). fla does this prep inside its KDA kernels
(``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``); here it is one memory-bound pass each way
that ``chunk_kda`` can call from its autograd Function: the forward reads q, k, z once and writes
qn, kn, g once; the backward reads q, k, z and the three output gradients once, recomputes what it
needs and writes dq, dk, dz once, plus a per-row partial of dA_log (reduced in torch, so the
result is deterministic: no atomics).

L2 norm: ``F.normalize`` semantics, ``y = x / max(||x||_2, eps)`` (what moelab's KDA layer and the
benchmark use), not fla's ``x * rsqrt(sum x^2 + eps)``; the two differ by a relative
``eps / (2 ||x||^2)`` when ``||x|| > eps``. Its gradient is ``(dy - y <dy, y>) / ||x||`` when
``||x|| >= eps`` and ``dy / eps`` below (torch's, through ``clamp_min``).

All math is fp32; qn, kn are stored in q's dtype, g in fp32.

Host functions ``prep_fwd`` / ``prep_bwd`` (no autograd; for a caller's own autograd Function),
``prep_fwd_chunked`` (the forward for the chunk kernels: padded outputs and the chunk-local cumsum
of the decay instead of the decay),
``PrepFunction`` + ``kda_prep`` (standalone autograd use). The fp32 PyTorch reference that defines
the semantics is ``moelab.ops.kda.gate.kda_prep_torch``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moelab.ops.kda.gate import DTYPES
from moelab.ops.kda.gate import check_prep_args as _check

_GATE_ID = {"none": 0, "bounded": 1, "softplus": 2}
# torch's softplus switches to the identity above this input (beta = 1); matched so gradients agree
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)

# Elements per program: fp32 tiles of BR rows x BK channels at 4 warps. The backward holds about
# twice the live tiles of the forward (inputs and output gradients), so it takes half the rows.
_FWD_ELEMS, _BWD_ELEMS, _NUM_WARPS = 4096, 2048, 4
# interpreter: few rows per program so that small test shapes still span several programs
_INTERP_ROWS = 8


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _block_rows(BK: int, elems: int) -> int:
    return _INTERP_ROWS if _interpret() else max(1, elems // BK)


@triton.jit
def _qk_fwd(x, eps, SILU: tl.constexpr, L2NORM: tl.constexpr):
    """``[BR, BK]`` fp32 rows -> L2Norm(SiLU(x)) (each step optional); padded lanes hold 0 and stay 0."""
    if SILU:
        x = x * tl.sigmoid(x)
    if L2NORM:
        n = tl.sqrt(tl.sum(x * x, axis=1))
        x = x / tl.maximum(n, eps).to(tl.float32)[:, None]
    return x


@triton.jit
def _qk_bwd(x, dy, eps, SILU: tl.constexpr, L2NORM: tl.constexpr):
    """Gradient of ``_qk_fwd`` at ``x`` for the output gradient ``dy`` (both ``[BR, BK]`` fp32)."""
    if SILU:
        s = tl.sigmoid(x)
        xs = x * s
    else:
        xs = x
    dxs = dy
    if L2NORM:
        n = tl.sqrt(tl.sum(xs * xs, axis=1))
        d = tl.maximum(n, eps).to(tl.float32)
        y = xs / d[:, None]
        # below eps the denominator is the constant eps: only the dy / eps term remains
        proj = tl.where(n >= eps, tl.sum(dy * y, axis=1), 0.0)
        dxs = (dy - y * proj[:, None]) / d[:, None]
    if SILU:
        dxs = dxs * s * (1.0 + x * (1.0 - s))
    return dxs


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20) in fp32; log1p(u) via log(w) * u / (w - 1), w = 1 + u, which
    keeps full relative precision for small u (plain log(1 + u) loses it once u < ~1e-4)."""
    u = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    w = 1.0 + u
    exact = w == 1.0  # u below half an ulp of 1: log1p(u) = u to fp32 precision
    lp = tl.where(exact, u, tl.log(w) * u / tl.where(exact, 1.0, w - 1.0))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, lp)


@triton.jit
def _gate(x, a, g_min, GATE: tl.constexpr):
    """Log decay from the biased gate input ``x`` and the head rate ``a = exp(A_log)`` (fp32):
    ``GATE`` 1: ``g_min * sigmoid(a x)``; 2: ``-a softplus(x)``."""
    if GATE == 1:
        return g_min * tl.sigmoid(a * x)
    else:
        return -a * _softplus(x)


@triton.jit
def _gate_bwd(dy, x, a, g_min, GATE: tl.constexpr):
    """The gate's backward from ``dy = dL/dg`` at pre-activation ``x`` (z plus dt_bias), ``a = exp(A_log)``, fp32:
    ``(dx, dA)`` with dA the term of dL/d(A_log). GATE 1 (bounded) or 2 (softplus)."""
    if GATE == 1:
        # g = lb * sigmoid(u), u = a x: dg/du = lb s (1 - s); du/dx = a; d(u)/d(A_log) = a x
        s = tl.sigmoid(a * x)
        du = dy * g_min * s * (1.0 - s)
        return du * a, du * a * x
    # g = -a softplus(x): dg/dx = -a sigmoid(x) (1 above the threshold); dg/d(A_log) = g
    ds = tl.where(x > SOFTPLUS_THRESHOLD, 1.0, tl.sigmoid(x))
    return -a * dy * ds, -a * dy * _softplus(x)


@triton.jit
def _prep_fwd_kernel(
    q,
    k,
    z,
    A_log,
    dt_bias,
    qn,
    kn,
    g,
    n_rows,
    H,
    g_min,
    eps,
    K: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """One program: rows ``[row0, row0 + BR)`` of the ``[n_rows, K]`` views of q, k, z (row = (b, t, h))."""
    row0 = tl.program_id(0).to(tl.int64) * BR
    base = row0 * K  # int64: B*T*H*K may pass 2^31; offsets inside the tile stay int32
    r = tl.arange(0, BR)
    c = tl.arange(0, BK)
    mask = (r < n_rows - row0)[:, None] & (c < K)[None, :]
    offs = r[:, None] * K + c[None, :]

    x = tl.load(q + base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(qn + base + offs, _qk_fwd(x, eps, SILU, L2NORM).to(qn.dtype.element_ty), mask=mask)
    x = tl.load(k + base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(kn + base + offs, _qk_fwd(x, eps, SILU, L2NORM).to(kn.dtype.element_ty), mask=mask)

    x = tl.load(z + base + offs, mask=mask, other=0.0).to(tl.float32)
    if GATE != 0:
        h = ((row0 % H).to(tl.int32) + r) % H
        a = tl.exp(tl.load(A_log + h).to(tl.float32))[:, None]
        if HAS_BIAS:
            x += tl.load(dt_bias + h[:, None] * K + c[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _gate(x, a, g_min, GATE)
    tl.store(g + base + offs, x, mask=mask)


@triton.jit
def _prep_fwd_chunk_kernel(
    q,
    k,
    z,
    A_log,
    dt_bias,
    qn,
    kn,
    G,
    v,
    beta,
    vp,
    bp,
    chunk_src,
    chunk_len,
    T,
    Tp,
    g_min,
    eps,
    H: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    C: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    L2NORM: tl.constexpr,
    QK: tl.constexpr,
    V: tl.constexpr = 1,
    BV: tl.constexpr = 1,
    PACK: tl.constexpr = False,
):
    """One chunk of ``C`` tokens of one head (grid ``[Tp // C, B*H]``): the rows of
    ``_prep_fwd_kernel`` written into zero-padded ``[B, Tp, H, BK]`` outputs, with the log decay
    replaced by its chunk-local cumsum in log2 units, ``G = log2(e) cumsum_chunk(g)`` (fp32), the
    form the chunk kernels read. Padded tokens and channels get q = k = 0 and g = 0 (so G stays
    flat over them). ``QK=False``: G only (q and k pass through unchanged).

    ``PACK`` (packed documents, B = 1): output chunk ``i_c`` of the documents' chunk layout
    (``triton_chunk.Packing``) holds the ``chunk_len[i_c]`` (0..C) tokens from ``chunk_src[i_c]`` on, the rest
    zeros; v ``[1, T, H, V]`` and beta ``[1, T, H]`` are laid out alike into ``vp [1, Tp, H, BV]`` and
    ``bp [1, Tp, H]``, so that the layout costs no pass of its own."""
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    r = tl.arange(0, C)
    c = tl.arange(0, BK)
    if PACK:
        first = tl.load(chunk_src + i_c)  # int64: the chunk's first token
        rows = r < tl.load(chunk_len + i_c)
    else:
        first = (i_b * T + i_c * C).to(tl.int64)
        rows = i_c * C + r < T
    mask = rows[:, None] & (c < K)[None, :]
    src = (first * H + i_h) * K  # int64 row base; tile offsets int32
    dst = ((i_b * Tp + i_c * C).to(tl.int64) * H + i_h) * BK
    if PACK:
        cv = tl.arange(0, BV)
        xv = tl.load(v + (first * H + i_h) * V + r[:, None] * (H * V) + cv[None, :],
                     mask=rows[:, None] & (cv < V)[None, :], other=0.0)
        tl.store(vp + (i_c * C * H + i_h).to(tl.int64) * BV + r[:, None] * (H * BV) + cv[None, :], xv)
        xb = tl.load(beta + first * H + i_h + r * H, mask=rows, other=0.0)
        tl.store(bp + (i_c * C * H + i_h).to(tl.int64) + r * H, xb)
    si = r[:, None] * (H * K) + c[None, :]
    so = r[:, None] * (H * BK) + c[None, :]
    if QK:
        x = tl.load(q + src + si, mask=mask, other=0.0).to(tl.float32)
        tl.store(qn + dst + so, _qk_fwd(x, eps, SILU, L2NORM).to(qn.dtype.element_ty))
        x = tl.load(k + src + si, mask=mask, other=0.0).to(tl.float32)
        tl.store(kn + dst + so, _qk_fwd(x, eps, SILU, L2NORM).to(kn.dtype.element_ty))
    x = tl.load(z + src + si, mask=mask, other=0.0).to(tl.float32)
    if GATE != 0:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if HAS_BIAS:
            x += tl.load(dt_bias + i_h * K + c, mask=c < K, other=0.0).to(tl.float32)[None, :]
        x = tl.where(mask, _gate(x, a, g_min, GATE), 0.0)
    tl.store(G + dst + so, tl.cumsum(x, axis=0) * 1.4426950408889634)


@triton.jit
def _prep_bwd_kernel(
    q,
    k,
    z,
    A_log,
    dt_bias,
    dqn,
    dkn,
    dg,
    dq,
    dk,
    dz,
    dA_part,
    dbias_part,
    grow,
    n_tok,
    H,
    g_min,
    eps,
    K: tl.constexpr,
    BK: tl.constexpr,
    BR: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    L2NORM: tl.constexpr,
    HAS_DQ: tl.constexpr,
    HAS_DK: tl.constexpr,
    HAS_DG: tl.constexpr,
    KG: tl.constexpr = 1,
    PACK: tl.constexpr = False,
):
    """Gradients of ``_prep_fwd_kernel`` for ``BR`` tokens of one head (grid ``[cdiv(B*T, BR), H]``),
    and that block's fp32 shares of the gate's parameter gradients, summed over its tokens from the
    fp32 dz (before dz is rounded to z's dtype): ``dA_part[block, h]`` (over the K channels too) and
    ``dbias_part[block, h*K:(h+1)*K]``. ``PACK``: dqn, dkn, dg lie in another layout, token t's at row
    ``grow[t]`` of ``[R, H, KG]`` (packed documents' chunk layout), read from there directly."""
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = i_t.to(tl.int64) * BR
    base = (t0 * H + i_h) * K  # int64: B*T*H*K may pass 2^31; offsets inside the tile stay int32
    r = tl.arange(0, BR)
    c = tl.arange(0, BK)
    rmask = r < n_tok - t0
    cmask = c < K
    mask = rmask[:, None] & cmask[None, :]
    offs = r[:, None] * (H * K) + c[None, :]
    if PACK:
        gsrc = (tl.load(grow + t0 + r, mask=rmask, other=0) * H + i_h)[:, None] * KG + c[None, :]
    else:
        gsrc = base + offs

    if HAS_DQ:
        x = tl.load(q + base + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dqn + gsrc, mask=mask, other=0.0).to(tl.float32)
        tl.store(dq + base + offs, _qk_bwd(x, dy, eps, SILU, L2NORM).to(dq.dtype.element_ty), mask=mask)
    if HAS_DK:
        x = tl.load(k + base + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dkn + gsrc, mask=mask, other=0.0).to(tl.float32)
        tl.store(dk + base + offs, _qk_bwd(x, dy, eps, SILU, L2NORM).to(dk.dtype.element_ty), mask=mask)
    if HAS_DG:
        dy = tl.load(dg + gsrc, mask=mask, other=0.0).to(tl.float32)
        if GATE == 0:
            dx = dy
        else:
            x = tl.load(z + base + offs, mask=mask, other=0.0).to(tl.float32)
            a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
            if HAS_BIAS:
                x += tl.load(dt_bias + i_h * K + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
            dx, dA = _gate_bwd(dy, x, a, g_min, GATE)
            dx = tl.where(mask, dx, 0.0)
            tl.store(dA_part + i_t * H + i_h, tl.sum(tl.sum(tl.where(mask, dA, 0.0), axis=1), axis=0))
            if HAS_BIAS:
                tl.store(dbias_part + (i_t * H + i_h) * K + c, tl.sum(dx, axis=0), mask=cmask)
        tl.store(dz + base + offs, dx.to(dz.dtype.element_ty), mask=mask)


def _launch_args(
    q: torch.Tensor, gate: str, g_min: float | None, silu_qk: bool, l2norm_qk: bool, eps: float, elems: int
) -> tuple[int, tuple, dict]:
    """(rows per program, runtime scalars after the row count, constexprs) shared by both kernels."""
    H, K = q.shape[2], q.shape[3]
    BK = triton.next_power_of_2(K)
    BR = _block_rows(BK, elems)
    lb = float(g_min) if gate == "bounded" else 0.0
    const = dict(K=K, BK=BK, BR=BR, GATE=_GATE_ID[gate], SILU=bool(silu_qk), L2NORM=bool(l2norm_qk))
    return BR, (H, lb, float(eps)), const


def prep_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    *,
    gate: str,
    g_min: float | None,
    silu_qk: bool,
    l2norm_qk: bool,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward prep in one kernel launch (no autograd).

    Args:
        q, k: ``[B, T, H, K]`` raw queries / keys, one dtype of bf16/fp16/fp32; K in 1..256.
        z: ``[B, T, H, K]`` raw gate input (any of bf16/fp16/fp32); with ``gate="none"`` it is the
            log decay itself.
        A_log: ``[H]`` log of the per-head decay rate ``a = exp(A_log)``; None for ``gate="none"``.
        dt_bias: ``[H*K]`` per-channel bias added to z (channel ``h*K + d``), or None.
        gate: ``"bounded"`` (``g = g_min * sigmoid(a (z + dt_bias))``), ``"softplus"``
            (``g = -a softplus(z + dt_bias)``) or ``"none"`` (``g = z``).
        g_min: the bound of the bounded gate (< 0); ignored by the other gates.
        silu_qk: apply SiLU to q and k first.
        l2norm_qk: L2-normalize each ``(b, t, h)`` row of K channels: ``x / max(||x||, eps)``.
        eps: the norm's floor.

    Returns:
        ``qn``, ``kn`` ``[B, T, H, K]`` in q's dtype and ``g`` ``[B, T, H, K]`` fp32, the
        per-channel log decay (natural log, <= 0 for both gates).
    """
    _check(q, k, z, A_log, dt_bias, gate, g_min, eps)
    q, k, z = q.contiguous(), k.contiguous(), z.contiguous()
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    g = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    BR, scalars, const = _launch_args(q, gate, g_min, silu_qk, l2norm_qk, eps, _FWD_ELEMS)
    n_rows = q.shape[0] * q.shape[1] * q.shape[2]
    _prep_fwd_kernel[(triton.cdiv(n_rows, BR),)](
        q,
        k,
        z,
        A_log if A_log is not None else g,
        dt_bias if dt_bias is not None else g,
        qn,
        kn,
        g,
        n_rows,
        *scalars,
        **const,
        HAS_BIAS=dt_bias is not None,
        num_warps=_NUM_WARPS,
    )
    return qn, kn, g


def prep_fwd_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    *,
    chunk_size: int,
    gate: str,
    g_min: float | None,
    silu_qk: bool,
    l2norm_qk: bool,
    eps: float = 1e-6,
    qk: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Forward prep for the chunk kernels (no autograd): as :func:`prep_fwd`, but the outputs are
    zero-padded to ``Tp`` (T rounded up to ``chunk_size``) tokens and ``Kp`` (K rounded up to a
    power of two >= 16) channels, and the log decay comes out as its chunk-local cumsum in log2
    units, ``G[b, c*C + i, h] = log2(e) sum_{j <= i} g[b, c*C + j, h]`` (what the chunk kernels
    read; one pass, where g followed by a cumsum in the kernels would take two).

    Returns:
        ``qn``, ``kn`` ``[B, Tp, H, Kp]`` in q's dtype (None with ``qk=False``: only G is computed)
        and ``G`` ``[B, Tp, H, Kp]`` fp32 (padded tokens repeat the chunk's last G, padded channels 0).
    """
    _check(q, k, z, A_log, dt_bias, gate, g_min, eps)
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size={chunk_size} is not allowed: expected one of (16, 32, 64, 128)")
    q, k, z = q.contiguous(), k.contiguous(), z.contiguous()
    B, T, H, K = q.shape
    C = chunk_size
    Tp = triton.cdiv(T, C) * C
    Kp = max(16, triton.next_power_of_2(K))
    G = torch.empty(B, Tp, H, Kp, device=q.device, dtype=torch.float32)
    qn = q.new_empty(B, Tp, H, Kp) if qk else None
    kn = k.new_empty(B, Tp, H, Kp) if qk else None
    lb = float(g_min) if gate == "bounded" else 0.0
    _prep_fwd_chunk_kernel[(Tp // C, B * H)](
        q,
        k,
        z,
        A_log if A_log is not None else G,
        dt_bias if dt_bias is not None else G,
        qn if qk else G,
        kn if qk else G,
        G,
        G,
        G,
        G,
        G,
        G,
        G,
        T,
        Tp,
        lb,
        float(eps),
        H=H,
        K=K,
        BK=Kp,
        C=C,
        GATE=_GATE_ID[gate],
        HAS_BIAS=dt_bias is not None,
        SILU=bool(silu_qk),
        L2NORM=bool(l2norm_qk),
        QK=qk,
        num_warps=_NUM_WARPS if C * Kp <= 8192 else 2 * _NUM_WARPS,
    )
    return qn, kn, G


def prep_fwd_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    z: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    chunk_src: torch.Tensor,
    chunk_len: torch.Tensor,
    *,
    chunk_size: int,
    gate: str,
    g_min: float | None,
    silu_qk: bool,
    l2norm_qk: bool,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`prep_fwd_chunked` for packed documents (B = 1), straight into the documents' chunk layout: output
    chunk ``s`` holds the ``chunk_len[s]`` tokens from ``chunk_src[s]`` on (``triton_chunk.Packing``: each document
    starts on a chunk), zeros after them; v and beta are laid out alike in the same launch. One pass in place of the
    prep, a zero-filled copy and a scatter per tensor, and the cumsum's second pass.

    Args:
        q, k, z: ``[1, T, H, K]``; v: ``[1, T, H, V]``; beta: ``[1, T, H]``.
        chunk_src: ``[NS]`` int64 first token of each output chunk; chunk_len: ``[NS]`` int32 tokens in it (0..C).

    Returns:
        ``qn``, ``kn`` ``[1, NS*C, H, Kp]`` in q's dtype, ``G`` ``[1, NS*C, H, Kp]`` fp32 (as prep_fwd_chunked's),
        ``vp`` ``[1, NS*C, H, Vp]`` in v's dtype and ``bp`` ``[1, NS*C, H]`` in beta's dtype.
    """
    _check(q, k, z, A_log, dt_bias, gate, g_min, eps)
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size={chunk_size} is not allowed: expected one of (16, 32, 64, 128)")
    if q.shape[0] != 1:
        raise ValueError(f"prep_fwd_packed: batch {q.shape[0]} is not allowed: packed documents come as one row")
    q, k, z, v, beta = (x.contiguous() for x in (q, k, z, v, beta))
    _, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    Tp = chunk_src.numel() * C
    Kp = max(16, triton.next_power_of_2(K))
    Vp = max(16, triton.next_power_of_2(V))
    G = torch.empty(1, Tp, H, Kp, device=q.device, dtype=torch.float32)
    qn, kn = q.new_empty(1, Tp, H, Kp), k.new_empty(1, Tp, H, Kp)
    vp, bp = v.new_empty(1, Tp, H, Vp), beta.new_empty(1, Tp, H)
    _prep_fwd_chunk_kernel[(Tp // C, H)](
        q, k, z, A_log if A_log is not None else G, dt_bias if dt_bias is not None else G, qn, kn, G, v, beta, vp,
        bp, chunk_src, chunk_len, T, Tp, float(g_min) if gate == "bounded" else 0.0, float(eps),
        H=H, K=K, BK=Kp, C=C, GATE=_GATE_ID[gate], HAS_BIAS=dt_bias is not None, SILU=bool(silu_qk),
        L2NORM=bool(l2norm_qk), QK=True, V=V, BV=Vp, PACK=True,
        num_warps=_NUM_WARPS if C * Kp <= 8192 else 2 * _NUM_WARPS,
    )
    return qn, kn, G, vp, bp


def prep_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dqn: torch.Tensor | None,
    dkn: torch.Tensor | None,
    dg: torch.Tensor | None,
    *,
    gate: str,
    g_min: float | None,
    silu_qk: bool,
    l2norm_qk: bool,
    eps: float = 1e-6,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward prep in one kernel launch (no autograd); recomputes from the inputs of ``prep_fwd``.

    Args:
        q, k, z, A_log, dt_bias and the keyword flags: exactly as given to :func:`prep_fwd`.
        dqn, dkn, dg: ``[B, T, H, K]`` gradients of qn, kn, g (any float dtype), or None where no
            gradient flowed; with ``rows``, ``[1, R, H, Kg]`` (Kg >= K) in another token layout.
        rows: None, or ``[T]`` int64 (B = 1): the row of dqn / dkn / dg that holds token t's gradient (packed
            documents' chunk layout, ``triton_chunk.Packing.pos``), read there in the same pass.

    Returns:
        ``(dq, dk, dz, dA_log, ddt_bias)``: dq, dk ``[B, T, H, K]`` in q's dtype (None when dqn /
        dkn is None); dz ``[B, T, H, K]`` in z's dtype, dA_log ``[H]`` fp32 and ddt_bias
        ``[H*K]`` fp32 (None when dg is None; dA_log also for ``gate="none"``, ddt_bias also when
        dt_bias is None). Both are formed from the fp32 chain rule, not from the rounded dz: torch
        sums of the kernel's fp32 per-block partials (deterministic).
    """
    _check(q, k, z, A_log, dt_bias, gate, g_min, eps)
    B, T, H, K = q.shape
    for name, t in (("dqn", dqn), ("dkn", dkn), ("dg", dg)):
        ok = t is None or (t.dtype in DTYPES and t.device == q.device and (
            t.shape == q.shape if rows is None else (t.dim() == 4 and t.shape[0] == 1 and t.shape[2] == H
                                                      and t.shape[3] >= K)))
        if not ok:
            want = tuple(q.shape) if rows is None else f"(1, R, {H}, >= {K})"
            raise ValueError(f"{name} must be None or {want} float on {q.device}; got "
                             f"{(tuple(t.shape), t.dtype, t.device)}")
    if rows is not None and (B != 1 or rows.shape != (T,) or rows.dtype != torch.int64):
        raise ValueError(f"rows must be a [T] = [{T}] int64 tensor with B = 1, got B = {B} and "
                         f"{(tuple(rows.shape), rows.dtype)}")
    if dqn is None and dkn is None and dg is None:
        return None, None, None, None, None
    q, k, z = q.contiguous(), k.contiguous(), z.contiguous()
    dqn, dkn, dg = (t.contiguous() if t is not None else None for t in (dqn, dkn, dg))
    kg = next(t.shape[3] for t in (dqn, dkn, dg) if t is not None)
    dq = torch.empty_like(q) if dqn is not None else None
    dk = torch.empty_like(k) if dkn is not None else None
    dz = torch.empty_like(z) if dg is not None else None
    gated = dg is not None and gate != "none"
    BR, scalars, const = _launch_args(q, gate, g_min, silu_qk, l2norm_qk, eps, _BWD_ELEMS)
    NB = triton.cdiv(B * T, BR)
    # per-block fp32 partials of dA_log and ddt_bias, summed here (deterministic: no atomics)
    dA_part = torch.empty(NB if gated else 1, H, device=q.device, dtype=torch.float32)
    dbias_part = torch.empty(NB, H * K, device=q.device, dtype=torch.float32) if gated and dt_bias is not None else None
    dummy = dA_part  # stands in for absent tensors; constexpr flags keep the kernel off it
    _prep_bwd_kernel[(NB, H)](
        q,
        k,
        z,
        A_log if A_log is not None else dummy,
        dt_bias if dt_bias is not None else dummy,
        *(t if t is not None else dummy for t in (dqn, dkn, dg, dq, dk, dz, dA_part, dbias_part)),
        rows if rows is not None else dummy,
        B * T,
        *scalars,
        **const,
        HAS_BIAS=dt_bias is not None,
        HAS_DQ=dqn is not None,
        HAS_DK=dkn is not None,
        HAS_DG=dg is not None,
        KG=kg if rows is not None else 1,
        PACK=rows is not None,
        num_warps=_NUM_WARPS,
    )
    dA_log = dA_part.sum(0) if gated else None
    ddt_bias = dbias_part.sum(0) if dbias_part is not None else None
    return dq, dk, dz, dA_log, ddt_bias


class PrepFunction(torch.autograd.Function):
    """Autograd wrapper of :func:`prep_fwd` / :func:`prep_bwd`; saves only the inputs."""

    @staticmethod
    def forward(ctx, q, k, z, A_log, dt_bias, gate, g_min, silu_qk, l2norm_qk, eps):
        flags = dict(gate=gate, g_min=g_min, silu_qk=silu_qk, l2norm_qk=l2norm_qk, eps=eps)
        qn, kn, g = prep_fwd(q, k, z, A_log, dt_bias, **flags)
        ctx.save_for_backward(q, k, z, A_log, dt_bias)
        ctx.flags = flags
        # an unused output gets None, not a tensor of zeros: prep_bwd then skips that part
        ctx.set_materialize_grads(False)
        return qn, kn, g

    @staticmethod
    def backward(ctx, dqn, dkn, dg):
        q, k, z, A_log, dt_bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, dk, dz, dA_log, ddt_bias = prep_bwd(
            q,
            k,
            z,
            A_log,
            dt_bias,
            dqn if need[0] else None,
            dkn if need[1] else None,
            dg if any(need[2:5]) else None,
            **ctx.flags,
        )
        dA_log = dA_log.to(A_log.dtype) if dA_log is not None and need[3] else None
        ddt_bias = ddt_bias.to(dt_bias.dtype) if ddt_bias is not None and need[4] else None
        return dq, dk, dz if need[2] else None, dA_log, ddt_bias, None, None, None, None, None


def kda_prep(
    q: torch.Tensor,
    k: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None = None,
    gate: str = "bounded",
    g_min: float | None = None,
    silu_qk: bool = False,
    l2norm_qk: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable fused prep: ``(qn, kn, g)`` as in :func:`prep_fwd` (shapes, dtypes, flags)."""
    return PrepFunction.apply(q, k, z, A_log, dt_bias, gate, g_min, silu_qk, l2norm_qk, eps)
