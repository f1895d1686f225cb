"""A curriculum run stopped in the middle of a stage and resumed ends with the same weights, bit for bit, as an
uninterrupted one; the learning-rate schedule runs across the stages."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from moelab.train import fit
from moelab.train.module import lr_factor
from tests.train.helpers import tiny_config

# tiny: train.batch_size 8 x data.seq_len 64 = 512 tokens per micro-batch -> batches 16, 8, 4
CURRICULUM = {"train__max_steps": 9, "train__val_every": 3, "train__warmup_steps": 2,
              "data__curriculum": [{"seq_len": 32, "steps": 3},
                                   {"seq_len": 64, "steps": 3, "synthetic": 0.25, "synthetic_tasks": ["mqar"]},
                                   {"seq_len": 128}]}


class CtrlCAt(Callback):
    """Sends SIGINT once, before the batch after ``step`` optimizer steps (fit then saves last.ckpt and stops)."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.done and trainer.global_step == self.step:
            self.done = True
            os.kill(os.getpid(), signal.SIGINT)


def test_resume_in_the_middle_of_a_stage_is_exact(tmp_path) -> None:
    straight = fit(tiny_config(tmp_path / "a", **CURRICULUM))
    assert [r["train/seq_len"] for r in straight.history] == [32.0] * 3 + [64.0] * 3 + [128.0] * 3
    cfg = tiny_config(tmp_path / "b", **CURRICULUM)
    lrs = [r["train/lr"] for r in straight.history]  # the lr the next step uses: one schedule over all stages
    assert lrs == pytest.approx([cfg.train.lr * lr_factor(s, 2, 9, cfg.train.min_lr_ratio) for s in range(1, 10)])

    with pytest.raises(KeyboardInterrupt, match="resume from"):
        fit(cfg, callbacks=[CtrlCAt(3)])  # stops after step 4, the middle of the second stage
    assert torch.load(tmp_path / "b" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 4
    resumed = fit(cfg, resume=True)

    assert [r["train/loss"] for r in resumed.history] == [r["train/loss"] for r in straight.history]
    a = torch.load(tmp_path / "a" / "last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(tmp_path / "b" / "last.ckpt", map_location="cpu", weights_only=False)
    assert a["global_step"] == b["global_step"] == 9
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    moments = [(s["exp_avg"], t["exp_avg"]) for s, t in zip(a["optimizer_states"][0]["state"].values(),
                                                             b["optimizer_states"][0]["state"].values())]
    assert moments and all(torch.equal(x, y) for x, y in moments)
