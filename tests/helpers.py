"""One comparison helper for every output/gradient check in the suite, and the allocation poisoning of the
kernel tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
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


@contextlib.contextmanager
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch, shapes: list | None = None) -> Iterator[None]:
    """Inside the block every uninitialised float tensor (``torch.empty``, ``empty_like``, ``Tensor.new_empty``)
    starts full of NaN, so a kernel that reads or accumulates into memory it did not write turns its result NaN
    instead of silently depending on what the allocator's previous user left. ``shapes`` collects the shapes of
    the allocations it reached."""

    def poisoned(make):
        def alloc(*args, **kw):
            x = make(*args, **kw)
            if shapes is not None:
                shapes.append(x.shape)
            return x.fill_(float("nan")) if x.is_floating_point() else x
        return alloc

    with monkeypatch.context() as m:
        for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
            m.setattr(owner, name, poisoned(getattr(owner, name)))
        yield
