"""Study 2 logic: the arms differ only in the balancer; balance measures, shift stream and findings on
tiny synthetic inputs."""

import copy
import math
import statistics

import numpy as np
import pandas as pd
import pytest
import torch

from moelab.studies import balancing as study
from moelab.studies import common


# ids without the bare word "gpu": tests/conftest.py skips tests carrying that keyword on CPU machines
@pytest.mark.parametrize("preset", ["cpu", "gpu"], ids=["cpu-preset", "gpu-preset"])
def test_arms_differ_only_in_the_balancer(preset):
    factor = study.arms_factor(preset)
    assert set(factor) <= {"model.moe.balancer", "model.moe.aux_loss_alpha", "model.moe.quantile_balancing_cutoff"}
    assert factor["model.moe.balancer"] == {a: ov["model.moe.balancer"] for a, ov in study.ARMS.items()}
    assert factor["model.moe.aux_loss_alpha"]["aux_1e-3"] == 1e-3
    assert factor["model.moe.quantile_balancing_cutoff"]["qb_excl_self"] == "excluding_self"
    cfg = study.base_config(preset).model
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.activation) == (64, 8, "situ_glu")
    assert cfg.moe.num_shared >= 1 and cfg.moe.latent_dim > 0  # a LatentMoE with shared experts


def test_the_check_refuses_an_arm_that_changes_something_else():
    p = study.PRESETS["cpu"]
    arms = {**study.ARMS, "qb": {**study.ARMS["qb"], "train.lr": 1e-4}}
    with pytest.raises(ValueError, match="train.lr"):
        common.check_arms_differ_only(p["base"], arms, p["overrides"])


def test_random_routing_maxvio():
    # one token, one expert: that expert holds everything, MaxVio = n - 1 exactly
    assert study.random_routing_maxvio(1, 16, 1, trials=4) == pytest.approx(15.0)
    small, large = (study.random_routing_maxvio(m, 64, 8, trials=8) for m in (512, 32768))
    assert 0.15 < small < 0.6 and large < 0.08 and large < small / 4  # shrinks about as 1/sqrt(m)
    with pytest.raises(ValueError, match="k=9"):
        study.random_routing_maxvio(10, 8, 9)


def test_settle_threshold_is_the_target_unless_the_floor_is_high():
    assert study.settle_threshold(0.03) == 0.1
    assert study.settle_threshold(0.3) == pytest.approx(0.6)


def test_steps_until_needs_hold_consecutive_values():
    steps = [1, 2, 3, 4, 5, 6, 7]
    values = [0.5, 0.05, 0.5, 0.05, 0.04, 0.03, 0.5]
    assert study.steps_until(steps, values, 0.1, hold=3) == 4
    assert study.steps_until(steps, values, 0.1, hold=1) == 2
    assert study.steps_until(steps, values, 0.1, hold=4) is None
    assert study.steps_until(steps, [0.05, math.nan, 0.05, 0.05, 0.05, 1, 1], 0.1, hold=2) == 3
    with pytest.raises(ValueError, match="7 steps but 2 values"):
        study.steps_until(steps, [0.1, 0.2], 0.1)


def test_tail_mean_and_dead_experts():
    assert study.tail_mean([float(v) for v in range(1, 11)], 0.2) == pytest.approx(9.5)
    assert study.tail_mean([1.0, math.nan], 0.5) != study.tail_mean([1.0, math.nan], 0.5)  # only NaN in the tail
    load = torch.ones(10, 2, 4, dtype=torch.long)
    load[:5, 0, 1] = 0  # dead early only: not counted
    load[8:, 1, 2] = 0  # dead over the last 20%: counted
    load[9:, 1, 3] = 0  # dead on the last step only: not counted
    assert study.dead_experts(load, 0.2) == 1


