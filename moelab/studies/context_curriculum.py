"""Study 4: context curriculum vs direct long training vs short-only training, at the same total tokens.

The report trains 8K -> 64K -> 256K -> 1M, each stage starting from the last, and judges a model by
its *effective* context (the longest length where passkey retrieval works), not its nominal window.
This study trains three **schedules** over one token budget (same steps, same tokens per optimizer
step, same data mix and learning-rate schedule; :mod:`moelab.data.curriculum` keeps the tokens per
step by resizing the micro-batch):

* ``curriculum``: the plan's stage lengths in order (e.g. 256 -> 1024 -> 2048 on a CPU), each stage a
  share of the steps;
* ``direct``: every step at the longest length;
* ``short``: every step at the shortest length.

Every arm sets only ``data.curriculum`` (the schedule), which :func:`arms_factor` checks. Validation
reads windows of the longest length (``data.seq_len``) in every arm, so the validation loss is
comparable. Each trained model then runs the evaluation suite (:mod:`moelab.eval`): passkey over
lengths x depths up to 4x the longest training length, MQAR, loss by position.

The notebook ``nbs/04_context_curriculum.py`` calls, in order: :func:`arms_factor`, :func:`train`,
:func:`evaluate_runs`, :func:`summary_rows`, :func:`stage_perf`, the figures, :func:`summarize` and
:func:`findings` (every sentence computed from the summary).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.eval.tasks import EFFECTIVE_THRESHOLD
from moelab.studies import common, report

STUDY = "04_context_curriculum"
SCHEDULES = ("curriculum", "direct", "short")


@dataclass(frozen=True)
class EvalPlan:
    """Settings of the evaluation suite for every trained model.

    depths: passkey needle depths; samples: passkey samples per (length, depth) cell; mqar_pairs and
    mqar_samples: per MQAR length; lbp_samples: held-out windows for loss by position; batch_size:
    sequences per forward; extrapolation: the longest evaluated length over the longest trained one.
    """

    depths: tuple[float, ...]
    samples: int
    mqar_pairs: int
    mqar_samples: int
    lbp_samples: int
    batch_size: int
    extrapolation: int = 4


@dataclass(frozen=True)
class Plan:
    """One preset of the study.

    base: training preset; common: overrides for every arm (scale); lengths: the curriculum's stage
    lengths, shortest first (direct trains at the last, short at the first); shares: each stage's
    share of the steps; steps: optimizer steps of every run; synthetic: share of retrieval
    sub-tasks (passkey, MQAR) in every stage of every arm, drawn per sequence; seeds; threads: torch intra-op
    threads. synthetic_batch_share (instead of synthetic): the share of every micro-batch's sequences that are
    retrieval sub-tasks (``data.curriculum[].synthetic_batch_share``), the same in every step of every arm.
    pilot_steps: budgets (optimizer steps, seed 0) of the pilot runs of the short arm, trained before the grid
    to show that retrieval is learnable at this size (:func:`train_pilot`); the grid's short runs are its last point.
    pilot_monitor_every: with a value n > 0, every pilot run measures passkey and MQAR at the short length every n
    steps while it trains (:func:`pilot_monitor`, the record's ``trajectory``): one run gives the learning curve.
    pilot_variants: ``(suffix, steps, overrides)``: further pilot runs of the short schedule, named
    ``pilot<steps><suffix>``, with other model or training settings (a smaller model, another learning rate, and under
    ``"data.curriculum"`` a mapping of the short stage's fields, e.g. its ``synthetic_tasks``), for when the preset's
    model does not learn retrieval within ``pilot_steps``; the grid keeps the preset's settings.
    train_mqar_density: key-value pairs per token of the training MQAR sub-tasks (a stage of ``seq_len`` tokens asks
    ``int(density * seq_len)``; 0: every stage asks the evaluation's ``eval.mqar_pairs``). A retrieval sequence trains
    only on its answers (the rest of its targets are ignored), so the pairs set how much of the loss retrieval is,
    and pairs in proportion to the length give every arm the same MQAR answers per step at the same share of tokens
    (a fixed count would give the short arm's many short sequences 16x the long arm's answers).
    """

    base: str
    common: Mapping[str, Any]
    lengths: tuple[int, ...]
    shares: tuple[float, ...]
    steps: int
    synthetic: float
    seeds: tuple[int, ...]
    eval: EvalPlan
    threads: int | None = None
    notes: str = ""
    synthetic_batch_share: float = 0.0
    pilot_steps: tuple[int, ...] = ()
    pilot_monitor_every: int = 0
    pilot_variants: tuple[tuple[str, int, Mapping[str, Any]], ...] = ()
    train_mqar_density: float = 0.0
    source_pin: str | None = None  # training-code epoch of the records (common.pinned): bump when training changes
    # keep each run's training speed in its record (train_perf): split calls train on machines whose MLflow store,
    # where the perf/* metrics go, does not come back
    record_perf: bool = False


PRESETS = {
    # 2 shared CPU cores, about 3 minutes: all-MLA mixers and dense FFNs at width 64 (KDA's chunked form and
    # the MoE dispatch cost most of a CPU step), 80 steps of 2048 tokens, 9 runs. The shortest stage is 256
    # because a passkey sample needs 132 tokens with the 512-id tokenizer; 256 -> 1024 -> 2048 keeps the ratio
    # 1:4:8. The evaluation (passkey and MQAR up to 8192 tokens, plain-PyTorch attention, ~11K tokens/s) takes
    # half the time (114 of 241 s in CI at bece0e7, with 4 MQAR samples per length and 4 loss-by-position
    # windows); retrieval stays at chance at this scale, so it runs 2 passkey samples per cell, 2 MQAR samples
    # per length and 2 loss-by-position windows (times 3 seeds). One thread (see study 3).
    "cpu": Plan("tiny", {"model.pattern": "M", "model.dense_layers": 8, "model.max_seq_len": 2048,
                         "data.seq_len": 2048, "train.batch_size": 1, "train.max_steps": 80,
                         "train.warmup_steps": 8, "train.val_every": 20, "train.val_batches": 2,
                         "train.log_every": 5, "tracking.log_system_metrics": False},
                (256, 1024, 2048), (0.5, 0.3, 0.2), 80, 0.1, (0, 1, 2),
                EvalPlan(depths=(0.0, 0.5, 1.0), samples=2, mqar_pairs=8, mqar_samples=2, lbp_samples=2,
                         batch_size=4),
                threads=1, notes="all-MLA, d_model 64, 80 steps of 2048 tokens; stages 256 -> 1024 -> 2048"),
    # One H200: 479 s wall at f5cf7b2 (estimated ~6.5 minutes beforehand; summary.json): gpu-small (3 KDA : 1
    # MLA, d_model 512, MoE) at 32K tokens per step, 1K -> 4K -> 16K (the report's 8K -> 64K -> 256K ratios 1:8:32,
    # scaled to 1:4:16). Estimate: gpu-small's measured 121 ms per 32K-token step (T = 4096; the three MLA layers'
    # longer attention adds a little at 16K), so ~15 s of steps and ~5 s of start, validation and checkpoints per run,
    # ~3 min for 3 schedules x 3 seeds; the evaluation forwards ~7M tokens per model (passkey and MQAR up to
    # 64K), ~10 s each, ~1.5 min; ~1.5 min of kernel compilation over the lengths. The steps run captured
    # (train.compile graphs, one capture per stage): a 1K -> 4K -> 16K curriculum of 60 steps on an H100 ended at
    # train / val loss 6.376 / 6.317 captured, 6.361 / 6.296 eager (kernels/results/model_capture_h200.json,
    # other_gpus.H100_curriculum_eager_vs_graphs).
    "gpu": Plan("gpu-small", {"model.max_seq_len": 16384, "data.seq_len": 16384, "train.batch_size": 2,
                              "train.max_steps": 120, "train.warmup_steps": 12, "train.val_every": 20,
                              "train.val_batches": 2, "train.log_every": 5, "train.compile": "graphs",
                              **common.FAST_BACKENDS},
                (1024, 4096, 16384), (0.5, 0.3, 0.2), 120, 0.1, (0, 1, 2),
                EvalPlan(depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=8, mqar_pairs=16, mqar_samples=16,
                         lbp_samples=4, batch_size=8),
                notes="gpu-small, 120 steps of 2 x 16384 tokens; stages 1K -> 4K -> 16K"),
    # The tier that answers the question (issue 40), split calls on one GPU, one run per call (~6 minutes each, ~60
    # GPU-minutes in all). The model is gpu-small at 4 layers (one KKKM unit: 36.7M parameters, 20.2M activated) at
    # lr 3e-3: the recipe whose pilot learned passkey retrieval (below). Every step trains 65,536 tokens in every arm
    # (8 x 8K, 16 x 4K or 64 x 1K: direct sees 8 sequences per step) and a quarter of every micro-batch's sequences are
    # retrieval sub-tasks (passkey and MQAR taking turns; the training MQAR asks a pair per 8 tokens, so every arm
    # trains the same MQAR answers per step), so the arms see the same retrieval tokens per step. 4096 steps = 268M
    # tokens per run (11.9 epochs of the 22.6M-token Gutenberg split: the held-out loss overfits, the retrieval metrics
    # are what the study compares). The longest length is 8K, not 16K: at 16K the direct arm's 8 sequences make 131K
    # tokens per step, and at the steps retrieval needs (~2,900, below) that run does not fit one 10-minute call
    # (~1.45x the FLOPs per token of 1K, whose 3072 steps took 378 s). The norms run as the fused Triton kernels on a
    # GPU (model.norm_backend auto; the same math).
    # How the recipe was found (records of the earlier designs in git; each a monitored run of the short arm that
    # measures passkey and MQAR at 1K every 64 steps): gpu-small at 12 layers, lr 1e-3, 131K tokens per step, left
    # passkey at 0.00 for 1024 steps (134M tokens; H100, git 471ab16, record at d364e25), its answer NLL flat at
    # 2.44-2.55 nats from step 192 (a uniform digit: 2.30), as the 96- and 192-step pilots before it (git 4d00c40,
    # 56fe7aa). The toy probe (moelab.studies.induction, results/induction_cpu.json) measured this KDA + NoPE-MLA hybrid
    # learning in-context copying later at 4 layers than at 2 and later still at 12, and an uncommitted CPU probe of
    # in-context repetition as a third task (``synthetic_tasks`` "repeat") did not help. At 4 layers and lr 3e-3 (the
    # variants below, 131K tokens per step as the old grid): after a plateau of the answer NLL at ~2.5 until step
    # ~1300, passkey rose to 0.075 by step 2048 in a 2048-step run, and to 0.9 at step 2880 in a 3072-step run (0.86
    # at its end; 377M tokens). The grid trains that recipe at half the tokens per step for 4096 steps; its pilot
    # (pilot4096, the grid's recipe) learned retrieval too: the answer NLL left its plateau at step ~2000, passkey
    # reached 0.9 first at step 3008 (197M tokens) and was 0.96 at the end (H100, record committed at 5d73dce:
    # records/research/pilot4096_s0.json). The runs are eager (train.compile none): the records were trained so, and
    # the mode is part of every record's fingerprint (the gpu tier above captures its steps: one capture per stage).
    "research": Plan("gpu-small", {"model.n_layers": 4, "model.max_seq_len": 8192, "data.seq_len": 8192,
                                   "train.batch_size": 8, "model.norm_backend": "auto", "train.lr": 3e-3,
                                   "train.max_steps": 4096, "train.warmup_steps": 100, "train.val_every": 512,
                                   "train.val_batches": 2, "train.log_every": 16},
                     (1024, 4096, 8192), (0.5, 0.3, 0.2), 4096, 0.0, (0, 1, 2),
                     EvalPlan(depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=8, mqar_pairs=16, mqar_samples=16,
                              lbp_samples=4, batch_size=8),
                     notes="gpu-small at 4 layers, lr 3e-3, 4096 steps of 65,536 tokens (8 x 8K .. 64 x 1K), 25% "
                           "retrieval sequences in every micro-batch (MQAR: a pair per 8 tokens); "
                           "stages 1K -> 4K -> 8K",
                     synthetic_batch_share=0.25, pilot_steps=(4096,), pilot_monitor_every=64,
                     # the earlier recipe's batch: 2 micro-batches of 4 x 16K per step (the records keep their names)
                     pilot_variants=tuple(("L4", n, {"model.max_seq_len": 16384, "data.seq_len": 16384,
                                                     "train.batch_size": 4, "train.accumulate_grad_batches": 2,
                                                     "train.val_every": 48, "train.log_every": 8})
                                          for n in (2048, 3072)),
                     source_pin="s4research-1", record_perf=True, train_mqar_density=0.125),
}


def plan(preset: str) -> Plan:
    """The :class:`Plan` of ``preset`` (``cpu``, ``gpu`` or ``research``)."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not allowed: expected one of {tuple(PRESETS)}")
    return PRESETS[preset]


# ------------------------------------------------------------------------------------------- arms


def split_steps(steps: int, shares: Sequence[float]) -> list[int]:
    """``steps`` split by ``shares`` into whole numbers (largest remainder), each >= 1, summing to ``steps``."""
    if not shares or any(s <= 0 for s in shares):
        raise ValueError(f"shares={list(shares)} is not allowed: expected a non-empty list of positive numbers")
    if steps < len(shares):
        raise ValueError(f"steps={steps} is not allowed: expected >= {len(shares)}, one per stage")
    total = sum(shares)
    exact = [steps * s / total for s in shares]
    out = [max(1, math.floor(x)) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True)
    i = 0
    while sum(out) < steps:
        out[order[i % len(order)]] += 1
        i += 1
    while sum(out) > steps:  # only when the floor of 1 pushed a tiny share up: take from the largest
        out[out.index(max(out))] -= 1
    return out


def schedules(p: Plan) -> dict[str, list[dict[str, Any]]]:
    """``{schedule: data.curriculum stages}``: curriculum over ``p.lengths``, direct at the longest, short at the
    shortest; every stage has the plan's synthetic share, its MQAR sub-tasks ``train_mqar_density`` pairs per token
    (or the evaluation's count)."""
    if list(p.lengths) != sorted(set(p.lengths)) or len(p.lengths) < 2:
        raise ValueError(f"lengths={p.lengths} is not allowed: expected two or more increasing lengths")
    if len(p.shares) != len(p.lengths):
        raise ValueError(f"shares={p.shares} is not allowed: expected one share per length ({len(p.lengths)})")

    def stage(seq_len: int, steps: int) -> dict[str, Any]:
        pairs = int(p.train_mqar_density * seq_len) if p.train_mqar_density else p.eval.mqar_pairs
        if p.synthetic_batch_share:
            return {"seq_len": seq_len, "steps": steps, "synthetic_batch_share": p.synthetic_batch_share,
                    "mqar_pairs": pairs}
        return {"seq_len": seq_len, "steps": steps, "synthetic": p.synthetic, "mqar_pairs": pairs}

    return {"curriculum": [stage(L, n) for L, n in zip(p.lengths, split_steps(p.steps, p.shares))],
            "direct": [stage(p.lengths[-1], p.steps)],
            "short": [stage(p.lengths[0], p.steps)]}


def arms(preset: str) -> dict[str, dict[str, Any]]:
    """``{schedule: {"data.curriculum": stages}}``: the schedule is the only override of an arm."""
    return {name: {"data.curriculum": stages} for name, stages in schedules(plan(preset)).items()}


def arms_factor(preset: str) -> dict[str, dict[str, Any]]:
    """``{config key: {arm: value}}``; raises if the arms differ in anything but ``data.curriculum``."""
    p = plan(preset)
    return common.check_arms_differ_only(p.base, arms(preset), p.common)


def stage_text(stages: Sequence[Mapping[str, Any]]) -> str:
    """``256x30 -> 512x18 -> 1024x12`` (length x steps per stage)."""
    return " -> ".join(f"{s['seq_len']}x{s['steps']}" for s in stages)


def retrieval_budget(preset: str) -> dict[str, dict[str, Any]]:
    """Per schedule and stage, from the resolved configs (:func:`moelab.data.curriculum.plan`): ``tokens_per_step``,
    ``sequences_per_step`` and ``retrieval_sequences_per_step`` / ``retrieval_share`` (of the step's tokens, for
    ``synthetic_batch_share``; the expected share for a per-sequence ``synthetic``) and ``mqar_pairs`` (of the training
    MQAR sub-tasks: the answers each MQAR sequence trains on)."""
    from moelab.data.curriculum import plan as stage_plan

    p = plan(preset)
    cfgs = common.resolve_arms(p.base, arms(preset), p.common)
    out = {}
    for name, cfg in cfgs.items():
        acc = cfg.train.accumulate_grad_batches
        stages = stage_plan(cfg.data.curriculum, cfg.train.batch_size, cfg.data.seq_len, acc, cfg.train.max_steps)
        out[name] = {"stages": [{"seq_len": s.seq_len, "tokens_per_step": s.batch_size * s.seq_len * acc,
                                 "sequences_per_step": s.batch_size * acc,
                                 "retrieval_sequences_per_step": (s.synthetic_per_batch * acc if s.synthetic_per_batch
                                                                  else s.synthetic * s.batch_size * acc),
                                 "retrieval_share": (s.synthetic_per_batch / s.batch_size if s.synthetic_per_batch
                                                     else s.synthetic),
                                 "mqar_pairs": s.mqar_pairs} for s in stages]}
    return out


def pilot_arms(preset: str) -> dict[str, dict[str, Any]]:
    """``{"pilot<steps>[<suffix>]": overrides}``: the short schedule trained for each of the plan's ``pilot_steps``,
    then each of its ``pilot_variants`` (their own steps and overrides)."""
    p = plan(preset)
    short = schedules(p)["short"][0]
    out = {f"pilot{n}": {"data.curriculum": [{**short, "steps": n}], "train.max_steps": n} for n in p.pilot_steps}
    for suffix, n, overrides in p.pilot_variants:
        stage = {**short, **overrides.get("data.curriculum", {}), "steps": n}  # a mapping: fields of the one stage
        out[f"pilot{n}{suffix}"] = {**overrides, "data.curriculum": [stage], "train.max_steps": n}
    return out


def pilot_eval_settings(preset: str) -> dict[str, dict[str, Any]]:
    """The pilot's evaluation: passkey and MQAR at the short arm's own length only (more passkey samples)."""
    p = plan(preset)
    e = p.eval
    return {"passkey": {"lengths": [p.lengths[0]], "depths": list(e.depths), "samples": 2 * e.samples,
                        "batch_size": e.batch_size},
            "mqar": {"lengths": [p.lengths[0]], "samples": e.mqar_samples, "mqar_pairs": e.mqar_pairs,
                     "batch_size": e.batch_size}}


def pilot_monitor(preset: str) -> Callable[[torch.nn.Module, Any], dict[str, float]]:
    """The pilot's learning curve (run_grid's ``monitor`` function): passkey and MQAR accuracy at the short length,
    and the passkey answer's NLL per key token, with :func:`pilot_eval_settings` (the pilot's final evaluation's
    settings, so every point and the end are the same measurement) on the model being trained.

    Returns ``{"passkey", "passkey_nll", "mqar"}``.
    """
    settings = pilot_eval_settings(preset)

    def measure(model: torch.nn.Module, cfg: Any) -> dict[str, float]:
        from moelab.eval.suite import evaluate_model

        device = next(model.parameters()).device
        pk = evaluate_model(model, cfg, "passkey", device=device, **settings["passkey"])
        mq = evaluate_model(model, cfg, "mqar", device=device, **settings["mqar"])
        return {"passkey": float(pk["accuracy_by_length"][0]), "passkey_nll": float(np.mean(pk["answer_nll"][0])),
                "mqar": float(mq["accuracy"][0])}

    return measure


def train_pilot(preset: str, out_dir: str | Path) -> list[common.Grid]:
    """Train the pilot runs (seed 0 of the short schedule at each of ``pilot_steps``), one grid per budget
    (they differ in steps, which a grid's arms may not); finished runs are reused. With the plan's
    ``pilot_monitor_every``, each run measures :func:`pilot_monitor` every that many steps (its ``trajectory``).
    A split call (``RUNS=``) that names no pilot run leaves them for a later call (their grids come back
    incomplete)."""
    p = plan(preset)
    monitor = (p.pilot_monitor_every, pilot_monitor(preset)) if p.pilot_monitor_every else None
    grids = []
    for name, overrides in pilot_arms(preset).items():
        grids.append(common.run_grid(STUDY, p.base, {name: overrides}, (0,), out_dir, common=dict(p.common),
                                     checkpoints="final", source_pin=p.source_pin, monitor=monitor,
                                     evaluate=functools.partial(evaluate_trained, preset=preset,
                                                                settings=pilot_eval_settings(preset))))
    return grids


PILOT_PASSKEY = 0.9  # the pilot shows retrieval learnable where passkey at the short arm's own length reaches this
DIGIT_NLL = float(np.log(10))  # NLL of a key token guessed uniformly among ten digits (most key tokens are 1 digit)


def pilot_recipe(arm: str) -> str:
    """The recipe of pilot arm ``arm``: a variant's steps and suffix (``"pilot2048L4"`` -> ``"2048L4"``: one curve
    per variant run, as two lengths of one suffix follow different learning-rate schedules), ``""`` for the preset's
    own pilot (``"pilot4096"``)."""
    m = re.fullmatch(r"pilot(\d+)(.*)", arm)
    if m is None:
        raise ValueError(f"arm={arm!r} is not a pilot arm: expected pilot<steps>[<suffix>]")
    return m.group(1) + m.group(2) if m.group(2) else ""


def pilot_recipes(preset: str) -> dict[str, str]:
    """``{recipe: description}``: ``""`` the preset's settings (the grid's), each pilot variant's steps and suffix
    its overrides and length (``"2048L4"`` -> ``"model.max_seq_len=16384, ..., train.log_every=8, 2048 steps"``)."""
    p = plan(preset)
    out = {"": "the grid's settings"}
    for suffix, n, overrides in p.pilot_variants:
        flat: dict[str, Any] = {}
        for key, value in overrides.items():  # a stage mapping ("data.curriculum") names its fields one by one
            flat.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, Mapping) else {key: value})
        out[f"{n}{suffix}"] = ", ".join([*(f"{k}={'+'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}"
                                           for k, v in flat.items()), f"{n} steps"])
    return out


