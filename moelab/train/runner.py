"""``fit(cfg)``: one training run from a RunConfig, tracked in MLflow, checkpointed, resumable.

What a run leaves behind, in ``cfg.ckpt_dir`` (``runs/<name>`` by default):

    config.yaml     the resolved config (``moelab train --config runs/<name>/config.yaml`` repeats it)
    last.ckpt       the state after the latest validation (every ``val_every`` steps, the last step, Ctrl-C)
    best.ckpt       the state with the lowest validation loss
    history.csv     the scalars of every optimizer step
    summary.json    final losses, tokens/s, MFU, peak memory, parameter counts

and in MLflow: the flattened config as params, accounting numbers, step metrics, system
metrics, the loss curve (``loss_curve.png``), the per-step table (``metrics_table.json``) and
the summary. Resume (``resume=True`` or a checkpoint path) continues the exact trajectory of an
uninterrupted run: same weights, optimizer and schedule state, and the same batches (the data
module derives them from the step).
"""

from __future__ import annotations

import math
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from moelab.config import RunConfig, flatten, to_yaml
from moelab.data import prepare
from moelab.data.datamodule import TextDataModule
from moelab.model.accounting import flops_per_token, param_counts
from moelab.model.accounting import summary as model_summary
from moelab.model.config import ConfigError
from moelab.tracking import Run, start_run
from moelab.train.callbacks import LastCheckpoint, StepMonitor, StopControl, Throughput
from moelab.train.module import LitMoELab
from moelab.utils import atomic_write, write_json

LAST = "last.ckpt"
BEST = "best"


@dataclass
class TrainResult:
    """What ``fit`` returns (on every rank; ``summary`` and the files are complete on rank 0).

    history: one dict per optimizer step (``step``, ``train/loss``, ``train/ce``,
        ``train/aux_loss``, ``train/grad_norm``, ``train/lr``).
    val_history: ``(step, val/loss)`` after each validation.
    """

    status: str  # "finished" | "interrupted"
    ckpt_dir: Path
    last_checkpoint: Path | None
    best_checkpoint: Path | None
    run_id: str | None
    history: list[dict[str, float]] = field(default_factory=list)
    val_history: list[tuple[int, float]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes checkpoints through ``atomic_write``: a crash mid-save keeps the previous file intact."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        with atomic_write(path, "wb") as f:
            torch.save(checkpoint, f)


def resolve_precision(cfg: RunConfig) -> str:
    """``train.precision``, with ``auto`` = ``bf16-mixed`` when training on a CUDA device, else ``32-true``."""
    if cfg.train.precision != "auto":
        return cfg.train.precision
    on_gpu = torch.cuda.is_available() and cfg.train.accelerator in ("auto", "gpu", "cuda")
    return "bf16-mixed" if on_gpu else "32-true"


def resume_path(cfg: RunConfig, resume: bool | str | Path | None) -> Path | None:
    """The checkpoint to resume from: None (fresh run), ``<ckpt_dir>/last.ckpt`` (True) or the given path."""
    if resume is None or resume is False:
        return None
    path = cfg.ckpt_dir / LAST if resume is True else Path(resume).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"resume checkpoint {path} does not exist: train without --resume first, "
                                f"or pass the path of a .ckpt file (found: "
                                f"{sorted(p.name for p in path.parent.glob('*.ckpt')) or 'none'})")
    return path


def check_vocab(cfg: RunConfig, tokenizer_vocab: int) -> None:
    """Fail when the tokenizer emits ids the model cannot embed; warn when embedding rows go unused."""
    if tokenizer_vocab > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is not allowed: the prepared tokenizer has "
                          f"{tokenizer_vocab} ids; set model.vocab_size={tokenizer_vocab}")
    if tokenizer_vocab < cfg.model.vocab_size:
        rank_zero_warn(f"the tokenizer has {tokenizer_vocab} ids, fewer than model.vocab_size="
                       f"{cfg.model.vocab_size} (a small corpus stops merging early); the extra rows stay unused")


