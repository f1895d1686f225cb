"""The study runner: papermill execution into studies/NN_name/, one MLflow parent run, nested children."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jupytext
import nbformat
import pytest

from moelab.studies import STUDIES, default_preset, find_notebook, run_study
from moelab.studies.runner import StudyFailed, export_html, math_to_mathml, results_root
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

NOTEBOOK = '''# %% tags=["parameters"]
preset = "cpu"
out_dir = "."

# %%
import json
import os

from moelab.studies import current_parent_run_id, nested_run

assert os.path.samefile(os.getcwd(), out_dir)
with nested_run(f"child-{preset}") as run:
    run.log_metrics({"score": 0.5}, step=1)
os.makedirs("figures", exist_ok=True)
open("figures/plot.svg", "w").write("<svg/>")
json.dump({"preset": preset, "parent": current_parent_run_id(), "scores": {"a": 1.5},
           "meta": {"wall_s": 3.0}, "arms": {"x": {"loss": 2.0}}, "factor": {"model.k": {"x": 1, "y-2": 2}},
           "growth": {"x": 1.1, "y-2": {"ratio": 1.2}, "mean": 1.15}}, open("summary.json", "w"))
print(os.environ["MOELAB_STUDY_COMMAND"], json.loads(os.environ["MOELAB_STUDY_GIT"])["commit"] is not None)
FAIL

# %% [markdown] tags=["research"]
# ## Only in the research report

# %% tags=["quick"]
print("quick tier cell ran")
'''


def _write_notebook(folder: Path, name: str, source: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nb = jupytext.reads(source, fmt="py:percent")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def test_runner_executes_notebook_under_a_parent_run(tmp_path, tracking_uri) -> None:  # noqa: F811
    from mlflow.tracking import MlflowClient

    nbs = tmp_path / "nbs"
    _write_notebook(nbs, "07_demo", NOTEBOOK.replace("FAIL\n", ""))
    stale = tmp_path / "studies" / "07_demo" / "07_demo.failed.ipynb"  # an earlier failure's record
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    out = run_study(7, "cpu", nbs_dir=nbs, out_root=tmp_path / "studies", tracking_uri=tracking_uri,
                    log_output=False)

    assert out == tmp_path / "studies" / "07_demo"
    assert not stale.exists()  # the report that followed replaces it
    executed = nbformat.read(out / "07_demo.ipynb", as_version=4)
    paths = [executed.metadata.papermill[k] for k in ("input_path", "output_path")]
    assert not any(p.startswith("/") or ".tmp." in p for p in paths), paths  # no machine or temp paths kept
    injected = [c for c in executed.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert injected and "preset = \"cpu\"" in injected[0].source
    assert 'out_dir = "."' in injected[0].source  # the working directory: no machine path in the notebook
    printed = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert "make study-7 PRESET=cpu True" in printed  # command and code state reach the kernel
    # the report of a cpu run keeps its own tier's cells and leaves the research tier's out
    assert "quick tier cell ran" in printed and not any("Only in the research" in c.source for c in executed.cells)
    assert "make study-7 PRESET=cpu True" in (out / "07_demo.html").read_text()  # the HTML export has the outputs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["preset"] == "cpu"

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("study/07_demo")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    parent, child = runs["07_demo-cpu"], runs["child-cpu"]
    assert parent.info.status == child.info.status == "FINISHED"
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id == summary["parent"]
    assert parent.data.params == {"study": "07_demo", "preset": "cpu", "notebook": "07_demo.ipynb"}
    # The summary is one table artifact, not a single-value chart per number.
    assert not any(k.startswith("summary/") for k in parent.data.metrics)
    table = json.loads((Path(client.download_artifacts(parent.info.run_id, "summary_table.json"))).read_text())
    rows = dict(zip(*[[r[i] for r in table["data"]] for i in (0, 1)]))
    assert rows["scores.a"] == 1.5 and rows["preset"] == "cpu" and rows["growth.y-2.ratio"] == 1.2
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", parent.data.tags["moelab.code"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"07_demo.ipynb", "07_demo.html", "summary.json", "summary_table.json", "figures"} <= artifacts
    assert not list(out.glob(".*.tmp.ipynb"))


def test_failing_notebook_marks_parent_failed_and_keeps_the_executed_notebook(tmp_path, tracking_uri) -> None:  # noqa: F811
    from mlflow.tracking import MlflowClient

    nbs = tmp_path / "nbs"
    _write_notebook(nbs, "08_broken", NOTEBOOK.replace("FAIL", "raise ValueError('study failed here')"))
    # One line: which cell (counted in the executed notebook, its injected parameters included), what it
    # raised, where the notebook with the traceback is.
    report = tmp_path / "studies" / "08_broken" / "08_broken.ipynb"
    report.parent.mkdir(parents=True)
    report.write_text("the committed report")  # what an earlier run (or the repository) holds
    with pytest.raises(StudyFailed, match=r"^study 8: cell 3 \('import json'\) raised ValueError: study failed "
                                          r"here; the executed notebook with the traceback: .*08_broken/08_broken"
                                          r".failed.ipynb") as e:
        run_study(8, "cpu", nbs_dir=nbs, out_root=tmp_path / "studies", tracking_uri=tracking_uri,
                  log_output=False)
    assert "\n" not in str(e.value)
    executed = tmp_path / "studies" / "08_broken" / "08_broken.failed.ipynb"
    assert "study failed here" in executed.read_text()
    assert report.read_text() == "the committed report"  # a failure never takes the report's place
    assert not report.with_suffix(".html").exists()
    assert (tmp_path / "studies" / "08_broken" / "summary.json").exists()  # what the notebook wrote is kept
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("study/08_broken")
    statuses = {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}
    assert statuses == {"08_broken-cpu": "FAILED", "child-cpu": "FINISHED"}


def test_dashboard_link_opens_the_training_view() -> None:
    from moelab.studies.runner import dashboard_link

    assert dashboard_link("7") == "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"


def test_only_a_record_preset_writes_the_committed_report() -> None:
    root = Path(__file__).resolve().parents[1]
    assert results_root("gpu") == root / "studies"
    assert results_root("cpu") == root / "runs" / "studies"
    assert "/runs/" in (root / ".gitignore").read_text().split()


def test_a_gpu_run_never_overwrites_a_research_report(tmp_path, monkeypatch) -> None:
    from moelab.studies import runner

    monkeypatch.setattr(runner, "repo_root", lambda: tmp_path)
    study = tmp_path / "studies" / "01_x"
    study.mkdir(parents=True)
    assert runner.results_root("gpu", "01_x") == tmp_path / "studies"  # no report yet
    (study / "summary.json").write_text(json.dumps({"meta": {"preset": "gpu"}}))
    assert runner.committed_preset("01_x") == "gpu"
    assert runner.results_root("gpu", "01_x") == runner.results_root("research", "01_x") == tmp_path / "studies"
    (study / "summary.json").write_text(json.dumps({"meta": {"preset": "research"}}))
    assert runner.results_root("gpu", "01_x") == tmp_path / "runs" / "studies"
    assert runner.results_root("research", "01_x") == tmp_path / "studies"
    assert runner.results_root("cpu", "01_x") == tmp_path / "runs" / "studies"
    assert runner.records_dir(study, "research") == study / "records" / "research"


def test_html_export_renders_formulas_offline(tmp_path) -> None:
    """Formulas become MathML (rendered by the browser, no script); no script is loaded from the network."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("Decay $g = g_{min}\\,\\sigma(z)$ see `$x$`.\n\n"
                                              "$$e^{G_i - G_j} \\le 1$$"),
                nbformat.v4.new_code_cell("1", outputs=[nbformat.v4.new_output(
                    "display_data", data={"text/markdown": "- bound $\\alpha^2$ holds"})])]
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    html = export_html(path).read_text()
    assert html.count("<math") == 3 and 'display="block"' in html
    assert "<msub><mi>g</mi>" in html and "<mi>σ</mi>" in html and "<mi>α</mi>" in html
    assert "<code>$x$</code>" in html  # code left alone
    assert not re.search(r"<script[^>]*src=\"(https?:)?//", html), "a script from the network"
    assert "mathjax" not in html.lower()


