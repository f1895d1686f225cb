"""Expert load balancing: what a router call decided (:class:`RouterStats`), the rules as pure
functions, the per-router statistics, the balance metrics.

Notation: m tokens, n routed experts, k active per token,
sigmoid scores s ``[m, n]``, a per-expert bias b ``[n]`` used for selection only (TopK(s + b)),
load_j = tokens routed to expert j (sums to m k), target load q = m k / n.

Balancers (``MoEConfig.balancer``):

    none                no balancing (the loads are still measured)
    aux_loss            L = alpha n sum_j f_j P_j,  f_j = load_j / (m k),  P_j = mean_t s_tj / sum_i s_ti
                        (Switch / GShard; a loss term with gradient, the bias stays 0)
    loss_free_sign      b_j += u sign(mean(load) - load_j)                  (Wang et al. 2024, DeepSeek-V3)
    quantile_load       l <- decay l + (1 - decay) load / mean(load);  b_j += eta (quantile_q(l) - l_j);  b -= mean(b)
    quantile_balancing  a_t = (k+1)-th largest of s_t + b                    (cutoff just below the top k)
                        b_j = -[(q+1)-th largest over t of s_tj - a_t];  b -= mean(b)
                        (one exact coordinate step on the dual of the balanced assignment LP;
                        ``quantile_balancing_cutoff='excluding_self'`` takes a_tj over the other
                        experts instead, see ``routing_margins``)

TopK(s + b) does not change when every b_j moves by the same constant, so the rules whose step
does not sum to zero re-centre b; the sign rule is kept as published (its drift is bounded by u
per step and changes no routing). ``router_z_loss`` (ST-MoE: coeff mean_t logsumexp(logits_t)^2)
can be added to any balancer.

How it runs (the torchtitan split): every router of a LatentMoE owns a :class:`RouterBalance`.
During a training forward it adds the loads and keeps the scores; once per optimizer
step the training side calls :func:`balance_step` with its data-parallel collectives, which
computes the statistics (router entropy, and for quantile balancing the margins s - a or their
histogram) for all routers in one batch of kernels, reduces them over micro-batches and ranks,
writes the new biases and clears the accumulators, without a host sync. On a GPU the statistics,
the metrics and the histogram quantile-balancing update are two fused Triton kernels for all
routers (``moelab.ops.router_stats``; the functions here are their reference and the CPU's path). Every rank then holds
the same bias. This module never imports ``torch.distributed``: callers pass the
reductions. In eval mode the bias is frozen and only the loads are summed (MaxVio_global).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from moelab.model.config import MoEConfig
from moelab.ops.backend import use_triton
from moelab.ops.router_stats import finish_step, router_statistics

BIAS_BALANCERS = ("loss_free_sign", "quantile_load", "quantile_balancing")
TINY = torch.finfo(torch.float32).tiny

Collective = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class RouterStats:
    """What one router call decided; balancers and metrics read it.

    aux_loss: scalar, zero unless ``Router.aux_loss_fn`` is set (then its value, with grad).
    tokens_per_expert: ``[E]`` long, assignments per expert in this call (sums to N * k).
    scores: ``[N, E]`` fp32 sigmoid scores s (with grad).
    topk_idx: ``[N, k]`` long, experts chosen by TopK(s + bias).
    topk_weight: ``[N, k]`` fp32, p = s[idx] / sum s[idx] (with grad).
    logits: ``[N, E]`` fp32 router logits, s = sigmoid(logits) (with grad; the z-loss reads them).
    """

    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    scores: torch.Tensor
    topk_idx: torch.Tensor
    topk_weight: torch.Tensor
    logits: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------
# The rules.
# ----------------------------------------------------------------------------------------------

def recentre(bias: torch.Tensor) -> torch.Tensor:
    """``b - mean(b)`` over the experts (last dim) of ``[..., n]``: the same routing, without the common drift."""
    return bias - bias.mean(-1, keepdim=True)


def aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int, alpha: float) -> torch.Tensor:
    """Switch/GShard balance loss ``alpha n sum_j f_j P_j`` (fp32 scalar; gradient through P only).

    scores ``[m, n]`` fp32 sigmoid scores; tokens_per_expert ``[n]`` integer loads (sum m k).
    f_j = load_j / (m k) and P_j = mean over tokens of the scores normalized over experts both
    sum to 1, so the loss is alpha at a uniform routing and up to alpha n when one expert takes all.
    """
    m, n = scores.shape
    f = tokens_per_expert.float() / max(m * top_k, 1)
    p = (scores / scores.sum(-1, keepdim=True).clamp_min(TINY)).sum(0) / max(m, 1)
    return alpha * n * (f * p).sum()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss ``coeff mean_t logsumexp_j(logits_tj)^2`` (ST-MoE); logits ``[m, n]`` fp32."""
    if logits.shape[0] == 0:
        return logits.sum()
    return coeff * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


