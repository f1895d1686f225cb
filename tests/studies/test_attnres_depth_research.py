"""Study 3's research tier on CPU: the arms differ only in depth, mode, block count and lr; the lr-carry rule; the
split order (no run that needs the sweep's winner before the sweep is recorded); the verdicts on synthetic rows."""

from __future__ import annotations

import pytest

from moelab.config import load_config
from moelab.studies import attnres_depth as study
from moelab.studies import common

P = study.RESEARCH
BEST = {"prenorm": 2e-3, "block_attnres": 4e-3, "full_attnres": 2e-3}


def test_research_arms_differ_only_in_the_studied_factors() -> None:
    factor = study.research_factor(BEST)
    assert sorted(factor) == ["model.n_layers", "model.residual.mode", "model.residual.num_blocks", "train.lr"]
    assert factor["train.lr"]["block3-L12-lr1e-3"] == 1e-3 and factor["train.lr"]["block6-L24"] == 4e-3
    shallow, deep = study.main_arms(BEST)
    assert set(deep) == {"prenorm-L24", "block6-L24", "full-L24"} and set(shallow) == {"prenorm-L12", "block3-L12",
                                                                                       "full-L12"}
    for arm, ov in {**study.sweep_arms(), **shallow, **deep}.items():
        cfg = load_config(P.base, {**P.common, **ov})
        info = study.parse_arm(arm)
        assert (cfg.model.n_layers, cfg.model.residual.mode) == (info["n_layers"], info["residual"])
        assert cfg.model.dense_layers >= cfg.model.n_layers and cfg.model.d_model == 384
        assert cfg.train.compile == "graphs"  # one key, the same for every arm
        if info["residual"] == "block_attnres":  # 4 layers (8 sublayers) per block at both depths
            assert cfg.model.residual.num_blocks == cfg.model.n_layers // 4 == info["blocks"]
    # The shallow main arm of a mode is the sweep's winning run at another seed: the same config.
    sweep = study.sweep_arms()
    assert shallow["block3-L12"] == sweep["block3-L12-lr4e-3"]
    # A confound in one deep arm (its weight decay) is refused.
    bad = {**deep, "full-L24": {**deep["full-L24"], "train.weight_decay": 0.37}}
    with pytest.raises(ValueError, match=r"train.weight_decay"):
        common.check_arms_differ_only(P.base, {**sweep, **bad}, P.common)


def test_plan_meets_the_design() -> None:
    lo, hi = P.depths
    assert hi >= 24 and hi >= 2 * lo and len(P.lrs) == 3 and len(P.seeds) == 3
    assert P.tokens_per_run == 1536 * 16 * 2048 == 50_331_648 >= P.min_tokens
    assert round(P.tokens_per_run / 22_646_121, 2) == 2.22  # epochs of the GPU corpus


def test_lr_carry_picks_the_lowest_sweep_loss() -> None:
    picked = study.pick_lr({"prenorm": {1e-3: 3.41, 2e-3: 3.37, 4e-3: 3.39},
                            "block_attnres": {1e-3: 3.40, 2e-3: 3.36, 4e-3: 3.35}})
    assert picked["prenorm"]["lr"] == 2e-3 and not picked["prenorm"]["at_edge"]
    assert picked["block_attnres"]["lr"] == 4e-3 and picked["block_attnres"]["at_edge"]
    assert study.pick_lr({"prenorm": {1e-3: 3.0, 2e-3: 3.0}})["prenorm"]["lr"] == 1e-3  # a tie: the smaller lr
    with pytest.raises(ValueError, match=r"prenorm: sweep losses .* no finite value at lr \[0.004\]"):
        study.pick_lr({"prenorm": {1e-3: 3.41, 4e-3: float("nan")}})


def test_lr_names_round_trip() -> None:
    assert [study.lr_text(x) for x in (1e-3, 2e-3, 4e-3, 3e-4)] == ["1e-3", "2e-3", "4e-3", "3e-4"]
    assert study.parse_arm("full-L12-lr4e-3") == {"residual": "full_attnres", "n_layers": 12, "lr": 4e-3, "blocks": 24}
    with pytest.raises(ValueError, match="not a study-3 arm"):
        study.parse_arm("block-L12")


class _Rec:
    def __init__(self, arm: str, seed: int, loss: float, tps: float = 1e5, mem: float = 10.0) -> None:
        self.arm, self.seed, self.tokens, self.epochs = arm, seed, P.tokens_per_run, 2.22
        self.summary = {"final_val_loss": loss, "tok_per_s": tps, "peak_mem_gb": mem, "params_total": 1}
        self.timing = {"gpu_minutes": 1.0}
        self.evals = None
        self.tok_per_s = tps  # a run that trained alone: its speed (common.RunRecord.tok_per_s)


