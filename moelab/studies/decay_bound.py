"""Study 1: the lower-bounded decay, where it overflows, what it costs and what it buys.

Three measurements, each a function the notebook ``nbs/01_decay_bound.py`` calls:

1. :func:`tile_overflow_table`: the factored diagonal tile ``(q e^{G-G_m}) (k e^{G_m-G})^T`` of
   chunked KDA, computed in bf16 / fp16 / fp32 against an exact fp64 element-wise reference,
   swept over the per-token bound ``g_min`` and the tile length. Shows where the GEMM form breaks.
2. :func:`decay_stats` on the log decays a *trained* model produces (:func:`collect_log_decay`):
   how far an unbounded softplus gate goes below -5, and how many 16-token tiles the factored
   form could not hold.
3. Training quality bounded vs softplus (the notebook trains both through ``moelab.train.fit``)
   and kernel speed (``kernels/bench_kda.py`` on a GPU; the committed H200 JSON elsewhere).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from moelab.ops.kda.bounds import EXP_LIMIT

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _tile_cumsum(g: torch.Tensor, subtile: int) -> torch.Tensor:
    """Cumulative sum of ``g [..., T, K]`` restarted at every ``subtile`` tokens (T divisible)."""
    *lead, T, K = g.shape
    return g.reshape(*lead, T // subtile, subtile, K).cumsum(-2).reshape(*lead, T, K)


def factored_tile(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, dtype: torch.dtype,
                  midpoint: bool = True) -> torch.Tensor:
    """Gated scores of one tile through one matmul, the way a bounded-decay kernel forms them.

    Args:
        q, k: ``[S, K]`` one tile of queries and keys.
        g: ``[S, K]`` per-token log decay (natural log, <= 0).
        dtype: working precision of the rescaled operands and the product.
        midpoint: shift exponents by ``G`` at the tile midpoint (halves their range).

    Returns:
        ``[S, S]`` lower-triangular ``A_ij = sum_c q_ic k_jc exp(G_ic - G_jc)`` in ``dtype``
        (inf/NaN where the factors overflowed).
    """
    G = g.double().cumsum(0)
    ref = G[G.shape[0] // 2] if midpoint else torch.zeros_like(G[0])
    qs = (q.double() * (G - ref).exp()).to(dtype)
    ks = (k.double() * (ref - G).exp()).to(dtype)
    A = qs @ ks.T
    return A.tril()


def exact_tile(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp64 element-wise reference of :func:`factored_tile`: ``[S, S]`` lower-triangular."""
    G = g.double().cumsum(0)
    diff = (G[:, None, :] - G[None, :, :]).clamp(max=0)  # masked (i >= j has diff <= 0) before exp
    A = (q.double()[:, None, :] * k.double()[None, :, :] * diff.exp()).sum(-1)
    return A.tril()