def pilot_rows(pilot_grids: Sequence[common.Grid], rows: Sequence[Mapping[str, Any]], preset: str
               ) -> list[dict[str, Any]]:
    """Passkey (and MQAR) accuracy at the shortest length against training tokens: one row per pilot run
    (``source`` ``pilot``), one per point of a monitored pilot run's trajectory before its last step (``source``
    ``pilot``, ``steps`` the point's; the last step is the run's final evaluation, the same measurement) and one per
    run of the grid's short schedule (``short``, the full budget); ``passkey_nll``: the passkey answer's mean NLL per
    key token there (None where the record has none); ``recipe``: :func:`pilot_recipe` of the run (``""``: the
    preset's model and training settings, which the grid trains; a variant's steps and suffix otherwise)."""
    L = plan(preset).lengths[0]
    out = []
    for g in pilot_grids:
        for r in g.records:
            if r.evals is None:
                continue
            recipe = pilot_recipe(r.arm)
            steps = int(r.summary.get("steps") or 0)
            for point in r.trajectory or []:
                if 0 < point["step"] < steps:  # step 0 is the untrained model; the last step is the evaluation's
                    out.append({"source": "pilot", "recipe": recipe, "seed": r.seed, "steps": point["step"],
                                "tokens": r.tokens * point["step"] // steps, "passkey": float(point["passkey"]),
                                "passkey_nll": point.get("passkey_nll"), "mqar": float(point["mqar"])})
            pk = r.evals["passkey"]
            out.append({"source": "pilot", "recipe": recipe, "seed": r.seed, "steps": r.summary.get("steps"),
                        "tokens": r.tokens,
                        "passkey": float(pk["accuracy_by_length"][0]),
                        "passkey_nll": float(np.mean(pk["answer_nll"][0])) if pk.get("answer_nll") else None,
                        "mqar": float(r.evals["mqar"]["accuracy"][0])})
    for r in rows:
        if r["schedule"] == "short":
            nll = {int(k): v for k, v in (r.get("passkey_nll") or {}).items()}
            out.append({"source": "short", "recipe": "", "seed": r["seed"], "steps": plan(preset).steps,
                        "tokens": r["tokens"],
                        "passkey": float({int(k): v for k, v in r["passkey"].items()}[L]),
                        "passkey_nll": nll.get(L),
                        "mqar": float({int(k): v for k, v in r["mqar"].items()}[L])})
    return sorted(out, key=lambda d: (d["tokens"], d["seed"]))


