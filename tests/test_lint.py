"""The repository passes its own linter (`make lint`): the package, the tests, the notebooks' paired sources and the
kernel benchmarks, under pyproject.toml's ruff settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_passes_on_every_python_source() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the dev extra (make setup)")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                           "moelab", "tests", "nbs", "kernels"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
