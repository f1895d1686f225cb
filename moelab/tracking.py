"""MLflow tracking: the embedded default store, run lifecycle, nested runs, figures and tables.

Where runs go (``resolve_tracking_uri``): ``tracking.tracking_uri`` if a config sets it, else
``$MLFLOW_TRACKING_URI``, else ``sqlite:///<repo>/mlflow.db``; with a sqlite store, artifacts go
to ``mlruns/<experiment>/`` beside the database, whatever the working directory. ``make mlflow-ui``
serves the same database.

Experiments are named by one rule, :func:`experiment_name`: ``train/<preset>`` for ``moelab train``
(``train/tiny``), ``study/<NN_name>`` for a study (``study/01_decay_bound``). Every experiment moelab
creates carries MLflow 3's kind tag (``mlflow.experimentKind``), so the UI opens the training view.

``start_run`` owns a run's status: FINISHED when its block completes, KILLED on Ctrl-C or SIGTERM
(KeyboardInterrupt, SystemExit), FAILED on any other exception, so a crashed run never stays RUNNING.
Inside a study (the runner exports ``MOELAB_PARENT_RUN_ID``) every run nests under the study's
parent run, in the parent's experiment.

A tracking outage does not stop the work: ``Run.log_metrics`` queues the metrics and a background
thread sends them, retrying while the store fails (a locked sqlite file, a server restart); the
run's end waits up to ``retry_timeout_s`` for the store to come back, then records what it could
not send in ``Run.problems()``. A store that cannot be reached at the start fails fast instead
(:class:`TrackingError`, naming the URI), before anything is trained.

Other helpers: :func:`end_stale_run` closes a run a killed process left RUNNING; :func:`client`
serialises the creation of a new sqlite database, so runs started at once on a fresh file do not
race on MLflow's schema migrations.

Everything goes through an explicit ``MlflowClient`` and run id, never MLflow's process-global
"active run", so notebooks, nested runs and Lightning cannot trip over it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.base import repo_root

PARENT_ENV = "MOELAB_PARENT_RUN_ID"
PARENT_TAG = "mlflow.parentRunId"  # the tag MLflow's UI nests runs by
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # MLflow 3 opens the GenAI view on experiments without it
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_CHARS = 6000  # MLflow rejects longer param values
MAX_BATCH_METRICS = 1000  # MLflow's log_batch limit
PROBE_TIMEOUT_S = 5.0


class StorageError(RuntimeError):
    """A storage or tracking fault the user can act on; the message is the whole report, one line: what failed,
    what is intact, what to do. ``python -m moelab`` prints it without a traceback and exits 1."""


class TrackingError(StorageError):
    """The tracking store cannot be used at the start of a run; the message names the URI and what to do."""


@contextmanager
def _quiet_store_errors() -> Iterator[None]:
    """Hide MLflow's own log of a failing SQL statement (the error and a traceback, before it raises it): at the
    start of a run the raised error becomes one :class:`TrackingError` line."""
    import logging

    log = logging.getLogger("mlflow.store")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


class _MlflowNoise:
    """Hides, for the life of a run, what MLflow logs about the store failing under it, and counts it.

    MLflow logs every failing SQL statement with its traceback (``mlflow.store.db.utils``, ~90 lines each) and
    every system-metrics sample it could not store (``mlflow.system_metrics``); a database that turns read-only
    or locked mid-run printed thousands of lines. moelab reports the fault itself, once (``Run`` notices) and
    at the end (``Run.problems``); these counts feed that summary.
    """

    LOGGERS = ("mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor")

    def __init__(self) -> None:
        self.hidden = {name: 0 for name in self.LOGGERS}
        self.last: str | None = None

    def filter(self, record: Any) -> bool:
        if record.levelno >= 30:  # WARNING and above: MLflow's reports of a failure it caught
            self.hidden[record.name] = self.hidden.get(record.name, 0) + 1
            self.last = (record.getMessage().strip().splitlines() or [""])[0][:200]
            return False
        return True

    def __enter__(self) -> _MlflowNoise:
        import logging

        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        import logging

        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)

    def system_samples_lost(self) -> int:
        return self.hidden.get("mlflow.system_metrics.system_metrics_monitor", 0)


# At a run's end, how long to wait for a read-only sqlite store to accept the queued metrics and the final status
# (a locked one gets the run's whole retry_timeout_s: a lock passes, a read-only file or mount rarely does).
READ_ONLY_WAIT_S = 5.0


def store_fault_kind(text: str) -> str | None:
    """``"read-only"`` or ``"locked"`` when an error text says the sqlite store is so, else None."""
    low = text.lower()
    if "database is locked" in low or "database table is locked" in low:
        return "locked"
    if "readonly" in low or "read-only" in low or "read only" in low:
        return "read-only"
    return None


def _store_fault(where: object, e: BaseException) -> str | None:
    """The one line for a sqlite store that is locked or read-only (``where``: the database file), else None."""
    text = _describe(e)
    low = text.lower()
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        low += " read-only"  # the file or its folder cannot be written (chmod a-w, a read-only mount)
    if "database is locked" in low or "database table is locked" in low:
        return (f"the MLflow database {where} is locked by another process ({text}); nothing was trained or "
                f"written: let that process finish or end it (a sqlite3 shell or script holding a transaction), "
                f"point tracking.tracking_uri / $MLFLOW_TRACKING_URI at another database, or set "
                f"tracking.enabled=false")
    if "readonly" in low or "read-only" in low or "read only" in low:
        return (f"the MLflow database {where} is read-only ({text}); nothing was trained or written: make it and "
                f"its folder writable (chmod u+w), point tracking.tracking_uri / $MLFLOW_TRACKING_URI at another "
                f"database, or set tracking.enabled=false")
    return None


def default_tracking_uri() -> str:
    """``sqlite:///<repo>/mlflow.db``: the embedded store ``make mlflow-ui`` serves."""
    return f"sqlite:///{repo_root() / 'mlflow.db'}"


