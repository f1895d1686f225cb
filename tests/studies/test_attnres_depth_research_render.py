"""Study 3's research report renders before any GPU time is spent on it: a complete synthetic record set of the
research preset (the lr sweep, the shallow seeds and the deep grid at each mode's winning lr: 24 runs), written by the
harness's record writer with the preset's fingerprints (source pin s3research-1) into a temporary folder, then the
notebook end to end through the runner (papermill, a temporary MLflow store): nothing trains, every record is reused,
the verdicts are the synthetic numbers' own. Also the split-call entry on CPU at toy size."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from scipy import stats as sps

from moelab.base import repo_root
from moelab.studies import attnres_depth as study
from moelab.studies import common
from moelab.studies.runner import run_study
from tests.test_notebooks import report_problems
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

P = study.RESEARCH
MODES = study.MODES
# final validation loss of the sweep (12 layers, seed 0): prenorm and full pick 2e-3, block picks 4e-3 (at the edge)
SWEEP = {"prenorm": {1e-3: 3.642, 2e-3: 3.611, 4e-3: 3.627},
         "block_attnres": {1e-3: 3.630, 2e-3: 3.598, 4e-3: 3.589},
         "full_attnres": {1e-3: 3.625, 2e-3: 3.587, 4e-3: 3.603}}
BEST = {"prenorm": 2e-3, "block_attnres": 4e-3, "full_attnres": 2e-3}
SEED_SHIFT = (0.0, 0.012, -0.007)  # what a seed does to every arm alike (drops out of the paired differences)
GAIN = {"prenorm": -0.060, "block_attnres": -0.085, "full_attnres": -0.090}  # 24 minus 12 layers
JITTER = {"prenorm": (0.0, 0.003, -0.002), "block_attnres": (0.001, -0.002, 0.004),
          "full_attnres": (-0.003, 0.002, 0.0)}
TOK_PER_S = {"prenorm": 1.00e6, "block_attnres": 0.91e6, "full_attnres": 0.78e6}  # at 12 layers; 24: / 1.9
CORPUS = 22_646_121  # tokens of the GPU corpus's training split


def val_loss(mode: str, n_layers: int, seed: int) -> float:
    """The synthetic final validation loss of a main run (seed 0 at 12 layers: the sweep's run at the winning lr)."""
    v = SWEEP[mode][BEST[mode]] + SEED_SHIFT[seed]
    return v + GAIN[mode] + JITTER[mode][seed] if n_layers == P.depths[1] else v


def _evals(mode: str, n_layers: int) -> dict:
    """What research_diagnostics leaves: per-sublayer norms, the depth-attention matrix (rows: reads, None padded)."""
    subs = 2 * n_layers
    out = {"hidden_rms": [1.0 + 0.15 * i * (mode == "prenorm") + 0.02 * i for i in range(subs + 1)],
           "output_rms": [0.5 + 0.01 * i for i in range(subs)],
           "grad_norm": [0.2 / (1 + 0.05 * i) for i in range(subs)], "depth_weights": []}
    if mode != "prenorm":
        per = 1 if mode == "full_attnres" else subs // P.blocks(n_layers)
        width = subs // per + 1
        for read in range(subs + 1):
            n = 1 + read // per + (1 if read % per and read < subs else 0)
            out["depth_weights"].append([1.0 / n] * n + [None] * (width - n))
    return out


def _record(arm: str, overrides: dict, seed: int, out_dir: Path) -> Path:
    """One run's record as a GPU split call would leave it, written by the harness's writer under the fingerprint
    run_grid computes for this (arm, seed) of the research preset."""
    info = study.parse_arm(arm)
    mode, L = info["residual"], info["n_layers"]
    lr = overrides["train.lr"]
    cfg = common.resolve_arms(P.base, {arm: overrides},
                              {**P.common, "name": f"{study.STUDY}-{arm}-s{seed}",
                               "train.ckpt_dir": str(out_dir / "checkpoints" / f"{arm}-s{seed}"),
                               "tracking.run_name": f"{arm}/s{seed}"}, seed)[arm]
    cfg.train.log_every = min(cfg.train.log_every, max(1, cfg.train.max_steps // common.CURVE_POINTS))
    code = {"commit": "c" * 40, "dirty": False, "diff_sha256": None, "source_sha256": "f" * 64,
            "source_pin": P.source_pin}
    final = SWEEP[mode][lr] if info["lr"] is not None else val_loss(mode, L, seed)
    steps, every = cfg.train.max_steps, cfg.train.val_every
    val_history = [[s, round(final + 2.0 * (1 - s / steps) ** 2, 6)] for s in range(every, steps + 1, every)]
    history = [{"step": s, "train/loss": final - 0.05 + 2.5 * (1 - s / steps) ** 2, "train/lr": lr,
                "train/grad_norm": 0.4} for s in range(64, steps + 1, 64)]  # sparse: the report reads val_history
    tps = TOK_PER_S[mode] / (1.9 if L == P.depths[1] else 1.0) * (1 + 0.01 * seed)
    wall = P.tokens_per_run / tps + 20.0
    params = {12: 29_400_000, 24: 52_400_000}[L] + (0 if mode == "prenorm" else (2 * L + 1) * 2 * 384)
    tokens = steps * cfg.train.batch_size * cfg.data.seq_len
    summary = {"name": cfg.name, "preset": P.base, "status": "finished", "run_id": None, "steps": steps,
               "final_train_loss": final - 0.05, "final_val_loss": final, "best_val_loss": final,
               "B": cfg.train.batch_size, "T": cfg.data.seq_len, "device": "NVIDIA H200", "tok_per_s": tps,
               "mfu": 0.12, "peak_mem_gb": 20.0 * L / 12 * (1.0 if mode == "prenorm" else 1.08), "params_total": params,
               "world_size": 1, "tokens_per_step": tokens // steps, "precision": "bf16-mixed", "wall_s": wall - 10,
               "last_checkpoint": f"runs/studies/{study.STUDY}/split/checkpoints/{arm}-s{seed}/last.ckpt",
               "best_checkpoint": None}
    rec = common.RunRecord(
        arm=arm, seed=seed, summary=summary, history=history, val_history=val_history, tokens=tokens,
        epochs=tokens / CORPUS, train_val_gap=0.05, fingerprint=common._fingerprint(cfg, code),
        evals=_evals(mode, L),
        timing={"started": "2026-12-06T10:00:00+00:00", "ended": "2026-12-06T10:03:00+00:00", "wall_s": wall,
                "gpus": 1, "gpu_minutes": round(wall / 60, 3), "resumed": False},
        machine={"device": "NVIDIA H200", "python": "3.12.3", "torch": "2.11.0+cu130", "triton": "3.6.0"},
        code=code)
    path = common.record_path(out_dir / "records" / "research", arm, seed)
    common._write_record(path, rec, cfg, study.STUDY, f"synthetic-{arm}-s{seed}")
    return path


def write_records(out_dir: Path) -> list[Path]:
    """Every run the research ``train`` walks: the sweep (seed 0), the shallow seeds 1-2, the deep grid."""
    paths = [_record(a, ov, P.sweep_seed, out_dir) for a, ov in study.sweep_arms().items()]
    shallow, deep = study.main_arms(BEST)
    paths += [_record(a, ov, s, out_dir) for a, ov in shallow.items() for s in P.seeds if s != P.sweep_seed]
    paths += [_record(a, ov, s, out_dir) for a, ov in deep.items() for s in P.seeds]
    return paths


def _paired(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = sps.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@pytest.mark.slow
def test_research_report_renders_from_synthetic_records(tmp_path: Path, tracking_uri: str) -> None:  # noqa: F811
    out_root = tmp_path / "studies"
    out = out_root / study.STUDY
    paths = write_records(out)
    assert len(paths) == 24 and max(p.stat().st_size + p.with_suffix(".evals.pt").stat().st_size
                                    for p in paths) < 500_000
    repo_studies = sorted(p for p in (repo_root() / "studies").rglob("*") if p.is_file())
    before = {p: p.stat().st_mtime for p in repo_studies}

    # the speed part, as `python -m moelab.studies.attnres_depth overhead` writes it on a GPU
    part = {"meta": {"gpu": "NVIDIA H200", "commit": "0" * 40, "date": "2026-12-05T00:00:00+00:00",
                     "command": f"python -m moelab.studies.attnres_depth overhead --out {study.OVERHEAD_FILE}"},
            "config": {"mode": "graphs", "B": 16, "T": 2048}, "rows": [], "errors": {},
            "ratios": {str(L): {"block": {"median": 0.88, "min": 0.87, "max": 0.9, "rounds": [0.87, 0.88, 0.9],
                                          "peak_mem_ratio": 1.05},
                                "full": {"median": 0.8, "min": 0.79, "max": 0.81, "rounds": [0.79, 0.8, 0.81],
                                         "peak_mem_ratio": 1.2}} for L in P.depths}}
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "overhead_research.json").write_text(json.dumps(part))

    assert run_study(3, "research", out_root=out_root, tracking_uri=tracking_uri, log_output=False) == out

    # nothing trained: no checkpoint folder, every run of the grid a reused record
    assert not (out / "checkpoints").exists()
    summary = json.loads((out / "summary.json").read_text())
    meta = summary["meta"]
    assert meta["preset"] == "research" and meta["runs"] == 24 and meta["runs_skipped"] == 24
    gpu_minutes = sum(json.loads(p.read_text())["timing"]["gpu_minutes"] for p in paths)
    assert meta["gpu_minutes"] == pytest.approx(gpu_minutes, abs=0.01)
    assert meta["records_code"]["source_pins"] == [P.source_pin]
    assert meta["overhead_meaningful"] is True  # the records trained on a GPU, wherever this final call runs
    # the lr sweep's choice
    assert {m: v["lr"] for m, v in summary["lr_sweep"].items()} == BEST
    assert summary["lr_sweep"]["block_attnres"]["at_edge"] and not summary["lr_sweep"]["prenorm"]["at_edge"]
    # the depth gain and the interaction, paired by seed, computed here by hand
    for m in MODES:
        d = summary["depth_gain"][m]
        want = _paired([GAIN[m] + JITTER[m][s] for s in P.seeds])
        assert (d["mean"], d["low"], d["high"]) == pytest.approx(want) and d["verdict"] == "lower"
    inter = summary["interaction"]["block_attnres"]
    want = _paired([GAIN["block_attnres"] + JITTER["block_attnres"][s] - GAIN["prenorm"] - JITTER["prenorm"][s]
                    for s in P.seeds])
    assert (inter["mean"], inter["low"], inter["high"]) == pytest.approx(want) and inter["verdict"] == "lower"
    fb = summary["full_minus_block"]["24"]
    assert fb["mean"] == pytest.approx(sum(val_loss("full_attnres", 24, s) - val_loss("block_attnres", 24, s)
                                           for s in P.seeds) / 3)
    assert summary["precondition"]["reason"] is None
    assert summary["overhead"]["24"]["block"]["tok_per_s_ratio"] == pytest.approx(0.91)
    # headline and verdicts from those numbers
    assert summary["headline"].startswith("Does extra depth (12 -> 24 layers) pay more with Block AttnRes")
    assert f"{want[0]:+.3f}" in summary["headline"] and "better" in summary["headline"]
    assert len(summary["verdicts"]) == 5
    assert summary["overhead_part"]["ratios"]["24"]["block"]["median"] == 0.88
    assert ("Block AttnRes's training speed at 24 layers (tokens/s over PreNorm's, paired rounds)? 0.880x (rounds "
            "0.870-0.900, 3 paired rounds; NVIDIA H200)") in summary["verdicts"]
    # the figures and raw results
    for name in ("lr_sweep", "loss_curves", "depth_gain", "norms_by_layer", "depth_weights"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 10_000, name
    runs = (out / "results" / "runs.csv").read_text().splitlines()
    assert len(runs) == 1 + 24 + 3  # the sweep winners are also the shallow seed-0 main rows
    weights = json.loads((out / "results" / "depth_weights.json").read_text())
    assert sorted(weights) == ["block3-L12", "block6-L24", "full-L12", "full-L24"]
    nb = nbformat.read(out / f"{study.STUDY}.ipynb", as_version=4)
    assert not report_problems(nb), report_problems(nb)  # reads as a report, as the committed one must
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    # the report says once per grid that its runs were read from their records (each run's line: progress file)
    assert "recorded, not retrained" not in text and "Traceback" not in text
    assert sum(int(n) for n in re.findall(r"(\d+) of the grid's \d+ runs read from their records", text)) == 24
    # from_results (make study-3 --from-results): the committed results' rows give the same factor and verdicts
    rows = study.research_rows_from_table(pd.read_csv(out / "results" / "runs.csv"))
    again = json.loads(json.dumps(study.research_summary(None, rows, summary["benchmark_overhead"], meta=meta,
                                                         overhead=study.read_overhead(out / "results")), default=str))
    assert again["factor"] == summary["factor"] and sorted(again["factor"]["train.lr"]) == sorted(
        [*study.sweep_arms(), "prenorm-L24", "block6-L24", "full-L24"])
    for key in ("lr_sweep", "depth_gain", "interaction", "full_minus_block", "precondition", "overhead",
                "overhead_part"):
        assert again[key] == summary[key], key
    # nothing in the repository's studies/ was written
    assert {p: p.stat().st_mtime for p in repo_studies} == before
    assert sorted(p for p in (repo_root() / "studies").rglob("*") if p.is_file()) == repo_studies


# The research plan at toy size: tiny all-MLA model, 4 steps, 2 and 4 layers (blocks of one layer), eager steps.
TOY = dataclasses.replace(
    P, base="tiny", depths=(2, 4), layers_per_block=1, min_tokens=1,
    common={"model.pattern": "M", "model.dense_layers": 8, "data.seq_len": 64, "train.batch_size": 8,
            "train.max_steps": 4, "train.warmup_steps": 1, "train.val_every": 2, "train.val_batches": 1,
            "train.log_every": 1, "train.compile": "none", "tracking.enabled": False,
            "tracking.log_system_metrics": False})


@pytest.mark.slow
def test_split_call_trains_exactly_the_named_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train("research", out_dir) under a split (RUNS_ENV, as the runner sets it): the named sweep runs train, with
    their diagnostics, and the call stops with GridIncomplete naming the rest of the sweep; a call naming only a run
    that needs the sweep's winner trains nothing and says the sweep is incomplete."""
    monkeypatch.setattr(study, "RESEARCH", TOY)
    records = tmp_path / "records"
    monkeypatch.setenv(common.RECORDS_ENV, str(records))
    named = ["prenorm-L2-lr1e-3:0", "block2-L2-lr4e-3:0"]
    monkeypatch.setenv(common.RUNS_ENV, ",".join(named))
    common.forget_split_runs()
    with pytest.raises(common.GridIncomplete) as info:
        study.train("research", tmp_path / "work")
    assert sorted(info.value.trained) == sorted(named) and len(info.value.missing) == 7
    assert "full-L2-lr2e-3:0" in info.value.missing
    assert sorted(p.name for p in records.glob("*.json")) == ["block2-L2-lr4e-3_s0.json", "prenorm-L2-lr1e-3_s0.json"]
    rec = json.loads((records / "block2-L2-lr4e-3_s0.json").read_text())
    assert rec["code"]["source_pin"] == P.source_pin and rec["config"]["train.lr"] == 4e-3
    assert rec["config"]["model.residual.num_blocks"] == 2 and rec["summary"]["steps"] == 4
    import torch

    ev = torch.load(records / "block2-L2-lr4e-3_s0.evals.pt", weights_only=True)
    assert "error" not in ev and len(ev["hidden_rms"]) == 5 and len(ev["grad_norm"]) == 4
    assert len(ev["depth_weights"]) == 5 and sum(ev["depth_weights"][-1]) == pytest.approx(1.0, abs=1e-3)
    # a run of the main grid before the sweep is complete: nothing trains
    monkeypatch.setenv(common.RUNS_ENV, "prenorm-L4:0")
    common.forget_split_runs()
    with pytest.raises(common.GridIncomplete, match="the lr sweep is incomplete"):
        study.train("research", tmp_path / "work")
    assert len(list(records.glob("*.json"))) == 2
    common.forget_split_runs()


@pytest.mark.slow
def test_overhead_part_at_toy_size_times_every_mode_at_both_depths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOELAB_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    toy = dataclasses.replace(TOY, common={**TOY.common, "data.seq_len": 32, "train.batch_size": 2})
    monkeypatch.setattr(study, "RESEARCH", toy)
    monkeypatch.setattr(study.overhead_part, "__defaults__", (2, 1, 2, toy, "cpu", 480.0, print, None))
    out = tmp_path / "overhead_research.json"
    assert study.main(["overhead", "--rounds", "2", "--window", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["command"] == ("python -m moelab.studies.attnres_depth overhead --rounds 2 --window 1 --out "
                                       "studies/03_attnres_depth/results/overhead_research.json")
    assert sorted((r["n_layers"], r["residual"]) for r in data["rows"]) == sorted(
        (L, m) for L in toy.depths for m in toy.modes)
    assert set(data["ratios"]) == {"2", "4"} and set(data["ratios"]["4"]) == {"block", "full"}
    assert all(len(r["rounds"]) == 2 and r["min"] <= r["median"] <= r["max"] for m in data["ratios"].values()
               for r in m.values())
    assert data["config"]["mode"] == "eager" and not data["errors"]  # no GPU: eager steps
    assert study.read_overhead(tmp_path) == data and study.read_overhead(tmp_path / "nowhere") is None
    with pytest.raises(ValueError, match="warm=1 are not allowed"):
        study.overhead_part(warm=1, plan_=toy, device="cpu")


@pytest.mark.slow
def test_overhead_part_frees_one_depths_arms_before_building_the_next(monkeypatch) -> None:
    """Every arm's CUDA graph holds its own memory pool: all six arms at once ran out of memory on an 80 GB H100
    (full-L24), so the speed part builds, times and frees one depth's arms before the next depth's."""
    import gc
    import weakref

    from moelab.train import perf

    live: weakref.WeakSet = weakref.WeakSet()
    alive_at_build: list[int] = []

    class Counted(perf.TimedStep):
        def __init__(self, *args, **kwargs) -> None:
            gc.collect()
            alive_at_build.append(len(live))
            super().__init__(*args, **kwargs)
            live.add(self)

    monkeypatch.setattr(perf, "TimedStep", Counted)
    monkeypatch.setenv("MOELAB_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    toy = dataclasses.replace(TOY, common={**TOY.common, "data.seq_len": 32, "train.batch_size": 2})
    lines: list[str] = []
    data = study.overhead_part(rounds=1, window=1, warm=2, plan_=toy, device="cpu", log=lines.append)
    per_depth = list(range(len(toy.modes)))
    assert alive_at_build == per_depth * len(toy.depths)  # the first depth's arms are gone before the second's
    assert set(data["ratios"]) == {str(L) for L in toy.depths} and not data["errors"]
    first_round, deep_build = (next(i for i, x in enumerate(lines) if x.strip().startswith("round")),
                               next(i for i, x in enumerate(lines) if f"-L{max(toy.depths)}" in x))
    assert first_round < deep_build  # the shallow depth was timed before the deep arms were built


def test_block_speed_finding_says_where_the_speed_comes_from_or_that_it_was_not_measured() -> None:
    shared = study.block_speed_finding({}, {"overhead": {}}, 24)
    assert shared.status == "measured" and "not measured" in shared.plain() and "overhead` on a GPU" in shared.plain()
    iv = {"mean": 0.93, "low": 0.91, "high": 0.95, "n": 3}
    alone = study.block_speed_finding({}, {"overhead": {"24": {"block": {"tok_per_s_interval": iv}}}}, 24)
    assert "0.930" in alone.plain() and "this study's runs" in alone.plain()
    part = {"overhead_part": {"ratios": {"24": {"block": {"median": 0.928, "min": 0.927, "max": 0.929,
                                                          "rounds": [0.927, 0.928, 0.929]}}},
                              "meta": {"gpu": "NVIDIA H100 80GB HBM3"}}}
    paired = study.block_speed_finding(part, {"overhead": {}}, 24)
    assert "0.928x (rounds 0.927-0.929, 3 paired rounds; NVIDIA H100 80GB HBM3)" in paired.plain()


def test_research_report_names_untimed_speeds_and_why() -> None:
    """Runs that shared a GPU have no tokens/s (their peak memory still counts) and an arm the speed part could
    not time names its error: neither reads as a bare 'not recorded'."""
    summary = json.loads((repo_root() / "studies" / study.STUDY / "summary.json").read_text())
    if summary["meta"]["preset"] != "research":
        pytest.skip("the committed study 3 report is not the research tier's")
    rows = [{**r, "tok_per_s": None} if r.get("n_layers") == 24 else r for r in summary["rows"]]
    summary["overhead_part"] = {**(summary.get("overhead_part") or {"ratios": {}, "config": {"mode": "graphs",
                                                                                            "B": 16, "T": 2048},
                                                                       "meta": {"gpu": "x"}}),
                                "errors": {"full-L24": "setup: OutOfMemoryError: CUDA out of memory. Tried to "
                                                       "allocate 48.00 MiB. GPU 0 has a total capacity of 79 GiB"}}
    rep = study.research_report(summary, rows)
    text = "\n".join(rep.details)
    assert re.search(r"Overhead at 24 layers over PreNorm \(this study's runs, train.compile=graphs\): block "
                     r"tokens/s not recorded \(its runs shared a GPU: the speed part below times it\), peak memory "
                     r"1\.\d{3}x", text), text
    assert "Speed part: full-L24 not timed (setup: OutOfMemoryError: CUDA out of memory)." in text
