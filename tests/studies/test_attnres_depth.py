"""Study 3 logic: the arms (only depth, mode and block count differ), the verdicts on known rows, the diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.config import load_config
from moelab.model import MoELab
from moelab.model.config import MLAConfig, ModelConfig, ResidualConfig
from moelab.studies import attnres_depth as study
from moelab.studies import common

FACTOR = ["model.n_layers", "model.residual.mode", "model.residual.num_blocks"]


@pytest.mark.parametrize("preset", ["cpu", "gpu"], ids=["cpu_plan", "gpu_plan"])  # "gpu" alone marks a GPU test
def test_arms_differ_only_in_depth_mode_and_blocks(preset: str) -> None:
    p = study.plan(preset)
    main, extra = study.arms(preset)
    assert sorted(study.arms_factor(preset)) == FACTOR
    for L in p.depths:
        assert {f"prenorm-L{L}", f"full-L{L}", f"block{study.main_blocks(L)}-L{L}"} <= set(main)
    for arm, ov in {**main, **extra}.items():
        cfg = load_config(p.base, {**p.common, **ov}).model
        info = study.arm_info(ov)
        assert (cfg.n_layers, cfg.residual.mode) == (info["n_layers"], info["residual"])
        if cfg.residual.mode == "block_attnres":
            assert cfg.residual.num_blocks == info["blocks"] and (2 * cfg.n_layers) % info["blocks"] == 0
        assert cfg.dense_layers >= cfg.n_layers, f"{arm}: an MoE layer would add routing to the comparison"
    # The harness refuses an arm that changes anything else (here one arm's learning rate).
    confounded = {**main, "prenorm-L2": {**next(iter(main.values())), "train.lr": 0.1}}
    with pytest.raises(ValueError, match=r"train.lr"):
        common.check_arms_differ_only(p.base, confounded, p.common)


def test_block_counts() -> None:
    assert [study.main_blocks(L) for L in (1, 2, 3, 4, 6, 12, 48)] == [1, 2, 3, 4, 6, 8, 8]
    assert study.block_counts(2) == [2]  # 4 blocks of 4 sublayers would be Full AttnRes
    assert study.block_counts(6) == [2, 4, 6]
    assert study.block_counts(24) == [2, 4, 8]
    with pytest.raises(ValueError, match="n_layers=0"):
        study.main_blocks(0)
    with pytest.raises(ValueError, match="mode='sum'"):
        study.arm_name("sum", 4)
    with pytest.raises(ValueError, match="preset='tpu'"):
        study.plan("tpu")


def _rows(losses: dict[tuple[str, int], list[float]]) -> list[dict]:
    """Rows of the summary from ``{(residual, n_layers): [val_loss per seed]}`` (block: the main count)."""
    rows = []
    for (mode, L), vals in losses.items():
        blocks = {"prenorm": None, "block_attnres": study.main_blocks(L), "full_attnres": 2 * L}[mode]
        for seed, v in enumerate(vals):
            rows.append({"residual": mode, "blocks": blocks, "n_layers": L, "seed": seed, "val_loss": v,
                         "params": 1000 + (0 if mode == "prenorm" else 4), "tokens": 512,
                         "tok_per_s": {"prenorm": 100.0, "block_attnres": 90.0, "full_attnres": 50.0}[mode],
                         "peak_mem_gb": None, "arm": study.arm_name(mode, L, blocks)})
    return rows


# 2 layers: every paired gap inside the noise; 8 layers: Full < Block < PreNorm, each interval excluding 0.
KNOWN = {("prenorm", 2): [2.00, 2.02], ("block_attnres", 2): [1.99, 2.02], ("full_attnres", 2): [2.01, 2.02],
         ("prenorm", 8): [1.90, 1.91], ("block_attnres", 8): [1.80, 1.81], ("full_attnres", 8): [1.78, 1.79]}


def test_paired_diff_with_its_t_interval() -> None:
    a, b = {0: 1.00, 1: 1.10, 2: 1.20}, {0: 1.10, 1: 1.21, 2: 1.29}
    d = study.paired_diff(a, b)  # differences -0.10, -0.11, -0.09: a seed offset shared by both arms drops out
    assert d["mean"] == pytest.approx(-0.1) and d["std"] == pytest.approx(0.01) and d["n"] == 3
    half = 4.302652729911275 * 0.01 / 3 ** 0.5  # t(0.975, 2 dof) * sd / sqrt(n)
    assert (d["low"], d["high"]) == (pytest.approx(-0.1 - half), pytest.approx(-0.1 + half))
    assert d["verdict"] == "lower"
    assert study.paired_diff(b, a)["verdict"] == "higher"
    assert study.paired_diff({0: 1.0, 1: 1.2}, {0: 1.05, 1: 1.1})["verdict"] == "within noise"
    one = study.paired_diff({0: 1.0, 1: 1.2}, {0: 1.05})  # only seed 0 pairs up
    assert one["verdict"] == "one seed" and one["low"] is None and one["mean"] == pytest.approx(-0.05)


def test_verdicts_on_known_rows() -> None:
    rows = _rows(KNOWN)
    v = study.depth_verdicts(rows)
    assert v["2"]["order"] == ("Block - PreNorm inside the noise (interval includes 0); "
                               "Full - Block inside the noise (interval includes 0)")
    assert v["8"]["order"] == ("Block - PreNorm better (interval excludes 0); "
                               "Full - Block better (interval excludes 0)") and v["8"]["blocks"] == 8
    assert v["8"]["block_vs_prenorm"]["mean"] == pytest.approx(-0.1)
    g = study.paired_gain(rows, "full_attnres", 16, 8)
    assert g["values"] == pytest.approx([0.12, 0.12]) and g["n"] == 2
    t = study.gain_trend(rows)
    assert t["block_attnres"]["verdict"] == "grows"  # per-seed gain 0.01 -> 0.1 and 0 -> 0.1: [+0.03, +0.16]
    assert t["block_attnres"]["deep_minus_shallow"] == pytest.approx(0.1 - 0.005)
    assert t["block_attnres"]["interval"]["low"] > 0
    assert t["block_attnres"]["slope_per_doubling"] == pytest.approx((0.1 - 0.005) / 2)  # log2 8 - log2 2 = 2
    # Full above Block, the interval excluding 0: said so, gap by gap, never "holds"
    worse = _rows({("prenorm", 4): [2.0, 2.0], ("block_attnres", 4): [1.8, 1.8], ("full_attnres", 4): [1.9, 1.9]})
    assert study.depth_verdicts(worse)["4"]["order"].endswith("Full - Block worse (interval excludes 0)")
    one = _rows({("prenorm", 4): [2.0], ("block_attnres", 4): [1.8], ("full_attnres", 4): [1.7]})
    assert study.depth_verdicts(one)["4"]["order"] == "one seed"
    assert study.gain_trend(one)["full_attnres"]["verdict"] == "one depth"
    over = study.overhead(rows)
    assert over["8"]["full"] == {"tok_per_s_ratio": 0.5, "peak_mem_ratio": None}
    assert over["8"]["block8"]["tok_per_s_ratio"] == pytest.approx(0.9)


def _summary_of(rows: list[dict]) -> dict:
    diag = [{"arm": a, "sublayer": s, "hidden_rms": h, "grad_norm": g}
            for a, hs in (("prenorm-L8", (1.0, 2.0, 6.0)), ("full-L8", (1.0, 1.1, 1.2)))
            for s, (h, g) in enumerate(zip(hs, (2.0, 1.0, None)))]
    return {"budget": {"tokens_per_run": [512], "max_param_excess_at_a_depth": study._param_excess(rows)},
            "gain_trend": study.gain_trend(rows), "norm_growth": study.norm_growth(diag),
            "overhead": study.overhead(rows),
            "meta": {"device": "CPU: test", "overhead_meaningful": False, "epochs": None, "seeds": [0, 1]}}


def test_findings_are_rules_with_the_precondition_first() -> None:
    rows = _rows(KNOWN)  # depth pays: prenorm 8 - 2 layers = -0.105 [-0.169, -0.041]
    rep = study.study_report(_summary_of(rows), rows)
    lines = rep.markdown().splitlines()
    assert lines[0].startswith("- **Does Block AttnRes's gain over PreNorm grow with depth (8 vs 2 layers)?** "
                               "+0.095 nats [") and lines[0].endswith("better (interval excludes 0)")
    assert "depth pays: -0.105 nats" in lines[1]
    assert "inside the noise (interval includes 0)" in lines[4]  # Block - PreNorm at 2 layers
    assert "not tested at this scale (timed on a CPU" in lines[5]
    assert "prenorm-L8 6.0x" in rep.markdown().split("### Details")[1]
    # deeper and worse (under-trained): the depth question is "not tested", the reason first
    deep = _rows({("prenorm", 2): [2.0, 2.01], ("block_attnres", 2): [1.9, 1.91], ("full_attnres", 2): [1.9, 1.92],
                  ("prenorm", 8): [2.2, 2.21], ("block_attnres", 8): [1.9, 1.92], ("full_attnres", 8): [1.8, 1.81]})
    first = study.study_report(_summary_of(deep), deep).findings[0]
    assert first.status == "not tested" and first.plain().split("?")[1].startswith(
        " not tested at this scale (under-trained: depth does not pay yet, PreNorm 8 minus 2 layers +0.200 nats")
    diag = [{"arm": "prenorm-L8", "sublayer": 0, "hidden_rms": 1.0, "grad_norm": 2.0},
            {"arm": "prenorm-L8", "sublayer": 1, "hidden_rms": 2.0, "grad_norm": 1.0}]
    assert study.norm_growth(diag)["prenorm-L8"]["grad_first_over_last"] == pytest.approx(2.0)


def test_weight_matrix_pads_reads_of_different_lengths() -> None:
    w = study.weight_matrix([torch.tensor([1.0]), torch.tensor([0.25, 0.75]), torch.tensor([0.2, 0.3, 0.5])])
    assert w.shape == (3, 3)
    assert torch.isnan(w[0, 1:]).all() and torch.isnan(w[1, 2]) and w[2].tolist() == pytest.approx([0.2, 0.3, 0.5])
    assert study.weight_matrix([]).shape == (0, 0)


def _model(mode: str, n_layers: int = 2, blocks: int = 2) -> MoELab:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=n_layers, pattern="M", dense_layers=n_layers,
                      mla=MLAConfig(num_heads=2, head_dim=16, kv_latent_dim=16),
                      residual=ResidualConfig(mode=mode, num_blocks=blocks, backend="torch")).validate()
    return MoELab(cfg)


@pytest.mark.parametrize("mode", ["prenorm", "block_attnres", "full_attnres"])
def test_layer_diagnostics_on_a_tiny_model(mode: str) -> None:
    model = _model(mode)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    d = study.layer_diagnostics(model, ids, ids)
    assert d["hidden_rms"].shape == (5,) and d["output_rms"].shape == (4,) and d["grad_norm"].shape == (4,)
    assert all(p.grad is None for p in model.parameters())  # cleared
    emb = model.embed(ids).detach()
    # The first sublayer reads the embedding alone in every mode.
    assert d["hidden_rms"][0] == pytest.approx(emb.pow(2).mean().sqrt().item(), rel=1e-5)
    # Reference gradient norm of sublayer 2 (layer 1's mixer and its pre-norm), from a separate backward.
    params = [*model.layers[1].mixer_norm.parameters(), *model.layers[1].mixer.parameters()]
    grads = torch.autograd.grad(model(ids, ids).loss, params, allow_unused=True)
    ref = math.sqrt(sum(g.pow(2).sum().item() for g in grads if g is not None))
    assert d["grad_norm"][2].item() == pytest.approx(ref, rel=1e-4)
    if mode == "prenorm":
        assert d["depth_weights"] == []
    else:
        # Zero-initialized pseudo-queries: every read starts as a uniform average of its sources.
        n_sources = [1, 2, 2, 3, 3] if mode == "block_attnres" else [1, 2, 3, 4, 5]
        assert [w.numel() for w in d["depth_weights"]] == n_sources
        for w in d["depth_weights"]:
            assert torch.allclose(w, torch.full_like(w, 1 / w.numel()))
