"""Shared bits of the training tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from moelab.config import RunConfig, load_config


def tiny_config(ckpt_dir: Path, tracking_uri: str | None = None, **overrides: Any) -> RunConfig:
    """The tiny preset writing into ``ckpt_dir``; MLflow off unless ``tracking_uri`` is given."""
    values: dict[str, Any] = {"train.ckpt_dir": str(ckpt_dir), "tracking.enabled": tracking_uri is not None,
                              "tracking.system_metrics_interval_s": 0.2}
    if tracking_uri:
        values["tracking.tracking_uri"] = tracking_uri
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config("tiny", values)


class AtStep(Callback):
    """Calls ``action(trainer, pl_module)`` once, at the start of the batch after ``step`` optimizer steps."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action, self.done = step, action, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.done and trainer.global_step == self.step:
            self.done = True
            self.action(trainer, pl_module)


class InfScalar(Callback):
    """At the end of the step that makes ``step``: ``train/aux_loss`` becomes +Inf before StepMonitor reads it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pl_module.step_scalars["train/aux_loss"] = torch.tensor(float("inf"))


class EagerStep:
    """``moelab.train.module.CapturedStep``'s interface with the capture left out (the CPU has no CUDA graphs): the
    same step, the same copies of its outputs; ``check_syncs`` and ``recapture`` kept to be read back, and the shape
    of every batch the step was given (``shapes``: ``{key: shape}`` per call)."""

    def __init__(self, step: Any, warmup: int = 3, check_syncs: bool = True, recapture: bool = False) -> None:
        self.step, self.check_syncs, self.recapture = step, check_syncs, recapture
        self.shapes: list[dict[str, tuple[int, ...]]] = []

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.shapes.append({k: tuple(v.shape) for k, v in batch.items()})
        return {k: v.detach().clone() for k, v in self.step(batch).items()}
