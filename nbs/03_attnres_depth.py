# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Study 3: Attention Residuals over depth — PreNorm vs Block vs Full AttnRes
#
# With a PreNorm residual every sublayer (each mixer and each FFN) reads the running sum
# $h_l = v_0 + \sum_{i<l} v_i$ of the embedding and all earlier outputs. Full AttnRes replaces the sum by a
# softmax over depth, $h_l = \sum_{i<l} a_{i\to l} v_i$ with $a_{\cdot\to l} = \mathrm{softmax}_i(w_l^\top
# \mathrm{RMSNorm}(v_i))$ and one learned pseudo-query $w_l$ per sublayer (zero at init: a uniform average).
# Block AttnRes groups the $2L$ sublayers into $N$ blocks and attends over the block sums (K3: 8 blocks). The
# AttnRes paper reports, for a 16-layer model, validation loss Full 1.737 < Block 1.746 < PreNorm 1.766, and a gain
# that grows with depth; public reproductions see little gain at ~12 layers and a clear one at 24-48.
#
# This notebook trains the three modes (and Block AttnRes with 2, 4 and 8 blocks) at several depths and measures
# (1) validation loss vs depth with the seed spread, (2) hidden-state and gradient norms by layer, (3) the learned
# depth-attention weights, (4) each mode's cost in tokens/s and memory. **Budget rule: same tokens and same width
# for every run, depth varied; at one depth the modes have the same parameters** (up to the AttnRes pseudo-queries
# and key norms, reported below). The logic is in `moelab.studies.attnres_depth`, the run grid in
# `moelab.studies.common`, the intervals and their wording in `moelab.studies.report`. With `from_results = True` the
# notebook trains nothing: it renders the report from the raw results a run committed in `results/`.

# %% tags=["parameters"]
preset = "cpu"  # "cpu": minutes on 2 cores (all-MLA, width 64); "gpu": gpu-small's hybrid with dense FFNs, one GPU;
# "research": 12 vs 24 layers at width 384, lr swept per mode, 3 seeds, 50M tokens per run (split GPU calls)
out_dir = "."
from_results = False  # True: render from the committed results/ and summary.json instead of training again

# %%
import json
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from moelab.base import repo_root
from moelab.studies import attnres_depth as study
from moelab.studies import common, report
from moelab.utils import write_json

common.quiet_known_noise()  # log noise filtered at its source, before anything imports Lightning

out = Path(out_dir)
(out / "figures").mkdir(parents=True, exist_ok=True)
(out / "results").mkdir(parents=True, exist_ok=True)
research = preset == "research"
plan = study.RESEARCH if research else study.plan(preset)
if research:
    print(f"preset research: base {plan.base} ({plan.notes}); depths {plan.depths}; Block AttnRes with "
          f"{plan.layers_per_block} layers per block; lr sweep {plan.lrs} per mode at {plan.depths[0]} layers (seed "
          f"{plan.sweep_seed}); seeds {plan.seeds}; {plan.tokens_per_run:,} tokens per run")
else:
    print(f"preset {preset}: base {plan.base} ({plan.notes}); depths {plan.depths}; seeds {plan.seeds} for the three "
          f"main modes, {plan.extra_seeds} for the other block counts at depths {plan.extra_depths}")

# %% [markdown]
# ## 1. The arms
# Each arm sets depth, residual mode and block count; the check below resolves every arm's config and fails if
# anything else differs (prenorm and full_attnres keep the preset's `num_blocks`, which they ignore). The main
# Block AttnRes arm at each depth has the largest block count up to 8 that divides the $2L$ sublayers and is below
# $2L$ (at $2L$ blocks it would be Full AttnRes).

# %%
pd.DataFrame(study.research_factor() if research else study.arms_factor(preset))

# %% [markdown]
# ## 2. Training
# One line per finished run; each run's training output goes to `checkpoints/<arm>-s<seed>/train.log`.

# %%
if research:
    # The lr sweep first, then the grids at each mode's winning lr (a split call runs the same study.train).
    grid, picked = (None, None) if from_results else study.train(preset, out)
    table = report.result_table(out / "results" / "runs.csv", lambda: study.research_rows(grid), from_results)
    rows = study.research_rows_from_table(table)
    group = ["role", "n_layers", "residual", "blocks", "lr"]
else:
    grid = None if from_results else study.train(preset, out)
    table = report.result_table(out / "results" / "runs.csv", lambda: study.summary_rows(grid, preset), from_results)
    rows = study.rows_from_table(table)
    group = ["n_layers", "residual", "blocks"]