def resolve_tracking_uri(uri: str = "") -> str:
    """``uri`` if given, else ``$MLFLOW_TRACKING_URI``, else :func:`default_tracking_uri`.

    Read at call time, not import time (Lightning's ``MLFlowLogger`` reads the variable when it is
    imported, which is why moelab always passes the URI explicitly).
    """
    return uri or os.environ.get("MLFLOW_TRACKING_URI", "") or default_tracking_uri()


def experiment_name(kind: str, name: str) -> str:
    """The experiment naming rule: ``<kind>/<name>``, e.g. ``train/tiny`` or ``study/01_decay_bound``."""
    return f"{kind}/{name}"


def _sqlite_path(uri: str) -> Path | None:
    """Absolute path of the database file of a ``sqlite:///...`` URI; None for other stores and ``:memory:``.

    SQLAlchemy reads ``sqlite:///rel.db`` as relative to the working directory and
    ``sqlite:////abs/x.db`` as absolute: everything after the third slash is the path. (Parsing the
    URI as a URL would keep a leading ``//``, which POSIX treats as a different root.)
    """
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    path, _, query = uri[len(prefix):].partition("?")
    if path.startswith("file:") and "uri=true" in query:  # sqlite's URI form, e.g. file:/x/mlflow.db?mode=ro&uri=true
        path = path[len("file:"):]
    if path in ("", ":memory:"):
        return None
    return Path(os.path.abspath(path))


def _sqlite_dir(uri: str) -> Path | None:
    """Folder of the database file of a ``sqlite:///...`` URI, else None."""
    path = _sqlite_path(uri)
    return path.parent if path is not None else None


def _probe_server(uri: str) -> None:
    """Fail within seconds when the HTTP tracking server ``uri`` does not answer (MLflow would retry for minutes)."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        pass  # something answered: MLflow's own calls will say what is wrong with it
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise TrackingError(f"the MLflow tracking server {uri} does not answer ({reason}): start it (make "
                            f"mlflow-ui), point tracking.tracking_uri or $MLFLOW_TRACKING_URI at another store, "
                            f"or set tracking.enabled=false") from e


LAB_EXTRA_HINT = "install the lab extra, pip install 'moelab[lab]' (make setup installs it)"


def installed() -> bool:
    """Whether MLflow can be imported (it comes with the ``lab`` extra, not with ``pip install moelab``)."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