def test_math_to_mathml_leaves_text_and_code_alone() -> None:
    assert math_to_mathml("a $5 and $6 b") == "a $5 and $6 b"
    assert math_to_mathml("`$x$` and ``$y$``") == "`$x$` and ``$y$``"
    assert math_to_mathml("$x$").startswith("<math") and 'display="inline"' in math_to_mathml("$x$")
    # a soft line break inside a formula (study 3's intro wraps one), but not a paragraph break
    wrapped = math_to_mathml("with $a = \\mathrm{softmax}(w^\\top\n\\mathrm{RMSNorm}(v))$ and")
    assert "$" not in wrapped and wrapped.count("<math") == 1 and wrapped.endswith("</math> and")
    assert math_to_mathml("costs $5\n\nand $6 more") == "costs $5\n\nand $6 more"


def test_missing_html_exporter_stops_the_study_before_it_runs(tmp_path, tracking_uri, monkeypatch) -> None:  # noqa: F811
    """Without nbconvert the runner refuses at once, naming the module: no folder, no MLflow run, no training
    (on a GPU machine whose wheels lacked it, study 4 trained for 8 minutes and then died at the HTML export)."""
    import sys

    from mlflow.tracking import MlflowClient

    nbs = tmp_path / "nbs"
    _write_notebook(nbs, "08_needs", NOTEBOOK.replace("FAIL", "pass"))
    monkeypatch.setitem(sys.modules, "nbconvert", None)  # import nbconvert -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r"needs nbconvert .*nothing was run"):
        run_study(8, "cpu", nbs_dir=nbs, out_root=tmp_path / "studies", tracking_uri=tracking_uri,
                  log_output=False)
    assert not (tmp_path / "studies").exists()
    assert MlflowClient(tracking_uri).get_experiment_by_name("study/08_needs") is None


