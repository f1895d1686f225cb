"""The LightningModule: loss, optimizer, schedule and logging around the plain ``MoELab`` model.

Lightning owns the loop (devices, precision, accumulation, clipping, checkpoints); the math
stays in ``moelab.model``. The loss is ``ModelOutput.loss`` (mean next-token cross-entropy)
plus ``ModelOutput.aux_loss`` (the routers' loss terms from ``model.moe``: the aux-loss balancer,
the z-loss; zero without them). The routing statistics of every training forward feed the
balancer inside the model (``moelab.model.balance``); ``configure_callbacks`` adds the
:class:`moelab.train.balancer.BalancerCallback` that updates the biases once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from moelab.base import ConfigError
from moelab.config import COMPILE_MODES, RunConfig, to_dict
from moelab.model import MoELab
from moelab.train.balancer import BalancerCallback
from moelab.train.callbacks import HostScalar

# A compiled model recompiles per new input shape (a curriculum's stages, the last short batch of a validation),
# and AttnRes's depth aggregation once per number of sources it reads (up to two per layer: 26 for k3-mini's Block
# AttnRes on the H200, where dynamo's default limit of 8 made every later depth run eagerly). Past
# RECOMPILE_LIMIT + 2 x layers versions of one frame dynamo raises instead of falling back to eager without a word.
RECOMPILE_LIMIT = 8


def compile_model(model: torch.nn.Module, mode: str, device: torch.device, backend: str = "inductor") -> None:
    """Apply ``train.compile`` to ``model`` in place (``nn.Module.compile``: the state-dict keys stay the same).

    ``none``: nothing. ``default``: torch.compile (dynamo + inductor); the fused Triton ops
    (``torch.compiler.disable``) run eagerly between the compiled pieces. ``graphs``: the same with
    ``mode="reduce-overhead"``: each compiled piece's forward and backward replay as CUDA graphs. Both
    compiled modes fail loudly rather than slow down silently: a frame recompiled more than
    ``RECOMPILE_LIMIT + 2 x layers`` times raises (``fail_on_recompile_limit_hit``; dynamo's warning above the
    error names the frame and the guard that failed), and with ``graphs`` a compiled piece
    that cannot be captured raises an error naming why (inductor's ``cudagraph_or_error``; otherwise it
    would run uncaptured). Raises ConfigError for an unknown mode or ``graphs`` without CUDA. ``backend``:
    torch.compile's (tests pass ``"eager"`` to trace without generating code).
    """
    if mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile={mode!r} is not allowed: expected one of "
                          f"{', '.join(map(repr, COMPILE_MODES))}")
    if mode == "none":
        return
    if mode == "graphs" and device.type != "cuda":
        raise ConfigError(f"train.compile='graphs' needs a CUDA device (CUDA graphs); this run trains on "
                          f"{device.type}: use train.compile='default' or 'none'")
    layers = getattr(model, "layers", ())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT + 2 * len(layers))
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    if mode == "graphs" and hasattr(torch._inductor.config.triton, "cudagraph_or_error"):  # torch >= 2.12
        torch._inductor.config.triton.cudagraph_or_error = True
    model.compile(mode="reduce-overhead" if mode == "graphs" else None, backend=backend)


def train_step_fn(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                  dtype: torch.dtype | None) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The step :class:`LitMoELab` trains with under Lightning, as one function (benchmarks, :class:`CapturedStep`).

    ``step({"input_ids", "targets"[, "segment_ids"]} [B, T])``: the forward under autocast to ``dtype`` (None: none;
    ``cache_enabled=False``, as a captured step needs), ``loss + aux_loss`` backward, the gradient norm, the
    balancer's update (``moelab.model.balance.balance_step``, as ``BalancerCallback`` runs it), clipping to
    ``grad_clip`` (0: none), the optimizer step and ``zero_grad``. Returns ``loss``, ``ce``, ``aux_loss`` and
    ``grad_norm`` (0-dim tensors on the device; no host sync anywhere).
    """
    from moelab.model.balance import balance_step

    params = [p for p in model.parameters() if p.requires_grad]
    device_type = params[0].device.type

    def step(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None,
                            cache_enabled=False):
            out = model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False,
                        segment_ids=batch.get("segment_ids"))
        loss = out.loss + out.aux_loss
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        balance_step(model)
        if grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "ce": out.loss.detach(), "aux_loss": out.aux_loss.detach(), "grad_norm": norm}

    return step


