"""Whole-model training throughput on one GPU, moelab beside fla, in one run.

Rows (added to ``studies/throughput_h200.json`` by ``impl``):

* ``moelab_fla_shape`` and ``fla_kda``: the fla anchor shape (all-KDA, dense SwiGLU FFN 4096, hidden
  1024, 12 layers, 8 heads x 128, vocab 32000), B = 8, T = 4096, bf16 autocast, fused AdamW, bounded
  gate (``g_min = -5``; fla: ``safe_gate=True, lower_bound=-5``). fla-core/flash-linear-attention are
  optional: without them the fla row is skipped and the script says so.
* ``moelab_gpu_small_<residual>``: the ``gpu-small`` preset (~100M total, hybrid KDA + gated MLA,
  LatentMoE) for each residual mode (block_attnres with 6 blocks, and ``..._block_attnres_8`` with
  the 8 of the issue's target), with a check that loss and every gradient are finite.
* ``moelab_k3_mini`` beside ``moelab_k3_mini_balancer_none``: the ``k3-mini`` preset (quantile
  balancing, histogram mode) and the same model with ``model.moe.balancer=none``. The QB row adds
  ``balancer_cost`` = 1 - its tokens/s over the none row's (the acceptance target is <= 0.02).

Every model with MoE layers runs ``moelab.model.balance.balance_step`` after each backward and
before the optimizer step, as training does (``BalancerCallback``; with ``none`` it only reduces
the load metrics), so its cost is in the step time; its own device time is the row's
``balancer_ms`` (CUDA events around it, read after the timed steps) and ``balancer_share`` =
``balancer_ms / step_ms``. Training also lists each step's loss as ``loss + aux_loss``, so do the rows.

``host_ms``: after the timed steps, the wall time the host takes to issue one more step from an
idle GPU (no sync inside it). Near ``step_ms`` the row is bound by the host (Python, autograd,
launches), and host-side work such as the balancer's shows in it 1:1 (and so does a slower or
busier host CPU); well below it, by the GPU. With a host-bound row the balancer's CUDA-event
span also grows beyond its kernels' time: it then includes the GPU waiting for the host.

Timing as the H200 anchor measurement of fla's model: 5 warm-up steps, then the mean of 10
timed steps on random tokens. MFU columns: ``mfu`` = 6 x params x tokens/s / 792e12 (the anchor's
convention: all parameters, the measured bf16 matmul ceiling), and ``mfu_model_flops`` = 3 x forward
FLOPs per token (moelab accounting, activated parameters + attention/KDA terms) x tokens/s / 989e12.

    python kernels/bench_model.py --out studies/throughput_h200.json [--steps 10] [--only fla|gpu-small|k3-mini]
    python kernels/bench_model.py --only fla --profile kernels/results/model_profile_h200.json
    python kernels/bench_model.py --only gpu-small --rounds 8 --steps 20 --out ...   # paired rounds, see below
    TRITON_CACHE_DIR=$PWD/.tcache python kernels/bench_model.py --only gpu-small --rounds 8 --steps 20 \
        --budget-s 280 --out ...   # as many rounds as end within 280 s of the start, kernels cached in .tcache/
    python kernels/bench_model.py --smoke --out /tmp/bench.json   # CPU: the k3-mini rows at toy sizes, fp32
    python kernels/bench_model.py --smoke --only gpu-small --rounds 4 --out /tmp/b.json  # CPU: its 4 configs, toy

``--profile PATH`` also records the device time per kernel of one training step of each row
(torch.profiler, after the timed steps) to PATH: ``{impl: {"step_ms": ..., "kernels": {name: ms}}}``,
the breakdown that says where a whole-model gap comes from (projections, short convolutions,
norms, the KDA op, the loss, the optimizer). With ``--rounds`` it profiles each row once, after the rounds.

``--rounds N`` (N > 1, with ``--only gpu-small`` or ``--only k3-mini``): these groups are judged as
ratios (issue 16: block_attnres >= 0.9x and full_attnres >= 0.75x of prenorm's tokens/s; issue 15:
quantile balancing costs <= 2% of the tokens/s of ``balancer: none``, a ratio >= 0.98), and their step
is host-bound, so rows timed one after the other drift apart by more than such effects. Every config of
the group is built, gradient-checked and warmed up (``--warmup`` steps) once and stays on the GPU; then
each of N rounds times every config once, in the order of a Williams design (:func:`round_order`: over
every n rounds each config runs once in each position and once right after each other config; 2n rounds
for an odd n; so 4 configs balance in multiples of 4 rounds, 2 in multiples of 2). A config's window is
one untimed step of its own model, then the timed steps as above (mean of ``--steps`` synchronized steps,
then the host issue time of one more).

After every round all rows of the group are written at once (one atomic write: the file never mixes rounds),
over the rounds done so far: ``rounds_done`` of ``rounds_planned``, ``complete`` false until the last one, so a
run killed by a time limit leaves rows that say so. ``--budget-s S`` starts no round that would end more than
S seconds after the script's start (the estimate: the longest round so far; before the first, each config's
mean warm-up step x (``--steps`` + 2); with ``--profile`` one more round's time is kept for the profiles), and
then writes the rows again with ``stopped`` saying why. Fewer than 2 rounds give ratios without a spread, and
a count that is not a multiple of the Williams period leaves the positions unbalanced: stderr says either.

Progress goes to stderr, each line flushed and stamped with the seconds since the start: the Triton cache
directory and its entry count (0: a cold start), then per config its set-up (model build; the gradient check,
which is the first step and so includes every Triton compile that the cache lacks; the warm-up), then per
round and config the window's step time, its wall time and the time the remaining rounds should take. Where
the time goes: a round is (``--steps`` + 2) steps of every config; the set-up is a few seconds per config
with a warm cache, but on a cold one the first step compiles every kernel it launches, and the AttnRes op
compiles a variant per source count and per read's accumulate mask (full_attnres: one forward and one
backward per count up to 2 x n_layers + 1), which takes minutes for gpu-small. Keep ``TRITON_CACHE_DIR`` in
a directory that outlives the call (``.tcache/``, ignored by git) so the next run starts warm.

Per row: ``step_ms`` = median of the rounds, ``tok_per_s`` = B x T / that median, ``host_ms`` and
``balancer_ms`` the medians (``balancer_share`` their quotient), ``peak_mem_gb`` the largest window's own
peak (the memory the other models hold between their steps subtracted), ``loss`` the last window's; and
``rounds_done``, ``rounds_planned``, ``complete`` (and ``stopped``), ``rounds_step_ms`` / ``rounds_host_ms``
(in round order), ``step_ms_min`` / ``step_ms_max``, and ``setup_s`` (seconds of build, gradient check and
warm-up; the single-run rows have the first two).
A compared row adds ``ratio_vs_prenorm`` or ``ratio_vs_balancer_none`` (from :func:`compare_rounds`):
``ratios``, per round the base row's step time over this row's (this row's tokens/s over the base's,
paired by round so that drift between rounds cancels), their ``median``, ``min``, ``max``, the ``target``
and the ``verdict`` (:func:`verdict`): "met" when every paired ratio reaches the target, "not met" when
none does, "within noise" when min..max straddles it. For independent rounds, [min, max] of n ratios
holds their distribution's median with probability 1 - 2^(1-n) whatever that distribution (94% at 5
rounds, 99% at 8). The quantile-balancing row's ``balancer_cost`` is 1 - its median ratio.

Memory with ``--rounds``: each model holds its fp32 parameters and AdamW state (12 bytes per parameter)
between its steps, and one step's activations come and go. gpu-small (4 configs of 103M parameters, each
16.5-17.7 GB peak alone) needs about 3 x 1.2 + 17.7 ~ 21 GB allocated at once; k3-mini (2 of 173M, 24.3 GB
alone) about 2.1 + 24.3 ~ 27 GB; the allocator's cache may hold up to the sum of the single peaks (~69 /
~49 GB), within an H200's 141 GB. A group that does not fit stops with an out-of-memory message.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # before torch is imported: --budget-s counts the whole process, as a time limit does

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moelab.config import load_config  # noqa: E402
from moelab.model import MoELab  # noqa: E402
from moelab.model.accounting import flops_per_token, param_counts  # noqa: E402
from moelab.model.balance import balance_step, balanced_routers  # noqa: E402
from moelab.tracking import git_commit  # noqa: E402
from moelab.train.perf import record_throughput  # noqa: E402

ANCHOR_PEAK = 792e12  # measured bf16 8192^3 matmul on the H200 (anchors/h200.md)
DATASHEET_PEAK = 989e12
MFU_CONVENTION = "6 x all params x tok/s / 792e12 (anchor convention)"


class Runner:
    """One model's training step with its optimizer and input batch, kept between timing windows so that
    several models can be timed in turn (``--rounds``).

    CUDA: bf16 autocast, fused AdamW, the balancer's time from CUDA events (no host sync inside the
    timed loop). CPU (``--smoke``): fp32, plain AdamW, perf_counter around the balancer.
    """

    def __init__(self, model: torch.nn.Module, loss_fn, B: int, T: int, vocab: int, balance: bool = False,
                 device: str = "cuda"):
        self.model, self.loss_fn, self.balance = model, loss_fn, balance
        self.cuda = device == "cuda"
        self.tokens = B * T
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=self.cuda or None)
        self.x = torch.randint(0, vocab, (B, T), device=device)  # (B, T) token ids
        # Bytes this model keeps allocated between steps (parameters, AdamW state, input, buffers), set once
        # it is warm when other models share the GPU: a window's peak memory is then its own, as if alone.
        self.held_bytes: int | None = None

    def step(self, spans: list | None = None) -> torch.Tensor:
        """One training step; with ``spans`` given, the balancer's (start, end) CUDA events or seconds go there."""
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.loss_fn(self.model, self.x)
        loss.backward()
        if self.balance:
            if self.cuda:
                span = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                span[0].record()
                balance_step(self.model)
                span[1].record()
            else:
                t = time.perf_counter()
                balance_step(self.model)
                span = time.perf_counter() - t
            if spans is not None:
                spans.append(span)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def warm(self, steps: int) -> float:
        """``steps`` untimed steps; returns their wall time in seconds."""
        t = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        return time.perf_counter() - t

    def window(self, steps: int) -> dict:
        """Mean time of ``steps`` steps (synchronized at both ends), then the host time to issue one more
        step from an idle GPU, the peak memory of both, and the balancer's mean time in the timed steps."""
        self.sync()
        others = 0 if self.held_bytes is None else self.allocated() - self.held_bytes
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        spans: list = []
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.step(spans)
        self.sync()
        dt = (time.perf_counter() - t0) / steps
        t1 = time.perf_counter()
        self.step()
        host = time.perf_counter() - t1
        self.sync()
        out = {"step_ms": dt * 1e3, "tok_per_s": self.tokens / dt, "host_ms": host * 1e3,
               "peak_mem_gb": (torch.cuda.max_memory_allocated() - others) / 2**30 if self.cuda else None,
               "loss": float(loss.detach())}
        if self.balance:
            ms = [a.elapsed_time(b) for a, b in spans] if self.cuda else [1e3 * t for t in spans]
            out["balancer_ms"] = sum(ms) / len(ms)
            out["balancer_share"] = out["balancer_ms"] / out["step_ms"]
        return out

    def profile(self) -> dict[str, float]:
        """Device ms per kernel name of one step (torch.profiler), largest first."""
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            self.step()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us:
                kernels[ev.key[:160]] = kernels.get(ev.key[:160], 0.0) + us / 1e3
        return dict(sorted(kernels.items(), key=lambda kv: -kv[1]))


