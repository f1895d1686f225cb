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
# # Study 1: the lower-bounded decay — where the kernel overflows, what the bound costs, what it buys
#
# KDA's chunked kernels need the gated scores $q_i^\top \mathrm{diag}(e^{G_i - G_j})\, k_j$ inside each chunk,
# where $G$ is the cumulative sum of the per-token log decay $g \le 0$. moelab's bounded kernel forms each
# diagonal 16-token sub-tile as one tensor-core product $(q \odot e^{G - G_r})(k \odot e^{G_r - G})^\top$, with
# the reference $G_r$ placed by the bound the op is told (forward: $G$ before the sub-tile plus $8 g_{min}$;
# backward: $G$ at row 7), so the factors $e^{\pm(G - G_r)}$ must stay finite. K3 bounds
# the decay, $g = g_{min}\,\sigma(\cdot)$ with $g_{min} = -5$; Kimi Linear's softplus gate does not. This notebook
# measures (1) where the kernel's sub-tile breaks, modelled and on the real Triton op; (2) language models that
# differ only in the gate (bounded at $-5$, $-2$, $-1$; softplus), several seeds each: loss, how close the decay
# comes to the bound, the cumulative decay per sub-tile, and loss past the training length (NoPE extrapolation);
# (3) a task that needs fast forgetting; (4) kernel speed. Logic: `moelab.studies.decay_bound`; run grid:
# `moelab.studies.common`; intervals and wording: `moelab.studies.report`. With `from_results = True` the notebook
# trains nothing: it renders the report from the raw results a run committed in `results/` (figures that need the
# trained models are shown as that run drew them).
#
# With `preset = "research"` (the dose-response tier: bounds $-0.25$, $-0.5$, $-1$, $-5$ and softplus, 3 seeds, one
# epoch each) the notebook needs no GPU: the runs come from their committed records (split GPU calls trained them),
# and every GPU-bound measurement is a standalone command whose raw JSON in `results/` this notebook reads
# (`python -m moelab.studies.decay_bound speed|overflow|forgetting`); a part whose file is missing is reported as not
# measured. Section 6 shows the research tier's own figures and its findings lead with the precondition.

# %% tags=["parameters"]
preset = "cpu"  # "cpu": minutes on 2 cores; "gpu": the gpu-small model on one GPU; "research": split GPU calls
out_dir = "."
from_results = False  # True: render from the committed results/ instead of training and measuring again

# %%
import json
import os

import torch

if not torch.cuda.is_available():  # the Triton kernels run in the interpreter; chosen before their first import
    os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402
from IPython.display import Markdown, display  # noqa: E402

from moelab.studies import (
    common,  # noqa: E402
    report,  # noqa: E402
)
from moelab.studies import decay_bound as study  # noqa: E402
from moelab.utils import write_json  # noqa: E402

common.quiet_known_noise()  # log noise filtered at its source, before anything imports Lightning

out = Path(out_dir)
(out / "figures").mkdir(parents=True, exist_ok=True)
(out / "results").mkdir(parents=True, exist_ok=True)
P = study.PRESETS[preset]
research = preset == "research"  # the GPU parts are standalone commands: their files are read, not measured here
parts = study.research_parts(out / "results") if research else {}
for part, data in parts.items():
    print(f"{part}: " + (f"{study.RESEARCH_FILES[part]} ({data['meta'].get('gpu')}, {data['meta'].get('date')})"
                         if data else study.not_measured(part)))
if common.split_from_env() is not None:  # a split call (RUNS=/SHARD=) trains its runs first, then stops at the grid
    study.train(preset, out)

