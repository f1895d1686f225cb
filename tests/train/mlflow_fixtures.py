"""MLflow fixtures: a fresh sqlite store per test, copied from one initialised per session.

Creating MLflow's tables takes seconds (migrations); copying an initialised empty database
takes milliseconds, so every test still gets its own isolated store.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()  # creates the schema
    return path


@pytest.fixture
def tracking_uri(tmp_path: Path, mlflow_template_db: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``sqlite:///<tmp>/mlflow.db``, also exported as MLFLOW_TRACKING_URI so nothing reaches the repo's store."""
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template_db, db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri
