"""Synthetic long-context tasks: passkey retrieval, multi-query associative recall (MQAR) and in-context repetition.

Both return next-token pairs shaped like the DataModule's batches, plus a loss mask convention:
``input_ids [N, T]`` int64 and ``targets [N, T]`` int64 where every position that is not an
answer holds ``IGNORE`` (-100, PyTorch cross-entropy's ``ignore_index``). A sample is solved
when every non-ignored target is the argmax prediction. Generation is numpy-only, seeded, and
costs O(N * T), so any context length is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moelab.data.tokenizer import Tokenizer

IGNORE = -100

PASSKEY_PREFIX = ("There is an important piece of information hidden inside a lot of irrelevant text. "
                  "Find it and memorize it; you will be asked about it.\n")
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key.\n"
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"
PASSKEY_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass
class SyntheticBatch:
    """``input_ids``/``targets`` ``[N, T]`` int64 (targets = ``IGNORE`` except at answers);
    ``answer_pos`` ``[N, A]``: positions t whose target is an answer token;
    ``meta``: per-task extras (passkey: ``keys``, ``needle_pos``, ``depth``, each ``[N]``;
    mqar: ``keys``, ``values``, each ``[N, num_pairs]``)."""

    input_ids: np.ndarray
    targets: np.ndarray
    answer_pos: np.ndarray
    meta: dict

    def as_torch(self) -> dict:
        """``{"input_ids", "targets"}`` as int64 torch tensors, the DataModule's batch layout."""
        import torch

        return {"input_ids": torch.from_numpy(self.input_ids), "targets": torch.from_numpy(self.targets)}


def passkey(tokenizer: Tokenizer, n: int, seq_len: int, depth: float | None = None, digits: int = 5,
            seed: int = 0, filler: np.ndarray | None = None) -> SyntheticBatch:
    """Passkey retrieval: a ``digits``-digit key hidden in filler, asked for at the end.

    Layout of each sample (``seq_len + 1`` tokens, inputs are the first ``seq_len``)::

        prefix | filler | needle("The pass key is K ...") | filler | question | " K"

    ``depth`` in [0, 1] places the needle at that fraction of the filler (None: uniform per sample).
    ``filler``: a token stream (e.g. a val stream) to cut haystacks from at seeded offsets;
    None repeats a neutral sentence. Targets are set only where the next token belongs to " K".
    """
    if n < 1 or seq_len < 1:
        raise ValueError(f"n={n}, seq_len={seq_len} are not allowed: expected integers >= 1")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} is not allowed: expected a number in [0, 1] or None")
    if not 1 <= digits <= 18:
        raise ValueError(f"digits={digits} is not allowed: expected 1..18")
    rng = np.random.default_rng(seed)
    prefix = tokenizer.encode(PASSKEY_PREFIX)
    question = tokenizer.encode(PASSKEY_QUESTION)
    haystack = np.asarray(filler if filler is not None else tokenizer.encode(PASSKEY_FILLER), dtype=np.int64)
    if haystack.size == 0:
        raise ValueError("filler is empty")

    keys = rng.integers(10 ** (digits - 1), 10**digits, size=n)
    depths = rng.random(n) if depth is None else np.full(n, depth)
    input_ids = np.zeros((n, seq_len), dtype=np.int64)
    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    answer_pos, needle_pos = [], np.zeros(n, dtype=np.int64)
    for i in range(n):
        needle = tokenizer.encode(PASSKEY_NEEDLE.format(key=int(keys[i])))
        answer = tokenizer.encode(f" {int(keys[i])}")
        n_fill = seq_len + 1 - len(prefix) - len(needle) - len(question) - len(answer)
        if n_fill < 0:
            raise ValueError(f"seq_len={seq_len} is not allowed: a passkey sample needs at least "
                             f"{seq_len - n_fill} tokens with this tokenizer")
        start = int(rng.integers(0, haystack.size)) if filler is not None else 0
        fill = haystack[(start + np.arange(n_fill)) % haystack.size]  # cyclic: any length from any stream
        cut = int(round(float(depths[i]) * n_fill))
        seq = np.concatenate([prefix, fill[:cut], needle, fill[cut:], question, answer]).astype(np.int64)
        input_ids[i], needle_pos[i] = seq[:-1], len(prefix) + cut
        pos = np.arange(seq_len + 1 - len(answer) - 1, seq_len)  # predict each answer token
        targets[i, pos] = seq[pos + 1]
        answer_pos.append(pos)
    width = max(len(p) for p in answer_pos)
    padded = np.full((n, width), -1, dtype=np.int64)  # -1: no answer token (keys' encodings may differ in length)
    for i, p in enumerate(answer_pos):
        padded[i, : len(p)] = p
    return SyntheticBatch(input_ids, targets, padded, {"keys": keys, "needle_pos": needle_pos, "depth": depths})


