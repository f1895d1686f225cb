"""Study 1 logic: the factored tile against its exact reference, decay statistics, layer hooks."""

import math

import pytest
import torch

from moelab.model import MoELab
from moelab.model.config import KDAConfig, ModelConfig
from moelab.studies.decay_bound import collect_log_decay, decay_stats, exact_tile, factored_tile, tile_overflow_table
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
    assert mid["max_exponent"] == pytest.approx(abs(g_min) * 8)
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


def _summary(safe: dict, val: tuple[float, float], std: tuple[float | None, float | None], epochs: float) -> dict:
    arm = {"g_min_observed": -0.5, "frac_below_-5": 0.0, "frac_tiles_over_bf16": 0.0, "n_seeds": 2}
    return {
        "most_negative_safe_g_min": safe,
        "arms": {"bounded": {**arm, "best_val_loss_mean": val[0], "best_val_loss_std": std[0]},
                 "softplus": {**arm, "g_min_observed": -7.0, "frac_below_-5": 0.25,
                              "best_val_loss_mean": val[1], "best_val_loss_std": std[1]}},
        "meta": {"epochs": epochs, "corpus_train_tokens": 1_000_000, "train_val_gap": {"bounded": 0.1, "softplus": 0.3},
                 "kernel_results": {"gpu": "NVIDIA H200", "commit": "730381e"}},
        "general_over_bounded_fwdbwd": {"B8_T4096": 1.36, "B1_T32768": 1.25},
    }


def test_findings_are_computed_from_the_summary() -> None:
    from moelab.studies.decay_bound import findings

    safe = {"bf16_tile16_noshift": -5.0, "bf16_tile16_midpoint": -10.0, "fp32_tile16_noshift": -2.0,
            "fp32_tile16_midpoint": -5.5, "fp16_tile16_midpoint": -1.0}
    text = findings(_summary(safe, (5.70, 5.60), (0.01, 0.02), 0.4))
    lines = text.splitlines()
    assert all(ln.startswith("- ") for ln in lines)
    assert ("down to $g_{min} = -5$ without a shift and down to $g_{min} = -10$ with the midpoint shift, so K3's "
            "bound $g_{min} = -5$ holds.") in lines[0]
    assert lines[1].endswith("holds only with the midpoint shift.")  # fp32: -2 without, -5.5 with the shift
    assert "at no swept bound without a shift" in lines[2] and lines[2].endswith("does not hold.")  # fp16
    assert "**softplus** is lower by 0.100" in text and "not seed noise" in text
    assert "-7.00 (below -5; 25.0% of entries below it)" in text
    assert "0.40 epochs of the 1,000,000-token training split" in text and "memorization" not in text
    assert "at most +0.300 nats/token" in text
    assert "1.25-1.36x" in text and "buys speed" in text and "commit 730381e" in text

    close = findings(_summary(safe, (5.60, 5.61), (0.02, 0.03), 3.0))
    assert "**bounded** is lower by 0.010" in close and "not distinguishable at these seeds" in close
    assert "memorization" in close
    one_seed = findings(_summary(safe, (5.60, 5.70), (None, None), 0.5))
    assert "from one seed per arm" in one_seed


def test_the_study_arms_differ_only_in_the_gate() -> None:
    from moelab.studies.decay_bound import ARMS, PRESETS, arms_factor

    for preset in PRESETS:
        assert arms_factor(preset) == {"model.kda.gate": {"bounded": "bounded", "softplus": "softplus"}}
    assert set(ARMS) == {"bounded", "softplus"}
    with pytest.raises(ValueError, match="preset='tpu'"):
        arms_factor("tpu")


def test_kernel_speed_reads_the_committed_results_with_their_commit() -> None:
    from moelab.studies.decay_bound import describe_source, kernel_speed

    rows, source = kernel_speed()
    assert {r["impl"] for r in rows} >= {"moelab_bounded", "moelab_general"}
    assert source["file"] == "kernels/results/kda_h200.json" and source["gpu"] == "NVIDIA H200"
    assert source["commit"] and len(source["commit"]) >= 7
    assert f"code at commit {source['commit']}" in describe_source(source)