def loss_free_sign_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """``b_j + u sign(mean(load) - load_j)``: bias ``[..., n]`` fp32, load ``[..., n]`` (counts) -> new bias."""
    load = load.float()
    return bias + rate * torch.sign(load.mean(-1, keepdim=True) - load)


def load_average(average: torch.Tensor, load: torch.Tensor, decay: float) -> torch.Tensor:
    """Moving average of mean-normalized loads: ``decay avg + (1 - decay) load / mean(load)``; ``[..., n]`` fp32.

    Normalizing by the mean makes the rate independent of the batch size (a uniform load is 1).
    """
    load = load.float()
    return decay * average + (1.0 - decay) * load / load.mean(-1, keepdim=True).clamp_min(TINY)


def quantile_load_update(bias: torch.Tensor, average: torch.Tensor, rate: float, q: float) -> torch.Tensor:
    """``b_j + eta (quantile_q(avg) - avg_j)``, re-centred; average ``[..., n]`` from :func:`load_average`.

    Experts above the q-quantile of the averaged load lose bias, those below gain; using a
    quantile rather than the mean as the base is the articles' choice (robust to one outlier).
    """
    base = torch.quantile(average, q, dim=-1, keepdim=True)
    return recentre(bias + rate * (base - average))


def qb_target(m: int, k: int, n: int) -> int:
    """q = m k / n, the per-expert load quantile balancing aims at; m k must be a multiple of n.

    With a remainder no assignment gives every expert the same load, and the dual step's
    order statistic (the (q+1)-th largest margin) is not defined, so this refuses it (as
    Megatron-LM does); choose batch_size * seq_len (* accumulation * ranks) accordingly.
    """
    if m < 1 or (m * k) % n:
        raise ValueError(f"quantile_balancing needs m*k divisible by n: m={m} tokens per optimizer step, "
                         f"k={k}, n={n} experts (m*k % n = {(m * k) % n if m >= 1 else 'no tokens'}); choose "
                         f"batch_size * seq_len * accumulation * ranks as a multiple of {n // _gcd(n, k)}")
    return m * k // n


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def routing_margins(scores: torch.Tensor, bias: torch.Tensor, k: int, cutoff: str = "k_plus_1") -> torch.Tensor:
    """Margins ``s_tj - a_tj`` over per-token cutoffs: scores ``[..., m, n]``, bias ``[..., 1, n]`` or ``[n]``
    -> ``[..., m, n]`` fp32 (the leading dims batch several routers: one kernel each for all of them).

    cutoff ``"k_plus_1"`` (the report's step): a_tj = a_t, the (k+1)-th largest of ``s_t + b``, the
    same for every expert. ``"excluding_self"``: a_tj = the k-th largest of ``s_t + b`` over the
    experts other than j (the (k+1)-th overall when j is in the top k, else the k-th), so that
    ``s_tj + b_j > a_tj`` is exactly "token t picks j" with every other bias held: the bias then
    becomes each expert's exact best response. The difference matters for an under-loaded expert
    that is the (k+1)-th choice of many tokens: with ``k_plus_1`` those tokens' margins all equal
    ``-b_j``, its (q+1)-th largest margin is ``-b_j`` again, and its bias only moves through the
    re-centring, so on correlated scores balancing slows down or stalls (tests/model/test_balance.py
    shows both on one batch).
    """
    top = torch.topk(scores.float() + bias.float(), k + 1, dim=-1)
    after = top.values[..., k:]
    if cutoff == "k_plus_1":
        return scores.float() - after
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices[..., :k], True)
    return scores.float() - torch.where(chosen, after, top.values[..., k - 1:k])


