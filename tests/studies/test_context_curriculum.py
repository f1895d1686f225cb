"""Study 4 (context curriculum): the arms differ only in the schedule, at equal tokens; the pure helpers."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.config import load_config
from moelab.data.curriculum import plan as stage_plan
from moelab.studies import context_curriculum as cc


@pytest.mark.parametrize("preset", sorted(cc.PRESETS), ids=lambda p: f"preset_{p}")
def test_arms_differ_only_in_the_schedule_at_equal_tokens(preset: str) -> None:
    p = cc.plan(preset)
    factor = cc.arms_factor(preset)
    assert set(factor) == {"data.curriculum"}
    steps_and_tokens = set()
    for arm, ov in cc.arms(preset).items():
        cfg = load_config(p.base, {**p.common, **ov})
        stages = stage_plan(cfg.data.curriculum, cfg.train.batch_size, cfg.data.seq_len,
                            cfg.train.accumulate_grad_batches, cfg.train.max_steps)
        # every stage trains the same tokens per step; the runs the same steps
        per_step = {s.batch_size * s.seq_len for s in stages}
        assert len(per_step) == 1, (arm, per_step)
        steps_and_tokens.add((stages[-1].end_step, per_step.pop()))
        assert {s.synthetic for s in stages} == {p.synthetic}
    assert len(steps_and_tokens) == 1, steps_and_tokens
    sched = cc.schedules(p)
    assert [s["seq_len"] for s in sched["curriculum"]] == list(p.lengths)
    assert [s["seq_len"] for s in sched["direct"]] == [max(p.lengths)]
    assert [s["seq_len"] for s in sched["short"]] == [min(p.lengths)]
    assert max(cc.eval_lengths(p)) >= 4 * max(p.lengths)


def test_split_steps() -> None:
    assert cc.split_steps(100, (0.5, 0.3, 0.2)) == [50, 30, 20]
    assert cc.split_steps(10, (1, 1, 1)) == [4, 3, 3]
    assert cc.split_steps(3, (0.98, 0.01, 0.01)) == [1, 1, 1]
    with pytest.raises(ValueError, match=r"steps=2 is not allowed: expected >= 3"):
        cc.split_steps(2, (1, 1, 1))
    with pytest.raises(ValueError, match=r"shares=\[1, 0\] is not allowed"):
        cc.split_steps(10, (1, 0))


def test_schedules_refuse_bad_lengths() -> None:
    p = cc.plan("cpu")
    from dataclasses import replace

    with pytest.raises(ValueError, match=r"lengths=\(512, 256\) is not allowed"):
        cc.schedules(replace(p, lengths=(512, 256), shares=(1, 1)))
    with pytest.raises(ValueError, match=r"shares=\(1,\) is not allowed"):
        cc.schedules(replace(p, shares=(1,)))


def test_stage_of_window() -> None:
    stages = [{"seq_len": 4, "steps": 10}, {"seq_len": 8, "steps": 5}]
    assert cc.stage_of_window(stages, 0, 5) == 0
    assert cc.stage_of_window(stages, 5, 10) == 0
    assert cc.stage_of_window(stages, 10, 15) == 1
    assert cc.stage_of_window(stages, 5, 12) is None  # spans the boundary


def test_step_times_and_value_at_time() -> None:
    stages = [{"steps": 2}, {"steps": 2}]
    t = cc.step_times(stages, [1.0, 3.0], wall_s=16.0)
    assert np.allclose(t, [0, 2, 4, 10, 16])
    assert np.allclose(cc.step_times(stages, [None, None], 8.0), [0, 2, 4, 6, 8])
    val = [[2, 5.0], [4, 3.0]]
    assert cc.value_at_time(val, t, 7.0) == pytest.approx(4.5)  # a quarter of the way from t=4 to t=16
    assert cc.value_at_time(val, t, 4.0) == pytest.approx(5.0)
    assert cc.value_at_time(val, t, 16.0) == pytest.approx(3.0)
    assert cc.value_at_time(val, t, 3.0) is None  # before the first validation


def test_train_clock_leaves_out_compilation() -> None:
    stages = [{"steps": 2}, {"steps": 3}]
    assert cc.train_clock(stages, [1.0, 2.0], wall_s=99.0) == (8.0, "steady")
    assert cc.train_clock(stages, [1.0, None], wall_s=99.0) == (99.0, "wall")


def test_equal_time_compares_steady_state_time_not_the_first_runs_compilation() -> None:
    """The first run of a process compiles (its wall-clock is 10x here); the comparison must not see it."""
    from types import SimpleNamespace

    sched = cc.schedules(cc.plan("cpu"))
    steps = {arm: sum(s["steps"] for s in st) for arm, st in sched.items()}

    def rec(arm: str, wall: float, losses: list[float]) -> SimpleNamespace:
        n = steps[arm]
        hist = [[n * (i + 1) // len(losses), v] for i, v in enumerate(losses)]
        return SimpleNamespace(arm=arm, seed=0, val_history=hist,
                               summary={"wall_s": wall, "final_val_loss": losses[-1]})

    grid = SimpleNamespace(records=[rec("curriculum", 1000.0, [6.0, 5.0]), rec("direct", 100.0, [6.0, 4.0])])
    perf = [{"schedule": "curriculum", "seed": 0, "stage": k, "step_time_s": 0.5}
            for k in range(len(sched["curriculum"]))]
    perf += [{"schedule": "direct", "seed": 0, "stage": 0, "step_time_s": 1.0}]
    out = cc.equal_time(grid, "cpu", perf)
    v = out["values"][0]
    assert v["clock"] == "steady" and v["read"] == "direct"  # curriculum's steady time is the shorter one
    assert v["time_s"] == pytest.approx(0.5 * steps["curriculum"])
    assert v["curriculum"] == 5.0 and 4.0 < v["direct"] < 6.0 + 1e-9


def test_train_times_per_run_and_the_findings_line_use_the_steady_clock() -> None:
    """A compiling first run (wall-clock 1000 s) shows its steady training time in the findings, with the
    wall-clock beside it; a run with an untimed stage falls back to its wall-clock."""
    from types import SimpleNamespace

    sched = cc.schedules(cc.plan("cpu"))
    n_cur = sum(s["steps"] for s in sched["curriculum"])
    grid = SimpleNamespace(records=[SimpleNamespace(arm="curriculum", seed=s, summary={"wall_s": w})
                                    for s, w in ((0, 1000.0), (1, 100.0))])
    perf = [{"schedule": "curriculum", "seed": s, "stage": k, "step_time_s": 0.5}
            for s in (0, 1) for k in range(len(sched["curriculum"]))]
    clocks = cc.train_times(grid, "cpu", perf)
    assert clocks[("curriculum", 0)] == pytest.approx((0.5 * n_cur, "steady"))
    assert clocks[("curriculum", 1)] == pytest.approx((0.5 * n_cur, "steady"))
    # seed 0's stage 0 untimed: it takes seed 1's (a step time is the schedule's); untimed in every seed: wall-clock
    assert cc.train_times(grid, "cpu", perf[1:])[("curriculum", 0)] == pytest.approx((0.5 * n_cur, "steady"))
    untimed = [r for r in perf if r["stage"] != 0]
    assert cc.train_times(grid, "cpu", untimed)[("curriculum", 0)] == (1000.0, "wall")
    rows = [{"wall_s": w, "train_s": 0.5 * n_cur, "train_clock": "steady"} for w in (1000.0, 100.0)]
    text = cc._time_text(rows)
    assert text.startswith(f"training time {0.5 * n_cur:.1f} ± 0.0 s") and "550.0" in text
    assert cc._time_text([{**rows[0], "train_clock": "wall"}]).startswith("wall-clock 1000.0")


def test_paired_and_verdicts() -> None:
    assert cc.paired({0: 1.0, 1: 2.0}, {0: 0.0, 1: 1.1})["verdict"] == "higher"  # diffs 1.0, 0.9: noise 0.14
    assert cc.paired({0: 1.0, 1: 2.0}, {0: 0.0, 1: 2.5})["verdict"] == "within noise"
    assert cc.paired({0: 1.0}, {0: 0.0})["verdict"] == "one seed"
    assert cc.paired({0: 0.0, 1: 0.0}, {0: 0.0, 1: 0.0})["verdict"] == "within noise"

    def row(schedule: str, seed: int, val: float, eff: int, acc: float) -> dict:
        return {"schedule": schedule, "seed": seed, "val_loss": val, "effective_context": eff,
                "passkey": {256: acc, 512: acc / 2}, "mqar_acc": acc}

    rows = [row("curriculum", 0, 3.0, 512, 0.9), row("curriculum", 1, 3.1, 512, 0.95),
            row("direct", 0, 3.5, 256, 0.5), row("direct", 1, 3.61, 256, 0.52)]
    cmp = cc.compare(rows, "curriculum", "direct")
    assert cmp["val_loss"]["judgement"] == "better" and cmp["passkey_mean"]["judgement"] == "better"
    assert cmp["effective_context"]["judgement"] == "better"  # +256 at both seeds: zero spread
    tie_clock = {"diff": cc.paired({0: 3.0, 1: 3.2}, {0: 3.1, 1: 3.0})}
    v = cc.verdict(cmp, tie_clock)
    assert v == {"equal_tokens": "better (interval excludes 0)",
                 "equal_wall_clock": "inside the noise (interval includes 0)",
                 "effective_context": "better (interval excludes 0)"}
    worse = cc.compare([{**r, "val_loss": -r["val_loss"]} if r["schedule"] == "direct" else r for r in rows],
                       "curriculum", "direct")
    assert worse["val_loss"]["judgement"] == "worse"
    assert cc.verdict(worse, tie_clock)["equal_tokens"] == "worse (interval excludes 0)"
    learned = cc.retrieval_learned(rows)
    assert learned == (True, None)
    unlearned = cc.retrieval_learned([{**r, "passkey": {256: 0.0}} for r in rows])
    assert not unlearned[0] and "retrieval never learned" in unlearned[1]
    assert cc.verdict(cmp, tie_clock, unlearned)["effective_context"].startswith(
        "not tested at this scale (retrieval never learned")


def test_paired_uses_the_t_interval() -> None:
    # diffs 1, 2, 3: mean 2, sd 1, t(0.975, 2) = 4.3027: [-0.484, 4.484] includes 0, where 2 sd (= 2) said "higher"
    d = cc.paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert d["verdict"] == "within noise" and d["low"] == pytest.approx(2 - 4.302652729911275 / 3 ** 0.5)


def test_findings_lead_with_the_precondition_and_carry_intervals() -> None:
    import json

    from moelab.base import repo_root

    summary = json.loads((repo_root() / "studies/04_context_curriculum/summary.json").read_text())
    for key in ("pilot", "pilot_length", "pilot_recipes"):  # the gpu tier's report: no pilot, no run retrieves
        summary.pop(key, None)
    for r in summary["rows"]:
        r["passkey"] = {k: 0.0 for k in r["passkey"]}
        r["effective_context"] = 0
    rep = cc.study_report(cc.refresh_comparisons(summary))
    lines = rep.markdown().splitlines()
    assert lines[0].startswith("- **Does the curriculum reach a longer effective context than direct training")
    assert "not tested at this scale (retrieval never learned" in lines[0]
    assert all("[" in ln for ln in lines[2:6])  # every comparison with its interval


def test_a_run_that_shared_its_gpu_takes_its_schedules_step_times_from_the_solo_seeds() -> None:
    from types import SimpleNamespace

    p = cc.plan("cpu")
    sched = cc.schedules(p)
    recs = [SimpleNamespace(arm="direct", seed=s) for s in (0, 1, 2)]
    rows = [{"schedule": "direct", "seed": 0, "stage": 0, "step_time_s": 0.2},
            {"schedule": "direct", "seed": 1, "stage": 0, "step_time_s": 0.4},
            {"schedule": "direct", "seed": 2, "stage": 0, "step_time_s": None}]  # seed 2 shared its GPU
    got = cc.stage_step_times(SimpleNamespace(records=recs), "cpu", rows)
    assert len(sched["direct"]) == 1
    assert got[("direct", 0)] == [0.2] and got[("direct", 2)] == [pytest.approx(0.3)]
