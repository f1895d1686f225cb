"""The fused RMSNorm (moelab.ops.rms_norm) against the fp32 torch path of moelab.model.norm.RMSNorm: forward and
the gradients of x and the weight, in the Triton interpreter on CPU (fp32 / fp16 / bf16 storage) and on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _reference(x, w, eps, dy):
    """The torch path in fp32 (``RMSNorm(backend="torch")``), its output rounded to x's dtype as that path does."""
    xr = x.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_() if w is not None else None
    y = F.rms_norm(xr, (x.shape[-1],), wr, eps)
    y.backward(dy.float())
    return y.to(x.dtype).float(), xr.grad, (wr.grad if wr is not None else None)


GPU_SHAPES = [pytest.param((8, 4096, 512), True, marks=pytest.mark.gpu),  # gpu-small's pre-norms
              pytest.param((8, 4096, 4, 128), True, marks=pytest.mark.gpu),  # the KDA output norm per head
              pytest.param((32768, 7168), True, marks=pytest.mark.gpu)]  # K3's width


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, weight", [((3, 5, 40), True), ((70, 128), True), ((2, 9, 600), False),
                                           ((1, 1, 16), True), *GPU_SHAPES],
                         ids=["B3T5D40", "N70D128", "D600-noweight", "one-row", "gpu-B8T4096D512",
                              "gpu-heads-D128", "gpu-N32768D7168"])
def test_matches_the_fp32_torch_path(shape, weight, dtype):
    """Rows of a non-power-of-two width (masked columns), several rows per tile, row tiles split across the
    backward's programs, no weight: y in x's dtype, dx and dw within the storage dtype's bound of the fp32 path."""
    from moelab.ops.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(DEV, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(DEV) if weight else None
    dy = torch.randn(*shape, generator=gen).to(DEV, dtype)
    ref_y, ref_dx, ref_dw = _reference(x, w, 1e-6, dy)
    xl = x.clone().requires_grad_()
    wl = w.clone().requires_grad_() if w is not None else None
    y = rms_norm(xl, wl, 1e-6)
    y.backward(dy)
    assert y.dtype == dtype and y.shape == x.shape and xl.grad.dtype == dtype
    tol = TOL[dtype]
    assert_close(y.float(), ref_y, tol, "y")
    assert_close(xl.grad.float(), ref_dx, tol, "dx")
    if weight:
        assert wl.grad.dtype == torch.float32
        assert_close(wl.grad, ref_dw, tol, "dw")


def _gated_reference(x, w, gate, eps, dy):
    """``sigmoid(gate) * rms_norm(x, w)`` in fp32 and its gradients (x, w, gate), y rounded to x's dtype."""
    xr, gr = x.detach().float().requires_grad_(), gate.detach().float().requires_grad_()
    wr = w.detach().float().requires_grad_()
    y = torch.sigmoid(gr) * F.rms_norm(xr, (x.shape[-1],), wr, eps)
    y.backward(dy.float())
    return y.to(x.dtype).float(), xr.grad, wr.grad, gr.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 3, 16), (37, 96), pytest.param((8, 4096, 4, 128), marks=pytest.mark.gpu)],
                         ids=["heads-D16", "N37D96", "gpu-B8T4096-heads-D128"])
def test_gated_matches_the_fp32_reference(shape, dtype):
    """The output-gated form (KDA's sigmoid(W_g x) * RMSNorm(o) per head): y, dx, dw and dgate within the storage
    dtype's bound of the fp32 reference, at a masked width and at several heads per row tile; the gate's gradient
    comes back in the gate's dtype."""
    from moelab.ops.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(sum(shape) + 7)
    x = (torch.randn(*shape, generator=gen) * 3).to(DEV, dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(DEV)
    gate = (2 * torch.randn(*shape, generator=gen)).to(DEV, dtype)
    dy = torch.randn(*shape, generator=gen).to(DEV, dtype)
    ref_y, ref_dx, ref_dw, ref_dg = _gated_reference(x, w, gate, 1e-6, dy)
    xl, wl, gl = x.clone().requires_grad_(), w.clone().requires_grad_(), gate.clone().requires_grad_()
    y = rms_norm(xl, wl, 1e-6, gate=gl)
    y.backward(dy)
    assert y.dtype == dtype and gl.grad.dtype == dtype and gl.grad.shape == gate.shape
    tol = TOL[dtype]
    for name, got, ref in (("y", y, ref_y), ("dx", xl.grad, ref_dx), ("dw", wl.grad, ref_dw),
                           ("dgate", gl.grad, ref_dg)):
        assert_close(got.float(), ref, tol, name)


def test_gated_module_paths_agree_and_the_torch_path_is_the_two_ops():
    """``RMSNorm(x, gate)``: the torch path is bitwise ``sigmoid(gate) * norm(x)`` (what KDALayer computed before the
    gate moved into the norm), the Triton path agrees with it; a gate of another shape names both shapes."""
    from moelab.model.norm import RMSNorm
    from moelab.ops.rms_norm import rms_norm

    norm = RMSNorm(16, eps=1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = torch.randn(3, 5, 2, 16, device=DEV, dtype=torch.bfloat16)
    gate = torch.randn(3, 5, 2, 16, device=DEV, dtype=torch.bfloat16)
    ref = norm(x, gate)
    assert torch.equal(ref, torch.sigmoid(gate) * norm(x))
    norm.backend = "triton"
    assert_close(norm(x, gate).float(), ref.float(), 1e-2, "y")
    with pytest.raises(ValueError, match=r"gate shape \(3, 5, 32\) is not allowed: expected x's shape \(3, 5, 2, 16\)"):
        rms_norm(x, norm.weight, 1e-6, gate=gate.view(3, 5, 32))


def test_module_backends_agree_and_the_model_sets_them():
    """``RMSNorm`` with backend "triton" equals backend "torch" (eps None: fp32's epsilon on both), and
    ``model.norm_backend`` reaches every norm of a model; bad input names the value."""
    from moelab.config import load_config
    from moelab.model import MoELab
    from moelab.model.norm import RMSNorm
    from moelab.ops.rms_norm import rms_norm

    norm = RMSNorm(24, eps=None).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 24))
    x = torch.randn(4, 7, 24, device=DEV) * 1e-3  # small rows: eps matters
    ref = norm(x)
    norm.backend = "triton"
    assert_close(norm(x), ref, 1e-5, "y")
    cfg = load_config("tiny", {"model.norm_backend": "triton"})
    model = MoELab(cfg.model)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.backend == "triton" for m in norms)
    with pytest.raises(ValueError, match=r"weight shape \(5,\)"):
        rms_norm(x, torch.ones(5, device=DEV))
    with pytest.raises(ValueError, match="int64"):
        rms_norm(torch.ones(2, 3, dtype=torch.int64, device=DEV), None)
