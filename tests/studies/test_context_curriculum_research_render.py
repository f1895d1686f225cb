"""Study 4's research report on CPU, before any GPU time is spent on it: a complete synthetic record set of the
research preset (the pilot runs and every schedule x seed, written through the harness's record writer with the
preset's fingerprints and source pin), then the notebook run end to end through the runner as the final call
(``make study-4 PRESET=research``) runs it: every record reused, nothing trained, the report computed from the
synthetic numbers. And the split-call entry at toy size: ``train("research", ...)`` under ``RUNS=`` trains exactly
the named runs and stops with GridIncomplete."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy import stats

from moelab.base import repo_root
from moelab.studies import common, run_study
from moelab.studies import context_curriculum as cc
from tests.test_notebooks import report_problems
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

P = cc.plan("research")
LONGEST = P.lengths[-1]
TPS = cc.retrieval_budget("research")["direct"]["stages"][0]["tokens_per_step"]  # every arm's tokens per step
# final validation loss per (schedule, seed): curriculum below direct by 0.05, 0.04, 0.07
VAL = {"curriculum": (3.10, 3.12, 3.09), "direct": (3.15, 3.16, 3.16), "short": (3.30, 3.28, 3.31)}
# effective context per (schedule, seed): passkey >= 0.9 up to this length, below after
EFFECTIVE = {"curriculum": (16384, 16384, 32768), "direct": (8192, 16384, 8192), "short": (1024, 2048, 1024),
             "pilot4096": (1024,), "pilot2048L4": (1024,), "pilot3072L4": (1024,)}
STEP_S = {1024: 0.25, 4096: 0.26, 8192: 0.30}  # seconds per optimizer step at each training length
MEM_GB = {1024: 9.0, 4096: 9.5, 8192: 10.2}  # peak memory of a logging window at each training length
OVERHEAD_S = 40.0  # start, compilation, validation and evaluation of a run


def _passkey(arm: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    eff = EFFECTIVE[arm][seed]
    by_length = [0.95 if n <= eff else max(0.0, 0.5 - 0.1 * math.log2(n / max(eff, 512))) for n in settings["lengths"]]
    return {"task": "passkey", "lengths": settings["lengths"], "depths": settings["depths"],
            "samples": settings["samples"], "accuracy": [[a] * len(settings["depths"]) for a in by_length],
            "accuracy_by_length": by_length, "effective_context": eff, "threshold": 0.9,
            "state_bytes_per_token": 1536.0}


def _mqar(arm: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    acc = [round(0.8 if n <= EFFECTIVE[arm][seed] else 0.1, 3) for n in settings["lengths"]]
    return {"task": "mqar", "lengths": settings["lengths"], "pairs": settings["mqar_pairs"],
            "samples": settings["samples"], "accuracy": acc, "all_correct": [a / 2 for a in acc]}


def _loss_by_position(arm: str, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    (n,) = settings["lengths"]
    edges = sorted({0, *(int(x) for x in np.geomspace(2, n, 24))})
    off = {"curriculum": 0.01, "direct": 0.05 + 0.01 * seed, "short": 0.3}[arm] * (1 + seed)
    loss = [4.0 - 0.1 * math.log2(max(a, 1)) + (off if a >= LONGEST else off / 2) for a in edges[:-1]]
    return {"task": "loss_by_position", "lengths": [n],
            "curves": [{"length": n, "windows": settings["samples"], "mean_loss": float(np.mean(loss)),
                        "bin_start": edges[:-1], "bin_end": edges[1:], "loss": loss}]}


def _report(task: str, arm: str, seed: int, settings: dict[str, Any], cfg: Any) -> dict[str, Any]:
    make = {"passkey": _passkey, "mqar": _mqar, "loss_by_position": _loss_by_position}[task]
    return {"step": cfg.train.max_steps, "config": cfg.name, "preset": cfg.preset,
            "settings": {"task": task, **settings, "device": "cuda", "training_window": LONGEST}, "wall_s": 5.0,
            **make(arm, seed, settings)}


def _tps(cfg: Any) -> int:
    """A run's tokens per optimizer step (the pilot variants keep the earlier recipe's 131,072)."""
    return cfg.train.batch_size * cfg.data.seq_len * cfg.train.accumulate_grad_batches


def _stages(cfg: Any) -> list[tuple[int, int]]:
    """``[(seq_len, steps)]`` of a run's curriculum."""
    return [(s.seq_len, s.steps) for s in cfg.data.curriculum]


