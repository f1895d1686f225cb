"""Where a measurement came from: the one ``meta`` block that benchmarks and studies write beside their numbers.

    from moelab.provenance import provenance
    meta = provenance()          # {"gpu", "python", "torch", "triton", "fla", "commit", "dirty", ...}

:func:`provenance` names the device, the library versions, the code (commit, and whether tracked files
differ from it, outputs left out), the command line and the UTC time. :func:`git_state` is its code part
alone. Nothing here imports torch at module import: ``kernels/bench.py --help`` runs anywhere.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# Paths whose changes do not make a measurement's code dirty: what studies and benchmarks write.
OUTPUTS = ("studies", "kernels/results")
# A copied tree whose .git is not its own (the GPU machine's copy keeps an old .git) names its commit here.
COMMIT_ENV = "MOELAB_COMMIT"


def git_state(root: str | os.PathLike | None = None, exclude: Sequence[str] = OUTPUTS) -> dict[str, Any]:
    """``{"commit", "dirty", "diff_sha256"}`` of the checkout at ``root`` (default: the one moelab runs from).

    Tracked files only; changes under ``exclude`` (paths relative to ``root``) do not count. ``diff_sha256``
    hashes ``git diff HEAD`` (16 hex digits), so two dirty trees with different edits differ. Outside a git
    checkout every value is None. With ``MOELAB_COMMIT`` set (and ``root`` not given), that is the commit and
    ``dirty`` is None: the copy's own git cannot say.
    """
    if root is None and os.environ.get(COMMIT_ENV):
        return {"commit": os.environ[COMMIT_ENV], "dirty": None, "diff_sha256": None}
    if root is None:
        from moelab.base import repo_root

        root = repo_root()
    spec = ["--", ".", *(f":(exclude){p}" for p in exclude)]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30,
                              check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD", *spec)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "diff_sha256": None}
    return {"commit": commit, "dirty": bool(diff),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if diff else None}


def command_line(argv: Sequence[str]) -> str:
    """The command that made a result, as a user would type it, from ``argv`` (interpreter first, or not): a
    script of the moelab package run by its path is ``python -m`` its module, another script under this checkout is
    named by its path from the checkout's root, and a path under ``$OUT`` (the GPU machine's output folder) is
    spelled ``$OUT/...`` rather than that machine's path. Shell-quoted."""
    args = list(argv)
    for i, a in enumerate(args[:2]):
        if a.endswith(".py"):
            path = Path(a).resolve()
            parts = path.with_suffix("").parts
            if "moelab" in parts:
                module = ".".join(parts[len(parts) - 1 - parts[::-1].index("moelab"):])
                args[:i + 1] = ["python", "-m", module]
            else:
                from moelab.base import repo_root

                root = Path(repo_root()).resolve()
                if path.is_relative_to(root):
                    args[i] = str(path.relative_to(root))
            break
    out = os.environ.get("OUT", "").rstrip("/")
    if out:
        args = [a.replace(out + "/", "$OUT/") if a.startswith(out + "/") or ("=" + out + "/") in a else a for a in args]
    return " ".join(a if a.startswith("$OUT/") or "=$OUT/" in a else shlex.quote(a) for a in args)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Python, torch, triton and fla versions (None where a package is not installed; fla: fla-core)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = None
    out["triton"] = _version("triton")
    out["fla"] = _version("fla-core") or _version("flash-linear-attention")
    return out


def device() -> str:
    """The CUDA device's name, else ``"CPU: <model> (<n> cores)"``."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {model} ({os.cpu_count()} cores)"


def provenance(command: Sequence[str] | None = None, root: str | os.PathLike | None = None) -> dict[str, Any]:
    """The ``meta`` block of a result file.

    Args:
        command: the command line that produced the result (default ``sys.argv`` after the interpreter);
            stored as one shell-quoted string.
        root: the checkout whose code ran (default: the one moelab runs from; a ``git worktree`` of another
            commit for an A/B run).

    Returns:
        ``{"gpu", "python", "torch", "triton", "fla", "commit", "dirty", "diff_sha256", "command", "date"}``:
        ``gpu`` the CUDA device's name (``"CPU: ..."`` without one), ``commit`` the full hash or None outside
        git, ``dirty`` whether tracked files differ from it (outputs under ``studies/`` and
        ``kernels/results/`` left out), ``date`` UTC in ISO 8601 to the second.
    """
    argv = list(command) if command is not None else [os.path.basename(sys.executable), *sys.argv]
    return {"gpu": device(), **versions(), **git_state(root),
            "command": command_line(argv),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


__all__ = ["COMMIT_ENV", "OUTPUTS", "command_line", "device", "git_state", "provenance", "versions"]
