"""Causal depthwise 1-D convolution over time (the ShortConv of KDA / Mamba layers), in Triton.

    y[b, t, c] = act( sum_{i < W} w[c, i] * x[b, t - (W - 1) + i, c] ),   x[t < 0] = 0

``x [B, T, C]`` stays in its ``[B, T, C]`` layout (the torch path transposes to ``[B, C, T]`` for
``F.conv1d`` and back, and concatenates a zero tail first: three extra passes over x each way).
One pass forward; one pass backward that recomputes the pre-activation it needs and writes dx plus
per-block partials of dw (summed in torch, so the result is deterministic). fp32 accumulation;
y in x's dtype; dw in fp32, cast to the weight's dtype.

``causal_conv1d`` is the autograd entry; ``causal_conv1d_torch`` the fp32-exact PyTorch
reference that defines the semantics. Both start from zeros before the first token; a layer that
carries a tail across calls (decoding) keeps its torch path for those calls.

Packed documents: with ``pos [B, T]`` (each token's position within its document,
``moelab.model.documents.Documents.pos``) a tap that would read across a document start reads zero
instead, in the same pass forward and backward: an output at position p mixes only the ``min(p + 1, W)``
inputs of its own document, as if each document were convolved alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ACTIVATIONS = (None, "silu")
# (rows, channels, warps) per program, forward and backward; the interpreter takes small blocks so tests span
# several programs. At 64 x 128 on 4 warps (64 elements of a tile per thread) the backward, which recomputes the
# pre-activation of W rows from W shifted x tiles each, compiled for sm_90a (`kernels/aot_kda.py --conv`) to 255
# registers and 0.9-17.6 KB of spill loads per thread: 5.7 ms of a 120 ms k3-mini step
# (kernels/results/model_profile_h200.json, 27 calls). At 16 x 128 on 8 warps it takes 140-158 registers and
# spills nothing; the forward at 16 x 128 on 4 warps 71-118, nothing (at 64 x 128: up to 320 B of spills). Each
# output element sums the same terms in the same order at any tile; only dw's per-tile partial sums group the rows
# differently. Timed side by side on an H100 (``kernels/bench.py --entry conv``, kernels/results/conv_h100.json,
# fwd+bwd ms at B8 T4096 C512 / B1 T32768 C1536): the backward at 16 x 128 on 8 warps (the launch before) 0.717 /
# 2.035, at 64 x 64 on 4 warps 0.269 / 0.686 with the generic kernel and 0.261 / 0.655 with the 4-tap one (its
# errors alike, 2.4e-3 vs fp32; F.conv1d 1.001 / 3.115); the forward's launches took 0.036-0.060 / 0.081-0.126
# ms, 16 x 128 on 4 warps the fastest at the long shape. The 4-tap backward at 64 x 64 on 4 warps compiles (Triton
# 3.9, `aot_kda.py --conv`) to 255 registers and up to 3.3 KB of spill loads a thread with document positions and
# SiLU (0.8 KB without positions), yet timed fastest; 32 x 64 spills at most 104 B and took 6% longer (0.697 ms).
LAUNCH = {"fwd": (16, 128, 4), "bwd": (64, 64, 4)}
# the one-pass 4-tap backward (``_conv_bwd_slide_kernel``): (rows, channels, warps, stages of its row loop); BWD_SLIDE
# runs it at W 4 (the default). Two H100 runs of the conv bench (kernels/results/conv_h100.json, rows ``bwd_slide_*``):
# 128 x 256 on 1 warp, 3 stages the fastest launch at B1 T32768 C1536 in their geometric mean, 0.27 ms fwd+bwd against
# the tile kernel's 0.68 (64 x 64, 4 warps), with the same bf16 errors; its GPU test passed on the H100.
SLIDE_LAUNCH = (128, 256, 1, 3)
BWD_SLIDE = True
# 4 taps (KDA's ShortConv): True, the backward loads each of the 7 distinct x tiles once (``_conv_bwd4_kernel``),
# not 16 shifted ones (same file: 3-5% under the generic kernel at the same launch).
BWD_TAPS4 = True
_INTERP_BT, _INTERP_BC = 16, 16


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _reach(pos, rows, T, W: tl.constexpr, HAS_POS: tl.constexpr):
    """How many taps back each of ``rows`` may read: its position in its document (``pos``), or ``W``."""
    if HAS_POS:
        return tl.load(pos + rows, mask=(rows >= 0) & (rows < T), other=0)
    else:
        return tl.full(rows.shape, W, tl.int32)


@triton.jit
def _pre(x, w, rows, c, cm, T, C, reach, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Pre-activation ``sum_i w[c, i] x[rows - (W - 1) + i, c]`` of a ``[BT, BC]`` block, fp32; tap ``i``
    only where ``W - 1 - i <= reach`` (the row's own document)."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i in tl.static_range(W):
        s = rows - (W - 1) + i
        ok = (s >= 0) & (s < T) & (W - 1 - i <= reach)
        xv = tl.load(x + s[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
        acc += xv.to(tl.float32) * tl.load(w + c * W + i, mask=cm, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _block(C, BT: tl.constexpr, BC: tl.constexpr):
    """This program's time block, batch row, row indices ``t``, channels ``c`` and channel mask."""
    i_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    return i_t, tl.program_id(2).to(tl.int64), i_t * BT + tl.arange(0, BT), c, c < C


