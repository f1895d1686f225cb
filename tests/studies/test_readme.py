"""README numbers come from committed files; no document or source cites a path a clone does not have."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from moelab.studies import readme

ROOT = Path(__file__).resolve().parents[2]
# Paths of one machine or of the workspace around the repository: a clone has none of them.
OUTSIDE = re.compile(r"(?<![\w.~-])/(?:work|home|root|Users)/|\.\./shared/|\bshared/(?:anchors|research|device)/")
# The READMEs whose tables a reader scans: no cell longer than readme.MAX_CELL characters.
READMES = ["README.md", "kernels/README.md", "studies/README.md", "tests/README.md", "nbs/README.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def _table_rows(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("|") and not re.fullmatch(r"\|[-|: ]+\|", ln.strip())]


@pytest.mark.parametrize("doc", list(readme.BLOCKS))
def test_measured_table_matches_the_result_files(doc: str) -> None:
    text = (ROOT / doc).read_text()
    assert readme.render(text, doc) == text, f"{doc}'s measured table is stale: run `python -m moelab.studies.readme`"


@pytest.mark.parametrize("doc", list(readme.BLOCKS))
def test_every_row_links_its_files_and_names_a_commit(doc: str) -> None:
    rows = _table_rows(readme.table(doc))[1:]  # without the header
    assert len(rows) >= {"kernels/README.md": len(readme.KERNEL_ROWS)}.get(doc, len(readme.STUDIES))
    here = (ROOT / doc).parent
    for row in rows:
        cells = _cells(row)
        links = LINK.findall(cells[-2 if doc != "README.md" else -1])
        # a JSON file, or a folder of them (a study's research records while they accumulate)
        files = [f for f in links if f.endswith(".json") or any((here / f).glob("*.json"))]
        assert files and all((here / f).is_file() or (here / f).is_dir() for f in files), row
        if doc != "README.md":
            assert re.fullmatch(r"`[0-9a-f]{7}`", cells[-1]), row


@pytest.mark.parametrize("doc", READMES)
def test_no_readme_table_cell_is_over_the_limit(doc: str) -> None:
    long = [f"{doc}: {len(c)} characters: {c[:80]}..." for row in _table_rows((ROOT / doc).read_text())
            for c in _cells(row) if len(c) > readme.MAX_CELL]
    assert not long, "\n".join(long)


def test_front_readme_stays_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


def test_render_replaces_only_the_marked_block() -> None:
    doc = f"intro\n{readme.BEGIN}\nold rows\n{readme.END}\noutro\n"
    out = readme.render(doc, "studies/README.md")
    assert out.startswith("intro\n" + readme.BEGIN) and out.endswith(readme.END + "\noutro\n")
    assert "old rows" not in out and "| study | question | answer | raw output | code |" in out
    with pytest.raises(ValueError, match="kernels/README.md has no generated table"):
        readme.render("no markers here", "kernels/README.md")


def test_links_are_relative_to_the_readme() -> None:
    assert readme._links(["kernels/results/moe_h200.json"], "kernels/README.md") == \
        "[`results/moe_h200.json`](results/moe_h200.json)"
    assert readme._links(["studies/a.json"], "kernels/README.md") == "[`../studies/a.json`](../studies/a.json)"
    assert readme._links(["studies/a.json"], "README.md") == "[`studies/a.json`](studies/a.json)"
    assert os.path.normpath(os.path.join("kernels", "../studies/a.json")) == os.path.normpath("studies/a.json")


def test_study_rows_prefer_the_summary_s_own_headline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A summary with ``headline`` and ``verdicts`` is rendered from them (the front README shows the headline,
    studies/README.md every verdict once); without them, the study's numbers as the fallback reads them."""
    meta = {"preset": "cpu", "device": "cpu", "runs": 6, "tokens_per_run": 1234567, "commit": "abcdef1"}
    by_depth = {"4": {"prenorm": {"mean": 6.0, "n": 3}, "block_attnres": {"mean": 5.9}, "full_attnres": {"mean": 5.8},
                      "blocks": 4, "order": "holds"},
                "16": {"prenorm": {"mean": 6.2, "n": 3}, "block_attnres": {"mean": 5.7},
                       "full_attnres": {"mean": 5.9}, "blocks": 8, "order": "does not hold"}}
    summary = {"meta": meta, "by_depth": by_depth}
    monkeypatch.setattr(readme, "_load", lambda rel: summary)
    st = readme.STUDIES[2]()
    assert st.setup == "`cpu` preset (cpu), 6 runs of 1,234,567 tokens"
    meta["tokens_per_run_min"] = 234567  # runs of different lengths (study 2's two layouts): the range
    assert readme.STUDIES[2]().setup == "`cpu` preset (cpu), 6 runs of 234,567-1,234,567 tokens"
    del meta["tokens_per_run_min"]
    assert st.headline == ("Full <= Block < PreNorm in mean val loss holds at 4 layers, not at 16 (16 layers: "
                           "prenorm 6.200, block (8) 5.700, full 5.900)")
    assert st.lines[1].startswith("16 layers, mean val loss: prenorm 6.200")
    summary.update(headline="Q? A +0.1 [-0.1, +0.3]", verdicts=["Q? A +0.1 [-0.1, +0.3]", "Q2? B"])
    st = readme.STUDIES[2]()
    assert (st.headline, st.lines) == ("Q? A +0.1 [-0.1, +0.3]", ["Q? A +0.1 [-0.1, +0.3]", "Q2? B"])
    monkeypatch.setattr(readme, "STUDIES", [readme.STUDIES[2]])
    monkeypatch.setattr(readme, "measured_commit", lambda path, needle=None: {"commit": "abcdef1234"})
    front, full = readme.table("README.md"), readme.table("studies/README.md")
    assert "| Q? | A +0.1 [-0.1, +0.3] | - | [`studies/03_attnres_depth/summary.json`]" in front and "Q2?" not in front
    assert full.count("A +0.1") == 1 and "|  | Q2? | B | [`03_attnres_depth/summary.json`]" in full
    assert readme._question("no question here? ") == ("", "no question here? ")


