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
import re
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
                              "train.val_batches": 2, "train.compile": "graphs", **common.FAST_BACKENDS},
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


def train(preset: str, out_dir: str | Path, extra_overrides: Mapping[str, Any] | None = None
          ) -> common.Grid | tuple[common.Grid, dict]:
    """Train every grid of ``preset``; finished runs are reused. The study's one training entry: the notebook calls
    it, and so does a split call (``make study-3 PRESET=research RUNS=...``, without the notebook).

    ``research``: :func:`train_research` (the lr sweep first, then the shallow seeds and the deep grid at each mode's
    winning lr; a split call stops with :class:`moelab.studies.common.GridIncomplete` at the first incomplete grid),
    its records pinned to :attr:`ResearchPlan.source_pin`; returns ``(grid, picked)``. ``cpu`` / ``gpu``: the main modes
    at every seed, the other block counts at the first seeds; returns the :class:`~moelab.studies.common.Grid`.
    Runs go to ``<out_dir>/checkpoints/<arm>-s<seed>``. Sets the plan's torch thread count for this process.
    """
    if preset == "research":
        extra = {"common": {**RESEARCH.common, **extra_overrides}} if extra_overrides else {}
        return train_research(out_dir, RESEARCH, **extra)  # the module's plan at call time
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
                     "val_loss": s.get("final_val_loss"), "tok_per_s": r.tok_per_s,
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




# ======================================================================================== research
#
# The research tier (issue 40) answers the seeds' claim "extra depth keeps paying with AttnRes where it stops
# paying under PreNorm; Block is close to Full at a fraction of the cost" past the early phase: two depths
# (the deeper >= 24 layers) at a narrower width, Block AttnRes with blocks of several layers (a fixed block
# size, so the block count grows with depth as K3's does), a learning-rate sweep per mode at the shallower
# depth whose winner every later run of that mode uses, 3 seeds, >= 50M tokens per run (2.2 epochs of the
# 22.6M-token GPU corpus). It runs as split calls (studies/README.md): the sweep first, then the runs that
# need its winner.


@dataclass(frozen=True)
class ResearchPlan:
    """The research tier.

    base: training preset; common: overrides of every run (width, dense FFNs, steps, batch, the captured
    step); depths: ``(shallow, deep)`` ``model.n_layers``; layers_per_block: Block AttnRes block size in
    layers (``num_blocks = n_layers / layers_per_block``); lrs: the sweep's ``train.lr`` values (at the
    shallow depth, seed ``sweep_seed``); seeds: of the main grid; modes: the residual modes compared;
    min_tokens: tokens per run the design needs to be past the early phase (the precondition).
    """

    base: str
    common: Mapping[str, Any]
    depths: tuple[int, int]
    layers_per_block: int
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    sweep_seed: int
    modes: tuple[str, ...]
    min_tokens: int
    notes: str = ""
    source_pin: str | None = None  # training-code epoch of the records (common.pinned): bump when training changes

    @property
    def tokens_per_run(self) -> int:
        c = self.common
        return int(c["train.max_steps"]) * int(c["train.batch_size"]) * int(c["data.seq_len"])

    def blocks(self, n_layers: int) -> int:
        """Block AttnRes's ``num_blocks`` at depth ``n_layers`` (``layers_per_block`` layers per block)."""
        if n_layers % self.layers_per_block:
            raise ValueError(f"n_layers={n_layers} is not allowed: expected a multiple of layers_per_block="
                             f"{self.layers_per_block}")
        return n_layers // self.layers_per_block


# Width 384 (3 KDA / MLA heads of 128), dense SwiGLU FFNs (1024) in every layer, gpu-small's 3:1 KDA/MLA pattern;
# 1536 steps of 16 x 2048 tokens = 50,331,648 tokens per run = 2.22 epochs of the 22,646,121-token GPU corpus.
# `python -m moelab info --config gpu-small --set ...` (these overrides): 12 layers 29.4M parameters, 196M training
# FLOPs/token; 24 layers 52.4M, 373M. At 10% MFU of 989 TFLOP/s (expected 10-25% for these small models) a
# 12-layer run trains in ~100 s, a 24-layer run in ~190 s (PreNorm; Block ~1.1x, Full ~1.3x). train.compile=graphs
# captures the whole step as one CUDA graph (the eager step is host-bound: ~110 ms of host time for 12 layers).
RESEARCH = ResearchPlan(
    "gpu-small",
    {"model.d_model": 384, "model.kda.num_heads": 3, "model.mla.num_heads": 3, "model.mla.kv_latent_dim": 192,
     "model.dense_layers": 24, "data.seq_len": 2048, "train.batch_size": 16, "train.max_steps": 1536,
     "train.warmup_steps": 100, "train.val_every": 256, "train.val_batches": 4, "train.log_every": 16,
     "train.compile": "graphs"},
    depths=(12, 24), layers_per_block=4, lrs=(1e-3, 2e-3, 4e-3), seeds=(0, 1, 2), sweep_seed=0,
    modes=MODES, min_tokens=50_000_000,
    notes="3:1 KDA/MLA, d_model 384, dense FFNs, 1536 steps of 16 x 2048 tokens, one CUDA graph per step",
    source_pin="s3research-1")

_ARM = re.compile(r"^(prenorm|block(\d+)|full)-L(\d+)(?:-lr(.+))?$")


def lr_text(lr: float) -> str:
    """``2e-3`` for 0.002: the learning rate as a sweep arm's name carries it."""
    mant, exp = f"{lr:.0e}".split("e")
    return f"{mant}e{int(exp)}"


def research_arm(mode: str, n_layers: int, lr: float | None = None, plan_: ResearchPlan = RESEARCH) -> str:
    """``prenorm-L12-lr2e-3`` (a sweep arm), ``block3-L12`` / ``full-L24`` (main arms, the sweep's lr)."""
    blocks = plan_.blocks(n_layers) if mode == "block_attnres" else None
    name = arm_name(mode, n_layers, blocks)
    return name if lr is None else f"{name}-lr{lr_text(lr)}"


