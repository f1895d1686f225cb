"""Gated linear units for the FFNs: SiTU-GLU (Kimi K3) and SwiGLU, in PyTorch and fused in Triton.

    SiTU-GLU(g, u) = [b1 tanh(g / b1)] * sigmoid(g) * [b2 tanh(u / b2)]      (b1 = 4, b2 = 25)
    SwiGLU(g, u)   = g * sigmoid(g) * u                                       (= silu(g) * u)

``b tanh(z / b) = z + O(z^3 / b^2)`` is a smooth cap at +-b, so SiTU-GLU is bounded by ``b1 * b2``
and becomes SwiGLU as both betas grow.

Two implementations of the same function:
- ``situ_glu`` / ``swiglu``: plain PyTorch on separate gate and up tensors (the reference; autograd).
- ``glu(h, ..., backend)`` on a fused ``[..., 2F]`` projection (gate = first half, up = second half):
  with the Triton backend it runs one kernel forward and one backward (fp32 math, hand-written derivative). In eager
  PyTorch SiTU-GLU is ~9 elementwise passes forward and more backward over the largest activation
  of an MoE layer (``[tokens * top_k, 2F]``); the fused kernel reads/writes it once each way.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F

from moelab.base import ConfigError
from moelab.ops.backend import HAS_TRITON, use_triton

if HAS_TRITON:  # Triton is optional on CPU-only installs; the fused path is then unavailable.
    import triton
    import triton.language as tl

Activation = Literal["situ_glu", "swiglu"]
ACTIVATIONS: tuple[Activation, ...] = get_args(Activation)


def check_activation(name: str) -> str:
    """Return ``name`` if it is a known GLU activation, else raise ConfigError naming the choices."""
    if name not in ACTIVATIONS:
        raise ConfigError(f"activation={name!r} is not allowed: expected one of "
                          + ", ".join(map(repr, ACTIVATIONS)))
    return name


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU-GLU, reference PyTorch: ``[b1 tanh(gate/b1)] * sigmoid(gate) * [b2 tanh(up/b2)]``.

    gate, up: same shape ``[..., F]``, any float dtype; output has their shape and dtype and
    ``|out| <= beta1 * beta2``.
    """
    return (beta1 * torch.tanh(gate / beta1)) * torch.sigmoid(gate) * (beta2 * torch.tanh(up / beta2))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU, ``silu(gate) * up``; gate, up ``[..., F]``."""
    return F.silu(gate) * up


def glu(h: torch.Tensor, activation: str, beta1: float = 4.0, beta2: float = 25.0,
        backend: str = "auto") -> torch.Tensor:
    """Apply a GLU activation to a fused gate|up projection.

    h: ``[..., 2F]`` with gate = ``h[..., :F]``, up = ``h[..., F:]``. Returns ``[..., F]`` in h's dtype.
    backend: "triton" runs the fused kernel (also on CPU under TRITON_INTERPRET=1, for tests),
    "torch" the reference, "auto" Triton on CUDA.
    """
    check_activation(activation)
    if h.shape[-1] % 2:
        raise ValueError(f"glu: last dim {h.shape[-1]} of h must be even (gate | up halves)")
    if use_triton(backend, h):
        lead = h.shape[:-1]
        out = _FusedGLU.apply(h.reshape(-1, h.shape[-1]), activation == "situ_glu", float(beta1), float(beta2))
        return out.reshape(*lead, h.shape[-1] // 2)
    gate, up = h.chunk(2, dim=-1)
    if activation == "situ_glu":
        return situ_glu(gate, up, beta1, beta2)
    return swiglu(gate, up)


# ----------------------------------------------------------------------------------------------
# Fused Triton kernels. Math in fp32 whatever the storage dtype. tanh and sigmoid are written with
# tl.exp rather than libdevice calls, which keeps the kernels portable across Triton versions and
# the CPU interpreter.
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _tanh(z):
        # (1 - e) / (1 + e) loses relative accuracy near 0 (cancellation); SiTU-GLU lives there
        # (u / 25 is small), so below |z| = 0.2 use the odd Taylor series (next term < 1e-10).
        # Only exp(-2|z|) and a clamped series are evaluated, so nothing overflows.
        zc = tl.minimum(tl.maximum(z, -0.2), 0.2)
        z2 = zc * zc
        series = zc * (1.0 + z2 * (-1.0 / 3.0 + z2 * (2.0 / 15.0 + z2 * (-17.0 / 315.0))))
        e = tl.exp(-tl.abs(z))
        e = e * e  # exp(-2|z|), without forming 2|z| (which overflows near the fp32 max)
        far = (1.0 - e) / (1.0 + e)
        return tl.where(tl.abs(z) < 0.2, series, tl.where(z < 0, -far, far))

    @triton.jit
    def _sigmoid(z):
        # One division: r = 1 / (1 + exp(-|z|)) is sigmoid(|z|); sigmoid(z) = 1 - r = e r for z < 0.
        e = tl.exp(-tl.abs(z))
        r = 1.0 / (1.0 + e)
        return tl.where(z < 0, e * r, r)

    @triton.jit
    def _glu_fwd_kernel(h_ptr, out_ptr, n_rows, F_half, inv_beta1, inv_beta2, beta1, beta2,
                        SITU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < F_half)
        h_off = rows[:, None] * (2 * F_half) + cols[None, :]
        g = tl.load(h_ptr + h_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + h_off + F_half, mask=mask, other=0.0).to(tl.float32)
        s = _sigmoid(g)
        if SITU:
            # Multiplying by 1 / beta (passed in) instead of dividing: divisions dominate this kernel.
            a = (beta1 * _tanh(g * inv_beta1)) * s * (beta2 * _tanh(u * inv_beta2))
        else:
            a = g * s * u
        tl.store(out_ptr + rows[:, None] * F_half + cols[None, :], a.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(h_ptr, go_ptr, gh_ptr, n_rows, F_half, inv_beta1, inv_beta2, beta1, beta2,
                        SITU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < F_half)
        h_off = rows[:, None] * (2 * F_half) + cols[None, :]
        g = tl.load(h_ptr + h_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + h_off + F_half, mask=mask, other=0.0).to(tl.float32)
        go = tl.load(go_ptr + rows[:, None] * F_half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = _sigmoid(g)
        if SITU:
            t1 = _tanh(g * inv_beta1)
            t2 = _tanh(u * inv_beta2)
            cap_g = beta1 * t1
            cap_u = beta2 * t2
            # d/dg [b1 tanh(g/b1) sigmoid(g)] = (1 - t1^2) s + b1 t1 s (1 - s)
            dg = go * cap_u * s * ((1.0 - t1 * t1) + cap_g * (1.0 - s))
            du = go * cap_g * s * (1.0 - t2 * t2)
        else:
            gs = go * s
            dg = gs * u * (1.0 + g * (1.0 - s))
            du = gs * g
        tl.store(gh_ptr + h_off, dg.to(gh_ptr.dtype.element_ty), mask=mask)
        tl.store(gh_ptr + h_off + F_half, du.to(gh_ptr.dtype.element_ty), mask=mask)


# GLU launch: (elements per program, widest BLOCK_N, warps). A program covers BLOCK_N of the F
# output columns of BLOCK_M = elements / BLOCK_N rows. H200 sweep on [262144, 2 x 512] bf16: all
# tiles of 2048 elements are within 3%; SiTU-GLU fwd 348 us / bwd 407 us (compute-bound: exp and
# division units), SwiGLU 193 / 315 us (memory-bound, ~4.2 TB/s); 8192-element tiles with 4 warps
# are up to 2x slower (kernels/results/moe_h200.log).
GLU_TILE = {"fwd": (2048, 512, 4), "bwd": (2048, 512, 4)}


def _glu_launch(m: int, f_half: int, which: str):
    elements, widest, warps = GLU_TILE[which]
    block_n = min(widest, triton.next_power_of_2(f_half))
    block_m = max(1, elements // block_n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(f_half, block_n))
    return grid, dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)


class _FusedGLU(torch.autograd.Function):
    """Triton GLU on ``h [M, 2F]`` -> ``[M, F]``; saves only h, recomputes the rest in backward."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, situ: bool, beta1: float, beta2: float) -> torch.Tensor:
        h = h.contiguous()
        m, f_half = h.shape[0], h.shape[1] // 2
        out = torch.empty(m, f_half, dtype=h.dtype, device=h.device)
        if m > 0:
            grid, meta = _glu_launch(m, f_half, "fwd")
            _glu_fwd_kernel[grid](h, out, m, f_half, 1.0 / beta1, 1.0 / beta2, beta1, beta2, SITU=situ, **meta)
        ctx.save_for_backward(h)
        ctx.cfg = (situ, beta1, beta2)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (h,) = ctx.saved_tensors
        situ, beta1, beta2 = ctx.cfg
        grad_out = grad_out.contiguous()
        m, f_half = h.shape[0], h.shape[1] // 2
        grad_h = torch.empty_like(h)
        if m > 0:
            grid, meta = _glu_launch(m, f_half, "bwd")
            _glu_bwd_kernel[grid](h, grad_out, grad_h, m, f_half, 1.0 / beta1, 1.0 / beta2, beta1, beta2,
                                  SITU=situ, **meta)
        return grad_h, None, None, None
