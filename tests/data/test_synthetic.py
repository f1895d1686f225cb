"""Synthetic long-context tasks: layout, answers, determinism, any length."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.data.synthetic import IGNORE, mqar, passkey, repeat
from moelab.data.tokenizer import ByteTokenizer


@pytest.mark.parametrize("seq_len", [256, 4096])
def test_passkey_byte(seq_len: int) -> None:
    tok = ByteTokenizer()
    b = passkey(tok, n=3, seq_len=seq_len, digits=5, seed=1)
    assert b.input_ids.shape == b.targets.shape == (3, seq_len) and b.input_ids.dtype == np.int64
    for i in range(3):
        key = str(int(b.meta["keys"][i]))
        assert len(key) == 5
        pos = b.answer_pos[i]
        assert (b.targets[i] != IGNORE).sum() == len(pos) == 6  # " " + 5 digits
        assert tok.decode(b.targets[i, pos]) == " " + key
        # the needle is in the inputs before the question, and the inputs end with the question
        text = tok.decode(b.input_ids[i])
        assert f"The pass key is {key}." in text and text.endswith("The pass key is" + " " + key[:-1])
        # targets are next-token: the input after each answer position is the answer token itself
        assert np.array_equal(b.input_ids[i, pos[1:]], b.targets[i, pos[:-1]])


def test_passkey_depth_and_filler(shakespeare) -> None:
    tok = shakespeare.tokenizer()
    stream = shakespeare.load_tokens("val")
    shallow = passkey(tok, n=2, seq_len=512, depth=0.0, seed=0, filler=stream)
    deep = passkey(tok, n=2, seq_len=512, depth=1.0, seed=0, filler=stream)
    assert (shallow.meta["needle_pos"] < deep.meta["needle_pos"]).all()
    for b in (shallow, deep):
        for i in range(2):
            key = str(int(b.meta["keys"][i]))
            answer = b.targets[i][b.targets[i] != IGNORE]
            assert tok.decode(answer) == " " + key
            needle = tok.decode(b.input_ids[i, b.meta["needle_pos"][i]:])
            assert needle.startswith(f" The pass key is {key}.")
    again = passkey(tok, n=2, seq_len=512, depth=1.0, seed=0, filler=stream)
    assert np.array_equal(again.input_ids, deep.input_ids) and np.array_equal(again.targets, deep.targets)
    with pytest.raises(ValueError, match="seq_len=20"):
        passkey(tok, n=1, seq_len=20)
    with pytest.raises(ValueError, match="depth=1.5"):
        passkey(tok, n=1, seq_len=512, depth=1.5)


@pytest.mark.parametrize(("seq_len", "pairs", "queries"), [(64, 8, 8), (1024, 32, 16), (8192, 64, None)])
def test_mqar(seq_len: int, pairs: int, queries: int | None) -> None:
    b = mqar(n=5, seq_len=seq_len, vocab_size=512, num_pairs=pairs, num_queries=queries, seed=2)
    q = pairs if queries is None else queries
    assert b.input_ids.shape == b.targets.shape == (5, seq_len)
    for i in range(5):
        x, y = b.input_ids[i], b.targets[i]
        keys, values = x[0: 2 * pairs: 2], x[1: 2 * pairs: 2]
        assert len(set(keys.tolist())) == pairs and keys.max() < 256 <= values.min()
        table = dict(zip(keys.tolist(), values.tolist()))
        pos = np.flatnonzero(y != IGNORE)
        assert len(pos) == q and np.array_equal(pos, b.answer_pos[i])
        assert len(set(x[pos].tolist())) == q  # distinct queried keys
        for p in pos:  # each query key's target is its value
            assert y[p] == table[int(x[p])]
            if p + 1 < seq_len:
                assert x[p + 1] == y[p]
        gaps = np.ones(seq_len, bool)
        gaps[: 2 * pairs] = False
        gaps[pos] = False
        gaps[np.minimum(pos + 1, seq_len - 1)] = False
        assert (x[gaps] == 0).all()
    again = mqar(n=5, seq_len=seq_len, vocab_size=512, num_pairs=pairs, num_queries=queries, seed=2)
    assert np.array_equal(again.input_ids, b.input_ids)
    batch = b.as_torch()
    assert batch["input_ids"].dtype == torch.int64 and batch["targets"].shape == (5, seq_len)


def test_mqar_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seq_len=10"):
        mqar(n=1, seq_len=10, vocab_size=64, num_pairs=4)
    with pytest.raises(ValueError, match="num_pairs=40"):
        mqar(n=1, seq_len=1000, vocab_size=64, num_pairs=40)
    with pytest.raises(ValueError, match="num_queries=5"):
        mqar(n=1, seq_len=1000, vocab_size=64, num_pairs=4, num_queries=5)


@pytest.mark.parametrize("seq_len", [3, 8, 9, 257])
def test_repeat_copies_a_span_and_marks_the_copies(seq_len: int) -> None:
    """``repeat``: a span of the stream then the same span; every position is a target (the next token), and
    ``answer_pos`` are the positions whose target the earlier copy predicts exactly (not the repeat's first token)."""
    stream = np.arange(1000, 1400)
    b = repeat(3, seq_len, stream, seed=4)
    span = (seq_len + 2) // 2
    seq = np.concatenate([b.input_ids, b.targets[:, -1:]], axis=1)  # the seq_len + 1 tokens
    assert b.input_ids.shape == b.targets.shape == (3, seq_len) and (b.targets != IGNORE).all()
    assert (b.targets[:, :-1] == b.input_ids[:, 1:]).all()
    assert (seq[:, span:] == seq[:, : seq_len + 1 - span]).all()  # the second copy repeats the first
    assert (np.diff(seq[:, :span], axis=1) == 1).all()  # a contiguous span of this stream (no wrap: it is long)
    for i in range(3):
        for t in b.answer_pos[i]:  # the target at t is the token one after t's earlier occurrence
            assert b.targets[i, t] == b.input_ids[i, t - span + 1] and b.input_ids[i, t] == b.input_ids[i, t - span]
    assert b.answer_pos.shape == (3, seq_len - span)
    assert (repeat(3, seq_len, stream, seed=4).input_ids == b.input_ids).all()  # seeded
    short = repeat(2, seq_len, np.arange(5, 7), seed=1)  # a stream shorter than a span: read cyclically
    assert set(np.unique(short.input_ids)) <= {5, 6}
    with pytest.raises(ValueError, match="seq_len=2 are not allowed"):
        repeat(1, 2, stream)
    with pytest.raises(ValueError, match="stream is empty"):
        repeat(1, 8, np.array([], dtype=np.int64))
