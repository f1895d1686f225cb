"""Context curriculum: stages of training lengths at constant tokens per step, and long sequences built from documents.

A curriculum (``data.curriculum``, a list of :class:`moelab.data.config.CurriculumStage`) trains
stage after stage at growing sequence lengths, as the report's 8K -> 64K -> 256K -> 1M schedule
does. :func:`plan` turns the stages into optimizer-step ranges and per-stage micro-batch sizes:

* **Tokens per optimizer step stay constant** because the micro-batch shrinks as the sequences
  grow: ``batch_k = train.batch_size * data.seq_len / seq_len_k``. The batch is adjusted rather
  than the gradient accumulation because Lightning fixes ``accumulate_grad_batches`` for a whole
  ``fit`` (its scheduler changes it only between epochs, and a moelab run is one epoch), and
  because one micro-batch per ``accumulate_grad_batches``-th of a step keeps the step -> batch
  mapping, hence exact resume, as simple as without a curriculum. The activation memory of the
  token-wise layers (FFN, MoE, projections, the KDA chunks) stays the same from stage to stage.
* **The learning-rate schedule runs across stages**: it is a function of the optimizer step over
  ``train.max_steps`` (the sum of the stages), never restarted at a stage boundary.
* **Resume is exact in the middle of any stage**: micro-step ``m`` belongs to the stage holding
  optimizer step ``m // accumulate``, and its items are numbered within that stage, so a resumed
  sampler recomputes the same items from ``trainer.global_step`` alone (:class:`CurriculumSampler`).

Each training sequence of a stage (:class:`CurriculumSequences`) is, by a seeded draw per item,
either a **document pack**, the corpus documents concatenated in random order (the report
synthesizes long data by permuting and concatenating documents) with their boundaries kept (each
document ends with the end-of-text id, and ``segment_ids`` numbers the documents of the sample,
from which ``moelab.ops.varlen.cu_seqlens`` gives the offsets a packed-sequence kernel takes), or,
with probability ``synthetic``, a retrieval sub-task (passkey or MQAR from :mod:`moelab.data.synthetic`)
whose loss is on its answers only. With ``synthetic_batch_share`` instead, the first
``batch_size_k * synthetic_batch_share`` sequences of every micro-batch are the sub-tasks (taking turns
across the run's retrieval slots), so every step of every stage holds the same share of retrieval
tokens: the passkey's filler is corpus text the document packs already train on, and MQAR's random
pairs are unpredictable before they are asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from moelab.base import ConfigError, _check
from moelab.data.config import CurriculumStage
from moelab.data.synthetic import mqar, passkey, repeat
from moelab.data.tokenizer import EOS_ID, Tokenizer

_STAGE_SHIFT = 64  # Philox counter of item i of stage k: (k << 64) | i, so no two items of a run share one


@dataclass(frozen=True)
class StagePlan:
    """Where stage ``index`` sits in the run: optimizer steps ``start_step .. start_step + steps - 1``,
    ``batch_size`` sequences of ``seq_len`` tokens per device and micro-batch, and its data mix."""

    index: int
    seq_len: int
    batch_size: int
    start_step: int
    steps: int
    synthetic: float
    synthetic_tasks: tuple[str, ...]
    mqar_pairs: int
    synthetic_per_batch: int = 0  # retrieval sequences at the head of every micro-batch (synthetic_batch_share)

    @property
    def end_step(self) -> int:
        """The optimizer step after the stage's last one."""
        return self.start_step + self.steps