def client(uri: str = ""):
    """An ``MlflowClient`` for :func:`resolve_tracking_uri` ``(uri)``, checked to be usable.

    sqlite: creates the folder, and creates or migrates the schema under an exclusive lock on the
    database file (MLflow's migrations are not safe against a second process doing the same).
    HTTP: fails fast with :class:`TrackingError` when the server does not answer; without MLflow
    installed (``pip install moelab`` has no lab), :class:`TrackingError` names the extra.
    """
    if not installed():
        raise TrackingError(f"MLflow is not installed: {LAB_EXTRA_HINT}, or set tracking.enabled=false")
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(uri)
    db = _sqlite_path(uri)
    if uri.startswith(("http://", "https://")):
        _probe_server(uri)
    if db is None:
        return MlflowClient(tracking_uri=uri)
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        with open(db, "a") as f:
            # flock and sqlite's own (fcntl) locks do not interact: this only orders moelab processes.
            # The client builds (and migrates) the store when it is constructed, once per process.
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                with _quiet_store_errors():
                    return MlflowClient(tracking_uri=uri)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    except OSError as e:
        raise TrackingError(_store_fault(db, e) or f"the MLflow database {db} cannot be opened ({e}): check its "
                            f"folder's permissions, or set tracking.tracking_uri / $MLFLOW_TRACKING_URI") from e
    except Exception as e:  # sqlalchemy's OperationalError: a locked or read-only file, a damaged database
        raise TrackingError(_store_fault(db, e) or f"the MLflow database {db} cannot be used ({_describe(e)}); "
                            f"nothing was trained: point tracking.tracking_uri / $MLFLOW_TRACKING_URI at another "
                            f"database, or set tracking.enabled=false") from e


def experiment_id(mlflow_client, name: str) -> str:
    """Id of experiment ``name``, created if missing (sqlite: artifacts under ``mlruns/<name>`` beside the db).

    New and restored experiments get the training kind tag (``mlflow.experimentKind``).
    """
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(exp.experiment_id)
        if EXPERIMENT_KIND_TAG not in exp.tags:
            mlflow_client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id
    location = None
    folder = _sqlite_dir(mlflow_client.tracking_uri)
    if folder is not None:
        # Without this, MLflow puts artifacts in ./mlruns of whatever the working directory is.
        location = (folder / "mlruns" / re.sub(r"[^A-Za-z0-9_.\-]+", "_", name)).as_uri()
    return mlflow_client.create_experiment(name, artifact_location=location,
                                           tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})


def end_stale_run(run_id: str, tracking_uri: str = "", status: str = "KILLED") -> bool:
    """Mark ``run_id`` ``status`` if it is still RUNNING; True if it was.

    KILLED: its process died without closing it (kill -9). FINISHED / FAILED: its process ended but could not
    record the status (the database was read-only or locked at the end).
    Best effort: a store that is gone or a run that no longer exists leaves nothing to close.
    """
    try:
        mlflow_client = client(tracking_uri)
        with _quiet_store_errors():
            if mlflow_client.get_run(run_id).info.status != "RUNNING":
                return False
            mlflow_client.set_terminated(run_id, status)
    except Exception as e:
        _report(f"could not close the stale run {run_id} in {tracking_uri or 'the default store'}: {_describe(e)}")
        return False
    return True


def git_commit() -> str | None:
    """HEAD of the repository moelab runs from, with ``-dirty`` if tracked files outside the outputs of
    studies and benchmarks changed; None outside git."""
    try:
        root = repo_root()
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        # What studies and benchmarks write (studies/, kernels/results/) does not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)studies", ":(exclude)kernels/results"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _report(message: str) -> None:
    print(f"moelab: {message}", file=sys.stderr, flush=True)