def repeat(n: int, seq_len: int, stream: np.ndarray, seed: int = 0) -> SyntheticBatch:
    """In-context repetition: a span of ``stream`` (e.g. corpus text) followed by the same span again.

    Each sample (``seq_len + 1`` tokens, inputs the first ``seq_len``) is ``span | span[:rest]`` with a span of
    ``ceil((seq_len + 1) / 2)`` tokens cut from ``stream`` at a seeded offset (cyclically where the stream is
    shorter than a span). Every position is a target: the first copy is ordinary language modelling, the second is
    predicted exactly by looking back one span (the copy an induction head performs); ``answer_pos`` holds the
    positions whose target is a copy (the second span's first token has no earlier cue and is left out). Repeated
    text is what induction heads, and with them passkey retrieval and associative recall, are learned from
    (Olsson et al., 2022).
    """
    if n < 1 or seq_len < 3:
        raise ValueError(f"n={n}, seq_len={seq_len} are not allowed: expected n >= 1 and seq_len >= 3")
    stream = np.asarray(stream, dtype=np.int64)
    if stream.size == 0:
        raise ValueError("stream is empty")
    rng = np.random.default_rng(seed)
    span = (seq_len + 2) // 2  # ceil((seq_len + 1) / 2)
    seq = np.zeros((n, seq_len + 1), dtype=np.int64)
    for i in range(n):
        # a contiguous span where the stream holds one, else cyclic from any offset
        start = int(rng.integers(0, stream.size - span + 1 if stream.size >= span else stream.size))
        piece = stream[(start + np.arange(span)) % stream.size]
        seq[i] = np.concatenate([piece, piece])[: seq_len + 1]
    # position t >= span reads the second copy's token t - span and predicts t - span + 1 of the span: a copy
    answer_pos = np.broadcast_to(np.arange(span, seq_len), (n, seq_len - span)).copy()
    return SyntheticBatch(seq[:, :-1].copy(), seq[:, 1:].copy(), answer_pos, {"span": span})


def mqar(n: int, seq_len: int, vocab_size: int, num_pairs: int, num_queries: int | None = None,
         seed: int = 0) -> SyntheticBatch:
    """Multi-query associative recall (Zoology-style) on raw token ids.

    Each sample opens with ``num_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` (distinct keys from
    ids ``[1, vocab_size // 2)``, values from ``[vocab_size // 2, vocab_size)``); the rest is id 0
    with ``num_queries`` keys (default ``num_pairs``, distinct, drawn from the pairs) at random
    positions. The target at a query position is that key's value, which also follows it in the
    input, so every answer is scored once.
    """
    num_queries = num_pairs if num_queries is None else num_queries
    if vocab_size < 4 or num_pairs < 1 or not 1 <= num_queries <= num_pairs:
        raise ValueError(f"vocab_size={vocab_size}, num_pairs={num_pairs}, num_queries={num_queries} are not "
                         "allowed: expected vocab_size >= 4, num_pairs >= 1, 1 <= num_queries <= num_pairs")
    half = vocab_size // 2
    if num_pairs > half - 1:
        raise ValueError(f"num_pairs={num_pairs} is not allowed: expected <= {half - 1} distinct keys for "
                         f"vocab_size={vocab_size}")
    n_tail = seq_len + 1 - 2 * num_pairs  # room after the pairs; each query takes 2 slots (key, value)
    if n_tail < 2 * num_queries:
        raise ValueError(f"seq_len={seq_len} is not allowed: expected >= {2 * num_pairs + 2 * num_queries - 1} "
                         f"for {num_pairs} pairs and {num_queries} queries")
    rng = np.random.default_rng(seed)
    # distinct keys per sample: the first num_pairs of a random permutation of the key ids
    keys = np.argsort(rng.random((n, half - 1)), axis=1)[:, :num_pairs] + 1
    values = rng.integers(half, vocab_size, size=(n, num_pairs))
    seq = np.zeros((n, seq_len + 1), dtype=np.int64)
    seq[:, 0: 2 * num_pairs: 2], seq[:, 1: 2 * num_pairs: 2] = keys, values

    # query slots: choose num_queries of the n_tail // 2 non-overlapping (key, value) slots in the tail
    slots = np.sort(np.argsort(rng.random((n, n_tail // 2)), axis=1)[:, :num_queries], axis=1)
    qpos = 2 * num_pairs + 2 * slots  # [N, Q] positions of the query keys
    which = np.argsort(rng.random((n, num_pairs)), axis=1)[:, :num_queries]  # which pairs are asked
    rows = np.arange(n)[:, None]
    seq[rows, qpos] = keys[rows, which]
    seq[rows, qpos + 1] = values[rows, which]

    targets = np.full((n, seq_len), IGNORE, dtype=np.int64)
    targets[rows, qpos] = seq[rows, qpos + 1]
    return SyntheticBatch(seq[:, :-1].copy(), targets, qpos, {"keys": keys, "values": values})


__all__ = ["IGNORE", "SyntheticBatch", "mqar", "passkey", "repeat"]
