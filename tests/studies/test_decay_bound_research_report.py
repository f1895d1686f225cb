"""Study 1's research report on CPU: the committed seed-0 records plus synthetic seeds 1-2 (written and read back
through the harness's record files), the standalone parts' files (real speed file, synthetic overflow and forgetting
rows), rendered through the notebook's functions; the parts' commands at toy size."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from scipy import stats

from moelab.base import repo_root
from moelab.studies import common, report
from moelab.studies import decay_bound as study

RECORDS = repo_root() / study.RECORDS_DIR
ARMS = list(study.RESEARCH_ARMS)
# val loss added to seed 0's per (arm, seed): seeds 1 and 2 are synthetic
DELTA = {"bounded-0.25": (0.0, 0.012, 0.006), "bounded-0.5": (0.0, 0.004, 0.011), "bounded-1": (0.0, -0.003, 0.002),
         "bounded-5": (0.0, 0.001, -0.002), "softplus": (0.0, 0.002, 0.004)}


def _seed0() -> dict[str, common.RunRecord]:
    recs = {}
    for arm in ARMS:
        path = common.record_path(RECORDS, arm, 0)
        if not path.is_file():
            pytest.skip(f"{path.name} is not committed")
        fp = json.loads(path.read_text())["fingerprint"]
        recs[arm] = common._load_record(path, fp, evals=True, trajectory=True)
    return recs


def _grid(tmp_path: Path, seeds=(0, 1, 2)) -> common.Grid:
    """The research grid: seed 0 as committed, seeds 1-2 copies with DELTA added to the losses, every record written
    by the harness's writer into ``tmp_path/records`` and read back."""
    P = study.PRESETS["research"]
    base = _seed0()
    records = []
    for arm in ARMS:
        for seed in seeds:
            rec = copy.deepcopy(base[arm])
            rec.seed = seed
            for key in ("best_val_loss", "final_val_loss"):
                rec.summary[key] += DELTA[arm][seed]
            if seed not in P["real_g_seeds"]:
                rec.evals["real_g"] = {}
            cfg = common.resolve_arms(P["base"], {arm: study.RESEARCH_ARMS[arm]}, P["overrides"], seed)[arm]
            path = common.record_path(tmp_path / "records", arm, seed)
            common._write_record(path, rec, cfg, study.STUDY, rec.mlflow.get("run_id"))
            back = common._load_record(path, rec.fingerprint, evals=True, trajectory=True)
            assert back is not None and back.trajectory == rec.trajectory
            records.append(back)
    return common.Grid(study.STUDY, P["base"], records, factor=study.arms_factor("research"),
                       corpus_tokens=round(records[0].tokens / records[0].epochs))


def _overflow_file() -> dict:
    """An overflow part's file as a GPU would write it: told -5 constant decays, errors rising to non-finite."""
    rows = []
    for g, err in ((-5.0, 3.1e-3), (-6.0, 4e-3), (-8.0, 0.25), (-8.1, None)):
        for pattern in ("constant", "uniform"):
            e = err if pattern == "constant" else 3e-3
            rows.append({"source": f"synthetic {pattern}", "pattern": pattern, "bound": g, "told_bound": False,
                         "told": -5.0, "g_min": g, "nonfinite": 0.0 if e is not None else 1.0, "rel_err": e,
                         "rel_err_general": 2e-3, "dtype": "bfloat16"})
    trained = [{"source": f"softplus-s0/layers.{i}.mixer", "pattern": "trained softplus", "bound": -5.0, "told": -5.0,
                "g_min": -1.5 - i, "nonfinite": 0.0, "rel_err": 1e-3 * (i + 1), "rel_err_general": 1e-3,
                "dtype": "bfloat16"} for i in range(3)]
    return {"meta": {"gpu": "NVIDIA H200", "commit": "0" * 40, "date": "2026-12-05T00:00:00+00:00",
                     "command": study.PART_COMMANDS["overflow"]},
            "config": {"shape": [2, 1024, 4, 128]}, "synthetic": rows, "trained": trained, "wall_s": 60.0}