def fit(
    cfg: RunConfig,
    *,
    resume: bool | str | Path | None = None,
    callbacks: Sequence[Callback] = (),
    parent_run_id: str | None = None,
) -> TrainResult:
    """Train ``cfg``; return the histories, checkpoints and summary.

    Args:
        resume: True: continue from ``<ckpt_dir>/last.ckpt``; a path: from that checkpoint.
        callbacks: extra Lightning callbacks (run before moelab's own).
        parent_run_id: nest the MLflow run under this run (default: the enclosing study's, if any).

    Raises:
        ConfigError: inconsistent config (e.g. vocabulary sizes) before anything runs.
        NonFiniteLossError: a NaN/Inf training scalar (names the step and the last good checkpoint).
        KeyboardInterrupt: after Ctrl-C, once ``last.ckpt`` is saved (resume from it).
    """
    cfg.validate().check_trainable()
    ckpt = resume_path(cfg, resume)
    ckpt_dir = cfg.ckpt_dir
    started = time.perf_counter()
    corpus = prepare(cfg.data)  # builds the cache on first use, with progress on stderr
    check_vocab(cfg, corpus.vocab_size)
    t = cfg.train
    dm = TextDataModule(cfg.data, t.batch_size, cfg.seed, t.max_steps, t.val_batches)
    dm.corpus = corpus
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = LitMoELab(cfg)

    with ExitStack() as stack:
        run = None
        if cfg.tracking.enabled and rank_zero_only.rank == 0:
            run = stack.enter_context(start_run(
                cfg.tracking.experiment, cfg.tracking.run_name or cfg.name,
                tracking_uri=cfg.tracking.tracking_uri, parent_run_id=parent_run_id,
                log_system_metrics=cfg.tracking.log_system_metrics,
                system_metrics_interval_s=cfg.tracking.system_metrics_interval_s))
            _log_start(run, cfg, ckpt)
        module.mlflow_run_id = run.run_id if run else None
        if rank_zero_only.rank == 0:
            with atomic_write(ckpt_dir / "config.yaml") as f:
                f.write(to_yaml(cfg))

        monitor, throughput, stop = StepMonitor(ckpt_dir / LAST), _throughput(cfg), StopControl()
        best = ModelCheckpoint(dirpath=ckpt_dir, filename=BEST, monitor="val/loss", mode="min", save_top_k=1,
                               save_last=False, auto_insert_metric_name=False, enable_version_counter=False)
        trainer = L.Trainer(
            max_steps=t.max_steps,
            accelerator=t.accelerator,
            devices=t.devices,
            strategy=t.strategy,
            precision=resolve_precision(cfg),
            gradient_clip_val=t.grad_clip or None,
            gradient_clip_algorithm="norm",
            accumulate_grad_batches=t.accumulate_grad_batches,
            # Validation every val_every optimizer steps, counted across the (single, long) epoch.
            val_check_interval=t.val_every * t.accumulate_grad_batches,
            check_val_every_n_epoch=None,
            limit_val_batches=t.val_batches,
            num_sanity_val_steps=0,
            log_every_n_steps=t.log_every,
            deterministic=t.deterministic,
            use_distributed_sampler=False,  # TextDataModule splits the data over ranks itself
            callbacks=[*callbacks, monitor, throughput, stop, LastCheckpoint(ckpt_dir / LAST), best],
            logger=_logger(cfg, run),
            default_root_dir=str(ckpt_dir),
            plugins=[AtomicCheckpointIO()],
            enable_model_summary=False,
        )
        with _first_sigint_requests(stop.request_stop), warnings.catch_warnings():
            # config.yaml is always there already; the warning would only be noise.
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            trainer.fit(module, datamodule=dm, ckpt_path=str(ckpt) if ckpt else None)

        interrupted = stop.interrupted_at is not None
        last = ckpt_dir / LAST
        result = TrainResult(
            status="interrupted" if interrupted else "finished",
            ckpt_dir=ckpt_dir,
            last_checkpoint=last if last.exists() else None,
            best_checkpoint=Path(best.best_model_path) if best.best_model_path else None,
            run_id=run.run_id if run else None,
            history=monitor.history,
            val_history=monitor.val_history,
        )
        if trainer.is_global_zero:
            result.summary = _summarize(cfg, trainer, result, throughput, time.perf_counter() - started)
            _write_outputs(ckpt_dir, result)
            if run is not None:
                _log_end(run, result)
        if interrupted:
            raise KeyboardInterrupt(f"training interrupted at step {stop.interrupted_at}; resume from {last}")
    return result


def _throughput(cfg: RunConfig) -> Throughput:
    t = cfg.train
    return Throughput(tokens_per_device_step=t.batch_size * t.accumulate_grad_batches * cfg.data.seq_len,
                      flops_per_token_fwd=flops_per_token(cfg.model, cfg.data.seq_len),
                      log_every=t.log_every)


