"""README numbers come from committed files; no document or source cites a path a clone does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from moelab.studies import readme

ROOT = Path(__file__).resolve().parents[2]
# Paths of one machine or of the workspace around the repository: a clone has none of them.
OUTSIDE = re.compile(r"(?<![\w.~-])/(?:work|home|root|Users)/|\.\./shared/|\bshared/(?:anchors|research|device)/")


def test_measured_table_matches_the_result_files() -> None:
    text = (ROOT / "README.md").read_text()
    stale = "README.md's 'Measured so far' table is stale: run `python -m moelab.studies.readme`"
    assert readme.render(text) == text, stale


def test_every_row_names_its_files_and_a_commit() -> None:
    rows = [ln for ln in readme.table().splitlines() if ln.startswith("| ") and not ln.startswith("| what")]
    assert len(rows) == len(readme.ROWS)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        files = re.findall(r"`([^`\s]+\.(?:json|ipynb|log))`", cells[2])
        assert files and all((ROOT / f).is_file() for f in files), row
        assert re.fullmatch(r"`[0-9a-f]{7}`", cells[3]), row


def test_render_replaces_only_the_marked_block() -> None:
    doc = f"intro\n{readme.BEGIN}\nold rows\n{readme.END}\noutro\n"
    out = readme.render(doc)
    assert out.startswith("intro\n" + readme.BEGIN) and out.endswith(readme.END + "\noutro\n")
    assert "old rows" not in out and readme.HEADER in out
    with pytest.raises(ValueError, match="no generated table"):
        readme.render("no markers here")


def test_no_path_outside_the_repository_is_cited() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.yaml", "*.toml", "Makefile", ".gitignore"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # Tests hold such paths on purpose, as inputs that the checks must reject.
    cited = [f"{f}:{i}: {line.strip()}" for f in tracked if not f.startswith("tests/")
             for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not cited, "paths a clone does not have:\n" + "\n".join(cited)
