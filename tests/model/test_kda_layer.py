"""KDA layer: gates, ShortConv, state carry (chunked prefill + decoding == one pass), config bounds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from moelab.base import ConfigError
from moelab.model import kda as kda_module
from moelab.model.config import KDAConfig
from moelab.model.kda import KDALayer, ShortConv
from moelab.ops.kda.bounds import G_MIN_FLOOR, max_safe_g_min
from moelab.ops.kda.gate import naive_kda_gate
from tests.helpers import assert_close

D = 24


def layer(gate: str = "bounded", backend: str = "chunk", **kw) -> KDALayer:
    torch.manual_seed(0)
    cfg = KDAConfig(num_heads=2, head_dim=8, decay_rank=4, gate=gate, backend=backend, chunk_size=16, **kw)
    cfg.validate()
    return KDALayer(D, cfg)


def _output_and_grads(m: KDALayer, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output of ``m`` on ``x`` and the gradients of ``sum(y^2)`` for x and every parameter."""
    xi = x.clone().requires_grad_()
    y, _ = m(xi)
    y.pow(2).sum().backward()
    return y.detach(), [xi.grad] + [p.grad for p in m.parameters()]


def _assert_runs_agree(a: tuple, b: tuple, y_tol: float, grad_tol: float) -> None:
    assert_close(a[0], b[0], y_tol, "y")
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        assert_close(ga, gb, grad_tol, f"grad {i}")


def test_shortconv_matches_explicit_causal_sum() -> None:
    torch.manual_seed(0)
    conv = ShortConv(channels=5, size=4)
    x = torch.randn(2, 9, 5)
    y, tail = conv(x)
    w = conv.weight[:, 0]  # [C, size]
    xp = F.pad(x, (0, 0, 3, 0))  # three zeros before the first token
    ref = torch.stack([sum(w[:, j] * xp[:, t + j] for j in range(4)) for t in range(9)], dim=1)
    assert_close(ref, y, 1e-6, "conv")
    assert torch.equal(tail, x[:, -3:])


def test_shortconv_tail_chains_short_pieces() -> None:
    torch.manual_seed(0)
    conv = ShortConv(channels=3, size=4)
    x = torch.randn(1, 7, 3)
    full, _ = conv(x)
    tail, outs = None, []
    for piece in (x[:, :1], x[:, 1:3], x[:, 3:4], x[:, 4:]):  # pieces shorter than the kernel
        y, tail = conv(piece, tail)
        outs.append(y)
    assert_close(full, torch.cat(outs, 1), 1e-6, "chained conv")


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_gate_range_and_init(gate: str) -> None:
    m = layer(gate)
    x = 30 * torch.randn(2, 20, D)  # large inputs push the gate to its extremes
    g = m.log_decay(x)
    assert g.shape == (2, 20, 2, 8) and g.dtype == torch.float32
    assert (g <= 0).all()
    if gate == "bounded":
        assert (g >= m.cfg.g_min).all()
    assert torch.equal(m.A_log, torch.zeros(2))  # A = 0 at init for either gate (K3)
    # At z = b (x = 0) the decay starts in Mamba's range: g = -exp(A) * dt, dt in [1e-3, 0.1].
    g0 = m.log_decay(torch.zeros(1, 1, D))[0, 0]
    dt = -g0 / m.A_log.exp()[:, None]
    assert ((dt > 0.9e-3) & (dt < 0.11)).all()