def time_once(runner: Runner, warmup: int, steps: int) -> dict:
    """A row's timing without ``--rounds``: ``warmup`` steps, one window of ``steps``, the profile if asked."""
    runner.warm(warmup)
    out = runner.window(steps)
    if PROFILE:
        out["_profile"] = runner.profile()
    return out


PROFILE = False  # set by --profile


@dataclass
class Bench:
    """A built moelab model: its row's fixed fields (config, sizes, the gradient check), its runner, its config."""

    row: dict
    runner: Runner
    model_cfg: Any

    def result(self, res: dict) -> dict:
        """The row with the measured fields ``res`` and the MFU columns derived from its tokens/s."""
        row = {**self.row, **res}
        peak = self.runner.cuda
        row["mfu"] = 6 * row["params"] * res["tok_per_s"] / ANCHOR_PEAK if peak else None
        row["mfu_convention"] = MFU_CONVENTION
        row["mfu_model_flops"] = (3 * flops_per_token(self.model_cfg, row["T"]) * res["tok_per_s"] / DATASHEET_PEAK
                                  if peak else None)
        return row


def build_moelab(impl: str, preset: str, overrides: dict, check_grads: bool, compile_model: bool = False,
                 device: str = "cuda") -> Bench:
    t0 = time.perf_counter()
    cfg = load_config(preset, overrides)
    torch.manual_seed(0)
    model = MoELab(cfg.model).to(device)
    if compile_model:  # as train.compile=true does in the trainer; the KDA op stays eager
        model.compile()
        impl += "_compiled"
    B, T = cfg.train.batch_size, cfg.data.seq_len
    balance = bool(balanced_routers(model))
    row = {"impl": impl, "preset": preset, **{k: str(v) for k, v in overrides.items()},
           "params": sum(p.numel() for p in model.parameters()),
           "params_activated": param_counts(cfg.model)["activated"], "B": B, "T": T}
    if balance:
        row["balancer"] = cfg.model.moe.balancer
    # Where a run's setup time goes; the first step (the gradient check, else the first warm-up step) also
    # compiles every Triton kernel that TRITON_CACHE_DIR does not hold yet.
    row["setup_s"] = {"build": time.perf_counter() - t0}
    if check_grads:
        t1 = time.perf_counter()
        x = torch.randint(0, cfg.model.vocab_size, (B, T), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(x, x, return_logits=False)
        (out.loss + out.aux_loss).backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        row.update(first_loss=float(out.loss.detach()), loss_finite=bool(torch.isfinite(out.loss)), nonfinite_grads=bad,
                   params_without_grad=no_grad)
        model.zero_grad(set_to_none=True)
        if balance:
            balance_step(model)  # the statistics of this forward must not enter the first timed update
        row["setup_s"]["grad_check"] = time.perf_counter() - t1

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # As LitMoELab.training_step: no id check, whose min/max reads wait on the GPU every step (the
        # data pipeline checks ids once); with it the timed loop was serialised at each step's start.
        out = m(x, x, return_logits=False, check_ids=False)
        return out.loss + out.aux_loss  # what LitMoELab.training_step minimizes

    return Bench(row, Runner(model, loss_fn, B, T, cfg.model.vocab_size, balance, device), cfg.model)


def moelab_row(impl: str, preset: str, overrides: dict, warmup: int, steps: int, check_grads: bool,
               compile_model: bool = False, device: str = "cuda") -> dict:
    bench = build_moelab(impl, preset, overrides, check_grads, compile_model, device)
    row = bench.result(time_once(bench.runner, warmup, steps))
    _save_profile(row)
    del bench
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


# --smoke: each group's structure at toy sizes, so the CPU runs its rows in seconds. k3-mini: 3:1 KDA/MLA + final
# MLA, Block AttnRes, LatentMoE, QB histogram (m k / n = 2 * 32 * 2 / 8 is an integer, as QB needs); gpu-small:
# its 12 layers (24 sublayers: blocks of 6 and 8 divide them), so every residual mode reads what it reads on the GPU.
SMOKE_GPU_SMALL = {
    "model.vocab_size": 512, "data.vocab_size": 512, "model.d_model": 64, "model.dense_ffn_dim": 128,
    "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2,
    "model.kda.num_heads": 2, "model.kda.head_dim": 32, "model.kda.decay_rank": 8, "model.kda.chunk_size": 16,
    "model.mla.num_heads": 2, "model.mla.head_dim": 32, "model.mla.kv_latent_dim": 32,
    "model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.latent_dim": 32, "model.moe.expert_dim": 32,
}
SMOKE_K3_MINI = {**SMOKE_GPU_SMALL, "model.n_layers": 5, "model.mla.q_latent_dim": 32, "model.moe.shared_dim": 32,
                 "model.moe.quantile_balancing_bins": 64}


PROFILE_OUT: str | None = None


def _save_profile(row: dict) -> None:
    """Move a row's kernel breakdown (``--profile``) out of the row into the profile file."""
    prof = row.pop("_profile", None)
    if prof is None or PROFILE_OUT is None:
        return
    data = json.load(open(PROFILE_OUT)) if os.path.exists(PROFILE_OUT) else {}
    data.setdefault("meta", {}).update(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                       date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       command="python " + " ".join(sys.argv))
    top = dict(list(prof.items())[:60])
    data[row["impl"]] = {"step_ms": row["step_ms"], "total_kernel_ms": sum(prof.values()), "kernels": top}
    with open(PROFILE_OUT, "w") as fh:
        json.dump(data, fh, indent=1)
    print(f"{row['impl']}: top kernels of one step (ms):")
    for name, ms in list(prof.items())[:15]:
        print(f"  {ms:8.3f}  {name[:100]}")


def fla_row(warmup: int, steps: int) -> dict | None:
    try:
        from fla.models import KDAConfig, KDAForCausalLM
    except ImportError as e:
        print(f"fla_kda: skipped (flash-linear-attention not installed: {e})")
        return None
    B, T, V = 8, 4096, 32000
    cfg = KDAConfig(hidden_size=1024, num_hidden_layers=12, num_heads=8, head_dim=128, vocab_size=V,
                    fuse_cross_entropy=True, safe_gate=True, lower_bound=-5.0)
    torch.manual_seed(0)
    model = KDAForCausalLM(cfg).cuda()
    n_params = sum(p.numel() for p in model.parameters())
    res = time_once(Runner(model, lambda m, x: m(input_ids=x, labels=x).loss, B, T, V), warmup, steps)
    row = {"impl": "fla_kda", "params": n_params, "B": B, "T": T, **res,
           "mfu": 6 * n_params * res["tok_per_s"] / ANCHOR_PEAK, "mfu_convention": MFU_CONVENTION}
    _save_profile(row)
    del model
    torch.cuda.empty_cache()
    return row


# --rounds: the groups compared as ratios. gpu-small's rows per residual mode, each built with its overrides.
GPU_SMALL = [
    ("moelab_gpu_small_prenorm", {"model.residual.mode": "prenorm"}),
    ("moelab_gpu_small_full_attnres", {"model.residual.mode": "full_attnres"}),
    ("moelab_gpu_small_block_attnres", {"model.residual.mode": "block_attnres", "model.residual.num_blocks": 6}),
    ("moelab_gpu_small_block_attnres_8", {"model.residual.mode": "block_attnres", "model.residual.num_blocks": 8}),
]
# row -> (the row it is compared with, the field holding the paired tokens/s ratios, the least ratio the issue allows)
TARGETS = {
    "moelab_gpu_small_full_attnres": ("moelab_gpu_small_prenorm", "ratio_vs_prenorm", 0.75),  # issue 16
    "moelab_gpu_small_block_attnres": ("moelab_gpu_small_prenorm", "ratio_vs_prenorm", 0.9),
    "moelab_gpu_small_block_attnres_8": ("moelab_gpu_small_prenorm", "ratio_vs_prenorm", 0.9),
    "moelab_k3_mini": ("moelab_k3_mini_balancer_none", "ratio_vs_balancer_none", 0.98),  # issue 15: cost <= 2%
}
# row -> the most peak memory it may take relative to prenorm's (issue 16: Block AttnRes <= 1.2x)
MEM_TARGETS = {"moelab_gpu_small_block_attnres": 1.2, "moelab_gpu_small_block_attnres_8": 1.2}


def mem_verdict(row: dict, base: dict) -> dict | None:
    """``{"base", "ratio", "target", "verdict"}``: ``row``'s peak memory over ``base``'s against
    :data:`MEM_TARGETS` ("met" when at most the target); None for a row without a target or without
    measured memory (CPU)."""
    target = MEM_TARGETS.get(row["impl"])
    if target is None or not row.get("peak_mem_gb") or not base.get("peak_mem_gb"):
        return None
    ratio = row["peak_mem_gb"] / base["peak_mem_gb"]
    return {"base": base["impl"], "ratio": ratio, "target": target, "verdict": "met" if ratio <= target else "not met"}


def k3_mini_specs(base: dict) -> list[tuple[str, dict]]:
    """The k3-mini rows: ``balancer: none`` first, then the preset's quantile balancing (``base``: overrides)."""
    return [("moelab_k3_mini_balancer_none", {**base, "model.moe.balancer": "none"}), ("moelab_k3_mini", base)]


def verdict(ratios: list[float], target: float) -> str:
    """``"met"`` when every paired tokens/s ratio is >= ``target``, ``"not met"`` when every one is below it,
    ``"within noise"`` when their range straddles it (the median alone could land on either side)."""
    if not ratios:
        raise ValueError("verdict needs at least one paired ratio, got none")
    if min(ratios) >= target:
        return "met"
    if max(ratios) < target:
        return "not met"
    return "within noise"


def compare_rounds(base_ms: list[float], other_ms: list[float], target: float) -> dict:
    """Per-round step times (ms) of a row and of the row it is compared with, paired by round.

    Returns both medians (ms), the per-round tokens/s ratios other / base (= base_ms / other_ms: both rows
    run the same tokens per step), their median, min and max, the target and :func:`verdict`.
    """
    if len(base_ms) != len(other_ms) or not base_ms:
        raise ValueError(f"need the same number (>= 1) of rounds on both sides, got base={len(base_ms)}, "
                         f"other={len(other_ms)}")
    ratios = [b / o for b, o in zip(base_ms, other_ms)]
    return {"base_median_ms": statistics.median(base_ms), "median_ms": statistics.median(other_ms),
            "ratios": ratios, "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "target": target, "verdict": verdict(ratios, target)}


def round_order(n: int, r: int) -> list[int]:
    """Order of the ``n`` configs in round ``r``: a Williams design (a balanced Latin square; for odd ``n``
    the square and its mirror, 2n rounds). Over every n rounds (2n for odd n) each config runs once in each
    position, and each config runs right after each other config equally often."""
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    order = [(c + r) % n for c in first]
    return order[::-1] if n % 2 and (r // n) % 2 else order


def rounds_result(windows: list[dict], tokens: int) -> dict:
    """One row's measured fields from its per-round windows (:meth:`Runner.window` dicts, in round order):
    medians of step, host and balancer time, tokens/s from the median step, the largest peak, the last loss,
    and the per-round lists."""
    ms = [w["step_ms"] for w in windows]
    step = statistics.median(ms)
    out = {"step_ms": step, "tok_per_s": tokens / (step / 1e3),
           "host_ms": statistics.median(w["host_ms"] for w in windows),
           "peak_mem_gb": None if windows[0]["peak_mem_gb"] is None else max(w["peak_mem_gb"] for w in windows),
           "loss": windows[-1]["loss"]}
    if "balancer_ms" in windows[0]:
        out["balancer_ms"] = statistics.median(w["balancer_ms"] for w in windows)
        out["balancer_share"] = out["balancer_ms"] / step
    out.update(rounds_done=len(windows), rounds_step_ms=ms, step_ms_min=min(ms), step_ms_max=max(ms),
               rounds_host_ms=[w["host_ms"] for w in windows])
    return out


def paired_rows(benches: list[Bench], windows: list[list[dict]], planned: int) -> list[dict]:
    """The rows of one ``--rounds`` group so far, each compared row with its paired ratios (``TARGETS``), and
    ``rounds_planned`` beside ``rounds_done``: ``complete`` is false until all ``planned`` rounds are in."""
    rows = [b.result({**rounds_result(w, b.runner.tokens), "rounds_planned": planned, "complete": len(w) == planned})
            for b, w in zip(benches, windows)]
    by = {r["impl"]: r for r in rows}
    for row in rows:
        if row["impl"] in TARGETS and TARGETS[row["impl"]][0] in by:
            base, key, target = TARGETS[row["impl"]]
            row[key] = {"base": base, **compare_rounds(by[base]["rounds_step_ms"], row["rounds_step_ms"], target)}
            if key == "ratio_vs_balancer_none":
                row["balancer_cost"] = 1.0 - row[key]["median"]
            mem = mem_verdict(row, by[base])
            if mem is not None:
                row["mem_vs_prenorm"] = mem
    return rows


def elapsed() -> float:
    """Seconds since the script started (:data:`START`)."""
    return time.perf_counter() - START


def progress(msg: str) -> None:
    """A progress line on stderr, flushed at once and stamped with :func:`elapsed`: a run cut by a time limit
    still shows how far it got and what each phase took."""
    print(f"[bench_model {elapsed():7.1f} s] {msg}", file=sys.stderr, flush=True)


def budget_stop(budget_s: float | None, now_s: float, round_s: float | None, reserve_s: float = 0.0) -> str | None:
    """Why the next round must not start, or None when it may: it would end (``now_s`` + its estimated
    ``round_s``, then ``reserve_s`` for what runs after the rounds) past ``budget_s`` seconds from the start.
    Without a budget or an estimate every round starts."""
    if budget_s is None or round_s is None:
        return None
    end = now_s + round_s + reserve_s
    if end <= budget_s:
        return None
    after = f" and {reserve_s:.1f} s of profiles after it" if reserve_s else ""
    return f"--budget-s {budget_s:g}: the next round (about {round_s:.1f} s{after}) would end at {end:.1f} s"


def run_rounds(specs: list[tuple[str, dict]], preset: str, warmup: int, steps: int, rounds: int, device: str,
               record, budget_s: float | None = None) -> list[dict]:
    """Build and warm every config of a group (all stay on the GPU), then time them in ``rounds`` interleaved
    rounds (:func:`round_order`); ``record(rows)`` after every round with the rows so far, so a run cut short
    keeps what it has (``complete`` false).

    ``budget_s``: no round starts that would end later than this many seconds after the script's start; the
    estimate is the longest round so far, before the first one the warm-up steps' mean time per config x
    (``steps`` + 2); with ``--profile`` one more round's time is kept for the profiles (one step per config).
    A stop is recorded in the rows (``stopped``). Progress, one line per set-up config and per window with
    the time left, goes to stderr (:func:`progress`). Returns the last rows recorded, [] when no round fitted.
    """
    n = len(specs)
    benches, warm_step_s = [], []
    for k, (impl, over) in enumerate(specs):
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        bench = build_moelab(impl, preset, over, check_grads=True, device=device)
        setup = bench.row["setup_s"]
        setup["warmup"] = bench.runner.warm(warmup)
        bench.runner.held_bytes = bench.runner.allocated() - before
        benches.append(bench)
        warm_step_s.append(setup["warmup"] / warmup if warmup else None)
        progress(f"set up {k + 1}/{n} {impl}: model {setup['build']:.1f} s, gradient check (the first step: any "
                 f"Triton compiles) {setup['grad_check']:.1f} s, {warmup} warm-up steps {setup['warmup']:.1f} s")

    windows: list[list[dict]] = [[] for _ in benches]
    wall: list[list[float]] = [[] for _ in benches]  # per config, the wall seconds of its windows

    def window_s(i: int) -> float:
        """Config i's window time (one untimed step, ``steps`` timed, one host-timed): the mean so far, else
        from its warm-up steps."""
        return statistics.fmean(wall[i]) if wall[i] else (steps + 2) * (warm_step_s[i] or 0.0)

    round_s: list[float] = []
    rows: list[dict] = []
    for r in range(rounds):
        est = max(round_s) if round_s else (None if None in warm_step_s else sum(map(window_s, range(n))))
        stop = budget_stop(budget_s, elapsed(), est, est if PROFILE and est is not None else 0.0)
        if stop:
            period = n if n % 2 == 0 else 2 * n
            progress(f"stopped before round {r + 1}/{rounds}: {stop}" + (
                f"; the round count {r} is not a multiple of the Williams period {period}: positions not balanced"
                if r % period else "") + ("; fewer than 2 rounds: the paired ratios have no spread" if r < 2 else ""))
            if rows:
                rows = [{**row, "stopped": stop} for row in rows]
                record(rows)
            break
        t_round = time.perf_counter()
        order = round_order(n, r)
        for pos, i in enumerate(order):
            t = time.perf_counter()
            # one untimed step first, so the window starts from this model's own step, not another model's
            benches[i].runner.warm(1)
            windows[i].append(benches[i].runner.window(steps))
            wall[i].append(time.perf_counter() - t)
            left = sum(map(window_s, order[pos + 1:])) + (rounds - r - 1) * sum(map(window_s, range(n)))
            progress(f"round {r + 1}/{rounds}, config {pos + 1}/{n} {benches[i].row['impl']}: "
                     f"{windows[i][-1]['step_ms']:.1f} ms/step, window {wall[i][-1]:.1f} s; rounds left about "
                     f"{left:.0f} s (end at about {elapsed() + left:.0f} s)")
        round_s.append(time.perf_counter() - t_round)
        rows = paired_rows(benches, windows, rounds)
        record(rows)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{benches[i].row['impl']} {windows[i][-1]['step_ms']:.1f}" for i in order) + " ms/step", flush=True)
        progress(f"round {r + 1}/{rounds} recorded ({round_s[-1]:.1f} s)")
    if PROFILE:  # once, after the rounds (their budget kept time for it)
        for bench, row in zip(benches, rows):
            t = time.perf_counter()
            _save_profile({**row, "_profile": bench.runner.profile()})
            progress(f"profiled {row['impl']} ({time.perf_counter() - t:.1f} s)")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="studies/throughput_h200.json")
    ap.add_argument("--commit", default=None, help="commit recorded in every row (default: git rev-parse "
                    "HEAD; a copied tree without .git records none unless given)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", choices=["fla", "gpu-small", "k3-mini"], default=None, help="run one group of rows")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --only gpu-small or k3-mini: time the group's configs in this many interleaved rounds "
                         "(all models on the GPU at once) and judge the ratios on the paired rounds; 1: one run each")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="with --rounds: start no round that would end later than this many seconds after the "
                         "script's start (estimated from the rounds so far); the rows then hold the rounds done")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the harness: a group's rows at toy sizes (k3-mini unless --only gpu-small), "
                         "fp32, 1 warm-up + 2 timed steps")
    ap.add_argument("--profile", default=None, help="also write each row's per-kernel device time to this JSON")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for the moelab_fla_shape rows (e.g. model.kda.chunk_size=32); "
                         "the row's impl gets a '+' suffix and the overrides are recorded in it")
    ap.add_argument("--compile", action="store_true",
                    help="also time moelab_fla_shape with torch.compile (row moelab_fla_shape_compiled)")
    args = ap.parse_args()
    global PROFILE, PROFILE_OUT
    PROFILE, PROFILE_OUT = args.profile is not None, args.profile
    if args.rounds < 1:
        sys.exit(f"--rounds must be >= 1, got {args.rounds}")
    if args.rounds > 1 and args.only not in ("gpu-small", "k3-mini") and not args.smoke:  # --smoke: a group
        sys.exit(f"--rounds {args.rounds} needs --only gpu-small or --only k3-mini (the groups compared as ratios), "
                 f"got --only {args.only}")
    if args.budget_s is not None and (args.rounds < 2 or args.budget_s <= 0):
        sys.exit(f"--budget-s needs --rounds >= 2 and a budget > 0 seconds, got --rounds {args.rounds}, "
                 f"--budget-s {args.budget_s:g}")
    if args.smoke:
        if args.only not in (None, "k3-mini", "gpu-small") or args.profile or args.compile:
            sys.exit(f"--smoke runs the k3-mini or gpu-small rows only (got --only {args.only}, --profile "
                     f"{args.profile}, --compile {args.compile})")
        args.only, args.warmup, args.steps = args.only or "k3-mini", 1, 2
    elif not torch.cuda.is_available():
        sys.exit("bench_model.py needs a CUDA device (or --smoke for the CPU check)")
    device = "cpu" if args.smoke else "cuda"
    command = "python " + " ".join(sys.argv)
    commit = args.commit or git_commit()
    rows = []

    def add(row: dict | None) -> None:
        # recorded as soon as measured: a run cut by a time limit keeps the rows it finished
        rows.append(row)
        if row is not None:
            row["commit"] = commit
            record_throughput(args.out, row, command)
            print(json.dumps(row), flush=True)
            progress(f"recorded {row['impl']}: {row['step_ms']:.1f} ms/step")

    def record(group: list[dict]) -> None:
        for row in group:
            row["commit"] = commit
        record_throughput(args.out, group, command)  # one write: the file never pairs rows of different rounds

    cache = triton.knobs.cache.dir
    progress(f"Triton cache {cache}: {len(os.listdir(cache)) if os.path.isdir(cache) else 0} entries at the start "
             "(a kernel missing there compiles at its first launch)")
    smoke = {"gpu-small": SMOKE_GPU_SMALL, "k3-mini": SMOKE_K3_MINI} if args.smoke else {}
    groups = {"gpu-small": ("gpu-small", [(impl, {**smoke.get("gpu-small", {}), **over}) for impl, over in GPU_SMALL]),
              "k3-mini": ("k3-mini", k3_mini_specs(smoke.get("k3-mini", {})))}
    if args.rounds > 1:
        preset, specs = groups[args.only]
        try:
            rows = run_rounds(specs, preset, args.warmup, args.steps, args.rounds, device, record, args.budget_s)
        except torch.cuda.OutOfMemoryError as e:
            sys.exit(f"--rounds keeps all {len(specs)} models of {args.only} on the GPU at once and ran out of "
                     f"memory; run it with --rounds 1 (one model at a time): {e}")
        if not rows:
            sys.exit(f"--budget-s {args.budget_s:g} left no time for a round after the set-up ({elapsed():.0f} s, see "
                     "the progress lines): nothing recorded")
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        if args.only in (None, "fla"):
            over = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
            name = "moelab_fla_shape" + ("+" + ",".join(args.set) if args.set else "")
            add(moelab_row(name, "fla-shape", over, args.warmup, args.steps, check_grads=False))
            if args.compile:
                add(moelab_row(name, "fla-shape", over, args.warmup, args.steps, check_grads=False,
                               compile_model=True))
            add(fla_row(args.warmup, args.steps))
        for group, (preset, specs) in groups.items():
            if args.only in (None, group):
                for impl, over in specs:
                    row = moelab_row(impl, preset, over, args.warmup, args.steps, check_grads=True, device=device)
                    if impl == "moelab_k3_mini":  # measured after its balancer-none row (k3_mini_specs)
                        none = next(r for r in rows if r is not None and r["impl"] == "moelab_k3_mini_balancer_none")
                        row["balancer_cost"] = 1.0 - row["tok_per_s"] / none["tok_per_s"]
                    add(row)
    report(rows)
    if any(not math.isfinite(r.get("loss", 0.0)) or r.get("nonfinite_grads") for r in rows if r is not None):
        sys.exit("non-finite loss or gradients: see the rows above")


