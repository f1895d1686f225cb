"""Fused KDA prep (moelab/ops/kda/triton_prep.py) against its fp32 PyTorch reference.

Forward outputs and every gradient (q, k, z, A_log, dt_bias) for each gate, SiLU and L2 norm on /
off, with and without dt_bias, K a power of two and not. On a CPU machine the kernels run in the
Triton interpreter (tests/conftest.py): small shapes, fp32 and fp16 only (the interpreter gets
bf16 wrong); the bf16 test at a real size is marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from moelab.ops.kda.gate import kda_prep_torch
from moelab.ops.kda.triton_prep import kda_prep, prep_bwd, prep_fwd, prep_fwd_chunked, prep_fwd_packed
from tests.helpers import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL, FP16_TOL = 1e-5, 2e-3
NAMES = ("dq", "dk", "dz", "dA_log", "ddt_bias")
# the interpreter evaluates tl.sigmoid as 1 / (1 + exp(-x)) in numpy, which warns on exp overflow
# for very negative x (the result, 0, is right)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(B, T, H, K, gate, bias=True, dtype=torch.float32, z_dtype=None, seed=0):
    """Raw q, k, z at the scale of projections (std 2) and the gate parameters of that gate kind."""
    gen = torch.Generator().manual_seed(seed)
    q, k, z = (2 * torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    A_log = torch.randn(H, generator=gen) if gate != "none" else None
    dt_bias = torch.randn(H * K, generator=gen) if gate != "none" and bias else None
    q, k = q.to(DEV, dtype), k.to(DEV, dtype)
    z = z.to(DEV, z_dtype or dtype)
    if A_log is not None:
        A_log = A_log.to(DEV)
    if dt_bias is not None:
        dt_bias = dt_bias.to(DEV)
    return [q, k, z, A_log, dt_bias]


def _run(fn, ins, seed=1, use=(True, True, True), **kw):
    """Outputs and input gradients of loss = sum_i <out_i, r_i> over the used outputs (random r_i)."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in ins]
    outs = fn(*leaves, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o, u in zip(outs, use) if u)
    loss.backward()
    return outs, [x.grad if x is not None else None for x in leaves]


def _compare(ins, tol, **kw):
    """Kernel vs the fp32 reference on the same (already rounded) inputs, forward and gradients."""
    ref_outs, ref_grads = _run(kda_prep_torch, [x.float() if x is not None else None for x in ins], **kw)
    outs, grads = _run(kda_prep, ins, **kw)
    assert outs[0].dtype == ins[0].dtype and outs[1].dtype == ins[0].dtype and outs[2].dtype == torch.float32
    for name, r, o in zip(("qn", "kn", "g"), ref_outs, outs):
        assert_close(r, o.float(), tol, name)
    for name, x, r, o in zip(NAMES, ins, ref_grads, grads):
        if x is None:
            assert o is None, f"{name}: gradient for an absent input"
            continue
        assert o.dtype == x.dtype, f"{name}: dtype {o.dtype} != input dtype {x.dtype}"
        assert_close(r, o.float(), tol, name)


@pytest.mark.parametrize("gate", ["bounded", "softplus", "none"])
@pytest.mark.parametrize("silu_qk", [False, True])
@pytest.mark.parametrize("l2norm_qk", [False, True])
def test_fp32_matches_reference(gate, silu_qk, l2norm_qk):
    # K = 48 (not a power of two: masked channels), 30 rows = 4 programs of 8, the last partial
    ins = _inputs(2, 5, 3, 48, gate)
    _compare(ins, FP32_TOL, gate=gate, g_min=-5.0, silu_qk=silu_qk, l2norm_qk=l2norm_qk)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
@pytest.mark.parametrize("K", [1, 32, 256])
def test_fp32_no_dt_bias_head_dims(gate, K):
    ins = _inputs(1, 3, 3, K, gate, bias=False, seed=K)
    # at K = 1 the L2 norm is sign(x): its gradient is 0 and only rounding noise is left to compare
    _compare(ins, FP32_TOL, gate=gate, g_min=-3.0, silu_qk=True, l2norm_qk=K > 1)


