"""TextDataModule: batch layout, exact resume (sampler level and with a real Lightning Trainer), rank split."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from moelab.data.config import DataConfig
from moelab.data.corpus import PreparedCorpus
from moelab.data.datamodule import (
    StepBatchSampler,
    StepLoader,
    TextDataModule,
    step_indices,
    val_windows,
    window_offset,
)
from moelab.model.config import ConfigError

B, T = 4, 32


def _fake_trainer(step: int = 0, rank: int = 0, world: int = 1, accum: int = 1, max_steps: int = 10):
    return SimpleNamespace(global_step=step, global_rank=rank, world_size=world, accumulate_grad_batches=accum,
                           max_steps=max_steps, _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))


@pytest.fixture
def dm(shakespeare_cfg: DataConfig, shakespeare: PreparedCorpus) -> TextDataModule:
    module = TextDataModule(dataclasses.replace(shakespeare_cfg, seq_len=T), batch_size=B, seed=11, max_steps=10)
    module.prepare_data()
    module.setup("fit")
    return module


def _batches(module: TextDataModule, trainer=None) -> list[dict[str, torch.Tensor]]:
    module.trainer = trainer
    return list(module.train_dataloader())


def test_train_batch_layout(dm: TextDataModule, shakespeare: PreparedCorpus) -> None:
    loader = dm.train_dataloader()
    assert len(loader) == 10
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "targets"}
    for key in batch:
        assert batch[key].shape == (B, T) and batch[key].dtype == torch.int64
    assert torch.equal(batch["targets"][:, :-1], batch["input_ids"][:, 1:])
    stream = shakespeare.load_tokens("train")
    for j in range(B):  # row j is the window at the Philox offset of item j of step 0
        o = loader.dataset.offset(j)
        np.testing.assert_array_equal(batch["input_ids"][j].numpy(), stream[o: o + T])
        assert batch["targets"][j, -1].item() == stream[o + T]
    assert int(batch["input_ids"].max()) < dm.vocab_size == 4096
    assert dm.tokenizer.decode(batch["input_ids"][0].tolist())


def test_val_batches_are_the_first_windows(dm: TextDataModule, shakespeare: PreparedCorpus) -> None:
    batches = list(dm.val_dataloader())
    assert len(batches) == 8  # val_batches
    x = torch.cat([b["input_ids"] for b in batches])
    y = torch.cat([b["targets"] for b in batches])
    stream = torch.from_numpy(shakespeare.load_tokens("val").astype(np.int64))
    n = 8 * B
    assert torch.equal(x, stream[: n * T].view(n, T)) and torch.equal(y, stream[1: n * T + 1].view(n, T))
    assert torch.equal(x, torch.cat([b["input_ids"] for b in dm.val_dataloader()]))  # fixed


def test_val_split_across_ranks() -> None:
    w0, w1 = val_windows(1000, 8, B, 0, 2), val_windows(1000, 8, B, 1, 2)
    assert len(w0) == len(w1) == 16 and sorted(w0 + w1) == list(range(32))
    assert len(val_windows(5, 8, B, 1, 2)) == 2  # short stream: truncated evenly
    with pytest.raises(ValueError, match="fewer than world_size"):
        val_windows(1, 8, B, 0, 2)


def test_window_offsets_are_pinned() -> None:
    """Raw Philox output: these values must not change across numpy versions or machines."""
    assert all(0 <= window_offset(1234, i, 1000) < 1000 for i in range(100))
    assert window_offset(1234, 0, 2**63) == 6174562084317992592
    assert window_offset(1234, 1, 2**63) == 10921459058212318879 % 2**63


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_sees_the_tail_of_the_full_run(dm: TextDataModule, accum: int) -> None:
    full = _batches(dm, _fake_trainer(step=0, accum=accum))
    assert len(full) == 10 * accum
    for s in (1, 4, 9):
        trainer = _fake_trainer(step=s, accum=accum)
        dm.trainer = trainer
        loader = dm.train_dataloader()
        assert len(loader) == 10 * accum  # whole-run length, as Lightning's restored batch count expects
        resumed = list(loader)
        assert len(resumed) == (10 - s) * accum
        for a, b in zip(full[s * accum:], resumed):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["targets"], b["targets"])


def test_workers_do_not_change_batches(dm: TextDataModule) -> None:
    dm.cfg.num_workers = 2
    parallel = _batches(dm, _fake_trainer(step=6))
    dm.cfg.num_workers = 0
    serial = _batches(dm, _fake_trainer(step=6))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(parallel, serial))


def test_rank_split_is_disjoint(dm: TextDataModule) -> None:
    idx = {r: [i for batch in StepBatchSampler(B, 10, r, 2) for i in batch] for r in (0, 1)}
    assert not set(idx[0]) & set(idx[1])
    assert sorted(idx[0] + idx[1]) == list(range(10 * B * 2))
    assert step_indices(3, B, 1, 2) == [3 * B * 2 + B + j for j in range(B)]
    # the same step on the two ranks reads different windows
    r0, r1 = (_batches(dm, _fake_trainer(step=2, rank=r, world=2)) for r in (0, 1))
    assert len(r0) == len(r1) == 8
    assert not torch.equal(r0[0]["input_ids"], r1[0]["input_ids"])
    # a 2-rank step covers the items of two consecutive 1-rank micro-steps of the same batch size
    single = StepBatchSampler(B, 20, 0, 1)
    assert [i for b in list(single)[4:6] for i in b] == step_indices(2, B, 0, 2) + step_indices(2, B, 1, 2)


def test_guards(dm: TextDataModule, shakespeare_cfg: DataConfig) -> None:
    with pytest.raises(ConfigError, match="trainer.max_steps=20"):
        _batches(dm, _fake_trainer(max_steps=20))
    trainer = _fake_trainer(world=2)
    trainer._accelerator_connector.use_distributed_sampler = True
    with pytest.raises(ConfigError, match="use_distributed_sampler=False"):
        _batches(dm, trainer)
    for kwargs, field in [({"batch_size": 0}, "batch_size"), ({"seed": -1}, "seed"), ({"max_steps": 0}, "max_steps"),
                          ({"val_batches": 0}, "val_batches")]:
        args = {"batch_size": B, "seed": 0, "max_steps": 5, **kwargs}
        with pytest.raises(ConfigError, match=f"^{field}="):
            TextDataModule(shakespeare_cfg, **args)
    long = TextDataModule(dataclasses.replace(shakespeare_cfg, seq_len=10**7), batch_size=B, seed=0, max_steps=5)
    with pytest.raises(ConfigError, match="data.seq_len=10000000"):
        long.setup()


def test_loader_state_flags_changed_settings(dm: TextDataModule) -> None:
    dm.trainer = None
    loader = dm.train_dataloader()
    assert isinstance(loader, StepLoader)
    state = loader.state_dict()
    loader.load_state_dict(state)  # same settings: silent
    with pytest.warns(UserWarning, match="seed: 5 -> 11"):
        loader.load_state_dict({**state, "seed": 5})


class _Recorder(L.LightningModule):
    """Smallest trainable model; remembers (global_step, input_ids) of every training batch."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.out = torch.nn.Linear(8, vocab)
        self.seen: list[tuple[int, torch.Tensor]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.global_step, batch["input_ids"].clone()))
        logits = self.out(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("accum", [1, 2])
def test_real_trainer_resume(shakespeare_cfg: DataConfig, shakespeare: PreparedCorpus, tmp_path: Path,
                             accum: int) -> None:
    """Lightning restores global_step before building the train loader: a run resumed from the step-3
    checkpoint trains on exactly the batches steps 3..7 of the uninterrupted run trained on."""
    cfg = dataclasses.replace(shakespeare_cfg, seq_len=8)

    def fit(ckpt_path: str | None = None) -> list[tuple[int, torch.Tensor]]:
        data = TextDataModule(cfg, batch_size=2, seed=3, max_steps=8, val_batches=1)
        model = _Recorder(data.vocab_size)
        callbacks = [] if ckpt_path else [L.pytorch.callbacks.ModelCheckpoint(
            dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)]
        trainer = L.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=callbacks, enable_checkpointing=not ckpt_path,
                            use_distributed_sampler=False, limit_val_batches=0, accumulate_grad_batches=accum,
                            default_root_dir=tmp_path)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model.seen

    full = fit()
    assert [s for s, _ in full] == [s for s in range(8) for _ in range(accum)]
    resumed = fit(str(tmp_path / "epoch=0-step=3.ckpt"))
    assert [s for s, _ in resumed] == [s for s in range(3, 8) for _ in range(accum)]
    for (sa, a), (sb, b) in zip(full[3 * accum:], resumed):
        assert sa == sb and torch.equal(a, b), f"step {sa}: resumed batch differs"


