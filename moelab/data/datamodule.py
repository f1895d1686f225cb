"""Lightning DataModule over a prepared corpus, with sampling that survives resume and DDP exactly.

Training batches are a pure function of (seed, micro-step, rank, world size):

* item ``i`` of :class:`RandomWindows` is the ``seq_len + 1`` tokens at an offset drawn from a
  counter-based RNG (Philox with key ``seed`` and counter ``i``), so any item can be computed
  without computing the ones before it;
* micro-step ``m`` on rank ``r`` of ``W`` reads items ``m*B*W + r*B + j`` for ``j < B``
  (:func:`step_indices`), so the ranks of one step never share an item;
* the sampler starts at ``m = trainer.global_step * accumulate_grad_batches``, which Lightning has
  restored from the checkpoint before it asks for the train loader, and reports the length of
  the whole run (``max_steps * accumulate_grad_batches`` batches: the run is one epoch) so that
  Lightning's restored in-epoch batch count lines up with it.

A resumed run therefore sees exactly the batches an uninterrupted run would have seen, whatever
the number of dataloader workers. Build the Trainer with ``use_distributed_sampler=False`` so
Lightning keeps this sampler instead of substituting a ``DistributedSampler``.

With ``data.curriculum`` set, training items come from :mod:`moelab.data.curriculum` instead
(stage-sized batches of document packs and retrieval sub-tasks), on the same step -> batch rule.

Validation reads the first ``val_batches * B`` non-overlapping windows of the val stream, dealt
round-robin to the ranks (each rank gets the same count, so per-rank means average exactly).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from moelab.base import ConfigError, _check
from moelab.data.config import DataConfig
from moelab.data.corpus import PreparedCorpus, prepare
from moelab.data.curriculum import CurriculumSampler, CurriculumSequences, StagePlan, plan
from moelab.data.tokenizer import EOS_ID, Tokenizer
from moelab.ops.varlen import segments_from_eos


def window_offset(seed: int, index: int, n_starts: int) -> int:
    """Start of training window ``index``: uniform in ``[0, n_starts)`` from Philox(key=seed, counter=index).

    The raw 64-bit Philox output is fixed by the algorithm (unlike ``Generator.integers``, whose
    stream NumPy may change between versions), so offsets agree across machines and versions;
    the modulo bias is below ``n_starts / 2**64``.
    """
    return int(np.random.Philox(key=seed, counter=index).random_raw()) % n_starts


def step_indices(step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """Item indices of micro-step ``step`` on ``rank`` of ``world_size``: ``step*B*W + rank*B + j``, ``j < B``."""
    base = step * batch_size * world_size + rank * batch_size
    return list(range(base, base + batch_size))


class RandomWindows(Dataset):
    """Map-style dataset: item ``i`` is the window at :func:`window_offset` ``(seed, i)`` of ``tokens``.

    ``tokens``: ``[N]`` integer token stream. Items are ``{"input_ids": [T] int64, "targets": [T] int64}``
    with ``targets[t] = input_ids[t + 1]`` (T = ``seq_len``); the index space is unbounded and the
    length reported is ``length`` (what the sampler will visit).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, length: int) -> None:
        if tokens.size < seq_len + 1:
            raise ValueError(f"the token stream holds {tokens.size} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len, self.seed, self.length = tokens, seq_len, seed, length
        self.n_starts = tokens.size - seq_len  # offsets o with o + seq_len + 1 <= N

    def __len__(self) -> int:
        return self.length

    def offset(self, index: int) -> int:
        return window_offset(self.seed, index, self.n_starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        o = self.offset(index)
        return _pair(self.tokens[o: o + self.seq_len + 1])


class FixedWindows(Dataset):
    """Non-overlapping windows ``k * seq_len`` of ``tokens`` for the window numbers ``windows``.

    ``documents``: items also hold ``segment_ids`` ``[T]`` int32, each input token's document within
    the window: a document ends with its end-of-text id (``eos_id``), as the curriculum's packs do."""

    def __init__(self, tokens: np.ndarray, seq_len: int, windows: list[int], documents: bool = False,
                 eos_id: int = EOS_ID) -> None:
        self.tokens, self.seq_len, self.windows = tokens, seq_len, windows
        self.documents, self.eos_id = documents, eos_id

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        o = self.windows[i] * self.seq_len
        item = _pair(self.tokens[o: o + self.seq_len + 1])
        if self.documents:
            item["segment_ids"] = segments_from_eos(item["input_ids"], self.eos_id)
        return item


class StepBatchSampler(Sampler[list[int]]):
    """One epoch of ``num_steps`` micro-steps; yields :func:`step_indices` for steps ``start_step .. num_steps - 1``.

    ``len()`` is ``num_steps`` even when ``start_step > 0``: a resumed Lightning run keeps counting
    the epoch's batches from the restored position, so the loader must report the whole epoch and
    fast-forward, as a resumable loader does, or Lightning would end the epoch early and restart it.
    """

    def __init__(self, batch_size: int, num_steps: int, rank: int = 0, world_size: int = 1,
                 start_step: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not allowed: expected 0..{world_size - 1}")
        if not 0 <= start_step <= num_steps:
            raise ValueError(f"start_step={start_step} is not allowed: expected 0..num_steps ({num_steps})")
        self.batch_size, self.num_steps, self.rank, self.world_size = batch_size, num_steps, rank, world_size
        self.start_step = start_step

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start_step, self.num_steps):
            yield step_indices(step, self.batch_size, self.rank, self.world_size)


class StepLoader(DataLoader):
    """The train DataLoader, resumable in Lightning's sense.

    Its position needs no saving (the sampler derives it from ``trainer.global_step``); the state
    it saves is what that derivation assumes (seed, batch size, world size, corpus, ...), and
    loading a checkpoint written under other settings warns that the resumed batches will differ.
    """

    def __init__(self, *args, sampling: dict, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sampling = sampling

    def state_dict(self) -> dict:
        return dict(self.sampling)

    def load_state_dict(self, state: dict) -> None:
        changed = {k: (state.get(k), v) for k, v in self.sampling.items() if state.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            warnings.warn(f"resuming with other sampling settings ({detail}): the batches will not continue "
                          "those of the checkpointed run", stacklevel=2)


def val_windows(n_available: int, val_batches: int, batch_size: int, rank: int, world_size: int) -> list[int]:
    """Window numbers rank ``rank`` validates on: the first ``min(val_batches*B, n_available)`` windows,
    truncated to a multiple of ``world_size`` and dealt round-robin."""
    n = min(val_batches * batch_size, n_available)
    per_rank = n // world_size
    if per_rank == 0:
        raise ValueError(f"the val stream holds {n_available} windows, fewer than world_size={world_size}: "
                         "lower seq_len or raise data.val_fraction")
    return [rank + world_size * j for j in range(per_rank)]


class TextDataModule(L.LightningDataModule):
    """Token windows of a prepared corpus as ``{"input_ids": [B, T] int64, "targets": [B, T] int64}``
    (with a curriculum, training batches are ``[B_k, T_k]`` per stage and add ``segment_ids`` ``[B_k, T_k]`` int32).

    ``max_steps`` is the optimizer-step length of the whole run (the train loader covers steps
    ``global_step .. max_steps``); ``seed`` fixes which windows each step reads.
    """

    def __init__(self, cfg: DataConfig, batch_size: int, seed: int, max_steps: int, val_batches: int = 8) -> None:
        super().__init__()
        cfg.validate()
        _check(isinstance(batch_size, int) and batch_size >= 1, "batch_size", batch_size, "an integer >= 1")
        _check(isinstance(seed, int) and seed >= 0, "seed", seed, "an integer >= 0")
        _check(isinstance(max_steps, int) and max_steps >= 1, "max_steps", max_steps, "an integer >= 1")
        _check(isinstance(val_batches, int) and val_batches >= 1, "val_batches", val_batches, "an integer >= 1")
        self.cfg, self.batch_size, self.seed = cfg, batch_size, seed
        self.max_steps, self.val_batches = max_steps, val_batches
        self.corpus: PreparedCorpus | None = None
        self._tokens: dict[str, np.ndarray] = {}

    # ---------------------------------------------------------------- Lightning hooks

    def prepare_data(self) -> None:
        """Build or verify the cache (Lightning runs this on one process per node)."""
        self.corpus = prepare(self.cfg)

    def setup(self, stage: str | None = None) -> None:
        """Load both token streams (every process)."""
        corpus = self._prepared()
        for split in ("train", "val"):
            if split not in self._tokens:
                tokens = corpus.load_tokens(split)
                if tokens.size < self.cfg.seq_len + 1:
                    raise ConfigError(f"data.seq_len={self.cfg.seq_len} is not allowed: the {split} stream of "
                                      f"{corpus.cache_dir.name} holds only {tokens.size} tokens")
                self._tokens[split] = tokens

    def train_dataloader(self) -> DataLoader:
        rank, world, accum, step = self._placement()
        trainer = self.trainer
        if trainer is not None and trainer.max_steps > self.max_steps:
            raise ConfigError(f"trainer.max_steps={trainer.max_steps} is not allowed: expected <= the "
                              f"datamodule's max_steps={self.max_steps}")
        if world > 1 and getattr(getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler", False):
            raise ConfigError("Trainer(use_distributed_sampler=True) is not allowed with TextDataModule: "
                              "build the Trainer with use_distributed_sampler=False (the sampler splits ranks)")
        num_steps = self.max_steps * accum
        if step * accum > num_steps:
            raise ConfigError(f"max_steps={self.max_steps} is not allowed: the trainer resumed at global step {step}")
        sampling = {"seed": self.seed, "batch_size": self.batch_size, "world_size": world,
                    "accumulate_grad_batches": accum, "seq_len": self.cfg.seq_len,
                    "corpus": self._prepared().cache_dir.name}
        if self.cfg.curriculum:
            stages = self.stages(accum)
            dataset: Dataset = CurriculumSequences(
                self._stream("train"), stages, self.seed, self.tokenizer, self.vocab_size,
                length=sum(s.steps * accum * s.batch_size * world for s in stages))
            dataset.check()
            sampler: Sampler = CurriculumSampler(stages, accum, rank, world, start_step=step * accum)
            sampling["curriculum"] = [dataclasses.asdict(s) for s in self.cfg.curriculum]
        else:
            dataset = RandomWindows(self._stream("train"), self.cfg.seq_len, self.seed,
                                    length=num_steps * self.batch_size * world)
            sampler = StepBatchSampler(self.batch_size, num_steps, rank, world, start_step=step * accum)
        return self._loader(dataset, loader_cls=StepLoader, sampling=sampling, batch_sampler=sampler)

    def stages(self, accumulate: int = 1) -> list[StagePlan]:
        """The curriculum's stages over this module's ``max_steps`` (:func:`moelab.data.curriculum.plan`)."""
        return plan(self.cfg.curriculum, self.batch_size, self.cfg.seq_len, accumulate, self.max_steps)

    def val_dataloader(self) -> DataLoader:
        rank, world, _, _ = self._placement()
        tokens = self._stream("val")
        n_available = (tokens.size - 1) // self.cfg.seq_len
        if n_available < self.val_batches * self.batch_size:
            warnings.warn(f"the val stream holds {n_available} windows of {self.cfg.seq_len} tokens, fewer than "
                          f"val_batches * batch_size = {self.val_batches * self.batch_size}; validating on all of them",
                          stacklevel=2)
        windows = val_windows(n_available, self.val_batches, self.batch_size, rank, world)
        documents = bool(self.cfg.curriculum) and self.cfg.document_mask  # validate as the run trains
        return self._loader(FixedWindows(tokens, self.cfg.seq_len, windows, documents),
                            batch_size=self.batch_size, shuffle=False)

    # ---------------------------------------------------------------- what the model needs

    @property
    def vocab_size(self) -> int:
        """Ids in the tokenizer (size the embedding with this, not with cfg.vocab_size)."""
        return self._prepared().vocab_size

    @property
    def tokenizer(self) -> Tokenizer:
        return self._prepared().tokenizer()

    # ---------------------------------------------------------------- internals

    def _prepared(self) -> PreparedCorpus:
        if self.corpus is None:
            self.corpus = prepare(self.cfg, progress=False)
        return self.corpus

    def _stream(self, split: str) -> np.ndarray:
        if split not in self._tokens:
            self.setup()
        return self._tokens[split]

    def _placement(self) -> tuple[int, int, int, int]:
        """``(rank, world_size, accumulate_grad_batches, global_step)``; ``(0, 1, 1, 0)`` without a Trainer."""
        trainer = self.trainer
        if trainer is None:
            return 0, 1, 1, 0
        return trainer.global_rank, trainer.world_size, trainer.accumulate_grad_batches, trainer.global_step

    def _loader(self, dataset: Dataset, loader_cls: type[DataLoader] = DataLoader, **kwargs) -> DataLoader:
        workers = self.cfg.num_workers
        return loader_cls(dataset, num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=torch.cuda.is_available(), collate_fn=collate, **kwargs)


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The loaders' batches: the items stacked, and where they carry ``segment_ids`` (packed documents), their
    ``cu_seqlens`` (``moelab.ops.varlen.cu_seqlens``), counted here, in the loader's workers on the CPU, so that the
    forward on the device needs no host sync to count the documents (``MoELab.forward(cu_seqlens=)``)."""
    from moelab.ops.varlen import cu_seqlens

    batch = default_collate(items)
    if "segment_ids" in batch:
        batch["cu_seqlens"] = cu_seqlens(batch["segment_ids"])
    return batch


def _pair(chunk: np.ndarray) -> dict[str, torch.Tensor]:
    """``[T + 1]`` tokens -> inputs ``[T]`` and next-token targets ``[T]``, both int64."""
    ids = torch.from_numpy(chunk.astype(np.int64))
    return {"input_ids": ids[:-1], "targets": ids[1:]}


__all__ = ["FixedWindows", "RandomWindows", "StepBatchSampler", "StepLoader", "TextDataModule", "collate",
           "step_indices", "val_windows", "window_offset"]