def _describe(e: BaseException) -> str:
    # SQLAlchemy puts "(raised as a result of Query-invoked autoflush; ...)" before the driver's error line.
    text = [line for line in str(e).strip().splitlines() if line.strip() and not line.startswith("(raised as")]
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class _MetricSender:
    """Sends queued metrics from a background thread; while the store fails, keeps them and retries.

    A locked sqlite file blocks each attempt for up to its busy timeout (20 s in MLflow) and an
    unreachable server for its retries; on this thread that costs the training loop nothing.
    """

    RETRY_MIN_S, RETRY_MAX_S = 1.0, 15.0

    def __init__(self, mlflow_client: Any, run_id: str, uri: str, notice: Callable[..., None] | None = None) -> None:
        self.client, self.run_id, self.uri = mlflow_client, run_id, uri
        self.notice = notice or (lambda message, again=False: _report(message))
        self.pending: list[Any] = []  # mlflow.entities.Metric
        self.failures = 0
        self.failing = False  # the last attempt failed
        self.last_error: str | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._loop, name="moelab-mlflow-metrics", daemon=True)
        self._thread.start()

    def put(self, items: list[Any]) -> None:
        with self._cond:
            self.pending.extend(items)
            self._cond.notify()

    def _loop(self) -> None:
        delay = self.RETRY_MIN_S
        while True:
            with self._cond:
                while not self.pending and not self._closing:
                    self._cond.wait()
                if not self.pending or time.monotonic() > self._deadline:
                    return
                batch = self.pending[:MAX_BATCH_METRICS]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as e:
                self.failures += 1
                self.last_error = _describe(e)
                if not self.failing:
                    self.notice(f"logging metrics to {self.uri} failed ({self.last_error}); training continues, the "
                                f"metrics are kept and retried, what cannot be recorded is summarised at the end")
                self.failing = True
                with self._cond:
                    self._cond.wait(min(delay, max(0.0, self._deadline - time.monotonic())))
                delay = min(2 * delay, self.RETRY_MAX_S)
                continue
            with self._cond:
                del self.pending[:len(batch)]
            if self.failing:
                self.notice(f"logging metrics to {self.uri} works again after {self.failures} failed attempt(s)",
                            again=True)
            delay, self.failing = self.RETRY_MIN_S, False

    def close(self, timeout_s: float) -> None:
        """Send what is queued, retrying for at most ``timeout_s`` seconds; what is left stays in ``pending``."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify()
        # An attempt already under way may block for its own timeout past the deadline.
        self._thread.join(timeout_s + 30.0)


@dataclass
class Run:
    """One MLflow run, addressed by id through its own client.

    ``log_metrics`` is asynchronous and survives a store outage (see the module docstring); the
    other calls are synchronous. ``problems()`` says what did not reach the store.
    """

    client: Any  # mlflow.tracking.MlflowClient
    run_id: str
    experiment_id: str
    tracking_uri: str
    _sender: _MetricSender | None = field(default=None, repr=False)
    _failures: list[str] = field(default_factory=list, repr=False)
    _status_recorded: bool = field(default=True, repr=False)
    final_status: str | None = None  # the status the run ended with (FINISHED, KILLED, FAILED), recorded or not
    _noise: _MlflowNoise | None = field(default=None, repr=False)
    _noticed: bool = field(default=False, repr=False)
    _status_error: str = field(default="", repr=False)
    _store_down: str | None = field(default=None, repr=False)  # an attempt found the store locked or read-only

    def _notice(self, message: str, again: bool = False) -> None:
        """Print a tracking fault once per run (later ones are summarised at the end by ``problems``);
        ``again``: the store works again, said only after a fault was printed, and a new fault is printed anew."""
        if again:
            if self._noticed:
                _report(message)
            self._noticed = False
        elif not self._noticed:
            self._noticed = True
            _report(message)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (values as strings, cut to MLflow's 6000-character limit)."""
        from mlflow.entities import Param

        items = [Param(str(k), _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's per-batch limit for params
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Queue scalar metrics at ``step`` (non-finite values are logged as they are: MLflow stores NaN)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(str(k), float(v), now, step or 0) for k, v in metrics.items()]
        if not items:
            return
        if self._sender is None:
            self._sender = _MetricSender(self.client, self.run_id, self.tracking_uri, self._notice)
        self._sender.put(items)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until queued metrics are sent (or ``timeout_s`` passes); later ``log_metrics`` calls still work."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close(timeout_s)
            if sender.pending:
                self._failures.append(f"{len(sender.pending)} metric value(s) not sent ({sender.last_error})")

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, str(k), str(v))

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure as an image artifact (``artifact_file`` like ``"loss_curve.png"``)."""
        self.client.log_figure(self.run_id, figure, artifact_file)

    def log_table(self, data: Any, artifact_file: str) -> None:
        """A pandas DataFrame or dict of columns as a JSON table (read back with ``mlflow.load_table``)."""
        self.client.log_table(self.run_id, data, artifact_file)

    def log_dict(self, data: Mapping[str, Any], artifact_file: str) -> None:
        """A dict as a JSON or YAML artifact (by the extension of ``artifact_file``)."""
        self.client.log_dict(self.run_id, dict(data), artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A local file or folder as artifact(s)."""
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def attempt(self, what: str, call: Callable[..., Any], *args: Any) -> bool:
        """Run ``call(*args)``; on failure report it, remember it in ``problems()`` and return False.

        While the sqlite store is known to be locked or read-only (the metric sender's last attempt or an earlier
        ``attempt`` failed so), the call is not tried: each try on a locked file blocks for MLflow's 20 s busy timeout.
        """
        sender = self._sender
        down = store_fault_kind(sender.last_error or "") if sender is not None and sender.failing else None
        if down or self._store_down:
            self._failures.append(f"{what}: not tried, the store is {down or self._store_down}")
            return False
        try:
            call(*args)
        except Exception as e:
            self._store_down = store_fault_kind(_describe(e))
            self._failures.append(f"{what}: {_describe(e)}")
            self._notice(f"{what} in MLflow ({self.tracking_uri}) failed: {_describe(e)}; what cannot be recorded "
                         f"is summarised at the end")
            return False
        return True

    def problems(self) -> list[str]:
        """What did not reach the tracking store (unsent metrics, failed artifact uploads, the final status).

        System-metrics samples MLflow could not store are not listed (they are lost during any outage, even one
        the run outlives): :meth:`system_samples_lost` counts them."""
        out = list(self._failures)
        if self._sender is not None and self._sender.failures:
            out.append(f"{self._sender.failures} failed metric upload attempt(s), last: {self._sender.last_error}")
        if not self._status_recorded:
            out.append(f"the final status {self.final_status} was not recorded ({self._status_error}): the run shows "
                       f"RUNNING until the next run in its folder closes it")
        return out

    def system_samples_lost(self) -> int:
        """How many of MLflow's system-metrics samples the store refused during the run."""
        return self._noise.system_samples_lost() if self._noise is not None else 0

    def status_recorded(self) -> bool:
        """Whether the store took the run's final status (False: it shows RUNNING; see ``end_stale_run``)."""
        return self._status_recorded

    def fault_kind(self) -> str | None:
        """``"read-only"`` or ``"locked"`` when the problems say the sqlite store was so, else None."""
        text = " ".join(self.problems()) + " " + ((self._noise.last or "") if self._noise else "")
        return store_fault_kind(text)

    def _terminate(self, status: str, timeout_s: float) -> None:
        """Send the queued metrics and record ``status``, retrying both within one ``timeout_s`` while the store fails
        (at most ``READ_ONLY_WAIT_S`` when the sqlite store is known to be read-only: that does not pass by itself)."""
        self.final_status = status
        sender = self._sender
        sender_down = store_fault_kind(sender.last_error or "") if sender is not None and sender.failing else None
        if "read-only" in (self._store_down, sender_down):
            timeout_s = min(timeout_s, READ_ONLY_WAIT_S)
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s)
        delay = _MetricSender.RETRY_MIN_S
        while True:
            try:
                self.client.set_terminated(self.run_id, status)
                return
            except Exception as e:
                if time.monotonic() + delay > deadline:
                    self._status_recorded = False
                    self._status_error = _describe(e)
                    return
                time.sleep(delay)
                delay = min(2 * delay, _MetricSender.RETRY_MAX_S)


