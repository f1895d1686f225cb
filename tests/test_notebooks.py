"""The study notebooks: sources and their executed reports.

nbs/NN_name.py (jupytext py:percent) and nbs/NN_name.ipynb must hold the same cells: edit either
one, then ``make sync-nbs`` (``jupytext --sync``); these tests fail when they drift. The executed
notebook in studies/NN_name/ must read as a report: every figure rendered as a PNG with a caption,
no machine paths or known log noise in any output, and a computed "Findings" section at the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jupytext
import pytest

from moelab.studies.common import KNOWN_NOISE, MACHINE_PATH

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


# --- executed notebooks (studies/NN_name/NN_name.ipynb): what a reader sees -----------------------

EXECUTED = sorted((NBS.parent / "studies").glob("[0-9][0-9]_*/[0-9][0-9]_*.ipynb"))
UNRENDERED_FIGURE = re.compile(r"<(?:matplotlib\.figure\.)?Figure size \d")


def output_texts(output: dict) -> list[str]:
    """Every text a reader can see in one cell output (streams, plain/HTML/Markdown data, tracebacks)."""
    texts = [output.get("text", "")] if output.get("output_type") == "stream" else []
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/") or mime == "application/json":
            texts.append(value if isinstance(value, str) else json.dumps(value))
    texts.extend(output.get("traceback", []))
    return [t if isinstance(t, str) else "".join(t) for t in texts]


def report_problems(nb: dict) -> list[str]:
    """Why an executed study notebook does not read as a report; empty when it does."""
    problems = []
    cells = nb["cells"]
    captions = 0
    images = 0
    for i, cell in enumerate(cells):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "markdown":
            captions += len(re.findall(r"^\*\*Figure \d+[a-z]?\.\*\*", src, flags=re.M))
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                images += 1
            # a figure drawn only at some presets carries its caption in its cell's output, not in a markdown cell
            md = data.get("text/markdown", "")
            captions += len(re.findall(r"^\*\*Figure \d+[a-z]?\.\*\*", "".join(md) if isinstance(md, list) else md,
                                       flags=re.M))
            if any(k.startswith("application/vnd.jupyter.widget") for k in data):
                problems.append(f"cell {i}: a widget output (an empty progress bar in the saved notebook)")
            for text in output_texts(out):
                if UNRENDERED_FIGURE.search(text) and "image/png" not in data:
                    problems.append(f"cell {i}: a figure output without image/png: {text[:80]!r}")
                path = MACHINE_PATH.search(text)
                if path:
                    where = text[max(0, path.start() - 40):][:120]
                    problems.append(f"cell {i}: a machine path in the output: {where!r}")
                for noise in KNOWN_NOISE:
                    hit = re.search(noise, text)
                    if hit:
                        problems.append(f"cell {i}: known noise {noise!r} in the output: {text[hit.start():][:80]!r}")
            if out.get("output_type") == "error":
                problems.append(f"cell {i}: an error: {out.get('ename')}: {out.get('evalue')}")
    if captions != images:
        problems.append(f"{images} image/png outputs but {captions} '**Figure N.**' captions")
    for key, value in nb.get("metadata", {}).get("papermill", {}).items():
        if isinstance(value, str) and MACHINE_PATH.search(value):
            problems.append(f"papermill metadata {key} is a machine path: {value!r}")
    heads = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
             and re.match(r"#+\s*Findings\s*$", "".join(c["source"]).strip())]
    if not heads:
        problems.append("no '## Findings' markdown cell")
    else:
        after = [c for c in cells[heads[-1] + 1:] if c["cell_type"] == "code"][:1]
        md = [o["data"]["text/markdown"] for c in after for o in c.get("outputs", [])
              if "text/markdown" in o.get("data", {})]
        if not md or not "".join(md[0]).strip().startswith("- "):
            problems.append("the cell after '## Findings' has no computed Markdown list as its output")
    return problems


@pytest.mark.parametrize("ipynb", EXECUTED, ids=[p.stem for p in EXECUTED])
def test_executed_study_notebook_reads_as_a_report(ipynb: Path) -> None:
    nb = json.loads(ipynb.read_text())
    problems = report_problems(nb)
    assert not problems, f"{ipynb.name}:\n" + "\n".join(problems)
    # The HTML export is made by each run and logged to MLflow, never committed (one copy of each artifact).
    assert not ipynb.with_suffix(".html").exists() or not _tracked(ipynb.with_suffix(".html"))


def _tracked(path: Path) -> bool:
    """Whether git tracks ``path`` (False outside a git checkout)."""
    import subprocess

    try:
        out = subprocess.run(["git", "ls-files", "--error-unmatch", str(path)], cwd=path.parent,
                             capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0


def test_report_check_catches_each_problem() -> None:
    def nb(*cells: dict) -> dict:
        return {"cells": list(cells)}

    def code(*outputs: dict) -> dict:
        return {"cell_type": "code", "source": "x", "outputs": list(outputs)}

    def md(text: str) -> dict:
        return {"cell_type": "markdown", "source": text}

    findings = [md("## Findings"), code({"output_type": "execute_result", "data": {"text/markdown": "- a finding"}})]
    png = {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<IPython.core.display.Image>"}}
    good = nb(code(png), md("**Figure 1.** What it shows."), *findings)
    assert report_problems(good) == []
    bare = {"output_type": "execute_result", "data": {"text/plain": "<Figure size 640x480 with 1 Axes>"}}
    assert any("without image/png" in p for p in report_problems(nb(code(bare), *findings)))
    path = {"output_type": "stream", "name": "stdout", "text": "saved to /work/main/studies/x.png\n"}
    assert any("machine path" in p for p in report_problems(nb(code(path), *findings)))
    noise = {"output_type": "stream", "name": "stderr", "text": "GPU available: False, used: False\n"}
    assert any("known noise" in p for p in report_problems(nb(code(noise), *findings)))
    assert any("no '## Findings'" in p for p in report_problems(nb(code(png), md("**Figure 1.** x"))))
    assert any("'**Figure N.**' captions" in p for p in report_problems(nb(code(png), *findings)))
    shown = {"output_type": "display_data", "data": {"text/markdown": "**Figure 1.** Drawn at this preset only."}}
    assert report_problems(nb(code(png, shown), *findings)) == []  # a caption the drawing cell displays counts
    widget = {"output_type": "display_data", "data": {"application/vnd.jupyter.widget-view+json": {}}}
    assert any("widget" in p for p in report_problems(nb(code(widget), *findings)))


# --- study 2's committed results --------------------------------------------------------------------

def test_study_2_summary_covers_every_balancer() -> None:
    """studies/02_balancing/summary.json: every balancer arm with its seeds, each balance column and the shift test."""
    from moelab.studies import balancing

    path = NBS.parent / "studies" / "02_balancing" / "summary.json"
    assert path.exists(), "studies/02_balancing/summary.json is missing: run `make study-2 PRESET=cpu`"
    summary = json.loads(path.read_text())
    preset = summary["meta"]["preset"]
    if preset == "research":
        _check_study_2_research(summary)
        return
    assert set(summary["arms"]) == set(balancing.ARMS)
    assert set(summary["factor"]) <= {"model.moe.balancer", "model.moe.aux_loss_alpha",
                                      "model.moe.quantile_balancing_cutoff"}
    for arm, a in summary["arms"].items():
        assert a["n_seeds"] == len(balancing.PRESETS[preset]["seeds"]) >= 3, arm
        assert len(a["run_ids"]) == a["n_seeds"], arm
        for metric in ("final_val_loss", "maxvio_batch", "maxvio_global", "load_cv", "dead_experts", "balancer_share"):
            assert isinstance(a[f"{metric}_mean"], float), (arm, metric)
        assert a["shift_maxvio_first"] is not None, f"{arm}: no shift test"
    assert summary["settings"]["threshold"] >= 0.1


def _check_study_2_research(summary: dict) -> None:
    """The research tier's summary (issue 39): every balancer at both layouts on 3 seeds after a warm start, a
    steady state of >= 2000 steps with histogram QB, the shift test on 3 seeds, within the 75 GPU-minute budget."""
    from moelab.studies import balancing

    runs = summary["runs"]
    seeds = set(balancing.PRESETS["research"]["seeds"])
    assert len(seeds) >= 3
    for layout, (_, _, _, balancers) in balancing.LAYOUTS.items():
        for b in balancers:
            got = {r["seed"] for r in runs if r["layout"] == layout and r["balancer"] == b}
            assert got == seeds, (layout, b, got)
        assert any(f["question"].startswith(f"Steps to the floor after a warm switch, {layout}, qb minus")
                   and f["status"] != "not tested" for f in summary["findings"]), layout
    assert "qb_hist" in balancing.LAYOUTS["8x2048"][3] and summary["settings"]["steady_steps"] >= 2000
    assert {(r["arm"], r["seed"]) for r in summary["shift"]} == {
        (b, s) for b in balancing.LAYOUTS[balancing.SHIFT_LAYOUT][3] for s in seeds}
    assert summary["findings"][0]["question"].startswith("Has the router left its early collapse")
    assert 0 < summary["meta"]["gpu_minutes_total"] <= 75


STUDY3 = NBS.parent / "studies" / "03_attnres_depth" / "summary.json"


@pytest.mark.skipif(not STUDY3.exists(), reason="study 3 has no committed results yet")
def test_study3_summary_holds_its_grid_and_verdicts() -> None:
    """Study 3's committed rows cover the grid it promises, under one token budget, with a verdict per depth."""
    from moelab.studies.attnres_depth import ROW_KEYS, main_blocks

    s = json.loads(STUDY3.read_text())
    if s["meta"]["preset"] == "research":
        return _check_study3_research(s)
    rows = s["rows"]
    assert rows and all(set(r) == set(ROW_KEYS) for r in rows)
    depths = sorted({r["n_layers"] for r in rows})
    assert len(depths) >= 3, f"depths {depths}: the study sweeps at least three"
    for L in depths:
        for mode, blocks in (("prenorm", None), ("block_attnres", main_blocks(L)), ("full_attnres", 2 * L)):
            seeds = {r["seed"] for r in rows if (r["residual"], r["blocks"], r["n_layers"]) == (mode, blocks, L)}
            assert len(seeds) >= 3, f"{mode} at {L} layers has seeds {seeds}: compared losses need three or more"
    assert {r["blocks"] for r in rows if r["residual"] == "block_attnres"} >= {2, 4}
    assert len({r["tokens"] for r in rows}) == 1, "the budget rule: every run sees the same tokens"
    assert set(s["by_depth"]) == {str(L) for L in depths}
    assert all(v["order"] for v in s["by_depth"].values())
    if s["meta"]["preset"] == "cpu":
        assert s["meta"]["wall_s"] <= 240, f"PRESET=cpu took {s['meta']['wall_s']} s: the rule is 4 minutes"


