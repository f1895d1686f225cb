"""Packed documents in the layouts varlen kernels take: segment ids, document starts, ``cu_seqlens``.

Several documents packed into one row of a ``[B, T]`` batch are marked by ``segment_ids [B, T]``,
the document number of each token within its row; a document is a run of equal consecutive ids
and a row start always opens one (``[0, 0, 1, 1, 0]`` holds three). Varlen kernels (the KDA ops
here, flash-attention's and fla's ``cu_seqlens``) take the same documents as ``[N + 1]`` offsets
into the ``B * T`` tokens flattened into one row: document ``n`` is tokens ``cu[n] : cu[n + 1]``.

The one home of these conversions: the data floor builds ``segment_ids`` with them, the model
(``moelab.model.documents``) and the KDA ops read them.
"""

from __future__ import annotations

import torch

__all__ = ["check_cu_seqlens", "cu_seqlens", "cu_seqlens_from_starts", "document_starts", "pad_cu_seqlens",
           "segments_from_eos"]


def segments_from_eos(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document numbers of the tokens ``ids [..., T]``: a new document starts after each ``eos_id``.

    Returns ``[..., T]`` int32, 0 for the first document of each row (the eos token belongs to the
    document it ends)."""
    ends = (ids == eos_id).long()
    return (ends.cumsum(-1) - ends).to(torch.int32)


def document_starts(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool, True at the first token of each document of ``segment_ids [B, T]`` (any integer dtype).

    Raises ValueError unless ``segment_ids`` is an integer ``[B, T]`` tensor with ``T >= 1``."""
    if segment_ids.dim() != 2 or segment_ids.shape[1] < 1:
        raise ValueError(f"segment_ids must be [B, T] with T >= 1, got shape {tuple(segment_ids.shape)}")
    if segment_ids.dtype.is_floating_point or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
        raise ValueError(f"segment_ids must be an integer tensor, got dtype {segment_ids.dtype}")
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    return starts


def cu_seqlens_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """``[N + 1]`` int32 offsets of the N documents whose first tokens ``starts [B, T]`` marks, in the
    flattened ``B * T`` order (one host sync: N is data-dependent)."""
    offsets = starts.flatten().nonzero().flatten()
    return torch.cat([offsets, offsets.new_tensor([starts.numel()])]).to(torch.int32)


def cu_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[N + 1]`` int32 offsets of the documents of ``segment_ids [B, T]`` in the flattened ``B * T`` order."""
    return cu_seqlens_from_starts(document_starts(segment_ids))


def pad_cu_seqlens(cu_seqlens: torch.Tensor, capacity: int) -> torch.Tensor:
    """``cu_seqlens [N + 1]`` as ``[capacity + 1]`` offsets: the N documents, then ``capacity - N`` empty ones at the
    end (the last offset repeated). Every consumer treats an empty document as no tokens, so the offsets of batches
    with different N get one shape, as a captured step (one CUDA graph) needs. Reads only the shape (no sync).

    Raises ValueError when N > capacity (the value and the allowed range named)."""
    n = cu_seqlens.numel() - 1
    if cu_seqlens.dim() != 1 or n < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if n > capacity:
        raise ValueError(f"pad_cu_seqlens: {n} documents do not fit capacity={capacity}: expected N <= capacity "
                         f"(raise the capacity)")
    return torch.cat([cu_seqlens, cu_seqlens[-1:].expand(capacity - n)])


def check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int, read: bool = True) -> list[int] | None:
    """Raise ValueError unless ``cu_seqlens`` is a 1-D int32/int64 ``[N + 1]`` tensor for B = 1;
    with ``read``, also check its values (0 first, non-decreasing, T last: one host sync) and
    return them as a list."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of N + 1 >= 2 offsets, got "
                         f"{(tuple(cu_seqlens.shape), cu_seqlens.dtype)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the documents are packed in one row: expected B = 1, got B = {B}")
    if not read:
        return None
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        shown = cu if len(cu) <= 16 else cu[:8] + ["..."] + cu[-8:]
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T = {T}, got {shown}")
    return cu
