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
    config.addinivalue_line("markers", "slow: takes more than ~5 s on 2 CPU cores (make test-fast leaves it out)")


# Test files whose every test executes notebooks (papermill, a kernel each: 5-10 s), marked here
# while their owners rework them; a ``pytestmark = pytest.mark.slow`` in the file can replace this.
SLOW_FILES = ("test_runner.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.path.name in SLOW_FILES and item.path.parent.name == "tests":
            item.add_marker(pytest.mark.slow)
        if not _HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip)


# Lines a test asks to have in the run's summary (``record_property("summary_line", text)``): the
# studies' wall times, which a CI log must show. Properties travel back from pytest-xdist's workers
# with each report, where a worker's printing does not.
SUMMARY_KEY = "summary_line"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = [value for reports in terminalreporter.stats.values() for r in reports
             if getattr(r, "when", None) == "call" for key, value in getattr(r, "user_properties", ())
             if key == SUMMARY_KEY]
    if lines:
        terminalreporter.section("recorded by the tests")
        for line in sorted(lines):
            terminalreporter.write_line(line)
