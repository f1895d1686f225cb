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
from typing import Any

import lightning as L
import torch

from moelab.config import RunConfig, to_dict
from moelab.model import MoELab
from moelab.train.balancer import BalancerCallback
from moelab.train.callbacks import HostScalar


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
        if cfg.train.compile:
            self.model.compile()
        self.step_scalars: dict[str, torch.Tensor | HostScalar] = {}
        self.mlflow_run_id: str | None = None  # stored in checkpoints so a resumed run can link back

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
        out = self.model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False,
                         segment_ids=self._segments(batch))
        loss = out.loss + out.aux_loss
        self.step_scalars = {"train/loss": loss.detach(), "train/ce": out.loss.detach(),
                             "train/aux_loss": out.aux_loss.detach()}
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
