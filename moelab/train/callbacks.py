"""Callbacks that watch a run: per-step scalars and the NaN guard, throughput/MFU, stopping, the last checkpoint,
and the progress bar.

A step's scalars are read on the host one step late (:class:`LateReads`), so the host never waits for
the GPU work it has just queued: small models train host-bound, and a read right after a step would
leave the GPU idle while the host queues the next one.

Under DDP every decision that ends the loop (non-finite value, Ctrl-C, SIGTERM) is reduced over
ranks first, so all ranks stop at the same step instead of one waiting forever in a collective.

Step convention (MLflow, ``history.csv``, the NaN guard): step ``s`` is the state after ``s``
optimizer steps, i.e. Lightning's ``global_step`` after the step. ``train/*``, ``balance/*`` and ``perf/*`` are
logged together every ``log_every`` steps, ``val/*`` at each validation.
"""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar

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


class Event(Protocol):
    """What :class:`LateReads` and the balancer's timing use of ``torch.cuda.Event``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


class HostEvent:
    """``torch.cuda.Event`` for CPU work, which is done once it is queued: complete at once, timed by the host clock."""

    def __init__(self) -> None:
        self.time = 0.0

    def record(self) -> None:
        self.time = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end``."""
        return (end.time - self.time) * 1e3


def device_event(device: torch.device, timing: bool = False) -> Event:
    """An event for work queued on ``device`` (its current stream): a CUDA event there, else a :class:`HostEvent`.

    ``timing``: the event can measure ``elapsed_time`` (CUDA events without it are cheaper).
    """
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=timing)
    return HostEvent()


T = TypeVar("T")


class LateReads(Generic[T]):
    """Reads device values on the host one step late, so the host never waits for the step it has just queued.

    Why: a small model on a fast GPU trains host-bound (the host needs about a step's time to queue
    a step's kernels). Reading a step's scalars right after queueing it (``.tolist()``) makes the host
    wait until the GPU has run the whole step, and the GPU then idles while the host queues the next
    one. :meth:`push` instead starts a non-blocking copy into pinned host memory and records an event
    after it; :meth:`pop` hands back, oldest first, every entry but the newest (waiting for its event,
    normally long complete). The newest comes back too when its values were on the CPU and its event
    has completed, which a :class:`HostEvent` has at once: on the CPU every entry comes back at the
    first ``pop`` after its ``push``. A CUDA entry always waits for the next ``pop``, done or not, so
    all data-parallel ranks record (and vote on) the same steps at the same point.
    ``pop(everything=True)`` waits for all (train end, before validation or a checkpoint).
    """

    def __init__(self) -> None:
        self.pending: deque[tuple[T, torch.Tensor, Event, bool]] = deque()  # (item, host values, event, on CUDA)

    def push(self, item: T, values: torch.Tensor) -> None:
        """Queue ``item`` with its device values ``[n]``; ``pop`` returns them as a list of n floats."""
        host, cuda = values, values.device.type == "cuda"
        if cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
        event = device_event(values.device)
        event.record()
        self.pending.append((item, host, event, cuda))

    def pop(self, everything: bool = False) -> list[tuple[T, list[float]]]:
        """The entries that are ready (all with ``everything``), oldest first, each removed from the queue."""
        out = []
        while self.pending:
            item, host, event, cuda = self.pending[0]
            if not everything and len(self.pending) == 1 and (cuda or not event.query()):
                break
            event.synchronize()
            self.pending.popleft()
            out.append((item, host.tolist()))
        return out

    def clear(self) -> None:
        self.pending.clear()


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


HostScalar = float | Callable[[], float | None]
"""A step scalar the host holds: a float, or a function giving it (None: not recorded) once the step's GPU work ran."""


@dataclass
class _Step:
    """What :class:`StepMonitor` keeps of a step until its device scalars reach the host."""

    step: int
    names: list[str]  # every scalar's name, in the order of ``step_scalars``
    host: dict[str, HostScalar]  # those not on the device
    lr: float


