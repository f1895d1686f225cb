"""Training: a thin LightningModule around ``moelab.model.MoELab``, callbacks, and ``fit(cfg)``.

    from moelab.config import load_config
    from moelab.train import fit
    result = fit(load_config("tiny", ["train.max_steps=50"]))
    result.history[-1]["train/loss"], result.summary["tok_per_s"]

Lightning owns the loop (devices, precision, accumulation, clipping, checkpoints); MLflow
records the run (``moelab.tracking``); the model and data never import either.
"""

from moelab.train.callbacks import NonFiniteLossError
from moelab.train.module import LitMoELab, lr_factor
from moelab.train.runner import TrainResult, fit, load_model, loss_figure

__all__ = ["LitMoELab", "NonFiniteLossError", "TrainResult", "fit", "load_model", "loss_figure", "lr_factor"]