def _param_value(v: Any) -> str:
    s = str(v)
    return s if len(s) <= MAX_PARAM_CHARS else s[: MAX_PARAM_CHARS - 3] + "..."


def current_parent_run_id() -> str | None:
    """The enclosing study's run id (``$MOELAB_PARENT_RUN_ID``), or None outside a study."""
    return os.environ.get(PARENT_ENV) or None


@contextmanager
def start_run(
    experiment: str = "moelab",
    run_name: str | None = None,
    *,
    tracking_uri: str = "",
    parent_run_id: str | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
    log_system_metrics: bool = True,
    system_metrics_interval_s: float = 10.0,
    retry_timeout_s: float = 60.0,
) -> Iterator[Run]:
    """Create a run, yield it, and always end it with the right status.

    Args:
        experiment: experiment name (see :func:`experiment_name`; ignored under a parent: children
            live in the parent's experiment).
        parent_run_id: nest under this run; None: under ``$MOELAB_PARENT_RUN_ID`` if set; ``""``: top level.
        params, tags: logged at creation.
        log_system_metrics: sample CPU, memory, disk, network and NVIDIA GPUs into ``system/*``
            metrics every ``system_metrics_interval_s`` seconds.
        retry_timeout_s: at the end, how long to keep retrying queued metrics and the final status
            while the store fails.

    Status at the end: FINISHED, KILLED (KeyboardInterrupt, SystemExit) or FAILED (any other
    exception, re-raised). Raises :class:`TrackingError` when the store cannot be used at the start.
    """
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME

    mlflow_client = client(tracking_uri)
    uri = mlflow_client.tracking_uri
    parent = parent_run_id if parent_run_id is not None else current_parent_run_id()
    try:
        with _quiet_store_errors():
            if parent:
                exp_id = mlflow_client.get_run(parent).info.experiment_id
            else:
                exp_id = experiment_id(mlflow_client, experiment)
            all_tags = {MLFLOW_SOURCE_NAME: " ".join(sys.argv) or "python"}
            commit = git_commit()
            if commit:
                all_tags[MLFLOW_GIT_COMMIT] = commit
            if parent:
                all_tags[PARENT_TAG] = parent
            all_tags.update({str(k): str(v) for k, v in (tags or {}).items()})
            info = mlflow_client.create_run(exp_id, tags=all_tags, run_name=run_name).info
    except Exception as e:
        raise TrackingError(_store_fault(_sqlite_path(uri) or uri, e) or f"cannot open an MLflow run in {uri} "
                            f"({_describe(e)}); set tracking.enabled=false to train without tracking") from e
    run = Run(mlflow_client, info.run_id, exp_id, uri)
    run._noise = _MlflowNoise().__enter__()
    monitor = None
    status = "FAILED"
    try:
        if params:
            run.log_params(params)
        if log_system_metrics:
            monitor = _system_monitor(run.run_id, system_metrics_interval_s, uri)
        yield run
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):
        # Told to stop (Ctrl-C; SIGTERM), not broken.
        status = "KILLED"
        raise
    finally:
        try:
            if monitor is not None:
                monitor.finish()
            run._terminate(status, retry_timeout_s)
        finally:
            run._noise.__exit__()


def _system_monitor(run_id: str, interval_s: float, uri: str) -> Any:
    """MLflow's system-metrics sampler, started; GPU metrics when nvidia-ml-py finds an NVIDIA driver."""
    import logging

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # Its "Skip logging GPU metrics" and "Started monitoring" lines are INFO noise on every CPU run.
    logging.getLogger("mlflow.system_metrics.system_metrics_monitor").setLevel(logging.WARNING)
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s, tracking_uri=uri)
    monitor.start()
    return monitor