class StepMonitor(_PerStep):
    """Records the scalars of every optimizer step (``history``), logs them, and stops on the first non-finite one.

    Reads ``LitMoELab.step_scalars`` (loss of the step's last micro-batch, its CE and aux parts,
    the pre-clipping gradient norm; 0-dim device tensors, or :data:`HostScalar` values) and the
    learning rate. The device values reach the host one step late, through :class:`LateReads`:
    step ``s`` is recorded, checked and logged at the end of step ``s + 1`` (at once on the CPU), and
    every pending step before validation, before any checkpoint is saved, at the end of training and
    on an exception, so a non-finite step stops the run before a later step's checkpoint exists.
    Every ``log_every`` steps the row goes to ``sink`` (MLflow); after
    each validation every ``val/*`` scalar logged in it (``val/loss``, the balancer's ``val/maxvio_global``)
    and ``val/best_loss`` do, the row gets those scalars and
    ``history_path`` (``history.csv``: ``prior`` rows from before a resume, then this run's) is
    rewritten, so it always reaches as far as ``last.ckpt``. ``shown`` holds the newest recorded
    ``train/loss`` for the progress bar.
    """

    def __init__(self, checkpoints: LastCheckpoint, log_every: int, sink: MetricSink | None = None,
                 history_path: Path | None = None, prior: list[dict[str, float]] | None = None) -> None:
        self.checkpoints, self.log_every, self.sink, self.history_path = checkpoints, log_every, sink, history_path
        self.prior = prior or []
        self.history: list[dict[str, float]] = []
        self.val_history: list[tuple[int, float]] = []
        self.shown: dict[str, float] = {}
        self._reads: LateReads[_Step] = LateReads()
        vals = [r["val/loss"] for r in self.prior if math.isfinite(r.get("val/loss", math.nan))]
        self._best = min(vals) if vals else math.inf

    @property
    def rows(self) -> list[dict[str, float]]:
        """The whole run's rows: before the resume, then this process's."""
        return self.prior + self.history

    def on_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        scalars = pl_module.step_scalars
        host = {k: v for k, v in scalars.items() if not isinstance(v, torch.Tensor)}
        values = torch.stack([v.float() for k, v in scalars.items() if k not in host])
        lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        self._reads.push(_Step(trainer.global_step, list(scalars), host, lr), values)
        self._record_ready(trainer)

    def _record_ready(self, trainer: L.Trainer, everything: bool = False) -> None:
        for step, values in self._reads.pop(everything):
            self._record(trainer, step, values)

    def _record(self, trainer: L.Trainer, step: _Step, values: list[float], vote: bool = True) -> bool:
        """Append ``step``'s row and log it; a non-finite scalar on any rank raises :class:`NonFiniteLossError`.

        ``vote=False`` (while an exception ends the run): this rank's scalars only, and a non-finite
        one returns False instead of raising. Either way no later step is recorded after it.
        """
        device_values = iter(values)
        row = {"step": float(step.step)}
        for name in step.names:
            value = step.host[name] if name in step.host else next(device_values)
            value = value() if callable(value) else value
            if value is not None:
                row[name] = float(value)
        bad = [(k, v) for k, v in row.items() if not math.isfinite(v)]
        row["train/lr"] = step.lr
        if trainer.strategy.reduce_boolean_decision(bool(bad), all=False) if vote else bad:
            self._reads.clear()
            if not vote:
                return False
            metric, value = bad[0] if bad else ("train/loss", float("nan"))
            if not bad:
                metric += " (on another rank)"
            raise NonFiniteLossError(step.step, metric, value, *self.checkpoints.describe())
        self.history.append(row)
        if "train/loss" in row:
            self.shown["train/loss"] = row["train/loss"]
        if self.sink is not None and step.step % self.log_every == 0:
            self.sink({k: v for k, v in row.items() if k != "step"}, step.step)
        return True

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record_ready(trainer, everything=True)  # the validation row and last.ckpt need the step's row

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._record_ready(trainer, everything=True)  # a non-finite step raises here, before the file is written

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record_ready(trainer, everything=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # The run's history (written after the exception) reaches the last finite step, as when steps were
        # read at once. No vote (another rank may not get here) and no second error over the one in flight.
        with contextlib.suppress(RuntimeError):
            for step, values in self._reads.pop(everything=True):
                if not self._record(trainer, step, values, vote=False):
                    break

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
    """``history.csv``: one row per optimizer step, ``val/loss`` filled in at validation steps (else empty).

    The csv module rather than pandas: training needs no pandas (``pip install moelab`` has none);
    ``repr`` of a float reads back exactly.
    """
    import csv

    columns = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_write(path) as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([["" if r.get(k) is None else repr(float(r[k])) for k in columns] for r in rows])


def read_history(path: Path, up_to_step: int) -> list[dict[str, float]]:
    """The rows of ``history.csv`` with ``step <= up_to_step`` (what a checkpoint at that step had seen)."""
    import csv

    if not path.is_file():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        # Empty cells (no validation at that step) are left out, as they were written.
        rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(f)]
    return [r for r in rows if r.get("step", math.inf) <= up_to_step]


