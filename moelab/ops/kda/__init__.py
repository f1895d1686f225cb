"""KDA (Kimi Delta Attention) operators: fp32 reference, chunked PyTorch path, Triton kernels.

``kda(...)`` is the one front door: it takes the whole op (optional q/k SiLU + L2 norm, the gate
from its raw input with A_log, dt_bias and g_min, the gated delta rule) and runs it with the
backend a config field names, so layers and studies switch implementations without code edits:

- ``recurrent``: :func:`naive_recurrent_kda`, token by token (the reference).
- ``chunk``: :func:`chunk_kda_torch`, chunkwise WY form in PyTorch (CPU-friendly, any g).
- ``triton``: ``moelab.ops.kda.triton_chunk.chunk_kda`` (GPU; imported on first use), with the
  prep and gate fused into its kernels.
- ``auto``: ``triton`` when q is on a CUDA device, else ``chunk``.

The PyTorch backends take the prep and gate from ``moelab.ops.kda.gate``, the one PyTorch copy of
those formulas (the Triton kernels are tested against it).
"""

from __future__ import annotations

import torch

from moelab.ops.kda.chunk import chunk_kda_torch
from moelab.ops.kda.gate import GATES, naive_kda_gate, naive_qk_prep
from moelab.ops.kda.naive import naive_recurrent_kda

BACKENDS = ("auto", "triton", "chunk", "recurrent")


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "chunk",
    chunk_size: int = 64,
    gate: str = "none",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    g_min: float | None = None,
    silu_qk: bool = False,
    l2norm_qk: bool = False,
    norm_eps: float = 1e-6,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule with per-channel decay, by the chosen backend.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` in (0, 1).
        g: ``[B, T, H, K]``: with ``gate="none"`` the log decay (natural log, <= 0); otherwise the
            gate's raw input z, turned into the log decay by the op (``gate.naive_kda_gate``).
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state, or None.
        output_final_state: also return the final state ``[B, H, K, V]`` fp32.
        backend: ``auto | triton | chunk | recurrent``.
        chunk_size: tokens per chunk for ``chunk`` / ``triton``.
        gate: ``none | bounded | softplus``; A_log ``[H]`` and dt_bias ``[H*K]`` (or None) are its
            parameters.
        g_min: the lower bound of g: the bounded gate's floor (required with ``gate="bounded"``),
            or with ``gate="none"`` the caller's promise ``g >= g_min``. Either lets the Triton
            backend use its bounded (factored-GEMM) mode; None: g is unbounded below.
        silu_qk, l2norm_qk, norm_eps: ``q, k <- L2Norm(SiLU(.))`` first, each step as flagged.
        validate: ``triton`` with ``gate="none"`` only: check the range of g first (one reduction
            and a host sync); callers whose g is bounded by construction pass False.

    Returns:
        ``(o [B, T, H, V] in v's dtype, S_T or None)``.
    """
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not allowed: expected one of {', '.join(map(repr, GATES))}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "chunk"
    if backend == "triton":
        from moelab.ops.kda.triton_chunk import chunk_kda

        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, g_min=g_min, validate=validate,
                         chunk_size=chunk_size, gate=gate, A_log=A_log, dt_bias=dt_bias, l2norm_qk=l2norm_qk,
                         silu_qk=silu_qk, norm_eps=norm_eps)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed: expected one of {', '.join(map(repr, BACKENDS))}")
    if gate == "bounded" and g_min is None:
        raise ValueError("gate='bounded' needs g_min, the gate's floor (a number < 0)")
    if silu_qk or l2norm_qk:
        q = naive_qk_prep(q, silu_qk, l2norm_qk, norm_eps).to(q.dtype)
        k = naive_qk_prep(k, silu_qk, l2norm_qk, norm_eps).to(k.dtype)
    if gate != "none":
        g = naive_kda_gate(g, A_log, gate, g_min, dt_bias)
    if backend == "recurrent":
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state)
    return chunk_kda_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, chunk_size=chunk_size)


__all__ = ["BACKENDS", "chunk_kda_torch", "kda", "naive_kda_gate", "naive_recurrent_kda"]
