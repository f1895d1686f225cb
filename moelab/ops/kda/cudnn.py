"""cuDNN's Hopper KDA engine as a backend of ``kda(...)``: the forward (no-grad calls) only.

``backend="cudnn"`` runs ``cudnn.linear_attention.kimi_delta_attention`` from the optional package
``nvidia-cudnn-frontend`` (``pip install 'moelab[cudnn]'``), a hand-written sm90 CUDA engine. Measured
through this backend on the H200 (``kernels/check_kda_gpu.py --part backends`` ->
``kernels/results/kda_backends_h200.json``), prep + engine ran the no-grad forward at 0.19-0.62x our
inference forward (B8 T4096 to B2 T65536, H16), so ``auto`` never picks it; its fwd+bwd was 1.16-1.65x
our training op, with gate gradients beyond the targets (below). What it takes, and so
what :func:`unavailable_reason` checks (anything else falls back to our Triton op, the reason
logged once):

- an sm90 GPU (Hopper; the engine's CUDA is compiled for it at run time with NVRTC);
- head dims ``K = V = 128``; q, k, v in bf16; the default scale ``K ** -0.5``;
- q, k as the op uses them, the log decay g in fp32 and beta after its sigmoid. The engine's
  forward could L2-normalize q, k and apply the bounded gate itself, but not the layer's SiLU of
  q, k that comes first, and its backward takes none of that. So one fused Triton pass
  (``triton_prep.prep_fwd``: SiLU + L2 norm of q and k, the bounded or softplus gate, in fp32,
  writing bf16 qn, kn and fp32 g) runs first; prep + engine is the op that is timed. beta arrives
  post-sigmoid in fp32 from the layer (``[B, T, H]``, 1/K of q's bytes): nothing to fuse.
  (``check_kda_gpu.py --part backends`` also times the engine with its in-kernel L2 norm and gate
  and no prep pass: what inference could run once the SiLU of q, k moves into their ShortConv.)

Layouts, converted once per call: our ``[B, T, H, D]`` rows are the engine's THD
``[B*T, H, D]`` as they are (a view) with ``cu_seqlens = [0, T, 2T, ..., B*T]``; packed documents
(``B = 1`` and ``cu_seqlens``) are THD already. The engine's states are ``[N, H, V, K]``, ours
``[N, H, K, V]``: the initial state is transposed in, the final state out (:func:`state_to_engine`,
:func:`state_from_engine`).

Why training stays on our Triton op. The engine's backward returns dq, dk, dv, dbeta within the
targets, but its dg (and so dz, dA_log, ddt_bias) misses 1e-2 against fp32 (issue 37). dg has an
exact closed form in what the backward returns: with ``S'_t = Diag(exp(g_t)) S_{t-1}``,

    dg_i = sum_{t >= i} (q_t * dq_t - k_t * dk_t - 2 k_t * (S'_t dv_t))   (+ S_T * dS_T summed
                                                                          over V at t = T)

where ``S_t dv_t`` is the engine's dq for an upstream gradient ``dv / scale`` (a second backward)
and ``S'_t dv_t = S_t dv_t - k_t beta_t^2 dbeta_t``. It holds exactly, in fp32 too, but its
terms are several times larger than dg and cancel, so each term's rounding stays in every dg
before it through the reverse cumsum over the whole sequence, growing with its length; the engine
hands out dq, dk, dv in bf16, and with bf16 terms the identity misses 1e-2 by far at a few hundred
tokens (``tests/ops/test_kda_cudnn.py::test_dg_identity_exact_but_not_from_bf16`` shows both).
Our backward avoids that by forming dg chunk by chunk from the chunk states and their gradients
(``triton_bwd``), which the engine does not return; recomputing them is most of our own backward's
work, so a cuDNN training path with an accurate dg would run that work on top of the engine's.
Training calls with ``backend="cudnn"`` therefore run our Triton training op (reason logged once),
and ``auto`` never picks the engine. How the engine is built (its forward truncates the state of sequence
segments; its backward keeps the states and the products behind dg in bf16): kernels/README.md, "How cuDNN's
sm90 KDA engine gets its speed".
"""

from __future__ import annotations

import functools
import importlib
import logging
import math

import torch

log = logging.getLogger(__name__)

HEAD_DIM = 128  # the engine's only head dim (K = V)
CAPABILITY = (9, 0)  # sm90: the engine's CUDA targets Hopper
INSTALL_HINT = "pip install 'moelab[cudnn]'"
TRAINING_REASON = ("training needs dg, and the engine's dg misses the 1e-2 target while an accurate one "
                   "needs our own backward (moelab.ops.kda.cudnn docstring)")


class EngineDeclined(RuntimeError):
    """The engine refused a call at run time (after :func:`unavailable_reason` passed it)."""


@functools.cache
def _import_reason() -> str | None:
    """Why ``cudnn.linear_attention.kimi_delta_attention`` cannot be imported, or None (cached)."""
    try:  # the op module itself: the package's attribute would import it lazily, on first call
        importlib.import_module("cudnn.linear_attention.ops.kda")
    except Exception as exc:  # a missing package, a missing CUDA library, an old version: all decline
        return f"nvidia-cudnn-frontend is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA device, None for any other device."""
    return torch.cuda.get_device_capability(device) if torch.device(device).type == "cuda" else None


_declined: dict[tuple, str] = {}  # engine failures at run time, by shape: not retried


def _shape_key(q: torch.Tensor, v: torch.Tensor | None) -> tuple:
    return (q.device, tuple(q.shape), None if v is None else v.shape[-1])


