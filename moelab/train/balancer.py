"""The balancer's training side: the once-per-optimizer-step bias update under DDP, its metrics, the load heatmap.

The rules and the statistics live in ``moelab.model.balance`` (no ``torch.distributed`` there);
this module supplies the data-parallel collectives and the moment: :class:`BalancerCallback`
runs ``balance_step`` in ``on_before_optimizer_step``, which Lightning calls once per optimizer
step, after the backward of the step's last micro-batch. So the statistics of every micro-batch
(gradient accumulation) and every rank (DDP) enter one update, and all ranks write the same bias.

What a run records (``moelab.train.runner`` wires it): per optimizer step, per MoE layer, the
``balance/*`` metrics (MaxVio_batch, load CV, dead experts, router entropy) and the balancer's own
time ``perf/balancer_ms`` and ``perf/balancer_share``, in ``history.csv`` and in MLflow at the
``train/*`` steps; ``val/maxvio_global`` at each validation; at the end ``load_heatmap.png`` and
``balance_trajectories.pt`` (every step's loads and biases) in the run folder and as MLflow
artifacts. The trajectories travel in the checkpoint, so after a resume they cover the whole run.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from moelab.base import ConfigError
from moelab.model.balance import (
    BalanceStep,
    Collective,
    balance_step,
    balanced_routers,
    clear_eval_loads,
    eval_loads,
    max_vio,
    qb_target,
)
from moelab.train.callbacks import Event, device_event
from moelab.utils import atomic_path


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over the default process group (in place); ``t`` itself without one."""
    if _world() > 1:
        dist.all_reduce(t)
    return t


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` ``[m_rank, c]`` concatenated along dim 0 in rank order (ranks may differ in m_rank)."""
    world = _world()
    if world == 1:
        return t
    rows = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(sizes, rows)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros(max(sizes), *t.shape[1:])
    padded[:t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes)])


def all_gather_stack(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` ``[c]`` (the same shape on all ranks) stacked in rank order: ``[world, c]``."""
    world = _world()
    if world == 1:
        return t[None]
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.stack(out)


@torch.no_grad()
def compare_replicas(module: torch.nn.Module, gather: Collective = all_gather_stack) -> dict[str, bool]:
    """Whether every data-parallel rank holds the same router biases and the same weights.

    ``bias``: all biases, compared exactly. ``weights``: per parameter the fp64 sum and sum of
    squares, compared exactly (DDP applies the same all-reduced gradient on every rank, so replicas
    are bitwise equal; a sum over identical values on identical hardware is too). ``gather(t [c])``
    returns ``[world, c]``. One gather of ``L n + 2 P`` numbers.
    """
    routers = balanced_routers(module)
    bias = torch.cat([r.bias.float().reshape(-1) for _, r in routers]).double() if routers else None
    params = [p.detach().double() for p in module.parameters()]
    sums = torch.stack([torch.stack([p.sum(), p.square().sum()]) for p in params]).reshape(-1)
    mine = sums if bias is None else torch.cat([bias, sums])
    every = gather(mine)
    same = (every == every[:1]).all(0)
    n_bias = 0 if bias is None else bias.numel()
    return {"bias": bool(same[:n_bias].all()), "weights": bool(same[n_bias:].all())}


def step_scalars(step: BalanceStep) -> dict[str, torch.Tensor]:
    """Per layer ``balance/<metric>/<layer>`` and the mean over layers ``balance/<metric>`` (0-dim tensors).

    Metrics: ``maxvio_batch``, ``load_cv``, ``dead_experts``, ``router_entropy`` (nats; at most ln n).
    """
    out = {}
    for metric, values in step.metrics.items():
        values = values.float()
        out[f"balance/{metric}"] = values.mean()
        out.update({f"balance/{metric}/{name}": v for name, v in zip(step.layers, values)})
    return out


class _Timing:
    """One balancer update's events (CUDA or host clock), read once: ``(step, ms, share or None)``."""

    def __init__(self, step: int, start: Event, end: Event, previous_end: Event | None) -> None:
        self.step = step
        self._events: tuple[Event, Event, Event | None] | None = (start, end, previous_end)
        self._read: tuple[int, float, float | None] | None = None

    def read(self) -> tuple[int, float, float | None]:
        """Waits for the update's end if its GPU work has not run yet; then drops the events."""
        if self._events is not None:
            start, end, previous_end = self._events
            end.synchronize()
            ms = start.elapsed_time(end)
            share = ms / previous_end.elapsed_time(end) if previous_end is not None else None
            self._read, self._events = (self.step, ms, share), None
        assert self._read is not None
        return self._read