def _forgetting_rows(moving: dict[tuple[str, int], float] | None = None) -> list[dict]:
    """Log10 final loss -3 for softplus, -3 + 0.5 * (bound index) + 0.01 * seed for the bounded arms."""
    rows = []
    for i, arm in enumerate(ARMS):
        bound = study.forgetting_bounds("research")[arm]
        for seed in range(3):
            log10 = -3.0 if bound is None else -3.0 + 0.5 * (4 - i) + 0.01 * seed
            change = (moving or {}).get((arm, seed), 0.001)
            rows.append({"arm": arm, "seed": seed, "bound": bound if bound is not None else study.REFERENCE_BOUND,
                         "final_loss": 10 ** log10, "first_loss": 10 ** (log10 + 2), "last20_change": change,
                         "last20_converged": abs(change) < 0.01})
    return rows


def _parts(tmp_path: Path, forgetting_rows: list[dict] | None = None) -> dict:
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    shutil.copy(repo_root() / study.SPEED_FILE, results / Path(study.SPEED_FILE).name)
    from moelab.utils import write_json

    write_json(results / Path(study.OVERFLOW_FILE).name, _overflow_file())
    write_json(results / Path(study.FORGETTING_FILE).name,
               {"meta": {"gpu": "NVIDIA H200"}, "config": {"steps": 3000},
                "rows": forgetting_rows or _forgetting_rows()})
    return study.research_parts(results)


def test_research_report_end_to_end_from_records_and_part_files(tmp_path) -> None:
    grid = _grid(tmp_path)
    runs = grid.table()
    decay = pd.DataFrame(study.gate_decay_rows(grid)[0])
    parts = _parts(tmp_path)
    assert math.isinf(parts["overflow"]["synthetic"][-2]["rel_err"])  # null in the file: inf again
    summary = study.research_summary(grid, runs, decay, parts)
    rep = study.research_report(summary, runs, decay, parts)
    lead = rep.findings
    assert len(lead) == 6 and lead[0].question.startswith("Does the trained decay reach its bound")
    # the precondition, from the committed records: every bound binds (mean over seeds of the largest layer share)
    binds = study.binds_by_arm(decay)
    for arm in ARMS[:-1]:
        ev = grid.records[ARMS.index(arm) * 3].evals["decay"]
        share = max(r["frac_channels_near_bound"] for r in ev)
        assert share > 0 and binds[arm]["share"] == pytest.approx(share)
    assert lead[0].answer.startswith("binds in bounded-0.25, bounded-0.5, bounded-1, bounded-5")
    # the cost per bound, tightest first: the paired t interval over the 3 seeds, computed here by hand
    v0 = {arm: grid.records[ARMS.index(arm) * 3].summary["best_val_loss"] for arm in ARMS}
    for f, arm in zip(lead[1:5], ARMS[:-1]):
        assert f"({arm} minus softplus)" in f.question
        d = [v0[arm] - v0["softplus"] + DELTA[arm][s] - DELTA["softplus"][s] for s in range(3)]
        mean, sd = sum(d) / 3, pd.Series(d).std()
        half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
        assert (f.number.mean, f.number.low, f.number.high) == pytest.approx((mean, mean - half, mean + half))
        assert f.number.n == 3 and f.status == report.judge(f.number)
    # the end-to-end speed: the committed file's medians and round ranges
    speed = json.loads((repo_root() / study.SPEED_FILE).read_text())
    assert lead[5].status == "measured" and f"{speed['ratios'][0]['median']:.3f}x" in lead[5].answer
    assert f"rounds {speed['ratios'][0]['min']:.3f}-{speed['ratios'][0]['max']:.3f}" in lead[5].answer
    # details: the op's error vs g and fast forgetting
    text = rep.markdown()
    assert "g -8: 2.5e-01; g -8.1: non-finite; within 1% down to g = -6.0, first non-finite at -8.1" in text
    assert "on 3 trained softplus layers (min g -3.50) non-finite in 0, worst error 3.0e-03" in text
    assert text.count("hurt a task that needs fast forgetting") == 4
    assert "+2.01 log10 [+1.99, +2.03]; worse (interval excludes 0)" in text  # bounded-0.25: +2 + 0.01 * mean seed
    # meta: GPU minutes per run and in all, the parts' provenance
    meta = summary["meta"]
    assert len(meta["gpu_minutes_per_run"]) == 15
    assert meta["gpu_minutes"] == pytest.approx(sum(r.timing["gpu_minutes"] for r in grid.records), abs=1e-3)
    assert meta["standalone_parts"]["overflow"]["wall_s"] == 60.0 and meta["epochs"] >= 1
    assert summary["overflow"]["cases"]["told_-5_constant"]["first_nonfinite"] == -8.1
    assert summary["arms"]["softplus"]["end_g_min"]["mean"] < -5  # softplus goes past K3's bound
    full = report.attach(summary, rep, from_results=False)
    assert full["headline"] == lead[0].plain() and len(full["verdicts"]) == 6
    json.dumps(full, allow_nan=False, default=str)
    # figures and tables draw from the same inputs
    traj = grid.trajectories()
    first = study.first_binding_step(traj)
    assert all(first[a] is not None and first[a] <= 700 for a in ARMS[:-1])
    hists = study.final_histograms(grid)
    assert set(hists) == set(ARMS) and all(sum(h) == pytest.approx(1.0) for h in hists.values())
    table = study.overflow_error_table(parts["overflow"]["synthetic"])
    assert table.loc[-8.1, "told g_min = -5, constant"] == "non-finite" and table.loc[-5.0].iloc[0] == "3.10e-03"
    for fig in (study.trajectory_figure(traj), study.histogram_figure(hists), study.e2e_speed_figure(parts["speed"]),
                study.cost_figure(study.cost_findings(runs, decay), study.cost_arms(decay)),
                study.overflow_figure(study.tile_overflow_table(g_mins=(-5, -8.1), trials=1),
                                      parts["overflow"]["synthetic"])):
        assert len(fig.axes) >= 1