def _train_perf(cfg: Any, seed: int) -> dict[str, Any]:
    """What :func:`cc.train_perf` records: one window per ``log_every`` steps at its stage's step time."""
    every, ends, mem, edge = cfg.train.log_every, [], [], 0
    per_step = [STEP_S[n] * (1 + 0.01 * seed) for n, k in _stages(cfg) for _ in range(k)]
    length = [n for n, k in _stages(cfg) for _ in range(k)]
    for end in range(every, cfg.train.max_steps + 1, every):
        t = float(np.mean(per_step[end - every:end]))
        ends.append([end, _tps(cfg) / t, t])
        mem.append(max(MEM_GB[n] for n in length[end - every:end]))
        edge = end
    assert edge == cfg.train.max_steps - cfg.train.max_steps % every
    return {"log_every": every, "tokens_per_step": _tps(cfg), "windows": ends, "peak_mem_gb": max(mem),
            "window_peak_mem_gb": mem}


def _fake_train(study, arm, seed, cfg, run_dir, fingerprint, code, record, evaluate=None, checkpoints="", monitor=None):
    """common._train's stand-in: the run's synthetic record, written by the harness's writer."""
    steps = cfg.train.max_steps
    val = VAL.get(arm, (3.6 - steps / 1000,))[seed]
    vals = {s: val + 0.5 * (1 - s / steps) for s in range(cfg.train.val_every, steps + 1, cfg.train.val_every)}
    history = [{"step": float(s), "train/loss": val - 0.05 + 0.6 * (1 - s / steps), "train/lr": 1e-3,
                **({"val/loss": vals[s]} if s in vals else {})} for s in range(1, steps + 1)]
    settings = cc.eval_settings("research") if arm in cc.SCHEDULES else cc.pilot_eval_settings("research")
    evals = {task: _report(task, arm, seed, kw, cfg) for task, kw in settings.items()}
    evals["train_perf"] = _train_perf(cfg, seed)
    train_s = sum(STEP_S[n] * k for n, k in _stages(cfg)) * (1 + 0.01 * seed)
    wall = round(train_s + OVERHEAD_S, 1)
    tokens = steps * _tps(cfg)
    # a monitored pilot's learning curve: passkey at the short length rising linearly to 0.95 at half its steps
    trajectory = None if monitor is None else [
        {"step": s, "passkey": round(min(0.95, 0.95 * s / (steps / 2)), 4), "passkey_nll": 7.0 - 6.0 * s / steps,
         "mqar": 0.5 * s / steps}
        for s in sorted({*range(0, steps + 1, monitor[0]), steps})]
    rec = common.RunRecord(
        arm=arm, seed=seed, history=history, val_history=[[s, v] for s, v in vals.items()], tokens=tokens,
        epochs=tokens / 22_600_000, train_val_gap=0.05, fingerprint=fingerprint, evals=evals,
        summary={"status": "finished", "steps": steps, "B": cfg.train.batch_size, "T": cfg.data.seq_len,
                 "best_val_loss": val, "final_val_loss": val, "final_train_loss": val - 0.05, "wall_s": wall,
                 "tok_per_s": _tps(cfg) / STEP_S[_stages(cfg)[-1][0]], "peak_mem_gb": 60.0, "run_id": None},
        timing={"started": "2026-12-05T00:00:00+00:00", "ended": "2026-12-05T00:05:00+00:00", "wall_s": wall,
                "gpus": 1, "gpu_minutes": round(wall / 60, 3), "resumed": False},
        machine={"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"}, code=dict(code),
        trajectory=trajectory)
    common._write_record(record, rec, cfg, study, None)
    return rec


