"""Study 1: the lower-bounded decay, where it overflows, what it costs and what it buys.

Three measurements, each a function the notebook ``nbs/01_decay_bound.py`` calls:

1. :func:`tile_overflow_table`: the factored diagonal tile ``(q e^{G-G_m}) (k e^{G_m-G})^T`` of
   chunked KDA, computed in bf16 / fp16 / fp32 against an exact fp64 element-wise reference,
   swept over the per-token bound ``g_min`` and the tile length. Shows where the GEMM form breaks.
2. :func:`decay_stats` on the log decays a *trained* model produces (:func:`collect_log_decay`):
   how far an unbounded softplus gate goes below -5, and how many 16-token tiles the factored
   form could not hold.
3. Training quality bounded vs softplus: two arms of the study harness
   (:func:`moelab.studies.common.run_grid`) that differ only in ``model.kda.gate``; and kernel
   speed, read from the committed ``kernels/results/kda_h200.json`` (``make kda-bench`` measures
   it; re-running that sweep inside the study would not fit one GPU session).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from moelab.ops.kda.bounds import EXP_LIMIT
from moelab.studies import common

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

STUDY = "01_decay_bound"
ARMS = {"bounded": {"model.kda.gate": "bounded"}, "softplus": {"model.kda.gate": "softplus"}}
# preset -> (training preset, overrides for every arm, seeds). cpu: about a minute per run on 2 cores.
PRESETS = {
    "cpu": ("cpu", {"train.max_steps": 150, "train.batch_size": 8, "train.val_every": 50}, (0,)),
    "gpu": ("gpu-small", {"train.max_steps": 300, "train.val_every": 100}, (0,)),
}
KERNEL_RESULTS = "kernels/results/kda_h200.json"


def _preset(preset: str) -> tuple[str, dict[str, Any], tuple[int, ...]]:
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed: expected one of {tuple(PRESETS)}")
    return PRESETS[preset]


def arms_factor(preset: str) -> dict[str, dict[str, Any]]:
    """``{config key: {arm: value}}``: what differs between the arms (raises if anything but the gate does)."""
    base, overrides, _ = _preset(preset)
    return common.check_arms_differ_only(base, ARMS, overrides)


def train_gates(preset: str, out_dir: str | Path, extra: Mapping[str, Any] | None = None) -> common.Grid:
    """Train every gate arm at every seed of ``preset`` (finished runs are reused); see ``PRESETS``.

    Args:
        out_dir: the study folder; runs go to ``<out_dir>/checkpoints/<gate>-s<seed>``.
        extra: more ``--set`` style overrides for every arm.
    """
    base, overrides, seeds = _preset(preset)
    return common.run_grid(STUDY, base, ARMS, seeds, out_dir, common={**overrides, **(extra or {})})


def gate_decay_rows(grid: common.Grid, batches: int = 2) -> list[dict]:
    """Per trained model (arm, seed) and KDA layer, :func:`decay_stats` of the log decay on validation windows."""
    from moelab.data import TextDataModule
    from moelab.train.runner import load_model

    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for rec in grid.records:
        model, cfg = load_model(rec.summary.get("best_checkpoint") or rec.summary["last_checkpoint"])
        dm = TextDataModule(cfg.data, cfg.train.batch_size, cfg.seed, cfg.train.max_steps, batches)
        dm.setup("validate")
        model = model.to(device)
        for i, batch in enumerate(dm.val_dataloader()):
            if i >= batches:
                break
            for layer, g in collect_log_decay(model, batch["input_ids"].to(device)).items():
                rows.append({"gate": rec.arm, "seed": rec.seed, "layer": layer, "batch": i, **decay_stats(g)})
    return rows


# --- kernel speed ----------------------------------------------------------------------------

def kernel_speed() -> tuple[list[dict], dict[str, Any]]:
    """KDA kernel timings from the committed H200 benchmark (``make kda-bench`` writes it).

    Returns ``(rows, source)``: rows as in ``kernels/results/kda_h200.json`` (empty if the file is
    missing) and ``{"file", "gpu", "date", "commit", "commit_how"}`` saying where they came from.
    """
    from moelab.base import repo_root

    path = repo_root() / KERNEL_RESULTS
    if not path.exists():
        return [], {"file": KERNEL_RESULTS, "gpu": None, "date": None, "commit": None, "commit_how": "missing"}
    data = json.loads(path.read_text())
    meta = data.get("meta", {})
    measured = common.measured_commit(path)
    return data["rows"], {"file": KERNEL_RESULTS, "gpu": meta.get("gpu"), "date": meta.get("date"),
                          "commit": measured["commit"], "commit_how": measured["how"]}


def describe_source(source: Mapping[str, Any]) -> str:
    """One line naming the benchmark file, its GPU, date and the commit it measured."""
    if source.get("gpu") is None:
        return f"{source['file']} is not committed yet: no kernel timings"
    return (f"{source['file']}: {source['gpu']}, {str(source['date'])[:10]}, code at commit {source['commit']} "
            f"({source['commit_how']})")


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


def speed_figure(rows: list[dict], source: Mapping[str, Any]) -> Any:
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
    ax.set_title(f"{source.get('gpu')}, code at {source.get('commit')}", fontsize=9)
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


# --- summary and findings ------------------------------------------------------------------------

def safe_bounds(overflow: Any, tol: float = 1e-2) -> dict[str, float]:
    """Most negative swept g_min at which the factored tile is finite with relative error < ``tol``.

    Keys ``<dtype>_tile<S>_<midpoint|noshift>``; a combination that fails at every swept bound is absent.
    """
    ok = overflow[overflow.finite & (overflow.rel_err < tol)]
    return {f"{d}_tile{s}_{'midpoint' if m else 'noshift'}": float(g)
            for (d, s, m), g in ok.groupby(["dtype", "subtile", "midpoint"]).g_min.min().items()}


def summarize(overflow: Any, grid: common.Grid, decay: Any, speed_rows: list[dict], speed_source: Mapping[str, Any],
              preset: str) -> dict[str, Any]:
    """The study's ``summary.json``: the meta block, then the numbers the findings are computed from."""
    table = grid.table()
    agg = common.aggregate(table)
    arms = {}
    for gate in agg.index:
        sel = decay[decay.gate == gate]
        a = agg.loc[gate]
        arms[gate] = {
            "n_seeds": int(a.n_seeds),
            **{f"{m}_{stat}": (float(a[f"{m}_{stat}"]) if math.isfinite(a[f"{m}_{stat}"]) else None)
               for m in common.STUDY_METRICS for stat in ("mean", "std")},
            "steps": int(table[table.arm == gate].steps.max()),
            "tok_per_s": float(table[table.arm == gate].tok_per_s.mean()),
            "g_min_observed": float(sel.g_min.min()),
            "frac_below_-5": float(sel.frac_below_bound.max()),
            "max_tile_exponent": float(sel.max_tile_exponent.max()),
            "frac_tiles_over_bf16": float(sel.frac_tiles_over_bf16.max()),
            "run_ids": [r for r in table[table.arm == gate].run_id],
        }
    return {
        "meta": common.study_meta(STUDY, preset, grid, kernel_results=dict(speed_source)),
        "factor": {k: {a: v for a, v in vals.items()} for k, vals in grid.factor.items()},
        "most_negative_safe_g_min": safe_bounds(overflow),
        "arms": arms,
        "general_over_bounded_fwdbwd": _ratio(speed_rows, "moelab_general", "moelab_bounded"),
        "fla_safe_gate_over_moelab_bounded_fwdbwd": _ratio(speed_rows, "fla_safe_gate", "moelab_bounded"),
    }