# %% [markdown]
# ## 1. Where the bounded kernel's sub-tile overflows
# Left: the sub-tile modelled as the forward kernel computes it (`study.kernel_tile`): $G$ (each row's own decay
# included) and the factors in fp32, shifted by $G$ before the sub-tile plus $8 g_{min}$, with $g_{min}$ the bound
# the op is *told*, not the data; the products' operands in the precision the kernel picks (fp32 inputs: fp32;
# bf16, fp16: TF32), against an exact fp64 element-wise tile. Two decays per swept value: $g = g_{min}$ on every
# channel of every token (the worst case) and $g$ uniform in $[g_{min}, 0]$; two promises: the op told $-5$ with its
# input check off (decays below it break the promise: row 15's $k$ factor holds $e^{16|g| - 8 \cdot 5}$), and the op
# told each decay's own $g_{min}$ (the promise kept, below the op's floor: $e^{8|g|}$). Right: the real Triton op
# in bounded mode on the same cases, against the fp32 token recurrence.

# %%
overflow = report.result_table(out / "results" / "tile_overflow.csv", study.tile_overflow_table, from_results)
if research:  # the op's rows from the standalone part's file (`python -m moelab.studies.decay_bound overflow`)
    kernel_rows = list(parts["overflow"]["synthetic"]) if parts["overflow"] else []
elif from_results:  # the op's rows as the run wrote them: synthetic decays, then the trained softplus decays
    saved_kernel_rows = pd.read_csv(out / "results" / "kernel_overflow.csv").to_dict("records")
    kernel_rows = [r for r in saved_kernel_rows if r["source"].startswith("synthetic")]
else:
    kernel_rows = study.kernel_overflow_rows(P["overflow_g_mins"], P["overflow_shape"])
    pd.DataFrame(kernel_rows).to_csv(out / "results" / "kernel_overflow.csv", index=False)
common.show(study.overflow_figure(overflow.to_dict("records"), kernel_rows), out / "figures" / "tile_overflow.png")

# %% [markdown]
# **Figure 1.** Left: relative RMS error of the modelled diagonal sub-tile vs $|g_{min}|$ (a line that stops has
# overflowed). Right: relative error of the op's output $o$ in bounded mode (markers), crosses where it has
# non-finite entries, dotted the general mode (element-wise diagonal sub-tiles) on the same inputs. Vertical lines:
# the constant decay at which a factor leaves fp32's exponent range (`study.constant_overflow_g`; dashed: told
# $-5$, solid: told its own bound); the values follow the table.

# %%
Markdown(study.overflow_text(overflow, kernel_rows))

# %%
pd.Series(study.safe_bounds(overflow), name="g_min").to_frame()  # most negative finite within 1%; first non-finite

# %% [markdown]
# ## 2. Language models that differ only in the gate
# **Matched initialization.** Both gates start with $A = 0$ (rate 1) and each channel's bias $b$ of the gate input
# $z = W_{up} W_{down} x + b$ set so that $g(b) = -dt$, with $dt$ log-uniform in $[10^{-3}, 0.1]$ from the same
# $H \cdot K$ random numbers: softplus $b = \mathrm{softplus}^{-1}(dt)$, bounded $b = \mathrm{logit}(dt/|g_{min}|)$.
# The slopes $\partial g / \partial z$ at $b$ agree to first order in $dt$ too. The gate draws the same random
# numbers whatever its kind, so with one seed every other parameter is bitwise equal (checked below and by
# `tests/studies/test_decay_bound.py`), and the data order depends on the seed only. The arms differ in the
# two config keys below (checked on the resolved configs); softplus ignores `g_min`.

# %%
pd.DataFrame(study.arms_factor(preset))

# %%
init = study.build_arm_models(preset, seed=0)
gate_names = study.gate_parameter_names(init["softplus"])
first = dict(init["softplus"].named_parameters())
same = {arm: all(torch.equal(p, first[n]) for n, p in m.named_parameters() if n not in gate_names)
        for arm, m in init.items()}