@pytest.mark.parametrize("gate", ["bounded", "softplus", "none"])
@pytest.mark.parametrize("K", [48, 64])
def test_fp16_matches_reference(gate, K):
    ins = _inputs(2, 4, 2, K, gate, dtype=torch.float16, seed=K)
    _compare(ins, FP16_TOL, gate=gate, g_min=-5.0, silu_qk=True, l2norm_qk=True)


def test_fp16_qk_with_fp32_gate_input():
    # the model's z is fp32 (log_decay upcasts) while q, k are in the activation dtype
    ins = _inputs(2, 4, 2, 40, "softplus", dtype=torch.float16, z_dtype=torch.float32)
    _compare(ins, FP16_TOL, gate="softplus", g_min=None, silu_qk=True, l2norm_qk=True)


def test_extreme_values():
    """Softplus on both sides of its threshold (|x| > 20, where log(1 + e^x) underflows to the
    tail), saturated sigmoids, and an all-zero row for the L2 norm (its gradient is dy / eps)."""
    ins = _inputs(1, 4, 2, 16, "softplus", bias=False)
    z = ins[2]
    z[0, 0] = torch.linspace(-40, 40, 16)
    z[0, 1] = torch.linspace(-25, -15, 16)
    ins[0][0, 2, 1] = 0.0
    ins[1][0, 3, 0] = 1e-8  # norm 4e-8 < eps: the constant-denominator branch
    for gate in ("softplus", "bounded"):
        _compare(ins, FP32_TOL, gate=gate, g_min=-5.0, silu_qk=False, l2norm_qk=True)


def test_unused_outputs_and_frozen_inputs():
    ins = _inputs(1, 3, 2, 24, "bounded")
    kw = dict(gate="bounded", g_min=-5.0, silu_qk=True, l2norm_qk=True)
    # only qn feeds the loss: k and the gate inputs get no gradient at all
    _, grads = _run(kda_prep, ins, use=(True, False, False), **kw)
    _, ref = _run(kda_prep_torch, ins, use=(True, False, False), **kw)
    assert_close(ref[0], grads[0], FP32_TOL, "dq")
    assert all(x is None for x in grads[1:])
    # only g feeds the loss, A_log frozen: dz and ddt_bias still right
    leaves = [x.detach().clone().requires_grad_(i != 3) for i, x in enumerate(ins)]
    ref_leaves = [x.detach().clone().requires_grad_(i != 3) for i, x in enumerate(ins)]
    dg = torch.randn(ins[2].shape).to(DEV)
    kda_prep(*leaves, **kw)[2].mul(dg).sum().backward()
    kda_prep_torch(*ref_leaves, **kw)[2].mul(dg).sum().backward()
    assert leaves[0].grad is None and leaves[1].grad is None and leaves[3].grad is None
    assert_close(ref_leaves[2].grad, leaves[2].grad, FP32_TOL, "dz")
    assert_close(ref_leaves[4].grad, leaves[4].grad, FP32_TOL, "ddt_bias")


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_parameter_gradients_from_the_fp32_chain_rule(gate):
    """With z in bf16 (as on the GPU), dA_log and ddt_bias are sums over tokens of the fp32 chain rule,
    not of dz after its rounding to bf16: they match the fp32 reference to fp32 precision, while dz
    itself is only as close as its bf16 rounding allows. ddt_bias used to be summed from the rounded
    dz: 3e-3 here (the interpreter truncates to bf16), 300x this bound."""
    B, T, H, K = 2, 48, 2, 16
    gen = torch.Generator().manual_seed(7)
    z = (2 * torch.randn(B, T, H, K, generator=gen)).bfloat16()
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    dg = torch.randn(B, T, H, K, generator=gen)
    q = k = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    kw = dict(gate=gate, g_min=-5.0 if gate == "bounded" else None, silu_qk=False, l2norm_qk=False)
    _, _, dz, dA_log, ddt_bias = prep_bwd(*(x.to(DEV) for x in (q, k, z, A_log, dt_bias)), None, None,
                                          dg.to(DEV), **kw)
    assert dz.dtype == torch.bfloat16 and dA_log.dtype == ddt_bias.dtype == torch.float32
    leaves = [x.float().requires_grad_() for x in (z, A_log, dt_bias)]
    g = kda_prep_torch(q.float(), k.float(), *leaves, gate=gate, g_min=kw["g_min"], l2norm_qk=False)[2]
    (g * dg).sum().backward()
    assert_close(leaves[0].grad, dz.float().cpu(), 1e-2, "dz")
    assert_close(leaves[1].grad, dA_log.cpu(), 1e-5, "dA_log")
    assert_close(leaves[2].grad, ddt_bias.cpu(), 1e-5, "ddt_bias")


