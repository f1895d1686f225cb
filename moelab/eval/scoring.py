"""Scoring a model on long inputs piece by piece: per-token losses, and answer spans read alone.

Every evaluation forward goes through :func:`chunked_forward`, the one place that knows how the
model carries its state from piece to piece: the model's own chunked prefill
(``MoELab.prefill_chunks``: the KDA recurrent state and conv tails, the MLA latent cache, eval mode,
the KDA inference path on a GPU). A sequence is fed ``chunk_size``
tokens at a time, so the memory of a forward is that of one chunk against the cache, and what
persists between chunks grows only with the MLA latent cache (``kv_latent_dim`` numbers per token
and MLA layer; the KDA state is fixed-size); :func:`state_nbytes` measures it.

Indices: ``ids [B, T]`` is the whole sample; the logits at position ``t`` predict ``ids[:, t + 1]``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TokenScores:
    """Per-position results of :func:`token_nll`.

    Attributes:
        nll: ``[B, T - 1]`` fp32, ``-log p(ids[t + 1] | ids[: t + 1])`` at position ``t`` (nats).
        correct: ``[B, T - 1]`` bool, the argmax at position ``t`` is ``ids[t + 1]``.
        state_bytes: bytes of the model state after the last fed token (all rows).
    """

    nll: torch.Tensor
    correct: torch.Tensor
    state_bytes: int


@dataclass
class SpanScore:
    """What :func:`score_continuation` returns, per row of the batch.

    Attributes:
        nll: ``[B]`` fp32, summed negative log-likelihood of the answer tokens (nats).
        n_tokens: ``[B]`` long, answer tokens in the row.
        n_correct: ``[B]`` long, answer tokens that are the argmax prediction.
        state_bytes: bytes of the model state after the last fed token (all rows).
    """

    nll: torch.Tensor
    n_tokens: torch.Tensor
    n_correct: torch.Tensor
    state_bytes: int

    @property
    def correct(self) -> torch.Tensor:
        """``[B]`` bool: greedy decoding reproduces every answer token of the row."""
        return self.n_correct == self.n_tokens


def state_nbytes(state: object) -> int:
    """Bytes held by the tensors of a model state (``ModelState``, its layers' states, nested containers)."""
    if state is None:
        return 0
    if torch.is_tensor(state):
        return state.numel() * state.element_size()
    if isinstance(state, (list, tuple)):
        return sum(state_nbytes(s) for s in state)
    if hasattr(state, "__dict__"):
        return sum(state_nbytes(v) for v in vars(state).values())
    return 0


def chunked_forward(model: torch.nn.Module, ids: torch.Tensor,
                    chunk_size: int | None) -> Iterator[tuple[int, torch.Tensor, object]]:
    """Feed ``ids [B, T]`` to ``model`` in pieces; yield ``(start, logits [B, c, vocab], state)`` per piece.

    ``chunk_size``: tokens per piece; None (or ``>= T``): one piece. The pieces come from
    ``model.prefill_chunks`` (equal to one full forward, tested there); the state after each piece
    is yielded so callers can measure it.
    """
    T = ids.shape[1]
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} is not allowed: expected an integer >= 1 or None")
    for piece in model.prefill_chunks(ids, chunk_size=min(chunk_size or T, T)):
        yield piece.start, piece.logits, piece.state


@torch.no_grad()
def token_nll(model: torch.nn.Module, ids: torch.Tensor, chunk_size: int | None = None) -> TokenScores:
    """Next-token loss and argmax hit at every position of ``ids [B, T]`` (T >= 2), fed in ``chunk_size`` pieces."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be [B, T] with T >= 2, got shape {tuple(ids.shape)}")
    nll, correct, nbytes = [], [], 0
    inputs, targets = ids[:, :-1], ids[:, 1:]
    for start, logits, state in chunked_forward(model, inputs, chunk_size):
        nbytes = state_nbytes(state)  # the state grows piece by piece: the last one is the largest
        target = targets[:, start: start + logits.shape[1]]
        logits = logits.float()
        nll.append(F.cross_entropy(logits.transpose(1, 2), target, reduction="none"))
        correct.append(logits.argmax(-1) == target)
    return TokenScores(torch.cat(nll, dim=1), torch.cat(correct, dim=1), nbytes)


def answer_mask(ids: torch.Tensor, answer_span: torch.Tensor | tuple[int, int]) -> torch.Tensor:
    """``[B, T]`` bool mask of the answer tokens: ``answer_span`` as given, or True on ``start:end`` of every row."""
    if isinstance(answer_span, tuple):
        start, end = answer_span
        if not 1 <= start < end <= ids.shape[1]:
            raise ValueError(f"answer_span={answer_span} is not allowed: expected 1 <= start < end <= T={ids.shape[1]}")
        mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        mask[:, start:end] = True
        return mask
    if answer_span.shape != ids.shape or answer_span.dtype != torch.bool:
        raise ValueError(f"answer_span must be a (start, end) pair or a bool mask shaped like ids {tuple(ids.shape)}, "
                         f"got {answer_span.dtype} {tuple(answer_span.shape)}")
    if answer_span[:, 0].any():
        raise ValueError("answer_span marks position 0, which no context predicts")
    return answer_span


@torch.no_grad()
def score_continuation(model: torch.nn.Module, ids: torch.Tensor, answer_span: torch.Tensor | tuple[int, int],
                       chunk_size: int | None = None) -> SpanScore:
    """Score the answer tokens of ``ids [B, T]`` given everything before each of them.

    Args:
        ids: the whole samples, context and answers (``[B, T]`` long).
        answer_span: which tokens are answers: a ``[B, T]`` bool mask (any positions, e.g. MQAR's
            scattered values; never position 0) or a ``(start, end)`` pair for ``ids[:, start:end]``.
        chunk_size: feed the model this many tokens at a time (None: one forward).

    Only the logits at the positions that predict an answer token are read; the input stops at
    the last of them, so tokens after the last answer are never fed.
    """
    mask = answer_mask(ids, answer_span)
    B = ids.shape[0]
    reads = mask[:, 1:]  # position t predicts token t + 1
    if not reads.any():
        raise ValueError("answer_span marks no answer token")
    last = int(reads.any(0).nonzero().max()) + 1
    nll = torch.zeros(B, dtype=torch.float32, device=ids.device)
    hits = torch.zeros(B, dtype=torch.long, device=ids.device)
    nbytes = 0
    for start, logits, state in chunked_forward(model, ids[:, :last], chunk_size):
        nbytes = state_nbytes(state)
        here = reads[:, start: start + logits.shape[1]]
        rows, cols = here.nonzero(as_tuple=True)
        picked = logits[rows, cols].float()  # [n, vocab]: the answer-predicting positions only
        target = ids[rows, start + cols + 1]
        nll.index_add_(0, rows, F.cross_entropy(picked, target, reduction="none"))
        hits.index_add_(0, rows, (picked.argmax(-1) == target).long())
    return SpanScore(nll, mask.sum(1), hits, nbytes)


__all__ = ["SpanScore", "TokenScores", "answer_mask", "chunked_forward", "score_continuation", "state_nbytes",
           "token_nll"]