def _record(arm: str, seed: int, maxvio: list[float], val: float = 5.0) -> common.RunRecord:
    history = [{"step": float(i + 1), "train/loss": 6.0, "balance/maxvio_batch": v, "balance/load_cv": v / 2}
               for i, v in enumerate(maxvio)]
    summary = {"steps": len(maxvio), "final_val_loss": val, "maxvio_global": maxvio[-1] / 2, "balancer_share": 0.01,
               "balancer_ms": 1.0, "run_id": f"{arm}{seed}", "status": "finished"}
    return common.RunRecord(arm=arm, seed=seed, summary=summary, history=history, val_history=[[len(maxvio), val]],
                            tokens=1000, epochs=0.1, train_val_gap=0.0, fingerprint="x")


def _traj(steps: int, bias_scale: float = 0.0) -> dict:
    bias = torch.zeros(steps, 2, 4)
    bias[:, 1] = bias_scale * torch.tensor([1.0, 1.0, 1.0, -3.0]) + 7.0  # a common shift is not counted
    return {"layers": ["L1", "L2"], "step": torch.arange(1, steps + 1), "load": torch.full((steps, 2, 4), 5),
            "bias": bias}


def test_run_metrics_from_history_and_trajectories():
    rec = _record("qb", 0, [2.0, 1.0, 0.05, 0.05, 0.05, 0.2, 0.05, 0.05, 0.05, 0.05])
    row = study.run_metrics(rec, _traj(10, bias_scale=0.5), threshold=0.1)
    assert row["settle_step"] == 3
    assert row["maxvio_batch"] == pytest.approx(0.05)  # last 2 of 10 steps
    assert row["load_cv"] == pytest.approx(0.025)
    assert row["maxvio_global"] == pytest.approx(0.025)
    assert row["dead_experts"] == 0
    assert row["max_abs_bias"] == pytest.approx(1.5)  # the bias minus its mean over experts
    assert (row["peak_maxvio"], row["peak_step"]) == (2.0, 1.0)


def test_balance_table_counts_settled_seeds():
    rows = pd.DataFrame([
        {"arm": "qb", "seed": 0, "settle_step": 4, **{m: 1.0 for m in study.TABLE_METRICS if m != "settle_step"}},
        {"arm": "qb", "seed": 1, "settle_step": None, **{m: 3.0 for m in study.TABLE_METRICS if m != "settle_step"}},
    ])
    agg = study.balance_table(rows)
    assert agg.loc["qb", "settled"] == "1/2"
    assert agg.loc["qb", "settle_step_mean"] == 4
    assert agg.loc["qb", "maxvio_batch_mean"] == 2.0 and agg.loc["qb", "n_seeds"] == 2


def test_window_batches_are_shifted_windows_of_the_stream():
    tokens = torch.arange(50).numpy() % 7
    batches = study.window_batches(tokens, batch_size=3, seq_len=5, steps=2, seed=1, vocab_size=7)
    assert len(batches) == 2
    for b in batches:
        assert b["input_ids"].shape == (3, 5) and b["input_ids"].dtype == torch.long
        assert torch.equal(b["input_ids"][:, 1:], b["targets"][:, :-1])
        ids = torch.cat([b["input_ids"], b["targets"][:, -1:]], 1)
        assert torch.equal((ids[:, 1:] - ids[:, :-1]) % 7, torch.ones(3, 5, dtype=torch.long))  # contiguous
    again = study.window_batches(tokens, 3, 5, 2, seed=1)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again))
    with pytest.raises(ValueError, match="outside the model's vocabulary of 5 ids"):
        study.window_batches(tokens, 1, 5, 1, vocab_size=5)
    with pytest.raises(ValueError, match="seq_len=60"):
        study.window_batches(tokens, 1, 60, 1)


def test_shift_rows():
    shift = {"arm": "qb", "seed": 0, "step": [1, 2, 3, 4, 5, 6], "maxvio_batch": [3.0, 0.5, 0.15, 0.05, 0.05, 0.05]}
    calm = {"arm": "none", "seed": 0, "step": [1, 2, 3], "maxvio_batch": [7.0, 7.0, 7.0]}
    qb, none = study.shift_rows([shift, calm], threshold=0.1, before={("qb", 0): 0.2, ("none", 0): 6.9})
    assert qb == {"arm": "qb", "seed": 0, "maxvio_before": 0.2, "maxvio_first": 3.0, "maxvio_last": 0.05,
                  "disturbed": True, "recover_step": 3, "resettle_step": 4}
    assert none["disturbed"] is False and none["recover_step"] == 1 and none["resettle_step"] is None


