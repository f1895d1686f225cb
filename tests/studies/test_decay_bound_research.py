"""Study 1's research tier: the dose-response arms, the in-training decay monitor, the per-bound verdicts, the
end-to-end speed measurement's file."""

import json
import math

import pytest
import torch

from moelab.model import MoELab
from moelab.studies import decay_bound as study

GPU_CORPUS_TRAIN_TOKENS = 22_646_121  # data.source gutenberg's training split (studies/01_decay_bound meta)


def test_research_arms_are_the_dose_response_and_differ_only_in_the_gate() -> None:
    factor = study.arms_factor("research")
    assert set(factor) == {"model.kda.gate", "model.kda.g_min"}
    assert factor["model.kda.g_min"] == {"bounded-0.25": -0.25, "bounded-0.5": -0.5, "bounded-1": -1.0,
                                         "bounded-5": -5.0, "softplus": -5.0}
    assert {a for a, g in factor["model.kda.gate"].items() if g == "softplus"} == {"softplus"}
    assert study.forgetting_bounds("research") == {"bounded-0.25": -0.25, "bounded-0.5": -0.5, "bounded-1": -1.0,
                                                   "bounded-5": -5.0, "softplus": None}
    assert set(study.arms_of("gpu")) == set(study.ARMS)  # the quick look keeps its arms


def test_research_runs_see_at_least_one_epoch_of_the_gpu_corpus() -> None:
    from moelab.studies import common

    p = study.PRESETS["research"]
    cfgs = common.resolve_arms(p["base"], study.arms_of("research"), p["overrides"])
    for cfg in cfgs.values():
        tokens = cfg.train.max_steps * cfg.train.batch_size * cfg.data.seq_len * cfg.train.accumulate_grad_batches
        assert cfg.data.source == "gutenberg" and tokens >= GPU_CORPUS_TRAIN_TOKENS
        assert cfg.train.compile == "none" and cfg.model.max_seq_len == 4 * cfg.data.seq_len
    assert cfgs["bounded-0.25"].train.max_steps // p["monitor_every"] >= 6  # a trajectory, not two points
    # the overflow grid: every 0.25 from the told bound to -12, and both sides of each predicted overflow
    g = p["overflow_g_mins"]
    assert max(g) == -5 and min(g) == -12 and {-8.05, -8.1, -11.05, -11.1} <= set(g)


def test_monitor_stats_on_a_known_decay() -> None:
    # layer a: channel (0, 0) reaches -0.24 (within 5% of -0.25), the rest stay at -0.01; layer b all at -0.3
    a = torch.full((1, 4, 2, 2), -0.01)
    a[0, 1, 0, 0] = -0.24
    b = torch.full((1, 4, 2, 2), -0.3)
    s = study.monitor_stats({"a": a, "b": b}, bound=-0.25)
    assert s["g_min"] == pytest.approx(-0.3) and s["bound"] == -0.25
    assert s["layers"][0]["frac_channels_near_bound"] == 0.25 and s["layers"][1]["frac_channels_near_bound"] == 1.0
    assert s["frac_channels_near_bound"] == 1.0  # the largest layer share
    assert s["frac_channels_near_bound_all"] == pytest.approx(5 / 8)
    assert s["frac_entries_near_bound"] == pytest.approx(17 / 32)
    assert s["g_mean"] == pytest.approx((15 * -0.01 - 0.24 + 16 * -0.3) / 32)
    edges = study.DECAY_EDGES
    assert len(s["hist"]) == len(edges) and sum(s["hist"]) == pytest.approx(1.0)
    # |g| = 0.01 sits in [1e-2, 3e-2), 0.24 in [0.1, 0.25), 0.3 in [0.25, 0.5)
    want = {edges.index(1e-2): 15 / 32, edges.index(0.1): 1 / 32, edges.index(0.25): 16 / 32}
    assert s["hist"] == pytest.approx([want.get(i, 0.0) for i in range(len(edges))])
    assert study.monitor_stats({"c": torch.full((1, 2, 1, 1), -7.0)}, -5.0)["hist"][-1] == 1.0  # past the edges
    with pytest.raises(ValueError, match="bound=0"):
        study.monitor_stats({"a": a}, bound=0.0)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_decay_monitor_measures_the_model_on_one_fixed_batch(gate) -> None:
    from moelab.config import load_config

    cfg = load_config("tiny", {"model.kda.gate": gate, "model.kda.g_min": -0.5})
    torch.manual_seed(0)
    model = MoELab(cfg.model).eval()
    monitor = study.decay_monitor(windows=2)
    first = monitor(model, cfg)
    ids = study._val_windows(cfg, cfg.data.seq_len, 2)[:, :-1]
    decays = study.collect_log_decay(model, ids)
    bound = -0.5 if gate == "bounded" else study.REFERENCE_BOUND
    assert first == study.monitor_stats(decays, bound)
    with torch.no_grad():  # a changed model: the monitor reads it again, on the same batch
        for name, p in model.named_parameters():
            if name.endswith("f_up.bias"):
                p.add_(3.0)  # a larger z: a faster decay
    second = monitor(model, cfg)
    assert second["g_min"] < first["g_min"]
    assert second == study.monitor_stats(study.collect_log_decay(model, ids), bound)
    assert math.isfinite(second["g_mean"])


