"""Tiny model configs shared by the model tests (small enough for many CPU forward passes)."""

from __future__ import annotations

from moelab.model.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig


def tiny_config(
    *,
    pattern: str = "KKKM",
    n_layers: int = 4,
    final_mla: bool = True,
    dense_layers: int = 1,
    mode: str = "prenorm",
    num_blocks: int = 2,
    gate: str = "bounded",
    activation: str = "situ_glu",
    latent_dim: int = 16,
    q_latent_dim: int = 0,
    fp32_output: bool = False,
    output_gate: bool = True,
    tie_embeddings: bool = False,
    kda_backend: str = "chunk",
    max_seq_len: int = 128,
    loss_backend: str = "torch",
) -> ModelConfig:
    """A validated ModelConfig with d_model 32, 2-head mixers of width 8 and 4 experts (top 2)."""
    return ModelConfig(
        vocab_size=50,
        d_model=32,
        n_layers=n_layers,
        pattern=pattern,
        final_mla=final_mla,
        dense_layers=dense_layers,
        dense_ffn_dim=48,
        max_seq_len=max_seq_len,
        tie_embeddings=tie_embeddings,
        loss_backend=loss_backend,
        kda=KDAConfig(num_heads=2, head_dim=8, decay_rank=4, gate=gate, backend=kda_backend, chunk_size=16),
        mla=MLAConfig(num_heads=2, head_dim=8, kv_latent_dim=12, q_latent_dim=q_latent_dim,
                      output_gate=output_gate, fp32_output=fp32_output),
        moe=MoEConfig(num_experts=4, top_k=2, num_shared=1, latent_dim=latent_dim, expert_dim=16,
                      activation=activation),
        residual=ResidualConfig(mode=mode, num_blocks=num_blocks),
    ).validate()
