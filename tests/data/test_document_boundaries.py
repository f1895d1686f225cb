"""Document boundaries of training items, derived independently from the stream's end-of-text positions.

The stream's documents hold distinct token ids, so each token names its stream position. The
expected boundaries then follow from the list of end-of-text positions alone (no call into
moelab.ops.varlen): a new document starts right after an end-of-text token and nowhere else.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.data.curriculum import DocumentPacker
from moelab.data.datamodule import FixedWindows

EOS = 0
LENGTHS = [5, 1, 9, 3, 14, 2, 7, 4, 11, 6]  # tokens per document, its end-of-text included


def _stream() -> tuple[np.ndarray, list[int]]:
    """Documents of ``LENGTHS`` tokens with ids 1, 2, ... (each id once), each closed by EOS; and the EOS positions."""
    out, eos_at, next_id = [], [], 1
    for n in LENGTHS:
        out += list(range(next_id, next_id + n - 1)) + [EOS]
        next_id += n - 1
        eos_at.append(len(out) - 1)
    return np.asarray(out, dtype=np.int64), eos_at


def _expected_segments(first: int, n: int, eos_at: list[int]) -> list[int]:
    """Segment numbers of the stream tokens first .. first + n - 1: +1 after each EOS position."""
    seg, out = 0, []
    for p in range(first, first + n):
        out.append(seg)
        if p in eos_at:
            seg += 1
    return out


@pytest.mark.parametrize("seq_len", [4, 7, 16])
def test_fixed_windows_segments_follow_the_stream_eos_positions(seq_len: int) -> None:
    tokens, eos_at = _stream()
    windows = list(range((tokens.size - 1) // seq_len))
    ds = FixedWindows(tokens, seq_len, windows, documents=True, eos_id=EOS)
    for w in windows:
        item = ds[w]
        assert item["segment_ids"].dtype == torch.int32 and item["segment_ids"].shape == (seq_len,)
        assert item["segment_ids"].tolist() == _expected_segments(w * seq_len, seq_len, eos_at), w


@pytest.mark.parametrize(("length", "seed"), [(3, 0), (12, 1), (40, 2), (130, 3)])
def test_packed_documents_start_only_after_an_eos(length: int, seed: int) -> None:
    tokens, eos_at = _stream()
    starts = {0} | {p + 1 for p in eos_at}  # stream positions where a document begins
    where = {int(t): p for p, t in enumerate(tokens) if t != EOS}
    packer = DocumentPacker(tokens, eos_id=EOS)
    for draw in range(20):
        ids, segments = packer.pack(length, np.random.Philox(key=seed, counter=draw))
        assert ids.shape == segments.shape == (length,)
        ids, segments = ids.tolist(), segments.tolist()
        assert segments[0] == 0
        for t in range(1, length):
            # A new segment exactly where the previous token is an end-of-text.
            assert (segments[t] != segments[t - 1]) == (ids[t - 1] == EOS), (draw, t)
            assert segments[t] - segments[t - 1] in (0, 1)
        # Every segment after the first starts at the first token of a document of the stream ...
        for t in range(1, length):
            if segments[t] != segments[t - 1] and ids[t] != EOS:
                assert where[ids[t]] in starts, (draw, t)
            # ... and within a segment the tokens run on consecutively in the stream.
            if segments[t] == segments[t - 1] and ids[t] != EOS:
                assert where[ids[t]] == where[ids[t - 1]] + 1, (draw, t)