def _few(values: Sequence[int], most: int = 6) -> list[int]:
    """At most ``most`` of the sorted ``values``, evenly spaced, the first and the last among them."""
    if len(values) <= most:
        return list(values)
    return [values[round(i * (len(values) - 1) / (most - 1))] for i in range(most)]


def _pilot_curve(pilot: Sequence[Mapping[str, Any]]) -> tuple[str, list[int], list[float]]:
    """Passkey (and answer NLL) by budget of ``pilot``'s rows as text, the budgets (tokens) whose mean passkey
    reached :data:`PILOT_PASSKEY`, and the passkey values at the largest budget."""
    budgets: dict[int, list[float]] = {}
    for d in pilot:
        budgets.setdefault(int(d["tokens"]), []).append(d["passkey"])
    shown = _few(sorted(budgets))  # a monitored run has a point every few steps: the text names a handful
    curve = "; ".join(f"{t / 1e6:.1f}M tokens: {np.mean(budgets[t]):.2f}"
                      + (f" ({len(budgets[t])} seeds)" if len(budgets[t]) > 1 else "") for t in shown)
    nlls: dict[int, list[float]] = {}
    for d in pilot:
        if d.get("passkey_nll") is not None:
            nlls.setdefault(int(d["tokens"]), []).append(d["passkey_nll"])
    if nlls:  # how far from retrieval: a model that knows only that digits follow is near a uniform digit's NLL
        curve += ("; answer NLL per key token by budget: "
                  + "; ".join(f"{t / 1e6:.1f}M: {np.mean(nlls[t]):.2f}" for t in _few(sorted(nlls)))
                  + f" (a uniform digit: {DIGIT_NLL:.2f})")
    reached = [t for t, v in sorted(budgets.items()) if np.mean(v) >= PILOT_PASSKEY]
    return curve, reached, budgets[max(budgets)]


def pilot_variants(pilot: Sequence[Mapping[str, Any]], recipes: Mapping[str, str] | None = None) -> list[str]:
    """One sentence per pilot variant (rows whose ``recipe`` is not ``""``; ``recipes``: their descriptions,
    :func:`pilot_recipes`): learned or not, and its curve."""
    out = []
    for recipe in sorted({d["recipe"] for d in pilot if d.get("recipe")}):
        rows = [d for d in pilot if d.get("recipe") == recipe]
        text, hit, _ = _pilot_curve(rows)
        what = (recipes or {}).get(recipe, recipe)
        out.append(f"pilot variant {recipe} ({what}): "
                   + (f"learned, first at {hit[0] / 1e6:.1f}M tokens" if hit else
                      f"not learned within {max(int(d['tokens']) for d in rows) / 1e6:.1f}M tokens")
                   + f" (passkey by budget {text})")
    return out


def pilot_finding(pilot: Sequence[Mapping[str, Any]], length: int,
                  recipes: Mapping[str, str] | None = None, variants: bool = True,
                  curve: bool = True) -> report.Finding:
    """Is retrieval learnable at this size, with the grid's settings: how many runs reached :data:`PILOT_PASSKEY`
    passkey at ``length`` (a run: one ``(source, seed)`` of ``pilot``'s rows, the monitored pilot at each of its
    budgets, a short run at its end), the fewest tokens at which one did, and every run's value at the largest
    budget with its interval; "not tested" with the best reached where none did. A "yes" needs every run to reach
    it: a size at which some seeds learn retrieval and some do not says so. Pilot variants (:func:`pilot_variants`)
    follow in the answer where ``variants``, each with its own curve: they say whether another model or learning
    rate learns retrieval, not whether the grid's runs did. ``curve``: the learning curve (passkey and answer NLL by
    budget, :func:`pilot_curve_text`) in the answer; the report leaves it to its details, so that the line fits a
    README cell."""
    q = f"Is passkey retrieval learnable at this size (short arm, accuracy >= {PILOT_PASSKEY} at {length:,} tokens)"
    own = [d for d in pilot if not d.get("recipe")]
    tail = "".join(f". {o}" for o in pilot_variants(pilot, recipes)) if variants else ""
    if not own:
        return report.not_tested(q, f"no pilot run of the grid's recipe recorded{tail}")
    text, _, last = _pilot_curve(own)
    iv = report.mean_interval(last, bounds=(0.0, 1.0)) if len(last) > 1 else None
    runs: dict[tuple[Any, Any], list[Mapping[str, Any]]] = {}
    for d in own:
        runs.setdefault((d.get("source"), d.get("seed")), []).append(d)
    firsts = [min(int(d["tokens"]) for d in rs if d["passkey"] >= PILOT_PASSKEY) for rs in runs.values()
              if any(d["passkey"] >= PILOT_PASSKEY for d in rs)]
    top = max(int(d["tokens"]) for d in own)
    at_end = f"passkey at {top / 1e6:.1f}M tokens by run: " + ", ".join(f"{v:.2f}" for v in sorted(last, reverse=True))
    if firsts:
        k, n = len(firsts), len(runs)
        lead = "yes, " if k == n and (iv is None or not iv.includes_zero) else ""
        return report.measured(q, iv, answer=f"{lead}{k} of {n} runs reached it, the first at {min(firsts) / 1e6:.1f}M"
                                             f" tokens ({at_end}" + (f"; passkey by budget: {text}" if curve else "")
                                             + f"){tail}")
    best = max(own, key=lambda d: (d["passkey"], -int(d["tokens"])))
    how = (f"passkey by budget {text}" if curve else
           f"best passkey {best['passkey']:.2f} at {int(best['tokens']) / 1e6:.1f}M tokens")
    return report.not_tested(q, f"not learned within {top / 1e6:.1f}M tokens: {how}{tail}", iv)


PILOT_ONSET = 0.1  # passkey above this at the short length: retrieval has begun to emerge in the pilot


def curriculum_timing(summary: Mapping[str, Any]) -> str | None:
    """When the curriculum left the pilot's length, against when the pilot (the grid's recipe, monitored) began to
    retrieve there (passkey > :data:`PILOT_ONSET`) and reached :data:`PILOT_PASSKEY`: one sentence for the report's
    details, None without a monitored pilot or a curriculum stage at the pilot's length."""
    length = summary.get("pilot_length")
    curve = sorted((int(d["tokens"]), d["passkey"]) for d in summary.get("pilot", [])
                   if d.get("source") == "pilot" and not d.get("recipe"))
    rows = [r for r in summary["rows"] if r["schedule"] == "curriculum"]
    if not curve or not rows or length is None:
        return None
    per_step = summary["budget"]["per_step"]["curriculum"]["stages"]
    done, end = 0, None
    for st, part in zip(per_step, rows[0]["stages"].split(" -> ")):
        done += st["tokens_per_step"] * int(part.split("x")[1])
        if st["seq_len"] == length:
            end = done
    if end is None:
        return None
    onset = next((t for t, v in curve if v > PILOT_ONSET), None)
    learned = next((t for t, v in curve if v >= PILOT_PASSKEY), None)
    if onset is None:
        return (f"Timing: the curriculum's {length:,}-token stage ends at {end / 1e6:.1f}M tokens; the pilot's passkey "
                f"at that length never passed {PILOT_ONSET} within {curve[-1][0] / 1e6:.1f}M tokens.")
    when = "before" if end < onset else "after"
    return (f"Timing: the curriculum's {length:,}-token stage ends at {end / 1e6:.1f}M tokens, {when} the pilot's "
            f"passkey at that length first passed {PILOT_ONSET} ({onset / 1e6:.1f}M tokens"
            + (f"; {PILOT_PASSKEY} at {learned / 1e6:.1f}M" if learned else "") + ").")


def pilot_curve_text(pilot: Sequence[Mapping[str, Any]]) -> str | None:
    """The learning curve of ``pilot``'s runs of the grid's recipe as text (passkey and answer NLL by budget, a
    handful of budgets), None without one."""
    own = [d for d in pilot if not d.get("recipe")]
    return _pilot_curve(own)[0] if own else None


