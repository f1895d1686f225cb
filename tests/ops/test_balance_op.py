"""The balancer's fused Triton statistics and update (moelab.ops.router_stats) against the torch reference
in moelab.model.balance: loads, histograms and quantile bins bitwise, entropy, metrics and bias
within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from moelab.model.balance import (
    dead_experts,
    histogram_range,
    load_cv,
    margin_histogram,
    max_vio,
    qb_histogram,
    routing_margins,
    smooth,
    token_entropy,
)
from moelab.ops.backend import HAS_TRITON
from moelab.ops.router_stats import finish_step, parts_size, router_statistics
from tests.helpers import assert_close

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
# On a GPU machine the kernels run on CUDA tensors; on CPU, in the Triton interpreter (tests/conftest.py).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(L: int, m: int, n: int, k: int, seed: int, device: str = DEV) -> tuple[torch.Tensor, ...]:
    """Skewed sigmoid scores ``[L, m, n]`` with a few exact ties, biases ``[L, n]`` and their top-k loads."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(L, m, n, generator=g) * 2 + torch.linspace(2, -2, n))
    scores[:, :3, :4] = 0.5  # equal scores: the cutoffs must not depend on which tied expert is taken
    bias = torch.randn(L, n, generator=g) * 0.1
    bias[:, :4] = 0.0
    idx = torch.topk(scores + bias[:, None], k, dim=-1).indices
    load = torch.zeros(L, n, dtype=torch.long).scatter_add_(1, idx.reshape(L, -1), torch.ones(L, m * k).long())
    return scores.to(device), bias.to(device), load.to(device)


def _reference(scores: torch.Tensor, bias: torch.Tensor, load: torch.Tensor, k: int, bins: int,
               cutoff: str) -> torch.Tensor:
    parts = [load.double().reshape(-1), token_entropy(scores).double().sum(-1)]
    if bins:
        lo, hi = histogram_range(bias)
        margins = routing_margins(scores, bias[:, None], k, cutoff)
        parts.append(margin_histogram(margins, lo, hi, bins).double().reshape(-1))
    return torch.cat(parts)


@pytest.mark.parametrize("cutoff", ["k_plus_1", "excluding_self"])
@pytest.mark.parametrize("L,m,n,k,bins", [(3, 40, 8, 2, 64), (2, 33, 12, 3, 50), (1, 16, 64, 8, 1000)])
def test_statistics_match_the_reference(L: int, m: int, n: int, k: int, bins: int, cutoff: str) -> None:
    scores, bias, load = _case(L, m, n, k, seed=L + m)
    ref = _reference(scores, bias, load, k, bins, cutoff)
    got = router_statistics(scores, load, bias, k, bins, cutoff)
    assert got.shape == (parts_size(L, n, bins),)
    assert torch.equal(got[:L * n], ref[:L * n]), "loads"
    assert torch.equal(got[L * n + L:], ref[L * n + L:]), "histograms must agree bitwise"
    assert got[L * n + L:].sum() == L * m * n  # every token's margin to every expert in one bin
    # fp32 entropy per token in another summation order: a few ulp of each token's ln n.
    assert_close(ref[L * n:L * n + L], got[L * n:L * n + L], 1e-6, "entropy")


def test_statistics_without_histograms() -> None:
    scores, bias, load = _case(4, 24, 8, 2, seed=1)
    ref = _reference(scores, bias, load, 2, 0, "k_plus_1")
    got = router_statistics(scores, load, None, 2)
    assert torch.equal(got[:32], ref[:32])
    assert_close(ref[32:], got[32:], 1e-6, "entropy")


