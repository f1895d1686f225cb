"""Step scalars and balancer times read one step late (LateReads), forced on the CPU with events that complete
only when waited for, as a CUDA event of a step the GPU is still running: every step is recorded once and in
order, the last one at the end, and a non-finite step still stops the run before a later checkpoint exists."""

from __future__ import annotations

import os
import statistics
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import moelab.train.balancer as train_balance
import moelab.train.callbacks as callbacks
from moelab.train import NonFiniteLossError, fit
from moelab.train.balancer import BalancerCallback
from moelab.train.callbacks import HostEvent, LastCheckpoint, LateReads, StepMonitor
from tests.train.balance_probe import Probe, batches
from tests.train.helpers import AtStep, InfScalar, tiny_config


class RunningEvent(HostEvent):
    """A CPU event reporting its work unfinished until someone waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = False

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.waited = True


def running_events_in(module, monkeypatch: pytest.MonkeyPatch) -> list[RunningEvent]:
    """``module.device_event`` makes RunningEvents; the list holds them in creation order."""
    made: list[RunningEvent] = []

    def make(device: torch.device, timing: bool = False) -> RunningEvent:
        made.append(RunningEvent())
        return made[-1]

    monkeypatch.setattr(module, "device_event", make)
    return made


@pytest.fixture
def running_events(monkeypatch: pytest.MonkeyPatch) -> list[RunningEvent]:
    """StepMonitor's (LateReads') events are RunningEvents."""
    return running_events_in(callbacks, monkeypatch)


def test_late_reads_return_each_entry_once_in_order(running_events: list[RunningEvent]) -> None:
    reads: LateReads[int] = LateReads()
    reads.push(1, torch.tensor([1.0, 2.0]))
    assert reads.pop() == [] and not running_events[0].waited  # the newest waits while it runs
    reads.push(2, torch.tensor([3.0, 4.0]))
    assert reads.pop() == [(1, [1.0, 2.0])]
    assert running_events[0].waited and not running_events[1].waited
    reads.push(3, torch.tensor([5.0, 6.0]))
    running_events[2].waited = True  # step 3's work ran already: it comes back with step 2, not waited for
    assert reads.pop() == [(2, [3.0, 4.0]), (3, [5.0, 6.0])]
    assert reads.pop(everything=True) == []
    reads.push(4, torch.tensor([7.0, 8.0]))
    assert reads.pop(everything=True) == [(4, [7.0, 8.0])] and running_events[3].waited


def test_late_reads_on_the_cpu_come_back_at_once() -> None:
    reads: LateReads[str] = LateReads()
    reads.push("a", torch.tensor([0.5]))
    assert reads.pop() == [("a", [0.5])] and reads.pop(everything=True) == []


class Lag(Callback):
    """At each batch start, (optimizer steps done, steps StepMonitor has recorded)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        monitor = next(c for c in trainer.callbacks if isinstance(c, StepMonitor))
        self.seen.append((trainer.global_step, len(monitor.history)))


def _metric_steps(tracking_uri: str, run_id: str, names: list[str]) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    return {n: [(m.step, m.value) for m in client.get_metric_history(run_id, n)] for n in names}


def test_late_steps_are_recorded_once_in_order_as_at_once(tmp_path: Path, tracking_uri: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def config(name: str):
        return tiny_config(tmp_path / name, tracking_uri, train__max_steps=7, train__val_every=3,
                           train__log_every=2, train__warmup_steps=1)

    now = fit(config("now"))
    made = running_events_in(callbacks, monkeypatch)
    lag = Lag()
    late = fit(config("late"), callbacks=[lag])

    assert len(made) == 7 and all(e.waited for e in made)  # one event per step, each step waited for
    # One step behind, except after a validation (steps 3, 6), which records every step first.
    assert lag.seen == [(0, 0), (1, 0), (2, 1), (3, 3), (4, 3), (5, 4), (6, 6)]
    assert [int(r["step"]) for r in late.history] == list(range(1, 8))  # the last step too, at train end
    assert [list(r) for r in late.history] == [list(r) for r in now.history]  # the same columns, same order
    timed = {"perf/balancer_ms", "perf/balancer_share"}
    for a, b in zip(now.history, late.history):
        assert {k: v for k, v in a.items() if k not in timed} == {k: v for k, v in b.items() if k not in timed}
    assert [s for s, _ in late.val_history] == [3, 6, 7]
    names = ["train/loss", "train/lr", "balance/maxvio_batch", "perf/balancer_ms", "val/loss"]
    logged_now, logged_late = (_metric_steps(tracking_uri, r.run_id, names) for r in (now, late))
    for name in names:
        assert [s for s, _ in logged_late[name]] == [s for s, _ in logged_now[name]], name
    assert [s for s, _ in logged_late["train/loss"]] == [2, 4, 6]
    assert logged_late["train/loss"] == logged_now["train/loss"]
    csv = (tmp_path / "late" / "history.csv").read_text().splitlines()
    assert csv[0] == (tmp_path / "now" / "history.csv").read_text().splitlines()[0] and len(csv) == 1 + 7


@pytest.mark.parametrize("bad", [3, 4])
def test_a_late_non_finite_step_stops_the_run_before_a_later_checkpoint(tmp_path: Path, bad: int,
                                                                        running_events: list[RunningEvent]) -> None:
    # Validation (and last.ckpt, best.ckpt) after steps 2 and 4: step 4 is still unread when its validation starts.
    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=10, train__val_every=2, train__warmup_steps=1)
    with pytest.raises(NonFiniteLossError, match=rf"^train/aux_loss=inf at step {bad}: ") as err:
        fit(cfg, callbacks=[InfScalar(bad)])
    folder = tmp_path / "ckpt"
    assert err.value.step == bad and err.value.last_good == folder / "last.ckpt"
    for name in ("last.ckpt", "best.ckpt"):
        assert torch.load(folder / name, map_location="cpu", weights_only=False)["global_step"] == 2, name
    rows = (folder / "history.csv").read_text().splitlines()
    assert len(rows) == 1 + bad - 1  # the steps before the bad one; none after it


