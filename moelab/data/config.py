"""Data configuration: which corpus, which tokenizer, how long the windows are, where the cache lives.

Relative paths (``files`` globs, ``cache_dir``) resolve against the repository root, so a run
finds the same cache whatever its working directory; see :func:`repo_root`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from moelab.base import ConfigError, _check, _one_of, repo_root

Source = Literal["shakespeare", "gutenberg", "files", "hf"]
TokenizerKind = Literal["bpe", "byte"]

SOURCES: tuple[Source, ...] = get_args(Source)
SYNTHETIC_TASKS = ("passkey", "mqar", "repeat")
DEFAULT_SYNTHETIC_TASKS = ("passkey", "mqar")  # the retrieval tasks; "repeat" (in-context repetition) is opt-in
TOKENIZERS: tuple[TokenizerKind, ...] = get_args(TokenizerKind)
BYTE_VOCAB = 256
# A byte-level BPE needs its 256-byte alphabet plus the end-of-text token before any merge.
MIN_BPE_VOCAB = BYTE_VOCAB + 1
# Ids above 2**31 would not fit the int32 token stream.
MAX_BPE_VOCAB = 2**31 - 1


def resolve_path(path: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded; relative paths are taken from :func:`repo_root`."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else repo_root() / p


@dataclass
class CurriculumStage:
    """One stage of a context curriculum (``data.curriculum``): train at ``seq_len`` for a stretch of steps.

    Length of the stage: ``steps`` optimizer steps, or ``tokens`` (per device, a multiple of the
    run's tokens per optimizer step and device); the last stage may leave both at 0 to run until
    ``train.max_steps``. Validation keeps reading ``data.seq_len`` windows in every stage, so its
    loss stays comparable across stages.
    The micro-batch is resized so that every stage trains on the same tokens per optimizer step
    (``moelab.data.curriculum.plan``). Data mix: a share ``synthetic`` of the stage's sequences are
    retrieval sub-tasks (``synthetic_tasks``, drawn uniformly), the rest are corpus documents
    permuted and concatenated (``moelab.data.curriculum``). ``mqar_pairs``: key-value pairs per
    MQAR sequence.
    ``synthetic_batch_share`` (instead of ``synthetic``, which draws each sequence independently): a
    fixed share of *every* micro-batch's sequences, hence of its tokens (all have the stage's length),
    are retrieval sub-tasks, the tasks taking turns; the stage's micro-batch times the share must be a
    whole number (checked by ``moelab.data.curriculum.plan``), so every optimizer step of every stage
    carries the same share and never a step of retrieval samples only.
    """

    seq_len: int = 0  # required: 0 is refused
    steps: int = 0
    tokens: int = 0
    synthetic: float = 0.0
    synthetic_tasks: list[str] = field(default_factory=lambda: list(DEFAULT_SYNTHETIC_TASKS))
    mqar_pairs: int = 8
    synthetic_batch_share: float = 0.0

    def validate(self, name: str = "data.curriculum[0]") -> CurriculumStage:
        """Check the fields that need no other section (``name`` prefixes the messages); return self."""
        _check(_is_int(self.seq_len) and self.seq_len >= 1, f"{name}.seq_len", self.seq_len, "an integer >= 1")
        _check(_is_int(self.steps) and self.steps >= 0, f"{name}.steps", self.steps, "an integer >= 0")
        _check(_is_int(self.tokens) and self.tokens >= 0, f"{name}.tokens", self.tokens, "an integer >= 0")
        _check(not (self.steps and self.tokens), f"{name}.tokens", self.tokens,
               f"0 when {name}.steps is given ({self.steps}): a stage's length is steps or tokens, not both")
        _check(isinstance(self.synthetic, (int, float)) and 0.0 <= self.synthetic <= 1.0, f"{name}.synthetic",
               self.synthetic, "a share in [0, 1]")
        _check(isinstance(self.synthetic_batch_share, (int, float)) and not isinstance(self.synthetic_batch_share, bool)
               and 0.0 <= self.synthetic_batch_share <= 1.0, f"{name}.synthetic_batch_share",
               self.synthetic_batch_share, "a share in [0, 1]")
        _check(not (self.synthetic and self.synthetic_batch_share), f"{name}.synthetic_batch_share",
               self.synthetic_batch_share, f"0 when {name}.synthetic is given ({self.synthetic}): the retrieval "
               "share is drawn per sequence (synthetic) or fixed per micro-batch (synthetic_batch_share), not both")
        _check(len(self.synthetic_tasks) > 0 and all(t in SYNTHETIC_TASKS for t in self.synthetic_tasks)
               and len(set(self.synthetic_tasks)) == len(self.synthetic_tasks), f"{name}.synthetic_tasks",
               self.synthetic_tasks, f"a non-empty list of distinct names from {SYNTHETIC_TASKS}")
        _check(_is_int(self.mqar_pairs) and self.mqar_pairs >= 1, f"{name}.mqar_pairs", self.mqar_pairs,
               "an integer >= 1")
        if (self.synthetic > 0 or self.synthetic_batch_share > 0) and "mqar" in self.synthetic_tasks:
            need = 4 * self.mqar_pairs - 1  # the pairs, then every key asked once with its value
            _check(self.seq_len >= need, f"{name}.seq_len", self.seq_len,
                   f">= {need} for MQAR with mqar_pairs={self.mqar_pairs}")
        return self


@dataclass
class DataConfig:
    """Where text comes from and how it becomes ``[B, seq_len]`` token windows.

    ``source``: ``"shakespeare"`` unpacks the committed ``data/shakespeare.tar.xz`` (one play = one
    document; the CPU presets' corpus), ``"gutenberg"`` the committed ``data/gutenberg.tar.xz`` (one
    e-book = one document; the GPU presets' corpus, see data/README.md), ``"files"`` reads every
    file matched by the ``files`` globs (one file = one document),
    ``"hf"`` calls ``datasets.load_dataset(hf_name, hf_config, split=hf_split)[text_field]`` (one row
    = one document; needs the hub or a local datasets cache).
    ``tokenizer``: ``"bpe"`` is a byte-level BPE trained on the train split (``vocab_size`` ids,
    id 0 = end of text); ``"byte"`` maps UTF-8 bytes to ids 0..255 (byte 0 = end of text).
    ``seq_len``: the window of validation, and of training without a curriculum.
    ``curriculum``: stages of training lengths (:class:`CurriculumStage`); empty: every step
    trains on random ``seq_len`` windows of the train stream.
    ``document_mask``: with a curriculum, whose training sequences are documents packed with their
    boundaries marked, keep the documents apart (``segment_ids`` reach the model: every token
    mixer restarts at each boundary, ``moelab.model.documents``), and validate the same way (the
    val windows' documents are cut at each end-of-text id). False: context runs across documents.
    Runs without a curriculum read plain windows of the stream, never masked.
    """

    source: Source = "shakespeare"
    files: list[str] = field(default_factory=list)
    hf_name: str = ""
    hf_config: str = ""
    hf_split: str = "train"
    text_field: str = "text"
    tokenizer: TokenizerKind = "bpe"
    vocab_size: int = 4096  # bpe only; byte -> 256
    seq_len: int = 256
    val_fraction: float = 0.05  # share of documents (not tokens) held out, at least one document
    split_seed: int = 1234
    cache_dir: str = "data/cache"
    num_workers: int = 0
    curriculum: list[CurriculumStage] = field(default_factory=list)
    document_mask: bool = True

    def validate(self) -> DataConfig:
        """Check every field; return self so calls chain. Raises ConfigError naming field and range."""
        _one_of("data.source", self.source, SOURCES)
        _one_of("data.tokenizer", self.tokenizer, TOKENIZERS)
        _check(isinstance(self.files, (list, tuple)) and all(isinstance(f, str) and f for f in self.files),
               "data.files", self.files, "a list of non-empty glob strings")
        if self.source == "files":
            _check(len(self.files) > 0, "data.files", self.files, "at least one glob when source='files'")
        if self.source == "hf":
            _check(isinstance(self.hf_name, str) and bool(self.hf_name), "data.hf_name", self.hf_name,
                   "a datasets hub name (e.g. 'roneneldan/TinyStories') when source='hf'")
            _check(isinstance(self.hf_split, str) and bool(self.hf_split), "data.hf_split", self.hf_split,
                   "a split name such as 'train'")
            _check(isinstance(self.text_field, str) and bool(self.text_field), "data.text_field",
                   self.text_field, "the name of the text column")
        if self.tokenizer == "bpe":
            _check(_is_int(self.vocab_size) and MIN_BPE_VOCAB <= self.vocab_size <= MAX_BPE_VOCAB,
                   "data.vocab_size", self.vocab_size, f"an integer in {MIN_BPE_VOCAB}..{MAX_BPE_VOCAB} for bpe")
        _check(_is_int(self.seq_len) and self.seq_len >= 1, "data.seq_len", self.seq_len, "an integer >= 1")
        _check(isinstance(self.val_fraction, (int, float)) and 0.0 < self.val_fraction < 1.0,
               "data.val_fraction", self.val_fraction, "a number in the open interval (0, 1)")
        _check(_is_int(self.split_seed) and self.split_seed >= 0, "data.split_seed", self.split_seed,
               "an integer >= 0")
        _check(isinstance(self.cache_dir, (str, os.PathLike)) and str(self.cache_dir) != "", "data.cache_dir",
               self.cache_dir, "a non-empty path")
        _check(_is_int(self.num_workers) and self.num_workers >= 0, "data.num_workers", self.num_workers,
               "an integer >= 0")
        _check(isinstance(self.curriculum, list), "data.curriculum", self.curriculum, "a list of stages")
        _check(isinstance(self.document_mask, bool), "data.document_mask", self.document_mask, "true or false")
        for i, stage in enumerate(self.curriculum):
            stage.validate(f"data.curriculum[{i}]")
            if i < len(self.curriculum) - 1:
                _check(stage.steps > 0 or stage.tokens > 0, f"data.curriculum[{i}].steps", stage.steps,
                       "an integer >= 1 (or tokens >= 1): only the last stage may run until train.max_steps")
        return self

    @property
    def effective_vocab_size(self) -> int:
        """Requested vocabulary size: ``vocab_size`` for bpe, 256 for byte."""
        return BYTE_VOCAB if self.tokenizer == "byte" else self.vocab_size


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


__all__ = ["ConfigError", "CurriculumStage", "DataConfig", "repo_root", "resolve_path"]
