"""fp32 token-by-token reference for KDA (the gated delta rule with per-channel decay).

Every faster path (``chunk.py`` in PyTorch, the Triton kernels) is checked against this.
"""

from __future__ import annotations

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the recurrence one token at a time, in fp32.

    ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale * S_t^T q_t``.

    Args:
        q: ``[B, T, H, K]`` queries (already normalized if the caller wants that).
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` per-channel log decay (natural log, <= 0).
        beta: ``[B, T, H]`` write strength in (0, 1).
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, or None (zeros).
        output_final_state: also return ``S_T``.

    Returns:
        ``o`` ``[B, T, H, V]`` in the dtype of ``v``, and ``S_T`` ``[B, H, K, V]`` fp32 or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.float()
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        k_t = k[:, t]  # [B, H, K]
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)
        u = beta[:, t, :, None] * (v[:, t] - pred)  # [B, H, V]
        S = S + k_t[..., None] * u[..., None, :]
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S)
    return o.to(dtype), (S if output_final_state else None)
