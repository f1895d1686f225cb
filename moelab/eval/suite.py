"""``evaluate(ckpt, task)``: one long-context task on any moelab checkpoint, recorded as JSON and in MLflow.

What it does: loads the checkpoint (verified) with its limit on input length raised to the
longest length asked (the model has no positions, so nothing else changes), prepares the run's
corpus for the tokenizer and the held-out text, runs :mod:`moelab.eval.tasks`, and writes

* ``<out>`` (default ``<checkpoint folder>/eval/<task>.json``): the task's results, the
  checkpoint, its step and config name, the settings and the wall-clock;
* an MLflow run ``<config name>-<task>`` in experiment ``eval/<preset>``, tagged with the
  checkpoint and the training run that wrote it: the settings as params, one metric per length
  at ``step = length`` (``passkey/acc``, ``passkey/acc_depth_<d>``, ``mqar/acc``, ``memory/...``)
  or per position bin (``loss_by_position/len_<L>`` at ``step = bin_end``), and the JSON.

Default lengths are 1x, 2x and 4x the training window (the longest curriculum stage, else
``data.seq_len``); lengths beyond it run in ``chunk_size`` pieces (default: the window).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.base import ConfigError, _check
from moelab.config import RunConfig, from_dict
from moelab.data import prepare
from moelab.data.synthetic import mqar, passkey
from moelab.data.tokenizer import Tokenizer
from moelab.eval.tasks import loss_by_position, mqar_grid, passkey_grid
from moelab.tracking import experiment_name, start_run
from moelab.train.runner import load_checkpoint, model_from_checkpoint
from moelab.utils import write_json

TASKS = ("passkey", "mqar", "loss_by_position")
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def training_window(cfg: RunConfig) -> int:
    """The longest sequence the run trained on: its longest curriculum stage, else ``data.seq_len``."""
    return max([cfg.data.seq_len, *(s.seq_len for s in cfg.data.curriculum)])


def evaluate(
    ckpt: str | Path,
    task: str,
    *,
    lengths: list[int] | None = None,
    depths: list[float] | None = None,
    samples: int = 16,
    mqar_pairs: int = 16,
    chunk_size: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
    device: str = "auto",
    out: str | Path | None = None,
    tracking: bool = True,
    tracking_uri: str = "",
) -> dict[str, Any]:
    """Run ``task`` (``passkey`` | ``mqar`` | ``loss_by_position``) on the checkpoint ``ckpt``; return the results.

    Args:
        lengths: context lengths in tokens (default: 1x, 2x, 4x the training window).
        depths: passkey needle depths in [0, 1] (default 0, 0.25, 0.5, 0.75, 1).
        samples: samples per (length, depth) cell, MQAR length or loss-by-position length.
        mqar_pairs: key-value pairs per MQAR sample.
        chunk_size: tokens per forward piece (default: the training window; 0: one full forward).
        batch_size: sequences per forward.
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``; on CUDA the forward runs
            under bf16 autocast, as training does by default.
        out: JSON path (default ``<checkpoint folder>/eval/<task>.json``).
        tracking: record an MLflow run (``tracking_uri`` as for training: "" = the default store).

    Raises ConfigError for a bad setting (naming it and its range), CheckpointError for a damaged
    checkpoint, TrackingError when the MLflow store cannot be opened.
    """
    _check(task in TASKS, "task", task, "one of " + ", ".join(map(repr, TASKS)))
    ckpt = Path(ckpt)
    state = load_checkpoint(ckpt)
    step = int(state.get("global_step", 0))
    source_run = state["moelab"].get("mlflow_run_id")
    trained = from_dict(state["moelab"]["config"])
    lengths, depths, _ = _settings(trained, lengths, depths, samples, chunk_size, batch_size)
    dev = _device(device)

    model, cfg = model_from_checkpoint(state, dev, max_seq_len=max(max(lengths), trained.model.max_seq_len))
    del state
    results = evaluate_model(model, cfg, task, device=dev, lengths=lengths, depths=depths, samples=samples,
                             mqar_pairs=mqar_pairs, chunk_size=chunk_size, batch_size=batch_size, seed=seed)
    report = {"checkpoint": str(ckpt.resolve()), "step": step, **results}

    path = Path(out) if out else ckpt.parent / "eval" / f"{task}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, report)
    report["json"] = str(path)
    if tracking:
        report["run_id"] = _record(cfg, report, source_run, tracking_uri)
    return report


def evaluate_model(
    model: torch.nn.Module,
    cfg: RunConfig,
    task: str,
    *,
    device: str | torch.device = "auto",
    lengths: list[int] | None = None,
    depths: list[float] | None = None,
    samples: int = 16,
    mqar_pairs: int = 16,
    chunk_size: int | None = None,
    batch_size: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Run ``task`` on a model in memory (in eval mode, on ``device``, accepting the longest length).

    ``cfg``: the run's config (its corpus, tokenizer, vocabulary and training window); the settings
    as for :func:`evaluate`, which loads a checkpoint and calls this. Returns the report without the
    checkpoint's path and step: ``config``, ``preset``, ``settings``, ``wall_s`` and the task's results.
    """
    _check(task in TASKS, "task", task, "one of " + ", ".join(map(repr, TASKS)))
    window = training_window(cfg)
    lengths, depths, chunk = _settings(cfg, lengths, depths, samples, chunk_size, batch_size)
    dev = device if isinstance(device, torch.device) else _device(device)

    settings = {"task": task, "lengths": lengths, "samples": samples, "chunk_size": chunk, "batch_size": batch_size,
                "seed": seed, "device": str(dev), "training_window": window}
    if task == "passkey":
        settings["depths"] = depths
    if task == "mqar":
        settings["mqar_pairs"] = mqar_pairs

    corpus = prepare(cfg.data, progress=False) if task != "mqar" else None
    val = corpus.load_tokens("val") if corpus is not None else None
    tokenizer = corpus.tokenizer() if corpus is not None else None
    _check_lengths(task, min(lengths), max(lengths), tokenizer, cfg.model.vocab_size, mqar_pairs, val)

    started = time.perf_counter()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    with torch.no_grad(), autocast:
        if task == "mqar":
            results = mqar_grid(model, cfg.model.vocab_size, lengths, mqar_pairs, samples, chunk, batch_size, seed)
        elif task == "passkey":
            results = passkey_grid(model, tokenizer, lengths, depths, samples, chunk, batch_size, seed, filler=val)
        else:
            results = loss_by_position(model, val, lengths, samples, chunk, batch_size)
    return {"config": cfg.name, "preset": cfg.preset, "settings": settings, "wall_s": time.perf_counter() - started,
            **results}