def _check_study3_research(s: dict) -> None:
    """The research tier's committed report holds what issue 40 asks: two depths (the deeper >= 24 layers, >= 2x
    the shallower), >= 50M tokens per run, a 3-point lr sweep per mode at the shallow depth, 3 seeds of every main
    arm, the depth gain per mode with its 95% interval and a computed verdict, and each mode's overhead beside it."""
    from moelab.studies.attnres_depth import RESEARCH, SHORT

    main = [r for r in s["rows"] if r["role"] == "main"]
    depths = sorted({r["n_layers"] for r in main})
    assert len(depths) == 2 and depths[1] >= 24 and depths[1] >= 2 * depths[0], depths
    assert min(r["tokens"] for r in s["rows"]) >= 50_000_000 and len({r["tokens"] for r in main}) == 1
    for mode in RESEARCH.modes:
        assert len(s["lr_sweep"][mode]["losses"]) >= 3, mode
        for L in depths:
            seeds = {r["seed"] for r in main if r["residual"] == mode and r["n_layers"] == L}
            assert len(seeds) >= 3, (mode, L, seeds)
            assert len({r["lr"] for r in main if r["residual"] == mode}) == 1  # the sweep's choice, carried
        gain = s["depth_gain"][mode]
        assert gain["n"] >= 3 and gain["low"] <= gain["mean"] <= gain["high"] and gain["verdict"], mode
    assert s["compared"][0]["status"] in ("better", "worse", "noise", "not tested")
    assert s["meta"]["gpu_minutes"] <= 120, "issue 40's budget: 120 GPU-minutes per study"
    part = s["overhead_part"]
    assert part and str(depths[1]) in part["ratios"], "the speed part beside the losses"
    assert set(s["overhead"][str(depths[1])]) == {SHORT[m] for m in RESEARCH.modes if m != "prenorm"}


