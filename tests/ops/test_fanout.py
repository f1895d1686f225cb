"""fan_out: one autocast cast for the projections that read a layer's input (forward bit for bit what autocast
computes, gradient the same fp32 sum), its Triton sum of the readers' gradients, and the KDA and MLA layers that
use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from moelab.model import kda as kda_module
from moelab.model import mla as mla_module
from moelab.model.config import KDAConfig, MLAConfig
from moelab.model.kda import KDALayer
from moelab.model.mla import MLA
from moelab.ops.fanout import fan_out, widen_sum
from tests.helpers import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _readers(x0: torch.Tensor, ws: list[torch.Tensor], fanned: bool, autocast: bool = True, used: int | None = None,
             backend: str = "torch"):
    """``len(ws)`` linear readers of a non-leaf ``h = 2 x`` (a norm's output: autocast caches no cast of it) and
    the gradients of a loss weighting reader i by i + 1; ``used``: only the first ``used`` readers enter the loss."""
    x = x0.clone().requires_grad_()
    w = [v.clone().requires_grad_() for v in ws]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        h = x * 2.0
        hs = fan_out(h, len(ws), backend) if fanned else (h,) * len(ws)
        ys = [F.linear(a, b) for a, b in zip(hs, w)]
        loss = sum((y.float() ** 2).sum() * (i + 1) for i, y in enumerate(ys[:used]))
    loss.backward()
    return ys, x.grad, [v.grad for v in w]


def _inputs(n: int = 3):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 32, 64, generator=gen), [torch.randn(48, 64, generator=gen) * 0.1 for _ in range(n)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_is_autocasts_cast_and_the_gradient_its_fp32_sum(backend):
    x0, ws = _inputs()
    ys, dx, dws = _readers(x0, ws, fanned=True, backend=backend)
    ref_ys, ref_dx, ref_dws = _readers(x0, ws, fanned=False)
    for y, r in zip(ys, ref_ys):
        assert y.dtype == torch.bfloat16 and torch.equal(y, r)  # one cast, the same bits as each reader's own
    assert dx.dtype == torch.float32
    assert_close(ref_dx, dx, 1e-6, "dx vs autocast's path")  # the same widened terms, summed in fp32
    for d, r in zip(dws, ref_dws):
        assert torch.equal(d, r)
    # and against the fp32 computation (no autocast): bf16 matmuls
    _, f32_dx, _ = _readers(x0, ws, fanned=False, autocast=False)
    assert_close(f32_dx, dx, 2e-2, "dx vs fp32")


def test_a_reader_outside_the_loss_adds_nothing():
    x0, ws = _inputs()
    _, dx, _ = _readers(x0, ws, fanned=True, used=2)
    _, ref_dx, _ = _readers(x0, ws, fanned=False, used=2)
    assert_close(ref_dx, dx, 1e-6, "dx")


def test_without_autocast_or_in_the_autocast_dtype_the_input_itself():
    x = torch.randn(3, 5, requires_grad=True)
    assert all(t is x for t in fan_out(x, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xb = x.to(torch.bfloat16)
        assert all(t is xb for t in fan_out(xb, 2))
        assert all(t is not x and t.dtype == torch.bfloat16 for t in fan_out(x * 1.0, 2))
    with pytest.raises(ValueError, match=r"fan_out: n=0 is not allowed: expected >= 1"):
        fan_out(x, 0)


class _InputCasts(TorchDispatchMode):
    """Counts the casts of a tensor of ``shape`` to bf16 (what autocast does to a layer's input per projection)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.n = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._to_copy and args[0].shape == self.shape \
                and kwargs.get("dtype") == torch.bfloat16:
            self.n += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("k, n", [(1, 7), (3, 2048), (6, 5000), (7, 4097), (13, 300)])
def test_widen_sum_adds_the_widened_terms_in_order_on_both_backends(k, n):
    """The Triton sum (interpreter) equals the PyTorch chain bit for bit (same terms, same order) for 1 to 6 terms
    per launch and more (a second launch adds into the first's result), mixed 16/32-bit terms and a ragged last
    block; both within fp32 rounding of the fp64 sum."""
    gen = torch.Generator().manual_seed(k)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    gs = [torch.randn(n, generator=gen).to(dtypes[i % 3]) for i in range(k)]
    fast, ref = widen_sum(gs, "triton"), widen_sum(gs, "torch")
    assert fast.dtype == ref.dtype == torch.float32 and torch.equal(fast, ref)
    assert_close(sum(g.double() for g in gs), fast, 1e-6, "sum vs fp64")
    assert all(g.dtype == dtypes[i % 3] for i, g in enumerate(gs))  # the terms untouched


def test_widen_sum_names_bad_input():
    with pytest.raises(ValueError, match=r"widen_sum: grads=\[\] is not allowed: expected >= 1 tensor"):
        widen_sum([])
    with pytest.raises(ValueError, match=r"widen_sum: grads\[1\] is \(3,\) torch.bfloat16, expected \(2,\) floating"):
        widen_sum([torch.zeros(2), torch.zeros(3, dtype=torch.bfloat16)])


@pytest.mark.gpu
def test_widen_sum_on_the_gpu_at_a_kda_layers_size():
    """bf16, a k3-mini KDA layer's six input gradients (8 x 4096 tokens, width 512): the kernel equals the PyTorch
    chain bit for bit."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    gs = [torch.randn(8, 4096, 512, generator=gen, device=DEV).to(torch.bfloat16) for _ in range(6)]
    assert torch.equal(widen_sum(gs, "triton"), widen_sum(gs, "torch"))


def _layer_run(m: torch.nn.Module, x0: torch.Tensor):
    x = x0.clone().requires_grad_()
    casts = _InputCasts(x0.shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x * 1.0
        with casts:
            y, _ = m(h)
        loss = (y.float() ** 2).sum()
    loss.backward()
    return y, x.grad, {n: p.grad for n, p in m.named_parameters()}, casts.n


@pytest.mark.parametrize("make, readers", [
    (lambda: KDALayer(24, KDAConfig(num_heads=2, head_dim=8, decay_rank=4, backend="chunk", chunk_size=16)), 6),
    (lambda: MLA(24, MLAConfig(num_heads=3, head_dim=8, kv_latent_dim=10, q_latent_dim=12, fp32_output=True)), 2),
    (lambda: MLA(24, MLAConfig(num_heads=3, head_dim=8, kv_latent_dim=10, fp32_output=False)), 3),
], ids=["kda", "mla-fp32-output", "mla-16-bit-gate"])
def test_layers_compute_what_they_computed_with_a_cast_per_projection(make, readers, monkeypatch):
    """A KDA / MLA layer under autocast casts its input once where each of its ``readers`` projections cast it
    before; the output bit for bit and every gradient (the input's within fp32 regrouping) equal to the same
    layer with fan_out switched off."""
    torch.manual_seed(0)
    m = make()
    x0 = torch.randn(2, 32, 24)
    y, dx, grads, casts = _layer_run(m, x0)
    m.zero_grad(set_to_none=True)
    for mod in (kda_module, mla_module):
        monkeypatch.setattr(mod, "fan_out", lambda x, n: (x,) * n)
    ref_y, ref_dx, ref_grads, ref_casts = _layer_run(m, x0)
    assert (casts, ref_casts) == (1, readers)
    assert torch.equal(y, ref_y)
    assert_close(ref_dx, dx, 1e-5, "dx")
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
