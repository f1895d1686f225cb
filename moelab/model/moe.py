"""Stable LatentMoE (Kimi K3): sigmoid router with a selection-only bias, routed GLU experts in a
latent width, full-width shared experts, dropless dispatch.

    s = sigmoid(W_r x)                              [N, E] fp32 router scores
    T = TopK(s + b)                                 b: per-expert bias, selection only
    p_i = s_i / sum_{r in T} s_r                    routing weights (bias excluded)
    u = sum_{i in T} p_i E_i(W_down x)              routed experts act in width l (latent_dim)
    y = sum_j S_j(x) + W_up RMSNorm(u)              S_j: shared GLU experts at d_model

With ``latent_dim == 0`` the routed experts act at d_model directly: ``y = sum_j S_j(x) + u(x)``.

Dispatch is dropless (no capacity): every (token, expert) assignment is computed. The operators
(``moelab.ops.moe``, ``moelab.ops.glu``) come in a Triton and a PyTorch version of the same
function, chosen by ``MoEConfig.backend``; ``MoEConfig.dispatch`` picks grouped GEMMs or a
per-expert loop for the experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from moelab.base import ConfigError
from moelab.model.balance import RouterBalance, RouterStats, router_loss_fn
from moelab.model.config import MoEConfig
from moelab.model.ffn import GLUFFN
from moelab.model.norm import RMSNorm
from moelab.ops.glu import check_activation, glu
from moelab.ops.moe import (
    combine,
    combine_norm,
    dispatch,
    experts_grouped,
    experts_loop,
    grouped_mm_aligned,
    grouped_mm_supported,
    make_plan,
    project_input,
    select_experts,
)


class Router(nn.Module):
    """Sigmoid top-k router in fp32 with a selection-only per-expert bias.

    ``bias`` ``[E]`` fp32 is a persistent buffer (not a Parameter): balancers update it in place
    between steps. ``balance`` (a ``moelab.model.balance.RouterBalance``; LatentMoE builds it from
    ``MoEConfig.balancer``) sees every routing decision: training forwards feed the step's balancer
    statistics, eval forwards only the loads. ``aux_loss_fn``, when set (LatentMoE: from the config),
    is called with the RouterStats of every forward and its scalar result becomes ``stats.aux_loss``
    (the caller adds it to the loss). ``backend``
    ("auto" | "triton" | "torch", ``MoEConfig.backend``): the logits (``mm_f32``) and the top-k
    (``select_experts``) implementations.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, backend: str = "auto",
                 balance: RouterBalance | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ConfigError(f"Router: top_k={top_k} is not allowed: expected 1..num_experts ({num_experts})")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32), persistent=True)
        self.balance = balance
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
        logits, _ = project_input(x, self.weight, [], x.dtype, self.backend)
        return self.route(logits)

    def route(self, logits: torch.Tensor) -> RouterStats:
        """logits ``[N, E]`` fp32 (``x W_r^T``) -> RouterStats: sigmoid, biased top-k, normalized weights."""
        scores = torch.sigmoid(logits.float())
        # Selection sees the bias; the weights do not. Selection has no gradient (detached scores).
        idx, counts = select_experts(scores.detach(), self.bias, self.top_k, self.backend)
        picked = scores.gather(1, idx)
        # sigmoid > 0, but can underflow to 0 for logits < -88; keep the division finite then.
        weight = picked / picked.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        stats = RouterStats(aux_loss=torch.zeros((), device=logits.device), tokens_per_expert=counts,
                            scores=scores, topk_idx=idx, topk_weight=weight, logits=logits)
        if self.aux_loss_fn is not None:
            stats.aux_loss = self.aux_loss_fn(stats)
        if self.balance is not None:
            self.balance.observe(stats, self.bias, self.training)
        return stats

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, top_k={self.top_k}, backend={self.backend}"


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
    ``cfg.backend`` picks the operators' implementation ("auto": Triton on CUDA; "triton" also runs
    on CPU under TRITON_INTERPRET=1, as the tests do); both compute the same function.
    """

    def __init__(self, d_model: int, cfg: MoEConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        cfg.validate()
        check_activation(cfg.activation)
        self.cfg, self.d_model = cfg, d_model
        self.latent = cfg.latent_dim > 0
        self.routed_dim = cfg.latent_dim if self.latent else d_model
        r, f, e = self.routed_dim, cfg.expert_dim, cfg.num_experts
        self.router = Router(d_model, e, cfg.top_k, cfg.backend, balance=RouterBalance(cfg))
        self.router.aux_loss_fn = router_loss_fn(cfg)
        if self.latent:
            self.proj_down = nn.Linear(d_model, r, bias=False)
            self.latent_norm = RMSNorm(r, eps=norm_eps)
            self.proj_up = nn.Linear(r, d_model, bias=False)
        self.w_in = nn.Parameter(torch.empty(e, r, 2 * f))
        self.w_out = nn.Parameter(torch.empty(e, f, r))
        self.shared_width = cfg.shared_dim or cfg.expert_dim
        self.shared = (GLUFFN(d_model, cfg.num_shared * self.shared_width, cfg.activation,
                              cfg.situ_beta1, cfg.situ_beta2, cfg.backend) if cfg.num_shared > 0 else None)
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
        cfg, backend = self.cfg, self.cfg.backend
        xf = x.reshape(-1, self.d_model)
        cdt = _compute_dtype(x)
        act = (cfg.activation, cfg.situ_beta1, cfg.situ_beta2, backend)

        # Every matmul that reads x at once: router logits (fp32), W_down, the shared gate|up.
        reads = [m.weight for m in (self.proj_down if self.latent else None,
                                    self.shared.gate_up if self.shared is not None else None) if m is not None]
        logits, outs = project_input(xf, self.router.weight, reads, cdt, backend)
        stats = self.router.route(logits)
        h = outs.pop(0) if self.latent else xf.to(cdt)  # [N, R], the routed experts' input

        plan = make_plan(stats.topk_idx, stats.tokens_per_expert)
        xs = dispatch(h, plan, backend)  # [N k, R], expert-contiguous
        w_in, w_out = self.w_in.to(cdt), self.w_out.to(cdt)
        if self.use_grouped(h.device, cdt):
            ys = experts_grouped(xs, w_in, w_out, plan.offs, *act)
        else:
            ys = experts_loop(xs, w_in, w_out, plan.counts.tolist(), *act)
        if self.latent:  # RMSNorm(u) [N, l]
            z = combine_norm(ys, stats.topk_weight, plan, self.latent_norm.weight, self.latent_norm.eps, cdt, backend)
        else:  # u [N, d]
            z = combine(ys, stats.topk_weight, plan, backend).to(cdt)

        shared = (F.linear(glu(outs.pop(0), *act), self.shared.down.weight.to(cdt))
                  if self.shared is not None else None)
        if self.latent:
            w_up = self.proj_up.weight.to(cdt).t()
            # One GEMM with the shared output as addend (beta = 1): no separate add kernel.
            y = torch.mm(z, w_up) if shared is None else torch.addmm(shared, z, w_up)
        else:
            y = z if shared is None else shared + z
        return y.reshape(x.shape), stats

    def extra_repr(self) -> str:
        c = self.cfg
        return (f"d_model={self.d_model}, experts={c.num_experts}, top_k={c.top_k}, latent_dim={c.latent_dim}, "
                f"expert_dim={c.expert_dim}, shared={c.num_shared}x{self.shared_width}, activation={c.activation}, "
                f"dispatch={c.dispatch}, backend={c.backend}")
