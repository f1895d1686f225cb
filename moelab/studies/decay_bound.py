"""Study 1: the lower-bounded decay, where it overflows, what it costs and what it buys.

The measurements the notebook ``nbs/01_decay_bound.py`` calls, in its order:

1. :func:`tile_overflow_table`: the bounded kernel's diagonal 16-token sub-tile
   ``(q e^{G - G_r}) (k e^{G_r - G})^T`` modelled as the kernel forms it (reference row ``G_r`` fixed
   at row ``SUBTILE/2 - 1``, fp32 factors, operands in the precision the kernel picks for the input
   dtype), against an exact fp64 element-wise tile, swept over the bound ``g_min``;
   :func:`kernel_overflow_rows` runs the real Triton op in bounded mode on decays below its bound.
2. A grid of language models that differ only in the gate (``ARMS``: bounded at three bounds,
   softplus), several seeds each (:func:`train`); per trained model the decay against the
   bound and the per-tile cumulative decay (:func:`gate_decay_rows`), and loss by position past the
   training length (:func:`extrapolation_rows`).
3. :func:`fast_forgetting`: a task that needs fast forgetting, where an unbounded gate shows how
   far it goes and a bounded one stops at its bound.
4. Kernel speed, read from the committed ``kernels/results/kda_h200.json`` and ``kda_long_h200.json``
   (``make kda-bench``).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import torch

from moelab.model.config import KDAGate
from moelab.ops.kda.bounds import EXP_LIMIT, G_MIN_FLOOR, SUBTILE
from moelab.studies import common, report

# input dtype -> operand precision of the diagonal sub-tile's products: the forward (``triton_fwd._diag``)
# casts its factors to fp32 whatever the input dtype, so the products are exact fp32 for fp32 inputs
# (``triton_chunk._ieee``) and TF32 otherwise
OPERANDS = {"bf16": "tf32", "fp16": "tf32", "fp32": "fp32"}
REFERENCE_BOUND = -5.0  # K3's bound: the line the softplus arm is measured against
INPUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REF_ROW = SUBTILE // 2 - 1  # the row whose G the backward's diagonal sub-tile shifts by (triton_bwd._kda_bwd_dqkg)
NEAR = 0.05  # a channel is "near" its bound when its most negative g is within 5% of it (decay_stats)


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` rounded to TF32 (10-bit mantissa, round to nearest even), as fp32."""
    bits = x.float().contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def _operand(x: torch.Tensor, operand: str) -> torch.Tensor:
    """fp32 ``x`` rounded to ``operand`` ("bf16" | "tf32" | "fp32"), returned as fp32."""
    if operand == "bf16":
        return x.bfloat16().float()
    return _tf32(x) if operand == "tf32" else x


def factor_exponents(g: torch.Tensor, told: float) -> torch.Tensor:
    """Exponents ``G - ref`` (natural log) of the bounded forward's diagonal sub-tile factors.

    The kernel (``triton_fwd._diag``) shifts G by ``ref = off + SUBTILE/2 * told``: ``off`` is G
    just before the sub-tile and ``told`` the g_min the op was told (``mid`` in triton_chunk), not
    the data; G of row r includes row r's own decay. So a constant decay g puts
    ``(r + 1) g - 8 told`` on row r: ``-8 g`` on row 7 when told = g, but ``16 g - 8 told`` on row 15
    when g is below what the op was told.

    Args:
        g: ``[S, ...]`` one sub-tile's log decay (natural log, <= 0), rows first.
        told: the g_min the op is told (< 0).

    Returns:
        ``[S, ...]`` fp32: the q factor is ``e^{x}``, the k factor ``e^{-x}``.
    """
    return g.float().cumsum(0) - (SUBTILE / 2) * told


def constant_overflow_g(told: float | None = None, limit: float = EXP_LIMIT["fp32"]) -> float:
    """The constant log decay below which the bounded forward's diagonal sub-tile holds a factor
    past ``e^limit`` (fp32's range: the factors are fp32 whatever the input dtype).

    Told ``g_min = told``, the k factor of row 15 holds ``e^{16 |g| - 8 |told|}``; told the decay's
    own value (``told=None``, the promise kept), ``e^{8 |g|}``.
    """
    half = SUBTILE / 2
    if told is None:
        return -limit / half
    if not -limit / half <= told < 0:
        raise ValueError(f"told={told} is not allowed: expected {-limit / half:.3f} <= told < 0 (below it the q "
                         f"factor of row 0, e^(8 |told|), overflows whatever g is)")
    return -(limit + half * abs(told)) / SUBTILE


def kernel_tile(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, told: float, operand: str = "tf32") -> torch.Tensor:
    """Gated scores of one diagonal sub-tile as the bounded Triton forward forms them.

    Args:
        q, k: ``[S, K]`` the sub-tile's queries and keys (fp32).
        g: ``[S, K]`` per-token log decay (natural log, <= 0).
        told: the g_min the op is told: it places the factors' reference (:func:`factor_exponents`).
        operand: precision of the product's operands (``OPERANDS`` of the input dtype).

    Returns:
        ``[S, S]`` fp32 ``A_ij = sum_c q_ic k_jc exp(G_ic - G_jc)`` for ``j <= i``, 0 above the
        diagonal (a select, as in the kernel): the factors ``q e^{x}``, ``k e^{-x}`` are fp32 (inf
        past fp32's range); the product accumulates in fp32.
    """
    x = factor_exponents(g, told)
    qs = _operand(q.float() * x.exp(), operand)
    ks = _operand(k.float() * (-x).exp(), operand)
    A = qs @ ks.T
    S = g.shape[0]
    return torch.where(torch.ones(S, S, dtype=torch.bool).tril(), A, torch.zeros_like(A))


