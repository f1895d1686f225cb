"""The NaN guard on every step scalar (Inf too, the gradient norm too), its DDP branch, and the second Ctrl-C.

The loss-NaN and NaN-weight cases are in tests/train/test_fit.py; the CLI exit codes in tests/test_cli.py.
"""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from moelab.train import NonFiniteLossError, fit
from moelab.train.callbacks import Interrupted, LastCheckpoint, StepMonitor
from tests.train.helpers import AtStep, InfScalar, tiny_config


class InfGradient(Callback):
    """Before the optimizer step that makes ``step``: one gradient entry becomes +Inf (the loss stays finite)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 == self.step:
            pl_module.model.lm_head.weight.grad[0, 0] = float("inf")


def test_infinite_gradient_norm_stops_the_run_at_its_step(tmp_path) -> None:
    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=10, train__val_every=2, train__warmup_steps=1)
    with pytest.raises(NonFiniteLossError, match=r"^train/grad_norm=inf at step 3: ") as err:
        fit(cfg, callbacks=[InfGradient(3)])
    assert err.value.step == 3 and err.value.last_good == tmp_path / "ckpt" / "last.ckpt"
    rows = (tmp_path / "ckpt" / "history.csv").read_text().splitlines()
    assert len(rows) == 1 + 2  # steps 1 and 2: the bad step is not recorded as a good one


def test_infinite_scalar_stops_the_run(tmp_path) -> None:
    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=10, train__val_every=5, train__warmup_steps=1)
    with pytest.raises(NonFiniteLossError, match=r"^train/aux_loss=inf at step 2: .*no checkpoint was saved"):
        fit(cfg, callbacks=[InfScalar(2)])


class FakeStrategy:
    """Stands in for the DDP strategy: every decision comes back as if some rank had voted True."""

    def __init__(self, others: bool) -> None:
        self.others, self.votes = others, []

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self.votes.append((decision, all))
        return decision or self.others  # the all-reduce of "any rank" (all=False)


def _trainer(others: bool, step: int = 7) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, strategy=FakeStrategy(others), sanity_checking=False,
                           state=SimpleNamespace(fn="fit"), optimizers=[SimpleNamespace(param_groups=[{"lr": 1e-3}])])


def test_guard_stops_every_rank_when_another_rank_sees_a_non_finite_scalar(tmp_path) -> None:
    checkpoints = LastCheckpoint(tmp_path / "last.ckpt", (tmp_path / "last.ckpt", 6))
    module = SimpleNamespace(step_scalars={"train/loss": torch.tensor(2.5), "train/grad_norm": torch.tensor(0.5)})
    monitor = StepMonitor(checkpoints, log_every=1)
    calm = _trainer(others=False)
    monitor.on_step_end(calm, module)
    assert calm.strategy.votes == [(False, False)] and monitor.history[-1]["train/loss"] == 2.5
    trainer = _trainer(others=True)
    bad = r"^train/loss \(on another rank\)=nan at step 7: .*last.ckpt \(step 6"
    with pytest.raises(NonFiniteLossError, match=bad):
        monitor.on_step_end(trainer, module)
    assert trainer.strategy.votes == [(False, False)] and len(monitor.history) == 1  # this rank voted finite


def test_weight_guard_stops_every_rank_when_another_rank_holds_a_nan(tmp_path) -> None:
    checkpoints = LastCheckpoint(tmp_path / "last.ckpt")
    model = torch.nn.Linear(3, 2)
    trainer = _trainer(others=True)
    with pytest.raises(NonFiniteLossError, match=r"^weight \(on another rank\)=nan at step 7: .*no checkpoint"):
        checkpoints.on_validation_end(trainer, model)
    assert trainer.strategy.votes == [(False, False)]
    with torch.no_grad():
        model.bias[1] = float("inf")
    trainer = _trainer(others=False)
    with pytest.raises(NonFiniteLossError, match=r"^weight bias=nan at step 7"):
        checkpoints.on_validation_end(trainer, model)
    assert trainer.strategy.votes == [(True, False)]


def test_second_ctrl_c_aborts_at_once(tmp_path) -> None:
    """The first Ctrl-C asks for a clean stop; a second one, before the step ends, raises KeyboardInterrupt
    there (the default handler is back), which Lightning turns into SystemExit(1): no clean stop, no
    checkpoint, the run recorded as failed, the handlers restored."""

    def twice(trainer, module) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=10, train__val_every=5, train__warmup_steps=1)
    with pytest.raises((KeyboardInterrupt, SystemExit)) as err:
        fit(cfg, callbacks=[AtStep(2, twice)])
    assert not isinstance(err.value, Interrupted)
    summary = json.loads((tmp_path / "ckpt" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith(("KeyboardInterrupt", "SystemExit"))
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()  # no clean stop: nothing saved after step 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