class Throughput(_PerStep):
    """Logs ``perf/tokens_per_s`` (all devices), ``perf/step_time_s``, ``perf/mfu`` and ``perf/peak_mem_gb`` (GPU)
    to ``sink`` every ``log_every`` steps, at the same steps as ``train/*``.

    A window runs from the first batch after a log (or after validation) to the next log, so
    validation time is excluded and data loading included. ``summary()`` reports the median
    window after the first (the first holds compilation and allocator warm-up).

    ``spans`` keeps each window's optimizer steps and its seconds per step, ``(first, end, s)``: steps ``first ..
    end - 1`` counted from 0 (as ``moelab.data.curriculum.StagePlan`` counts them), so a caller can set aside the
    windows that hold a curriculum's change of length.

    ``perf/peak_mem_gb`` is the window's own peak: the CUDA peak counter is reset when a window
    starts, so a curriculum stage's windows show that stage's memory, and a run that follows another
    in the same process (a study's notebook) does not inherit the earlier run's peak. ``summary()``'s
    ``peak_mem_gb`` is the largest of the run's window peaks and of the counter since the last window began.
    """

    def __init__(self, tokens_per_device_step: int, flops_per_token_fwd: float, log_every: int,
                 sink: MetricSink | None = None) -> None:
        self.tokens_per_device_step = tokens_per_device_step
        self.flops_per_token_fwd = flops_per_token_fwd
        self.log_every = log_every
        self.sink = sink
        self.windows: list[tuple[float, float]] = []  # (tokens/s over all devices, mfu)
        self.spans: list[tuple[int, int, float]] = []  # per window: (first step, end step, seconds per step)
        self.window_mem_gb: list[float | None] = []  # per window: its own peak (None on a CPU)
        self._t0: float | None = None
        self._step0 = 0
        self._peak: float | None = None
        self._world = 1
        self._mem_peak = 0.0  # bytes, the largest window peak so far
        self.shown: dict[str, float] = {}  # the newest window's tokens/s, for the progress bar

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # imported here and below: moelab.train importing moelab.train.perf made `python -m moelab.train.perf` warn
        from moelab.train.perf import device_peak_flops

        self._peak = device_peak_flops(pl_module.device)
        self._world = trainer.world_size
        self._mem_peak = 0.0

    def _sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._t0 is None:
            self._sync(pl_module.device)
            if pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self._t0, self._step0 = time.perf_counter(), trainer.global_step

    def on_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        if self._t0 is None or step % self.log_every != 0 or step == self._step0:
            return
        self._sync(pl_module.device)
        dt = time.perf_counter() - self._t0
        per_device = self.tokens_per_device_step * (step - self._step0) / dt
        from moelab.train.perf import mfu

        util = mfu(self.flops_per_token_fwd, per_device, self._peak)
        self.windows.append((per_device * self._world, util))
        self.spans.append((self._step0, step, dt / (step - self._step0)))
        metrics = {"perf/tokens_per_s": per_device * self._world, "perf/step_time_s": dt / (step - self._step0)}
        if self._peak:
            metrics["perf/mfu"] = util
        self.window_mem_gb.append(None)
        if pl_module.device.type == "cuda":
            window = float(torch.cuda.max_memory_allocated(pl_module.device))
            self._mem_peak = max(self._mem_peak, window)
            metrics["perf/peak_mem_gb"] = self.window_mem_gb[-1] = window / 1e9
        if self.sink is not None:
            self.sink(metrics, step)
        self.shown["tok/s"] = per_device * self._world
        self._t0 = None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0 = None  # restart the window after validation

    def summary(self, device: torch.device) -> dict[str, float | None]:
        """``tok_per_s`` (all devices), ``mfu`` (None on CPU), ``peak_mem_gb`` (None on CPU)."""
        steady = self.windows[1:] or self.windows
        tps = statistics.median(w[0] for w in steady) if steady else None
        util = statistics.median(w[1] for w in steady) if steady and self._peak else None
        mem = None
        if device.type == "cuda":  # the counter since the last window started: steps after the last log count too
            mem = max(self._mem_peak, float(torch.cuda.max_memory_allocated(device))) / 1e9
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


