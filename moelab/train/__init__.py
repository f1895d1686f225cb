"""Training: a thin LightningModule around ``moelab.model.MoELab``, callbacks, and ``fit(cfg)``.

    from moelab.config import load_config
    from moelab.train import fit
    result = fit(load_config("tiny", ["train.max_steps=50"]))
    result.history[-1]["train/loss"], result.summary["tok_per_s"]

or ``python -m moelab train --config PRESET [--set key=value ...] [--resume [PATH]]``.

Lightning owns the loop (devices, precision, accumulation, clipping, checkpoints); MLflow
records the run (``moelab.tracking``); the model and data never import either.

What a run does: AdamW with linear warmup and cosine decay to ``train.min_lr_ratio``, gradient
clipping, ``bf16-mixed`` on a GPU and fp32 on a CPU, seeds and deterministic algorithms. It logs
tokens/s and MFU (GPU: ``3 x forward FLOPs per token x tokens/s / dense bf16 peak``, see
``moelab.train.perf``; not reported on a CPU); the progress bar counts optimizer steps of the whole
run. It writes ``runs/<name>/`` (or ``train.ckpt_dir``): ``config.yaml`` (the effective config),
``last.ckpt`` (after every validation and at the end), ``best.ckpt`` (lowest validation loss),
each checkpoint's ``.sha256``, ``history.csv`` (every step of the whole run) and ``summary.json``.
The loss never holds the ``[B, T, vocab]`` logits (``moelab.ops.linear_ce``).

Resume (``--resume``: ``runs/<name>/last.ckpt``, or a checkpoint or run folder given as PATH):

- continues on exactly the trajectory an uninterrupted run would have followed: same weights,
  optimizer and schedule state, same batches (bitwise on a CPU); ``history.csv`` keeps the steps
  before the resume.
- compares the checkpoint's config with yours: changes to the model, the data, the tokenizer, the
  seed or the batch size are refused, listing every differing key; the ones in
  ``moelab.config.RESUME_APPLIED`` (``train.lr``, ``train.max_steps``, ...) are applied from the
  next step and announced (also as the MLflow tag ``moelab.resume_changes``). A run that already
  reached ``train.max_steps`` is not resumed: raise it to train further.
- verifies checkpoints before use (checksum, a moelab checkpoint, finite weights) and names a
  damaged one, suggesting an intact ``best.ckpt`` or ``last.ckpt`` beside it; ``last.ckpt`` is
  only written while the weights are finite.

Faults:

- A run folder belongs to one run: a new run refuses a folder holding another run's checkpoints,
  and a folder in use by a live process (``run.lock``) is refused with that process's pid.
  Temporary files a killed save left behind are removed at the next start.
- Ctrl-C and SIGTERM finish the current step, save ``last.ckpt`` and ``summary.json``, mark the
  MLflow run KILLED and exit with 130 and 143; a second signal aborts at once. A resume closes
  the MLflow run of a process killed with ``kill -9`` (KILLED).
- A NaN or Inf loss, gradient norm or weight stops training with the step, the value and the
  last good checkpoint in the message (:class:`NonFiniteLossError`); the MLflow run is FAILED and
  ``summary.json`` records the error.
- User errors (a bad value, ``train.accelerator=gpu`` or ``model.kda.backend=triton`` without a
  GPU, a duplicate YAML key, a damaged checkpoint or corpus archive) print one ``error:`` line
  and exit 2 before an MLflow run is opened; an unreachable tracking server exits 1 within
  seconds. A tracking outage during a run does not stop it: metrics are retried from a
  background thread and what never arrived is listed under ``tracking_problems`` in
  ``summary.json``.
- DDP works unchanged: ``--set train.strategy=ddp --set train.devices=2`` (on CPUs too, with
  gloo). The balancer's once-per-step bias update (``moelab.train.balancer``) all-reduces its
  statistics, so every rank holds the same biases.
"""

from moelab.train.callbacks import NonFiniteLossError
from moelab.train.module import LitMoELab, lr_factor
from moelab.train.runner import TrainResult, fit, load_model, loss_figure

__all__ = ["LitMoELab", "NonFiniteLossError", "TrainResult", "fit", "load_model", "loss_figure", "lr_factor"]