def parse_arm(arm: str) -> dict[str, Any]:
    """``{"residual", "blocks", "n_layers", "lr"}`` from a research arm's name (lr None for a main arm)."""
    m = _ARM.match(arm)
    if not m:
        raise ValueError(f"arm={arm!r} is not a study-3 arm: expected prenorm|blockN|full-L<layers>[-lr<lr>]")
    short, blocks, L, lr = m.groups()
    mode = {"prenorm": "prenorm", "full": "full_attnres"}.get(short, "block_attnres")
    L = int(L)
    return {"residual": mode, "n_layers": L, "lr": float(lr) if lr else None,
            "blocks": {"prenorm": None, "block_attnres": int(blocks or 0), "full_attnres": 2 * L}[mode]}


def _research_overrides(mode: str, n_layers: int, lr: float, plan_: ResearchPlan) -> dict[str, Any]:
    # prenorm and full ignore num_blocks: they keep the deep depth's block count, so every arm sets the key
    nb = plan_.blocks(n_layers) if mode == "block_attnres" else plan_.blocks(plan_.depths[-1])
    return {**_overrides(n_layers, mode, nb), "train.lr": lr}


def sweep_arms(plan_: ResearchPlan = RESEARCH) -> dict[str, dict[str, Any]]:
    """The lr sweep: every mode at every lr of the plan, at the shallow depth (one seed, ``sweep_seed``)."""
    L = plan_.depths[0]
    return {research_arm(m, L, lr, plan_): _research_overrides(m, L, lr, plan_) for m in plan_.modes
            for lr in plan_.lrs}


def main_arms(best: Mapping[str, float], plan_: ResearchPlan = RESEARCH) -> tuple[dict, dict]:
    """``(shallow, deep)`` arms, each mode at its sweep winner ``best[mode]``. The shallow arms train the seeds
    other than ``sweep_seed`` (that seed is the sweep's own run at the winning lr, the same config)."""
    missing = [m for m in plan_.modes if m not in best]
    if missing:
        raise ValueError(f"best has no learning rate for {missing}: expected one per mode of {plan_.modes}")
    lo, hi = plan_.depths
    return ({research_arm(m, lo, None, plan_): _research_overrides(m, lo, best[m], plan_) for m in plan_.modes},
            {research_arm(m, hi, None, plan_): _research_overrides(m, hi, best[m], plan_) for m in plan_.modes})


def research_factor(best: Mapping[str, float] | None = None, plan_: ResearchPlan = RESEARCH) -> dict[str, dict]:
    """``{config key: {arm: value}}`` over the sweep and (with ``best``) the main arms; raises if any arm differs
    in anything but depth, residual mode, block count and learning rate."""
    arms_ = dict(sweep_arms(plan_))
    if best is not None:
        shallow, deep = main_arms(best, plan_)
        # the shallow main arms resolve to the sweep winners' configs by design (the same run at another seed):
        # they are checked against the deep arms, the sweep against the deep arms
        common.check_arms_differ_only(plan_.base, {**shallow, **deep}, plan_.common)
        arms_.update(deep)
    return common.check_arms_differ_only(plan_.base, arms_, plan_.common)


def pick_lr(sweep: Mapping[str, Mapping[float, float]]) -> dict[str, dict[str, Any]]:
    """The lr-carry rule: per mode the swept lr with the lowest final validation loss.

    sweep: ``{mode: {lr: val_loss}}``. Returns ``{mode: {"lr", "val_loss", "at_edge", "losses"}}``; ``at_edge``:
    the winner is the smallest or largest lr swept (the optimum may lie outside the sweep). A mode whose
    sweep has a missing (None / NaN) loss raises: the choice would be made on part of the sweep.
    """
    out = {}
    for mode, losses in sweep.items():
        bad = [lr for lr, v in losses.items() if v is None or not math.isfinite(v)]
        if bad or not losses:
            raise ValueError(f"{mode}: sweep losses {dict(losses)} have no finite value at lr {bad}: every lr of the "
                             "sweep needs its run before the winner is chosen")
        lr = min(losses, key=lambda k: (losses[k], k))
        out[mode] = {"lr": lr, "val_loss": losses[lr], "at_edge": lr in (min(losses), max(losses)) and len(losses) > 1,
                     "losses": dict(sorted(losses.items()))}
    return out


def sweep_table(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[float, float]]:
    """``{mode: {lr: val_loss}}`` from the sweep rows (``role == "sweep"``)."""
    out: dict[str, dict[float, float]] = {}
    for r in rows:
        if r["role"] == "sweep":
            out.setdefault(r["residual"], {})[float(r["lr"])] = r["val_loss"]
    return out


def research_diagnostics(model: torch.nn.Module, cfg: Any, batches: int = 1) -> dict[str, Any]:
    """run_grid's ``evaluate`` of the research tier: :func:`layer_diagnostics` of the trained model on ``batches``
    validation windows, inside the training process (a split call's checkpoints stay on its machine).

    Returns ``{"hidden_rms", "output_rms", "grad_norm"}`` (means, lists), ``depth_weights`` (the
    :func:`weight_matrix` as lists, NaN as None; [] for prenorm) or ``{"error": text}``: a diagnostic that fails
    must not cost the run its record.
    """
    from moelab.data import TextDataModule

    try:
        device = next(model.parameters()).device
        dm = TextDataModule(cfg.data, cfg.train.batch_size, cfg.seed, cfg.train.max_steps, batches)
        dm.setup("validate")
        found = []
        with torch.enable_grad():
            for i, batch in enumerate(dm.val_dataloader()):
                if i >= batches:
                    break
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    found.append(layer_diagnostics(model, batch["input_ids"].to(device), batch["targets"].to(device)))
        mean = {k: torch.stack([f[k] for f in found]).mean(0).tolist() for k in ("hidden_rms", "output_rms",
                                                                                 "grad_norm")}
        w = torch.stack([weight_matrix(f["depth_weights"]) for f in found]).mean(0) if found[0]["depth_weights"] \
            else torch.empty(0, 0)
        return {**mean, "depth_weights": [[None if math.isnan(v) else v for v in row] for row in w.tolist()]}
    except Exception as e:  # noqa: BLE001 (any failure: keep the trained run's record)
        return {"error": f"{type(e).__name__}: {e}"}


