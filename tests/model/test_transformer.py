"""MoELab: causality in every residual mode and layer kind, cached generation == full forward,
input validation, init, loss and aux-loss plumbing."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moelab.model.transformer import ModelOutput, MoELab
from tests.helpers import assert_close, rel_err
from tests.model.tiny import tiny_config

KINDS = {  # layer kinds: hybrid, all-KDA, all-MLA
    "hybrid": dict(pattern="KKKM"),
    "all_kda": dict(pattern="K", final_mla=False),
    "all_mla": dict(pattern="M"),
}
MODES = ["prenorm", "full_attnres", "block_attnres"]


def model(**kw) -> MoELab:
    torch.manual_seed(0)
    return MoELab(tiny_config(**kw)).eval()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_causal(mode: str, kind: str) -> None:
    m = model(mode=mode, **KINDS[kind])
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (2, 40))
    changed = ids.clone()
    t = 23
    changed[:, t + 1:] = torch.randint(0, 50, (2, 40 - t - 1))
    with torch.no_grad():
        a, b = m(ids).logits, m(changed).logits
    assert_close(a[:, :t + 1], b[:, :t + 1], 1e-6, "logits up to t")
    assert rel_err(a[:, t + 1:], b[:, t + 1:]) > 1e-3  # the later positions did see the change


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_logits_equal_full_forward(mode: str, kind: str) -> None:
    m = model(mode=mode, **KINDS[kind])
    prompt = torch.randint(0, 50, (2, 21), generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    ids, logits = m.generate(prompt, 12, temperature=1.0, generator=gen, prefill_chunk=8, return_logits=True)
    assert ids.shape == (2, 33) and torch.equal(ids[:, :21], prompt)
    with torch.no_grad():
        full = m(ids).logits
    assert_close(full[:, 20:32], logits, 1e-5, "decoded vs full-forward logits")


def test_generate_greedy_top_k_and_reproducible() -> None:
    m = model()
    prompt = torch.randint(0, 50, (1, 5))
    greedy = m.generate(prompt, 6, temperature=0)
    with torch.no_grad():  # greedy = argmax of the full forward at every step
        logits = m(greedy).logits
    assert torch.equal(greedy[:, 5:], logits[:, 4:10].argmax(-1))
    a = m.generate(prompt, 6, generator=torch.Generator().manual_seed(7))
    b = m.generate(prompt, 6, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    ids, lg = m.generate(prompt, 6, top_k=1, return_logits=True)  # top-1 sampling is greedy
    assert torch.equal(ids, greedy)
    assert m.generate(prompt, 0).shape == (1, 5)


def test_generate_restores_training_mode() -> None:
    m = model().train()
    m.generate(torch.randint(0, 50, (1, 3)), 2)
    assert m.training


def test_input_validation() -> None:
    m = model(max_seq_len=32)
    with pytest.raises(ValueError, match="token id 50 out of range.*vocab_size=50"):
        m(torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="token id -1 out of range"):
        m(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        m(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, T\] long"):
        m(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets shape"):
        m(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        m.generate(torch.zeros(1, 30, dtype=torch.long), 3)
    out = m(torch.zeros(1, 20, dtype=torch.long), use_cache=True)
    with pytest.raises(ValueError, match=r"cached 20 \+ new 13"):
        m(torch.zeros(1, 13, dtype=torch.long), state=out.state)
    with pytest.raises(ValueError, match="top_k=0"):
        m.generate(torch.zeros(1, 3, dtype=torch.long), 1, top_k=0)


def test_loss_matches_cross_entropy_and_ignores_minus_100() -> None:
    m = model()
    ids = torch.randint(0, 50, (2, 10))
    targets = torch.randint(0, 50, (2, 10))
    targets[0, :4] = -100
    out = m(ids, targets)
    assert isinstance(out, ModelOutput)
    keep = targets != -100
    ref = F.cross_entropy(out.logits[keep].double(), targets[keep])
    assert abs(out.loss.item() - ref.item()) < 1e-5
    assert m(ids).loss is None


@pytest.mark.parametrize("loss_backend", ["torch", "triton"])
def test_loss_without_logits_matches(loss_backend: str) -> None:
    """``return_logits=False`` (what training uses): the same loss and parameter gradients from the
    chunked linear cross-entropy (either ``model.loss_backend``; Triton in the interpreter here), and no logits."""
    ids = torch.randint(0, 50, (2, 10))
    targets = torch.randint(0, 50, (2, 10))
    targets[1, 6:] = -100
    runs = []
    for return_logits in (True, False):
        m = model(loss_backend=loss_backend)
        out = m(ids, targets, return_logits=return_logits)
        out.loss.backward()
        assert (out.logits is None) != return_logits
        runs.append((out.loss, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (l_ref, g_ref), (l_out, g_out) = runs
    assert abs(l_out.item() - l_ref.item()) <= 1e-5 * abs(l_ref.item())
    assert g_ref.keys() == g_out.keys()
    for name in g_ref:
        assert_close(g_ref[name], g_out[name], 1e-5, name)


def test_aux_loss_and_router_stats() -> None:
    m = model(dense_layers=1)  # 3 MoE layers
    ids = torch.randint(0, 50, (2, 6))
    out = m(ids)
    assert len(out.router_stats) == 3 and out.aux_loss.shape == () and out.aux_loss.item() == 0.0
    assert all(s.tokens_per_expert.sum().item() == 2 * 6 * 2 for s in out.router_stats)
    for layer in m.layers[1:]:
        layer.ffn.router.aux_loss_fn = lambda stats: stats.scores.mean()
    out = m(ids)
    ref = sum(s.scores.mean() for s in out.router_stats)
    assert abs(out.aux_loss.item() - ref.item()) < 1e-6 and out.aux_loss.requires_grad
    dense = model(dense_layers=4)
    out = dense(ids)
    assert out.router_stats == [] and out.aux_loss.item() == 0.0


def test_init() -> None:
    cfg = tiny_config(n_layers=8, dense_layers=2, mode="block_attnres", num_blocks=4)
    torch.manual_seed(0)
    m = MoELab(cfg)
    std, scaled = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    plain = torch.cat([layer.mixer.q_proj.weight.flatten() for layer in m.layers])
    writers = []  # the projections that write into the residual stream
    for layer in m.layers:
        writers.append(layer.mixer.o_proj.weight)
        if layer.is_moe:
            writers += [layer.ffn.proj_up.weight, layer.ffn.shared.down.weight]
        else:
            writers.append(layer.ffn.down.weight)
    outs = torch.cat([w.flatten() for w in writers])
    assert abs(plain.std().item() / std - 1) < 0.1
    assert abs(outs.std().item() / scaled - 1) < 0.1
    assert abs(m.embed.weight.std().item() / std - 1) < 0.05
    assert all(torch.equal(d.query, torch.zeros(32)) for d in m.residual.depth)
    kda = [layer.mixer for layer in m.layers if layer.kind == "kda"]
    assert all(torch.equal(k.A_log, torch.zeros(2)) for k in kda)  # A = 0 for either gate
    soft = MoELab(tiny_config(gate="softplus"))
    assert all(torch.equal(layer.mixer.A_log, torch.zeros(2)) for layer in soft.layers if layer.kind == "kda")


def test_tied_embeddings() -> None:
    m = model(tie_embeddings=True)
    assert m.lm_head.weight is m.embed.weight
    ids = torch.randint(0, 50, (1, 5))
    m(ids, ids).loss.backward()
    assert m.embed.weight.grad is not None


def test_diagnostics() -> None:
    m = model(mode="block_attnres", num_blocks=4)
    out = m(torch.randint(0, 50, (2, 9)), return_diagnostics=True)
    d = out.diagnostics
    assert d["hidden_rms"].shape == (9,) and d["output_rms"].shape == (8,)
    assert len(d["depth_weights"]) == 9
    assert all(abs(w.sum().item() - 1) < 1e-5 for w in d["depth_weights"])
    assert d["g_min"].shape == (3,) and (d["g_min"] >= -5).all() and (d["g_mean"] <= 0).all()
    assert m(torch.randint(0, 50, (2, 9))).diagnostics is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_triton_kda_model(mode: str) -> None:
    """On a CUDA device (KDA backend auto -> Triton, SDPA flash): cached generation equals the full
    forward in fp32, and a bf16-autocast training step gives finite loss and gradients."""
    torch.manual_seed(0)
    m = MoELab(tiny_config(mode=mode, kda_backend="auto", max_seq_len=512)).cuda()
    prompt = torch.randint(0, 50, (2, 150), device="cuda")
    ids, logits = m.generate(prompt, 10, prefill_chunk=100, return_logits=True)
    with torch.no_grad():
        full = m(ids).logits
    assert_close(full[:, 149:159], logits, 1e-4, "decoded vs full-forward logits")
    m.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = m(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