def train(preset: str, out_dir: str | Path, extra_overrides: Mapping[str, Any] | None = None) -> common.Grid:
    """Train every grid of ``preset``, in the notebook's order: the pilot runs first (:func:`train_pilot`, where the
    plan has ``pilot_steps``), then every schedule at every seed; finished runs are reused, the records are pinned to
    the plan's ``source_pin`` (run_grid's ``source_pin``; so are the pilot's). Returns the schedules' grid (the
    notebook's pilot cell runs :func:`train_pilot` first, the same grids: ``train`` then reads them back).

    The study's one training entry: the notebook calls it, and so does a split call (``make study-4 PRESET=research
    RUNS=...``, without the notebook), which stops with :class:`moelab.studies.common.GridIncomplete` at the first
    grid still incomplete once its own runs are trained.
    """
    p = plan(preset)
    if p.threads:
        torch.set_num_threads(p.threads)
    if p.pilot_steps:
        train_pilot(preset, out_dir)
    # One checkpoint per run, at its end; the evaluation runs on the trained model in its training process
    # and travels in the run's record (a run trained in another call needs no checkpoint here).
    return common.run_grid(STUDY, p.base, arms(preset), p.seeds, out_dir,
                           common={**p.common, **(extra_overrides or {})}, checkpoints="final",
                           evaluate=functools.partial(evaluate_trained, preset=preset), source_pin=p.source_pin)


# ------------------------------------------------------------------------------------------- eval


def eval_lengths(p: Plan) -> list[int]:
    """Passkey lengths: doublings from the shortest training length to ``extrapolation`` x the longest."""
    out, n = [], p.lengths[0]
    while n <= p.eval.extrapolation * p.lengths[-1]:
        out.append(n)
        n *= 2
    return out


def eval_settings(preset: str) -> dict[str, dict[str, Any]]:
    """``{task: keyword arguments of moelab.eval.suite.evaluate}`` (lengths, depths, samples, ...)."""
    p = plan(preset)
    e = p.eval
    longest = p.lengths[-1]
    return {
        "passkey": {"lengths": eval_lengths(p), "depths": list(e.depths), "samples": e.samples,
                    "batch_size": e.batch_size},
        "mqar": {"lengths": [p.lengths[0], longest, e.extrapolation * longest], "samples": e.mqar_samples,
                 "mqar_pairs": e.mqar_pairs, "batch_size": e.batch_size},
        "loss_by_position": {"lengths": [e.extrapolation * longest], "samples": e.lbp_samples,
                             "batch_size": e.batch_size},
    }


def train_perf(trainer: Any) -> dict[str, Any] | None:
    """The training speed of the run ``trainer`` just finished, for its record (the ``perf/*`` metrics reach only
    MLflow, whose store a split call on another machine does not bring back): ``{"log_every", "tokens_per_step",
    "windows": [[end step, tokens/s, step time s], ...], "peak_mem_gb", "window_peak_mem_gb": [GB or None per
    window]}`` from its :class:`moelab.train.callbacks.Throughput` callback, None without one.

    Throughput closes one window at every multiple of ``log_every`` (a validation restarts the open window, it
    does not skip a multiple), so the windows end at consecutive multiples up to the last one <= the final step
    (counted back from it: a resumed run's windows start after its resume). ``peak_mem_gb``: the run's largest
    window peak (None on a CPU); ``window_peak_mem_gb`` each window's own, so a curriculum's stages have theirs
    (records made before it was kept have none).
    """
    from moelab.train.callbacks import Throughput

    tp = next((c for c in trainer.callbacks if isinstance(c, Throughput)), None)
    if tp is None or not tp.windows:
        return None
    every, step = tp.log_every, int(trainer.global_step)
    last = step - step % every
    n = len(tp.windows)
    tokens = tp.tokens_per_device_step * trainer.world_size
    return {"log_every": every, "tokens_per_step": tokens,
            "windows": [[last - every * (n - 1 - i), float(tps), tokens / tps] for i, (tps, _) in
                        enumerate(tp.windows)],
            "peak_mem_gb": tp.summary(trainer.lightning_module.device)["peak_mem_gb"],
            "window_peak_mem_gb": list(tp.window_mem_gb)}


def evaluate_trained(model: torch.nn.Module, cfg: Any, preset: str,
                     settings: Mapping[str, Mapping[str, Any]] | None = None,
                     trainer: Any = None) -> dict[str, dict[str, Any]]:
    """``{task: report}`` of :func:`eval_settings`'s tasks on the trained ``model`` (run_grid's ``evaluate``),
    and, where the plan has ``record_perf``, ``train_perf`` (:func:`train_perf` of ``trainer``, read before the
    evaluation).

    The reports are :func:`moelab.eval.suite.evaluate`'s on the run's checkpoint, without its paths:
    the same numbers. As ``model_from_checkpoint`` does, the evaluation runs on an eager copy of the
    trained weights whose limit on input length is raised to the longest evaluated length (no
    positions: the limit only guards inputs); the trained model and the run's config stay as trained.
    ``settings``: other tasks and settings (the pilot's, :func:`pilot_eval_settings`); default :func:`eval_settings`.
    """
    from moelab.eval.suite import evaluate_model
    from moelab.model import MoELab

    settings = eval_settings(preset) if settings is None else settings
    device = torch.device(next(model.parameters()).device.type)
    longest = max(n for kwargs in settings.values() for n in kwargs["lengths"])
    with torch.random.fork_rng(devices=[]):  # the copy's initialization leaves the run's random state alone
        copy = MoELab(dataclasses.replace(model.cfg, max_seq_len=max(longest, model.cfg.max_seq_len)))
    copy.load_state_dict(model.state_dict())
    perf = train_perf(trainer) if trainer is not None and plan(preset).record_perf else None
    copy = copy.to(device).eval()
    out = {task: {"step": cfg.train.max_steps, **evaluate_model(copy, cfg, task, device=device, **kwargs)}
           for task, kwargs in settings.items()}
    return {**out, "train_perf": perf} if perf is not None else out


def _same_settings(found: Mapping[str, Any], kwargs: Mapping[str, Any]) -> bool:
    s = found.get("settings", {})
    return all(s.get(k) == v for k, v in kwargs.items() if k in ("lengths", "depths", "samples", "mqar_pairs"))


def evaluate_runs(grid: common.Grid, preset: str, echo: Any = print) -> dict[str, dict[str, Any]]:
    """The evaluation suite's reports of every run; ``{"<arm>-s<seed>": {task: report}}`` (the reports of
    :func:`moelab.eval.suite.evaluate` without their file paths).

    A run's record carries them (:func:`evaluate_trained` at the end of its training: ``rec.evals``),
    so a run trained in another call (``RUNS=``) needs no checkpoint here. A record without them (or
    with other settings) is evaluated from its last checkpoint: reports are written beside it
    (``eval/<task>.json``), which a retrained run's fresh folder drops, so a rerun reuses a report only
    for the same trained model and settings. The main numbers go onto the run's MLflow run as ``study/*`` metrics.
    """
    from moelab.eval.suite import evaluate

    settings = eval_settings(preset)
    out: dict[str, dict[str, Any]] = {}
    for rec in grid.records:
        if rec.evals is not None and all(task in rec.evals and _same_settings(rec.evals[task], kwargs)
                                         for task, kwargs in settings.items()):
            reports = {task: dict(rec.evals[task]) for task in settings}
            out[f"{rec.arm}-s{rec.seed}"] = reports
            _echo_eval(rec, reports, echo)
            _log_eval(rec, reports)
            continue
        ckpt = Path(rec.summary.get("last_checkpoint") or rec.summary["best_checkpoint"])
        reports = {}
        for task, kwargs in settings.items():
            path = ckpt.parent / "eval" / f"{task}.json"
            found = json.loads(path.read_text()) if path.exists() else None
            if found is None or not _same_settings(found, kwargs):
                with common.output_to(ckpt.parent / "eval.log"):
                    found = evaluate(ckpt, task, out=path, tracking=False, **kwargs)
            # where this machine keeps the checkpoint says nothing in a committed report
            reports[task] = {k: v for k, v in found.items() if k not in ("checkpoint", "json")}
        out[f"{rec.arm}-s{rec.seed}"] = reports
        _echo_eval(rec, reports, echo)
        _log_eval(rec, reports)
    return out


def _echo_eval(rec: common.RunRecord, reports: Mapping[str, Mapping[str, Any]], echo: Any) -> None:
    pk = reports["passkey"]
    echo(f"eval {rec.arm} seed {rec.seed}: passkey by length "
         f"{dict(zip(pk['lengths'], (round(a, 2) for a in pk['accuracy_by_length'])))}, effective context "
         f"{pk['effective_context']}, mqar {[round(a, 3) for a in reports['mqar']['accuracy']]}")


def _log_eval(rec: common.RunRecord, reports: Mapping[str, Mapping[str, Any]]) -> None:
    """``study/effective_context``, ``study/passkey_acc`` and ``study/mqar_acc`` on the training's MLflow run."""
    run_id = rec.summary.get("run_id")
    if not run_id:
        return
    import time

    from mlflow.entities import Metric

    from moelab.tracking import client

    pk, mq = reports["passkey"], reports["mqar"]
    now = int(time.time() * 1000)
    metrics = [Metric("study/effective_context", float(pk["effective_context"]), now, 0)]
    metrics += [Metric("study/passkey_acc", float(a), now, int(n)) for n, a in zip(pk["lengths"],
                                                                                   pk["accuracy_by_length"])]
    metrics += [Metric("study/mqar_acc", float(a), now, int(n)) for n, a in zip(mq["lengths"], mq["accuracy"])]
    client("").log_batch(run_id, metrics=metrics)


# ------------------------------------------------------------------------------------------- rows

ROW_KEYS = ("schedule", "seed", "stages", "tokens", "wall_s", "val_loss", "effective_context", "passkey",
            "mqar_acc", "mqar")


def summary_rows(grid: common.Grid, preset: str, evals: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: schedule, seed, stages (``len x steps`` text), tokens, wall_s (training), val_loss
    (final, on longest-length windows), effective_context, passkey ``{length: accuracy}``, passkey_nll ``{length:
    the answer's mean NLL per key token}``, mqar_acc (at the
    longest training length), mqar ``{length: accuracy}`` and loss_beyond (held-out loss averaged over the
    loss-by-position bins that start at or past the longest training length)."""
    longest = plan(preset).lengths[-1]
    sched = schedules(plan(preset))
    rows = []
    for r in grid.records:
        ev = evals[f"{r.arm}-s{r.seed}"]
        pk, mq = ev["passkey"], ev["mqar"]
        mqar = {int(n): float(a) for n, a in zip(mq["lengths"], mq["accuracy"])}
        rows.append({"schedule": r.arm, "seed": r.seed, "stages": stage_text(sched[r.arm]), "tokens": r.tokens,
                     "wall_s": r.summary.get("wall_s"), "val_loss": r.summary.get("final_val_loss"),
                     "effective_context": int(pk["effective_context"]),
                     "passkey": {int(n): float(a) for n, a in zip(pk["lengths"], pk["accuracy_by_length"])},
                     "passkey_nll": {int(n): float(np.mean(v))
                                     for n, v in zip(pk["lengths"], pk.get("answer_nll", []))},
                     "mqar_acc": mqar.get(longest), "mqar": mqar,
                     "loss_beyond": loss_beyond(ev["loss_by_position"], longest)})
    return rows


def loss_beyond(lbp: Mapping[str, Any], length: int) -> float | None:
    """Mean held-out loss over the loss-by-position bins (first curve) that start at or past ``length``; None
    when no bin does."""
    c = lbp["curves"][0]
    ys = [y for a, y in zip(c["bin_start"], c["loss"]) if a >= length and y is not None]
    return float(np.mean(ys)) if ys else None


def stage_of_window(stages: Sequence[Mapping[str, Any]], start: int, end: int) -> int | None:
    """Index of the stage holding every optimizer step of ``(start, end]``; None if the window spans two."""
    edge = 0
    for i, s in enumerate(stages):
        lo, edge = edge, edge + s["steps"]
        if lo <= start and end <= edge:
            return i
    return None


PERF_KEYS = ("perf/tokens_per_s", "perf/step_time_s", "perf/peak_mem_gb")


def _perf_history(rec: common.RunRecord, mlflow: Any, n_stages: int) -> dict[str, dict[int, float]]:
    """``{perf metric: {window end step: value}}`` of one run: from its record's ``train_perf`` (:func:`train_perf`;
    a run trained on another machine brings no MLflow metrics), else from its MLflow run's ``perf/*`` metrics
    (``mlflow()``: the client). From a record, each window's own peak memory where the record keeps it; in an older
    record a single-stage run's peak (``n_stages`` 1) stands for its stage's, a curriculum's stages get none."""
    tp = (rec.evals or {}).get("train_perf")
    if tp:
        wins, mem, per = tp["windows"], tp.get("peak_mem_gb"), tp.get("window_peak_mem_gb")
        if per is not None and len(per) == len(wins):
            peaks = {int(e): float(m) for (e, _, _), m in zip(wins, per) if m is not None}
        else:
            peaks = {int(e): float(mem) for e, _, _ in wins} if mem is not None and n_stages == 1 else {}
        return {"perf/tokens_per_s": {int(e): float(t) for e, t, _ in wins},
                "perf/step_time_s": {int(e): float(st) for e, _, st in wins}, "perf/peak_mem_gb": peaks}
    run_id = rec.summary.get("run_id")
    return {k: {m.step: m.value for m in mlflow().get_metric_history(run_id, k)} if run_id else {} for k in PERF_KEYS}


