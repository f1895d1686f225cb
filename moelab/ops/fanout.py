"""One autocast cast of a layer's input for all the projections that read it.

Under autocast every ``F.linear`` casts its fp32 input to the autocast dtype itself, so a KDA layer's
input ``x [B, T, D]`` (the pre-norm's fp32 output) is cast six times (q, k, v, beta, gate, output gate),
and in the backward each projection's 16-bit ``dx`` is widened to fp32 on its own before autograd adds
the six: 12 extra passes over ``[B, T, D]`` and 10 more kernel launches per layer. ``fan_out(x, n)``
casts once and hands ``n`` aliases of the cast to the ``n`` readers; its backward widens each reader's
gradient into one fp32 sum. The forward computes what autocast computes, bit for bit; the gradient is the
same fp32 sum of the same exactly-widened terms, possibly added in another order.
"""

from __future__ import annotations

import torch

# What autocast casts (``cached_cast``): floating tensors other than fp64.
_CAST = (torch.float32, torch.float16, torch.bfloat16)


class _FanOut(torch.autograd.Function):
    """``x`` -> ``n`` aliases of ``x.to(dtype)``; backward: the sum of their gradients in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # a reader that took no part in the loss gives None
        ctx.in_dtype = x.dtype
        y = x.to(dtype)
        return tuple(y.view_as(y) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None]:
        total = None
        for g in grads:
            if g is None:
                continue
            if total is None:
                total = g.to(ctx.in_dtype, copy=True)  # a buffer of its own: the adds below write into it
            else:
                total.add_(g)  # fp32 += 16-bit: the term widened exactly, the sum in fp32
        return total, None, None


def fan_out(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """``x [..., D]`` as ``n`` tensors for ``n`` projections that read it under autocast.

    With autocast on for ``x``'s device and ``x`` in a dtype autocast casts, the ``n`` tensors are one
    cast of ``x`` to the autocast dtype (what each projection would have cast on its own) and their
    gradients come back as one sum in ``x``'s dtype; otherwise they are ``x`` itself, and nothing changes.
    """
    if n < 1:
        raise ValueError(f"fan_out: n={n} is not allowed: expected >= 1 reader")
    dev = x.device.type
    # torch.compile: inductor fuses the casts itself (and a Function returning aliases is a graph break)
    if not torch.is_autocast_enabled(dev) or x.dtype not in _CAST or torch.compiler.is_compiling():
        return (x,) * n
    dtype = torch.get_autocast_dtype(dev)
    if x.dtype == dtype:
        return (x,) * n
    return _FanOut.apply(x, n, dtype)