def test_each_preset_shifts_to_the_other_corpus():
    assert study.base_config("cpu").data.source == "shakespeare" and study.base_config("gpu").data.source == "gutenberg"
    assert study.SHIFT_SOURCE == {"shakespeare": "gutenberg", "gutenberg": "shakespeare"}


def test_shift_stream_is_the_other_corpus_under_the_runs_tokenizer(tmp_path):
    from moelab.data import prepare
    from moelab.data.corpus import _archive_documents
    from moelab.data.tokenizer import EOS_ID
    from tests.train.helpers import tiny_config

    cfg = tiny_config(tmp_path)  # trains on shakespeare: its shift text is gutenberg's
    s = study.shift_stream(cfg, steps=3, seed=0)
    ids, tok = s["ids"], prepare(cfg.data, progress=False).tokenizer()
    assert s["source"] == "gutenberg" and ids.size >= study.SHIFT_MARGIN * 3 * 8 * 65
    assert 0 <= int(ids.min()) and int(ids.max()) < tok.vocab_size <= cfg.model.vocab_size
    # whole gutenberg documents in stream order, each closed by end-of-text, decoding to the archive's text
    gutenberg = _archive_documents("gutenberg")
    texts = dict(zip(gutenberg.ids, gutenberg.texts(range(len(gutenberg.ids)))))
    ends = np.flatnonzero(ids == EOS_ID)
    assert len(ends) == len(s["documents"]) and ends[-1] == ids.size - 1
    assert tok.decode(ids[:ends[0]].tolist()) == texts[s["documents"][0]]
    # not the training text: no shakespeare play holds the first document's opening
    shakespeare = _archive_documents("shakespeare")
    head = texts[s["documents"][0]][:300]
    assert not any(head in t for t in shakespeare.texts(range(len(shakespeare.ids))))
    assert study.shift_stream(cfg, steps=3, seed=0)["ids"] is ids  # encoded once per tokenizer


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> common.RunRecord:
    """A 4-step quantile-balancing run of the tiny preset (shakespeare) with its final checkpoint."""
    from moelab.train import fit
    from tests.train.helpers import tiny_config

    cfg = tiny_config(tmp_path_factory.mktemp("run"), model__moe__balancer="quantile_balancing",
                      train__max_steps=4, train__warmup_steps=1, train__val_every=4, train__val_batches=1,
                      train__log_every=1, tracking__log_system_metrics=False)
    res = fit(cfg, checkpoints="final")
    return common.RunRecord(arm="qb", seed=0, summary=res.summary, history=res.history, val_history=[], tokens=0,
                            epochs=0.0, train_val_gap=None, fingerprint="x")


