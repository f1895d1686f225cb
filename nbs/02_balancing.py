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
# # Study 2: load balancers — auxiliary loss, loss-free sign rule, quantile rules, Quantile Balancing
#
# A sigmoid router picks the top $k$ of $n$ experts by $s + b$, where the per-expert bias $b$ is used for
# selection only. Balancers either add a loss term (Switch/GShard auxiliary loss, coefficient $\alpha$) or
# move $b$ once per optimizer step: the loss-free sign rule $b_j \mathrel{+}= u\,\mathrm{sign}(\bar{l} - l_j)$,
# the articles' quantile rule on averaged loads, and Quantile Balancing (QB), one exact coordinate step on the
# dual of the balanced assignment problem. QB's per-token cutoff is the $(k{+}1)$-th largest $s + b$ (the
# report's) or, per expert, the $k$-th largest over the other experts (`excluding_self`, each expert's exact
# best response). Every balancer trains the same model on the same tokens and seeds; the arms differ only in
# the balancer's config keys. Measured: validation loss, MaxVio (max load over mean load, minus 1) per batch and
# over the validation set, load CV, dead experts, steps until MaxVio_batch settles, the balancer's time, and how
# fast each re-balances when training continues on another corpus; and, without training, what keeps Quantile
# Balancing above the sampling floor. Anchors: the loss-free paper's Table 2 (sign rule
# MaxVio_global 0.04 where the auxiliary loss stays at 0.5-0.7, at equal or better perplexity) and the report's
# "QB settles in a few steps". The logic is in `moelab.studies.balancing`, the run grid in `moelab.studies.common`,
# the intervals and their wording in `moelab.studies.report`. With `from_results = True` the notebook trains nothing:
# it renders the report from the raw results a run committed in `results/` and `summary.json` (the figures drawn from
# the runs' per-step router statistics, which `results/` does not keep, are shown as that run drew them).

# %% tags=["parameters"]
preset = "cpu"  # "cpu": minutes on 2 cores; "gpu": a gpu-small-width model on one GPU; "research": split GPU calls
out_dir = "."
from_results = False  # True: render from the committed results/ and summary.json instead of training again

# %%
import json
from pathlib import Path

import pandas as pd
import torch
from IPython.display import Markdown, display

from moelab.model.accounting import param_counts
from moelab.studies import balancing as study
from moelab.studies import common, report
from moelab.utils import write_json

common.quiet_known_noise()  # log noise filtered at its source, before anything imports Lightning
research = preset == "research"  # the research tier's cells below; the cpu/gpu cells are skipped with it

out = Path(out_dir)
(out / "figures").mkdir(parents=True, exist_ok=True)
(out / "results").mkdir(parents=True, exist_ok=True)
p = study.PRESETS[preset]
cfg = study.base_config(preset)
moe = cfg.model.moe
tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
floor = study.random_routing_maxvio(tokens_per_step, moe.num_experts, moe.top_k)
threshold = study.settle_threshold(floor)
counts = param_counts(cfg.model)
moe_layers = cfg.model.n_layers - cfg.model.dense_layers
pd.Series({
    "base preset": p["base"], "layers (mixers)": "".join(k[0].upper() for k in cfg.model.layer_types()),
    "MoE layers": moe_layers, "d_model": cfg.model.d_model,
    "routed experts / top-k / shared": f"{moe.num_experts} / {moe.top_k} / {moe.num_shared}",
    "latent / expert width": f"{moe.latent_dim} / {moe.expert_dim}", "expert activation": moe.activation,
    "parameters (total / activated)": f"{counts['total']:,} / {counts['activated']:,}",
    "tokens per step": f"{tokens_per_step:,} ({cfg.train.batch_size} x {cfg.data.seq_len})",
    "steps": cfg.train.max_steps, "seeds": len(p["seeds"]), "corpus": cfg.data.source,
    "random-routing MaxVio_batch floor": round(floor, 4), "settle threshold": round(threshold, 4),
}, name=f"preset {preset}").to_frame()

# %% [markdown] tags=["quick"]
# The model and its scale. The floor is the MaxVio_batch of uniformly random top-$k$ routing at this many tokens
# per step: even exactly balanced expected loads fluctuate by sampling. A run counts as settled from the first
# step after which MaxVio_batch (mean over MoE layers) stays below the threshold for three steps; the threshold
# is 0.1, or twice the floor where that is larger (the cpu preset's 512 tokens per step). Both presets train
# three seeds per arm; the cpu preset uses MLA layers only (the KDA layers' chunked recurrence in plain torch
# would triple the step time), the gpu preset gpu-small's width, KDA/MLA mix and corpus.

# %% [markdown]
# ## 1. Arms: what differs
# Checked on the resolved configs: every other key (model, data, schedule, seeds) is the same in every arm.

