"""``fit(cfg)``: one training run from a RunConfig, tracked in MLflow, checkpointed, resumable.

What a run leaves behind, in ``cfg.ckpt_dir`` (``runs/<name>`` by default):

    config.yaml     the effective config (``moelab train --config runs/<name>/config.yaml`` repeats it)
    last.ckpt       the state after the latest validation (every ``val_every`` steps, the last step,
                    Ctrl-C, SIGTERM); written only while the weights are finite
    best.ckpt       the state with the lowest validation loss
                    (``fit(..., checkpoints="final")``: last.ckpt only at the validation that ends
                    training, no best.ckpt)
    *.ckpt.sha256   each checkpoint's checksum (``sha256sum -c`` format), verified before a resume
    history.csv     the scalars of every optimizer step of the whole run (resumes append), rewritten
                    at each validation so it reaches as far as ``last.ckpt``
    summary.json    status, final losses, tokens/s, MFU, peak memory, parameter counts (MoE: the
                    balancer's time per step and share of the step, the last MaxVio_global); also
                    written when training fails (status ``failed`` and the error)
    load_heatmap.png, balance_trajectories.pt
                    MoE models: every step's per-layer expert loads and biases (moelab.train.balancer)
    run.lock        held (flock) while a process trains here; names that process and its MLflow run

and in MLflow (experiment ``train/<preset>``): the flattened config and the run's constants
(parameter counts, FLOPs per token, world size, tokens per step) as params, the preset as the
``moelab.preset`` tag, ``train/*``, ``balance/*`` and ``perf/*`` every ``log_every`` steps and ``val/*``
at each validation (all at the optimizer step they describe), system metrics, the loss curve
(``loss_curve.png``), the per-step table (``metrics_table.json``), the summary, and for MoE models
the load heatmap and trajectories.

A run folder belongs to one run: a fresh run refuses a folder that holds another run's
checkpoints, and no two processes train in one folder at once. Resume (``resume=True``, a
checkpoint path or a run folder) continues the exact trajectory of an uninterrupted run: same
weights, optimizer and schedule state, and the same batches (the data module derives them from the
step). The checkpoint's config is compared with the new one first: changes to the model, the data
or the batch sequence are refused, listing the keys; the optimizer and schedule fields
(``moelab.config.RESUME_APPLIED``) are applied and announced. A resume also closes the MLflow run
of a process that was killed in this folder (KILLED).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from moelab.base import ConfigError
from moelab.config import CAPTURED_MODES, RunConfig, flatten, from_dict, resume_changes, to_yaml
from moelab.data import prepare
from moelab.data.datamodule import TextDataModule
from moelab.model.accounting import flops_per_token, param_counts
from moelab.model.accounting import summary as model_summary
from moelab.tracking import LAB_EXTRA_HINT, Run, StorageError, end_stale_run, start_run
from moelab.tracking import installed as tracking_installed
from moelab.train.balancer import BalancerCallback
from moelab.train.callbacks import (
    Interrupted,
    LastCheckpoint,
    StepMonitor,
    StopControl,
    Throughput,
    progress_bar,
    read_history,
    write_history,
)
from moelab.train.module import LitMoELab
from moelab.utils import atomic_path, atomic_write, signal_handlers, write_json

LAST = "last.ckpt"
BEST = "best"  # ModelCheckpoint's file name, without the extension
LOCK = "run.lock"
CHECKSUM_SUFFIX = ".sha256"
CHECKPOINT_POLICIES = ("every_validation", "final")  # fit(checkpoints=...)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as shells report it


class CheckpointError(ConfigError):
    """A checkpoint given to resume or load is damaged, not a moelab checkpoint, or does not fit the config."""


class RunFolderError(ConfigError):
    """The run folder belongs to another run (live, finished or interrupted); the message says which."""


# The OS errors of a full or closed storage, and what to do about each.
STORAGE_ERRNOS = {
    errno.ENOSPC: ("no space left on the device", "free space on it"),
    errno.EFBIG: ("the file-size limit was reached", "raise the file-size limit (ulimit -f)"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space within the quota"),
    errno.EROFS: ("the file system is read-only", "make it writable"),
}


def storage_os_error(e: BaseException | None) -> OSError | None:
    """The OSError of a full or closed storage (:data:`STORAGE_ERRNOS`) in ``e``'s chain, else None.

    ``torch.save`` reports a failed write as ``RuntimeError: [enforce fail at inline_container.cc]`` raised
    while handling the ``OSError``, so the cause is looked for along ``__cause__`` and ``__context__``.
    """
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None


class CheckpointSaveError(StorageError):
    """A checkpoint (or another file of the run folder) could not be written: disk full, file-size limit, quota,
    read-only file system.

    Raised by :class:`AtomicCheckpointIO` with the file and the OS error; ``fit`` raises it again with the
    whole line: what failed, that the previous checkpoint is intact, what to do.
    """

    def __init__(self, path: Path, os_error: OSError, message: str = "", what: str = "checkpoint ") -> None:
        self.path, self.os_error, self.what = path, os_error, what
        reason, _ = STORAGE_ERRNOS[os_error.errno]
        super().__init__(message or f"cannot save {what}{path}: {reason} "
                                    f"({errno.errorcode.get(os_error.errno, os_error.errno)})")

    def explained(self, step: int, last_good: Path | None, detail: str, folder: Path, unsaved: str = "",
                  tracked: bool = False) -> CheckpointSaveError:
        """The same fault with the one line a user reads: ``last_good``/``detail``: the checkpoint still intact;
        ``folder``: the run folder; ``unsaved``: what else could not be written; ``tracked``: an MLflow run was
        open (it ends FAILED)."""
        reason, todo = STORAGE_ERRNOS[self.os_error.errno]
        code = errno.errorcode.get(self.os_error.errno, str(self.os_error.errno))
        if last_good is not None:
            intact = f"the previous checkpoint {last_good}{detail} is intact"
            then = f"resume with --resume {last_good}"
        else:
            intact = "no earlier checkpoint exists"
            then = f"delete {folder} (it holds no checkpoint) and train again"
        failed = "; the MLflow run is marked FAILED" if tracked else ""
        return CheckpointSaveError(
            self.path, self.os_error,
            f"cannot save {self.what}{self.path} at step {step}: {reason} ({code}); training stopped, {intact} "
            f"and no partial file was left{unsaved}{failed}: {todo}, then {then}", self.what)


@dataclass
class TrainResult:
    """What ``fit`` returns (on every rank; ``summary`` and the files are complete on rank 0).

    history: one dict per optimizer step of the whole run, including the steps before a resume
        (``step``, ``train/loss``, ``train/ce``, ``train/aux_loss``, ``train/grad_norm``,
        ``train/lr``, and ``val/loss`` at validation steps).
    val_history: ``(step, val/loss)`` after each validation of the whole run.
    """

    status: str  # "finished" | "interrupted" (Ctrl-C) | "terminated" (SIGTERM)
    ckpt_dir: Path
    last_checkpoint: Path | None
    best_checkpoint: Path | None
    run_id: str | None
    history: list[dict[str, float]] = field(default_factory=list)
    val_history: list[tuple[int, float]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    # this run's logging windows (not those before a resume): (first step, end step, seconds per step), Throughput.spans
    windows: list[tuple[int, int, float]] = field(default_factory=list)
    # the MLflow record lacks something (the store failed mid-run): what, one line
    tracking_incomplete: str | None = None


# ---------------------------------------------------------------------------------------------
# Checkpoints: atomic, checksummed, verified

def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints through ``atomic_path`` (a crash mid-save keeps the previous file intact), each with a
    ``<file>.sha256`` checksum written just before the checkpoint takes its final name."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = Path(path)
        try:
            with atomic_path(path) as tmp:
                with open(tmp, "xb") as f:
                    torch.save(checkpoint, f)
                    f.flush()
                    os.fsync(f.fileno())
                with atomic_write(checksum_path(path)) as f:
                    f.write(f"{sha256_file(tmp)}  {path.name}\n")
        except Exception as e:
            cause = storage_os_error(e)
            if cause is None:
                raise
            raise CheckpointSaveError(path, cause) from e

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        checksum_path(Path(path)).unlink(missing_ok=True)


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and check ``path``: its checksum (when it has one), that it is a moelab checkpoint, finite weights."""
    sidecar = checksum_path(path)
    if sidecar.is_file():
        expected = (sidecar.read_text().split() or [""])[0]
        if sha256_file(path) != expected:
            raise CheckpointError(f"{path} does not match its checksum in {sidecar.name}: the file changed or "
                                  f"was damaged after it was written")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {first})") from e
    if not isinstance(state, dict) or "moelab" not in state or "state_dict" not in state:
        raise CheckpointError(f"{path} is not a moelab training checkpoint (no 'moelab' entry)")
    for name, tensor in state["state_dict"].items():
        if torch.is_tensor(tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{path} holds non-finite weights ({name})")
    return state


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A verified moelab checkpoint (the dict Lightning saved, tensors on the CPU).

    Raises CheckpointError naming the file and, when another checkpoint in its folder verifies
    (``best.ckpt`` beside a damaged ``last.ckpt``), naming that one.
    """
    path = Path(path)
    try:
        return _read_checkpoint(path)
    except CheckpointError as e:
        for name in (f"{BEST}.ckpt", LAST):
            other = path.parent / name
            if other != path and other.is_file():
                try:
                    step = _read_checkpoint(other).get("global_step")
                except CheckpointError:
                    continue
                raise CheckpointError(f"{e}; {other} (step {step}) verifies: resume with --resume {other}") from e
        raise


def resume_path(cfg: RunConfig, resume: bool | str | Path | None) -> Path | None:
    """The checkpoint to resume from: None (fresh run), ``<ckpt_dir>/last.ckpt`` (True), a run folder's
    ``last.ckpt``, or the given file."""
    if resume is None or resume is False:
        return None
    path = cfg.ckpt_dir / LAST if resume is True else Path(resume).expanduser()
    if path.is_dir():
        path = path / LAST
    if not path.is_file():
        raise FileNotFoundError(f"resume checkpoint {path} does not exist: train without --resume first, "
                                f"or pass the path of a .ckpt file or a run folder (found: "
                                f"{sorted(p.name for p in path.parent.glob('*.ckpt')) or 'none'})")
    return path


def check_resume(cfg: RunConfig, state: dict[str, Any], ckpt: Path) -> dict[str, tuple[Any, Any]]:
    """Compare the checkpoint's config with ``cfg``: raise on changes a resume cannot honour; return the applied ones.

    Raises CheckpointError when the model, data or batch sequence differ (all differing keys in
    one message) or when the checkpoint already reached ``train.max_steps``.
    """
    try:
        old = from_dict(state["moelab"]["config"])
    except ConfigError as e:
        raise CheckpointError(f"{ckpt} was written with a config this version cannot read ({e})") from e
    refused, applied = resume_changes(old, cfg)
    if refused:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *v) for k, v in refused.items()))
        raise CheckpointError(f"cannot resume {ckpt} with a different model, data or batch sequence ({listed}): "
                              f"resume with the checkpoint's values, or start a new run under another name "
                              f"(--set name=...)")
    step = int(state.get("global_step", 0))
    if step >= cfg.train.max_steps:
        raise CheckpointError(f"nothing to resume: {ckpt} is at step {step} and train.max_steps={cfg.train.max_steps}"
                              f"; to train further, raise it (--set train.max_steps={2 * step})")
    return applied


# ---------------------------------------------------------------------------------------------
# The run folder: one run per folder, one live process per run

class RunFolder:
    """Claims ``folder`` for this process: an exclusive ``flock`` on ``run.lock``, released when the process ends.

    The lock file's JSON names the owner (pid, host, MLflow run and store), so a later run can say
    who holds the folder, and a resume can close the MLflow run of an owner that was killed.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.previous: dict[str, Any] = {}
        self._file: Any = None

    def claim(self, resume_from: Path | None) -> None:
        """Take the lock; refuse a live owner, and a folder holding another run unless resuming from it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        f = open(self.folder / LOCK, "a+")
        f.seek(0)
        try:
            self.previous = json.loads(f.read() or "{}")
        except json.JSONDecodeError:
            self.previous = {}
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            owner = self.previous
            raise RunFolderError(f"{self.folder} is in use by a live run (pid {owner.get('pid', '?')} on "
                                 f"{owner.get('host', '?')}, MLflow run {owner.get('run_id')}): wait for it to end, or "
                                 f"train into another folder (--set name=... or --set train.ckpt_dir=...)") from None
        self._file = f
        resuming_here = resume_from is not None and resume_from.resolve().parent == self.folder.resolve()
        held = self.describe_run()
        if held and not resuming_here:
            self.release()
            raise RunFolderError(f"{self.folder} already holds a run ({held}): continue it with --resume "
                                 f"{self.folder}, or train into another folder (--set name=... or "
                                 f"--set train.ckpt_dir=...); delete the folder to start it over")
        self._remove_temp_files()

    def describe_run(self) -> str | None:
        """``"finished at step 60"``-style description of the run whose files are here, or None if there is none."""
        summary = self.folder / "summary.json"
        if summary.is_file():
            try:
                data = json.loads(summary.read_text())
                return f"{data.get('status')} at step {data.get('steps')}, MLflow run {data.get('run_id')}"
            except (json.JSONDecodeError, AttributeError):
                return "summary.json"
        found = sorted(p.name for p in self.folder.glob("*.ckpt"))
        return f"checkpoints {', '.join(found)}" if found else None

    def _remove_temp_files(self) -> None:
        # atomic_path's temporary names: a process killed mid-save leaves them behind.
        for path in self.folder.glob(".*.tmp*"):
            if re.fullmatch(r"\..+\.[0-9a-f]{12}\.tmp.*", path.name):
                path.unlink(missing_ok=True)

    def record(self, run_id: str | None, tracking_uri: str | None) -> None:
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "tracking_uri": tracking_uri}
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(owner) + "\n")
        self._file.flush()

    def release(self) -> None:
        """Drop the lock. A folder that holds no run (no config.yaml, summary or checkpoint: it failed before
        its first step) loses its lock file too, and is removed when nothing else is left in it."""
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None
            if not (self.folder / "config.yaml").exists() and self.describe_run() is None:
                (self.folder / LOCK).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.folder.rmdir()  # only when empty


# ---------------------------------------------------------------------------------------------
# Checks that need the machine, not just the config

def resolve_precision(cfg: RunConfig) -> str:
    """``train.precision``, with ``auto`` = ``bf16-mixed`` when training on a CUDA device, else ``32-true``."""
    if cfg.train.precision != "auto":
        return cfg.train.precision
    on_gpu = torch.cuda.is_available() and cfg.train.accelerator in ("auto", "gpu", "cuda")
    return "bf16-mixed" if on_gpu else "32-true"


def check_device(cfg: RunConfig) -> None:
    """Refuse settings this machine cannot run (a GPU accelerator or Triton kernels without a CUDA device)."""
    cuda = torch.cuda.is_available()
    if cfg.train.accelerator in ("gpu", "cuda") and not cuda:
        raise ConfigError(f"train.accelerator={cfg.train.accelerator!r} is not allowed here: no CUDA device is "
                          f"visible; use train.accelerator=auto or cpu")
    on_cuda = cuda and cfg.train.accelerator != "cpu"
    if on_cuda and cfg.train.compile in CAPTURED_MODES and resolve_precision(cfg) == "32-true" \
            and cfg.model.n_layers > cfg.model.dense_layers:
        # torch's fp32 grouped GEMM has no sm90 kernel: its fallback reads the expert offsets on the host, which a
        # CUDA graph cannot hold (the capture would fail at moelab/ops/moe.py experts_grouped)
        raise ConfigError(f"train.precision={cfg.train.precision!r} (fp32 on this GPU) is not allowed with "
                          f"train.compile={cfg.train.compile!r} and MoE layers: fp32 expert GEMMs read their offsets "
                          f"on the host, which a CUDA graph cannot capture; use train.precision='bf16-mixed' or "
                          f"train.compile='none' / 'default'")
    # The Triton interpreter (TRITON_INTERPRET=1, what the tests use) runs the kernels on the CPU.
    if on_cuda or os.environ.get("TRITON_INTERPRET") == "1" or "kda" not in cfg.model.layer_types():
        return
    for key in ("backend", "conv_backend"):
        if getattr(cfg.model.kda, key) == "triton":
            raise ConfigError(f"model.kda.{key}='triton' is not allowed without a CUDA device: use "
                              f"model.kda.{key}=auto (picks a CPU implementation here)")


def check_vocab(cfg: RunConfig, tokenizer_vocab: int) -> None:
    """Fail when the tokenizer emits ids the model cannot embed; warn when embedding rows go unused."""
    if tokenizer_vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is not allowed: the prepared tokenizer has "
                          f"{tokenizer_vocab} ids; set model.vocab_size={tokenizer_vocab}")
    if tokenizer_vocab < cfg.model.vocab_size:
        rank_zero_warn(f"the tokenizer has {tokenizer_vocab} ids, fewer than model.vocab_size="
                       f"{cfg.model.vocab_size} (a small corpus stops merging early); the extra rows stay unused")


# ---------------------------------------------------------------------------------------------
# fit

def fit(
    cfg: RunConfig,
    *,
    resume: bool | str | Path | None = None,
    callbacks: Sequence[Callback] = (),
    parent_run_id: str | None = None,
    checkpoints: str = "every_validation",
) -> TrainResult:
    """Train ``cfg``; return the histories, checkpoints and summary.

    Args:
        resume: True: continue from ``<ckpt_dir>/last.ckpt``; a path: from that checkpoint, or from
            that run folder's ``last.ckpt``.
        callbacks: extra Lightning callbacks (run before moelab's own).
        parent_run_id: nest the MLflow run under this run (default: the enclosing study's, if any).
        checkpoints: ``"every_validation"``: ``last.ckpt`` after each validation and ``best.ckpt``;
            ``"final"``: ``last.ckpt`` once, when training ends (a study's short runs, which its harness
            restarts rather than resumes).

    Every check below runs before the MLflow run is opened or anything is written.

    Raises:
        ConfigError: inconsistent config, settings this machine cannot run; subclasses
            CheckpointError (damaged checkpoint, changes a resume cannot honour, a finished run)
            and RunFolderError (the folder belongs to another run).
        moelab.tracking.TrackingError: the tracking store cannot be reached or opened.
        NonFiniteLossError: a NaN/Inf training scalar or weight (names the step and the last good checkpoint).
        CheckpointSaveError: a checkpoint could not be written (disk full, file-size limit, quota, read-only
            file system); the message names the file, the previous checkpoint left intact and what to do.
        Interrupted: after Ctrl-C or SIGTERM, once ``last.ckpt`` and ``summary.json`` are saved.
    """
    if checkpoints not in CHECKPOINT_POLICIES:
        raise ValueError(f"checkpoints={checkpoints!r} is not allowed: expected one of {CHECKPOINT_POLICIES}")
    cfg.validate().check_trainable()
    check_device(cfg)
    ckpt = resume_path(cfg, resume)
    if cfg.tracking.enabled and tracking_installed() and rank_zero_only.rank == 0:
        # Before any refusal below ("nothing to resume", "already holds a run"): that is how a finished run whose
        # status a read-only database could not take gets it.
        for where in dict.fromkeys([cfg.ckpt_dir, *([ckpt.parent] if ckpt is not None else [])]):
            close_unrecorded_run(where, cfg.tracking.tracking_uri)
    resumed = None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        resumed = Resumed(ckpt, int(state.get("global_step", 0)), state["moelab"].get("mlflow_run_id"),
                          check_resume(cfg, state, ckpt))
        del state  # Lightning loads the checkpoint itself
    folder = RunFolder(cfg.ckpt_dir)
    with ExitStack() as outer:
        if rank_zero_only.rank == 0:
            folder.claim(ckpt)
            outer.callback(folder.release)
        return _fit(cfg, resumed, folder, callbacks, parent_run_id, checkpoints == "final")


@dataclass
class Resumed:
    """The checkpoint a run resumes from: path, step, the MLflow run that wrote it, the applied config changes."""

    path: Path
    step: int
    run_id: str | None
    applied: dict[str, tuple[Any, Any]]


def _fit(cfg: RunConfig, resumed: Resumed | None, folder: RunFolder, callbacks: Sequence[Callback],
         parent_run_id: str | None, final_only: bool) -> TrainResult:
    ckpt_dir = cfg.ckpt_dir
    started = time.perf_counter()
    corpus = prepare(cfg.data)  # builds the cache on first use, with progress on stderr
    check_vocab(cfg, corpus.vocab_size)
    t = cfg.train
    dm = TextDataModule(cfg.data, t.batch_size, cfg.seed, t.max_steps, t.val_batches)
    dm.corpus = corpus
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = LitMoELab(cfg)

    run: Run | None = None
    summary_path = ckpt_dir / "summary.json"
    try:
        with ExitStack() as stack:
            if cfg.tracking.enabled and not tracking_installed() and rank_zero_only.rank == 0:
                rank_zero_info(f"MLflow is not installed: this run is not tracked ({LAB_EXTRA_HINT})")
            elif cfg.tracking.enabled and rank_zero_only.rank == 0:
                run = stack.enter_context(start_run(
                    cfg.experiment, cfg.tracking.run_name or cfg.name,
                    tracking_uri=cfg.tracking.tracking_uri, parent_run_id=parent_run_id,
                    log_system_metrics=cfg.tracking.log_system_metrics,
                    system_metrics_interval_s=cfg.tracking.system_metrics_interval_s,
                    retry_timeout_s=cfg.tracking.retry_timeout_s))
            module.mlflow_run_id = run.run_id if run else None
            if rank_zero_only.rank == 0:
                folder.record(module.mlflow_run_id, run.tracking_uri if run else None)
                with atomic_write(ckpt_dir / "config.yaml") as f:
                    f.write(to_yaml(cfg))
            if resumed is not None and resumed.applied:
                changes = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in resumed.applied.items())
                rank_zero_info(f"resuming {resumed.path} at step {resumed.step} with changed settings, applied "
                               f"from the next step: {changes}")
            result = _train(cfg, run, resumed, module, dm, callbacks, started, final_only)
    finally:
        # A final status MLflow could not record shows up only when the run closes.
        if run is not None and summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            if run.problems() and summary.get("tracking_problems") != run.problems():
                summary["tracking_problems"] = run.problems()
                with contextlib.suppress(OSError):  # a full disk here: the error on its way out says so
                    write_json(summary_path, summary)
    if run is not None and run.problems():
        result.summary["tracking_problems"] = run.problems()
        result.tracking_incomplete = _tracking_incomplete(result, run)
    return result


def _tracking_incomplete(result: TrainResult, run: Run) -> str:
    """One line: the training result is intact, what the MLflow record lacks, and how the run gets closed."""
    from moelab.tracking import _sqlite_path

    kind = run.fault_kind()
    store = _sqlite_path(run.tracking_uri) or run.tracking_uri
    what = (f"the MLflow database {store} turned {kind} during the run" if kind
            else f"recording the run in MLflow ({run.tracking_uri}) failed")
    last = f"{result.last_checkpoint} and " if result.last_checkpoint else ""
    steps = result.summary.get("steps")
    status = result.status if result.status != "finished" else f"finished at step {steps}"
    todo = {"read-only": "make the database and its folder writable (chmod u+w)",
            "locked": "end the process that holds the database locked"}.get(kind or "", "make the store usable again")
    missing = [p for p in run.problems() if not p.startswith("the final status ")]
    if run.system_samples_lost():
        missing.append(f"{run.system_samples_lost()} system-metrics sample(s)")
    if not run.status_recorded():
        close = (f"; nor the final status: the MLflow run {run.run_id} shows RUNNING: {todo}, then any python -m "
                 f"moelab train naming {result.ckpt_dir} (the same command again) marks it {run.final_status}")
    else:
        close = f"; the MLflow run {run.run_id} is marked {run.final_status}, its record is incomplete: {todo}"
    return (f"training {status}; {last}{result.ckpt_dir / 'summary.json'} are intact, but {what}: not recorded: "
            f"{'; '.join(missing) or 'nothing else'}{close}")


_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED", "terminated": "KILLED"}


def close_unrecorded_run(folder: Path, tracking_uri: str = "") -> str | None:
    """Close the MLflow run a past process in ``folder`` left RUNNING; the status it got, or None.

    The run is the one ``run.lock`` names, closed only when no live process holds the lock: with the status its
    ``summary.json`` records (a finished run whose database was read-only or locked when it ended: FINISHED),
    else KILLED (the process was killed with kill -9 before writing its summary).
    """
    lock = folder / LOCK
    if not lock.is_file():
        return None
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live run owns the folder and will close its run itself
        try:
            owner = json.loads(f.read() or "{}")
        except json.JSONDecodeError:
            return None
    run_id = owner.get("run_id")
    if not run_id:
        return None
    status = "KILLED"
    with contextlib.suppress(OSError, json.JSONDecodeError, AttributeError):
        summary = json.loads((folder / "summary.json").read_text())
        if summary.get("run_id") == run_id:
            status = _MLFLOW_STATUS.get(summary.get("status"), "KILLED")
    if not end_stale_run(run_id, owner.get("tracking_uri") or tracking_uri, status):
        return None
    why = "its process ended without closing it" if status == "KILLED" else "its process could not record it"
    print(f"moelab: closed MLflow run {run_id} ({status}): {why}", file=sys.stderr, flush=True)
    return status


def _train(cfg: RunConfig, run: Run | None, resumed: Resumed | None, module: LitMoELab, dm: TextDataModule,
           callbacks: Sequence[Callback], started: float, final_only: bool) -> TrainResult:
    ckpt_dir, t = cfg.ckpt_dir, cfg.train
    ckpt = resumed.path if resumed else None
    # The whole run's history: what the resumed checkpoint had seen, then this process's steps.
    prior = read_history(ckpt.parent / "history.csv", resumed.step) if resumed else []
    sink = run.log_metrics if run is not None else None
    last_ckpt = LastCheckpoint(ckpt_dir / LAST, (ckpt, resumed.step) if resumed else None, final_only)
    monitor = StepMonitor(last_ckpt, t.log_every, sink, ckpt_dir / "history.csv", prior)
    throughput, stop = _throughput(cfg, sink), StopControl()
    best = None if final_only else ModelCheckpoint(
        dirpath=ckpt_dir, filename=BEST, monitor="val/loss", mode="min", save_top_k=1, save_last=False,
        auto_insert_metric_name=False, enable_version_counter=False)
    trainer = L.Trainer(
        max_steps=t.max_steps,
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        precision=resolve_precision(cfg),
        gradient_clip_val=(t.grad_clip or None) if t.compile not in CAPTURED_MODES else None,  # captured: step clips
        gradient_clip_algorithm="norm",
        accumulate_grad_batches=t.accumulate_grad_batches,
        # Validation every val_every optimizer steps, counted across the (single, long) epoch.
        val_check_interval=t.val_every * t.accumulate_grad_batches,
        check_val_every_n_epoch=None,
        limit_val_batches=t.val_batches,
        num_sanity_val_steps=0,
        deterministic=t.deterministic,
        use_distributed_sampler=False,  # TextDataModule splits the data over ranks itself
        callbacks=[*callbacks, monitor, throughput, stop, last_ckpt, *([best] if best else []), progress_bar()],
        logger=False,  # moelab's callbacks log to MLflow themselves, at the step they describe
        default_root_dir=str(ckpt_dir),
        plugins=[AtomicCheckpointIO()],
        enable_checkpointing=best is not None,  # else Lightning adds a ModelCheckpoint of its own
        enable_model_summary=False,
    )
    if run is not None:
        _log_start(run, cfg, resumed, trainer.world_size)

    def result(status: str) -> TrainResult:
        last = ckpt_dir / LAST
        rows = monitor.rows
        return TrainResult(
            status=status, ckpt_dir=ckpt_dir, last_checkpoint=last if last.exists() else None,
            best_checkpoint=Path(best.best_model_path) if best is not None and best.best_model_path else None,
            run_id=run.run_id if run else None, history=rows,
            val_history=[(int(r["step"]), r["val/loss"]) for r in rows if "val/loss" in r],
            windows=list(throughput.spans))

    try:
        with _stop_on_signals(stop), warnings.catch_warnings():
            # config.yaml is always there already; the warning would only be noise.
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)
    except BaseException as e:
        if trainer.is_global_zero and resumed is None and trainer.global_step == 0 and not any(ckpt_dir.glob("*.ckpt")):
            # Failed before its first step (a data check, say): nothing to resume, so the folder keeps no
            # record that would hold the name; RunFolder.release removes the emptied folder.
            (ckpt_dir / "config.yaml").unlink(missing_ok=True)
            raise
        save_error = e if isinstance(e, CheckpointSaveError) else None
        if save_error is None and (cause := storage_os_error(e)) is not None:  # history.csv at a validation, say
            save_error = CheckpointSaveError(Path(cause.filename) if cause.filename else ckpt_dir, cause,
                                             what="" if cause.filename else "into ")
        unsaved = ""
        if trainer.is_global_zero:
            out = result("failed")
            out.summary = {**_summarize(cfg, trainer, out, throughput, time.perf_counter() - started),
                           "error": f"{type(e).__name__}: {e}"}
            try:
                write_history(ckpt_dir / "history.csv", out.history)
                write_json(ckpt_dir / "summary.json", out.summary)
            except OSError as also:
                if save_error is None or storage_os_error(also) is None:
                    raise
                unsaved = " (history.csv and summary.json could not be updated either)"
        if save_error is not None:
            raise save_error.explained(trainer.global_step, *last_ckpt.describe(), ckpt_dir, unsaved,
                                       run is not None) from e
        raise

    signum = stop.requested if stop.interrupted_at is not None else None
    out = result({None: "finished", signal.SIGTERM: "terminated"}.get(signum, "interrupted"))
    if trainer.is_global_zero:
        out.summary = _summarize(cfg, trainer, out, throughput, time.perf_counter() - started)
        balancer = _balancer(trainer)
        extra: list[Path] = []
        for name, write in (("history.csv", lambda: write_history(ckpt_dir / "history.csv", out.history)),
                            ("summary.json", lambda: write_json(ckpt_dir / "summary.json", out.summary)),
                            ("balance_trajectories.pt and load_heatmap.png",
                             lambda: extra.extend(balancer.save(ckpt_dir) if balancer is not None else []))):
            try:
                write()
            except Exception as e:
                cause = storage_os_error(e)
                if cause is None:
                    raise
                raise _final_write_error(ckpt_dir / name.split()[0], name, cause, trainer.global_step,
                                         *last_ckpt.describe(), run is not None) from e
        if run is not None:
            _log_end(run, out, extra)
            run.flush(cfg.tracking.retry_timeout_s)
            if run.problems():
                out.summary["tracking_problems"] = run.problems()
                write_json(ckpt_dir / "summary.json", out.summary)
    if signum is not None:
        name = signal.Signals(signum).name
        raise Interrupted(f"training stopped by {name} at step {stop.interrupted_at}; resume from "
                          f"{ckpt_dir / LAST}", signum)
    return out


def _final_write_error(path: Path, name: str, cause: OSError, step: int, last: Path | None, detail: str,
                       tracked: bool) -> CheckpointSaveError:
    """The one line for a file of the run folder that could not be written after the last step (history.csv,
    summary.json, the balancer's files): training is over and its checkpoint intact, only that record is missing."""
    reason, todo = STORAGE_ERRNOS[cause.errno]
    code = errno.errorcode.get(cause.errno, str(cause.errno))
    kept = (f"{last}{detail} holds the trained model and is intact" if last is not None
            else "no checkpoint was written (the run has none to keep)")
    failed = "; the MLflow run is marked FAILED" if tracked else ""
    return CheckpointSaveError(
        path, cause,
        f"training finished at step {step}, but {name} could not be written in {path.parent}: {reason} ({code}); "
        f"{kept}, the files written before keep their previous complete version and no partial file was "
        f"left{failed}: {todo}; the model needs nothing more (python -m moelab eval --ckpt {last or path.parent})",
        what="")


def _throughput(cfg: RunConfig, sink: Any) -> Throughput:
    t = cfg.train
    return Throughput(tokens_per_device_step=t.batch_size * t.accumulate_grad_batches * cfg.data.seq_len,
                      flops_per_token_fwd=flops_per_token(cfg.model, cfg.data.seq_len),
                      log_every=t.log_every, sink=sink)


@contextmanager
def _stop_on_signals(stop: StopControl) -> Iterator[None]:
    """While fitting, the first Ctrl-C or SIGTERM asks for a clean stop (checkpoint, summary, then
    :class:`Interrupted`); a second one acts as usual (KeyboardInterrupt, termination).

    Lightning's own handlers would end the process mid-step or without a summary; finishing the
    step keeps weights and optimizer state consistent with the checkpoint. Only the main thread
    can own signals.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}  # the handlers replaced: signal_handlers fills it before installing this one

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signum, previous[signum])
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        rank_zero_info(f"\n{what}: stopping after this step and saving last.ckpt (send it again to abort now)")
        stop.request_stop(signum)

    stop.handler = handler
    with signal_handlers(handler, previous=previous):
        yield


def _constants(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """What a run holds fixed: MLflow params (not metrics), and part of the summary."""
    counts = param_counts(cfg.model)
    t = cfg.train
    return {"params_total": counts["total"], "params_activated": counts["activated"],
            "params_activated_non_embedding": counts["activated_non_embedding"],
            "flops_per_token_fwd": flops_per_token(cfg.model, cfg.data.seq_len),
            "world_size": world_size,
            "tokens_per_step": t.batch_size * t.accumulate_grad_batches * cfg.data.seq_len * world_size,
            "precision": resolve_precision(cfg)}


def _log_start(run: Run, cfg: RunConfig, resumed: Resumed | None, world_size: int) -> None:
    run.log_params(flatten(cfg))
    run.log_params({f"run.{k}": v for k, v in _constants(cfg, world_size).items()})
    run.log_text(to_yaml(cfg), "config.yaml")
    run.log_text(model_summary(cfg.model, cfg.data.seq_len), "model_summary.txt")
    tags: dict[str, Any] = {"moelab.preset": cfg.preset or cfg.name}
    if resumed is not None:
        tags["moelab.resumed_from_checkpoint"] = str(resumed.path)
        tags["moelab.resumed_at_step"] = resumed.step
        if resumed.run_id:
            tags["moelab.resumed_from_run"] = resumed.run_id
        if resumed.applied:
            tags["moelab.resume_changes"] = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in resumed.applied.items())
    run.set_tags(tags)


def _summarize(cfg: RunConfig, trainer: L.Trainer, result: TrainResult, throughput: Throughput,
               wall_s: float) -> dict[str, Any]:
    last_loss = result.history[-1]["train/loss"] if result.history else None
    balancer = _balancer(trainer)
    vals = [v for _, v in result.val_history]
    return {
        "name": cfg.name,
        "preset": cfg.preset,
        "status": result.status,
        "run_id": result.run_id,
        "steps": trainer.global_step,
        "final_train_loss": last_loss,
        "final_val_loss": vals[-1] if vals else None,
        "best_val_loss": min(vals) if vals else None,
        "B": cfg.train.batch_size,
        "T": cfg.data.seq_len,
        "device": torch.cuda.get_device_name() if trainer.strategy.root_device.type == "cuda" else "cpu",
        **throughput.summary(trainer.strategy.root_device),
        **(balancer.summary() if balancer is not None else {}),
        **_constants(cfg, trainer.world_size),
        "wall_s": wall_s,
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "best_checkpoint": str(result.best_checkpoint) if result.best_checkpoint else None,
    }


def loss_figure(result: TrainResult) -> Any:
    """Train loss per step and validation loss per validation, as a matplotlib Figure (no pyplot state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    if result.history:
        ax.plot([r["step"] for r in result.history], [r["train/loss"] for r in result.history],
                label="train/loss", lw=1)
    if result.val_history:
        steps, vals = zip(*result.val_history)
        ax.plot(steps, vals, "o-", label="val/loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(result.summary.get("name", ""))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _balancer(trainer: L.Trainer) -> BalancerCallback | None:
    """The MoE balancer's callback (``LitMoELab.configure_callbacks`` adds it to MoE models), if any."""
    return next((c for c in trainer.callbacks if isinstance(c, BalancerCallback)), None)


def _log_end(run: Run, result: TrainResult, files: Sequence[Path] = ()) -> None:
    """Artifacts of the finished run (and ``files`` from the run folder); a failing store is reported
    (``Run.problems``), never raised."""
    import pandas as pd

    for path in files:
        run.attempt(f"uploading {path.name}", run.log_artifact, path)

    run.attempt("uploading loss_curve.png", run.log_figure, loss_figure(result), "loss_curve.png")
    if result.history:
        run.attempt("uploading metrics_table.json", run.log_table, pd.DataFrame(result.history), "metrics_table.json")
    run.attempt("uploading summary.json", run.log_dict, result.summary, "summary.json")


def load_model(checkpoint: str | Path, map_location: str | torch.device = "cpu",
               max_seq_len: int | None = None) -> tuple[Any, RunConfig]:
    """``(MoELab, RunConfig)`` from a moelab checkpoint (verified): the model in eval mode with the trained weights.

    ``max_seq_len``: see :func:`model_from_checkpoint`.
    """
    return model_from_checkpoint(load_checkpoint(checkpoint), map_location, max_seq_len)


def model_from_checkpoint(state: dict[str, Any], map_location: str | torch.device = "cpu",
                          max_seq_len: int | None = None) -> tuple[Any, RunConfig]:
    """``(MoELab, RunConfig)`` from a checkpoint :func:`load_checkpoint` read: the model in eval mode.

    ``max_seq_len``: the longest input the model accepts, when it should differ from the trained
    config's (evaluation beyond the training window; the model has no positional parameters, so
    the limit only guards inputs). The returned config is the checkpoint's.
    """
    from moelab.model import MoELab

    cfg = from_dict(state["moelab"]["config"])
    model_cfg = cfg.model if max_seq_len is None else dataclasses.replace(cfg.model, max_seq_len=max_seq_len)
    model = MoELab(model_cfg)
    prefix = "model."
    model.load_state_dict({k[len(prefix):]: v for k, v in state["state_dict"].items() if k.startswith(prefix)})
    return model.to(map_location).eval(), cfg
