from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401
