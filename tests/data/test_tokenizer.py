"""Tokenizers: exact round-trip, id ranges, end-of-text id, save/load, deterministic BPE training."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab.data.tokenizer import EOS_ID, EOT, BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe

from .conftest import write_tiny_corpus

SAMPLES = [
    "To be, or not to be: that is the question.",
    "  leading spaces, trailing\t\n\n",
    "naïve café — 東京 ✓ 🙂 \u00a0non-breaking",
    "",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> BPETokenizer:
    paths = write_tiny_corpus(tmp_path_factory.mktemp("tok"), n_docs=6)
    return train_bpe((p.read_text() for p in paths), vocab_size=320)


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256 and tok.eos_id == EOS_ID == 0


@pytest.mark.parametrize("text", SAMPLES)
def test_bpe_round_trip_on_unseen_text(bpe: BPETokenizer, text: str) -> None:
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert EOS_ID not in ids  # the end-of-text id only ever comes from the stream writer
    assert bpe.decode(ids) == text


def test_bpe_vocab_layout(bpe: BPETokenizer) -> None:
    assert bpe.vocab_size == 320
    assert bpe.backend.token_to_id(EOT) == EOS_ID
    assert bpe.decode([EOS_ID]) == EOT
    # merges learned: a frequent corpus word is shorter than its byte count
    assert len(bpe.encode(" queen")) < len(b" queen")
    assert bpe.encode_batch(SAMPLES) == [bpe.encode(s) for s in SAMPLES]


def test_bpe_training_is_deterministic(tmp_path: Path, bpe: BPETokenizer) -> None:
    paths = write_tiny_corpus(tmp_path, n_docs=6)
    again = train_bpe((p.read_text() for p in paths), vocab_size=320)
    assert again.backend.to_str() == bpe.backend.to_str()


@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_save_load(tmp_path: Path, bpe: BPETokenizer, kind: str) -> None:
    tok = bpe if kind == "bpe" else ByteTokenizer()
    tok.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.kind == kind and loaded.vocab_size == tok.vocab_size
    for text in SAMPLES:
        assert loaded.encode(text) == tok.encode(text)
