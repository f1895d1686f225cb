"""MLflow tracking: the embedded default store, run lifecycle, nested runs, figures and tables.

Where runs go (``resolve_tracking_uri``): ``tracking.tracking_uri`` if a config sets it, else
``$MLFLOW_TRACKING_URI``, else ``sqlite:///<repo>/mlflow.db``; with a sqlite store, artifacts go
to ``mlruns/`` beside the database, whatever the working directory. ``make mlflow-ui`` serves
the same database.

``start_run`` owns a run's status: FINISHED when its block completes, KILLED on Ctrl-C or SIGTERM
(KeyboardInterrupt, SystemExit), FAILED on any other exception, so a crashed run never stays RUNNING.
Inside a study (the runner exports ``MOELAB_PARENT_RUN_ID``) every run nests under the study's
parent run, in the parent's experiment.

Everything goes through an explicit ``MlflowClient`` and run id, never MLflow's process-global
"active run", so notebooks, nested runs and Lightning's ``MLFlowLogger`` cannot trip over it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from moelab.base import repo_root

PARENT_ENV = "MOELAB_PARENT_RUN_ID"
PARENT_TAG = "mlflow.parentRunId"  # the tag MLflow's UI nests runs by
MAX_PARAM_CHARS = 6000  # MLflow rejects longer param values


def default_tracking_uri() -> str:
    """``sqlite:///<repo>/mlflow.db``: the embedded store ``make mlflow-ui`` serves."""
    return f"sqlite:///{repo_root() / 'mlflow.db'}"


def resolve_tracking_uri(uri: str = "") -> str:
    """``uri`` if given, else ``$MLFLOW_TRACKING_URI``, else :func:`default_tracking_uri`.

    Read at call time, not import time (Lightning's ``MLFlowLogger`` reads the variable when it is
    imported, which is why moelab always passes the URI explicitly).
    """
    return uri or os.environ.get("MLFLOW_TRACKING_URI", "") or default_tracking_uri()


def _sqlite_dir(uri: str) -> Path | None:
    """Folder of the database file of a ``sqlite:///...`` URI, else None."""
    parsed = urlparse(uri)
    if parsed.scheme != "sqlite":
        return None
    return Path(unquote(parsed.path)).parent


def client(uri: str = ""):
    """An ``MlflowClient`` for :func:`resolve_tracking_uri` ``(uri)``; creates the sqlite folder if needed."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(uri)
    folder = _sqlite_dir(uri)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=uri)


def experiment_id(mlflow_client, name: str) -> str:
    """Id of experiment ``name``, created if missing (sqlite: artifacts under ``mlruns/<name>`` beside the db)."""
    exp = mlflow_client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            mlflow_client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    location = None
    folder = _sqlite_dir(mlflow_client.tracking_uri)
    if folder is not None:
        # Without this, MLflow puts artifacts in ./mlruns of whatever the working directory is.
        location = (folder / "mlruns" / re.sub(r"[^A-Za-z0-9_.\-]+", "_", name)).as_uri()
    return mlflow_client.create_experiment(name, artifact_location=location)


def git_commit() -> str | None:
    """HEAD of the repository moelab runs from, with ``-dirty`` if tracked files changed; None outside git."""
    try:
        root = repo_root()
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


@dataclass
class Run:
    """One MLflow run, addressed by id through its own client."""

    client: Any  # mlflow.tracking.MlflowClient
    run_id: str
    experiment_id: str
    tracking_uri: str

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (values as strings, cut to MLflow's 6000-character limit)."""
        from mlflow.entities import Param

        items = [Param(str(k), _param_value(v)) for k, v in params.items()]
        if items:
            self.client.log_batch(self.run_id, params=items)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log scalar metrics at ``step`` (non-finite values are logged as they are: MLflow stores NaN)."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(str(k), float(v), now, step or 0) for k, v in metrics.items()]
        if items:
            self.client.log_batch(self.run_id, metrics=items)

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
) -> Iterator[Run]:
    """Create a run, yield it, and always end it with the right status.

    Args:
        experiment: experiment name (ignored under a parent: children live in the parent's experiment).
        parent_run_id: nest under this run; None: under ``$MOELAB_PARENT_RUN_ID`` if set; ``""``: top level.
        params, tags: logged at creation.
        log_system_metrics: sample CPU, memory, disk, network (and GPU with nvidia-ml-py) into
            ``system/*`` metrics every ``system_metrics_interval_s`` seconds.

    Status at the end: FINISHED, KILLED (KeyboardInterrupt, SystemExit) or FAILED (any other
    exception, re-raised).
    """
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME

    mlflow_client = client(tracking_uri)
    uri = mlflow_client.tracking_uri
    parent = parent_run_id if parent_run_id is not None else current_parent_run_id()
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
    run = Run(mlflow_client, info.run_id, exp_id, uri)
    monitor = None
    status = "FAILED"
    try:
        if params:
            run.log_params(params)
        if log_system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run.run_id, sampling_interval=system_metrics_interval_s, tracking_uri=uri)
            monitor.start()
        yield run
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):
        # Told to stop (Ctrl-C; SIGTERM, which Lightning turns into SystemExit), not broken.
        status = "KILLED"
        raise
    finally:
        if monitor is not None:
            monitor.finish()
        mlflow_client.set_terminated(run.run_id, status)
