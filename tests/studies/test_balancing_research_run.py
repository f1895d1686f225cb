"""Study 2's research tier in the training process and in the notebook: the shift test and the run's evaluation
with a stand-in for Lightning's trainer (the optimizer state and the balancer's records come from it, no
checkpoint), ``train``'s dispatch, and the notebook's research functions end to end on synthetic records."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from moelab.config import load_config
from moelab.model.balance import max_vio
from moelab.studies import balancing as study
from moelab.studies.common import Grid, RunRecord
from moelab.train.balancer import BalancerCallback
from moelab.train.module import LitMoELab, train_step_fn


def _trained(balancer: str = "quantile_balancing", steps: int = 2) -> tuple[LitMoELab, torch.optim.Optimizer]:
    """A tiny module after ``steps`` optimizer steps (AdamW moments and a moved bias), as a run ends."""
    torch.manual_seed(0)
    lit = LitMoELab(load_config("tiny", {"tracking.enabled": False, "model.moe.balancer": balancer}))
    opt = lit.configure_optimizers()["optimizer"]
    step = train_step_fn(lit.model, opt, lit.cfg.train.grad_clip, None)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, lit.cfg.model.vocab_size, (2, 33), generator=gen)
        step({"input_ids": ids[:, :-1], "targets": ids[:, 1:]})
    return lit, opt


def _stream(cfg, steps: int, seed: int = 0) -> dict:
    ids = np.random.default_rng(7).integers(0, cfg.model.vocab_size, 4096)
    return {"source": "other-corpus", "ids": ids, "documents": []}


def test_shift_continue_trains_a_copy_from_the_trainers_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shift test continues a copy: the trained weights, bias and AdamW moments are untouched; its first step
    is routed with the trained bias (MaxVio of TopK(s + b) of the trained model on that batch), and it runs as many
    steps as asked with the balancer on."""
    monkeypatch.setattr(study, "shift_stream", _stream)
    lit, opt = _trained()
    cfg = lit.cfg
    weights = {k: v.clone() for k, v in lit.model.state_dict().items()}
    moments = {i: s["exp_avg"].clone() for i, s in enumerate(opt.state.values())}
    out = study.shift_continue(lit, opt, cfg, steps=5)
    assert out["source"] == "other-corpus" and out["step"] == [1, 2, 3, 4, 5]
    assert all(math.isfinite(v) and v >= 0 for v in out["maxvio_batch"])
    for k, v in lit.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for i, s in enumerate(opt.state.values()):
        assert torch.equal(s["exp_avg"], moments[i])
    # step 1 by hand: the first shifted batch through the trained model, TopK(s + b) with the trained bias
    batch = study.window_batches(_stream(cfg, 5)["ids"], cfg.train.batch_size, cfg.data.seq_len, 5, 0)[0]
    lit.model.train()
    with torch.no_grad():
        res = lit.model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False)
    bias = torch.stack([r.bias for _, r in study.balanced_routers(lit.model)])
    load = torch.stack([study.routed_load(st.scores, b, cfg.model.moe.top_k) for st, b in zip(res.router_stats, bias)])
    for _, r in study.balanced_routers(lit.model):
        r.balance.clear()
    assert out["maxvio_batch"][0] == pytest.approx(float(max_vio(load).mean()), abs=1e-6)