def _settings(cfg: RunConfig, lengths: list[int] | None, depths: list[float] | None, samples: int,
              chunk_size: int | None, batch_size: int) -> tuple[list[int], list[float], int | None]:
    """``(lengths, depths, chunk)`` with their defaults for the run ``cfg``; ConfigError for a bad setting."""
    window = training_window(cfg)
    lengths = list(lengths) if lengths else [window, 2 * window, 4 * window]
    depths = list(depths) if depths is not None else list(DEFAULT_DEPTHS)
    chunk = window if chunk_size is None else (chunk_size or None)
    _check(all(isinstance(n, int) and n >= 2 for n in lengths), "lengths", lengths, "integers >= 2")
    _check(len(depths) > 0 and all(0.0 <= d <= 1.0 for d in depths), "depths", depths, "numbers in [0, 1]")
    _check(samples >= 1, "samples", samples, "an integer >= 1")
    _check(batch_size >= 1, "batch_size", batch_size, "an integer >= 1")
    _check(chunk is None or chunk >= 1, "chunk_size", chunk_size, "an integer >= 1, or 0 for one full forward")
    return lengths, depths, chunk


def _check_lengths(task: str, shortest: int, longest: int, tokenizer: Tokenizer | None, vocab_size: int,
                   pairs: int, val: np.ndarray | None) -> None:
    """Refuse, before any forward, lengths the task cannot fill (ConfigError naming the length and the minimum)."""
    try:
        if task == "passkey":
            passkey(tokenizer, 1, shortest)
        elif task == "mqar":
            mqar(1, shortest, vocab_size, pairs)
    except ValueError as e:
        raise ConfigError(f"--lengths {shortest} cannot hold a {task} sample: {e}") from e
    if task == "loss_by_position":
        _check(longest + 1 <= val.size, "lengths", longest,
               f"<= {val.size - 1}: the held-out stream holds {val.size} tokens")


def _device(spec: str) -> torch.device:
    _check(spec in ("auto", "cpu", "cuda"), "device", spec, "'auto', 'cpu' or 'cuda'")
    if spec == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' is not allowed here: no CUDA device is visible; use --device cpu")
    return torch.device("cuda" if spec == "cuda" or (spec == "auto" and torch.cuda.is_available()) else "cpu")


def _metrics(report: dict[str, Any]) -> list[tuple[dict[str, float], int]]:
    """``(metrics, step)`` pairs for MLflow: per length at ``step = length``, per position bin at ``step = bin_end``."""
    task, rows = report["task"], []
    for i, length in enumerate(report["lengths"]):
        m: dict[str, float] = {"memory/state_bytes_per_sequence": report["state_bytes_per_sequence"][i]}
        if "peak_memory_bytes" in report:
            m["memory/peak_bytes"] = report["peak_memory_bytes"][i]
        if task == "passkey":
            m["passkey/acc"] = report["accuracy_by_length"][i]
            m.update({f"passkey/acc_depth_{d:g}": a for d, a in zip(report["depths"], report["accuracy"][i])})
        elif task == "mqar":
            m["mqar/acc"], m["mqar/all_correct"] = report["accuracy"][i], report["all_correct"][i]
        else:
            curve = report["curves"][i]
            m[f"loss_by_position/mean_len_{length}"] = curve["mean_loss"]
            rows += [({f"loss_by_position/len_{length}": loss}, end) for loss, end in zip(curve["loss"],
                                                                                          curve["bin_end"])]
        rows.append((m, length))
    summary = {"wall_s": report["wall_s"]}
    if report.get("state_bytes_per_token") is not None:
        summary["memory/state_bytes_per_token"] = report["state_bytes_per_token"]
    if task == "passkey":
        summary["passkey/effective_context"] = report["effective_context"]
    rows.append((summary, 0))
    return rows


def _record(cfg: RunConfig, report: dict[str, Any], source_run: str | None, tracking_uri: str) -> str:
    params = {f"eval.{k}": v for k, v in report["settings"].items()}
    params.update({"eval.checkpoint": report["checkpoint"], "eval.step": report["step"]})
    tags = {"moelab.preset": cfg.preset or cfg.name, "moelab.checkpoint": report["checkpoint"]}
    if source_run:
        tags["moelab.source_run"] = source_run
    task = report["task"]
    with start_run(experiment_name("eval", cfg.preset or cfg.name), f"{cfg.name}-{task}", tracking_uri=tracking_uri,
                   params=params, tags=tags, log_system_metrics=False) as run:
        for metrics, step in _metrics(report):
            run.log_metrics(metrics, step)
        run.log_dict({k: v for k, v in report.items() if k != "json"}, f"{task}.json")
        return run.run_id


__all__ = ["DEFAULT_DEPTHS", "TASKS", "evaluate", "evaluate_model", "training_window"]
