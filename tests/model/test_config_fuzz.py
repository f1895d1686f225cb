"""Config and shape fuzzing (hypothesis): every ModelConfig that validates builds, counts and runs.

A config ``validate()`` accepts must build a model whose parameter count is the analytic one, run a
forward of any length up to ``max_seq_len`` with finite logits and loss, and carry its decoding
state (prefill + one step == one pass); one it refuses must raise ConfigError naming a field,
never another exception.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moelab.base import ConfigError
from moelab.model import MoELab, param_counts
from moelab.model.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig, ResidualConfig
from tests.helpers import assert_close

VOCAB = 40


@st.composite
def model_configs(draw) -> ModelConfig:
    """Small configs over every structural choice, a few invalid on purpose (top_k > experts, too many blocks)."""
    d = draw(st.sampled_from([8, 16, 24]))
    experts = draw(st.integers(1, 5))
    return ModelConfig(
        vocab_size=VOCAB, d_model=d, n_layers=draw(st.integers(1, 4)),
        pattern=draw(st.sampled_from(["K", "M", "KM", "KKM"])), final_mla=draw(st.booleans()),
        dense_layers=draw(st.integers(0, 4)), dense_ffn_dim=draw(st.sampled_from([0, 12])),
        dense_activation=draw(st.sampled_from(["swiglu", "situ_glu"])), max_seq_len=32,
        tie_embeddings=draw(st.booleans()),
        kda=KDAConfig(num_heads=draw(st.integers(1, 3)), head_dim=draw(st.sampled_from([1, 4, 8, 12])),
                      conv_size=draw(st.integers(1, 4)), conv_backend="torch", decay_rank=draw(st.integers(1, 4)),
                      gate=draw(st.sampled_from(["bounded", "softplus"])), backend="chunk",
                      chunk_size=draw(st.sampled_from([16, 32]))),
        mla=MLAConfig(num_heads=draw(st.integers(1, 3)), head_dim=draw(st.sampled_from([4, 8])),
                      kv_latent_dim=draw(st.integers(1, 12)), q_latent_dim=draw(st.sampled_from([0, 6])),
                      output_gate=draw(st.booleans())),
        moe=MoEConfig(num_experts=experts, top_k=draw(st.integers(1, experts + 1)),
                      num_shared=draw(st.integers(0, 2)), latent_dim=draw(st.sampled_from([0, 4])),
                      expert_dim=draw(st.sampled_from([4, 8])),
                      activation=draw(st.sampled_from(["swiglu", "situ_glu"])), dispatch="loop", backend="torch"),
        residual=ResidualConfig(mode=draw(st.sampled_from(["prenorm", "full_attnres", "block_attnres"])),
                                num_blocks=draw(st.integers(1, 4)), backend="torch"),
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=model_configs(), T=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_a_valid_config_builds_counts_and_runs(cfg: ModelConfig, T: int, seed: int) -> None:
    try:
        cfg.validate()
    except ConfigError as e:
        assert "is not allowed" in str(e) or "must" in str(e), str(e)
        return
    torch.manual_seed(seed)
    model = MoELab(cfg).eval()
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"]
    ids = torch.randint(0, VOCAB, (2, T))
    with torch.no_grad():
        out = model(ids, torch.roll(ids, -1, 1))
        assert out.logits.shape == (2, T, VOCAB) and torch.isfinite(out.logits).all()
        assert torch.isfinite(out.loss)
        if T >= 2:  # decoding: a prefill of T - 1 tokens and one step give the one-pass logits
            first = model(ids[:, :-1], use_cache=True)
            step = model(ids[:, -1:], state=first.state, use_cache=True)
            assert_close(out.logits[:, -1], step.logits[:, -1], 1e-4, "last-token logits after prefill")


def test_invalid_draws_are_refused_by_name() -> None:
    """The strategy's invalid draws, pinned: each error names its field."""
    with pytest.raises(ConfigError, match="moe.top_k=4"):
        ModelConfig(moe=MoEConfig(num_experts=3, top_k=4)).validate()
    with pytest.raises(ConfigError, match="residual.num_blocks=4"):
        ModelConfig(n_layers=1, residual=ResidualConfig(mode="block_attnres", num_blocks=4)).validate()
