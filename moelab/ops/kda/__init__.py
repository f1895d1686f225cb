"""KDA (Kimi Delta Attention) operators: fp32 reference, chunked PyTorch path, Triton kernels.

``kda(...)`` is the one front door: it takes the whole op (optional q/k SiLU + L2 norm, the gate
from its raw input with A_log, dt_bias and g_min, the gated delta rule) and runs it with the
backend a config field names, so layers and studies switch implementations without code edits:

- ``recurrent``: :func:`naive_recurrent_kda`, token by token (the reference).
- ``chunk``: :func:`chunk_kda_torch`, chunkwise WY form in PyTorch (CPU-friendly, any g).
- ``triton``: the Triton kernels (GPU, or CPU under ``TRITON_INTERPRET=1``; imported on first
  use), with the prep and gate fused into them. Two paths, picked per call (:func:`kda_path`):
  the inference forward ``infer_plan.kda_infer`` (chunk 16, no autograd graph) when no
  gradient is needed and g is bounded, else the training op ``triton_chunk.chunk_kda``.
- ``cudnn``: cuDNN's Hopper engine (``moelab.ops.kda.cudnn``, the extra ``moelab[cudnn]``) after
  the fused Triton prep, for a call that needs no gradient on an sm90 GPU with K = V = 128 in bf16;
  any other call (training included) falls back to ``triton``, the reason logged once.
- ``auto``: ``triton`` when q is on a CUDA device, else ``chunk``. It never picks ``cudnn``: on the
  H200, prep + engine ran the no-grad forward 0.19-0.62x as fast as our inference forward
  (``kernels/results/kda_backends_h200.json``), and its gate gradients miss the training targets.

The PyTorch backends take the prep and gate from ``moelab.ops.kda.gate``, the one PyTorch copy of
those formulas (the Triton kernels are tested against it).
"""

from __future__ import annotations

import os
from typing import Literal, get_args

import torch

from moelab.ops.kda.bounds import max_safe_g_min
from moelab.ops.kda.chunk import chunk_kda_torch
from moelab.ops.kda.gate import GATES, naive_kda_gate, naive_qk_prep
from moelab.ops.kda.naive import naive_recurrent_kda
from moelab.ops.varlen import check_cu_seqlens