histories = report.result_table(out / "results" / "loss_histories.csv", lambda: grid.histories(), from_results)
(table.groupby(group, dropna=False, sort=True)
 .agg(val_loss=("val_loss", "mean"), val_loss_std=("val_loss", "std"), seeds=("seed", "nunique"),
      params=("params", "first"), tokens=("tokens", "first"), tok_per_s=("tok_per_s", "mean"),
      peak_mem_gb=("peak_mem_gb", "mean")))

# %% [markdown] tags=["research"]
# ### Research tier: the lr sweep, the loss curves, the depth gain
# Each mode trains at three learning rates at the shallow depth (seed 0); the one with the lowest final validation
# loss is carried to every other run of that mode, so each mode is compared at its own best rate. The depth gain of a
# mode is its validation loss at the deep depth minus the shallow one, seed by seed; the interaction is an AttnRes
# mode's depth gain minus PreNorm's.

# %% tags=["research"]
if research:
    display(common.show(study.lr_sweep_figure(rows), out / "figures" / "lr_sweep.png"))

# %% [markdown] tags=["research"]
# **Figure 1.** Final validation loss against the peak learning rate per mode at the shallow depth (one seed); the
# rate carried to the mode's other runs circled.

# %% tags=["research"]
if research:
    display(common.show(study.research_curves_figure(histories, rows), out / "figures" / "loss_curves.png"))

# %% [markdown] tags=["research"]
# **Figure 2.** Validation loss against training tokens per depth and mode, mean over the 3 seeds with their range as
# a band.

# %% tags=["research"]
if research:
    committed = json.loads((out / "summary.json").read_text()) if from_results else None
    bench = study.benchmark_overhead(repo_root() / "kernels" / "results" / "model_h200.json")
    summary = study.research_summary(grid, rows, bench, meta=committed["meta"] if from_results else None,
                                     overhead=study.read_overhead(out / "results"))
    display(common.show(study.depth_gain_figure(summary), out / "figures" / "depth_gain.png"))

# %% [markdown] tags=["research"]
# **Figure 3.** Left: deep minus shallow validation loss per mode (each seed a dot, the mean with its 95% paired t
# interval). Right: each AttnRes mode's depth gain minus PreNorm's.

# %% tags=["research"]
if research:
    if from_results:
        diag_rows = study.rows_from_table(pd.read_csv(out / "results" / "layer_diagnostics.csv"))
        weights = study.weights_from_json(json.loads((out / "results" / "depth_weights.json").read_text()))
    else:
        diag_rows, weights = study.research_diag_rows(grid)
        pd.DataFrame(diag_rows).to_csv(out / "results" / "layer_diagnostics.csv", index=False)
        write_json(out / "results" / "depth_weights.json", {arm: w.tolist() for arm, w in weights.items()})
    # drawn when the runs measured them (each run does when it finishes): the caption comes with the figure
    if diag_rows:
        display(common.show(study.norms_figure(diag_rows, plan.depths[-1]), out / "figures" / "norms_by_layer.png"))
        display(Markdown("**Figure 4.** At the deep depth, per mode (seed 0, log scale): left, the RMS of each "
                         "sublayer's input; right, the L2 norm of the loss gradient over each sublayer's parameters, "
                         "measured by each run when it finished."))
    if weights:
        display(common.show(study.depth_weights_figure(weights, {a: a for a in weights}),
                            out / "figures" / "depth_weights.png"))
        display(Markdown(f"**Figure {5 if diag_rows else 4}.** Learned depth-attention weights of each AttnRes run "
                         "(seed 0): row $l$ is the read before sublayer $l$, column $i$ its source, colour the weight "
                         "averaged over validation tokens."))
    findings = study.research_report(summary, rows)
    summary = report.attach(summary, findings, from_results)
    write_json(out / "summary.json", summary)

# %% tags=["quick"]
if not research:
    deepest = max(plan.depths)
    deep = histories[histories.arm.str.endswith(f"-L{deepest}")]
    title = f"{plan.base}, {deepest} layers: training loss minus prenorm's"
    display(common.show(report.difference_figure(deep, f"prenorm-L{deepest}", title),
                        out / "figures" / "training_loss.png"))

# %% [markdown] tags=["quick"]
# **Figure 1.** At the deepest depth, each AttnRes arm's training loss minus prenorm's, seed by seed (same seed:
# same initialization of the shared parts and the same data order), smoothed over 4 steps; line: mean over seeds,
# band: its 95% t interval; diamonds: the validation loss differences with their intervals (`blockN-L*` = Block
# AttnRes with N blocks, `full-L*` = Full AttnRes; the extra block counts ran one seed: no band). Below 0: lower
# loss than prenorm. The y axis spans the 2-98% range of the bands after the first quarter of the steps.

