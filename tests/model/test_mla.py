"""Gated MLA against an explicit fp32 softmax-attention reference; latent cache decoding."""

from __future__ import annotations

import pytest
import torch

from moelab.base import ConfigError
from moelab.model.config import MLAConfig
from moelab.model.mla import MLA
from tests.helpers import assert_close

D = 24


def mla(**kw) -> MLA:
    torch.manual_seed(0)
    cfg = MLAConfig(num_heads=3, head_dim=8, kv_latent_dim=10, **kw)
    cfg.validate()
    m = MLA(D, cfg)
    with torch.no_grad():  # non-trivial norm weights so the reference must apply them
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m


def reference(m: MLA, x: torch.Tensor) -> torch.Tensor:
    """Written from the formulas: latent -> RMSNorm -> K, V; causal softmax; gate; out-proj."""
    B, T, _ = x.shape
    H, Dh = m.H, m.Dh

    def rms(z, w):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    c = rms(x @ m.kv_down.weight.T, m.kv_norm.weight)
    if m.cfg.q_latent_dim:
        q = rms(x @ m.q_down.weight.T, m.q_norm.weight) @ m.q_up.weight.T
    else:
        q = x @ m.q_proj.weight.T
    k, v = c @ m.k_up.weight.T, c @ m.v_up.weight.T
    q, k, v = (t.view(B, T, H, Dh) for t in (q, k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) / Dh**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhij,bjhd->bihd", scores.softmax(-1), v).reshape(B, T, H * Dh)
    if m.cfg.output_gate:
        o = torch.sigmoid(x @ m.g_proj.weight.T) * o
    return o @ m.o_proj.weight.T


VARIANTS = [dict(), dict(q_latent_dim=6), dict(output_gate=False), dict(fp32_output=True)]


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "default")
def test_forward_and_grads_match_reference(kw: dict) -> None:
    m = mla(**kw)
    x = torch.randn(2, 13, D)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, cache = m(x1)
    assert cache is None
    y_ref = reference(m, x2)
    assert_close(y_ref, y, 1e-5, "y")
    gy = torch.randn_like(y)
    g1 = torch.autograd.grad(y, [x1, *m.parameters()], gy)
    g2 = torch.autograd.grad(y_ref, [x2, *m.parameters()], gy)
    for i, (a, b) in enumerate(zip(g2, g1)):
        assert_close(a, b, 1e-5, f"grad {i}")


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(kw) or "default")
def test_latent_cache_prefill_and_decode_equal_one_pass(kw: dict) -> None:
    m = mla(**kw)
    x = torch.randn(2, 20, D)
    full, _ = m(x)
    cache, outs = None, []
    for a, b in ((0, 7), (7, 8), (8, 15)):
        y, cache = m(x[:, a:b], cache, use_cache=True)
        outs.append(y)
    for t in range(15, 20):
        y, cache = m(x[:, t:t + 1], cache, use_cache=True)
        outs.append(y)
    assert cache.shape == (2, 20, 10)  # only the latent is cached
    assert_close(full, torch.cat(outs, 1), 1e-5, "cached vs one pass")