# KDA names its two PyTorch algorithms instead of "torch": "chunk" (chunkwise) and "recurrent" (the
# reference); "cudnn": moelab.ops.kda.cudnn (forward).
KDABackend = Literal["auto", "triton", "chunk", "recurrent", "cudnn"]
BACKENDS: tuple[KDABackend, ...] = get_args(KDABackend)
PATHS = ("infer", "train", "chunk", "recurrent", "cudnn")
INFER_CHUNK = 16  # the inference forward's chunk (infer_plan.CHUNK; kept here to avoid importing triton)
INFER_G_MIN_FLOOR = max_safe_g_min("fp32", INFER_CHUNK)  # the lowest g_min the inference forward takes


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def kda_path(backend: str, q: torch.Tensor, *, gate: str = "none", g_min: float | None = None,
             needs_grad: bool = False, v: torch.Tensor | None = None, scale: float | None = None) -> str:
    """Which implementation ``kda(...)`` runs, one of :data:`PATHS`.

    - ``"cudnn"``: ``cudnn.cudnn_kda``, for ``backend="cudnn"`` when ``cudnn.unavailable_reason``
      finds nothing against the call; otherwise it resolves as ``"triton"`` (the reason logged once).
    - ``"infer"``: ``infer_plan.kda_infer``, when the backend resolves to ``triton``, q is on a
      CUDA device (or ``TRITON_INTERPRET=1``), no gradient is needed, and g is bounded: ``gate=
      "bounded"``, or ``gate="none"`` with a ``g_min``, where ``INFER_G_MIN_FLOOR <= g_min < 0``.
    - ``"train"``: ``triton_chunk.chunk_kda`` (forward + backward), the other ``triton`` calls.
    - ``"chunk"`` / ``"recurrent"``: the PyTorch backends (``auto`` on a CPU tensor is ``chunk``).

    Args:
        backend: one of :data:`BACKENDS`.
        q: the op's q (its device decides ``auto``).
        gate, g_min: as for :func:`kda`.
        needs_grad: whether autograd must reach any input (``kda`` passes
            ``torch.is_grad_enabled()`` and any input's ``requires_grad``).
        v, scale: the op's v and scale, for the cuDNN engine's checks (v None: not checked).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed: expected one of {', '.join(map(repr, BACKENDS))}")
    if backend == "cudnn":
        from moelab.ops.kda import cudnn

        reason = cudnn.unavailable_reason(q, v, needs_grad=needs_grad, scale=scale)
        if reason is None:
            cudnn.note(f"kda: backend={backend!r} runs the cuDNN engine (forward)")
            return "cudnn"
        cudnn.note(f"kda: backend={backend!r} does not run the cuDNN engine: {reason}")
        backend = "triton"
    if backend == "auto":
        backend = "triton" if q.is_cuda else "chunk"
    if backend != "triton":
        return backend
    on_device = q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    bounded = gate in ("bounded", "none") and g_min is not None and INFER_G_MIN_FLOOR <= g_min < 0
    return "infer" if on_device and bounded and not needs_grad else "train"


def _per_document(run, q, k, v, g, beta, initial_state, output_final_state, cu: list[int]):
    """``run(q, k, v, g, beta, h0) -> (o, S)`` on each packed document on its own (the state
    restarts at each boundary): the reference semantics of ``cu_seqlens``."""
    N = len(cu) - 1
    _, _, H, K = q.shape
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)} with cu_seqlens (N = documents), "
                         f"got {tuple(initial_state.shape)}")
    outs, states = [], []
    for n in range(N):
        a, b = cu[n], cu[n + 1]
        h0 = initial_state[n:n + 1] if initial_state is not None else None
        if b == a:  # an empty document leaves its state as it came in
            states.append(h0.float() if h0 is not None else q.new_zeros(1, H, K, V, dtype=torch.float32))
            continue
        o, S = run(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], h0)
        outs.append(o)
        states.append(S)
    o = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, (torch.cat(states, dim=0) if output_final_state else None)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    backend: str = "chunk",
    chunk_size: int = 64,
    gate: str = "none",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    g_min: float | None = None,
    silu_qk: bool = False,
    l2norm_qk: bool = False,
    norm_eps: float = 1e-6,
    validate: bool = True,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule with per-channel decay, by the chosen backend.

    Which path runs (:func:`kda_path`): with ``backend="triton"`` (or ``"auto"`` on a CUDA
    tensor), a call that needs no gradient (``torch.no_grad()`` / ``inference_mode()``, or no
    input requiring grad) with a bounded g runs the inference forward ``infer_plan.kda_infer``
    (chunk 16, no autograd graph; ``chunk_size`` is not used); any other Triton call runs the
    training op ``triton_chunk.chunk_kda``. ``chunk`` / ``recurrent`` (and ``auto`` on CPU) run
    the PyTorch code. All paths compute the same function.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` in (0, 1).
        g: ``[B, T, H, K]``: with ``gate="none"`` the log decay (natural log, <= 0); otherwise the
            gate's raw input z, turned into the log decay by the op (``gate.naive_kda_gate``).
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 state before the first token of each sequence
            (N = B, or the number of documents with ``cu_seqlens``), or None (zeros).
        output_final_state: also return the state after the last token, ``[N, H, K, V]`` fp32.
        backend: ``auto | triton | chunk | recurrent | cudnn``.
        chunk_size: tokens per chunk for ``chunk`` and the Triton training op.
        gate: ``none | bounded | softplus``; A_log ``[H]`` and dt_bias ``[H*K]`` (or None) are its
            parameters.
        g_min: the lower bound of g: the bounded gate's floor (required with ``gate="bounded"``),
            or with ``gate="none"`` the caller's promise ``g >= g_min``. Either lets the Triton
            backend use its bounded modes (the training op's factored GEMMs, the inference
            forward); None: g is unbounded below.
        silu_qk, l2norm_qk, norm_eps: ``q, k <- L2Norm(SiLU(.))`` first, each step as flagged.
        validate: ``triton`` only: with ``gate="none"`` check the range of g, and check
            ``cu_seqlens`` (a host sync each); callers whose inputs are right by construction
            pass False. The PyTorch backends always check ``cu_seqlens`` (they read it anyway).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N documents packed in one row (B = 1):
            document n is tokens ``[cu_seqlens[n], cu_seqlens[n + 1])`` and the state restarts at
            each boundary (from ``initial_state[n]`` or zeros). Every path takes it: the Triton
            kernels in-kernel (the training op lays each document out on whole chunks), the
            PyTorch backends one document at a time.

    Returns:
        ``(o [B, T, H, V] in v's dtype, S_T [N, H, K, V] fp32 or None)``.
    """
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not allowed: expected one of {', '.join(map(repr, GATES))}")
    path = kda_path(backend, q, gate=gate, g_min=g_min, v=v, scale=scale,
                    needs_grad=_needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias))
    if path == "cudnn":
        from moelab.ops.kda import cudnn

        try:
            return cudnn.cudnn_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, gate=gate, A_log=A_log, dt_bias=dt_bias,
                                   g_min=g_min, silu_qk=silu_qk, l2norm_qk=l2norm_qk, norm_eps=norm_eps,
                                   validate=validate, cu_seqlens=cu_seqlens)
        except cudnn.EngineDeclined as exc:
            cudnn.note(f"kda: falls back to triton: {exc}")
            path = kda_path("triton", q, gate=gate, g_min=g_min)
    if path == "infer":
        from moelab.ops.kda.infer_plan import kda_infer

        return kda_infer(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, g_min=g_min, validate=validate, gate=gate,
                         A_log=A_log, dt_bias=dt_bias, l2norm_qk=l2norm_qk, silu_qk=silu_qk, norm_eps=norm_eps,
                         cu_seqlens=cu_seqlens)
    if path == "train":
        from moelab.ops.kda.triton_chunk import chunk_kda

        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, g_min=g_min, validate=validate,
                         chunk_size=chunk_size, gate=gate, A_log=A_log, dt_bias=dt_bias, l2norm_qk=l2norm_qk,
                         silu_qk=silu_qk, norm_eps=norm_eps, cu_seqlens=cu_seqlens)
    if gate == "bounded" and g_min is None:
        raise ValueError("gate='bounded' needs g_min, the gate's floor (a number < 0)")
    cu = check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1]) if cu_seqlens is not None else None
    if silu_qk or l2norm_qk:
        q = naive_qk_prep(q, silu_qk, l2norm_qk, norm_eps).to(q.dtype)
        k = naive_qk_prep(k, silu_qk, l2norm_qk, norm_eps).to(k.dtype)
    if gate != "none":
        g = naive_kda_gate(g, A_log, gate, g_min, dt_bias)

    def run(q, k, v, g, beta, h0):
        if path == "recurrent":
            return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0,
                                       output_final_state=output_final_state or cu is not None)
        return chunk_kda_torch(q, k, v, g, beta, scale=scale, initial_state=h0,
                               output_final_state=output_final_state or cu is not None, chunk_size=chunk_size)

    if cu is None:
        return run(q, k, v, g, beta, initial_state)
    return _per_document(run, q, k, v, g, beta, initial_state, output_final_state, cu)


__all__ = ["BACKENDS", "PATHS", "chunk_kda_torch", "kda", "kda_path", "naive_kda_gate", "naive_recurrent_kda"]
