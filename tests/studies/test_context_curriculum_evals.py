"""Study 4's evaluation travels in the run records: the reports made on the trained model at the end of
training equal the suite's on the run's checkpoint, and a split study needs no checkpoint of another call."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from moelab.eval.suite import evaluate
from moelab.studies import common, context_curriculum

CODE = json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None, "source_sha256": "5" * 16})


def _trimmed(seeds: tuple[int, ...] = (0,)) -> context_curriculum.Plan:
    """The cpu plan at 512 tokens and 6 steps, one sample per cell, evaluated up to 2x the longest length."""
    cpu = context_curriculum.PRESETS["cpu"]
    return dataclasses.replace(
        cpu, common={**cpu.common, "model.max_seq_len": 512, "data.seq_len": 512, "train.max_steps": 6,
                     "train.warmup_steps": 1, "train.val_every": 3, "train.val_batches": 1, "train.log_every": 1,
                     "tracking.enabled": False},
        lengths=(256, 512), shares=(0.5, 0.5), steps=6, seeds=seeds,
        eval=dataclasses.replace(cpu.eval, samples=1, mqar_samples=1, lbp_samples=1, extrapolation=2))


def _numbers(report: dict[str, Any]) -> dict[str, Any]:
    """A report without what differs between two evaluations of one model: paths and wall-clock."""
    return {k: v for k, v in report.items() if k not in ("checkpoint", "json", "wall_s")}


def test_evaluation_at_the_end_of_training_equals_the_checkpoints(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(common.GIT_ENV, CODE)
    monkeypatch.setitem(context_curriculum.PRESETS, "cpu", _trimmed())
    arms = context_curriculum.arms
    monkeypatch.setattr(context_curriculum, "arms", lambda preset: {"curriculum": arms(preset)["curriculum"]})
    settings = context_curriculum.eval_settings("cpu")
    assert max(settings["passkey"]["lengths"]) == 1024  # past the trained model's max_seq_len of 512

    rec = context_curriculum.train("cpu", tmp_path).records[0]
    record = json.loads(common.record_path(tmp_path / "records", "curriculum", 0).read_text())
    assert record["config"]["model.max_seq_len"] == 512  # the run's config as trained
    assert set(rec.evals) == set(settings)
    ckpt = Path(rec.summary["last_checkpoint"])
    for task, kwargs in settings.items():
        found = evaluate(ckpt, task, out=tmp_path / f"{task}.json", tracking=False, device="cpu", **kwargs)
        assert _numbers(rec.evals[task]) == _numbers(found), task
        assert rec.evals[task]["settings"]["lengths"] == kwargs["lengths"]

    # Read back from the record (no training), the reports are evaluate_runs' without any checkpoint.
    again = context_curriculum.train("cpu", tmp_path)
    assert again.records[0].skipped
    shutil.rmtree(tmp_path / "checkpoints")
    lines: list[str] = []
    evals = context_curriculum.evaluate_runs(again, "cpu", echo=lines.append)
    assert list(evals) == ["curriculum-s0"] and lines[0].startswith("eval curriculum seed 0: passkey by length")
    assert {t: _numbers(r) for t, r in evals["curriculum-s0"].items()} == {
        t: _numbers(r) for t, r in rec.evals.items()}


def test_the_evaluation_leaves_the_models_limit_as_trained(monkeypatch) -> None:
    import torch

    from moelab.config import load_config
    from moelab.model import MoELab

    monkeypatch.setitem(context_curriculum.PRESETS, "cpu", _trimmed())
    cfg = load_config("tiny", dict(context_curriculum.PRESETS["cpu"].common))
    model = MoELab(cfg.model).eval()
    limit = model.cfg
    seen: list[tuple[int, bool]] = []

    def fake(copy, cfg, task, *, device, **kwargs):  # the model the evaluation gets
        same = all(torch.equal(a, b) for a, b in zip(copy.state_dict().values(), model.state_dict().values()))
        seen.append((copy.cfg.max_seq_len, copy is not model and same and not copy.training))
        return {"task": task}

    monkeypatch.setattr("moelab.eval.suite.evaluate_model", fake)
    with torch.no_grad():
        out = context_curriculum.evaluate_trained(model, cfg, "cpu")
    assert seen == [(1024, True)] * 3 and list(out) == ["passkey", "mqar", "loss_by_position"]
    assert out["mqar"] == {"step": 6, "task": "mqar"}
    assert model.cfg is limit and model.cfg.max_seq_len == cfg.model.max_seq_len == 512


@pytest.mark.slow
def test_a_split_study_equals_one_go_without_the_other_calls_checkpoints(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(common.GIT_ENV, CODE)
    monkeypatch.setitem(context_curriculum.PRESETS, "cpu", _trimmed())
    arms = context_curriculum.arms
    monkeypatch.setattr(context_curriculum, "arms",
                        lambda preset: {k: v for k, v in arms(preset).items() if k in ("curriculum", "direct")})
    one_go = context_curriculum.evaluate_runs(context_curriculum.train("cpu", tmp_path / "one"), "cpu",
                                              echo=lambda line: None)

    split = tmp_path / "split"
    monkeypatch.setenv(common.RUNS_ENV, "direct:0")  # "another machine": its checkpoints stay there
    with pytest.raises(common.GridIncomplete):
        context_curriculum.train("cpu", split)
    shutil.rmtree(split / "checkpoints")
    monkeypatch.delenv(common.RUNS_ENV)
    grid = context_curriculum.train("cpu", split)  # the final call trains the rest
    assert [r.skipped for r in grid.records] == [False, True]
    assert not (split / "checkpoints" / "direct-s0").exists()
    final = context_curriculum.evaluate_runs(grid, "cpu", echo=lambda line: None)
    assert list(final) == list(one_go) == ["curriculum-s0", "direct-s0"]
    for key in one_go:
        assert {t: _numbers(r) for t, r in final[key].items()} == {t: _numbers(r) for t, r in one_go[key].items()}