def report(rows: list[dict | None]) -> None:
    """The console table: per row its step time (median and range with --rounds), then each compared pair's
    tokens/s ratio (median and range of the paired rounds) with its verdict against the issue's target."""
    print(f"\n{'impl':32s} {'params':>8s} {'ms/step':>9s} {'range':>13s} {'host ms':>8s} {'tok/s':>10s} "
          f"{'MFU(6N)':>8s} {'peak GB':>8s} {'balancer':>9s}")
    for r in rows:
        if r is not None:
            mfu = f"{100 * r['mfu']:7.1f}%" if r["mfu"] is not None else f"{'-':>8s}"
            mem = f"{r['peak_mem_gb']:8.1f}" if r["peak_mem_gb"] is not None else f"{'-':>8s}"
            share = f"{100 * r['balancer_share']:8.2f}%" if "balancer_share" in r else f"{'-':>9s}"
            spread = f"{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}" if "step_ms_min" in r else "-"
            print(f"{r['impl']:32s} {r['params'] / 1e6:7.1f}M {r['step_ms']:9.1f} {spread:>13s} {r['host_ms']:8.1f} "
                  f"{r['tok_per_s'] / 1e3:9.1f}K {mfu} {mem} {share}")
    by = {r["impl"]: r for r in rows if r is not None}
    for impl, (base_impl, key, target) in TARGETS.items():
        if impl not in by or base_impl not in by:
            continue
        r, base = by[impl], by[base_impl]
        q = r.get(key) or compare_rounds([base["step_ms"]], [r["step_ms"]], target)
        n, planned = len(q["ratios"]), r.get("rounds_planned", 1)
        of = f" of {planned} planned" if n < planned else ""
        spread = (f" [{q['min']:.3f}, {q['max']:.3f}] over {n}{of} paired rounds" if n > 1
                  else f" (one {'round' if of else 'run each'}{of}: no spread)")
        line = (f"{impl} / {base_impl}: tokens/s {q['median']:.3f}{spread} (target >= {target}): "
                f"{q['verdict']}")
        mem = mem_verdict(r, base)  # None on the CPU
        if mem is not None:
            line += f"; peak memory {mem['ratio']:.3f} (target <= {mem['target']}): {mem['verdict']}"
        print(line)
    if "balancer_cost" in by.get("moelab_k3_mini", {}):
        q = by["moelab_k3_mini"].get("ratio_vs_balancer_none")
        spread = f" [{100 * (1 - q['max']):.2f}%, {100 * (1 - q['min']):.2f}%]" if q else ""
        print(f"k3-mini quantile_balancing vs none: {100 * by['moelab_k3_mini']['balancer_cost']:.2f}%{spread} fewer "
              f"tokens/s (target <= 2%)")
    if "fla_kda" in by and "moelab_fla_shape" in by:
        ratio = by["moelab_fla_shape"]["tok_per_s"] / by["fla_kda"]["tok_per_s"]
        print(f"moelab_fla_shape / fla_kda tokens/s = {ratio:.3f} (target >= 1.0)")


if __name__ == "__main__":
    main()
