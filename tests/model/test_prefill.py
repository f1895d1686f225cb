"""Chunked prefill (``MoELab.prefill`` / ``prefill_chunks``) against one full forward.

fp32 on CPU: the chunked loss, per-token loss and logits equal the full forward's, prefill +
decode equals the full forward at the next position, and the KDA inference forward (Triton
interpreter) gives the training path's numbers. The ``gpu`` test checks the same in bf16 with the
real kernels.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from moelab.model.transformer import MoELab
from moelab.ops.kda import infer_plan
from tests.helpers import assert_close
from tests.model.tiny import tiny_config

KINDS = {"hybrid": dict(pattern="KKKM"), "all_kda": dict(pattern="K", final_mla=False), "all_mla": dict(pattern="M")}
MODES = ["prenorm", "block_attnres"]


def model(**kw) -> MoELab:
    torch.manual_seed(0)
    return MoELab(tiny_config(**kw)).eval()


def data(B: int, T: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids and their next-token targets, a few of them ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (B, T + 1), generator=gen)
    targets = ids[:, 1:].clone()
    targets[:, ::7] = -100
    return ids[:, :-1], targets


@pytest.fixture
def infer_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Counts the calls of the KDA inference forward (the op imports it at call time)."""
    calls = []
    real = infer_plan.kda_infer

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(infer_plan, "kda_infer", spy)
    return calls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_loss_equals_full_forward(mode: str, kind: str, chunk: int) -> None:
    m = model(mode=mode, **KINDS[kind])
    ids, targets = data(2, 30)
    with torch.no_grad():
        full = m(ids, targets)
    pre = m.prefill(ids, targets, chunk_size=chunk)
    per_token = F.cross_entropy(full.logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                reduction="none").view(targets.shape)
    assert pre.token_loss.shape == (2, 30) and (pre.token_loss[targets == -100] == 0).all()
    assert_close(per_token, pre.token_loss, 1e-6, "per-token loss")
    assert abs(pre.loss.item() - full.loss.item()) <= 1e-6 * full.loss.item()
    assert_close(full.logits[:, -1], pre.last_logits, 1e-6, "last logits")
    assert pre.state.seq_len == 30


def test_pieces_and_state() -> None:
    """``prefill_chunks`` yields pieces in order with their logits; the MLA cache holds every token
    and the KDA state keeps its size; two prefills chained by ``state=`` equal one."""
    m = model()
    ids, targets = data(2, 30)
    with torch.no_grad():
        full = m(ids).logits
    pieces = list(m.prefill_chunks(ids, chunk_size=8))
    assert [p.start for p in pieces] == [0, 8, 16, 24] and [p.logits.shape[1] for p in pieces] == [8, 8, 8, 6]
    assert all(p.token_loss is None for p in pieces)
    assert_close(full, torch.cat([p.logits for p in pieces], 1), 1e-6, "logits of the pieces")
    layers = pieces[-1].state.layers
    kinds = [layer.kind for layer in m.layers]
    assert [layers[i].shape for i, k in enumerate(kinds) if k == "mla"] == [(2, 30, 12)]
    assert all(layers[i].S.shape == (2, 2, 8, 8) for i, k in enumerate(kinds) if k == "kda")
    first = m.prefill(ids[:, :11], targets[:, :11], chunk_size=4)
    second = m.prefill(ids[:, 11:], targets[:, 11:], chunk_size=5, state=first.state)
    whole = m.prefill(ids, targets, chunk_size=30)
    assert_close(whole.token_loss, torch.cat([first.token_loss, second.token_loss], 1), 1e-6, "chained")
    assert second.state.seq_len == 30


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_then_decode_equals_full_forward(kind: str) -> None:
    m = model(**KINDS[kind])
    ids, _ = data(2, 25)
    pre = m.prefill(ids[:, :24], chunk_size=5)
    with torch.no_grad():
        step = m(ids[:, 24:], state=pre.state, use_cache=True)
        full = m(ids).logits
    assert_close(full[:, 23], pre.last_logits, 1e-6, "logits at the prompt's last token")
    assert_close(full[:, 24], step.logits[:, 0], 1e-6, "logits at the next position")


def test_restores_mode_and_checks_arguments() -> None:
    m = model().train()
    ids, targets = data(1, 10)
    m.prefill(ids, targets, chunk_size=3)
    assert m.training
    with pytest.raises(ValueError, match="chunk_size=0 is not allowed"):
        m.prefill(ids, chunk_size=0)
    with pytest.raises(ValueError, match="exceeds max_seq_len=128"):
        m.prefill(torch.zeros(1, 129, dtype=torch.long))
    with pytest.raises(ValueError, match="token id 50 out of range"):
        m.prefill(torch.full((1, 4), 50))
    assert torch.isnan(m.prefill(ids, torch.full_like(targets, -100)).loss)  # as F.cross_entropy


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU tensors through the Triton interpreter (GPU machines run the bf16 test below)")
def test_inference_path_equals_training_path_interpreter(infer_calls: list) -> None:
    """KDA backend ``triton`` in the CPU interpreter, fp32: prefill (no gradient: the inference
    forward, chunk 16) vs a forward that builds a graph (the training op), at pieces that cut
    the 16-token chunks."""
    m = model(kda_backend="triton")
    ids, targets = data(1, 37)
    out = m(ids, targets)
    assert out.loss.requires_grad and not infer_calls
    pre = m.prefill(ids, targets, chunk_size=20)
    assert len(infer_calls) == 2 * 3  # two pieces through three KDA layers
    per_token = F.cross_entropy(out.logits.detach().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                reduction="none").view(targets.shape)
    assert_close(per_token, pre.token_loss, 1e-5, "per-token loss")
    assert_close(out.logits.detach()[:, -1], pre.last_logits, 1e-5, "last logits")


def gpu_model() -> MoELab:
    """The tiny stack with KDA heads of a real size (the inference forward's K, V = 128)."""
    cfg = tiny_config(kda_backend="auto", max_seq_len=4096)
    cfg = replace(cfg, kda=replace(cfg.kda, num_heads=4, head_dim=128, chunk_size=64)).validate()
    torch.manual_seed(0)
    return MoELab(cfg).cuda().eval()


@pytest.mark.gpu
def test_inference_path_equals_training_path_bf16_gpu(infer_calls: list) -> None:
    """bf16 autocast on the GPU: chunked prefill and generate (the inference forward) against the
    full forward with a graph (the training op), within bf16 tolerance."""
    m = gpu_model()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 1500), generator=gen).cuda()
    targets = torch.randint(0, 50, (2, 1500), generator=gen).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(ids, targets)
        assert out.loss.requires_grad and not infer_calls
        pre = m.prefill(ids, targets, chunk_size=512)
        assert len(infer_calls) == 3 * 3
        new, logits = m.generate(ids[:, :1000], 8, temperature=0, prefill_chunk=300, return_logits=True)
    per_token = F.cross_entropy(out.logits.detach().float().flatten(0, 1), targets.flatten(),
                                reduction="none").view(targets.shape)
    assert_close(per_token, pre.token_loss, 2e-2, "per-token loss, bf16")
    assert abs(pre.loss.item() - out.loss.item()) <= 5e-3 * out.loss.item()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = m(new).logits.detach().float()  # grad mode on, parameters require grad: the training op
    assert_close(ref[:, 999:1007], logits.float(), 2e-2, "generate's logits, bf16")