def test_missing_parts_are_not_measured_and_one_seed_has_no_interval(tmp_path) -> None:
    grid = _grid(tmp_path, seeds=(0,))
    runs = grid.table()
    decay = pd.DataFrame(study.gate_decay_rows(grid)[0])
    parts = study.research_parts(tmp_path / "empty")
    assert parts == {"speed": None, "overflow": None, "forgetting": None}
    summary = study.research_summary(grid, runs, decay, parts)
    rep = study.research_report(summary, runs, decay, parts)
    costs, speed = rep.findings[1:5], rep.findings[5]
    assert all(f.status == "measured" and f.answer == "one seed, no interval" and not f.number.known for f in costs)
    assert "[interval n/a: 1 seed]" in costs[0].plain()
    assert speed.status == "not tested" and "not measured: no speed_research.json" in speed.reason
    text = rep.markdown()
    assert "not measured: no overflow_research.json" in text and "not measured: no forgetting_research.json" in text
    assert summary["speed"] is None and summary["overflow"] is None and summary["meta"]["runs"] == 5


def test_forgetting_needs_converged_runs_unless_only_the_reference_still_falls() -> None:
    data = {"config": {"steps": 3000}}
    done = study.forgetting_findings({**data, "rows": _forgetting_rows()})
    assert [f.status for f in done] == ["worse", "worse", "worse", "worse"]
    assert done[-1].number.mean == pytest.approx(0.51)  # bounded-5: 0.5 + 0.01 * mean seed
    moving = study.forgetting_findings({**data, "rows": _forgetting_rows({("bounded-1", 2): -0.05})})
    assert moving[2].status == "not tested" and "1 of 6 runs still move" in moving[2].reason
    assert moving[2].reason.endswith("(bounded-1/s2)") and moving[0].status == "worse"
    falling = study.forgetting_findings({**data, "rows": _forgetting_rows({("softplus", 0): -0.03})})
    assert all(f.status == "worse" and f.answer.startswith("softplus still falling") for f in falling)
    # a run 1000-fold below its first loss has solved the task: its last 20% moving (up or down) is noise near zero
    rows = _forgetting_rows({("softplus", 1): 0.03, ("bounded-1", 2): -0.05})
    for r in rows:
        if (r["arm"], r["seed"]) == ("softplus", 1):
            r["first_loss"] = r["final_loss"] * 2000
    solved = study.forgetting_findings({**data, "rows": rows})
    assert [f.status for f in solved] == ["worse", "worse", "not tested", "worse"]
    assert solved[2].reason.endswith("(bounded-1/s2)")  # 100-fold below its first: still training


