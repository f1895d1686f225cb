"""MoE operators: fp32 router logits, top-k selection, dropless dispatch / combine, routed experts.

Each op takes ``backend`` ("auto" | "triton" | "torch"; ``moelab.ops.backend``) and computes the
same function either way; the PyTorch branch is the reference.

- ``project_input``: every matmul that reads the layer input x (router logits in fp32, W_down,
  shared gate|up). Triton backend: one autograd node whose backward sums the input gradients
  inside the GEMMs (cuBLAS beta = 1) instead of separate add kernels, and the fp32 router logits on
  bf16 tensor cores (exact for 16-bit operands, see ``mm_f32``).
- ``select_experts``: top-k of ``scores + bias`` and the per-expert counts (a Triton kernel, or
  ``torch.topk`` + ``scatter_add``).
- ``make_plan`` / ``dispatch`` / ``combine`` / ``combine_norm``: the N*k (token, expert)
  assignments sorted by expert once (stable argsort), rows copied to expert-contiguous order, and
  the expert outputs summed back per token with the routing weights in fp32 (``combine_norm``:
  then RMSNorm, fused into the same kernel with the Triton backend).
- ``experts_grouped`` / ``experts_loop``: the routed GLU experts on the sorted rows as two grouped
  GEMMs (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` with int32 cumulative offsets,
  no host synchronisation) or one matmul pair per expert (needs the counts on the host).

Gather and combine are each other's adjoint: dispatch-backward is "un-permute and sum the k copies",
combine-backward is "gather grad_u to every copy". The Triton versions work per token (one token's k
rows at a time), so every write has one writer: no atomics, deterministic.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moelab.ops.backend import HAS_TRITON, use_triton
from moelab.ops.glu import glu

if HAS_TRITON:
    import triton
    import triton.language as tl


# ----------------------------------------------------------------------------------------------
# fp32-output matmuls on bf16 tensor cores, and the input projection.
# ----------------------------------------------------------------------------------------------

_MM_OUT_F32: dict[tuple, bool] = {}


def _mm_out_f32_supported(device: torch.device) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for bf16 a, b on this device (cached)."""
    key = (device.type, device.index)
    if key not in _MM_OUT_F32:
        try:
            a = torch.ones(4, 16, device=device, dtype=torch.bfloat16)
            _MM_OUT_F32[key] = torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _MM_OUT_F32[key] = False
    return _MM_OUT_F32[key]


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``t`` -> bf16 ``(hi, lo)`` with ``hi + lo`` = t to ~16 significant bits (relative error <= 2^-16).

    lo is the bf16 rounding of the residual ``t - hi``: the pair carries 2 x 8 significant bits.
    """
    t32 = t.float()
    hi = t32.to(torch.bfloat16)
    return hi, (t32 - hi.float()).to(torch.bfloat16)


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` -> fp32 ``[M, N]``, i.e. ``a.float() @ b.float()``, on tensor cores when exact enough.

    On CUDA with ``torch.mm(out_dtype=float32)`` (torch >= 2.8):
    - both operands 16-bit of one dtype: one tensor-core GEMM with fp32 accumulation and output. The
      product of two bf16 (or fp16) numbers is exact in fp32, so this IS the fp32 matmul of the
      upcast operands, up to summation order (the router forward of a bf16 model).
    - one bf16, one fp32 (the router weight gradient ``g^T x``: g fp32 ``[N, E]``, small): the fp32
      operand is split into bf16 hi + lo (``split_bf16``) and multiplied as two GEMMs: relative error
      ~2^-16 instead of 2^-24, at bf16 GEMM speed. Only the small operand is ever split: splitting
      ``x [N, d]`` itself costs more elementwise passes than the fp32 GEMM (measured on the H200).
    - otherwise (both fp32): the plain fp32 matmul (exact; this is the fp32-parameter autocast case).
    Elsewhere (CPU): the plain fp32 matmul.
    """
    if not (a.is_cuda and _mm_out_f32_supported(a.device)):
        return a.float() @ b.float()
    half = (torch.bfloat16, torch.float16)
    if a.dtype == b.dtype and a.dtype in half:
        return torch.mm(a, b, out_dtype=torch.float32)
    if a.dtype == torch.bfloat16 and b.dtype == torch.float32:
        hi, lo = split_bf16(b)
        return torch.mm(a, hi, out_dtype=torch.float32) + torch.mm(a, lo, out_dtype=torch.float32)
    if a.dtype == torch.float32 and b.dtype == torch.bfloat16:
        hi, lo = split_bf16(a)
        return torch.mm(hi, b, out_dtype=torch.float32) + torch.mm(lo, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _InputProjection(torch.autograd.Function):
    """``x [N, d]`` -> (fp32 router logits ``x W_r^T`` ``[N, E]``, ``x W_i^T`` in cdt for each W_i).

    One node for every matmul that reads x, so the backward forms dx as one GEMM chain
    (``dx = g_0 W_0; dx += g_1 W_1; ...`` with cuBLAS beta = 1) instead of one GEMM per branch plus
    elementwise adds; a 16-bit x is never materialized in fp32 for the router.
    """

    @staticmethod
    def forward(ctx, x, w_r, cdt, *ws):
        with torch.autocast(device_type=x.device.type, enabled=False):
            xc = x.to(cdt)
            logits = mm_f32(x, w_r.t())
            outs = tuple(xc @ w.to(cdt).t() for w in ws)
        ctx.save_for_backward(x, w_r, *ws)
        ctx.cdt = cdt
        return (logits, *outs)

    @staticmethod
    def backward(ctx, g_logits, *g_outs):
        x, w_r, *ws = ctx.saved_tensors
        cdt, need = ctx.cdt, ctx.needs_input_grad
        dx, dw_r, dws = None, None, [None] * len(ws)
        with torch.autocast(device_type=x.device.type, enabled=False):
            xc = x.to(cdt)
            if need[0]:
                # Each branch's GEMM accumulates into dx (cuBLAS beta = 1): no separate add kernels.
                dx = g_logits.to(cdt) @ w_r.to(cdt)
                for g, w in zip(g_outs, ws):
                    dx.addmm_(g.to(cdt), w.to(cdt))
                dx = dx.to(x.dtype)
            if need[1]:
                dw_r = mm_f32(g_logits.t(), x).to(w_r.dtype)
            for i, (g, w) in enumerate(zip(g_outs, ws)):
                if need[3 + i]:
                    dws[i] = (g.to(cdt).t() @ xc).to(w.dtype)
        return (dx, dw_r, None, *dws)


def project_input(x: torch.Tensor, router_weight: torch.Tensor, weights: list[torch.Tensor],
                  cdt: torch.dtype, backend: str = "auto") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x ``[N, d]``, router_weight ``[E, d]``, weights ``[n_i, d]`` -> (logits ``[N, E]`` fp32, ``[[N, n_i]]`` cdt).

    The logits are ``x.float() @ W_r.float().T`` (see ``mm_f32`` for the CUDA precision of the
    Triton backend); the other outputs are plain cdt matmuls, as autocast would compute them.
    """
    if use_triton(backend, x):
        logits, *outs = _InputProjection.apply(x, router_weight, cdt, *weights)
        return logits, list(outs)  # a list, as the caller pops from it (dynamo's unpacking gives a tuple)
    with torch.autocast(device_type=x.device.type, enabled=False):
        logits = F.linear(x.float(), router_weight.float())
        xc = x.to(cdt)
        return logits, [F.linear(xc, w.to(cdt)) for w in weights]


# ----------------------------------------------------------------------------------------------
# Top-k selection.
# ----------------------------------------------------------------------------------------------

def select_experts(scores: torch.Tensor, bias: torch.Tensor, k: int,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores + bias``: scores ``[N, E]`` fp32, bias ``[E]`` -> (idx ``[N, k]`` long, counts ``[E]`` long).

    Indices come in descending order of ``scores + bias``; counts = how often each expert was
    picked. Both backends return the same indices (ties: the lower expert index) and counts.
    """
    if use_triton(backend, scores):
        return topk_select(scores, bias, k)
    idx = torch.topk(scores + bias.float(), k, dim=-1).indices
    # scatter_add instead of bincount: CUDA bincount reads max() on the host (a sync).
    counts = torch.zeros(bias.numel(), dtype=torch.long, device=scores.device)
    counts.scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.long, device=scores.device))
    return idx, counts


