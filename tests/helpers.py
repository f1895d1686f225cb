"""One comparison helper for every output/gradient check in the suite."""

from __future__ import annotations

import torch


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(ref - out) / RMS(ref), computed in fp64; 0 when both are zero."""
    ref, out = ref.double(), out.double()
    denom = ref.pow(2).mean().sqrt().item()
    num = (ref - out).pow(2).mean().sqrt().item()
    return num / denom if denom > 0 else num


def assert_close(ref: torch.Tensor, out: torch.Tensor, tol: float, name: str = "tensor") -> None:
    """Fail with the measured error when rel_err(ref, out) > tol (or when out is not finite)."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = rel_err(ref, out)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