def test_a_crash_still_records_the_unread_step(tmp_path: Path, running_events: list[RunningEvent]) -> None:
    def boom(trainer, module) -> None:
        raise RuntimeError("injected failure")

    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=6, train__val_every=5)
    with pytest.raises(RuntimeError, match="injected failure"):
        fit(cfg, callbacks=[AtStep(2, boom)])
    rows = (tmp_path / "ckpt" / "history.csv").read_text().splitlines()
    assert [int(float(r.split(",")[0])) for r in rows[1:]] == [1, 2]  # step 2 was still unread at the crash


class EndEvents(Callback):
    """After each optimizer step (the balancer ran before it): whether the step's own and the previous step's
    balancer end events had been waited for."""

    def __init__(self, made: list[RunningEvent]) -> None:
        self.made, self.waited = made, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Two events per update, start and end: made[-1] is this step's end, made[-3] the previous step's.
        self.waited.append((self.made[-1].waited, self.made[-3].waited if len(self.made) > 2 else None))


def test_balancer_times_are_read_a_step_later(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = running_events_in(train_balance, monkeypatch)
    balancer, probe = BalancerCallback(), EndEvents(made)
    L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, callbacks=[balancer, probe], default_root_dir=str(tmp_path)).fit(
        Probe(batches(3, 4)))
    assert probe.waited == [(False, None), (False, True), (False, True)]
    assert [s for s, _, _ in balancer.timings] == [1, 2, 3] and all(e.waited for e in made[1::2])
    ms = [m for _, m, _ in balancer.timings]
    shares = [share for _, _, share in balancer.timings]
    assert all(m > 0 for m in ms) and shares[0] is None and all(0 < x < 1 for x in shares[1:])
    assert balancer.summary()["balancer_ms"] == statistics.median(ms[1:])


def test_monitor_records_the_unread_step_at_train_end(tmp_path: Path, running_events: list[RunningEvent]) -> None:
    logged: list[tuple[int, dict[str, float]]] = []
    monitor = StepMonitor(LastCheckpoint(tmp_path / "last.ckpt"), log_every=1, sink=lambda m, s: logged.append((s, m)))
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all=True: d),
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 1e-3}])])
    for step in (1, 2):
        trainer.global_step = step
        # Host values beside the tensors: a float, a function, and one that gives None (not recorded).
        module = SimpleNamespace(step_scalars={"train/loss": torch.tensor(float(step)), "train/seq_len": 64.0,
                                               "perf/balancer_ms": lambda: 0.5, "train/ce": torch.tensor(0.25),
                                               "perf/balancer_share": lambda: None})
        monitor.on_step_end(trainer, module)
    assert [r["step"] for r in monitor.history] == [1.0] and monitor.shown == {"train/loss": 1.0}
    monitor.on_train_end(trainer, module)
    rows = [{"step": float(s), "train/loss": float(s), "train/seq_len": 64.0, "perf/balancer_ms": 0.5, "train/ce": 0.25,
             "train/lr": 1e-3} for s in (1, 2)]
    assert monitor.history == rows and [list(r) for r in monitor.history] == [list(r) for r in rows]  # in order
    assert [s for s, _ in logged] == [1, 2] and monitor.shown == {"train/loss": 2.0}


class SyncWatch(Callback):
    """Reports the synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode``) of optimizer steps ``first``
    to ``last`` as warnings: from the start of the batch after ``first - 1`` steps to the end of step ``last``."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.first - 1:
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.last:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_steps_make_the_host_wait_for_nothing_in_the_loop(tmp_path: Path) -> None:
    """Steps 3-6 of a GPU run (no validation, no log window in them): no synchronizing call from moelab's
    callbacks or from Lightning's metric conversion. Every other one is listed in the message."""
    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=8, train__val_every=8, train__log_every=8,
                      model__moe__balancer="quantile_balancing")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fit(cfg, callbacks=[SyncWatch(3, 6)])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message))
    loop = {k: n for k, n in syncs.items() if f"moelab{os.sep}train{os.sep}" in k or "apply_func.py" in k}
    assert not loop, f"the loop waits for the GPU: {loop}; all synchronizing calls in steps 3-6: {dict(syncs)}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_entry_waits_for_the_next_pop_even_when_done() -> None:
    reads: LateReads[int] = LateReads()
    reads.push(1, torch.tensor([1.5, 2.5], device="cuda"))
    torch.cuda.synchronize()  # done: still not returned, so that every rank records step 1 at the same point
    assert reads.pop() == []
    reads.push(2, torch.tensor([3.5], device="cuda"))
    assert reads.pop() == [(1, [1.5, 2.5])] and reads.pop(everything=True) == [(2, [3.5])]
