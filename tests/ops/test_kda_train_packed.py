"""Packed documents (``cu_seqlens``) in the Triton training op ``triton_chunk.chunk_kda``.

The reference is each document run on its own through the fp32 token recurrence (the PyTorch
gate and prep), from its own initial state: the packed op must give the same outputs, final states
and gradients of every input, so no document leaks into another in either direction. Lengths
0, 1, 63, 64 and 65 with 64-token chunks put documents on, just before and just after chunk edges.
Interpreter, fp32, small heads; the GPU counterpart is ``kernels/check_kda_gpu.py --packed``.
"""

from __future__ import annotations

import pytest
import torch

from moelab.ops.kda import kda
from moelab.ops.kda.triton_chunk import VARIANTS, chunk_kda, launch_overrides
from tests.helpers import assert_close

LENS = [65, 0, 1, 64, 63]  # the empty document sits between two others
H, K, V = 2, 16, 32
G_MIN = -5.0

# (gate, mode, silu/l2 prep): the bounded gate in bounded mode, the softplus gate in general mode,
# and a raw log decay g in general mode (its gradient is dg itself)
CASES = [("bounded", "bounded", True), ("softplus", "general", True), ("none", "general", False)]


def _inputs(gate: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(LENS), len(LENS)
    q, k, z = (torch.randn(1, T, H, K, generator=gen) for _ in range(3))
    x = dict(q=q, k=k, v=torch.randn(1, T, H, V, generator=gen), g=z,
             beta=torch.rand(1, T, H, generator=gen), h0=torch.randn(N, H, K, V, generator=gen))
    if gate == "none":  # a log decay in [-1, 0]: q, k normalized by hand as the op takes them
        x["g"] = -torch.rand(1, T, H, K, generator=gen)
        x["q"], x["k"] = (torch.nn.functional.normalize(t, dim=-1) for t in (q, k))
    else:
        x["A_log"] = 0.5 * torch.randn(H, generator=gen)
        x["dt_bias"] = 0.5 * torch.randn(H * K, generator=gen)
    return {n: t.requires_grad_() for n, t in x.items()}


def _kw(x: dict, gate: str, prep: bool) -> dict:
    kw = dict(gate=gate, silu_qk=prep, l2norm_qk=prep, output_final_state=True)
    if gate != "none":
        kw.update(A_log=x["A_log"], dt_bias=x["dt_bias"])
    if gate == "bounded":
        kw["g_min"] = G_MIN
    return kw


def _grads(x: dict, o: torch.Tensor, S: torch.Tensor) -> dict:
    gen = torch.Generator().manual_seed(7)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()
    return dict(zip(x, torch.autograd.grad(loss, list(x.values()))))


def _reference(x: dict, gate: str, prep: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Each document alone through the fp32 recurrence; an empty one passes its state through."""
    cu = [0, *torch.tensor(LENS).cumsum(0).tolist()]
    outs, states = [], []
    for n in range(len(LENS)):
        a, b = cu[n], cu[n + 1]
        if a == b:
            states.append(x["h0"][n:n + 1])
            continue
        doc = [x[name][:, a:b] for name in ("q", "k", "v", "g", "beta")]
        o, S = kda(*doc, initial_state=x["h0"][n:n + 1], backend="recurrent", **_kw(x, gate, prep))
        outs.append(o)
        states.append(S)
    o, S = torch.cat(outs, 1), torch.cat(states, 0)
    return o, S, _grads(x, o, S)


@pytest.mark.parametrize("variant", [{}, {name: choices[-1] for name, choices in VARIANTS.items()}, {"states": "kept"}],
                         ids=["default", "other-variants", "states-kept"])
@pytest.mark.parametrize(("gate", "mode", "prep"), CASES)
def test_packed_training_op_equals_separate_documents(gate: str, mode: str, prep: bool, variant: dict) -> None:
    """The op's default kernels, and the other choice of every switch of ``triton_chunk.VARIANTS`` at once (the
    inference forward in bounded mode, the backward's chains one after the other), and the training forward keeping its
    chunk states: the chunks of a packed row hold pieces of several documents, and padded slots between them."""
    x = _inputs(gate)
    ref_o, ref_S, ref_g = _reference(x, gate, prep)
    cu = torch.tensor([0, *LENS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    with launch_overrides(**variant):
        o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], mode=mode,
                         chunk_size=64, cu_seqlens=cu, **_kw(x, gate, prep))
        grads = _grads(x, o, S)
    assert_close(ref_o, o, 1e-5, "o")
    assert_close(ref_S, S, 1e-5, "final states")
    assert set(grads) == set(ref_g)
    for name in ref_g:
        assert_close(ref_g[name], grads[name], 3e-5, f"d{name}")


def test_packed_through_front_door_with_grad() -> None:
    """``kda(..., backend="triton", cu_seqlens=...)`` with inputs requiring grad runs the training
    op (int64 offsets, chunk 16, no initial state, no final state) and matches the chunk backend."""
    gen = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 17, 17, 18, 40])
    T = int(cu[-1])
    q, k, z = (torch.randn(1, T, H, K, generator=gen) for _ in range(3))
    v, beta = torch.randn(1, T, H, V, generator=gen), torch.rand(1, T, H, generator=gen)
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)
    leaves = [t.requires_grad_() for t in (q, k, v, z, beta)]
    kw = dict(gate="bounded", g_min=G_MIN, A_log=A_log, dt_bias=dt_bias, l2norm_qk=True, chunk_size=16,
              cu_seqlens=cu)
    outs = []
    for backend in ("chunk", "triton"):
        o, S = kda(*leaves, backend=backend, **kw)
        assert S is None
        outs.append((o, torch.autograd.grad(o.square().sum(), leaves)))
    assert_close(outs[0][0], outs[1][0], 2e-5, "o")
    for name, ref, got in zip(("q", "k", "v", "z", "beta"), outs[0][1], outs[1][1]):
        assert_close(ref, got, 1e-4, f"d{name}")


def test_packed_training_op_errors() -> None:
    q = torch.randn(1, 10, 1, 16)
    v, beta = torch.randn(1, 10, 1, 16), torch.rand(1, 10, 1)
    g = -torch.rand(1, 10, 1, 16)
    with pytest.raises(ValueError, match="end at T = 10"):
        chunk_kda(q, q, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        chunk_kda(q, q, v, g, beta, cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match="expected B = 1, got B = 2"):
        chunk_kda(*(t.expand(2, *t.shape[1:]) for t in (q, q, v, g, beta)), cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \(2, 1, 16, 16\) \(N = documents\)"):
        chunk_kda(q, q, v, g, beta, cu_seqlens=torch.tensor([0, 4, 10]), initial_state=torch.zeros(1, 1, 16, 16))


def test_packing_is_reused_for_the_same_offsets() -> None:
    """Every KDA layer of a forward passes the same ``cu_seqlens`` tensor: its Packing is made once; the same
    values in another tensor, the tensor changed in place, or another length or chunk make a new one."""
    from moelab.ops.kda.triton_chunk import Packing

    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    first = Packing.of(cu, 12, 4)
    assert Packing.of(cu, 12, 4) is first
    assert Packing.of(cu.clone(), 12, 4) is not first
    again = Packing.of(cu, 12, 4)
    assert Packing.of(cu, 12, 16) is not again
    cu[2] = 8  # documents of 5, 3 and 4 tokens: 2, 1 and 1 chunks of 4
    changed = Packing.of(cu, 12, 4)
    assert changed is not again and changed.coff.tolist() == [0, 2, 3, 4]
