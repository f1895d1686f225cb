"""The KDA front door (``moelab.ops.kda.kda``): which path runs, packed documents, errors.

The inference forward (``infer_plan.kda_infer``) must run exactly when no gradient is needed
and g is bounded, and give the training path's outputs; ``cu_seqlens`` through every backend must
equal running each document on its own with the fp32 token recurrence. On a CPU machine the
Triton kernels run in the interpreter (tests/conftest.py), fp32 at small shapes; bf16 at real
sizes is the ``gpu`` test at the end.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moelab.ops.kda import INFER_G_MIN_FLOOR, infer_plan, kda, kda_path
from tests.helpers import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
G_MIN = -5.0


def _inputs(B: int, T: int, H: int, K: int, V: int, n_states: int, dtype=torch.float32, seed: int = 0,
            device: str = DEV) -> dict:
    """Raw layer-style inputs: q, k, v, the gate input z, beta in (0, 1), the gate's parameters, states."""
    gen = torch.Generator().manual_seed(seed)
    q, k, z = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    A_log = torch.log(torch.empty(H).uniform_(1, 16, generator=gen))
    dt_bias = 0.5 * torch.randn(H * K, generator=gen)
    s0 = torch.randn(n_states, H, K, V, generator=gen)
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=z, beta=beta, A_log=A_log, dt_bias=dt_bias, s0=s0)
    return {n: t.to(device) for n, t in x.items()}


def _op(x: dict, backend: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer op (SiLU + L2 norm of q, k; bounded gate) with the final state."""
    return kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["s0"], output_final_state=True,
               backend=backend, chunk_size=16, gate="bounded", A_log=x["A_log"], dt_bias=x["dt_bias"], g_min=G_MIN,
               silu_qk=True, l2norm_qk=True, **kw)


@pytest.fixture
def infer_calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """Records each call of the inference forward (the dispatcher imports it at call time)."""
    calls = []
    real = infer_plan.kda_infer

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(infer_plan, "kda_infer", spy)
    return calls


@pytest.mark.parametrize(("backend", "cuda", "interp", "gate", "g_min", "needs_grad", "path"), [
    ("auto", True, False, "bounded", -5.0, False, "infer"),
    ("auto", True, False, "bounded", -5.0, True, "train"),
    ("auto", True, False, "none", -3.0, False, "infer"),
    ("auto", True, False, "none", None, False, "train"),  # unbounded g
    ("auto", True, False, "softplus", None, False, "train"),
    ("auto", True, False, "bounded", INFER_G_MIN_FLOOR - 0.1, False, "train"),  # below the chunk-16 floor
    ("auto", False, True, "bounded", -5.0, False, "chunk"),  # auto on CPU is the PyTorch path
    ("triton", False, True, "bounded", -5.0, False, "infer"),  # the interpreter
    ("triton", False, False, "bounded", -5.0, False, "train"),
    ("chunk", True, False, "bounded", -5.0, False, "chunk"),
    ("recurrent", True, False, "bounded", -5.0, False, "recurrent"),
])
def test_kda_path(monkeypatch: pytest.MonkeyPatch, backend, cuda, interp, gate, g_min, needs_grad, path) -> None:
    """The path table of the docstring (only ``q.is_cuda`` is read of q: a stand-in takes its place)."""
    if interp:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = SimpleNamespace(is_cuda=cuda)
    assert kda_path(backend, q, gate=gate, g_min=g_min, needs_grad=needs_grad) == path


def test_kda_path_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match="backend='cuda' is not allowed"):
        kda_path("cuda", torch.zeros(1))


def test_inference_path_equals_training_path(infer_calls: list) -> None:
    """Same raw inputs, no_grad (inference forward) vs a graph (training op): outputs and final state
    agree to fp32 precision, with T not a multiple of 16 and an initial state."""
    x = _inputs(B=2, T=37, H=2, K=16, V=16, n_states=2)
    with torch.no_grad():
        o_inf, S_inf = _op(x, "triton")
    assert len(infer_calls) == 1
    q = x["q"].clone().requires_grad_()
    o_tr, S_tr = _op({**x, "q": q}, "triton")
    assert len(infer_calls) == 1 and o_tr.requires_grad and not o_inf.requires_grad
    assert_close(o_tr.detach(), o_inf, 2e-5, "o")
    assert_close(S_tr.detach(), S_inf, 2e-5, "final state")


def test_inference_path_without_grad_inputs(infer_calls: list) -> None:
    """Grad mode on but no input requires grad: nothing to differentiate, so the inference forward."""
    x = _inputs(B=1, T=5, H=1, K=16, V=16, n_states=1)
    o, _ = _op(x, "triton")
    ref, _ = _op(x, "recurrent")
    assert len(infer_calls) == 1
    assert_close(ref, o, 1e-5, "o")


def _per_document(x: dict, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: each document alone through the fp32 token recurrence."""
    outs, states = [], []
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        if a == b:
            states.append(x["s0"][n:n + 1])
            continue
        doc = {name: x[name][:, a:b] for name in ("q", "k", "v", "g", "beta")}
        o, S = _op({**x, **doc, "s0": x["s0"][n:n + 1]}, "recurrent")
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), torch.cat(states, 0)


