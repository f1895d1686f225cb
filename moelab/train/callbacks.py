"""Callbacks that watch a run: per-step scalars and the NaN guard, throughput/MFU, stopping, last checkpoint.

Under DDP every decision that ends the loop (non-finite value, Ctrl-C) is reduced over ranks
first, so all ranks stop at the same step instead of one waiting forever in a collective.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from moelab.train.perf import device_peak_flops, mfu


class NonFiniteLossError(FloatingPointError):
    """A training scalar became NaN/Inf; the message names the step, the metric and the last good checkpoint."""

    def __init__(self, step: int, metric: str, value: float, last_good: Path | None) -> None:
        where = (f"last good checkpoint: {last_good} (resume with --resume {last_good}, e.g. with a lower "
                 f"train.lr)") if last_good else "no checkpoint was saved before it"
        super().__init__(f"{metric}={value} at step {step}: training stopped; {where}")
        self.step, self.metric, self.value, self.last_good = step, metric, value, last_good


class _PerStep(Callback):
    """Calls ``on_step_end`` once per optimizer step, on the micro-batch that completed it.

    With gradient accumulation ``on_train_batch_end`` fires for every micro-batch;
    ``global_step`` only moves when the optimizer stepped.
    """

    _seen = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._seen = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self._seen:
            self._seen = trainer.global_step
            self.on_step_end(trainer, pl_module)

    def on_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        raise NotImplementedError


class StepMonitor(_PerStep):
    """Records the scalars of every optimizer step (``history``) and stops on the first non-finite one.

    Reads ``LitMoELab.step_scalars`` (loss of the step's last micro-batch, its CE and aux parts,
    the pre-clipping gradient norm) and the learning rate: one host sync per step, which the
    progress bar pays anyway. ``val_history`` holds ``(step, val/loss)`` after each validation.
    """

    def __init__(self, last_checkpoint: Path) -> None:
        self.last_checkpoint = last_checkpoint
        self.history: list[dict[str, float]] = []
        self.val_history: list[tuple[int, float]] = []

    def on_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        names = list(pl_module.step_scalars)
        values = torch.stack([pl_module.step_scalars[k].float() for k in names]).tolist()
        row = {"step": float(trainer.global_step), **dict(zip(names, values)),
               "train/lr": float(trainer.optimizers[0].param_groups[0]["lr"])}
        bad = [(k, v) for k, v in zip(names, values) if not math.isfinite(v)]
        if trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
            metric, value = bad[0] if bad else ("train/loss", float("nan"))
            if not bad:
                metric += " (on another rank)"
            last = self.last_checkpoint if self.last_checkpoint.exists() else None
            raise NonFiniteLossError(trainer.global_step, metric, value, last)
        self.history.append(row)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        self.val_history.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


class Throughput(_PerStep):
    """Logs ``perf/tokens_per_s`` (all devices), ``perf/mfu`` and ``perf/peak_mem_gb`` (GPU) every ``log_every`` steps.

    A window runs from the first batch after a log (or after validation) to the next log, so
    validation time is excluded and data loading included. ``summary()`` reports the median
    window after the first (the first holds compilation and allocator warm-up).
    """

    def __init__(self, tokens_per_device_step: int, flops_per_token_fwd: float, log_every: int) -> None:
        self.tokens_per_device_step = tokens_per_device_step
        self.flops_per_token_fwd = flops_per_token_fwd
        self.log_every = log_every
        self.windows: list[tuple[float, float]] = []  # (tokens/s over all devices, mfu)
        self._t0: float | None = None
        self._step0 = 0
        self._peak: float | None = None
        self._world = 1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._peak = device_peak_flops(pl_module.device)
        self._world = trainer.world_size

    def _sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._t0 is None:
            self._sync(pl_module.device)
            self._t0, self._step0 = time.perf_counter(), trainer.global_step

    def on_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        if self._t0 is None or step % self.log_every != 0 or step == self._step0:
            return
        self._sync(pl_module.device)
        dt = time.perf_counter() - self._t0
        per_device = self.tokens_per_device_step * (step - self._step0) / dt
        util = mfu(self.flops_per_token_fwd, per_device, self._peak)
        self.windows.append((per_device * self._world, util))
        metrics = {"perf/tokens_per_s": per_device * self._world, "perf/step_time_s": dt / (step - self._step0)}
        if self._peak:
            metrics["perf/mfu"] = util
        if pl_module.device.type == "cuda":
            metrics["perf/peak_mem_gb"] = torch.cuda.max_memory_allocated(pl_module.device) / 1e9
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        pl_module.log("tok/s", per_device * self._world, prog_bar=True, logger=False)
        self._t0 = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = None  # restart the window after validation

    def summary(self, device: torch.device) -> dict[str, float | None]:
        """``tok_per_s`` (all devices), ``mfu`` (None on CPU), ``peak_mem_gb`` (None on CPU)."""
        steady = self.windows[1:] or self.windows
        tps = statistics.median(w[0] for w in steady) if steady else None
        util = statistics.median(w[1] for w in steady) if steady and self._peak else None
        mem = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        return {"tok_per_s": tps, "mfu": util, "peak_mem_gb": mem}


class StopControl(_PerStep):
    """Ends training at ``max_steps`` or at the first Ctrl-C, always through a validation and a checkpoint.

    Setting ``trainer.should_stop`` makes Lightning validate after the current step, and
    :class:`LastCheckpoint` saves after every validation, so the final step and an interrupted
    step both leave ``last.ckpt``. ``request_stop()`` is what the SIGINT handler calls.
    """

    def __init__(self) -> None:
        self.requested = False
        self.interrupted_at: int | None = None

    def request_stop(self) -> None:
        self.requested = True

    def on_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.reduce_boolean_decision(self.requested, all=False):
            self.interrupted_at = trainer.global_step
            trainer.should_stop = True
        elif trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class LastCheckpoint(Callback):
    """Saves ``path`` (normally ``<ckpt_dir>/last.ckpt``) after every validation during fit.

    ``ModelCheckpoint(save_last=True)`` only refreshes ``last.ckpt`` when the monitored metric
    improves; resuming needs the latest state whatever the validation loss did.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        trainer.save_checkpoint(self.path, weights_only=False)