def test_e2e_speed_writes_paired_rounds_with_provenance(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOELAB_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    toy = {"d_model": 32, "n_layers": 1, "num_heads": 2, "head_dim": 16, "vocab_size": 64, "dense_ffn_dim": 64}
    r = study.e2e_speed([(32, 2), (64, 1)], rounds=3, window=1, warmup=0, **toy)
    assert r["meta"]["commit"] == "0123456789abcdef0123456789abcdef01234567" and "gpu" in r["meta"]
    assert r["config"]["model"]["pattern"] == "K" and not r["config"]["model"]["final_mla"]
    assert r["config"]["kda"]["num_heads"] == 2 and r["config"]["gates"] == ["bounded", "softplus"]
    assert [(x["T"], x["B"], x["tokens"]) for x in r["ratios"]] == [(32, 2, 64), (64, 1, 64)]
    for ratio in r["ratios"]:
        rows = [x for x in r["rows"] if x["T"] == ratio["T"]]
        assert len(rows) == 6 and [x["first"] for x in rows if x["arm"] == "bounded"] == [True, False, True]
        by = {(x["round"], x["arm"]): x["tok_per_s"] for x in rows}
        per = [by[(i, "bounded")] / by[(i, "softplus")] for i in range(3)]
        assert ratio["rounds"] == pytest.approx(per) and ratio["median"] == pytest.approx(sorted(per)[1])
        assert ratio["min"] <= ratio["median"] <= ratio["max"]
        assert all(x["tok_per_s"] == pytest.approx(x["steps"] * x["T"] * x["B"] / x["seconds"]) for x in rows)
    with pytest.raises(ValueError, match="rounds=0"):
        study.e2e_speed([(32, 1)], rounds=0, **toy)
    out = tmp_path / "speed.json"
    monkeypatch.setattr(study, "SPEED_LENGTHS", ((32, 1),))
    import moelab.studies.decay_bound as mod

    calls = {}
    real = mod.e2e_speed
    monkeypatch.setattr(mod, "e2e_speed", lambda lengths, rounds, window: calls.setdefault(
        "r", real(lengths, rounds=rounds, window=window, warmup=0, **toy)))
    assert study.main(["speed", "--out", str(out), "--lengths", "32x1", "--rounds", "2", "--window", "1"]) == 0
    assert json.loads(out.read_text())["ratios"][0]["T"] == 32 and study.read_speed(out)["config"]["rounds"] == 2
    assert study.read_speed(tmp_path / "absent.json") is None


def _synthetic(shares: dict[str, float], cost: dict[str, float]):
    """Runs and decay tables of 3 seeds: arm -> share of channels at its bound, arm -> val loss over softplus's."""
    import pandas as pd

    bounds = {"bounded-0.25": -0.25, "bounded-5": -5.0, "softplus": -5.0}
    runs, decay = [], []
    for arm, bound in bounds.items():
        for seed in range(3):
            runs.append({"arm": arm, "seed": seed, "best_val_loss": 4.0 + 0.01 * seed + cost.get(arm, 0.0)
                         + (0.001 * seed if arm != "softplus" else 0.0)})
            for layer, share in (("l0", shares.get(arm, 0.0)), ("l1", 0.0)):
                decay.append({"arm": arm, "seed": seed, "layer": layer, "bound": bound,
                              "frac_channels_near_bound": share, "g_min": bound * (0.99 if share else 0.5)})
    return pd.DataFrame(runs), pd.DataFrame(decay)


def test_cost_is_tested_only_for_the_bounds_that_bind() -> None:
    runs, decay = _synthetic({"bounded-0.25": 0.4}, {"bounded-0.25": 0.05, "bounded-5": 0.0})
    binds = study.binds_by_arm(decay)
    assert set(binds) == {"bounded-0.25", "bounded-5"}  # softplus is the reference
    assert binds["bounded-0.25"]["binds"] and binds["bounded-0.25"]["share"] == pytest.approx(0.4)
    assert not binds["bounded-5"]["binds"] and "never binds" in binds["bounded-5"]["reason"]
    tight, loose = study.cost_findings(runs, decay)  # tightest bound first
    assert "bound -0.25" in tight.question and tight.status == "worse"
    assert tight.number.mean == pytest.approx(0.051)  # mean paired difference: 0.05 + 0.001 * (0 + 1 + 2) / 3
    assert 0 < tight.number.low < 0.051 < tight.number.high
    assert loose.status == "not tested" and "-5 never binds" in loose.reason
    assert "binds in bounded-0.25" in study.binds_finding(decay).answer


def test_no_bound_binds_makes_every_cost_not_tested() -> None:
    runs, decay = _synthetic({}, {"bounded-0.25": 0.05})
    assert all(f.status == "not tested" for f in study.cost_findings(runs, decay))
    assert study.binds_finding(decay).answer.startswith("never binds")


def test_plateau_reads_the_last_fifth_of_the_curve() -> None:
    flat = [10.0] * 80 + [1.0] * 20
    assert study.plateau(flat) == {"change": 0.0, "converged": True}
    falling = [1.0] * 80 + [1.0] * 10 + [0.9] * 10
    p = study.plateau(falling)
    assert p["change"] == pytest.approx(-0.1) and not p["converged"]
