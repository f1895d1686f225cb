"""Every config alternative builds and trains a few steps with a plain torch optimizer loop."""

from __future__ import annotations

import pytest
import torch

from moelab.model.transformer import MoELab
from tests.model.tiny import tiny_config

ALTERNATIVES = {
    "bounded_gate": dict(gate="bounded"),
    "softplus_gate": dict(gate="softplus"),
    "prenorm": dict(mode="prenorm"),
    "full_attnres": dict(mode="full_attnres"),
    "block_attnres": dict(mode="block_attnres", num_blocks=4),
    "situ_glu": dict(activation="situ_glu"),
    "swiglu": dict(activation="swiglu"),
    "plain_moe": dict(latent_dim=0),
    "latent_moe": dict(latent_dim=16),
    "dense_only": dict(dense_layers=4),
    "all_moe": dict(dense_layers=0),
    "all_kda": dict(pattern="K", final_mla=False),
    "all_mla": dict(pattern="M"),
    "q_latent": dict(q_latent_dim=8),
    "no_output_gate": dict(output_gate=False),
    "fp32_output": dict(fp32_output=True),
    "tied": dict(tie_embeddings=True),
    "recurrent_kda": dict(kda_backend="recurrent"),
}


@pytest.mark.parametrize("name", list(ALTERNATIVES))
def test_trains(name: str) -> None:
    torch.manual_seed(0)
    m = MoELab(tiny_config(**ALTERNATIVES[name]))
    before = [p.detach().clone() for p in m.parameters()]
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (4, 24), generator=gen)  # one fixed batch: the loss must fall on it
    losses = []
    for _ in range(6):
        out = m(ids[:, :-1], ids[:, 1:])
        loss = out.loss + 0.01 * out.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.05, f"{name}: loss did not fall: {losses}"
    changed = sum(not torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert changed >= 0.9 * len(before), f"{name}: only {changed}/{len(before)} parameter tensors changed"
