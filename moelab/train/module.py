"""The LightningModule: loss, optimizer, schedule and logging around the plain ``MoELab`` model.

Lightning owns the loop (devices, precision, accumulation, clipping, checkpoints); the math
stays in ``moelab.model``. The loss is ``ModelOutput.loss`` (mean next-token cross-entropy)
plus ``ModelOutput.aux_loss`` (the routers' loss terms from ``model.moe``: the aux-loss balancer,
the z-loss; zero without them). The routing statistics of every training forward feed the
balancer inside the model (``moelab.model.balance``); ``configure_callbacks`` adds the
:class:`moelab.train.balancer.BalancerCallback` that updates the biases once per optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

from moelab.base import ConfigError
from moelab.config import CAPTURED_MODES, COMPILE_MODES, RunConfig, to_dict
from moelab.model import MoELab
from moelab.model.balance import BalanceStep
from moelab.train.balancer import BalancerCallback
from moelab.train.callbacks import HostScalar

# A compiled model recompiles per new input shape (a curriculum's stages, the last short batch of a validation),
# and AttnRes's depth aggregation once per number of sources it reads (up to two per layer: k3-mini's 13 layers
# exceeded dynamo's default limit of 8 on the H200, kernels/results/model_capture_h200.json). Past
# RECOMPILE_LIMIT + 2 x layers versions of one frame dynamo raises instead of falling back to eager without a word.
RECOMPILE_LIMIT = 8


def compile_model(model: torch.nn.Module, mode: str, device: torch.device, backend: str = "inductor") -> None:
    """Apply ``train.compile`` to ``model`` in place (``nn.Module.compile``: the state-dict keys stay the same).

    ``none``: nothing. ``default``: torch.compile (dynamo + inductor); the fused Triton ops
    (``torch.compiler.disable``) run eagerly between the compiled pieces. A frame recompiled more than
    ``RECOMPILE_LIMIT + 2 x layers`` times raises (``fail_on_recompile_limit_hit``; dynamo's warning above the
    error names the frame and the guard that failed) instead of running on eagerly without a word.
    ``graphs``: the model stays as it is (:class:`LitMoELab` captures the whole step: :class:`CapturedStep`);
    only the device is checked. ``compiled_graphs``: compiled as ``default``, and the step captured as ``graphs``
    (inductor's fused kernels, the launches of every piece replayed from one graph). Raises ConfigError for an
    unknown mode or a captured mode without CUDA.
    ``backend``: torch.compile's (tests pass ``"eager"`` to trace without generating code).
    """
    if mode not in COMPILE_MODES:
        raise ConfigError(f"train.compile={mode!r} is not allowed: expected one of "
                          f"{', '.join(map(repr, COMPILE_MODES))}")
    if mode in CAPTURED_MODES and device.type != "cuda":
        raise ConfigError(f"train.compile={mode!r} needs a CUDA device (CUDA graphs); this run trains on "
                          f"{device.type}: use train.compile='default' or 'none'")
    if mode not in ("default", "compiled_graphs"):
        return
    layers = getattr(model, "layers", ())
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT + 2 * len(layers))
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    import torch._inductor.config as inductor_config

    options = {}
    if backend == "inductor" and hasattr(inductor_config, "_use_fp64_for_unbacked_floats"):
        # inductor types a Python float passed to a user Triton kernel as fp64 where Triton's own launcher
        # passes fp32: our kernels' fp32 arithmetic would turn fp64 (and a loop-carried fp32 sum fails to compile)
        options["_use_fp64_for_unbacked_floats"] = False
    model.compile(backend=backend, **({"options": options} if options else {}))


def train_step_fn(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float,
                  dtype: torch.dtype | None, balancer_start_step: int = 0,
                  first_step: int = 0) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The step :class:`LitMoELab` trains with under Lightning, as one function (benchmarks, :class:`CapturedStep`).

    ``step({"input_ids", "targets"[, "segment_ids"]} [B, T])``: the forward under autocast to ``dtype`` (None: none;
    ``cache_enabled=False``, as a captured step needs), ``loss + aux_loss`` backward, the gradient norm, the
    balancer's update (``moelab.model.balance.balance_step``, as ``BalancerCallback`` runs it), clipping to
    ``grad_clip`` (0: none), the optimizer step and ``zero_grad``. Returns ``loss``, ``ce``, ``aux_loss`` and
    ``grad_norm`` (0-dim tensors on the device; no host sync anywhere) and, with MoE layers, what the balancer
    did: ``balance/load`` ``[L, n]``, ``balance/bias`` ``[L, n]`` and ``balance/<metric>`` ``[L]``, for the layers
    named in ``step.balance_layers`` (set by the first call).

    ``balancer_start_step`` S > 0 (``train.balancer_start_step``, a warm start): the step's index lives on the
    device (``step.index``, a 0-dim int64 starting at ``first_step``, the optimizer steps already done, +1 at the
    end of every call) and the switch is arithmetic on it, so one captured graph serves both sides: while
    index < S the aux loss is replaced by zero (``torch.where``: no gradient reaches it) and the balancer's
    update is undone (:func:`moelab.train.balancer.gate`: zero bias, ``quantile_load`` averages at 1), as the
    eager path does with host branches. S = 0: no counter, the step as without a warm start.
    """
    from moelab.model.balance import balance_step
    from moelab.train.balancer import gate

    params = [p for p in model.parameters() if p.requires_grad]
    device_type = params[0].device.type
    index = torch.full((), first_step, dtype=torch.long, device=params[0].device) if balancer_start_step else None

    def step(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None,
                            cache_enabled=False):
            out = model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False,
                        segment_ids=batch.get("segment_ids"), cu_seqlens=batch.get("cu_seqlens"))
        aux, on = out.aux_loss, None
        if index is not None:  # warm start: the balancer is on from step index S (0-based), device-side
            on = index >= balancer_start_step
            aux = torch.where(on, aux, torch.zeros_like(aux))
        loss = out.loss + aux
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        balanced = balance_step(model)
        if on is not None:
            if balanced is not None:
                gate(model, balanced, on)
            index.add_(1)
        if grad_clip:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        res = {"loss": loss.detach(), "ce": out.loss.detach(), "aux_loss": aux.detach(), "grad_norm": norm}
        if balanced is not None:
            step.balance_layers = balanced.layers
            res.update({"balance/load": balanced.load, "balance/bias": balanced.bias},
                       **{f"balance/{k}": v for k, v in balanced.metrics.items()})
        return res

    step.balance_layers = []
    step.index = index
    return step