def plan(stages: Sequence[CurriculumStage], batch_size: int, seq_len: int, accumulate: int,
         max_steps: int) -> list[StagePlan]:
    """Step ranges and micro-batch sizes of ``stages`` for a run of ``max_steps`` optimizer steps.

    ``batch_size * seq_len`` (``train.batch_size`` x ``data.seq_len``) are the tokens of one
    micro-batch, held in every stage; a stage's ``tokens`` count per device, in units of one
    optimizer step (``batch_size * seq_len * accumulate``), since the run's length is counted in
    steps whatever the number of devices. Raises ConfigError when a stage cannot keep the tokens
    per step (its length does not divide them, or leaves a batch below 1), when ``tokens`` is not
    a whole number of steps, or when the stages do not add up to ``max_steps``.
    """
    micro_tokens = batch_size * seq_len
    step_tokens = micro_tokens * accumulate
    out: list[StagePlan] = []
    start = 0
    for i, stage in enumerate(stages):
        name = f"data.curriculum[{i}]"
        _check(stage.seq_len <= micro_tokens, f"{name}.seq_len", stage.seq_len,
               f"<= the tokens of one micro-batch, train.batch_size x data.seq_len = {batch_size} x {seq_len} = "
               f"{micro_tokens} (a longer stage would need a batch below 1 sequence; raise train.batch_size)")
        _check(micro_tokens % stage.seq_len == 0, f"{name}.seq_len", stage.seq_len,
               f"a divisor of the tokens of one micro-batch, train.batch_size x data.seq_len = {micro_tokens}, "
               f"so that every stage trains on the same tokens per step")
        if stage.tokens:
            _check(stage.tokens % step_tokens == 0, f"{name}.tokens", stage.tokens,
                   f"a multiple of the tokens per optimizer step and device, train.batch_size x data.seq_len x "
                   f"train.accumulate_grad_batches = {step_tokens}")
            steps = stage.tokens // step_tokens
        elif stage.steps:
            steps = stage.steps
        else:  # the last stage, open-ended (validate() allows no other)
            steps = max_steps - start
            _check(steps >= 1, "train.max_steps", max_steps,
                   f"> {start}, the steps of the stages before the open-ended last one")
        batch = micro_tokens // stage.seq_len
        per_batch = batch * float(stage.synthetic_batch_share)
        _check(abs(per_batch - round(per_batch)) < 1e-9, f"{name}.synthetic_batch_share", stage.synthetic_batch_share,
               f"a multiple of 1/{batch}: the stage's micro-batch of {batch} sequences of {stage.seq_len} tokens "
               f"must hold a whole number of retrieval sequences (now {per_batch:g})")
        out.append(StagePlan(i, stage.seq_len, batch, start, steps, float(stage.synthetic),
                             tuple(stage.synthetic_tasks), stage.mqar_pairs, int(round(per_batch))))
        start += steps
    if out and start != max_steps:
        raise ConfigError(f"train.max_steps={max_steps} is not allowed: expected the sum of the curriculum's stages, "
                          f"{' + '.join(str(s.steps) for s in out)} = {start} optimizer steps (or leave the last "
                          f"stage's steps and tokens at 0 to run it until train.max_steps)")
    return out


def stage_at(stages: Sequence[StagePlan], step: int) -> StagePlan:
    """The stage that optimizer step ``step`` (0-based) trains in."""
    for stage in stages:
        if stage.start_step <= step < stage.end_step:
            return stage
    raise ValueError(f"step={step} is not allowed: expected 0..{stages[-1].end_step - 1}")


