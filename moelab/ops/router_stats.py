"""The balancer's once-per-step statistics and histogram quantile-balancing update as two Triton kernels.

At one-GPU scale the model is host-bound, so every kernel launch of ``moelab.model.balance.balance_step``
costs its launch in wall time; its plain torch composition takes ~75 launches per step for
histogram quantile balancing over 12 MoE layers. These kernels do the same work for all layers
of a step at once:

* :func:`router_statistics` (one launch + one reduction): per layer the loads (as fp64), the sum
  of the tokens' router entropies, and for histogram quantile balancing the per-expert histogram
  of the routing margins, written straight into the fp64 vector that the data-parallel all-reduce
  sums (layout ``[L n loads | L entropy sums | L n bins counts]``).
* :func:`finish_step` (one launch): from that all-reduced vector, per layer the integer loads, the
  metrics (MaxVio_batch, load CV, dead experts, normalized router entropy) and for histogram
  quantile balancing the new, re-centred (optionally EMA-smoothed) bias.

The torch reference is ``moelab.model.balance`` (``token_entropy``, ``routing_margins``,
``histogram_range``, ``margin_histogram``, ``qb_histogram``, ``smooth``, the metrics), which the
CPU runs and the tests compare against. What agrees bitwise: the loads, the histograms (the
margins are the same fp32 operations on the same values, the division is IEEE-rounded, and the
fp64 counts are exact integers, so atomics in any order sum to the same), the quantile bin. What
differs by fp32 rounding: the entropy (another summation order within a token, the device log),
the metrics, and the bias through its re-centring mean and the EMA's fused multiply-add (a few
ulp of the bias's magnitude; tests/ops/test_balance_op.py bounds it).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from moelab.ops.backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

TINY = torch.finfo(torch.float32).tiny
# k_plus_1: the per-token cutoff is the (k+1)-th largest score; excluding_self: each expert's exact best response
Cutoff = Literal["k_plus_1", "excluding_self"]
CUTOFFS: tuple[Cutoff, ...] = get_args(Cutoff)


def parts_size(layers: int, n: int, bins: int) -> int:
    """Length of the all-reduced vector of ``layers`` routers with n experts (bins = 0: no histograms)."""
    return layers * n + layers + layers * n * bins


def router_statistics(scores: torch.Tensor, load: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                      bins: int = 0, cutoff: str = "k_plus_1") -> torch.Tensor:
    """One micro-batch's statistics of L routers that saw the same m tokens, as one fp64 vector.

    scores ``[L, m, n]`` fp32 sigmoid scores; load ``[L, n]`` int64 tokens per expert; bias ``[L, n]``
    fp32 (needed when bins > 0). Returns ``[L n + L + L n bins]`` fp64: the loads, per layer the sum
    over tokens of ``token_entropy``, and (bins > 0) per layer and expert the histogram of the
    margins ``routing_margins(scores, bias, top_k, cutoff)`` over ``bins`` bins of
    ``histogram_range(bias)`` (values outside go to the end bins).
    """
    L, m, n = scores.shape
    if bins < 0 or (bins and bias is None):
        raise ValueError(f"router_statistics: bins={bins} is not allowed: expected 0, or > 0 with a bias")
    if bins and not 1 <= top_k < n:
        raise ValueError(f"router_statistics: top_k={top_k} is not allowed: expected 1..{n - 1} (n - 1 experts)")
    if cutoff not in CUTOFFS:
        raise ValueError(f"router_statistics: cutoff={cutoff!r} is not allowed: expected one of {CUTOFFS}")
    scores, load = scores.float().contiguous(), load.contiguous()
    bias = bias.float().contiguous() if bins else scores  # without histograms the kernel reads no bias
    # Histograms are accumulated by atomic adds, so their part starts at zero; the rest is written.
    out = (torch.zeros if bins else torch.empty)(parts_size(L, n, bins), dtype=torch.float64, device=scores.device)
    np_ = triton.next_power_of_2(n)
    block_t = max(1, min(64, 2048 // np_))  # k + 1 rounds of row maxima: latency-bound, many small programs
    programs = max(1, triton.cdiv(m, block_t))
    partial = torch.empty(L, programs, dtype=torch.float64, device=scores.device)
    _stats_kernel[(programs, L)](scores, bias, load, out, partial, m, n, max(bins, 1), programs,
                                 K=top_k, NP=np_, BLOCK_T=block_t, HIST=bins > 0,
                                 EXCLUDING_SELF=cutoff == "excluding_self")
    torch.sum(partial, dim=1, out=out[L * n:L * n + L])
    return out


def finish_step(summed: torch.Tensor, bias: torch.Tensor, top_k: int, bins: int = 0,
                ema: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor]:
    """Loads, metrics and (bins > 0) the histogram quantile-balancing bias from the all-reduced statistics.

    summed ``[L n + L + L n bins]`` fp64 (:func:`router_statistics` summed over micro-batches and
    ranks); bias ``[L, n]`` fp32, the biases the histograms were taken with. Returns (load ``[L, n]``
    int64; metrics ``maxvio_batch``, ``load_cv``, ``router_entropy`` ``[L]`` fp32 and
    ``dead_experts`` ``[L]`` int64; new bias ``[L, n]`` fp32 or None without histograms; tokens
    ``[L]`` fp64, each layer's load sum / top_k, the step's token count that histogram quantile
    balancing needs m k / n integral for).
    """
    L, n = bias.shape
    if summed.numel() != parts_size(L, n, bins):
        raise ValueError(f"finish_step: {summed.numel()} statistics for L={L}, n={n}, bins={bins}: "
                         f"expected {parts_size(L, n, bins)}")
    if not 0.0 <= ema < 1.0:
        raise ValueError(f"finish_step: ema={ema} is not allowed: expected 0 <= ema < 1")
    dev = bias.device
    load = torch.empty(L, n, dtype=torch.long, device=dev)
    metrics = torch.empty(3, L, dtype=torch.float32, device=dev)
    dead = torch.empty(L, dtype=torch.long, device=dev)
    tokens = torch.empty(L, dtype=torch.float64, device=dev)
    new = torch.empty(L, n, dtype=torch.float32, device=dev) if bins else None
    np_ = triton.next_power_of_2(n)
    block_b = max(16, min(triton.next_power_of_2(max(bins, 1)), 8192 // np_))
    _finish_kernel[(L,)](summed.contiguous(), bias.float().contiguous(), load, metrics, dead, tokens,
                         load if new is None else new, n, max(bins, 1), float(ema), K=top_k, NP=np_,
                         BLOCK_B=block_b, HIST=bins > 0, num_warps=8)  # an n x BLOCK_B fp64 tile per chunk
    named = {"maxvio_batch": metrics[0], "load_cv": metrics[1], "dead_experts": dead, "router_entropy": metrics[2]}
    return load, named, new, tokens


if HAS_TRITON:

    @triton.jit
    def _stats_kernel(s_ptr, b_ptr, load_ptr, out_ptr, part_ptr, M, N, BINS, P, K: tl.constexpr, NP: tl.constexpr,
                      BLOCK_T: tl.constexpr, HIST: tl.constexpr, EXCLUDING_SELF: tl.constexpr):
        # Program (i, l): tokens [i BLOCK_T, (i + 1) BLOCK_T) of layer l, all experts in registers.
        pid = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, NP)
        rmask = rows < M
        cmask = cols < N
        valid = rmask[:, None] & cmask[None, :]
        s = tl.load(s_ptr + (layer * M + rows[:, None]) * N + cols[None, :], mask=valid, other=0.0)

        # Entropy of each token's normalized scores (p log p = 0 at p = 0, padding included), summed in fp64.
        total = tl.maximum(tl.sum(s, axis=1), 1.1754943508222875e-38)
        p = s / total[:, None]
        h = -tl.sum(p * tl.log(tl.where(p > 0, p, 1.0)), axis=1)
        tl.store(part_ptr + layer * P + pid, tl.sum(tl.where(rmask, h, 0.0).to(tl.float64), axis=0))
        if pid == 0:
            ld = tl.load(load_ptr + layer * N + cols, mask=cmask, other=0)
            tl.store(out_ptr + layer * N + cols, ld.to(tl.float64), mask=cmask)

        if HIST:
            b = tl.load(b_ptr + layer * N + cols, mask=cmask, other=0.0)
            lo = -1.0 - tl.max(tl.where(cmask, b, float("-inf")), axis=0)
            hi = 1.0 - tl.min(tl.where(cmask, b, float("inf")), axis=0)
            width = tl.math.div_rn(hi - lo, BINS.to(tl.float32))
            # The k-th and (k+1)-th largest of s + b: k + 1 rounds of (max, remove one at the lowest index).
            v = tl.where(valid, s + b[None, :], float("-inf"))
            free = valid
            kth = tl.zeros([BLOCK_T], dtype=tl.float32)
            after = tl.zeros([BLOCK_T], dtype=tl.float32)
            for j in tl.static_range(K + 1):
                cand = tl.where(free, v, float("-inf"))
                best = tl.max(cand, axis=1)
                pick = tl.min(tl.where(free & (cand == best[:, None]), cols[None, :], NP), axis=1)
                free = free & (cols[None, :] != pick[:, None])
                if j == K - 1:
                    kth = best
                after = best
            if EXCLUDING_SELF:
                # j is among the top k iff s + b >= the k-th value, whenever that is above the (k+1)-th;
                # when the two are equal both cutoffs are the same number, so the tie does not matter.
                cut = tl.where(v >= kth[:, None], after[:, None], kth[:, None])
            else:
                cut = after[:, None]
            margin = s - cut
            idx = tl.math.div_rn(margin - lo, width)
            idx = tl.minimum(tl.maximum(idx, 0.0), (BINS - 1).to(tl.float32)).to(tl.int64)
            hist = out_ptr + tl.num_programs(1).to(tl.int64) * (N + 1)  # after the L n loads and L entropies
            dst = hist + (layer * N + cols[None, :]) * BINS + idx
            tl.atomic_add(dst, tl.full([BLOCK_T, NP], 1.0, tl.float64), mask=valid, sem="relaxed")  # counts: any order

    @triton.jit
    def _finish_kernel(sum_ptr, b_ptr, load_ptr, metric_ptr, dead_ptr, tok_ptr, new_ptr, N, BINS, EMA,
                       K: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr, HIST: tl.constexpr):
        # Program l: layer l's n loads, its metrics and (HIST) its n biases from the n x BINS histograms.
        layer = tl.program_id(0).to(tl.int64)
        L = tl.num_programs(0).to(tl.int64)
        cols = tl.arange(0, NP)
        cmask = cols < N
        ld = tl.load(sum_ptr + layer * N + cols, mask=cmask, other=0.0)  # exact integers
        tl.store(load_ptr + layer * N + cols, ld.to(tl.int64), mask=cmask)
        lf = ld.to(tl.float32)
        mean = tl.sum(lf, axis=0) / N
        safe = tl.maximum(mean, 1.1754943508222875e-38)
        dev = tl.where(cmask, lf - mean, 0.0)
        tl.store(metric_ptr + layer, (tl.max(tl.where(cmask, lf, float("-inf")), axis=0) - mean) / safe)
        tl.store(metric_ptr + L + layer, tl.sqrt(tl.sum(dev * dev, axis=0) / N) / safe)
        tl.store(dead_ptr + layer, tl.sum((cmask & (ld == 0)).to(tl.int64), axis=0))
        tokens = tl.sum(ld, axis=0) / K
        tl.store(tok_ptr + layer, tokens)
        entropy = tl.load(sum_ptr + L * N + layer)
        tl.store(metric_ptr + 2 * L + layer, (entropy / tl.maximum(tokens, 1.0)).to(tl.float32))

        if HIST:
            b = tl.load(b_ptr + layer * N + cols, mask=cmask, other=0.0)
            lo = -1.0 - tl.max(tl.where(cmask, b, float("-inf")), axis=0)
            hi = 1.0 - tl.min(tl.where(cmask, b, float("inf")), axis=0)
            q = tokens * K / N
            hist = sum_ptr + L * (N + 1) + (layer * N + cols[:, None]) * BINS
            bins = tl.arange(0, BLOCK_B)
            total = tl.zeros([NP], dtype=tl.float64)
            for start in range(0, BINS, BLOCK_B):
                mask = cmask[:, None] & (start + bins[None, :] < BINS)
                total += tl.sum(tl.load(hist + start + bins[None, :], mask=mask, other=0.0), axis=1)
            # Bins with more than q tokens at or above them: the top one holds the (q+1)-th largest margin.
            count = tl.zeros([NP], dtype=tl.int32)
            below = tl.zeros([NP], dtype=tl.float64)  # tokens in the bins before this chunk
            for start in range(0, BINS, BLOCK_B):
                mask = cmask[:, None] & (start + bins[None, :] < BINS)
                c = tl.load(hist + start + bins[None, :], mask=mask, other=0.0)
                running = below[:, None] + tl.cumsum(c, axis=1)  # tokens up to and including each bin
                at_or_above = total[:, None] - (running - c)
                count += tl.sum((mask & (at_or_above > q)).to(tl.int32), axis=1)
                # The counts are >= 0, so the running sum's largest entry is its last (exact: integers in
                # fp64). Not ``below += tl.sum(c, 1)``: a summed loop-carry that nothing reads after the
                # loop crashes Triton's TritonGPUOptimizeThreadLocality pass on the GPU (triton 3.6).
                below = tl.max(running, axis=1)
            top = (count - 1).to(tl.float32)
            value = lo + tl.math.div_rn((top + 0.5) * (hi - lo), BINS.to(tl.float32))
            new = tl.where(cmask, -value, 0.0)
            new = tl.where(cmask, new - tl.sum(new, axis=0) / N, 0.0)
            if EMA > 0:
                new = tl.where(cmask, EMA * b + (1.0 - EMA) * new, 0.0)
                new = new - tl.sum(new, axis=0) / N
            tl.store(new_ptr + layer * N + cols, new, mask=cmask)
