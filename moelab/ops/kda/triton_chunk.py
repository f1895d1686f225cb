"""Chunked KDA in Triton: public entry ``chunk_kda`` and its autograd Function.

Same semantics as ``naive_recurrent_kda`` (moelab/ops/kda/naive.py)::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

Kernels: triton_fwd.py (intra-chunk scores + UT transform, state recurrence, output) and
triton_bwd.py (state-gradient recurrence, per-chunk gradients); the two modes differ only in how
the 16x16 diagonal sub-tiles of the gated scores are formed (triton_common.py):

* ``mode="bounded"``: one tensor-core product per sub-tile on ``q exp(G - G_mid)`` and
  ``k exp(G_mid - G)``; exact while ``g >= lower_bound`` with ``|lower_bound| * 16 / 2`` inside
  the fp32/bf16 exponent range (``lower_bound >= max_safe_g_min("fp32", 16)``, about -5.5).
* ``mode="general"``: element-wise ``exp(G_i - G_j)`` per position pair, masked to ``i >= j``
  before ``exp``; correct for any ``g <= 0``.

The backward keeps only the inputs and recomputes the intra-chunk quantities and chunk states.
"""

from __future__ import annotations

import os

import torch
import triton

from moelab.model.config import max_safe_g_min
from moelab.ops.kda.triton_bwd import _kda_bwd_dh, _kda_bwd_grads
from moelab.ops.kda.triton_common import SUBTILE
from moelab.ops.kda.triton_fwd import _kda_fwd_intra, _kda_fwd_out, _kda_fwd_state

MODES = ("bounded", "general")
CHUNK_SIZES = (16, 32, 64)
MAX_HEAD_DIM = 256


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Launch parameters; kernels/bench_kda.py --tune overrides entries to compare variants on a GPU.
TUNING: dict = {
    "bk_intra": 64,  # K-block of the intra kernel (scores are summed over K-blocks)
    "bk_grads": 128,  # K-block of the gradient kernel; K <= bk_grads keeps all partials in registers
    "bv": 64,  # V-block of the intra, output and gradient kernels
    "warps_intra": 8,
    "warps_state": 4,
    "warps_out": 4,
    "warps_grads": 8,
    # A_kk feeds the (I + A_kk)^-1 solve, which can amplify its rounding: form the intra-chunk
    # scores from fp32 operands (TF32 on the GPU) rather than bf16 ones
    "scores_tf32": True,
}


def _cfg(K: int, V: int) -> dict:
    """Block sizes and warps. Fixed (no autotune): the interpreter cannot autotune, and the
    recurrent kernels' cost depends on the grid, not only the tile. In the interpreter the
    gradient kernel uses 64-wide K-blocks so that K = 128 tests its multi-block path."""
    BKP = max(16, triton.next_power_of_2(K))
    BVP = max(16, triton.next_power_of_2(V))
    return dict(
        BKP=BKP,
        BK_intra=min(BKP, TUNING["bk_intra"]),
        BK_grads=min(BKP, 64 if _interpret() else TUNING["bk_grads"]),
        BV=min(BVP, TUNING["bv"]),
        **{key: val for key, val in TUNING.items() if key.startswith("warps")},
    )


def _state_bv(V: int, BH: int, cfg: dict) -> int:
    """V-block of the sequential kernels: smaller blocks give more programs when B*H is small
    (the chunk loop is latency-bound), larger ones fewer re-reads of k, w, q."""
    if _interpret():
        return cfg["BV"]
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    bv = cfg["BV"]
    while bv > 16 and BH * triton.cdiv(V, bv) < 2 * n_sm:
        bv //= 2
    return bv