def tile_overflow_table(
    g_mins: Iterable[float] = (-1, -2, -3, -4, -5, -5.5, -6, -8, -10, -12),
    subtiles: Iterable[int] = (16, 32, 64),
    dtypes: Iterable[str] = ("bf16", "fp16", "fp32"),
    head_dim: int = 64,
    trials: int = 4,
    seed: int = 0,
) -> list[dict]:
    """Sweep the factored tile over bound, tile length and precision.

    The decay is the worst case the bound allows (``g = g_min`` on every channel of every token)
    for half the trials and uniform in ``[g_min, 0]`` for the other half; q and k are unit vectors
    like the L2-normalized ones of the layer.

    Returns:
        One row per (dtype, subtile, g_min, midpoint): ``max_exponent`` (largest |exponent| a factor
        needs, in natural-log units), ``limit`` (``ln`` of the dtype's max), ``finite`` (all entries
        finite in every trial) and ``rel_err`` (worst RMS relative error vs fp64; inf when not finite).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for dtype in dtypes:
        for S in subtiles:
            for g_min in g_mins:
                for midpoint in (False, True):
                    worst, finite = 0.0, True
                    for t in range(trials):
                        q = torch.nn.functional.normalize(torch.randn(S, head_dim, generator=gen), dim=-1)
                        k = torch.nn.functional.normalize(torch.randn(S, head_dim, generator=gen), dim=-1)
                        if t % 2 == 0:
                            g = torch.full((S, head_dim), float(g_min))
                        else:
                            g = g_min * torch.rand(S, head_dim, generator=gen)
                        out = factored_tile(q, k, g, DTYPES[dtype], midpoint).double()
                        ref = exact_tile(q, k, g)
                        if not torch.isfinite(out).all():
                            finite, worst = False, math.inf
                            continue
                        err = ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
                        worst = max(worst, err)
                    span = abs(g_min) * (S // 2 if midpoint else S)
                    rows.append({"dtype": dtype, "subtile": S, "g_min": float(g_min), "midpoint": midpoint,
                                 "max_exponent": span, "limit": EXP_LIMIT[dtype], "finite": finite,
                                 "rel_err": worst})
    return rows


@torch.no_grad()
def collect_log_decay(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Log decays ``g [B, T, H, K]`` (fp32, CPU) of every KDA layer for one forward of ``input_ids``.

    Uses forward pre-hooks on the layers (the model is left unchanged); works on any module that
    contains ``moelab.model.kda.KDALayer`` instances.
    """
    from moelab.model.kda import KDALayer

    found: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, KDALayer):
            def hook(m, args, name=name):
                found[name] = m.log_decay(args[0]).float().cpu()
            hooks.append(mod.register_forward_pre_hook(hook))
    if not hooks:
        raise ValueError("collect_log_decay: the model has no KDA layer (model.pattern has no 'K')")
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return found