def test_notebook_lookup_errors_name_the_pattern(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"03_\*\.ipynb"):
        find_notebook(3, tmp_path)
    with pytest.raises(ValueError, match="preset='tpu'"):
        run_study(1, "tpu", nbs_dir=tmp_path)


def test_default_preset_and_study_folders() -> None:
    import torch

    assert default_preset() == ("gpu" if torch.cuda.is_available() else "cpu")
    assert STUDIES == {1: "01_decay_bound", 2: "02_balancing", 3: "03_attnres_depth", 4: "04_context_curriculum"}


def test_html_export_finds_templates_installed_with_pip_target(tmp_path, monkeypatch) -> None:
    """``pip install --target DIR`` (the GPU machine's install) puts nbconvert's templates in
    ``DIR/share/jupyter/nbconvert/templates``, outside nbconvert's search path: the exporter gets it."""
    from moelab.studies import runner

    site = tmp_path / "site"
    (site / "share" / "jupyter" / "nbconvert" / "templates" / "lab").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    monkeypatch.setattr("sys.path", [str(tmp_path / "other"), str(site)])
    assert runner._jupyter_data_dirs() == [str(site / "share" / "jupyter")]


FIGURES_NOTEBOOK = '''# %% tags=["parameters"]
preset = "cpu"
out_dir = "."

# %%
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from moelab.studies import common, report

common.show(plt.figure(), "figures/new.png")

# %%
report.committed_figure("figures/kept.png")

# %% tags=["research"]
common.show(plt.figure(figsize=(2, 2)), "figures/research_only.png")
'''


def test_a_finished_report_removes_the_figures_it_neither_drew_nor_showed(tmp_path, tracking_uri) -> None:  # noqa: F811
    """A report that replaces another tier's (the research report over the gpu one) keeps no figure of the old,
    nor one a cell of the other tier drew before the report left the cell out: what it shows, drawn
    (common.show) or read from the committed files (report.committed_figure), stays."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moelab.studies import common

    nbs = tmp_path / "nbs"
    _write_notebook(nbs, "07_figs", FIGURES_NOTEBOOK)
    figures = tmp_path / "studies" / "07_figs" / "figures"
    figures.mkdir(parents=True)
    for name, size in (("old.png", 3), ("kept.png", 4)):
        common.show(plt.figure(figsize=(size, size)), figures / name)
    lines: list[str] = []
    out = run_study(7, "cpu", nbs_dir=nbs, out_root=tmp_path / "studies", tracking_uri=tracking_uri,
                    log_output=False, echo=lines.append)
    assert sorted(p.name for p in (out / "figures").glob("*.png")) == ["kept.png", "new.png"]
    assert any("removed 2 figure(s) that this report does not show: old.png, research_only.png" in x
               for x in lines), lines
