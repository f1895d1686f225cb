"""A small Lightning run of the balancer callback, for test_balance*.py: one MoELab per balancer,
all trained on the same fixed token batches, each step's biases recorded.

``python -m tests.train.balance_probe <out_dir> <devices>`` runs it under CPU DDP (gloo) and saves
each rank's trajectories to ``<out_dir>/rank<r>.pt``; Lightning relaunches this module for the
other ranks, which is why DDP cannot run inside the pytest process. Rank r of a W-rank run reads
rows ``[r B, (r + 1) B)`` of each global batch, so one process reading all ``W B`` rows sees the
concatenated batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from moelab.model import MoELab
from moelab.train.balancer import BalancerCallback
from tests.model.tiny import tiny_config

# (balancer, extra MoEConfig fields): every bias rule and both quantile-balancing modes.
BALANCERS = [
    ("quantile_balancing", {}),
    ("quantile_balancing", {"quantile_balancing_mode": "histogram", "quantile_balancing_cutoff": "excluding_self"}),
    ("quantile_load", {"quantile_load_rate": 0.05}),
    ("loss_free_sign", {"loss_free_sign_rate": 0.01}),
]
SEQ, VOCAB = 8, 50


def batches(steps: int, rows: int, seed: int = 0) -> torch.Tensor:
    """``[steps, rows, SEQ]`` token ids: the global batch of every step."""
    return torch.randint(0, VOCAB, (steps, rows, SEQ), generator=torch.Generator().manual_seed(seed))


class Probe(L.LightningModule):
    """Sum of the models' losses on ``data[step]``, rows of this rank only, in ``micro_batches``
    pieces (train with ``accumulate_grad_batches=micro_batches``); SGD or Adam at ``lr``."""

    def __init__(self, data: torch.Tensor, world: int = 1, lr: float = 0.0, adam: bool = False,
                 micro_batches: int = 1) -> None:
        super().__init__()
        self.data, self.world, self.lr, self.adam, self.micro_batches = data, world, lr, adam, micro_batches
        models = []
        for balancer, extra in BALANCERS:
            cfg = tiny_config(pattern="K", n_layers=2, dense_layers=0)
            cfg.moe.balancer = balancer
            for key, value in extra.items():
                setattr(cfg.moe, key, value)
            torch.manual_seed(0)
            models.append(MoELab(cfg.validate()))
        self.models = nn.ModuleList(models)

    def train_dataloader(self) -> DataLoader:
        per_rank = self.data.shape[1] // self.world
        mine = self.data[:, self.global_rank * per_rank:(self.global_rank + 1) * per_rank]
        return DataLoader(list(mine.reshape(-1, SEQ)), batch_size=per_rank // self.micro_batches, shuffle=False)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return sum(m(batch, batch).loss for m in self.models)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adam:
            return torch.optim.Adam(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def trainer(max_steps: int, callback: BalancerCallback, root: Path, **kwargs: Any) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                     callbacks=[callback], default_root_dir=str(root), **kwargs)


# The DDP run trains (Adam at this rate), so "identical weights on both ranks" says something: the
# weights move, and each rank's move must be the all-reduced one.
DDP_LR = 1e-2


def main(out_dir: str, devices: str) -> None:
    world, steps = int(devices), 3
    callback = BalancerCallback()
    module = Probe(batches(steps, 2 * world), world, lr=DDP_LR, adam=True)
    init = {k: v.detach().clone() for k, v in module.state_dict().items()}
    t = trainer(steps, callback, Path(out_dir), devices=world, strategy="ddp")
    t.fit(module)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    torch.save({"trajectories": callback.trajectories(), "state": weights, "init": init,
                "replicas": callback.replicas}, Path(out_dir) / f"rank{t.global_rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