def _median_at(values: Mapping[int, float], steps: Sequence[int]) -> float | None:
    """The median of ``values`` at ``steps`` (None without steps)."""
    return float(np.median([values[w] for w in steps])) if steps else None


def stage_perf(grid: common.Grid, preset: str) -> list[dict[str, Any]]:
    """Training speed and memory per (run, stage): from each record's ``train_perf`` (:func:`train_perf`), else from
    the run's ``perf/*`` MLflow metrics.

    Rows: schedule, seed, stage, seq_len, batch (sequences per micro-batch), windows (logging windows
    wholly inside the stage, the first of the run left out: it holds compilation), tok_per_s and
    step_time_s (medians over those windows), peak_mem_gb (largest; None on CPU, and for a curriculum's stages
    read from records made before they kept each window's peak). A run that shared its GPU with other runs (a
    split call's ``jobs``) has no speed: its tok_per_s and step_time_s are None.
    """
    from moelab.tracking import client

    p = plan(preset)
    sched = schedules(p)
    micro = p.common["train.batch_size"] * p.common["data.seq_len"]
    store = functools.cache(lambda: client(""))
    rows = []
    for r in grid.records:
        hist = _perf_history(r, store, len(sched[r.arm]))
        steps = sorted(hist["perf/tokens_per_s"])
        by_stage: dict[int, list[int]] = {}
        for prev, step in zip([0, *steps[:-1]], steps):
            k = stage_of_window(sched[r.arm], prev, step)
            if prev and k is not None:
                by_stage.setdefault(k, []).append(step)
        for k, s in enumerate(sched[r.arm]):
            ws = by_stage.get(k, [])
            mem = [hist["perf/peak_mem_gb"][w] for w in ws if w in hist["perf/peak_mem_gb"]]
            timed = ws if getattr(r, "gpu_share", 1) == 1 else []  # a shared GPU: no speed
            rows.append({"schedule": r.arm, "seed": r.seed, "stage": k, "seq_len": s["seq_len"],
                         "batch": micro // s["seq_len"], "windows": len(ws),
                         "tok_per_s": _median_at(hist["perf/tokens_per_s"], timed),
                         "step_time_s": _median_at(hist["perf/step_time_s"], timed),
                         "peak_mem_gb": max(mem) if mem else None})
    return rows


# ------------------------------------------------------------------------------------ wall-clock


def step_times(stages: Sequence[Mapping[str, Any]], stage_step_s: Sequence[float | None], wall_s: float) -> np.ndarray:
    """Estimated wall-clock at the end of each optimizer step ``[steps + 1]`` (index 0: the start).

    Each stage's steps take its measured median step time (a stage without one takes the mean of the
    others, or 1); the whole is scaled so the last step ends at ``wall_s`` (the run's wall-clock, with
    validation and start-up spread over the steps in proportion).
    """
    known = [t for t in stage_step_s if t]
    fill = float(np.mean(known)) if known else 1.0
    per_step = np.concatenate([np.full(s["steps"], t or fill) for s, t in zip(stages, stage_step_s)])
    t = np.concatenate([[0.0], np.cumsum(per_step)])
    return t * (wall_s / t[-1])


def train_clock(stages: Sequence[Mapping[str, Any]], stage_step_s: Sequence[float | None],
                wall_s: float) -> tuple[float, str]:
    """Training time of one run in seconds and how it was taken.

    ``"steady"``: the sum over stages of steps x the stage's median step time, when every stage has
    one: compilation, validation and evaluation are left out. A process compiles once, so its first
    run pays for every later one; on the wall-clock that first run looks slower by tens of seconds.
    ``"wall"``: the run's measured wall-clock, when a stage has no step time (too short to time).
    """
    if stage_step_s and all(stage_step_s):
        return float(sum(s["steps"] * t for s, t in zip(stages, stage_step_s))), "steady"
    return float(wall_s), "wall"


def value_at_time(val_history: Sequence[Sequence[float]], times: np.ndarray, when: float) -> float | None:
    """Validation loss at wall-clock ``when``, linearly interpolated between validations (``[[step, loss]]``);
    None before the first validation or after the last."""
    pts = sorted((times[int(s)], v) for s, v in val_history if 0 < int(s) < len(times))
    if not pts or when < pts[0][0] or when > pts[-1][0] + 1e-9:
        return None
    ts, vs = zip(*pts)
    return float(np.interp(when, ts, vs))


def stage_step_times(grid: common.Grid, preset: str,
                     perf_rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], list[float | None]]:
    """``{(schedule, seed): [median step time of each stage, None where untimed]}`` from :func:`stage_perf`'s rows.

    A step time is the schedule's, not the seed's: a run without one for a stage (it shared its GPU with other
    runs, or the stage was too short to time) takes the median over the seeds of its schedule that have one."""
    sched = schedules(plan(preset))
    st = {(p["schedule"], p["seed"], p["stage"]): p["step_time_s"] for p in perf_rows}
    timed: dict[tuple[str, int], list[float]] = {}  # (schedule, stage) -> the seeds' step times
    for (arm, _, k), t in st.items():
        if t:
            timed.setdefault((arm, k), []).append(t)
    fill = {key: float(np.median(ts)) for key, ts in timed.items()}
    return {(r.arm, r.seed): [st.get((r.arm, r.seed, k)) or fill.get((r.arm, k)) for k in range(len(sched[r.arm]))]
            for r in grid.records}


def train_times(grid: common.Grid, preset: str,
                perf_rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], tuple[float, str]]:
    """``{(schedule, seed): (seconds, clock)}``: each run's :func:`train_clock`."""
    sched = schedules(plan(preset))
    per_stage = stage_step_times(grid, preset, perf_rows)
    return {(r.arm, r.seed): train_clock(sched[r.arm], per_stage[(r.arm, r.seed)], r.summary["wall_s"])
            for r in grid.records}


def equal_time(grid: common.Grid, preset: str, perf_rows: Sequence[Mapping[str, Any]], a: str = "curriculum",
               b: str = "direct") -> dict[str, Any]:
    """Validation loss of ``a`` and ``b`` at the same wall-clock, seed by seed.

    The shared time is the shorter run's training time (:func:`train_clock`: steady-state when both
    runs have step times, else both wall-clocks); the longer run's loss there is read off its
    validation curve (:func:`value_at_time`, steps placed in time by :func:`step_times`). Returns
    ``{"values": {seed: {"time_s", "clock", "read": arm read mid-run, a, b}}, "diff": paired a - b}``;
    a seed whose reading falls before the first validation is left out, and so is one without step times whose
    runs shared a GPU (their wall-clock is no time).
    """
    sched = schedules(plan(preset))
    recs = {(r.arm, r.seed): r for r in grid.records}
    step_s, clock_of = stage_step_times(grid, preset, perf_rows), train_times(grid, preset, perf_rows)
    values: dict[int, dict[str, Any]] = {}
    for seed in sorted({s for arm, s in recs if arm == a} & {s for arm, s in recs if arm == b}):
        ra, rb = recs[(a, seed)], recs[(b, seed)]
        per_stage = {r.arm: step_s[(r.arm, seed)] for r in (ra, rb)}
        clocks = {r.arm: clock_of[(r.arm, seed)] for r in (ra, rb)}
        if {kind for _, kind in clocks.values()} != {"steady"}:  # compare like with like
            if any(getattr(r, "gpu_share", 1) > 1 for r in (ra, rb)):
                continue  # a shared GPU's wall-clock is no time: without step times the seed cannot be placed
            clocks = {r.arm: (float(r.summary["wall_s"]), "wall") for r in (ra, rb)}
        early, late = (ra, rb) if clocks[ra.arm][0] <= clocks[rb.arm][0] else (rb, ra)
        t = clocks[early.arm][0]
        times = step_times(sched[late.arm], per_stage[late.arm], clocks[late.arm][0])
        v_late = value_at_time(late.val_history, times, t)
        if v_late is None:
            continue
        vals = {early.arm: early.summary["final_val_loss"], late.arm: v_late}
        values[seed] = {"time_s": t, "clock": clocks[early.arm][1], "read": late.arm, a: vals[a], b: vals[b]}
    diff = paired({s: v[a] for s, v in values.items()}, {s: v[b] for s, v in values.items()})
    return {"values": values, "diff": diff}


# ------------------------------------------------------------------------------------ verdicts


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> dict[str, Any]:
    """``a - b`` seed by seed (same seed = same initialization and data order) with its 95% t interval.

    ``{"mean", "std", "n", "low", "high", "values", "verdict"}`` (``report.paired``): verdict ``lower`` /
    ``higher`` when the interval excludes 0, ``within noise`` when it includes 0 (also when every
    difference is 0), ``one seed`` without an interval.
    """
    seeds = sorted(s for s in set(a) & set(b) if a[s] is not None and b[s] is not None)
    values = [a[s] - b[s] for s in seeds]
    n = len(values)
    std = float(np.std(values, ddof=1)) if n > 1 else None
    if n == 0:
        return {"mean": None, "std": None, "n": 0, "low": None, "high": None, "values": [], "verdict": "one seed"}
    iv = report.paired({s: a[s] for s in seeds}, {s: b[s] for s in seeds})
    if n < 2:
        return {**iv.to_dict(), "std": std, "values": values, "verdict": "one seed"}
    if iv.low == iv.high == 0.0:  # every difference 0: nothing to tell apart
        verdict = "within noise"
    else:
        verdict = "within noise" if iv.includes_zero else ("lower" if iv.mean < 0 else "higher")
    return {**iv.to_dict(), "std": std, "values": values, "verdict": verdict}


