"""Residual modes: depth attention vs the formulas of attnres.md, block bookkeeping, full == block(S=1)."""

from __future__ import annotations

import pytest
import torch

from moelab.model.attnres import AttnResidual, DepthAttention
from moelab.model.config import ConfigError, ResidualConfig
from moelab.model.transformer import MoELab
from tests.helpers import assert_close
from tests.model.tiny import tiny_config

D = 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rms_norm(v: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w


def depth_reference(att: DepthAttention, sources: list[torch.Tensor]) -> torch.Tensor:
    """``h = sum_i a_i v_i``, ``a = softmax_i(w^T RMSNorm(v_i))``, written per source."""
    logits = torch.stack([(rms_norm(v, att.key_norm.weight) * att.query).sum(-1) for v in sources])
    a = logits.softmax(0)
    return sum(a[i, ..., None] * v for i, v in enumerate(sources))


def test_depth_attention_matches_formula_and_starts_uniform() -> None:
    torch.manual_seed(0)
    att = DepthAttention(D)
    sources = [torch.randn(2, 5, D) * s for s in (1.0, 3.0, 0.2)]
    h0, w0 = att(torch.stack(sources))
    assert_close(sum(sources) / 3, h0, 1e-6, "zero query = uniform average")
    assert torch.allclose(w0, torch.full_like(w0, 1 / 3))
    with torch.no_grad():
        att.query.normal_()
        att.key_norm.weight.uniform_(0.5, 1.5)
    h, w = att(torch.stack(sources))
    assert_close(depth_reference(att, sources), h, 1e-6, "h")
    assert w.shape == (3, 2, 5) and torch.allclose(w.sum(0), torch.ones(2, 5))


def stream_reference(mode: str, n_sub: int, ends: list[int], outputs: list[torch.Tensor],
                     emb: torch.Tensor, depth: torch.nn.ModuleList) -> list[torch.Tensor]:
    """The reads h_0..h_{n_sub} (last = final) written straight from attnres.md."""
    reads = []
    for i in range(n_sub + 1):
        done = outputs[:i]
        if mode == "prenorm":
            reads.append(emb + sum(done, torch.zeros_like(emb)))
            continue
        closed = [e for e in ends if e <= i]
        starts = [0] + closed
        sources = [emb] + [sum(outputs[a:b]) for a, b in zip(starts[:-1], starts[1:])]
        if starts[-1] < i:
            sources.append(sum(outputs[starts[-1]:i]))  # partial current block
        reads.append(depth_reference(depth[i], sources))
    return reads


@pytest.mark.parametrize("mode, num_blocks, uneven", [
    ("prenorm", 1, False), ("full_attnres", 1, False), ("block_attnres", 1, False), ("block_attnres", 2, False),
    ("block_attnres", 4, False), ("block_attnres", 3, True), ("block_attnres", 5, True),
])
def test_stream_reads_match_reference(mode: str, num_blocks: int, uneven: bool) -> None:
    n_sub = 8
    cfg = ResidualConfig(mode=mode, num_blocks=num_blocks, uneven_blocks=uneven)
    res = AttnResidual(D, n_sub, cfg)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in res.parameters():
            p.normal_()
    emb = torch.randn(2, 3, D)
    outputs = [torch.randn(2, 3, D) for _ in range(n_sub)]
    stream = res.stream(emb, diagnostics=True)
    reads = []
    for i in range(n_sub):
        reads.append(stream.read(i))
        stream.write(i, outputs[i])
    reads.append(stream.read_final())
    ref = stream_reference(mode, n_sub, cfg.block_ends(n_sub), outputs, emb, res.depth)
    for i, (a, b) in enumerate(zip(ref, reads)):
        assert_close(a, b, 1e-6, f"read {i}")
    diag = stream.diagnostics()
    assert diag["hidden_rms"].shape == (n_sub + 1,) and diag["output_rms"].shape == (n_sub,)
    assert len(diag["depth_weights"]) == (0 if mode == "prenorm" else n_sub + 1)


@pytest.mark.parametrize("mode, num_blocks, launch", [("full_attnres", 1, ""), ("block_attnres", 3, ""),
                                                      ("block_attnres", 3, "r2w1g2-b1w2g4s2")])
def test_stream_on_the_fused_op_matches_torch_with_gradients(mode: str, num_blocks: int, launch: str,
                                                             monkeypatch) -> None:
    """A whole residual stream on the fused op (its reads go through ``read_sources``: only the sources a
    read owns are autograd inputs, the rest reach their producers through the gradient slots) against the
    same stream on the torch path: every read, and the gradients of the embedding, the sublayers' inputs
    (through their outputs), the queries and the norm weights, with a loss that weighs every read. With
    ``residual.launch`` every read runs at that launch (forward and backward) instead of the rule's."""
    from moelab.ops import attnres as op

    seen = []
    real_fwd = op._forward_kernels
    monkeypatch.setattr(op, "_forward_kernels", lambda q, w, eps, dt, cfg, *a, **kw: seen.append(cfg) or real_fwd(
        q, w, eps, dt, cfg, *a, **kw))
    n_sub = 6
    torch.manual_seed(3)
    res = AttnResidual(D, n_sub, ResidualConfig(mode=mode, num_blocks=num_blocks, launch=launch)).to(DEV)
    with torch.no_grad():
        for p in res.parameters():
            p.normal_()
    emb0 = torch.randn(2, 5, D, device=DEV)
    mats = [torch.randn(D, D, device=DEV) / D ** 0.5 for _ in range(n_sub)]
    probes = [torch.randn(2, 5, D, device=DEV) for _ in range(n_sub + 1)]

    def run(backend: str) -> list[torch.Tensor]:
        for d in res.depth:
            d.backend = backend
        res.zero_grad(set_to_none=True)
        emb = emb0.clone().requires_grad_(True)
        stream = res.stream(emb)
        loss = emb.new_zeros(())
        for i in range(n_sub):
            h = stream.read(i)
            loss = loss + (h * probes[i]).sum()
            stream.write(i, torch.tanh(h @ mats[i]))  # a sublayer: its input's gradient needs its output's
        loss = loss + (stream.read_final() * probes[-1]).sum()
        loss.backward()
        return [loss.detach(), emb.grad] + [t for d in res.depth for t in (d.query.grad, d.key_norm.weight.grad)
                                              if t is not None]

    ref, fused = run("torch"), run("triton")
    want = op.LaunchConfig.parse(launch) if launch else op.launch_config(D)
    assert len(seen) == n_sub + 1 and all(cfg == want for cfg in seen)
    assert len(ref) == len(fused)
    for i, (a, b) in enumerate(zip(ref, fused)):
        assert_close(a, b, 1e-3, f"tensor {i}")  # fp32 both; a lost slot gradient is off by O(1)


def test_block_ends() -> None:
    assert ResidualConfig("block_attnres", 4).block_ends(8) == [2, 4, 6, 8]
    assert ResidualConfig("full_attnres").block_ends(4) == [1, 2, 3, 4]
    assert ResidualConfig("prenorm").block_ends(4) == []
    ends = ResidualConfig("block_attnres", 8, uneven_blocks=True).block_ends(186)  # K3
    sizes = [b - a for a, b in zip([0] + ends[:-1], ends)]
    assert len(ends) == 8 and ends[-1] == 186 and set(sizes) == {23, 24}
    with pytest.raises(ConfigError, match="residual.num_blocks=8"):
        ResidualConfig("block_attnres", 8).validate(186)
    with pytest.raises(ConfigError, match="residual.num_blocks=9"):
        ResidualConfig("block_attnres", 9, uneven_blocks=True).validate(8)
    for bad in ("r3w4g1", "fast", "r4w4g1-b4w4g16"):  # rows not a power of two; no spec; group past 8
        with pytest.raises(ConfigError, match=f"residual.launch='{bad}' is not allowed"):
            ResidualConfig("block_attnres", 4, launch=bad).validate(8)
    assert ResidualConfig("block_attnres", 4, launch="r4w4g1-b4w4g2").launch_config().bwd_launch == (4, 4, 2, 1)


@pytest.mark.parametrize("pattern", ["KKKM", "M"])
def test_block_with_one_block_per_sublayer_equals_full(pattern: str) -> None:
    torch.manual_seed(0)
    full = MoELab(tiny_config(pattern=pattern, mode="full_attnres"))
    block = MoELab(tiny_config(pattern=pattern, mode="block_attnres", num_blocks=8))  # 4 layers = 8 sublayers
    with torch.no_grad():
        for p in full.residual.parameters():  # non-zero queries, so the mixing is not uniform
            p.normal_()
    block.load_state_dict(full.state_dict())
    ids = torch.randint(0, 50, (2, 21))
    a, b = full(ids, return_diagnostics=True), block(ids, return_diagnostics=True)
    assert torch.equal(a.logits, b.logits)
    for wa, wb in zip(a.diagnostics["depth_weights"], b.diagnostics["depth_weights"]):
        assert torch.equal(wa, wb)


def test_attnres_queries_start_at_zero_and_learn() -> None:
    m = MoELab(tiny_config(mode="block_attnres", num_blocks=4))
    assert len(m.residual.depth) == 2 * 4 + 1
    assert all(torch.equal(d.query, torch.zeros(32)) for d in m.residual.depth)
    ids = torch.randint(0, 50, (2, 12))
    m(ids, ids).loss.backward()
    # The first sublayer has one source (the embedding): a softmax over one item has no gradient.
    assert torch.equal(m.residual.depth[0].query.grad, torch.zeros(32))
    assert all(d.query.grad.abs().sum() > 0 for d in m.residual.depth[1:])


# Host work one residual read may add to a training step over prenorm (forward + backward + optimizer),
# whatever the number of sources it mixes: the fused op's two launches and one autograd Function, that
# Function's graph node and the AccumulateGrad of its two parameters, and a few allocations and one
# sum (moelab.train.host_work.count_step gives the breakdown: about 8.5 aten ops per read now).
PER_READ = {"triton_launches": 2, "fn_applies": 1, "graph_nodes": 3, "aten_ops": 9, "attnres_py_calls": 16}


@pytest.fixture(scope="module")
def step_counts() -> dict:
    """Counts of one training step of the tiny model (4 layers, 9 reads; fused op, bf16 autocast, fused
    AdamW) per residual mode."""
    from moelab.train.host_work import count_step
    from moelab.train.host_work import train_loss as _loss
    from moelab.train.host_work import train_update as _update

    counts = {}
    for mode, blocks in (("prenorm", 2), ("block_attnres", 4), ("full_attnres", 1)):
        cfg = tiny_config(mode=mode, num_blocks=blocks)
        cfg.residual.backend = "triton"
        torch.manual_seed(0)
        model = MoELab(cfg).to(DEV)
        x = torch.randint(0, cfg.vocab_size, (2, 16), device=DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        _update(_loss(model, x), opt)  # optimizer state, kernel caches
        counts[mode] = count_step(model, x, opt)
    return counts


@pytest.mark.parametrize("mode", ["block_attnres", "full_attnres"])
def test_step_host_work_per_read_is_bounded(step_counts: dict, mode: str) -> None:
    """Over prenorm, a step of an AttnRes mode adds at most ``PER_READ`` of each count per read (exactly
    two launches and one Function): no per-source op, launch or Python call, so full AttnRes (up to
    9 sources here) costs what block AttnRes does."""
    reads = 2 * 4 + 1
    base, got = step_counts["prenorm"], step_counts[mode]
    assert got["triton_launches"] - base["triton_launches"] == 2 * reads, got["by"]["triton_launches"]
    assert got["fn_applies"] - base["fn_applies"] == reads, got["by"]["fn_applies"]
    for key, limit in PER_READ.items():
        added = got[key] - base[key]
        assert added <= limit * reads, f"{mode}: {key} +{added} over prenorm, more than {limit} per read x {reads}"