def _research_records(grid: common.Grid) -> dict[str, dict[str, Any]]:
    return {f"{r.arm}:{r.seed}": r for r in grid.records}


def train_research(out_dir: str | Path, plan_: ResearchPlan = RESEARCH, **grid_kwargs: Any) -> tuple[common.Grid, dict]:
    """Train the research tier: the sweep, then (once every sweep run has its record) the shallow seeds and the deep
    grid at each mode's winning lr. Returns ``(grid, picked)``: every record and :func:`pick_lr`'s choice.

    A split call whose sweep is still incomplete stops with :class:`moelab.studies.common.GridIncomplete` before any
    run that needs the sweep's winner (the harness stops there itself when the call's own runs are done).
    ``grid_kwargs`` go to every :func:`moelab.studies.common.run_grid` call (tests pass ``split``, ``records_dir``).
    The runs' code is pinned to ``plan_.source_pin`` (run_grid's ``source_pin``).
    """
    kw = {"common": dict(plan_.common), "evaluate": research_diagnostics, "checkpoints": "final",
          "source_pin": plan_.source_pin, **grid_kwargs}
    sweep = common.run_grid(STUDY, plan_.base, sweep_arms(plan_), (plan_.sweep_seed,), out_dir, **kw)
    if not sweep.complete:
        have = {r.arm for r in sweep.records}
        todo = sorted(f"{a}:{plan_.sweep_seed}" for a in sweep_arms(plan_) if a not in have)
        raise common.GridIncomplete(f"the lr sweep is incomplete ({', '.join(todo)} still to train): the runs that "
                                    "use its winner cannot be configured yet", missing=todo)
    rows = research_rows(sweep, plan_)
    picked = pick_lr(sweep_table(rows))
    shallow, deep = main_arms({m: v["lr"] for m, v in picked.items()}, plan_)
    seeds = tuple(s for s in plan_.seeds if s != plan_.sweep_seed)
    grids = [sweep]
    if seeds:
        grids.append(common.run_grid(STUDY, plan_.base, shallow, seeds, out_dir, **kw))
    grids.append(common.run_grid(STUDY, plan_.base, deep, plan_.seeds, out_dir, **kw))
    factor = research_factor({m: v["lr"] for m, v in picked.items()}, plan_)
    return common.Grid(study=STUDY, base=plan_.base, records=[r for g in grids for r in g.records], factor=factor,
                       corpus_tokens=max(g.corpus_tokens for g in grids),
                       complete=all(g.complete for g in grids)), picked


RESEARCH_KEYS = ("arm", "role", "residual", "blocks", "n_layers", "lr", "seed", "params", "tokens", "epochs",
                 "val_loss", "tok_per_s", "peak_mem_gb", "gpu_minutes")


def research_rows(grid: common.Grid, plan_: ResearchPlan = RESEARCH) -> list[dict[str, Any]]:
    """One row per run: :data:`RESEARCH_KEYS`. role: ``sweep`` (every sweep run) or ``main``; the sweep's run at
    each mode's winning lr is also a ``main`` row of the shallow depth (the seed the shallow arms do not train).
    """
    rows = []
    for r in grid.records:
        info = parse_arm(r.arm)
        s = r.summary
        base = {"arm": r.arm, **info, "seed": r.seed, "params": s.get("params_total"), "tokens": r.tokens,
                "epochs": r.epochs, "val_loss": s.get("final_val_loss"), "tok_per_s": r.tok_per_s,
                "peak_mem_gb": s.get("peak_mem_gb"), "gpu_minutes": r.timing.get("gpu_minutes")}
        rows.append({**base, "role": "sweep" if info["lr"] is not None else "main"})
    sweep = sweep_table(rows)
    if not sweep or any(len(v) < len(plan_.lrs) for v in sweep.values()):
        return [{k: row.get(k) for k in RESEARCH_KEYS} for row in rows]
    picked = pick_lr(sweep)
    for row in [r for r in rows if r["role"] == "sweep"]:
        if row["lr"] == picked[row["residual"]]["lr"] and row["seed"] == plan_.sweep_seed:
            rows.append({**row, "role": "main", "arm": research_arm(row["residual"], row["n_layers"], None, plan_)})
    main_lr = {m: v["lr"] for m, v in picked.items()}
    for row in rows:
        if row["role"] == "main" and row["lr"] is None:
            row["lr"] = main_lr[row["residual"]]
    return [{k: row.get(k) for k in RESEARCH_KEYS} for row in rows]


def research_rows_from_table(df: Any) -> list[dict[str, Any]]:
    """``results/runs.csv`` of the research tier read back as :func:`research_rows` gives them."""
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v
    out = []
    for r in df.to_dict("records"):
        r = {k: clean(v) for k, v in r.items()}
        r["blocks"] = None if r["blocks"] is None else int(r["blocks"])
        r["n_layers"], r["seed"] = int(r["n_layers"]), int(r["seed"])
        out.append(r)
    return out


def _main(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if r["role"] == "main"]


def _mode_blocks(mode: str, n_layers: int, plan_: ResearchPlan) -> int | None:
    return {"prenorm": None, "block_attnres": plan_.blocks(n_layers), "full_attnres": 2 * n_layers}[mode]


def depth_gains(rows: Sequence[Mapping[str, Any]], plan_: ResearchPlan = RESEARCH) -> dict[str, dict[int, float]]:
    """Per mode, ``{seed: val_loss(deep) - val_loss(shallow)}`` (the depth gain; below 0: depth pays), seed by seed."""
    lo, hi = plan_.depths
    main = _main(rows)
    out = {}
    for m in plan_.modes:
        a = seed_values(main, m, _mode_blocks(m, hi, plan_), hi)
        b = seed_values(main, m, _mode_blocks(m, lo, plan_), lo)
        out[m] = {s: a[s] - b[s] for s in sorted(set(a) & set(b))}
    return out


