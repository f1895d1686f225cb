"""Study 2's research tier: the arms differ only in the balancer, steps to the floor after a warm switch,
the bias thinning, and the verdict rules on synthetic rows (no training)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from moelab.studies import balancing as study


def test_research_arms_differ_only_in_the_balancer() -> None:
    factor = study.research_arms_factor()
    assert set(factor) == set(study.LAYOUTS)
    for layout, keys in factor.items():
        assert set(keys) <= set(study._RKEYS), keys  # check_arms_differ_only raised on anything else
        assert keys["model.moe.quantile_balancing_mode"][study.research_arm("qb_hist", layout)] == "histogram"
    grids = study.research_grids()
    b8, b64 = grids["8x2048"]["common"], grids["64x256"]["common"]
    assert b8["train.batch_size"] * b8["data.seq_len"] == b64["train.batch_size"] * b64["data.seq_len"] == 16384
    assert b8["train.max_steps"] - study.WARM_STEPS >= 2000  # steady state
    assert b8["train.balancer_start_step"] == b64["train.balancer_start_step"] == study.WARM_STEPS
    cfg = study.base_config("research")
    # one compile key for every arm: the captured step (the warm-start switch is device arithmetic in it)
    assert cfg.train.balancer_start_step == study.WARM_STEPS and cfg.train.compile == "graphs"
    assert study.PRESETS["research"]["source_pin"] == "s2research-1"


def test_steps_to_floor_counts_from_the_switch() -> None:
    steps = list(range(1, 21))
    # collapse before the switch at 10 (below the floor there does not count), then 3.0, 2.0, 1.05, 1.0, ...
    values = [0.5] * 10 + [3.0, 2.0, 1.05, 1.0, 1.08, 2.0, 1.0, 1.0, 1.0, 1.0]
    assert study.steps_to_floor(steps, values, start=10, floor=1.0) == 3  # steps 13-15 within 1.1x
    assert study.steps_to_floor(steps, values, start=10, floor=1.0, hold=4) == 7  # 17-20
    assert study.steps_to_floor(steps, values, start=10, floor=0.5) is None
    assert study.steps_to_floor(steps, [math.nan] * 20, start=0, floor=1.0) is None


def test_thin_bias_keeps_the_switch_dense_then_every_nth() -> None:
    step = torch.arange(1, 101)
    bias = step.float()[:, None].repeat(1, 3)
    s, b = study.thin_bias(step, bias, start=20, dense=10, every=10)
    assert s.tolist() == [*range(1, 31), 40, 50, 60, 70, 80, 90, 100]
    assert torch.equal(b[:, 0], s.float())


def _rows(steps_qb: list[float | None], change: float = 0.02, glob_qb: float = 0.05) -> pd.DataFrame:
    rows = []
    for layout in study.LAYOUTS:
        for b in study.LAYOUTS[layout][3]:
            for seed in range(3):
                rows.append({"layout": layout, "balancer": b, "arm": study.research_arm(b, layout), "seed": seed,
                             "final_val_loss": 4.0 + 0.01 * seed + (0.02 if b == "aux_1e-2" else 0.0),
                             "floor": 0.2 if b == "qb" else math.nan,
                             "steps_to_floor": steps_qb[seed] if b.startswith("qb") else None,
                             "maxvio_batch": 0.3, "maxvio_global": {"qb": glob_qb, "qb_hist": glob_qb + 0.01,
                                                                    "loss_free_sign": 0.2}.get(b, 0.5) + 0.01 * seed,
                             "peak_maxvio": 6.5, "peak_step": 20, "maxvio_at_switch": 1.5,
                             "collapse_change": change, "gpu_minutes": 2.0})
    return pd.DataFrame(rows)


def test_research_verdicts_from_synthetic_rows() -> None:
    rep = study.research_report(_rows([3.0, 4.0, 5.0]))
    lines = {f.question: f for f in rep.findings}
    collapse = next(f for q, f in lines.items() if q.startswith("Has the router left"))
    assert collapse.answer.startswith("yes")
    b8 = next(f for q, f in lines.items() if "8x2048 (qb)" in q)
    assert b8.status != "not tested" and b8.number.mean == pytest.approx(60.0 ** (1 / 3))  # geometric mean
    assert b8.number.low > 0 and "(3, 4, 5 steps)" in b8.answer
    # aux and the sign rule never reach the floor: counted as the whole window, so qb's lead is a bound
    vs = next(f for q, f in lines.items() if q.startswith("Steps to the floor after a warm switch, 8x2048, qb minus"))
    window = study.LAYOUTS["8x2048"][2]
    assert vs.number.mean == pytest.approx(4.0 - window) and vs.status == "better" and "a bound" in vs.answer
    assert vs in rep.findings  # in the lead, with the 64x256 comparison
    assert rep.summary()["headline"] == vs.plain()  # the README's headline: the answer, not the precondition
    vs_sign = next(f for q, f in lines.items() if "qb minus loss_free_sign" in q)
    assert vs_sign.number.mean == pytest.approx(-0.15) and vs_sign.status == "better"


def test_research_verdicts_not_tested_when_a_precondition_fails() -> None:
    never = {f.question: f for f in study.research_report(_rows([None, None, None])).findings}
    assert all(f.status == "not tested" and "no arm reached" in f.reason for q, f in never.items()
               if "(qb)" in q or "after a warm switch" in q)
    moving = {f.question: f for f in study.research_report(_rows([3.0, 4.0, 5.0], change=0.4)).findings}
    assert next(f for q, f in moving.items() if q.startswith("Has the router")).answer.startswith("no")
    assert all(f.status == "not tested" and "collapse" in f.reason for q, f in moving.items() if "(qb)" in q)


def test_research_figures_draw_from_records() -> None:
    from moelab.studies.common import Grid, RunRecord

    grids = {}
    for layout in study.LAYOUTS:
        recs = []
        for b in study.LAYOUTS[layout][3]:
            for seed in range(2):
                hist = [{"step": s, "balance/maxvio_batch": 6.0 / s + 0.2} for s in range(1, study.WARM_STEPS + 50)]
                step = torch.arange(1, study.WARM_STEPS + 50)
                evals = {"layers": ["L1", "L2"], "step": step, "bias": torch.randn(len(step), 2, 4),
                         "floor": {"frozen_next": 0.25}}
                recs.append(RunRecord(arm=study.research_arm(b, layout), seed=seed, summary={}, history=hist,
                                      val_history=[], tokens=0, epochs=0.0, train_val_gap=None, fingerprint="x",
                                      evals=evals, timing={"gpu_minutes": 1.0}))
        grids[layout] = Grid(study=study.STUDY, base="gpu-small", records=recs)
    rows = study.research_rows(grids)
    assert set(rows.floor) == {0.25} and len(rows) == 2 * sum(len(v[3]) for v in study.LAYOUTS.values())
    # 6/s + 0.2 after the switch (s > 400) is ~0.215 < 1.1 x 0.25 from the first step on
    assert set(rows.steps_to_floor) == {1}
    assert len(study.switch_figure(grids, rows).axes) == len(study.LAYOUTS)
    assert len(study.research_bias_figure(grids).axes) == 3  # loss_free_sign, qb, qb_hist
    study.steady_figure(rows.assign(maxvio_global=0.1))