def test_research_evaluate_reads_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """research_evaluate with a stand-in trainer (lightning_module, optimizers, callbacks, precision): the bias
    trajectory from the switch on (fp16, every step for SWITCH_DENSE steps then every BIAS_EVERY-th), the floor,
    and the shift test for a shift seed only; without a trainer a clear error."""
    monkeypatch.setattr(study, "shift_stream", _stream)
    monkeypatch.setattr(study, "frozen_floor", lambda model, cfg: {"frozen_next": 0.25})
    lit, opt = _trained()
    cb = BalancerCallback()
    S = 400
    cb.layers = ["layers.1.moe"]
    cb.steps = list(range(1, 601))
    cb.biases = [torch.full((1, 8), float(s > S) * s) for s in cb.steps]
    cb.loads = [torch.ones(1, 8, dtype=torch.long) for _ in cb.steps]
    cfg = lit.cfg
    cfg.train.balancer_start_step = S
    trainer = SimpleNamespace(lightning_module=lit, optimizers=[opt], callbacks=[object(), cb], precision="32-true")
    got = study.research_evaluate(lit.model, cfg, trainer=trainer, shift_steps=3, shift_seeds=(cfg.seed,))
    assert got["floor"] == {"frozen_next": 0.25} and got["layers"] == ["layers.1.moe"]
    step = got["step"].tolist()
    assert step[0] == S and step[:study.SWITCH_DENSE + 1] == list(range(S, S + study.SWITCH_DENSE + 1))
    every = study.BIAS_EVERY
    assert step[study.SWITCH_DENSE + 1:] == list(range(S + study.SWITCH_DENSE + every, 601, every))
    assert got["bias"].dtype == torch.float16 and got["bias"][0].abs().max() == 0
    assert float(got["bias"][-1, 0, 0]) == 600
    assert got["shift"]["step"] == [1, 2, 3]
    no_shift = study.research_evaluate(lit.model, cfg, trainer=trainer, shift_steps=3, shift_seeds=(cfg.seed + 1,))
    assert "shift" not in no_shift
    with pytest.raises(ValueError, match="needs the run's trainer"):
        study.research_evaluate(lit.model, cfg)


