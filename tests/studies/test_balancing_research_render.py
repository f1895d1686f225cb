"""Study 2's research report rendered end to end on CPU before any GPU time is spent on it.

The research grids' records are synthetic but written by the harness itself: ``study.train("research", ...)`` runs
``common.run_grid`` with its training step (``common._train``) replaced by a writer of plausible records (the
research preset's configs, fingerprints and source pin, so the notebook's own ``train`` reuses every one of them), then
the notebook runs through ``run_study`` (papermill, a kernel, a tmp MLflow store) with ``preset="research"``. Also
the split-call entry: ``train("research", out_dir)`` under ``RUNS`` at toy size trains exactly the named runs."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch
from scipy import stats

from moelab.studies import balancing as study
from moelab.studies import common, run_study
from tests.test_notebooks import report_problems
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
FLOOR = {"8x2048": 0.25, "64x256": 0.4}  # the frozen QB floor per layout (+ 0.01 x seed)
REACH = {"qb": 3, "qb_hist": 5, "loss_free_sign": 60}  # steps after the switch until MaxVio_batch is at the floor
BACK = {"qb": 3, "qb_hist": 6, "loss_free_sign": 15, "aux_1e-2": 30, "none": 30}  # shift: steps back (+ seed)
VAL = {"none": 4.00, "aux_1e-2": 4.03, "loss_free_sign": 4.01, "qb": 3.99, "qb_hist": 4.00}  # final val loss
NOISE = (0.0, 0.004, -0.003)  # per seed, on the balancers' val loss (none: its negative)
GLOBAL = {"none": 3.0, "aux_1e-2": 0.6, "loss_free_sign": 0.12, "qb": 0.05, "qb_hist": 0.06}  # MaxVio_global
GPU_MIN = {"8x2048": 1.25, "64x256": 0.5}  # per run
LAYERS = ["layers.1.moe", "layers.2.moe", "layers.3.moe"]


def _val(balancer: str, seed: int) -> float:
    return VAL[balancer] + (-NOISE[seed] if balancer == "none" else NOISE[seed])


def _maxvio(balancer: str, layout: str, seed: int, s: int, start: int) -> float:
    """6/s + 0.2 with the balancer off (flat well before the switch), then 1.0 until the balancer reaches its
    floor (1.05 x it); none and aux never do."""
    if s <= start:
        return 6.0 / s + 0.2
    floor = FLOOR[layout] + 0.01 * seed
    return 1.05 * floor if s - start >= REACH.get(balancer, 10**9) else 1.0


def _fake_train(study_name, arm, seed, cfg, run_dir, fingerprint, code, record, evaluate=None,
                checkpoints="every_validation", monitor=None, *, store=None) -> common.RunRecord:
    """``common._train``'s stand-in: a finished run's record of the shapes a GPU run writes (history per optimizer
    step with the balance scalars, validations every val_every steps, research_evaluate's evals), written by the
    harness's writer under the fingerprint run_grid computed. ``store``: ``(MlflowClient, experiment id)`` where
    the run is made as if it had trained against that store (the final call then imports nothing)."""
    balancer, layout = arm.rsplit("-", 1)
    t = cfg.train
    n, start, B, T = t.max_steps, t.balancer_start_step, t.batch_size, cfg.data.seq_len
    assert f"{B}x{T}" == layout and start == study.WARM_STEPS
    history, vals = [], []
    for s in range(1, n + 1):
        loss = 4.0 + 6.0 * math.exp(-s / 150) + 0.01 * math.sin(s)
        row = {"step": float(s), "train/loss": loss, "train/ce": loss,
               "train/aux_loss": 0.01 if balancer == "aux_1e-2" and s > start else 0.0,
               "balance/maxvio_batch": _maxvio(balancer, layout, seed, s, start),
               "balance/load_cv": 0.1 + 0.5 / s, "balance/dead_experts": 0.0, "balance/router_entropy": 4.1,
               "train/grad_norm": 0.5 + 1.0 / s, "train/lr": t.lr * min(1.0, s / t.warmup_steps)}
        if s % t.val_every == 0 or s == n:
            v = _val(balancer, seed) + 0.1 * (n - s) / n
            row.update({"val/loss": v, "val/maxvio_global": GLOBAL[balancer] + 0.01 * seed})
            vals.append([s, v])
        history.append(row)
    floor = FLOOR[layout] + 0.01 * seed
    step, bias = study.thin_bias(torch.arange(start, n + 1), torch.randn(n + 1 - start, len(LAYERS), 64) * 0.01,
                                 start, dense=study.SWITCH_DENSE)
    evals = {"floor": {"frozen_next": floor, "shuffled_next": 0.9 * floor, "same_batch": 0.5 * floor,
                       "converged_next": floor},
             "layers": LAYERS, "step": step, "bias": bias.half()}
    kw = evaluate.keywords
    if kw["shift_steps"] and seed in kw["shift_seeds"]:
        level = 1.05 * floor if balancer in REACH else 1.0
        k = BACK[balancer] + seed
        evals["shift"] = {"source": "shakespeare", "step": list(range(1, kw["shift_steps"] + 1)),
                          "maxvio_batch": [0.9 if i < k else level for i in range(1, kw["shift_steps"] + 1)]}
    val = _val(balancer, seed)
    wall = GPU_MIN[layout] * 60
    summary = {"name": cfg.name, "preset": "gpu-small", "status": "finished", "run_id": None, "steps": n,
               "final_train_loss": history[-1]["train/loss"], "final_val_loss": val, "best_val_loss": val,
               "B": B, "T": T, "device": "NVIDIA H200", "tok_per_s": n * B * T / wall, "balancer_ms": None,
               "balancer_share": None, "maxvio_global": GLOBAL[balancer] + 0.01 * seed, "world_size": 1,
               "tokens_per_step": B * T, "precision": "bf16-mixed", "wall_s": wall,
               "last_checkpoint": str(run_dir / "last.ckpt"), "best_checkpoint": None}
    tokens = n * B * T
    rec = common.RunRecord(arm=arm, seed=seed, summary=summary, history=history, val_history=vals, tokens=tokens,
                           epochs=tokens / 30e6, train_val_gap=0.02, fingerprint=fingerprint, evals=evals,
                           timing={"started": "2026-12-05T00:00:00+00:00", "ended": "2026-12-05T00:01:00+00:00",
                                   "wall_s": wall, "gpus": 1, "gpu_minutes": GPU_MIN[layout], "resumed": False},
                           machine={"device": "NVIDIA H200"}, code=dict(code))
    run_id = store[0].create_run(store[1], run_name=f"{arm}/s{seed}").info.run_id if store else None
    common._write_record(record, rec, cfg, study_name, run_id)
    return rec


def _write_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uri: str | None = None) -> Path:
    """Every research run's record in ``<tmp>/studies/02_balancing/records/research`` (where run_study looks); with
    ``uri`` each record's MLflow run made in that store (as if trained against it)."""
    records = tmp_path / "studies" / study.STUDY / "records" / "research"
    store = None
    if uri:
        from mlflow.tracking import MlflowClient

        mc = MlflowClient(uri)
        store = (mc, mc.create_experiment("02_balancing-split-calls"))
    with monkeypatch.context() as m:
        m.setattr(common, "_train", functools.partial(_fake_train, store=store))
        m.setenv(common.RECORDS_ENV, str(records))
        m.delenv(common.RUNS_ENV, raising=False)
        m.delenv(common.SHARD_ENV, raising=False)
        grids = study.train("research", tmp_path / "writer")
    assert {k: len(g.records) for k, g in grids.items()} == {"8x2048": 15, "64x256": 12}
    return records


def _repo_state() -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in (ROOT / "studies").rglob("*") if p.is_file()}


