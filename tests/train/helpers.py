"""Shared bits of the training tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moelab.config import RunConfig, load_config


def tiny_config(ckpt_dir: Path, tracking_uri: str | None = None, **overrides: Any) -> RunConfig:
    """The tiny preset writing into ``ckpt_dir``; MLflow off unless ``tracking_uri`` is given."""
    values: dict[str, Any] = {"train.ckpt_dir": str(ckpt_dir), "tracking.enabled": tracking_uri is not None,
                              "tracking.system_metrics_interval_s": 0.2}
    if tracking_uri:
        values["tracking.tracking_uri"] = tracking_uri
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config("tiny", values)
