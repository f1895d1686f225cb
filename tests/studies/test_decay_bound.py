"""Study 1 logic: the kernel's sub-tile against its exact reference, decay statistics, matched arms, findings."""

import math

import pandas as pd
import pytest
import torch

from moelab.model import MoELab
from moelab.model.config import KDAConfig, ModelConfig
from moelab.ops.kda.bounds import G_MIN_FLOOR
from moelab.studies import decay_bound as study
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
    assert rel_err(ref, study.exact_tile(q, k, g)) < 1e-12


def test_kernel_tile_fp32_is_exact_inside_the_bound_and_tf32_within_a_percent():
    q, k, g = _tile(g_min=-5.0)
    ref = study.exact_tile(q, k, g)
    assert rel_err(ref, study.kernel_tile(q, k, g, -5.0, "fp32")) < 1e-5
    assert 1e-5 < rel_err(ref, study.kernel_tile(q, k, g, -5.0, "tf32")) < 1e-2  # TF32 operands do round


@pytest.mark.parametrize("told,g_min,finite", [(None, -11.0, True), (None, -11.1, False),
                                               (-5.0, -8.0, True), (-5.0, -8.1, False)])
def test_kernel_tile_overflows_where_the_told_shift_exceeds_fp32(told, g_min, finite):
    # told g_min = t, the forward shifts by 8 t: row 15's k factor is exp(16 |g| - 8 |t|); fp32 holds exp(88.72)
    q, k, _ = _tile()
    g = torch.full((16, 32), g_min)
    t = g_min if told is None else told
    assert bool(torch.isfinite(study.kernel_tile(q, k, g, t)).all()) is finite
    rows = study.tile_overflow_table(g_mins=[g_min], dtypes=["fp32"], tolds=[told], head_dim=16, trials=2)
    row = next(r for r in rows if r["pattern"] == "constant")
    assert row["finite"] is finite and row["told"] == t
    assert row["max_exponent"] == pytest.approx(16 * abs(g_min) - 8 * abs(t), rel=1e-6)
    assert (g_min >= study.constant_overflow_g(told)) is finite


def test_constant_overflow_g_is_fp32s_range_over_the_factor_exponent():
    assert study.constant_overflow_g() == pytest.approx(-88.7228 / 8, rel=1e-4)
    assert study.constant_overflow_g(-5.0) == pytest.approx(-(88.7228 + 40) / 16, rel=1e-4)
    with pytest.raises(ValueError, match="told=-11.2"):
        study.constant_overflow_g(-11.2)  # row 0's q factor e^(8 * 11.2) overflows even at g = 0


@pytest.mark.parametrize("told,grid", [(-5.0, (-7.9, -8.0, -8.1, -8.2)), (None, (-10.9, -11.0, -11.1, -11.2))])
def test_modelled_tile_and_real_op_first_overflow_at_the_same_constant_decay(told, grid):
    # fp32 in the interpreter; the grid steps by 0.1 across constant_overflow_g(told)
    rows = study.kernel_overflow_rows(grid, (1, 16, 1, 16), tolds=[told])
    real = max(r["bound"] for r in rows if r["pattern"] == "constant" and r["nonfinite"] > 0)
    tile = pd.DataFrame(study.tile_overflow_table(g_mins=grid, dtypes=["fp32"], tolds=[told], head_dim=16, trials=1))
    key = "fp32_constant" + ("_told_bound" if told is None else "")
    modelled = study.safe_bounds(tile)[f"{key}_first_nonfinite"]
    predicted = max(g for g in grid if g < study.constant_overflow_g(told))
    assert real == modelled == predicted
    assert all(r["nonfinite"] == 0 for r in rows if r["pattern"] == "constant" and r["bound"] > real)


def test_the_ops_floor_holds_on_the_real_op():
    # the op's check accepts g_min >= G_MIN_FLOOR: told the floor, g at the floor or 0 (row 0's q factor
    # holds e^(8 |told|)) must stay finite and exact; the forward overflows only at 2x the floor
    assert study.constant_overflow_g() == pytest.approx(2 * G_MIN_FLOOR)
    g = G_MIN_FLOOR * torch.rand(1, 32, 1, 16, generator=torch.Generator().manual_seed(0))
    g[:, ::16] = 0.0
    rows = study.bounded_kernel_rows([torch.full((1, 32, 1, 16), G_MIN_FLOOR), g], told=G_MIN_FLOOR)
    assert all(r["nonfinite"] == 0 and r["rel_err"] < 1e-4 for r in rows), rows


