"""nbs/NN_name.py (jupytext py:percent) and nbs/NN_name.ipynb must hold the same cells.

Edit either one, then ``make sync-nbs`` (``jupytext --sync``); this test fails when they drift.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import pytest

NBS = Path(__file__).resolve().parents[1] / "nbs"
SOURCES = sorted(NBS.glob("[0-9][0-9]_*.py"))
NOTEBOOKS = sorted(NBS.glob("[0-9][0-9]_*.ipynb"))


def cells(path: Path) -> list[tuple[str, str, tuple[str, ...]]]:
    """(type, source, tags) per cell, as jupytext reads the file (outputs and ids ignored)."""
    nb = jupytext.read(path)
    return [(c.cell_type, c.source.strip(), tuple(c.metadata.get("tags", ()))) for c in nb.cells]


def drift(py: Path, ipynb: Path) -> str | None:
    """None when both files hold the same cells, else where they first differ."""
    a, b = cells(py), cells(ipynb)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"cell {i} differs:\n--- {py.name}\n{x[1][:400]}\n--- {ipynb.name}\n{y[1][:400]}"
    if len(a) != len(b):
        return f"{py.name} has {len(a)} cells, {ipynb.name} has {len(b)}"
    return None


@pytest.mark.parametrize("py", SOURCES, ids=[p.stem for p in SOURCES])
def test_source_and_notebook_are_in_sync(py: Path) -> None:
    ipynb = py.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run `make sync-nbs`"
    problem = drift(py, ipynb)
    assert problem is None, f"{problem}\nrun `make sync-nbs` after editing either file"


@pytest.mark.parametrize("py", SOURCES, ids=[p.stem for p in SOURCES])
def test_notebook_has_a_parameters_cell_with_preset(py: Path) -> None:
    params = [src for kind, src, tags in cells(py) if "parameters" in tags]
    assert len(params) == 1, f"{py.name}: expected one cell tagged 'parameters', found {len(params)}"
    assert "preset" in params[0] and "out_dir" in params[0]


def test_every_notebook_has_its_source() -> None:
    orphans = [p.name for p in NOTEBOOKS if not p.with_suffix(".py").exists()]
    assert not orphans, f"notebooks without a py:percent source: {orphans}"


def test_drift_is_detected(tmp_path: Path) -> None:
    text = '# %% tags=["parameters"]\npreset = "cpu"\n\n# %%\nprint(preset)\n'
    py = tmp_path / "01_x.py"
    py.write_text(text)
    ipynb = tmp_path / "01_x.ipynb"
    jupytext.write(jupytext.reads(text, fmt="py:percent"), ipynb)
    assert drift(py, ipynb) is None
    py.write_text(text.replace("print(preset)", "print(preset * 2)"))
    assert "cell 1 differs" in drift(py, ipynb)
    py.write_text(text + "\n# %%\nx = 1\n")
    assert "3 cells" in drift(py, ipynb)
    py.write_text(text.replace('tags=["parameters"]', ""))
    assert "cell 0 differs" in drift(py, ipynb)