def unavailable_reason(q: torch.Tensor, v: torch.Tensor | None = None, *, needs_grad: bool = False,
                       scale: float | None = None) -> str | None:
    """Why the engine cannot run this call, or None when it can.

    Args:
        q: ``[B, T, H, K]``, the op's q as the caller passes it; v: ``[B, T, H, V]`` or None (not
            checked).
        needs_grad: whether autograd must reach an input (the engine serves no-grad calls only).
        scale: the op's scale (None: ``K ** -0.5``).
    """
    if needs_grad:
        return TRAINING_REASON
    reason = _import_reason()
    if reason is not None:
        return reason
    cap = _capability(q.device)
    if cap is None:
        return f"q is on {q.device}: the engine runs on a CUDA device"
    if cap != CAPABILITY:
        return f"the GPU is sm_{cap[0]}{cap[1]}: the engine needs sm_{CAPABILITY[0]}{CAPABILITY[1]} (Hopper)"
    K = q.shape[-1]
    V = K if v is None else v.shape[-1]
    if K != HEAD_DIM or V != HEAD_DIM:
        return f"head dims K={K}, V={V}: the engine takes K = V = {HEAD_DIM} only"
    if q.dtype != torch.bfloat16 or (v is not None and v.dtype != torch.bfloat16):
        return f"q, v are {q.dtype}, {None if v is None else v.dtype}: the engine takes bf16 only"
    if scale is not None and not math.isclose(scale, K**-0.5, rel_tol=1e-6):
        return f"scale={scale}: the engine takes the default {K ** -0.5:.6g} (K ** -0.5) only"
    return _declined.get(_shape_key(q, v))


_noted: set[str] = set()


def note(message: str) -> None:
    """Log ``message`` at INFO the first time it comes (which KDA path ran, and why)."""
    if message not in _noted:
        _noted.add(message)
        log.info(message)


def to_thd(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` -> the engine's THD ``[B*T, H, D]`` (a view of a contiguous x)."""
    return x.contiguous().view(-1, *x.shape[2:])


def fixed_cu_seqlens(B: int, T: int, device: torch.device) -> torch.Tensor:
    """int32 ``[B + 1]`` offsets ``[0, T, ..., B*T]``: B rows of T tokens as B THD sequences."""
    return torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)


def state_to_engine(S: torch.Tensor) -> torch.Tensor:
    """Our state ``[N, H, K, V]`` -> the engine's ``[N, H, V, K]`` (contiguous, fp32)."""
    return S.float().transpose(-1, -2).contiguous()


def state_from_engine(S: torch.Tensor) -> torch.Tensor:
    """The engine's state ``[N, H, V, K]`` -> ours ``[N, H, K, V]`` (contiguous)."""
    return S.transpose(-1, -2).contiguous()


def _engine_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    cu_seqlens: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
                    output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One engine forward in its layouts: q, k, v ``[TT, H, 128]`` bf16, g ``[TT, H, 128]`` fp32 log
    decay, beta ``[TT, H]`` fp32, cu_seqlens int32 ``[N + 1]``, initial_state ``[N, H, V, K]`` fp32 or
    None -> ``(o [TT, H, V] bf16, final state [N, H, V, K] fp32 or None)``."""
    from cudnn.linear_attention import kimi_delta_attention

    o, final = kimi_delta_attention(q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
                                    output_final_state=output_final_state)
    return o, (final if output_final_state else None)


@torch.compiler.disable  # a compiled model calls the op eagerly, like the Triton paths
def cudnn_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
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
    """The KDA forward by the fused prep and the cuDNN engine (no autograd graph).

    Arguments and returns as ``moelab.ops.kda.kda`` (q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``,
    beta ``[B, T, H]``, states ``[N, H, K, V]`` fp32); the caller (``kda``) has checked
    :func:`unavailable_reason`. Raises :class:`EngineDeclined` when the engine refuses the call at
    run time (the shape is then not offered to it again).
    """
    from moelab.ops.kda.gate import check_op_shapes
    from moelab.ops.kda.triton_prep import prep_fwd
    from moelab.ops.varlen import check_cu_seqlens

    B, T, H, K, V = check_op_shapes(q, k, v, g, beta)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, B, T, read=validate)
        cu = cu_seqlens.to(torch.int32)
    else:
        cu = fixed_cu_seqlens(B, T, q.device)
    N = cu.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}")
    if gate == "bounded" and g_min is None:
        raise ValueError("gate='bounded' needs g_min, the gate's floor (a number < 0)")
    if validate and gate == "none" and bool((g > 0).any()):
        raise ValueError("gate='none' takes g as the log decay: every g must be <= 0")
    if silu_qk or l2norm_qk or gate != "none":
        q, k, g = prep_fwd(q, k, g, A_log, dt_bias, gate=gate, g_min=g_min, silu_qk=silu_qk, l2norm_qk=l2norm_qk,
                           eps=norm_eps)
    try:
        o, S = _engine_forward(to_thd(q), to_thd(k), to_thd(v), to_thd(g.float()), to_thd(beta.float()), cu,
                               K**-0.5 if scale is None else float(scale),
                               None if initial_state is None else state_to_engine(initial_state), output_final_state)
    except (RuntimeError, NotImplementedError) as exc:  # cudnnGraphNotSupportedError, NVRTC, ... are RuntimeErrors
        _declined[_shape_key(q, v)] = f"the engine declined shape {tuple(q.shape)}: {type(exc).__name__}: {exc}"
        raise EngineDeclined(_declined[_shape_key(q, v)]) from exc
    return o.view(B, T, H, V), (state_from_engine(S) if S is not None else None)


__all__ = ["EngineDeclined", "cudnn_kda", "fixed_cu_seqlens", "note", "state_from_engine", "state_to_engine",
           "to_thd", "unavailable_reason"]