CU = [0, 5, 5, 22, 23, 40]  # an empty document, one of a single token, lengths across chunk edges


@pytest.mark.parametrize("backend", ["recurrent", "chunk", "triton"])
def test_packed_documents_equal_separate_runs(backend: str, infer_calls: list) -> None:
    """``cu_seqlens`` through the front door == each document run alone (state reset at each
    boundary, each from its own initial state), for every backend; triton: the inference forward."""
    x = _inputs(B=1, T=CU[-1], H=2, K=16, V=16, n_states=len(CU) - 1)
    ref_o, ref_S = _per_document(x, CU)
    with torch.no_grad():
        o, S = _op(x, backend, cu_seqlens=torch.tensor(CU, device=DEV))
    assert len(infer_calls) == (backend == "triton")
    assert_close(ref_o, o, 2e-5, "o")
    assert_close(ref_S, S, 2e-5, "final states")
    # the boundaries matter: the packed row as one sequence gives other outputs
    with torch.no_grad():
        o_leak, _ = _op({**x, "s0": x["s0"][:1]}, backend)
    assert (o_leak - ref_o).abs().max() > 1e-2


def test_packed_documents_gradients_in_torch() -> None:
    """The PyTorch backends run each document on its own, so autograd crosses no boundary: the
    gradients of the packed chunk path equal the per-document recurrence's."""
    base = _inputs(B=1, T=CU[-1], H=2, K=8, V=8, n_states=len(CU) - 1, device="cpu")
    w = torch.randn(1, CU[-1], 2, 8, generator=torch.Generator().manual_seed(5))
    grads = []
    for packed in (True, False):
        x = {n: t.clone().requires_grad_() for n, t in base.items()}
        if packed:
            o, S = _op(x, "chunk", cu_seqlens=torch.tensor(CU))
        else:
            o, S = _per_document(x, CU)
        ((o * w).sum() + S.square().sum()).backward()
        grads.append({n: t.grad for n, t in x.items()})
    for name in base:
        assert_close(grads[1][name], grads[0][name], 1e-4, f"d{name}")


def test_cu_seqlens_errors() -> None:
    x = _inputs(B=1, T=10, H=1, K=8, V=8, n_states=2, device="cpu")
    cu = torch.tensor([0, 4, 10])
    with pytest.raises(ValueError, match="end at T = 10"):
        _op(x, "chunk", cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="non-decreasing"):
        _op(x, "recurrent", cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="1-D int32/int64"):
        _op(x, "chunk", cu_seqlens=torch.tensor([0.0, 10.0]))
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H, K, V\] = \(3, 1, 8, 8\)"):
        _op(x, "chunk", cu_seqlens=torch.tensor([0, 4, 6, 10]))
    y = _inputs(B=2, T=10, H=1, K=8, V=8, n_states=2, device="cpu")
    with pytest.raises(ValueError, match="expected B = 1, got B = 2"):
        _op(y, "chunk", cu_seqlens=cu)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
def test_inference_path_equals_training_path_bf16_gpu(packed: bool) -> None:
    """bf16 at a real head size: the inference forward vs the training op at the same inputs (per
    document when packed; the training op takes no cu_seqlens), both against the fp32 recurrence."""
    cu = [0, 700, 701, 1500, 2048] if packed else None
    B = 1 if packed else 2
    x = _inputs(B=B, T=2048, H=4, K=128, V=128, n_states=len(cu) - 1 if packed else B, dtype=torch.bfloat16,
                device="cuda")
    with torch.no_grad():
        o_inf, S_inf = _op(x, "auto", cu_seqlens=torch.tensor(cu, device="cuda") if packed else None)
        xf = {**x, **{name: x[name].float() for name in ("q", "k", "v")}}  # the same rounded inputs in fp32
        ref = _per_document(xf, cu) if packed else _op(xf, "recurrent")
    with torch.enable_grad():
        runs = []
        for n in range(len(cu) - 1) if packed else [None]:
            a, b = (cu[n], cu[n + 1]) if packed else (0, 2048)
            doc = {name: x[name][:, a:b] for name in ("q", "k", "v", "g", "beta")}
            s0 = x["s0"][n:n + 1] if packed else x["s0"]
            runs.append(_op({**x, **doc, "q": doc["q"].clone().requires_grad_(), "s0": s0}, "auto"))
        o_tr = torch.cat([o.detach() for o, _ in runs], 1)
        S_tr = torch.cat([S.detach() for _, S in runs], 0)
    assert_close(o_tr.float(), o_inf.float(), 1e-2, "o: inference vs training")
    assert_close(S_tr, S_inf, 1e-2, "state: inference vs training")
    assert_close(ref[0].float(), o_inf.float(), 5e-3, "o vs fp32 recurrence")
    assert_close(ref[1], S_inf, 5e-3, "state vs fp32 recurrence")