# %%
if research:
    for layout, factor in study.research_arms_factor().items():
        display(pd.DataFrame(factor).rename_axis(layout))
else:
    display(pd.DataFrame(study.arms_factor(preset)))

# %% [markdown] tags=["research"]
# ## 2. Research tier: a warm switch at two batch layouts, the steady state, the shift
# Per batch layout (8 x 2048 and 64 x 256: the same 16,384 tokens per step) every run trains 400 steps with the
# balancer off (`train.balancer_start_step`: bias zero, no aux loss), past the router's early collapse, then its
# balancer from zero bias; the 8 x 2048 runs go on 2000 steps (the steady state), the 64 x 256 runs 300. Every run
# is one CUDA graph per step (`train.compile='graphs'`, the switch as device arithmetic). At the end of each run, in
# its training process: QB's floor on the frozen trained model at the run's layout, the bias trajectories, and for
# the 8 x 2048 runs the shift test (a copy of the trained model and AdamW state continues 100 steps on the other
# corpus). The render reads the records alone (no checkpoint): `train` trains only what has no record.

# %% tags=["research"]
if research:
    grids = study.train(preset, out)
    rows = study.research_rows(grids)
    shift = study.research_shift_rows(study.research_shifts(grids), rows)
    rows.to_csv(out / "results" / "research_runs.csv", index=False)
    shift.to_csv(out / "results" / "research_shift.csv", index=False)
    display(rows.drop(columns=["arm"]).round(4))

# %% tags=["research"]
if research:
    display(common.show(study.switch_figure(grids, rows), out / "figures" / "research_switch.png"))

# %% [markdown] tags=["research"]
# **Figure 1.** MaxVio_batch around the switch (step 0: the balancer switches on), seed mean per balancer
# (shaded between seeds), log scale; dotted: the layout's frozen QB floor, dashed: 1.1 x it (reached: 3 steps within).

# %% tags=["research"]
if research:
    display(common.show(study.steady_figure(rows), out / "figures" / "research_steady.png"))

# %% [markdown] tags=["research"]
# **Figure 2.** MaxVio_global at the end of the 2000-step steady state (8 x 2048): seed mean with its 95% t
# interval, seeds as dots.

# %% tags=["research"]
if research:
    display(common.show(study.research_bias_figure(grids), out / "figures" / "research_bias.png"))

# %% [markdown] tags=["research"]
# **Figure 3.** Re-centred router bias of the last MoE layer's experts from the switch on (seed 0), per bias
# balancer (histogram QB included).

# %% tags=["research"]
if research:
    display(shift.set_index(["arm", "seed"]).rename(columns={
        "maxvio_before": "MaxVio_batch before (last 20%)", "maxvio_first": "at the first shifted step",
        "recover_step": "steps back to within 10% of before", "resettle_step": "steps to 1.1 x floor"}))
    rep = study.research_report(rows, shift)
    summary = study.research_summary(grids, rows, shift, rep)
    summary = report.attach(summary, rep, from_results)
    write_json(out / "summary.json", summary)
    display(pd.Series({k: str(summary["meta"].get(k)) for k in (
        "commit", "dirty", "device", "command", "date", "wall_s", "gpu_minutes_total", "gpu_minutes_by_layout",
        "records_code")}, name="run facts").to_frame())

# %% [markdown] tags=["quick"]
# ## 2. Training every balancer
# One line per finished run; each run's training output goes to `checkpoints/<arm>-s<seed>/train.log`.

# %% tags=["quick"]
if not research:
    grid = None if from_results else study.train_balancers(preset, out)
    runs = report.result_table(out / "results" / "runs.csv", lambda: grid.table(), from_results)
    histories = report.result_table(out / "results" / "loss_histories.csv", lambda: grid.histories(), from_results)
    trajs = {} if from_results else {(r.arm, r.seed): study.trajectories(r) for r in grid.records}
    rows = report.result_table(out / "results" / "balance_runs.csv",
                               lambda: [study.run_metrics(r, trajs[r.arm, r.seed], threshold) for r in grid.records],
                               from_results)
    table = study.balance_table(rows)
    if not from_results:
        table.to_csv(out / "results" / "balance_table.csv")
    display(table[list(study.TABLE_METRICS) + ["settled", "n_seeds"]].rename(columns={
        "final_val_loss": "val loss", "maxvio_batch": "MaxVio_batch (last 20%)", "maxvio_global": "MaxVio_global",
        "load_cv": "load CV (last 20%)", "dead_experts": f"dead experts (of {moe_layers * moe.num_experts})",
        "settle_step": f"steps to MaxVio_batch < {threshold:.2g}", "balancer_share": "balancer share of step"}))

