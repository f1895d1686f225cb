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
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 4096


def _compute_dtype(h: torch.Tensor) -> torch.dtype:
    """The autocast dtype of h's device when autocast is on there, else h's own dtype."""
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, ignore_index, chunk, dt, grads):
        keep = targets != ignore_index
        n = keep.sum()
        # 1/n for the gradients (0 targets: zero gradients; the loss itself is 0/0 = NaN below)
        inv = 1.0 / n.clamp_min(1).to(torch.float32)
        hc, wc = h.to(dt), weight.to(dt)
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        dh = torch.empty_like(hc) if grads else None
        dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if grads else None
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
        return (dh * grad_loss).to(h_dtype), (dw * grad_loss).to(w_dtype), None, None, None, None, None


@torch.compiler.disable  # a compiled model calls it eagerly (a Python loop over chunks)
def linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight^T`` against ``targets``, chunk by chunk.

    Args:
        h: ``[N, d]`` hidden states (any float dtype).
        weight: ``[V, d]`` head weight (e.g. an ``nn.Linear(d, V, bias=False)``'s ``weight``).
        targets: ``[N]`` long class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index: targets to leave out of the mean.
        chunk: tokens per chunk (>= 1): peak extra memory is a few ``[chunk, V]`` fp32 tiles.

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
    return _LinearCE.apply(h, weight, targets, ignore_index, int(chunk), _compute_dtype(h), grads)