def test_no_path_outside_the_repository_is_cited() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.md", "*.py", "*.yaml", "*.toml", "Makefile", ".gitignore"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    # Tests hold such paths on purpose, as inputs that the checks must reject.
    cited = [f"{f}:{i}: {line.strip()}" for f in tracked if not f.startswith("tests/")
             for i, line in enumerate((ROOT / f).read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not cited, "paths a clone does not have:\n" + "\n".join(cited)


def test_rows_show_paired_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows from ``kernels/bench.py --entry model`` show the median paired ratio, its range and the verdict."""
    def q(ratios: list[float], target: float, verdict: str) -> dict:
        return {"ratios": ratios, "median": sorted(ratios)[1], "min": min(ratios), "max": max(ratios),
                "target": target, "verdict": verdict}

    common = {"tok_per_s": 250e3, "loss_finite": True, "nonfinite_grads": [], "params": 173e6,
              "params_activated": 57e6, "B": 8, "T": 4096, "mfu": 0.3, "mfu_model_flops": 0.09, "peak_mem_gb": 24.0,
              "host_ms": 120.0, "step_ms": 131.0, "balancer_ms": 0.5, "balancer_share": 0.004}
    rows = [{**common, "impl": "moelab_gpu_small_prenorm", "model.residual.mode": "prenorm"},
            {**common, "impl": "moelab_gpu_small_block_attnres_8", "model.residual.mode": "block_attnres",
             "model.residual.num_blocks": "8", "ratio_vs_prenorm": q([0.88, 0.93, 0.95], 0.9, "within noise")},
            {**common, "impl": "moelab_k3_mini_balancer_none", "balancer": "none"},
            {**common, "impl": "moelab_k3_mini", "balancer": "quantile_balancing", "balancer_cost": 0.015,
             "ratio_vs_balancer_none": q([0.975, 0.985, 0.99], 0.98, "within noise")}]
    monkeypatch.setattr(readme, "_load", lambda rel: {"rows": rows})
    result = readme._residual_modes().result
    assert "block_attnres_8 0.93x (0.88-0.95 in 3 paired rounds: within noise)" in result
    result = readme._k3_mini().result
    assert "costs 1.5% (1.0% to 2.5% in 3 paired rounds: within noise" in result
    assert "MFU 9.0% vs 9.0% (activated)" in result  # a sparse model's MFU counts the activated FLOPs
    for r in rows[1], rows[3]:  # a run that stopped early says how many of its planned rounds it has
        r.update(rounds_planned=8, complete=False)
    result = readme._residual_modes().result
    assert "block_attnres_8 0.93x (0.88-0.95 in 3 of 8 planned paired rounds: within noise)" in result
    assert "(1.0% to 2.5% in 3 of 8 planned paired rounds: within noise" in readme._k3_mini().result
    del rows[1]["ratio_vs_prenorm"], rows[3]["ratio_vs_balancer_none"]  # single runs: the plain ratio as before
    assert "block_attnres_8 1.00x" in readme._residual_modes().result
    assert "costs 0.0% (one run each" in readme._k3_mini().result


def test_research_progress_counts_the_committed_records(tmp_path, monkeypatch) -> None:
    import json

    monkeypatch.setattr(readme, "repo_root", lambda: tmp_path)
    study = tmp_path / "studies" / "09_x"
    (study / "records" / "research").mkdir(parents=True)
    (study / "summary.json").write_text(json.dumps({"meta": {"preset": "gpu"}}))
    assert readme.research_progress("09_x") is None  # no research record yet
    runs = (("a", 0, 2.5, "1111111aaaa", "12:00"), ("b", 0, 1.25, "2222222bbbb", "12:30"),
            ("a", 1, 3.0, "1111111aaaa", "12:10"))
    for arm, seed, minutes, commit, started in runs:
        (study / "records" / "research" / f"{arm}_s{seed}.json").write_text(json.dumps(
            {"arm": arm, "seed": seed, "code": {"commit": commit},
             "timing": {"gpu_minutes": minutes, "started": f"2026-12-04T{started}:00+00:00"},
             "machine": {"device": "NVIDIA H200"}}))
    answer, commit = readme.research_progress("09_x")
    assert answer.startswith("in progress: 3 run(s) recorded (2 arms: a, b; seeds 0, 1), 6.8 GPU-minutes on "
                             "NVIDIA H200 at 2 commit(s)")
    assert commit == "2222222"  # the latest run's
    (study / "summary.json").write_text(json.dumps({"meta": {"preset": "research"}}))
    assert readme.research_progress("09_x") is None  # the report is the research tier's: its own rows say it


def test_front_row_names_what_the_study_left_unresolved() -> None:
    """The front README's 'not resolved' cell: the lead questions inside the noise or not tested, by status, and a
    count when the list would not fit a cell."""
    st = readme.Study(9, "09_x", "x", "setup", "Q? A", ["Q? A"],
                      [("Q2", "noise"), ("Q3", "not tested"), ("Q4", "noise")])
    assert readme.unresolved_cell(st) == "inside the noise: Q2; Q4. not tested: Q3"
    assert readme.unresolved_cell(readme.Study(9, "09_x", "x", "setup", "Q? A", ["Q? A"])) == "-"
    long = readme.Study(9, "09_x", "x", "s", "Q? A", [], [("q" * 200, "noise"), ("r" * 200, "noise")])
    assert readme.unresolved_cell(long) == "2 inside the noise (each in studies/README.md)"


def test_kda_row_shows_paired_passes_with_intervals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The KDA speed row: plain ratios of medians for a file without passes; with ``bench.py --entry kda``'s per-pass
    ratios, each shape's geometric mean with its 95% interval and the verdict against the target from it."""
    def row(impl: str, T: int, ms: float, **kw) -> dict:
        return {"impl": impl, "B": 1, "T": T, "H": 16, "D": 128, "fwd_ms": ms / 4, "fwdbwd_ms": ms, "peak_mem_gb": 4.0,
                **kw}

    rows = [row("moelab_bounded", 4096, 6.0), row("fla_safe_gate", 4096, 9.0), row("moelab_general", 4096, 8.0),
            row("moelab_bounded", 8192, 8.0), row("fla_safe_gate", 8192, 10.0)]
    files = {"kernels/results/kda_h200.json": {"rows": rows},
             "kernels/results/kda_long_h200.json": {"rows": [row("moelab_bounded", 131072, 40.0)]},
             readme.CANDIDATES: {"runs": []}}
    monkeypatch.setattr(readme, "_load", lambda rel: files[rel])
    assert "**1.50x / 1.25x** fla's speed; forward" in readme._kda_speed().result
    assert readme.CANDIDATES not in readme._kda_speed().files
    # a later run of the default beside fla on another GPU at both shapes (an H200 run, or one shape, is not taken)
    paired = {"fwdbwd_vs_fla": {"ratios": [1.4, 1.4, 1.4], "target": 1.5}}
    h100 = {"meta": {"gpu": "NVIDIA H100 80GB HBM3"}, "rows": [row("moelab_bounded", 4096, 6.0, **paired),
                                                                 row("moelab_bounded", 8192, 7.0, **paired)]}
    files[readme.CANDIDATES]["runs"] = [h100, {**h100, "rows": h100["rows"][:1]},
                                        {**h100, "meta": {"gpu": "NVIDIA H200"}}]
    shown = readme._kda_speed()
    assert shown.result.endswith("; H100 run 1: 1.40/1.40x (CI 1.40-1.40/1.40-1.40)"), shown.result
    assert shown.files[-1] == readme.CANDIDATES
    files[readme.CANDIDATES]["runs"] = []
    rows[0]["fwdbwd_vs_fla"] = {"ratios": [1.52, 1.55, 1.58], "target": 1.5}
    rows[3]["fwdbwd_vs_fla"] = {"ratios": [1.2, 1.25, 1.3], "target": 1.5}
    result = readme._kda_speed().result
    assert "**1.55x / 1.25x** fla's speed (95% CI 1.48-1.63 / 1.13-1.38, 3 paired passes; target 1.5x: " \
           "within noise of the target / not met)" in result, result
    rows[3]["fwdbwd_vs_fla"] = {"ratios": [1.6, 1.62, 1.64], "target": 1.5}
    rows[0]["fwdbwd_vs_fla"] = {"ratios": [1.7, 1.72, 1.74], "target": 1.5}
    assert "3 paired passes; target 1.5x: met)" in readme._kda_speed().result
