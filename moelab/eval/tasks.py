"""The long-context tasks on a model in memory: passkey over lengths x depths, MQAR, loss by position.

Each returns a JSON-ready dict (lists aligned with ``lengths``) and runs every forward through
:mod:`moelab.eval.scoring`, so lengths beyond the training window run in ``chunk_size`` pieces.
``state_bytes_per_sequence`` is the model state one sequence holds after its last token (the
memory that grows with length); :func:`bytes_per_token` fits its slope.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

from moelab.data.synthetic import IGNORE, SyntheticBatch, mqar, passkey
from moelab.data.tokenizer import Tokenizer
from moelab.eval.scoring import SpanScore, TokenScores, score_continuation, token_nll

EFFECTIVE_THRESHOLD = 0.9  # the report's bar: a length counts as usable context at >= 90% passkey accuracy


def synthetic_span(batch: SyntheticBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N, T + 1], answers [N, T + 1] bool)``: a generator batch as whole samples and their answer tokens.

    The generators give inputs ``[N, T]`` and next-token targets (``IGNORE`` except at answers);
    the whole sample is the inputs followed by the last target.
    """
    x, y = torch.from_numpy(batch.input_ids), torch.from_numpy(batch.targets)
    answers = y != IGNORE
    ids = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
    ids[:, 1:][answers] = y[answers]
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[:, 1:] = answers
    return ids, mask


def effective_context(lengths: Sequence[int], accuracy: Sequence[float], threshold: float = EFFECTIVE_THRESHOLD) -> int:
    """The longest length whose accuracy, and that of every shorter length, is ``>= threshold``; 0 if none."""
    best = 0
    for length, acc in sorted(zip(lengths, accuracy)):
        if acc < threshold:
            break
        best = length
    return best


def bytes_per_token(lengths: Sequence[int], nbytes: Sequence[float]) -> float | None:
    """Least-squares slope of state bytes against length (bytes per token); None with fewer than 2 lengths."""
    if len(set(lengths)) < 2:
        return None
    return float(np.polyfit(np.asarray(lengths, dtype=np.float64), np.asarray(nbytes, dtype=np.float64), 1)[0])


def _score(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, chunk_size: int | None,
           batch_size: int) -> tuple[SpanScore, int]:
    """Scores of all rows, ``batch_size`` rows per forward; and the state bytes of one sequence."""
    device = next(model.parameters()).device
    parts = [score_continuation(model, ids[i: i + batch_size].to(device), mask[i: i + batch_size].to(device),
                                chunk_size) for i in range(0, ids.shape[0], batch_size)]
    merged = SpanScore(*(torch.cat([getattr(p, k).cpu() for p in parts]) for k in ("nll", "n_tokens", "n_correct")),
                       state_bytes=parts[0].state_bytes)
    return merged, parts[0].state_bytes // min(batch_size, ids.shape[0])


def _token_scores(model: torch.nn.Module, windows: torch.Tensor, chunk_size: int | None,
                  batch_size: int) -> list[TokenScores]:
    device = next(model.parameters()).device
    return [token_nll(model, windows[i: i + batch_size].to(device), chunk_size)
            for i in range(0, windows.shape[0], batch_size)]


def _peak(device: torch.device, run: Callable[[], object]) -> tuple[object, int | None]:
    """``run()``'s result and the peak bytes allocated on ``device`` meanwhile (CUDA only; None elsewhere)."""
    if device.type != "cuda":
        return run(), None
    torch.cuda.reset_peak_memory_stats(device)
    out = run()
    return out, int(torch.cuda.max_memory_allocated(device))


def passkey_grid(model: torch.nn.Module, tokenizer: Tokenizer, lengths: Sequence[int], depths: Sequence[float],
                 samples: int, chunk_size: int | None = None, batch_size: int = 8, seed: int = 0,
                 filler: np.ndarray | None = None) -> dict:
    """Passkey accuracy for every (length, depth): ``samples`` keys each, hidden at that depth of the filler.

    A sample counts as solved when greedy decoding gives every token of its key (the scorer reads
    the answer span only). ``filler``: token stream to cut haystacks from (None: a repeated sentence).
    """
    device = next(model.parameters()).device
    acc, nll, state, peak = [], [], [], []
    for i, length in enumerate(lengths):
        acc_row, nll_row, peaks = [], [], []
        for j, depth in enumerate(depths):
            batch = passkey(tokenizer, samples, length, depth=depth, seed=seed + 7919 * i + j, filler=filler)
            ids, mask = synthetic_span(batch)
            (score, per_seq), used = _peak(device, partial(_score, model, ids, mask, chunk_size, batch_size))
            acc_row.append(score.correct.float().mean().item())
            nll_row.append((score.nll.sum() / score.n_tokens.sum()).item())
            peaks.append(used)
        acc.append(acc_row)
        nll.append(nll_row)
        state.append(per_seq)
        peak.append(max(peaks) if peaks[0] is not None else None)
    by_length = [float(np.mean(row)) for row in acc]
    return {"task": "passkey", "lengths": list(lengths), "depths": list(depths), "samples": samples,
            "accuracy": acc, "answer_nll": nll, "accuracy_by_length": by_length,
            "effective_context": effective_context(lengths, by_length), "threshold": EFFECTIVE_THRESHOLD,
            **_memory(lengths, state, peak)}