STUDY4 = NBS.parent / "studies" / "04_context_curriculum" / "summary.json"


@pytest.mark.skipif(not STUDY4.exists(), reason="study 4 has no committed results yet")
def test_study4_summary_holds_its_schedules_and_verdicts() -> None:
    """Study 4's committed rows: every schedule with three or more seeds at one token budget, passkey up to 4x the
    longest training length, and both verdicts computed."""
    from moelab.studies.context_curriculum import ROW_KEYS, SCHEDULES

    s = json.loads(STUDY4.read_text())
    rows = s["rows"]
    # the row keys, and each run's training time with the clock it was read from (summarize)
    # (a research-tier report adds each run's held-out loss past the longest training length)
    extra = {"loss_beyond"} if s["meta"]["preset"] == "research" else set()
    assert rows and all(set(r) == {*ROW_KEYS, "train_s", "train_clock", *extra} for r in rows)
    assert all(r["train_clock"] in ("steady", "wall") and 0 < r["train_s"] <= r["wall_s"] for r in rows)
    for sched in SCHEDULES:
        seeds = {r["seed"] for r in rows if r["schedule"] == sched}
        assert len(seeds) >= 3, f"{sched} has seeds {seeds}: compared losses need three or more"
    assert len({r["tokens"] for r in rows}) == 1, "the budget rule: every schedule sees the same tokens"
    longest = max(s["meta"]["lengths"])
    assert all(max(int(n) for n in r["passkey"]) >= 4 * longest for r in rows)
    assert set(s["factor"]) == {"data.curriculum"}
    assert set(s["verdict"]) == {"equal_tokens", "equal_wall_clock", "effective_context"} and all(s["verdict"].values())
    if s["meta"]["preset"] == "cpu":
        assert s["meta"]["wall_s"] <= 240, f"PRESET=cpu took {s['meta']['wall_s']} s: the rule is 4 minutes"
