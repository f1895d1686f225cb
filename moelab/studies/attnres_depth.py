"""Study 3: Attention Residuals over depth (attnres.md): PreNorm vs Block vs Full AttnRes at several depths.

Budget rule: **same tokens, same width, same parameters at each depth**. Every run trains on the
same number of tokens (same steps, batch and sequence length) at the same width; depth is the
swept factor, so parameters and FLOPs grow with depth, and at one depth the residual modes differ
only by the AttnRes pseudo-queries and key norms (``(2L + 1) * 2d`` parameters, reported per run).

The arms are ``(residual mode, blocks, n_layers)`` over the harness (:func:`moelab.studies.common.run_grid`):
``prenorm``, ``full_attnres`` and ``block_attnres`` with N blocks, where the main block arm takes
the largest divisor of the sublayer count ``2L`` that is at most 8 and below ``2L`` (``N = 2L`` would
be Full AttnRes) and the other block counts (2, 4) run where they divide ``2L`` and differ from it.
The three main modes run every seed of the preset at every depth, the other block counts the first
seed at the preset's ``extra_depths``.

The notebook ``nbs/03_attnres_depth.py`` calls, in order: :func:`arms_factor`, :func:`train`,
:func:`summary_rows`, :func:`collect_diagnostics` (hidden-state RMS, gradient norm and depth-attention
weights of each trained model, from :func:`layer_diagnostics`), the figures, :func:`summarize` and
:func:`findings` (every sentence computed from the summary).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moelab.studies import common, report

STUDY = "03_attnres_depth"
MODES = ("prenorm", "block_attnres", "full_attnres")
SHORT = {"prenorm": "prenorm", "block_attnres": "block", "full_attnres": "full"}
BLOCK_COUNTS = (2, 4, 8)  # the block counts studied; the main block arm is the largest that fits
MAIN_BLOCKS = 8


@dataclass(frozen=True)
class Plan:
    """One preset of the study.

    base: training preset every arm starts from; common: overrides for every arm (scale and the
    dense FFN); depths: ``model.n_layers`` values; seeds: of the three main modes; extra_seeds: of
    the other block counts, which run at ``extra_depths``; threads: torch intra-op threads for the
    study's process (None: leave torch's setting).
    """

    base: str
    common: Mapping[str, Any]
    depths: tuple[int, ...]
    seeds: tuple[int, ...]
    extra_seeds: tuple[int, ...]
    extra_depths: tuple[int, ...]
    threads: int | None = None
    notes: str = ""


# Dense SwiGLU FFNs in every layer (dense_layers >= every depth): the study is about the residual
# stream, and routing would add a second source of seed noise and most of the step time.
PRESETS = {
    # 2 shared CPU cores, under 2 minutes when idle and about 3 under other jobs' load: all-MLA mixers (KDA's
    # chunked form costs ~4x an MLA layer per step on CPU), width 64, 40 steps of 512 tokens, the other block
    # counts at the deepest depth only; 29 runs. One thread: measured on a busy 2-core machine, two threads
    # made a step 5-9x slower.
    "cpu": Plan("tiny", {"model.pattern": "M", "model.dense_layers": 8, "train.max_steps": 40,
                         "train.warmup_steps": 4, "train.val_every": 20, "train.val_batches": 2,
                         "train.log_every": 5, "tracking.log_system_metrics": False},
                (2, 4, 8), (0, 1, 2), (0,), (8,), threads=1,
                notes="all-MLA mixers, d_model 64, 40 steps of 8 x 64 tokens"),
    # One H200: 504 s wall at fdd7e59 (estimated ~7 minutes beforehand; summary.json): gpu-small's hybrid
    # (3 KDA : 1 MLA, d_model 512) with dense FFNs, 80 steps of 16K tokens. Estimate: gpu-small's measured 121 ms per
    # 32K-token step over 12 layers is ~5 ms per layer per 16K-token step; Block and Full AttnRes cost ~1.9x
    # prenorm's step at 12 layers (kernels/results/restructure_h200/model_gpu_small_1227ff2.json, in git; Full's extra
    # grows with depth), so the three main modes at 4 + 8 + 16 layers take ~53 s per seed, ~160 s for three
    # seeds, plus ~25 s for the other block counts at 16 layers (seed 0): ~3 min of steps, ~2.5 min of start,
    # validation and checkpoints over 29 runs (~5 s each), ~1 min of kernel compilation. Three seeds at depths
    # (6, 12, 24) with the other block counts at every depth and 100 steps would take ~11 min, so the grid is
    # 4 -> 16 layers, 80 steps, and the other block counts run at the deepest depth only.
    "gpu": Plan("gpu-small", {"model.dense_layers": 16, "data.seq_len": 1024, "train.batch_size": 16,
                              "train.max_steps": 80, "train.warmup_steps": 8, "train.val_every": 40,
                              "train.val_batches": 2},
                (4, 8, 16), (0, 1, 2), (0,), (16,),
                notes="3:1 KDA/MLA, d_model 512, 80 steps of 16 x 1024 tokens"),
}


def plan(preset: str) -> Plan:
    """The :class:`Plan` of ``preset`` (``cpu`` or ``gpu``)."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed: expected one of {tuple(PRESETS)}")
    return PRESETS[preset]


