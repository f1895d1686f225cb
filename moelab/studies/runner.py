"""Run a study end to end: ``python -m moelab study N [--preset cpu|gpu|research] [--runs A:S,...|--shard i/n]``
(``make study-N``): its notebook, or, for a split call, its module's ``train``.

For study ``N`` the runner

1. finds ``nbs/NN_*.ipynb`` (the paired, executable copy of ``nbs/NN_*.py``);
2. picks the results folder (:func:`results_root`): ``studies/NN_name/`` (the committed report) for
   ``research`` (the tier that answers the study's question, run as split calls), and for ``gpu``
   (the quick look) while no research report is committed there; any other preset (``cpu``, or
   ``gpu`` once ``research`` wrote the report) writes to the ignored ``runs/studies/NN_name/``, so a
   quick run never overwrites the record; it says where. Run records live in
   ``<results>/records/<preset>/`` (:func:`records_dir`): tiers never share a record;
3. opens one MLflow parent run (experiment ``study/NN_name``, run ``NN_name-<preset>``) and exports
   ``MOELAB_PARENT_RUN_ID`` / ``MLFLOW_TRACKING_URI`` so that the kernel's training runs nest
   under it, and what the kernel cannot know itself: the command, the start time, the code
   state before the study wrote anything (``moelab.studies.common.study_context``), the records
   folder, the split, a progress file whose lines (one per trained run) it echoes to the terminal,
   and ``OMP_NUM_THREADS`` (1 unless set: on a busy machine more threads spin against each other);
4. executes the notebook with papermill, injecting ``preset`` and ``out_dir = "."`` into its
   ``parameters`` cell, with the results folder as the working directory (so no machine path
   enters the notebook), into ``NN_name.ipynb`` there (kept even when a cell fails: it shows the error);
5. exports the executed notebook as ``NN_name.html`` beside it (formulas as MathML: it renders
   offline; not committed), and logs the notebook, the HTML, ``summary.json`` (as a table artifact,
   ``summary_table.json``) and the figures and results the notebook wrote as artifacts of the parent run.

A **split** call (``runs="arm:seed,..."`` or ``shard="i/n"``) runs no notebook: it imports the study module
(``moelab.studies.<name>`` of ``nbs/NN_<name>.ipynb``) and calls its ``train(preset, out_dir)`` (:data:`TRAIN_ENTRY`,
the same function the notebook's training cells call, so split calls add up to one go) in this process, with
``out_dir`` the ignored ``runs/studies/NN_name/split/`` (checkpoints, train.log); it trains only those runs, leaves
their records in the report's ``records/<preset>/`` folder and ends at the first incomplete grid
(:class:`~moelab.studies.common.GridIncomplete`) with one line: what it trained, where the records are, what is
left. It needs neither papermill, nbformat, nbconvert nor a Jupyter kernel, and MLflow only when importable: without
it the runs train untracked (it says so once) and the final call logs them from their records. The final call
without a split runs the notebook, reads every record and trains only what is missing (studies/README.md has the
recipe). A study preset may pin its records to a training-code epoch (``source_pin``,
:func:`moelab.studies.common.pinned`), so split calls at different commits still add up.

A split call with ``jobs=k`` (``--jobs k``, ``make ... JOBS=k``) trains its runs in ``k`` processes at once on the
same GPU (the named runs dealt round-robin; a shard ``i/n`` as the shards ``i + j*n / n*k``): a study model that
leaves the GPU mostly idle (a host-bound step) may train ``k`` runs in little more than the time of one; others do
not (two of study 4's research runs together on an H100 had not finished when a 10-minute call ended; one alone
trains in 346 s: studies/04_context_curriculum/records/research/pilot4096_s0.json). Probe first: ``PROBE=n`` with
``JOBS=k`` times the runs together (the probes wait for each other after their compilation, so the
steps they are timed on share the GPU; a probe that waited in vain says its time is optimistic). The processes
train untracked (the final call logs them); each record keeps ``gpu_share = k``, its GPU-minutes are its wall time
/ k, and its tokens/s is not a speed (:attr:`moelab.studies.common.RunRecord.tok_per_s` is None). Ctrl-C or
SIGTERM reaches every process: each saves its run's checkpoint, and the next call resumes them.

Ctrl-C or SIGTERM stops the run in progress cleanly (it saves ``last.ckpt``; its MLflow run and the
parent run end KILLED), removes the temporary notebook and raises :class:`StudyStopped`; the next call
resumes: finished runs are kept, the stopped one continues from its checkpoint, and runs a ``kill -9``
left RUNNING are closed. A cell that raises ends in :class:`StudyFailed`, one line naming the cell.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

from moelab.base import repo_root
from moelab.studies.common import (
    COMMAND_ENV,
    GIT_ENV,
    GPU_SHARE_ENV,
    PROBE_BARRIER_ENV,
    PROBE_ENV,
    PROGRESS_ENV,
    RECORDS_ENV,
    RUNS_ENV,
    SHARD_ENV,
    SPLIT_UNTRACKED_ENV,
    STARTED_ENV,
    GridIncomplete,
    ProbeDone,
    forget_split_runs,
    git_state,
    parse_runs,
    parse_shard,
    probe_steps,
    probed_runs,
    progress_to,
    quiet_known_noise,
    source_sha256,
)
from moelab.tracking import LAB_EXTRA_HINT, PARENT_ENV, Run, end_stale_run, experiment_name, start_run
from moelab.tracking import installed as tracking_installed
from moelab.utils import atomic_path, flatten_dict, signal_handlers, write_json

STUDIES = {1: "01_decay_bound", 2: "02_balancing", 3: "03_attnres_depth", 4: "04_context_curriculum"}
PRESETS = ("cpu", "gpu", "research")
# Presets whose results can be the committed report in studies/NN_name/, highest tier first: a research
# report is never overwritten by a gpu run. Every other preset writes to RUNS_ROOT.
RECORD_PRESETS = ("research", "gpu")
RUNS_ROOT = Path("runs") / "studies"  # under the repository; ignored by git
ARTIFACT_SUFFIXES = {".png", ".svg", ".pdf", ".json", ".csv", ".md", ".txt", ".html"}
ARTIFACT_DIRS = ("figures", "results")
STATE_FILE = "parent_run.json"  # beside the run folders: the last call's parent run (closed if left RUNNING)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StudyStopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the study; ``signum`` is the signal, the message says how to resume."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class StudyFailed(RuntimeError):
    """A cell of the study notebook raised; the message names the cell, the error and where the notebook is."""


def default_preset() -> str:
    """``gpu`` when a CUDA device is visible, else ``cpu``."""
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def committed_preset(stem: str) -> str | None:
    """The preset of the committed report ``studies/<stem>/summary.json`` (its ``meta.preset``); None without one."""
    summary = _read_json(repo_root() / "studies" / stem / "summary.json")
    meta = summary.get("meta") if isinstance(summary, dict) else None
    return meta.get("preset") if isinstance(meta, dict) else None


def results_root(preset: str, stem: str | None = None) -> Path:
    """Where ``preset``'s results go: ``<repo>/studies`` for :data:`RECORD_PRESETS`, else ``<repo>/runs/studies``.

    With ``stem`` (``01_decay_bound``), a preset below the tier of the committed report there (``gpu`` where
    ``research`` wrote it) also goes to ``<repo>/runs/studies``.
    """
    if preset not in RECORD_PRESETS:
        return repo_root() / RUNS_ROOT
    have = committed_preset(stem) if stem else None
    if have in RECORD_PRESETS and RECORD_PRESETS.index(have) < RECORD_PRESETS.index(preset):
        return repo_root() / RUNS_ROOT
    return repo_root() / "studies"


def records_dir(out_dir: Path, preset: str) -> Path:
    """The run records of ``preset`` in the results folder ``out_dir``: ``<out_dir>/records/<preset>``."""
    return out_dir / "records" / preset


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
    runs: str | None = None,
    shard: str | None = None,
    nbs_dir: str | os.PathLike | None = None,
    out_root: str | os.PathLike | None = None,
    tracking_uri: str = "",
    parameters: Mapping[str, Any] | None = None,
    kernel_name: str | None = None,
    log_output: bool = True,
    echo: Any = None,
    module: str | ModuleType | None = None,
    jobs: int = 1,
    probe: int | None = None,
) -> Path:
    """Execute study ``number``'s notebook (a split call: its module's ``train``); return ``<out_root>/NN_name``.

    Args:
        preset: ``cpu`` (minutes on 2 cores), ``gpu`` (the quick look, minutes on one H200) or
            ``research`` (the tier that answers the question: split calls over several GPU sessions);
            None: :func:`default_preset`.
        runs: ``"arm:seed,arm:seed"``: a split call that trains only these runs (see the module docstring).
        shard: ``"i/n"``: a split call that trains runs i, i + n, ... of each grid.
        nbs_dir: default ``<repo>/nbs``. out_root: default :func:`results_root` of the preset.
        parameters: extra papermill parameters (after ``preset`` and ``out_dir``).
        kernel_name: Jupyter kernel; None: the notebook's own (``python3`` = this interpreter).
        log_output: stream the cells' output to this process's stdout/stderr.
        echo: where the progress lines go (default: stderr).
        module: the study module whose ``train(preset, out_dir)`` a split call runs (a module or its dotted name);
            default ``moelab.studies.<name>`` of the notebook ``NN_<name>`` (:func:`study_module`).
        jobs: a split call's processes training at once on the same GPU (see the module docstring).
        probe: a split call that times its runs instead of training them: ``probe`` optimizer steps each in a
            scratch folder (``runs/studies/NN_name/split/probe/``), no record; one line per run with its step time
            and what the whole run would take (:data:`moelab.studies.common.PROBE_ENV`).

    Raises:
        StudyFailed: a cell raised (the parent run is marked FAILED; the executed notebook, with the
            error, is kept as ``NN_name.failed.ipynb`` beside the report, which stays as it was, and so are the
            partial results); a split call's ``train`` raised, or the study module
            has no ``train``.
        StudyStopped: Ctrl-C / SIGTERM (parent and current training run KILLED; the next call resumes).
    """
    quiet_known_noise()
    preset = preset or default_preset()
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed: expected one of {PRESETS}")
    if runs and shard:
        raise ValueError(f"runs={runs!r} and shard={shard!r}: give one of them")
    if runs:
        parse_runs(runs)
    if shard:
        parse_shard(shard)
    split = bool(runs or shard)
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1 or (jobs > 1 and not split):
        raise ValueError(f"jobs={jobs!r} is not allowed: expected a whole number >= 1, and > 1 only with runs or "
                         "shard (a split call)")
    if probe is not None and not split:
        raise ValueError(f"probe={probe!r} is not allowed without runs or shard: a probe times a split call's runs")
    say = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    if split and jobs > 1:
        return _run_split_jobs(number, preset, split_groups(runs, shard, jobs), nbs_dir=nbs_dir, out_root=out_root,
                               module=module, say=say, probe=probe)
    if split:
        return _run_split(number, preset, runs=runs, shard=shard, nbs_dir=nbs_dir, out_root=out_root,
                          tracking_uri=tracking_uri, module=module, say=say, probe=probe)
    _require_modules()
    import papermill

    notebook, out_dir = _report_folder(number, preset, nbs_dir, out_root)
    records = records_dir(out_dir, preset)
    # A split call's notebook runs apart from the report; its runs' records go to the report's records/.
    # The runner's own files (the progress lines, the last parent run) stay out of the report's folder.
    state = (Path(out_root).resolve() if out_root else repo_root() / RUNS_ROOT) / notebook.stem
    work = state / "split" if split else out_dir
    state.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    executed = work / notebook.name
    for stale in work.glob(f".{notebook.stem}.*.tmp.ipynb"):  # left by a process that was killed
        stale.unlink(missing_ok=True)
    params = {"preset": preset, "out_dir": ".", **(parameters or {})}
    code = _code_state()
    command = f"make study-{number} PRESET={preset}" + (f" RUNS={runs}" if runs else f" SHARD={shard}" if shard else "")
    where = _shown(out_dir)
    if out_dir.parent != repo_root() / "studies" and out_root is None:
        have = committed_preset(notebook.stem)
        say(f"study {number} ({notebook.stem}), preset {preset}: results go to {where}/ (not the committed report "
            f"in studies/, which " + (f"holds the {have} tier)" if have in RECORD_PRESETS and preset in RECORD_PRESETS
                                      else f"only PRESET={'|'.join(RECORD_PRESETS)} writes)"))
    _close_stale(state / STATE_FILE, tracking_uri, say)
    progress = state / ("progress-split.log" if split else "progress.log")
    progress.write_text("")

    stopper = _Stopper()
    with start_run(experiment_name("study", notebook.stem), f"{notebook.stem}-{preset}" + ("-split" if split else ""),
                   tracking_uri=tracking_uri, parent_run_id="",
                   params={"study": notebook.stem, "preset": preset, "notebook": notebook.name,
                           **({"split": runs or f"shard {shard}"} if split else {})},
                   tags={"moelab.study": notebook.stem,
                         "moelab.code": f"{code['commit']}{'-dirty' if code['dirty'] else ''}"}) as run:
        write_json(state / STATE_FILE, {"run_id": run.run_id, "tracking_uri": run.tracking_uri})
        env = {
            PARENT_ENV: run.run_id,
            "MLFLOW_TRACKING_URI": run.tracking_uri,
            # The kernel imports moelab from this checkout even where it is not pip-installed.
            "PYTHONPATH": os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH", "")) if p),
            COMMAND_ENV: command,
            STARTED_ENV: repr(time.time()),
            GIT_ENV: json.dumps(code),
            RECORDS_ENV: str(records),
            RUNS_ENV: runs or "",
            SHARD_ENV: shard or "",
            PROGRESS_ENV: str(progress),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or "1",
            "MLFLOW_LOGGING_LEVEL": "WARNING",
        }
        tmp = executed.with_name(f".{executed.stem}.{uuid.uuid4().hex[:12]}.tmp{executed.suffix}")
        failure = None
        try:
            with _environ(env), stopper, _echo_lines(progress, say):
                try:
                    papermill.execute_notebook(str(notebook), str(tmp), parameters=params, cwd=str(work),
                                               kernel_name=kernel_name, progress_bar=False, log_output=log_output,
                                               # ipykernel warns on every start that its local TCP is unencrypted
                                               extra_arguments=["--IPKernelApp.log_level=ERROR"])
                except papermill.PapermillExecutionError as e:
                    failure = e
            # a failed run's notebook is the record of the failure: beside the report, never in its place (a
            # research call that fails on this machine leaves the committed report as it was)
            failed = failure is not None and failure.ename != "GridIncomplete"
            if failed:
                executed = failed_notebook(executed)
            if stopper.signum is None and tmp.exists() and tmp.stat().st_size > 0:
                os.replace(tmp, executed)
                if not failed:
                    failed_notebook(executed).unlink(missing_ok=True)  # a failure's record outlived by a report
        finally:
            tmp.unlink(missing_ok=True)
        if stopper.signum is not None:
            name = signal.Signals(stopper.signum).name
            saved = "the stopped run saved its checkpoint"
            if failure is not None and failure.ename not in CLEAN_STOPS:  # the stop itself failed in the kernel
                say(f"study {number}: the run in progress failed while it stopped, in its kernel:\n"
                    + _ANSI.sub("", "\n".join(failure.traceback or [f"{failure.ename}: {failure.evalue}"])))
                saved = f"the run in progress failed while it stopped ({failure.ename}, above)"
            raise StudyStopped(f"study {number} stopped by {name}: finished runs are recorded in "
                               f"{_shown(records)}/ and {saved}; `{command}` resumes", stopper.signum)
        _finish_notebook(executed, notebook, preset)
        if failure is not None and failure.ename == "GridIncomplete":
            say(f"study {number}, split call: {failure.evalue}; when every run is recorded, `make study-{number} "
                f"PRESET={preset}` trains what is missing and writes the report")
            _log_results(run, work, executed, records)
            return out_dir
        if failure is None:
            export_html(executed)
            if not split:
                stale = remove_stale_figures(out_dir, executed)
                if stale:
                    say(f"study {number}: removed {len(stale)} figure(s) that this report does not show: "
                        f"{', '.join(stale)}")
        _log_results(run, work, executed, records)
        if failure is not None:
            raise StudyFailed(_failure_line(number, failure, executed))
        if split:
            say(f"study {number}, split call: every run of the study is recorded in {_shown(records)}/; "
                f"`make study-{number} PRESET={preset}` writes the report")
    say(f"dashboard: {dashboard_link(run.experiment_id)} (after make mlflow-ui)")
    return out_dir


def remove_stale_figures(out_dir: Path, executed: Path) -> list[str]:
    """Remove the ``figures/*.png`` of a report folder that its report ``executed`` does not show (no output of
    the notebook holds the file's bytes): an earlier report's figures (the gpu tier's beside the research report
    that replaced it) and those a cell of the other tier drew before the report left that cell out. Returns their
    names."""
    import base64

    nb = json.loads(executed.read_text())
    shown = set()
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png")
            if png:
                shown.add(("".join(png) if isinstance(png, list) else png).replace("\n", ""))
    gone = []
    for path in sorted((out_dir / "figures").glob("*.png")):
        if base64.b64encode(path.read_bytes()).decode() not in shown:
            path.unlink()
            gone.append(path.name)
    return gone


TRAIN_ENTRY = "train"  # every study module's entry: train(preset: str, out_dir: Path) -> Any, all grids of the preset


def _report_folder(number: int, preset: str, nbs_dir: Any, out_root: Any) -> tuple[Path, Path]:
    """``(notebook, out_dir)``: study ``number``'s paired notebook and its report's folder (``<out_root>/NN_name``,
    by default :func:`results_root` of ``preset``)."""
    notebook = find_notebook(number, Path(nbs_dir) if nbs_dir else repo_root() / "nbs")
    return notebook, (Path(out_root) if out_root else results_root(preset, notebook.stem)).resolve() / notebook.stem


def _code_state() -> dict[str, Any]:
    """The code a call trains: ``MOELAB_STUDY_GIT`` when given (a machine whose checkout has no usable .git, a
    copied tree), else :func:`git_state` (study and benchmark outputs left out: one study's fresh outputs do not
    make the next study's code "dirty"); with the package hash, taken once: every run of the call shares it."""
    code = json.loads(os.environ[GIT_ENV]) if os.environ.get(GIT_ENV) else git_state()
    code.setdefault("source_sha256", source_sha256())
    return code


def study_module(stem: str, module: str | ModuleType | None = None) -> ModuleType:
    """The study module of notebook ``NN_<name>``: ``module`` (itself, or imported by its dotted name), else
    ``moelab.studies.<name>``."""
    import importlib

    if isinstance(module, ModuleType):
        return module
    return importlib.import_module(module or f"moelab.studies.{stem.split('_', 1)[1]}")


def study_train(number: int, stem: str, module: str | ModuleType | None = None) -> Any:
    """The study's ``train(preset, out_dir)``; :class:`StudyFailed` naming the study and the module without one."""
    mod = study_module(stem, module)
    fn = getattr(mod, TRAIN_ENTRY, None)
    if not callable(fn):
        raise StudyFailed(f"study {number} ({stem}): {mod.__name__} has no {TRAIN_ENTRY}(preset, out_dir), the entry a "
                          f"split call runs (every study module trains all its grids of a preset through it, as its "
                          f"notebook does); nothing was run")
    return fn


def _run_split(number: int, preset: str, *, runs: str | None, shard: str | None, nbs_dir: Any, out_root: Any,
               tracking_uri: str, module: str | ModuleType | None, say: Any, probe: int | None = None) -> Path:
    """A split call: the study module's ``train(preset, out_dir)`` in this process (no notebook, no kernel, no
    papermill), its runs' records in the report's ``records/<preset>/``, its checkpoints in the ignored
    ``runs/studies/NN_name/split/``; returns the report's folder. With MLflow importable the runs nest under one
    parent run ``NN_name-<preset>-split`` as before; without it they train untracked (the final call logs them)."""
    notebook, out_dir = _report_folder(number, preset, nbs_dir, out_root)
    stem = notebook.stem
    records = records_dir(out_dir, preset)
    state = (Path(out_root).resolve() if out_root else repo_root() / RUNS_ROOT) / stem
    work = state / "split"
    work.mkdir(parents=True, exist_ok=True)
    code = _code_state()
    command = f"make study-{number} PRESET={preset}" + (f" RUNS={runs}" if runs else f" SHARD={shard}")
    env = {COMMAND_ENV: command, STARTED_ENV: repr(time.time()), GIT_ENV: json.dumps(code), RECORDS_ENV: str(records),
           RUNS_ENV: runs or "", SHARD_ENV: shard or "", PROGRESS_ENV: "", "MLFLOW_LOGGING_LEVEL": "WARNING",
           PROBE_ENV: str(probe) if probe is not None else ""}
    import torch

    if not torch.cuda.is_available():  # Triton kernels run in the interpreter; set before a kernel module is imported
        env["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET") or "1"
    tracked = tracking_installed() and os.environ.get(SPLIT_UNTRACKED_ENV) != "1" and probe is None
    if os.environ.get(SPLIT_UNTRACKED_ENV) == "1" or probe is not None:
        pass  # one of a jobs call's processes (the parent said it once), or a probe (nothing to log)
    elif not tracked:
        say(f"study {number}, split call: MLflow cannot be imported here, so its runs train untracked; their records "
            f"carry their curves, timings and machine, and the final call (`make study-{number} PRESET={preset}`) "
            "logs them into MLflow")
    threads = torch.get_num_threads()
    if not os.environ.get("OMP_NUM_THREADS"):  # as a notebook's kernel gets: 1 unless set (busy machines)
        torch.set_num_threads(1)
    try:
        with _environ(env), progress_to(say):
            train = study_train(number, stem, module)
            if not tracked:
                return _split_train(number, preset, train, work, out_dir, records, command, say, run=None)
            _close_stale(state / STATE_FILE, tracking_uri, say)
            with start_run(experiment_name("study", stem), f"{stem}-{preset}-split", tracking_uri=tracking_uri,
                           parent_run_id="",
                           params={"study": stem, "preset": preset, "notebook": notebook.name,
                                   "split": runs or f"shard {shard}"},
                           tags={"moelab.study": stem,
                                 "moelab.code": f"{code['commit']}{'-dirty' if code['dirty'] else ''}"}) as run:
                write_json(state / STATE_FILE, {"run_id": run.run_id, "tracking_uri": run.tracking_uri})
                with _environ({PARENT_ENV: run.run_id, "MLFLOW_TRACKING_URI": run.tracking_uri}):
                    return _split_train(number, preset, train, work, out_dir, records, command, say, run=run)
    finally:
        torch.set_num_threads(threads)


def _split_train(number: int, preset: str, train: Any, work: Path, out_dir: Path, records: Path, command: str,
                 say: Any, run: Run | None) -> Path:
    """Run ``train(preset, work)`` for a split call; say what it trained and what is left (one line)."""
    import traceback

    from moelab.train.callbacks import Interrupted

    forget_split_runs()  # a split met in an earlier call of this process starts over
    try:
        with _stop_between_runs():
            train(preset, work)
    except ProbeDone as e:
        say(f"study {number}, split call: {e}")
    except GridIncomplete as e:
        if probe_steps() is not None:  # a grid the named runs need is incomplete: they cannot be configured yet
            say(f"study {number}, split call: probed {', '.join(probed_runs()) or 'nothing'} (nothing recorded); "
                f"the other named runs not reached: {e}")
        else:
            say(f"study {number}, split call: {e}; when every run is recorded, `make study-{number} "
                f"PRESET={preset}` trains what is missing and writes the report")
    except (Interrupted, KeyboardInterrupt) as e:
        signum = getattr(e, "signum", None) or signal.SIGINT
        raise StudyStopped(f"study {number} stopped by {signal.Signals(signum).name}: finished runs are recorded in "
                           f"{_shown(records)}/ and the stopped run saved its checkpoint; `{command}` resumes",
                           signum) from None
    except Exception as e:  # noqa: BLE001 (the traceback, then one line naming the study)
        say(traceback.format_exc().rstrip())
        first = str(e).splitlines()[0][:300] if str(e) else ""
        raise StudyFailed(f"study {number}, split call: {type(e).__name__}: {first} (the traceback above; a run's "
                          f"training output: checkpoints/<arm>-s<seed>/train.log under {_shown(work)}/)") from e
    else:
        say(f"study {number}, split call: every run of the study is recorded in {_shown(records)}/; "
            f"`make study-{number} PRESET={preset}` writes the report")
    if run is not None:
        gpu_minutes = _gpu_minutes(records)
        if gpu_minutes is not None:
            run.log_metrics({"study/gpu_minutes": gpu_minutes}, step=0)
    return out_dir


def split_groups(runs: str | None, shard: str | None, jobs: int) -> list[tuple[str | None, str | None]]:
    """The ``(runs, shard)`` of each of ``jobs`` split calls that together train what ``runs`` or ``shard`` names:
    the named runs dealt round-robin (no empty call: at most one call per run), or shard ``i/n`` as the shards
    ``(i + j*n)/(n*jobs)``, j = 0..jobs-1."""
    if runs:
        parse_runs(runs)
        items = list(dict.fromkeys(t.strip() for t in runs.split(",") if t.strip()))
        return [(",".join(items[j::jobs]), None) for j in range(min(jobs, len(items)))]
    if not shard:
        raise ValueError("jobs > 1 needs runs or shard (a split call)")
    i, n = parse_shard(shard)
    return [(None, f"{i + j * n}/{n * jobs}") for j in range(jobs)]


def _run_split_jobs(number: int, preset: str, groups: list[tuple[str | None, str | None]], *, nbs_dir: Any,
                    out_root: Any, module: str | ModuleType | None, say: Any, probe: int | None = None) -> Path:
    """Run each group of :func:`split_groups` as its own split call in a child process, all at once on this
    machine's GPU; their lines come here prefixed ``[j/k]``. Returns the report's folder; StudyStopped when a
    signal stopped them, StudyFailed when a child failed (the others finish first)."""
    import subprocess

    _, out_dir = _report_folder(number, preset, nbs_dir, out_root)
    code = _code_state()
    k = len(groups)
    base = f"make study-{number} PRESET={preset}"
    command = f"{base} JOBS={k}"
    if tracking_installed():
        say(f"study {number}, split call in {k} processes: their runs train untracked (one MLflow store, {k} "
            f"writers); the final call (`make study-{number} PRESET={preset}`) logs them from their records")
    env = {**os.environ, GIT_ENV: json.dumps(code), GPU_SHARE_ENV: str(k), SPLIT_UNTRACKED_ENV: "1",
           "PYTHONUNBUFFERED": "1"}
    name = module.__name__ if isinstance(module, ModuleType) else module
    children: list[tuple[str, Any]] = []
    stopped: list[int] = []

    def pump(tag: str, stream: Any) -> None:
        for line in stream:
            say(f"{tag} {line.rstrip()}")

    interrupted: list[str] = []  # the groups still training when a signal came

    def handler(signum: int, frame: Any) -> None:
        stopped.append(signum)
        for tag, proc in children:
            if proc.poll() is None:
                interrupted.append(tag)
                proc.send_signal(signum)

    threads = []
    # probes meet after their first logging window so that they are timed together (common.PROBE_BARRIER_ENV)
    meet = tempfile.mkdtemp(prefix="moelab-probe-") if probe is not None else None
    counts = [len(runs.split(",")) for runs, _ in groups] if all(runs for runs, _ in groups) else None
    with signal_handlers(handler) if threading.current_thread() is threading.main_thread() else nullcontext():
        for j, (runs, shard) in enumerate(groups, 1):
            args = {"number": number, "preset": preset, "runs": runs, "shard": shard, "module": name, "probe": probe,
                    "nbs_dir": str(nbs_dir) if nbs_dir else None, "out_root": str(out_root) if out_root else None}
            tag = f"[{j}/{k}]"
            say(f"{tag} {base} " + (f"RUNS={runs}" if runs else f"SHARD={shard}"))
            child_env = env if meet is None else {**env, PROBE_BARRIER_ENV: json.dumps({"dir": meet, "job": j,
                                                                                      "runs": counts})}
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(args)], env=child_env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # a signal reaches them once: forwarded from here
            children.append((tag, proc))
            t = threading.Thread(target=pump, args=(tag, proc.stdout), daemon=True)
            t.start()
            threads.append(t)
        codes = [proc.wait() for _, proc in children]
        for t in threads:
            t.join(timeout=10)
    if meet is not None:
        shutil.rmtree(meet, ignore_errors=True)
    if stopped and not interrupted:  # every process had finished: the signal stopped nothing
        say(f"study {number}: {signal.Signals(stopped[0]).name} came after every process of the split call had "
            "finished: nothing was stopped")
    elif stopped:
        groups_ = sorted(set(interrupted))
        raise StudyStopped(f"study {number} stopped by {signal.Signals(stopped[0]).name}: finished runs are recorded "
                           f"in {_shown(records_dir(out_dir, preset))}/; {', '.join(groups_)} "
                           f"{'was' if len(groups_) == 1 else 'were'} still training and saved "
                           f"{'its' if len(groups_) == 1 else 'their'} checkpoint; `{command}` with the same runs "
                           "resumes", stopped[0])
    failed = [f"{tag} (exit {c})" for (tag, _), c in zip(children, codes) if c != 0]
    if failed:
        raise StudyFailed(f"study {number}, split call in {k} processes: {', '.join(failed)} failed (its lines above)")
    return out_dir


# A child of _run_split_jobs: one split call in this process, its exit status the CLI's.
_CHILD = """
import json, sys
from moelab.studies.runner import StudyFailed, StudyStopped, run_study
a = json.loads(sys.argv[1])
try:
    run_study(a["number"], a["preset"], runs=a["runs"], shard=a["shard"], module=a["module"], nbs_dir=a["nbs_dir"],
              out_root=a["out_root"], probe=a["probe"], echo=lambda line: print(line, flush=True))
except StudyStopped as e:
    print(f"stopped: {e}", flush=True)
    sys.exit(128 + e.signum)
except StudyFailed as e:
    print(f"error: {e}", flush=True)
    sys.exit(1)
"""


@contextmanager
def _stop_between_runs() -> Iterator[None]:
    """While a split call trains, SIGTERM (and Ctrl-C) outside a run's training stops the call at once as
    :class:`StudyStopped` (inside a run, ``moelab.train.fit`` owns the signals: it finishes the step and saves)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise StudyStopped("", signum)

    with signal_handlers(handler):
        yield


def dashboard_link(experiment_id: str, port: int = 5000) -> str:
    """The MLflow UI's runs table of an experiment in its training view (MLflow 3.17 opens its GenAI view
    on a link without ``workflowType``)."""
    return f"http://127.0.0.1:{port}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    path = path.resolve()
    return path.relative_to(repo_root()).as_posix() if path.is_relative_to(repo_root()) else str(path)


def failed_notebook(executed: Path) -> Path:
    """Where a failed run's executed notebook goes: ``NN_name.failed.ipynb`` beside the report's ``NN_name.ipynb``."""
    return executed.with_name(f"{executed.stem}.failed{executed.suffix}")


def _failure_line(number: int, e: Any, executed: Path) -> str:
    """One line for a failed cell: which cell (1-based, with its first source line), the error, where to look."""
    first = next((ln.strip() for ln in (e.source or "").splitlines() if ln.strip() and not ln.startswith("#")), "")
    cell = f"cell {e.cell_index + 1}" if e.cell_index is not None else "a cell"
    error = str(e.evalue).splitlines()[0][:320] if e.evalue else ""
    return (f"study {number}: {cell} ({first[:60]!r}) raised {e.ename}: {error}; the executed notebook with "
            f"the traceback: {_shown(executed)} (results so far kept beside it)")


def _close_stale(state: Path, tracking_uri: str, say: Any) -> None:
    """Close the previous call's parent run and its children if a ``kill -9`` left them RUNNING."""
    data = _read_json(state)
    if not isinstance(data, dict) or not data.get("run_id"):
        return
    uri = tracking_uri or data.get("tracking_uri") or ""
    try:
        from moelab.tracking import client

        mc = client(uri)
        parent = mc.get_run(data["run_id"])
        if parent.info.status != "RUNNING":
            return
        children = mc.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                                "and attributes.status = 'RUNNING'")
    except Exception:  # noqa: BLE001 (a store that is gone leaves nothing to close)
        return
    closed = [r.info.run_id for r in children if end_stale_run(r.info.run_id, uri)]
    if end_stale_run(parent.info.run_id, uri):
        closed.append(parent.info.run_id)
    if closed:
        say(f"closed {len(closed)} MLflow run(s) left RUNNING by a process that was killed (now KILLED)")


# What a run's kernel raises when a stop ends it cleanly (training saved last.ckpt, then raised Interrupted); any other
# error of a stopped kernel is shown, not dropped with its notebook
CLEAN_STOPS = ("Interrupted", "KeyboardInterrupt")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colours, cursor moves and shows


class _Stopper:
    """While entered, Ctrl-C and SIGTERM are passed on to the notebook's kernel as Ctrl-C (training there
    stops cleanly at the end of its step and saves), and remembered in ``signum``. A third signal stops
    this process at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._handlers = ExitStack()

    def __enter__(self) -> _Stopper:
        if threading.current_thread() is threading.main_thread():
            self._handlers.enter_context(signal_handlers(self._handle))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handlers.close()

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1
        if self.count >= 3:
            raise KeyboardInterrupt
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        again = "again to stop at once" if self.count == 1 else "once more to abandon it"
        print(f"\n{what}: stopping the run in progress after its step (it saves a checkpoint); {again}",
              file=sys.stderr, flush=True)
        for pid in _kernel_pids():
            try:
                os.kill(pid, signal.SIGINT)
            except OSError:
                pass


def _kernel_pids() -> list[int]:
    """Process ids of this process's Jupyter kernels (its descendants running ``ipykernel``), not the processes a
    kernel forked: a DataLoader worker carries its kernel's command line, and a Ctrl-C sent to it ends the worker
    mid-batch, so the run fails instead of stopping at the end of its step with a checkpoint."""
    import psutil

    found: dict[int, int] = {}  # pid -> parent pid
    for child in psutil.Process().children(recursive=True):
        try:
            if any("ipykernel" in part for part in child.cmdline()):
                found[child.pid] = child.ppid()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return [pid for pid, parent in found.items() if parent not in found]


@contextmanager
def _echo_lines(path: Path, say: Any, every_s: float = 0.5) -> Iterator[None]:
    """Echo the lines appended to ``path`` (the kernel's progress lines) through ``say`` while the block runs."""
    done = threading.Event()

    def follow() -> None:
        pos = 0
        while True:
            stop = done.wait(every_s)
            try:
                with open(path, "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                chunk = b""
            complete = chunk[:chunk.rfind(b"\n") + 1]
            pos += len(complete)
            for line in complete.decode("utf-8", "replace").splitlines():
                say(line)
            if stop:
                return

    thread = threading.Thread(target=follow, name="study-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


# What a study needs after its notebook ran, imported before it runs: a missing one would otherwise end
# an hour of training at the HTML export, with the parent run FAILED and nothing logged.
REQUIRED_MODULES = ("papermill", "nbformat", "nbconvert", "latex2mathml", "mlflow", "psutil")


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
            f"this interpreter cannot import: {LAB_EXTRA_HINT}; nothing was run")


# Cell tags of a study notebook: a cell tagged ``research`` belongs to the research tier's report, one tagged
# ``quick`` to the cpu/gpu presets' report; the executed notebook keeps only the cells of the preset it ran.
RESEARCH_TAG, QUICK_TAG = "research", "quick"


def _tier_cells(cells: list[Any], preset: str) -> list[Any]:
    """The cells a report of ``preset`` shows: those tagged for the other tier (:data:`RESEARCH_TAG`,
    :data:`QUICK_TAG`) left out."""
    other = QUICK_TAG if preset == "research" else RESEARCH_TAG
    return [c for c in cells if other not in c.get("metadata", {}).get("tags", [])]


def _finish_notebook(executed: Path, notebook: Path, preset: str) -> None:
    """The executed notebook as a report: the other tier's cells left out (:func:`_tier_cells`), papermill's input
    and output paths relative to the repository (no machine paths in a committed notebook):
    ``nbs/NN_name.ipynb`` and ``studies/NN_name/NN_name.ipynb``."""
    if not executed.exists():
        return
    import nbformat

    nb = nbformat.read(executed, as_version=4)
    nb.cells = _tier_cells(nb.cells, preset)
    meta = nb.metadata.get("papermill")
    if meta is not None:
        root = repo_root()
        for key, path in (("input_path", notebook), ("output_path", executed)):
            path = path.resolve()
            meta[key] = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.name
    with atomic_path(executed) as tmp:
        nbformat.write(nb, tmp)


def export_html(notebook: Path) -> Path | None:
    """Write ``notebook`` as a standalone HTML page beside it (figures embedded); None if it does not exist.

    Formulas (``$...$``, ``$$...$$`` in Markdown cells and Markdown outputs) become MathML, which browsers
    render without any script, and every script the template loads from the network (MathJax, require.js)
    is left out: the page renders offline.
    """
    if not notebook.exists():
        return None
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = math_to_mathml(cell.source)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/markdown" in data:
                text = data["text/markdown"]
                data["text/markdown"] = math_to_mathml("".join(text) if isinstance(text, list) else text)
    extra = os.pathsep.join(_jupyter_data_dirs())
    path = os.pathsep.join(p for p in (extra, os.environ.get("JUPYTER_PATH", "")) if p)
    with _environ({"JUPYTER_PATH": path} if extra else {}):
        body, _ = HTMLExporter().from_notebook_node(nb)
    out = notebook.with_suffix(".html")
    with atomic_path(out) as tmp:
        tmp.write_text(strip_remote_scripts(body), encoding="utf-8")
    return out


_DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
# inline: within a paragraph, so a soft line break may fall inside the formula (a blank line may not)
_INLINE_MATH = re.compile(r"(?<![\\$\w])\$(?=\S)((?:[^$\n]|\n(?![ \t]*\n))+?)(?<=\S)\$(?![\w$])")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# A script tag that loads anything from the network: by its src, or by an import inside (mermaid's loader).
_REMOTE_SCRIPT = re.compile(r"<script\b[^>]*\bsrc=\"(?:https?:)?//[^\"]*\"[^>]*>\s*</script>"
                            r"|<script\b[^>]*>(?:(?!</script>).)*?import\(\"https?://(?:(?!</script>).)*?</script>",
                            re.S | re.I)
_MATHJAX_CONFIG = re.compile(r"<script type=\"text/x-mathjax-config\">.*?</script>|<!--[^>]*mathjax[^>]*-->",
                             re.S | re.I)


def math_to_mathml(markdown: str) -> str:
    """Markdown with its TeX formulas as MathML (``<math>``; ``display="block"`` for ``$$...$$``).

    Code spans are left alone; a formula latex2mathml cannot read stays as ``<code>`` with its TeX.
    """
    try:
        from latex2mathml.converter import convert
    except ImportError as e:
        raise ModuleNotFoundError("the HTML export needs latex2mathml (formulas that render offline): install "
                                  "the lab extra, pip install 'moelab[lab]' (make setup)") from e

    def mathml(tex: str, display: str) -> str:
        try:
            return convert(tex.strip(), display=display).replace("\n", "")
        except Exception:  # noqa: BLE001 (the converter raises many kinds of errors on TeX it does not know)
            return f"<code>{tex.strip()}</code>"

    def math(text: str) -> str:
        text = _DISPLAY_MATH.sub(lambda m: "\n\n" + mathml(m.group(1), "block") + "\n\n", text)
        return _INLINE_MATH.sub(lambda m: mathml(m.group(1), "inline"), text)

    parts, last = [], 0
    for m in _CODE_SPAN.finditer(markdown):
        parts += [math(markdown[last:m.start()]), m.group(0)]
        last = m.end()
    return "".join(parts) + math(markdown[last:])


def strip_remote_scripts(html: str) -> str:
    """``html`` without scripts that load from the network (``src="http..."`` or an import from a CDN inside)
    and without MathJax's configuration block."""
    return _MATHJAX_CONFIG.sub("", _REMOTE_SCRIPT.sub("", html))


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


def _log_results(run: Run, out_dir: Path, executed: Path, records: Path) -> None:
    """The executed notebook, its HTML, the summary as one table artifact (``summary_table.json``: ``key``,
    ``value``) and the figures and results, as artifacts of the parent run; the study's GPU minutes as a metric."""
    if executed.exists():
        run.log_artifact(executed)
    summary = _read_json(out_dir / "summary.json")
    if isinstance(summary, dict):
        flat = flatten_dict(summary)
        rows = {"key": list(flat), "value": [v if isinstance(v, (int, float, str, bool)) or v is None else json.dumps(v)
                                             for v in flat.values()]}
        run.attempt("uploading summary_table.json", run.log_table, rows, "summary_table.json")
    gpu_minutes = _gpu_minutes(records)
    if gpu_minutes is not None:
        run.log_metrics({"study/gpu_minutes": gpu_minutes}, step=0)
    for path in sorted(out_dir.iterdir()):
        if path.is_file() and path.suffix in ARTIFACT_SUFFIXES and not path.name.startswith(".") \
                and path.name != STATE_FILE:
            run.log_artifact(path)
        elif path.is_dir() and path.name in ARTIFACT_DIRS:
            run.log_artifact(path, path.name)


def _gpu_minutes(records: Path) -> float | None:
    """GPU minutes summed over the run records in ``records`` (None when there are none)."""
    total, found = 0.0, False
    for path in records.glob("*.json") if records.is_dir() else ():
        data = _read_json(path)
        if isinstance(data, dict):
            total += float(data.get("timing", {}).get("gpu_minutes") or 0.0)
            found = True
    return round(total, 3) if found else None


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it is missing or not JSON (it is still logged as an artifact)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
