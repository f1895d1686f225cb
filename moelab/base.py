"""The lowest floor of the package: what every other module may import (and nothing it imports back).

``ConfigError`` with its two checks, used by every config section and op that rejects a value
with a message naming it and its allowed range; ``repo_root``, the checkout every relative path
(data cache, MLflow store, study results) is resolved against.
"""

from __future__ import annotations

import os
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is out of its allowed range; the message names field and range."""


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is not allowed: expected {allowed}")


def _one_of(name: str, value: object, choices: tuple) -> None:
    _check(value in choices, name, value, "one of " + ", ".join(map(repr, choices)))


def repo_root() -> Path:
    """The checkout root: ``$MOELAB_ROOT`` if set, else the parent of the ``moelab`` package dir."""
    env = os.environ.get("MOELAB_ROOT")
    if env:
        return Path(env).expanduser().resolve()
    return Path(__file__).resolve().parents[1]
