"""Packed documents: several documents in one row of a batch, kept apart by every token mixer.

A long training sequence built by concatenating documents (``moelab.data.curriculum``) marks its
boundaries with ``segment_ids [B, T]``: the document number of each token within its row. Passed to
``MoELab.forward(..., segment_ids=)``, no token sees a token of another document:

* **KDA**: the op runs on the ``B * T`` tokens flattened into one row with ``cu_seqlens`` (one
  offset per document, :attr:`Documents.cu_seqlens`, from ``moelab.ops.varlen``), so its
  recurrent state restarts at each boundary: the Triton training op (forward and backward) and
  the inference forward take the offsets in-kernel, the PyTorch backends run document by
  document (``moelab.ops.kda.kda``).
* **ShortConv** (KDA's q, k, v): the first ``size - 1`` tokens of a document that starts inside a
  row would read the previous document's last inputs. The Triton conv (``moelab.ops.short_conv``)
  masks those taps itself, from each token's position in its document (:attr:`Documents.pos`), in
  the same pass forward and backward (no host sync, no extra op); the torch conv recomputes those
  few outputs afterwards with the other document's taps zeroed (:meth:`Documents.conv_fix`).
* **MLA**: attention is causal within each document: on a GPU through ``flex_attention`` with a block
  mask built from the documents' block ranges (:meth:`Documents.block_mask`, ``[B, 1, T / 128, T / 128]``
  block lists, no ``[T, T]`` tensor), elsewhere through SDPA with a dense mask
  (:meth:`Documents.attention_mask`, ``B T^2`` bytes); ``model.mla.mask_backend`` picks.
* The FFN / MoE and the residual mixing over depth are per token already.

Equal to running each document alone (tested: outputs and gradients). A row start always opens a
document, and a document is a run of equal consecutive ids: ``[0, 0, 1, 1, 0]`` holds three.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import BlockMask

from moelab.ops.varlen import cu_seqlens_from_starts, document_starts

# flex_attention's default tile (queries and keys) on a GPU.
FLEX_BLOCK = 128


@dataclass
class Documents:
    """Where the documents of a packed ``[B, T]`` batch lie; built once per forward and shared by the layers.

    Attributes:
        doc: ``[B, T]`` long, the number of each token's document within its row (0, 1, ...).
        pos: ``[B, T]`` long, each token's position within its document (0 at a document's start).
        cu_seqlens: ``[N + 1]`` int32 offsets of the N documents in the flattened ``B * T`` order
            (the layout ``cu_seqlens`` kernels take: document n is tokens ``[cu[n], cu[n + 1])``).
        num_docs: N (a host int).
    """

    doc: torch.Tensor
    pos: torch.Tensor
    cu_seqlens: torch.Tensor
    num_docs: int
    _conv: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _blocks: dict[int, BlockMask] = field(default_factory=dict, repr=False)
    _taps: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @classmethod
    def from_segment_ids(cls, segment_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> Documents:
        """From ``segment_ids [B, T]`` (any integer dtype). ``cu_seqlens``: the documents' offsets made before the
        batch reached the device (``moelab.ops.varlen.cu_seqlens`` on the CPU batch, as the data loaders do), so no
        host sync; None: counted here (one host sync)."""
        starts = document_starts(segment_ids)
        B, T = segment_ids.shape
        doc = starts.long().cumsum(1) - 1
        t = torch.arange(T, device=segment_ids.device).expand(B, T)
        first = torch.where(starts, t, torch.zeros_like(t)).cummax(1).values  # start of each token's document
        if cu_seqlens is None:
            cu = cu_seqlens_from_starts(starts)
        else:
            if cu_seqlens.dim() != 1 or cu_seqlens.numel() < B + 1 or cu_seqlens.dtype != torch.int32:
                raise ValueError(f"cu_seqlens must be [N + 1] int32 with N >= B = {B} documents, got "
                                 f"{(tuple(cu_seqlens.shape), cu_seqlens.dtype)}")
            cu = cu_seqlens.to(segment_ids.device, non_blocking=True)
        return cls(doc=doc, pos=t - first, cu_seqlens=cu, num_docs=cu.numel() - 1)

    @property
    def one_per_row(self) -> bool:
        """Every row is a single document: the layers can run as without ``segment_ids``."""
        return self.num_docs == self.doc.shape[0]

    def attention_mask(self) -> torch.Tensor:
        """``[B, 1, T, T]`` bool, True where query t may attend key s: ``s <= t`` in the same document.

        Built once per forward (``B T^2`` bytes) and shared by the MLA layers."""
        if self._mask is None:
            T = self.doc.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=self.doc.device).tril()
            self._mask = ((self.doc[:, :, None] == self.doc[:, None, :]) & causal)[:, None]
        return self._mask

    def block_mask(self, block_size: int = FLEX_BLOCK) -> BlockMask:
        """The document-causal mask as flex_attention's :class:`BlockMask`, from the documents' block ranges.

        A row's document numbers never decrease, so a tile of ``block_size`` queries holds documents
        ``doc[first] .. doc[last]`` of its first and last token, and so does a tile of keys. Key tile j
        of query tile i (``j <= i``) is skipped when its last document ends before the query tile's first
        (``kmax < qmin``), is full (no element masked: the kernel skips the mask function) when ``j < i``
        and both tiles lie in one document, and is partial otherwise. Block lists
        ``[B, 1, nb, nb]`` int32 (``nb = ceil(T / block_size)``) and no ``[T, T]`` tensor; no host sync. Its
        ``mask_mod`` holds :meth:`attention_mask`'s predicate per element (the partial tiles).
        Cached per ``block_size`` (built once per forward, shared by the MLA layers).
        """
        if block_size not in self._blocks:
            B, T = self.doc.shape
            nb = -(-T // block_size)
            # Pad with each row's last document: rows stay non-decreasing, the tiles' ranges unchanged, and the
            # kernel's reads of a last partial tile stay in bounds (it drops those positions itself).
            doc = torch.cat([self.doc, self.doc[:, -1:].expand(B, nb * block_size - T)], dim=1)
            tiles = doc.view(B, nb, block_size)
            lo, hi = tiles[:, :, 0], tiles[:, :, -1]  # [B, nb] first and last document of each tile
            i = torch.arange(nb, device=doc.device)
            below = i[None, :, None] >= i[None, None, :]  # [1, nb(q), nb(kv)]: key tile j <= query tile i
            reach = hi[:, None, :] >= lo[:, :, None]  # [B, nb, nb]: the key tile reaches the query's documents
            live = below & reach
            full = (i[None, :, None] > i[None, None, :]) & (lo[:, None, :] == hi[:, :, None]) & (
                hi[:, None, :] == lo[:, :, None])  # [B, nb, nb]: key and query tiles in one document
            partial = live & ~full

            def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                # What attention_mask holds: key kv <= query q, in the same document.
                return (kv <= q) & (doc[b, q] == doc[b, kv])

            self._blocks[block_size] = BlockMask.from_kv_blocks(
                *_ordered(partial), *_ordered(full), BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(T, T))
        return self._blocks[block_size]

    def conv_fix(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens a causal conv of kernel ``size`` would mix across a boundary: ``(rows, cols, pos)``,
        each ``[M]`` long, every token within the first ``size - 1`` of a document that starts inside
        its row (a row start is padded with zeros already). One host sync per kernel size."""
        if size not in self._conv:
            cols = torch.arange(self.pos.shape[1], device=self.pos.device)
            bad = (self.pos < size - 1) & (self.pos < cols)
            rows, where = bad.nonzero(as_tuple=True)
            self._conv[size] = (rows, where, self.pos[rows, where])
        return self._conv[size]

    def conv_taps(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For :meth:`conv_fix`'s M tokens, what their outputs read: ``(rows [M, 1], src [M, size], keep [M, size,
        1] bool)``: tap i reads ``x[rows, src[:, i]]`` (token ``t - size + 1 + i``, clamped to the row) and counts
        where ``keep`` (within the token's own document). Cached per size: the ShortConvs of every KDA layer
        (q, k and v) share it, so each fix is a gather, a masked product and a scatter."""
        if size not in self._taps:
            rows, cols, pos = self.conv_fix(size)
            i = torch.arange(size, device=cols.device)
            src = (cols[:, None] - (size - 1) + i[None, :]).clamp(min=0)
            keep = (i[None, :] >= size - 1 - pos[:, None])[..., None]
            self._taps[size] = (rows[:, None], src, keep)
        return self._taps[size]


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tile mask ``[B, nq, nkv]`` bool -> (counts ``[B, 1, nq]`` int32, key tile indices ``[B, 1, nq, nkv]`` int32,
    the kept tiles first in ascending order): the block lists flex_attention reads."""
    counts = dense.sum(-1, dtype=torch.int32)
    index = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], index[:, None]


def causal_conv_fix(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, docs: Documents,
                    activation: str | None = None) -> torch.Tensor:
    """``y [B, T, C]``, a causal depthwise conv of ``x [B, T, C]`` with ``weight [C, size]`` (``y[t] =
    sum_i weight[:, i] x[t - size + 1 + i]``, then ``activation``), with the outputs that read across a
    document boundary recomputed from their own document's inputs only. Differentiable; out of place."""
    rows, cols, _ = docs.conv_fix(weight.shape[-1])
    if rows.numel() == 0:
        return y
    at, src, keep = docs.conv_taps(weight.shape[-1])
    taps = torch.where(keep, x[at, src], 0)  # [M, size, C]
    with torch.autocast(x.device.type, enabled=False):  # fp32, as the conv kernels accumulate (autocast: bf16)
        fixed = torch.einsum("msc,cs->mc", taps.float(), weight.float())  # [M, C]
    if activation == "silu":
        fixed = torch.nn.functional.silu(fixed)
    return y.index_put((rows, cols), fixed.to(y.dtype))


__all__ = ["Documents", "causal_conv_fix"]
