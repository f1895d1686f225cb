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
# # Study 4: context curriculum — effective context, not nominal window
#
# The report trains at 8K → 64K → 256K → 1M tokens, each stage starting from the previous one, with long
# training data synthesized by permuting and concatenating documents, and it judges a model by its **effective
# context**: the longest length at which retrieval still works, not the window it was trained at. Here the
# question is whether such a curriculum beats the obvious alternatives **at the same total tokens**: training every
# step at the longest length (direct), or only at the shortest (short).
#
# Three schedules, same steps, same tokens per optimizer step (the micro-batch shrinks as the sequences grow), same
# learning-rate schedule across stages, same data mix (document packs with a share of passkey / MQAR sub-tasks in
# every stage). The documents of a pack are kept apart (`data.document_mask`): the KDA state, its convolutions and
# MLA attention restart at every boundary, through the packed-sequence (`cu_seqlens`) kernels, so a longer stage
# gives longer documents room, never another document's text as context. Validation reads windows of the longest
# length in every arm, documents kept apart the same way. Each trained model then runs the
# evaluation suite: passkey over lengths × needle depths up to 4× the longest training length (beyond the window by
# chunked prefill), multi-query associative recall (MQAR), loss by token position. The logic is in
# `moelab.studies.context_curriculum`, the run grid in `moelab.studies.common`, the tasks in `moelab.eval`, the
# intervals and their wording in `moelab.studies.report`. With `from_results = True` the notebook trains nothing: it
# renders the report from the raw results a run committed in `results/` and `summary.json` (the one figure that
# needs the training runs themselves, validation loss against wall-clock, is shown as that run drew it).

# %% tags=["parameters"]
preset = "cpu"  # "cpu": minutes on 2 cores (all-MLA, width 64, 256 -> 2048); "gpu": gpu-small, 1K -> 16K, one H200;
# "research": gpu-small at 4 layers, 1K -> 8K, 65,536 tokens per step in every arm, 25% retrieval per step, pilot
# first (split calls, RUNS=)
out_dir = "."
from_results = False  # True: render from the committed results/ and summary.json instead of training again

# %%
import json
from pathlib import Path

import pandas as pd
from IPython.display import Markdown, display

from moelab.studies import common, induction, report
from moelab.studies import context_curriculum as study
from moelab.utils import write_json

common.quiet_known_noise()  # log noise filtered at its source, before anything imports Lightning

out = Path(out_dir)
(out / "figures").mkdir(parents=True, exist_ok=True)
(out / "results").mkdir(parents=True, exist_ok=True)
plan = study.plan(preset)
retrieval = (f"{plan.synthetic_batch_share:.0%} of every micro-batch's sequences are retrieval sub-tasks"
             if plan.synthetic_batch_share else f"{plan.synthetic:.0%} retrieval sub-tasks in every stage (drawn per "
             "sequence)")
print(f"preset {preset}: base {plan.base} ({plan.notes}); seeds {plan.seeds}; {retrieval}")

# %% [markdown]
# ## 1. The arms
# Each arm sets only `data.curriculum` (its stages: length, steps, data mix); the check resolves every arm's config
# and fails if anything else differs.

# %%
pd.DataFrame([{"schedule": s, "stages (length x steps)": study.stage_text(st)}
              for s, st in study.schedules(plan).items()]).set_index("schedule")

# %%
study.arms_factor(preset).keys()

# %%
pd.DataFrame([{"schedule": a, "length": st["seq_len"], "tokens per step": st["tokens_per_step"],
               "sequences per step": st["sequences_per_step"],
               "retrieval sequences per step": st["retrieval_sequences_per_step"],
               "retrieval share of the tokens": st["retrieval_share"], "training MQAR pairs": st["mqar_pairs"]}
              for a, v in study.retrieval_budget(preset).items() for st in v["stages"]])

