"""MoE operators (moelab.ops.moe): dispatch / combine / combine+norm / top-k / input projection, Triton vs PyTorch."""

import pytest
import torch

from moelab.ops.moe import (
    combine,
    combine_norm,
    dispatch,
    make_plan,
    mm_f32,
    project_input,
    select_experts,
    split_bf16,
    topk_select,
)
from tests.helpers import assert_close

# The fused Triton kernels run on CUDA when there is a GPU, else in the interpreter on CPU.
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_dispatch_combine_kernels_match_autograd():
    torch.manual_seed(0)
    n, k, e, r = 13, 3, 5, 24
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)]).to(DEV)
    counts = torch.bincount(idx.flatten(), minlength=e)
    plan = make_plan(idx, counts)
    assert torch.equal(plan.offs, counts.cumsum(0).to(torch.int32))
    # rows are expert-contiguous and token_of / inv are inverse maps
    assert torch.equal(idx.flatten()[plan.inv.argsort()], idx.flatten().sort(stable=True).values)
    assert torch.equal(plan.token_of[plan.inv], torch.arange(n, device=DEV).repeat_interleave(k))
    for dtype, tol in [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]:
        x = torch.randn(n, r).to(DEV, dtype)
        y = torch.randn(n * k, r).to(DEV, dtype)
        w = torch.rand(n, k, device=DEV)
        gxs, gu = torch.randn(n * k, r).to(DEV, dtype), torch.randn(n, r, device=DEV)
        outs = []
        for backend in ("torch", "triton"):
            xl, yl, wl = (t.clone().requires_grad_() for t in (x, y, w))
            xs = dispatch(xl, plan, backend)
            u = combine(yl, wl, plan, backend)
            assert u.dtype == torch.float32
            torch.autograd.backward([xs, u], [gxs, gu])
            outs.append((xs, u, xl.grad, yl.grad, wl.grad))
        for name, a, b in zip(("xs", "u", "dx", "dy", "dw"), *outs):
            assert_close(a.float(), b.float(), tol, f"{dtype} {name}")


def test_combine_norm_kernel_matches_autograd():
    """Fused combine + RMSNorm (Triton) vs combine then F.rms_norm, forward and grads (rows, weights, gain)."""
    torch.manual_seed(0)
    for n, k, e, r in [(13, 3, 5, 24), (17, 1, 4, 40), (9, 4, 6, 16)]:  # N not a multiple of the 8 tokens/program
        idx = torch.stack([torch.randperm(e)[:k] for _ in range(n)]).to(DEV)
        plan = make_plan(idx, torch.bincount(idx.flatten(), minlength=e))
        for dtype, tol in [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]:
            y = (torch.randn(n * k, r) * 3).to(DEV, dtype)
            w = torch.rand(n, k, device=DEV)
            gamma = (1 + 0.3 * torch.randn(r)).to(DEV)
            gz = torch.randn(n, r).to(DEV, dtype)
            outs = []
            for backend in ("torch", "triton"):
                yl, wl, gl = (t.clone().requires_grad_() for t in (y, w, gamma))
                if backend == "triton":
                    z = combine_norm(yl, wl, plan, gl, 1e-6, dtype, backend)
                else:  # the reference written out: combine, then F.rms_norm
                    z = torch.nn.functional.rms_norm(combine(yl, wl, plan, "torch"), (r,), gl, 1e-6).to(dtype)
                assert z.dtype == dtype
                z.backward(gz)
                outs.append((z, yl.grad, wl.grad, gl.grad))
            for name, a, b in zip(("z", "dy", "dw", "dgamma"), *outs):
                if name == "dw" and k == 1:  # RMSNorm(w y) does not depend on w > 0: both are round-off
                    continue
                assert_close(a.float(), b.float(), tol, f"{dtype} n={n} k={k} {name}")