def _trained_like(m: KDALayer, seed: int = 1) -> KDALayer:
    """Move the gate parameters off their init as training does: per-head rates ``exp(A_log)`` spread
    moved by about e^{+-0.9} (a fresh bounded gate has A_log = 0, where exp(A) = 1 + A hides a wrong
    rate) and the per-channel bias of ``W_up`` shifted."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.A_log.add_(torch.linspace(-0.9, 0.9, m.H) + 0.1 * torch.randn(m.H, generator=gen))
        m.f_up.bias.add_(torch.randn(m.f_up.bias.shape, generator=gen))
    return m


def _gate_fp64(z: torch.Tensor, A_log: torch.Tensor, gate: str, g_min: float | None) -> torch.Tensor:
    """The gate written out in fp64 from the paper's formulas (not from moelab's code):
    bounded ``g_min / (1 + e^{-e^A z})``, softplus ``-e^A ln(1 + e^z)``; z ``[B, T, H, K]``, A_log ``[H]``."""
    z, rate = z.double(), A_log.double().exp()[:, None]
    if gate == "bounded":
        return g_min / (1 + torch.exp(-rate * z))
    return -rate * torch.log1p(torch.exp(z))


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_gate_formulas_with_trained_like_parameters(gate: str) -> None:
    """The layer's log decay and the op's gate (with a dt_bias) at random A_log: the fp64 formula."""
    m = _trained_like(layer(gate))
    x = 3 * torch.randn(2, 9, D)
    z = m.f_up(m.f_down(x)).view(2, 9, 2, 8).detach()
    assert_close(_gate_fp64(z, m.A_log.detach(), gate, m.g_min), m.log_decay(x).detach(), 1e-6, "layer log decay")
    dt_bias = torch.randn(2 * 8)
    got = naive_kda_gate(z, m.A_log.detach(), gate, m.g_min, dt_bias)
    assert_close(_gate_fp64(z + dt_bias.view(2, 8), m.A_log.detach(), gate, m.g_min), got, 1e-6, "gate with dt_bias")


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_prefill_and_decode_agree_with_trained_like_gate(gate: str) -> None:
    """A prompt through the Triton op (its gate fused in the kernel), then token-by-token decoding
    (T = 1 takes the PyTorch recurrence and its gate): with trained-like A_log and bias both must
    give the one-pass output. At init the two gates agree whatever the rate formula says."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = _trained_like(layer(gate, backend="triton")).to(dev)
    x = torch.randn(1, 24, D, device=dev)
    with torch.no_grad():
        full, _ = m(x)
        y, state = m(x[:, :18], use_cache=True)
        outs = [y]
        for t in range(18, 24):
            y, state = m(x[:, t:t + 1], state, use_cache=True)
            outs.append(y)
    assert_close(full, torch.cat(outs, 1), 1e-5, "prefill + decode vs one pass")


