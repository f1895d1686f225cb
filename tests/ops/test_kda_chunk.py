"""Chunked PyTorch KDA (and the backend dispatcher) against the fp32 token-by-token reference."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from moelab.ops.kda import chunk_kda_torch, kda, naive_recurrent_kda
from tests.helpers import assert_close

TOL = 1e-4  # fp32 on both sides; measured errors are <= ~2e-6 (both are ~1e-7 from an fp64 recurrence)


def make_inputs(B: int, T: int, H: int, K: int, V: int, g_low: float, seed: int = 0):
    """Random KDA inputs; g uniform in [g_low, 0], keys L2-normalized as the layer feeds them."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.rand(B, T, H, K, generator=gen) * g_low
    beta = torch.rand(B, T, H, generator=gen)
    s0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, s0


def run_with_grads(fn, inputs, use_s0: bool, seed: int = 1):
    """Forward + backward with fixed random cotangents; returns (o, S_T, grads by name)."""
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    leaves = [x.clone().requires_grad_() for x in inputs]
    s0 = leaves[5] if use_s0 else None
    o, s = fn(*leaves[:5], initial_state=s0, output_final_state=True)
    gen = torch.Generator().manual_seed(seed)
    do, ds = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    ((o * do).sum() + (s * ds).sum()).backward()
    grads = {n: x.grad for n, x in zip(names, leaves) if x.grad is not None}
    return o.detach(), s.detach(), grads


@pytest.mark.parametrize("T", [64, 77, 5])  # multiple of the chunk, not a multiple, shorter than one chunk
@pytest.mark.parametrize("use_s0", [False, True])
@pytest.mark.parametrize("g_low", [-1.0, -40.0, -1000.0])  # ordinary, beyond the bounded gate, extreme
def test_chunk_matches_recurrent_forward_and_grads(T: int, use_s0: bool, g_low: float) -> None:
    inputs = make_inputs(B=2, T=T, H=2, K=16, V=8, g_low=g_low)
    o_ref, s_ref, g_ref = run_with_grads(naive_recurrent_kda, inputs, use_s0)
    chunk = lambda *a, **kw: chunk_kda_torch(*a, **kw, chunk_size=32)  # noqa: E731
    o, s, grads = run_with_grads(chunk, inputs, use_s0)
    assert_close(o_ref, o, TOL, "o")
    assert_close(s_ref, s, TOL, "final state")
    assert set(grads) == set(g_ref) == ({"q", "k", "v", "g", "beta"} | ({"initial_state"} if use_s0 else set()))
    for name in g_ref:
        assert_close(g_ref[name], grads[name], TOL, f"d{name}")


@pytest.mark.parametrize("chunk_size", [16, 64, 128])
def test_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    q, k, v, g, beta, s0 = make_inputs(B=1, T=50, H=3, K=8, V=8, g_low=-5.0, seed=3)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = chunk_kda_torch(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
    assert_close(o_ref, o, TOL, "o")
    assert_close(s_ref, s, TOL, "final state")


def test_chunk_scale_dtype_and_no_final_state() -> None:
    q, k, v, g, beta, _ = make_inputs(B=1, T=20, H=1, K=8, V=4, g_low=-2.0, seed=4)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.3)
    o, s = chunk_kda_torch(q, k, v, g, beta, scale=0.3, chunk_size=16)
    assert s is None
    assert_close(o_ref, o, TOL, "o")
    o16, s16 = chunk_kda_torch(q, k, v.half(), g, beta, output_final_state=True)
    assert o16.dtype == torch.float16 and s16.dtype == torch.float32


def test_chunk_rejects_bad_shapes() -> None:
    q, k, v, g, beta, _ = make_inputs(B=1, T=8, H=2, K=8, V=4, g_low=-1.0)
    with pytest.raises(ValueError, match="must match q"):
        chunk_kda_torch(q, k[..., :4], v, g, beta)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda_torch(q, k, v, g, beta[:, :4])