def test_split_call_stops_before_runs_that_need_the_sweep(monkeypatch, tmp_path) -> None:
    """A split call whose sweep has records missing raises GridIncomplete before it configures any main arm; once
    the sweep is recorded, the main grids are configured with each mode's winning lr."""
    calls = []

    def fake_grid(study_name, base, arms, seeds, out_dir, **kw):
        calls.append((sorted(arms), tuple(seeds)))
        first = next(iter(arms))
        if "-lr" in first and len(calls) == 1 and fake_grid.sweep_missing:
            return common.Grid(study_name, base, [_Rec(a, 0, 3.4) for a in list(arms)[:2]], complete=False)
        recs = [_Rec(a, s, 3.3 + (0.01 if "4e-3" in a else 0)) for a in arms for s in seeds]
        return common.Grid(study_name, base, recs, complete=True)

    monkeypatch.setattr(study.common, "run_grid", fake_grid)
    fake_grid.sweep_missing = True
    with pytest.raises(common.GridIncomplete, match="the lr sweep is incomplete") as info:
        study.train_research(tmp_path)
    assert len(calls) == 1 and "full-L12-lr4e-3:0" in info.value.missing
    calls.clear()
    fake_grid.sweep_missing = False
    grid, picked = study.train_research(tmp_path)
    assert [c[1] for c in calls] == [(0,), (1, 2), (0, 1, 2)]
    assert calls[2][0] == ["block6-L24", "full-L24", "prenorm-L24"]
    assert {m: p["lr"] for m, p in picked.items()} == {m: 1e-3 for m in study.MODES}


def rows_for(gain: dict[str, float], base: float = 3.5, noise: float = 0.004, tokens: int = P.tokens_per_run) -> list:
    """Main rows at both depths, 3 seeds, plus a sweep; ``gain[mode]``: deep minus shallow loss."""
    rows = []
    for m in study.MODES:
        for s in P.seeds:
            for L in P.depths:
                loss = base + (gain[m] if L == P.depths[1] else 0.0) + noise * s * (1 if L == 24 else -1)
                rows.append({"arm": study.research_arm(m, L), "role": "main", "residual": m,
                             "blocks": study._mode_blocks(m, L, P), "n_layers": L, "lr": 2e-3, "seed": s,
                             "params": 1, "tokens": tokens, "epochs": 2.22, "val_loss": loss,
                             "tok_per_s": 1e5 if m == "prenorm" else 9e4 + 1e3 * s,
                             "peak_mem_gb": 10.0 if m == "prenorm" else 11.0, "gpu_minutes": 1.0})
        for lr in P.lrs:
            rows.append({"arm": study.research_arm(m, 12, lr), "role": "sweep", "residual": m,
                         "blocks": study._mode_blocks(m, 12, P), "n_layers": 12, "lr": lr, "seed": 0,
                         "val_loss": base + abs(lr - 2e-3) * 10, "tokens": tokens})
    return rows


def test_verdicts_depth_pays_more_with_block() -> None:
    rows = rows_for({"prenorm": -0.03, "block_attnres": -0.05, "full_attnres": -0.06})
    for r in rows:  # a seed-dependent interaction: 0, -0.002, +0.001 nats on Block's deep runs
        if r["role"] == "main" and r["residual"] == "block_attnres" and r["n_layers"] == 24:
            r["val_loss"] += (0.0, -0.002, 0.001)[r["seed"]]
    v = study.research_verdicts(rows)
    assert v["precondition"]["reason"] is None and set(v["precondition"]["depth_pays_under"]) == set(study.MODES)
    # seed s: deep - shallow = gain + 0.008 s (+ Block's offsets): mean over seeds gain + 0.008 - 0.001 / 3
    assert v["depth_gain"]["block_attnres"]["mean"] == pytest.approx(-0.05 + 0.008 - 0.001 / 3, abs=1e-9)
    inter = v["interaction"]["block_attnres"]
    assert inter["mean"] == pytest.approx(-0.02 - 0.001 / 3, abs=1e-9) and inter["verdict"] == "lower"
    assert inter["high"] < 0 < inter["high"] - inter["low"]  # the t interval (2 df) of -0.020, -0.022, -0.019
    assert v["overhead"]["24"]["block"]["tok_per_s_ratio"] == pytest.approx(0.91)
    assert v["overhead"]["24"]["block"]["peak_mem_ratio"] == pytest.approx(1.1)
    rep = study.research_report({"benchmark_overhead": {}}, rows)
    assert rep.findings[0].question.startswith("Does extra depth (12 -> 24 layers) pay more with Block AttnRes")
    assert rep.findings[0].status != "not tested"
    assert "prenorm 2e-3; block_attnres 2e-3; full_attnres 2e-3" in rep.details[0]


def test_verdict_not_tested_when_depth_never_pays_or_runs_are_short() -> None:
    rows = rows_for({"prenorm": 0.05, "block_attnres": 0.02, "full_attnres": 0.01})
    rep = study.research_report({}, rows)
    assert rep.findings[0].status == "not tested"
    assert "depth does not pay under any mode: prenorm +0.058" in rep.findings[0].reason
    short = rows_for({"prenorm": -0.05, "block_attnres": -0.06, "full_attnres": -0.06}, tokens=1_310_720)
    v = study.research_verdicts(short)
    assert not v["precondition"]["past_early_phase"]
    assert v["precondition"]["reason"].startswith("runs saw 1,310,720 tokens, below the 50,000,000")


def test_research_rows_relabel_the_sweep_winner_as_the_shallow_seed() -> None:
    recs = [_Rec(a, 0, 3.4 - (0.02 if "2e-3" in a else 0)) for a in study.sweep_arms()]
    recs += [_Rec(a, s, 3.4) for a in ("prenorm-L12", "block3-L12", "full-L12") for s in (1, 2)]
    rows = study.research_rows(common.Grid("s", "b", recs))
    main12 = [r for r in rows if r["role"] == "main" and r["n_layers"] == 12]
    assert len(main12) == 9 and {r["lr"] for r in main12} == {2e-3}
    assert sorted(r["seed"] for r in main12 if r["residual"] == "prenorm") == [0, 1, 2]
    assert len([r for r in rows if r["role"] == "sweep"]) == 9
