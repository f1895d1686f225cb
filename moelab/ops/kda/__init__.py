"""KDA (Kimi Delta Attention) operators: fp32 reference, chunked PyTorch path, Triton kernels.

``kda(...)`` picks one by name so layers and studies switch backends with a config field:

- ``recurrent``: :func:`naive_recurrent_kda`, token by token (the reference).
- ``chunk``: :func:`chunk_kda_torch`, chunkwise WY form in PyTorch (CPU-friendly, any g).
- ``triton``: ``moelab.ops.kda.triton_chunk.chunk_kda`` (GPU; imported on first use).
- ``auto``: ``triton`` when q is on a CUDA device, else ``chunk``.
"""

from __future__ import annotations

import torch

from moelab.ops.kda.chunk import chunk_kda_torch
from moelab.ops.kda.naive import naive_recurrent_kda

BACKENDS = ("recurrent", "chunk", "triton", "auto")


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
    lower_bound: float | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule with per-channel decay, by the chosen backend.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` in (0, 1).
        g: ``[B, T, H, K]`` log decay (natural log, <= 0). When ``lower_bound`` is given the
            caller promises ``g >= lower_bound``, which lets the Triton path use its bounded
            (factored-GEMM) mode; the PyTorch paths ignore it.
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state, or None.
        output_final_state: also return the final state ``[B, H, K, V]`` fp32.
        backend: ``recurrent | chunk | triton | auto``.
        chunk_size: tokens per chunk for ``chunk`` / ``triton``.
        validate: ``triton`` only: check the range of g first (one reduction and a host sync);
            callers whose gate bounds g by construction pass False.

    Returns:
        ``(o [B, T, H, V] in v's dtype, S_T or None)``.
    """
    if backend == "auto":
        backend = "triton" if q.is_cuda else "chunk"
    if backend == "recurrent":
        return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state)
    if backend == "chunk":
        return chunk_kda_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, chunk_size=chunk_size)
    if backend == "triton":
        from moelab.ops.kda.triton_chunk import chunk_kda

        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state,
                         mode="bounded" if lower_bound is not None else "general",
                         lower_bound=lower_bound if lower_bound is not None else -5.0,
                         validate=validate, chunk_size=chunk_size)
    raise ValueError(f"backend={backend!r} is not allowed: expected one of {', '.join(map(repr, BACKENDS))}")


__all__ = ["BACKENDS", "chunk_kda_torch", "kda", "naive_recurrent_kda"]
