"""Small helpers shared by training, tracking and studies.

``atomic_write`` is the one way moelab writes a result file: a reader (another process, a
crashed run's successor, ``git add``) sees either the old file or the complete new one, never a
prefix of it.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def signal_handlers(handler: Callable[[int, Any], None], signals: tuple[int, ...] = STOP_SIGNALS,
                    previous: dict[int, Any] | None = None) -> Iterator[dict[int, Any]]:
    """``handler`` for ``signals`` while the block runs, the previous handlers back after it (also when the block
    raises); yields those previous handlers ``{signum: handler}``, filled into ``previous`` (when given) before
    ``handler`` is installed, so a handler that restores them can read it. Call from the main thread (only it
    owns signals)."""
    previous = {} if previous is None else previous
    previous.update({s: signal.getsignal(s) for s in signals})
    for s in signals:
        signal.signal(s, handler)
    try:
        yield previous
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def atomic_path(path: str | os.PathLike, keep_on_error: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` when the block succeeds.

    For writers that want a file name rather than a file object (papermill, ``savefig``).
    Parent folders are created. On an exception the temporary file is removed and ``path`` is
    left as it was, unless ``keep_on_error``: then whatever the writer finished is published
    too (papermill's notebook of a failed run is the record of the failure).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Same folder as the target: os.replace is only atomic within one file system. The name keeps
    # the extension (savefig and papermill pick the format from it); the writer creates the file,
    # so it gets the usual umask permissions (mkstemp would give 0600).
    tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex[:12]}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if keep_on_error and tmp.exists() and tmp.stat().st_size > 0:
            os.replace(tmp, path)
        raise
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; rename it onto ``path`` on success.

    ``mode`` is ``"w"`` (text, ``encoding``) or ``"wb"`` (bytes). The data is flushed and
    fsync'ed before the rename, so a power loss cannot leave an empty file under the new name.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode={mode!r} is not allowed: expected 'w' or 'wb'")
    with atomic_path(path) as tmp:
        with open(tmp, mode.replace("w", "x"), encoding=encoding if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def flatten_dict(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": 2}`` -> ``{"a.b": 1, "c": 2}``: the leaves of nested dicts, keyed by dotted path."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_dict(value, dotted))
        else:
            out[dotted] = value
    return out


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    """Atomically write ``obj`` as JSON, indented by ``indent`` (None: one compact line, for machine records)
    (NaN/inf become null: strict JSON readers choke on them)."""
    with atomic_write(path) as f:
        if indent is None:
            json.dump(_finite(obj), f, separators=(",", ":"))
        else:
            json.dump(_finite(obj), f, indent=indent, sort_keys=False)
        f.write("\n")


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
