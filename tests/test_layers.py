"""The package's floors: a module imports only from its own unit or from a lower floor, and no
module-level imports go round in a circle; a choice tuple is derived from its ``Literal`` type.

Parses every ``import`` of ``moelab/`` (function-level ones too) and fails on one that runs up a
floor or sideways into another unit of the same floor, e.g. ``moelab.ops`` importing
``moelab.model`` or ``moelab.data`` importing ``moelab.model``. Within a unit, the modules'
module-level imports (``if TYPE_CHECKING:`` ones too: a circle there is one a refactor trips on)
must form no circle; the failure names the modules of each.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moelab"

# Lowest first. A unit is a top-level module or subpackage of moelab.
LAYERS: list[set[str]] = [
    {"base", "utils"},
    {"ops", "provenance"},  # provenance: the git / GPU / versions block of results (reads base)
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


def _package_sources(root: Path = PACKAGE) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*.py")}


def _module_name(rel: str, package: str) -> str:
    """``ops/kda/chunk.py`` -> ``moelab.ops.kda.chunk``; ``ops/kda/__init__.py`` -> ``moelab.ops.kda``."""
    parts = [package, *rel.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported: ``body`` and the blocks of its ``if``,
    ``try``, ``with`` and ``class`` statements, not the bodies of functions."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                yield from _top_level([b for b in block if isinstance(b, ast.stmt)] +
                                      [s for h in block if isinstance(h, ast.ExceptHandler) for s in h.body])


def import_graph(sources: dict[str, str], package: str = "moelab") -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level.

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``; relative
    imports are resolved against the importing module's package. Parent packages a dotted import
    runs implicitly are not edges (a package's ``__init__`` re-exporting its submodules is no circle).
    """
    names = {rel: _module_name(rel, package) for rel in sources}
    modules = set(names.values())
    graph: dict[str, set[str]] = {}
    for rel, text in sources.items():
        me = names[rel]
        here = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
        edges = graph.setdefault(me, set())
        for node in _top_level(ast.parse(text).body):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in modules else base)
        edges &= modules
        edges.discard(me)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle ``[a, b, ..., a]`` per strongly connected group of modules in ``graph`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:  # the shortest way from the group's first module back to itself, inside the group
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        cycles.append(paths[last] + [start])
    return sorted(cycles)


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


def test_no_import_circle() -> None:
    graph = import_graph(_package_sources())
    assert len(graph) > 20 and "moelab.model.transformer" in graph["moelab.model"]  # the walk found the edges
    cycles = import_cycles(graph)
    assert not cycles, "module-level imports in a circle:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_circle_check_finds_a_circle() -> None:
    """Self-check on the package: the circle RouterStats once closed (model.balance importing it from
    model.moe under ``if TYPE_CHECKING:``, model.moe importing the balancer) is found and named."""
    sources = _package_sources()
    rel = "model/balance.py"
    closed = dict(sources, **{rel: sources[rel] + "\nif TYPE_CHECKING:\n    from moelab.model.moe import Router\n"})
    assert import_cycles(import_graph(closed)) == [["moelab.model.balance", "moelab.model.moe",
                                                    "moelab.model.balance"]]


def test_circle_check_on_a_small_package(tmp_path: Path) -> None:
    """Self-check on a package in tmp_path: two separate circles (one through a subpackage with a
    relative import, one a plain pair) are each named; a function-level import, a class body's
    import and a package ``__init__`` re-exporting its submodule are handled as Python runs them."""
    files = {
        "__init__.py": "",
        "a.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.sub.c import C\n",
        "sub/__init__.py": "from pkg.sub.c import C\n",  # re-exports c, which does not import pkg.sub: no circle
        "sub/c.py": "try:\n    from ..a import X\nexcept ImportError:\n    X = None\n",
        "x.py": "class K:\n    from pkg import y\n",
        "y.py": "import pkg.x\n\ndef f():\n    from pkg import e\n",
        "e.py": "def g():\n    from pkg import y\n",
    }
    for rel, text in files.items():
        (tmp_path / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / rel).write_text(text)
    graph = import_graph(_package_sources(tmp_path / "pkg"), package="pkg")
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.sub"] == {"pkg.sub.c"} and graph["pkg.e"] == set()
    assert import_cycles(graph) == [["pkg.a", "pkg.sub.c", "pkg.a"], ["pkg.x", "pkg.y", "pkg.x"]]
    (tmp_path / "pkg" / "a.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "x.py").write_text("def k():\n    from pkg import y\n")
    assert import_cycles(import_graph(_package_sources(tmp_path / "pkg"), package="pkg")) == []


def repeated_literals(sources: dict[str, str]) -> list[str]:
    """Every tuple of two or more strings that spells out the values of a ``Literal[...]`` of the package, in its
    order, as ``path:line: (values) repeats Literal at path:line``: derive it with ``typing.get_args`` instead."""
    literals: dict[tuple[str, ...], str] = {}
    tuples: list[tuple[str, int, tuple[str, ...]]] = []

    def strings(node: ast.expr) -> tuple[str, ...] | None:
        elts = node.elts if isinstance(node, ast.Tuple) else [node]
        ok = len(elts) >= 2 and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts)
        return tuple(e.value for e in elts) if ok else None

    for rel, text in sorted(sources.items()):
        inside: set[int] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)) \
                    and (getattr(node.value, "id", None) or getattr(node.value, "attr", None)) == "Literal":
                inside.add(id(node.slice))
                values = strings(node.slice)
                if values:
                    literals.setdefault(values, f"moelab/{rel}:{node.lineno}")
            elif isinstance(node, ast.Tuple) and id(node) not in inside and strings(node):
                tuples.append((f"moelab/{rel}", node.lineno, strings(node)))
    return [f"{path}:{line}: {values} repeats the Literal at {literals[values]}"
            for path, line, values in tuples if values in literals]


def test_choice_tuples_come_from_their_literal() -> None:
    assert repeated_literals(_package_sources()) == []


def test_repeated_literal_check_finds_a_copy() -> None:
    """Self-check: a copied tuple is found whether the Literal sits in the same module or another one."""
    sources = {"a.py": "from typing import Literal\nMode = Literal['x', 'y']\nMODES = typing.get_args(Mode)\n",
               "b.py": "def f(m):\n    _one_of('m', m, ('x', 'y'))\n    return m in ('y', 'x')\n"}
    assert repeated_literals(sources) == ["moelab/b.py:2: ('x', 'y') repeats the Literal at moelab/a.py:2"]
    sources["a.py"] += "KINDS = ('x', 'y')\n"
    assert len(repeated_literals(sources)) == 2
