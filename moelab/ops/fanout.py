"""One autocast cast of a layer's input for all the projections that read it.

Under autocast every ``F.linear`` casts its fp32 input to the autocast dtype itself, so a KDA layer's
input ``x [B, T, D]`` (the pre-norm's fp32 output) is cast six times (q, k, v, beta, gate, output gate),
and in the backward each projection's 16-bit ``dx`` is widened to fp32 on its own before autograd adds
the six: five casts too many in the forward, six widening copies and five adds where one pass would do in
the backward (15 launches over ``[B, T, D]`` per layer that need not run). ``fan_out(x, n)``
casts once and hands ``n`` aliases of the cast to the ``n`` readers; its backward widens each reader's
gradient into one fp32 sum. The forward computes what autocast computes, bit for bit; the gradient is the
same fp32 sum of the same exactly-widened terms, possibly added in another order.

The sum: with the Triton backend one kernel reads the n 16-bit gradients once and writes the fp32 sum
(``2n + 4`` bytes per element, one launch); in PyTorch a widening copy and n - 1 in-place adds
(``10n - 4`` bytes, n launches). Both add the terms in reader order, so they agree bit for bit.
"""

from __future__ import annotations

import torch

from moelab.ops.backend import HAS_TRITON, use_triton

if HAS_TRITON:  # Triton is optional on CPU-only installs; the fused sum is then unavailable.
    import triton
    import triton.language as tl

_MAX_TERMS = 6  # gradients one launch of the sum kernel reads (a KDA layer's six); more: further launches
_BLOCK = 2048


if HAS_TRITON:

    @triton.jit
    def _add_term(acc, g, offs, m, ON: tl.constexpr):
        if ON:
            acc += tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
        return acc

    @triton.jit
    def _widen_sum_kernel(out, g0, g1, g2, g3, g4, g5, n, K: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
        """``out[:n] = (out if ACC else 0) + g0 + ... + g{K-1}``, each term widened to fp32 and added in that order."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        acc = tl.load(g0 + offs, mask=m, other=0.0).to(tl.float32)
        if ACC:
            acc = tl.load(out + offs, mask=m, other=0.0) + acc
        acc = _add_term(acc, g1, offs, m, K > 1)
        acc = _add_term(acc, g2, offs, m, K > 2)
        acc = _add_term(acc, g3, offs, m, K > 3)
        acc = _add_term(acc, g4, offs, m, K > 4)
        acc = _add_term(acc, g5, offs, m, K > 5)
        tl.store(out + offs, acc, mask=m)


def widen_sum(grads: list[torch.Tensor], backend: str = "auto") -> torch.Tensor:
    """``sum(grads)`` as fp32: ``grads`` (>= 1, one shape, any float dtype) -> a new fp32 tensor of that shape,
    each term widened exactly and the terms added in list order (both backends: the same bits)."""
    if not grads:
        raise ValueError("widen_sum: grads=[] is not allowed: expected >= 1 tensor")
    shape = grads[0].shape
    for i, g in enumerate(grads):
        if g.shape != shape or not g.is_floating_point():
            raise ValueError(f"widen_sum: grads[{i}] is {tuple(g.shape)} {g.dtype}, expected {tuple(shape)} floating")
    if not use_triton(backend, grads[0]):
        total = grads[0].to(torch.float32, copy=True)  # a buffer of its own: the adds below write into it
        for g in grads[1:]:
            total.add_(g)  # fp32 += 16-bit: the term widened exactly, the sum in fp32
        return total
    gs = [g.contiguous() for g in grads]
    out = torch.empty(shape, dtype=torch.float32, device=gs[0].device)
    n = out.numel()
    for start in range(0, len(gs), _MAX_TERMS):
        part = gs[start:start + _MAX_TERMS]
        pad = part + [part[0]] * (_MAX_TERMS - len(part))  # unread: K says how many count
        _widen_sum_kernel[(triton.cdiv(n, _BLOCK),)](out, *pad, n, K=len(part), ACC=start > 0, BLOCK=_BLOCK,
                                                     num_warps=4)
    return out


class _FanOut(torch.autograd.Function):
    """fp32 ``x`` -> ``n`` aliases of ``x.to(dtype)``; backward: the fp32 sum of their gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # a reader that took no part in the loss gives None
        ctx.backend = backend
        y = x.to(dtype)
        return tuple(y.view_as(y) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None]:
        terms = [g for g in grads if g is not None]
        return widen_sum(terms, ctx.backend) if terms else None, None, None, None


def fan_out(x: torch.Tensor, n: int, backend: str = "auto") -> tuple[torch.Tensor, ...]:
    """``x [..., D]`` as ``n`` tensors for ``n`` projections that read it under autocast.

    With autocast on for ``x``'s device and ``x`` in fp32 (a model's stream under autocast), the ``n`` tensors
    are one cast of ``x`` to the autocast dtype (what each projection would have cast on its own) and their
    gradients come back as one fp32 sum (:func:`widen_sum`, ``backend``); otherwise they are ``x`` itself, and
    each projection casts as autocast does.
    """
    if n < 1:
        raise ValueError(f"fan_out: n={n} is not allowed: expected >= 1 reader")
    dev = x.device.type
    # torch.compile: inductor fuses the casts itself (and a Function returning aliases is a graph break)
    if not torch.is_autocast_enabled(dev) or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return (x,) * n
    return _FanOut.apply(x, n, torch.get_autocast_dtype(dev), backend)