@pytest.mark.parametrize("gate, bound", [("bounded", -5.0), ("softplus", None)])
def test_whole_op_reaches_the_dispatcher(monkeypatch: pytest.MonkeyPatch, gate: str, bound) -> None:
    seen = {}
    real = kda_module.kda

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(kda_module, "kda", spy)
    layer(gate)(torch.randn(1, 5, D))
    assert seen["g_min"] == bound and seen["backend"] == "chunk" and seen["validate"] is False
    assert seen["gate"] == gate and seen["silu_qk"] and seen["l2norm_qk"] and "A_log" in seen


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_triton_backend_matches_chunk_in_the_layer(gate: str) -> None:
    """The layer's call into the Triton kernels (CPU interpreter here, the GPU on a CUDA machine):
    fp32 q/k/v with fp32 g and beta, chunk 16, T not a multiple of it."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1, 40, D, device=dev)
    runs = []
    for backend in ("chunk", "triton"):
        torch.manual_seed(0)
        runs.append(_output_and_grads(KDALayer(D, KDAConfig(num_heads=2, head_dim=16, decay_rank=4, gate=gate,
                                                            backend=backend, chunk_size=16)).to(dev), x))
    _assert_runs_agree(*runs, y_tol=1e-4, grad_tol=1e-3)


def test_fused_output_norm_and_gate_match_the_torch_path_in_the_layer() -> None:
    """The layer's output norm and gate through the fused Triton norm (``model.norm_backend`` "triton") equal the torch
    path's sigmoid(W_g x) * RMSNorm(o): the output and the gradient of x and of every parameter (g_proj and the norm
    weight included), fp32, in the interpreter on CPU."""
    x = torch.randn(2, 21, D)
    runs = []
    for backend in ("torch", "triton"):
        m = layer()
        m.o_norm.backend = backend
        with torch.no_grad():
            m.o_norm.weight.copy_(torch.linspace(0.5, 1.5, m.o_norm.weight.numel()))
        runs.append(_output_and_grads(m, x))
    _assert_runs_agree(*runs, y_tol=1e-5, grad_tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_triton_layer_under_bf16_autocast_on_gpu(gate: str) -> None:
    """bf16 q/k/v into the kernels (fp32 g, beta) vs the fp32 chunked PyTorch path; state carry too."""
    x = torch.randn(2, 200, D, device="cuda")
    torch.manual_seed(0)
    ref = KDALayer(D, KDAConfig(num_heads=2, head_dim=16, decay_rank=4, gate=gate, backend="chunk")).cuda()
    fast = KDALayer(D, KDAConfig(num_heads=2, head_dim=16, decay_rank=4, gate=gate, backend="triton")).cuda()
    fast.load_state_dict(ref.state_dict())
    y_ref, _ = ref(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _ = fast(x)
        y1, st = fast(x[:, :130], use_cache=True)
        y2, _ = fast(x[:, 130:], st, use_cache=True)
    assert_close(y_ref, y.float(), 2e-2, "y bf16")
    assert_close(y_ref, torch.cat([y1, y2], 1).float(), 2e-2, "y bf16, two pieces")


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_chunk_backend_matches_recurrent_in_the_layer(gate: str) -> None:
    x = torch.randn(2, 37, D)
    runs = [_output_and_grads(layer(gate, backend), x) for backend in ("recurrent", "chunk")]
    _assert_runs_agree(*runs, y_tol=1e-5, grad_tol=1e-4)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_state_carry_equals_one_pass(gate: str) -> None:
    m = layer(gate)
    x = torch.randn(2, 40, D)
    full, _ = m(x)
    state, outs = None, []
    for a, b in ((0, 17), (17, 18), (18, 20), (20, 33)):  # prefill pieces, incl. 1 and 2 tokens
        y, state = m(x[:, a:b], state, use_cache=True)
        outs.append(y)
    for t in range(33, 40):  # token-by-token decoding
        y, state = m(x[:, t:t + 1], state, use_cache=True)
        outs.append(y)
    assert_close(full, torch.cat(outs, 1), 1e-5, "pieces vs one pass")
    assert state.S.shape == (2, 2, 8, 8) and state.S.dtype == torch.float32
    assert all(t.shape == (2, 3, 16) for t in state.conv)


def test_no_state_without_use_cache_and_g_stats() -> None:
    m = layer()
    y, st = m(torch.randn(1, 6, D))
    assert st is None and y.shape == (1, 6, D)
    x = torch.randn(1, 6, D)
    g = m.log_decay(x)
    g_lo, g_mean = m.decay_stats(x).tolist()
    assert m.cfg.g_min <= g_lo <= g_mean <= 0
    assert g_lo == g.min().item() and abs(g_mean - g.mean().item()) < 1e-6


def test_config_rejects_g_min_the_kernels_cannot_hold() -> None:
    assert math.isclose(G_MIN_FLOOR, -88.72 / 16, rel_tol=1e-3)
    assert math.isclose(max_safe_g_min("fp16", 16), -0.69, rel_tol=1e-2)  # fp16 holds only ~ -0.69 at 16 tokens
    KDAConfig(g_min=-5.0).validate()
    with pytest.raises(ConfigError, match="kda.g_min=-6.0"):
        KDAConfig(g_min=-6.0).validate()
    KDAConfig(g_min=-6.0, backend="chunk").validate()  # the PyTorch path has no bound
    KDAConfig(g_min=-50.0, gate="softplus").validate()  # g_min unused by softplus
    with pytest.raises(ConfigError, match="kda.g_min"):
        KDAConfig(g_min=0.5, backend="chunk").validate()
