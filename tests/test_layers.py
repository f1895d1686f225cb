"""The package's floors: a module imports only from its own unit or from a lower floor.

Parses every ``import`` of ``moelab/`` (function-level ones too) and fails on one that runs up a
floor or sideways into another unit of the same floor, e.g. ``moelab.ops`` importing
``moelab.model`` or ``moelab.data`` importing ``moelab.model``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moelab"

# Lowest first. A unit is a top-level module or subpackage of moelab.
LAYERS: list[set[str]] = [
    {"base", "utils"},
    {"ops"},
    {"model", "data", "tracking"},
    {"config"},
    {"train"},
    {"eval"},
    {"studies"},
    {"cli"},
    {"__main__"},
]
FLOOR = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str | None:
    """``moelab.ops.kda.chunk`` -> ``ops``; None for modules outside moelab (or moelab itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "moelab" and len(parts) > 1 else None


def _imports(source: str) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute import in ``source``; ``from moelab import x`` gives moelab.x."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "moelab":
                found += [(node.lineno, f"moelab.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def violations(sources: dict[str, str]) -> list[str]:
    """Every import that breaks the floors, as ``path:line: unit (floor) imports target (floor)``.

    ``sources`` maps a path relative to the package root (``ops/kda/chunk.py``) to its text.
    """
    bad = []
    for rel, text in sorted(sources.items()):
        first = rel.split("/")[0]
        unit = first.removesuffix(".py")
        if unit == "__init__":
            continue  # moelab/__init__.py: the package itself
        assert unit in FLOOR, f"moelab/{rel}: unit {unit!r} has no floor in LAYERS; add it there"
        for line, module in _imports(text):
            target = _unit(module)
            if target is None or target == unit:
                continue
            assert target in FLOOR, f"moelab/{rel}:{line} imports {module}, whose unit has no floor in LAYERS"
            if FLOOR[target] >= FLOOR[unit]:
                bad.append(f"moelab/{rel}:{line}: {unit} (floor {FLOOR[unit]}) imports {module} "
                           f"(floor {FLOOR[target]})")
    return bad


def _package_sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in PACKAGE.rglob("*.py")}


def test_no_import_runs_up_a_floor() -> None:
    sources = _package_sources()
    assert len(sources) > 20  # the walk found the package
    assert violations(sources) == []


def test_layer_check_catches_an_inverted_import() -> None:
    """Self-check: the same sources with one inverted import (an op reading the model config, a
    lazy one inside a function, and a sideways one from data into model) each fail."""
    sources = _package_sources()
    inverted = {
        "ops/kda/bounds.py": "from moelab.model.config import KDAConfig\n",
        "base.py": "def f():\n    import moelab.train.runner\n",
        "data/config.py": "from moelab import model\n",
    }
    for rel, extra in inverted.items():
        broken = dict(sources, **{rel: sources[rel] + "\n" + extra})
        found = violations(broken)
        assert len(found) == 1 and found[0].startswith(f"moelab/{rel}:"), (rel, found)