# %% [markdown] tags=["quick"]
# ## 3. Validation loss vs depth
# The verdicts in the findings compare arms seed by seed (the same seed gives the same data order, so what a seed
# does to every arm alike drops out), each difference with the 95% Student t interval of the per-seed differences:
# better or worse only when that interval excludes 0, inside the noise otherwise.

# %% tags=["quick"]
if not research:
    display(common.show(study.loss_vs_depth_figure(rows), out / "figures" / "loss_vs_depth.png"))

# %% [markdown] tags=["quick"]
# **Figure 2.** Left: final validation loss (nats/token) vs number of layers (log scale), mean over seeds with its
# 95% t interval as error bars and each seed as a dot, for prenorm, Block AttnRes with the main block
# count and Full AttnRes; open squares: Block AttnRes with other block counts (one seed). Right: the gain over
# prenorm, `val_loss(prenorm) − val_loss(mode)` computed seed by seed (same seed = same data order), mean and its
# 95% t interval.

# %% [markdown] tags=["quick"]
# ## 4. Hidden-state and gradient norms by layer, learned depth attention
# For the first seed of every arm: one forward and backward pass of the trained model on validation windows.

# %% tags=["quick"]
if not research:
    if from_results:
        diag_rows = study.rows_from_table(pd.read_csv(out / "results" / "layer_diagnostics.csv"))
        weights = study.weights_from_json(json.loads((out / "results" / "depth_weights.json").read_text()))
    else:
        diag_rows, weights = study.collect_diagnostics(grid, preset)
        pd.DataFrame(diag_rows).to_csv(out / "results" / "layer_diagnostics.csv", index=False)
        write_json(out / "results" / "depth_weights.json", {arm: w.tolist() for arm, w in weights.items()})
    display(common.show(study.norms_figure(diag_rows, deepest), out / "figures" / "norms_by_layer.png"))

# %% [markdown] tags=["quick"]
# **Figure 3.** At the deepest depth, per arm (log scale): left, the RMS of each sublayer's input $h_l$ (the last
# point is the stream the final norm reads); right, the L2 norm of the loss gradient over each sublayer's
# parameters (its pre-norm and its mixer or FFN). Under PreNorm the stream is a growing sum, so later sublayers
# add a shrinking share to it; AttnRes keeps $h_l$ a convex mix of the sources.

# %% tags=["quick"]
if not research:
    labels = {a: f"{a}: {study.mode_label(r['residual'], r['blocks'])}, {r['n_layers']} layers"
              for a, r in {r["arm"]: r for r in rows}.items()}
    deep_weights = {a: w for a, w in weights.items() if a.endswith(f"-L{deepest}")}
    display(common.show(study.depth_weights_figure(deep_weights, labels), out / "figures" / "depth_weights.png"))

# %% [markdown] tags=["quick"]
# **Figure 4.** Learned depth-attention weights at the deepest depth (first seed), one panel per AttnRes arm: row
# $l$ is the read before sublayer $l$ (the last row: the final read before the LM head), column $i$ its source
# (0 = the embedding, then the block sums or, for Full AttnRes, the sublayer outputs), colour the weight averaged
# over the validation tokens. Blank cells are sources that do not exist yet at that read. At initialization every
# row is uniform over its sources.

# %% [markdown] tags=["quick"]
# ## 5. Overhead: tokens/s and peak memory relative to prenorm

# %% tags=["quick"]
if not research:
    committed = json.loads((out / "summary.json").read_text()) if from_results else None
    device = committed["meta"]["device"] if from_results else common.device_name()
    over = study.overhead(rows)
    display(common.show(study.overhead_figure(over, device), out / "figures" / "overhead.png"))

# %% [markdown] tags=["quick"]
# **Figure 5.** Training throughput (median tokens/s over the logging windows after the first, which holds the
# compilation) and peak GPU memory of each AttnRes arm divided by prenorm's at the same depth, mean over seeds; 1
# is prenorm's cost. On a CPU the depth softmax runs as plain PyTorch and memory is not recorded, so the bars do not
# say what the fused op costs on a GPU.

# %% tags=["quick"]
if not research:
    summary = (study.refresh_verdicts(committed, rows) if from_results
               else study.summarize(grid, rows, diag_rows, preset))
    findings = study.study_report(summary, rows)
    summary = report.attach(summary, findings, from_results)
    write_json(out / "summary.json", summary)
    facts = ("commit", "dirty", "device", "torch", "triton", "command", "date", "wall_s", "tokens_per_run", "epochs",
             "runs", "runs_skipped")
    display(pd.Series({k: str(summary["meta"][k]) for k in facts}, name="run facts").to_frame())

# %% [markdown]
# ## Findings

# %%
display(Markdown(findings.markdown() if research else study.findings(findings)))
