"""Chunked evaluation equals one full forward; the span scorer reads the answer tokens and nothing else;
the state that persists between chunks grows by the MLA latent cache only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moelab.eval.scoring import score_continuation, state_nbytes, token_nll
from moelab.model import MoELab
from tests.helpers import assert_close
from tests.model.tiny import tiny_config


@pytest.fixture(scope="module")
def model() -> MoELab:
    torch.manual_seed(0)
    m = MoELab(tiny_config(max_seq_len=128)).eval()
    with torch.no_grad():  # a sharper output distribution than the init's, so a wrong chunk shows
        m.lm_head.weight.mul_(20)
    return m


@pytest.mark.parametrize("chunk", [7, 16, 50])
def test_chunked_loss_equals_the_full_forward(model: MoELab, chunk: int) -> None:
    ids = torch.randint(0, 50, (2, 97), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits.float()
    ref = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    out = token_nll(model, ids, chunk_size=chunk)
    assert out.nll.shape == (2, 96)
    assert_close(ref, out.nll, 1e-5, f"nll, chunk {chunk}")
    assert torch.equal(out.correct, logits.argmax(-1) == ids[:, 1:])
    assert_close(ref, token_nll(model, ids).nll, 1e-6, "nll, one forward")

    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, [5, 40, 41, 96]] = True
    mask[1, 60:70] = True
    span = score_continuation(model, ids, mask, chunk_size=chunk)
    want = torch.stack([(ref[b] * mask[b, 1:]).sum() for b in range(2)])
    assert_close(want, span.nll, 1e-5, "span nll")
    assert span.n_tokens.tolist() == [4, 10]
    hits = (logits.argmax(-1) == ids[:, 1:]) & mask[:, 1:]
    assert span.n_correct.tolist() == hits.sum(1).tolist()


class Oracle(torch.nn.Module):
    """A stand-in model that predicts ``guess[t + 1]`` at position ``t`` (one-hot logits), carrying a position state."""

    def __init__(self, guess: torch.Tensor, vocab: int = 10) -> None:
        super().__init__()
        self.guess, self.vocab, self.fed = guess, vocab, 0

    def forward(self, ids: torch.Tensor, state=None, use_cache: bool = False):
        past = state.seen if state is not None else 0
        T = ids.shape[1]
        self.fed = max(self.fed, past + T)
        nxt = self.guess[:, past + 1: past + T + 1]
        nxt = torch.cat([nxt, nxt.new_zeros(ids.shape[0], T - nxt.shape[1])], dim=1)
        return SimpleNamespace(logits=F.one_hot(nxt, self.vocab).float() * 10, state=SimpleNamespace(seen=past + T))

    def prefill_chunks(self, ids: torch.Tensor, *, chunk_size: int):
        """The pieces of ``MoELab.prefill_chunks``: start, logits and state per ``chunk_size`` tokens."""
        state = None
        for start in range(0, ids.shape[1], chunk_size):
            out = self(ids[:, start: start + chunk_size], state=state)
            state = out.state
            yield SimpleNamespace(start=start, logits=out.logits, state=state)


def test_the_scorer_reads_only_the_answer_span() -> None:
    ids = torch.randint(0, 10, (3, 40), generator=torch.Generator().manual_seed(2))
    span = (30, 34)
    wrong_outside = (ids + 1) % 10  # every prediction wrong ...
    wrong_outside[:, 30:34] = ids[:, 30:34]  # ... except on the answer span
    for chunk in (None, 8, 13):
        oracle = Oracle(wrong_outside)
        score = score_continuation(oracle, ids, span, chunk_size=chunk)
        assert score.correct.all() and score.n_tokens.tolist() == [4, 4, 4]
        assert oracle.fed == 33  # nothing after the last answer-predicting position is fed
    one_wrong = wrong_outside.clone()
    one_wrong[1, 33] = (ids[1, 33] + 1) % 10  # the span's last token, row 1 only
    score = score_continuation(Oracle(one_wrong), ids, span, chunk_size=8)
    assert score.correct.tolist() == [True, False, True] and score.n_correct.tolist() == [4, 3, 4]
    with pytest.raises(ValueError, match=r"answer_span=\(0, 3\) is not allowed"):
        score_continuation(Oracle(ids), ids, (0, 3))
    with pytest.raises(ValueError, match="marks no answer token"):
        score_continuation(Oracle(ids), ids, torch.zeros_like(ids, dtype=torch.bool))


def test_state_grows_by_the_latent_cache_per_token(model: MoELab) -> None:
    cfg = model.cfg
    ids = torch.randint(0, 50, (2, 121), generator=torch.Generator().manual_seed(3))
    short, long = token_nll(model, ids[:, :41], chunk_size=16), token_nll(model, ids, chunk_size=16)
    n_mla = cfg.layer_types().count("mla")
    per_token = n_mla * cfg.mla.kv_latent_dim * 4  # fp32 latents of every MLA layer
    assert (long.state_bytes - short.state_bytes) == 2 * 80 * per_token
    kda = cfg.layer_types().count("kda") * 2 * cfg.kda.num_heads * cfg.kda.head_dim ** 2 * 4
    assert short.state_bytes > kda + 2 * 40 * per_token  # plus the conv tails
    assert state_nbytes(None) == 0
