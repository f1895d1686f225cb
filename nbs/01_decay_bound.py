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
# # Study 1: the lower-bounded decay — where the factored tile overflows, what the bound costs, what it buys
#
# KDA's chunked kernels need the gated scores $q_i^\top \mathrm{diag}(e^{G_i - G_j})\, k_j$ inside each chunk,
# where $G$ is the cumulative sum of the per-token log decay $g \le 0$. Computed as one tensor-core product
# $(q \odot e^{G - G_m})(k \odot e^{G_m - G})^\top$, the factors $e^{\pm G}$ must stay finite in the working
# precision. K3 bounds the per-token log decay from below, $g = g_{min}\,\sigma(\cdot)$ with $g_{min} = -5$, so
# that they do over 16-token tiles. This notebook measures (1) where the factored tile breaks, per precision,
# tile length and bound; (2) what an unbounded softplus gate produces in training, and the loss of both gates;
# (3) the kernel time the bounded path saves. The logic is in `moelab.studies.decay_bound`, the run grid in
# `moelab.studies.common`.

# %% tags=["parameters"]
preset = "cpu"  # "cpu": minutes on 2 cores; "gpu": the gpu-small model on one GPU
out_dir = "."

# %%
from pathlib import Path

import pandas as pd
from IPython.display import Markdown

from moelab.studies import common
from moelab.studies import decay_bound as study
from moelab.utils import write_json

out = Path(out_dir)
(out / "figures").mkdir(parents=True, exist_ok=True)
(out / "results").mkdir(parents=True, exist_ok=True)

# %% [markdown]
# ## 1. The factored diagonal tile against an exact fp64 reference
# Two decays per bound: the worst case the bound allows ($g = g_{min}$ on every channel of every token) and
# $g$ uniform in $[g_{min}, 0]$; $q$ and $k$ are unit vectors like the layer's L2-normalized ones.

# %%
overflow = pd.DataFrame(study.tile_overflow_table())
overflow.to_csv(out / "results" / "tile_overflow.csv", index=False)
common.show(study.overflow_figure(overflow.to_dict("records")), out / "figures" / "tile_overflow.png")

# %% [markdown]
# **Figure 1.** Relative RMS error of the factored tile against the exact fp64 tile, as the bound $|g_{min}|$
# grows, one panel per precision; a line per tile length, with and without shifting the exponents by $G$ at the
# tile midpoint $G_m$ (which halves their range). A line that stops has overflowed (inf or NaN). The vertical
# line is K3's bound, $|g_{min}| = 5$.

# %%
safe_bound = (pd.Series(study.safe_bounds(overflow), name="most negative safe g_min").rename_axis("tile")
              .to_frame())
safe_bound  # the most negative swept g_min at which the tile is finite and within 1% of the exact one

# %% [markdown]
# ## 2. Training with the bounded and the softplus gate
# The arms differ in one config key, checked on the resolved configs (same model, data, seeds, schedule).
# One line per finished run; each run's training output goes to `checkpoints/<arm>-s<seed>/train.log`.

# %%
pd.DataFrame(study.arms_factor(preset))

# %%
grid = study.train_gates(preset, out)
runs = grid.table()
runs.to_csv(out / "results" / "runs.csv", index=False)
grid.histories().to_csv(out / "results" / "loss_histories.csv", index=False)
common.aggregate(runs)[list(common.STUDY_METRICS) + ["n_seeds"]]

# %%
common.show(common.loss_curves(grid, f"{grid.base}: bounded vs softplus gate"),
            out / "figures" / "training_loss.png")

# %% [markdown]
# **Figure 2.** Training loss per optimizer step (thin: each seed; bold: mean over seeds) and validation loss
# (dots: each seed; diamonds: mean) of the two gates, in nats per token. Same model, data order and schedule;
# only `model.kda.gate` differs.

# %%
decay = pd.DataFrame(study.gate_decay_rows(grid))
decay.to_csv(out / "results" / "trained_decay_stats.csv", index=False)
decay.groupby("gate")[["g_min", "frac_below_bound", "max_tile_exponent", "frac_tiles_over_bf16",
                       "frac_tiles_over_fp16"]].agg(
    {"g_min": "min", "frac_below_bound": "max", "max_tile_exponent": "max",
     "frac_tiles_over_bf16": "max", "frac_tiles_over_fp16": "max"})

# %% [markdown]
# The table: per gate, over every KDA layer and two validation batches, the most negative log decay $g$, the
# share of entries below $-5$, the largest exponent $|G_i - G_m|$ a factored 16-token tile must represent, and
# the share of (tile, head, channel) triples whose exponent exceeds the bf16 and fp16 ranges
# ($\ln$ of the dtype's largest finite value).
#
# ## 3. Kernel speed: bounded (dense tiles) vs general (element-wise diagonal tiles) vs fla
# Read from the committed H200 benchmark (`make kda-bench` writes it); the study does not re-run the sweep.

# %%
speed_rows, speed_source = study.kernel_speed()
print(study.describe_source(speed_source))
if speed_rows:
    pd.DataFrame(speed_rows).to_csv(out / "results" / "kernel_speed.csv", index=False)
common.show(study.speed_figure(speed_rows, speed_source), out / "figures" / "kernel_speed.png")

# %% [markdown]
# **Figure 3.** Forward+backward time of the KDA op (log scale) per implementation and shape (batch $B$,
# sequence length $T$; 16 heads of dimension 128, bf16): moelab's bounded and general paths, fla's `chunk_kda`
# with and without its safe gate, and causal SDPA (flash) for scale.

# %%
summary = study.summarize(overflow, grid, decay, speed_rows, speed_source, preset)
write_json(out / "summary.json", summary)
pd.Series({k: str(summary["meta"][k]) for k in ("commit", "dirty", "device", "torch", "triton", "command", "date",
                                                "wall_s", "tokens_per_run", "epochs")}, name="run facts").to_frame()

# %% [markdown]
# ## Findings

# %%
Markdown(study.findings(summary))
