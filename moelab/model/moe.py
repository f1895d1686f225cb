"""Stable LatentMoE (Kimi K3): sigmoid router with a selection-only bias, routed GLU experts in a
latent width, full-width shared experts, dropless dispatch.

    s = sigmoid(W_r x)                              [N, E] fp32 router scores
    T = TopK(s + b)                                 b: per-expert bias, selection only
    p_i = s_i / sum_{r in T} s_r                    routing weights (bias excluded)
    u = sum_{i in T} p_i E_i(W_down x)              routed experts act in width l (latent_dim)
    y = sum_j S_j(x) + W_up RMSNorm(u)              S_j: shared GLU experts at d_model

With ``latent_dim == 0`` the routed experts act at d_model directly: ``y = sum_j S_j(x) + u(x)``.

Dispatch (dropless, no capacity): the N*k (token, expert) assignments are sorted by expert once
(stable argsort), the latent rows are gathered into expert-contiguous order, the experts run as
two grouped GEMMs (``dispatch="grouped"``, ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``
with int32 cumulative ``offs``) or as a per-expert loop (``"loop"``, the reference), and the outputs
are combined back per token with the weights p, accumulating in fp32. The grouped path issues no
host synchronisation; the loop path needs the counts on the host.

Gather and combine are each other's adjoint: dispatch-backward is "un-permute and sum the k copies",
combine-backward is "gather grad_u to every copy". Both are written as gathers (no atomics, so
deterministic); on CUDA they run as small Triton kernels that sum the k rows of a token in fp32
without materializing the un-permuted ``[N*k, l]`` tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from moelab.model.activations import GLUFFN, check_activation, glu
from moelab.model.config import ConfigError, MoEConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


@dataclass
class RouterStats:
    """What one router call decided; balancers and metrics read it.

    aux_loss: scalar, zero unless ``Router.aux_loss_fn`` is set (then its value, with grad).
    tokens_per_expert: ``[E]`` long, assignments per expert in this call (sums to N * k).
    scores: ``[N, E]`` fp32 sigmoid scores s (with grad).
    topk_idx: ``[N, k]`` long, experts chosen by TopK(s + bias).
    topk_weight: ``[N, k]`` fp32, p = s[idx] / sum s[idx] (with grad).
    """

    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    scores: torch.Tensor
    topk_idx: torch.Tensor
    topk_weight: torch.Tensor


class Router(nn.Module):
    """Sigmoid top-k router in fp32 with a selection-only per-expert bias.

    ``bias`` ``[E]`` fp32 is a persistent buffer (not a Parameter): balancers update it in place
    between steps. ``aux_loss_fn``, when set, is called with the RouterStats of every forward and
    its scalar result becomes ``stats.aux_loss`` (the caller adds it to the loss).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"Router: top_k={top_k} is not allowed: expected 1..num_experts ({num_experts})")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        self.aux_loss_fn: Callable[[RouterStats], torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=std)
        self.bias.zero_()

    def _apply(self, fn, recurse: bool = True):
        # model.to(bf16) would cast the bias buffer too, and bf16 cannot hold the small balancer
        # steps (1e-3 on values ~0.1 rounds away): keep it fp32 whatever the module dtype.
        super()._apply(fn, recurse)
        if self.bias.dtype != torch.float32:
            self.bias = self.bias.float()
        return self

    def forward(self, x: torch.Tensor) -> RouterStats:
        """x: ``[N, d_model]`` any float dtype. Scores are computed in fp32 even under autocast."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        # Selection sees the bias; the weights do not. topk of a detached tensor: selection has no gradient.
        idx = torch.topk(scores.detach() + self.bias.float(), self.top_k, dim=-1).indices
        picked = scores.gather(1, idx)
        # sigmoid > 0, but can underflow to 0 for logits < -88; keep the division finite then.
        weight = picked / picked.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        # scatter_add instead of bincount: CUDA bincount reads max() on the host (a sync).
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.long, device=x.device))
        stats = RouterStats(aux_loss=torch.zeros((), device=x.device), tokens_per_expert=counts,
                            scores=scores, topk_idx=idx, topk_weight=weight)
        if self.aux_loss_fn is not None:
            stats.aux_loss = self.aux_loss_fn(stats)
        return stats

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}"


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32: ``[..., dim]`` any float dtype -> ``[..., dim]`` fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)


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
# Dispatch plan, gather (dispatch) and weighted un-permute + sum (combine).
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
    order = torch.argsort(flat, stable=True)  # sorted position -> assignment; stable keeps token order
    inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return DispatchPlan(token_of=order // k, inv=inv, counts=counts,
                        offs=counts.cumsum(0).to(torch.int32), top_k=k)


def dispatch(x: torch.Tensor, plan: DispatchPlan, fused: bool) -> torch.Tensor:
    """x ``[N, R]`` -> rows in expert order ``[N * k, R]`` (row i is token ``plan.token_of[i]``)."""
    if fused:
        return _Dispatch.apply(x, plan.token_of, plan.inv, plan.top_k)
    return x.index_select(0, plan.token_of)


def combine(y: torch.Tensor, weight: torch.Tensor, plan: DispatchPlan, fused: bool) -> torch.Tensor:
    """y ``[N * k, R]`` in expert order, weight ``[N, k]`` fp32 -> ``u[n] = sum_j weight[n, j] y[inv[n k + j]]``.

    Returns ``[N, R]`` fp32 (the sum accumulates in fp32 whatever y's dtype).
    """
    n, k = weight.shape
    if fused:
        return _Combine.apply(y, weight, plan.inv, k)
    return (y.index_select(0, plan.inv).view(n, k, -1).float() * weight.unsqueeze(-1)).sum(1)


class _Dispatch(torch.autograd.Function):
    """Gather forward; backward sums the k copies of each token with the Triton gather-sum."""

    @staticmethod
    def forward(ctx, x, token_of, inv, k):
        ctx.save_for_backward(inv)
        ctx.k, ctx.dtype = k, x.dtype
        return x.index_select(0, token_of)

    @staticmethod
    def backward(ctx, grad_xs):
        (inv,) = ctx.saved_tensors
        return _gather_sum(grad_xs, inv, None, ctx.k, ctx.dtype), None, None, None


class _Combine(torch.autograd.Function):
    """Weighted gather-sum forward (fp32 out); backward gathers grad_u to every copy and dots for p."""

    @staticmethod
    def forward(ctx, y, weight, inv, k):
        weight = weight.float().contiguous()
        ctx.save_for_backward(y, weight, inv)
        ctx.k = k
        return _gather_sum(y, inv, weight, k, torch.float32)

    @staticmethod
    def backward(ctx, grad_u):
        y, weight, inv = ctx.saved_tensors
        grad_u = grad_u.float().contiguous()
        y = y.contiguous()
        grad_y = torch.empty_like(y)
        grad_w = torch.empty(weight.shape, dtype=torch.float32, device=y.device)
        r = y.shape[1]
        if inv.numel() > 0:
            _combine_bwd_kernel[(inv.numel(),)](grad_u, y, inv, weight, grad_y, grad_w, r,
                                                K=ctx.k, BLOCK=_block(r))
        return grad_y, grad_w, None, None


def _block(r: int) -> int:
    return min(1024, triton.next_power_of_2(r))


def _gather_sum(src: torch.Tensor, inv: torch.Tensor, weight: torch.Tensor | None, k: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """``out[n] = sum_j w[n, j] src[inv[n k + j]]`` in fp32; src ``[N k, R]`` -> ``[N, R]`` out_dtype."""
    src = src.contiguous()
    n, r = inv.numel() // k, src.shape[1]
    out = torch.empty(n, r, dtype=out_dtype, device=src.device)
    if n > 0:
        block = _block(r)
        _gather_sum_kernel[(n, triton.cdiv(r, block))](src, inv, weight if weight is not None else src, out, r,
                                                       K=k, HAS_W=weight is not None, BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(src_ptr, inv_ptr, w_ptr, out_ptr, R, K: tl.constexpr, HAS_W: tl.constexpr,
                           BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < R
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            i = tl.load(inv_ptr + n * K + j).to(tl.int64)
            v = tl.load(src_ptr + i * R + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + n * K + j)
            acc += v
        tl.store(out_ptr + n * R + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_bwd_kernel(gu_ptr, y_ptr, inv_ptr, w_ptr, gy_ptr, gw_ptr, R, K: tl.constexpr,
                            BLOCK: tl.constexpr):
        # One program per assignment a = n K + j: grad_y[inv[a]] = w[a] grad_u[n], grad_w[a] = <grad_u[n], y[inv[a]]>.
        a = tl.program_id(0).to(tl.int64)
        n = a // K
        i = tl.load(inv_ptr + a).to(tl.int64)
        w = tl.load(w_ptr + a)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, R, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < R
            gu = tl.load(gu_ptr + n * R + cols, mask=mask, other=0.0)
            yv = tl.load(y_ptr + i * R + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(gy_ptr + i * R + cols, (gu * w).to(gy_ptr.dtype.element_ty), mask=mask)
            dot += gu * yv
        tl.store(gw_ptr + a, tl.sum(dot, axis=0))


# ----------------------------------------------------------------------------------------------
# Routed experts on sorted rows.
# ----------------------------------------------------------------------------------------------

def experts_grouped(xs: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, offs: torch.Tensor,
                    activation: str, beta1: float, beta2: float, fused: bool | None) -> torch.Tensor:
    """xs ``[M, R]`` sorted by expert, w_in ``[E, R, 2F]``, w_out ``[E, F, R]``, offs ``[E]`` int32 -> ``[M, R]``."""
    gmm = _grouped_mm_fn()
    if w_in.requires_grad and not grouped_mm_zeroes_empty_groups(xs.device, xs.dtype):
        empty = (offs.diff(prepend=offs.new_zeros(1)) == 0)[:, None, None]
        # Hooks go on fresh views (not on the Parameters, where they would pile up call after call).
        w_in, w_out = w_in.view_as(w_in), w_out.view_as(w_out)
        for w in (w_in, w_out):
            w.register_hook(lambda g, empty=empty: g.masked_fill(empty, 0))
    h = gmm(xs, w_in, offs=offs)
    return gmm(glu(h, activation, beta1, beta2, fused), w_out, offs=offs)


def experts_loop(xs: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts: list[int],
                 activation: str, beta1: float, beta2: float, fused: bool | None) -> torch.Tensor:
    """Same as ``experts_grouped`` with host-side counts ``[E]``: one matmul pair per non-empty expert."""
    outs, start = [], 0
    for e, c in enumerate(counts):
        if c:
            seg = xs[start:start + c]
            outs.append(glu(seg @ w_in[e], activation, beta1, beta2, fused) @ w_out[e])
            start += c
    return torch.cat(outs) if outs else xs.new_zeros(0, w_out.shape[-1])


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class LatentMoE(nn.Module):
    """Stable LatentMoE layer: ``[B, T, d_model] -> ([B, T, d_model], RouterStats)``.

    Parameters:
      router.weight ``[E, d]`` (fp32 math), router.bias buffer ``[E]``;
      proj_down ``d -> l``, latent_norm ``[l]``, proj_up ``l -> d`` (only when latent_dim > 0);
      w_in ``[E, R, 2F]`` (gate columns first, then up), w_out ``[E, F, R]`` with R = l or d, F = expert_dim;
      shared: ONE GLUFFN of width ``num_shared * shared_width`` standing for ``num_shared`` shared
      experts of width ``shared_width`` (shared_dim, or expert_dim when 0): their outputs are summed,
      and a sum of GLU FFNs over disjoint hidden units is one GLU FFN over all of them.
    Attribute ``fused``: None uses the Triton gather/combine/activation kernels on CUDA, True forces
    them (tests run them in the Triton interpreter), False forces plain PyTorch.
    """

    def __init__(self, d_model: int, cfg: MoEConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        cfg.validate()
        check_activation(cfg.activation)
        self.cfg, self.d_model = cfg, d_model
        self.latent = cfg.latent_dim > 0
        self.routed_dim = cfg.latent_dim if self.latent else d_model
        r, f, e = self.routed_dim, cfg.expert_dim, cfg.num_experts
        self.router = Router(d_model, e, cfg.top_k)
        if self.latent:
            self.proj_down = nn.Linear(d_model, r, bias=False)
            self.latent_norm = RMSNorm(r, norm_eps)
            self.proj_up = nn.Linear(r, d_model, bias=False)
        self.w_in = nn.Parameter(torch.empty(e, r, 2 * f))
        self.w_out = nn.Parameter(torch.empty(e, f, r))
        self.shared_width = cfg.shared_dim or cfg.expert_dim
        self.shared = (GLUFFN(d_model, cfg.num_shared * self.shared_width, cfg.activation,
                              cfg.situ_beta1, cfg.situ_beta2) if cfg.num_shared > 0 else None)
        self.fused: bool | None = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        self.init_weights(std, out_scale=1.0)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, out_scale: float = 1.0) -> None:
        """Every weight ~ N(0, std), norm gain 1, router bias 0; the matrices that write into the
        residual stream (proj_up, or w_out without a latent, and the shared down projection) are
        then multiplied by ``out_scale`` (the model passes 1 / sqrt(2 n_layers)). w_out with a
        latent is not scaled: RMSNorm removes its scale anyway."""
        self.router.reset_parameters(std)
        nn.init.normal_(self.w_in, std=std)
        nn.init.normal_(self.w_out, std=std)
        if self.latent:
            nn.init.normal_(self.proj_down.weight, std=std)
            nn.init.normal_(self.proj_up.weight, std=std)
            self.latent_norm.reset_parameters()
            self.proj_up.weight.mul_(out_scale)
        else:
            self.w_out.mul_(out_scale)
        if self.shared is not None:
            self.shared.reset_parameters(std)
            self.shared.down.weight.mul_(out_scale)

    def set_fused(self, fused: bool | None) -> None:
        """Choose the Triton kernels for routed AND shared experts (None: on CUDA)."""
        self.fused = fused
        if self.shared is not None:
            self.shared.fused = fused

    def use_grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Resolve ``cfg.dispatch`` for this device/dtype; "grouped" raises if it cannot run."""
        mode = self.cfg.dispatch
        if mode == "loop":
            return False
        dims = (self.routed_dim, self.cfg.expert_dim)
        aligned = grouped_mm_aligned(dims, dtype)
        ok = aligned and grouped_mm_supported(device, dtype)
        if mode == "grouped" and not ok:
            why = (f"routed_dim={dims[0]} and expert_dim={dims[1]} must be multiples of "
                   f"{16 // torch.empty((), dtype=dtype).element_size()} for {dtype}" if not aligned
                   else f"the installed torch {torch.__version__} has no working grouped_mm for {device.type}/{dtype}")
            raise ConfigError(f"moe.dispatch='grouped' cannot run: {why}; use dispatch='auto' or 'loop'")
        return ok

    def matmul_flops(self, n_tokens: int) -> int:
        """Forward matmul FLOPs (2 per multiply-add) for ``n_tokens`` tokens: router, projections, experts."""
        d, r, f, k = self.d_model, self.routed_dim, self.cfg.expert_dim, self.cfg.top_k
        fl = 2 * n_tokens * d * self.cfg.num_experts  # router
        fl += 2 * n_tokens * k * (r * 2 * f + f * r)  # routed experts
        if self.latent:
            fl += 2 * n_tokens * (d * r + r * d)
        if self.shared is not None:
            w = self.shared.d_hidden
            fl += 2 * n_tokens * (d * 2 * w + w * d)
        return fl

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x ``[B, T, d_model]`` (any leading dims) -> (y same shape, RouterStats over N = B*T tokens).

        Every token is routed on its own, so row t never depends on other rows (causal by construction).
        """
        if x.shape[-1] != self.d_model:
            raise ValueError(f"LatentMoE: input last dim {x.shape[-1]} != d_model {self.d_model}")
        shape = x.shape
        xf = x.reshape(-1, self.d_model)
        cfg = self.cfg
        cdt = _compute_dtype(x)
        fused = self.fused if self.fused is not None else (triton is not None and x.is_cuda)

        stats = self.router(xf)
        plan = make_plan(stats.topk_idx, stats.tokens_per_expert)
        h = (self.proj_down(xf) if self.latent else xf).to(cdt)  # [N, R]
        xs = dispatch(h, plan, fused)  # [N k, R], expert-contiguous
        w_in, w_out = self.w_in.to(cdt), self.w_out.to(cdt)
        act = (cfg.activation, cfg.situ_beta1, cfg.situ_beta2, fused)
        if self.use_grouped(x.device, cdt):
            ys = experts_grouped(xs, w_in, w_out, plan.offs, *act)
        else:
            ys = experts_loop(xs, w_in, w_out, plan.counts.tolist(), *act)
        u = combine(ys, stats.topk_weight, plan, fused)  # [N, R] fp32
        y = self.proj_up(self.latent_norm(u).to(cdt)) if self.latent else u.to(cdt)
        if self.shared is not None:
            y = y + self.shared(xf)
        return y.reshape(shape), stats

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"d_model={self.d_model}, experts={c.num_experts}, top_k={c.top_k}, latent_dim={c.latent_dim}, "
                f"expert_dim={c.expert_dim}, shared={c.num_shared}x{self.shared_width}, activation={c.activation}, "
                f"dispatch={c.dispatch}")