def research_verdicts(rows: Sequence[Mapping[str, Any]], plan_: ResearchPlan = RESEARCH) -> dict[str, Any]:
    """The computed answers of the research tier, for ``summary.json``.

    ``depth_gain``: per mode, the paired t interval of deep minus shallow; ``interaction``: per AttnRes mode,
    its depth gain minus PreNorm's, seed by seed (below 0: depth pays more with the mode); ``full_minus_block``:
    per depth; ``precondition``: ``{"depth_pays_under", "tokens_per_run", "past_early_phase", "reason"}``
    (reason None when the interaction is tested); ``overhead``: per depth and AttnRes mode, tokens/s and peak
    memory over PreNorm's (means over seeds) with the per-seed tokens/s ratio's interval.
    """
    gains = depth_gains(rows, plan_)
    depth_gain = {m: paired_diff(g, {s: 0.0 for s in g}) for m, g in gains.items()}
    pays = [m for m, d in depth_gain.items() if d["verdict"] == "lower"]
    tokens = sorted({int(r["tokens"]) for r in _main(rows) if r["tokens"]})
    past = bool(tokens) and min(tokens) >= plan_.min_tokens
    reasons = []
    if not past:
        reasons.append(f"runs saw {min(tokens) if tokens else 0:,} tokens, below the {plan_.min_tokens:,} the design "
                       "needs to be past the early phase")
    if not pays:
        reasons.append("depth does not pay under any mode: " + ", ".join(
            f"{m} {d['mean']:+.3f}" if d["mean"] is not None else f"{m} n/a" for m, d in depth_gain.items())
            + " nats (deep minus shallow)")
    interaction = {m: paired_diff(gains[m], gains["prenorm"]) for m in plan_.modes if m != "prenorm"}
    main = _main(rows)
    full_block = {}
    for L in plan_.depths:
        if "full_attnres" in plan_.modes and "block_attnres" in plan_.modes:
            full_block[str(L)] = paired_diff(seed_values(main, "full_attnres", 2 * L, L),
                                             seed_values(main, "block_attnres", plan_.blocks(L), L))
    return {"depth_gain": depth_gain, "interaction": interaction, "full_minus_block": full_block,
            "precondition": {"depth_pays_under": pays, "tokens_per_run": tokens, "past_early_phase": past,
                             "reason": "; ".join(reasons) or None},
            "overhead": research_overhead(rows, plan_)}


def research_overhead(rows: Sequence[Mapping[str, Any]], plan_: ResearchPlan = RESEARCH) -> dict[str, Any]:
    """``{n_layers: {mode: {"tok_per_s_ratio", "peak_mem_ratio", "tok_per_s_interval"}}}`` from the runs' own
    records (main rows): each AttnRes mode's tokens/s and peak memory over PreNorm's at the same depth; the
    interval is the paired t interval of the per-seed ratio (None with fewer than 2 seeds)."""
    main = _main(rows)
    out: dict[str, Any] = {}
    for L in plan_.depths:
        def vals(mode: str, key: str, L: int = L) -> dict[int, float]:
            b = _mode_blocks(mode, L, plan_)
            return {r["seed"]: float(r[key]) for r in main if r["residual"] == mode and r["n_layers"] == L
                    and r["blocks"] == b and r.get(key) is not None}
        pre_t, pre_m = vals("prenorm", "tok_per_s"), vals("prenorm", "peak_mem_gb")
        for m in plan_.modes:
            if m == "prenorm":
                continue
            t, mem = vals(m, "tok_per_s"), vals(m, "peak_mem_gb")
            ratios = [t[s] / pre_t[s] for s in sorted(set(t) & set(pre_t)) if pre_t[s]]
            iv = report.mean_interval(ratios) if ratios else None
            out.setdefault(str(L), {})[SHORT[m]] = {
                "tok_per_s_ratio": _ratio(_avg(t.values()), _avg(pre_t.values())),
                "peak_mem_ratio": _ratio(_avg(mem.values()), _avg(pre_m.values())),
                "tok_per_s_interval": iv.to_dict() if iv is not None and iv.known else None}
    return out


def _avg(values: Any) -> float | None:
    v = list(values)
    return sum(v) / len(v) if v else None


def benchmark_overhead(path: str | Path) -> dict[str, Any]:
    """The committed benchmark's AttnRes rows (``kernels/results/model_h200.json``: gpu-small, 12 layers, d_model
    512, MoE, eager, 8 x 4096 tokens): ``{mode: {"tok_per_s_ratio", "peak_mem_ratio"}}`` over its prenorm row,
    with the setting they were measured in; {} when the file or its rows are missing."""
    import json

    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    by = {r.get("impl"): r for r in rows}
    pre = by.get("moelab_gpu_small_prenorm")
    if not pre:
        return {}
    out = {}
    for impl, r in by.items():
        if impl and impl.startswith("moelab_gpu_small_") and impl != "moelab_gpu_small_prenorm" \
                and "model.residual.mode" in r:
            out[impl.removeprefix("moelab_gpu_small_")] = {
                "tok_per_s_ratio": _ratio(r.get("tok_per_s"), pre.get("tok_per_s")),
                "peak_mem_ratio": _ratio(r.get("peak_mem_gb"), pre.get("peak_mem_gb")),
                "setting": f"{r.get('preset')}, B {r.get('B')} x T {r.get('T')}, eager, commit {r.get('commit')}"}
    return out


OVERHEAD_FILE = "studies/03_attnres_depth/results/overhead_research.json"  # the research tier's speed part