def exact_tile(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """fp64 element-wise reference of :func:`kernel_tile`: ``[S, S]`` lower-triangular."""
    G = g.double().cumsum(0)
    diff = (G[:, None, :] - G[None, :, :]).clamp(max=0)  # masked (i >= j has diff <= 0) before exp
    A = (q.double()[:, None, :] * k.double()[None, :, :] * diff.exp()).sum(-1)
    return A.tril()


def _rms_rel(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(ref - out) / RMS(ref) in fp64; inf when ``out`` has a non-finite entry."""
    if not torch.isfinite(out).all():
        return math.inf
    ref, out = ref.double(), out.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


TILE_G_MINS = (-2, -5, -8, -8.1, -10, -11, -11.1, -12, -16, -24, -32)  # both sides of each overflow, 0.1 apart


def tile_overflow_table(
    g_mins: Iterable[float] = TILE_G_MINS,
    dtypes: Iterable[str] = ("bf16", "fp16", "fp32"),
    tolds: Iterable[float | None] = (REFERENCE_BOUND, None),
    head_dim: int = 64,
    trials: int = 4,
    seed: int = 0,
) -> list[dict]:
    """Sweep :func:`kernel_tile` over the decay's lower end, the input dtype and what the op is told.

    Decays: ``g = g_min`` on every channel of every token (the worst case; ``pattern="constant"``)
    and ``g`` uniform in ``[g_min, 0]`` (``"uniform"``); q, k unit vectors like the layer's
    L2-normalized ones; q, k, g rounded to the input dtype (as the op stores them).

    Args:
        tolds: the g_min the op is told, per sweep: a number (fixed; decays below it break the promise,
            as with the op's check off), or None (each decay's own ``g_min``: the promise kept).

    Returns:
        One row per (dtype, told, pattern, g_min): ``operand``, ``told`` (the g_min the op is told),
        ``told_bound`` (told each decay's own g_min), ``max_exponent`` (largest |exponent| a factor
        holds over the trials, natural log), ``limit`` (ln of fp32's max: the factors are fp32),
        ``finite`` (every trial finite) and ``rel_err`` (worst RMS relative error vs fp64; inf when
        not finite).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for dtype in dtypes:
        rnd = INPUT_DTYPES[dtype]
        for told in tolds:
            for pattern in ("constant", "uniform"):
                for g_min in g_mins:
                    t = float(g_min) if told is None else float(told)
                    worst, finite, span = 0.0, True, 0.0
                    for _ in range(trials):
                        q = torch.nn.functional.normalize(torch.randn(SUBTILE, head_dim, generator=gen), dim=-1)
                        k = torch.nn.functional.normalize(torch.randn(SUBTILE, head_dim, generator=gen), dim=-1)
                        g = (torch.full((SUBTILE, head_dim), float(g_min)) if pattern == "constant"
                             else g_min * torch.rand(SUBTILE, head_dim, generator=gen))
                        q, k, g = (x.to(rnd).float() for x in (q, k, g))
                        span = max(span, factor_exponents(g.double(), t).abs().max().item())
                        err = _rms_rel(exact_tile(q, k, g), kernel_tile(q, k, g, t, OPERANDS[dtype]))
                        finite &= math.isfinite(err)
                        worst = max(worst, err)
                    rows.append({"dtype": dtype, "operand": OPERANDS[dtype], "told": t, "told_bound": told is None,
                                 "pattern": pattern, "g_min": float(g_min), "max_exponent": span,
                                 "limit": EXP_LIMIT["fp32"], "finite": finite, "rel_err": worst})
    return rows


def _told_key(told_bound: bool) -> str:
    return "_told_bound" if told_bound else ""


def safe_bounds(overflow: Any, tol: float = 1e-2) -> dict[str, float]:
    """Most negative swept g_min at which the modelled tile is finite with relative error < ``tol``,
    keyed ``<dtype>_<pattern>`` (the op told a fixed g_min) or ``<dtype>_<pattern>_told_bound`` (told
    each decay's own g_min), and the least negative swept g_min where it is not finite (the key plus
    ``_first_nonfinite``); a key is absent when no swept g_min qualifies."""
    out = {}
    for (d, p, tb), sel in overflow.groupby(["dtype", "pattern", "told_bound"]):
        key = f"{d}_{p}{_told_key(tb)}"
        ok = sel[sel.finite & (sel.rel_err < tol)]
        if len(ok):
            out[key] = float(ok.g_min.min())
        bad = sel[~sel.finite]
        if len(bad):
            out[f"{key}_first_nonfinite"] = float(bad.g_min.max())
    return out


def overflow_text(overflow: Any, kernel_rows: list[dict], dtype: str = "fp32") -> str:
    """One sentence per told case: the predicted constant-decay overflow (:func:`constant_overflow_g`), the
    first non-finite swept g of the modelled sub-tile (``dtype`` inputs) and of the real op."""
    tiles = safe_bounds(overflow)
    syn = [r for r in kernel_rows if r["source"].startswith("synthetic")]
    lines = []
    for tb, sel in overflow.groupby("told_bound"):
        told = None if tb else float(sel.told.iloc[0])
        first = _first_nonfinite([r for r in syn if r["told_bound"] == tb])
        lines.append(
            f"- {_told_label(tb, sel.told.iloc[0])}: a constant decay first overflows below g = "
            f"{constant_overflow_g(told):.3f}; modelled sub-tile ({dtype}) first non-finite at swept g = "
            f"{tiles.get(f'{dtype}_constant{_told_key(tb)}_first_nonfinite', float('nan')):g}; real op "
            f"({syn[0]['dtype'] if syn else 'not run'}) first non-finite at "
            f"{'none swept' if first is None else f'{first:g}'}.")
    return "\n".join(lines)


def _triton_kda():
    """``triton_chunk.chunk_kda``; on a machine without CUDA, in the Triton interpreter.

    The interpreter must be chosen before the kernels are first imported (``@triton.jit`` reads
    ``TRITON_INTERPRET`` then): a clear error when they were imported for a GPU that is absent.
    """
    import sys

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise RuntimeError("Triton was imported without TRITON_INTERPRET=1 on a machine without CUDA: set it "
                               "before anything imports triton (the notebook's first cell does)")
        os.environ["TRITON_INTERPRET"] = "1"
    from moelab.ops.kda.triton_chunk import chunk_kda

    return chunk_kda


def bounded_kernel_rows(gs: Sequence[torch.Tensor], seed: int = 0,
                        told: float | Sequence[float] = REFERENCE_BOUND) -> list[dict[str, Any]]:
    """The real Triton op in bounded mode (told ``g_min = told``, validation off) on each log decay of ``gs``.

    The decays go through one call of the fp32 token recurrence and of the general mode, and one
    bounded call per distinct ``told``, stacked along the batch (a token-by-token reference on a GPU
    is thousands of small kernel launches per call); each gets the same q, k (unit vectors), v and
    beta, drawn from ``seed`` for one decay's shape, so a row is what the decay alone would give.

    Args:
        gs: log decays ``[B, T, H, K]``, all of one shape (may go below ``told``: what the check
            would have refused).
        told: the g_min the op is told, one for all decays or one per decay (may be below
            ``bounds.G_MIN_FLOOR``: what the check would have refused).

    Returns:
        Per decay: ``told``, ``nonfinite`` (share of non-finite entries of o), ``rel_err`` (RMS
        relative error of the finite case vs the fp32 token recurrence, inf otherwise),
        ``rel_err_general`` (the general mode on the same inputs), ``g_min`` of the input, and
        ``dtype`` (bf16 on a GPU; fp32 in the CPU interpreter, whose bf16 products are not faithful:
        the same exponent range).
    """
    import warnings
    from unittest import mock

    import numpy as np

    from moelab.ops.kda.naive import naive_recurrent_kda

    if not gs or len({tuple(g.shape) for g in gs}) != 1:
        raise ValueError(f"gs has shapes {[tuple(g.shape) for g in gs]}: expected one or more decays of one shape")
    n = len(gs)
    tolds = [float(told)] * n if isinstance(told, (int, float)) else [float(t) for t in told]
    if len(tolds) != n:
        raise ValueError(f"told has {len(tolds)} values for {n} decays: expected one, or one per decay")
    chunk_kda = _triton_kda()
    from moelab.ops.kda import triton_chunk

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    B, T, H, K = gs[0].shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    ins = [x.repeat(n, *[1] * (x.dim() - 1)).to(dev, dtype) for x in (q, k, v)]
    ins += [torch.cat(list(gs)).to(dev, dtype), beta.repeat(n, 1, 1).to(dev, dtype)]
    out = torch.empty_like(ins[2])
    # overflow is what is measured here: the interpreter's numpy warnings about it are expected
    with torch.no_grad(), np.errstate(over="ignore", invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref, _ = naive_recurrent_kda(*(x.float() for x in ins))
        for t in dict.fromkeys(tolds):
            sel = torch.tensor([i * B + b for i in range(n) if tolds[i] == t for b in range(B)], device=dev)
            # the op refuses g_min below its floor even unvalidated: lowered here, for the measurement only
            with mock.patch.object(triton_chunk, "G_MIN_FLOOR", min(t, triton_chunk.G_MIN_FLOOR)):
                out[sel] = chunk_kda(*(x[sel] for x in ins), mode="bounded", g_min=t, validate=False)[0]
        gen_out, _ = chunk_kda(*ins, mode="general")
    rows = []
    for i, g in enumerate(gs):
        part = slice(i * B, (i + 1) * B)
        rows.append({"told": tolds[i], "g_min": g.min().item(),
                     "nonfinite": (~torch.isfinite(out[part])).float().mean().item(),
                     "rel_err": _rms_rel(ref[part], out[part].float()),
                     "rel_err_general": _rms_rel(ref[part], gen_out[part].float()),
                     "dtype": str(dtype).replace("torch.", "")})
    return rows


def run_bounded_kernel(g: torch.Tensor, seed: int = 0, told: float = REFERENCE_BOUND) -> dict[str, Any]:
    """:func:`bounded_kernel_rows` of the one log decay ``g [B, T, H, K]``."""
    return bounded_kernel_rows([g], seed, told)[0]


def kernel_overflow_rows(g_mins: Iterable[float], shape: tuple[int, int, int, int], seed: int = 0,
                         tolds: Iterable[float | None] = (REFERENCE_BOUND, None)) -> list[dict]:
    """:func:`bounded_kernel_rows` on synthetic decays: per g_min, constant ``g = g_min`` and uniform in
    ``[g_min, 0]`` over ``shape`` ``(B, T, H, K)``, per entry of ``tolds`` (as in
    :func:`tile_overflow_table`: a fixed g_min told, or None: each decay's own)."""
    gen = torch.Generator().manual_seed(seed)
    g_mins = [float(x) for x in g_mins]
    cases, gs, tell = [], [], []
    for told in tolds:
        for g_min in g_mins:
            for pattern in ("constant", "uniform"):
                gs.append(torch.full(shape, g_min) if pattern == "constant"
                          else g_min * torch.rand(shape, generator=gen))
                cases.append({"source": f"synthetic {pattern}", "pattern": pattern, "bound": g_min,
                              "told_bound": told is None})
                tell.append(g_min if told is None else float(told))
    return [{**case, **row} for case, row in zip(cases, bounded_kernel_rows(gs, seed, tell) if gs else [])]


@torch.no_grad()
def collect_log_decay(model: torch.nn.Module, input_ids: torch.Tensor, on_device: bool = False
                      ) -> dict[str, torch.Tensor]:
    """Log decays ``g [B, T, H, K]`` (fp32, CPU; ``on_device``: where the model computed them) of every KDA
    layer for one forward of ``input_ids``.

    Uses forward pre-hooks on the layers (the model is left unchanged); works on any module that
    contains ``moelab.model.kda.KDALayer`` instances.
    """
    from moelab.model.kda import KDALayer

    found: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, KDALayer):
            def hook(m, args, name=name):
                g = m.log_decay(args[0]).float()
                found[name] = g if on_device else g.cpu()
            hooks.append(mod.register_forward_pre_hook(hook))
    if not hooks:
        raise ValueError("collect_log_decay: the model has no KDA layer (model.pattern has no 'K')")
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return found


def decay_stats(g: torch.Tensor, bound: float, near: float = 0.05) -> dict[str, float]:
    """How a log decay ``g [B, T, H, K]`` sits against a lower ``bound`` (< 0) and the kernel's tile.

    Returns:
        ``g_min``, ``g_mean``; ``frac_channels_near_bound``: share of the H*K channels whose most
        negative g over the B*T tokens is within ``near`` (5%) of the bound (``<= (1 - near) bound``);
        ``frac_entries_near_bound``: the same share over all entries; ``frac_below_bound``;
        ``tile_decay_q50/q99/max``: quantiles of ``-sum g`` over each aligned 16-token sub-tile
        (per tile, head, channel), the cumulative decay one sub-tile spans; ``max_factor_exponent``:
        the largest exponent a factor of the bounded kernel's diagonal sub-tile holds
        in the backward (``|G_i - G_ref|``, reference row ``REF_ROW``; the forward's factors, shifted by
        the told bound, stay within ``8 |bound|`` for ``g >= bound``), against ``ln`` fp32 max = 88.7.
    """
    B, T, H, K = g.shape
    T0 = (T // SUBTILE) * SUBTILE
    if T0 == 0:
        raise ValueError(f"decay_stats: T={T} is shorter than one sub-tile ({SUBTILE} tokens)")
    if not bound < 0:
        raise ValueError(f"decay_stats: bound={bound} is not allowed: expected a number < 0")
    g = g.float()
    line = (1 - near) * bound
    tiles = g[:, :T0].reshape(B, T0 // SUBTILE, SUBTILE, H, K)
    tile_decay = tile_decays(g)
    G = tiles.cumsum(2)
    factor = (G - G[:, :, REF_ROW:REF_ROW + 1]).abs().amax(2)
    q = torch.quantile(tile_decay[:2 ** 24], torch.tensor([0.5, 0.99]))
    return {
        "g_min": g.min().item(),
        "g_mean": g.mean().item(),
        "frac_channels_near_bound": (g.amin((0, 1)) <= line).float().mean().item(),
        "frac_entries_near_bound": (g <= line).float().mean().item(),
        "frac_below_bound": (g < bound).float().mean().item(),
        "tile_decay_q50": q[0].item(), "tile_decay_q99": q[1].item(), "tile_decay_max": tile_decay.max().item(),
        "max_factor_exponent": factor.max().item(),
    }


def tile_decays(g: torch.Tensor) -> torch.Tensor:
    """``-sum g`` over each aligned 16-token sub-tile of ``g [B, T, H, K]`` (a partial last tile left out):
    1-D fp32, one value per (sequence, tile, head, channel)."""
    B, T, H, K = g.shape
    T0 = (T // SUBTILE) * SUBTILE
    return -g[:, :T0].float().reshape(B, T0 // SUBTILE, SUBTILE, H, K).sum(2).flatten()


# --- training: arms that differ only in the gate ----------------------------------------------------

STUDY = "01_decay_bound"
# Every arm sets both keys (the factor studied); softplus ignores g_min.
ARMS = {
    "bounded-5": {"model.kda.gate": "bounded", "model.kda.g_min": -5.0},
    "bounded-2": {"model.kda.gate": "bounded", "model.kda.g_min": -2.0},
    "bounded-1": {"model.kda.gate": "bounded", "model.kda.g_min": -1.0},
    "softplus": {"model.kda.gate": "softplus", "model.kda.g_min": -5.0},
}
# The research tier's dose-response: bounds from K3's -5 down to -0.25, tight enough that the trained decay
# reaches them within one epoch (the gpu look's decays stopped near -0.2 to -0.3 after 3.3M tokens).
RESEARCH_ARMS = {
    **{f"bounded{b:g}": {"model.kda.gate": "bounded", "model.kda.g_min": float(b)} for b in (-0.25, -0.5, -1, -5)},
    "softplus": {"model.kda.gate": "softplus", "model.kda.g_min": -5.0},
}
ARM_OVERRIDES = {**ARMS, **RESEARCH_ARMS}  # every arm name of every preset (one name: one override set)
EXTRAPOLATE = 4  # evaluate at up to 4x the training context (max_seq_len is raised for it in every arm)
# preset -> (training preset, overrides for every arm, seeds, evaluation sizes).
# cpu: a narrower cpu model, seconds per run on 2 shared cores. gpu: gpu-small at 8 x 4096 tokens per
# step; 4 arms x 3 seeds x 100 steps = 39M tokens. Time on one fresh H200 (Triton cache empty), per
# notebook phase, estimated from the cell times of the run at 0d87287 (killed at 549 s, ~11.5 min in
# all) and a gpu-small run (kernels/results/model_h200.json, moelab_gpu_small's train: 200 steps in 40 s):
#   imports 5 s; §1 modelled tile + the op on synthetic decays, mostly compilation: 15 s (was 20 s: one
#   batched call instead of 16, each with a 1024-step token-by-token reference); init check of the 4
#   arms: 16 s;
#   grid: the first run ~70 s (compilation), then ~26 s per run: ~19 s of training, ~5 s of start and
#   tracking, one 1.2 GB checkpoint at the end instead of four (last and best at both validations),
#   ~1 s of evaluate_run in the training process: ~6 min (was 425 s, evaluation not included);
#   decay statistics and loss by position: read from the runs (was 65 s + ~65 s of reloading 12
#   checkpoints and rebuilding the models); tile-decay figure <1 s (was 3.4 s); the op on 27 trained
#   softplus decays: one call, ~2 s; fast forgetting: 12 runs in one batched loop on the GPU, ~5 s (was
#   12 sequential CPU loops, ~1 min); speed, summary, HTML: ~10 s.
#   In all ~7 min (was ~11.5 min).
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"base": "cpu", "seeds": (0, 1, 2),
            "overrides": {"train.max_steps": 30, "train.batch_size": 8, "train.val_every": 15, "train.val_batches": 4,
                          "train.warmup_steps": 5, "data.seq_len": 64, "model.max_seq_len": 64 * EXTRAPOLATE,
                          "model.d_model": 64, "model.kda.head_dim": 32, "model.mla.head_dim": 32,
                          "model.kda.decay_rank": 8},
            "eval_windows": 4, "overflow_shape": (1, 32, 1, 32), "overflow_g_mins": (-5, -8, -8.1, -11, -11.1, -16),
            "forget_steps": 150, "forget_seeds": (0,)},
    "gpu": {"base": "gpu-small", "seeds": (0, 1, 2),
            "overrides": {"train.max_steps": 100, "train.val_every": 50, "train.val_batches": 4,
                          "train.warmup_steps": 10, "model.max_seq_len": 4096 * EXTRAPOLATE,
                          "train.compile": "graphs", **common.FAST_BACKENDS},
            "eval_windows": 4, "overflow_shape": (2, 1024, 4, 128),
            "overflow_g_mins": (-5, -8, -8.1, -10, -11, -11.1, -12, -16, -24), "forget_steps": 300,
            "forget_seeds": (0, 1, 2)},
    # gpu: the captured step (train.compile='graphs'); the softplus arm's general-mode step captured on an H100
    # (session 45, kernels/results/model_capture_h200.json, other_gpus.H100_softplus_graphs): 1.10x eager tokens/s
    # (95% CI 1.04-1.16, 5 paired rounds), train losses within 0.0043 of eager's over 60 steps.
    # research: >= 1 epoch of the 22,646,121-token GPU corpus at 8 x 4096 tokens per step (692 steps), eager
    # (train.compile='none': its 15 records were trained eager before the softplus arm's step was known to capture,
    # and the mode is part of every record's fingerprint: 'graphs' would retrain all of them, ~22 GPU-minutes), the
    # decay monitored every 100 steps on a fixed batch.
    # On one H200 (gpu-small eager ~310K tokens/s, kernels/results/model_capture_h200.json): ~74 s of training
    # per run, + ~5 s start, ~4 s of validation (4 x 16 batches), 8 monitor points (< 1 s each), ~2 s of
    # evaluation: ~85-90 s per run, 15 runs ~22 min; the first run of a call compiles Triton (~60 s).
    "research": {"base": "gpu-small", "seeds": (0, 1, 2), "arms": RESEARCH_ARMS,
                 "overrides": {"train.max_steps": 700, "train.val_every": 175, "train.val_batches": 16,
                               "train.compile": "none", "model.max_seq_len": 4096 * EXTRAPOLATE},
                 "monitor_every": 100, "monitor_windows": 2,
                 "eval_windows": 4, "overflow_shape": (2, 1024, 4, 128),
                 "overflow_g_mins": (*[-5 - 0.25 * i for i in range(29)], -8.05, -8.1, -11.05, -11.1),
                 "forget_steps": 3000, "forget_seeds": (0, 1, 2),
                 # the source every research record was fingerprinted with (the harness pins it, so report-side
                 # commits after the first split call do not retrain the records): keep it while records exist
                 "source_pin": "s1research-1",
                 # softplus seeds whose record keeps its trained log decays (real_g, ~1.2 MB an evals file):
                 # the op's check on 9 trained layers of one model answers "does the real op stay finite on
                 # trained decays"; more seeds of the same gate add size, not a new question
                 "real_g_seeds": (0,)},
}
KERNEL_RESULTS = ("kernels/results/kda_h200.json", "kernels/results/kda_long_h200.json")


def _preset(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed: expected one of {tuple(PRESETS)}")
    return PRESETS[preset]


def arms_of(preset: str) -> dict[str, dict[str, Any]]:
    """The arms ``preset`` trains: ``RESEARCH_ARMS`` for ``research``, else ``ARMS``."""
    return _preset(preset).get("arms", ARMS)


def arms_factor(preset: str) -> dict[str, dict[str, Any]]:
    """``{config key: {arm: value}}``: what differs between the arms (raises if anything but the gate does)."""
    p = _preset(preset)
    return common.check_arms_differ_only(p["base"], arms_of(preset), p["overrides"])


def forgetting_bounds(preset: str) -> dict[str, float | None]:
    """``{arm: g_min}`` of ``preset``'s arms for :func:`fast_forgetting` (None: the softplus gate)."""
    return {arm: (ov["model.kda.g_min"] if ov["model.kda.gate"] == "bounded" else None)
            for arm, ov in arms_of(preset).items()}


def build_arm_models(preset: str, seed: int = 0) -> dict[str, torch.nn.Module]:
    """``{arm: MoELab}`` as each arm's training starts: the resolved config, ``seed_everything(seed)``."""
    import lightning as L

    from moelab.model import MoELab

    p = _preset(preset)
    models = {}
    for arm, cfg in common.resolve_arms(p["base"], arms_of(preset), p["overrides"], seed).items():
        L.seed_everything(seed, verbose=False)
        models[arm] = MoELab(cfg.model)
    return models


def gate_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters that define the gate (per KDA layer: ``A_log`` and ``f_up.bias``, the b of z)."""
    from moelab.model.kda import KDALayer

    return {f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, KDALayer)
            for p in ("A_log", "f_up.bias")}


def train(preset: str, out_dir: Path) -> common.Grid:
    """Train every arm at every seed of ``preset`` (finished runs are reused); see ``PRESETS``.

    The harness calls it for a split call (``RUNS=`` / ``SHARD=``), the notebook's grid cell for a whole one.
    Each run is measured by :func:`evaluate_run` in its training process when it ends (the records'
    ``evals``), and writes one checkpoint, at its end. With a preset's ``monitor_every`` (research),
    :func:`decay_monitor` measures the decay every that many steps during training (the records' ``trajectory``).

    Args:
        out_dir: the study folder; runs go to ``<out_dir>/checkpoints/<arm>-s<seed>``.
    """
    p = _preset(preset)
    evaluate = functools.partial(evaluate_run, eval_windows=p["eval_windows"], real_g_tokens=p["overflow_shape"][1],
                                 real_g_seeds=p.get("real_g_seeds"))
    monitor = (p["monitor_every"], decay_monitor(p["monitor_windows"])) if p.get("monitor_every") else None
    return common.run_grid(STUDY, p["base"], arms_of(preset), p["seeds"], out_dir, common=p["overrides"],
                           evaluate=evaluate, checkpoints="final", monitor=monitor, source_pin=p.get("source_pin"))


def arm_bound(grid: common.Grid, arm: str) -> float:
    """The bound an arm's decay is measured against: its g_min (bounded) or ``REFERENCE_BOUND`` (softplus)."""
    gate = grid.factor.get("model.kda.gate", {}).get(arm, ARM_OVERRIDES[arm]["model.kda.gate"])
    return float(ARM_OVERRIDES[arm]["model.kda.g_min"]) if gate == "bounded" else REFERENCE_BOUND


def _val_windows(cfg: Any, length: int, n: int) -> torch.Tensor:
    """``[n, length + 1]`` int64 contiguous windows of the validation stream, evenly spaced (same for every arm)."""
    import numpy as np

    from moelab.data import prepare

    stream = prepare(cfg.data, progress=False).load_tokens("val").astype(np.int64)
    if stream.size < length + 1:
        raise ValueError(f"the validation split has {stream.size} tokens: fewer than one window of {length + 1}")
    n = min(n, stream.size // (length + 1))
    starts = np.linspace(0, stream.size - length - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([stream[s:s + length + 1] for s in starts]))


TILE_SAMPLE = 5000  # sub-tile decays kept per model and layer for the distribution figure (fp32: 20 KB a layer)
REAL_G_TOKENS = 128  # most tokens of a softplus layer's log decay a record keeps for the kernel check
# Kept in bf16: on gpu-small (9 KDA layers, H=4, K=128) a layer's [1, 128, 4, 128] bf16 is 1/16 of the fp32
# [1, 1024, 4, 128] it replaces, and a softplus record's evals.pt ~1.8 MiB (real_g 1.1 MiB, the tile-decay
# samples 0.7 MiB) instead of ~18 MiB. 128 tokens are two of the op's 64-token chunks, so the check still
# crosses a chunk boundary.


def evaluate_run(model: torch.nn.Module, cfg: Any, eval_windows: int, real_g_tokens: int, decay_windows: int = 2,
                 factor: int = EXTRAPOLATE, bins: int = 16, real_g_seeds: Sequence[int] | None = None
                 ) -> dict[str, Any]:
    """What the study measures on one trained model; ``common.run_grid`` calls it when the training ends.

    Runs on the model's training device under the training's autocast (bf16 on a GPU, none on a
    CPU), so the log decays are the ones the trained model applies and the forward reuses the
    kernels training compiled.

    Args:
        model: the trained ``MoELab`` (eval mode). cfg: its RunConfig.
        eval_windows: validation windows for the loss by position (:func:`loss_by_position`).
        real_g_tokens: tokens of the first decay window a softplus model keeps for the kernel check
            (at most ``REAL_G_TOKENS``, so a run's record stays small enough to carry back from a GPU call).
        decay_windows: validation windows of the training length for the decay statistics.
        real_g_seeds: the seeds whose softplus model keeps ``real_g`` (None: every seed).

    Returns:
        ``decay``: per KDA layer ``{"layer", "bound", **decay_stats}`` against the arm's bound (its
        g_min; ``REFERENCE_BOUND`` for softplus); ``tile_decay``: per layer ``TILE_SAMPLE`` of its
        16-token sub-tile decays (seeded sample); ``real_g``: softplus only, per layer the log decay
        ``[1, min(real_g_tokens, REAL_G_TOKENS), H, K]`` of the first window, rounded to bf16 (the
        kernel check runs the op on these values, so its errors are those of the op on bf16-exact
        decays); ``extrapolation``: :func:`loss_by_position`.
    """
    dev = next(model.parameters()).device
    kda = cfg.model.kda
    bound = float(kda.g_min) if kda.gate == "bounded" else REFERENCE_BOUND
    ids = _val_windows(cfg, cfg.data.seq_len, decay_windows)[:, :-1].to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        decays = collect_log_decay(model, ids)
    gen = torch.Generator().manual_seed(cfg.seed)
    out: dict[str, Any] = {"decay": [], "tile_decay": {}, "real_g": {}}
    for layer, g in decays.items():
        out["decay"].append({"layer": layer, "bound": bound, **decay_stats(g, bound)})
        td = tile_decays(g)
        out["tile_decay"][layer] = td[torch.randperm(td.numel(), generator=gen)[:TILE_SAMPLE]].clone()
        if kda.gate == "softplus" and (real_g_seeds is None or cfg.seed in real_g_seeds):
            out["real_g"][layer] = g[:1, :min(real_g_tokens, REAL_G_TOKENS)].to(torch.bfloat16)
    out["extrapolation"] = loss_by_position(model, cfg, eval_windows, factor, bins)
    return out


# |g| edges of the monitor's decay histogram (natural log per token), the same for every arm: from no decay to
# past K3's bound; the last bin holds everything below -5
DECAY_EDGES = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


def monitor_stats(decays: Mapping[str, torch.Tensor], bound: float, near: float = NEAR) -> dict[str, Any]:
    """The decay against ``bound`` during training, from one forward's log decays (any device).

    Args:
        decays: ``{layer: g [B, T, H, K]}`` (natural log, <= 0), as :func:`collect_log_decay` returns them.
        bound: the arm's bound (< 0; softplus: ``REFERENCE_BOUND``).

    Returns:
        ``bound``, ``g_min`` (over layers), ``frac_channels_near_bound`` (largest share over layers of the
        H*K channels whose most negative g is within ``near`` of the bound: :func:`bound_binds`'s measure),
        ``frac_channels_near_bound_all`` (the share over every layer's channels), ``frac_entries_near_bound``
        (share of all entries), ``g_mean``, ``hist``: share of entries with ``|g|`` in each bin of
        ``DECAY_EDGES`` (one more bin past the last edge), and ``layers``: per layer ``g_min`` and the channel share.
    """
    if not bound < 0:
        raise ValueError(f"monitor_stats: bound={bound} is not allowed: expected a number < 0")
    if not decays:
        raise ValueError("monitor_stats: no log decay given (the model has no KDA layer)")
    line = (1 - near) * bound
    edges = None
    layers, counts, entries, near_entries, near_channels, channels, total = [], 0, 0, 0, 0, 0, 0.0
    for name, g in decays.items():
        g = g.float()
        if edges is None:
            edges = torch.tensor(DECAY_EDGES, device=g.device)
        ch = g.amin((0, 1)) <= line  # [H, K]
        layers.append({"layer": name, "g_min": g.min().item(), "frac_channels_near_bound": ch.float().mean().item()})
        counts = counts + torch.bincount(torch.bucketize(-g.flatten(), edges, right=True) - 1,
                                         minlength=len(DECAY_EDGES))
        entries += g.numel()
        near_entries += int((g <= line).sum().item())
        near_channels += int(ch.sum().item())
        channels += ch.numel()
        total += g.double().sum().item()
    counts = counts.double().cpu()
    return {"bound": float(bound), "g_min": min(r["g_min"] for r in layers),
            "frac_channels_near_bound": max(r["frac_channels_near_bound"] for r in layers),
            "frac_channels_near_bound_all": near_channels / channels, "frac_entries_near_bound": near_entries / entries,
            "g_mean": total / entries, "hist": (counts / counts.sum()).tolist(), "layers": layers}


def decay_monitor(windows: int = 2) -> Any:
    """``fn(model, cfg) -> dict`` for ``run_grid``'s ``monitor``: :func:`monitor_stats` of the model being trained
    on one fixed batch (the first ``windows`` evenly spaced validation windows of the training length, read once
    per process and the same for every arm and step), under the training's autocast (bf16 on a GPU), against
    the arm's bound (softplus: ``REFERENCE_BOUND``)."""
    batch: dict[tuple, torch.Tensor] = {}

    def measure(model: torch.nn.Module, cfg: Any) -> dict[str, Any]:
        dev = next(model.parameters()).device
        key = (cfg.data.source, cfg.data.seq_len, windows)
        if key not in batch:
            batch[key] = _val_windows(cfg, cfg.data.seq_len, windows)[:, :-1]
        kda = cfg.model.kda
        bound = float(kda.g_min) if kda.gate == "bounded" else REFERENCE_BOUND
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            decays = collect_log_decay(model, batch[key].to(dev), on_device=True)
        return monitor_stats(decays, bound)

    return measure


def _evals(rec: common.RunRecord) -> dict[str, Any]:
    if rec.evals is None:
        raise ValueError(f"run {rec.arm}-s{rec.seed} has no evaluation: train it with decay_bound.train")
    return rec.evals


def gate_decay_rows(grid: common.Grid) -> tuple[list[dict], dict[str, Any]]:
    """Per trained model (arm, seed) and KDA layer, :func:`decay_stats` on validation windows of the
    training length against the arm's bound (from :func:`evaluate_run`); and per arm the pooled 16-token
    tile decays (``{arm: 1-D tensor}``, for the distribution figure) and the softplus models' log decays
    (``{"<arm>-s<seed>/<layer>": g}``) for the kernel check."""
    rows, tile_decay, real_g = [], {}, {}
    for rec in grid.records:
        ev = _evals(rec)
        rows += [{"arm": rec.arm, "seed": rec.seed, **r} for r in ev["decay"]]
        tile_decay.setdefault(rec.arm, []).extend(ev["tile_decay"].values())
        real_g.update({f"{rec.arm}-s{rec.seed}/{layer}": g for layer, g in ev["real_g"].items()})
    return rows, {"tile_decay": {a: torch.cat(v) for a, v in tile_decay.items()}, "real_g": real_g}


def real_g_kernel_rows(real_g: Mapping[str, torch.Tensor], max_tokens: int = 256) -> list[dict]:
    """:func:`bounded_kernel_rows` on trained softplus models' log decays (the first ``max_tokens``
    tokens of the first window, as many as the records keep: see :func:`evaluate_run`), one row per
    model and layer, all in one call of the op (in fp32)."""
    gs = [g[:1, :max_tokens].float().contiguous() for g in real_g.values()]
    return [{"source": name, "pattern": "trained softplus", "bound": REFERENCE_BOUND, **row}
            for name, row in zip(real_g, bounded_kernel_rows(gs) if gs else [])]


@torch.no_grad()
def loss_by_position(model: torch.nn.Module, cfg: Any, windows: int, factor: int = EXTRAPOLATE,
                     bins: int = 16) -> list[dict]:
    """Loss by position on ``windows`` validation windows ``factor`` times the training context.

    The model is causal, so evaluating at 1x and 2x the training length reads the first quarter /
    half of the 4x evaluation on the same windows. ``MoELab.prefill`` runs the window in pieces of
    the training length (memory bounded by one piece; the KDA state and MLA cache carry across),
    under bf16 autocast on a GPU.

    Returns:
        One row per position bin: ``pos_lo``, ``pos_hi``, ``rel_pos`` (bin centre / training length)
        and ``loss`` (mean next-token loss, nats/token, over windows and the bin).
    """
    dev = next(model.parameters()).device
    L_train = cfg.data.seq_len
    data = _val_windows(cfg, L_train * factor, windows).to(dev)
    ids, targets = data[:, :-1], data[:, 1:]
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = model.prefill(ids, targets, chunk_size=L_train).token_loss.float().mean(0).cpu()
    width = loss.numel() // bins
    return [{"pos_lo": b * width, "pos_hi": (b + 1) * width, "rel_pos": (b + 0.5) * width / L_train,
             "loss": loss[b * width:(b + 1) * width].mean().item()} for b in range(bins)]


def extrapolation_rows(grid: common.Grid) -> list[dict]:
    """Loss by position per trained model (arm, seed), from :func:`evaluate_run`: :func:`loss_by_position`'s
    rows with ``arm`` and ``seed``."""
    return [{"arm": rec.arm, "seed": rec.seed, **r} for rec in grid.records for r in _evals(rec)["extrapolation"]]


def extrapolation_summary(extra: Any) -> Any:
    """Per (arm, seed): mean loss inside the training length, over 1-2x and over 2-4x of it, and the
    increases ``d_2x = loss(1-2x) - loss(0-1x, second half)`` and ``d_4x = loss(2-4x) - loss(0-1x, second half)``."""
    import pandas as pd

    out = []
    for (arm, seed), sel in extra.groupby(["arm", "seed"], sort=False):
        def mean(lo, hi, sel=sel):
            return sel[(sel.rel_pos > lo) & (sel.rel_pos < hi)].loss.mean()
        inside, late, x2, x4 = mean(0, 1), mean(0.5, 1), mean(1, 2), mean(2, 4)
        out.append({"arm": arm, "seed": seed, "loss_1x": inside, "loss_1x_2nd_half": late, "loss_1_2x": x2,
                    "loss_2_4x": x4, "d_2x": x2 - late, "d_4x": x4 - late})
    return pd.DataFrame(out)


# --- a task that needs fast forgetting -----------------------------------------------------------

def fast_forgetting(bounds: Mapping[str, float | None], steps: int = 200, seeds: Iterable[int] = (0, 1, 2),
                    fast: float = -8.0, slow: float = -0.05, B: int = 8, T: int = 64, H: int = 2,
                    K: int = 16, lr: float = 0.3, device: str | None = None) -> list[dict]:
    """Learn the decay of a KDA op whose targets need fast forgetting, with each gate.

    The targets are the outputs of a KDA recurrence (fresh random unit q, k, values, beta each
    step) whose per-channel decay is ``fast`` on half the channels (a token is forgotten within
    about one step: e^-8 = 3e-4) and ``slow`` on the other half. A student with the same inputs
    learns one gate bias per channel (``z = b``, ``A = 0``, started at ``g = -0.05`` on every
    channel); loss: mean squared error of the outputs. With the bounded gate (``bounds[arm]`` =
    g_min) the fast channels cannot go below g_min; the softplus gate (``None``) can.

    All runs (arms x seeds) train together, stacked along the batch of one op call per step: the
    same numbers as one run at a time, at a fraction of the small-tensor overhead. ``device``: where
    the op runs (default: the GPU if there is one); the random inputs are drawn on the CPU either way.

    Returns:
        One row per (arm, seed): ``final_loss`` (mean of the last 10 steps), ``g_fast_min`` /
        ``g_fast_mean`` (learned decays of the fast channels), ``g_slow_mean``,
        ``frac_fast_near_bound`` (share of fast channels within 5% of the arm's bound;
        ``REFERENCE_BOUND`` for softplus), ``target_fast``, and :func:`plateau` of the loss curve
        (``last20_change``: relative change over the last 20% of the steps; ``last20_converged``: under 1%).
    """
    from moelab.ops.kda import kda, naive_kda_gate

    arms, seeds = list(bounds), list(seeds)
    if not arms or not seeds:
        raise ValueError(f"fast_forgetting: bounds={dict(bounds)} and seeds={seeds} must both be non-empty")
    A, S = len(arms), len(seeds)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    half = torch.arange(H * K, device=dev).view(H, K) % K < K // 2
    g_true = torch.where(half, fast, slow)
    dt = torch.tensor(-slow)
    b0 = [(dt + torch.log(-torch.expm1(-dt))) if bounds[a] is None else torch.logit(dt / -bounds[a]) for a in arms]
    # [A, S, H, K]: one bias per (arm, seed) run
    b = torch.stack(b0)[:, None, None, None].repeat(1, S, H, K).to(dev).requires_grad_()
    opt = torch.optim.Adam([b], lr=lr)  # element-wise: the same as one Adam per (arm, seed)
    gens = [torch.Generator().manual_seed(s) for s in seeds]

    def gates() -> torch.Tensor:
        """``[A, S, H, K]`` learned log decay of every run."""
        rate = torch.zeros(H, device=dev)  # A = 0: rate 1
        return torch.stack([naive_kda_gate(b[i], rate, "softplus" if bounds[a] is None else "bounded", bounds[a])
                            for i, a in enumerate(arms)])

    losses = []
    for _ in range(steps):
        draws = []
        for gen in gens:  # each seed's generator, in the order one run per seed would draw
            q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
            k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
            draws.append((q, k, torch.randn(B, T, H, K, generator=gen), torch.rand(B, T, H, generator=gen)))
        q, k, v, beta = (torch.cat(x).to(dev) for x in zip(*draws))  # [S*B, ...]
        with torch.no_grad():
            target, _ = kda(q, k, v, g_true.expand(S * B, T, H, K), beta, backend="chunk", chunk_size=16)
        g = gates()[:, :, None, None].expand(A, S, B, T, H, K).reshape(A * S * B, T, H, K)
        out, _ = kda(*(x.repeat(A, *[1] * (x.dim() - 1)) for x in (q, k, v)), g, beta.repeat(A, 1, 1),
                     backend="chunk", chunk_size=16)
        err = (out - target.repeat(A, 1, 1, 1)).pow(2).reshape(A, S, -1).mean(-1)  # [A, S]: each run's loss
        opt.zero_grad()
        err.sum().backward()  # a sum of independent runs' losses: each bias gets its own run's gradient
        opt.step()
        losses.append(err.detach())
    curve = torch.stack(losses).cpu()  # [steps, A, S]
    with torch.no_grad():
        g = gates().cpu()
    half = half.cpu()
    rows = []
    for i, arm in enumerate(arms):
        bound = REFERENCE_BOUND if bounds[arm] is None else bounds[arm]
        for j, seed in enumerate(seeds):
            fast_g = g[i, j][half]
            rows.append({"arm": arm, "seed": seed, "bound": bound, "target_fast": fast,
                         "final_loss": curve[-10:, i, j].mean().item(), "first_loss": curve[0, i, j].item(),
                         "g_fast_min": fast_g.min().item(), "g_fast_mean": fast_g.mean().item(),
                         "g_slow_mean": g[i, j][~half].mean().item(),
                         "frac_fast_near_bound": (fast_g <= 0.95 * bound).float().mean().item(),
                         **{f"last20_{k}": v for k, v in plateau(curve[:, i, j].tolist()).items()}})
    return rows


# --- kernel speed ----------------------------------------------------------------------------

def kernel_speed() -> tuple[list[dict], dict[str, Any]]:
    """KDA kernel timings from the committed H200 benchmarks (``make kda-bench`` writes them).

    Returns ``(rows, source)``: the rows of every file in ``KERNEL_RESULTS`` (with ``file``), and
    ``{"files", "gpu", "date", "commit", "commit_how", "same_commit"}``; no rows when none is committed.
    """
    from moelab.base import repo_root

    rows, metas, commits = [], [], []
    for rel in KERNEL_RESULTS:
        path = repo_root() / rel
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        rows += [{**r, "file": rel} for r in data["rows"]]
        metas.append(data.get("meta", {}))
        commits.append(common.measured_commit(path))
    if not metas:
        return [], {"files": list(KERNEL_RESULTS), "gpu": None, "date": None, "commit": None, "commit_how": "missing",
                    "same_commit": None}
    return rows, {"files": list(KERNEL_RESULTS), "gpu": metas[0].get("gpu"), "date": metas[0].get("date"),
                  "commit": commits[0]["commit"], "commit_how": commits[0]["how"],
                  "same_commit": len({c["commit"] for c in commits}) == 1}


def describe_source(source: Mapping[str, Any]) -> str:
    """One line naming the benchmark files, their GPU, date and the commit they measured."""
    if source.get("gpu") is None:
        return f"{', '.join(source['files'])}: not committed yet, no kernel timings"
    same = "both at" if source.get("same_commit") else "NOT all at one commit; the first at"
    return (f"{', '.join(source['files'])}: {source['gpu']}, {str(source['date'])[:10]}, {same} code commit "
            f"{source['commit']} ({source['commit_how']})")


def speed_ratios(rows: list[dict], base: str = "moelab_bounded", key: str = "fwdbwd_ms") -> list[dict]:
    """Per shape and implementation: ``time(impl) / time(base)`` (> 1: the bounded path is faster)."""
    by = {(r["impl"], r["B"], r["T"]): r.get(key) for r in rows}
    out = []
    for (impl, B, T), t in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][0])):
        d = by.get((base, B, T))
        if impl != base and t and d:
            out.append({"impl": impl, "B": B, "T": T, "tokens": B * T, "ratio": t / d})
    return out


def crossover_length(ratios: list[dict], impl: str = "sdpa_flash") -> float | None:
    """Sequence length at which ``impl``'s time equals the bounded KDA path's, interpolated linearly in T
    between the two measured lengths around ratio 1 (attention's time per token grows about linearly
    with T, KDA's stays flat); None when the ratio does not cross 1 in the measured range."""
    pts = sorted((r["T"], r["ratio"]) for r in ratios if r["impl"] == impl)
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:
            return t0 + (1 - r0) * (t1 - t0) / (r1 - r0)
    return None


# --- end-to-end speed where KDA dominates -------------------------------------------------------

SPEED_LENGTHS = ((16384, 2), (32768, 2), (65536, 1))  # (T, B) of the research measurement
SPEED_FILE = "studies/01_decay_bound/results/speed_research.json"


def speed_model_config(gate: str, d_model: int = 1024, n_layers: int = 4, num_heads: int = 16, head_dim: int = 128,
                       vocab_size: int = 8192, g_min: float = REFERENCE_BOUND, max_seq_len: int = 65536,
                       dense_ffn_dim: int = 1024) -> Any:
    """An all-KDA model (no MLA layer, a narrow dense SwiGLU FFN of ``dense_ffn_dim`` in every layer, no MoE) whose
    time goes mostly into the KDA layers (2048 = 16 x 128 channels each at d_model 1024):
    ``ModelConfig`` with ``gate`` ("bounded": the op's bounded path, told ``g_min``; "softplus": its general
    path), ``num_heads`` x ``head_dim`` per layer."""
    from moelab.model.config import KDAConfig, ModelConfig

    return ModelConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, pattern="K", final_mla=False,
                       dense_layers=n_layers, dense_ffn_dim=dense_ffn_dim, max_seq_len=max_seq_len,
                       kda=KDAConfig(num_heads=num_heads, head_dim=head_dim, gate=gate, g_min=g_min)).validate()


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    """One training step on ``ids [B, T + 1]``: forward (bf16 autocast on a GPU), backward, ``opt``."""
    dev = ids.device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        out = model(ids[:, :-1], ids[:, 1:], return_logits=False, check_ids=False)
    (out.loss + out.aux_loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def e2e_speed(lengths: Sequence[tuple[int, int]] = SPEED_LENGTHS, rounds: int = 7, window: int = 3, warmup: int = 2,
              seed: int = 0, device: str | None = None, **model: Any) -> dict[str, Any]:
    """Training tokens/s of an all-KDA model (:func:`speed_model_config`), bounded vs softplus gate, in interleaved
    paired rounds.

    Per ``(T, B)`` of ``lengths``: both arms' models from one seed (the same weights outside the gate), AdamW, one
    random batch ``[B, T]`` of token ids; ``warmup`` untimed steps per arm (Triton compilation, the optimizer's
    state), then ``rounds`` rounds, each timing ``window`` full training steps (forward under bf16 autocast on a
    GPU, backward, AdamW) of each arm, the arm that goes first alternating by round (a drift of the clock or
    the host hits both arms alike). A round's ratio is bounded tokens/s over softplus tokens/s.

    Args:
        lengths: ``(T, B)`` pairs. model: :func:`speed_model_config`'s keywords (d_model, n_layers, ...).
        device: default the GPU if there is one, else the CPU (the torch chunk path: for tests at toy sizes).

    Returns:
        ``{"meta": moelab.provenance.provenance(), "config": {...}, "rows": [{"T", "B", "round", "arm", "first",
        "steps", "seconds", "tok_per_s"}], "ratios": [{"T", "B", "tokens", "median", "min", "max", "rounds":
        [ratio per round], "tok_per_s": {arm: median}}]}``. The file's ratios > 1: the bounded gate trains faster.
    """
    import statistics
    import time

    from moelab import provenance
    from moelab.model import MoELab

    if rounds < 1 or window < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds}, window={window}, warmup={warmup} are not allowed: expected rounds >= 1, "
                         f"window >= 1, warmup >= 0")
    if not lengths or any(T < 1 or B < 1 for T, B in lengths):
        raise ValueError(f"lengths={list(lengths)} is not allowed: expected (T, B) pairs of positive integers")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    arms = get_args(KDAGate)  # ("bounded", "softplus")
    cfgs = {a: speed_model_config(a, max_seq_len=max(T for T, _ in lengths), **model) for a in arms}
    rows, ratios = [], []
    for T, B in lengths:
        models, opts = {}, {}
        for arm in arms:
            torch.manual_seed(seed)
            models[arm] = MoELab(cfgs[arm]).to(dev).train()
            opts[arm] = torch.optim.AdamW(models[arm].parameters(), lr=1e-4, fused=dev.type == "cuda")
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfgs["bounded"].vocab_size, (B, T + 1), generator=gen).to(dev)
        for arm in arms:
            for _ in range(warmup):
                _train_step(models[arm], opts[arm], ids)
        _sync(dev)
        per_round = []
        for r in range(rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            tps = {}
            for arm in order:
                _sync(dev)
                t0 = time.perf_counter()
                for _ in range(window):
                    _train_step(models[arm], opts[arm], ids)
                _sync(dev)
                sec = time.perf_counter() - t0
                tps[arm] = window * B * T / sec
                rows.append({"T": T, "B": B, "round": r, "arm": arm, "first": order[0] == arm, "steps": window,
                             "seconds": sec, "tok_per_s": tps[arm]})
            per_round.append(tps["bounded"] / tps["softplus"])
        ratios.append({"T": T, "B": B, "tokens": B * T, "median": statistics.median(per_round),
                       "min": min(per_round), "max": max(per_round), "rounds": per_round,
                       "tok_per_s": {a: statistics.median(x["tok_per_s"] for x in rows if x["T"] == T and x["arm"] == a)
                                     for a in arms}})
        del models, opts
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    from dataclasses import asdict

    config = {"model": {k: v for k, v in asdict(cfgs["bounded"]).items() if k not in ("kda", "mla", "moe")},
              "kda": {k: v for k, v in asdict(cfgs["bounded"].kda).items() if k != "gate"},
              "gates": list(arms), "lengths": [list(x) for x in lengths], "rounds": rounds, "window": window,
              "warmup": warmup, "seed": seed, "device": dev.type,
              "step": "forward (bf16 autocast on a GPU) + backward + AdamW, one fixed random batch"}
    return {"meta": provenance.provenance(), "config": config, "rows": rows, "ratios": ratios}


def read_speed(path: str | Path = SPEED_FILE) -> dict[str, Any] | None:
    """The committed :func:`e2e_speed` result (a path relative to the repository), or None when not measured."""
    from moelab.base import repo_root

    path = Path(path)
    path = path if path.is_absolute() else repo_root() / path
    return json.loads(path.read_text()) if path.is_file() else None


# --- figures -------------------------------------------------------------------------------

def _figure(w: float, h: float, n: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    return fig, fig.subplots(1, n, squeeze=False)[0]


def _told_label(told_bound: bool, told: float) -> str:
    return "told its own g_min" if told_bound else f"told g_min = {told:g}"


def overflow_figure(rows: list[dict], kernel_rows: list[dict]) -> Any:
    """Left: modelled sub-tile error vs |g_min| per input dtype, decay pattern and what the op is told.
    Right: the real op in bounded mode (relative error of o, non-finite shown at 1). Vertical lines:
    :func:`constant_overflow_g` of each told case."""
    fig, (ax, bx) = _figure(11, 4.2, 2)
    keys = sorted({(r["told_bound"], r["dtype"], r["pattern"]) for r in rows})
    for i, (tb, dt, pat) in enumerate(keys):
        sel = sorted((r for r in rows if (r["told_bound"], r["dtype"], r["pattern"]) == (tb, dt, pat)),
                     key=lambda r: -r["g_min"])
        ax.semilogy([-r["g_min"] for r in sel], [r["rel_err"] if r["finite"] else float("nan") for r in sel],
                    "-" if pat == "constant" else "--", color=f"C{i // 2}", marker="o", ms=3,
                    label=f"{_told_label(tb, sel[0]['told'])}, {dt} ({sel[0]['operand']}), {pat} g")
    ax.set(xlabel="|g_min| of the decay", ylabel="relative error (gaps: inf/NaN)", title="modelled diagonal sub-tile")
    syn = [r for r in kernel_rows if r["source"].startswith("synthetic")]
    for i, tb in enumerate(sorted({r["told_bound"] for r in syn})):
        for pat, marker in (("constant", "o"), ("uniform", "s")):
            sel = sorted((r for r in syn if r["pattern"] == pat and r["told_bound"] == tb), key=lambda r: -r["bound"])
            xs = [-r["bound"] for r in sel]
            bx.semilogy(xs, [r["rel_err"] if math.isfinite(r["rel_err"]) else float("nan") for r in sel],
                        marker=marker, color=f"C{i}", ls="-" if pat == "constant" else "--",
                        label=f"bounded mode, {_told_label(tb, sel[0]['told'])}, {pat} g")
            bad = [x for x, r in zip(xs, sel) if r["nonfinite"] > 0]
            bx.plot(bad, [1.0] * len(bad), "x", color=f"C{i}", ms=8)
        bx.semilogy(xs, [r["rel_err_general"] for r in sel], ":", color="gray",
                    label="general mode" if i == 0 else None)
    for a in (ax, bx):
        for told in sorted({r["told"] for r in rows if not r["told_bound"]}):
            a.axvline(-constant_overflow_g(told), color="k", lw=0.8, alpha=0.5, ls="--")
        a.axvline(-constant_overflow_g(), color="k", lw=0.8, alpha=0.5)
        a.grid(alpha=0.3)
        a.legend(fontsize=5)
    bx.set(xlabel="|g_min| of the input decay (x: non-finite output)", ylabel="rel. error of o vs fp32 recurrence",
           title=f"real Triton op ({syn[0]['dtype'] if syn else ''})")
    fig.tight_layout()
    return fig


def tile_decay_figure(tile_decay: Mapping[str, torch.Tensor]) -> Any:
    """Distribution (1 - CDF, log x) of the cumulative decay ``-sum g`` over 16-token sub-tiles, per arm.

    Drawn through 2000 evenly spaced ranks of each arm's sorted values, the largest included (a line
    through every one of the ~10^5-10^6 values per arm looks the same and takes seconds to draw)."""
    fig, (ax,) = _figure(6.4, 4)
    colors = report.palette(list(ARM_OVERRIDES))
    for arm, td in tile_decay.items():
        x = td.sort().values.clamp(min=1e-6)
        rank = torch.linspace(0, len(x) - 1, min(len(x), 2000)).round().long()
        ax.loglog(x[rank].numpy(), (1 - rank / len(x)).numpy() + 1e-9, label=arm, color=colors.get(arm))
    ax.axvline(EXP_LIMIT["fp32"] * 2, color="k", lw=0.8, alpha=0.5)
    ax.set(xlabel="cumulative decay over a 16-token sub-tile, -sum g (nats)", ylabel="share of tiles above",
           title="trained models, validation windows")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def extrapolation_figure(extra: Any, reference: str = "softplus") -> Any:
    """Loss by position (x: position / training length) of each arm minus ``reference``, paired by seed:
    mean over seeds and its 95% t band (``report.step_differences`` over position bins)."""
    fig, (ax,) = _figure(6.4, 4)
    colors = report.palette(list(ARM_OVERRIDES))
    diffs = report.step_differences(extra.rename(columns={"rel_pos": "step"}), reference, "loss")
    for arm, d in diffs.items():
        ax.plot(d["step"], d["mean"], marker="o", ms=3, color=colors[arm], label=f"{arm} ({d['n']} seeds)")
        ax.fill_between(d["step"], d["low"], d["high"], color=colors[arm], alpha=0.18, lw=0)
    ax.axhline(0.0, color="k", lw=0.8)
    for x in (1, 2):
        ax.axvline(x, color="k", lw=0.8, alpha=0.5, ls=":")
    ax.set(xlabel="position / training context", ylabel=f"loss minus {reference} (nats/token)",
           title=f"NoPE length extrapolation: each arm minus {reference}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def speed_figure(ratios: list[dict], source: Mapping[str, Any], crossover: float | None) -> Any:
    """Forward+backward time of each implementation over the bounded path's, vs sequence length (linear y)."""
    fig, (ax,) = _figure(7, 4)
    for impl in dict.fromkeys(r["impl"] for r in ratios if r["impl"] != "sdpa_flash"):
        sel = [r for r in ratios if r["impl"] == impl]
        ax.plot([r["T"] for r in sel], [r["ratio"] for r in sel], marker="o", label=f"{impl} / moelab_bounded")
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="sequence length T (B*T ~ 32K-131K tokens per call)", ylabel="time ratio (fwd+bwd)",
           title=f"{source.get('gpu')}, code at {source.get('commit')}")
    sd = [r for r in ratios if r["impl"] == "sdpa_flash"]
    if sd:
        bx = ax.twinx()
        bx.plot([r["T"] for r in sd], [r["ratio"] for r in sd], "k--", marker="s", label="sdpa_flash / moelab_bounded")
        bx.set_ylabel("sdpa_flash / moelab_bounded (dashed)")
        if crossover:
            bx.axvline(crossover, color="r", lw=0.8)
        bx.legend(fontsize=7, loc="upper right")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# --- summary and findings ------------------------------------------------------------------------

def _ms(values: Any) -> dict[str, float | None]:
    """``{"mean", "std", "n"}`` of a sequence (std over seeds, ddof=1; None for one value)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {"mean": mean, "std": std, "n": len(vals)}


def _first_nonfinite(rows: list[dict], pattern: str = "constant") -> float | None:
    """The least negative swept bound at which the op's output of ``pattern`` decays is non-finite."""
    return max((r["bound"] for r in rows if r["pattern"] == pattern and r["nonfinite"] > 0), default=None)


def summarize(overflow: Any, kernel_rows: list[dict], grid: common.Grid, decay: Any, extra_summary: Any,
              forgetting: Any, ratios: list[dict], speed_source: Mapping[str, Any], preset: str) -> dict[str, Any]:
    """The study's ``summary.json``: the meta block, then the numbers the findings are computed from.

    Per-model statistics are first reduced over layers (the extreme layer), then given as mean and
    standard deviation over seeds.
    """
    table = grid.table()
    per_model = decay.groupby(["arm", "seed"]).agg(
        g_min=("g_min", "min"), frac_channels_near_bound=("frac_channels_near_bound", "max"),
        frac_entries_near_bound=("frac_entries_near_bound", "max"), tile_decay_q99=("tile_decay_q99", "max"),
        tile_decay_max=("tile_decay_max", "max"), max_factor_exponent=("max_factor_exponent", "max")).reset_index()
    arms = {}
    for arm in dict.fromkeys(table.arm):
        t, d = table[table.arm == arm], per_model[per_model.arm == arm]
        e, f = extra_summary[extra_summary.arm == arm], forgetting[forgetting.arm == arm]
        arms[arm] = {
            "gate": ARM_OVERRIDES[arm]["model.kda.gate"], "bound": arm_bound(grid, arm),
            "seeds": [int(s) for s in t.seed],
            **{m: _ms(t[m]) for m in ("best_val_loss", "final_val_loss", "final_train_loss", "train_val_gap")},
            "steps": int(t.steps.max()), "tok_per_s": float(t.tok_per_s.mean()),
            **{m: _ms(d[m]) for m in ("g_min", "frac_channels_near_bound", "frac_entries_near_bound", "tile_decay_q99",
                                      "tile_decay_max", "max_factor_exponent")},
            **{f"extrapolation_{m}": _ms(e[m]) for m in ("loss_1x", "loss_1_2x", "loss_2_4x", "d_2x", "d_4x")},
            **{f"forgetting_{m}": _ms(f[m]) for m in ("final_loss", "g_fast_min", "frac_fast_near_bound")},
            "run_ids": list(t.run_id),
        }
    real = [r for r in kernel_rows if not r["source"].startswith("synthetic")]
    syn = [r for r in kernel_rows if r["source"].startswith("synthetic")]
    fixed = [r for r in syn if not r["told_bound"]]
    own = [r for r in syn if r["told_bound"]]
    general = [r for r in ratios if r["impl"] == "moelab_general"]
    return {
        "meta": common.study_meta(STUDY, preset, grid, kernel_results=dict(speed_source)),
        "factor": {k: dict(v) for k, v in grid.factor.items()},
        "modelled_tile": safe_bounds(overflow),
        "kernel_overflow": {
            "dtype": kernel_rows[0]["dtype"] if kernel_rows else None,
            "synthetic": syn,
            "told": fixed[0]["told"] if fixed else None,
            "first_nonfinite_bound": _first_nonfinite(fixed),
            "first_nonfinite_bound_told_bound": _first_nonfinite(own),
            "predicted_constant": constant_overflow_g(fixed[0]["told"]) if fixed else None,
            "predicted_constant_told_bound": constant_overflow_g(),
            "op_floor": G_MIN_FLOOR,
            "worst_finite_rel_err_at_or_above_-5": max((r["rel_err"] for r in syn if r["bound"] >= REFERENCE_BOUND),
                                                       default=None),
            "real_softplus": {"layers": len(real), "g_min": min((r["g_min"] for r in real), default=None),
                              "layers_nonfinite": sum(r["nonfinite"] > 0 for r in real),
                              "layers_rel_err_over_1pct": sum(r["rel_err"] > 1e-2 for r in real),
                              "worst_rel_err_general": max((r["rel_err_general"] for r in real), default=None)},
        },
        "arms": arms,
        "speed": {"ratios": ratios, "crossover_T_sdpa_flash": crossover_length(ratios),
                  "general_over_bounded": [r["ratio"] for r in general]},
    }



def bound_binds(decay: Any) -> dict[str, Any]:
    """Study 1's precondition: does any trained model's decay come near its bound?

    ``decay``: :func:`gate_decay_rows`'s table (arm, seed, layer, ``frac_channels_near_bound``, ``g_min``).
    Returns ``{"binds", "share" (largest per-arm mean over seeds of the largest per-layer share),
    "g_min" ({arm: per-seed most negative g}), "reason"}``.
    """
    per_model = decay.groupby(["arm", "seed"], sort=False).agg(
        near=("frac_channels_near_bound", "max"), g_min=("g_min", "min")).reset_index()
    share = per_model.groupby("arm", sort=False).near.mean()
    binds = bool((share > 0).any())
    deepest = per_model.loc[per_model.g_min.idxmin()]
    tightest = max(float(ARM_OVERRIDES[a]["model.kda.g_min"]) for a in share.index
                   if ARM_OVERRIDES[a]["model.kda.gate"] == "bounded")
    reason = None if binds else (
        f"the bound never binds: no trained channel came within {NEAR:.0%} of its bound (most negative g "
        f"{deepest.g_min:.2f}, tightest bound {tightest:g})")
    return {"binds": binds, "share": float(share.max()), "per_model": per_model, "reason": reason}


def binds_by_arm(decay: Any, reference: str = "softplus") -> dict[str, dict[str, Any]]:
    """Per bounded arm: does its trained decay reach its bound (the research tier's precondition, bound by bound)?

    ``decay``: :func:`gate_decay_rows`'s table (arm, seed, layer, ``frac_channels_near_bound``, ``g_min``,
    ``bound``). Returns ``{arm: {"bound", "share" (mean over seeds of the largest per-layer share of channels
    within ``NEAR`` of the bound), "g_min" (per seed), "binds" (share > 0), "reason" (None when it binds)}}``.
    """
    per_model = decay.groupby(["arm", "seed"], sort=False).agg(
        near=("frac_channels_near_bound", "max"), g_min=("g_min", "min"), bound=("bound", "first")).reset_index()
    out = {}
    for arm, sel in per_model.groupby("arm", sort=False):
        if arm == reference:
            continue
        share, bound = float(sel.near.mean()), float(sel.bound.iloc[0])
        out[arm] = {"bound": bound, "share": share, "g_min": dict(zip(sel.seed.tolist(), sel.g_min.tolist())),
                    "binds": share > 0,
                    "reason": None if share > 0 else (
                        f"the bound {bound:g} never binds: no trained channel came within {NEAR:.0%} of it (most "
                        f"negative g {sel.g_min.min():.2f})")}
    return out


def cost_findings(runs: Any, decay: Any, reference: str = "softplus", metric: str = "best_val_loss"
                  ) -> list[report.Finding]:
    """The research tier's dose-response: per bounded arm, its val loss minus ``reference``'s, paired by seed with a
    95% t interval (``report.compare``), "not tested" where that arm's bound never binds (:func:`binds_by_arm`),
    tightest bound first; with one common seed a measured difference without an interval (no verdict)."""
    ref = report.by_seed(runs, reference, metric)
    return [_paired_finding(f"What does the bound {b['bound']:g} cost in val loss ({arm} minus {reference})",
                            report.by_seed(runs, arm, metric), ref, unit="nats", precondition=b["reason"])
            for arm, b in cost_arms(decay, reference).items()]


def cost_arms(decay: Any, reference: str = "softplus") -> dict[str, dict[str, Any]]:
    """:func:`binds_by_arm`, tightest bound first (the order of :func:`cost_findings`)."""
    return dict(sorted(binds_by_arm(decay, reference).items(), key=lambda kv: -kv[1]["bound"]))


def binds_finding(decay: Any, reference: str = "softplus") -> report.Finding:
    """The precondition as the first finding: the share of channels at the bound per bounded arm."""
    binds = binds_by_arm(decay, reference)
    tight = [a for a, b in binds.items() if b["binds"]]
    parts = "; ".join(f"{a} {b['share']:.1%} (min g {min(b['g_min'].values()):.2f})" for a, b in
                      sorted(binds.items(), key=lambda kv: -kv[1]["bound"]))
    return report.Finding("Does the trained decay reach its bound (share of channels within 5%, mean over seeds)",
                          "measured", answer=(f"{'binds in ' + ', '.join(tight) if tight else 'never binds'}: "
                                              f"{parts}"))


def plateau(curve: Sequence[float], tail: float = 0.2, tol: float = 0.01) -> dict[str, Any]:
    """Whether a loss curve has converged: the relative change between the mean of the first and the second half
    of its last ``tail`` share of steps (``change``), and ``converged`` (``|change| < tol``)."""
    n = max(2, int(round(len(curve) * tail)))
    if len(curve) < n:
        raise ValueError(f"plateau: a curve of {len(curve)} points is too short: expected >= {n}")
    last = [float(v) for v in curve[-n:]]
    a, b = sum(last[:n // 2]) / (n // 2), sum(last[n // 2:]) / (n - n // 2)
    change = (b - a) / a if a else math.inf
    return {"change": change, "converged": abs(change) < tol}


def study_report(summary: Mapping[str, Any], runs: Any, decay: Any, extra_summary: Any, forgetting: Any,
                 reference: str = "softplus", main: str = "bounded-5") -> report.Report:
    """The findings as rules (``moelab.studies.report``): what the bound costs (only where it binds), whether
    it binds, what it buys (overflow, speed), fast forgetting and extrapolation; intervals over paired seeds.

    ``runs``, ``decay``, ``extra_summary``, ``forgetting``: the per-seed tables the notebook writes to
    ``results/`` (runs.csv, trained_decay_stats.csv, extrapolation_summary.csv, fast_forgetting.csv).
    """
    bind = bound_binds(decay)
    ko = summary["kernel_overflow"]
    real = ko["real_softplus"]
    arms = [a for a in dict.fromkeys(runs.arm)]
    val = {a: report.by_seed(runs, a, "best_val_loss") for a in arms}
    cost = report.compare(f"What does the bound cost in val loss ({main} minus {reference})", val[main],
                          val[reference], unit="nats", precondition=bind["reason"])
    g_deep = bind["per_model"]
    deepest = {a: g_deep[g_deep.arm == a].g_min.tolist() for a in arms}
    tightest = max((a for a in arms if a != reference), key=lambda a: summary["arms"][a]["bound"])
    reach = report.measured(
        "Does the trained decay reach its bound",
        deepest[tightest], answer=(f"{'reached' if bind['binds'] else 'never reached'}: largest share of channels "
                                   f"within "
                                   f"{NEAR:.0%} of the bound {bind['share']:.1%}; most negative g of {tightest} "
                                   f"(bound {summary['arms'][tightest]['bound']:g})"), digits=2)
    overflow = report.Finding(
        "Does the bound keep the bf16 kernel finite", "measured",
        answer=(f"for decays inside -5 the op's error is at most {ko['worst_finite_rel_err_at_or_above_-5']:.1e}; "
                f"told g_min = {ko['told']:g}, it is first non-finite at g = {ko['first_nonfinite_bound']} "
                f"(predicted {ko['predicted_constant']:.2f}); the {real['layers']} trained softplus layers (min g "
                f"{real['g_min']:.2f}) run non-finite in {real['layers_nonfinite']}"))
    ratios = summary["speed"]["general_over_bounded"]
    src = summary["meta"].get("kernel_results", {})
    speed = report.Finding(
        "What does the bound buy in kernel speed", "measured",
        answer=(f"the general path takes {min(ratios):.2f}-{max(ratios):.2f}x the bounded path's forward+backward "
                f"time over {len(ratios)} lengths ({src.get('gpu')}, one timing each: no seed interval)")
        if ratios else "no committed kernel benchmark")
    fast = {a: {s: math.log10(v) for s, v in report.by_seed(forgetting, a, "final_loss").items()} for a in arms}
    tight_fast = report.compare(f"Does a tight bound hurt a task that needs fast forgetting ({tightest} minus "
                                f"{reference}, log10 final loss)", fast[tightest], fast[reference], unit="log10",
                                digits=2)
    d4 = {a: report.by_seed(extra_summary, a, "d_4x") for a in arms}
    extra = report.compare(f"Does the bound change NoPE extrapolation ({main} minus {reference}, loss increase "
                           f"at 2-4x the training context)", d4[main], d4[reference], unit="nats")
    rows = {}
    for a in arms:
        rows[a] = {"bound": summary["arms"][a]["bound"] if a != reference else "none (measured against -5)",
                   "val loss": report.cell(report.mean_interval(list(val[a].values())), 3, signed=False),
                   f"minus {reference}": "" if a == reference else report.cell(report.paired(val[a], val[reference])),
                   "share near bound": f"{g_deep[g_deep.arm == a].near.mean():.1%}",
                   "min g": report.cell(report.mean_interval(deepest[a]), 2),
                   "4x loss increase": report.cell(report.mean_interval(list(d4[a].values())))}
    import pandas as pd
    table = pd.DataFrame(rows).T
    table.index.name = "arm"
    meta = summary["meta"]
    details = [
        f"Overflow (modelled sub-tile, bf16 inputs): finite within 1% down to g = "
        f"{summary['modelled_tile'].get('bf16_constant', float('nan')):g}; told each decay's own g_min the factors "
        f"hold e^(8|g|), which overflows below {ko['predicted_constant_told_bound']:.2f}; the op's floor g_min >= "
        f"{ko['op_floor']:.2f} keeps {ko['predicted_constant_told_bound'] / ko['op_floor']:.1f}x of margin.",
        "Fast forgetting (targets at g = -8 on half the channels): learned fast-channel g per arm "
        + "; ".join(f"{a} {report.cell(report.mean_interval(forgetting[forgetting.arm == a].g_fast_min), 2)}"
                    for a in arms) + ".",
    ]
    if ratios and summary["speed"].get("crossover_T_sdpa_flash"):
        details.append(f"Bounded KDA overtakes flash attention (SDPA) at T = "
                       f"{summary['speed']['crossover_T_sdpa_flash']:,.0f} (interpolated; code at "
                       f"{src.get('commit')}).")
    if meta.get("epochs") is not None:
        details.append(f"Data: {meta['tokens_per_run']:,} tokens per run, {meta['epochs']:.2f} epochs of the "
                       f"{meta['corpus_train_tokens']:,}-token training split, {runs.steps.max()} steps.")
    return report.Report([cost, reach, overflow, speed, tight_fast, extra], table, details)


def findings(rep: report.Report) -> str:
    """The findings section (markdown) of :func:`study_report`."""
    return rep.markdown()


# --- research tier: the standalone GPU parts and the report that reads them ------------------------------------
# Every GPU-bound measurement of the research tier is its own command writing one raw JSON into RESULTS_DIR; the
# report (``make study-1 PRESET=research`` once every record is committed) only reads the records and these files
# and runs on a CPU. A part whose file is missing is reported as not measured.

RESULTS_DIR = "studies/01_decay_bound/results"
RECORDS_DIR = "studies/01_decay_bound/records/research"
OVERFLOW_FILE = f"{RESULTS_DIR}/overflow_research.json"
FORGETTING_FILE = f"{RESULTS_DIR}/forgetting_research.json"
RESEARCH_FILES = {"speed": SPEED_FILE, "overflow": OVERFLOW_FILE, "forgetting": FORGETTING_FILE}
PART_COMMANDS = {part: f"python -m moelab.studies.decay_bound {part} --out {path}"
                 for part, path in RESEARCH_FILES.items()}


def part_command(part: str, out: str | Path, args: Sequence[str] = ()) -> list[str]:
    """The command line a part's result file records: ``python -m moelab.studies.decay_bound <part> [args] --out
    <its path in the repository>`` (``RESEARCH_FILES[part]`` when ``out`` lies outside the repository)."""
    if part not in RESEARCH_FILES:
        raise ValueError(f"part={part!r} is not allowed: expected one of {tuple(RESEARCH_FILES)}")
    return ["python", "-m", "moelab.studies.decay_bound", part, *args, "--out",
            common.repo_relative(out, RESEARCH_FILES[part])]


def softplus_real_g(records_dir: str | Path, preset: str = "research") -> dict[str, torch.Tensor]:
    """The trained softplus log decays the records keep (``evals["real_g"]``; the research preset keeps seed 0's:
    ``PRESETS["research"]["real_g_seeds"]``): ``{"<arm>-s<seed>/<layer>": g [1, T, H, K] bf16}``, grid order."""
    p = _preset(preset)
    out: dict[str, torch.Tensor] = {}
    for arm, ov in arms_of(preset).items():
        if ov["model.kda.gate"] != "softplus":
            continue
        for seed in p["seeds"]:
            path = common.record_path(records_dir, arm, seed).with_suffix(".evals.pt")
            if path.is_file():
                ev = torch.load(path, weights_only=True)
                out.update({f"{arm}-s{seed}/{layer}": g for layer, g in ev.get("real_g", {}).items()})
    return out


def overflow_part(preset: str = "research", records_dir: str | Path = RECORDS_DIR,
                  shape: tuple[int, int, int, int] | None = None, g_mins: Sequence[float] | None = None,
                  real_tokens: int | None = None, command: Sequence[str] | None = None) -> dict[str, Any]:
    """The real Triton op's error vs the decay, on a GPU (bf16): :func:`kernel_overflow_rows` over ``preset``'s
    ``overflow_g_mins`` at its ``overflow_shape`` (told -5 and told each decay's own g_min), and
    :func:`real_g_kernel_rows` on the trained softplus decays of ``records_dir`` (first ``real_tokens`` tokens).

    Returns:
        ``{"meta": provenance (``command``), "config": {...}, "synthetic": rows, "trained": rows, "wall_s"}``;
        a row's ``rel_err`` is inf (null in the file) where the output is not finite.
    """
    import time

    from moelab import provenance

    p = _preset(preset)
    t0 = time.perf_counter()
    shape = tuple(shape or p["overflow_shape"])
    g_mins = [float(g) for g in (g_mins or p["overflow_g_mins"])]
    real_g = softplus_real_g(records_dir, preset)
    tokens = min(real_tokens or shape[1], REAL_G_TOKENS)
    synthetic = kernel_overflow_rows(g_mins, shape)  # type: ignore[arg-type]
    trained = real_g_kernel_rows(real_g, max_tokens=tokens)
    return {"meta": provenance.provenance(command),
            "config": {"preset": preset, "shape": list(shape), "g_mins": g_mins, "tolds": [REFERENCE_BOUND, "own"],
                       "records": common.repo_relative(records_dir, RECORDS_DIR), "real_g": sorted(real_g),
                       "real_tokens": tokens, "reference": "fp32 token recurrence (naive_recurrent_kda)"},
            "synthetic": synthetic, "trained": trained, "wall_s": round(time.perf_counter() - t0, 1)}


def forgetting_part(preset: str = "research", steps: int | None = None, seeds: Sequence[int] | None = None,
                    command: Sequence[str] | None = None) -> dict[str, Any]:
    """:func:`fast_forgetting` for every arm of ``preset`` (``forget_steps`` steps, ``forget_seeds``), with each
    run's plateau flags. Returns ``{"meta", "config", "rows", "wall_s"}``."""
    import time

    from moelab import provenance

    p = _preset(preset)
    t0 = time.perf_counter()
    steps = int(steps or p["forget_steps"])
    seeds = [int(s) for s in (seeds if seeds is not None else p["forget_seeds"])]
    bounds = forgetting_bounds(preset)
    rows = fast_forgetting(bounds, steps=steps, seeds=seeds)
    return {"meta": provenance.provenance(command),
            "config": {"preset": preset, "bounds": bounds, "steps": steps, "seeds": seeds, "target_fast": -8.0,
                       "converged": "plateau: the mean loss over the last 10% of steps within 1% of the 10% "
                                    "before it"},
            "rows": rows, "wall_s": round(time.perf_counter() - t0, 1)}


def read_part(part: str, results_dir: str | Path | None = None) -> dict[str, Any] | None:
    """A part's committed result file (``RESEARCH_FILES[part]``'s name in ``results_dir``, relative to the working
    directory; default the committed results folder), inf restored where the file holds null for a non-finite
    error; None when not measured."""
    if part not in RESEARCH_FILES:
        raise ValueError(f"part={part!r} is not allowed: expected one of {tuple(RESEARCH_FILES)}")
    data = common.read_part_file(RESEARCH_FILES[part], results_dir)
    for key in ("synthetic", "trained"):
        for r in (data or {}).get(key, []):
            for k in ("rel_err", "rel_err_general"):
                if r.get(k) is None:
                    r[k] = math.inf
    return data


def research_parts(results_dir: str | Path | None = None) -> dict[str, dict[str, Any] | None]:
    """``{part: read_part(part) or None}`` for every standalone part (speed, overflow, forgetting)."""
    return {part: read_part(part, results_dir) for part in RESEARCH_FILES}


def not_measured(part: str) -> str:
    return f"not measured: no {Path(RESEARCH_FILES[part]).name} (run `{PART_COMMANDS[part]}` on a GPU)"


# --- research tier: tables and figures --------------------------------------------------------------------------

def first_binding_step(traj: Any) -> dict[str, float | None]:
    """Per arm, the first monitored step at which the mean over seeds of the largest layer's share of channels
    within 5% of the bound is > 0 (None: never). ``traj``: ``Grid.trajectories()``."""
    out: dict[str, float | None] = {}
    for arm, sel in traj.groupby("arm", sort=False):
        share = sel.groupby("step").frac_channels_near_bound.mean()
        hit = share[share > 0]
        out[arm] = float(hit.index.min()) if len(hit) else None
    return out


def trajectory_figure(traj: Any, reference: str = "softplus") -> Any:
    """The decay during training (the monitor's points): left, the most negative g over layers, ``|min g|`` on a
    log axis, per run (thin) and the mean over seeds (bold), each bound dashed in its arm's colour (softplus: no
    bound; K3's -5 drawn grey); right, the largest layer's share of channels within 5% of the bound."""
    fig, (ax, bx) = _figure(12, 4.4, 2)
    colors = report.palette(list(ARM_OVERRIDES))
    for arm, sel in traj.groupby("arm", sort=False):
        c = colors.get(arm)
        for _, run in sel.groupby("seed"):
            ax.plot(run.step, -run.g_min, color=c, lw=0.7, alpha=0.4)
            bx.plot(run.step, 100 * run.frac_channels_near_bound, color=c, lw=0.7, alpha=0.4)
        mean = sel.groupby("step")[["g_min", "frac_channels_near_bound"]].mean()
        n = sel.seed.nunique()
        ax.plot(mean.index, -mean.g_min, color=c, lw=2, label=f"{arm} ({n} seed{'s' * (n != 1)})")
        bx.plot(mean.index, 100 * mean.frac_channels_near_bound, color=c, lw=2, label=arm)
        if arm != reference:
            ax.axhline(-float(sel.bound.iloc[0]), color=c, ls="--", lw=1)
    ax.axhline(-REFERENCE_BOUND, color="gray", ls=":", lw=1, label="-5 (K3's bound; softplus has none)")
    ax.set_yscale("log")
    ax.set(xlabel="optimizer step", ylabel="|most negative g| over layers (nats/token)",
           title="most negative log decay (dashed: each arm's bound)")
    bx.set(xlabel="optimizer step", ylabel="% of channels within 5% of the bound (largest layer)",
           title="share of channels at the bound (softplus: at -5)")
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    return fig


def final_histograms(grid: common.Grid) -> dict[str, list[float]]:
    """Per arm, the share of log-decay entries in each ``|g|`` bin of ``DECAY_EDGES`` at the last monitored step
    (mean over seeds): ``{arm: [share per bin]}``, one more bin than edges (past the last edge)."""
    per: dict[str, list[list[float]]] = {}
    for rec in grid.records:
        if rec.trajectory:
            per.setdefault(rec.arm, []).append(rec.trajectory[-1]["hist"])
    return {arm: [sum(col) / len(col) for col in zip(*h)] for arm, h in per.items()}


def histogram_figure(hists: Mapping[str, Sequence[float]]) -> Any:
    """:func:`final_histograms` as grouped bars over the ``|g|`` bins (log y)."""
    fig, (ax,) = _figure(10, 4)
    colors = report.palette(list(ARM_OVERRIDES))
    labels = [f"{lo:g}-{hi:g}" for lo, hi in zip(DECAY_EDGES, DECAY_EDGES[1:])] + [f">{DECAY_EDGES[-1]:g}"]
    width = 0.8 / max(len(hists), 1)
    for i, (arm, h) in enumerate(hists.items()):
        xs = [j + (i - (len(hists) - 1) / 2) * width for j in range(len(h))]
        ax.bar(xs, [max(v, 1e-9) for v in h], width, color=colors.get(arm), label=arm)
    ax.set_yscale("log")
    ax.set_ylim(bottom=1e-7)
    ax.set_xticks(range(len(labels)), labels, rotation=30, fontsize=7)
    ax.set(xlabel="|g| (nats/token)", ylabel="share of entries (token, layer, head, channel)",
           title="log-decay distribution at the end of training (mean over seeds)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def cost_figure(costs: Sequence[report.Finding], arms: Mapping[str, Mapping[str, Any]]) -> Any:
    """Each bound's val loss minus softplus's (:func:`cost_findings`, in the order of ``arms`` =
    :func:`cost_arms`): the paired mean over seeds with its 95% t interval (a bare dot with one seed); hollow where
    the bound never binds (not tested)."""
    fig, (ax,) = _figure(6.4, 4)
    colors = report.palette(list(ARM_OVERRIDES))
    for i, (f, arm) in enumerate(zip(costs, arms)):
        iv = f.number
        err = [[iv.mean - iv.low], [iv.high - iv.mean]] if iv.known else None
        ax.errorbar([i], [iv.mean], yerr=err, fmt="o", ms=7, capsize=5, color=colors.get(arm),
                    mfc="white" if f.status == "not tested" else colors.get(arm))
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(costs)), [f"{b['bound']:g}" for b in arms.values()])
    ax.set(xlabel="bound g_min (tightest first; hollow: never binds)", ylabel="best val loss minus softplus (nats)",
           title="what the bound costs (95% paired t interval)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def e2e_speed_figure(speed: Mapping[str, Any]) -> Any:
    """The all-KDA model's bounded/softplus training tokens/s per length: every paired round (dots), the median
    (bar) and the rounds' range (whisker)."""
    fig, (ax,) = _figure(6.4, 4)
    ratios = speed["ratios"]
    for i, r in enumerate(ratios):
        ax.bar([i], [r["median"] - 1], bottom=1, color="C0", alpha=0.5, width=0.5)
        ax.errorbar([i], [r["median"]], yerr=[[r["median"] - r["min"]], [r["max"] - r["median"]]], color="k",
                    capsize=6)
        ax.plot([i] * len(r["rounds"]), r["rounds"], "o", color="C1", ms=4)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(range(len(ratios)), [f"T={r['T'] // 1024}K, B={r['B']}" for r in ratios])
    ax.set(ylabel="bounded / softplus tokens/s", title=f"all-KDA training step, {speed['meta'].get('gpu')}")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def overflow_error_table(rows: Sequence[Mapping[str, Any]]) -> Any:
    """The real op's relative error of o vs the swept g (rows: ``overflow_part``'s ``synthetic``): one row per
    g_min, one column per (what the op was told, decay pattern); "non-finite" where the output is not finite."""
    import pandas as pd

    table: dict[str, dict[float, Any]] = {}
    for r in rows:
        col = f"{_told_label(r['told_bound'], r['told'])}, {r['pattern']}"
        table.setdefault(col, {})[r["bound"]] = (f"{r['rel_err']:.2e}" if r["nonfinite"] == 0 and
                                                 math.isfinite(r["rel_err"]) else "non-finite")
    df = pd.DataFrame(table).sort_index(ascending=False)
    df.index.name = "g_min"
    return df


# --- research tier: findings and summary ------------------------------------------------------------------------

def speed_finding(speed: Mapping[str, Any] | None) -> report.Finding:
    """What the bound buys end to end where KDA dominates: bounded/softplus tokens/s per length, the median of the
    paired rounds and their range; not tested where the file is missing."""
    q = "What does the bound buy in end-to-end training speed (all-KDA model, bounded over softplus tokens/s)"
    if not speed:
        return report.not_tested(q, not_measured("speed"))
    parts = [f"{r['median']:.3f}x at T={r['T']:,} B={r['B']} (rounds {r['min']:.3f}-{r['max']:.3f}, "
             f"{len(r['rounds'])} paired rounds)" for r in speed["ratios"]]
    return report.Finding(q, "measured", answer="; ".join(parts) + f" ({speed['meta'].get('gpu')})")


def overflow_summary(overflow: Mapping[str, Any] | None, tol: float = 1e-2) -> dict[str, Any] | None:
    """The op's error vs g (:func:`overflow_part`'s file): per told case and pattern the error at the told bound
    (told -5), the most negative swept g with error < ``tol``, the first non-finite g; on the trained softplus
    decays, layers, min g, non-finite layers and the worst error. None when not measured."""
    if not overflow:
        return None
    out: dict[str, Any] = {"dtype": overflow["synthetic"][0]["dtype"] if overflow["synthetic"] else None,
                           "shape": overflow["config"]["shape"], "cases": {}}
    for r in overflow["synthetic"]:
        key = f"{'told_own' if r['told_bound'] else 'told_' + format(r['told'], 'g')}_{r['pattern']}"
        case = out["cases"].setdefault(key, {"errors": {}, "first_nonfinite": None, "last_within_tol": None})
        ok = r["nonfinite"] == 0 and math.isfinite(r["rel_err"])
        case["errors"][format(r["bound"], "g")] = r["rel_err"] if ok else None
        if not ok and (case["first_nonfinite"] is None or r["bound"] > case["first_nonfinite"]):
            case["first_nonfinite"] = r["bound"]
    for case in out["cases"].values():
        good = [float(g) for g, e in case["errors"].items() if e is not None and e < tol
                and (case["first_nonfinite"] is None or float(g) > case["first_nonfinite"])]
        case["last_within_tol"] = min(good, default=None)
        case["at_-5"] = case["errors"].get("-5")
    trained = overflow.get("trained", [])
    out["trained"] = {"layers": len(trained), "g_min": min((r["g_min"] for r in trained), default=None),
                      "layers_nonfinite": sum(r["nonfinite"] > 0 for r in trained),
                      "worst_rel_err": max((r["rel_err"] for r in trained), default=None),
                      "worst_rel_err_general": max((r["rel_err_general"] for r in trained), default=None),
                      "sources": sorted({r["source"].split("/")[0] for r in trained})}
    return out


def overflow_finding(overflow: Mapping[str, Any] | None) -> report.Finding:
    """The op's error vs g as measured (told -5, constant decay) and on the trained softplus decays."""
    q = "How accurate is the real bounded op near and past its bound (told -5, constant decay; error of o)"
    s = overflow_summary(overflow)
    if s is None:
        return report.not_tested(q, not_measured("overflow"))
    c = s["cases"].get("told_-5_constant", {})
    errs = c.get("errors", {})
    shown = "; ".join(f"g {g}: {'non-finite' if e is None else f'{e:.1e}'}"
                      for g, e in sorted(errs.items(), key=lambda x: -float(x[0]))  # nearest the bound first
                      if float(g) in (-5.0, -6.0, -7.0, -8.0, -8.05, -8.1, -11.0, -12.0))
    t = s["trained"]
    trained = (f"; on {t['layers']} trained softplus layers (min g {t['g_min']:.2f}) non-finite in "
               f"{t['layers_nonfinite']}, worst error {t['worst_rel_err']:.1e}" if t["layers"] else
               "; no trained softplus decay in the records")
    first = c.get("first_nonfinite")
    return report.Finding(q, "measured", answer=(
        f"{shown}; within 1% down to g = {c.get('last_within_tol')}, first non-finite at "
        f"{'none swept' if first is None else f'{first:g}'} ({s['dtype']}){trained}"))


SOLVED = 1e-3  # fast forgetting: a run whose final loss is <= 1e-3 x its first has solved the task (converged)


def forgetting_findings(forgetting: Mapping[str, Any] | None, reference: str = "softplus") -> list[report.Finding]:
    """Per bounded arm of the fast-forgetting task, its log10 final loss minus ``reference``'s, paired by seed with
    a 95% t interval, tightest bound first; "not tested" where a compared run has not converged (its last 20% of
    steps still moving > 1%: :func:`plateau`, and its final loss above :data:`SOLVED` x its first), unless only the
    reference's runs are still falling while the bounded arm is already worse (the gap can only grow: reported as a
    lower bound); or where the file is missing."""
    import pandas as pd

    q = "Does the bound {b:g} hurt a task that needs fast forgetting ({arm} minus {ref}, log10 final loss)"
    if not forgetting:
        return [report.not_tested("Does a bound hurt a task that needs fast forgetting", not_measured("forgetting"))]
    rows = pd.DataFrame(forgetting["rows"])
    rows["log10_final_loss"] = rows.final_loss.map(math.log10)
    ref = report.by_seed(rows, reference, "log10_final_loss")
    out = []
    arms = sorted((a for a in dict.fromkeys(rows.arm) if a != reference),
                  key=lambda a: -float(rows[rows.arm == a].bound.iloc[0]))
    # a run whose loss fell SOLVED-fold below its first is solved: there its last 20% "moving" is the noise of a
    # loss near zero (relative changes of a 1e-7 loss), not training still under way
    rows["solved"] = rows.final_loss <= SOLVED * rows.get("first_loss", 0.0)  # a file without first_loss: none
    for arm in arms:
        sel = rows[rows.arm.isin([arm, reference])]
        moving = sel[~(sel.last20_converged.astype(bool) | sel.solved)]
        a, b = report.by_seed(rows, arm, "log10_final_loss"), ref
        iv = report.paired(a, b)
        # only the reference still falling while the bounded arm is already worse: the gap can only grow
        lower_bound = (not moving.empty and (moving.arm == reference).all() and (moving.last20_change < 0).all()
                       and iv.known and iv.low > 0)
        names = ", ".join(f"{x}/s{s}" for x, s in zip(moving.arm, moving.seed))
        reason = (None if moving.empty or lower_bound else
                  f"not converged: {len(moving)} of {len(sel)} runs still move > 1% over the last 20% of "
                  f"{forgetting['config']['steps']} steps ({names})")
        f = _paired_finding(q.format(b=float(rows[rows.arm == arm].bound.iloc[0]), arm=arm, ref=reference), a, b,
                            unit="log10", digits=2, precondition=reason)
        if lower_bound:
            f.answer = f"{reference} still falling ({names}): a lower bound on the gap"
        out.append(f)
    return out


def _paired_finding(question: str, a: Mapping[int, float], b: Mapping[int, float], unit: str, digits: int = 3,
                    precondition: str | None = None) -> report.Finding:
    """``report.compare``, except that one common seed gives a measured difference without an interval (not a
    verdict: a single seed cannot tell an effect from noise)."""
    f = report.compare(question, a, b, unit=unit, digits=digits, precondition=precondition)
    if f.status in ("better", "worse", "noise") and f.number.n < 2:
        return report.Finding(question, "measured", f.number, answer="one seed, no interval", unit=unit,
                              digits=digits, signed=True)
    return f


def research_summary(grid: common.Grid, runs: Any, decay: Any, parts: Mapping[str, Any], preset: str = "research",
                     reference: str = "softplus", kernel_results: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The research tier's ``summary.json`` (before :func:`report.attach`): meta (with GPU minutes per run and in
    all, and each standalone part's file, commit and date), per arm the val loss and the decay at the end of
    training, the precondition per bound, the end-to-end speed, the op's error vs g and the forgetting rows."""
    traj = grid.trajectories()
    per_run = {f"{r.arm}/s{r.seed}": r.timing.get("gpu_minutes") for r in grid.records}
    standalone = {part: ({"file": RESEARCH_FILES[part], "commit": d["meta"].get("commit"), "gpu": d["meta"].get("gpu"),
                          "date": d["meta"].get("date"), "command": d["meta"].get("command"),
                          "wall_s": d.get("wall_s")} if d else {"file": RESEARCH_FILES[part], "measured": False})
                  for part, d in parts.items()}
    # kernel_results: the benchmark files section 5 read (a from-results render reads them back from here)
    meta = common.study_meta(STUDY, preset, grid, gpu_minutes_per_run=per_run, standalone_parts=standalone,
                             **({"kernel_results": dict(kernel_results)} if kernel_results is not None else {}))
    last = traj.sort_values("step").groupby(["arm", "seed"], sort=False).tail(1) if len(traj) else traj
    first = first_binding_step(traj) if len(traj) else {}
    arms = {}
    for arm in dict.fromkeys(runs.arm):
        t, end = runs[runs.arm == arm], (last[last.arm == arm] if len(last) else last)
        arms[arm] = {"gate": ARM_OVERRIDES[arm]["model.kda.gate"], "bound": arm_bound(grid, arm),
                     "seeds": [int(s) for s in t.seed], "steps": int(t.steps.max()),
                     **{m: _ms(t[m]) for m in ("best_val_loss", "final_val_loss", "final_train_loss")},
                     "gpu_minutes": float(t.gpu_minutes.fillna(0).sum()),
                     "end_g_min": _ms(end.g_min) if len(end) else _ms([]),
                     "end_frac_channels_near_bound": _ms(end.frac_channels_near_bound) if len(end) else _ms([]),
                     "first_binding_step": first.get(arm)}
    binds = {a: {**b, "g_min": {str(k): v for k, v in b["g_min"].items()}}
             for a, b in binds_by_arm(decay, reference).items()}
    speed = parts.get("speed")
    forgetting = parts.get("forgetting")
    return {"meta": meta, "factor": {k: dict(v) for k, v in grid.factor.items()}, "arms": arms, "binds": binds,
            "speed": ({"ratios": [{k: r[k] for k in ("T", "B", "median", "min", "max", "rounds", "tok_per_s")}
                                  for r in speed["ratios"]]} if speed else None),
            "overflow": overflow_summary(parts.get("overflow")),
            "forgetting": ({"config": forgetting["config"], "rows": forgetting["rows"]} if forgetting else None)}


def research_report(summary: Mapping[str, Any], runs: Any, decay: Any, parts: Mapping[str, Any],
                    reference: str = "softplus") -> report.Report:
    """The research tier's findings: the precondition first (:func:`binds_finding`), the loss cost of every bound
    with its paired interval (:func:`cost_findings`, tightest first), the end-to-end speed (:func:`speed_finding`);
    in the details the op's error vs g (:func:`overflow_finding`) and fast forgetting (:func:`forgetting_findings`),
    then the cost of GPU time."""
    import pandas as pd

    lead = [binds_finding(decay, reference), *cost_findings(runs, decay, reference), speed_finding(parts.get("speed"))]
    binds = binds_by_arm(decay, reference)
    rows = {}
    val = {a: report.by_seed(runs, a, "best_val_loss") for a in dict.fromkeys(runs.arm)}
    for arm, s in summary["arms"].items():
        rows[arm] = {"bound": "none" if arm == reference else f"{s['bound']:g}",
                     "val loss": report.cell(report.mean_interval(list(val[arm].values())), 3, signed=False),
                     f"minus {reference}": "" if arm == reference else report.cell(report.paired(val[arm],
                                                                                             val[reference])),
                     "share at bound (end)": "" if arm == reference else f"{binds[arm]['share']:.1%}",
                     "first binds at step": "" if arm == reference or s["first_binding_step"] is None
                     else f"{s['first_binding_step']:.0f}",
                     "min g (end)": report.cell(report.mean_interval(decay[decay.arm == arm].groupby("seed").g_min
                                                                     .min().tolist()), 2),
                     "GPU min": f"{s['gpu_minutes']:.1f}"}
    table = pd.DataFrame(rows).T
    table.index.name = "arm"
    meta = summary["meta"]
    details = [f"{f.plain()}" for f in (overflow_finding(parts.get("overflow")),
                                       *forgetting_findings(parts.get("forgetting"), reference))]
    if meta.get("epochs") is not None:
        details.append(f"Data: {meta['tokens_per_run']:,} tokens per run, {meta['epochs']:.2f} epochs of the "
                       f"{meta['corpus_train_tokens']:,}-token training split, {runs.steps.max()} steps; "
                       f"{meta['runs']} runs, {meta['gpu_minutes']:.1f} GPU minutes of training in all.")
    return report.Report(lead, table, details)



def main(argv: Sequence[str] | None = None) -> int:
    """``python -m moelab.studies.decay_bound {speed,overflow,forgetting} [--out FILE]``: the research tier's GPU
    parts, each writing one raw JSON (default: its file in ``studies/01_decay_bound/results/``) whose meta records
    the command with that repository path (a scratch ``--out`` outside the repository is recorded as that path)."""
    import argparse
    import sys
    import time

    from moelab import provenance
    from moelab.utils import write_json

    parser = argparse.ArgumentParser(prog="python -m moelab.studies.decay_bound", description=main.__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    sp = sub.add_parser("speed", help="end-to-end training tokens/s, bounded vs softplus, all-KDA model")
    sp.add_argument("--rounds", type=int, default=7)
    sp.add_argument("--window", type=int, default=3)
    sp.add_argument("--lengths", default=",".join(f"{T}x{B}" for T, B in SPEED_LENGTHS),
                    help="T x B pairs, comma-separated (e.g. 16384x2,65536x1)")
    op = sub.add_parser("overflow", help="the real op's error vs g: synthetic decays and the trained softplus ones")
    op.add_argument("--preset", default="research", choices=tuple(PRESETS))
    op.add_argument("--records", default=RECORDS_DIR, help=f"the records holding real_g (default {RECORDS_DIR})")
    op.add_argument("--shape", default=None, help="BxTxHxK of the synthetic decays (default: the preset's)")
    op.add_argument("--g-mins", default=None, help="comma-separated swept g (default: the preset's overflow_g_mins)")
    op.add_argument("--real-tokens", type=int, default=None, help="tokens of each trained decay (default: all kept)")
    fp = sub.add_parser("forgetting", help="fast_forgetting of every arm, with its plateau flags")
    fp.add_argument("--preset", default="research", choices=tuple(PRESETS))
    fp.add_argument("--steps", type=int, default=None, help="default: the preset's forget_steps")
    fp.add_argument("--seeds", default=None, help="comma-separated (default: the preset's forget_seeds)")
    for p in (sp, op, fp):
        p.add_argument("--out", default=None, help="the JSON to write (default: the part's file in the repository)")
    raw = list(argv) if argv is not None else sys.argv[1:]
    args = parser.parse_args(raw)
    out = args.out or RESEARCH_FILES[args.what]
    # the recorded command: the arguments as given, the output named by its path in the repository
    command = part_command(args.what, out, common.part_args(raw))

    def numbers(text: str, kind: type, what: str, n: int | None = None, sep: str = ",") -> list:
        try:
            vals = [kind(v) for v in text.split(sep)]
            if n is not None and len(vals) != n:
                raise ValueError
        except ValueError:
            parser.error(f"{what} {text!r} is not allowed: expected {n or 'one or more'} numbers separated by '{sep}'")
        return vals

    if args.what == "speed":
        try:
            lengths = [tuple(int(v) for v in item.split("x")) for item in args.lengths.split(",")]
            if any(len(x) != 2 for x in lengths):
                raise ValueError
        except ValueError:
            parser.error(f"--lengths {args.lengths!r} is not allowed: expected TxB pairs, comma-separated")
        t0 = time.perf_counter()
        result = e2e_speed(lengths, rounds=args.rounds, window=args.window)
        result["meta"]["command"] = provenance.provenance(command)["command"]
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        write_json(out, result)
        for r in result["ratios"]:
            print(f"T={r['T']} B={r['B']}: bounded/softplus tokens/s median {r['median']:.3f} "
                  f"[{r['min']:.3f}, {r['max']:.3f}] over {len(r['rounds'])} rounds; "
                  + ", ".join(f"{a} {v / 1e3:.0f}K tok/s" for a, v in r["tok_per_s"].items()))
    elif args.what == "overflow":
        result = overflow_part(args.preset, args.records,
                               shape=tuple(numbers(args.shape, int, "--shape", 4, "x")) if args.shape else None,
                               g_mins=numbers(args.g_mins, float, "--g-mins") if args.g_mins else None,
                               real_tokens=args.real_tokens, command=command)
        write_json(out, result)
        print(overflow_finding(result).plain())
    else:
        result = forgetting_part(args.preset, steps=args.steps,
                                 seeds=numbers(args.seeds, int, "--seeds") if args.seeds else None, command=command)
        write_json(out, result)
        for f in forgetting_findings(result):
            print(f.plain())
    print(f"wrote {out}" + (f" ({result['wall_s']} s)" if "wall_s" in result else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