def by_seed(rows: Sequence[Mapping[str, Any]], schedule: str, key: str) -> dict[int, float]:
    """``{seed: row[key]}`` of one schedule; ``key`` ``passkey_mean`` is the mean passkey accuracy over lengths."""
    out = {}
    for r in rows:
        if r["schedule"] == schedule:
            out[r["seed"]] = float(np.mean(list(r["passkey"].values()))) if key == "passkey_mean" else r[key]
    return out


METRICS = {"val_loss": -1, "effective_context": 1, "passkey_mean": 1, "mqar_acc": 1}  # sign: +1 higher is better


def compare(rows: Sequence[Mapping[str, Any]], a: str, b: str) -> dict[str, dict[str, Any]]:
    """Per metric of :data:`METRICS`, :func:`paired` ``a - b`` and whether ``a`` is ``better`` / ``worse``
    (beyond the noise), ``tie`` (inside it) or ``one seed``."""
    out = {}
    for m, sign in METRICS.items():
        d = paired(by_seed(rows, a, m), by_seed(rows, b, m))
        d["judgement"] = _judgement(d, sign)
        out[m] = d
    return out


def _judgement(d: Mapping[str, Any], sign: int) -> str:
    if d["verdict"] in ("one seed", "within noise"):
        return "one seed" if d["verdict"] == "one seed" else "tie"
    return "better" if (d["verdict"] == "higher") == (sign > 0) else "worse"


PASSKEY_LEARNED = 0.5  # retrieval counts as learned where some run reaches this passkey accuracy at some length


def retrieval_learned(rows: Sequence[Mapping[str, Any]]) -> tuple[bool, str | None]:
    """Study 4's precondition: did any run learn retrieval (passkey accuracy >= PASSKEY_LEARNED at some length)?

    Returns ``(learned, reason)``; the reason (for "not tested") names the best accuracy reached and chance.
    """
    best = max((max(r["passkey"].values()) for r in rows if r["passkey"]), default=0.0)
    if best >= PASSKEY_LEARNED:
        return True, None
    return False, (f"retrieval never learned: best passkey accuracy {best:.2f} at any length (chance "
                   f"{chance_passkey():.0e}), effective context 0 in every arm")


def retrieval_by_arm(rows: Sequence[Mapping[str, Any]], arms: Sequence[str] = SCHEDULES) -> str:
    """Which arms retrieve, run by run: ``"short retrieves in 2 of 3 runs (passkey at 1,024 tokens by run: 0.85,
    0.75, 0.05)"`` per arm, a run retrieving where its passkey reaches :data:`PASSKEY_LEARNED` at some length."""
    out = []
    for arm in arms:
        runs = [r for r in rows if r["schedule"] == arm and r["passkey"]]
        if not runs:
            continue
        shortest = min(int(k) for k in runs[0]["passkey"])
        k = sum(max(r["passkey"].values()) >= PASSKEY_LEARNED for r in runs)
        first = sorted(({int(n): v for n, v in r["passkey"].items()}[shortest] for r in runs), reverse=True)
        out.append(f"{arm} retrieves in {k} of {len(runs)} runs (passkey at {shortest:,} tokens by run: "
                   + ", ".join(f"{v:.2f}" for v in first) + ")")
    return "; ".join(out)


def effective_floor(rows: Sequence[Mapping[str, Any]], other: str = "direct") -> str | None:
    """The reason effective context (curriculum against ``other``) is not measured though some run retrieves: every
    run of both arms has effective context 0, so their difference is 0 - 0; None otherwise. Where some run of the two
    arms retrieves at all, the mean passkey accuracy over the lengths still compares them (the reason says so);
    where none does, that comparison is at the floor too (the reason says that instead)."""
    both = [r for r in rows if r["schedule"] in ("curriculum", other)]
    if not both or any(r.get("effective_context") for r in both):
        return None
    some = any(v > 0 for r in both for v in (r.get("passkey") or {}).values())
    return (f"no run of either arm reaches passkey >= {EFFECTIVE_THRESHOLD:.0%} at the shortest evaluated length "
            "(effective context 0 in every run); " + ("the mean passkey accuracy over the lengths compares them" if some
                                                      else "their passkey accuracy is 0 at every length as well"))


def _wording(d: Mapping[str, Any], lower_is_better: bool) -> str:
    iv = report.Interval(d["mean"], *(math.nan if d.get(k) is None else d[k] for k in ("low", "high")),
                         d["n"], "paired t")
    return report.status_text(report.judge(iv, lower_is_better))


def verdict(cmp: Mapping[str, Mapping[str, Any]], at_time: Mapping[str, Any],
            learned: tuple[bool, str | None] = (True, None), floor: str | None = None) -> dict[str, str]:
    """Curriculum against direct long training, in the one wording of ``moelab.studies.report``:
    ``equal_tokens`` (validation loss at the longest length), ``equal_wall_clock`` (validation loss when the
    faster run finished), ``effective_context`` ("not tested" unless retrieval was learned, or with ``floor``,
    :func:`effective_floor`'s reason, where neither arm holds the bar in any run)."""
    out = {"equal_tokens": _wording(cmp["val_loss"], True) if cmp["val_loss"]["n"] else "not compared",
           "equal_wall_clock": (_wording(at_time["diff"], True) if at_time["diff"]["n"]
                                else "not compared (no seed has a reading at equal wall-clock)")}
    out["effective_context"] = (_wording(cmp["effective_context"], False) if learned[0] and not floor
                                else report.status_text("not tested", learned[1] or floor))
    return out


def refresh_comparisons(summary: Mapping[str, Any]) -> dict[str, Any]:
    """``summary`` with its comparisons and verdict recomputed from its per-seed ``rows`` and equal-wall-clock
    readings (a summary written by an earlier version of the rules reads with the current ones)."""
    rows = summary["rows"]
    et = summary["equal_wall_clock"]["values"]
    cmp_direct, cmp_short = compare(rows, "curriculum", "direct"), compare(rows, "curriculum", "short")
    at_time = {"values": et, "diff": paired({int(k): v["curriculum"] for k, v in et.items()},
                                            {int(k): v["direct"] for k, v in et.items()})}
    return {**summary, "curriculum_vs_direct": cmp_direct, "curriculum_vs_short": cmp_short,
            "equal_wall_clock": at_time,
            "verdict": verdict(cmp_direct, at_time, retrieval_learned(rows), effective_floor(rows))}


def summarize(grid: common.Grid, rows: Sequence[Mapping[str, Any]], perf_rows: Sequence[Mapping[str, Any]],
              evals: Mapping[str, Mapping[str, Any]], preset: str,
              pilot: Sequence[Mapping[str, Any]] | None = None,
              pilot_grids: Sequence[common.Grid] = ()) -> dict[str, Any]:
    """The study's ``summary.json``: meta, factor, budget, rows, per-stage perf, comparisons and verdicts;
    ``pilot``: :func:`pilot_rows` (research), kept as ``summary["pilot"]``; ``pilot_grids``: :func:`train_pilot`'s
    grids, whose GPU minutes the meta counts beside the schedules' (``gpu_minutes_pilot``, ``gpu_minutes_total``).

    Speed is meaningful (``perf_meaningful``) where every run trained on a GPU, wherever the report is rendered
    (the records' ``timing.gpus``); ``train_device`` names the devices the runs trained on."""
    p = plan(preset)
    on_gpu = bool(grid.records) and all((r.timing or {}).get("gpus") for r in grid.records)
    pilot_recs = [r for g in pilot_grids for r in g.records]
    minutes = {f"{r.arm}-s{r.seed}": r.timing.get("gpu_minutes") for r in [*pilot_recs, *grid.records]}
    cmp_direct, cmp_short = compare(rows, "curriculum", "direct"), compare(rows, "curriculum", "short")
    at_time = equal_time(grid, preset, perf_rows)
    clocks = train_times(grid, preset, perf_rows)
    out_rows = [{**{k: r[k] for k in ROW_KEYS}, **({"loss_beyond": r["loss_beyond"]} if "loss_beyond" in r else {}),
                 "train_s": clocks[(r["schedule"], r["seed"])][0],
                 "train_clock": clocks[(r["schedule"], r["seed"])][1]} for r in rows]
    any_eval = next(iter(evals.values()))
    return {
        "meta": common.study_meta(STUDY, preset, grid, plan=p.notes, seeds=list(p.seeds), lengths=list(p.lengths),
                                  perf_meaningful=on_gpu, eval_settings=eval_settings(preset),
                                  state_bytes_per_token=any_eval["passkey"].get("state_bytes_per_token"),
                                  train_device=", ".join(dict.fromkeys(str(r.machine.get("device"))
                                                                       for r in [*pilot_recs, *grid.records])),
                                  gpu_minutes_per_run=minutes,
                                  gpu_minutes_pilot=round(sum(r.timing.get("gpu_minutes") or 0.0
                                                              for r in pilot_recs), 3),
                                  gpu_minutes_total=round(sum(m or 0.0 for m in minutes.values()), 3)),
        "factor": {k: dict(v) for k, v in grid.factor.items()},
        "budget": {"rule": "same optimizer steps, tokens per step, data mix and learning-rate schedule; only the "
                           "sequence length per step (the schedule) differs",
                   "tokens_per_run": sorted({r["tokens"] for r in rows}), "steps": p.steps,
                   "synthetic_share": p.synthetic_batch_share or p.synthetic,
                   "synthetic_fixed_per_step": bool(p.synthetic_batch_share),
                   "per_step": retrieval_budget(preset)},
        "rows": out_rows,
        "stage_perf": list(perf_rows),
        "wall_s": {s: _mean_std([r["wall_s"] for r in rows if r["schedule"] == s]) for s in SCHEDULES},
        "train_s": {s: _mean_std([r["train_s"] for r in out_rows if r["schedule"] == s]) for s in SCHEDULES},
        "curriculum_vs_direct": cmp_direct,
        "curriculum_vs_short": cmp_short,
        "equal_wall_clock": at_time,
        "verdict": verdict(cmp_direct, at_time, retrieval_learned(rows), effective_floor(rows)),
        "chance": {"passkey": chance_passkey(), "mqar": 1 / max(2, _mqar_values(preset))},
        **({"pilot": list(pilot), "pilot_length": p.lengths[0], "pilot_recipes": pilot_recipes(preset)}
           if pilot is not None else {}),
    }


def chance_passkey(digits: int = 5) -> float:
    """Accuracy of guessing a ``digits``-digit key: ``1 / 9·10^(digits-1)`` (the generator draws them uniformly)."""
    return 1 / (9 * 10 ** (digits - 1))


def _mqar_values(preset: str) -> int:
    """How many distinct values an MQAR answer can take (the value half of the vocabulary)."""
    from moelab.config import load_config

    p = plan(preset)
    return load_config(p.base, dict(p.common)).model.vocab_size // 2


def _mean_std(xs: Sequence[float | None]) -> dict[str, float | None]:
    xs = [x for x in xs if x is not None]
    return {"mean": float(np.mean(xs)) if xs else None, "std": float(np.std(xs, ddof=1)) if len(xs) > 1 else None}


