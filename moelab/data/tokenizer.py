"""Tokenizers that need no download: a byte-level BPE trained offline, and raw UTF-8 bytes.

Both reserve id 0 for the end-of-text token that separates documents in the token streams:
``<|endoftext|>`` for BPE, the NUL byte for the byte tokenizer (text never holds it in practice).
Both round-trip any Unicode string exactly: ``decode(encode(s)) == s``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

EOT = "<|endoftext|>"
EOS_ID = 0


class Tokenizer(ABC):
    """String <-> list of int ids. ``vocab_size`` ids, ``eos_id`` separates documents."""

    kind: str
    eos_id: int = EOS_ID

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; every id is in ``0 .. vocab_size - 1``."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no end-of-text appended)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; the end-of-text id decodes to its marker (``<|endoftext|>`` or ``\\x00``)."""

    @abstractmethod
    def save(self, path: str | Path) -> None:
        """Write the tokenizer to one JSON file that :func:`load_tokenizer` reads back."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``; BPE runs it on all cores."""
        return [self.encode(t) for t in texts]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; needs no training. Invalid UTF-8 in ``decode`` becomes U+FFFD."""

    kind = "byte"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"moelab_tokenizer": "byte", "vocab_size": 256, "eos_id": EOS_ID}) + "\n")


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenization) backed by a HuggingFace ``tokenizers.Tokenizer``."""

    kind = "bpe"

    def __init__(self, backend) -> None:  # backend: tokenizers.Tokenizer
        self.backend = backend
        eos = backend.token_to_id(EOT)
        if eos != EOS_ID:
            raise ValueError(f"BPE tokenizer must map {EOT!r} to id {EOS_ID}, found {eos!r}")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))


def train_bpe(texts: Iterable[str], vocab_size: int, length: int | None = None) -> BPETokenizer:
    """Train a byte-level BPE with ``vocab_size`` ids on ``texts`` (deterministic for the same input).

    The vocabulary is the end-of-text token (id 0), the 256 byte symbols, then merges; a small
    corpus may stop with fewer ids than asked (every pair seen twice or more is merged).
    ``min_frequency=2`` keeps one-off pairs (typos, rare names) out of the vocabulary.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(s)) == s for every string.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer, length=length)
    return BPETokenizer(backend)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a tokenizer written by :meth:`Tokenizer.save`."""
    path = Path(path)
    spec = json.loads(path.read_text())
    if spec.get("moelab_tokenizer") == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    return BPETokenizer(HFTokenizer.from_file(str(path)))


__all__ = ["EOS_ID", "EOT", "BPETokenizer", "ByteTokenizer", "Tokenizer", "load_tokenizer", "train_bpe"]