def _start_step(pl_module: L.LightningModule) -> int:
    """``train.balancer_start_step`` of the module's config (0 for a module without one)."""
    cfg = getattr(pl_module, "cfg", None)
    return int(getattr(getattr(cfg, "train", None), "balancer_start_step", 0) or 0)


@torch.no_grad()
def hold_off(model: torch.nn.Module, step: BalanceStep) -> None:
    """Undo one balancer update before ``train.balancer_start_step``: every router's bias back to zero
    (and ``quantile_load``'s averaged loads back to their start, 1), and the recorded ``step.bias``
    ``[L, n]`` zeroed too, so the trajectories show what routed. The step's loads and metrics stay:
    MaxVio is measured with the balancer off as with it on."""
    for _, router in balanced_routers(model):
        router.bias.zero_()
        load_avg = getattr(router.balance, "load_avg", None)
        if load_avg is not None:
            load_avg.fill_(1.0)
    step.bias.zero_()


@torch.no_grad()
def gate(model: torch.nn.Module, step: BalanceStep, on: torch.Tensor) -> None:
    """:func:`hold_off` as device arithmetic, for a step that runs as one CUDA graph (``train.compile='graphs'``):
    ``on`` is a 0-dim bool tensor on the device (the step's index >= ``train.balancer_start_step``); where it is
    False every router's bias, ``quantile_load``'s averaged loads and ``step.bias`` ``[L, n]`` are set as
    :func:`hold_off` sets them, where True nothing changes. No host branch, no sync: the graph is the same
    before and after the switch. The values equal :func:`hold_off`'s (``masked_fill``: exact zeros and ones)."""
    off = ~on
    for _, router in balanced_routers(model):
        router.bias.masked_fill_(off, 0.0)
        load_avg = getattr(router.balance, "load_avg", None)
        if load_avg is not None:
            load_avg.masked_fill_(off, 1.0)
    step.bias.masked_fill_(off, 0.0)


