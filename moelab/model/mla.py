"""Gated multi-head latent attention with no positional encoding (architecture.md, "Gated MLA").

    c_kv = RMSNorm(W_dkv x)                      [B, T, kv_latent_dim]   (the only thing cached)
    k, v = W_uk c_kv, W_uv c_kv                  [B, T, H, d_head]
    q    = W_q x  or  W_uq RMSNorm(W_dq x)       full rank (q_latent_dim = 0) or low rank
    o    = softmax(q k^T / sqrt(d_head) + causal) v      (NoPE: position comes from the KDA layers;
                                                        packed documents: causal within each document)
    y    = W_o [ Sigmoid(W_g x) * o ]            output gate (output_gate=True), else W_o o

``fp32_output`` keeps ``o`` in fp32 through the gate and the output projection (K3 does so in
training) even under bf16 autocast.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moelab.model.attnres import RMSNorm
from moelab.model.config import MLAConfig
from moelab.model.documents import Documents


class MLA(nn.Module):
    """Gated MLA token mixer, ``[B, T, D] -> [B, T, D]``, with a latent cache for decoding."""

    def __init__(self, d_model: int, cfg: MLAConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        H, Dh = cfg.num_heads, cfg.head_dim
        self.H, self.Dh = H, Dh
        if cfg.q_latent_dim > 0:
            self.q_down = nn.Linear(d_model, cfg.q_latent_dim, bias=False)
            self.q_norm = RMSNorm(cfg.q_latent_dim, eps=norm_eps)
            self.q_up = nn.Linear(cfg.q_latent_dim, H * Dh, bias=False)
        else:
            self.q_proj = nn.Linear(d_model, H * Dh, bias=False)
        self.kv_down = nn.Linear(d_model, cfg.kv_latent_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_latent_dim, eps=norm_eps)
        self.k_up = nn.Linear(cfg.kv_latent_dim, H * Dh, bias=False)
        self.v_up = nn.Linear(cfg.kv_latent_dim, H * Dh, bias=False)
        self.g_proj = nn.Linear(d_model, H * Dh, bias=False) if cfg.output_gate else None
        self.o_proj = nn.Linear(H * Dh, d_model, bias=False)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_latent_dim > 0:
            return self.q_up(self.q_norm(self.q_down(x)))
        return self.q_proj(x)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None, use_cache: bool = False,
        docs: Documents | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [B, T, D]`` -> ``(y [B, T, D], latent cache [B, T_past + T, kv_latent_dim] or None)``.

        Args:
            x: input (already normalized by the caller).
            cache: normalized latents ``c_kv`` of the previous tokens, ``[B, T_past, kv_latent_dim]``.
            use_cache: return the cache extended by this call's latents.
            docs: packed documents (``moelab.model.documents``): each query attends to the earlier
                keys of its own document only (a ``[B, 1, T, T]`` mask). Not with a cache.
        """
        B, T, _ = x.shape
        H, Dh = self.H, self.Dh
        if docs is not None and (cache is not None or use_cache):
            raise ValueError("MLA: packed documents (docs) run without a cache: cache must be None and "
                             "use_cache False")
        c_kv = self.kv_norm(self.kv_down(x))
        if cache is not None:
            c_kv = torch.cat([cache.to(c_kv.dtype), c_kv], dim=1)
        S = c_kv.shape[1]
        q = self._query(x).view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_up(c_kv).view(B, S, H, Dh).transpose(1, 2)  # [B, H, S, Dh]
        v = self.v_up(c_kv).view(B, S, H, Dh).transpose(1, 2)
        past = S - T
        if docs is not None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.attention_mask())
        elif past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif T == 1:
            o = F.scaled_dot_product_attention(q, k, v)  # one new query sees every cached key
        else:
            # SDPA's is_causal aligns the mask top-left; with a cache the queries sit at the end.
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=past)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(1, 2).reshape(B, T, H * Dh)
        if self.cfg.fp32_output:
            with torch.autocast(device_type=x.device.type, enabled=False):
                o = o.float()
                if self.g_proj is not None:
                    o = torch.sigmoid(F.linear(x.float(), self.g_proj.weight.float())) * o
                # Back to the stream's dtype (fp32 under autocast, bf16 in a bf16-cast model).
                y = F.linear(o, self.o_proj.weight.float()).to(x.dtype)
        else:
            if self.g_proj is not None:
                o = torch.sigmoid(self.g_proj(x)) * o
            y = self.o_proj(o)
        return y, (c_kv if use_cache else None)