def test_prep_bwd_partial_gradients_and_determinism():
    q, k, z, A_log, dt_bias = _inputs(2, 3, 2, 20, "softplus")
    kw = dict(gate="softplus", g_min=None, silu_qk=True, l2norm_qk=True)
    assert prep_bwd(q, k, z, A_log, dt_bias, None, None, None, **kw) == (None,) * 5
    dkn, dg = torch.randn_like(k), torch.randn_like(z)
    first = prep_bwd(q, k, z, A_log, dt_bias, None, dkn, dg, **kw)
    second = prep_bwd(q, k, z, A_log, dt_bias, None, dkn, dg, **kw)
    assert first[0] is None
    for name, a, b in zip(NAMES[1:], first[1:], second[1:]):
        assert torch.equal(a, b), f"{name}: two runs differ"
    # the host function agrees with autograd through the reference
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, z, A_log, dt_bias)]
    _, kn, g = kda_prep_torch(*leaves, **kw)
    ((kn * dkn).sum() + (g * dg).sum()).backward()
    for name, leaf, out in zip(NAMES[1:], leaves[1:], first[1:]):
        assert_close(leaf.grad, out, FP32_TOL, name)
    qn, kn2, g2 = prep_fwd(q, k, z, A_log, dt_bias, **kw)
    assert_close(kn.detach(), kn2, FP32_TOL, "kn")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(gate="sigmoid"), "gate='sigmoid' is not allowed"),
        (dict(g_min=0.0), "g_min=0.0 is not allowed"),
        (dict(g_min=None), "g_min=None is not allowed"),
        (dict(eps=0.0), "eps=0.0 is not allowed"),
        (dict(q=torch.randn(2, 3, 2, 300)), "K=300 is not allowed"),
        (dict(q=torch.randn(2, 3, 8)), "q must be"),
        (dict(k=torch.randn(2, 3, 2, 4)), "must match q"),
        (dict(q=torch.ones(2, 3, 2, 8, dtype=torch.int32)), "dtype"),
        (dict(z=torch.ones(2, 3, 2, 8, dtype=torch.float64)), "z dtype"),
        (dict(A_log=None), "needs A_log"),
        (dict(A_log=torch.zeros(3)), "needs A_log"),
        (dict(dt_bias=torch.zeros(8)), "dt_bias must be None or"),
        (dict(gate="none"), "A_log and dt_bias must be None"),
    ],
)
def test_bad_arguments(change, match):
    args = dict(
        q=torch.randn(2, 3, 2, 8),
        k=torch.randn(2, 3, 2, 8),
        z=torch.randn(2, 3, 2, 8),
        A_log=torch.zeros(2),
        dt_bias=torch.zeros(16),
        gate="bounded",
        g_min=-5.0,
        eps=1e-6,
    )
    args.update(change)
    if args["q"].shape != (2, 3, 2, 8) and "k" not in change:
        args["k"] = torch.randn(args["q"].shape).to(args["q"].dtype)
        args["z"] = torch.randn(args["q"].shape)
    with pytest.raises(ValueError, match=match):
        prep_fwd(**args, silu_qk=True, l2norm_qk=True)


