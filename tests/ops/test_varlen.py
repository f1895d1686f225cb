"""moelab.ops.varlen: segment ids, document starts and cu_seqlens of packed documents."""

from __future__ import annotations

import pytest
import torch

from moelab.ops.varlen import check_cu_seqlens, cu_seqlens, document_starts, segments_from_eos


def test_cu_seqlens_gives_document_offsets_in_the_flattened_batch() -> None:
    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]], dtype=torch.int32)
    cu = cu_seqlens(seg)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 6, 10, 12]  # a row start opens a document
    assert cu_seqlens(torch.zeros(3, 4, dtype=torch.int32)).tolist() == [0, 4, 8, 12]
    # a repeated id after another is a new document; any integer dtype
    assert cu_seqlens(torch.tensor([[4, 4, 9, 4, 4]])).tolist() == [0, 2, 3, 5]


def test_document_starts_rejects_what_is_not_integer_B_T() -> None:
    assert document_starts(torch.tensor([[7, 7, 1]], dtype=torch.int16)).tolist() == [[True, False, True]]
    with pytest.raises(ValueError, match=r"\[B, T\] with T >= 1, got shape \(4,\)"):
        cu_seqlens(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"got shape \(2, 0\)"):
        cu_seqlens(torch.zeros(2, 0, dtype=torch.int32))
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(ValueError, match=f"integer tensor, got dtype {dtype}"):
            cu_seqlens(torch.zeros(2, 3, dtype=dtype))


def test_segments_from_eos_round_trips_to_cu_seqlens() -> None:
    eos = 0
    ids = torch.tensor([[5, 6, 0, 7, 0, 0, 8], [0, 1, 2, 3, 4, 0, 9]])
    seg = segments_from_eos(ids, eos)
    assert seg.dtype == torch.int32
    # the eos ends its document; two eos in a row make a one-token document
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 2]]
    assert cu_seqlens(seg).tolist() == [0, 3, 5, 6, 7, 8, 13, 14]
    assert segments_from_eos(ids[1], eos).tolist() == seg[1].tolist()  # one row [T] alone


def test_check_cu_seqlens_names_the_bad_value() -> None:
    assert check_cu_seqlens(torch.tensor([0, 3, 3, 8]), 1, 8) == [0, 3, 3, 8]
    assert check_cu_seqlens(torch.tensor([0, 9], dtype=torch.int32), 1, 8, read=False) is None  # values unread
    with pytest.raises(ValueError, match="int32/int64"):
        check_cu_seqlens(torch.tensor([0.0, 8.0]), 1, 8)
    with pytest.raises(ValueError, match="expected B = 1, got B = 2"):
        check_cu_seqlens(torch.tensor([0, 8]), 2, 8)
    with pytest.raises(ValueError, match=r"end at T = 8, got \[0, 5, 4, 8\]"):
        check_cu_seqlens(torch.tensor([0, 5, 4, 8]), 1, 8)
    with pytest.raises(ValueError, match=r"end at T = 8, got \[0, 5\]"):
        check_cu_seqlens(torch.tensor([0, 5]), 1, 8)