class CaptureError(RuntimeError):
    """A training step that cannot run as one CUDA graph (``train.compile='graphs'``); the message names the pieces."""


def _where_raised(exc: BaseException) -> str:
    """The innermost moelab frame of ``exc``'s traceback (``moelab/ops/moe.py:543 experts_grouped``): the piece whose
    op CUDA refused to capture (``moelab.train.perf.moelab_site``)."""
    import traceback

    from moelab.train.perf import moelab_site

    frames = traceback.extract_tb(exc.__traceback__)
    return moelab_site(frames) if frames else "an unknown place"


def _blockers(calls: list[tuple[str, str]]) -> str:
    seen: dict[str, int] = {}
    for op, where in calls:
        seen[f"{op} at {where}"] = seen.get(f"{op} at {where}", 0) + 1
    pieces = "; ".join(f"{k}" + (f" (x{n})" if n > 1 else "") for k, n in seen.items())
    return (f"train.compile='graphs' cannot capture this step: it waits for the GPU (a host sync) in {pieces}; "
            f"use train.compile='default' or 'none', or take the sync out of the step")


class CapturedStep:
    """A whole training step as one CUDA graph: ``step(batch) -> {name: 0-dim tensor}`` (forward, backward, the
    balancer's update, clipping, the optimizer: whatever ``step`` runs), replayed on static input buffers.

    The first ``warmup`` calls run ``step`` eagerly on a side stream (real steps: they fill the Triton and
    grouped-GEMM caches, the optimizer state and the gradients); the next call captures it and replays the
    graph, and every later call copies its batch into the static buffers and replays. Each call returns
    copies of the step's outputs (the graph's own are overwritten by the next replay). What ``step`` needs:
    no host sync (the last warm-up step runs under ``moelab.train.perf.HostSyncs``: a sync on a CUDA tensor
    raises :class:`CaptureError` naming the op and the moelab function, as does a capture that CUDA
    refuses), no new shapes (a batch of another shape raises ValueError), and an optimizer that runs in a
    graph (AdamW with ``capturable=True`` or ``fused=True``, a tensor ``lr`` to change the rate between
    replays); autocast with ``cache_enabled=False`` inside ``step``
    (a cast cached outside the graph would be captured as a stale constant).

    ``recapture=True`` (a context curriculum: one shape per stage): a batch of another shape (or other keys) drops the
    graph and its memory and starts over, ``warmup`` eager steps on the new shape, then its capture; shapes that come
    back and forth would recapture each time, so the caller keeps them fixed within a stage (packed documents: their
    offsets padded to one capacity, :func:`moelab.ops.varlen.pad_cu_seqlens`). ``captures`` counts the graphs made.

    ``check_syncs=False`` (a step around a ``torch.compile``'d model, ``train.compile='compiled_graphs'``): the last
    warm-up step runs without ``HostSyncs`` (a torch-function mode changes what dynamo traces: it would recompile
    the model for that one step, and inductor's kernels do not pass through it anyway); a sync then surfaces as
    the CUDA error of the capture, raised as :class:`CaptureError`.
    """

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]], warmup: int = 3,
                 check_syncs: bool = True, recapture: bool = False) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("CapturedStep needs a CUDA device (CUDA graphs)")
        if warmup < 1:
            raise ValueError(f"CapturedStep: warmup={warmup} is not allowed: expected >= 1 eager step before the "
                             f"capture (caches, optimizer state, the host-sync check)")
        self.step, self.warmup, self.check_syncs, self.recapture = step, warmup, check_syncs, recapture
        self.calls = self.captures = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, torch.Tensor] | None = None
        self.out: dict[str, torch.Tensor] = {}

    def _load(self, batch: dict[str, torch.Tensor]) -> None:
        if self.static is None:
            self.static = {k: v.clone() for k, v in batch.items()}
            return
        if self.recapture and {k: v.shape for k, v in batch.items()} != {k: v.shape for k, v in self.static.items()}:
            # a new stage: the old graph (and the memory pool it holds) goes, the new shape warms up and is captured
            self.graph, self.out, self.calls = None, {}, 0
            torch.cuda.empty_cache()  # the dropped graph's private pool goes back to the device, not to a cache
            self.static = {k: v.clone() for k, v in batch.items()}
            return
        for k, v in batch.items():
            if k not in self.static or self.static[k].shape != v.shape:
                got = tuple(v.shape)
                want = tuple(self.static[k].shape) if k in self.static else None
                raise ValueError(f"CapturedStep: batch[{k!r}] has shape {got}, the captured step takes {want}")
            self.static[k].copy_(v, non_blocking=True)

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from moelab.train.perf import HostSyncs

        self._load(batch)
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # The last warm-up step (the first ones fill caches, which may read values once) must not sync.
            last = self.calls == self.warmup and self.check_syncs
            seen = HostSyncs(devices=("cuda",)) if last else contextlib.nullcontext(None)
            with torch.cuda.stream(side), seen:
                out = self.step(self.static)
            torch.cuda.current_stream().wait_stream(side)
            if isinstance(seen, HostSyncs) and seen.calls:
                raise CaptureError(_blockers(seen.calls))
            return {k: v.detach().clone() for k, v in out.items()}
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: a data loader's pin-memory thread may call CUDA while this thread captures.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self.out = self.step(self.static)
            except RuntimeError as e:
                where = _where_raised(e)
                raise CaptureError(f"the step could not be captured as a CUDA graph (at {where}): {e}") from e
            self.graph = graph
            self.captures += 1
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

    ``train.compile='graphs'``: the whole step (forward, backward, the balancer's update, clipping, AdamW)
    replays as one CUDA graph (:class:`CapturedStep` around :func:`train_step_fn`) under Lightning's manual
    optimization; the module steps the schedule, counts the step for the trainer, and hands the balancer's
    result to :class:`BalancerCallback` itself (no ``perf/balancer_ms``: a graph has no events to read).
    One device, one micro-batch per step (``moelab.config`` refuses the rest), one shape (with a curriculum, one per
    stage: the graph is captured again when the length changes; packed documents' offsets padded to one shape).
    """

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = MoELab(cfg.model)
        self._compiled = False  # train.compile is applied in setup(), once the device is known
        self.automatic_optimization = cfg.train.compile not in CAPTURED_MODES
        self._captured: CapturedStep | None = None
        self._doc_capacity: dict[tuple[int, ...], int] = {}  # packed documents per batch shape (captured steps)
        self.step_scalars: dict[str, torch.Tensor | HostScalar] = {}
        self.mlflow_run_id: str | None = None  # stored in checkpoints so a resumed run can link back

    def setup(self, stage: str) -> None:
        if not self._compiled:
            compile_model(self.model, self.cfg.train.compile, self.trainer.strategy.root_device)
            if self.cfg.train.compile in CAPTURED_MODES and self.trainer.world_size > 1:
                raise ConfigError(f"train.compile={self.cfg.train.compile!r} runs on one device; this run has "
                                  f"{self.trainer.world_size} ranks: use train.compile='default' or 'none'")
            self._compiled = True

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(input_ids, targets)

    def _segments(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        """The batch's document numbers ``segment_ids [B, T]`` when ``data.document_mask`` keeps packed documents
        apart (the data module adds them with a curriculum), with the ``cu_seqlens`` its loaders count on the CPU
        (``moelab.data.datamodule.collate``); else None for both."""
        if not self.cfg.data.document_mask:
            return {"segment_ids": None, "cu_seqlens": None}
        return {"segment_ids": batch.get("segment_ids"), "cu_seqlens": batch.get("cu_seqlens")}

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
        if not self.automatic_optimization:
            return self._captured_step(batch)
        out = self.model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False,
                         **self._segments(batch))
        aux = out.aux_loss
        if self.global_step < self.cfg.train.balancer_start_step:  # warm start: the balancer is still off
            aux = torch.zeros_like(aux)
        loss = out.loss + aux
        self.step_scalars = {"train/loss": loss.detach(), "train/ce": out.loss.detach(),
                             "train/aux_loss": aux.detach()}
        if self.cfg.data.curriculum:  # the stage's length, so tokens/s and loss can be read per stage
            self.step_scalars["train/seq_len"] = float(batch["input_ids"].shape[1])  # a device copy would sync
        # No self.log here: a tensor logged for the progress bar becomes a float after every batch (a host
        # sync per step); StepProgressBar shows StepMonitor's train/loss instead.
        return loss

    def _captured_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """train.compile='graphs' or 'compiled_graphs': one optimizer step as a CUDA graph replay (the first steps
        eager, then the capture: :class:`CapturedStep`), then what Lightning's automatic loop would do."""
        if self._captured is None:
            optimizer = self.optimizers().optimizer
            dtype = torch.bfloat16 if str(self.trainer.precision).startswith("bf16") else None
            self._train_step = train_step_fn(self.model, optimizer, self.cfg.train.grad_clip, dtype,
                                             self.cfg.train.balancer_start_step, self.global_step)
            self._captured = CapturedStep(self._train_step, check_syncs=self.cfg.train.compile == "graphs",
                                          recapture=bool(self.cfg.data.curriculum))
        out = self._captured(self._static_batch(batch))
        self.step_scalars = {"train/loss": out["loss"], "train/ce": out["ce"], "train/aux_loss": out["aux_loss"],
                             "train/grad_norm": out["grad_norm"]}
        if "balance/load" in out:
            metrics = {k.removeprefix("balance/"): v for k, v in out.items()
                       if k.startswith("balance/") and k not in ("balance/load", "balance/bias")}
            step = BalanceStep(list(self._train_step.balance_layers), out["balance/load"], out["balance/bias"],
                               metrics)
            for callback in self.trainer.callbacks:
                if isinstance(callback, BalancerCallback):
                    callback.record(self.trainer, self, step)
        if self.cfg.data.curriculum:  # the stage's length, as the eager step records it
            self.step_scalars["train/seq_len"] = float(batch["input_ids"].shape[1])
        self.lr_schedulers().step()
        # Manual optimization counts optimizer steps through LightningOptimizer.step, which the graph bypasses.
        progress = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        progress.increment_ready()
        progress.increment_completed()
        return out["loss"]

    def _static_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the captured step reads of ``batch``: ids and targets, and with packed documents their ``segment_ids``
        and ``cu_seqlens`` padded with empty documents to a capacity per batch shape (one graph per curriculum stage:
        the number of documents differs from batch to batch). The capacity starts at ``B + max(4, B // 8)`` (the
        corpus documents are long: most rows hold one) and doubles its margin when a batch holds more, the one
        case that recaptures within a stage."""
        from moelab.ops.varlen import pad_cu_seqlens

        out = {"input_ids": batch["input_ids"], "targets": batch["targets"]}
        seg = self._segments(batch)
        if seg["segment_ids"] is None:
            return out
        if seg["cu_seqlens"] is None:
            raise CaptureError(f"train.compile={self.cfg.train.compile!r} with packed documents needs their offsets "
                               "counted by the data loader (batch['cu_seqlens'], moelab.data.datamodule.collate): "
                               "counting them in the step is a host sync")
        B = batch["input_ids"].shape[0]
        n = seg["cu_seqlens"].numel() - 1
        key = tuple(batch["input_ids"].shape)
        cap = self._doc_capacity.get(key, B + max(4, B // 8))
        while n > cap:
            cap = B + 2 * (cap - B)
        self._doc_capacity[key] = cap
        return out | {"segment_ids": seg["segment_ids"], "cu_seqlens": pad_cu_seqlens(seg["cu_seqlens"], cap)}

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Before clipping: the norm the raw gradient had (what blows up first when training diverges).
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        self.step_scalars["train/grad_norm"] = norm.detach()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False,
                         **self._segments(batch))
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
        on_gpu = torch.cuda.is_available() and all(p.is_cuda for p in self.parameters())
        if not self.automatic_optimization and on_gpu:
            # graphs: the captured step clips itself; the kernel runs in the graph and reads the rate from a
            # device tensor that the schedule fills between replays (a float would be baked into the graph).
            optimizer = torch.optim.AdamW(groups, lr=torch.tensor(t.lr, device=self.device), betas=t.betas,
                                          fused=True, capturable=True)
        else:
            optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, fused=(not t.grad_clip and on_gpu) or None)
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
            group.update(initial_lr=t.lr, weight_decay=decay, betas=t.betas)
            if isinstance(group["lr"], torch.Tensor):  # graphs: the captured step reads this tensor
                group["lr"].fill_(t.lr * factor)
            else:
                group["lr"] = t.lr * factor

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
