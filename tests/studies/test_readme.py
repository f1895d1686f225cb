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


def test_rows_show_paired_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows from ``bench_model.py --rounds`` show the median paired ratio, its range and the verdict."""
    def q(ratios: list[float], target: float, verdict: str) -> dict:
        return {"ratios": ratios, "median": sorted(ratios)[1], "min": min(ratios), "max": max(ratios),
                "target": target, "verdict": verdict}

    common = {"tok_per_s": 250e3, "loss_finite": True, "nonfinite_grads": [], "params": 173e6,
              "params_activated": 57e6, "B": 8, "T": 4096, "mfu": 0.3, "mfu_model_flops": 0.09, "peak_mem_gb": 24.0, "host_ms": 120.0,
              "step_ms": 131.0, "balancer_ms": 0.5, "balancer_share": 0.004}
    rows = [{**common, "impl": "moelab_gpu_small_prenorm", "model.residual.mode": "prenorm"},
            {**common, "impl": "moelab_gpu_small_block_attnres_8", "model.residual.mode": "block_attnres",
             "model.residual.num_blocks": "8", "ratio_vs_prenorm": q([0.88, 0.93, 0.95], 0.9, "within noise")},
            {**common, "impl": "moelab_k3_mini_balancer_none", "balancer": "none"},
            {**common, "impl": "moelab_k3_mini", "balancer": "quantile_balancing", "balancer_cost": 0.015,
             "ratio_vs_balancer_none": q([0.975, 0.985, 0.99], 0.98, "within noise")}]
    monkeypatch.setattr(readme, "_load", lambda rel: {"rows": rows})
    result = readme._residual_modes()[1]
    assert "block_attnres_8 0.93x (0.88-0.95 in 3 paired rounds: within noise)" in result
    result = readme._k3_mini()[1]
    assert "costs 1.5% of the tokens/s (1.0% to 2.5% in 3 paired rounds; target <= 2%: within noise" in result
    assert "MFU 9.0% vs 9.0% (model FLOPs" in result and "would say 30.0%" in result  # a sparse model's MFU
    for r in rows[1], rows[3]:  # a run that stopped early says how many of its planned rounds it has
        r.update(rounds_planned=8, complete=False)
    result = readme._residual_modes()[1]
    assert "block_attnres_8 0.93x (0.88-0.95 in 3 of 8 planned paired rounds: within noise)" in result
    assert "(1.0% to 2.5% in 3 of 8 planned paired rounds; target <= 2%" in readme._k3_mini()[1]
    del rows[1]["ratio_vs_prenorm"], rows[3]["ratio_vs_balancer_none"]  # single runs: the plain ratio as before
    assert "block_attnres_8 1.00x (issue 16's" in readme._residual_modes()[1]
    assert "costs 0.0% of the tokens/s (target <= 2%; one run each" in readme._k3_mini()[1]
