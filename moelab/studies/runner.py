"""Run a study notebook end to end: ``python -m moelab study N [--preset cpu|gpu]`` (``make study-N``).

For study ``N`` the runner

1. finds ``nbs/NN_*.ipynb`` (the paired, executable copy of ``nbs/NN_*.py``);
2. creates ``studies/NN_name/`` (papermill does not create folders);
3. opens one MLflow parent run (experiment ``study/NN_name``, run ``NN_name-<preset>``) and exports
   ``MOELAB_PARENT_RUN_ID`` / ``MLFLOW_TRACKING_URI`` so that the kernel's training runs nest
   under it, and what the kernel cannot know itself: the command, the start time and the code
   state before the study wrote anything (``moelab.studies.common.study_context``);
4. executes the notebook with papermill (cell progress on stderr), injecting ``preset`` and
   ``out_dir = "."`` into its ``parameters`` cell, with the results folder as the working
   directory (so no machine path enters the notebook), into ``studies/NN_name/NN_name.ipynb``
   (kept even when a cell fails: it shows the error);
5. exports the executed notebook as ``NN_name.html`` beside it, and logs both, ``summary.json``
   (its study-level numbers as ``summary/*`` metrics; per-arm numbers, including any keyed by an
   arm name of ``arms`` or ``factor``, live on the child runs and in ``summary.json``) and
   the figures and results the notebook wrote as artifacts of the parent run.

The notebook itself writes its figures, raw results and ``summary.json`` into ``out_dir``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from moelab.base import repo_root
from moelab.studies.common import COMMAND_ENV, GIT_ENV, STARTED_ENV, git_state, quiet_known_noise
from moelab.tracking import PARENT_ENV, Run, experiment_name, start_run
from moelab.utils import atomic_path, flatten_dict

STUDIES = {1: "01_decay_bound", 2: "02_balancing", 3: "03_attnres_depth", 4: "04_context_curriculum"}
PRESETS = ("cpu", "gpu")
ARTIFACT_SUFFIXES = {".png", ".svg", ".pdf", ".json", ".csv", ".md", ".txt", ".html"}
ARTIFACT_DIRS = ("figures", "results")
# summary.json sections not logged as parent metrics: run facts (meta) and per-arm numbers, which
# the child runs carry under one metric name per quantity so MLflow can chart arms side by side.
NOT_PARENT_METRICS = ("meta", "arms", "factor")


def default_preset() -> str:
    """``gpu`` when a CUDA device is visible, else ``cpu``."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def find_notebook(number: int, nbs_dir: Path) -> Path:
    """The one ``NN_*.ipynb`` in ``nbs_dir`` for study ``number``."""
    found = sorted(nbs_dir.glob(f"{number:02d}_*.ipynb"))
    if len(found) != 1:
        have = ", ".join(p.name for p in sorted(nbs_dir.glob("[0-9][0-9]_*.ipynb"))) or "none"
        what = "no notebook" if not found else f"{len(found)} notebooks"
        raise FileNotFoundError(f"study {number}: {what} matching {nbs_dir}/{number:02d}_*.ipynb "
                                f"(notebooks there: {have}; studies: {STUDIES})")
    return found[0]


@contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the block (the kernel process inherits them), then restore."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def nested_run(run_name: str, **kwargs: Any) -> AbstractContextManager[Run]:
    """``with nested_run("sweep-a") as run: run.log_metrics(...)``: a run under the study's parent run.

    Inside a notebook that ``run_study`` executes, the run nests under the study's parent run
    (in its experiment); elsewhere it is a top-level run. ``kwargs`` go to ``moelab.tracking.start_run``.
    """
    return start_run(run_name=run_name, **kwargs)


def run_study(
    number: int,
    preset: str | None = None,
    *,
    nbs_dir: str | os.PathLike | None = None,
    out_root: str | os.PathLike | None = None,
    tracking_uri: str = "",
    parameters: Mapping[str, Any] | None = None,
    kernel_name: str | None = None,
    log_output: bool = True,
) -> Path:
    """Execute study ``number``'s notebook; return its results folder ``<out_root>/NN_name``.

    Args:
        preset: ``cpu`` (minutes on 2 cores) or ``gpu``; None: :func:`default_preset`.
        nbs_dir, out_root: default ``<repo>/nbs`` and ``<repo>/studies``.
        parameters: extra papermill parameters (after ``preset`` and ``out_dir``).
        kernel_name: Jupyter kernel; None: the notebook's own (``python3`` = this interpreter).
        log_output: stream the cells' output to this process's stdout/stderr.

    Raises:
        papermill.PapermillExecutionError: a cell failed (the parent run is marked FAILED and the
        executed notebook, with the error, is still written).
    """
    quiet_known_noise()
    preset = preset or default_preset()
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed: expected one of {PRESETS}")
    _require_modules()
    import papermill
    notebook = find_notebook(number, Path(nbs_dir) if nbs_dir else repo_root() / "nbs")
    out_dir = (Path(out_root) if out_root else repo_root() / "studies").resolve() / notebook.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = out_dir / notebook.name
    params = {"preset": preset, "out_dir": ".", **(parameters or {})}
    # The code state leaves out every study's results (their folder): one study's fresh outputs do not
    # make the next study's code "dirty".
    # A machine whose checkout has no usable .git (a copied tree) passes the state in MOELAB_STUDY_GIT.
    results = out_dir.parent
    if os.environ.get(GIT_ENV):
        code = json.loads(os.environ[GIT_ENV])
    else:
        code = git_state(exclude=(results.relative_to(repo_root()).as_posix(),)
                         if results.is_relative_to(repo_root()) else ())

    with start_run(experiment_name("study", notebook.stem), f"{notebook.stem}-{preset}",
                   tracking_uri=tracking_uri, parent_run_id="",
                   params={"study": notebook.stem, "preset": preset, "notebook": notebook.name},
                   tags={"moelab.study": notebook.stem,
                         "moelab.code": f"{code['commit']}{'-dirty' if code['dirty'] else ''}"}) as run:
        env = {
            PARENT_ENV: run.run_id,
            "MLFLOW_TRACKING_URI": run.tracking_uri,
            # The kernel imports moelab from this checkout even where it is not pip-installed.
            "PYTHONPATH": os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH", "")) if p),
            COMMAND_ENV: f"make study-{number} PRESET={preset}",
            STARTED_ENV: repr(time.time()),
            GIT_ENV: json.dumps(code),
            "MLFLOW_LOGGING_LEVEL": "WARNING",
        }
        try:
            with _environ(env), atomic_path(executed, keep_on_error=True) as tmp:
                papermill.execute_notebook(str(notebook), str(tmp), parameters=params, cwd=str(out_dir),
                                           kernel_name=kernel_name, progress_bar=True, log_output=log_output)
        finally:
            _relative_paths(executed, notebook)
            export_html(executed)
            _log_results(run, out_dir, executed)
    return out_dir