@pytest.mark.slow
def test_research_report_renders_from_records_without_training(tmp_path, tracking_uri,  # noqa: F811
                                                               monkeypatch) -> None:
    # The records' runs are in the test's store: the final call's import of records made elsewhere (~4 s a 2400-step
    # run into sqlite on 2 cores, 108 s for the 27) is the harness's, tested in test_split_runs.
    records = _write_records(tmp_path, monkeypatch, tracking_uri)
    files = sorted(records.glob("*.json"))
    assert len(files) == 27 and len(list(records.glob("*.evals.pt"))) == 27
    sizes = {p.name: p.stat().st_size + p.with_suffix(".evals.pt").stat().st_size for p in files}
    # a 2400-step run: ~0.49 MB of record (its per-step history, indented JSON, is nearly all of it) + ~75 KB of evals
    assert max(sizes.values()) < 600_000 and max(p.stat().st_size for p in records.glob("*.evals.pt")) < 100_000
    written = {p.name: p.read_bytes() for p in records.iterdir()}
    before = _repo_state()

    lines: list[str] = []
    out = run_study(2, "research", out_root=tmp_path / "studies", tracking_uri=tracking_uri, log_output=False,
                    echo=lines.append)
    assert out == tmp_path / "studies" / study.STUDY
    # nothing trained: every run read from its record, no run folder made, the records as written
    progress = (out / "progress.log").read_text().splitlines()
    runs = [ln for ln in progress if ln.startswith("[")]
    assert len(runs) == 27 and all("recorded, not retrained" in ln for ln in runs), runs
    assert not (out / "checkpoints").exists()
    assert {p.name: p.read_bytes() for p in records.iterdir()} == written
    assert _repo_state() == before  # nothing written into the repository's studies/

    nb = nbformat.read(out / f"{study.STUDY}.ipynb", as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert not report_problems(nb), report_problems(nb)  # reads as a report, as the committed one must
    s = json.loads((out / "summary.json").read_text())
    meta = s["meta"]
    assert meta["preset"] == "research" and meta["runs"] == 27 and meta["runs_skipped"] == 27
    assert meta["gpu_minutes_total"] == pytest.approx(15 * 1.25 + 12 * 0.5)
    assert meta["gpu_minutes_by_layout"] == {"8x2048": 18.75, "64x256": 6.0}
    assert meta["records_code"]["source_pins"] == ["s2research-1"]
    assert s["settings"]["source_pin"] == "s2research-1" and len(s["runs"]) == 27 and len(s["shift"]) == 15
    assert s["headline"] and 1 <= len(s["verdicts"]) <= 6
    found = {f["question"]: f for f in s["findings"]}

    # the precondition: the balancer-off phase peaks at step 1 (6.2) and is flat by the switch
    collapse = next(f for q, f in found.items() if q.startswith("Has the router left"))
    # one value: no range
    assert collapse["answer"].startswith("yes: the balancer-off phase peaks at MaxVio_batch 6.2 at steps 1;")
    # steps to the floor (qb): REACH["qb"] after the switch at both layouts, every seed
    for layout in study.LAYOUTS:
        f = found[f"Steps after a warm switch until MaxVio_batch reaches the frozen floor, {layout} (qb)"]
        assert f["interval"]["mean"] == pytest.approx(REACH["qb"]) and f["interval"]["n"] == 3
    # the quality cost, paired by seed, by hand: qb minus none
    d = [_val("qb", s) - _val("none", s) for s in range(3)]
    half = stats.t.ppf(0.975, 2) * np.std(d, ddof=1) / math.sqrt(3)
    cost = found["Validation loss, qb minus none"]["interval"]
    assert (cost["mean"], cost["low"], cost["high"]) == pytest.approx((np.mean(d), np.mean(d) - half,
                                                                        np.mean(d) + half))
    assert "Validation loss, qb minus none" in " ".join(s["verdicts"])
    # none and aux stay at 1.0, above the first shifted step: not tested, the reason without a repeated name
    none = found["Steps back to within 1.1x the pre-shift MaxVio_batch after a shift, none"]
    assert none["status"] == "not tested" and none["line"].endswith("on every seed))")
    # the steady state: MaxVio_global qb minus loss_free_sign, the same offset every seed
    glob = found["MaxVio_global after 2000 steps, qb minus loss_free_sign"]["interval"]
    assert glob["mean"] == pytest.approx(GLOBAL["qb"] - GLOBAL["loss_free_sign"], abs=1e-5)
    # the shift: qb recovers BACK + seed steps after it, loss_free_sign likewise: qb minus it by seed
    paired = found["Steps to re-balance after the shift, qb minus loss_free_sign"]["interval"]
    assert paired["mean"] == pytest.approx(BACK["qb"] - BACK["loss_free_sign"]) and paired["n"] == 3
    for name in ("research_switch", "research_steady", "research_bias"):
        assert (out / "figures" / f"{name}.png").stat().st_size > 10_000, name
    for name in ("research_runs", "research_shift"):
        assert (out / "results" / f"{name}.csv").is_file()


@pytest.mark.slow
def test_split_call_trains_exactly_the_named_research_runs(tmp_path, monkeypatch) -> None:
    """``train("research", out_dir)`` under ``RUNS`` (what a split call runs), the preset scaled to a toy: the cpu
    preset's MLA model, 2 steps with the balancer off then 2 with it, eager (graphs needs CUDA), untracked. It trains
    the two named runs, one per layout, each evaluated in its training process (floor, bias from the switch, the
    shift test for the shift layout), and raises GridIncomplete naming the runs still missing."""
    p = study.PRESETS["research"]
    toy = {**study.PRESETS["cpu"]["overrides"], "train.warmup_steps": 1, "train.balancer_start_step": 2,
           "train.val_every": 4, "train.val_batches": 1, "train.log_every": 1, "train.compile": "none",
           "tracking.enabled": False}
    monkeypatch.setitem(study.PRESETS, "research", {**p, "base": "cpu", "seeds": (0, 1), "shift_steps": 2,
                                                    "shift_seeds": (0,), "overrides": toy})
    monkeypatch.setattr(study, "WARM_STEPS", 2)
    monkeypatch.setattr(study, "LAYOUTS", {"8x2048": (2, 32, 2, tuple(study.RESEARCH_BALANCERS)),
                                           "64x256": (4, 16, 2, ("aux_1e-2", "qb"))})
    records = tmp_path / "records"
    monkeypatch.setenv(common.RECORDS_ENV, str(records))
    monkeypatch.setenv(common.RUNS_ENV, "qb-8x2048:0,aux_1e-2-64x256:1")
    monkeypatch.delenv(common.SHARD_ENV, raising=False)
    common.forget_split_runs()
    with pytest.raises(common.GridIncomplete) as e:
        study.train("research", tmp_path / "split")
    assert e.value.trained == ["qb-8x2048:0", "aux_1e-2-64x256:1"]  # both layouts' runs, in the order trained
    assert e.value.missing[-3:] == ["aux_1e-2-64x256:0", "qb-64x256:0", "qb-64x256:1"] and len(e.value.missing) == 12
    assert str(e.value).startswith("trained qb-8x2048:0, aux_1e-2-64x256:1; records in ")
    assert "12 run(s) of these grids still to train: " in str(e.value)
    assert sorted(p.name for p in records.glob("*.json")) == ["aux_1e-2-64x256_s1.json", "qb-8x2048_s0.json"]
    qb = json.loads((records / "qb-8x2048_s0.json").read_text())
    assert qb["code"]["source_pin"] == "s2research-1" and qb["config"]["train.balancer_start_step"] == 2
    assert qb["summary"]["steps"] == 4 and qb["config"]["train.batch_size"] == 2
    ev = torch.load(records / "qb-8x2048_s0.evals.pt", weights_only=True)
    assert ev["floor"]["frozen_next"] > 0 and ev["step"].tolist() == [2, 3, 4] and ev["bias"].dtype == torch.float16
    assert ev["shift"]["step"] == [1, 2] and ev["shift"]["source"] == "gutenberg"
    aux = torch.load(records / "aux_1e-2-64x256_s1.evals.pt", weights_only=True)
    assert "shift" not in aux and aux["bias"].abs().max() == 0  # the aux loss leaves the bias at zero