def progress_bar() -> L.Callback:
    """:class:`StepProgressBar` where rich is installed, else Lightning's tqdm bar (rich is not a dependency of
    ``pip install moelab``)."""
    try:
        import rich  # noqa: F401
    except ImportError:
        from lightning.pytorch.callbacks import TQDMProgressBar

        return TQDMProgressBar()
    return StepProgressBar()


class Rendezvous(Callback):
    """Wait for other processes at one step: after ``at`` optimizer steps, mark this process's arrival as the file
    ``folder/<name>.<me>`` and wait until ``expected`` files ``<name>.*`` are there or ``timeout_s`` passed.

    Processes that share a GPU and time their steps (a study's probes in a jobs call) meet here after their
    compilation, so the steps they time run together. ``met``: whether all arrived in time; ``arrived``: how many
    had (a process that failed never arrives: the others go on after the timeout)."""

    def __init__(self, folder: str | Path, name: str, me: str, expected: int, at: int, timeout_s: float) -> None:
        self.folder, self.name, self.me = Path(folder), name, me
        self.expected, self.at, self.timeout_s = expected, at, timeout_s
        self.met, self.arrived, self.done = False, 0, False

    def _count(self) -> int:
        return len(list(self.folder.glob(f"{self.name}.*")))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.done or trainer.global_step < self.at:
            return
        self.done = True
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{self.name}.{self.me}").touch()
        deadline = time.monotonic() + self.timeout_s
        while (n := self._count()) < self.expected and time.monotonic() < deadline:
            time.sleep(0.1)
        self.arrived, self.met = n, n >= self.expected


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar counting optimizer steps of the whole run (``train 30/60``, also after a resume),
    labelled ``train`` instead of ``Epoch 0/-2`` (a run here is one long epoch), without ``v_num``
    (a logger version moelab does not use).

    It shows the ``shown`` values of :class:`StepMonitor` (``train/loss``, one step late) and
    :class:`Throughput` (``tok/s``) beside Lightning's logged ones: a tensor logged for the bar with
    ``self.log(..., prog_bar=True)`` is turned into a float after every batch, a host sync per step.
    """

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
        for callback in trainer.callbacks:
            if isinstance(callback, (StepMonitor, Throughput)):
                items.update(callback.shown)
        return items