@pytest.mark.parametrize("backend", ["recurrent", "chunk", "auto"])
def test_dispatcher_cpu_backends_agree(backend: str) -> None:
    q, k, v, g, beta, s0 = make_inputs(B=1, T=40, H=2, K=8, V=8, g_low=-3.0, seed=5)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    o, s = kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, backend=backend, chunk_size=16)
    assert_close(o_ref, o, TOL, "o")
    assert_close(s_ref, s, TOL, "final state")


def test_dispatcher_rejects_unknown_backend() -> None:
    q, k, v, g, beta, _ = make_inputs(B=1, T=4, H=1, K=4, V=4, g_low=-1.0)
    with pytest.raises(ValueError, match="backend='cuda'.*'recurrent'"):
        kda(q, k, v, g, beta, backend="cuda")


@pytest.mark.parametrize("g_min", [-5.0, -3.0, None])
def test_dispatcher_triton_call(monkeypatch: pytest.MonkeyPatch, g_min) -> None:
    """The triton backend imports the kernel module lazily and hands it the whole op (the kernel
    picks bounded mode from g_min)."""
    seen = {}

    def fake_chunk_kda(q, k, v, g, beta, **kw):
        seen.update(kw)
        return v, None

    fake = types.ModuleType("moelab.ops.kda.triton_chunk")
    fake.chunk_kda = fake_chunk_kda
    monkeypatch.setitem(sys.modules, "moelab.ops.kda.triton_chunk", fake)
    q, k, v, g, beta, s0 = make_inputs(B=1, T=4, H=1, K=4, V=4, g_low=-1.0)
    q.requires_grad_()  # a gradient is needed: the training op, not the inference forward
    o, _ = kda(q, k, v, g, beta, scale=0.5, initial_state=s0, output_final_state=True, backend="triton",
               chunk_size=32, g_min=g_min)
    assert o is v
    assert seen == {"scale": 0.5, "initial_state": s0, "output_final_state": True, "g_min": g_min,
                    "validate": True, "chunk_size": 32, "gate": "none", "A_log": None, "dt_bias": None,
                    "l2norm_qk": False, "silu_qk": False, "norm_eps": 1e-6, "cu_seqlens": None}


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_dispatcher_runs_the_whole_op_in_torch(backend: str, gate: str) -> None:
    """Raw q, k and gate input through ``kda(gate=..., silu_qk, l2norm_qk)`` == the torch prep
    (``gate.kda_prep_torch``) followed by the fp32 recurrence, forward and every gradient."""
    from moelab.ops.kda.gate import kda_prep_torch

    gen = torch.Generator().manual_seed(3)
    B, T, H, K = 1, 9, 2, 8
    raw = [torch.randn(B, T, H, K, generator=gen) for _ in range(4)]  # q, k, v, z
    beta = torch.rand(B, T, H, generator=gen)
    A_log = torch.randn(H, generator=gen) * 0.3
    g_min = -4.0 if gate == "bounded" else None
    outs = []
    for via_op in (True, False):
        q, k, v, z, a = (x.clone().requires_grad_() for x in (*raw, A_log))
        if via_op:
            o, _ = kda(q, k, v, z, beta, backend=backend, chunk_size=4, gate=gate, A_log=a, g_min=g_min,
                       silu_qk=True, l2norm_qk=True)
        else:
            qn, kn, g = kda_prep_torch(q, k, z, a, None, gate=gate, g_min=g_min, silu_qk=True, l2norm_qk=True)
            o, _ = naive_recurrent_kda(qn, kn, v, g, beta)
        o.pow(2).sum().backward()
        outs.append([o.detach()] + [x.grad for x in (q, k, v, z, a)])
    for name, a, b in zip(("o", "dq", "dk", "dv", "dz", "dA_log"), *outs):
        assert_close(b, a, 1e-5, name)
    with pytest.raises(ValueError, match="needs g_min"):
        kda(*raw[:3], raw[3], beta, backend=backend, gate="bounded", A_log=A_log)