def overhead_part(rounds: int = 7, window: int = 10, warm: int = 4, plan_: ResearchPlan = RESEARCH,
                  device: str | None = None, budget_s: float = 480.0, log: Any = print,
                  command: Sequence[str] | None = None) -> dict[str, Any]:
    """Each residual mode's training speed and peak memory at both research depths, in interleaved paired rounds
    (the research tier's speed part: its runs may share a GPU, whose tokens/s is then no speed).

    Every (depth, mode) of ``plan_`` builds its model from seed 0 with the research overrides (the middle lr of
    the sweep: speed does not depend on it) and trains ``warm`` untimed steps (compilation, the capture), then
    ``rounds`` rounds each time ``window`` steps of every arm, the order rotated round by round
    (``moelab.train.perf.interleaved_rounds``), one depth at a time (ratios pair arms of one depth only; the
    shallower depth's arms are freed before the deeper's are built): the whole step as one CUDA graph on a GPU
    (``train.compile=graphs``, as the runs train), eager on the CPU (tests). The same random batches ``[B, T]`` of
    the plan for every arm.

    Returns:
        ``{"meta": provenance, "config", "rows": [{"arm", "n_layers", "residual", "blocks", "compile", "step_ms",
        "tok_per_s", "peak_mem_gb", "rounds_step_ms", ...}], "ratios": {str(n_layers): {short mode: {"median",
        "min", "max", "rounds": per-round tokens/s over PreNorm's, "peak_mem_ratio"}}}, "errors": {arm: why},
        "wall_s"}``.
    """
    import gc
    import statistics
    import time

    from moelab import provenance
    from moelab.config import load_config
    from moelab.train.perf import TimedStep, interleaved_rounds, random_batches, timing_row

    if rounds < 1 or window < 1 or warm < 2:
        raise ValueError(f"rounds={rounds}, window={window}, warm={warm} are not allowed: expected rounds >= 1, "
                         "window >= 1, warm >= 2 (the capture needs a warm-up step before it)")
    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mode = "graphs" if dev.type == "cuda" else "eager"
    lr = plan_.lrs[len(plan_.lrs) // 2]
    base = {k: v for k, v in plan_.common.items() if k != "train.compile"}
    cfg0 = load_config(plan_.base, base)
    B, T = cfg0.train.batch_size, cfg0.data.seq_len
    data = random_batches(cfg0.model.vocab_size, B, T, 4, device=dev)
    rows, ratios, errors = [], {}, {}

    def time_depth(L: int) -> None:
        """Build, time and record the arms of depth ``L``; they (and their CUDA graphs) die when this returns."""
        arms, info = {}, {}
        for m in plan_.modes:
            name = research_arm(m, L, None, plan_)
            info[name] = m
            log(f"{name}: building and warming ({mode})")
            try:
                arms[name] = TimedStep(plan_.base, {**base, **_research_overrides(m, L, lr, plan_)}, mode, data,
                                       warm, lr)
            except Exception as e:  # noqa: BLE001 - recorded: which arm could not run and why is the measurement
                errors[name] = f"setup: {type(e).__name__}: {e}"[:2000]
                log(f"  {name} failed: {errors[name][:300]}")
        windows = interleaved_rounds(arms, rounds, window, t0 + budget_s, log, errors)
        for name, arm in arms.items():
            if not windows[name]:
                continue
            m = info[name]
            row = timing_row(arm, windows[name], None, None)
            row.pop("losses", None)
            row["compile"] = row.pop("mode")  # the step's mode (graphs / eager); "residual" is the study's factor
            rows.append({"arm": name, "n_layers": L, "residual": m, "blocks": _mode_blocks(m, L, plan_), **row})
        pre = research_arm("prenorm", L, None, plan_)
        for m in plan_.modes:
            name = research_arm(m, L, None, plan_)
            if m == "prenorm" or not windows.get(name) or not windows.get(pre):
                continue
            per_round = [b["step_ms"] / w["step_ms"] for b, w in zip(windows[pre], windows[name])]
            ratios.setdefault(str(L), {})[SHORT[m]] = {
                "median": statistics.median(per_round), "min": min(per_round), "max": max(per_round),
                "rounds": per_round,
                "peak_mem_ratio": _ratio(arms[name].peak, arms[pre].peak) if dev.type == "cuda" else None}

    # one depth at a time: every arm's CUDA graph holds its own memory pool, and all six arms at once do not fit
    # one 80 GB GPU (full-L24 ran out on an H100)
    for L in plan_.depths:
        time_depth(L)
        gc.collect()  # this depth's graphs and their pools go before the next depth's arms are built
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    config = {"preset": plan_.base, "overrides": dict(base), "B": B, "T": T, "mode": mode, "rounds": rounds,
              "window": window, "warm": warm, "lr": lr, "layers_per_block": plan_.layers_per_block,
              "step": "forward (bf16 autocast on a GPU) + backward + AdamW, the whole step one CUDA graph on a GPU; "
                      "four fixed random batches"}
    return {"meta": provenance.provenance(command), "config": config, "rows": rows, "ratios": ratios,
            "errors": errors, "wall_s": round(time.perf_counter() - t0, 1)}


def read_overhead(results_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The committed speed part (``OVERHEAD_FILE``'s name in ``results_dir``, relative to the working directory;
    default the repository's), or None when it was not measured."""
    return common.read_part_file(OVERHEAD_FILE, results_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m moelab.studies.attnres_depth overhead [--rounds N] [--window N] [--out PATH]``: the research
    tier's speed part on this machine's GPU (one call of a few minutes), written to ``OVERHEAD_FILE``."""
    import argparse
    import sys

    from moelab.base import repo_root
    from moelab.utils import write_json

    parser = argparse.ArgumentParser(prog="python -m moelab.studies.attnres_depth")
    sub = parser.add_subparsers(dest="what", required=True)
    op = sub.add_parser("overhead", help="each mode's tokens/s and peak memory at both depths, paired rounds")
    op.add_argument("--rounds", type=int, default=7)
    op.add_argument("--window", type=int, default=10)
    op.add_argument("--out", default=None, help=f"the JSON to write (default {OVERHEAD_FILE})")
    raw = list(argv) if argv is not None else sys.argv[1:]
    args = parser.parse_args(raw)
    out = Path(args.out) if args.out else repo_root() / OVERHEAD_FILE
    command = ["python", "-m", "moelab.studies.attnres_depth", "overhead", *common.part_args(raw), "--out",
               common.repo_relative(out, OVERHEAD_FILE)]
    try:
        result = overhead_part(rounds=args.rounds, window=args.window, command=command)
    except ValueError as e:
        parser.error(str(e))
    write_json(out, result)
    for L, modes in result["ratios"].items():
        print(f"{L} layers: " + "; ".join(f"{m} tokens/s {r['median']:.3f}x PreNorm's [{r['min']:.3f}, {r['max']:.3f}]"
                                          + (f", peak memory {r['peak_mem_ratio']:.3f}x" if r["peak_mem_ratio"] else "")
                                          for m, r in modes.items()))
    for name, why in result["errors"].items():
        print(f"{name}: {why[:300]}")
    print(f"wrote {out} ({result['wall_s']} s)")
    return 0


def research_report(summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                    plan_: ResearchPlan = RESEARCH) -> report.Report:
    """The research tier's findings as rules, the question first: does depth pay more with Block AttnRes than
    under PreNorm (the interaction, "not tested" when the precondition fails), the depth gain per mode, Full minus
    Block at the deep depth, Block's cost in tokens/s at the deep depth."""
    import pandas as pd

    lo, hi = plan_.depths
    v = research_verdicts(rows, plan_)
    pre = v["precondition"]
    gains = depth_gains(rows, plan_)
    nb = plan_.blocks(hi)
    found = [report.compare(f"Does extra depth ({lo} -> {hi} layers) pay more with Block AttnRes "
                            f"({plan_.layers_per_block} layers per block) than under PreNorm (depth gain of Block "
                            "minus PreNorm's)",
                            gains["block_attnres"], gains["prenorm"], unit="nats", precondition=pre["reason"])]
    for m in ("prenorm", "block_attnres"):
        d = v["depth_gain"][m]
        answer = {"lower": "depth pays", "higher": "the deeper model ends higher", "within noise": "",
                  "one seed": ""}[d["verdict"]]
        found.append(report.measured(f"Depth gain under {m} (val loss at {hi} minus {lo} layers)",
                                     list(gains[m].values()), answer=answer, unit="nats", signed=True))
    main = _main(rows)
    if "full_attnres" in plan_.modes:
        found.append(report.compare(f"Is Block AttnRes (N={nb}) close to Full at {hi} layers (Full minus Block)",
                                    seed_values(main, "full_attnres", 2 * hi, hi),
                                    seed_values(main, "block_attnres", nb, hi), unit="nats"))
    found.append(block_speed_finding(summary, v, hi))
    table = {}
    for L in plan_.depths:
        cells = {}
        for m in plan_.modes:
            x = seed_values(main, m, _mode_blocks(m, L, plan_), L)
            cells[SHORT[m]] = report.cell(report.mean_interval(list(x.values())), 4, signed=False) if x else "n/a"
        table[f"{L} layers"] = cells
    table["depth gain (deep - shallow)"] = {SHORT[m]: report.cell(report.mean_interval(list(gains[m].values())), 4)
                                            if gains[m] else "n/a" for m in plan_.modes}
    table = pd.DataFrame(table).T
    table.index.name = "val loss (nats/token)"
    picked = pick_lr(sweep_table(rows)) if sweep_table(rows) else {}
    details = [f"Learning rate per mode, picked by the lowest final validation loss of the sweep at {lo} layers "
               f"(seed {plan_.sweep_seed}, one run per lr): " + "; ".join(
                   f"{m} {lr_text(p['lr'])}" + (" (at the edge of the sweep: the optimum may lie beyond it)"
                                                if p["at_edge"] else "") for m, p in picked.items()) + "."]
    for m, d in v["interaction"].items():
        if d["n"]:
            details.append(f"Interaction {m}: depth gain minus PreNorm's {d['mean']:+.4f} nats"
                           + (f" [{d['low']:+.4f}, {d['high']:+.4f}]" if d["low"] is not None else "") + ".")
    for L, d in v["full_minus_block"].items():
        if d["n"]:
            details.append(f"Full minus Block at {L} layers: {d['mean']:+.4f} nats"
                           + (f" [{d['low']:+.4f}, {d['high']:+.4f}]" if d["low"] is not None else "") + ".")
    def run_overhead(m: str, o: Mapping[str, Any]) -> str:
        tok = (f"tokens/s {o['tok_per_s_ratio']:.3f}x" if o["tok_per_s_ratio"]
               else "tokens/s not recorded (its runs shared a GPU: the speed part below times it)")
        return f"{m} {tok}" + (f", peak memory {o['peak_mem_ratio']:.3f}x" if o["peak_mem_ratio"] else "")

    for L, modes in v["overhead"].items():
        details.append(f"Overhead at {L} layers over PreNorm (this study's runs, train.compile="
                       f"{plan_.common.get('train.compile', 'none')}): "
                       + ", ".join(run_overhead(m, o) for m, o in modes.items()) + ".")
    part = summary.get("overhead_part")
    if part:
        for L, modes in part["ratios"].items():
            details.append(f"Speed part at {L} layers (paired rounds, {part['config']['mode']}, "
                           f"{part['config']['B']} x {part['config']['T']} tokens, {part['meta'].get('gpu')}): "
                           + ", ".join(f"{m} tokens/s {r['median']:.3f}x PreNorm's (rounds {r['min']:.3f}-"
                                       f"{r['max']:.3f})" + (f", peak memory {r['peak_mem_ratio']:.3f}x"
                                                              if r.get("peak_mem_ratio") else "")
                                       for m, r in modes.items()) + ".")
        for arm, why in (part.get("errors") or {}).items():
            details.append(f"Speed part: {arm} not timed ({why.split('. ')[0].splitlines()[0][:160]}).")
    bench = summary.get("benchmark_overhead") or {}
    if bench:
        details.append("The committed benchmark (kernels/results/model_h200.json) measured at another setting: "
                       + ", ".join(
            f"{k} tokens/s {b['tok_per_s_ratio']:.3f}x, memory {b['peak_mem_ratio']:.3f}x ({b['setting']})"
            for k, b in bench.items() if b["tok_per_s_ratio"] and b["peak_mem_ratio"]) +
            "; it differs from this study's rows because it ran eagerly (host-bound: AttnRes's extra launches cost "
            "host time there, GPU time here under one CUDA graph), at 12 layers, width 512 with MoE FFNs, 8 x 4096 "
            "tokens; Full AttnRes's extra grows with depth (every read sums all earlier sublayer outputs).")
    tokens = pre["tokens_per_run"]
    epochs = sorted({round(r["epochs"], 3) for r in main if r.get("epochs")})
    if tokens:
        details.append(f"Budget: {', '.join(f'{t:,}' for t in tokens)} tokens per run (" + ", ".join(
            f"{e:.3g}" for e in epochs) + " epochs of the training split), the same at both depths; precondition "
            + ("met" if pre["reason"] is None else f"failed: {pre['reason']}") + ".")
    return report.Report(found, table, details)


def block_speed_finding(summary: Mapping[str, Any], verdicts: Mapping[str, Any], hi: int) -> report.Finding:
    """Block AttnRes's tokens/s over PreNorm's at the deep depth: from the speed part's paired rounds when it was
    measured (:func:`overhead_part`), else from the runs that trained alone (a paired t interval over seeds); "not
    measured" with neither (runs that shared a GPU have no speed)."""
    part = (summary.get("overhead_part") or {}).get("ratios", {}).get(str(hi), {}).get("block")
    if part:
        q = f"Block AttnRes's training speed at {hi} layers (tokens/s over PreNorm's, paired rounds)"
        return report.Finding(q, "measured", answer=(
            f"{part['median']:.3f}x (rounds {part['min']:.3f}-{part['max']:.3f}, {len(part['rounds'])} paired "
            f"rounds; {summary['overhead_part']['meta'].get('gpu')})"))
    iv = verdicts["overhead"].get(str(hi), {}).get("block", {}).get("tok_per_s_interval")
    q = f"Block AttnRes's training speed at {hi} layers (tokens/s over PreNorm's, this study's runs)"
    if not iv:
        return report.Finding(q, "measured", answer=(
            "not measured: the runs shared a GPU (no speed) and no speed part is committed (run `python -m "
            "moelab.studies.attnres_depth overhead` on a GPU)"))
    return report.measured(q, report.Interval(iv["mean"], iv["low"], iv["high"], iv["n"], "t"), unit="times",
                           digits=3)


def research_summary(grid: common.Grid | None, rows: Sequence[Mapping[str, Any]], benchmark: Mapping[str, Any],
                     plan_: ResearchPlan = RESEARCH, meta: Mapping[str, Any] | None = None,
                     overhead: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json`` of the research tier: meta, the factor, the plan, the rows, the sweep's choice, the
    verdicts, the speed part's paired rounds (``overhead``: :func:`overhead_part`'s file, None when not measured)
    and the benchmark's overhead rows beside the study's own."""
    sweep = sweep_table(rows)
    return {
        "meta": dict(meta) if meta is not None else common.study_meta(
            STUDY, "research", grid, plan=plan_.notes, depths=list(plan_.depths), seeds=list(plan_.seeds),
            lrs=list(plan_.lrs), layers_per_block=plan_.layers_per_block,
            # the final call may run where no GPU is (the records trained on one): the runs' own devices decide
            overhead_meaningful=bool(grid and grid.records
                                     and all((r.timing.get("gpus") or 0) > 0 for r in grid.records)),
            gpu_minutes=round(sum(r.timing.get("gpu_minutes") or 0 for r in grid.records), 2) if grid else None),
        # from the committed results (no grid): the arms' factor again from the sweep's choice, as train_research has it
        "factor": {k: dict(v) for k, v in (grid.factor if grid is not None else research_factor(
            {m: p["lr"] for m, p in pick_lr(sweep).items()}, plan_) if sweep else {}).items()},
        "budget": {"rule": "same tokens per run at both depths, same width; the modes differ at one depth only in "
                           "the AttnRes pseudo-queries and key norms; each mode at its own best swept lr",
                   "tokens_per_run": sorted({r["tokens"] for r in rows}),
                   "max_param_excess_at_a_depth": _param_excess(_main(rows))},
        "rows": [dict(r) for r in rows],
        "lr_sweep": {m: {"lr": p["lr"], "at_edge": p["at_edge"],
                         "losses": {lr_text(k): x for k, x in p["losses"].items()}}
                     for m, p in (pick_lr(sweep).items() if sweep else ())},
        **research_verdicts(rows, plan_),
        "overhead_part": ({"ratios": overhead["ratios"], "config": overhead["config"], "errors": overhead["errors"],
                           "meta": {k: overhead["meta"].get(k) for k in ("gpu", "commit", "date", "command")}}
                          if overhead else None),
        "benchmark_overhead": dict(benchmark),
    }


def research_curves_figure(histories: Any, rows: Sequence[Mapping[str, Any]], plan_: ResearchPlan = RESEARCH) -> Any:
    """Validation loss against tokens, one panel per depth, one colour per mode (mean over the main seeds, the
    seeds' range as a band)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=100)
    axes = fig.subplots(1, len(plan_.depths), sharey=True)
    tokens_per_step = int(plan_.common["train.batch_size"]) * int(plan_.common["data.seq_len"])
    main = {(r["arm"], r["seed"]) for r in _main(rows)}
    sweep_main = {(r["arm"], r["seed"]): research_arm(r["residual"], r["n_layers"], None, plan_) for r in rows
                  if r["role"] == "sweep"
                  and (research_arm(r["residual"], r["n_layers"], None, plan_), r["seed"]) in main
                  and any(m["lr"] == r["lr"] and m["residual"] == r["residual"] and m["seed"] == r["seed"]
                          and m["n_layers"] == r["n_layers"] for m in _main(rows))}
    h = histories.dropna(subset=["val/loss"]).copy()
    h["arm"] = [sweep_main.get((a, s), a) for a, s in zip(h["arm"], h["seed"])]
    h = h[[(a, s) in main for a, s in zip(h["arm"], h["seed"])]]
    for ax, L in zip(axes, plan_.depths):
        for m in plan_.modes:
            arm = research_arm(m, L, None, plan_)
            d = h[h.arm == arm].groupby("step")["val/loss"].agg(["mean", "min", "max"])
            if d.empty:
                continue
            x = d.index.to_numpy() * tokens_per_step / 1e6
            ax.plot(x, d["mean"], "-o", ms=3, color=COLORS[m], label=mode_label(m, _mode_blocks(m, L, plan_)))
            ax.fill_between(x, d["min"], d["max"], color=COLORS[m], alpha=0.2)
        ax.set_title(f"{L} layers")
        ax.set_xlabel("training tokens (M)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("validation loss (nats/token)")
    fig.tight_layout()
    return fig


def depth_gain_figure(summary: Mapping[str, Any], plan_: ResearchPlan = RESEARCH) -> Any:
    """Left: depth gain (deep minus shallow val loss) per mode with its 95% t interval; right: each AttnRes mode's
    gain minus PreNorm's (the interaction) with its interval."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.0), dpi=100)
    ax, ax2 = fig.subplots(1, 2)
    for i, (m, d) in enumerate(summary["depth_gain"].items()):
        if d["mean"] is None:
            continue
        err = 0 if d["low"] is None else [[d["mean"] - d["low"]], [d["high"] - d["mean"]]]
        ax.errorbar([i], [d["mean"]], yerr=err, fmt="o", capsize=4, color=COLORS[m])
        ax.plot([i] * len(d["values"]), d["values"], ".", color=COLORS[m], alpha=0.5)
    ax.set_xticks(range(len(summary["depth_gain"])), list(summary["depth_gain"]))
    lo, hi = plan_.depths
    ax.set_ylabel(f"val loss at {hi} minus {lo} layers (nats; < 0: depth pays)")
    ax.set_title("depth gain per mode (paired by seed, 95% t interval)")
    for i, (m, d) in enumerate(summary["interaction"].items()):
        if d["mean"] is None:
            continue
        err = 0 if d["low"] is None else [[d["mean"] - d["low"]], [d["high"] - d["mean"]]]
        ax2.errorbar([i], [d["mean"]], yerr=err, fmt="o", capsize=4, color=COLORS[m])
        ax2.plot([i] * len(d["values"]), d["values"], ".", color=COLORS[m], alpha=0.5)
    ax2.set_xticks(range(len(summary["interaction"])), list(summary["interaction"]))
    ax2.set_ylabel("minus PreNorm's depth gain (nats)")
    ax2.set_title("interaction: < 0, depth pays more than under PreNorm")
    for a in (ax, ax2):
        a.axhline(0, color="k", lw=0.8)
        a.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def lr_sweep_figure(rows: Sequence[Mapping[str, Any]], plan_: ResearchPlan = RESEARCH) -> Any:
    """Final validation loss against the learning rate per mode at the shallow depth (the sweep, one seed); the
    picked lr circled."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4.0), dpi=100)
    ax = fig.subplots()
    sweep = sweep_table(rows)
    picked = pick_lr(sweep) if sweep and all(len(v) == len(plan_.lrs) for v in sweep.values()) else {}
    for m, losses in sweep.items():
        xs = sorted(losses)
        ax.plot(xs, [losses[x] for x in xs], "-o", color=COLORS[m], label=m)
        if m in picked:
            ax.plot([picked[m]["lr"]], [picked[m]["val_loss"]], "o", ms=12, mfc="none", color=COLORS[m])
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (peak, AdamW)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(f"lr sweep at {plan_.depths[0]} layers (seed {plan_.sweep_seed}; circled: carried on)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def research_diag_rows(grid: common.Grid, plan_: ResearchPlan = RESEARCH) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The diagnostics that :func:`research_diagnostics` left in the main runs' records (seed ``sweep_seed``), as
    :func:`collect_diagnostics` returns them: ``(rows, {arm: weight_matrix})``; runs whose diagnostics failed are
    left out."""
    rows: list[dict[str, Any]] = []
    weights: dict[str, torch.Tensor] = {}
    picked = {}
    sweep_rows = research_rows(grid, plan_)
    if sweep_table(sweep_rows):
        picked = {m: p["lr"] for m, p in pick_lr(sweep_table(sweep_rows)).items()}
    for rec in grid.records:
        info = parse_arm(rec.arm)
        if rec.seed != plan_.sweep_seed or not rec.evals or "error" in rec.evals:
            continue
        if info["lr"] is not None and picked.get(info["residual"]) != info["lr"]:
            continue
        arm = research_arm(info["residual"], info["n_layers"], None, plan_)
        e = rec.evals
        for sub in range(2 * info["n_layers"] + 1):
            last = sub == 2 * info["n_layers"]
            rows.append({"residual": info["residual"], "blocks": info["blocks"], "n_layers": info["n_layers"],
                         "arm": arm, "seed": rec.seed, "sublayer": sub, "hidden_rms": float(e["hidden_rms"][sub]),
                         "output_rms": None if last else float(e["output_rms"][sub]),
                         "grad_norm": None if last else float(e["grad_norm"][sub])})
        if e.get("depth_weights"):
            weights[arm] = torch.tensor([[math.nan if x is None else x for x in r] for r in e["depth_weights"]])
    return rows, weights


if __name__ == "__main__":
    raise SystemExit(main())
