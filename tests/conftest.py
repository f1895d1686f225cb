"""Test setup: Triton kernels run in the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, so it is set here, at
collection time, before moelab's kernel modules are imported.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU machines)")
    config.addinivalue_line("markers", "slow: takes more than ~30 s on 2 CPU cores")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
