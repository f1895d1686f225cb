"""Passkey and MQAR grid scores from hand-made per-row outputs with known partial answers.

The scorer (score_continuation, tested in test_scoring.py) is replaced by one that misses a chosen
number of answer tokens per row, in the order the grids score their rows (length, then depth, then
batches of ``batch_size`` rows). The grids' accuracies, whole-sample shares, answer losses and
effective context must then be exactly the values worked out by hand below.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from moelab.data.tokenizer import ByteTokenizer
from moelab.eval import tasks
from moelab.eval.scoring import SpanScore


class _Scorer:
    """Stand-in for score_continuation: row r of the call misses ``misses[r]`` answer tokens.

    Its summed nll is ``0.5 n_tokens + misses`` nats. Rows are served from one queue in call order.
    """

    def __init__(self, misses: list[int]) -> None:
        self.misses = deque(misses)
        self.n_tokens: list[int] = []

    def __call__(self, model, ids: torch.Tensor, mask: torch.Tensor, chunk_size=None) -> SpanScore:
        n_tok = mask.sum(1)
        miss = torch.tensor([self.misses.popleft() for _ in range(ids.shape[0])])
        assert (miss <= n_tok).all()
        self.n_tokens += n_tok.tolist()
        return SpanScore(0.5 * n_tok.float() + miss.float(), n_tok, n_tok - miss, state_bytes=8 * ids.shape[1])


def test_passkey_grid_scores_known_partial_answers(monkeypatch) -> None:
    # lengths x depths = 2 x 2 cells of 4 samples, scored 2 rows per call (each cell's rows split over calls).
    misses = [0, 0, 0, 0,   0, 0, 0, 0,      # length 256: depth 0.0, depth 0.5 -> 1.0, 1.0
              0, 1, 0, 5,   0, 0, 2, 0]      # length 384: depth 0.0 -> 2/4 solved, depth 0.5 -> 3/4
    scorer = _Scorer(misses)
    monkeypatch.setattr(tasks, "score_continuation", scorer)
    out = tasks.passkey_grid(torch.nn.Linear(1, 1), ByteTokenizer(), [256, 384], [0.0, 0.5], samples=4,
                             batch_size=2)
    assert not scorer.misses  # every row scored once
    assert out["accuracy"] == [[1.0, 1.0], [0.5, 0.75]]
    assert out["accuracy_by_length"] == [1.0, 0.625]
    assert out["effective_context"] == 256  # 384's 0.625 is under the 0.9 bar
    # answer_nll per cell: (0.5 * tokens + misses) / tokens over the cell's rows, 4 rows of 6 tokens each.
    assert sum(out["answer_nll"], []) == pytest.approx([0.5, 0.5, (12 + 6) / 24, (12 + 2) / 24], rel=1e-6)
    assert set(scorer.n_tokens) == {6}  # " " and a 5-digit key: every passkey answer is 6 byte tokens
    assert out["state_bytes_per_sequence"] == [8 * 257 // 2, 8 * 385 // 2]


def test_mqar_grid_scores_known_partial_answers(monkeypatch) -> None:
    pairs = 4
    misses = [0, 1, 0, 4,  2, 0, 0, 0]  # length 64: 2 of 4 rows whole, 5 tokens missed; length 96: 3 of 4, 2 missed
    scorer = _Scorer(misses)
    monkeypatch.setattr(tasks, "score_continuation", scorer)
    out = tasks.mqar_grid(torch.nn.Linear(1, 1), 256, [64, 96], pairs, samples=4, batch_size=3)  # calls of 3 + 1
    assert not scorer.misses
    assert scorer.n_tokens == [pairs] * len(scorer.n_tokens)  # every key asked once: one answer token each
    assert out["accuracy"] == pytest.approx([(16 - 5) / 16, (16 - 2) / 16])
    assert out["all_correct"] == [0.5, 0.75]
