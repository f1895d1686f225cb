"""Long-context evaluation on any checkpoint: passkey over lengths x depths, MQAR, loss by position.

``python -m moelab eval --ckpt runs/tiny/last.ckpt --task passkey`` (:func:`moelab.eval.suite.evaluate`)
writes JSON and an MLflow run. :mod:`moelab.eval.scoring` feeds long inputs in pieces with the
model's state (the swap point for a dedicated prefill), :mod:`moelab.eval.tasks` builds and
scores the tasks on a model in memory.
"""

from moelab.eval.scoring import SpanScore, TokenScores, chunked_forward, score_continuation, state_nbytes, token_nll
from moelab.eval.tasks import effective_context, loss_by_position, mqar_grid, passkey_grid, synthetic_span

__all__ = ["SpanScore", "TokenScores", "chunked_forward", "effective_context", "loss_by_position", "mqar_grid",
           "passkey_grid", "score_continuation", "state_nbytes", "synthetic_span", "token_nll"]