def findings(summary: Mapping[str, Any], bound: float = -5.0) -> str:
    """The study's conclusions as a Markdown list, every sentence computed from ``summary`` (no typed numbers)."""
    lines = []
    safe = summary["most_negative_safe_g_min"]
    for dt in ("bf16", "fp32", "fp16"):
        no, mid = safe.get(f"{dt}_tile16_noshift"), safe.get(f"{dt}_tile16_midpoint")
        if no is None and mid is None:
            lines.append(f"- **{dt}**: the factored 16-token tile fails at every swept bound, even with the midpoint "
                         "shift.")
            continue
        verdict = ("holds" if (no is not None and no <= bound) else
                   "holds only with the midpoint shift" if (mid is not None and mid <= bound) else "does not hold")
        lines.append(f"- **{dt}**: the factored 16-token tile stays finite and within 1% of the exact tile "
                     f"{_reach(no, 'without a shift')} and {_reach(mid, 'with the midpoint shift')}, so K3's bound "
                     f"$g_{{min}} = {bound:g}$ {verdict}.")
    arms = summary["arms"]
    for gate, a in arms.items():
        below = a["frac_below_-5"]
        over = a["frac_tiles_over_bf16"]
        lines.append(f"- The trained **{gate}** gate's most negative per-token log decay is "
                     f"{a['g_min_observed']:.2f} ({'below' if a['g_min_observed'] < bound else 'above'} "
                     f"{bound:g}; {below:.1%} of entries below it); {over:.1%} of 16-token tiles exceed the bf16 "
                     "exponent range.")
    if len(arms) == 2:
        (ga, a), (gb, b) = arms.items()
        diff = a["best_val_loss_mean"] - b["best_val_loss_mean"]
        spreads = [s for s in (a["best_val_loss_std"], b["best_val_loss_std"]) if s is not None]
        better, worse = (gb, ga) if diff > 0 else (ga, gb)
        if spreads:
            noise = 2 * max(spreads)
            judged = (f"larger than twice the seed spread ({noise:.3f}), so the gap is not seed noise"
                      if abs(diff) > noise else
                      f"within twice the seed spread ({noise:.3f}): not distinguishable at these seeds")
        else:
            judged = "from one seed per arm, so its size against seed noise is not measured here"
        lines.append(f"- Best validation loss: {ga} {a['best_val_loss_mean']:.3f}, {gb} {b['best_val_loss_mean']:.3f}; "
                     f"**{better}** is lower by {abs(diff):.3f} nats/token than {worse}, {judged}.")
    meta = summary["meta"]
    epochs = meta.get("epochs")
    if epochs is not None:
        gaps = meta.get("train_val_gap", {})
        worst = max(gaps.values()) if gaps else None
        seen = (f"each run saw {epochs:.2f} epochs of the {meta['corpus_train_tokens']:,}-token training split"
                if epochs >= 0.01 else f"each run saw {epochs:.1e} epochs of the training split")
        gap = (f"; validation minus training loss is at most {worst:+.3f} nats/token" if worst is not None else "")
        warn = (" Over one epoch the arms are compared partly on memorization." if epochs > 1 else "")
        lines.append(f"- Data: {seen}{gap}.{warn}")
    ratio = summary["general_over_bounded_fwdbwd"]
    if ratio:
        lo, hi = min(ratio.values()), max(ratio.values())
        src = meta.get("kernel_results", {})
        lines.append(f"- Kernel time: the general (element-wise diagonal tile) path takes {lo:.2f}-{hi:.2f}x the "
                     f"bounded path's forward+backward time over {len(ratio)} shapes ({src.get('gpu')}, code at "
                     f"commit {src.get('commit')}): the bound {'buys speed' if lo > 1 else 'does not buy speed'}.")
    return "\n".join(lines)


def _reach(g_min: float | None, how: str) -> str:
    """``down to $g_{min} = -5$ without a shift``, or that it holds at no swept bound."""
    return f"at no swept bound {how}" if g_min is None else f"down to $g_{{min}} = {g_min:g}$ {how}"
