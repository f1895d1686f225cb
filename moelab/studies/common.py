"""The study harness: a grid of arms x seeds from one preset, tracked, resumable, splittable, summarized one way.

A study names a base preset and its arms, each a dict of ``--set``-style overrides
(``{"bounded": {"model.kda.gate": "bounded"}, "softplus": {"model.kda.gate": "softplus"}}``), and
calls :func:`run_grid`. For every (arm, seed) it

* checks first that the arms differ only in their override keys (:func:`check_arms_differ_only`);
* trains ``load_config(base, {**common, **arm, "seed": seed})`` with ``moelab.train.fit`` as a
  nested MLflow run of the study's parent run, named ``<arm>/s<seed>``, with ``study.arm``
  and ``study.seed`` as params and ``moelab.arm`` / ``moelab.seed`` as tags, and the same
  ``study/*`` metric names for every arm;
* sends the training's console output (progress, Lightning and data messages) to
  ``<out_dir>/checkpoints/<arm>-s<seed>/train.log`` and prints one line when the run ends (arm,
  seed, steps, val loss, time, ETA of the study), also to the runner's terminal;
* with ``evaluate``, measures the trained model inside the training process, when training ends
  (no checkpoint is read back, no model rebuilt);
* with ``monitor=(n, fn)``, measures the model being trained every ``n`` optimizer steps, in the training
  process (``fn(model, cfg) -> dict`` under ``torch.no_grad`` in eval mode, train mode restored after):
  the run's **trajectory** (``RunRecord.trajectory``, :meth:`Grid.trajectories`), kept in its record;
* leaves the finished run as a small portable **record** (:data:`RECORD_FORMAT`):
  ``<records>/<arm>_s<seed>.json`` (config, code state, summary, curves, timings, machine, GPU
  minutes; no checkpoint) and, with ``evaluate``, ``<arm>_s<seed>.evals.pt`` beside it. A rerun with
  the same config and source code (:func:`source_sha256`, not the commit: records made at an earlier
  commit of the same code still count; or, inside :func:`pinned`, the same **source pin**, a study
  preset's training-code epoch, whatever else changed in ``moelab``) reads the record instead of training,
  wherever the record was made; a record made elsewhere is logged into this MLflow experiment once, with its
  original timings and machine (a run trained where MLflow could not be imported, untracked, is logged
  this way by the final call). A run stopped by Ctrl-C / SIGTERM resumes from its ``last.ckpt`` on the next call.

A study can be split across processes and machines (``make study-N RUNS=arm:seed,...`` or
``SHARD=i/n``, which set :data:`RUNS_ENV` / :data:`SHARD_ENV`): each split call trains only its runs,
writes their records and stops the notebook at the first grid that is still incomplete
(:class:`GridIncomplete`); the final call without a split finds every record and trains only what is missing.

Results come back as a :class:`Grid`: one row per run (:meth:`Grid.table`), mean +- spread over seeds
(:func:`aggregate`), one loss-curve style (:func:`loss_curves`), and :func:`study_meta` for the
``meta`` block every ``summary.json`` carries. :func:`show` turns a matplotlib Figure into an
image that Jupyter renders (Figures built without pyplot have no inline display of their own).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from moelab import provenance
from moelab.base import repo_root
from moelab.utils import atomic_path, write_json

# Runner -> kernel: what the notebook cannot know by itself (its command line, when the study began,
# the code state before the study wrote anything into the checkout).
COMMAND_ENV = "MOELAB_STUDY_COMMAND"
STARTED_ENV = "MOELAB_STUDY_STARTED"
GIT_ENV = "MOELAB_STUDY_GIT"
RECORDS_ENV = "MOELAB_STUDY_RECORDS"  # the folder of the portable run records
RUNS_ENV = "MOELAB_STUDY_RUNS"  # "arm:seed,arm:seed": a split call trains only these runs
SHARD_ENV = "MOELAB_STUDY_SHARD"  # "i/n": a split call trains runs i, i + n, ... (1-based) of each grid
PROGRESS_ENV = "MOELAB_STUDY_PROGRESS"  # a file whose lines the runner echoes to its terminal
# How many runs train at once on this process's GPUs (a split call's ``jobs``): a record's GPU-minutes are its
# wall time's share of the devices, and its tokens/s, measured on a shared device, is not a speed.
GPU_SHARE_ENV = "MOELAB_GPU_SHARE"
# "n": a split call probes its named runs instead of training them: n optimizer steps each in a scratch folder, no
# record, no MLflow; one line per run with its step time and what the whole run would take (probe.json beside them)
PROBE_ENV = "MOELAB_STUDY_PROBE"
# A jobs call's probes (JSON ``{"dir", "job", "runs"}``, set by moelab.studies.runner for each process): each probe
# waits for the others' after its first logging window, so the windows it is timed on run while the GPU is shared.
# Without it a short probe is timed mostly alone (the other process still starting) and promises a shared speed
# that the runs do not reach together.
PROBE_BARRIER_ENV = "MOELAB_PROBE_BARRIER"
PROBE_BARRIER_S = 180.0  # the longest a probe waits for the others (a process that failed never arrives)
# "1": this process's runs train untracked even where MLflow imports (a split call's jobs: k processes would write
# one store at once, without the parent run they nest under); the final call logs them from their records
SPLIT_UNTRACKED_ENV = "MOELAB_SPLIT_UNTRACKED"
PROBE_MIN_STEPS = 10
OUTPUTS = provenance.OUTPUTS  # what studies and benchmarks write: its changes do not make the code dirty
RECORD_FORMAT = 2  # version of the record files' layout (2: columnar history without per-layer keys; 1 still reads)
READ_FORMATS = (1, 2)
# History keys a record leaves out: the per-layer copies of a metric (``balance/maxvio_batch/L3``), whose mean over
# layers it keeps (``balance/maxvio_batch``): at ~40 of them per step they made a 700-step record 1.5 MB.
LAYER_KEY = re.compile(r"/L\d+$")


def _pack_history(history: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """``history`` as a record keeps it: ``{"columns": [...], "rows": [[...], ...]}`` without per-layer keys,
    floats to 6 significant digits (what the tables and figures read, at a tenth of the size); a key a step
    lacks as None, a non-finite value as the string ``"nan"`` / ``"inf"`` / ``"-inf"``."""
    columns = list(dict.fromkeys(k for row in history for k in row if not LAYER_KEY.search(k)))

    def cell(v: Any) -> Any:
        if isinstance(v, float):
            return float(f"{v:.6g}") if math.isfinite(v) else str(v)
        return v

    return {"columns": columns, "rows": [[cell(row.get(k)) for k in columns] for row in history]}


def _unpack_history(packed: Any) -> list[dict[str, float]]:
    """The per-step dicts of a packed history (format 2; a format-1 list passes through)."""
    if isinstance(packed, list):
        return packed
    cols = packed["columns"]
    return [{k: (float(v) if isinstance(v, str) else v) for k, v in zip(cols, row) if v is not None}
            for row in packed["rows"]]

# Console lines that carry no information for a study reader. Filtered where they are emitted
# (quiet_known_noise) and looked for in executed notebooks by the tests.
_LIGHTNING_LINES = (  # Lightning's rank-zero log messages
    r"GPU available: ",
    r"TPU available: ",
    r"HPU available: ",
    r"litlogger",
    r"`Trainer\.fit` stopped: `max_steps=",
)
_WARNINGS = (  # warnings.warn messages
    r"LeafSpec",  # torch's FutureWarning, raised from inside Lightning
    r"IProgress not found",  # tqdm.auto imported in a Jupyter kernel without ipywidgets (Lightning imports it)
)
KNOWN_NOISE = (r"INFO mlflow\.", *_LIGHTNING_LINES, *_WARNINGS)
_LIGHTNING_NOISE = re.compile("|".join(_LIGHTNING_LINES))
# Absolute paths of one machine: meaningless in a committed report, and they leak the machine.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|tmp|root|Users|mnt|opt|usr|private|var/folders)/")

# run_grid's evaluate: (the trained MoELab, its RunConfig[, trainer=the Lightning Trainer]) -> results kept beside
# the run's record
Evaluate = Callable[..., dict[str, Any]]
# run_grid's monitor: (every n optimizer steps, fn(the MoELab being trained, its RunConfig) -> JSON-able dict)
Monitor = tuple[int, Callable[[Any, Any], dict[str, Any]]]

STUDY_METRICS = ("best_val_loss", "final_val_loss", "final_train_loss", "train_val_gap", "epochs")


# ------------------------------------------------------------------------------------------ quiet


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _LIGHTNING_NOISE.search(record.getMessage())


_NOISE_FILTER = _DropNoise()


def quiet_known_noise() -> None:
    """Silence the known noise at its source, for this process (idempotent).

    MLflow's INFO messages (database setup, system-metrics monitor start/stop), Lightning's
    accelerator inventory and litlogger advertisement, the end-of-fit ``max_steps`` notice,
    torch's ``LeafSpec`` FutureWarning raised from inside Lightning, and tqdm's "IProgress not
    found" warning (a kernel without ipywidgets, as on the GPU machines: tqdm falls back to its
    text bar). Other warnings and errors pass. A notebook calls it before anything imports
    Lightning (which imports ``tqdm.auto``, where that warning is raised once).
    """
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow configures its loggers
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning_utilities.core.rank_zero"):
        logger = logging.getLogger(name)
        if _NOISE_FILTER not in logger.filters:
            logger.addFilter(_NOISE_FILTER)
    warnings.filterwarnings("ignore", message=r".*LeafSpec", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"IProgress not found")


@contextlib.contextmanager
def output_to(path: str | os.PathLike) -> Iterator[None]:
    """Send this process's Python-level console output (print, warnings, logging) to ``path`` (appended).

    Logging handlers hold the stream they were created with (often the notebook's own), so each
    console ``StreamHandler`` is pointed at the file for the block and back afterwards; handlers
    created inside the block (bound to the file) are pointed at the console the block started with.
    """
    import sys

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    console = sys.stderr
    with open(path, "a", encoding="utf-8", buffering=1) as f:
        moved = [(h, h.stream) for h in _stream_handlers()]
        for h, _ in moved:
            h.stream = f
        try:
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f), _plain_rich(f):
                yield
        finally:
            for h, old in moved:
                h.stream = old
            for h in _stream_handlers():
                if h.stream is f:
                    h.stream = console


@contextlib.contextmanager
def _plain_rich(stream: Any) -> Iterator[None]:
    """Make rich (Lightning's progress bar) write plain text to ``stream``: no widget, no cursor codes.

    Inside a Jupyter kernel rich draws its live display as a widget in the running cell, and on a
    terminal it redraws with cursor movements: in a log file either is noise. rich's global console
    (what Lightning's bar uses) is replaced for the block by one that is neither a terminal nor Jupyter
    nor interactive, so the bar writes its final state once.
    """
    try:
        import rich
        import rich.console
    except ImportError:
        yield
        return
    saved, saved_console = rich.console._is_jupyter, rich._console
    rich.console._is_jupyter = lambda: False
    rich._console = rich.console.Console(file=stream, force_terminal=False, force_jupyter=False,
                                         force_interactive=False, no_color=True, width=120)
    try:
        yield
    finally:
        rich.console._is_jupyter, rich._console = saved, saved_console


def _stream_handlers() -> list[logging.StreamHandler]:
    """Every console-like ``StreamHandler`` of every logger (files and ``logging.lastResort`` left out)."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values()
                                      if isinstance(lg, logging.Logger))]
    # logging.lastResort's stream is a read-only property that follows sys.stderr by itself.
    return [h for lg in loggers for h in lg.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and not isinstance(getattr(type(h), "stream", None), property)]


# ---------------------------------------------------------------------------------- code and host


def git_state(exclude: Sequence[str] = OUTPUTS) -> dict[str, Any]:
    """``{"commit", "dirty", "diff_sha256"}`` of the checkout; tracked files only, ``exclude`` paths left out
    (default :data:`OUTPUTS`: what studies and benchmarks write does not make the code dirty).

    ``moelab.provenance.git_state`` (the one code-state helper of benchmarks and studies) on this checkout.
    """
    return provenance.git_state(repo_root(), exclude)


def source_sha256() -> str:
    """16 hex digits hashing the moelab package's source (every ``.py`` and ``.yaml`` under it, by path).

    The code part of a run's fingerprint: unlike the commit it stays the same across commits that
    change only outputs, docs or records, and it needs no ``.git`` (a copied tree on a GPU machine).
    """
    import moelab

    pkg = Path(moelab.__file__).parent
    h = hashlib.sha256()
    for path in sorted(p for p in pkg.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts):
        h.update(path.relative_to(pkg).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


_PINS: list[str | None] = []  # the source pins of the enclosing ``pinned`` blocks, innermost last


@contextlib.contextmanager
def pinned(pin: str | None) -> Iterator[None]:
    """Inside the block, :func:`run_grid` pins its runs' code to ``pin`` (None: no pin, the package hash counts).

    A study's ``train(preset, out_dir)`` wraps its grids in ``pinned(<the preset's source_pin>)``. A pin is a
    training-code epoch (``"s1research-1"``): a record counts while its config and its pin match, whatever else
    changed in ``moelab`` since it was made, so split calls over several sessions and commits still add up to one
    study. The record keeps the pin and the real package hash (``code.source_pin``, ``code.source_sha256``).
    Bump the pin when a change alters what training computes (studies/README.md).
    """
    _PINS.append(_checked_pin(pin))
    try:
        yield
    finally:
        _PINS.pop()


def _checked_pin(pin: Any) -> str | None:
    if pin is not None and (not isinstance(pin, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", pin)):
        raise ValueError(f"source_pin={pin!r} is not allowed: expected None or 1-64 letters, digits, '.', '_', '-' "
                         "(e.g. 's1research-1')")
    return pin


def current_pin() -> str | None:
    """The source pin of the innermost :func:`pinned` block (None outside one)."""
    return _PINS[-1] if _PINS else None


def device_name() -> str:
    """The CUDA device's name, else the CPU model and its core count (:func:`moelab.provenance.device`)."""
    from moelab.provenance import device

    return device()


def _versions() -> dict[str, str | None]:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton_version}


def study_context(study: str) -> dict[str, Any]:
    """Command, start time and code state of the running study: from the runner, else from here and now."""
    git = json.loads(os.environ[GIT_ENV]) if os.environ.get(GIT_ENV) else git_state()
    return {"command": os.environ.get(COMMAND_ENV) or "interactive (notebook run by hand)",
            "started": float(os.environ.get(STARTED_ENV) or _IMPORTED_AT), "git": git}


_IMPORTED_AT = time.time()


def measured_commit(path: str | os.PathLike, needle: str | None = None) -> dict[str, str | None]:
    """Which code produced a committed result file (or one value in it): ``{"commit", "how"}``.

    ``meta.commit`` inside the file when it records one; else the commit named in the message of the
    commit that added ``needle`` to the file (a value's exact text, for files whose rows were
    measured at different times), or of the last commit that changed the file
    (``"... results at 730381e"``, ``"(commit e95d6c9)"``); else that commit itself. ``how`` says which.
    """
    path = Path(path)
    try:
        meta = json.loads(path.read_text()).get("meta", {})
    except (OSError, json.JSONDecodeError, AttributeError):
        meta = {}
    if isinstance(meta, dict) and meta.get("commit"):
        return {"commit": str(meta["commit"])[:12], "how": "recorded in the file"}
    try:
        rel = path.resolve().relative_to(repo_root()).as_posix()
        pick = [f"-S{needle}"] if needle else []  # the latest commit that changed its count: the one that added it
        # --follow: a file moved by a pure rename keeps the commits that measured it
        line = subprocess.run(["git", "log", "-1", "--follow", *pick, "--format=%h %s", "--", rel], cwd=repo_root(),
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return {"commit": None, "how": "not in git"}
    if not line:
        return {"commit": None, "how": "not committed"}
    sha, subject = line.split(" ", 1) if " " in line else (line, "")
    what = "added the value" if needle else "last changed the file"
    named = re.search(r"\b(?:at|commit)\s+([0-9a-f]{7,40})\b", subject)
    if named:
        return {"commit": named.group(1), "how": f"named by the message of {sha}, which {what}"}
    return {"commit": sha, "how": f"the commit that {what}"}


# ------------------------------------------------------------------------------------------- arms


def resolve_arms(base: str, arms: Mapping[str, Mapping[str, Any]], common: Mapping[str, Any] | None = None,
                 seed: int = 0) -> dict[str, Any]:
    """``{arm: RunConfig}`` of ``load_config(base, {**common, **overrides, "seed": seed})``."""
    from moelab.config import load_config

    if not arms:
        raise ValueError("arms is empty: a study needs at least one arm")
    return {arm: load_config(base, {**(common or {}), **ov, "seed": seed}) for arm, ov in arms.items()}


def check_arms_differ_only(base: str, arms: Mapping[str, Mapping[str, Any]],
                           common: Mapping[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Check that the resolved configs of the arms differ only in the factor studied.

    The factor is the set of keys that every arm overrides. Returns ``{key: {arm: value}}`` for each
    key whose value differs between arms, to show in the study. Raises ValueError naming any other
    differing key (one arm overriding something the others leave at the preset's value, or a
    validation rule that changed a field), or two arms that resolve to the same config.
    """
    from moelab.config import flatten

    flat = {arm: flatten(cfg) for arm, cfg in resolve_arms(base, arms, common).items()}
    names = list(flat)
    keys = set().union(*(f.keys() for f in flat.values()))
    differing = {k: {a: flat[a].get(k) for a in names} for k in sorted(keys)
                 if len({json.dumps(flat[a].get(k), sort_keys=True, default=str) for a in names}) > 1}
    allowed = set.intersection(*(set(ov) for ov in arms.values()))
    extra = sorted(set(differing) - allowed)
    if extra:
        raise ValueError(f"arms {names} of {base!r} differ in {extra} besides the factor studied "
                         f"{sorted(allowed)} (the keys every arm sets): {({k: differing[k] for k in extra})}")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if flat[a] == flat[b]:
                raise ValueError(f"arms {a!r} and {b!r} resolve to the same config of {base!r}: "
                                 f"overrides {dict(arms[a])} and {dict(arms[b])}")
    return differing


# ------------------------------------------------------------------------------------------- runs


@dataclass
class RunRecord:
    """One finished (arm, seed) training of a grid, as its record file keeps it.

    history: ``[{"step", "train/loss", ...}]`` per optimizer step (as the record keeps it: no per-layer keys,
    6 significant digits); val_history: ``[[step, val/loss]]``.
    evals: what ``run_grid``'s ``evaluate`` returned for the trained model (kept in
    ``<arm>_s<seed>.evals.pt`` beside the record); None without ``evaluate``.
    timing: ``{"started", "ended"}`` (UTC, ISO), ``wall_s``, ``gpus`` (CUDA devices trained on, 0 on a
    CPU), ``gpu_share`` (runs that trained at once on those devices: a split call's ``jobs``; absent in
    records before it existed, i.e. 1), ``gpu_minutes`` (wall time x gpus / gpu_share / 60) and where the wall time
    went: ``prepare_s`` (the corpus), ``steps_s`` (the steps at the run's median speed), ``evaluate_s`` (``evaluate``)
    and ``fit_other_s`` (the rest: setup, compilation, capture, validations, checkpoints). machine: the device and
    library versions it trained on. code: ``commit``, ``dirty``, ``diff_sha256`` and ``source_sha256`` when it trained,
    and
    ``source_pin`` when its study pinned the training code (:func:`pinned`; the fingerprint then uses the pin).
    mlflow: ``{"run_id", "experiment"}`` of its training's run in the store it trained against.
    trajectory: with ``run_grid``'s ``monitor``, ``[{"step", **fn(model, cfg)}]`` at steps 0, n, 2n, ... and
    the last step (in the record's JSON); None without it.
    skipped: read from its record rather than trained by this call.
    """

    arm: str
    seed: int
    summary: dict[str, Any]
    history: list[dict[str, float]]
    val_history: list[list[float]]
    tokens: int
    epochs: float
    train_val_gap: float | None
    fingerprint: str
    skipped: bool = False
    evals: dict[str, Any] | None = None
    timing: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    code: dict[str, Any] = field(default_factory=dict)
    mlflow: dict[str, Any] = field(default_factory=dict)
    trajectory: list[dict[str, Any]] | None = None

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {"arm": self.arm, "seed": self.seed, "steps": s.get("steps"),
                "best_val_loss": s.get("best_val_loss"), "final_val_loss": s.get("final_val_loss"),
                "final_train_loss": s.get("final_train_loss"), "train_val_gap": self.train_val_gap,
                "tokens": self.tokens, "epochs": self.epochs, "tok_per_s": self.tok_per_s,
                "wall_s": s.get("wall_s"), "gpu_minutes": self.timing.get("gpu_minutes"),
                "gpu_share": self.gpu_share, "run_id": s.get("run_id")}

    @property
    def gpu_share(self) -> int:
        """How many runs trained at once on this run's devices (1: alone; see :data:`GPU_SHARE_ENV`)."""
        return int(self.timing.get("gpu_share") or 1)

    @property
    def tok_per_s(self) -> float | None:
        """Training tokens/s, None when the run shared its GPU with other runs (then it is not a speed)."""
        return self.summary.get("tok_per_s") if self.gpu_share == 1 else None


@dataclass
class Grid:
    """What :func:`run_grid` returns: the records in grid order and the arms' differing config keys.

    complete: False when a split call (``RUNS=`` / ``SHARD=``) left runs of this grid untrained.
    """

    study: str
    base: str
    records: list[RunRecord]
    factor: dict[str, dict[str, Any]] = field(default_factory=dict)
    corpus_tokens: int = 0
    complete: bool = True

    def table(self) -> Any:
        """One row per run (pandas DataFrame): arm, seed, steps, losses, gap, tokens, epochs, speed, GPU minutes,
        run id."""
        import pandas as pd

        return pd.DataFrame([r.row() for r in self.records])

    def histories(self) -> Any:
        """Every run's curves as one long table: arm, seed, step, ``train/loss``, ``val/loss`` (NaN off validations)."""
        import pandas as pd

        frames = []
        for r in self.records:
            h = pd.DataFrame(r.history)[["step", "train/loss"]] if r.history else pd.DataFrame(columns=["step"])
            v = pd.DataFrame(r.val_history, columns=["step", "val/loss"])
            df = h.merge(v, on="step", how="outer").sort_values("step")
            df.insert(0, "seed", r.seed)
            df.insert(0, "arm", r.arm)
            frames.append(df)
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def trajectories(self) -> Any:
        """Every run's monitor trajectory (``run_grid``'s ``monitor``) as one long table: arm, seed, step and
        the monitor's scalar values (its lists and dicts left out: read them from ``RunRecord.trajectory``)."""
        import pandas as pd

        rows = [{"arm": r.arm, "seed": r.seed, **{k: v for k, v in point.items() if not isinstance(v, (list, dict))}}
                for r in self.records for point in (r.trajectory or [])]
        return pd.DataFrame(rows)


# Config keys that say where a run lives or is tracked, not what it computes: left out of its fingerprint and
# record, so a record made on another machine (another checkout path, another store) still counts.
_PLACE_KEYS = ("tracking.", "train.ckpt_dir")


# Config keys added after records were made, each with the value that computes what the code did before the key
# existed: at that value a key is left out of the fingerprint, so adding a field does not retrain every record; at
# any other value it counts (a run that sets it computes something else).
ADDED_KEYS: dict[str, Any] = {"model.norm_backend": "torch", "model.mla.fp32_output_precision": "highest",
                              "model.loss_backend": "torch", "model.residual.launch": ""}


# The fused RMSNorm and loss kernels (``moelab.ops.rms_norm``, ``moelab.ops.linear_ce``: the same math, one pass each
# way) that the GPU quick looks (each study's ``gpu`` preset) train with; "auto" keeps them off a CPU. Not in the
# research tiers, whose records were trained on the torch paths (the keys count in a fingerprint at any other value).
# gpu-small's captured step on an H100: 80.9 -> 71.1 ms with them (1.15x, 95% CI 1.13-1.16, 5 paired rounds; equal
# losses), and one run of each study's gpu tier trained and evaluated with them
# (kernels/results/model_capture_h200.json, H100_gs_norm_loss).
FAST_BACKENDS: dict[str, Any] = {"model.norm_backend": "auto", "model.loss_backend": "auto"}


def _run_config(cfg: Any) -> dict[str, Any]:
    from moelab.config import flatten

    return {k: v for k, v in flatten(cfg).items()
            if not k.startswith(_PLACE_KEYS) and not (k in ADDED_KEYS and v == ADDED_KEYS[k])}


def _fingerprint(cfg: Any, code: Mapping[str, Any]) -> str:
    """16 hex digits over the run's config (places left out) and its code: ``code["source_pin"]`` (a study
    preset's training-code epoch, :func:`pinned`) where given, else ``code["source_sha256"]``
    (:func:`source_sha256`), else the commit and the diff of a :func:`git_state`.

    A pin enters the hash exactly as a ``source_sha256`` of the same text would (``{"source": pin}``): records
    made with ``MOELAB_STUDY_GIT='{..., "source_sha256": "s1research-1"}'`` count under the pin ``s1research-1``.
    """
    source = code.get("source_pin") or code.get("source_sha256")
    what = {"source": source} if source else {"commit": code.get("commit"), "diff": code.get("diff_sha256")}
    payload = {"config": _run_config(cfg), **what}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tail_train_loss(history: Sequence[Mapping[str, float]], window: int) -> float | None:
    """Mean training loss over the last ``window`` steps (the stretch the final validation follows)."""
    tail = [h["train/loss"] for h in history[-max(window, 1):] if math.isfinite(h.get("train/loss", math.nan))]
    return sum(tail) / len(tail) if tail else None


def record_path(records_dir: str | os.PathLike, arm: str, seed: int) -> Path:
    """``<records_dir>/<arm>_s<seed>.json`` (characters other than letters, digits, ``.``, ``-`` as ``_``)."""
    return Path(records_dir) / f"{re.sub(r'[^A-Za-z0-9.-]', '_', arm)}_s{seed}.json"


def _evals_path(record: Path) -> Path:
    return record.with_suffix(".evals.pt")


def _portable(value: Any) -> Any:
    """``value`` with absolute paths inside the repository made relative to it (no machine path in a record)."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        path = Path(value)
        return path.relative_to(repo_root()).as_posix() if path.is_relative_to(repo_root()) else path.name
    return value


_PATH_KEYS = ("last_checkpoint", "best_checkpoint")  # summary entries that are paths


def _load_record(path: Path, fingerprint: str, evals: bool = False, trajectory: bool = False) -> RunRecord | None:
    """The finished run recorded at ``path`` with this fingerprint (and, if ``evals``, its evaluation; if
    ``trajectory``, its monitor trajectory), else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if (data.get("format") not in READ_FORMATS or data.get("fingerprint") != fingerprint
            or data.get("summary", {}).get("status") != "finished" or (trajectory and not data.get("trajectory"))):
        return None
    found = None
    if evals:
        import pickle

        import torch

        try:
            found = torch.load(_evals_path(path), weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            return None
    keep = {f for f in RunRecord.__dataclass_fields__ if f not in ("skipped", "evals")}
    data["history"] = _unpack_history(data.get("history", []))
    rec = RunRecord(**{k: v for k, v in data.items() if k in keep}, skipped=True, evals=found)
    for key in _PATH_KEYS:  # a record keeps repository paths relative: this checkout's path again
        value = rec.summary.get(key)
        if value and not Path(value).is_absolute():
            rec.summary[key] = str(repo_root() / value)
    return rec


def _write_record(path: Path, rec: RunRecord, cfg: Any, study: str, run_id: str | None) -> None:
    """The portable record of a finished run: ``evals.pt`` first, then the JSON (whose presence marks it complete)."""
    if rec.evals is not None:
        import torch

        with atomic_path(_evals_path(path)) as tmp:
            torch.save(rec.evals, tmp)
    rec.mlflow = {"run_id": run_id, "experiment": cfg.experiment}
    body = {"format": RECORD_FORMAT, "study": study,
            **{k: v for k, v in rec.__dict__.items() if k not in ("skipped", "evals")},
            "history": _pack_history(rec.history),
            "config": _run_config(cfg), "command": study_context(study)["command"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, _portable(body), indent=None)  # one line: indented, a 2,400-step history was 0.5 MB, not 0.2
    rec.history = _unpack_history(body["history"])  # as a later call reads it back: one go equals split calls


def wants_trainer(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` takes a ``trainer`` keyword (a parameter of that name; ``**kwargs`` does not count)."""
    try:
        param = inspect.signature(fn).parameters.get("trainer")
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def _round(x: float | None, digits: int = 1) -> float | None:
    return None if x is None else round(x, digits)


def _evaluation_callback(evaluate: Evaluate) -> Any:
    """A Lightning callback that calls ``evaluate(model, cfg)`` once training has reached ``max_steps``.

    The model is the trained ``MoELab`` on its training device, in eval mode, without autograd;
    the result is left in the callback's ``result`` (None when training stopped early). An ``evaluate``
    with a ``trainer`` parameter (:func:`wants_trainer`) also gets the Lightning ``Trainer`` as
    ``trainer=``: its optimizer state (``trainer.optimizers[0].state``), its step, its callbacks.
    """
    import lightning as L
    import torch

    extra = wants_trainer(evaluate)

    class EvaluateAtEnd(L.Callback):
        result: dict[str, Any] | None = None
        seconds: float | None = None  # how long evaluate took (the record's timing.evaluate_s)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.global_step < trainer.max_steps:  # Ctrl-C / SIGTERM: not a finished run
                return
            model, was_training = pl_module.model, pl_module.model.training
            model.eval()
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    self.result = evaluate(model, pl_module.cfg, **({"trainer": trainer} if extra else {}))
            finally:
                model.train(was_training)
                self.seconds = time.perf_counter() - t0

    return EvaluateAtEnd()


def _jsonable(value: Any) -> Any:
    """``value`` with tensors and numpy values as Python numbers and lists (a trajectory lives in the record's JSON)."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # torch.Tensor, numpy array or scalar
        return _jsonable(value.tolist())
    return value


def partial_trajectory(record: Path) -> Path:
    """Where a monitored run keeps the trajectory measured so far while it trains (``<record stem>.trajectory.jsonl``
    beside its record, one point per line): a run stopped before its record is written (a call's time limit) still
    leaves its learning curve in the records folder that the call returns; the finished record replaces it."""
    return record.with_name(f"{record.stem}.trajectory.jsonl")


def _monitor_callback(monitor: Monitor, partial: Path | None = None) -> Any:
    """A Lightning callback that calls ``fn(model, cfg)`` every ``n`` optimizer steps (``monitor = (n, fn)``).

    Measured at step 0 (before the first step), at every multiple of ``n`` and at ``max_steps``, each step
    once (gradient accumulation calls the batch hook per micro-batch). The model is the ``MoELab`` being
    trained, on its device, in eval mode under ``torch.no_grad``; its mode is restored afterwards, so the
    next step trains as it would have. ``fn``'s dict (tensors become lists) goes into ``trajectory`` as
    ``{"step", **result}``; the trajectory is saved in the run's checkpoints (callback state), so a resumed
    run keeps the points measured before it stopped.

    With ``train.compile='graphs'`` ``fn`` runs eagerly between two replays of the captured step, as
    validation does: it reads the weights the graph updates in place and allocates outside the graph's pool.

    With ``partial`` (:func:`partial_trajectory`), the whole trajectory so far is rewritten there after every
    point (a resumed run's earlier points included), one JSON object per line.
    """
    import lightning as L
    import torch

    every, fn = monitor
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"monitor every={every!r} is not allowed: expected an int >= 1 (optimizer steps)")

    class MonitorEvery(L.Callback):
        def __init__(self) -> None:
            self.trajectory: list[dict[str, Any]] = []

        def _measure(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            step = int(trainer.global_step)
            if self.trajectory and self.trajectory[-1]["step"] >= step:
                return
            model, was_training = pl_module.model, pl_module.model.training
            model.eval()
            try:
                with torch.no_grad():
                    result = fn(model, pl_module.cfg)
            finally:
                model.train(was_training)
            self.trajectory.append({"step": step, **_jsonable(result)})
            if partial is not None and trainer.is_global_zero:
                partial.parent.mkdir(parents=True, exist_ok=True)
                tmp = partial.with_name(f".{partial.name}.tmp")
                tmp.write_text("".join(json.dumps(p) + "\n" for p in self.trajectory))
                os.replace(tmp, partial)

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.global_step % every == 0:
                self._measure(trainer, pl_module)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            step = trainer.global_step
            if step % every == 0 or step >= trainer.max_steps:
                self._measure(trainer, pl_module)

        def state_dict(self) -> dict[str, Any]:
            return {"trajectory": list(self.trajectory)}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.trajectory = list(state_dict.get("trajectory", []))

    return MonitorEvery()


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


CPU_GPU_PRESET_ENV = "MOELAB_STUDY_GPU_PRESET_ON_CPU"  # "1": train a GPU preset's missing run on a CPU anyway


class GPURequired(RuntimeError):
    """A study run with no record would train a GPU preset on a machine without CUDA (a research or gpu tier
    rendered on a laptop before all its records came back)."""


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class GridIncomplete(Exception):
    """A split call (``RUNS=`` / ``SHARD=``) trained its runs and stopped the study: runs are still missing.

    ``trained``: the ``arm:seed`` runs this call trained (in every grid it met); ``missing``: those without a record
    in the grids it met; ``where``: the records folder as shown.
    """

    def __init__(self, message: str, trained: Sequence[str] = (), missing: Sequence[str] = (), where: str = "") -> None:
        super().__init__(message)
        self.trained, self.missing, self.where = list(trained), list(missing), where

    @classmethod
    def of(cls, trained: Sequence[str], missing: Sequence[str], where: str, what: str = "this grid") -> GridIncomplete:
        """The one line a split call ends with: what it trained, where the records are, what of ``what`` is left."""
        return cls(f"trained {', '.join(trained) or 'nothing'}; records in {where}; {len(missing)} run(s) of {what} "
                   f"still to train: {', '.join(missing)}", trained, missing, where)


@dataclass(frozen=True)
class Split:
    """Which runs a split call trains: named ``runs`` (``{(arm, seed)}``) or the ``shard`` ``(i, n)``."""

    runs: frozenset[tuple[str, int]] | None = None
    shard: tuple[int, int] | None = None

    def wants(self, index: int, arm: str, seed: int) -> bool:
        """Whether run ``index`` (0-based, grid order) of a grid, ``(arm, seed)``, is this call's to train."""
        if self.runs is not None:
            return (arm, seed) in self.runs
        i, n = self.shard  # type: ignore[misc]
        return index % n == i - 1


def probe_steps() -> int | None:
    """The steps of :data:`PROBE_ENV` (None when unset); ValueError unless a whole number >= PROBE_MIN_STEPS."""
    text = os.environ.get(PROBE_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < PROBE_MIN_STEPS:
        raise ValueError(f"{PROBE_ENV}={text!r} is not allowed: expected a whole number of steps >= {PROBE_MIN_STEPS} "
                         "(the first logging window holds compilation and is left out of the step time)")
    return int(text)


class ProbeDone(GridIncomplete):
    """A probing split call timed its runs (nothing recorded): ``rows`` as :func:`_probe` returns them."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], path: Path) -> None:
        names = [f"{r['arm']}:{r['seed']}" for r in rows]
        super().__init__(f"probed {', '.join(names) or 'nothing'} (nothing recorded); the lines above, and "
                         f"{_shown(path)}", [], [])
        self.rows = list(rows)


_PROBE_ROUND = [0]  # this process's probes so far (a jobs call's barrier pairs the i-th probe of every process)


def _probe_barrier(at: int) -> Any:
    """This probe's ``moelab.train.callbacks.Rendezvous`` after ``at`` steps in a jobs call
    (:data:`PROBE_BARRIER_ENV`), None otherwise: this process's i-th probe waits for the i-th of every process that
    has one (``runs``: each process's count of runs; None, a shard: every process)."""
    text = os.environ.get(PROBE_BARRIER_ENV, "").strip()
    round_ = _PROBE_ROUND[0]
    _PROBE_ROUND[0] += 1
    if not text:
        return None
    spec = json.loads(text)
    counts = spec.get("runs")
    expected = sum(1 for n in counts if n > round_) if counts else gpu_share()
    if expected < 2:
        return None
    from moelab.train.callbacks import Rendezvous

    return Rendezvous(spec["dir"], str(round_), str(spec["job"]), expected, at, PROBE_BARRIER_S)


def _probe(arm: str, seed: int, cfg: Any, root: Path, steps: int, echo: Callable[[str], None]) -> dict[str, Any]:
    """Train ``steps`` optimizer steps of one run's config in ``root/<arm>-s<seed>`` (untracked, no record; warm-up
    and a balancer's start scaled into the probe, one validation at its end) and say what the whole run would take:
    the run's median step time over its logging windows (five; the first, which holds compilation and capture, left
    out, as in every run's summary), times the run's ``max_steps``. Appends the row to ``root/probe.json`` (one JSON
    object per line) and returns it."""
    from moelab.data.curriculum import plan as stage_plan
    from moelab.train import fit

    t = cfg.train
    full = {"max_steps": t.max_steps, "val_every": t.val_every}
    full_stages = probe_stages = None
    log_every = max(1, steps // 5)
    if cfg.data.curriculum:  # the stages scaled into the probe, each its share of the steps
        full_stages = stage_plan(cfg.data.curriculum, t.batch_size, cfg.data.seq_len, t.accumulate_grad_batches,
                                 t.max_steps)
        _scale_curriculum(cfg, steps)
        probe_stages = stage_plan(cfg.data.curriculum, t.batch_size, cfg.data.seq_len, t.accumulate_grad_batches,
                                  steps)
        log_every = max(1, steps // (5 * len(probe_stages)))  # windows enough in every stage to leave its first out
    t.max_steps, t.val_every, t.log_every = steps, steps, log_every
    t.warmup_steps = min(t.warmup_steps, steps // 2)
    t.balancer_start_step = min(t.balancer_start_step, steps // 2)
    cfg.tracking.enabled = False
    run_dir = root / f"{arm}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    t.ckpt_dir = str(run_dir)
    barrier = _probe_barrier(t.log_every)
    t0 = time.perf_counter()
    with output_to(run_dir / "train.log"):
        from moelab.data import prepare

        prepare(cfg.data)
        res = fit(cfg, checkpoints="final", callbacks=[barrier] if barrier else ())
    wall = time.perf_counter() - t0
    s = res.summary
    tokens = int(s["tokens_per_step"])
    # the run's own speed: the median of its logging windows after the first (steps // 5 steps each)
    step_s = tokens / s["tok_per_s"] if s.get("tok_per_s") else wall / steps
    stage_ms = None
    if probe_stages is not None and full_stages is not None:
        # per stage, its steady windows; the run's step time is the mix its own stages make
        per_stage = [v if v is not None else step_s for v in stage_step_s(res.windows, probe_stages)]
        step_s = sum(st.steps * v for st, v in zip(full_stages, per_stage)) / full["max_steps"]
        stage_ms = [round(v * 1e3, 2) for v in per_stage]
    row = {"arm": arm, "seed": seed, "probe_steps": steps, "step_ms": round(step_s * 1e3, 2),
           **({"stage_step_ms": stage_ms} if stage_ms else {}),
           "tokens_per_step": tokens, "tok_per_s": round(tokens / step_s), "peak_mem_gb": s.get("peak_mem_gb"),
           "probe_wall_s": round(wall, 1), "gpu_share": gpu_share(), "device": device_name(),
           "timed_together": None if barrier is None else barrier.met,
           "full_steps": full["max_steps"], "full_validations": full["max_steps"] // max(1, full["val_every"]),
           "projected_train_min": round(full["max_steps"] * step_s / 60, 2)}
    with open(root / "probe.json", "a") as f:
        f.write(json.dumps(row) + "\n")
    mem = f", peak {row['peak_mem_gb']:.1f} GB" if row["peak_mem_gb"] else ""
    shared = f", GPU shared by {row['gpu_share']}" if row["gpu_share"] > 1 else ""
    if barrier is not None:
        shared += (f" (timed with the other {barrier.expected - 1} probe(s) of its round)" if barrier.met else
                   f" (only {barrier.arrived} of the {barrier.expected} probes of its round were training: this step "
                   "time is optimistic)")
    if stage_ms:
        shared += f"; by stage {' / '.join(f'{v:.0f}' for v in stage_ms)} ms, mixed as the run's stages"
    progress(f"[probe] arm={arm} seed={seed}: {row['step_ms']:.0f} ms a step ({tokens:,} tokens, "
             f"{row['tok_per_s']:,} tok/s{mem}{shared}); "
             f"its {full['max_steps']:,} steps ~{row['projected_train_min']:.1f} min of training, plus "
             f"{row['full_validations']} validations and its evaluation", echo)
    return row


def stage_step_s(windows: Sequence[tuple[int, int, float]], stages: Sequence[Any]) -> list[float | None]:
    """Per curriculum stage, the median seconds per step of the logging windows wholly inside it, a window that holds
    any stage's first step left out (compilation and autotuning for the new length, the new loader's start); None
    for a stage with no such window. ``windows``: ``(first, end, s)`` (``TrainResult.windows``); ``stages``:
    ``moelab.data.curriculum.StagePlan`` (``start_step``, ``end_step``)."""
    starts = {st.start_step for st in stages}
    out: list[float | None] = []
    for st in stages:
        clean = [sec for first, end, sec in windows
                 if st.start_step <= first and end <= st.end_step and not any(first <= b < end for b in starts)]
        out.append(statistics.median(clean) if clean else None)
    return out


def _scale_curriculum(cfg: Any, steps: int) -> None:
    """Set ``cfg.data.curriculum`` to the same stages over ``steps`` optimizer steps: each stage (its steps or tokens
    resolved) keeps its share, at least one step, the last open-ended (it runs until ``steps``). A probe of a
    curriculum times its stages in that proportion; its median step time then stands for the run's mix of lengths."""
    from moelab.data.curriculum import plan as stage_plan

    t, stages = cfg.train, cfg.data.curriculum
    resolved = stage_plan(stages, t.batch_size, cfg.data.seq_len, t.accumulate_grad_batches, t.max_steps)
    if steps < len(stages):
        raise ValueError(f"probe steps={steps} is not allowed for a curriculum of {len(stages)} stages: expected >= "
                         f"{len(stages)}, one per stage")
    start = 0
    for i, (stage, r) in enumerate(zip(stages, resolved)):
        stage.tokens = 0
        if i == len(stages) - 1:
            stage.steps = 0  # open-ended: what is left of the probe
        else:
            stage.steps = max(1, min(round(r.steps * steps / t.max_steps), steps - start - (len(stages) - 1 - i)))
            start += stage.steps


def gpu_share() -> int:
    """Runs training at once on this process's GPUs (:data:`GPU_SHARE_ENV`, default 1); ValueError unless >= 1."""
    text = os.environ.get(GPU_SHARE_ENV, "").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{GPU_SHARE_ENV}={text!r} is not allowed: expected a whole number >= 1")
    return int(text)


def parse_runs(text: str) -> frozenset[tuple[str, int]]:
    """``"bounded:0,softplus:1"`` -> ``{("bounded", 0), ("softplus", 1)}``; ValueError naming a bad item."""
    out = set()
    for item in (t.strip() for t in text.split(",")):
        arm, _, seed = item.rpartition(":")
        if not arm or not seed.strip().lstrip("-").isdigit():
            raise ValueError(f"RUNS item {item!r} is not allowed: expected arm:seed (e.g. bounded:0), "
                             f"comma-separated")
        out.add((arm.strip(), int(seed)))
    return frozenset(out)


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/3"`` -> ``(2, 3)``; ValueError unless ``1 <= i <= n``."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"SHARD={text!r} is not allowed: expected i/n with 1 <= i <= n (e.g. 1/3)")
    return int(m.group(1)), int(m.group(2))


def split_from_env() -> Split | None:
    """The split this process was started with (:data:`RUNS_ENV` or :data:`SHARD_ENV`), else None."""
    runs, shard = os.environ.get(RUNS_ENV, "").strip(), os.environ.get(SHARD_ENV, "").strip()
    if runs and shard:
        raise ValueError(f"RUNS={runs!r} and SHARD={shard!r}: give one of them")
    if runs:
        return Split(runs=parse_runs(runs))
    return Split(shard=parse_shard(shard)) if shard else None


CURVE_POINTS = 25  # MLflow points per run and metric that run_grid asks for at least (train.log_every)
_SPLIT_SEEN: dict[Split, set[tuple[str, int]]] = {}  # named runs met in this process's grids, per split
_SPLIT_DONE: dict[Split, dict[str, list]] = {}  # per split: "trained" and "missing" runs over the grids met
_SPLIT_PROBED: dict[Split, list[dict[str, Any]]] = {}  # per split: the probe rows over the grids met


def forget_split_runs() -> None:
    """Forget the named runs this process's grids met (a new split call in the same process starts over)."""
    _SPLIT_SEEN.clear()
    _SPLIT_DONE.clear()
    _SPLIT_PROBED.clear()


def probed_runs() -> list[str]:
    """``arm:seed`` of every run this process's split calls probed so far (a probe stopped by an incomplete grid
    before its other named runs says these)."""
    return [f"{r['arm']}:{r['seed']}" for rows in _SPLIT_PROBED.values() for r in rows]


_PROGRESS_SINKS: list[Callable[[str], None]] = []  # progress_to's targets, innermost last


@contextlib.contextmanager
def progress_to(say: Callable[[str], None]) -> Iterator[None]:
    """Inside the block, :func:`progress` lines go to ``say`` only (a split call runs the study in the runner's own
    process: its lines go straight to the terminal, once)."""
    _PROGRESS_SINKS.append(say)
    try:
        yield
    finally:
        _PROGRESS_SINKS.pop()


def progress(line: str, echo: Callable[[str], None] = print, quiet: bool = False) -> None:
    """``echo(line)``, and append it to the runner's progress file (:data:`PROGRESS_ENV`) so it reaches the terminal;
    inside :func:`progress_to` only its ``say(line)``. ``quiet``: the progress file only (a run read from its
    record: the notebook's report gets one line per grid instead, :func:`run_grid`)."""
    if _PROGRESS_SINKS:
        if not quiet:
            _PROGRESS_SINKS[-1](line)
        return
    if not quiet:
        echo(line)
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def run_grid(
    study: str,
    base: str,
    arms: Mapping[str, Mapping[str, Any]],
    seeds: Sequence[int],
    out_dir: str | os.PathLike,
    *,
    common: Mapping[str, Any] | None = None,
    echo: Callable[[str], None] = print,
    evaluate: Evaluate | None = None,
    checkpoints: str = "every_validation",
    records_dir: str | os.PathLike | None = None,
    split: Split | None = None,
    monitor: Monitor | None = None,
    source_pin: str | None = None,
) -> Grid:
    """Train every (arm, seed) of the grid that has no record yet; return the :class:`Grid`.

    Args:
        study: the study's name (``01_decay_bound``): tags, the experiment of imported records.
        base: preset name or YAML path every run starts from.
        arms: ``{arm: {"section.key": value}}``; arms may differ only in the keys every arm sets.
        seeds: ``cfg.seed`` values (initialization and data order); every arm runs every seed.
        out_dir: the study's working folder; runs train in ``<out_dir>/checkpoints/<arm>-s<seed>/``.
        common: overrides applied to every arm first (scale of the preset: steps, batch size).
        echo: where the one-line progress per run goes (also to :data:`PROGRESS_ENV`'s file).
        evaluate: ``(trained MoELab, RunConfig) -> dict`` (tensors, lists, numbers, strings), called in
            the training process when a run reaches ``max_steps``, model in eval mode on its device
            under ``torch.no_grad``; kept beside the record and returned as ``RunRecord.evals``
            (a record without it trains again).
        checkpoints: ``moelab.train.fit``'s policy: ``"every_validation"`` (last and best after each
            validation) or ``"final"`` (one ``last.ckpt``, when the run ends or is stopped).
        records_dir: where the run records live; default ``$MOELAB_STUDY_RECORDS``, else ``<out_dir>/records``.
        split: train only these runs (default: :func:`split_from_env`); when the grid is then still
            incomplete, raises :class:`GridIncomplete` once every named run has been met (a ``SHARD``: at once).
        monitor: ``(n, fn)``: ``fn(model being trained, RunConfig) -> dict`` every ``n`` optimizer steps (and at
            step 0 and the last step) in the training process, model in eval mode under ``torch.no_grad`` (train
            mode restored); the points are the run's ``trajectory`` (:meth:`Grid.trajectories`), kept in its
            record (a record without one trains again). Keep ``fn`` cheap: it runs inside the training time.
        source_pin: the training-code epoch the runs' fingerprints use instead of the package hash (default: that of
            the enclosing :func:`pinned` block, None outside one); the records keep both.

    Where MLflow cannot be imported (a split call on a machine without the lab wheels), or under
    :data:`SPLIT_UNTRACKED_ENV` (a split call's jobs), the runs train with ``tracking.enabled=False`` (tracking
    keys are not part of a fingerprint); the final call logs them from their records.
    """
    if not seeds:
        raise ValueError("seeds is empty: a study needs at least one seed")
    quiet_known_noise()
    split = split if split is not None else split_from_env()
    if monitor is not None and (not isinstance(monitor[0], int) or monitor[0] < 1 or not callable(monitor[1])):
        raise ValueError(f"monitor={monitor!r} is not allowed: expected (every n >= 1 optimizer steps, fn(model, cfg))")
    factor = check_arms_differ_only(base, arms, common)
    from moelab.tracking import installed as tracking_installed

    if not tracking_installed() or os.environ.get(SPLIT_UNTRACKED_ENV) == "1":
        common = {**(common or {}), "tracking.enabled": False}
    ctx = study_context(study)
    code = {**ctx["git"], "source_sha256": ctx["git"].get("source_sha256") or source_sha256()}
    pin = _checked_pin(source_pin) if source_pin is not None else current_pin()
    if pin is not None:
        code["source_pin"] = pin
    root = Path(out_dir).resolve() / "checkpoints"  # train.ckpt_dir: relative paths start at the repo root
    records_dir = Path(records_dir or os.environ.get(RECORDS_ENV) or Path(out_dir) / "records").resolve()
    grid = [(arm, seed) for arm in arms for seed in seeds]
    probe = probe_steps()
    if probe is not None and split is None:
        raise ValueError(f"{PROBE_ENV}={probe} probes the runs a split call names: give RUNS or SHARD too")
    records: list[RunRecord] = []
    trained, missing, trained_s = [], [], []
    corpus_tokens = 0
    for i, (arm, seed) in enumerate(grid):
        run_dir = root / f"{arm}-s{seed}"
        cfg = resolve_arms(base, {arm: arms[arm]}, {**(common or {}), "name": f"{study}-{arm}-s{seed}",
                                                     "train.ckpt_dir": str(run_dir),
                                                     "tracking.run_name": f"{arm}/s{seed}"}, seed)[arm]
        # Curves on the dashboard: at least ~CURVE_POINTS logged steps per run (a CPU run has 30 steps).
        cfg.train.log_every = min(cfg.train.log_every, max(1, cfg.train.max_steps // CURVE_POINTS))
        fp = _fingerprint(cfg, code)
        path = record_path(records_dir, arm, seed)
        if probe is not None and split.wants(i, arm, seed):  # a probe times its runs, never reads or writes a record
            if split.runs is not None:
                _SPLIT_SEEN.setdefault(split, set()).add((arm, seed))
            _SPLIT_PROBED.setdefault(split, []).append(_probe(arm, seed, cfg, Path(out_dir).resolve() / "probe", probe,
                                                               echo))
            rec = _load_record(path, fp, evals=evaluate is not None, trajectory=monitor is not None)
            if rec is None:
                missing.append(f"{arm}:{seed}")  # a grid that needs this run's record stays incomplete
            else:
                records.append(rec)  # probed again, its record still counts for the grids after this one
            continue
        rec = _load_record(path, fp, evals=evaluate is not None, trajectory=monitor is not None)
        if rec is not None:
            _log_record_made_elsewhere(study, cfg, rec)
        elif split is not None and not split.wants(i, arm, seed):
            missing.append(f"{arm}:{seed}")
            continue
        else:
            t0 = time.perf_counter()
            rec = _train(study, arm, seed, cfg, run_dir, fp, code, path, evaluate, checkpoints, monitor)
            trained_s.append(time.perf_counter() - t0)
            trained.append(f"{arm}:{seed}")
        if split is not None and split.runs is not None:
            _SPLIT_SEEN.setdefault(split, set()).add((arm, seed))
        if rec.epochs:
            corpus_tokens = round(rec.tokens / rec.epochs)
        records.append(rec)
        left = sum(1 for j, (a, s) in enumerate(grid[i + 1:], i + 1)
                   if split is None or split.wants(j, a, s))
        if not left:
            eta = "grid done" if split is None else "this call's runs of the grid done"
        elif trained_s:
            eta = f"grid ETA {_fmt_s(left * sum(trained_s) / len(trained_s))}"
        else:  # nothing trained yet in this call (records read so far): no time to extrapolate from
            eta = f"{left} more run(s) in the grid"
        val = rec.summary.get("best_val_loss")
        progress(f"[{i + 1}/{len(grid)}] arm={arm} seed={seed} steps={rec.summary.get('steps')} "
                 f"val_loss={'n/a' if val is None else f'{val:.4f}'} "
                 f"({'recorded, not retrained' if rec.skipped else _fmt_s(trained_s[-1])}); {eta}", echo,
                 quiet=rec.skipped)
    read = [r for r in records if r.skipped]
    if read:
        progress(f"{len(read)} of the grid's {len(grid)} runs read from their records, not retrained "
                 f"({', '.join(dict.fromkeys(r.arm for r in read))})", echo)
    if probe is not None and (split.runs is None or not (split.runs - _SPLIT_SEEN.get(split, set()))):
        # every named run met (a shard: its runs of this grid); runs of a later grid (study 3's deep arms after its
        # lr sweep) are reached because this process read the earlier grids' records as a training call would
        raise ProbeDone(_SPLIT_PROBED.pop(split, []), Path(out_dir).resolve() / "probe" / "probe.json")
    out = Grid(study=study, base=base, records=records, factor=factor, corpus_tokens=corpus_tokens,
               complete=not missing)
    if split is not None:
        done = _SPLIT_DONE.setdefault(split, {"trained": [], "missing": [], "grids": []})
        done["trained"] += trained
        done["missing"] += missing
        done["grids"].append(bool(missing))
    if missing:
        unmet = sorted(f"{a}:{s}" for a, s in (split.runs or set()) - _SPLIT_SEEN.get(split, set()))
        if not unmet:  # what the call trained and left in every grid it met (a study may run several in turn)
            raise GridIncomplete.of(done["trained"], done["missing"], _shown(records_dir),
                                    "these grids" if sum(done["grids"]) > 1 else "this grid")
        progress(f"grid of {list(arms)} incomplete; RUNS still to meet in a later grid: {', '.join(unmet)}", echo)
    return out


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (no machine path in a notebook's output)."""
    return path.relative_to(repo_root()).as_posix() if path.is_relative_to(repo_root()) else path.name


def _train(study: str, arm: str, seed: int, cfg: Any, run_dir: Path, fingerprint: str, code: Mapping[str, Any],
           record: Path, evaluate: Evaluate | None = None, checkpoints: str = "every_validation",
           monitor: Monitor | None = None) -> RunRecord:
    """Train (and evaluate) one run of the grid with its output in ``train.log``; write and return its record.

    A ``last.ckpt`` that an earlier call of the same run (same fingerprint) left when it was stopped is
    resumed; anything else in ``run_dir`` is removed first, so a run's curves, record and MLflow run cover
    its whole training.
    """
    from moelab.data import prepare
    from moelab.tracking import client
    from moelab.train import fit

    if str(cfg.preset).startswith("gpu") and not _cuda() and os.environ.get(CPU_GPU_PRESET_ENV) != "1":
        number = study.split("_", 1)[0].lstrip("0")
        raise GPURequired(f"run {arm}:{seed} has no record and needs a GPU (preset {cfg.preset}; no CUDA here): "
                          f"train it on one, `make study-{number} PRESET=<tier> RUNS={arm}:{seed}`, then render here "
                          f"with every record in place ({CPU_GPU_PRESET_ENV}=1: train it here anyway)")
    marker = run_dir / "fingerprint"
    resume = ((run_dir / "last.ckpt").is_file() and marker.is_file() and marker.read_text().strip() == fingerprint
              and _status(run_dir / "summary.json") != "finished")
    if not resume:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        marker.write_text(fingerprint + "\n")
    at_end = _evaluation_callback(evaluate) if evaluate is not None else None
    watch = _monitor_callback(monitor, partial_trajectory(record)) if monitor is not None else None
    started, t0 = datetime.now(UTC), time.perf_counter()
    with output_to(run_dir / "train.log"):
        corpus = prepare(cfg.data)  # its size gives the epochs; a first build logs its progress here
        t_fit = time.perf_counter()
        res = fit(cfg, callbacks=[c for c in (at_end, watch) if c is not None], checkpoints=checkpoints,
                  resume=True if resume else None)
    wall = time.perf_counter() - t0
    s = res.summary
    tokens = int(s["steps"] * s["tokens_per_step"])
    # where the wall time went (a GPU call's plan needs the fixed costs, not only the step time): the corpus
    # (built once per machine), fit's steps at its measured speed, the rest of fit (setup, compilation, capture,
    # validations, checkpoints) and the evaluation at the end; a resumed run's steps ran in two processes
    prepare_s = t_fit - t0
    steps_s = tokens / s["tok_per_s"] if s.get("tok_per_s") and not resume else None
    evaluate_s = at_end.seconds if at_end is not None else None
    split_s = {"prepare_s": round(prepare_s, 1), "steps_s": _round(steps_s), "evaluate_s": _round(evaluate_s),
               "fit_other_s": _round(None if steps_s is None else wall - prepare_s - steps_s - (evaluate_s or 0.0))}
    tail = _tail_train_loss(res.history, cfg.train.val_every)
    val = s.get("final_val_loss")
    gpus = _gpus(cfg, s)
    share = gpu_share()
    rec = RunRecord(arm=arm, seed=seed, summary=s, history=res.history,
                    val_history=[list(v) for v in res.val_history], tokens=tokens,
                    epochs=tokens / corpus.n_train_tokens,
                    train_val_gap=(val - tail) if val is not None and tail is not None else None,
                    fingerprint=fingerprint, evals=at_end.result if at_end else None,
                    timing={"started": started.isoformat(timespec="seconds"),
                            "ended": datetime.now(UTC).isoformat(timespec="seconds"), "wall_s": round(wall, 1),
                            "gpus": gpus, "gpu_share": share, "gpu_minutes": round(wall * gpus / share / 60, 3),
                            "resumed": resume, **split_s},
                    machine={"device": device_name(), **_versions()}, code=dict(code),
                    trajectory=watch.trajectory if watch is not None else None)
    if at_end is not None and at_end.result is None:
        raise RuntimeError(f"{run_dir.name}: training ended at step {s['steps']} before max_steps="
                           f"{cfg.train.max_steps}, so the run was not evaluated")
    _write_record(record, rec, cfg, study, res.run_id)
    partial_trajectory(record).unlink(missing_ok=True)  # the record holds the whole trajectory now
    if res.run_id:
        _tag_child(client(cfg.tracking.tracking_uri), res.run_id, study, rec)
    return rec


def _status(summary: Path) -> str | None:
    """``status`` of a run folder's ``summary.json`` (None when missing or unreadable)."""
    try:
        return json.loads(summary.read_text()).get("status")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def _gpus(cfg: Any, summary: Mapping[str, Any]) -> int:
    """CUDA devices the run trained on (0 on a CPU)."""
    import torch

    if not torch.cuda.is_available() or str(cfg.train.accelerator) == "cpu":
        return 0
    return int(summary.get("world_size") or 1)


def _record_params(rec: RunRecord) -> dict[str, str]:
    """Where and how long a run trained, as MLflow params (its original timings and machine)."""
    t, m = rec.timing, rec.machine
    return {"study.arm": rec.arm, "study.seed": str(rec.seed), "study.tokens": str(rec.tokens),
            **{f"record.{k}": str(t[k]) for k in ("started", "wall_s", "gpus", "gpu_share", "gpu_minutes") if k in t},
            **{f"record.{k}": str(v) for k, v in m.items() if v is not None}}


def _study_metrics(rec: RunRecord) -> dict[str, float]:
    values = {"epochs": rec.epochs, "train_val_gap": rec.train_val_gap,
              "best_val_loss": rec.summary.get("best_val_loss"), "gpu_minutes": rec.timing.get("gpu_minutes")}
    return {f"study/{k}": float(v) for k, v in values.items() if v is not None}


def _tag_child(mlflow_client: Any, run_id: str, study: str, rec: RunRecord) -> None:
    """Arm, seed, timings and machine as params and tags, and the study's per-run metrics, on the training's run."""
    from mlflow.entities import Metric, Param, RunTag

    now = int(time.time() * 1000)
    mlflow_client.log_batch(
        run_id,
        params=[Param(k, v) for k, v in _record_params(rec).items()],
        tags=[RunTag("moelab.study", study), RunTag("moelab.arm", rec.arm), RunTag("moelab.seed", str(rec.seed))],
        # One value per run at step 0: MLflow charts a metric whose values all sit at step 0 as a bar
        # per run (or per arm when grouped); at step >= 1 it draws a line chart of lone dots.
        metrics=[Metric(k, v, now, 0) for k, v in _study_metrics(rec).items()])


IMPORTED_TAG = "moelab.record_run_id"  # on a run logged from a record: the run id it had where it trained


def _log_record_made_elsewhere(study: str, cfg: Any, rec: RunRecord) -> None:
    """Log a record whose MLflow run is not in this store (it trained elsewhere) into it, once.

    The new run nests under the study's parent run (``arm/s<seed>``), with the record's config as
    params, its original timings and machine as ``record.*`` params, its curves as metrics at their
    steps, and :data:`IMPORTED_TAG` so a later call finds it instead of logging it again.
    """
    if not cfg.tracking.enabled:
        return
    from moelab.tracking import client, current_parent_run_id, experiment_id, start_run

    origin = rec.mlflow.get("run_id") or f"record-{rec.fingerprint}"
    mc = client(cfg.tracking.tracking_uri)
    try:
        mc.get_run(origin)
        return  # trained against this store
    except Exception:  # noqa: BLE001 (MLflow raises its own errors for an unknown id)
        pass
    parent = current_parent_run_id()
    exp = mc.get_run(parent).info.experiment_id if parent else experiment_id(mc, cfg.experiment)
    if mc.search_runs([exp], filter_string=f"tags.`{IMPORTED_TAG}` = '{origin}'", max_results=1):
        return
    tags = {"moelab.study": study, "moelab.arm": rec.arm, "moelab.seed": str(rec.seed), IMPORTED_TAG: origin,
            "moelab.code": f"{rec.code.get('commit')}{'-dirty' if rec.code.get('dirty') else ''}",
            "moelab.machine": str(rec.machine.get("device"))}
    with start_run(cfg.experiment, cfg.tracking.run_name, tracking_uri=cfg.tracking.tracking_uri,
                   params={**_run_config(cfg), **_record_params(rec)}, tags=tags, log_system_metrics=False) as run:
        for row in rec.history:
            run.log_metrics({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))
        run.log_metrics(_study_metrics(rec), step=0)
        rec.summary = {**rec.summary, "run_id": run.run_id}


# ------------------------------------------------------------------------------------ summarizing


def aggregate(table: Any, metrics: Sequence[str] = STUDY_METRICS) -> Any:
    """Mean, standard deviation (over seeds, ddof=1; NaN for one seed) and seed count per arm.

    Returns a DataFrame indexed by arm with columns ``<metric>_mean``, ``<metric>_std``, ``n_seeds``
    and ``<metric>`` as display text (``5.564 ± 0.012``; ``5.564`` for one seed).
    """
    import pandas as pd

    g = table.groupby("arm", sort=False)
    out = pd.DataFrame({"n_seeds": g.seed.nunique()})
    for m in metrics:
        out[f"{m}_mean"] = g[m].mean()
        out[f"{m}_std"] = g[m].std(ddof=1)
        out[m] = [_pm(mu, sd, n) for mu, sd, n in zip(out[f"{m}_mean"], out[f"{m}_std"], out.n_seeds)]
    return out


def _pm(mean: float, std: float, n: int) -> str:
    if mean is None or not math.isfinite(mean):
        return "n/a"
    return f"{mean:.4g} ± {std:.2g}" if n > 1 and math.isfinite(std) else f"{mean:.4g}"


FEW_SEEDS = 4  # up to this many seeds the noise estimate (n - 1 degrees of freedom) is called rough


def seed_note(n_seeds: int, per: str) -> str | None:
    """The findings line on what the seed count means for the noise every verdict is judged against.

    For studies that call a paired difference real when its mean exceeds twice the standard deviation
    of the per-seed differences (studies 3 and 4): with n seeds that std has n - 1 degrees of freedom,
    so with a few seeds it is itself uncertain and a verdict beyond it is a lead rather than a result. None for one
    seed (no noise is measured; the verdicts say so). ``per``: what a seed count is counted per
    (``schedule``, ``main arm``).
    """
    if n_seeds < 2:
        return None
    count = {2: "two", 3: "three", 4: "four"}.get(n_seeds, str(n_seeds))
    line = (f"- Seeds: {count} per {per}, so each noise below is twice the standard deviation of {count} paired "
            f"differences ({n_seeds - 1} degree{'s' * (n_seeds > 2)} of freedom)")
    if n_seeds <= FEW_SEEDS:
        return line + ", itself a rough estimate: a verdict beyond it is a lead to confirm with more seeds."
    return line + "."


def loss_curves(grid: Grid, title: str = "") -> Any:
    """Train loss of every run: one colour per arm, each seed a thin line, the seed mean bold; val loss as dots.

    A matplotlib Figure (no pyplot state); pass it to :func:`show` to display it.
    """
    import matplotlib
    from matplotlib.figure import Figure

    df = grid.histories()
    fig = Figure(figsize=(6.4, 4.2), dpi=100)
    ax = fig.subplots()
    cycle = [c["color"] for c in matplotlib.rcParams["axes.prop_cycle"]]
    for i, arm in enumerate(dict.fromkeys(r.arm for r in grid.records)):
        color = cycle[i % len(cycle)]
        sel = df[df.arm == arm]
        train = sel.dropna(subset=["train/loss"])
        for _, one in train.groupby("seed"):
            ax.plot(one.step, one["train/loss"], color=color, lw=0.6, alpha=0.45)
        mean = train.groupby("step")["train/loss"].mean()
        n = train.seed.nunique()
        ax.plot(mean.index, mean.values, color=color, lw=2.0, label=f"{arm} train ({n} seed{'s' * (n > 1)})")
        val = sel.dropna(subset=["val/loss"])
        if not val.empty:
            vmean = val.groupby("step")["val/loss"].mean()
            ax.plot(val.step, val["val/loss"], "o", color=color, ms=3, alpha=0.45)
            ax.plot(vmean.index, vmean.values, "D--", color=color, ms=5, lw=1.0, label=f"{arm} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def show(fig: Any, path: str | os.PathLike | None = None) -> Any:
    """Save ``fig`` as PNG (to ``path`` if given) and return an ``IPython.display.Image`` of it.

    The returned object renders inline as ``image/png`` in Jupyter, papermill's executed notebook
    and its HTML export, whatever matplotlib backend the kernel runs.
    """
    from IPython.display import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=fig.dpi)
    data = buf.getvalue()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
    return Image(data=data, format="png")


def records_code(records: Sequence[RunRecord]) -> dict[str, list[str]]:
    """The code the runs were trained at, over ``records``: ``{"commits", "source_sha256", "source_pins"}``, each
    the distinct values in first-seen order (a commit with ``-dirty`` when its tree was; pins only where given; a
    record of an older harness with the pin in place of its ``source_sha256`` counts as that pin)."""
    seen: dict[str, dict[str, None]] = {"commits": {}, "source_sha256": {}, "source_pins": {}}
    for r in records:
        c = r.code or {}
        if c.get("commit"):
            seen["commits"][f"{c['commit']}{'-dirty' if c.get('dirty') else ''}"] = None
        sha = str(c.get("source_sha256") or "")
        # records of an older harness kept the pin in place of the hash (no source_pin key): a pin, not a hash
        pin = c.get("source_pin") or (sha if sha and not re.fullmatch(r"[0-9a-f]+", sha) else None)
        if sha and sha != pin:
            seen["source_sha256"][sha] = None
        if pin:
            seen["source_pins"][str(pin)] = None
    return {k: list(v) for k, v in seen.items()}


def read_part_file(repo_path: str, results_dir: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """A study part's committed JSON (a GPU measurement run apart from the grid): ``repo_path``, relative to the
    repository; or, with ``results_dir`` (relative to the working directory: a notebook's ``"results"``), the file
    of that name there. None when it was not measured."""
    path = (Path(results_dir).resolve() / Path(repo_path).name if results_dir is not None
            else repo_root() / repo_path)
    return json.loads(path.read_text()) if path.is_file() else None


def repo_relative(path: str | os.PathLike, default: str) -> str:
    """``path`` relative to the repository when inside it, else ``default`` (where the file is committed): a result
    file names its output in the repository, never the scratch folder a GPU call wrote it to."""
    p, root = Path(path).resolve(), repo_root().resolve()
    return p.relative_to(root).as_posix() if p.is_relative_to(root) else default


def part_args(argv: Sequence[str]) -> list[str]:
    """A part command's arguments as its result file records them: those after the part's name, without ``--out``
    and its value (the file names its own place in the repository)."""
    return [a for i, a in enumerate(argv[1:], 1)
            if a != "--out" and argv[i - 1] != "--out" and not a.startswith("--out=")]


def study_meta(study: str, preset: str, grid: Grid | None = None, **extra: Any) -> dict[str, Any]:
    """The ``meta`` block of a study's ``summary.json``.

    git commit and dirty flag (code state when the study began, its own results folder left out),
    device, python/torch/triton versions, command, UTC date, wall time since the study began, and
    from ``grid``: tokens per run, epochs over the corpus's training split and the train/val gap
    (final validation loss minus the mean training loss of the last validation interval; per
    arm, mean over seeds), the GPU minutes of its runs (wherever each trained) and ``records_code``
    (:func:`records_code`: the distinct commits, package hashes and source pins its runs were trained at: split calls
    under a pin may span several commits). ``extra`` entries are added as they are.
    """
    ctx = study_context(study)
    meta: dict[str, Any] = {
        "study": study, "preset": preset,
        "commit": ctx["git"]["commit"], "dirty": ctx["git"]["dirty"],
        "device": device_name(), **_versions(),
        "command": ctx["command"],
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.time() - ctx["started"], 1),
    }
    if grid is not None and grid.records:
        table = grid.table()
        meta.update({
            "base_preset": grid.base,
            "corpus_train_tokens": grid.corpus_tokens,
            "tokens_per_run": int(table.tokens.max()), "tokens_per_run_min": int(table.tokens.min()),
            "epochs": float(table.epochs.max()),
            "train_val_gap": {arm: float(v)
                              for arm, v in table.groupby("arm", sort=False).train_val_gap.mean().items()},
            "runs": len(table), "runs_skipped": sum(r.skipped for r in grid.records),
            "gpu_minutes": round(sum(r.timing.get("gpu_minutes") or 0.0 for r in grid.records), 3),
            "records_code": records_code(grid.records),
            # where the runs trained (a research report renders on any machine from records made on GPUs)
            "trained_on": sorted({str((r.machine or {}).get("device")) for r in grid.records if r.machine}),
        })
    meta.update(extra)
    return meta


__all__ = ["Grid", "GridIncomplete", "KNOWN_NOISE", "MACHINE_PATH", "Monitor", "ProbeDone", "RunRecord", "Split",
           "aggregate", "check_arms_differ_only", "current_pin", "device_name", "forget_split_runs", "git_state",
           "gpu_share", "loss_curves", "measured_commit", "output_to", "parse_runs", "parse_shard", "pinned",
           "probe_steps", "probed_runs", "progress", "progress_to", "quiet_known_noise", "record_path", "records_code",
           "resolve_arms", "run_grid", "seed_note", "show", "source_sha256", "split_from_env", "study_context",
           "study_meta", "wants_trainer"]
