"""Chunked linear cross-entropy (moelab/ops/linear_ce.py) against ``F.cross_entropy(F.linear(h, W))``.

fp32 on any device (exact up to rounding), bf16 autocast against the plain path under the same
autocast, and (GPU) bf16 at the fla-shape model's size; each with both backends (the Triton chunk kernel runs in
the interpreter on CPU).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from moelab.ops.linear_ce import linear_cross_entropy
from tests.helpers import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(N, d, V, seed=0, ignore=0.2):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=gen)
    w = torch.randn(V, d, generator=gen) / math.sqrt(d)
    t = torch.randint(0, V, (N,), generator=gen)
    t[torch.rand(N, generator=gen) < ignore] = -100
    return h.to(DEV), w.to(DEV), t.to(DEV)


def _plain(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def _run(fn, h, w, t, **kw):
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fn(hl, wl, t, **kw)
    loss.backward()
    return loss, hl.grad, wl.grad


BACKENDS = ("torch", "triton")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_fp32_matches_plain_loss_and_grads(chunk, backend):
    """Chunks of any size (1 token, not dividing N, larger than N): same loss and gradients."""
    h, w, t = _inputs(50, 16, 37)
    ref = _run(_plain, h, w, t)
    out = _run(linear_cross_entropy, h, w, t, chunk=chunk, backend=backend)
    assert abs(out[0].item() - ref[0].item()) <= 1e-5 * abs(ref[0].item())
    assert_close(ref[1], out[1], 1e-5, "dh")
    assert_close(ref[2], out[2], 1e-5, "dW")


def test_triton_kernel_over_several_vocabulary_blocks():
    """A vocabulary past the kernel's block (BLOCK_V columns at once: an online max and sum over blocks, a masked
    last block), the last id as a target and ignored rows: the plain path's loss and gradients."""
    h, w, t = _inputs(12, 8, 4100, seed=6)
    t[5] = 4099
    ref = _run(_plain, h, w, t)
    out = _run(linear_cross_entropy, h, w, t, chunk=5, backend="triton")
    assert abs(out[0].item() - ref[0].item()) <= 1e-5 * abs(ref[0].item())
    assert_close(ref[1], out[1], 1e-5, "dh")
    assert_close(ref[2], out[2], 1e-5, "dW")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_scales_by_the_incoming_gradient(backend):
    """A scaled loss (gradient accumulation divides by the micro-batch count, AMP multiplies by its
    scale) and a sum of two losses sharing the weight: the gradients scale and add as the plain path's."""
    h, w, t = _inputs(30, 16, 23, seed=4)
    h2, _, t2 = _inputs(20, 16, 23, seed=5)
    grads = []
    ours = functools.partial(linear_cross_entropy, backend=backend)
    for fn in (_plain, ours):
        hl, wl, hl2 = h.clone().requires_grad_(), w.clone().requires_grad_(), h2.clone().requires_grad_()
        (0.25 * fn(hl, wl, t) - 3.0 * fn(hl2, wl, t2)).backward()
        grads.append((hl.grad, hl2.grad, wl.grad))
    for name, a, b in zip(("dh", "dh2", "dW"), *grads):
        assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_autocast_matches_plain_path(backend):
    """Under bf16 autocast both paths form bf16 logits from bf16 operands and the loss in fp32."""
    h, w, t = _inputs(300, 64, 500, seed=1)
    with torch.autocast(DEV, dtype=torch.bfloat16):
        ref = _run(_plain, h, w, t)
        out = _run(linear_cross_entropy, h, w, t, chunk=128, backend=backend)
    assert out[0].dtype == torch.float32 and out[1].dtype == h.dtype and out[2].dtype == w.dtype
    assert abs(out[0].item() - ref[0].item()) <= 1e-3 * abs(ref[0].item())
    assert_close(ref[1], out[1], 1e-2, "dh")
    assert_close(ref[2], out[2], 1e-2, "dW")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_loss_and_all_ignored(backend):
    """Without grad the same loss (no gradient work); every target ignored: NaN like F.cross_entropy."""
    h, w, t = _inputs(40, 8, 11, seed=2)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, chunk=16, backend=backend)
    assert abs(loss.item() - _plain(h, w, t).item()) <= 1e-5 * abs(loss.item())
    assert torch.isnan(linear_cross_entropy(h, w, torch.full_like(t, -100), backend=backend))


def test_bad_inputs_are_refused():
    h, w, t = _inputs(10, 8, 11)
    with pytest.raises(ValueError, match=r"h must be \[N, d\]"):
        linear_cross_entropy(h, w[:, :4], t)
    with pytest.raises(ValueError, match=r"targets must be \[N\] = \[10\] long"):
        linear_cross_entropy(h, w, t[:5])
    with pytest.raises(ValueError, match="chunk=0"):
        linear_cross_entropy(h, w, t, chunk=0)
    with pytest.raises(ValueError, match="backend='cuda' is not allowed: expected one of 'auto', 'triton', 'torch'"):
        linear_cross_entropy(h, w, t, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_on_gpu_at_model_size(backend):
    """The fla-shape model's head: 32768 tokens, d 1024, vocab 32000, bf16 autocast."""
    h, w, t = _inputs(32768, 1024, 32000, seed=3, ignore=0.0)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = _run(_plain, h, w, t)
        out = _run(linear_cross_entropy, h, w, t, backend=backend)
    assert abs(out[0].item() - ref[0].item()) <= 1e-3 * abs(ref[0].item())
    assert_close(ref[1], out[1], 1e-2, "dh")
    assert_close(ref[2], out[2], 1e-2, "dW")