def _write_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every record of the research preset (pilot and grid) in ``tmp_path/studies/<stem>/records/research``."""
    records = tmp_path / "studies" / cc.STUDY / "records" / "research"
    monkeypatch.setattr(common, "_train", _fake_train)
    with monkeypatch.context() as m:
        m.setenv(common.RECORDS_ENV, str(records))
        m.delenv(common.RUNS_ENV, raising=False)
        m.delenv(common.SHARD_ENV, raising=False)
        grid = cc.train("research", tmp_path / "prepass")
    assert len(grid.records) == 9 and not any(r.skipped for r in grid.records)
    monkeypatch.undo()
    return records


def _repo_studies() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in (repo_root() / "studies").rglob("*") if p.is_file()}


@pytest.mark.slow
def test_research_report_renders_from_synthetic_records(tmp_path: Path, tracking_uri: str,  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    before = _repo_studies()
    records = _write_records(tmp_path, monkeypatch)
    names = sorted(p.name for p in records.glob("*.json"))
    assert names == sorted([*(f"{a}_s{s}.json" for a in cc.SCHEDULES for s in P.seeds),
                            *(f"{a}_s0.json" for a in cc.pilot_arms("research"))])
    assert max(p.stat().st_size for p in records.iterdir()) < 500_000  # a record stays small
    lines: list[str] = []
    out = run_study(4, "research", out_root=tmp_path / "studies", tracking_uri=tracking_uri, log_output=False,
                    echo=lines.append)
    assert out == tmp_path / "studies" / cc.STUDY
    assert not (out / "checkpoints").exists(), "a run trained"
    reused = [ln for ln in lines if "recorded, not retrained" in ln]
    assert len(reused) >= 11 and not any(ln for ln in lines if re_trained(ln)), lines
    nb = json.loads((out / f"{cc.STUDY}.ipynb").read_text())
    assert not report_problems(nb), report_problems(nb)  # reads as a report, as the committed one must
    summary = json.loads((out / "summary.json").read_text())
    meta = summary["meta"]
    assert meta["preset"] == "research" and meta["runs"] == 9 and meta["runs_skipped"] == 9
    walls = {(a, s): _wall(a, s) for a in cc.SCHEDULES for s in P.seeds}
    pilot_walls = [_wall(name, 0) for name in cc.pilot_arms("research")]
    assert meta["gpu_minutes"] == pytest.approx(sum(round(w / 60, 3) for w in walls.values()), abs=1e-3)
    assert meta["gpu_minutes_total"] == pytest.approx(meta["gpu_minutes"] + sum(round(w / 60, 3)
                                                                                for w in pilot_walls), abs=1e-3)
    assert meta["perf_meaningful"] and meta["train_device"] == "NVIDIA H200"
    # the verdicts from the synthetic numbers: curriculum minus direct in val loss, paired over 3 seeds
    d = [c - x for c, x in zip(VAL["curriculum"], VAL["direct"])]
    half = stats.t.ppf(0.975, 2) * np.std(d, ddof=1) / math.sqrt(3)
    cmp = summary["curriculum_vs_direct"]["val_loss"]
    assert (cmp["mean"], cmp["low"], cmp["high"]) == pytest.approx((np.mean(d), np.mean(d) - half, np.mean(d) + half))
    assert summary["verdict"]["equal_tokens"].startswith("better")
    eff = summary["curriculum_vs_direct"]["effective_context"]
    assert eff["values"] == [16384 - 8192, 0, 32768 - 8192]
    # the pilot: its learning curve (a point every pilot_monitor_every steps before the last), the final evaluation,
    # and the grid's short runs at their budget
    pilot = [d for d in summary["pilot"] if d["source"] == "pilot" and d["recipe"] == ""]
    every, (steps,) = P.pilot_monitor_every, P.pilot_steps
    assert [d["steps"] for d in pilot] == [*range(every, steps, every), steps]
    assert pilot[0]["tokens"] == every * TPS
    assert pilot[0]["passkey"] == pytest.approx(0.95 * every / (steps / 2), abs=1e-4)
    variants = {n: [d for d in summary["pilot"] if d["recipe"] == f"{n}L4"] for n in (2048, 3072)}  # a curve each
    for n, variant in variants.items():
        assert [d["steps"] for d in variant] == [*range(every, n, every), n]
    assert pilot[-1]["passkey"] == 0.95
    assert len(summary["pilot"]) == len(pilot) + sum(map(len, variants.values())) + len(P.seeds)
    assert summary["pilot_recipes"] == cc.pilot_recipes("research")
    assert pilot[0]["passkey_nll"] == pytest.approx(7.0 - 6.0 * every / steps)
    # the stages' step times come from the records (no MLflow perf metrics on this machine)
    perf = {(p["schedule"], p["seed"], p["stage"]): p for p in summary["stage_perf"]}
    assert perf[("curriculum", 0, 1)]["step_time_s"] == pytest.approx(STEP_S[4096])
    # and each stage's memory, from the windows' own peaks
    assert [perf[("curriculum", 0, k)]["peak_mem_gb"] for k in range(3)] == [MEM_GB[n] for n in P.lengths]
    assert perf[("direct", 2, 0)]["tok_per_s"] == pytest.approx(TPS / (STEP_S[LONGEST] * 1.02))
    rows = {(r["schedule"], r["seed"]): r for r in summary["rows"]}
    assert rows[("short", 0)]["train_clock"] == "steady"
    assert rows[("direct", 0)]["train_s"] == pytest.approx(P.steps * STEP_S[LONGEST])
    # held-out loss past the longest training length: every bin there carries the schedule's offset
    off = {(a, s): {"curriculum": 0.01, "direct": 0.05 + 0.01 * s, "short": 0.3}[a] * (1 + s) for a, s in walls}
    d = [off[("curriculum", s)] - off[("direct", s)] for s in P.seeds]  # -0.04, -0.10, -0.18
    half = stats.t.ppf(0.975, 2) * np.std(d, ddof=1) / math.sqrt(3)
    (beyond,) = [c for c in summary["compared"] if c["question"].startswith(f"Held-out loss past {LONGEST:,} tokens")]
    iv = beyond["interval"]
    assert (iv["mean"], iv["low"], iv["high"]) == pytest.approx((np.mean(d), np.mean(d) - half, np.mean(d) + half))
    assert summary["headline"] == summary["verdicts"][0] and len(summary["verdicts"]) == 6
    assert summary["headline"].startswith("Mean passkey accuracy over 1,024-32,768 tokens, curriculum minus direct")
    pilot_line = summary["verdicts"][1]
    assert pilot_line.startswith("Is passkey retrieval learnable at this size")
    # the first budget at which a run reached 0.9: the first monitored point past 0.9 / 0.95 of half the steps
    first = math.ceil(0.9 / 0.95 * steps / 2 / every) * every
    assert f"4 of 4 runs reached it, the first at {first * TPS / 1e6:.1f}M tokens (passkey at " in pilot_line
    assert "passkey by budget" not in pilot_line  # the learning curve: in the details, so the line fits a README cell
    curve = f"passkey by budget: {every * TPS / 1e6:.1f}M tokens: {0.95 * every / (steps / 2):.2f}; "
    assert curve in out.joinpath(f"{cc.STUDY}.ipynb").read_text()
    # the earlier recipes: in the report's details, not in the lead line
    assert "pilot variant" not in pilot_line
    report_text = out.joinpath(f"{cc.STUDY}.ipynb").read_text()
    assert ("pilot variant 2048L4 (model.max_seq_len=16384, data.seq_len=16384, train.batch_size=4, "
            "train.accumulate_grad_batches=2, train.val_every=48, train.log_every=8, 2048 steps): learned, first at "
            "134.2M") in report_text  # 1024 steps of 131,072 tokens
    # the lead: retrieval over the lengths, the pilot, effective context, and past the training length
    assert [c["question"] for c in summary["compared"]][2:4] == [
        "Mean passkey accuracy over 1,024-32,768 tokens, curriculum minus short",
        "Does the curriculum reach a longer effective context than direct training"]
    for name in ("training_loss", "passkey_heatmaps", "pilot", "retrieval_by_length", "loss_by_position", "cost",
                 "val_vs_wall_clock"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 10_000, name
    assert _repo_studies() == before, "the render wrote into the repository's studies/"


def re_trained(line: str) -> bool:
    """A progress line of a run that trained (``(12s)`` instead of ``(recorded, not retrained)``)."""
    return line.startswith("[") and "arm=" in line and "recorded, not retrained" not in line


def _wall(arm: str, seed: int) -> float:
    cfg = common.resolve_arms(P.base, {arm: {**cc.arms("research"), **cc.pilot_arms("research")}[arm]},
                              P.common, seed)[arm]
    return round(sum(STEP_S[n] * k for n, k in _stages(cfg)) * (1 + 0.01 * seed) + OVERHEAD_S, 1)


@pytest.mark.slow
def test_split_call_trains_only_the_named_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The research entry at toy size (the tiny preset, 4 steps of 2 x 4 x 1024 tokens, stages 256 -> 512 -> 1024,
    eager): RUNS names one
    pilot run and one grid run; exactly those train, their records carry the evaluation and the train_perf windows,
    and the call stops with GridIncomplete naming the rest."""
    tiny = dataclasses.replace(
        P, base="tiny", lengths=(256, 512, 1024), steps=4, pilot_steps=(2,), pilot_monitor_every=1,
        train_mqar_density=0.0, pilot_variants=(("L1", 3, {"model.n_layers": 1}),),
        common={"model.pattern": "M", "model.dense_layers": 2, "model.max_seq_len": 1024, "data.seq_len": 1024,
                "train.batch_size": 4, "train.accumulate_grad_batches": 2, "train.max_steps": 4,
                "train.warmup_steps": 1, "train.val_every": 2, "train.val_batches": 1, "train.log_every": 1,
                "train.compile": "none", "tracking.enabled": False, "tracking.log_system_metrics": False},
        eval=dataclasses.replace(P.eval, depths=(0.5,), samples=1, mqar_pairs=2, mqar_samples=1, lbp_samples=1,
                                 batch_size=1, extrapolation=2),
        threads=1)
    monkeypatch.setitem(cc.PRESETS, "research", tiny)
    records = tmp_path / "records"
    monkeypatch.setenv(common.RECORDS_ENV, str(records))
    monkeypatch.setenv(common.RUNS_ENV, "pilot2:0,direct:1")
    common.forget_split_runs()
    t0 = time.perf_counter()
    with pytest.raises(common.GridIncomplete) as e:
        cc.train("research", tmp_path / "out")
    assert time.perf_counter() - t0 < 60
    assert e.value.trained == ["pilot2:0", "direct:1"]  # what the call trained in every grid it met
    assert sorted(e.value.missing) == sorted(["pilot3L1:0", *(f"{a}:{s}" for a in cc.SCHEDULES for s in P.seeds
                                                               if (a, s) != ("direct", 1))])
    assert sorted(p.name for p in records.glob("*.json")) == ["direct_s1.json", "pilot2_s0.json"]
    rec = json.loads((records / "direct_s1.json").read_text())
    assert rec["code"]["source_pin"] == P.source_pin and rec["summary"]["steps"] == 4
    import torch

    evals = torch.load(records / "direct_s1.evals.pt", weights_only=True)
    assert set(evals) == {"passkey", "mqar", "loss_by_position", "train_perf"}
    assert [w[0] for w in evals["train_perf"]["windows"]] == [1, 2, 3, 4]  # one window per log_every step
    assert all(w[1] > 0 and w[2] > 0 for w in evals["train_perf"]["windows"])
    pilot = torch.load(records / "pilot2_s0.evals.pt", weights_only=True)
    assert pilot["passkey"]["settings"]["lengths"] == [256]
    # the pilot's monitor measured the real model at every step: its last point is the final evaluation's numbers
    curve = json.loads((records / "pilot2_s0.json").read_text())["trajectory"]
    assert [pt["step"] for pt in curve] == [0, 1, 2] and set(curve[0]) == {"step", "passkey", "passkey_nll", "mqar"}
    assert curve[-1]["passkey"] == pilot["passkey"]["accuracy_by_length"][0]
    assert curve[-1]["passkey_nll"] == pytest.approx(float(np.mean(pilot["passkey"]["answer_nll"][0])))