ids0 = torch.randint(0, init["softplus"].cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
g0 = {arm: torch.cat([g.flatten() for g in study.collect_log_decay(m, ids0).values()]) for arm, m in init.items()}
del init
pd.DataFrame({arm: {"non-gate parameters bitwise equal to softplus's": same[arm],
                    **{f"g at step 0, q{int(100 * q)}": float(g.quantile(q)) for q in (0.01, 0.5, 0.99)}}
              for arm, g in g0.items()}).T

# %%
grid = study.train(preset, out) if research or not from_results else None  # research: read from its records
runs = report.result_table(out / "results" / "runs.csv", lambda: grid.table(), from_results)
histories = report.result_table(out / "results" / "loss_histories.csv", lambda: grid.histories(), from_results)
common.aggregate(runs)[list(common.STUDY_METRICS) + ["n_seeds"]]

# %%
common.show(report.difference_figure(histories, "softplus", f"{P['base']}: training loss minus softplus's"),
            out / "figures" / "training_loss.png")

# %% [markdown]
# **Figure 2.** Each bounded arm's training loss minus the softplus arm's, seed by seed (same seed: same
# initialization and data order), smoothed over 5 steps; line: mean over seeds, band: its 95% t interval;
# diamonds: the validation loss differences with their intervals. Below 0: lower loss than softplus. Only the gate
# differs. The y axis spans the 2-98% range of the bands after the first quarter of the steps (the arms part and
# meet again within a few steps near step 20; that spike is cut).

# %%
if from_results:
    decay, pooled = pd.read_csv(out / "results" / "trained_decay_stats.csv"), None
else:
    decay_list, pooled = study.gate_decay_rows(grid)
    decay = pd.DataFrame(decay_list)
    decay.to_csv(out / "results" / "trained_decay_stats.csv", index=False)
decay.groupby("arm", sort=False)[["bound", "g_min", "frac_channels_near_bound", "frac_entries_near_bound",
                                  "tile_decay_q50", "tile_decay_q99", "tile_decay_max", "max_factor_exponent"]].agg(
    {"bound": "first", "g_min": "min", "frac_channels_near_bound": "mean", "frac_entries_near_bound": "mean",
     "tile_decay_q50": "mean", "tile_decay_q99": "max", "tile_decay_max": "max", "max_factor_exponent": "max"})

# %% [markdown]
# The table: per arm, over seeds and KDA layers, on validation windows of the training length (measured at the end
# of each training run, with the training's precision: bf16 autocast on a GPU): the most negative
# log decay $g$; the share of channels (layer, head, channel) whose most negative $g$ is within 5% of the arm's bound
# (softplus: of $-5$), mean over models; the same share of all (token, channel) entries; the median and 99th
# percentile of the cumulative decay $-\sum g$ over a 16-token sub-tile and its maximum; the largest exponent a
# factor of the bounded backward's sub-tile would hold ($|G_i - G_7|$; fp32 overflows above $\ln$ of its largest
# value, `study.EXP_LIMIT["fp32"]`).

# %%
if pooled is None:  # the pooled tile decays live in the trained runs, not in results/
    figure = report.committed_figure(out / "figures" / "tile_decay.png")
else:
    figure = common.show(study.tile_decay_figure(pooled["tile_decay"]), out / "figures" / "tile_decay.png")
figure

# %% [markdown]
# **Figure 3.** Distribution of the cumulative decay over one 16-token sub-tile, $-\sum_{t \in tile} g_t$, per
# arm (pooled over seeds, layers, heads, channels; share of tiles above x). A bounded arm cannot pass
# $16 |g_{min}|$. The vertical line, 177 nats, is twice fp32's exponent range: a constant decay that large puts
# 88.7 nats on either side of row 7.
#
# **The trained softplus decays on the real kernel.** Each softplus model's log decays (one validation window,
# each layer; a run's record keeps its first `REAL_G_TOKENS` tokens in bf16, 1024 fp32 tokens before the split
# records) fed to the Triton op in bounded mode (check off), with random unit q, k, values and beta:

# %%
if research:  # measured by the overflow part on the decays the softplus records keep (seed 0: P["real_g_seeds"])
    real_rows = list(parts["overflow"]["trained"]) if parts["overflow"] else []
elif from_results:
    real_rows = [r for r in saved_kernel_rows if not r["source"].startswith("synthetic")]
else:
    real_rows = study.real_g_kernel_rows(pooled["real_g"], max_tokens=P["overflow_shape"][1])
kernel_rows += real_rows
pd.DataFrame(kernel_rows).to_csv(out / "results" / "kernel_overflow.csv", index=False)
(pd.DataFrame(real_rows)[["source", "g_min", "nonfinite", "rel_err", "rel_err_general", "dtype"]] if real_rows
 else Markdown(study.not_measured("overflow")))

# %% [markdown]
# ## 3. When the model wants fast forgetting
# Language modelling at this scale keeps the decays far from any bound. Here the targets are the outputs of a KDA
# recurrence that forgets at $g = -8$ per token on half the channels ($e^{-8} = 3 \cdot 10^{-4}$) and at
# $-0.05$ on the rest; a student learns one gate bias per channel from $g = -0.05$, with each gate.

# %%
if research:  # the standalone part's rows (`python -m moelab.studies.decay_bound forgetting`), with plateau flags
    forgetting = pd.DataFrame(parts["forgetting"]["rows"]) if parts["forgetting"] else None
else:
    forgetting = report.result_table(
        out / "results" / "fast_forgetting.csv",
        lambda: study.fast_forgetting(study.forgetting_bounds(preset), steps=P["forget_steps"],
                                      seeds=P["forget_seeds"]),
        from_results)
cols = ["bound", "g_fast_min", "g_fast_mean", "g_slow_mean", "frac_fast_near_bound", "first_loss", "final_loss"]
if forgetting is None:
    display(Markdown(study.not_measured("forgetting")))
else:
    cols = [c for c in [*cols, "last20_change"] if c in forgetting]
    display(forgetting.groupby("arm", sort=False)[cols].agg(["mean", "std"]))

# %% [markdown]
# ## 4. NoPE length extrapolation
# Every trained model reads validation windows 4x its training context (`MoELab.prefill` in pieces of the
# training length; the KDA state and the MLA latent cache carry across pieces; the MLA layers have no positional
# encoding), at the end of its training run, like the decay statistics above. The model is causal, so the 1x and
# 2x evaluations are the first quarter and half of the same windows.

# %%
extra = report.result_table(out / "results" / "extrapolation.csv", lambda: study.extrapolation_rows(grid), from_results)
extra_summary = report.result_table(out / "results" / "extrapolation_summary.csv",
                                    lambda: study.extrapolation_summary(extra), from_results)
common.show(study.extrapolation_figure(extra), out / "figures" / "extrapolation.png")

# %% [markdown]
# **Figure 4.** Validation loss by position (16 bins over 4x the training context; x: position over the training
# length) of each bounded arm minus softplus's, paired by seed: mean over seeds and its 95% t band. Dotted lines: 1x
# and 2x the training context.

# %%
extra_summary.groupby("arm", sort=False)[["loss_1x", "loss_1_2x", "loss_2_4x", "d_2x", "d_4x"]].agg(["mean", "std"])

# %% [markdown]
# ## 5. Kernel speed: bounded vs general vs fla vs flash attention
# Read from the committed H200 benchmarks (`make kda-bench` writes them); the study does not re-run them.

# %%
if from_results:  # the benchmark rows the run read, and their source as its summary recorded it
    speed_rows = pd.read_csv(out / "results" / "kernel_speed.csv").to_dict("records")
    speed_source = json.loads((out / "summary.json").read_text())["meta"]["kernel_results"]
else:
    speed_rows, speed_source = study.kernel_speed()
print(study.describe_source(speed_source))
ratios = study.speed_ratios(speed_rows)
pd.DataFrame(speed_rows).to_csv(out / "results" / "kernel_speed.csv", index=False)
crossover = study.crossover_length(ratios)
common.show(study.speed_figure(ratios, speed_source, crossover), out / "figures" / "kernel_speed.png")

# %% [markdown]
# **Figure 5.** Forward+backward time of each implementation divided by moelab's bounded path, by sequence
# length (16 heads of dimension 128, bf16; B = 8, 1, 2 at T = 4K, 32K, 64K, B = 1 beyond): moelab's general path,
# fla's `chunk_kda` with its safe gate and with softplus (left axis), causal SDPA on the flash backend (dashed,
# right axis; the red line: where it becomes slower than bounded KDA, interpolated linearly in T).

# %% [markdown]
# ## 6. Research tier: does each bound bind, what does it cost, what does it buy end to end
# (Only with `preset = "research"`; the other presets skip these cells.) The decay monitored during training (every
# 100 steps on two fixed validation windows, bf16 as trained): the most negative $g$ over layers against each arm's
# bound, and the largest layer's share of channels whose most negative $g$ is within 5% of the bound (the
# precondition of the cost question: a bound that never binds cannot cost anything).

# %%
if research:
    traj = grid.trajectories()
    traj.to_csv(out / "results" / "decay_trajectory.csv", index=False)
    display(common.show(study.trajectory_figure(traj), out / "figures" / "decay_trajectory.png"))
    display(Markdown("**Figure 6.** The decay during training per run (thin) and mean over seeds (bold), dashed each "
                     "arm's bound: left the most negative $g$ over layers, right the largest layer's share of channels "
                     "within 5% of the bound."))
    display(Markdown(study.binds_finding(decay).line()))
    display(common.show(study.histogram_figure(study.final_histograms(grid)), out / "figures" / "decay_histogram.png"))
    display(Markdown("**Figure 7.** The share of log-decay entries per $|g|$ bin at the last monitored step (mean over "
                     "seeds)."))

# %% [markdown]
# Then the loss cost of each bound, the end-to-end speed of an all-KDA model, and the op's error of $o$ vs the swept
# $g$ (the overflow part; "non-finite": the output holds inf or NaN).

# %%
if research:
    display(common.show(study.cost_figure(study.cost_findings(runs, decay), study.cost_arms(decay)),
                        out / "figures" / "bound_cost.png"))
    display(Markdown("**Figure 8.** The loss cost of each bound: best validation loss minus softplus's, paired by "
                     "seed, 95% t interval (hollow: the bound never binds, so not tested)."))
    if parts["speed"]:
        display(common.show(study.e2e_speed_figure(parts["speed"]), out / "figures" / "e2e_speed.png"))
        display(Markdown("**Figure 9.** End-to-end training speed of an all-KDA model, bounded over softplus "
                         "tokens/s: every paired round, the median and the rounds' range, per sequence length."))
    display(study.overflow_error_table(parts["overflow"]["synthetic"]) if parts["overflow"]
            else Markdown(study.not_measured("overflow")))
    if not parts["speed"]:
        display(Markdown(study.not_measured("speed")))

# %%
if research:
    summary = study.research_summary(grid, runs, decay, parts, preset, kernel_results=speed_source)
    findings = study.research_report(summary, runs, decay, parts)
elif from_results:
    summary = json.loads((out / "summary.json").read_text())
    findings = study.study_report(summary, runs, decay, extra_summary, forgetting)
else:
    summary = study.summarize(overflow, kernel_rows, grid, decay, extra_summary, forgetting, ratios, speed_source,
                              preset)
    findings = study.study_report(summary, runs, decay, extra_summary, forgetting)
summary = report.attach(summary, findings, from_results)
write_json(out / "summary.json", summary)
pd.Series({k: str(summary["meta"][k]) for k in ("commit", "dirty", "device", "torch", "triton", "command", "date",
                                                "wall_s", "tokens_per_run", "epochs")}, name="run facts").to_frame()

# %% [markdown]
# ## Findings

# %%
Markdown(study.findings(findings))