def _dot_bf16(dtype: torch.dtype) -> bool:
    """Whether tensor-core operands are bf16 (bf16 inputs) rather than fp32/TF32."""
    return dtype == torch.bfloat16


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the intermediates (w, u, U, h, A_qk, dh): bf16 inputs keep bf16
    (measured bf16 rounding budget fits the 5e-3 / 1e-2 targets), fp16/fp32 inputs keep fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _forward(q, k, v, g, beta, scale, h0, output_final_state, bounded, C):
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, C)
    Tp = NT * C
    dev = q.device
    cfg = _cfg(K, V)
    wd = _work_dtype(q.dtype)
    dot_bf16 = _dot_bf16(q.dtype)
    store_g = not bounded  # only the general-mode gathers read G back from memory
    Gbuf = torch.empty(B, Tp, H, K, device=dev, dtype=torch.float32) if store_g else q.new_empty(1, dtype=torch.float32)
    Abuf = torch.empty(B, Tp, H, C, device=dev, dtype=torch.float32)
    Aqk = torch.empty(B, Tp, H, C, device=dev, dtype=wd)
    w = torch.empty(B, T, H, K, device=dev, dtype=wd)
    u = torch.empty(B, T, H, V, device=dev, dtype=wd)
    qg = torch.empty(B, T, H, K, device=dev, dtype=wd)
    kd = torch.empty(B, T, H, K, device=dev, dtype=wd)
    gl = torch.empty(B, NT, H, K, device=dev, dtype=torch.float32)
    _kda_fwd_intra[(NT, B * H)](
        q, k, v, g, beta, Gbuf, Abuf, Aqk, w, u, qg, kd, gl, scale, T, NT,
        H=H, K=K, V=V, C=C, BC=SUBTILE, BK=cfg["BK_intra"], BV=cfg["BV"],
        BOUNDED=bounded, STORE_G=store_g, SCORE_BF16=dot_bf16 and not TUNING["scores_tf32"],
        num_warps=cfg["warps_intra"],
    )
    hbuf = torch.empty(B, NT, H, K, V, device=dev, dtype=wd)
    U = torch.empty(B, T, H, V, device=dev, dtype=wd)
    hT = torch.empty(B, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    bv = _state_bv(V, B * H, cfg)
    _kda_fwd_state[(triton.cdiv(V, bv), B * H)](
        kd, gl, w, u, h0 if h0 is not None else U, hbuf, U, hT if hT is not None else U, T, NT,
        H=H, K=K, V=V, C=C, BKP=cfg["BKP"], BV=bv,
        HAS_H0=h0 is not None, STORE_HT=hT is not None, DOT_BF16=dot_bf16, num_warps=cfg["warps_state"],
    )
    return dict(Gbuf=Gbuf, Abuf=Abuf, Aqk=Aqk, w=w, u=u, qg=qg, kd=kd, gl=gl, hbuf=hbuf, U=U, hT=hT, cfg=cfg, NT=NT)


def _output(q, inter, v_dtype):
    B, T, H, K = q.shape
    U = inter["U"]
    V = U.shape[-1]
    cfg = inter["cfg"]
    o = torch.empty(B, T, H, V, device=q.device, dtype=v_dtype)
    _kda_fwd_out[(inter["NT"], B * H)](
        inter["qg"], inter["Aqk"], inter["hbuf"], U, o, T, inter["NT"],
        H=H, K=K, V=V, C=inter["Abuf"].shape[-1], BKP=cfg["BKP"], BV=cfg["BV"],
        DOT_BF16=_dot_bf16(q.dtype), num_warps=cfg["warps_out"],
    )
    return o


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd wrapper; gradients for q, k, v, g, beta and initial_state."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, bounded, chunk_size):
        inter = _forward(q, k, v, g, beta, scale, initial_state, output_final_state, bounded, chunk_size)
        o = _output(q, inter, v.dtype)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.scale, ctx.bounded, ctx.chunk_size = scale, bounded, chunk_size
        return o, inter["hT"]

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0 = ctx.saved_tensors
        scale, bounded, C = ctx.scale, ctx.bounded, ctx.chunk_size
        B, T, H, K = q.shape
        V = v.shape[-1]
        do = do.contiguous()
        inter = _forward(q, k, v, g, beta, scale, h0, False, bounded, C)
        cfg, NT = inter["cfg"], inter["NT"]
        dot_bf16 = _dot_bf16(q.dtype)
        wd = _work_dtype(q.dtype)
        dhbuf = torch.empty(B, NT, H, K, V, device=q.device, dtype=wd)
        dU = torch.empty(B, T, H, V, device=q.device, dtype=torch.float32)
        dh0 = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) if h0 is not None else None
        has_dht = dht is not None
        bv = _state_bv(V, B * H, cfg)
        _kda_bwd_dh[(triton.cdiv(V, bv), B * H)](
            inter["qg"], inter["kd"], inter["gl"], inter["w"], inter["Aqk"], do, dht.contiguous() if has_dht else dU,
            dhbuf, dU, dh0 if dh0 is not None else dU, T, NT,
            H=H, K=K, V=V, C=C, BKP=cfg["BKP"], BV=bv,
            HAS_DHT=has_dht, STORE_DH0=dh0 is not None, DOT_BF16=dot_bf16, num_warps=cfg["warps_state"],
        )
        dq = torch.empty_like(q)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        dg = torch.empty_like(g)
        dbeta = torch.empty_like(beta)
        BK = cfg["BK_grads"]
        if triton.cdiv(K, BK) > 1:
            scr = [torch.empty(B, NT * C, H, K, device=q.device, dtype=torch.float32) for _ in range(3)]
        else:
            scr = [dU] * 3
        _kda_bwd_grads[(NT, B * H)](
            q, k, v, g, beta, inter["Gbuf"], inter["Abuf"], inter["w"], inter["u"], inter["hbuf"], dhbuf,
            inter["U"], dU, do, dq, dk, dv, dg, dbeta, *scr, scale, T, NT,
            H=H, K=K, V=V, C=C, BC=SUBTILE, BK=BK, BV=cfg["BV"],
            BOUNDED=bounded, DOT_BF16=dot_bf16, num_warps=cfg["warps_grads"],
        )
        dh0 = dh0.to(h0.dtype) if dh0 is not None else None
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mode: str = "bounded",
    lower_bound: float = -5.0,
    validate: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward (Triton) with an autograd backward.

    Args:
        q: ``[B, T, H, K]`` queries (normalize them yourself if you want that).
        k: ``[B, T, H, K]`` keys, same dtype as q.
        v: ``[B, T, H, V]`` values, same dtype as q; bf16, fp16 or fp32 (accumulation is fp32).
        g: ``[B, T, H, K]`` per-channel log decay, natural log, ``<= 0``.
        beta: ``[B, T, H]`` write strength.
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[B, H, K, V]`` fp32 state before the first token, or None (zeros).
        output_final_state: also return the state after the last token.
        mode: ``"bounded"`` (fast diagonal sub-tiles, needs ``g >= lower_bound``) or ``"general"``
            (any ``g <= 0``).
        lower_bound: the bound g respects in bounded mode; must be ``>= max_safe_g_min("fp32", 16)``
            (about -5.5), else the 16-token diagonal sub-tile would overflow.
        validate: check ``max(g) <= 0`` and, in bounded mode, ``min(g) >= lower_bound``
            (one reduction over g and a host sync); ``validate=False`` skips it for speed, and
            then out-of-range g gives undefined (possibly non-finite) results.
        chunk_size: tokens per chunk, one of 16, 32, 64.

    Returns:
        ``o`` ``[B, T, H, V]`` in v's dtype and the final state ``[B, H, K, V]`` fp32 (or None).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed: expected one of {MODES}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size={chunk_size} is not allowed: expected one of {CHUNK_SIZES}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q {tuple(q.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] with B, T, H of q {tuple(q.shape)}, got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if T < 1:
        raise ValueError(f"T={T} is not allowed: expected T >= 1")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"head dims K={K}, V={V} are not allowed: expected 1..{MAX_HEAD_DIM}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of bf16/fp16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must be [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}")
    bounded = mode == "bounded"
    if bounded:
        floor = max_safe_g_min("fp32", SUBTILE)
        if not (floor <= lower_bound <= 0):
            raise ValueError(
                f"lower_bound={lower_bound} is not allowed in bounded mode: expected {floor:.3f} <= lower_bound <= 0 "
                f"(|lower_bound| * {SUBTILE} / 2 must stay inside the exp range of a {SUBTILE}-token sub-tile); "
                f"use mode='general' for lower decays")
    if validate:
        gmin, gmax = (x.item() for x in torch.aminmax(g.detach()))
        if gmax > 0:
            raise ValueError(f"g must be a log decay <= 0, got max(g)={gmax:.4g}")
        if bounded and gmin < lower_bound:
            raise ValueError(
                f"min(g)={gmin:.4g} is below lower_bound={lower_bound} in bounded mode: "
                f"use mode='general' or bound the gate (g = lower_bound * sigmoid(...))")
    scale = K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return ChunkKDAFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, bounded, chunk_size)
