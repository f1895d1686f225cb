"""Study 1 logic: the factored tile against its exact reference, decay statistics, layer hooks."""

import math

import pytest
import torch

from moelab.model import MoELab
from moelab.model.config import KDAConfig, ModelConfig
from moelab.studies.decay_bound import (collect_log_decay, decay_stats, exact_tile, factored_tile,
                                        tile_overflow_table)
from tests.helpers import rel_err


def _tile(S=16, K=32, g_min=-5.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(S, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(S, K, generator=gen), dim=-1)
    return q, k, g_min * torch.rand(S, K, generator=gen)


def test_exact_tile_matches_direct_sum():
    q, k, g = _tile(S=8, K=4)
    G = g.double().cumsum(0)
    ref = torch.zeros(8, 8, dtype=torch.float64)
    for i in range(8):
        for j in range(i + 1):
            ref[i, j] = (q[i].double() * k[j].double() * (G[i] - G[j]).exp()).sum()
    assert rel_err(ref, exact_tile(q, k, g)) < 1e-12


def test_factored_tile_fp32_is_exact_inside_the_bound():
    q, k, g = _tile(g_min=-5.0)
    assert rel_err(exact_tile(q, k, g), factored_tile(q, k, g, torch.float32)) < 1e-5


@pytest.mark.parametrize("dtype,g_min,finite", [("fp16", -5.0, False), ("bf16", -5.0, True), ("bf16", -12.0, False),
                                                ("fp32", -10.0, True)])
def test_overflow_table_marks_where_the_tile_breaks(dtype, g_min, finite):
    rows = tile_overflow_table(g_mins=[g_min], subtiles=[16], dtypes=[dtype], head_dim=16, trials=2)
    mid = next(r for r in rows if r["midpoint"])
    assert mid["finite"] is finite
    # the largest |exponent| a factor takes at a constant decay g_min: read off the 16-token tile's
    # cumulative decay around its midpoint row, not from the table's formula
    G = torch.full((16,), g_min, dtype=torch.float64).cumsum(0)
    assert mid["max_exponent"] == pytest.approx((G - G[8]).abs().max().item())
    if finite:
        assert mid["rel_err"] < 1e-2


def test_decay_stats_on_a_known_decay():
    g = torch.full((1, 32, 1, 2), -1.0)
    g[..., 1] = -20.0  # one channel decays far below the bound
    s = decay_stats(g, bound=-5.0, subtile=16)
    assert s["g_min"] == -20.0
    assert s["frac_below_bound"] == pytest.approx(0.5)
    assert s["max_tile_exponent"] == pytest.approx(20.0 * 8)
    assert s["frac_tiles_over_bf16"] == pytest.approx(0.5)  # 160 > 88.7 on the -20 channel only
    assert s["frac_tiles_over_fp16"] == pytest.approx(0.5)  # 8 < 11.1 on the -1 channel
    with pytest.raises(ValueError, match="T=4"):
        decay_stats(g[:, :4])


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_collect_log_decay_from_the_model(gate):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, pattern="K", final_mla=True, dense_layers=2,
                      kda=KDAConfig(num_heads=2, head_dim=16, gate=gate, backend="chunk", chunk_size=16)).validate()
    model = MoELab(cfg)
    g = collect_log_decay(model, torch.randint(0, 64, (2, 20)))
    assert list(g) == ["layers.0.mixer"]
    (gl,) = g.values()
    assert gl.shape == (2, 20, 2, 16) and (gl <= 0).all()
    if gate == "bounded":
        assert gl.min() > -5.0
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed
    assert math.isfinite(decay_stats(gl)["max_tile_exponent"])