# %% [markdown] tags=["quick"]
# Per balancer, mean ± standard deviation over seeds: final validation loss (nats/token), MaxVio_batch and load
# CV averaged over the last 20% of the steps, MaxVio_global at the last validation (loads summed over the
# validation set), experts that received no token in the last 20% of the steps (all MoE layers together), the
# step at which MaxVio_batch settled (over the settled seeds; `settled` counts them), and the balancer's median
# share of a training step (its statistics and update, the collectives included).

# %% tags=["quick"]
if not research:
    title = f"{p['base']}-based, {moe.num_experts} experts top-{moe.top_k}: training loss minus no balancer's"
    display(common.show(report.difference_figure(histories, "none", title),
                out / "figures" / "training_loss.png"))

# %% [markdown] tags=["quick"]
# **Figure 1.** Each balancer's training loss minus the unbalanced (`none`) arm's, seed by seed (same seed: same
# initialization and data order), smoothed over 8 steps; line: mean over seeds, band: its 95% t interval; diamonds:
# the validation loss differences with their intervals. Below 0: lower loss than training without a balancer. The y
# axis spans the 2-98% range of the bands after the first quarter of the steps.

# %% tags=["quick"]
if not research:
    if from_results:  # drawn from the runs' per-step router loads, which results/ does not keep
        figure = report.committed_figure(out / "figures" / "maxvio_batch.png")
    else:
        figure = common.show(study.maxvio_figure(grid, threshold, floor), out / "figures" / "maxvio_batch.png")
    display(figure)

# %% [markdown] tags=["quick"]
# **Figure 2.** MaxVio_batch per optimizer step (log scale, mean over MoE layers): the seed mean per balancer,
# shaded between the lowest and highest seed. Dashed: the settle threshold; dotted: the floor of uniformly random
# routing at this batch size. A value of $n/k - 1$ means every token picks the same $k$ experts.

# %% tags=["quick"]
if not research:
    bias_arms = study.bias_arms()
    if from_results:  # the per-step biases live in the runs, not in results/
        figure = report.committed_figure(out / "figures" / "bias_trajectories.png")
    else:
        figure = common.show(study.bias_figure({a: trajs[a, p["seeds"][0]] for a in bias_arms}),
                             out / "figures" / "bias_trajectories.png")
    display(figure)

# %% [markdown] tags=["quick"]
# **Figure 3.** Router bias of each of the last MoE layer's experts per step (one thin line per expert, seed
# 0), minus its mean over experts (routing depends only on differences). The auxiliary-loss and `none` arms keep
# a zero bias and are left out.

# %% tags=["quick"]
if not research:
    if from_results:  # the per-step expert loads live in the runs, not in results/
        figure = report.committed_figure(out / "figures" / "load_heatmaps.png")
    else:
        figure = common.show(study.heatmap_figure({a: trajs[a, p["seeds"][0]] for a in study.ARMS}),
                             out / "figures" / "load_heatmaps.png")
    display(figure)

# %% [markdown] tags=["quick"]
# **Figure 4.** Expert load over training, seed 0: one row per balancer, one column per MoE layer, experts on
# the vertical axis. Colour is the expert's load over the mean load of that step: white is balanced, blue
# under-used (dark blue: no token), red over-used (clipped at twice the mean).
#
# ## 3. Shift test: re-balancing after the data distribution changes
# Each trained model (seed 0) continues training for a fixed number of steps on text of the other committed
# corpus: a run trained on Gutenberg prose continues on Shakespeare's plays, a run trained on Shakespeare on
# Gutenberg prose, encoded with the run's own tokenizer (documents in a seeded order, random windows as in
# training). Nothing else changes at the switch: the weights, the router bias, the balancer's state and AdamW's
# moments come from the final checkpoint, and the learning rate stays at the schedule's final value. The
# balancer runs as in training. Step 1 is routed with the trained bias. Counted: the step from which
# MaxVio_batch stays (three steps) within 10% of the arm's own level before the switch (mean over the last 20%
# of its training steps), and the step from which it stays below the settle threshold.

# %% tags=["quick"]
if not research:
    committed = json.loads((out / "summary.json").read_text()) if from_results else None
    if from_results:
        shifts = study.shifts_from_table(pd.read_csv(out / "results" / "shift_maxvio.csv"),
                                         committed["settings"]["shift_source"])
    else:
        shifts = [study.shift_test(r, p["shift_steps"]) for r in grid.records if r.seed in p["shift_seeds"]]
        pd.DataFrame([{"arm": s["arm"], "seed": s["seed"], "step": st, "maxvio_batch": v} for s in shifts
                      for st, v in zip(s["step"], s["maxvio_batch"])]).to_csv(out / "results" / "shift_maxvio.csv",
                                                                              index=False)
    before = {(r.arm, r.seed): r.maxvio_batch for r in rows.itertuples()}
    display(pd.DataFrame(study.shift_rows(shifts, threshold, before)).set_index("arm").rename(columns={
        "maxvio_before": "MaxVio_batch before (last 20%)", "maxvio_first": "at the first shifted step",
        "maxvio_last": "last 20% after the switch", "recover_step": "steps back to within 10% of before",
        "resettle_step": f"steps to MaxVio_batch < {threshold:.2g}"}))

