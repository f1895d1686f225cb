"""Callbacks that watch a run: per-step scalars and the NaN guard, throughput/MFU, stopping, the last checkpoint,
and the progress bar.

Under DDP every decision that ends the loop (non-finite value, Ctrl-C, SIGTERM) is reduced over
ranks first, so all ranks stop at the same step instead of one waiting forever in a collective.

Step convention (MLflow, ``history.csv``, the NaN guard): step ``s`` is the state after ``s``
optimizer steps, i.e. Lightning's ``global_step`` after the step. ``train/*``, ``balance/*`` and ``perf/*`` are
logged together every ``log_every`` steps, ``val/*`` at each validation.
"""

from __future__ import annotations

import math
import signal
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar

from moelab.train.perf import device_peak_flops, mfu
from moelab.utils import atomic_write

MetricSink = Callable[[Mapping[str, float], int], None]  # (metrics, step): Run.log_metrics


class NonFiniteLossError(FloatingPointError):
    """A training scalar or the weights became NaN/Inf; the message names the step, the value and the last
    good checkpoint (weights finite, checksum written)."""

    def __init__(self, step: int, metric: str, value: float, last_good: Path | None, detail: str = "") -> None:
        where = (f"last good checkpoint: {last_good}{detail} (resume with --resume {last_good}, e.g. with a lower "
                 f"train.lr)") if last_good else "no checkpoint was saved before it"
        super().__init__(f"{metric}={value} at step {step}: training stopped; {where}")
        self.step, self.metric, self.value, self.last_good = step, metric, value, last_good