# %% [markdown] tags=["research"]
# ### Pilot (research preset): is retrieval learnable at this size?
# The short schedule (seed 0) with the grid's recipe, measuring passkey and MQAR at its own length every few
# steps while it trains (its learning curve) and once more at the end; the grid's short runs are the points at
# the grid's budget; pilot variants (other recipes, each named by its steps and suffix) draw their own curves.
# Trained first, so a split call can run it alone (`RUNS=pilot4096:0`).

# %% tags=["research"]
pilot_grids = [] if from_results or not plan.pilot_steps else study.train_pilot(preset, out)

# %% [markdown]
# ## 2. Training
# One line per finished run; each run's training output goes to `checkpoints/<schedule>-s<seed>/train.log`.

# %%
grid = None if from_results else study.train(preset, out)
histories = report.result_table(out / "results" / "loss_histories.csv", lambda: grid.histories(), from_results)
common.show(report.difference_figure(histories, "direct", f"{plan.base}: validation loss minus direct's, equal tokens",
                                     metric="val/loss", window=1, skip=0.0),
            out / "figures" / "training_loss.png")

# %% [markdown]
# **Figure 1.** Validation loss (windows of the longest length, the same for every schedule) of each schedule minus
# direct's, seed by seed (same seed: same initialization and data order); line: mean over seeds, band: its 95% t
# interval. Below 0: lower loss than direct at the same step, hence the same tokens. Training losses are not
# compared: each is on its schedule's own sequence length.

# %% [markdown]
# ## 3. Evaluation: passkey, MQAR, loss by position
# Every run's final model, evaluated by `moelab.eval` in its training process when training ends (the reports travel
# in the run's record; lengths beyond the training window in pieces of the window, carrying the KDA state and the
# MLA latent cache). One line per run.

# %%
if from_results:
    evals = json.loads((out / "results" / "eval.json").read_text())
    committed = study.refresh_comparisons(json.loads((out / "summary.json").read_text()))
    rows = committed["rows"]
else:
    evals = study.evaluate_runs(grid, preset)
    write_json(out / "results" / "eval.json", evals)
    rows = study.summary_rows(grid, preset, evals)
    pd.DataFrame(rows).to_csv(out / "results" / "runs.csv", index=False)
table = pd.DataFrame(rows)
table[["schedule", "seed", "stages", "tokens", "wall_s", "val_loss", "effective_context", "mqar_acc"]]

# %%
(table.groupby("schedule", sort=False)
 .agg(val_loss=("val_loss", "mean"), val_loss_std=("val_loss", "std"), effective_context=("effective_context", "mean"),
      mqar_acc=("mqar_acc", "mean"), mqar_acc_std=("mqar_acc", "std"), wall_s=("wall_s", "mean"),
      seeds=("seed", "nunique")))

# %%
common.show(study.passkey_figure(evals, preset), out / "figures" / "passkey_heatmaps.png")

# %% [markdown]
# **Figure 2.** Passkey accuracy (share of samples whose whole key greedy decoding reproduces; mean over seeds) by
# context length (x) and needle depth (y: 0 = right after the prompt, 1 = just before the question), one panel per
# schedule. The dashed white line marks the longest training length; to its right the model runs beyond every
# sequence it trained on. Effective context = the longest length at which this and every shorter length reach 90%
# accuracy averaged over depths.

# %% tags=["research"]
if from_results:
    pilot = committed.get("pilot")
else:
    pilot = study.pilot_rows(pilot_grids, rows, preset) if plan.pilot_steps else None
if pilot is not None:
    display(common.show(study.pilot_figure(pilot, plan.lengths[0], {"passkey": study.chance_passkey(),
                                                                   "mqar": 1 / max(2, study._mqar_values(preset))}),
                        out / "figures" / "pilot.png"))

# %% [markdown] tags=["research"]
# **Figure 2b.** Pilot: passkey accuracy (left), MQAR accuracy (middle) and the passkey answer's NLL per key
# token (right) at the short schedule's own length against training tokens; blue: the pilot run's learning curve,
# green: the grid's short runs (one dot per seed); dashed red: the 0.9 the pilot asks for; dotted: chance and a
# uniform digit's NLL. Below 0.9 at every budget, the effective-context comparisons are "not tested".