def decay_stats(g: torch.Tensor, bound: float = -5.0, subtile: int = 16) -> dict[str, float]:
    """How a log decay ``g [B, T, H, K]`` sits against a lower bound and the tile's exponent range.

    Returns:
        ``g_min``, ``g_mean``, ``frac_below_bound`` (share of entries < ``bound``),
        ``max_tile_exponent`` (largest |G_i - G_mid| inside any ``subtile``-token tile, i.e. the
        exponent a factored diagonal tile must represent), and ``frac_tiles_over_{bf16,fp16}``
        (share of (tile, head, channel) triples whose exponent exceeds that dtype's range).
    """
    B, T, H, K = g.shape
    T0 = (T // subtile) * subtile
    if T0 == 0:
        raise ValueError(f"decay_stats: T={T} is shorter than one tile (subtile={subtile})")
    G = _tile_cumsum(g[:, :T0].permute(0, 2, 3, 1).reshape(B * H * K, T0, 1), subtile)
    G = G.reshape(B * H * K, T0 // subtile, subtile)
    span = (G - G[..., subtile // 2: subtile // 2 + 1]).abs().amax(-1)  # [BHK, tiles]
    return {
        "g_min": g.min().item(),
        "g_mean": g.mean().item(),
        "frac_below_bound": (g < bound).float().mean().item(),
        "max_tile_exponent": span.max().item(),
        "frac_tiles_over_bf16": (span > EXP_LIMIT["bf16"]).float().mean().item(),
        "frac_tiles_over_fp16": (span > EXP_LIMIT["fp16"]).float().mean().item(),
    }


# --- training bounded vs softplus ------------------------------------------------------------

GATES = ("bounded", "softplus")
PRESETS = {
    # preset -> (training preset, its overrides): cpu finishes in minutes on 2 cores.
    "cpu": ("cpu", {"train.max_steps": 150, "train.batch_size": 8, "train.val_every": 50}),
    "gpu": ("gpu-small", {"train.max_steps": 300, "train.val_every": 100}),
}


def train_gates(preset: str, ckpt_root: str | Path, extra: dict | None = None) -> dict[str, Any]:
    """Train the same model once per gate parameterization; return ``{gate: TrainResult}``.

    Args:
        preset: ``cpu`` or ``gpu`` (see ``PRESETS``).
        ckpt_root: checkpoints go to ``<ckpt_root>/<gate>``.
        extra: more ``--set`` style overrides for both runs.
    """
    from moelab.config import load_config
    from moelab.train import fit

    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed: expected one of {tuple(PRESETS)}")
    base, overrides = PRESETS[preset]
    out = {}
    for gate in GATES:
        cfg = load_config(base, {**overrides, **(extra or {}), "model.kda.gate": gate,
                                 "name": f"decay_bound-{gate}",
                                 "train.ckpt_dir": str(Path(ckpt_root) / gate)})
        out[gate] = fit(cfg)
    return out


def gate_decay_rows(results: dict[str, Any], batches: int = 2) -> list[dict]:
    """Per trained model and KDA layer, :func:`decay_stats` of the log decay on validation windows."""
    from moelab.data import TextDataModule
    from moelab.train.runner import load_model

    rows = []
    for gate, res in results.items():
        ckpt = res.best_checkpoint or res.last_checkpoint
        model, cfg = load_model(ckpt)
        dm = TextDataModule(cfg.data, cfg.train.batch_size, cfg.seed, cfg.train.max_steps, batches)
        dm.setup("validate")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.to(device)
        for i, batch in enumerate(dm.val_dataloader()):
            if i >= batches:
                break
            per_layer = collect_log_decay(model, batch["input_ids"].to(device))
            for layer, g in per_layer.items():
                rows.append({"gate": gate, "layer": layer, "batch": i, **decay_stats(g)})
    return rows


# --- kernel speed ----------------------------------------------------------------------------

def kernel_speed(preset: str, out_dir: str | Path) -> tuple[list[dict], str]:
    """KDA kernel timings: measured now on a GPU, else the committed H200 results.

    Returns ``(rows, source)``: rows in the format of ``kernels/results/kda_h200.json`` and where
    they came from (a fresh run's JSON path, or the committed file with its date and machine).
    """
    from moelab.base import repo_root

    committed = repo_root() / "kernels" / "results" / "kda_h200.json"
    if preset == "gpu" and torch.cuda.is_available():
        out = Path(out_dir) / "results" / "kda_bench.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(repo_root() / "kernels" / "bench_kda.py"), "--quick",
                        "--out", str(out)], check=True)
        data = json.loads(out.read_text())
        return data["rows"], f"measured now: {out.name} ({data['meta'].get('gpu')})"
    if committed.exists():
        data = json.loads(committed.read_text())
        meta = data.get("meta", {})
        return data["rows"], f"committed {committed.name} ({meta.get('gpu')}, {meta.get('date')})"
    return [], "no GPU here and no committed kernels/results/kda_h200.json yet"


# --- figures -------------------------------------------------------------------------------

def overflow_figure(rows: list[dict]) -> Any:
    """Relative error of the factored tile vs g_min, one panel per dtype, lines per tile length."""
    from matplotlib.figure import Figure

    dtypes = sorted({r["dtype"] for r in rows})
    fig = Figure(figsize=(4.2 * len(dtypes), 3.6), dpi=100)
    axes = fig.subplots(1, len(dtypes), squeeze=False)[0]
    for ax, dt in zip(axes, dtypes):
        for (S, mid), style in zip(sorted({(r["subtile"], r["midpoint"]) for r in rows if r["dtype"] == dt}),
                                   ["-", "--", "-.", ":", "-", "--"]):
            sel = sorted((r for r in rows if r["dtype"] == dt and r["subtile"] == S and r["midpoint"] == mid),
                         key=lambda r: -r["g_min"])
            err = [r["rel_err"] if r["finite"] else float("nan") for r in sel]
            ax.semilogy([-r["g_min"] for r in sel], err, style, marker="o", ms=3,
                        label=f"{S}-token tile{' + midpoint' if mid else ''}")
        ax.axvline(5, color="k", lw=0.8, alpha=0.5)
        ax.set_title(f"{dt}: factored tile vs exact (gaps = inf/NaN)")
        ax.set_xlabel("|g_min| (per-token log decay bound)")
        ax.set_ylabel("relative error")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def training_figure(results: dict[str, Any]) -> Any:
    """Train (line) and validation (dots) loss of each gate."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.subplots()
    for gate, res in results.items():
        line, = ax.plot([h["step"] for h in res.history], [h["train/loss"] for h in res.history], lw=1,
                        label=f"{gate} train")
        if res.val_history:
            s, v = zip(*res.val_history)
            ax.plot(s, v, "o", color=line.get_color(), label=f"{gate} val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def speed_figure(rows: list[dict], source: str) -> Any:
    """Forward+backward time per implementation and shape (bars)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.subplots()
    ok = [r for r in rows if r.get("fwdbwd_ms")]
    shapes = sorted({(r["B"], r["T"]) for r in ok}, key=lambda s: s[0] * s[1])
    impls = sorted({r["impl"] for r in ok})
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        ys = [next((r["fwdbwd_ms"] for r in ok if r["impl"] == impl and (r["B"], r["T"]) == s), float("nan"))
              for s in shapes]
        ax.bar([j + i * width for j in range(len(shapes))], ys, width, label=impl)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"B{b} T{t}" for b, t in shapes])
    ax.set_yscale("log")  # SDPA's quadratic time at 64K tokens would flatten every other bar
    ax.set_ylabel("forward+backward (ms, log scale)")
    ax.set_title(source, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _ratio(rows: list[dict], num: str, den: str, key: str = "fwdbwd_ms") -> dict[str, float]:
    """``{"B8_T4096": time(num) / time(den)}`` for every shape both implementations ran."""
    by = {(r["impl"], r["B"], r["T"]): r.get(key) for r in rows}
    out = {}
    for (impl, B, T), t in by.items():
        d = by.get((den, B, T))
        if impl == num and t and d:
            out[f"B{B}_T{T}"] = t / d
    return out


def summarize(overflow: Any, results: dict[str, Any], decay: Any, speed_rows: list[dict], speed_source: str,
              preset: str) -> dict[str, Any]:
    """The study's ``summary.json``: findings with the numbers behind them and where they ran."""
    import datetime
    import platform

    ok = overflow[overflow.finite & (overflow.rel_err < 1e-2)]
    safe = {f"{d}_tile{s}_{'midpoint' if m else 'noshift'}": float(g)
            for (d, s, m), g in ok.groupby(["dtype", "subtile", "midpoint"]).g_min.min().items()}
    gates = {}
    for gate, res in results.items():
        sel = decay[decay.gate == gate]
        gates[gate] = {
            "best_val_loss": res.summary.get("best_val_loss"),
            "final_train_loss": res.summary.get("final_train_loss"),
            "steps": res.summary.get("steps"),
            "tok_per_s": res.summary.get("tok_per_s"),
            "g_min_observed": float(sel.g_min.min()),
            "frac_below_-5": float(sel.frac_below_bound.max()),
            "max_tile_exponent": float(sel.max_tile_exponent.max()),
            "frac_tiles_over_bf16": float(sel.frac_tiles_over_bf16.max()),
            "run_id": res.run_id,
        }
    return {
        "meta": {"study": "01_decay_bound", "preset": preset, "date": datetime.date.today().isoformat(),
                 "torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                 else platform.processor() or "cpu", "command": f"make study-1 PRESET={preset}"},
        "most_negative_safe_g_min": safe,
        "gates": gates,
        "kernel_source": speed_source,
        "general_over_bounded_fwdbwd": _ratio(speed_rows, "moelab_general", "moelab_bounded"),
        "fla_safe_gate_over_moelab_bounded_fwdbwd": _ratio(speed_rows, "fla_safe_gate", "moelab_bounded"),
    }