def test_tf32_rounding_keeps_ten_mantissa_bits():
    x = torch.tensor([1.0 + 2.0 ** -10, 1.0 + 2.0 ** -11 + 2.0 ** -20, 1.0 + 2.0 ** -12])
    assert study._tf32(x).tolist() == [1.0 + 2.0 ** -10, 1.0 + 2.0 ** -10, 1.0]


def test_decay_stats_on_a_known_decay():
    g = torch.full((1, 32, 1, 2), -0.5)
    g[..., 1] = -1.96  # one channel sits within 5% of the bound -2 on every token
    s = study.decay_stats(g, bound=-2.0)
    assert s["g_min"] == pytest.approx(-1.96)
    assert s["frac_channels_near_bound"] == 0.5 and s["frac_entries_near_bound"] == 0.5
    assert s["frac_below_bound"] == 0.0
    assert s["tile_decay_max"] == pytest.approx(16 * 1.96)
    assert s["max_factor_exponent"] == pytest.approx(8 * 1.96)  # rows 8..15 after the reference row 7
    with pytest.raises(ValueError, match="T=4"):
        study.decay_stats(g[:, :4], bound=-2.0)
    with pytest.raises(ValueError, match="bound=1"):
        study.decay_stats(g, bound=1.0)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_collect_log_decay_from_the_model(gate):
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, pattern="K", final_mla=True, dense_layers=2,
                      kda=KDAConfig(num_heads=2, head_dim=16, gate=gate, backend="chunk", chunk_size=16)).validate()
    model = MoELab(cfg)
    g = study.collect_log_decay(model, torch.randint(0, 64, (2, 20)))
    assert list(g) == ["layers.0.mixer"]
    (gl,) = g.values()
    assert gl.shape == (2, 20, 2, 16) and (gl <= 0).all()
    assert not any(m._forward_pre_hooks for m in model.modules())  # hooks removed