def test_bad_gradient_shape():
    q, k, z, A_log, dt_bias = _inputs(1, 2, 2, 8, "bounded")
    with pytest.raises(ValueError, match="dg must be None or"):
        prep_bwd(
            q,
            k,
            z,
            A_log,
            dt_bias,
            None,
            None,
            torch.randn(1, 2, 2, 4),
            gate="bounded",
            g_min=-5.0,
            silu_qk=True,
            l2norm_qk=True,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_bf16_real_size(gate):
    ins = _inputs(2, 4096, 16, 128, gate, dtype=torch.bfloat16)
    _compare(ins, 1e-2, gate=gate, g_min=-5.0, silu_qk=True, l2norm_qk=True)


def test_empty_sequence():
    ins = _inputs(2, 0, 3, 8, "bounded")
    outs, grads = _run(kda_prep, ins, gate="bounded", g_min=-5.0, silu_qk=True, l2norm_qk=True)
    assert all(o.shape == (2, 0, 3, 8) for o in outs)
    assert torch.equal(grads[3], torch.zeros(3, device=DEV)) and torch.equal(grads[4], torch.zeros(24, device=DEV))


@pytest.mark.parametrize("gate, T, K, C, qk", [("bounded", 70, 16, 64, True), ("softplus", 33, 12, 16, True),
                                            ("none", 40, 32, 32, True), ("bounded", 64, 20, 64, False)])
def test_chunked_prep_matches_reference(gate, T, K, C, qk):
    """``prep_fwd_chunked``: qn, kn zero-padded to [B, Tp, H, Kp] and G the chunk-local cumsum of
    the reference g in log2 units (flat over padded tokens, 0 in padded channels); ``qk=False``
    gives only G. T and K not multiples of the chunk / a power of two exercise the masks."""
    B, H = 2, 3
    ins = _inputs(B, T, H, K, gate)
    if gate == "none":
        ins[2] = -torch.nn.functional.softplus(ins[2])
    q, k, z, A_log, dt_bias = ins
    lb = -5.0 if gate == "bounded" else None
    rq, rk, rg = kda_prep_torch(q, k, z, A_log, dt_bias, gate=gate, g_min=lb, silu_qk=True, l2norm_qk=True)
    qn, kn, G = prep_fwd_chunked(q, k, z, A_log, dt_bias, chunk_size=C, gate=gate, g_min=lb, silu_qk=True,
                                 l2norm_qk=True, qk=qk)
    Tp, Kp = -(-T // C) * C, max(16, 1 << (K - 1).bit_length())
    assert G.shape == (B, Tp, H, Kp) and G.dtype == torch.float32
    gp = torch.zeros(B, Tp, H, Kp, device=DEV)
    gp[:, :T, :, :K] = rg
    want = gp.view(B, Tp // C, C, H, Kp).cumsum(2).view(B, Tp, H, Kp) * 1.4426950408889634
    assert_close(want, G, FP32_TOL, "G")
    assert torch.equal(G[..., K:], torch.zeros_like(G[..., K:]))
    if not qk:
        assert qn is None and kn is None
        return
    for name, r, o in (("qn", rq, qn), ("kn", rk, kn)):
        assert o.shape == (B, Tp, H, Kp) and o.dtype == q.dtype
        assert_close(r, o[:, :T, :, :K].float(), FP32_TOL, name)
        assert not o[:, T:].any() and not o[..., K:].any(), f"{name}: padding is not zero"


def test_chunked_prep_refuses_bad_chunk():
    q, k, z, A_log, dt_bias = _inputs(1, 8, 1, 16, "bounded")
    with pytest.raises(ValueError, match="chunk_size=48"):
        prep_fwd_chunked(q, k, z, A_log, dt_bias, chunk_size=48, gate="bounded", g_min=-5.0, silu_qk=False,
                         l2norm_qk=True)


@pytest.mark.parametrize("gate, K, V, C, dtype", [("bounded", 32, 48, 16, torch.float32),
                                                   ("none", 20, 16, 32, torch.float32),
                                                   ("bounded", 16, 16, 64, torch.float16),
                                                   pytest.param("bounded", 128, 128, 64, torch.bfloat16,
                                                                marks=pytest.mark.gpu)])
def test_packed_prep_writes_the_documents_chunk_layout(gate, K, V, C, dtype):
    """``prep_fwd_packed`` equals, bit for bit, what it replaced: ``prep_fwd``, a zero-filled scatter of q, k, g, v
    and beta into ``Packing``'s layout (each document on whole chunks), the padding, and G as the chunk-local cumsum
    of the laid-out g. Documents of 1 token, of exactly one chunk and of several chunks with a partial last one,
    K and V padded to powers of two; a layout with unused trailing slots. (On a GPU: v and beta bit for bit, the
    rest within a rounding.)"""
    from moelab.ops.kda.triton_chunk import Packing, _padded
    from moelab.ops.varlen import cu_seqlens_from_starts

    lengths = [1, C, 2 * C + 3, C - 1, 5]
    T, H = sum(lengths), 2
    q, k, z, A_log, dt_bias = _inputs(1, T, H, K, gate, dtype=dtype, seed=3)
    if gate == "none":
        z = -torch.nn.functional.softplus(z.float())
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(1, T, H, V, generator=gen).to(DEV, dtype)
    beta = torch.rand(1, T, H, generator=gen).to(DEV, dtype)
    starts = torch.zeros(1, T, dtype=torch.bool)
    starts[0, torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])] = True
    pack = Packing(cu_seqlens_from_starts(starts.to(DEV)), T, C)
    assert int(pack.chunk_len.sum()) == T and pack.chunk_len.numel() * C == pack.rows
    lb = -5.0 if gate == "bounded" else None
    kw = dict(gate=gate, g_min=lb, silu_qk=gate != "none", l2norm_qk=True)
    qp, kp, gp, vp, bp = prep_fwd_packed(q, k, z, v, beta, A_log, dt_bias, pack.chunk_src, pack.chunk_len,
                                         chunk_size=C, **kw)
    qn, kn, g = prep_fwd(q, k, z, A_log, dt_bias, **kw)
    want = _padded(*(pack.scatter(x) for x in (qn, kn, v, g, beta)), None, C)
    G = prep_fwd_chunked(want[0], want[1], want[3], None, None, chunk_size=C, gate="none", g_min=None,
                         silu_qk=False, l2norm_qk=False, qk=False)[2]
    for name, got, ref in (("qn", qp, want[0]), ("kn", kp, want[1]), ("v", vp, want[2]), ("G", gp, G),
                           ("beta", bp, want[4])):
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        if DEV == "cpu" or name in ("v", "beta"):
            assert torch.equal(got, ref), name
        else:  # compiled for the GPU, the two kernels may sum a row's L2 norm in another order: a rounding apart
            assert_close(got.float(), ref.float(), 1e-2 if dtype == torch.bfloat16 else FP16_TOL, name)


def test_prep_backward_reads_gradients_in_the_documents_layout():
    """``prep_bwd(..., rows=)``: dqn, dkn, dg given in another token layout (``[1, R, H, Kg]``, token t at row
    ``rows[t]``, Kg padded past K) give bit for bit what gathering them to token order first gives; bad rows are
    refused with the shapes."""
    T, H, K, R, Kg = 23, 2, 12, 40, 16
    q, k, z, A_log, dt_bias = _inputs(1, T, H, K, "bounded", seed=5)
    gen = torch.Generator().manual_seed(6)
    rows = torch.randperm(R, generator=gen)[:T].sort().values.to(DEV)
    grads = [torch.randn(1, R, H, Kg, generator=gen).to(DEV) for _ in range(3)]
    kw = dict(gate="bounded", g_min=-5.0, silu_qk=True, l2norm_qk=True)
    got = prep_bwd(q, k, z, A_log, dt_bias, *grads, rows=rows, **kw)
    want = prep_bwd(q, k, z, A_log, dt_bias, *(g[:, rows, :, :K] for g in grads), **kw)
    for name, a, b in zip(NAMES, got, want):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"rows must be a \[T\] = \[23\] int64"):
        prep_bwd(q, k, z, A_log, dt_bias, *grads, rows=rows.int(), **kw)
    with pytest.raises(ValueError, match=r"dqn must be None or \(1, R, 2, >= 12\)"):
        prep_bwd(q, k, z, A_log, dt_bias, grads[0][..., :8], None, None, rows=rows, **kw)