def test_shift_test_continues_from_the_trained_optimizer_state(tiny_run):
    import lightning as L

    from moelab.train.runner import load_checkpoint

    ckpt = load_checkpoint(tiny_run.summary["last_checkpoint"])
    seen = {}

    class Probe(L.Callback):  # the state the first shifted step starts from
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                seen["optimizer"] = copy.deepcopy(trainer.optimizers[0].state_dict())  # steps update in place
                seen["weights"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    out = study.shift_test(tiny_run, steps=2, callbacks=[Probe()])
    assert out["source"] == "gutenberg" and out["step"] == [1, 2] and len(out["maxvio_batch"]) == 2
    trained, restored = ckpt["optimizer_states"][0], seen["optimizer"]
    assert trained["state"].keys() == restored["state"].keys() and len(trained["state"]) > 10
    for i, st in trained["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(restored["state"][i][key], st[key]), (i, key)
    assert float(trained["state"][0]["step"]) == 4  # moments of 4 steps, not a fresh optimizer's
    cfg = ckpt["moelab"]["config"]["train"]
    for group in restored["param_groups"]:  # the schedule's final learning rate, constant
        assert group["lr"] == pytest.approx(cfg["lr"] * cfg["min_lr_ratio"]) and group["initial_lr"] == group["lr"]
    assert all(torch.equal(seen["weights"][k], v) for k, v in ckpt["state_dict"].items())


def _summary(free_global: float, aux_global: float, qb_settle: float | None) -> dict:
    def arm(maxvio_global, settle=None, loss=5.0):
        return {"n_seeds": 2, "final_val_loss_mean": loss, "final_val_loss_std": 0.01,
                "maxvio_global_mean": maxvio_global, "maxvio_batch_mean": maxvio_global, "dead_experts_mean": 0.0,
                "settle_step_mean": settle,
                "settled_seeds": 0 if settle is None else 2, "balancer_share_mean": 0.01, "max_abs_bias": 0.05,
                "shift_maxvio_before": maxvio_global, "shift_maxvio_first": 3.0, "shift_maxvio_last": 0.4,
                "shift_disturbed": True, "shift_recover_step": settle}

    arms = {a: arm(1.0) for a in study.ARMS}
    arms.update({"loss_free_sign": arm(free_global, 30), "aux_1e-3": arm(aux_global, loss=5.1),
                 "qb": arm(0.5, qb_settle), "qb_excl_self": arm(0.1, 5), "none": arm(7.0)})
    arms["none"]["shift_disturbed"] = False
    settings = {"threshold": 0.1, "noise_floor": 0.04, "steps": 100, "tokens_per_step": 4096, "num_experts": 64,
                "top_k": 8, "hold": 3, "shift_steps": 20, "shift_source": "gutenberg", "loss_free_sign_rate": 1e-3,
                "device": "CPU"}
    return {"meta": {"epochs": 0.5, "corpus_train_tokens": 1000}, "settings": settings, "arms": arms}


def _rows(qb_maxvio: tuple[float, ...] = (0.30, 0.32, 0.34), qb_settle: float | None = None):
    import pandas as pd

    out = []
    for arm in study.ARMS:
        for seed in range(3):
            mv = {"qb": qb_maxvio[seed], "loss_free_sign": 2.0 + 0.1 * seed,
                  "aux_1e-2": 0.5 + 0.01 * seed}.get(arm, 1.0)
            out.append({"arm": arm, "seed": seed, "final_val_loss": 5.0 + 0.01 * seed - 0.03 * (arm == "qb"),
                        "maxvio_batch": mv, "maxvio_global": mv, "dead_experts": 0, "balancer_share": 0.02,
                        "settle_step": qb_settle if arm == "qb" else None, "peak_maxvio": 6.5 + 0.1 * seed,
                        "peak_step": 8 + 10 * seed})
    return pd.DataFrame(out)


def test_findings_lead_with_the_floor_precondition_and_paired_intervals():
    summary = _summary(free_global=0.04, aux_global=0.6, qb_settle=None)
    summary["qb_limits"] = _limits(frozen=0.22, early=0.7)  # the frozen model's floor above the 0.1 threshold
    rep = study.study_report(summary, _rows())
    lines = rep.markdown().splitlines()
    assert lines[0].startswith("- **Does QB settle in a few steps (MaxVio_batch < 0.1)?** not tested at this scale "
                               "(the 0.1 threshold is below this batch layout's floor: 0.22 for QB on the frozen "
                               "trained model); measured qb, last 20%: 0.320 [")
    assert "peaks at MaxVio_batch 6.5-6.7 at steps 8-28; balance is read over steps 80-100" in lines[1]
    # qb - loss_free_sign: -1.70, -1.78, -1.86 (sd 0.08, half width 4.303 * 0.08 / sqrt 3 = 0.199);
    # qb - none val loss: -0.03 at every seed
    assert "qb minus loss_free_sign?** -1.780 [-1.979, -1.581]; better (interval excludes 0)" in lines[2]
    assert "(qb minus none)?** -0.030 nats [-0.030, -0.030]; better" in lines[4]
    assert "inside the noise" not in lines[4]
    assert "frozen weights account for" in rep.markdown().split("### Details")[1]
    # a floor below the threshold: settling is measured, not "not tested"
    summary["qb_limits"] = _limits(frozen=0.05, early=0.7)
    first = study.study_report(summary, _rows(qb_settle=4.0)).findings[0]
    assert first.status == "measured" and "3 of 3 seeds settle" in first.plain()
    # noisy seeds: the comparison reads "inside the noise"
    noisy = study.study_report(summary, _rows(qb_maxvio=(0.5, 1.5, 3.5))).findings[2]
    assert noisy.status == "noise" and "inside the noise (interval includes 0)" in noisy.plain()


def test_arm_intervals_beside_every_mean():
    summary = {"arms": {"qb": {"n_seeds": 3, "final_val_loss_mean": 5.0, "final_val_loss_std": 0.1,
                               "settle_step_mean": None, "settle_step_std": None}}}
    a = study.add_arm_intervals(summary)["arms"]["qb"]
    half = 4.302652729911275 * 0.1 / 3 ** 0.5
    assert a["final_val_loss_low"] == pytest.approx(5.0 - half)
    assert a["final_val_loss_high"] == pytest.approx(5.0 + half)
    assert a["settle_step_low"] is None


def test_figures_build_from_synthetic_runs():
    grid = common.Grid(study="02_balancing", base="cpu",
                       records=[_record(a, s, [1.0, 0.5, 0.2]) for a in ("qb", "none") for s in (0, 1)])
    trajs = {"qb": _traj(3, 0.1), "none": _traj(3)}
    shift = [{"arm": "qb", "seed": 0, "step": [1, 2], "maxvio_batch": [1.0, 0.1]}]
    for fig, panels in ((study.maxvio_figure(grid, 0.1, 0.05), 1), (study.bias_figure(trajs), 2),
                        (study.heatmap_figure(trajs), 2 * 2 + 1), (study.shift_figure(shift, 0.1, 0.05), 1)):
        assert len(fig.axes) == panels  # the heatmap grid: arms x layers panels and the colour bar


# --- what limits quantile balancing ---------------------------------------------------------------

def test_routed_load_counts_top_k_of_scores_plus_bias():
    scores = torch.tensor([[[0.9, 0.5, 0.1], [0.2, 0.8, 0.7]]])  # [L=1, m=2, n=3]
    assert study.routed_load(scores, torch.zeros(1, 3), 1).tolist() == [[1, 1, 0]]
    assert study.routed_load(scores, torch.tensor([[0.0, -1.0, 0.0]]), 1).tolist() == [[1, 0, 1]]
    assert study.routed_load(scores, torch.zeros(1, 3), 2).sum() == 4


def test_load_persistence_by_hand():
    same = torch.tensor([[[1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0]], [[3.0, 2.0, 1.0]]])  # [S=3, L=1, n=3]
    assert study.load_persistence(same) == pytest.approx([1.0, -1.0])


def test_qb_update_is_the_training_rule():
    """The study's one-batch update equals what balance_step writes after a training forward."""
    from moelab.model import MoELab
    from moelab.model.balance import balance_step, balanced_routers
    from tests.model.tiny import tiny_config

    cfg = tiny_config(pattern="M", n_layers=2, dense_layers=0)
    cfg.moe.balancer = "quantile_balancing"
    torch.manual_seed(0)
    model = MoELab(cfg.validate()).train()
    routers = [r for _, r in balanced_routers(model)]
    for r in routers:
        r.bias.copy_(torch.randn(r.bias.shape) * 0.1)
    old = torch.stack([r.bias.clone() for r in routers])
    out = model(torch.randint(0, 50, (2, 8)))
    scores = torch.stack([s.scores.detach() for s in out.router_stats])
    balance_step(model)
    new = torch.stack([r.bias for r in routers])
    assert not torch.allclose(new, old)
    torch.testing.assert_close(study.qb_update(scores, old, cfg.moe.top_k), new, rtol=0, atol=1e-6)


def _stream(drift: float, batches: int = 10, m: int = 2048, n: int = 64, k: int = 8) -> torch.Tensor:
    """[batches, 1, m, n] scores of one fixed distribution whose experts' offsets move by ``drift`` per batch."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, n, generator=g) * 0.3 / 4
    offset, velocity = torch.randn(n, generator=g) * 0.5, torch.randn(n, generator=g) * drift
    return torch.stack([torch.sigmoid(torch.randn(m, 16, generator=g) @ w + offset + i * velocity)[None]
                        for i in range(batches)])


def test_qb_tracking_separates_sampling_from_drift():
    floor = study.random_routing_maxvio(2048, 64, 8)
    still = study.qb_tracking(_stream(0.0), torch.zeros(1, 64), 8)
    moving = study.qb_tracking(_stream(0.05), torch.zeros(1, 64), 8)
    for r in (still, moving):
        assert math.isnan(r["converged_next"][0]) and math.isnan(r["persistence"][0]) and len(r["next"]) == 10
        assert max(r["same"][1:]) < floor  # one step (from near balance) on the batch it was computed from
    # Unchanging scores: the next batch lands near the floor and its errors do not persist.
    assert statistics.median(still["next"][1:]) < 1.75 * floor
    assert statistics.median(still["persistence"][2:]) < 0.2
    # Moving scores: the bias trails them, the same experts stay overloaded.
    assert statistics.median(moving["next"][1:]) > 2 * statistics.median(still["next"][1:])
    assert statistics.median(moving["persistence"][2:]) > 0.5
    with pytest.raises(ValueError, match=r"\[N, L, m, n\]"):
        study.qb_tracking(_stream(0.0)[0], torch.zeros(1, 64), 8)


def test_shuffle_tokens_keeps_each_token_across_layers():
    scores = torch.arange(3 * 2 * 4 * 1, dtype=torch.float32).reshape(3, 2, 4, 1)  # [N, L, m, n=1]
    scores[:, 1] = scores[:, 0] + 1000  # layer 1 holds token t's layer-0 value + 1000
    out = study.shuffle_tokens(scores, seed=0)
    assert out.shape == scores.shape and not torch.equal(out, scores)
    assert torch.equal(out[:, 1], out[:, 0] + 1000)
    assert sorted(out[:, 0].flatten().tolist()) == sorted(scores[:, 0].flatten().tolist())


def _limits(frozen: float, early: float, saturated: float = 0.0) -> dict:
    stream = {"next": [0.3, frozen, frozen], "same": [0.02] * 3, "converged_next": [math.nan, frozen, frozen],
              "persistence": [math.nan, 0.0, -0.1]}
    return {"arm": "qb", "seed": 0, "batches": 3, "tokens_per_batch": 4096, "floor": 0.05, "train_tail": 0.3,
            "ordered": stream, "shuffled": stream, "first_batch": 0.3, "frozen_next": frozen, "shuffled_next": 0.07,
            "same_batch": 0.02, "converged_next": frozen, "frozen_persistence": -0.1,
            "train_persistence_early": early, "train_persistence_tail": 0.0, "early_steps": 40,
            "token_spread": 0.01, "expert_spread": 0.1, "saturated": saturated, "bias_range": 0.6}


def test_limit_lines_say_what_limits_qb():
    text = "\n".join(study._limit_lines(_limits(frozen=0.15, early=0.7)))
    assert "reaches MaxVio_batch 0.150 (3.0x the random-routing floor 0.050)" in text
    assert "frozen weights account for 50% of that, and the rest comes from the weights moving" in text
    assert "The tokens of one sequence route alike" in text  # 0.15 vs 0.07 shuffled
    assert "(Jacobi) step is not what limits QB" in text
    assert "+0.70 in training's first 40 steps" in text and "the same experts stay overloaded" in text
    assert "in the last 20% there is none beyond sampling" in text and "saturation does not limit the bias" in text
    text = "\n".join(study._limit_lines(_limits(frozen=0.28, early=0.0, saturated=0.2)))
    assert "frozen weights account for 93% of that." in text and "early on no more than sampling" in text
    assert "a saturated sigmoid may hide" in text


def test_limits_figure_builds():
    assert len(study.limits_figure(_limits(frozen=0.15, early=0.7)).axes) == 1
