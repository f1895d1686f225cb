"""SiTU-GLU / SwiGLU (moelab.ops.glu): bounds, the SwiGLU limit, the fused Triton kernel vs PyTorch."""

import pytest
import torch
import torch.nn.functional as F

from moelab.ops.glu import glu, situ_glu, swiglu
from tests.helpers import assert_close, rel_err

# The fused Triton kernels run on CUDA when there is a GPU, else in the interpreter on CPU.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _situ_ref(g: torch.Tensor, u: torch.Tensor, b1: float, b2: float) -> torch.Tensor:
    """fp64 transcription of the definition, written independently of the module."""
    g, u = g.double(), u.double()
    return b1 * torch.tanh(g / b1) * (1.0 / (1.0 + torch.exp(-g))) * b2 * torch.tanh(u / b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_glu_bounded_by_beta_product(dtype):
    torch.manual_seed(0)
    huge = torch.tensor([0.0, 1.0, -1.0, 1e3, -1e3, 1e30, -1e30, 3e38, -3e38, float("inf"), float("-inf")])
    g, u = torch.meshgrid(huge, huge, indexing="ij")
    g = torch.cat([g.flatten(), torch.randn(4096) * 1e4]).to(DEV, dtype)
    u = torch.cat([u.flatten(), torch.randn(4096) * 1e4]).to(DEV, dtype)
    for b1, b2 in [(4.0, 25.0), (1.0, 2.0)]:
        out = situ_glu(g, u, b1, b2)
        fused = glu(torch.stack([g, u], -1).view(-1, 2), "situ_glu", b1, b2, backend="triton").view(-1)
        for name, o in [("reference", out), ("fused", fused)]:
            assert torch.isfinite(o).all(), name
            assert o.abs().max().item() <= b1 * b2 * (1 + 1e-6), name
        assert_close(out.float(), fused.float(), 1e-6 if dtype == torch.float32 else 1e-2, "fused vs reference")
    # The cap is reached: large positive gate and up give close to b1 * b2.
    assert situ_glu(torch.tensor(1e4), torch.tensor(1e4)).item() == pytest.approx(100.0, rel=1e-6)


def test_situ_glu_matches_definition():
    torch.manual_seed(0)
    g, u = torch.randn(2, 1000, dtype=torch.float64) * 10
    assert_close(_situ_ref(g, u, 4.0, 25.0), situ_glu(g, u), 1e-12, "situ_glu")


def test_situ_glu_tends_to_swiglu():
    torch.manual_seed(0)
    g, u = torch.randn(2, 10_000, dtype=torch.float64) * 3
    ref = swiglu(g, u)
    errs = [rel_err(ref, situ_glu(g, u, b, b)) for b in (4.0, 25.0, 1e2, 1e3, 1e4)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs  # monotone in beta
    assert errs[-1] < 1e-3, errs
    # O(z^3 / b^2): ten times larger betas cut the error about a hundredfold.
    assert errs[-1] < errs[-2] / 50, errs
    assert_close(F.silu(g) * u, swiglu(g, u), 1e-12, "swiglu")


def test_situ_glu_gradients_fp64():
    torch.manual_seed(0)
    g = (torch.randn(64, dtype=torch.float64) * 5).requires_grad_()
    u = (torch.randn(64, dtype=torch.float64) * 40).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b, 4.0, 25.0), (g, u))


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("scale", [0.05, 3.0, 200.0])
def test_fused_glu_matches_reference(activation, dtype, tol, scale):
    """Triton kernel (interpreter on CPU) vs autograd of the fp64 PyTorch formula: output and grad."""
    torch.manual_seed(0)
    h = (torch.randn(37, 2 * 48) * scale).to(DEV, dtype).requires_grad_()
    go = torch.randn(37, 48).to(DEV, dtype)
    out = glu(h, activation, backend="triton")
    out.backward(go)
    h64 = h.detach().double().requires_grad_()
    ref = glu(h64, activation, backend="torch")
    ref.backward(go.double())
    assert out.dtype == dtype and out.shape == (37, 48)
    assert_close(ref, out, tol, f"{activation} out")
    assert_close(h64.grad, h.grad, tol, f"{activation} grad")


def test_fused_glu_keeps_leading_dims():
    torch.manual_seed(0)
    h = torch.randn(2, 3, 16, device=DEV)
    assert_close(glu(h, "situ_glu", backend="torch"), glu(h, "situ_glu", backend="triton"), 1e-6, "3d")
