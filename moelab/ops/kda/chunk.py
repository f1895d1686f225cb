"""Chunkwise-parallel KDA in plain PyTorch (fp32 math, autograd by torch, runs on CPU).

Same signature and semantics as :func:`moelab.ops.kda.naive.naive_recurrent_kda`; it is the
readable middle step between the token-by-token reference and the Triton kernels.

Derivation (one chunk of C tokens, state ``S_0`` ``[K, V]`` entering it, per batch and head).
Let ``G_i = sum_{m<=i} g_m`` be the within-chunk cumulative log decay (``G_i[c] <= 0``, non-
increasing in i). Unrolling ``S_i = Diag(e^{g_i}) S_{i-1} + k_i u_i^T`` gives

    S_i = Diag(e^{G_i}) S_0 + sum_{j<=i} Diag(e^{G_i - G_j}) k_j u_j^T,

where ``u_j = beta_j (v_j - (Diag(e^{g_j}) S_{j-1})^T k_j)`` is the delta-rule write. Expanding
the prediction term gives a unit lower-triangular system for all ``u`` of the chunk at once
(the WY / UT transform):

    (I + A) U = Diag(beta) (V - (K * e^G) S_0),   A_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}  (j < i)

so ``U = W' - W S_0`` with ``W' = (I+A)^-1 Diag(beta) V`` and ``W = (I+A)^-1 Diag(beta)(K * e^G)``.
Outputs and the state leaving the chunk are then matrix products:

    O     = scale * [ (Q * e^G) S_0 + Aqk U ],   Aqk_ij = sum_c q_ic k_jc e^{G_ic - G_jc}  (j <= i)
    S_C   = e^{G_C} * S_0 + (K * e^{G_C - G})^T U

Every exponent used is a difference ``G_i - G_j`` with ``j <= i`` (so ``<= 0``) or a ``G`` itself:
nothing overflows for any g, however negative. The pairwise differences are formed element-wise
as a ``[C, C, K]`` tensor per chunk, summed segment by segment (no cancellation) and masked above
the diagonal before ``exp``; that costs memory (this path is a reference, not the fast one) but
needs no bound on g.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _segment_sums(g: torch.Tensor) -> torch.Tensor:
    """``L[i, j] = sum_{j < m <= i} g_m = G_i - G_j`` for ``j <= i``, ``-inf`` above the diagonal.

    Summed directly rather than as ``G_i - G_j``: late in a chunk of very negative g both
    cumulative sums are large (``|G| ~ 1e4``) and their difference would lose the digits that
    matter for ``exp(G_i - G_j)`` near 1 (catastrophic cancellation).

    Args:
        g: ``[..., C, K]`` log decay, fp32.

    Returns:
        ``[..., C, C, K]`` (row i, column j); ``exp`` of it is the decay from token j to token i.
    """
    C = g.shape[-2]
    ones = torch.ones(C, C, dtype=torch.bool, device=g.device)
    below = ones.tril(-1)[..., None]  # m > j, for rows m
    terms = g.unsqueeze(-2).expand(*g.shape[:-2], C, C, g.shape[-1]).masked_fill(~below, 0.0)  # [.., m, j, K]
    L = terms.cumsum(dim=-3)  # row i: sum over j < m <= i
    # Masking before exp keeps the upper triangle (and its gradient) at exactly zero.
    return L.masked_fill(~ones.tril()[..., None], float("-inf"))


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward; gradients come from torch autograd.

    Args:
        q: ``[B, T, H, K]`` queries.
        k: ``[B, T, H, K]`` keys.
        v: ``[B, T, H, V]`` values.
        g: ``[B, T, H, K]`` per-channel log decay (natural log, <= 0); any magnitude.
        beta: ``[B, T, H]`` write strength in (0, 1).
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` state before the first token, or None (zeros).
        output_final_state: also return ``S_T``.
        chunk_size: tokens per chunk (any T works: the tail is padded with no-op tokens
            ``k = v = g = beta = 0``). Capped at T so a short input is a single chunk.

    Returns:
        ``o`` ``[B, T, H, V]`` in the dtype of ``v``, and ``S_T`` ``[B, H, K, V]`` fp32 or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (B, T, H, K) or g.shape != (B, T, H, K):
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q {tuple(q.shape)} [B, T, H, K]")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v {tuple(v.shape)} must be [B, T, H, V] and beta {tuple(beta.shape)} [B, T, H] "
                         f"with B, T, H = {B}, {T}, {H}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    C = max(1, min(chunk_size, T))
    N = -(-T // C)
    pad = N * C - T

    # [B, H, N, C, *] in fp32; padded tokens have k = 0 and beta = 0 (no write) and g = 0 (no
    # decay), so they leave the state untouched and their outputs are dropped.
    def prep(x: torch.Tensor) -> torch.Tensor:
        x = x.float().transpose(1, 2)  # [B, H, T, *]
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.reshape(B, H, N, C, x.shape[-1])

    qc, kc, vc, gc = prep(q), prep(k), prep(v), prep(g)
    bc = prep(beta.unsqueeze(-1))  # [B, H, N, C, 1]
    G = gc.cumsum(-2)  # [B, H, N, C, K], <= 0

    # Intra-chunk matrices for all chunks at once (they do not depend on the state).
    decay = _segment_sums(gc).exp()  # [B, H, N, C, C, K]: exp(G_i - G_j) for j <= i, else 0
    eye = torch.eye(C, dtype=decay.dtype, device=decay.device)
    A = bc * torch.einsum("...ic,...jc,...ijc->...ij", kc, kc, decay) * (1 - eye)  # strictly lower
    IA = eye + A
    Wv = torch.linalg.solve_triangular(IA, bc * vc, upper=False, unitriangular=True)  # [..., C, V]
    Wk = torch.linalg.solve_triangular(IA, bc * kc * G.exp(), upper=False, unitriangular=True)  # [..., C, K]
    Aqk = torch.einsum("...ic,...jc,...ijc->...ij", qc, kc, decay)  # lower incl. diagonal
    q_dec = qc * G.exp()  # (Q * e^G): reads the entering state
    k_dec = kc * decay[..., -1, :, :]  # (K * e^{G_C - G}): writes into the leaving state
    state_decay = G[..., -1, :].exp()  # [B, H, N, K]

    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    outs = []
    # The only sequential part: the state crosses chunk boundaries.
    for n in range(N):
        U = Wv[:, :, n] - Wk[:, :, n] @ S  # [B, H, C, V]
        outs.append(q_dec[:, :, n] @ S + Aqk[:, :, n] @ U)
        S = state_decay[:, :, n, :, None] * S + k_dec[:, :, n].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2).reshape(B, H, N * C, V)[:, :, :T] * scale
    return o.transpose(1, 2).to(dtype), (S if output_final_state else None)