def _time_text(sel: Sequence[Mapping[str, Any]]) -> str:
    """A schedule's training time: steady-state (:func:`train_clock`) beside the measured wall-clock, whose
    spread holds the compilation that a process's first run pays."""
    wall = f"{_ms([r['wall_s'] for r in sel], 1)} s"
    if all(r.get("train_clock") == "steady" for r in sel):
        steady = _ms([r["train_s"] for r in sel], 1)
        return f"training time {steady} s (wall-clock with compilation and validation {wall})"
    return f"wall-clock {wall}"


def study_report(summary: Mapping[str, Any]) -> report.Report:
    """The findings as rules (``moelab.studies.report``), from ``summary`` alone (its ``rows`` are per seed):
    effective context first ("not tested" unless retrieval was learned), then validation loss against
    direct and short training at equal tokens, at equal wall-clock, and the training time."""
    meta, rows = summary["meta"], summary["rows"]
    learned, why = retrieval_learned(rows)

    def seeds(schedule: str, key: str) -> dict[int, float]:
        return {int(k): v for k, v in by_seed(rows, schedule, key).items()}

    def eff_compare(other: str) -> report.Finding:
        a, b = seeds("curriculum", "effective_context"), seeds(other, "effective_context")
        # retrieval learned somewhere, yet no run of either arm holds the bar at the shortest length: [0, 0] is no
        # measurement of a difference, the comparison has nothing to compare
        return report.compare(f"Does the curriculum reach a longer effective context than {other} training", a, b,
                              lower_is_better=False, unit="tokens", digits=0,
                              precondition=why or effective_floor(rows, other))

    eff = eff_compare("direct")
    best = max((max(r["passkey"].values()) for r in rows if r["passkey"]), default=0.0)
    ret = report.measured("Is retrieval learned at this scale", None,
                          answer=(f"{retrieval_by_arm(rows)}; best passkey accuracy of any run at any length "
                                  f"{best:.2f} (chance "
                                  f"{summary['chance']['passkey']:.1e}); mean MQAR accuracy "
                                  f"{np.mean([r['mqar_acc'] for r in rows]):.3f} (chance "
                                  f"{summary['chance']['mqar']:.1e})"))
    direct = report.compare("Validation loss at equal tokens, curriculum minus direct", seeds("curriculum", "val_loss"),
                            seeds("direct", "val_loss"), unit="nats")
    short = report.compare("Validation loss at equal tokens, curriculum minus short", seeds("curriculum", "val_loss"),
                           seeds("short", "val_loss"), unit="nats")
    et = summary["equal_wall_clock"]["values"]
    clock = (report.compare("Validation loss at equal wall-clock, curriculum minus direct",
                            {int(k): v["curriculum"] for k, v in et.items()},
                            {int(k): v["direct"] for k, v in et.items()}, unit="nats")
             if et else report.not_tested("Validation loss at equal wall-clock, curriculum minus direct",
                                          "no seed has a validation of the slower run before the faster one ended"))
    tkey = "train_s" if all(r.get("train_clock") == "steady" for r in rows) else "wall_s"
    kind = "steady step time x steps" if tkey == "train_s" else "wall-clock"
    tcost = report.compare(f"Training time, curriculum minus direct ({kind})",
                           seeds("curriculum", tkey), seeds("direct", tkey), unit="s", digits=1)
    if not meta.get("perf_meaningful"):
        tcost = report.not_tested(tcost.question, "timed on a shared CPU", tcost.number, unit="s", digits=1)
    import pandas as pd

    table = pd.DataFrame({s: {"stages (length x steps)": next(r["stages"] for r in rows if r["schedule"] == s),
                              "val loss": report.cell(report.mean_interval(list(seeds(s, "val_loss").values())), 3,
                                                      signed=False),
                              "minus direct": "" if s == "direct" else report.cell(
                                  report.paired(seeds(s, "val_loss"), seeds("direct", "val_loss"))),
                              "effective context": report.cell(report.mean_interval(
                                  list(seeds(s, 'effective_context').values())), 0, signed=False),
                              "MQAR accuracy": f"{np.mean(list(seeds(s, 'mqar_acc').values())):.3f}",
                              f"{tkey} (s)": report.cell(report.mean_interval(list(seeds(s, tkey).values())), 1,
                                                          signed=False)}
                          for s in SCHEDULES if any(r["schedule"] == s for r in rows)}).T
    table.index.name = "schedule"
    b = summary["budget"]
    details = [f"Budget: every run trained {', '.join(f'{t:,}' for t in b['tokens_per_run'])} tokens in {b['steps']} "
               f"steps, {b['synthetic_share']:.0%} retrieval sub-tasks in every stage; only the sequence length per "
               "step differs."]
    if et:
        details.append("Equal wall-clock readings: " + "; ".join(
            f"seed {k}: at {v['time_s']:.1f} s, curriculum {v['curriculum']:.4f} vs direct {v['direct']:.4f} "
            f"({v['read']} read mid-run)" for k, v in et.items()) + ".")
    if meta.get("perf_meaningful"):
        perf = [p for p in summary["stage_perf"] if p["tok_per_s"] is not None and p["seed"] == min(meta["seeds"])]
        details.append(f"Speed and memory per stage on {meta.get('train_device') or meta['device']} "
                       f"(seed {min(meta['seeds'])}): " + "; ".join(
            f"{p['schedule']} stage {p['stage']} ({p['seq_len']}) {p['tok_per_s']:,.0f} tok/s"
            + (f", {p['peak_mem_gb']:.1f} GB" if p["peak_mem_gb"] is not None else "") for p in perf) + ".")
    if meta.get("state_bytes_per_token") is not None:
        details.append(f"Evaluation memory: the chunked-prefill state grows by {meta['state_bytes_per_token']:,.0f} "
                       "bytes per token of context per sequence (the MLA latent cache; the KDA state is fixed-size).")
    if meta.get("epochs") is not None:
        details.append(f"Data: each run saw {meta['epochs']:.3g} epochs of the {meta['corpus_train_tokens']:,}-token "
                       "training split.")
    found = [eff, ret, direct, clock, short, tcost]
    if "pilot" in summary:  # research: the pilot, then effective context, retrieval and loss beyond the window
        longest = max(meta["lengths"])
        eff_short = eff_compare("short")
        span = sorted({int(k) for r in rows for k in r["passkey"]})

        def floor(a: Mapping[int, float], b: Mapping[int, float], other: str) -> str | None:
            """Retrieval learned somewhere, yet neither arm retrieves here in any run: 0 minus 0 in every seed is
            no measurement of a difference (both sit at the metric's floor)."""
            if why or any(a.values()) or any(b.values()):
                return None
            rest = [s for s in SCHEDULES if s not in ("curriculum", other)]
            return (f"floor: passkey 0.00 at every length in every run of curriculum and {other}, so the difference "
                    f"is not measured; {retrieval_by_arm(rows, rest)}")

        def mean_passkey(other: str) -> report.Finding:
            vals = {sch: {r["seed"]: float(np.mean(list(r["passkey"].values()))) for r in rows
                          if r["schedule"] == sch and r["passkey"]} for sch in ("curriculum", other)}
            return report.compare(f"Mean passkey accuracy over {span[0]:,}-{span[-1]:,} tokens, curriculum minus "
                                  f"{other}", vals["curriculum"], vals[other], lower_is_better=False, digits=2,
                                  precondition=why or floor(vals["curriculum"], vals[other], other))

        pk_direct, pk_short = mean_passkey("direct"), mean_passkey("short")
        beyond = []
        for n in sorted({int(k) for r in rows for k in r["passkey"] if int(k) > longest}, reverse=True):
            pk = {s: {r["seed"]: {int(k): v for k, v in r["passkey"].items()}[n] for r in rows if r["schedule"] == s}
                  for s in ("curriculum", "direct")}
            beyond.append(report.compare(f"Passkey accuracy at {n:,} tokens ({n // longest}x the longest training "
                                         "length), curriculum minus direct", pk["curriculum"], pk["direct"],
                                         lower_is_better=False, digits=2,
                                         precondition=why or floor(pk["curriculum"], pk["direct"], "direct")))
        if all(r.get("loss_beyond") is not None for r in rows):
            beyond.append(report.compare(f"Held-out loss past {longest:,} tokens (loss by position), curriculum "
                                         "minus direct", seeds("curriculum", "loss_beyond"),
                                         seeds("direct", "loss_beyond"), unit="nats"))
        # the question first, then its precondition; the pilot's other recipes go to the details
        pf = pilot_finding(summary["pilot"], summary["pilot_length"], summary.get("pilot_recipes"), variants=False,
                           curve=False)
        ordered = [pk_direct, pf, pk_short, eff, *beyond[:1], *(beyond[-1:] if len(beyond) > 1 else []), direct,
                   eff_short, ret, *beyond[1:-1], short, clock, tcost]
        variants = pilot_variants(summary["pilot"], summary.get("pilot_recipes"))
        own_curve = pilot_curve_text(summary["pilot"])
        timing = curriculum_timing(summary)
        details += [timing] if timing else []
        details += [f"Pilot learning curve (the grid's recipe, at {summary['pilot_length']:,} tokens; the largest "
                    f"budget holds the grid's short runs): passkey by budget: {own_curve}."] if own_curve else []
        details += [f"Pilot variants (earlier recipes, not the grid's): {'; '.join(variants)}."] if variants else []
        found, rest = ordered[:report.MAX_LEAD], ordered[report.MAX_LEAD:]
        details += ["Also: " + "; ".join(f.plain() for f in rest) + "."] if rest else []
    if b.get("synthetic_fixed_per_step"):
        details[0] = (f"Budget: every run trained {', '.join(f'{t:,}' for t in b['tokens_per_run'])} tokens in "
                      f"{b['steps']} steps; in every step of every arm {b['synthetic_share']:.0%} of the sequences "
                      "(and tokens) are retrieval sub-tasks: " + "; ".join(
                          f"{a} " + " -> ".join(f"{st['sequences_per_step']} x {st['seq_len']:,} "
                                                f"({st['retrieval_sequences_per_step']:g} retrieval)"
                                                for st in v["stages"]) for a, v in b["per_step"].items()) + ".")
    return report.Report(found, table, details)


def findings(rep: report.Report) -> str:
    """The findings section (markdown) of :func:`study_report`."""
    return rep.markdown()


NAMES = {"val_loss": "val loss", "effective_context": "effective context", "passkey_mean": "mean passkey accuracy",
         "mqar_acc": "MQAR accuracy"}


def _ms(xs: Sequence[float | None], digits: int) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{np.mean(xs):.{digits}f} ± {np.std(xs, ddof=1):.{digits}f}"


# ------------------------------------------------------------------------------------------ figures


def _colors() -> dict[str, str]:
    return report.palette(SCHEDULES)