def test_fp32_output_under_bf16_autocast() -> None:
    x = torch.randn(2, 9, D)
    ref = reference(mla(fp32_output=True), x)
    errs = {}
    for fp32 in (False, True):
        m = mla(fp32_output=fp32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = m(x)
        errs[fp32] = ((y.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
        if fp32:
            assert y.dtype == torch.float32  # the stream's dtype, not bf16
    assert errs[True] < 2e-2 and errs[False] < 5e-2  # bf16 projections either way
    assert errs[True] <= errs[False]  # gate + out-proj in fp32 remove one bf16 rounding


def test_fp32_output_precision_runs_both_directions_at_it_and_restores_the_process_setting(monkeypatch) -> None:
    """``fp32_output_precision="high"`` (TF32 on a GPU): the gate and output projection's matmuls run inside
    ``set_float32_matmul_precision("high")`` in the forward and in the backward, the process's setting is back after
    each; on the CPU the output and gradients equal "highest"'s (the CPU has no TF32). A process that set its TF32
    through torch's newer flags is left as it is; a precision outside the two names is refused."""
    from moelab.model import mla as mla_module

    real, entered = mla_module.matmul_precision, []

    def recorded(precision):
        entered.append(precision)
        return real(precision)

    monkeypatch.setattr(mla_module, "matmul_precision", recorded)
    x = torch.randn(2, 9, D)
    outs, blocks = {}, {}
    for prec in ("highest", "high", "tf32x3"):
        m = mla(fp32_output=True, fp32_output_precision=prec)
        xi = x.clone().requires_grad_()
        entered.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = m(xi)
        fwd = len(entered)
        y.float().pow(2).sum().backward()
        blocks[prec] = (fwd, len(entered) - fwd, set(entered))
        outs[prec] = (y.detach(), xi.grad, m.o_proj.weight.grad, m.g_proj.weight.grad)
        assert torch.get_float32_matmul_precision() == "highest"
    # the gate and o_proj: one matmul each forward, two each backward (dx, dw); tf32x3's three products in one block
    assert blocks == {"highest": (0, 0, set()), "high": (2, 4, {"high"}), "tf32x3": (2, 4, {"high"})}
    for a, b in zip(outs["highest"], outs["high"]):
        assert_close(a.float(), b.float(), 1e-6, "high vs highest on the CPU")
    for a, b in zip(outs["highest"], outs["tf32x3"]):  # the three fp32 products on the CPU: fp32 rounding apart
        assert_close(a.float(), b.float(), 1e-5, "tf32x3 vs highest on the CPU")
    calls = []
    monkeypatch.setattr(mla_module.torch, "set_float32_matmul_precision", lambda p: calls.append(p))
    with mla_module.matmul_precision("high"):
        pass
    assert calls == ["high", "highest"]
    calls.clear()

    def newer_flags():
        raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(mla_module.torch, "get_float32_matmul_precision", newer_flags)
    with mla_module.matmul_precision("high"):
        pass
    assert calls == []
    with pytest.raises(ConfigError, match="fp32_output_precision"):
        MLAConfig(fp32_output=True, fp32_output_precision="tf32").validate()


def test_tf32_split_and_tf32x3_matmul() -> None:
    """tf32_split: hi keeps 10 mantissa bits (a TF32 operand, exact), hi + lo is x bit for bit, |lo| <= 2^-10 |x|,
    for any strides; tf32x3_mm matches the fp64 product to fp32 level on the CPU, transposed operands too."""
    from moelab.model.mla import tf32_split, tf32x3_mm

    x = torch.randn(96, 40) * torch.logspace(-3, 3, 40)
    for t in (x, x.t()):
        hi, lo = tf32_split(t)
        assert torch.equal(hi + lo, t) and hi.stride() == t.stride()
        assert torch.equal(hi.view(torch.int32) & 0x1FFF, torch.zeros_like(hi, dtype=torch.int32))
        assert (lo.abs() <= t.abs() * 2.0 ** -10).all()
    a, b = torch.randn(80, 64), torch.randn(64, 48)
    ref = a.double() @ b.double()
    for aa, bb in ((a, b), (a.t().contiguous().t(), b.t().contiguous().t())):
        err = (tf32x3_mm(aa, bb).double() - ref).abs().max() / ref.abs().max()
        assert err < 2e-6, err
    with pytest.raises(ValueError, match="tf32x3_mm takes no autograd graph"):
        tf32x3_mm(a.requires_grad_(), b)


@pytest.mark.gpu
def test_fp32_output_precision_high_on_gpu() -> None:
    """On a GPU, "high" (TF32) stays within TF32's rounding of "highest" for the output and every gradient, under bf16
    autocast, and leaves the process at its precision."""
    x = torch.randn(4, 64, D, device="cuda")
    outs = []
    for prec in ("highest", "high", "tf32x3"):
        m = mla(fp32_output=True, fp32_output_precision=prec).cuda()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = m(xi)
        y.float().pow(2).sum().backward()
        outs.append((y.detach().float(), xi.grad, m.o_proj.weight.grad, m.g_proj.weight.grad))
        assert torch.get_float32_matmul_precision() == "highest"
    for name, a, b, c in zip(("y", "dx", "do_proj", "dg_proj"), *outs):
        assert_close(a, b, 5e-3, name)
        assert_close(a, c, 5e-5, f"{name} (tf32x3)")  # fp32 accuracy from TF32 products


@pytest.mark.gpu
def test_tf32x3_matmul_is_fp32_accurate_on_gpu() -> None:
    """On a GPU's TF32 tensor cores tf32x3_mm is as close to the fp64 product as IEEE fp32 (within 4x its error),
    where one TF32 product is ~1000x further; the process's precision is left as it was."""
    from moelab.model.mla import matmul_precision, tf32x3_mm

    a, b = torch.randn(4096, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    ref = a.double() @ b.double()

    def err(y: torch.Tensor) -> float:
        return float((y.double() - ref).norm() / ref.norm())

    fp32, x3 = err(a @ b), err(tf32x3_mm(a, b))
    with matmul_precision("high"):
        tf32 = err(a @ b)
    assert x3 <= 4 * fp32 and tf32 > 100 * fp32, (fp32, x3, tf32)
    assert torch.get_float32_matmul_precision() == "highest"
