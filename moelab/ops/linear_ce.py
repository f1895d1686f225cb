"""Cross-entropy of a linear head without the full logits: ``CE(h W^T, targets)`` in token chunks.

The plain loss of a language model materializes ``[N, vocab]`` logits (bf16 under autocast), an
fp32 copy for the softmax, the saved log-softmax and, in the backward, fp32 and bf16 gradients
of the logits: at N = 32768 tokens and a 32000-token vocabulary that is about 2 GB per copy.
``linear_cross_entropy`` walks the tokens in chunks instead and, because the loss is a scalar,
forms the gradients of ``h`` and ``W`` in the same pass (the softmax minus the one-hot target,
times ``W`` and ``h``), so only a chunk's logits ever exist and the backward is two scalings.

Semantics follow ``F.cross_entropy(F.linear(h, W).float(), targets, ignore_index=-100)`` (the
mean over targets != ignore_index; NaN when there are none): the logits are formed in the
compute dtype (the autocast dtype when autocast is on, else h's) and then taken to fp32, as the
plain path does.

Per chunk, the torch path's softmax side is a chain of elementwise passes over ``[c, V]`` tiles: the logits cast
to fp32, the log-softmax, the target gather, ``exp`` in place, the one-hot scatter, the cast of the gradient back
(about 1 GB of traffic per 4096-token chunk at V = 8192, eight such chunks a k3-mini step). With the Triton
backend (``backend``: "auto" takes it on a CUDA tensor) one kernel per chunk (``_ce_chunk_kernel``, one row per
program) reads the compute-dtype logits twice (the second pass from L2) and writes the row's loss and its
gradient row ``(softmax - onehot) * keep / n`` in the compute dtype: the row scaling rounds into the gradient
instead of into the ``[c, d]`` products, so the two paths agree to the compute dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import torch

from moelab.ops.backend import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

DEFAULT_CHUNK = 4096
BLOCK_V = 2048  # vocabulary columns a program holds at once (fp32, 8 per thread at 8 warps)

if HAS_TRITON:

    @triton.jit
    def _ce_chunk_kernel(logits, targets, scale, loss, grad, V, GRADS: tl.constexpr, BV: tl.constexpr):
        """Row ``r`` of a chunk: ``loss[r] = (logsumexp(x) - x[t]) * keep`` (0 where the target is ignored, ``scale[r]
        == 0``); with GRADS ``grad[r] = (softmax(x) - onehot(t)) * scale[r]`` in grad's dtype. fp32 math, an online
        max and sum over blocks of ``BV`` columns, then a second pass for the gradient."""
        r = tl.program_id(0).to(tl.int64)
        row = logits + r * V
        t = tl.load(targets + r)
        sc = tl.load(scale + r)
        cols = tl.arange(0, BV)
        m = tl.full([BV], float("-inf"), tl.float32)
        acc = tl.zeros([BV], dtype=tl.float32)
        for v0 in range(0, V, BV):
            x = tl.load(row + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # a lane that has seen only -inf (masked columns) shifts by 0, not by -inf: its sum stays 0, no NaN
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
        mx = tl.max(m, axis=0)
        lse = mx + tl.log(tl.sum(acc * tl.exp(m - mx), axis=0))
        keep = t >= 0
        safe = tl.where(keep, t, 0)
        xt = tl.load(row + safe).to(tl.float32)
        tl.store(loss + r, tl.where(keep, lse - xt, 0.0))
        if GRADS:
            out = grad + r * V
            for v0 in range(0, V, BV):
                c = v0 + cols
                x = tl.load(row + c, mask=c < V, other=float("-inf")).to(tl.float32)
                g = tl.exp(x - lse) - tl.where(c == safe, 1.0, 0.0)
                tl.store(out + c, (g * sc).to(out.dtype.element_ty), mask=c < V)


def _chunk_triton(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                  grads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_ce_chunk_kernel`` over a chunk: ``logits [c, V]`` (compute dtype, contiguous), ``targets [c]`` long (< 0:
    ignored), ``scale [c]`` fp32 (keep / n) -> ``(loss rows [c] fp32, gradient [c, V] in logits' dtype or None)``."""
    c, V = logits.shape
    loss = torch.empty(c, device=logits.device, dtype=torch.float32)
    grad = torch.empty_like(logits) if grads else loss
    bv = min(BLOCK_V, triton.next_power_of_2(V))
    _ce_chunk_kernel[(c,)](logits, targets, scale, loss, grad, V, GRADS=grads, BV=bv, num_warps=8)
    return loss, (grad if grads else None)


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The autocast dtype of h's device when autocast is on there, else h's own dtype."""
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk, dt, grads, fused):
        keep = targets != ignore_index
        n = keep.sum()
        # 1/n for the gradients (0 targets: zero gradients; the loss itself is 0/0 = NaN below)
        inv = 1.0 / n.clamp_min(1).to(torch.float32)
        hc, wc = h.to(dt), weight.to(dt)
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        dh = torch.empty_like(hc) if grads else None
        dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if grads else None
        if fused:  # the Triton kernel per chunk (module docstring): the row scaling is inside the gradient
            tgt_all = torch.where(keep, targets, -1)
            scale_all = keep.to(torch.float32) * inv
            for s in range(0, h.shape[0], chunk):
                e = min(s + chunk, h.shape[0])
                rows, grad = _chunk_triton((hc[s:e] @ wc.t()).contiguous(), tgt_all[s:e], scale_all[s:e], grads)
                loss += rows.sum()
                if grads:
                    dh[s:e] = grad @ wc
                    dw += (grad.t() @ hc[s:e]).float()
            ctx.save_for_backward(dh, dw)
            ctx.dtypes = (h.dtype, weight.dtype)
            return loss / n.to(torch.float32)
        for s in range(0, h.shape[0], chunk):
            e = min(s + chunk, h.shape[0])
            logits = (hc[s:e] @ wc.t()).float()  # [c, V]
            tgt, kp = targets[s:e], keep[s:e]
            safe = torch.where(kp, tgt, 0)[:, None]
            # one fused pass; logsumexp and a broadcast subtract took three (on the H200 the
            # subtract alone was 6 ms of a 195 ms training step of the fla-shape model)
            logp = torch.log_softmax(logits, dim=-1)
            del logits
            loss -= torch.where(kp, logp.gather(1, safe)[:, 0], 0.0).sum()
            if not grads:  # evaluation: the loss only
                continue
            # d(loss_sum)/d(logits) = softmax - onehot, formed in place in logp's buffer; the 1/n
            # and the ignore mask scale rows, so they go on the small [c, d] sides instead
            grad = logp.exp_()
            grad.scatter_add_(1, safe, torch.full(safe.shape, -1.0, device=grad.device))
            grad = grad.to(dt)
            row = (kp.to(torch.float32) * inv)[:, None]  # [c, 1]
            dh[s:e] = ((grad @ wc).float() * row).to(dt)
            dw += (grad.t() @ (hc[s:e].float() * row).to(dt)).float()
        ctx.save_for_backward(dh, dw)  # None, None without grads
        ctx.dtypes = (h.dtype, weight.dtype)
        return loss / n.to(torch.float32)

    @staticmethod
    def backward(ctx, grad_loss):
        dh, dw = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (dh * grad_loss).to(h_dtype), (dw * grad_loss).to(w_dtype), None, None, None, None, None, None


@torch.compiler.disable  # a compiled model calls it eagerly (a Python loop over chunks)
def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk: int = DEFAULT_CHUNK,
    backend: str = "auto",
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight^T`` against ``targets``, chunk by chunk.

    Args:
        h: ``[N, d]`` hidden states (any float dtype).
        weight: ``[V, d]`` head weight (e.g. an ``nn.Linear(d, V, bias=False)``'s ``weight``).
        targets: ``[N]`` long class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index: targets to leave out of the mean.
        chunk: tokens per chunk (>= 1): peak extra memory is a few ``[chunk, V]`` fp32 tiles (Triton: one
            ``[chunk, V]`` logits and one gradient tile in the compute dtype).
        backend: "auto" (Triton on a CUDA tensor), "triton" (also on CPU under ``TRITON_INTERPRET=1``) or "torch":
            who forms each chunk's loss and logits gradient (module docstring).

    Returns:
        fp32 scalar, differentiable w.r.t. ``h`` and ``weight``; NaN when every target is ignored
        (as ``F.cross_entropy``).
    """
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h must be [N, d] and weight [V, d] with the same d, got {tuple(h.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != h.shape[:1] or targets.dtype != torch.long:
        raise ValueError(f"targets must be [N] = [{h.shape[0]}] long, got {tuple(targets.shape)} {targets.dtype}")
    if chunk < 1:
        raise ValueError(f"chunk={chunk} is not allowed: expected chunk >= 1")
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    fused = use_triton(backend, h)
    return _LinearCE.apply(h, weight, targets, ignore_index, int(chunk), _compute_dtype(h), grads, fused)