def _logger(cfg: RunConfig, run: Run | None) -> Any:
    if run is None:
        return False
    from lightning.pytorch.loggers import MLFlowLogger

    # tracking_uri passed explicitly: MLFlowLogger's default reads $MLFLOW_TRACKING_URI at import time.
    return MLFlowLogger(experiment_name=cfg.tracking.experiment, tracking_uri=run.tracking_uri, run_id=run.run_id)


@contextmanager
def _first_sigint_requests(request_stop: Callable[[], None]) -> Iterator[None]:
    """While fitting, the first Ctrl-C asks for a clean stop (checkpoint, then KeyboardInterrupt); the second aborts.

    Lightning's own handler would exit the process mid-step; finishing the step keeps weights
    and optimizer state consistent with the checkpoint. Only the main thread can own signals.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, previous)
        rank_zero_info("\nCtrl-C: stopping after this step and saving last.ckpt (press Ctrl-C again to abort now)")
        request_stop()

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _accounting(cfg: RunConfig) -> dict[str, Any]:
    counts = param_counts(cfg.model)
    return {"params_total": counts["total"], "params_activated": counts["activated"],
            "params_activated_non_embedding": counts["activated_non_embedding"],
            "flops_per_token_fwd": flops_per_token(cfg.model, cfg.data.seq_len)}


def _log_start(run: Run, cfg: RunConfig, ckpt: Path | None) -> None:
    run.log_params(flatten(cfg))
    run.log_params({f"accounting.{k}": v for k, v in _accounting(cfg).items()})
    run.log_text(to_yaml(cfg), "config.yaml")
    run.log_text(model_summary(cfg.model, cfg.data.seq_len), "model_summary.txt")
    tags: dict[str, Any] = {"moelab.preset": cfg.name}
    if ckpt is not None:
        tags["moelab.resumed_from_checkpoint"] = str(ckpt)
        previous = _checkpoint_run_id(ckpt)
        if previous:
            tags["moelab.resumed_from_run"] = previous
    run.set_tags(tags)


def _checkpoint_run_id(path: Path) -> str | None:
    state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return state.get("moelab", {}).get("mlflow_run_id")


def _summarize(cfg: RunConfig, trainer: L.Trainer, result: TrainResult, throughput: Throughput,
               wall_s: float) -> dict[str, Any]:
    last_loss = result.history[-1]["train/loss"] if result.history else math.nan
    vals = [v for _, v in result.val_history]
    return {
        "name": cfg.name,
        "status": result.status,
        "run_id": result.run_id,
        "steps": trainer.global_step,
        "final_train_loss": last_loss,
        "final_val_loss": vals[-1] if vals else None,
        "best_val_loss": min(vals) if vals else None,
        "B": cfg.train.batch_size,
        "T": cfg.data.seq_len,
        "world_size": trainer.world_size,
        "precision": resolve_precision(cfg),
        "device": torch.cuda.get_device_name() if trainer.strategy.root_device.type == "cuda" else "cpu",
        **throughput.summary(trainer.strategy.root_device),
        **_accounting(cfg),
        "wall_s": wall_s,
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "best_checkpoint": str(result.best_checkpoint) if result.best_checkpoint else None,
    }


def _write_outputs(ckpt_dir: Path, result: TrainResult) -> None:
    import pandas as pd

    with atomic_write(ckpt_dir / "history.csv") as f:
        pd.DataFrame(result.history).to_csv(f, index=False)
    write_json(ckpt_dir / "summary.json", result.summary)


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


def _log_end(run: Run, result: TrainResult) -> None:
    import pandas as pd

    final = {f"final/{k}": v for k, v in result.summary.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None}
    run.log_metrics(final, step=result.summary.get("steps", 0))
    run.log_figure(loss_figure(result), "loss_curve.png")
    if result.history:
        run.log_table(pd.DataFrame(result.history), "metrics_table.json")
    run.log_dict(result.summary, "summary.json")


def load_model(checkpoint: str | Path, map_location: str | torch.device = "cpu") -> tuple[Any, RunConfig]:
    """``(MoELab, RunConfig)`` from a moelab checkpoint: the model in eval mode with the trained weights."""
    from moelab.config import from_dict
    from moelab.model import MoELab

    state = torch.load(checkpoint, map_location=map_location, weights_only=False)
    if "moelab" not in state:
        raise ValueError(f"{checkpoint} is not a moelab training checkpoint (no 'moelab' entry)")
    cfg = from_dict(state["moelab"]["config"])
    model = MoELab(cfg.model)
    prefix = "model."
    model.load_state_dict({k[len(prefix):]: v for k, v in state["state_dict"].items() if k.startswith(prefix)})
    return model.eval(), cfg