class DocumentPacker:
    """Samples of any length from the documents of a token stream (documents joined by ``eos_id``).

    :meth:`pack` starts at a uniformly drawn token, runs to the end of its document, then appends
    whole documents, each the one holding another uniformly drawn token (so documents come in
    proportion to their length, as in the stream), until the sample is full. Documents repeat only
    when a sample is longer than the corpus would need; cost O(length + log(#documents) per document).
    """

    def __init__(self, tokens: np.ndarray, eos_id: int = EOS_ID) -> None:
        if tokens.size == 0:
            raise ValueError("the token stream is empty")
        self.tokens = tokens
        ends = np.flatnonzero(tokens == eos_id)
        if ends.size == 0 or ends[-1] != tokens.size - 1:  # a last document without its end-of-text
            ends = np.append(ends, tokens.size - 1)
        self.ends = ends  # [D] index of each document's last token (its end-of-text)

    def _document(self, pos: int) -> int:
        """Number of the document holding token ``pos``."""
        return int(np.searchsorted(self.ends, pos))

    def pack(self, length: int, bitgen: np.random.BitGenerator) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [length] int64, segment_ids [length] int32)`` drawn with ``bitgen``'s raw outputs.

        ``segment_ids[t]`` is the number of the document token t belongs to (0 for the first);
        a document's end-of-text token belongs to it.
        """
        n = self.tokens.size
        pieces, filled = [], 0
        pos = int(bitgen.random_raw()) % n
        while filled < length:
            end = int(self.ends[self._document(pos)]) + 1
            piece = self.tokens[pos: min(end, pos + length - filled)]
            pieces.append(piece)
            filled += piece.size
            doc = self._document(int(bitgen.random_raw()) % n)
            pos = int(self.ends[doc - 1]) + 1 if doc > 0 else 0
        ids = np.concatenate(pieces).astype(np.int64)
        segments = np.repeat(np.arange(len(pieces), dtype=np.int32), [p.size for p in pieces])
        return ids, segments


class CurriculumSequences(Dataset):
    """Map-style dataset of the curriculum's training sequences; item ``(k, i)`` is sequence ``i`` of stage ``k``.

    Items are ``{"input_ids": [T] int64, "targets": [T] int64, "segment_ids": [T] int32}`` with
    ``T = stages[k].seq_len``: a document pack (targets = next tokens) or, with the stage's
    ``synthetic`` probability (or at the first ``synthetic_per_batch`` positions of each micro-batch:
    item ``i`` sits at position ``i % batch_size`` of micro-batch ``i // batch_size``), a passkey / MQAR
    sample (targets -100 except at its answers,
    ``segment_ids`` 0). Every draw comes from Philox(key=seed, counter=(k << 64) | i), so any item
    is computed without the ones before it, in any worker. ``vocab_size``: ids MQAR may use.
    """

    def __init__(self, tokens: np.ndarray, stages: Sequence[StagePlan], seed: int, tokenizer: Tokenizer,
                 vocab_size: int, length: int) -> None:
        self.packer = DocumentPacker(tokens, tokenizer.eos_id)
        self.stages, self.seed, self.tokenizer, self.vocab_size = list(stages), seed, tokenizer, vocab_size
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: tuple[int, int]) -> dict[str, torch.Tensor]:
        k, i = item
        stage = self.stages[k]
        T = stage.seq_len
        bitgen = np.random.Philox(key=self.seed, counter=(k << _STAGE_SHIFT) | i)
        if stage.synthetic_per_batch:
            slot = i % stage.batch_size
            synthetic = slot < stage.synthetic_per_batch
        else:
            synthetic = stage.synthetic > 0 and int(bitgen.random_raw()) < stage.synthetic * 2.0**64
        if not synthetic:
            ids, segments = self.packer.pack(T + 1, bitgen)
            return {"input_ids": torch.from_numpy(ids[:-1]), "targets": torch.from_numpy(ids[1:]),
                    "segment_ids": torch.from_numpy(segments[:-1])}
        if stage.synthetic_per_batch:  # the tasks take turns over the run's retrieval slots: equal shares
            turn = (i // stage.batch_size) * stage.synthetic_per_batch + slot
            task = stage.synthetic_tasks[turn % len(stage.synthetic_tasks)]
        else:
            task = stage.synthetic_tasks[int(bitgen.random_raw()) % len(stage.synthetic_tasks)]
        seed = int(bitgen.random_raw())
        if task == "passkey":
            filler, _ = self.packer.pack(T, bitgen)
            batch = passkey(self.tokenizer, 1, T, seed=seed, filler=filler)
        elif task == "repeat":
            span, _ = self.packer.pack((T + 2) // 2, bitgen)
            batch = repeat(1, T, span, seed=seed)
        else:
            batch = mqar(1, T, self.vocab_size, stage.mqar_pairs, seed=seed)
        return {"input_ids": torch.from_numpy(batch.input_ids[0]), "targets": torch.from_numpy(batch.targets[0]),
                "segment_ids": torch.zeros(T, dtype=torch.int32)}

    def check(self) -> None:
        """Build one sample of every synthetic task of every stage: a stage too short for its task fails
        here, before training, with the stage named (ConfigError)."""
        for stage in self.stages:
            if stage.synthetic == 0 and stage.synthetic_per_batch == 0:
                continue
            for task in stage.synthetic_tasks:
                try:
                    if task == "passkey":
                        passkey(self.tokenizer, 1, stage.seq_len)
                    elif task == "repeat":
                        repeat(1, stage.seq_len, np.arange(1, 4))
                    else:
                        mqar(1, stage.seq_len, self.vocab_size, stage.mqar_pairs)
                except ValueError as e:
                    raise ConfigError(f"data.curriculum[{stage.index}] (seq_len={stage.seq_len}) cannot hold its "
                                      f"{task} sub-task: {e}") from e


class CurriculumSampler(Sampler[list[tuple[int, int]]]):
    """The micro-batches of a curriculum run on ``rank`` of ``world_size``, from micro-step ``start_step`` on.

    Micro-step ``m`` trains in stage ``k`` = the stage of optimizer step ``m // accumulate``; with
    ``l = m - start_step_k * accumulate`` and ``B = batch_size_k``, rank ``r`` reads items
    ``(k, l*B*W + r*B + j)`` for ``j < B``. ``len()`` is the whole run's micro-steps (see
    :class:`moelab.data.datamodule.StepBatchSampler` for why a resumed loader reports them all).
    """

    def __init__(self, stages: Sequence[StagePlan], accumulate: int, rank: int = 0, world_size: int = 1,
                 start_step: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not allowed: expected 0..{world_size - 1}")
        self.stages, self.accumulate, self.rank, self.world_size = list(stages), accumulate, rank, world_size
        self.num_steps = self.stages[-1].end_step * accumulate
        if not 0 <= start_step <= self.num_steps:
            raise ValueError(f"start_step={start_step} is not allowed: expected 0..{self.num_steps}")
        self.start_step = start_step

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for m in range(self.start_step, self.num_steps):
            stage = stage_at(self.stages, m // self.accumulate)
            B, W = stage.batch_size, self.world_size
            base = (m - stage.start_step * self.accumulate) * B * W + self.rank * B
            yield [(stage.index, base + j) for j in range(B)]


__all__ = ["CurriculumSampler", "CurriculumSequences", "DocumentPacker", "StagePlan", "plan",
           "stage_at"]
