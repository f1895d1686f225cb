"""`make lab`: --allow-root only for root, PORT (default 8888, not the dashboard's 5000) and ARGS passed on."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(*args: str, env: dict[str, str] | None = None, as_user: bool = False) -> str:
    cmd = ["make", "-s", "-n", "-C", str(ROOT), "lab", "PYTHON=python3", *args]
    if as_user:
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60,
                          env={**os.environ, **(env or {})}).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_lab_command_for_this_user() -> None:
    line = _dry_run()
    assert "-m jupyterlab" in line and "--port 8888" in line and "--no-browser" in line
    assert ("--allow-root" in line) == (os.geteuid() == 0)
    line = _dry_run("PORT=9999", "ARGS=--ServerApp.token=abc")
    assert "--port 9999" in line and line.rstrip().endswith("--ServerApp.token=abc")
    assert "--port 7777" in _dry_run(env={"PORT": "7777"})


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("make") is None,
                    reason="needs root (to drop to an unprivileged user) and setpriv")
def test_lab_command_as_an_unprivileged_user() -> None:
    line = _dry_run("PORT=9999", as_user=True)
    assert "--allow-root" not in line and "--port 9999" in line
