import signal

import pytest

from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401


@pytest.fixture(autouse=True)
def default_sigint():
    """Every test starts with Python's own SIGINT handler: a shell that starts the suite in the background
    (``cmd &``) leaves SIGINT ignored, and the Ctrl-C tests check what the training guard restores. The
    handler found is put back afterwards."""
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, found)