def topk_select(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton top-k of ``scores + bias``.

    scores ``[N, E]`` fp32, bias ``[E]`` -> (idx ``[N, k]`` long, counts ``[E]`` long).

    Indices come in descending order of ``scores + bias``; ties go to the lower expert index; NaN
    counts as -inf. counts = how often each expert was picked (per-program int32 histograms, one
    atomic add per expert and program: an exact integer sum, so deterministic).
    """
    n, e = scores.shape
    if not 1 <= k <= e:
        raise ValueError(f"topk_select: k={k} is not allowed: expected 1..{e} (the number of experts)")
    scores, bias = scores.float().contiguous(), bias.float().contiguous()
    idx = torch.empty(n, k, dtype=torch.long, device=scores.device)
    counts = torch.zeros(e, dtype=torch.int32, device=scores.device)
    if n > 0:
        ep = triton.next_power_of_2(e)
        # Small blocks: k rounds of row reductions are latency-bound, so more programs beat wider ones.
        block_t = max(1, min(128, 1024 // ep))
        _topk_kernel[(triton.cdiv(n, block_t),)](scores, bias, idx, counts, n, e, K=k, EP=ep, BLOCK_T=block_t)
    return idx, counts.long()



# ----------------------------------------------------------------------------------------------
# Grouped GEMM: which function, and whether it runs for this device and dtype.
# ----------------------------------------------------------------------------------------------

def _grouped_mm_fn() -> Callable | None:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


_GROUPED: dict[tuple, tuple[bool, bool]] = {}


@torch.compiler.disable
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe once per (device, dtype): does grouped_mm run forward and backward, and agree with a loop?

    Torch versions differ (CUDA bf16 only on older builds; CPU in newer ones), so we ask the
    installed one with a tiny problem that includes an empty group. Cached.
    """
    return _grouped_probe(device, dtype)[0]


def grouped_mm_zeroes_empty_groups(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped_mm's weight gradient is exactly zero for an expert with no rows.

    With zero rows the weight-gradient GEMM has K = 0; a kernel that skips such a group leaves
    uninitialized memory. When the probe sees that, ``experts_grouped`` masks those gradients.
    """
    return _grouped_probe(device, dtype)[1]


@torch.compiler.disable
def _grouped_probe(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    device = torch.device(device)
    key = (device.type, device.index, dtype)
    if key not in _GROUPED:
        _GROUPED[key] = _probe_grouped(device, dtype)
    return _GROUPED[key]


def _probe_grouped(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    fn = _grouped_mm_fn()
    if fn is None:
        return False, False
    try:
        with torch.autocast(device_type=device.type, enabled=False), torch.enable_grad():
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(24, 16, generator=gen).to(device, dtype).requires_grad_()
            b = torch.randn(3, 16, 16, generator=gen).to(device, dtype).requires_grad_()
            offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)  # group 1 is empty
            out = fn(a, b, offs=offs)
            go = torch.randn(out.shape, generator=gen).to(device, dtype)
            # Leave NaNs in the block the allocator will hand to b.grad, so a skipped group shows.
            torch.full_like(b.detach(), float("nan"))
            out.backward(go)
            a32, b32, go32 = a.detach().float(), b.detach().float(), go.float()
            ref = torch.cat([a32[:8] @ b32[0], a32[8:] @ b32[2]])
            ref_da = torch.cat([go32[:8] @ b32[0].T, go32[8:] @ b32[2].T])
            ref_db = torch.stack([a32[:8].T @ go32[:8], torch.zeros(16, 16, device=device), a32[8:].T @ go32[8:]])
            used = [0, 2]
            runs = (_rel_close(ref, out.float(), 2e-2) and _rel_close(ref_da, a.grad.float(), 2e-2)
                    and _rel_close(ref_db[used], b.grad.float()[used], 2e-2))
            zero_empty = bool((b.grad[1] == 0).all().item())
            return runs, zero_empty
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False, False


def _rel_close(ref: torch.Tensor, out: torch.Tensor, tol: float) -> bool:
    return bool(torch.isfinite(out).all().item() and ((ref - out).norm() <= tol * ref.norm()).item())


def grouped_mm_aligned(dims: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Grouped GEMM needs 16-byte aligned row strides: every dim a multiple of 16 / itemsize."""
    step = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    return all(d % step == 0 for d in dims)


# ----------------------------------------------------------------------------------------------
# Dispatch plan, dispatch (copy rows to expert order) and combine (weighted un-permute + sum).
# ----------------------------------------------------------------------------------------------

@dataclass
class DispatchPlan:
    """Where each (token, slot) assignment goes. M = N * k; assignment a = n * k + j.

    token_of: ``[M]`` long, token of the row at sorted position i.
    inv: ``[M]`` long, sorted position of assignment a (inverse of the sort permutation).
    counts: ``[E]`` long, rows per expert; offs: ``[E]`` int32 cumulative counts (grouped GEMM).
    """

    token_of: torch.Tensor
    inv: torch.Tensor
    counts: torch.Tensor
    offs: torch.Tensor
    top_k: int


def make_plan(topk_idx: torch.Tensor, counts: torch.Tensor) -> DispatchPlan:
    """topk_idx ``[N, k]``, counts ``[E]`` -> DispatchPlan. One stable argsort, no host sync."""
    n, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    # Radix sort cost grows with the key width: sort 8-bit keys when expert ids fit (one pass, not eight).
    e = counts.numel()
    keys = flat.to(torch.uint8) if e <= 256 else (flat.to(torch.int16) if e <= 32768 else flat)
    order = torch.argsort(keys, stable=True)  # sorted position -> assignment; stable keeps token order
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return DispatchPlan(token_of=order // k, inv=inv, counts=counts,
                        offs=counts.cumsum(0).to(torch.int32), top_k=k)


def dispatch(x: torch.Tensor, plan: DispatchPlan, backend: str = "auto") -> torch.Tensor:
    """x ``[N, R]`` -> rows in expert order ``[N * k, R]`` (row i is token ``plan.token_of[i]``)."""
    if use_triton(backend, x):
        return _Dispatch.apply(x, plan.inv, plan.top_k)
    return x.index_select(0, plan.token_of)


def combine(y: torch.Tensor, weight: torch.Tensor, plan: DispatchPlan, backend: str = "auto") -> torch.Tensor:
    """y ``[N * k, R]`` in expert order, weight ``[N, k]`` fp32 -> ``u[n] = sum_j weight[n, j] y[inv[n k + j]]``.

    Returns ``[N, R]`` fp32 (the sum accumulates in fp32 whatever y's dtype).
    """
    n, k = weight.shape
    if use_triton(backend, y):
        return _Combine.apply(y, weight, plan.inv, k, None, 0.0, torch.float32)
    return (y.index_select(0, plan.inv).view(n, k, -1).float() * weight.unsqueeze(-1)).sum(1)


def combine_norm(y: torch.Tensor, weight: torch.Tensor, plan: DispatchPlan, gamma: torch.Tensor, eps: float,
                 out_dtype: torch.dtype, backend: str = "auto") -> torch.Tensor:
    """``RMSNorm(combine(y, weight))``: ``[N * k, R]`` -> ``[N, R]`` out_dtype, normalized in fp32.

    ``z[n] = gamma * u[n] / sqrt(mean(u[n]^2) + eps)`` with u = combine(...) in fp32. The Triton
    kernel never stores u: its backward recomputes u from the k rows it reads anyway for the
    weight gradients.
    """
    if use_triton(backend, y):
        return _Combine.apply(y, weight, plan.inv, weight.shape[1], gamma, float(eps), out_dtype)
    u = combine(y, weight, plan, "torch")
    return F.rms_norm(u, (u.shape[-1],), gamma.float(), eps).to(out_dtype)


def _tile(r: int, k: int, whole_row: bool) -> tuple[int, int]:
    """(KP, BLOCK_R) for kernels that hold a token's k rows as a ``[KP, BLOCK_R]`` tile."""
    kp = triton.next_power_of_2(k)
    block = triton.next_power_of_2(r) if whole_row else min(triton.next_power_of_2(r), max(16, 4096 // kp))
    return kp, block


def _warp_configs() -> list:
    """Autotune candidates for the combine kernels: the warp count. On the H200 it matters a lot
    (the [8, 512] combine forward: 81 us with 2 warps, 190 us with 4, 627 us with 8), and the best
    one moves with the tile; the interpreter (CPU tests) runs a single config."""
    warps = (4,) if os.environ.get("TRITON_INTERPRET") == "1" else (1, 2, 4, 8)
    return [triton.Config({}, num_warps=w) for w in warps]


class _Dispatch(torch.autograd.Function):
    """Copy each token's row to its k sorted positions; backward sums the k copies (fp32)."""

    @staticmethod
    def forward(ctx, x, inv, k):
        x = x.contiguous()
        n, r = x.shape
        out = torch.empty(n * k, r, dtype=x.dtype, device=x.device)
        if n > 0:
            kp, block = _tile(r, k, whole_row=False)
            # 85 us for [32768 x 512] bf16 to 8 rows each on the H200, whatever the warp count: no tuning.
            _scatter_rows_kernel[(n, triton.cdiv(r, block))](x, inv, out, r, K=k, KP=kp, BLOCK_R=block)
        ctx.save_for_backward(inv)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx, grad_xs):
        (inv,) = ctx.saved_tensors
        return _combine_fwd(grad_xs, inv, None, ctx.k, None, 0.0, grad_xs.dtype), None, None


def _combine_fwd(src: torch.Tensor, inv: torch.Tensor, weight: torch.Tensor | None, k: int,
                 gamma: torch.Tensor | None, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """``u[n] = sum_j w[n, j] src[inv[n k + j]]`` in fp32, then RMSNorm with gamma when given; ``[N, R]`` out_dtype."""
    src = src.contiguous()
    n, r = inv.numel() // k, src.shape[1]
    out = torch.empty(n, r, dtype=out_dtype, device=src.device)
    if n > 0:
        kp, block = _tile(r, k, whole_row=gamma is not None)
        _combine_fwd_kernel[(n, triton.cdiv(r, block))](
            src, inv, weight if weight is not None else src, gamma if gamma is not None else src, out, r, eps,
            K=k, KP=kp, BLOCK_R=block, HAS_W=weight is not None, HAS_NORM=gamma is not None)
    return out


# Tokens per program of the combine backward: the RMSNorm weight gradient is summed per program
# in registers, then over programs in torch (N / 4 rows of partial sums: small, deterministic).
_BWD_TOKENS = 4


class _Combine(torch.autograd.Function):
    """Weighted gather-sum (+ optional RMSNorm); backward per token: grad rows, grad weights, dgamma."""

    @staticmethod
    def forward(ctx, y, weight, inv, k, gamma, eps, out_dtype):
        y, weight = y.contiguous(), weight.float().contiguous()
        ctx.save_for_backward(y, weight, inv, gamma)
        ctx.k, ctx.eps = k, eps
        return _combine_fwd(y, inv, weight, k, gamma, eps, out_dtype)

    @staticmethod
    def backward(ctx, grad_z):
        y, weight, inv, gamma = ctx.saved_tensors
        k = ctx.k
        grad_z = grad_z.contiguous()
        n, r = weight.shape[0], y.shape[1]
        grad_y = torch.empty_like(y)
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=y.device)
        programs = triton.cdiv(n, _BWD_TOKENS) if n > 0 else 0
        dgamma = torch.empty(programs, r, dtype=torch.float32, device=y.device) if gamma is not None else None
        if n > 0:
            kp, block = _tile(r, k, whole_row=True)
            _combine_bwd_kernel[(programs,)](
                grad_z, y, inv, weight, gamma if gamma is not None else y, grad_y, grad_w,
                dgamma if dgamma is not None else grad_w, n, r, ctx.eps, K=k, KP=kp, BLOCK_R=block,
                TOKENS=_BWD_TOKENS, HAS_NORM=gamma is not None)
        if gamma is not None:
            dgamma = dgamma.sum(0).to(gamma.dtype)
        return grad_y, grad_w, None, None, dgamma, None, None


if HAS_TRITON:

    @triton.jit
    def _topk_kernel(s_ptr, b_ptr, idx_ptr, cnt_ptr, N, E, K: tl.constexpr, EP: tl.constexpr,
                     BLOCK_T: tl.constexpr):
        # BLOCK_T tokens x all E experts in registers; k rounds of (max, lowest index at the max, remove).
        rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, EP)
        rmask = rows < N
        cmask = cols < E
        free = rmask[:, None] & cmask[None, :]
        v = tl.load(s_ptr + rows[:, None] * E + cols[None, :], mask=free, other=0.0)
        v = v + tl.load(b_ptr + cols, mask=cmask, other=0.0)[None, :]
        v = tl.where(v == v, v, float("-inf"))  # NaN -> -inf, so a row always has a maximum
        cnt = tl.zeros([EP], dtype=tl.int32)
        for j in tl.static_range(K):
            cand = tl.where(free, v, float("-inf"))
            best = tl.max(cand, axis=1)
            pick = tl.min(tl.where(free & (cand == best[:, None]), cols[None, :], EP), axis=1)
            tl.store(idx_ptr + rows * K + j, pick.to(tl.int64), mask=rmask)
            hit = free & (cols[None, :] == pick[:, None])
            cnt += tl.sum(hit.to(tl.int32), axis=0)
            free = free & (cols[None, :] != pick[:, None])
        tl.atomic_add(cnt_ptr + cols, cnt, mask=cmask)

    @triton.jit
    def _scatter_rows_kernel(x_ptr, inv_ptr, out_ptr, R, K: tl.constexpr, KP: tl.constexpr,
                             BLOCK_R: tl.constexpr):
        # Token n's row, read once, written to its K sorted positions inv[n K + j].
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        js = tl.arange(0, KP)
        cmask = cols < R
        jmask = js < K
        rows = tl.load(inv_ptr + n * K + js, mask=jmask, other=0).to(tl.int64)
        v = tl.load(x_ptr + n * R + cols, mask=cmask, other=0.0)
        tile = tl.broadcast_to(v[None, :], (KP, BLOCK_R))
        tl.store(out_ptr + rows[:, None] * R + cols[None, :], tile, mask=jmask[:, None] & cmask[None, :])

    @triton.autotune(configs=_warp_configs(), key=["R", "K", "HAS_W", "HAS_NORM"])
    @triton.jit
    def _combine_fwd_kernel(src_ptr, inv_ptr, w_ptr, gamma_ptr, out_ptr, R, eps, K: tl.constexpr,
                            KP: tl.constexpr, BLOCK_R: tl.constexpr, HAS_W: tl.constexpr,
                            HAS_NORM: tl.constexpr):
        # Token n: its K rows as one [KP, BLOCK_R] gather, summed in fp32 (HAS_NORM: whole row in the block).
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        js = tl.arange(0, KP)
        cmask = cols < R
        jmask = js < K
        rows = tl.load(inv_ptr + n * K + js, mask=jmask, other=0).to(tl.int64)
        v = tl.load(src_ptr + rows[:, None] * R + cols[None, :], mask=jmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + n * K + js, mask=jmask, other=0.0)[:, None]
        u = tl.sum(v, axis=0)
        if HAS_NORM:
            rstd = (1.0 / tl.sqrt(tl.sum(u * u, axis=0) / R + eps)).to(tl.float32)
            u = u * rstd * tl.load(gamma_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * R + cols, u.to(out_ptr.dtype.element_ty), mask=cmask)

    # Autotuning reruns the kernel: fine, every output is overwritten, nothing accumulates.
    @triton.autotune(configs=_warp_configs(), key=["R", "K", "HAS_NORM"])
    @triton.jit
    def _combine_bwd_kernel(gz_ptr, y_ptr, inv_ptr, w_ptr, gamma_ptr, gy_ptr, gw_ptr, dgamma_ptr, N, R, eps,
                            K: tl.constexpr, KP: tl.constexpr, BLOCK_R: tl.constexpr, TOKENS: tl.constexpr,
                            HAS_NORM: tl.constexpr):
        # TOKENS tokens per program. Per token n with rows Y_j = y[inv[n K + j]] and weights w_j:
        #   u = sum_j w_j Y_j;  HAS_NORM: xh = u rstd, z = gamma xh, so
        #   g_u = rstd (gamma g_z - xh mean(gamma g_z xh)), dgamma += g_z xh;  else g_u = g_z;
        #   grad Y_j = w_j g_u,  grad w_j = <g_u, Y_j>.
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_R)
        js = tl.arange(0, KP)
        cmask = cols < R
        if HAS_NORM:
            gamma = tl.load(gamma_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            dgamma = tl.zeros([BLOCK_R], dtype=tl.float32)
        for t in range(TOKENS):
            n = pid.to(tl.int64) * TOKENS + t
            live = (n < N).to(tl.int32)  # 0 past the last token: every mask below goes empty
            jmask = js < K * live
            tile_mask = jmask[:, None] & cmask[None, :]
            rows = tl.load(inv_ptr + n * K + js, mask=jmask, other=0).to(tl.int64)
            w = tl.load(w_ptr + n * K + js, mask=jmask, other=0.0)
            yv = tl.load(y_ptr + rows[:, None] * R + cols[None, :], mask=tile_mask, other=0.0).to(tl.float32)
            g = tl.load(gz_ptr + n * R + cols, mask=cols < R * live, other=0.0).to(tl.float32)
            if HAS_NORM:
                u = tl.sum(yv * w[:, None], axis=0)
                rstd = (1.0 / tl.sqrt(tl.sum(u * u, axis=0) / R + eps)).to(tl.float32)
                xh = u * rstd
                dgamma += g * xh
                gx = g * gamma
                g = rstd * (gx - xh * (tl.sum(gx * xh, axis=0) / R))
            tl.store(gy_ptr + rows[:, None] * R + cols[None, :], (w[:, None] * g[None, :]).to(gy_ptr.dtype.element_ty),
                     mask=tile_mask)
            tl.store(gw_ptr + n * K + js, tl.sum(yv * g[None, :], axis=1), mask=jmask)
        if HAS_NORM:
            tl.store(dgamma_ptr + pid * R + cols, dgamma, mask=cmask)


# ----------------------------------------------------------------------------------------------
# Routed experts on sorted rows.
# ----------------------------------------------------------------------------------------------

@torch.compiler.disable  # torch's meta kernel of grouped_mm refuses fp32 that its CPU kernel runs
def experts_grouped(xs: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, offs: torch.Tensor,
                    activation: str, beta1: float, beta2: float, backend: str = "auto") -> torch.Tensor:
    """xs ``[M, R]`` sorted by expert, w_in ``[E, R, 2F]``, w_out ``[E, F, R]``, offs ``[E]`` int32 -> ``[M, R]``."""
    gmm = _grouped_mm_fn()
    if w_in.requires_grad and not grouped_mm_zeroes_empty_groups(xs.device, xs.dtype):
        empty = (offs.diff(prepend=offs.new_zeros(1)) == 0)[:, None, None]
        # Hooks go on fresh views (not on the Parameters, where they would pile up call after call).
        w_in, w_out = w_in.view_as(w_in), w_out.view_as(w_out)
        for w in (w_in, w_out):
            w.register_hook(lambda g, empty=empty: g.masked_fill(empty, 0))
    h = gmm(xs, w_in, offs=offs)
    return gmm(glu(h, activation, beta1, beta2, backend), w_out, offs=offs)


def experts_loop(xs: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts: list[int],
                 activation: str, beta1: float, beta2: float, backend: str = "auto") -> torch.Tensor:
    """Same as ``experts_grouped`` with host-side counts ``[E]``: one matmul pair per non-empty expert."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c:
            seg = xs[start:start + c]
            outs.append(glu(seg @ w_in[e], activation, beta1, beta2, backend) @ w_out[e])
            start += c
    return torch.cat(outs) if outs else xs.new_zeros(0, w_out.shape[-1])
