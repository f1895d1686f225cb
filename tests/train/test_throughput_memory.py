"""``Throughput``'s GPU memory readings: each window's own peak, and a run's peak that is its own.

The CUDA memory counters are replaced by a fake allocator (no GPU needed): the test drives the
callback's hooks the way Lightning does and checks what it logs.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moelab.train.callbacks import Throughput


class FakeAllocator:
    """``max_memory_allocated`` / ``reset_peak_memory_stats`` over a settable current allocation (bytes)."""

    def __init__(self, peak: float) -> None:
        self.now = 0.0
        self.peak = peak  # what an earlier run in the process left on the counter

    def use(self, nbytes: float) -> None:
        self.now = nbytes
        self.peak = max(self.peak, nbytes)

    def max_memory_allocated(self, device: object = None) -> float:
        return self.peak

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak = self.now


@pytest.fixture
def alloc(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    fake = FakeAllocator(peak=50e9)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr("moelab.train.perf.device_peak_flops", lambda device: None)
    return fake


def test_window_peaks_are_their_own_and_no_earlier_run_leaks(alloc: FakeAllocator) -> None:
    logged: dict[int, dict[str, float]] = {}
    cb = Throughput(tokens_per_device_step=1024, flops_per_token_fwd=1.0, log_every=2,
                    sink=lambda metrics, step: logged.__setitem__(step, metrics))
    trainer = SimpleNamespace(global_step=0, world_size=1)
    module = SimpleNamespace(device=torch.device("cuda", 0))
    cb.on_train_start(trainer, module)
    # Two windows of two steps: the first stage uses 8 GB, the second 3 GB (a curriculum's shorter stage
    # may come second); an earlier run in the process left 50 GB on the counter.
    for step, used in enumerate([8e9, 8e9, 3e9, 3e9], start=1):
        cb.on_train_batch_start(trainer, module, None, step - 1)
        alloc.use(used)
        trainer.global_step = step
        cb.on_train_batch_end(trainer, module, None, None, step - 1)
        alloc.use(1e9)  # activations freed after the step
    assert logged[2]["perf/peak_mem_gb"] == pytest.approx(8.0)
    assert logged[4]["perf/peak_mem_gb"] == pytest.approx(3.0)
    assert cb.summary(module.device)["peak_mem_gb"] == pytest.approx(8.0)
    # each window's optimizer steps, counted from 0 as a curriculum's StagePlan counts them, and its time per step
    assert [(first, end) for first, end, _ in cb.spans] == [(0, 2), (2, 4)]
    assert all(sec > 0 for _, _, sec in cb.spans)
    assert cb.window_mem_gb == pytest.approx([8.0, 3.0])  # each window's own peak, as logged


def test_summary_counts_steps_after_the_last_window(alloc: FakeAllocator) -> None:
    cb = Throughput(tokens_per_device_step=1024, flops_per_token_fwd=1.0, log_every=2)
    trainer = SimpleNamespace(global_step=0, world_size=1)
    module = SimpleNamespace(device=torch.device("cuda", 0))
    cb.on_train_start(trainer, module)
    for step, used in enumerate([2e9, 2e9, 6e9], start=1):  # step 3 ends the run before the next log
        cb.on_train_batch_start(trainer, module, None, step - 1)
        alloc.use(used)
        trainer.global_step = step
        cb.on_train_batch_end(trainer, module, None, None, step - 1)
    assert cb.summary(module.device)["peak_mem_gb"] == pytest.approx(6.0)
