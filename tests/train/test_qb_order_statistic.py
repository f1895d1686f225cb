"""Histogram quantile balancing's order statistic against one taken independently with numpy.

Rule stated here: bins are ``bins`` equal intervals of ``[lo, hi]`` (``histogram_range``), a margin v
falls in bin ``floor((v - lo) / width)`` clamped to ``[0, bins - 1]``, and the bias is minus the
centre of the bin holding each expert's (q+1)-th largest margin (q = m k / n), re-centred to mean 0.
The margins are drawn strictly inside bins (0.2..0.8 of a width from an edge) so that float rounding
cannot move one across an edge: the expected bias is then exact up to fp32 arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelab.model.balance import histogram_range, margin_histogram, qb_exact, qb_histogram


def _margins(m: int, n: int, bins: int, bias: torch.Tensor, seed: int) -> tuple[torch.Tensor, float, float]:
    """[m, n] margins inside bins of [lo, hi], with several margins per bin (ties in a bin)."""
    lo, hi = (float(t) for t in histogram_range(bias))
    width = (hi - lo) / bins
    rng = np.random.default_rng(seed)
    # Few distinct bins per expert so that the (q+1)-th largest shares its bin with others.
    which = rng.integers(bins // 4, bins // 4 + 5, size=(m, n))
    frac = rng.uniform(0.2, 0.8, size=(m, n))
    return torch.tensor(lo + (which + frac) * width, dtype=torch.float32), lo, hi


def _expected(margins: np.ndarray, lo: float, hi: float, bins: int, k: int) -> np.ndarray:
    m, n = margins.shape
    q = m * k // n
    kth = -np.sort(-margins, axis=0)[q]  # (q+1)-th largest per expert
    assert np.array_equal(kth, -np.partition(-margins, q, axis=0)[q])  # two order statistics agree
    width = (hi - lo) / bins
    b = np.clip(np.floor((kth - lo) / width), 0, bins - 1)
    bias = -(lo + (b + 0.5) * width)
    return bias - bias.mean()


@pytest.mark.parametrize(("m", "n", "k", "bins", "seed"), [(64, 8, 2, 32, 0), (96, 6, 1, 64, 1), (40, 4, 3, 16, 2)])
def test_histogram_bias_is_minus_the_centre_of_the_order_statistic_bin(m, n, k, bins, seed) -> None:
    bias = torch.linspace(-0.2, 0.3, n)
    margins, lo, hi = _margins(m, n, bins, bias, seed)
    lo_t, hi_t = histogram_range(bias)
    hist = margin_histogram(margins, lo_t, hi_t, bins)
    assert hist.sum(-1).tolist() == [m] * n
    want = _expected(margins.numpy().astype(np.float64), lo, hi, bins, k)
    got = qb_histogram(hist, lo_t, hi_t, k, m)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-5)
    # The 0-dim tensor form of m (no host sync) gives the same bias.
    np.testing.assert_allclose(qb_histogram(hist, lo_t, hi_t, k, torch.tensor(m)).numpy(), want, rtol=0, atol=1e-5)
    # And the exact order statistic is within one bin width of it after re-centring.
    assert (qb_exact(margins, k) - got).abs().max().item() <= (hi - lo) / bins + 1e-5


def test_order_statistic_is_the_q_plus_first_not_the_qth() -> None:
    # One expert column, n = 2, k = 1, m = 4: q = 2, so the 3rd largest margin decides.
    bins, bias = 8, torch.zeros(2)
    lo, hi = (float(t) for t in histogram_range(bias))  # [-1, 1]: width 0.25
    col = [0.9, 0.6, 0.1, -0.4]  # bins 7, 6, 4, 2; the 3rd largest (0.1) sits in bin 4 (centre 0.125)
    # The second column's 3rd largest (-0.6) sits in bin 1 (centre -0.625); the 2nd largest would give
    # bins 6 / 6 (equal biases) and the 4th bins 2 / 0.
    margins = torch.tensor([col, [0.9, 0.6, -0.6, -0.9]]).T.contiguous()
    got = qb_histogram(margin_histogram(margins, *histogram_range(bias), bins), *histogram_range(bias), 1, 4)
    raw = torch.tensor([-0.125, 0.625])
    torch.testing.assert_close(got, raw - raw.mean(), rtol=0, atol=1e-6)
    assert lo == -1.0 and hi == 1.0