def test_forgetting_part_at_toy_size_writes_its_schema_and_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOELAB_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    out = tmp_path / "forgetting_research.json"
    assert study.main(["forgetting", "--steps", "6", "--seeds", "0,1", "--out", str(out)]) == 0
    data = study.read_part("forgetting", tmp_path)
    assert data["meta"]["commit"] == "0123456789abcdef0123456789abcdef01234567"
    # a scratch output is recorded as the file's path in the repository, in python -m form
    assert data["meta"]["command"] == ("python -m moelab.studies.decay_bound forgetting --steps 6 --seeds 0,1 "
                                       "--out studies/01_decay_bound/results/forgetting_research.json")
    assert data["config"]["steps"] == 6 and data["config"]["seeds"] == [0, 1]
    assert {(r["arm"], r["seed"]) for r in data["rows"]} == {(a, s) for a in ARMS for s in (0, 1)}
    for r in data["rows"]:
        assert {"final_loss", "g_fast_min", "last20_change", "last20_converged"} <= r.keys()
        assert r["arm"] == "softplus" or r["g_fast_min"] >= r["bound"]  # a bounded gate stays above its bound
    assert len(study.forgetting_findings(data)) == 4 and study.read_part("forgetting", tmp_path / "nowhere") is None


def test_overflow_part_at_toy_size_reads_the_softplus_records(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MOELAB_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    records = tmp_path / "records"
    records.mkdir()
    g = -torch.rand(1, 16, 1, 16, generator=torch.Generator().manual_seed(0)) * 3
    torch.save({"real_g": {"layers.0.mixer": g.bfloat16()}}, records / "softplus_s0.evals.pt")
    torch.save({"real_g": {}}, records / "softplus_s1.evals.pt")  # seeds past real_g_seeds keep none
    out = tmp_path / "overflow.json"
    args = ["overflow", "--shape", "1x16x1x16", "--g-mins=-5,-8.1", "--records", str(records), "--out", str(out)]
    assert study.main(args) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["command"].startswith("python -m moelab.studies.decay_bound overflow --shape 1x16x1x16")
    assert data["meta"]["command"].endswith("--out studies/01_decay_bound/results/overflow_research.json")
    assert data["config"]["real_g"] == ["softplus-s0/layers.0.mixer"] and data["config"]["real_tokens"] == 16
    syn = {(r["told_bound"], r["pattern"], r["bound"]): r for r in data["synthetic"]}
    assert len(syn) == 8
    assert syn[(False, "constant", -5.0)]["rel_err"] < 1e-4  # told -5, inside the bound: exact in fp32
    assert syn[(False, "constant", -8.1)]["nonfinite"] > 0  # past the predicted overflow (-8.05)
    (trained,) = data["trained"]
    assert trained["g_min"] == pytest.approx(g.bfloat16().min().item()) and trained["nonfinite"] == 0
    with pytest.raises(SystemExit):
        study.main(["overflow", "--shape", "1x16x1", "--out", str(out)])


def test_a_part_is_read_from_a_results_folder_relative_to_the_working_directory(tmp_path, monkeypatch) -> None:
    # the notebook runs in its report's folder and passes "results": the folder there, not the repository's
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "forgetting_research.json").write_text(json.dumps({"rows": [], "config": {}}))
    monkeypatch.chdir(tmp_path)
    assert study.read_part("forgetting", "results") == {"rows": [], "config": {}}
    assert study.read_part("overflow", "results") is None