class BalancerCallback(Callback):
    """Runs the balancer once per optimizer step and records what it did.

    ``tokens_per_micro_batch`` (batch_size * seq_len per rank), when given, lets ``on_fit_start``
    refuse a quantile-balancing run whose step token count ``m`` (times accumulation and ranks)
    makes ``m k / n`` fractional, before any step runs.

    After each step: the per-layer metrics go into ``pl_module.step_scalars`` (when the module has
    one, as ``LitMoELab`` does: ``StepMonitor`` then records them in the run's history), and
    ``steps``, ``loads`` (``[L, n]`` int64) and ``biases`` (``[L, n]`` fp32) grow by one entry, kept
    on the device until :meth:`trajectories`. Each validation appends ``(step, MaxVio_global [L])``
    to ``val_history`` (loads summed over the whole validation set and all ranks) and logs
    ``val/maxvio_global`` (mean over layers) and ``val/maxvio_global/<layer>``.

    Timing: ``perf/balancer_ms`` is the wall time of the update (the collectives included) and
    ``perf/balancer_share`` that time over the time from the end of the previous update to the end of
    this one (one optimizer step; left out on the first step after the start and after each
    validation). On a GPU the update is bracketed by CUDA events, read a step later (at the next
    update, or when ``StepMonitor`` records the step), so the host never waits for the update it has
    just queued; on the CPU by the host clock. ``timings`` keeps ``(step, ms, share or None)`` of every step.

    At the end of a multi-rank fit, ``replicas`` says whether all ranks hold the same biases and
    weights (:func:`compare_replicas`; a warning when not); the run's summary records it.

    The trajectories and ``val_history`` are part of the checkpoint (``state_dict``): S L n x 12
    bytes for S steps, 1.8 MB for k3-mini's 300 steps.
    """

    def __init__(self, tokens_per_micro_batch: int | None = None) -> None:
        self.tokens_per_micro_batch = tokens_per_micro_batch
        self.layers: list[str] = []
        self.steps: list[int] = []
        self.loads: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = []
        self.val_history: list[tuple[int, torch.Tensor]] = []
        self._timings: list[_Timing] = []
        self.replicas: dict[str, bool] | None = None  # compare_replicas at the end of a multi-rank fit
        self._previous_end: Event | None = None  # the end of the previous update, if it counts for the share

    @property
    def timings(self) -> list[tuple[int, float, float | None]]:
        """``(step, ms, share or None)`` of every update (waits for the newest update's GPU work)."""
        return [t.read() for t in self._timings]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.tokens_per_micro_batch is None:
            return
        m = self.tokens_per_micro_batch * trainer.accumulate_grad_batches * trainer.world_size
        for _, router in balanced_routers(pl_module):
            b = router.balance
            if b.kind == "quantile_balancing":
                try:
                    qb_target(m, b.top_k, b.num_experts)
                except ValueError as e:
                    raise ConfigError(
                        f"model.moe.balancer='quantile_balancing' is not allowed with {m} tokens per optimizer "
                        f"step (train.batch_size * data.seq_len = {self.tokens_per_micro_batch}, x "
                        f"{trainer.accumulate_grad_batches} accumulated x {trainer.world_size} ranks): {e}") from e

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._previous_end = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        start, end = device_event(pl_module.device, timing=True), device_event(pl_module.device, timing=True)
        start.record()
        step = balance_step(pl_module, all_reduce_sum, all_gather_rows)
        if step is None:
            return
        if trainer.global_step < _start_step(pl_module):
            hold_off(pl_module, step)
        end.record()
        self.record(trainer, pl_module, step, (start, end))

    def record(self, trainer: L.Trainer, pl_module: L.LightningModule, step: BalanceStep,
               events: tuple[Event, Event] | None = None) -> None:
        """Record one update ``step`` (its trajectories, its metrics in ``pl_module.step_scalars``); ``events``:
        its (start, end), for ``perf/balancer_ms``. Called by :meth:`on_before_optimizer_step`, and by a module
        that runs the update inside its own step (``train.compile='graphs'``: no events, no timing), before the
        trainer counts that step."""
        done = trainer.global_step + 1  # the step being completed, as StepMonitor numbers it
        timing = None
        if events is not None:
            if self._timings:  # the previous update's, a step later: its GPU work has normally run by now
                self._timings[-1].read()
            timing = _Timing(done, events[0], events[1], self._previous_end)
            self._previous_end = events[1]
            self._timings.append(timing)

        self.layers = step.layers
        self.steps.append(done)
        self.loads.append(step.load)
        self.biases.append(step.bias)
        scalars = getattr(pl_module, "step_scalars", None)
        if isinstance(scalars, dict):
            scalars.update(step_scalars(step))
            if timing is not None:
                # Host values, read when StepMonitor records the step; the share is left out when None.
                scalars["perf/balancer_ms"] = lambda: timing.read()[1]
                scalars["perf/balancer_share"] = lambda: timing.read()[2]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size < 2:
            return
        self.replicas = compare_replicas(pl_module)
        differ = [name for name, same in self.replicas.items() if not same]
        if differ:
            rank_zero_warn(f"data-parallel ranks ended with different {' and '.join(differ)} (compare_replicas): "
                           f"the balancer or DDP did not keep the replicas equal")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        clear_eval_loads(pl_module)
        self._previous_end = None  # the next step's share must not count the validation

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        got = eval_loads(pl_module, all_reduce_sum)
        if got is None:
            return
        layers, load = got
        values = max_vio(load)
        self.val_history.append((trainer.global_step, values.cpu()))
        # Every rank holds the same all-reduced value; sync_dist only silences Lightning's epoch-level warning.
        pl_module.log("val/maxvio_global", values.mean(), sync_dist=True)
        for name, v in zip(layers, values):
            pl_module.log(f"val/maxvio_global/{name}", v, sync_dist=True)

    def trajectories(self) -> dict[str, Any]:
        """``{"layers": [L names], "step": [S] int64, "load": [S, L, n] int64, "bias": [S, L, n] fp32}`` on the CPU."""
        if not self.steps:
            return {"layers": self.layers, "step": torch.zeros(0, dtype=torch.long), "load": None, "bias": None}
        return {"layers": self.layers, "step": torch.tensor(self.steps),
                "load": torch.stack([t.cpu() for t in self.loads]), "bias": torch.stack([t.cpu() for t in self.biases])}

    def summary(self) -> dict[str, float | None]:
        """Medians over the steps after the first (which holds compilation and warm-up): ``balancer_ms``,
        ``balancer_share``; ``maxvio_global``, the last validation's mean over layers (None if none ran);
        ``replicas_identical`` (biases and weights equal on all ranks; None with one rank)."""
        steady = self.timings[1:] or self.timings
        shares = [share for _, _, share in steady if share is not None]
        return {"balancer_ms": statistics.median(ms for _, ms, _ in steady) if steady else None,
                "balancer_share": statistics.median(shares) if shares else None,
                "maxvio_global": float(self.val_history[-1][1].mean()) if self.val_history else None,
                "replicas_identical": all(self.replicas.values()) if self.replicas is not None else None}

    def state_dict(self) -> dict[str, Any]:
        traj = self.trajectories()
        return {"layers": traj["layers"], "step": traj["step"],
                "load": None if traj["load"] is None else traj["load"].int(), "bias": traj["bias"],
                "val_history": list(self.val_history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A resumed run continues the trajectories of the run it resumes, so the heatmap covers both.
        self.layers = list(state["layers"])
        self.steps = [int(s) for s in state["step"]]
        self.loads = list(state["load"].long()) if state["load"] is not None else []
        self.biases = list(state["bias"]) if state["bias"] is not None else []
        self.val_history = [(int(s), v) for s, v in state["val_history"]]

    def save(self, folder: Path) -> list[Path]:
        """Write ``load_heatmap.png`` (where matplotlib is installed) and ``balance_trajectories.pt``
        (:meth:`trajectories` plus ``val_history``) into ``folder``; returns the paths written (none before the
        first step)."""
        traj = self.trajectories()
        if traj["load"] is None:
            return []
        written = []
        with atomic_path(folder / "balance_trajectories.pt") as tmp:
            torch.save({**traj, "val_history": self.val_history}, tmp)
        written.append(folder / "balance_trajectories.pt")
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # `pip install moelab` has no matplotlib (the lab has): the trajectories, no figure
            return written
        with atomic_path(folder / "load_heatmap.png") as tmp:
            load_heatmap(traj["step"], traj["load"], traj["layers"]).savefig(tmp, format="png")
        written.append(folder / "load_heatmap.png")
        return written


def load_heatmap(step: torch.Tensor, load: torch.Tensor, layers: list[str]) -> Any:
    """Expert load over training, one panel per MoE layer, as a matplotlib Figure (no pyplot state).

    step ``[S]``, load ``[S, L, n]`` (e.g. :meth:`BalancerCallback.trajectories`). Colour = load /
    mean load of that step and layer: 1 is balanced, 0 a dead expert, 2 twice its share (clipped).
    """
    from matplotlib.figure import Figure

    rel = load.double() / load.double().mean(-1, keepdim=True).clamp_min(1e-12)
    n_layers, n = rel.shape[1], rel.shape[2]
    fig = Figure(figsize=(7, 1.2 + 1.4 * n_layers), dpi=100)
    axes = fig.subplots(n_layers, 1, sharex=True, squeeze=False)[:, 0]
    first, last = (float(step[0]), float(step[-1])) if len(step) else (0.0, 1.0)
    image = None
    for i, ax in enumerate(axes):
        image = ax.imshow(rel[:, i].T.numpy(), aspect="auto", origin="lower", cmap="coolwarm", vmin=0.0, vmax=2.0,
                          interpolation="nearest", extent=(first - 0.5, last + 0.5, -0.5, n - 0.5))
        ax.set_ylabel(f"{layers[i]}\nexpert")
    axes[-1].set_xlabel("optimizer step")
    fig.colorbar(image, ax=list(axes), label="load / mean load")
    return fig