def test_arms_start_bitwise_equal_outside_the_gate_with_the_same_initial_decay():
    models = study.build_arm_models("cpu", seed=3)
    assert set(models) == set(study.ARMS)
    soft = models["softplus"]
    gate = study.gate_parameter_names(soft)
    assert gate and all(n.endswith(("A_log", "f_up.bias")) for n in gate)
    ref = dict(soft.named_parameters())
    ids = torch.randint(0, soft.cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    g_soft = torch.cat([g.flatten() for g in study.collect_log_decay(soft, ids).values()])
    for arm, m in models.items():
        params = dict(m.named_parameters())
        assert params.keys() == ref.keys()
        for name, p in params.items():
            if name not in gate:
                assert torch.equal(p, ref[name]), (arm, name)
        # g = -dt at z = b for either gate; the slopes differ by O(dt), so the step-0 decays nearly coincide
        g = torch.cat([g.flatten() for g in study.collect_log_decay(m, ids).values()])
        assert (g - g_soft).abs().max() < 0.01 * g_soft.abs().max()
        assert -0.11 < g.min() and g.max() < 0


def test_the_study_arms_differ_only_in_the_gate() -> None:
    for preset in study.PRESETS:
        factor = study.arms_factor(preset)
        assert set(factor) == {"model.kda.gate", "model.kda.g_min"}
        assert factor["model.kda.gate"]["softplus"] == "softplus"
    with pytest.raises(ValueError, match="preset='tpu'"):
        study.arms_factor("tpu")


def test_real_kernel_in_bounded_mode_overflows_only_below_the_bound():
    inside = study.run_bounded_kernel(torch.full((1, 16, 1, 16), -5.0))
    assert inside["nonfinite"] == 0 and inside["rel_err"] < 1e-4  # fp32 in the interpreter
    below = study.run_bounded_kernel(torch.full((1, 16, 1, 16), -16.0))  # 8 * 16 = 128 > 88.7
    assert below["nonfinite"] > 0 and below["rel_err"] == math.inf
    assert below["rel_err_general"] < 1e-4


def test_fast_forgetting_softplus_goes_below_a_bound_the_bounded_gate_cannot_pass():
    rows = study.fast_forgetting({"bounded-1": -1.0, "softplus": None}, steps=40, seeds=(0,), B=2, T=32, H=1, K=8,
                                 lr=0.2)
    by = {r["arm"]: r for r in rows}
    assert by["bounded-1"]["g_fast_min"] >= -1.0
    assert by["softplus"]["g_fast_min"] < -1.0
    assert by["softplus"]["final_loss"] < by["bounded-1"]["final_loss"]


def test_crossover_is_linear_in_T_between_the_measured_lengths():
    ratios = [{"impl": "sdpa_flash", "T": 4096, "ratio": 0.5}, {"impl": "sdpa_flash", "T": 8192, "ratio": 1.5},
              {"impl": "moelab_general", "T": 4096, "ratio": 1.3}]
    assert study.crossover_length(ratios) == pytest.approx(6144)
    assert study.crossover_length(ratios, "moelab_general") is None


def test_speed_ratios_divide_by_the_bounded_path():
    rows = [{"impl": "moelab_bounded", "B": 1, "T": 8, "fwdbwd_ms": 2.0},
            {"impl": "sdpa_flash", "B": 1, "T": 8, "fwdbwd_ms": 5.0},
            {"impl": "fla_softplus", "B": 1, "T": 16, "fwdbwd_ms": 1.0}]  # no bounded row at T=16: left out
    assert study.speed_ratios(rows) == [{"impl": "sdpa_flash", "B": 1, "T": 8, "tokens": 8, "ratio": 2.5}]


def test_extrapolation_summary_reads_the_position_ranges():
    rows = [{"arm": "a", "seed": 0, "rel_pos": p, "loss": loss}
            for p, loss in ((0.25, 5.0), (0.75, 4.0), (1.5, 4.5), (3.0, 6.0))]
    s = study.extrapolation_summary(pd.DataFrame(rows)).iloc[0]
    assert (s.loss_1x, s.loss_1x_2nd_half, s.d_2x, s.d_4x) == (4.5, 4.0, 0.5, 2.0)


def _ms(mean, std, n=3):
    return {"mean": mean, "std": std, "n": n}


def _summary():
    arm = {"frac_channels_near_bound": _ms(0.0, 0.0), "forgetting_g_fast_min": _ms(-1.0, 0.0),
           "forgetting_final_loss": _ms(1e-3, 1e-4), "extrapolation_d_4x": _ms(0.05, 0.01)}
    return {
        "modelled_tile": {"bf16_constant": -8.0, "bf16_constant_first_nonfinite": -8.1,
                          "bf16_constant_told_bound_first_nonfinite": -11.1},
        "kernel_overflow": {"dtype": "bfloat16", "told": -5.0, "first_nonfinite_bound": -8.1,
                            "first_nonfinite_bound_told_bound": None, "predicted_constant": -8.045,
                            "predicted_constant_told_bound": -11.09, "op_floor": -5.545,
                            "worst_finite_rel_err_at_or_above_-5": 3e-3,
                            "real_softplus": {"layers": 9, "g_min": -14.2, "layers_nonfinite": 2,
                                              "layers_rel_err_over_1pct": 3, "worst_rel_err_general": 4e-3}},
        "speed": {"general_over_bounded": [1.25, 1.36], "crossover_T_sdpa_flash": 4440.0},
        "arms": {"bounded-5": {**arm, "gate": "bounded", "best_val_loss": _ms(5.70, 0.01)},
                 "softplus": {**arm, "gate": "softplus", "best_val_loss": _ms(5.60, 0.02),
                              "forgetting_g_fast_min": _ms(-7.9, 0.1), "extrapolation_d_4x": _ms(0.30, 0.02)}},
        "meta": {"epochs": 0.4, "corpus_train_tokens": 1_000_000, "tokens_per_run": 400_000,
                 "train_val_gap": {"bounded-5": 0.1, "softplus": 0.3},
                 "kernel_results": {"gpu": "NVIDIA H200", "commit": "730381e"}},
    }


def _tables(near: float = 0.0):
    import pandas as pd

    seeds = (0, 1, 2)
    runs = pd.DataFrame([{"arm": a, "seed": s, "steps": 100, "best_val_loss": v + 0.01 * s}
                         for a, v in (("bounded-5", 5.70), ("softplus", 5.60)) for s in seeds])
    decay = pd.DataFrame([{"arm": a, "seed": s, "layer": "l0", "g_min": -0.2 - 0.01 * s,
                           "frac_channels_near_bound": near if a == "bounded-5" else 0.0}
                          for a in ("bounded-5", "softplus") for s in seeds])
    extra = pd.DataFrame([{"arm": a, "seed": s, "d_4x": 0.05 + 0.01 * (s % 2) * (a == "softplus")}
                          for a in ("bounded-5", "softplus") for s in seeds])
    forget = pd.DataFrame([{"arm": a, "seed": s, "final_loss": f * (1 + 0.01 * s), "g_fast_min": -1.0}
                           for a, f in (("bounded-5", 1e-3), ("softplus", 1e-6)) for s in seeds])
    return runs, decay, extra, forget


def test_findings_are_rules_with_intervals_and_the_precondition_first() -> None:
    summary = _summary()
    summary["arms"]["bounded-5"]["bound"], summary["arms"]["softplus"]["bound"] = -5.0, -5.0
    rep = study.study_report(summary, *_tables(near=0.0))
    lines = rep.markdown().splitlines()
    # the bound never binds: the cost is "not tested", the reason leads, the number follows for the record
    assert lines[0].startswith("- **What does the bound cost in val loss (bounded-5 minus softplus)?** "
                               "not tested at this scale (the bound never binds")
    assert "measured +0.100 nats [+0.100, +0.100]" in lines[0]
    assert "never reached" in lines[1] and "0.0%" in lines[1]
    # fast forgetting: log10(1e-3) - log10(1e-6) = 3 in every seed
    assert "+3.00 log10 [+3.00, +3.00]; worse (interval excludes 0)" in rep.markdown()
    assert "inside the noise (interval includes 0)" in rep.markdown()  # extrapolation: diffs 0, -0.01, 0
    assert rep.markdown().index("| arm |") < rep.markdown().index("### Details")
    binds = study.study_report(summary, *_tables(near=0.2))
    assert binds.findings[0].status == "worse" and "reached: largest share" in binds.findings[1].plain()


def test_kernel_rows_of_a_batch_are_those_of_each_decay_alone():
    gs = [torch.full((1, 16, 1, 16), -5.0), torch.full((1, 16, 1, 16), -16.0),
          -3.0 * torch.rand(1, 16, 1, 16, generator=torch.Generator().manual_seed(1))]
    tolds = [-5.0, -5.0, -3.0]  # two bounded calls: the rows come back in order whatever the grouping
    together = study.bounded_kernel_rows(gs, told=tolds)
    alone = [study.run_bounded_kernel(g, told=t) for g, t in zip(gs, tolds)]
    assert [r["nonfinite"] > 0 for r in together] == [False, True, False]
    for a, b in zip(together, alone):
        assert a["g_min"] == b["g_min"] and a["nonfinite"] == b["nonfinite"] and a["told"] == b["told"]
        for key in ("rel_err", "rel_err_general"):
            assert a[key] == b[key] == math.inf or abs(a[key] - b[key]) <= 1e-6 + 1e-3 * b[key], (key, a, b)
    with pytest.raises(ValueError, match="one shape"):
        study.bounded_kernel_rows([gs[0], torch.zeros(1, 32, 1, 16)])


def test_fast_forgetting_runs_together_as_each_run_alone():
    bounds = {"bounded-1": -1.0, "softplus": None}
    kw = {"steps": 6, "B": 2, "T": 32, "H": 1, "K": 8, "device": "cpu"}
    together = study.fast_forgetting(bounds, seeds=(0, 1), **kw)
    alone = [r for arm, b in bounds.items() for s in (0, 1) for r in study.fast_forgetting({arm: b}, seeds=(s,), **kw)]
    assert [(r["arm"], r["seed"]) for r in together] == [(r["arm"], r["seed"]) for r in alone]
    for a, b in zip(together, alone):
        for key in ("final_loss", "first_loss", "g_fast_min", "g_fast_mean", "g_slow_mean"):
            assert rel_err(torch.tensor(a[key]), torch.tensor(b[key])) < 1e-5, (key, a, b)
    assert together[0]["first_loss"] != together[1]["first_loss"]  # the seeds draw different inputs


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_evaluate_run_measures_the_model_it_is_given(gate, monkeypatch):
    from moelab.config import load_config

    cfg = load_config("tiny", {"model.kda.gate": gate, "model.max_seq_len": 64 * study.EXTRAPOLATE})
    torch.manual_seed(0)
    model = MoELab(cfg.model).eval()
    ev = study.evaluate_run(model, cfg, eval_windows=2, real_g_tokens=32)
    (layer,) = [r["layer"] for r in ev["decay"]]
    bound = cfg.model.kda.g_min if gate == "bounded" else study.REFERENCE_BOUND
    ids = study._val_windows(cfg, 64, 2)[:, :-1]
    g = study.collect_log_decay(model, ids)[layer]
    assert ev["decay"][0]["bound"] == bound and ev["decay"][0]["g_min"] == pytest.approx(g.min().item())
    sample = ev["tile_decay"][layer]
    assert len(sample) == min(study.TILE_SAMPLE, g.shape[0] * (64 // 16) * g.shape[2] * g.shape[3])
    assert torch.isin(sample, study.tile_decays(g)).all()
    assert list(ev["real_g"]) == ([layer] if gate == "softplus" else [])
    if gate == "softplus":
        assert ev["real_g"][layer].dtype == torch.bfloat16
        assert torch.equal(ev["real_g"][layer], g[:1, :32].to(torch.bfloat16))
        monkeypatch.setattr(study, "REAL_G_TOKENS", 16)  # a record keeps at most REAL_G_TOKENS tokens
        capped = study.evaluate_run(model, cfg, eval_windows=1, real_g_tokens=32)
        assert torch.equal(capped["real_g"][layer], g[:1, :16].to(torch.bfloat16))
    # 16 bins over 4x the training length; the first quarter is a plain forward over the training length
    rows = ev["extrapolation"]
    assert len(rows) == 16 and rows[-1]["pos_hi"] == 4 * 64 and rows[0]["rel_pos"] == pytest.approx(8 / 64)
    data = study._val_windows(cfg, 4 * 64, 2)
    with torch.no_grad():
        first = model(data[:, :64], data[:, 1:65]).loss.item()
    assert sum(r["loss"] for r in rows[:4]) / 4 == pytest.approx(first, rel=1e-4)


def test_a_gpu_small_softplus_record_stays_under_two_mib(tmp_path, monkeypatch):
    """What ``evaluate_run`` keeps for a gpu-small softplus run (9 KDA layers of ``[2, 4096, 4, 128]`` log
    decays: the "gpu" preset's two decay windows) saves to at most 2 MiB, so a split GPU call can carry
    its record back (16 MiB a file) and it can be committed; fp32 real_g of 1024 tokens came to ~18 MiB."""
    from moelab.config import load_config

    cfg = load_config("tiny", {"model.kda.gate": "softplus", "model.max_seq_len": 64 * study.EXTRAPOLATE})
    gen = torch.Generator().manual_seed(0)
    decays = {f"layers.{i}.mixer": -torch.rand(2, 4096, 4, 128, generator=gen) * 3 for i in range(9)}
    monkeypatch.setattr(study, "collect_log_decay", lambda model, ids: decays)
    monkeypatch.setattr(study, "loss_by_position", lambda *a, **k: [])
    model = MoELab(cfg.model).eval()
    ev = study.evaluate_run(model, cfg, eval_windows=1, real_g_tokens=study.PRESETS["gpu"]["overflow_shape"][1])
    assert {g.shape for g in ev["real_g"].values()} == {(1, study.REAL_G_TOKENS, 4, 128)}
    torch.save(ev, tmp_path / "r.evals.pt")
    assert (tmp_path / "r.evals.pt").stat().st_size <= 2 * 2 ** 20
