"""The KDA gate and q/k prep in plain PyTorch: the one reference of the formulas.

    g = g_min * Sigmoid(exp(A_log_h) * (z + dt_bias))      gate="bounded"  (K3; g in (g_min, 0))
      = -exp(A_log_h) * Softplus(z + dt_bias)              gate="softplus" (Kimi Linear; g in (-inf, 0))
      = z                                                  gate="none"     (z is the log decay)
    qn = L2Norm(SiLU(q)),  kn = L2Norm(SiLU(k))            per (b, t, h) row of K channels

The Triton kernels (``triton_prep``, fused into ``triton_chunk.chunk_kda``) compute the same in
one pass and are tested against these; the PyTorch backends of ``moelab.ops.kda.kda`` and the KDA
layer's diagnostics call them directly. L2 norm: ``F.normalize`` semantics, ``x / max(||x||, eps)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GATES = ("none", "bounded", "softplus")
MAX_HEAD_DIM = 256
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def naive_kda_gate(z: torch.Tensor, A_log: torch.Tensor | None, gate: str, g_min: float | None = None,
                   dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Log decay ``g`` ``[B, T, H, K]`` fp32 (natural log, <= 0) from the gate input ``z`` ``[B, T, H, K]``.

    A_log: ``[H]`` log of the per-head rate (None for ``gate="none"``); g_min: the bounded gate's
    floor (< 0); dt_bias: ``[H*K]`` per-channel bias added to z, or None.
    """
    x = z.float()
    if gate == "none":
        return x
    H, K = z.shape[-2:]
    if dt_bias is not None:
        x = x + dt_bias.float().view(H, K)
    a = A_log.float().exp()[:, None]  # [H, 1]
    if gate == "bounded":
        return g_min * torch.sigmoid(a * x)
    return -a * F.softplus(x)


def naive_qk_prep(x: torch.Tensor, silu: bool, l2norm: bool, eps: float = 1e-6) -> torch.Tensor:
    """``[..., K]`` -> fp32 ``L2Norm(SiLU(x))`` over the last dim, each step only when flagged."""
    x = x.float()
    if silu:
        x = F.silu(x)
    return F.normalize(x, dim=-1, eps=eps) if l2norm else x



def check_op_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> tuple[int, int, int, int, int]:
    """The shape and dtype checks every KDA op shares; returns ``(B, T, H, K, V)``.

    q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``; T >= 1, head dims 1..MAX_HEAD_DIM,
    q, k, v of one dtype among bf16/fp16/fp32. Raises ValueError naming the offending shape or dtype.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q {tuple(q.shape)} [B, T, H, K]")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of q {tuple(q.shape)}, got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if T < 1:
        raise ValueError(f"T={T} is not allowed: expected T >= 1")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"head dims K={K}, V={V} are not allowed: expected 1..{MAX_HEAD_DIM}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of bf16/fp16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, T, H, K, V

def check_prep_args(
    q: torch.Tensor,
    k: torch.Tensor,
    z: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    gate: str,
    g_min: float | None,
    eps: float,
) -> None:
    """Raise ValueError for any prep argument outside what the kernels (and the reference) support."""
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not allowed: expected one of {GATES}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if not 1 <= K <= MAX_HEAD_DIM:
        raise ValueError(f"head dim K={K} is not allowed: expected 1..{MAX_HEAD_DIM}")
    if k.shape != q.shape or z.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and z {tuple(z.shape)} must match q {tuple(q.shape)}")
    if q.dtype not in DTYPES or k.dtype != q.dtype:
        raise ValueError(f"q, k must share one dtype of bf16/fp16/fp32, got {q.dtype}, {k.dtype}")
    if z.dtype not in DTYPES:
        raise ValueError(f"z dtype {z.dtype} is not allowed: expected one of bf16/fp16/fp32")
    if k.device != q.device or z.device != q.device:
        raise ValueError(f"q, k, z must be on one device, got {q.device}, {k.device}, {z.device}")
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps={eps} is not allowed: expected a finite eps > 0")
    if gate == "none":
        if A_log is not None or dt_bias is not None:
            raise ValueError(
                "gate='none' takes z as the log decay: A_log and dt_bias must be None (they would get no gradient)"
            )
        return
    if gate == "bounded" and not (g_min is not None and math.isfinite(g_min) and g_min < 0):
        raise ValueError(f"g_min={g_min} is not allowed for gate='bounded': expected a finite value < 0")
    if A_log is None or A_log.shape != (H,) or A_log.dtype not in DTYPES or A_log.device != q.device:
        got = None if A_log is None else (tuple(A_log.shape), A_log.dtype, A_log.device)
        raise ValueError(f"gate={gate!r} needs A_log of shape [H] = ({H},), float, on {q.device}; got {got}")
    if dt_bias is not None and (
        dt_bias.shape != (H * K,) or dt_bias.dtype not in DTYPES or dt_bias.device != q.device
    ):
        raise ValueError(
            f"dt_bias must be None or [H*K] = ({H * K},), float, on {q.device}; got "
            f"{(tuple(dt_bias.shape), dt_bias.dtype, dt_bias.device)}"
        )


def kda_prep_torch(
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
    """fp32 PyTorch reference of the KDA input prep (differentiable by autograd); defines the semantics
    of ``triton_prep.kda_prep`` and of the prep fused into ``triton_chunk.chunk_kda``.

    Arguments as ``triton_prep.prep_fwd``: q, k, z ``[B, T, H, K]``, A_log ``[H]``, dt_bias
    ``[H*K]`` or None. Returns ``(L2Norm(SiLU(q)), L2Norm(SiLU(k)), g)``, each step as flagged, all
    three ``[B, T, H, K]`` fp32 (g by :func:`naive_kda_gate`).
    """
    check_prep_args(q, k, z, A_log, dt_bias, gate, g_min, eps)
    return (naive_qk_prep(q, silu_qk, l2norm_qk, eps), naive_qk_prep(k, silu_qk, l2norm_qk, eps),
            naive_kda_gate(z, A_log, gate, g_min, dt_bias))
