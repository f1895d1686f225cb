"""Passkey places the needle at the asked depth; generator batches become whole samples with their answer
tokens marked; effective context and bytes per token are read off correctly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.data.synthetic import PASSKEY_NEEDLE, PASSKEY_PREFIX, mqar, passkey
from moelab.data.tokenizer import ByteTokenizer
from moelab.eval.tasks import bytes_per_token, effective_context, synthetic_span


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_passkey_needle_sits_at_the_asked_depth(depth: float) -> None:
    tok, T = ByteTokenizer(), 700
    b = passkey(tok, n=3, seq_len=T, depth=depth, seed=4)
    prefix = len(tok.encode(PASSKEY_PREFIX))
    for i in range(3):
        key = int(b.meta["keys"][i])
        needle = tok.encode(PASSKEY_NEEDLE.format(key=key))
        answer = len(tok.encode(f" {key}"))
        question_and_answer = len(tok.encode("\nWhat is the pass key? The pass key is")) + answer
        n_fill = T + 1 - prefix - len(needle) - question_and_answer
        pos = int(b.meta["needle_pos"][i])
        assert pos - prefix == round(depth * n_fill)  # the share of the filler before the needle
        assert b.input_ids[i, pos: pos + len(needle)].tolist() == needle
        ids, mask = synthetic_span(b)
        assert torch.equal(ids[i, :-1], torch.from_numpy(b.input_ids[i]))
        assert mask[i].sum() == answer and mask[i, -answer:].all()  # the answer closes the sample
        assert tok.decode(ids[i][mask[i]].tolist()) == f" {key}"


def test_synthetic_span_marks_every_mqar_value() -> None:
    b = mqar(n=4, seq_len=64, vocab_size=64, num_pairs=6, seed=1)
    ids, mask = synthetic_span(b)
    assert mask.sum(1).tolist() == [6] * 4
    for i in range(4):
        pairs = dict(zip(b.meta["keys"][i].tolist(), b.meta["values"][i].tolist()))
        queries = np.flatnonzero(mask[i].numpy()) - 1  # each answer follows its key
        assert [pairs[int(ids[i, q])] for q in queries] == ids[i][mask[i]].tolist()


def test_effective_context_and_bytes_per_token() -> None:
    lengths = [512, 1024, 2048, 4096]
    assert effective_context(lengths, [1.0, 0.95, 0.9, 0.2]) == 2048
    assert effective_context(lengths, [1.0, 0.5, 1.0, 1.0]) == 512  # a later success does not bridge a gap
    assert effective_context(lengths, [0.8, 1.0, 1.0, 1.0]) == 0
    assert bytes_per_token([100, 300], [1000 + 128 * 100, 1000 + 128 * 300]) == pytest.approx(128)
    assert bytes_per_token([100], [5]) is None