# ------------------------------------------------------------------------------------------- arms


def main_blocks(n_layers: int, largest: int = MAIN_BLOCKS) -> int:
    """Block count of the main Block AttnRes arm: the largest divisor of ``2 * n_layers`` that is
    ``<= largest`` and below ``2 * n_layers`` (one sublayer per block would be Full AttnRes)."""
    if n_layers < 1:
        raise ValueError(f"n_layers={n_layers} is not allowed: expected an integer >= 1")
    subs = 2 * n_layers
    return max(n for n in range(1, min(largest, subs - 1) + 1) if subs % n == 0)


def block_counts(n_layers: int) -> list[int]:
    """Block counts run at depth ``n_layers``: those of :data:`BLOCK_COUNTS` that divide ``2L`` and are
    below it, plus :func:`main_blocks` (sorted)."""
    subs = 2 * n_layers
    return sorted({n for n in BLOCK_COUNTS if n < subs and subs % n == 0} | {main_blocks(n_layers)})


def arm_name(mode: str, n_layers: int, blocks: int | None = None) -> str:
    """``prenorm-L12``, ``block8-L12``, ``full-L12``."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed: expected one of {MODES}")
    return f"{SHORT[mode]}{blocks if mode == 'block_attnres' else ''}-L{n_layers}"


def arms(preset: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """``(main, extra)`` arms of ``preset`` as ``{arm: overrides}``.

    Every arm sets ``model.n_layers``, ``model.residual.mode`` and ``model.residual.num_blocks``
    (prenorm and full keep the base preset's value, which they ignore), so those three keys are the
    factor :func:`moelab.studies.common.check_arms_differ_only` allows. main: the three main modes
    at every depth; extra: the other block counts at the plan's ``extra_depths``.
    """
    from moelab.config import load_config

    p = plan(preset)
    unused = load_config(p.base, dict(p.common)).model.residual.num_blocks
    main: dict[str, dict[str, Any]] = {}
    extra: dict[str, dict[str, Any]] = {}
    for L in p.depths:
        nb = main_blocks(L)
        for mode, n in (("prenorm", unused), ("block_attnres", nb), ("full_attnres", unused)):
            main[arm_name(mode, L, n)] = _overrides(L, mode, n)
        for n in block_counts(L) if L in p.extra_depths else ():
            if n != nb:
                extra[arm_name("block_attnres", L, n)] = _overrides(L, "block_attnres", n)
    return main, extra


def _overrides(n_layers: int, mode: str, num_blocks: int) -> dict[str, Any]:
    return {"model.n_layers": n_layers, "model.residual.mode": mode, "model.residual.num_blocks": num_blocks}


def arm_info(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"residual", "blocks", "n_layers"}`` of an arm: blocks is N for block_attnres, ``2L`` for
    full_attnres (one block per sublayer) and None for prenorm (no depth attention)."""
    mode, L = overrides["model.residual.mode"], int(overrides["model.n_layers"])
    blocks = {"prenorm": None, "block_attnres": int(overrides["model.residual.num_blocks"]),
              "full_attnres": 2 * L}[mode]
    return {"residual": mode, "blocks": blocks, "n_layers": L}


def arms_factor(preset: str) -> dict[str, dict[str, Any]]:
    """``{config key: {arm: value}}`` over every arm; raises if the arms differ in anything but
    depth, residual mode and block count."""
    p = plan(preset)
    main, extra = arms(preset)
    return common.check_arms_differ_only(p.base, {**main, **extra}, p.common)


def train(preset: str, out_dir: str | Path, extra_overrides: Mapping[str, Any] | None = None) -> common.Grid:
    """Train every arm of ``preset`` (the main modes at every seed, the other block counts at the first
    seeds); finished runs are reused. Runs go to ``<out_dir>/checkpoints/<arm>-s<seed>``. Sets the
    plan's torch thread count for this process."""
    p = plan(preset)
    if p.threads:
        torch.set_num_threads(p.threads)
    main, extra = arms(preset)
    factor = arms_factor(preset)
    overrides = {**p.common, **(extra_overrides or {})}
    grids = [common.run_grid(STUDY, p.base, main, p.seeds, out_dir, common=overrides)]
    if extra:
        grids.append(common.run_grid(STUDY, p.base, extra, p.extra_seeds, out_dir, common=overrides))
    records = [r for g in grids for r in g.records]
    return common.Grid(study=STUDY, base=p.base, records=records, factor=factor,
                       corpus_tokens=max(g.corpus_tokens for g in grids))


# ------------------------------------------------------------------------------------------- rows

ROW_KEYS = ("residual", "blocks", "n_layers", "seed", "params", "tokens", "val_loss", "tok_per_s", "peak_mem_gb")


def summary_rows(grid: common.Grid, preset: str) -> list[dict[str, Any]]:
    """One row per run: residual, blocks, n_layers, seed, params (total), tokens, val_loss (final
    validation loss, nats/token), tok_per_s (median training window), peak_mem_gb (None on CPU)."""
    main, extra = arms(preset)
    ov = {**main, **extra}
    rows = []
    for r in grid.records:
        s = r.summary
        rows.append({**arm_info(ov[r.arm]), "seed": r.seed, "params": s.get("params_total"), "tokens": r.tokens,
                     "val_loss": s.get("final_val_loss"), "tok_per_s": s.get("tok_per_s"),
                     "peak_mem_gb": s.get("peak_mem_gb"), "arm": r.arm})
    return rows


def mode_label(residual: str, blocks: int | None) -> str:
    """Legend name: ``prenorm``, ``block_attnres (N=8)``, ``full_attnres``."""
    return f"block_attnres (N={blocks})" if residual == "block_attnres" else residual


def stats(rows: Sequence[Mapping[str, Any]], metric: str = "val_loss") -> dict[tuple[str, int | None, int], dict]:
    """``{(residual, blocks, n_layers): {"mean", "std", "n", "values"}}`` of ``metric`` over seeds
    (std with ddof=1, None for one seed; None values left out)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["residual"], r["blocks"], r["n_layers"]), [])
        if r.get(metric) is not None:
            groups[(r["residual"], r["blocks"], r["n_layers"])].append(float(r[metric]))
    out = {}
    for k, v in groups.items():
        mean = sum(v) / len(v) if v else None
        std = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
        out[k] = {"mean": mean, "std": std, "n": len(v), "values": v}
    return out


def seed_values(rows: Sequence[Mapping[str, Any]], residual: str, blocks: int | None,
                n_layers: int) -> dict[int, float]:
    """``{seed: val_loss}`` of one arm (runs without a validation loss left out)."""
    return {r["seed"]: float(r["val_loss"]) for r in rows if r["residual"] == residual and r["blocks"] == blocks
            and r["n_layers"] == n_layers and r["val_loss"] is not None}


def paired_diff(a: Mapping[int, float], b: Mapping[int, float]) -> dict[str, Any]:
    """``a - b`` seed by seed over the seeds both arms ran, with its 95% t interval (``report.paired``).

    Seeds pair the arms: the same seed gives the same data order, so the per-seed difference leaves
    out what the seed does to every arm alike. Returns ``{"mean", "std", "n", "low", "high", "values",
    "verdict"}``: verdict ``lower`` / ``higher`` (a below / above b, the interval excludes 0),
    ``within noise`` (it includes 0) or ``one seed`` (no interval).
    """
    seeds = sorted(set(a) & set(b))
    values = [a[s] - b[s] for s in seeds]
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "n": 0, "low": None, "high": None, "values": [], "verdict": "one seed"}
    iv = report.paired({s: a[s] for s in seeds}, {s: b[s] for s in seeds})
    std = math.sqrt(sum((v - iv.mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    if n < 2:
        verdict = "one seed"
    elif iv.low == iv.high == 0.0:
        verdict = "within noise"
    else:
        verdict = "within noise" if iv.includes_zero else ("lower" if iv.mean < 0 else "higher")
    return {**iv.to_dict(), "std": std, "values": values, "verdict": verdict}


def _status(d: Mapping[str, Any], lower_is_better: bool = True) -> str:
    """The one wording of ``moelab.studies.report`` for a :func:`paired_diff` result."""
    if d["verdict"] == "one seed":
        return "one seed: no interval"
    iv = report.Interval(d["mean"], d["low"], d["high"], d["n"], "paired t")
    return report.status_text(report.judge(iv, lower_is_better))


def paired_gain(rows: Sequence[Mapping[str, Any]], residual: str, blocks: int | None, n_layers: int) -> dict[str, Any]:
    """Gain of a mode over prenorm at one depth: :func:`paired_diff` of ``val_loss(prenorm) - val_loss(mode)``
    (positive: the mode is better)."""
    return paired_diff(seed_values(rows, "prenorm", None, n_layers), seed_values(rows, residual, blocks, n_layers))


def depth_verdicts(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per depth (key: n_layers as text), the three main modes compared.

    ``block_vs_prenorm``, ``full_vs_prenorm``, ``full_vs_block``: :func:`paired_diff` results (first
    minus second); ``order``: the paper's Full <= Block < PreNorm read gap by gap in the one wording
    (``Block - PreNorm better (interval excludes 0); Full - Block inside the noise (interval includes 0)``),
    or ``one seed``.
    """
    s = stats(rows)
    out = {}
    for L in sorted({r["n_layers"] for r in rows}):
        keys = {"prenorm": None, "block_attnres": main_blocks(L), "full_attnres": 2 * L}
        if any((mode, blocks, L) not in s for mode, blocks in keys.items()):
            continue
        pre, blk, full = (seed_values(rows, mode, blocks, L) for mode, blocks in keys.items())
        bp, fp, fb = paired_diff(blk, pre), paired_diff(full, pre), paired_diff(full, blk)
        if "one seed" in (bp["verdict"], fb["verdict"]):
            order = "one seed"
        else:
            order = f"Block - PreNorm {_status(bp)}; Full - Block {_status(fb)}"
        means = {mode: _mean_std(s[(mode, blocks, L)]) for mode, blocks in keys.items()}
        out[str(L)] = {"blocks": main_blocks(L), **means, "block_vs_prenorm": bp, "full_vs_prenorm": fp,
                       "full_vs_block": fb, "order": order}
    return out


def _mean_std(g: Mapping[str, Any]) -> dict[str, Any]:
    return {"mean": g["mean"], "std": g["std"], "n": g["n"]}


def gain_trend(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Does the gain over prenorm grow with depth? Per AttnRes main mode (``block_attnres``, ``full_attnres``).

    ``gains``: ``{n_layers: paired_gain}``; ``slope_per_doubling``: least-squares slope of the mean
    gain against ``log2(n_layers)`` (nats/token per doubling of depth); ``deep_minus_shallow``:
    gain at the deepest minus the shallowest depth, seed by seed (same seed, same data order), with its
    95% t interval (``interval``); ``verdict``: ``grows`` / ``shrinks`` (the interval excludes 0),
    ``no trend beyond the noise`` (it includes 0), ``one seed`` or ``one depth``.
    """
    depths = sorted({r["n_layers"] for r in rows})
    out = {}
    for mode in ("block_attnres", "full_attnres"):
        gains = {L: paired_gain(rows, mode, main_blocks(L) if mode == "block_attnres" else 2 * L, L) for L in depths}
        gains = {L: g for L, g in gains.items() if g["n"]}
        res: dict[str, Any] = {"gains": {str(L): _mean_std(g) for L, g in gains.items()}}
        if len(gains) < 2:
            res.update(slope_per_doubling=None, deep_minus_shallow=None, noise=None, verdict="one depth")
            out[mode] = res
            continue
        xs = [math.log2(L) for L in gains]
        ys = [g["mean"] for g in gains.values()]
        xm, ym = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - xm) * (y - ym) for x, y in zip(xs, ys)) / sum((x - xm) ** 2 for x in xs)
        lo, hi = min(gains), max(gains)
        blocks = {L: main_blocks(L) if mode == "block_attnres" else 2 * L for L in (lo, hi)}
        per_seed = {L: {s: pre - v for s, pre in seed_values(rows, "prenorm", None, L).items()
                        if (v := seed_values(rows, mode, blocks[L], L).get(s)) is not None} for L in (lo, hi)}
        d = paired_diff(per_seed[hi], per_seed[lo])
        if d["verdict"] == "one seed":
            verdict = "one seed"
        else:
            verdict = {"within noise": "no trend beyond the noise", "higher": "grows", "lower": "shrinks"}[d["verdict"]]
        res.update(slope_per_doubling=slope, deep_minus_shallow=d["mean"],
                   interval={k: d[k] for k in ("mean", "low", "high", "n")}, verdict=verdict)
        out[mode] = res
    return out


def overhead(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{n_layers: {mode: {"tok_per_s_ratio", "peak_mem_ratio"}}}`` (mode: ``block8``, ``full``, the arm
    name without the depth): each mode's mean over seeds divided by prenorm's at the same depth (None
    where a value is missing, e.g. memory on CPU). Keys are valid MLflow metric names."""
    tps, mem = stats(rows, "tok_per_s"), stats(rows, "peak_mem_gb")
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for (mode, blocks, L), g in sorted(tps.items(), key=lambda kv: (kv[0][2], MODES.index(kv[0][0]), kv[0][1] or 0)):
        if mode == "prenorm":
            continue
        base_t, base_m = tps.get(("prenorm", None, L)), mem.get(("prenorm", None, L))
        m = mem.get((mode, blocks, L))
        out.setdefault(str(L), {})[arm_name(mode, L, blocks).split("-")[0]] = {
            "tok_per_s_ratio": _ratio(g["mean"], base_t["mean"] if base_t else None),
            "peak_mem_ratio": _ratio(m["mean"] if m else None, base_m["mean"] if base_m else None),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ------------------------------------------------------------------------------------ diagnostics


def layer_diagnostics(model: torch.nn.Module, input_ids: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Per-sublayer norms and depth-attention weights of one forward + backward of ``model`` (a MoELab).

    Args:
        input_ids, targets: ``[B, T]`` long.

    Returns:
        ``hidden_rms`` ``[2L + 1]`` (RMS of each sublayer's input ``h_l``, the last = the stream the
        final norm reads), ``output_rms`` ``[2L]`` (RMS of each sublayer output ``v_l``),
        ``grad_norm`` ``[2L]`` (L2 norm of the loss gradient over the parameters of sublayer l: its
        pre-norm and mixer or FFN), all fp32 CPU tensors, ``depth_weights`` (per read, the mean
        weight of each source ``[n_sources]``; empty for prenorm) and ``loss`` (float). The model's
        gradients are cleared afterwards.
    """
    model.zero_grad(set_to_none=True)
    out = model(input_ids, targets, return_diagnostics=True, return_logits=False)
    out.loss.backward()
    grads = []
    for layer in model.layers:
        for parts in ((layer.mixer_norm, layer.mixer), (layer.ffn_norm, layer.ffn)):
            sq = sum(p.grad.float().pow(2).sum() for m in parts for p in m.parameters() if p.grad is not None)
            grads.append(torch.as_tensor(sq).sqrt())
    model.zero_grad(set_to_none=True)
    d = out.diagnostics
    return {"hidden_rms": d["hidden_rms"].float().cpu(), "output_rms": d["output_rms"].float().cpu(),
            "grad_norm": torch.stack(grads).float().cpu(),
            "depth_weights": [w.float().cpu() for w in d["depth_weights"]], "loss": out.loss.item()}


def weight_matrix(depth_weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stack per-read source weights of different lengths into ``[n_reads, max_sources]`` (NaN-padded):
    row l = the read before sublayer l (the last row: the final read), column i = source i
    (0 = embedding, then blocks or sublayer outputs in order)."""
    if not depth_weights:
        return torch.empty(0, 0)
    width = max(w.numel() for w in depth_weights)
    out = torch.full((len(depth_weights), width), float("nan"))
    for i, w in enumerate(depth_weights):
        out[i, : w.numel()] = w.float()
    return out


def collect_diagnostics(grid: common.Grid, preset: str, seed: int | None = None,
                        batches: int = 1) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """:func:`layer_diagnostics` of every trained model of one seed (default: the first) on validation windows.

    Returns ``(rows, weights)``: rows per (arm, sublayer) with residual, blocks, n_layers, seed,
    sublayer, hidden_rms, output_rms, grad_norm (means over ``batches``; the final read is
    sublayer ``2L`` with only hidden_rms); weights ``{arm: weight_matrix}`` of the AttnRes arms.
    """
    from moelab.data import TextDataModule
    from moelab.train.runner import load_model

    p = plan(preset)
    seed = p.seeds[0] if seed is None else seed
    main, extra = arms(preset)
    ov = {**main, **extra}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows: list[dict[str, Any]] = []
    weights: dict[str, torch.Tensor] = {}
    for rec in (r for r in grid.records if r.seed == seed):
        model, cfg = load_model(rec.summary.get("best_checkpoint") or rec.summary["last_checkpoint"])
        model = model.to(device)
        dm = TextDataModule(cfg.data, cfg.train.batch_size, cfg.seed, cfg.train.max_steps, batches)
        dm.setup("validate")
        found = []
        for i, batch in enumerate(dm.val_dataloader()):
            if i >= batches:
                break
            with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
                found.append(layer_diagnostics(model, batch["input_ids"].to(device), batch["targets"].to(device)))
        info = arm_info(ov[rec.arm])
        mean = {k: torch.stack([f[k] for f in found]).mean(0) for k in ("hidden_rms", "output_rms", "grad_norm")}
        for sub in range(2 * info["n_layers"] + 1):
            last = sub == 2 * info["n_layers"]
            rows.append({**info, "arm": rec.arm, "seed": rec.seed, "sublayer": sub,
                         "hidden_rms": float(mean["hidden_rms"][sub]),
                         "output_rms": None if last else float(mean["output_rms"][sub]),
                         "grad_norm": None if last else float(mean["grad_norm"][sub])})
        if found[0]["depth_weights"]:
            weights[rec.arm] = torch.stack([weight_matrix(f["depth_weights"]) for f in found]).mean(0)
    return rows, weights


def norm_growth(diag_rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Per arm: ``hidden_last_over_first`` (RMS of the last read over the first sublayer input's) and
    ``grad_first_over_last`` (gradient norm of the first sublayer over the last one's): how much the
    stream grows with depth, and how unevenly the layers are trained."""
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in diag_rows:
        by.setdefault(r["arm"], []).append(r)
    out = {}
    for arm, rs in by.items():
        rs = sorted(rs, key=lambda r: r["sublayer"])
        grads = [r["grad_norm"] for r in rs if r["grad_norm"] is not None]
        out[arm] = {"hidden_last_over_first": rs[-1]["hidden_rms"] / rs[0]["hidden_rms"],
                    "grad_first_over_last": grads[0] / grads[-1] if grads and grads[-1] else None}
    return out


# ------------------------------------------------------------------------------------------ figures

_PAL = report.palette(["prenorm", "block_attnres", "full_attnres", "block2", "block4", "other"])
COLORS = {m: _PAL[m] for m in MODES}


def _color(residual: str, blocks: int | None, n_layers: int) -> str:
    if residual == "block_attnres" and blocks != main_blocks(n_layers):
        return {2: _PAL["block2"], 4: _PAL["block4"]}.get(blocks, _PAL["other"])
    return COLORS[residual]


def loss_vs_depth_figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Left: final validation loss vs depth per main mode (mean and seed spread, each seed a dot;
    other block counts as open markers). Right: the paired gain over prenorm per depth."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    ax, ax2 = fig.subplots(1, 2)
    s = stats(rows)
    depths = sorted({r["n_layers"] for r in rows})
    for mode in MODES:
        keys = [(mode, None if mode == "prenorm" else (main_blocks(L) if mode == "block_attnres" else 2 * L), L)
                for L in depths]
        keys = [k for k in keys if k in s]
        xs = [k[2] for k in keys]
        half = [_half(s[k]["values"]) for k in keys]
        ax.errorbar(xs, [s[k]["mean"] for k in keys], yerr=half, color=COLORS[mode],
                    marker="o", capsize=3, label=f"{mode}{' (main N)' if mode == 'block_attnres' else ''}")
        for k in keys:
            ax.plot([k[2]] * len(s[k]["values"]), s[k]["values"], ".", color=COLORS[mode], alpha=0.4)
        if mode != "prenorm":
            g = [(L, paired_gain(rows, mode, k[1], L)) for k, L in zip(keys, xs)]
            g = [(L, v) for L, v in g if v["n"]]
            ax2.errorbar([L for L, _ in g], [v["mean"] for _, v in g],
                         yerr=[0 if v["high"] is None else v["high"] - v["mean"] for _, v in g],
                         color=COLORS[mode], marker="o", capsize=3, label=mode)
    for (mode, blocks, L), v in s.items():
        if mode == "block_attnres" and blocks != main_blocks(L):
            ax.plot([L], [v["mean"]], "s", mfc="none", color=_color(mode, blocks, L), ms=7,
                    label=f"block_attnres N={blocks}")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(depths, [str(L) for L in depths])
        a.set_xlabel("layers (n_layers; 2 sublayers each)")
        a.grid(alpha=0.3)
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("validation loss vs depth (mean, 95% t interval)")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_ylabel("prenorm − mode (nats/token; > 0: better)")
    ax2.set_title("gain over prenorm, paired by seed (95% t interval)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _half(values: Sequence[float]) -> float:
    """Half width of the 95% t interval of the mean of ``values`` (0 for one value)."""
    iv = report.mean_interval(values)
    return iv.high - iv.mean if iv.known else 0.0


def norms_figure(diag_rows: Sequence[Mapping[str, Any]], n_layers: int) -> Any:
    """Hidden-state RMS (each sublayer's input) and gradient norm per sublayer at depth ``n_layers``, per arm."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    ax, ax2 = fig.subplots(1, 2)
    sel = [r for r in diag_rows if r["n_layers"] == n_layers]
    for arm in dict.fromkeys(r["arm"] for r in sel):
        rs = sorted((r for r in sel if r["arm"] == arm), key=lambda r: r["sublayer"])
        info = rs[0]
        label = mode_label(info["residual"], info["blocks"])
        color = _color(info["residual"], info["blocks"], n_layers)
        ax.plot([r["sublayer"] for r in rs], [r["hidden_rms"] for r in rs], "-o", ms=3, color=color, label=label)
        g = [r for r in rs if r["grad_norm"] is not None]
        ax2.plot([r["sublayer"] for r in g], [r["grad_norm"] for r in g], "-o", ms=3, color=color, label=label)
    ax.set_title(f"hidden-state RMS by sublayer ({n_layers} layers)")
    ax.set_ylabel("RMS of the sublayer input h_l")
    ax2.set_title(f"gradient norm by sublayer ({n_layers} layers)")
    ax2.set_ylabel("‖∂loss/∂θ_l‖ (sublayer l's parameters)")
    for a in (ax, ax2):
        a.set_yscale("log")
        a.set_xlabel(f"sublayer l (0..{2 * n_layers - 1}; {2 * n_layers} = the final read)")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def depth_weights_figure(weights: Mapping[str, torch.Tensor], labels: Mapping[str, str]) -> Any:
    """One heatmap per AttnRes arm: mean depth-attention weight of source i (columns) at read l (rows)."""
    from matplotlib.figure import Figure

    n = len(weights)
    fig = Figure(figsize=(3.6 * max(n, 1), 3.8), dpi=100)
    axes = fig.subplots(1, max(n, 1), squeeze=False)[0]
    for ax, (arm, w) in zip(axes, weights.items()):
        im = ax.imshow(w.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(labels.get(arm, arm), fontsize=9)
        ax.set_xlabel("source (0 = embedding, then blocks / sublayers)")
        ax.set_ylabel("read before sublayer l (last = final)")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def overhead_figure(over: Mapping[str, Mapping[str, Mapping[str, float | None]]], device: str) -> Any:
    """tokens/s and peak memory of each AttnRes arm relative to prenorm at the same depth (bars per depth)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.0), dpi=100)
    axes = fig.subplots(1, 2)
    depths = list(over)
    # block2, block4, block8, ..., full: one fixed order (and colour) per mode in every depth group
    labels = sorted({lab for d in over.values() for lab in d},
                    key=lambda lab: (lab == "full", int(lab[5:]) if lab.startswith("block") else 0))
    width = 0.8 / max(len(labels), 1)
    for ax, key, title in ((axes[0], "tok_per_s_ratio", "tokens/s ÷ prenorm's"),
                           (axes[1], "peak_mem_ratio", "peak memory ÷ prenorm's")):
        for i, lab in enumerate(labels):
            ys = [over[d].get(lab, {}).get(key) for d in depths]
            ax.bar([j + i * width for j in range(len(depths))], [y if y is not None else 0 for y in ys], width,
                   label=lab)
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(depths))], [f"{d} layers" for d in depths])
        ax.set_title(f"{title} ({device})", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        if all(over[d].get(lab, {}).get(key) is None for d in depths for lab in labels):
            ax.text(0.5, 0.5, "not recorded on this device", ha="center", va="center", transform=ax.transAxes)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------- summary, findings


def summarize(grid: common.Grid, rows: Sequence[Mapping[str, Any]], diag_rows: Sequence[Mapping[str, Any]],
              preset: str) -> dict[str, Any]:
    """The study's ``summary.json``: meta, the factor, the budget rule, the rows and the verdicts computed from them."""
    p = plan(preset)
    params = {r["arm"]: r["params"] for r in rows}
    on_gpu = torch.cuda.is_available()
    return {
        "meta": common.study_meta(STUDY, preset, grid, plan=p.notes, depths=list(p.depths), seeds=list(p.seeds),
                                  extra_seeds=list(p.extra_seeds), overhead_meaningful=on_gpu),
        "factor": {k: dict(v) for k, v in grid.factor.items()},
        "budget": {"rule": "same tokens per run, same width; depth varied; at one depth the modes differ only in "
                           "the AttnRes pseudo-queries and key norms",
                   "tokens_per_run": sorted({r["tokens"] for r in rows}),
                   "params_by_arm": params,
                   "max_param_excess_at_a_depth": _param_excess(rows)},
        "rows": [{k: r[k] for k in ROW_KEYS} for r in rows],
        "by_depth": depth_verdicts(rows),
        "gain_trend": gain_trend(rows),
        "overhead": overhead(rows),
        "norm_growth": norm_growth(diag_rows),
    }


def _param_excess(rows: Sequence[Mapping[str, Any]]) -> float:
    """Largest relative parameter difference between the arms of one depth (the budget rule's slack)."""
    worst = 0.0
    for L in {r["n_layers"] for r in rows}:
        ps = [r["params"] for r in rows if r["n_layers"] == L and r["params"]]
        if ps:
            worst = max(worst, max(ps) / min(ps) - 1)
    return worst


def rows_from_table(df: Any) -> list[dict[str, Any]]:
    """``results/runs.csv`` read back as :func:`summary_rows` gives them (no block count: None, not NaN)."""
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v
    rows = []
    for r in df.to_dict("records"):
        r = {key: clean(v) for key, v in r.items()}
        r["blocks"] = None if r["blocks"] is None else int(r["blocks"])
        r["n_layers"], r["seed"] = int(r["n_layers"]), int(r["seed"])
        rows.append(r)
    return rows


def weights_from_json(saved: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``results/depth_weights.json`` read back as ``{arm: weight_matrix}`` (JSON nulls, the sources that do not
    exist yet at a read, back to NaN)."""
    return {arm: torch.tensor([[math.nan if v is None else v for v in row] for row in w]) for arm, w in saved.items()}


def refresh_verdicts(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``summary`` with ``by_depth``, ``gain_trend`` and ``overhead`` recomputed from ``rows`` by the current rules."""
    return {**summary, "by_depth": depth_verdicts(rows), "gain_trend": gain_trend(rows), "overhead": overhead(rows)}


def depth_pays(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Study 3's precondition: is the training past the early phase, where depth pays?

    PreNorm's validation loss at the deepest depth minus at the shallowest, paired by seed. Depth pays
    when that interval lies below 0; otherwise the deeper models are under-trained at this budget and
    whether AttnRes's gain grows with depth is not tested. Returns ``{"diff", "pays", "reason"}``.
    """
    depths = sorted({r["n_layers"] for r in rows})
    lo, hi = depths[0], depths[-1]
    d = paired_diff(seed_values(rows, "prenorm", None, hi), seed_values(rows, "prenorm", None, lo))
    pays = d["verdict"] == "lower"
    reason = None if pays else (
        f"under-trained: depth does not pay yet, PreNorm {hi} minus {lo} layers "
        f"{d['mean']:+.3f} nats [{d['low']:+.3f}, {d['high']:+.3f}]")
    return {"diff": d, "pays": pays, "reason": reason, "shallow": lo, "deep": hi}


def study_report(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> report.Report:
    """The findings as rules (``moelab.studies.report``): whether the gain grows with depth (only where depth pays),
    whether depth pays, Block and Full against PreNorm and each other at the deepest depth, the overhead."""
    pre = depth_pays(rows)
    lo, hi = pre["shallow"], pre["deep"]
    bh, bl = main_blocks(hi), main_blocks(lo)
    gain = {L: {sd: p - v for sd, p in seed_values(rows, "prenorm", None, L).items()
                if (v := seed_values(rows, "block_attnres", b, L).get(sd)) is not None}
            for L, b in ((lo, bl), (hi, bh))}
    grows = report.compare(f"Does Block AttnRes's gain over PreNorm grow with depth ({hi} vs {lo} layers)",
                           gain[hi], gain[lo], unit="nats", lower_is_better=False,
                           precondition=pre["reason"])
    d = pre["diff"]
    answer = {"lower": "depth pays", "higher": "no: the deeper model ends higher",
              "within noise": "inside the noise", "one seed": "one seed"}[d["verdict"]]
    pays = report.measured(f"Does depth pay at this budget (PreNorm, {hi} minus {lo} layers)",
                           report.Interval(d["mean"], d["low"], d["high"], d["n"], "paired t"), answer=answer,
                           unit="nats", signed=True)
    vals = {m: seed_values(rows, m, b, hi) for m, b in (("prenorm", None), ("block_attnres", bh),
                                                          ("full_attnres", 2 * hi))}
    block = report.compare(f"Block AttnRes (N={bh}) minus PreNorm at {hi} layers", vals["block_attnres"],
                           vals["prenorm"], unit="nats")
    full_block = report.compare(f"Full minus Block AttnRes at {hi} layers (the paper: Full <= Block)",
                                vals["full_attnres"], vals["block_attnres"], unit="nats")
    shallow = report.compare(f"Block AttnRes (N={bl}) minus PreNorm at {lo} layers",
                             seed_values(rows, "block_attnres", bl, lo), seed_values(rows, "prenorm", None, lo),
                             unit="nats")
    meta = summary["meta"]
    tps = {m: {r["seed"]: r["tok_per_s"] for r in rows if r["residual"] == m and r["n_layers"] == hi
               and r["blocks"] == b and r["tok_per_s"]} for m, b in (("prenorm", None), ("block_attnres", bh))}
    ratio = [tps["block_attnres"][sd] / tps["prenorm"][sd] for sd in tps["prenorm"] if sd in tps["block_attnres"]]
    question = f"What does Block AttnRes cost in training speed at {hi} layers (tokens/s over PreNorm's)"
    cost = (report.measured(question, ratio, unit="times", digits=2) if meta.get("overhead_meaningful")
            else report.not_tested(question, "timed on a CPU, where the depth softmax is plain PyTorch",
                                   report.mean_interval(ratio), unit="times", digits=2))
    import pandas as pd

    table = {}
    for L in sorted({r["n_layers"] for r in rows}):
        b = main_blocks(L)
        v = {m: seed_values(rows, m, bb, L) for m, bb in (("prenorm", None), ("block_attnres", b),
                                                            ("full_attnres", 2 * L))}
        if not all(v.values()):
            continue
        table[f"{L} layers (block N={b})"] = {
            **{m: report.cell(report.mean_interval(list(x.values())), 3, signed=False) for m, x in v.items()},
            "block - prenorm": report.cell(report.paired(v["block_attnres"], v["prenorm"])),
            "full - block": report.cell(report.paired(v["full_attnres"], v["block_attnres"]))}
    table = pd.DataFrame(table).T
    table.index.name = "depth"
    budget = summary["budget"]
    details = [f"Budget: every run saw {', '.join(f'{t:,}' for t in budget['tokens_per_run'])} tokens; at one depth "
               f"the modes' parameter counts differ by at most {budget['max_param_excess_at_a_depth']:.2%}."]
    for mode, t in summary["gain_trend"].items():
        iv = t.get("interval")
        if iv and iv.get("low") is not None:
            details.append(f"Gain of {mode} over prenorm by depth: " + ", ".join(
                f"{L} layers {g['mean']:+.4f}" for L, g in t["gains"].items()) + f"; deepest minus shallowest "
                f"{iv['mean']:+.4f} [{iv['low']:+.4f}, {iv['high']:+.4f}], slope {t['slope_per_doubling']:+.4f} "
                "per doubling of depth.")
    growth = summary.get("norm_growth") or {}
    sel = {a: g for a, g in growth.items() if a.endswith(f"-L{hi}")}
    if sel:
        details.append(f"Hidden-state RMS, last read over first, at {hi} layers (first seed): " + ", ".join(
            f"{a} {g['hidden_last_over_first']:.1f}x" for a, g in sel.items()) + "; gradient norm of the first "
            "sublayer over the last: " + ", ".join(f"{a} {g['grad_first_over_last']:.2f}" for a, g in sel.items()
                                                   if g["grad_first_over_last"]) + ".")
    over = summary.get("overhead") or {}
    if over.get(str(hi)) and meta.get("overhead_meaningful"):
        details.append(f"Peak memory relative to prenorm at {hi} layers on {meta['device']}: " + ", ".join(
            f"{lab} {v['peak_mem_ratio']:.2f}x" for lab, v in over[str(hi)].items() if v["peak_mem_ratio"]) + ".")
    if meta.get("epochs") is not None:
        details.append(f"Data: each run saw {meta['epochs']:.3g} epochs of the {meta['corpus_train_tokens']:,}-token "
                       "training split.")
    return report.Report([grows, pays, block, full_block, shallow, cost], table, details)


def findings(rep: report.Report) -> str:
    """The findings section (markdown) of :func:`study_report`."""
    return rep.markdown()


TREND_TEXT = {"grows": "**grows** with depth", "shrinks": "**shrinks** with depth",
              "no trend beyond the noise": "shows **no trend with depth beyond the noise**",
              "one seed": "has one seed at an end of the sweep: **trend not judged**"}