@triton.jit
def _conv_fwd_kernel(x, w, y, pos, T, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
                     HAS_POS: tl.constexpr):
    i_t, i_b, t, c, cm = _block(C, BT, BC)
    x += i_b * T * C
    y += i_b * T * C
    pos += i_b * T
    acc = _pre(x, w, t, c, cm, T, C, _reach(pos, t, T, W, HAS_POS), W, BT, BC)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + t[:, None] * C + c[None, :], acc.to(y.dtype.element_ty), mask=(t < T)[:, None] & cm[None, :])


@triton.jit
def _conv_bwd_kernel(x, w, dy, dx, dw, pos, T, C, NTB, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                     SILU: tl.constexpr, HAS_POS: tl.constexpr):
    """dx for rows ``t`` of the block and this block's partial of dw (``dw [B * NTB, C, W]``).

    ``dx[t] = sum_j w[W-1-j] dpre[t + j]`` needs dpre at rows ``t .. t + W - 1``; each is
    recomputed here (pre-activation from x, then ``dy * act'``), so no ``[B, T, C]`` dpre buffer.
    With ``pos``, row ``t + j`` reads x[t] only when ``j <= pos[t + j]`` (the same document)."""
    i_t, i_b, t, c, cm = _block(C, BT, BC)
    x += i_b * T * C
    dy += i_b * T * C
    dx += i_b * T * C
    pos += i_b * T
    dxa = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        r = t + j  # rows whose output depends on x[t] through tap W - 1 - j
        reach = _reach(pos, r, T, W, HAS_POS)
        rin = (r < T) & (j <= reach)
        g = tl.load(dy + r[:, None] * C + c[None, :], mask=rin[:, None] & cm[None, :], other=0.0).to(tl.float32)
        if SILU:
            pre = _pre(x, w, r, c, cm, T, C, reach, W, BT, BC)
            sg = tl.sigmoid(pre)
            g = g * sg * (1.0 + pre * (1.0 - sg))
        dxa += g * tl.load(w + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)[None, :]
        if j == 0:  # dpre at the block's own rows: its part of dw
            for i in tl.static_range(W):
                s = t - (W - 1) + i
                ok = (s >= 0) & (s < T) & (W - 1 - i <= reach)
                xv = tl.load(x + s[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
                part = tl.sum(g * xv.to(tl.float32), axis=0)
                tl.store(dw + ((i_b * NTB + i_t) * C + c) * W + i, part, mask=cm)
    tl.store(dx + t[:, None] * C + c[None, :], dxa.to(dx.dtype.element_ty), mask=(t < T)[:, None] & cm[None, :])


@triton.jit
def _pick(d: tl.constexpr, xm3, xm2, xm1, x0, xp1, xp2, xp3):
    """The x tile at row offset ``d`` (-3 .. 3) of the seven a 4-tap backward reads."""
    if d == -3:
        return xm3
    elif d == -2:
        return xm2
    elif d == -1:
        return xm1
    elif d == 0:
        return x0
    elif d == 1:
        return xp1
    elif d == 2:
        return xp2
    else:
        return xp3


@triton.jit
def _tap(i: tl.constexpr, w0, w1, w2, w3):
    """Tap ``i`` (0 .. 3) of the four ``[1, BC]`` weight rows."""
    if i == 0:
        return w0
    elif i == 1:
        return w1
    elif i == 2:
        return w2
    else:
        return w3


@triton.jit
def _row_tile(x, t, d: tl.constexpr, c, cm, T, C):
    """x rows ``t + d`` of the block (zero outside ``0 .. T - 1``) as fp32."""
    s = t + d
    return tl.load(x + s[:, None] * C + c[None, :], mask=((s >= 0) & (s < T))[:, None] & cm[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _conv_bwd4_kernel(x, w, dy, dx, dw, pos, T, C, NTB, BT: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr,
                      HAS_POS: tl.constexpr):
    """``_conv_bwd_kernel`` for 4 taps (KDA's ShortConv): the 16 shifted x tiles that its recomputed
    pre-activations read (4 rows x 4 taps) are 7 distinct tiles, rows ``t - 3 .. t + 3``; each is loaded once,
    and a tap across a document start is zeroed by ``tl.where`` rather than by its load's mask. Every output
    element sums the same terms in the same order as the generic kernel (the same dx, the same dw partials)."""
    i_t, i_b, t, c, cm = _block(C, BT, BC)
    x += i_b * T * C
    dy += i_b * T * C
    dx += i_b * T * C
    pos += i_b * T
    xm3 = _row_tile(x, t, -3, c, cm, T, C)
    xm2 = _row_tile(x, t, -2, c, cm, T, C)
    xm1 = _row_tile(x, t, -1, c, cm, T, C)
    x0 = _row_tile(x, t, 0, c, cm, T, C)
    xp1 = _row_tile(x, t, 1, c, cm, T, C)
    xp2 = _row_tile(x, t, 2, c, cm, T, C)
    xp3 = _row_tile(x, t, 3, c, cm, T, C)
    # the taps, once (inside the loops the dw stores between their loads would keep the compiler from reusing them)
    w0 = tl.load(w + c * 4, mask=cm, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(w + c * 4 + 1, mask=cm, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w + c * 4 + 2, mask=cm, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w + c * 4 + 3, mask=cm, other=0.0).to(tl.float32)[None, :]
    dxa = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(4):
        r = t + j  # rows whose output depends on x[t] through tap 3 - j
        reach = _reach(pos, r, T, 4, HAS_POS)
        rin = (r < T) & (j <= reach)
        g = tl.load(dy + r[:, None] * C + c[None, :], mask=rin[:, None] & cm[None, :], other=0.0).to(tl.float32)
        if SILU:
            pre = tl.zeros([BT, BC], dtype=tl.float32)
            for i in tl.static_range(4):
                xv = _pick(j - 3 + i, xm3, xm2, xm1, x0, xp1, xp2, xp3)
                pre += tl.where((3 - i <= reach)[:, None], xv, 0.0) * _tap(i, w0, w1, w2, w3)
            sg = tl.sigmoid(pre)
            g = g * sg * (1.0 + pre * (1.0 - sg))
        dxa += g * _tap(3 - j, w0, w1, w2, w3)
        if j == 0:  # dpre at the block's own rows: its part of dw
            for i in tl.static_range(4):
                xv = tl.where((3 - i <= reach)[:, None], _pick(i - 3, xm3, xm2, xm1, x0, xp1, xp2, xp3), 0.0)
                tl.store(dw + ((i_b * NTB + i_t) * C + c) * 4 + i, tl.sum(g * xv, axis=0), mask=cm)
    tl.store(dx + t[:, None] * C + c[None, :], dxa.to(dx.dtype.element_ty), mask=(t < T)[:, None] & cm[None, :])


@triton.jit
def _slide_row(x, r, c, cm, T, C):
    """Row ``r`` (``[BC]`` channels ``c``) of x as fp32, zero outside ``0 .. T - 1``."""
    rr = c * 0 + r
    return tl.load(x + rr * C + c, mask=cm & (rr >= 0) & (rr < T), other=0.0).to(tl.float32)


@triton.jit
def _conv_bwd_slide_kernel(x, w, dy, dx, dw, pos, T, C, NTB, BT: tl.constexpr, BC: tl.constexpr,
                           SILU: tl.constexpr, HAS_POS: tl.constexpr, STAGES: tl.constexpr):
    """The 4-tap backward as one pass down the rows of a ``BT``-row, ``BC``-channel block: each x and dy row is
    loaded once (plus 3 rows of x before the block and 3 of dy after it), the pre-activation of each row formed
    once from the last four x rows (kept in registers), and dx of a row completed 3 rows later from the four
    dpre rows it takes, ``dx[t] = sum_j [j <= reach(t + j)] dpre[t + j] w[3 - j]`` in the order of j (the tile
    kernels' order: the interpreter gives their dx bit for bit); dw's partial of the block sums its rows in order.
    Registers hold a few ``[BC]`` rows, not ``[BT, BC]`` tiles: nothing to spill, so the loop is bound by its
    loads."""
    i_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    i_b = tl.program_id(2).to(tl.int64)
    x += i_b * T * C
    dy += i_b * T * C
    dx += i_b * T * C
    pos += i_b * T
    t0 = i_t * BT
    w0 = tl.load(w + c * 4, mask=cm, other=0.0).to(tl.float32)
    w1 = tl.load(w + c * 4 + 1, mask=cm, other=0.0).to(tl.float32)
    w2 = tl.load(w + c * 4 + 2, mask=cm, other=0.0).to(tl.float32)
    w3 = tl.load(w + c * 4 + 3, mask=cm, other=0.0).to(tl.float32)
    # x rows r - 3, r - 2, r - 1 before the first row r = t0 (zero before the sequence)
    xa = _slide_row(x, t0 - 3, c, cm, T, C)
    xb = _slide_row(x, t0 - 2, c, cm, T, C)
    xc = _slide_row(x, t0 - 1, c, cm, T, C)
    # dx accumulators of rows r - 1, r - 2, r - 3
    a1 = tl.zeros([BC], dtype=tl.float32)
    a2 = tl.zeros([BC], dtype=tl.float32)
    a3 = tl.zeros([BC], dtype=tl.float32)
    d0 = tl.zeros([BC], dtype=tl.float32)
    d1 = tl.zeros([BC], dtype=tl.float32)
    d2 = tl.zeros([BC], dtype=tl.float32)
    d3 = tl.zeros([BC], dtype=tl.float32)
    end = t0 + BT
    for r in tl.range(t0, end + 3, num_stages=STAGES):
        xd = _slide_row(x, r, c, cm, T, C)
        g = _slide_row(dy, r, c, cm, T, C)
        if HAS_POS:  # past T, g is 0 whatever the reach: the last row's stands in
            reach = tl.load(pos + tl.minimum(r, T - 1))
        else:
            reach = 4
        ta, tb, tc = tl.where(3 <= reach, xa, 0.0), tl.where(2 <= reach, xb, 0.0), tl.where(1 <= reach, xc, 0.0)
        if SILU:
            pre = ta * w0 + tb * w1 + tc * w2 + xd * w3
            sg = tl.sigmoid(pre)
            g = g * sg * (1.0 + pre * (1.0 - sg))
        own = r < end  # the block's own rows: their part of dw
        d0 += tl.where(own, g * ta, 0.0)
        d1 += tl.where(own, g * tb, 0.0)
        d2 += tl.where(own, g * tc, 0.0)
        d3 += tl.where(own, g * xd, 0.0)
        # g reaches dx[r - j] through tap 3 - j where j <= reach
        a0 = g * w3
        a1 += tl.where(1 <= reach, g * w2, 0.0)
        a2 += tl.where(2 <= reach, g * w1, 0.0)
        a3 += tl.where(3 <= reach, g * w0, 0.0)
        t = r - 3
        tt = c * 0 + t
        tl.store(dx + tt * C + c, a3.to(dx.dtype.element_ty), mask=cm & (tt >= t0) & (tt < T))
        a3, a2, a1 = a2, a1, a0
        xa, xb, xc = xb, xc, xd
    part = dw + ((i_b * NTB + i_t) * C + c) * 4
    tl.store(part, d0, mask=cm)
    tl.store(part + 1, d1, mask=cm)
    tl.store(part + 2, d2, mask=cm)
    tl.store(part + 3, d3, mask=cm)


def _blocks(which: str) -> tuple[int, int, int]:
    """(rows, channels, warps) of the ``which`` ("fwd" / "bwd") launch."""
    return (_INTERP_BT, _INTERP_BC, 4) if _interpret() else LAUNCH[which]


class CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, activation: str | None,
                pos: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        W = weight.shape[1]
        x = x.contiguous()
        w = weight.contiguous()
        y = torch.empty_like(x)
        BT, BC, warps = _blocks("fwd")
        grid = (triton.cdiv(T, BT), triton.cdiv(C, BC), B)
        _conv_fwd_kernel[grid](x, w, y, x if pos is None else pos, T, C, W=W, BT=BT, BC=BC,
                               SILU=activation == "silu", HAS_POS=pos is not None, num_warps=warps)
        ctx.save_for_backward(x, w, pos)
        ctx.activation = activation
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, w, pos = ctx.saved_tensors
        B, T, C = x.shape
        W = w.shape[1]
        slide = W == 4 and BWD_SLIDE
        if slide:
            BT, BC, warps, stages = (_INTERP_BT, _INTERP_BC, 1, 1) if _interpret() else SLIDE_LAUNCH
        else:
            BT, BC, warps = _blocks("bwd")
        ntb = triton.cdiv(T, BT)
        dx = torch.empty_like(x)
        dw = torch.empty(B * ntb, C, W, device=x.device, dtype=torch.float32)
        grid, args = (ntb, triton.cdiv(C, BC), B), (x, w, dy.contiguous(), dx, dw, x if pos is None else pos, T, C, ntb)
        flags = {"BT": BT, "BC": BC, "SILU": ctx.activation == "silu", "HAS_POS": pos is not None, "num_warps": warps}
        if slide:
            _conv_bwd_slide_kernel[grid](*args, STAGES=stages, **flags)
        elif W == 4 and BWD_TAPS4:
            _conv_bwd4_kernel[grid](*args, **flags)
        else:
            _conv_bwd_kernel[grid](*args, W=W, **flags)
        return dx, dw.sum(0).to(w.dtype), None, None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, activation: str | None = None,
                  pos: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution over time with an optional fused activation.

    Args:
        x: ``[B, T, C]`` bf16 / fp16 / fp32, on a CUDA device (or any device under
            ``TRITON_INTERPRET=1``).
        weight: ``[C, W]`` taps; ``weight[:, W - 1]`` multiplies the current token.
        activation: None or ``"silu"``.
        pos: packed documents: ``[B, T]`` integer position of each token within its document (0 at a
            document's first token; ``Documents.pos``), so no output reads an input of an earlier
            document; None: one sequence per row.

    Returns:
        ``y [B, T, C]`` in x's dtype; gradients flow to x and weight.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not allowed: expected one of {ACTIVATIONS}")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"weight must be [C, W] with C = {x.shape[2]}, got shape {tuple(weight.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype {x.dtype} is not allowed: expected bf16, fp16 or fp32")
    if pos is not None:
        if pos.shape != x.shape[:2] or pos.dtype not in (torch.int32, torch.int64) or pos.device != x.device:
            raise ValueError(f"pos must be an int32/int64 [B, T] = {tuple(x.shape[:2])} tensor on {x.device}, got "
                             f"{(tuple(pos.shape), pos.dtype, str(pos.device))}")
        pos = pos.contiguous()
    if x.shape[1] == 0:
        return x.clone()
    return CausalConv1dFunction.apply(x, weight, activation, pos)


def causal_conv1d_torch(x: torch.Tensor, weight: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """Reference: ``F.conv1d`` on the zero-padded ``[B, C, T]`` view (what ``ShortConv`` computes)."""
    W = weight.shape[1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight[:, None, :].to(x.dtype), groups=x.shape[2])
    y = y.transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


# (rows, channels, warps) launches ``launch_rows`` times; the first of each is ``LAUNCH``'s
FWD_LAUNCHES = ((16, 128, 4), (32, 128, 4), (64, 128, 4), (32, 64, 4))
BWD_LAUNCHES = ((16, 128, 8), (16, 128, 4), (32, 128, 8), (32, 64, 4), (64, 128, 4), (64, 64, 4))
# the one-pass backward's (rows, channels, warps, stages): 4 or 8 channels a thread (83 / 168 registers, no spill
# for sm_90a with Triton 3.9), 64 or 128 rows a program
SLIDE_LAUNCHES = ((64, 256, 1, 3), (64, 128, 1, 3), (128, 256, 1, 3), (64, 256, 2, 3), (64, 512, 2, 3),
                  (32, 256, 1, 2))


def bwd_row_name(launch: tuple[int, ...] | None = None, taps4: bool | None = None, slide: bool | None = None) -> str:
    """The ``launch_rows`` row of a backward launch (rows, channels, warps[, stages]) and kernel; by default the op's
    own (``SLIDE_LAUNCH`` with ``BWD_SLIDE``, else ``LAUNCH["bwd"]``, ``BWD_TAPS4``), e.g. ``bwd_taps4_64x64x4``,
    ``bwd_slide_64x256x1x3``."""
    slide = BWD_SLIDE if slide is None else slide
    launch = (SLIDE_LAUNCH if slide else LAUNCH["bwd"]) if launch is None else launch
    kind = "slide" if slide else "taps4" if (BWD_TAPS4 if taps4 is None else taps4) else "generic"
    return f"bwd_{kind}_{'x'.join(map(str, launch))}"


def launch_rows(B: int, T: int, C: int, device: str, dtype: torch.dtype, time_ms: Callable[..., float],
                rel_err: Callable[[torch.Tensor, torch.Tensor], float], every_launch: bool = True,
                tag: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Rows for choosing ``LAUNCH``, ``BWD_TAPS4`` and ``BWD_SLIDE`` by measurement (``kernels/bench.py --entry
    conv``): the op with 4 taps and SiLU on ``x [B, T, C]`` in ``dtype``, per forward launch and per backward launch
    and kernel (``taps4`` / ``generic``, and the one-pass ``slide`` kernel at each of ``SLIDE_LAUNCHES``), beside
    torch's ``F.conv1d`` path; each row ``fwd_ms``, ``fwd_bwd_ms`` (``time_ms(fn, before=)``: ms, or a result with
    ``.ms``) and the errors of y, dx, dw (``rel_err``) against the fp32 reference; a launch that fails to compile,
    its error. ``every_launch`` False: the first of each only (a CPU interpreter's smoke run). ``LAUNCH``,
    ``BWD_TAPS4``, ``BWD_SLIDE`` and ``SLIDE_LAUNCH`` are restored."""
    global BWD_TAPS4, BWD_SLIDE, SLIDE_LAUNCH
    gen = torch.Generator().manual_seed(0)
    x32, w = torch.randn(B, T, C, generator=gen), ((torch.rand(C, 4, generator=gen) - 0.5) / 2).to(device)
    dy = torch.randn(B, T, C, generator=gen).to(device)
    xr, wr = x32.to(device).requires_grad_(), w.clone().requires_grad_()
    yr = causal_conv1d_torch(xr, wr, "silu")
    (yr * dy).sum().backward()
    x, wt, dyd = x32.to(device, dtype).requires_grad_(), w.clone().requires_grad_(), dy.to(dtype)

    def clear() -> None:
        x.grad = wt.grad = None

    cases = [("torch_conv1d", None, None, None)] + [
        (f"fwd_{'x'.join(map(str, f))}", f, None, "taps4") for f in FWD_LAUNCHES[:None if every_launch else 1]] + [
        (bwd_row_name(b, k == "taps4", False), None, b, k) for k in ("taps4", "generic")
        for b in BWD_LAUNCHES[:None if every_launch else 1]] + [
        (bwd_row_name(b, slide=True), None, b, "slide") for b in SLIDE_LAUNCHES[:None if every_launch else 1]]
    default, taps4, slide, slide_launch, rows = dict(LAUNCH), BWD_TAPS4, BWD_SLIDE, SLIDE_LAUNCH, []
    try:
        for impl, fwd, bwd, kernel in cases:
            fn = causal_conv1d_torch if kernel is None else causal_conv1d
            BWD_SLIDE = kernel == "slide"
            SLIDE_LAUNCH = bwd if BWD_SLIDE else slide_launch
            LAUNCH.update(fwd=fwd or default["fwd"], bwd=default["bwd"] if BWD_SLIDE else bwd or default["bwd"])
            BWD_TAPS4 = kernel != "generic"
            row: dict[str, Any] = {"impl": impl, **(tag or {}), "B": B, "T": T, "C": C}
            try:
                for key, call, before in (("fwd_ms", lambda f=fn: f(x, wt, "silu"), None),
                                          ("fwd_bwd_ms", lambda f=fn: f(x, wt, "silu").backward(dyd), clear)):
                    t = time_ms(call, before=before)
                    row[key] = float(getattr(t, "ms", t))
                clear()
                y = fn(x, wt, "silu")
                y.backward(dyd)
                row.update(err_y=rel_err(yr, y), err_dx=rel_err(xr.grad, x.grad), err_dw=rel_err(wr.grad, wt.grad))
            except Exception as e:  # a launch that does not compile on this GPU: its row says why
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
    finally:
        LAUNCH.update(default)
        BWD_TAPS4, BWD_SLIDE, SLIDE_LAUNCH = taps4, slide, slide_launch
    return rows