@pytest.mark.parametrize("e,k", [(6, 1), (6, 3), (6, 6), (40, 8)])
def test_topk_select_matches_torch(e, k):
    torch.manual_seed(0)
    n = 300  # several programs, the last one partial
    scores = torch.rand(n, e)
    scores[5, 2] = float("nan")  # counts as -inf: never picked while a finite score is left
    bias = torch.randn(e) * 0.1
    idx, counts = topk_select(scores.to(DEV), bias.to(DEV), k)
    assert idx.dtype == torch.long and idx.shape == (n, k) and counts.dtype == torch.long
    ref = torch.topk(torch.nan_to_num(scores, nan=float("-inf")) + bias, k, dim=-1)
    assert torch.equal(idx.cpu(), ref.indices)  # same experts in the same (descending) order
    assert torch.equal(counts.cpu(), torch.bincount(ref.indices.flatten(), minlength=e))
    for backend in ("torch", "triton"):  # the op's front door: both backends agree with the kernel
        idx_b, counts_b = select_experts(torch.nan_to_num(scores, nan=float("-inf")).to(DEV), bias.to(DEV), k, backend)
        assert torch.equal(idx_b.cpu(), ref.indices) and torch.equal(counts_b.cpu(), counts.cpu()), backend
    with pytest.raises(ValueError, match=f"k={e + 1}"):
        topk_select(scores.to(DEV), bias.to(DEV), e + 1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_input_projection_matches_autograd(backend):
    """Router + W_down + shared gate|up (Triton backend: one autograd node): outputs and the summed
    input gradient against separate autograd matmuls."""
    torch.manual_seed(0)
    x = torch.randn(11, 24)
    w_r, w_a, w_b = torch.randn(5, 24), torch.randn(8, 24), torch.randn(16, 24)
    g_r, g_a, g_b = torch.randn(11, 5), torch.randn(11, 8), torch.randn(11, 16)
    for ws, gs in [((w_a, w_b), (g_a, g_b)), ((), ())]:
        leaves = [t.clone().requires_grad_() for t in (x, w_r, *ws)]
        logits, outs = project_input(leaves[0], leaves[1], leaves[2:], torch.float32, backend)
        assert logits.dtype == torch.float32 and len(outs) == len(ws)
        torch.autograd.backward([logits, *outs], [g_r, *gs])
        ref = [t.clone().requires_grad_() for t in (x, w_r, *ws)]
        ref_outs = [ref[0] @ w.T for w in ref[1:]]
        torch.autograd.backward(ref_outs, [g_r, *gs])
        for a, b, name in zip([logits, *outs], ref_outs, ("logits", "a", "b")):
            assert_close(b.detach(), a.detach(), 1e-6, name)
        for a, b, name in zip(leaves, ref, ("dx", "dw_r", "dw_a", "dw_b")):
            assert_close(b.grad, a.grad, 1e-6, name)
    frozen = x.clone()  # an input without grad: only the weight gradients are formed
    w = w_r.clone().requires_grad_()
    project_input(frozen, w, [], torch.float32, backend)[0].backward(g_r)
    assert_close(g_r.T @ frozen, w.grad, 1e-6, "dw_r, x frozen")


def test_split_bf16_pairs():
    torch.manual_seed(0)
    t = torch.randn(1000) * torch.logspace(-3, 3, 1000)
    hi, lo = split_bf16(t)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert ((hi.float() + lo.float() - t).abs() <= 2.0 ** -16 * t.abs()).all()
    a, m = torch.randn(7, 32), torch.randn(32, 5)
    assert_close(a @ m, mm_f32(a, m), 1e-7, "mm_f32 on CPU is the fp32 matmul")


@pytest.mark.gpu
def test_cuda_mm_f32_precision():
    """bf16 operands: exact fp32 products (only the summation order differs); fp32 x bf16: hi/lo pairs."""
    torch.manual_seed(0)
    a, b = torch.randn(512, 1024, device="cuda"), torch.randn(1024, 64, device="cuda")
    ab, bb = a.bfloat16(), b.bfloat16()
    assert_close(ab.double() @ bb.double(), mm_f32(ab, bb), 2e-6, "bf16 x bf16")
    assert_close(a.double() @ b.double(), mm_f32(a, b), 2e-6, "fp32 x fp32 (plain fp32)")
    assert_close(a.double() @ bb.double(), mm_f32(a, bb), 3e-5, "fp32 x bf16 (split)")
    assert_close(ab.double() @ b.double(), mm_f32(ab, b), 3e-5, "bf16 x fp32 (split)")