@pytest.mark.parametrize("ema", [0.0, 0.5])
@pytest.mark.parametrize("L,m,n,k,bins", [(3, 40, 8, 2, 64), (2, 64, 64, 8, 1000)])
def test_finish_matches_the_reference(L: int, m: int, n: int, k: int, bins: int, ema: float) -> None:
    scores, bias, load = _case(L, m, n, k, seed=m)
    summed = _reference(scores, bias, load, k, bins, "k_plus_1") * 3  # as if summed over 3 ranks
    got_load, metrics, new, tokens = finish_step(summed, bias, k, bins, ema)
    want_load = summed[:L * n].round().long().view(L, n)
    assert torch.equal(got_load, want_load)
    assert tokens.tolist() == [3.0 * m] * L
    lo, hi = histogram_range(bias)
    hist = summed[L * n + L:].view(L, n, bins)
    want = smooth(bias, qb_histogram(hist, lo, hi, k, torch.tensor(3.0 * m, device=DEV)), ema)
    # Same quantile bin (bitwise), then a re-centring mean (and the EMA) in another order: a few ulp.
    assert (new - want).abs().max() <= 8 * torch.finfo(torch.float32).eps * (1 + want.abs().max()), (new - want)
    assert abs(float(new.sum(-1).abs().max())) < 1e-5
    assert_close(max_vio(want_load), metrics["maxvio_batch"], 1e-6, "maxvio")
    assert_close(load_cv(want_load), metrics["load_cv"], 1e-6, "cv")
    assert torch.equal(dead_experts(want_load), metrics["dead_experts"])
    entropy = summed[L * n:L * n + L] / (want_load.sum(-1).double() / k).clamp_min(1)
    assert_close(entropy.float(), metrics["router_entropy"], 1e-7, "entropy")


def test_finish_counts_dead_experts_and_no_histograms() -> None:
    load = torch.tensor([[4, 4, 0, 0], [2, 2, 2, 2]], dtype=torch.float64, device=DEV)
    summed = torch.cat([load.reshape(-1), torch.tensor([1.0, 2.0], dtype=torch.float64, device=DEV)])
    got_load, metrics, new, tokens = finish_step(summed, torch.zeros(2, 4, device=DEV), top_k=2)
    assert new is None and got_load.tolist() == load.long().tolist() and tokens.tolist() == [4.0, 4.0]
    assert metrics["dead_experts"].tolist() == [2, 0]
    assert_close(torch.tensor([1.0, 0.0]), metrics["maxvio_batch"].cpu(), 1e-7, "maxvio")
    assert_close(torch.tensor([1.0, 0.0]), metrics["load_cv"].cpu(), 1e-7, "cv")
    assert_close(torch.tensor([0.25, 0.5]), metrics["router_entropy"].cpu(), 1e-7, "entropy")


def test_bad_arguments_name_the_value() -> None:
    scores, bias, load = _case(1, 8, 4, 2, seed=0)
    with pytest.raises(ValueError, match="bins=-1 is not allowed"):
        router_statistics(scores, load, bias, 2, bins=-1)
    with pytest.raises(ValueError, match="bins=8 is not allowed: expected 0, or > 0 with a bias"):
        router_statistics(scores, load, None, 2, bins=8)
    with pytest.raises(ValueError, match="top_k=4 is not allowed: expected 1..3"):
        router_statistics(scores, load, bias, 4, bins=8)
    with pytest.raises(ValueError, match="cutoff='median' is not allowed"):
        router_statistics(scores, load, bias, 2, bins=8, cutoff="median")
    with pytest.raises(ValueError, match="ema=1.0 is not allowed"):
        finish_step(torch.zeros(parts_size(1, 4, 8), dtype=torch.float64), bias, 2, 8, ema=1.0)
    with pytest.raises(ValueError, match="expected 37"):
        finish_step(torch.zeros(5, dtype=torch.float64), bias, 2, 8)


@pytest.mark.gpu
def test_statistics_and_update_on_the_gpu() -> None:
    scores, bias, load = _case(12, 4096, 64, 8, seed=3, device="cuda")
    ref = _reference(scores, bias, load, 8, 1000, "k_plus_1")
    got = router_statistics(scores, load, bias, 8, 1000)
    assert torch.equal(got[:12 * 64], ref[:12 * 64]) and torch.equal(got[12 * 65:], ref[12 * 65:])
    assert_close(ref[12 * 64:12 * 65], got[12 * 64:12 * 65], 1e-5, "entropy")
    _, _, new, _ = finish_step(got, bias, 8, 1000, 0.0)
    lo, hi = histogram_range(bias)
    want = qb_histogram(ref[12 * 65:].view(12, 64, 1000), lo, hi, 8, torch.tensor(4096.0, device="cuda"))
    assert (new - want).abs().max() <= 8 * torch.finfo(torch.float32).eps * (1 + want.abs().max())