@pytest.mark.slow  # two spawned ranks: ~8 s
def test_real_ddp_two_cpu_ranks(shakespeare_cfg: DataConfig, shakespeare: PreparedCorpus, tmp_path: Path) -> None:
    """Lightning DDP (gloo, 2 processes) keeps the sampler: each rank trains on its own step_indices
    windows and validates on its half of the fixed val windows."""
    import os
    import subprocess
    import sys

    from tests.data import ddp_probe as probe

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "tests.data.ddp_probe", shakespeare_cfg.cache_dir, str(tmp_path)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = {r: torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)}
    cfg = dataclasses.replace(shakespeare_cfg, seq_len=probe.SEQ)
    data = TextDataModule(cfg, batch_size=probe.BATCH, seed=probe.SEED, max_steps=probe.STEPS, val_batches=2)
    for r in (0, 1):
        assert seen[r]["world_size"] == 2
        expected = _batches(data, _fake_trainer(rank=r, world=2, max_steps=probe.STEPS))
        assert len(seen[r]["train"]) == probe.STEPS
        assert all(torch.equal(a, b["input_ids"]) for a, b in zip(seen[r]["train"], expected))
    val = {r: torch.cat(seen[r]["val"]) for r in (0, 1)}
    assert val[0].shape == val[1].shape == (2, probe.SEQ)  # 2 batches * B=2 windows, half per rank
    stream = torch.from_numpy(shakespeare.load_tokens("val").astype(np.int64))
    assert torch.equal(torch.stack([val[0][0], val[1][0], val[0][1], val[1][1]]), stream[: 4 * probe.SEQ].view(4, -1))