def passkey_figure(evals: Mapping[str, Mapping[str, Any]], preset: str) -> Any:
    """One heatmap per schedule: passkey accuracy (mean over seeds) by length (x) and needle depth (y)."""
    from matplotlib.figure import Figure

    longest = plan(preset).lengths[-1]
    fig = Figure(figsize=(3.6 * len(SCHEDULES) + 0.8, 3.4), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(SCHEDULES), squeeze=False, sharey=True)[0]
    im = None
    for k, (ax, s) in enumerate(zip(axes, SCHEDULES)):
        reps = [ev["passkey"] for k, ev in evals.items() if k.rsplit("-s", 1)[0] == s]
        if not reps:
            ax.set_axis_off()
            continue
        acc = np.mean([np.asarray(r["accuracy"]) for r in reps], axis=0).T  # [depth, length]
        lengths, depths = reps[0]["lengths"], reps[0]["depths"]
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], rotation=45, fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        if longest in lengths:
            ax.axvline(lengths.index(longest) + 0.5, color="w", ls="--", lw=1)
        for (i, j), v in np.ndenumerate(acc):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < 0.5 else "k")
        ax.set_title(f"{s} ({len(reps)} seed{'s' * (len(reps) > 1)})", fontsize=9)
        ax.set_xlabel("context length (tokens)")
        if k == 0:
            ax.set_ylabel("needle depth")
    if im is not None:
        fig.colorbar(im, ax=list(axes), shrink=0.8, label="passkey accuracy")
    cells = [np.asarray(ev["passkey"]["accuracy"]) for ev in evals.values()]
    if cells and max(float(c.max()) for c in cells) == 0.0:
        fig.suptitle(f"every cell of every run is 0: retrieval not learned at this scale (chance "
                     f"{chance_passkey():.0e}); the heatmaps carry no signal", fontsize=9, color="firebrick")
    return fig


def accuracy_figure(rows: Sequence[Mapping[str, Any]], preset: str, chance: Mapping[str, float]) -> Any:
    """Passkey accuracy by length (left) and MQAR accuracy by length (right), mean ± std over seeds per schedule."""
    from matplotlib.figure import Figure

    lengths = plan(preset).lengths
    fig = Figure(figsize=(10, 3.8), dpi=100)
    axes = fig.subplots(1, 2)
    colors = _colors()
    for ax, key, title in ((axes[0], "passkey", "passkey"), (axes[1], "mqar", "MQAR")):
        for s in SCHEDULES:
            sel = [r[key] for r in rows if r["schedule"] == s]
            if not sel:
                continue
            sel = [{int(k): v for k, v in d.items()} for d in sel]  # JSON keeps the lengths as strings
            xs = sorted(sel[0])
            ys = np.array([[d[x] for x in xs] for d in sel])
            half = ([report.mean_interval(list(ys[:, j])).high - ys[:, j].mean() for j in range(len(xs))]
                    if len(sel) > 1 else None)  # 95% t interval over seeds
            ax.errorbar(xs, ys.mean(0), yerr=half, marker="o", capsize=3, color=colors[s], label=s)
        for L in lengths:
            ax.axvline(L, color="grey", ls=":", lw=0.8)
        ax.axhline(chance[key], color="k", ls="--", lw=0.8, label="chance")
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(f"{title} accuracy")
        if all(max(r[key].values()) == 0.0 for r in rows if r[key]):
            ax.set_title(f"{title}: 0 in every run and length (chance {chance[key]:.0e}): not learned",
                         fontsize=9, color="firebrick")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def position_figure(evals: Mapping[str, Mapping[str, Any]], preset: str, reference: str = "direct") -> Any:
    """Held-out loss by token position (log-spaced bins) of each schedule minus ``reference``, paired by seed:
    mean over seeds and its 95% t band (``report.step_differences`` over the position bins)."""
    import pandas as pd
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=100)
    ax = fig.subplots()
    colors = _colors()
    long = []
    for k, ev in evals.items():
        arm, seed = k.rsplit("-s", 1)
        c = ev["loss_by_position"]["curves"][0]
        long += [{"arm": arm, "seed": int(seed), "step": math.sqrt(max(a, 1) * b), "loss": y}
                 for a, b, y in zip(c["bin_start"], c["bin_end"], c["loss"])]
    for s, d in report.step_differences(pd.DataFrame(long), reference, "loss").items():
        ax.plot(d["step"], d["mean"], color=colors[s], lw=1.6, marker="o", ms=3, label=f"{s} ({d['n']} seeds)")
        ax.fill_between(d["step"], d["low"], d["high"], color=colors[s], alpha=0.18, lw=0)
    ax.axhline(0.0, color="k", lw=0.8)
    for L in plan(preset).lengths:
        ax.axvline(L, color="grey", ls=":", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("token position")
    ax.set_ylabel(f"loss minus {reference} (nats/token)")
    ax.set_title(f"loss by position: each schedule minus {reference}, 95% band over seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def perf_figure(perf_rows: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]], device: str) -> Any:
    """Left: training tokens/s per (schedule, stage); middle: peak memory per stage (GPU); right: each run's
    training time (``train_s`` where every row has a steady clock, from :func:`summarize`'s rows; else wall-clock)."""
    import pandas as pd
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.8), dpi=100)
    axes = fig.subplots(1, 3)
    colors = _colors()
    df = pd.DataFrame(perf_rows)
    g = df.groupby(["schedule", "stage", "seq_len"], sort=False).agg(
        tps=("tok_per_s", "mean"), tps_sd=("tok_per_s", "std"), mem=("peak_mem_gb", "max")).reset_index()
    labels = [f"{r.schedule}\n{r.seq_len}" for r in g.itertuples()]
    cols = [colors[s] for s in g.schedule]
    axes[0].bar(range(len(g)), g.tps.fillna(0), yerr=g.tps_sd.fillna(0), color=cols, capsize=3)
    axes[0].set_ylabel("training tokens/s")
    mem = g.mem.astype(float)
    axes[1].bar(range(len(g)), mem.fillna(0), color=cols)
    axes[1].set_ylabel("peak memory (GB)")
    if mem.isna().all():
        axes[1].text(0.5, 0.5, "not recorded on CPU", ha="center", va="center", transform=axes[1].transAxes)
    else:
        for i in np.flatnonzero(mem.isna().to_numpy()):  # a stage whose record kept no memory of its own
            axes[1].text(i, 0.02 * float(mem.max()), "not\nrecorded", ha="center", va="bottom", fontsize=7)
    for ax in axes[:2]:
        ax.set_xticks(range(len(g)), labels, fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    steady = bool(rows) and all(r.get("train_clock") == "steady" for r in rows)
    key = "train_s" if steady else "wall_s"
    for i, s in enumerate(SCHEDULES):
        w = [r[key] for r in rows if r["schedule"] == s and r.get(key) is not None]
        if w:
            axes[2].bar(i, np.mean(w), yerr=np.std(w, ddof=1) if len(w) > 1 else 0, color=colors[s], capsize=3)
            axes[2].plot([i] * len(w), w, "k.", ms=4)
    axes[2].set_xticks(range(len(SCHEDULES)), SCHEDULES)
    axes[2].set_ylabel("training time (s): step time x steps" if steady else "training wall-clock (s)")
    axes[2].grid(alpha=0.3, axis="y")
    fig.suptitle(device, fontsize=9)
    fig.tight_layout()
    return fig


def pilot_figure(pilot: Sequence[Mapping[str, Any]], length: int, chance: Mapping[str, float]) -> Any:
    """Passkey accuracy (left), MQAR accuracy (middle) and the passkey answer's NLL per key token (right) at
    ``length`` against training tokens: the pilot with the grid's settings (blue, a line through a monitored run's
    points), each pilot variant (its own colour, labelled by its recipe) and the grid's short runs (green dots);
    dashed: :data:`PILOT_PASSKEY`, chance and a uniform digit's NLL."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.8), dpi=100)
    axes = fig.subplots(1, 3)
    panels = ((axes[0], "passkey", "passkey accuracy"), (axes[1], "mqar", "MQAR accuracy"),
              (axes[2], "passkey_nll", "passkey answer NLL (nats per key token)"))
    variants = sorted({d.get("recipe") or "" for d in pilot if d["source"] == "pilot"} - {""})
    series = [("pilot", "", "tab:blue", "pilot"), ("short", "", "tab:green", "grid's short runs"),
              *(("pilot", v, color, f"pilot {v}") for v, color in
                zip(variants, ("tab:orange", "tab:purple", "tab:brown", "tab:pink")))]
    for ax, key, title in panels:
        for source, recipe, color, label in series:
            pts = sorted((d["tokens"] / 1e6, d[key]) for d in pilot if d["source"] == source
                         and (d.get("recipe") or "") == recipe and d.get(key) is not None)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, "o-" if source == "pilot" else "o", color=color, ms=4, lw=1.0, alpha=0.85,
                        label=label)
        if key == "passkey":
            ax.axhline(PILOT_PASSKEY, color="firebrick", ls="--", lw=0.8, label=f"learned ({PILOT_PASSKEY})")
        if key == "passkey_nll":
            ax.axhline(DIGIT_NLL, color="grey", ls=":", lw=0.8, label="a uniform digit")
        else:
            ax.axhline(chance[key], color="grey", ls=":", lw=0.8, label="chance")
            ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel(f"{title} at {length:,} tokens", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def val_time_figure(grid: common.Grid, preset: str, perf_rows: Sequence[Mapping[str, Any]]) -> Any:
    """Validation loss (longest-length windows) against training time (:func:`train_clock`), every run."""
    from matplotlib.figure import Figure

    sched = schedules(plan(preset))
    st = {(p["schedule"], p["seed"], p["stage"]): p["step_time_s"] for p in perf_rows}
    fig = Figure(figsize=(6.4, 4.2), dpi=100)
    ax = fig.subplots()
    colors = _colors()
    seen = set()
    kinds = set()
    for r in grid.records:
        per_stage = [st.get((r.arm, r.seed, k)) for k in range(len(sched[r.arm]))]
        total, kind = train_clock(sched[r.arm], per_stage, r.summary["wall_s"])
        kinds.add(kind)
        times = step_times(sched[r.arm], per_stage, total)
        pts = sorted((times[int(s)], v) for s, v in r.val_history if 0 < int(s) < len(times))
        if not pts:
            continue
        ax.plot(*zip(*pts), "o-", color=colors[r.arm], ms=3, lw=1, alpha=0.8,
                label=None if r.arm in seen else r.arm)
        seen.add(r.arm)
    ax.set_xlabel("training time (s): median step time x steps, per stage" if kinds == {"steady"}
                  else "estimated training wall-clock (s)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["EvalPlan", "PILOT_PASSKEY", "PRESETS", "Plan", "ROW_KEYS", "SCHEDULES", "STUDY", "accuracy_figure", "arms",
           "arms_factor", "loss_beyond", "pilot_arms", "pilot_eval_settings", "pilot_figure", "pilot_finding",
           "pilot_recipe", "pilot_recipes", "pilot_rows", "retrieval_budget", "train_pilot",
           "by_seed", "chance_passkey", "compare", "equal_time", "eval_lengths", "eval_settings", "evaluate_runs",
           "evaluate_trained", "findings", "paired", "passkey_figure", "perf_figure", "plan", "position_figure",
           "refresh_comparisons", "retrieval_learned", "schedules", "split_steps", "stage_of_window", "stage_perf",
           "stage_step_times", "stage_text", "step_times", "study_report", "summarize", "summary_rows", "train_clock",
           "train_perf", "train_times", "val_time_figure", "value_at_time", "verdict"]