def mqar_grid(model: torch.nn.Module, vocab_size: int, lengths: Sequence[int], pairs: int, samples: int,
              chunk_size: int | None = None, batch_size: int = 8, seed: int = 0) -> dict:
    """Multi-query associative recall at each length: ``pairs`` key-value pairs, every key asked once.

    ``accuracy``: share of queries answered (argmax = the value); ``all_correct``: share of samples
    with every query answered.
    """
    device = next(model.parameters()).device
    acc, whole, state, peak = [], [], [], []
    for i, length in enumerate(lengths):
        batch = mqar(samples, length, vocab_size, pairs, seed=seed + 7919 * i)
        ids, mask = synthetic_span(batch)
        (score, per_seq), used = _peak(device, partial(_score, model, ids, mask, chunk_size, batch_size))
        acc.append((score.n_correct.sum() / score.n_tokens.sum()).item())
        whole.append(score.correct.float().mean().item())
        state.append(per_seq)
        peak.append(used)
    return {"task": "mqar", "lengths": list(lengths), "pairs": pairs, "samples": samples, "accuracy": acc,
            "all_correct": whole, **_memory(lengths, state, peak)}


def loss_by_position(model: torch.nn.Module, tokens: np.ndarray, lengths: Sequence[int], samples: int,
                     chunk_size: int | None = None, batch_size: int = 8, n_bins: int = 24) -> dict:
    """Mean next-token loss by position on held-out text, for windows of each length.

    The windows are the first ``samples`` non-overlapping ``length + 1``-token windows of
    ``tokens`` (a val stream: documents joined by end-of-text). Position ``t`` (0-based) is the
    loss of token ``t + 1`` given ``t + 1`` tokens. Positions are averaged in ``n_bins`` bins with
    log-spaced edges (``bin_start`` inclusive, ``bin_end`` exclusive), since what matters is how the
    loss keeps falling over orders of magnitude of context.
    """
    device = next(model.parameters()).device
    curves, state, peak = [], [], []
    for length in lengths:
        n = min(samples, (tokens.size - 1) // length)
        if n < 1:
            raise ValueError(f"length={length} is not allowed: the held-out stream holds {tokens.size} tokens, "
                             f"fewer than length + 1")
        windows = torch.from_numpy(np.stack([tokens[k * length: (k + 1) * length + 1] for k in range(n)])
                                   .astype(np.int64))

        parts, used = _peak(device, partial(_token_scores, model, windows, chunk_size, batch_size))
        per_position = torch.cat([p.nll.cpu() for p in parts]).mean(0)  # [length]
        edges = np.unique(np.round(np.geomspace(1, length, n_bins + 1)).astype(int))
        edges[0] = 0
        curves.append({"length": length, "windows": n, "mean_loss": per_position.mean().item(),
                       "bin_start": edges[:-1].tolist(), "bin_end": edges[1:].tolist(),
                       "loss": [per_position[a:b].mean().item() for a, b in zip(edges[:-1], edges[1:])]})
        state.append(parts[0].state_bytes // min(batch_size, n))
        peak.append(used)
    return {"task": "loss_by_position", "lengths": list(lengths), "curves": curves, **_memory(lengths, state, peak)}


def _memory(lengths: Sequence[int], state: list[int], peak: list[int | None]) -> dict:
    out: dict = {"state_bytes_per_sequence": state, "state_bytes_per_token": bytes_per_token(lengths, state)}
    if peak and peak[0] is not None:
        out["peak_memory_bytes"] = peak
    return out


__all__ = ["EFFECTIVE_THRESHOLD", "bytes_per_token", "effective_context", "loss_by_position", "mqar_grid",
           "passkey_grid", "synthetic_span"]