# What a study needs after its notebook ran, imported before it runs: a missing one would otherwise end
# an hour of training at the HTML export, with the parent run FAILED and nothing logged.
REQUIRED_MODULES = ("papermill", "nbformat", "nbconvert")


def _require_modules(names: tuple[str, ...] = REQUIRED_MODULES) -> None:
    """Import each of ``names``; a missing one raises ModuleNotFoundError naming all that are missing."""
    import importlib

    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ModuleNotFoundError(
            f"a study run needs {', '.join(missing)} (to execute the notebook and export it as HTML), which "
            f"this interpreter cannot import: install moelab's dependencies (make setup) or "
            f"pip install {' '.join(missing)}; nothing was run")


def _relative_paths(executed: Path, notebook: Path) -> None:
    """Record papermill's input and output paths relative to the repository (no machine paths in a
    committed notebook): ``nbs/NN_name.ipynb`` and ``studies/NN_name/NN_name.ipynb``."""
    if not executed.exists():
        return
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    meta = nb.metadata.get("papermill")
    if meta is None:
        return
    root = repo_root()
    for key, path in (("input_path", notebook), ("output_path", executed)):
        path = path.resolve()
        meta[key] = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
    with atomic_path(executed) as tmp:
        nbformat.write(nb, tmp)


def export_html(notebook: Path) -> Path | None:
    """Write ``notebook`` as a standalone HTML page beside it (figures embedded); None if it does not exist."""
    if not notebook.exists():
        return None
    import nbformat
    from nbconvert import HTMLExporter

    extra = os.pathsep.join(_jupyter_data_dirs())
    path = os.pathsep.join(p for p in (extra, os.environ.get("JUPYTER_PATH", "")) if p)
    with _environ({"JUPYTER_PATH": path} if extra else {}):
        body, _ = HTMLExporter().from_notebook_node(nbformat.read(notebook, as_version=4))
    out = notebook.with_suffix(".html")
    with atomic_path(out) as tmp:
        tmp.write_text(body, encoding="utf-8")
    return out


def _jupyter_data_dirs() -> list[str]:
    """Jupyter data folders holding nbconvert's templates outside the places Jupyter searches: a
    ``pip install --target DIR`` puts them in ``DIR/share/jupyter``, while nbconvert looks under
    ``sys.prefix``, the user's folders and ``JUPYTER_PATH`` only."""
    found = []
    for entry in sys.path:
        data = Path(entry or ".") / "share" / "jupyter"
        if (data / "nbconvert" / "templates" / "lab").is_dir():
            found.append(str(data))
    return found


def _log_results(run: Run, out_dir: Path, executed: Path) -> None:
    if executed.exists():
        run.log_artifact(executed)
    summary = _read_json(out_dir / "summary.json")
    if isinstance(summary, dict):
        study_level = {k: v for k, v in summary.items() if k not in NOT_PARENT_METRICS}
        arms = _arm_names(summary)
        run.log_metrics({f"summary/{k}": v for k, v in flatten_dict(study_level).items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)
                         and not any(f".{arm}." in f".{k}." for arm in arms)})
    for path in sorted(out_dir.iterdir()):
        if path.is_file() and path.suffix in ARTIFACT_SUFFIXES:
            run.log_artifact(path)
        elif path.is_dir() and path.name in ARTIFACT_DIRS:
            run.log_artifact(path, path.name)



def _arm_names(summary: Mapping[str, Any]) -> set[str]:
    """The arms a summary names: keys of ``arms`` and of each ``factor`` entry (``{key: {arm: value}}``).

    A number keyed by arm elsewhere in the summary (``norm_growth.<arm>.x``) is per-arm: as a parent
    metric it would be one single-bar chart per arm, named by arm, which MLflow cannot compare.
    """
    arms = summary.get("arms")
    names = set(arms) if isinstance(arms, dict) else set()
    factor = summary.get("factor")
    if isinstance(factor, dict):
        for by_arm in factor.values():
            if isinstance(by_arm, dict):
                names.update(by_arm)
    return names


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it is missing or not JSON (it is still logged as an artifact)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