# %% tags=["research"]
probe = induction.load()  # the committed toy probe (python -m moelab.studies.induction)
if probe is not None:  # its caption comes with it: the figure is drawn only where the file is
    display(pd.DataFrame(induction.table(probe)).set_index("arm"))
    display(common.show(induction.figure(probe), out / "figures" / "induction_probe.png"))
    display(Markdown(induction.caption(probe)))

# %%
summary = committed if from_results else study.summarize(grid, rows, study.stage_perf(grid, preset), evals, preset,
                                                         pilot=pilot, pilot_grids=pilot_grids)
common.show(study.accuracy_figure(rows, preset, summary["chance"]), out / "figures" / "retrieval_by_length.png")

# %% [markdown]
# **Figure 3.** Left: passkey accuracy by context length, averaged over depths; right: MQAR accuracy (share of
# queries whose value is the argmax) by length; mean over seeds with its 95% t interval as error bars.
# Dotted lines: the curriculum's stage lengths; dashed: chance.

# %%
common.show(study.position_figure(evals, preset), out / "figures" / "loss_by_position.png")

# %% [markdown]
# **Figure 4.** Held-out next-token loss by position in windows of 4× the longest training length (log-spaced
# position bins) of each schedule minus direct's, paired by seed: mean over seeds and its 95% t band. Dotted lines:
# the stage lengths. Below 0: the schedule predicts tokens at that position better than direct training.

# %% [markdown]
# ## 4. Cost: tokens/s and memory per stage, training time per schedule

# %%
perf = pd.DataFrame(summary["stage_perf"])
perf.to_csv(out / "results" / "stage_perf.csv", index=False)
common.show(study.perf_figure(summary["stage_perf"], summary["rows"],
                              summary["meta"].get("train_device") or summary["meta"]["device"]),
            out / "figures" / "cost.png")

# %% [markdown]
# **Figure 5.** Left: training tokens/s per stage (median of the logging windows inside the stage, the run's first
# window left out as it holds compilation; mean over seeds); middle: peak GPU memory per stage; right: training
# time per schedule (bars: mean; dots: seeds): each stage's median step time x its steps, so the
# compilation that a process's first run pays and validation are left out (the measured wall-clock where a stage
# was too short to time). Tokens per step are the same in every stage, so tokens/s
# differences are the cost of the sequence length. On a CPU shared with other jobs these numbers are not meaningful
# (plain-PyTorch attention, other load) and memory is not recorded.

# %%
if from_results:  # needs the runs' validation curves placed in time, which live in the training runs
    figure = report.committed_figure(out / "figures" / "val_vs_wall_clock.png")
else:
    figure = common.show(study.val_time_figure(grid, preset, summary["stage_perf"]),
                         out / "figures" / "val_vs_wall_clock.png")
figure

# %% [markdown]
# **Figure 6.** Validation loss (longest-length windows) against estimated training wall-clock, every run: each
# step placed at its stage's measured step time, scaled to the run's wall-clock. The equal-wall-clock verdict reads
# the slower schedule's curve at the time the faster one finished (before its learning rate had decayed, which
# favours the faster schedule).

# %% [markdown]
# ## 5. Summary
# Comparisons are paired by seed (same seed: same initialization and data order), each with the 95% Student t
# interval of the per-seed differences; a difference is called better or worse only when its interval excludes 0,
# inside the noise otherwise, and "not tested" where the study's precondition (retrieval learned) failed.

# %%
findings = study.study_report(summary)
summary = report.attach(summary, findings, from_results)
write_json(out / "summary.json", summary)
pd.Series({k: str(summary["meta"][k]) for k in ("commit", "dirty", "device", "torch", "triton", "command", "date",
                                                "wall_s", "tokens_per_run", "epochs", "runs", "runs_skipped")},
          name="run facts").to_frame()

# %% [markdown]
# ## Findings

# %%
Markdown(study.findings(findings))
