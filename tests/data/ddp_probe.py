"""Run by test_datamodule.py in its own process: 4 steps of 2-process CPU DDP, saving each rank's batches.

Usage: ``python -m tests.data.ddp_probe <cache_dir> <out_dir>``. Lightning relaunches this module
once per extra rank, which is why it cannot run inside the pytest process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

from moelab.data.config import DataConfig
from moelab.data.datamodule import TextDataModule

STEPS, BATCH, SEQ, SEED = 4, 2, 8, 3


class Recorder(L.LightningModule):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.out = torch.nn.Linear(8, vocab)
        self.train_seen: list[torch.Tensor] = []
        self.val_seen: list[torch.Tensor] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.train_seen.append(batch["input_ids"].clone())
        logits = self.out(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_seen.append(batch["input_ids"].clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(cache_dir: str, out_dir: str) -> None:
    data = TextDataModule(DataConfig(seq_len=SEQ, cache_dir=cache_dir), batch_size=BATCH, seed=SEED,
                          max_steps=STEPS, val_batches=2)
    model = Recorder(data.vocab_size)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, val_check_interval=STEPS,
                        default_root_dir=out_dir)
    trainer.fit(model, datamodule=data)
    torch.save({"train": model.train_seen, "val": model.val_seen, "world_size": trainer.world_size},
               Path(out_dir) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