# %% tags=["quick"]
if not research:
    display(common.show(study.shift_figure(shifts, threshold, floor), out / "figures" / "shift_test.png"))

# %% [markdown] tags=["quick"]
# **Figure 5.** MaxVio_batch per step after the switch to the other corpus (log scale, mean over MoE layers,
# seed 0), one line per balancer; dashed: the settle threshold, dotted: the random-routing floor.

# %% [markdown] tags=["quick"]
# ## 4. What limits Quantile Balancing
# QB's update is not rate-limited: every step it moves each bias to the balance point of that step's own scores (EMA 0),
# so if the next step's scores resembled this step's, one step would balance. This section measures, without training,
# what keeps it above the floor. The trained `qb` model of the first seed is frozen and routes fresh batches of the
# training text, of the study's size; QB's update runs over them as in training, each batch routed with the bias fitted
# to the batch before. What remains is the batches' sampling noise and the update's own error. The same tokens dealt
# across the batches at random show what the sequence structure of a batch adds (the tokens of one sequence route
# alike). Fitting each batch exactly (30 steps), and judging one step on the batch it was fitted to, separate the error
# of the single all-experts-at-once step. Whatever training's tail adds beyond the frozen stream comes from the weights
# moving between steps; as its sign, the correlation over experts of consecutive steps' load deviations: about 0 or
# below for batches of unchanging scores, towards +1 when the same experts stay overloaded because the bias, fitted to
# the previous step's scores, trails scores that keep moving. The forwards run on the GPU when there is one; the
# balancing arithmetic runs on the CPU.

# %% tags=["quick"]
if not research:
    if from_results:
        limits = study.limits_from_table(committed["qb_limits"], pd.read_csv(out / "results" / "qb_limits_stream.csv"))
    else:
        qb_run = next(r for r in grid.records if r.arm == "qb" and r.seed == p["seeds"][0])
        qb_tail = float(rows[(rows.arm == "qb") & (rows.seed == qb_run.seed)].maxvio_batch.iloc[0])
        limits = study.qb_limits(qb_run, trajs["qb", qb_run.seed], qb_tail, floor,
                                 device="cuda" if torch.cuda.is_available() else "cpu")
        pd.DataFrame([{"stream": name, "batch": i + 1, **{key: values[i] for key, values in limits[name].items()}}
                      for name in ("ordered", "shuffled") for i in range(limits["batches"])]).to_csv(
            out / "results" / "qb_limits_stream.csv", index=False)
    display(pd.Series({k: v for k, v in limits.items() if k not in ("ordered", "shuffled")},
              name="QB on the frozen model").to_frame())

# %% tags=["quick"]
if not research:
    display(common.show(study.limits_figure(limits), out / "figures" / "qb_limits.png"))

# %% [markdown] tags=["quick"]
# **Figure 6.** QB's update over fresh batches of the frozen trained `qb` model (first seed), MaxVio_batch per
# batch (log scale, mean over MoE layers): each batch routed with the bias of one update on the batch before (as in
# training), the same with the tokens dealt across batches at random, with a bias fitted in 30 steps to the batch
# before, and on the batch its one-step bias was computed from. Dashed: the same run's MaxVio_batch over the last
# 20% of its training steps; dotted: the random-routing floor.

# %% tags=["quick"]
if not research:
    if from_results:
        summary = committed
    else:
        settings = {"steps": cfg.train.max_steps, "tokens_per_step": tokens_per_step, "num_experts": moe.num_experts,
                    "top_k": moe.top_k, "moe_layers": moe_layers, "noise_floor": floor,
                    "threshold": threshold, "hold": study.HOLD, "tail": study.TAIL, "shift_steps": p["shift_steps"],
                    "shift_source": shifts[0]["source"] if shifts else None,
                    "loss_free_sign_rate": moe.loss_free_sign_rate, "device": common.device_name()}
        summary = study.summarize(grid, rows, shifts, preset, settings, limits)
    findings = study.study_report(summary, rows)
    summary = report.attach(study.add_arm_intervals(summary), findings, from_results)
    write_json(out / "summary.json", summary)
    facts = ("commit", "dirty", "device", "torch", "triton", "command", "date", "wall_s", "tokens_per_run", "epochs")
    display(pd.Series({k: str(summary["meta"][k]) for k in facts}, name="run facts").to_frame())

# %% [markdown]
# ## Findings

# %%
display(Markdown(rep.markdown() if research else study.findings(findings)))