class CapturedStep:
    """A whole training step as one CUDA graph: ``step(batch) -> {name: 0-dim tensor}`` (forward, backward, the
    balancer's update, clipping, the optimizer: whatever ``step`` runs), replayed on static input buffers.

    The first ``warmup`` calls run ``step`` eagerly on a side stream (real steps: they fill the Triton and
    grouped-GEMM caches, the optimizer state and the gradients); the next call captures it and replays the
    graph, and every later call copies its batch into the static buffers and replays. Each call returns
    copies of the step's outputs (the graph's own are overwritten by the next replay). What ``step`` needs:
    no host sync (``moelab.train.perf.HostSyncs``), no new shapes (a batch of another shape raises
    ValueError), and an optimizer that runs in a graph (AdamW with ``capturable=True`` or ``fused=True``, a
    tensor ``lr`` to change the rate between replays); autocast with ``cache_enabled=False`` inside ``step``
    (a cast cached outside the graph would be captured as a stale constant).
    """

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], warmup: int = 3) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("CapturedStep needs a CUDA device (CUDA graphs)")
        self.step, self.warmup = step, warmup
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, torch.Tensor] | None = None
        self.out: dict[str, torch.Tensor] = {}

    def _load(self, batch: dict[str, torch.Tensor]) -> None:
        if self.static is None:
            self.static = {k: v.clone() for k, v in batch.items()}
            return
        for k, v in batch.items():
            if k not in self.static or self.static[k].shape != v.shape:
                got = tuple(v.shape)
                want = tuple(self.static[k].shape) if k in self.static else None
                raise ValueError(f"CapturedStep: batch[{k!r}] has shape {got}, the captured step takes {want}")
            self.static[k].copy_(v, non_blocking=True)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._load(batch)
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self.step(self.static)
            torch.cuda.current_stream().wait_stream(side)
            return {k: v.detach().clone() for k, v in out.items()}
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self.step(self.static)
            self.graph = graph
        self.graph.replay()
        return {k: v.detach().clone() for k, v in self.out.items()}


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step``: linear warmup, then cosine to ``min_lr_ratio``.

    ``step`` counts optimizer steps from 0; warmup reaches 1.0 at ``step == warmup_steps`` and the
    cosine reaches ``min_lr_ratio`` at ``step == max_steps`` (and stays there).
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LitMoELab(L.LightningModule):
    """``MoELab(cfg.model)`` trained with AdamW + warmup/cosine on ``{"input_ids", "targets"}`` batches ``[B, T]``.

    Each optimizer step leaves its scalars in ``step_scalars`` (detached 0-dim tensors:
    ``train/loss``, ``train/ce``, ``train/aux_loss``, ``train/grad_norm``, and with MoE layers the
    balancer's ``balance/*`` per-layer metrics; host values: with a curriculum ``train/seq_len``, with
    MoE layers the balancer's time), which :class:`moelab.train.callbacks.StepMonitor` turns into
    floats one step later, so reading them never makes the host wait for the step it has just queued.
    """

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = MoELab(cfg.model)
        self._compiled = False  # train.compile is applied in setup(), once the device is known
        self.step_scalars: dict[str, torch.Tensor | HostScalar] = {}
        self.mlflow_run_id: str | None = None  # stored in checkpoints so a resumed run can link back

    def setup(self, stage: str) -> None:
        if not self._compiled:
            compile_model(self.model, self.cfg.train.compile, self.trainer.strategy.root_device)
            self._compiled = True

    def _step_begin(self) -> None:
        # CUDA graphs (train.compile='graphs') reuse their output memory: a new step tells them the outputs
        # of the previous one are no longer read (StepMonitor reads copies: see training_step).
        if self.cfg.train.compile == "graphs":
            torch.compiler.cudagraph_mark_step_begin()

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(input_ids, targets)

    def _segments(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The batch's document numbers ``[B, T]`` when ``data.document_mask`` keeps packed documents apart
        (the data module adds them with a curriculum), else None."""
        return batch.get("segment_ids") if self.cfg.data.document_mask else None

    def configure_callbacks(self) -> list[L.Callback]:
        # Every MoE model gets the balancer step (a no-op update for none / aux_loss) and its load metrics.
        m = self.cfg.model
        if m.dense_layers >= m.n_layers:
            return []
        return [BalancerCallback(self.cfg.train.batch_size * self.cfg.data.seq_len)]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # the loss without the [B, T, vocab] logits (moelab.ops.linear_ce): the fla-shape model at B8
        # T4096 peaked at 33.0 instead of 42.6 GB on the H200, and stepped faster (README.md, "Measured so far").
        # check_ids=False: the data module's ids are checked against the vocabulary once, before
        # training; the per-batch range check would cost a host sync every step.
        self._step_begin()
        out = self.model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False,
                         segment_ids=self._segments(batch))
        loss = out.loss + out.aux_loss
        # With graphs, copies: a CUDA graph's outputs are overwritten by its next replay, and StepMonitor reads
        # these a step later.
        keep = (lambda t: t.detach().clone()) if self.cfg.train.compile == "graphs" else torch.Tensor.detach
        self.step_scalars = {"train/loss": keep(loss), "train/ce": keep(out.loss), "train/aux_loss": keep(out.aux_loss)}
        if self.cfg.data.curriculum:  # the stage's length, so tokens/s and loss can be read per stage
            self.step_scalars["train/seq_len"] = float(batch["input_ids"].shape[1])  # a device copy would sync
        # No self.log here: a tensor logged for the progress bar becomes a float after every batch (a host
        # sync per step); StepProgressBar shows StepMonitor's train/loss instead.
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Before clipping: the norm the raw gradient had (what blows up first when training diverges).
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        self.step_scalars["train/grad_norm"] = norm.detach()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._step_begin()
        out = self.model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False,
                         segment_ids=self._segments(batch))
        # Every rank holds the same number of equal-size batches, so the mean of rank means is exact.
        self.log("val/loss", out.loss, prog_bar=True, sync_dist=True)
        return out.loss

    def configure_optimizers(self) -> dict[str, Any]:
        t = self.cfg.train
        # Decay matrices only: norms' gains, biases and the router bias buffer stay undecayed.
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # Lightning refuses gradient clipping with fused AdamW under mixed precision (it unscales
        # internally), so the fused kernel is used only when clipping is off; foreach otherwise.
        fused = not t.grad_clip and torch.cuda.is_available() and all(p.is_cuda for p in self.parameters())
        optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, fused=fused or None)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, t.warmup_steps, t.max_steps, t.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self) -> None:
        # After a resume Lightning has restored the checkpoint's optimizer and schedule state; the
        # config's values win (the fields moelab.config.RESUME_APPLIED lists), so the run trains with
        # the settings it records. On a fresh start this recomputes the same values.
        t = self.cfg.train
        optimizer = self.trainer.optimizers[0]
        schedule = self.trainer.lr_scheduler_configs[0].scheduler
        schedule.base_lrs = [t.lr] * len(optimizer.param_groups)
        factor = lr_factor(schedule.last_epoch, t.warmup_steps, t.max_steps, t.min_lr_ratio)
        for group, decay in zip(optimizer.param_groups, (t.weight_decay, 0.0)):
            group.update(initial_lr=t.lr, lr=t.lr * factor, weight_decay=decay, betas=t.betas)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Self-describing checkpoints (load_model needs no preset) and exact resume of any RNG use.
        checkpoint["moelab"] = {
            "config": to_dict(self.cfg),
            "mlflow_run_id": self.mlflow_run_id,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("moelab", {})
        if state.get("rng_cpu") is not None:
            torch.set_rng_state(state["rng_cpu"])
        if state.get("rng_cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