def qb_exact(margins: torch.Tensor, k: int) -> torch.Tensor:
    """Quantile-balancing bias from all margins of a step: ``[m, ..., n]`` -> ``[..., n]`` fp32, re-centred.

    b_j = -((q+1)-th largest margin of expert j), the (1 - k/n) quantile: with the cutoffs held,
    exactly q tokens of the step would pass expert j's threshold (ties aside). Middle dims batch
    several routers that saw the same m tokens.
    """
    m, n = margins.shape[0], margins.shape[-1]
    q = qb_target(m, k, n)
    return recentre(-margins.kthvalue(m - q, dim=0).values)


def histogram_range(bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[lo, hi] = [-1 - max(b), 1 - min(b)]``, which holds every margin for scores in (0, 1).

    a_t lies between min_j(s_tj + b_j) > min(b) and max_j(s_tj + b_j) < 1 + max(b). bias ``[..., n]``
    -> lo, hi ``[...]`` fp32 tensors (0-dim for one router; no host sync). Fixed by the bias, so the
    same on every rank in a step.
    """
    return -1.0 - bias.amax(-1), 1.0 - bias.amin(-1)


def _divide(x: torch.Tensor, bins: int) -> torch.Tensor:
    """``x / bins`` correctly rounded on every device. CUDA divides by a Python number as a multiply by
    its rounded reciprocal (one ulp off at times), which would move margins on a bin edge to the next
    bin and break the bitwise agreement with the fused kernel (tests/ops/test_balance_op.py)."""
    return x / torch.full((), float(bins), dtype=x.dtype, device=x.device)


def margin_histogram(margins: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """Per-expert histogram of margins ``[..., m, n]`` over ``bins`` equal bins of ``[lo, hi]`` (``[...]``
    each, from :func:`histogram_range`) -> ``[..., n, bins]`` int64.

    Integer counts: sums over micro-batches and ranks are exact and order-independent. The leading
    dims batch several routers into one scatter.
    """
    *batch, m, n = margins.shape
    lo, width = lo[..., None, None], _divide(hi - lo, bins)[..., None, None]
    # Values in [0, bins) truncate as they floor, and the clamp sends the rest to the end bins.
    idx = ((margins - lo) / width).clamp_(0, bins - 1).long()
    groups = math.prod(batch) * n  # one row of bins per (router, expert)
    idx += (torch.arange(groups, device=margins.device) * bins).view(*batch, 1, n)
    hist = torch.zeros(groups * bins, dtype=torch.long, device=margins.device)
    # 1-D scatter_add_ has a deterministic CUDA implementation; bincount would sync on max().
    hist.scatter_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.long, device=margins.device))
    return hist.view(*batch, n, bins)


def qb_histogram(hist: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, k: int,
                 m: int | torch.Tensor) -> torch.Tensor:
    """Quantile-balancing bias from margin histograms ``[..., n, bins]`` of m tokens -> ``[..., n]`` fp32, re-centred.

    The (q+1)-th largest margin is taken as the centre of the bin that holds it: at most half a
    bin width ``(hi - lo) / bins`` from :func:`qb_exact` before re-centring, one width after.
    lo, hi ``[...]`` from :func:`histogram_range`. m: an int (checked by :func:`qb_target`), or a
    0-dim tensor on the histogram's device, used there as is, so that this issues no host sync
    (the caller checks it: :func:`balance_step` does, one step late).
    """
    n, bins = hist.shape[-2:]
    q = qb_target(m, k, n) if isinstance(m, int) else m.double() * k / n
    at_or_above = hist.flip(-1).cumsum(-1).flip(-1)  # tokens in bin i or higher
    top_bin = (at_or_above > q).sum(-1) - 1  # highest bin with >= q + 1 tokens at or above it
    value = lo[..., None] + _divide((top_bin.float() + 0.5) * (hi - lo)[..., None], bins)
    return recentre(-value)


def smooth(old: torch.Tensor, new: torch.Tensor, ema: float) -> torch.Tensor:
    """``ema old + (1 - ema) new``, re-centred (the optional EMA of quantile balancing)."""
    return recentre(ema * old + (1.0 - ema) * new) if ema > 0 else new


# ----------------------------------------------------------------------------------------------
# Metrics.
# ----------------------------------------------------------------------------------------------

def max_vio(load: torch.Tensor) -> torch.Tensor:
    """MaxVio = (max_j load_j - mean load) / mean load of loads ``[..., n]`` -> ``[...]`` fp32 (0 = balanced)."""
    load = load.float()
    mean = load.mean(-1)
    return (load.amax(-1) - mean) / mean.clamp_min(TINY)


def load_cv(load: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation std / mean (population std) of loads ``[..., n]`` -> ``[...]`` fp32."""
    load = load.float()
    return load.std(-1, correction=0) / load.mean(-1).clamp_min(TINY)


def dead_experts(load: torch.Tensor) -> torch.Tensor:
    """Experts with zero load ``[..., n]`` -> ``[...]`` int64."""
    return (load == 0).sum(-1)


def token_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each token's scores normalized over experts: ``[m, n]`` -> ``[m]`` fp32 (max ln n)."""
    p = scores.float() / scores.float().sum(-1, keepdim=True).clamp_min(TINY)
    return -torch.xlogy(p, p).sum(-1)


# ----------------------------------------------------------------------------------------------
# Per-router statistics and the once-per-step update.
# ----------------------------------------------------------------------------------------------

class RouterBalance(nn.Module):
    """One router's balancer: its configuration, persistent state, and this step's statistics.

    Persistent (in ``state_dict``, so resume continues the same trajectory): ``load_avg`` ``[n]``
    fp32 for ``quantile_load`` (starts at 1, the uniform normalized load). The bias itself is the
    router's ``bias`` buffer. The accumulators are plain attributes, not buffers: DDP broadcasts
    buffers from rank 0 at every forward, which would overwrite the other ranks' statistics.
    A training loop must call :func:`balance_step` once per optimizer step (the Lightning
    callback does).

    A training forward only adds the loads and keeps the scores (:meth:`observe`): the
    entropies, margins and histograms are computed in :func:`balance_step`, for all routers of the
    model in one batch of kernels instead of a dozen small ones per router per forward (the model
    is host-bound at one-GPU scale, so every op a layer adds costs its launch). Only the last
    micro-batch's scores ``[m, n]`` fp32 are kept (autograd holds them for the sigmoid's backward
    anyway); under gradient accumulation the next forward folds them into the step's entropy sum,
    histogram or margins first, router by router, so memory does not grow with the micro-batches.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.balancer
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        if self.kind == "quantile_load":
            self.register_buffer("load_avg", torch.ones(cfg.num_experts), persistent=True)
        self.eval_load: torch.Tensor | None = None
        # Histogram quantile balancing: the last step's token count on its way to the host (see check_tokens).
        self.pending_tokens: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self.clear()

    @property
    def histogram(self) -> bool:
        return self.kind == "quantile_balancing" and self.cfg.quantile_balancing_mode == "histogram"

    def clear(self) -> None:
        """Forget this step's training statistics."""
        self.load: torch.Tensor | None = None  # [n] int64
        self.scores: torch.Tensor | None = None  # [m, n] fp32, the last training micro-batch (not detached)
        # The earlier micro-batches of the step, folded by observe: their number of tokens,
        self.folded_tokens = 0
        self.entropy_sum: torch.Tensor | None = None  # 0-dim fp64, sum over their tokens
        self.hist: torch.Tensor | None = None  # histogram quantile balancing: [n, bins] int64
        self.margins: list[torch.Tensor] = []  # exact quantile balancing: [m_i, n] per micro-batch

    def group_key(self) -> tuple:
        """Routers with the same key are updated as one batch: same rule, sizes and micro-batches."""
        return repr(self.cfg), self.scores.shape[0], self.folded_tokens, self.load.device

    def _apply(self, fn, recurse: bool = True):
        # Like Router.bias: a bf16 cast of the model must not round the moving average's small steps.
        super()._apply(fn, recurse)
        if self.kind == "quantile_load" and self.load_avg.dtype != torch.float32:
            self.load_avg = self.load_avg.float()
        return self

    @torch.compiler.disable
    def observe(self, stats: RouterStats, bias: torch.Tensor, training: bool) -> None:
        """Add one forward's routing to the statistics (training) or to ``eval_load`` (eval).

        No host sync; no kernel on the first micro-batch of a step, the load sum and a fold on the next.
        """
        counts = stats.tokens_per_expert
        if not training:
            self.eval_load = counts if self.eval_load is None else self.eval_load + counts
            return
        if self.load is not None:
            self._fold(bias)
        self.load = counts if self.load is None else self.load + counts
        self.scores = stats.scores  # read under no_grad only (balance_step, _fold): no detach needed

    @torch.no_grad()
    def _fold(self, bias: torch.Tensor) -> None:
        entropy, margins, hist, _ = _statistics(self, self.scores, bias.float())
        self.entropy_sum = entropy if self.entropy_sum is None else self.entropy_sum + entropy
        if hist is not None:
            self.hist = hist if self.hist is None else self.hist + hist
        if margins is not None:
            self.margins.append(margins)
        self.folded_tokens += self.scores.shape[0]
        self.scores = None

    def check_tokens(self, m: torch.Tensor) -> None:
        """Refuse (``qb_target``'s ValueError) a step whose global token count m (0-dim, exact integer
        value) makes m k / n fractional, without a host sync.

        On the CPU at once. On a GPU the count is copied to pinned host memory behind the step's
        kernels and read at the next step, long after it arrived: there the error comes one step
        late (``BalancerCallback`` refuses such a run before its first step anyway).
        """
        if not m.is_cuda:
            qb_target(int(m), self.top_k, self.num_experts)
            return
        if torch.cuda.is_current_stream_capturing():
            # A captured step (moelab.train.module.CapturedStep) replays one shape, whose count its eager
            # warm-up steps have checked; a host copy recorded into a graph would never be read again.
            return
        if self.pending_tokens is not None:
            host, arrived = self.pending_tokens
            arrived.synchronize()
            qb_target(int(host), self.top_k, self.num_experts)
        host = torch.empty((), dtype=m.dtype, pin_memory=True)
        host.copy_(m, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        self.pending_tokens = host, arrived


@dataclass
class BalanceStep:
    """What one :func:`balance_step` did, per MoE layer (in model order).

    layers: names (``"L3"`` for ``layers.3``); load: ``[L, n]`` int64 global loads of the step;
    bias: ``[L, n]`` fp32 biases after the update; metrics: ``maxvio_batch``, ``load_cv``,
    ``router_entropy`` ``[L]`` fp32 and ``dead_experts`` ``[L]`` int64, all on the model's device.
    """

    layers: list[str]
    load: torch.Tensor
    bias: torch.Tensor
    metrics: dict[str, torch.Tensor]


def balanced_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(layer name, router)`` for every router with a :class:`RouterBalance`, in model order."""
    found = []
    for name, module in model.named_modules():
        if isinstance(getattr(module, "balance", None), RouterBalance):
            layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
            found.append((f"L{layer.group(1)}" if layer else name, module))
    return found


def _statistics(b: RouterBalance, scores: torch.Tensor, bias: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """One micro-batch's statistics of routers with ``b``'s config: scores ``[..., m, n]``, bias ``[..., n]``
    -> (entropy sums ``[...]`` fp64; exact QB: margins ``[..., m, n]``; histogram QB: histograms
    ``[..., n, bins]`` int64 and their range (lo, hi ``[...]``))."""
    entropy = token_entropy(scores).double().sum(-1)
    if b.kind != "quantile_balancing":
        return entropy, None, None, None
    margins = routing_margins(scores, bias[..., None, :], b.top_k, b.cfg.quantile_balancing_cutoff)
    if not b.histogram:
        return entropy, margins, None, None
    lo, hi = histogram_range(bias)
    return entropy, None, margin_histogram(margins, lo, hi, b.cfg.quantile_balancing_bins), (lo, hi)


class _Group:
    """The local statistics of routers that share a :meth:`RouterBalance.group_key`, batched over them.

    The last micro-batch's statistics are computed here for all L routers at once, the folded
    earlier ones added. bias ``[L, n]``; ``parts`` go into the all-reduce (loads ``[L n]``, entropy
    sums ``[L]``, for histogram QB the histograms ``[L n bins]``); ``margins`` ``[m, L n]`` (exact QB,
    the micro-batches' rows in order) into the all-gather.

    ``fused``: on a GPU (``MoEConfig.backend`` 'auto', or 'triton' anywhere) a step whose one
    micro-batch nothing was folded into takes the two Triton kernels of ``moelab.ops.router_stats``
    (statistics, then metrics and the histogram QB update), a handful of launches for all layers
    instead of ~75 small ones; the loads and histograms are bitwise those of this module's torch
    functions, the bias equal within fp32 rounding. Steps with folded micro-batches (gradient
    accumulation) take the torch functions.
    """

    def __init__(self, routers: list[nn.Module]) -> None:
        self.routers = routers
        self.balance: RouterBalance = routers[0].balance
        b, folded = self.balance, self.balance.folded_tokens > 0
        self.bias = torch.stack([r.bias for r in routers])
        scores = torch.stack([r.balance.scores for r in routers])
        load = torch.stack([r.balance.load for r in routers])
        self.fused = not folded and use_triton(b.cfg.backend, scores)
        self.margins = None
        if self.fused:
            bins = b.cfg.quantile_balancing_bins if b.histogram else 0
            self.parts = [router_statistics(scores, load, self.bias if bins else None, b.top_k, bins,
                                            b.cfg.quantile_balancing_cutoff)]
            if b.kind == "quantile_balancing" and not b.histogram:
                margins = routing_margins(scores, self.bias[..., None, :], b.top_k, b.cfg.quantile_balancing_cutoff)
                self.margins = margins.transpose(0, 1).reshape(margins.shape[1], -1)
            return
        entropy, margins, hist, self.range = _statistics(b, scores, self.bias)
        if folded:
            entropy = torch.stack([r.balance.entropy_sum for r in routers]) + entropy
        self.parts = [load.double().reshape(-1), entropy]
        if hist is not None:
            if folded:
                hist = torch.stack([r.balance.hist for r in routers]) + hist
            self.parts.append(hist.double().reshape(-1))
        if margins is not None:
            earlier = [torch.cat([r.balance.margins[i] for r in routers], dim=1) for i in range(len(b.margins))]
            self.margins = torch.cat([*earlier, margins.transpose(0, 1).reshape(margins.shape[1], -1)])

    def update(self, summed: torch.Tensor,
               margins: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Write the routers' new biases from this group's slice of the all-reduce (``summed``, its
        ``parts`` concatenated) and, for exact QB, of the all-gather (``margins`` ``[m, L n]``).
        Returns (load ``[L, n]`` int64, the :class:`BalanceStep` metrics ``[L]``)."""
        b, c = self.balance, self.balance.cfg
        L, n = self.bias.shape
        new = None
        if self.fused:
            bins = c.quantile_balancing_bins if b.histogram else 0
            load, metrics, new, tokens = finish_step(summed, self.bias, b.top_k, bins, c.quantile_balancing_ema)
            if b.histogram:
                b.check_tokens(tokens[0])
        else:
            load = summed[:L * n].round().long().view(L, n)
            metrics = step_metrics(load, summed[L * n:L * n + L], b.top_k)
            if b.histogram:
                # Every layer routes the same tokens: m k = the load of any layer, read on the device.
                m = summed[:n].sum() / b.top_k
                b.check_tokens(m)
                hist = summed[L * n + L:].view(L, n, -1)  # integer counts, exact in fp64
                new = smooth(self.bias, qb_histogram(hist, *self.range, b.top_k, m), c.quantile_balancing_ema)
        if b.kind == "loss_free_sign":
            new = loss_free_sign_update(self.bias, load, c.loss_free_sign_rate)
        elif b.kind == "quantile_load":
            buffers = [r.balance.load_avg for r in self.routers]
            average = load_average(torch.stack(buffers), load, c.quantile_load_decay)
            torch._foreach_copy_(buffers, list(average.unbind(0)))
            new = quantile_load_update(self.bias, average, c.quantile_load_rate, c.quantile_load_q)
        elif b.kind == "quantile_balancing" and not b.histogram:
            new = smooth(self.bias, qb_exact(margins.view(margins.shape[0], L, n), b.top_k), c.quantile_balancing_ema)
        if new is not None:
            torch._foreach_copy_([r.bias for r in self.routers], list(new.unbind(0)))
            self.bias = new
        for r in self.routers:
            r.balance.clear()
        return load, metrics


def step_metrics(load: torch.Tensor, entropy: torch.Tensor, top_k: int) -> dict[str, torch.Tensor]:
    """The :class:`BalanceStep` metrics of loads ``[L, n]`` (m top_k tokens per layer) and entropy sums ``[L]``."""
    return {"maxvio_batch": max_vio(load), "load_cv": load_cv(load), "dead_experts": dead_experts(load),
            "router_entropy": (entropy / (load.sum(-1).double() / top_k).clamp_min(1)).float()}


@torch.no_grad()
def balance_step(model: nn.Module, all_reduce: Collective = _identity,
                 all_gather: Collective = _identity) -> BalanceStep | None:
    """Once per optimizer step: reduce every router's statistics, update its bias, clear the accumulators.

    all_reduce(t) must return the sum of ``t`` over data-parallel ranks (in place is fine);
    all_gather(t ``[m_rank, c]``) the ranks' tensors concatenated along dim 0. Defaults: one process.
    Loads, entropies and histograms travel in ONE all-reduce (fp64 holds integer counts exactly up
    to 2^53, so the sums do not depend on order); exact quantile balancing adds one all-gather of
    every layer's margins side by side (all layers see the same tokens). The routers are batched
    (one set of kernels for all layers with the same config; on a GPU the fused kernels of
    ``moelab.ops.router_stats``: 6 launches for ``none``, 9 for histogram QB) and nothing here waits for the device
    (histogram QB checks its token count one step late on a GPU: :meth:`RouterBalance.check_tokens`).
    Returns None when no training forward ran since the last step.
    """
    found = balanced_routers(model)
    if not found or any(r.balance.load is None for _, r in found):
        return None
    members: dict[tuple, list[int]] = {}
    for i, (_, r) in enumerate(found):
        members.setdefault(r.balance.group_key(), []).append(i)
    groups = [_Group([found[i][1] for i in idx]) for idx in members.values()]
    parts = [p for g in groups for p in g.parts]
    summed = all_reduce(parts[0] if len(parts) == 1 else torch.cat(parts))
    exact = [g for g in groups if g.margins is not None]
    gathered = all_gather(torch.cat([g.margins for g in exact], dim=1)) if exact else None

    loads, metrics, biases = [], [], []
    offset, column = 0, 0
    for g in groups:
        size = sum(p.numel() for p in g.parts)
        mine = None
        if g.margins is not None:
            width = g.margins.shape[1]
            mine, column = gathered[:, column:column + width], column + width
        load, values = g.update(summed[offset:offset + size], mine)
        offset += size
        loads.append(load)
        metrics.append(values)
        biases.append(g.bias)
    order = [i for idx in members.values() for i in idx]
    load, bias = (_in_model_order(parts, order) for parts in (loads, biases))
    named = {key: _in_model_order([values[key] for values in metrics], order) for key in metrics[0]}
    return BalanceStep([name for name, _ in found], load, bias, named)


def _in_model_order(parts: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    """The groups' per-router rows ``[L_g, ...]`` as one ``[L, ...]`` in model order; ``order[j]`` is
    the model position of row j of the groups' concatenation (one group: already in order)."""
    if len(parts) == 1:
        return parts[0]
    rows = [row for p in parts for row in p.unbind(0)]
    return torch.stack([rows[j] for j in sorted(range(len(order)), key=order.__getitem__)])


def clear_eval_loads(model: nn.Module) -> None:
    """Start a new evaluation: forget the loads summed by earlier eval-mode forwards."""
    for _, r in balanced_routers(model):
        r.balance.eval_load = None


@torch.no_grad()
def eval_loads(model: nn.Module, all_reduce: Collective = _identity) -> tuple[list[str], torch.Tensor] | None:
    """Per-layer loads summed over every eval-mode forward since :func:`clear_eval_loads`, and over ranks.

    Returns ``(layer names, [L, n] int64)`` (MaxVio_global = ``max_vio`` of it), or None when no
    eval forward ran. One all-reduce.
    """
    routers = balanced_routers(model)
    if not routers or any(r.balance.eval_load is None for _, r in routers):
        return None
    load = all_reduce(torch.stack([r.balance.eval_load for _, r in routers]).double()).round().long()
    return [name for name, _ in routers], load


def router_loss_fn(cfg: MoEConfig) -> Callable[[RouterStats], torch.Tensor] | None:
    """The router's loss term from the config (``Router.aux_loss_fn``): the aux loss when
    ``balancer='aux_loss'``, plus the z-loss when ``router_z_loss > 0``; None when neither."""
    alpha = cfg.aux_loss_alpha if cfg.balancer == "aux_loss" else 0.0
    z = cfg.router_z_loss
    if alpha == 0 and z == 0:
        return None

    def loss(stats: RouterStats) -> torch.Tensor:
        total = stats.scores.new_zeros(())
        if alpha:
            total = total + aux_loss(stats.scores, stats.tokens_per_expert, cfg.top_k, alpha)
        if z:
            total = total + z_loss(stats.logits, z)
        return total

    return loss