class Interrupted(KeyboardInterrupt):
    """Training stopped on Ctrl-C (``signum`` SIGINT) or SIGTERM after saving ``last.ckpt``; resume from it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def first_non_finite(module: torch.nn.Module) -> str | None:
    """Name of the first parameter holding a NaN/Inf, else None (one host sync when all are finite)."""
    params = list(module.named_parameters())
    if not params or torch.stack([torch.isfinite(p).all() for _, p in params]).all():
        return None
    return next(name for name, p in params if not torch.isfinite(p).all())


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


class LastCheckpoint(Callback):
    """Saves ``path`` (normally ``<ckpt_dir>/last.ckpt``) after every validation during fit, if the weights are finite.

    ``ModelCheckpoint(save_last=True)`` only refreshes ``last.ckpt`` when the monitored metric
    improves; resuming needs the latest state whatever the validation loss did. Weights with a
    NaN/Inf stop the run instead of replacing the last good checkpoint. ``good`` is the newest
    checkpoint known good: ``(path, step, val/loss)``, starting from the resumed one.

    ``final_only``: save only at the validation that ends training (``max_steps``, Ctrl-C,
    SIGTERM), for short runs that are restarted rather than resumed (a study's grid): a 100M-parameter
    model's state with AdamW's moments is ~1.2 GB per save. The weights are still checked at every
    validation.
    """

    def __init__(self, path: Path, resumed: tuple[Path, int] | None = None, final_only: bool = False) -> None:
        self.path = path
        self.final_only = final_only
        self.good: tuple[Path, int, float | None] | None = (*resumed, None) if resumed else None

    def describe(self) -> tuple[Path | None, str]:
        """``(path, " (step s, val/loss v)")`` of the last good checkpoint, for error messages."""
        if self.good is None:
            return None, ""
        path, step, val = self.good
        return path, f" (step {step}" + (f", val/loss {val:.4f})" if val is not None else ")")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        bad = first_non_finite(pl_module)
        if trainer.strategy.reduce_boolean_decision(bad is not None, all=False):
            last, detail = self.describe()
            raise NonFiniteLossError(trainer.global_step, f"weight {bad or '(on another rank)'}", float("nan"),
                                     last, detail)
        if self.final_only and not trainer.should_stop:  # StopControl sets it before the last validation
            return
        trainer.save_checkpoint(self.path, weights_only=False)
        val = trainer.callback_metrics.get("val/loss")
        self.good = (self.path, trainer.global_step, float(val) if val is not None else None)


class StepMonitor(_PerStep):
    """Records the scalars of every optimizer step (``history``), logs them, and stops on the first non-finite one.

    Reads ``LitMoELab.step_scalars`` (loss of the step's last micro-batch, its CE and aux parts,
    the pre-clipping gradient norm) and the learning rate: one host sync per step, which the
    progress bar pays anyway. Every ``log_every`` steps the row goes to ``sink`` (MLflow); after
    each validation every ``val/*`` scalar logged in it (``val/loss``, the balancer's ``val/maxvio_global``)
    and ``val/best_loss`` do, the row gets those scalars and
    ``history_path`` (``history.csv``: ``prior`` rows from before a resume, then this run's) is
    rewritten, so it always reaches as far as ``last.ckpt``.
    """

    def __init__(self, checkpoints: LastCheckpoint, log_every: int, sink: MetricSink | None = None,
                 history_path: Path | None = None, prior: list[dict[str, float]] | None = None) -> None:
        self.checkpoints, self.log_every, self.sink, self.history_path = checkpoints, log_every, sink, history_path
        self.prior = prior or []
        self.history: list[dict[str, float]] = []
        self.val_history: list[tuple[int, float]] = []
        vals = [r["val/loss"] for r in self.prior if math.isfinite(r.get("val/loss", math.nan))]
        self._best = min(vals) if vals else math.inf

    @property
    def rows(self) -> list[dict[str, float]]:
        """The whole run's rows: before the resume, then this process's."""
        return self.prior + self.history

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
            raise NonFiniteLossError(trainer.global_step, metric, value, *self.checkpoints.describe())
        self.history.append(row)
        if self.sink is not None and trainer.global_step % self.log_every == 0:
            self.sink({k: v for k, v in row.items() if k != "step"}, trainer.global_step)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or "val/loss" not in trainer.callback_metrics:
            return
        # Every val/* scalar of this validation (the loss, the balancer's MaxVio_global per layer, ...).
        vals = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        step, val = trainer.global_step, vals["val/loss"]
        self.val_history.append((step, val))
        if self.history and int(self.history[-1]["step"]) == step:
            self.history[-1].update(vals)
        if math.isfinite(val):
            self._best = min(self._best, val)
        if self.sink is not None:
            self.sink({**vals, "val/best_loss": self._best}, step)
        if self.history_path is not None and trainer.is_global_zero:
            write_history(self.history_path, self.rows)


def write_history(path: Path, rows: list[dict[str, float]]) -> None:
    """``history.csv``: one row per optimizer step, ``val/loss`` filled in at validation steps."""
    import pandas as pd

    with atomic_write(path) as f:
        pd.DataFrame(rows).to_csv(f, index=False)


def read_history(path: Path, up_to_step: int) -> list[dict[str, float]]:
    """The rows of ``history.csv`` with ``step <= up_to_step`` (what a checkpoint at that step had seen)."""
    import pandas as pd

    if not path.is_file():
        return []
    frame = pd.read_csv(path)
    rows = frame[frame["step"] <= up_to_step].to_dict("records")
    # Empty cells (no validation at that step) come back as NaN: leave them out, as they were written.
    return [{k: float(v) for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))} for r in rows]


class Throughput(_PerStep):
    """Logs ``perf/tokens_per_s`` (all devices), ``perf/step_time_s``, ``perf/mfu`` and ``perf/peak_mem_gb`` (GPU)
    to ``sink`` every ``log_every`` steps, at the same steps as ``train/*``.

    A window runs from the first batch after a log (or after validation) to the next log, so
    validation time is excluded and data loading included. ``summary()`` reports the median
    window after the first (the first holds compilation and allocator warm-up).
    """

    def __init__(self, tokens_per_device_step: int, flops_per_token_fwd: float, log_every: int,
                 sink: MetricSink | None = None) -> None:
        self.tokens_per_device_step = tokens_per_device_step
        self.flops_per_token_fwd = flops_per_token_fwd
        self.log_every = log_every
        self.sink = sink
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
        if self.sink is not None:
            self.sink(metrics, step)
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
    """Ends training at ``max_steps`` or at the first Ctrl-C / SIGTERM, always through a validation and a checkpoint.

    Setting ``trainer.should_stop`` makes Lightning validate after the current step, and
    :class:`LastCheckpoint` saves after every validation, so the final step and an interrupted
    step both leave ``last.ckpt``. ``request_stop(signum)`` is what the signal handler calls;
    ``handler`` (set by the runner) is re-installed for SIGTERM when training starts, over
    Lightning's own, which would exit at the next batch without a checkpoint or a summary.
    """

    def __init__(self) -> None:
        self.requested: int | None = None  # the signal that asked for the stop
        self.interrupted_at: int | None = None
        self.handler: Callable[[int, Any], None] | None = None

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        self.requested = signum

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.handler)

    def on_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False):
            self.interrupted_at = trainer.global_step
            trainer.should_stop = True
        elif trainer.global_step >= trainer.max_steps:
            trainer.should_stop = True


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar counting optimizer steps of the whole run (``train 30/60``, also after a resume),
    labelled ``train`` instead of ``Epoch 0/-2`` (a run here is one long epoch), without ``v_num``
    (a logger version moelab does not use)."""

    @property
    def total_train_batches(self) -> int:
        return self.trainer.max_steps

    def _get_train_description(self, current_epoch: int) -> str:
        return "train"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._update(self.train_progress_bar_id, trainer.global_step)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items