def test_train_dispatches_by_preset(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    called = []
    monkeypatch.setattr(study, "train_research", lambda out: called.append(("research", out)) or {"8x2048": None})
    monkeypatch.setattr(study, "train_balancers", lambda preset, out: called.append((preset, out)) or "grid")
    assert study.train("research", tmp_path) == {"8x2048": None}
    assert study.train("gpu", tmp_path) == "grid"
    assert called == [("research", tmp_path), ("gpu", tmp_path)]
    with pytest.raises(ValueError, match="preset='k3' is not allowed"):
        study.train("k3", tmp_path)
    import inspect

    assert list(inspect.signature(study.train).parameters) == ["preset", "out_dir"]
    from moelab.studies.common import wants_trainer

    assert wants_trainer(study.research_evaluate)


# --- the notebook's research path on synthetic records ----------------------------------------------------------

def _grids() -> dict[str, Grid]:
    """Synthetic records: MaxVio_batch 6/s + 0.2 before the switch, then per balancer a level that reaches the
    floor (0.25) after ``reach`` steps; the 8x2048 runs carry a shift test recovering after ``back`` steps."""
    S = study.WARM_STEPS
    reach = {"qb": 2, "qb_hist": 4, "loss_free_sign": 50, "aux_1e-2": 10_000, "none": 10_000}
    back = {"qb": 3, "qb_hist": 5, "loss_free_sign": 12, "aux_1e-2": 30, "none": 30}
    grids = {}
    for layout, (_, _, after, balancers) in study.LAYOUTS.items():
        recs = []
        for b in balancers:
            for seed in range(3):
                n = S + after
                hist = [{"step": s, "balance/maxvio_batch": (6.0 / s + 0.2 if s <= S else
                                                             0.26 if s - S >= reach[b] else 1.0)}
                        for s in range(1, n + 1)]
                evals = {"layers": ["L1"], "step": torch.arange(S, n + 1), "bias": torch.zeros(n + 1 - S, 1, 4).half(),
                         "floor": {"frozen_next": 0.25}}
                if layout == study.SHIFT_LAYOUT:
                    k = back[b] + seed
                    evals["shift"] = {"source": "shakespeare", "step": list(range(1, 41)),
                                      "maxvio_batch": [0.9 if i < k else 0.26 for i in range(1, 41)]}
                summary = {"final_val_loss": 4.0 + 0.01 * seed + (0.03 if b == "aux_1e-2" else 0.0),
                           "maxvio_global": ({"qb": 0.05, "qb_hist": 0.06, "loss_free_sign": 0.2}.get(b, 0.5)
                                             + 0.01 * seed)}
                recs.append(RunRecord(arm=study.research_arm(b, layout), seed=seed, summary=summary, history=hist,
                                      val_history=[], tokens=0, epochs=0.0, train_val_gap=None, fingerprint="x",
                                      evals=evals, timing={"gpu_minutes": 1.5}))
        grids[layout] = Grid(study=study.STUDY, base="gpu-small", records=recs)
    return grids


def test_research_notebook_functions_end_to_end() -> None:
    """rows -> shift rows -> report -> figures, the numbers of the findings from the synthetic records."""
    grids = _grids()
    rows = study.research_rows(grids)
    assert len(rows) == 3 * sum(len(v[3]) for v in study.LAYOUTS.values())
    b8 = rows[rows.layout == "8x2048"].set_index(["balancer", "seed"])
    # reach 2 and hold 3: steps 2, 3, 4 after the switch within 1.1 x 0.25
    assert b8.loc[("qb", 0), "steps_to_floor"] == 2 and b8.loc[("loss_free_sign", 1), "steps_to_floor"] == 50
    assert b8.loc[("none", 0), "steps_to_floor"] is None or math.isnan(b8.loc[("none", 0), "steps_to_floor"])
    shifts = study.research_shifts(grids)
    assert len(shifts) == 15 and {s["arm"] for s in shifts} == set(study.RESEARCH_BALANCERS)
    shift = study.research_shift_rows(shifts, rows)
    qb = shift[shift.arm == "qb"].set_index("seed")
    # before: the last 20% of the steps after the switch = 0.26; 0.26 x 1.1 is met from step back + seed on
    assert qb.loc[0, "maxvio_before"] == pytest.approx(0.26) and qb.loc[0, "maxvio_first"] == pytest.approx(0.9)
    assert qb.recover_step.tolist() == [3, 4, 5] and qb.resettle_step.tolist() == [3, 4, 5]
    rep = study.research_report(rows, shift)
    assert len(rep.findings) == 6 and len(rep.all_findings) == 18  # the lead capped; the rest in the details
    f = {x.question: x for x in rep.all_findings}
    assert next(v for q, v in f.items() if q.startswith("Has the router left")).answer.startswith("yes")
    steps8 = next(v for q, v in f.items() if "reaches the frozen floor, 8x2048" in q)
    assert steps8.number.mean == pytest.approx(2.0) and steps8.number.method == "t on log"
    # the fastest balancer that is not QB at 8x2048 reaches it at step 50 on seed 1
    vs8 = next(v for q, v in f.items() if q.startswith("Steps to the floor after a warm switch, 8x2048, qb minus"))
    assert vs8 in rep.findings and vs8.number.n >= 1
    glob = next(v for q, v in f.items() if "qb minus loss_free_sign" in q and "MaxVio_global" in q)
    assert glob.number.mean == pytest.approx(-0.15)
    rec = next(v for q, v in f.items() if q.endswith("after a shift, qb"))
    assert rec.number.mean == pytest.approx(4.0) and rec.number.n == 3
    paired = next(v for q, v in f.items() if q.startswith("Steps to re-balance after the shift, qb minus"))
    assert paired.number.mean == pytest.approx(3 - 12) and paired.status == "better"
    cost = next(v for q, v in f.items() if "Validation loss, qb minus none" in q)
    assert cost.number.mean == pytest.approx(0.0, abs=1e-9) and cost in rep.findings
    # none and aux never get back to the floor: their level before (1.0) is above the first shifted step (0.9)
    none = next(v for q, v in f.items() if q.endswith("after a shift, none"))
    assert none.status == "not tested" and "did not disturb none" in none.reason
    summary = study.research_summary(grids, rows, shift, rep)
    assert summary["meta"]["gpu_minutes_total"] == pytest.approx(40.5)
    assert summary["meta"]["gpu_minutes_by_layout"] == {"8x2048": 22.5, "64x256": 18.0}
    assert len(summary["findings"]) == 18 and len(summary["shift"]) == 15 and len(summary["runs"]) == 27
    assert summary["settings"]["source_pin"] == "s2research-1"
    import json

    json.dumps(summary)  # plain JSON types only
    md = rep.markdown()
    assert "8x2048" in md and "GPU minutes in all: 40.5" in md  # 27 runs x 1.5
    assert len(study.switch_figure(grids, rows).axes) == len(study.LAYOUTS)
    study.steady_figure(rows)
    assert len(study.research_bias_figure(grids).axes) == 3


def test_shift_findings_not_tested_without_a_disturbance() -> None:
    calm = pd.DataFrame([{"arm": "qb", "seed": s, "maxvio_before": 0.3, "maxvio_first": 0.31, "maxvio_last": 0.3,
                          "disturbed": False, "recover_step": 1, "resettle_step": 1} for s in range(3)])
    (only,) = study.shift_findings(calm)
    assert only.status == "not tested" and "did not disturb qb" in only.reason
    (none,) = study.shift_findings(calm.iloc[:0])
    assert none.status == "not tested"
