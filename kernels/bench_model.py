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
    python kernels/bench_model.py --smoke --out /tmp/bench.json   # CPU: the k3-mini rows at toy sizes, fp32

``--profile PATH`` also records the device time per kernel of one training step of each row
(torch.profiler, after the timed steps) to PATH: ``{impl: {"step_ms": ..., "kernels": {name: ms}}}``,
the breakdown that says where a whole-model gap comes from (projections, short convolutions,
norms, the KDA op, the loss, the optimizer).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moelab.config import load_config  # noqa: E402
from moelab.model import MoELab  # noqa: E402
from moelab.model.accounting import flops_per_token, param_counts  # noqa: E402
from moelab.model.balance import balance_step, balanced_routers  # noqa: E402
from moelab.train.perf import record_throughput  # noqa: E402

ANCHOR_PEAK = 792e12  # measured bf16 8192^3 matmul on the H200 (anchors/h200.md)
DATASHEET_PEAK = 989e12
MFU_CONVENTION = "6 x all params x tok/s / 792e12 (anchor convention)"


def time_training(model: torch.nn.Module, loss_fn, B: int, T: int, vocab: int, warmup: int, steps: int,
                  balance: bool = False, device: str = "cuda") -> dict:
    """Mean step time of forward + backward (+ the balancer update) + AdamW, and peak memory.

    CUDA: bf16 autocast, fused AdamW, the balancer's time from CUDA events (no host sync inside the
    timed loop). CPU (``--smoke``): fp32, plain AdamW, perf_counter around the balancer.
    """
    cuda = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda or None)
    x = torch.randint(0, vocab, (B, T), device=device)
    balancer_spans: list = []  # (start, end) CUDA events or seconds, one per timed step

    def step(timed: bool = False) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = loss_fn(model, x)
        loss.backward()
        if balance:
            if cuda:
                span = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                span[0].record()
                balance_step(model)
                span[1].record()
            else:
                t = time.perf_counter()
                balance_step(model)
                span = time.perf_counter() - t
            if timed:
                balancer_spans.append(span)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(timed=True)
    sync()
    dt = (time.perf_counter() - t0) / steps
    t1 = time.perf_counter()
    step()
    host = time.perf_counter() - t1
    sync()
    out = {"step_ms": dt * 1e3, "tok_per_s": B * T / dt, "host_ms": host * 1e3,
           "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "loss": float(loss)}
    if balance:
        ms = [a.elapsed_time(b) for a, b in balancer_spans] if cuda else [1e3 * t for t in balancer_spans]
        out["balancer_ms"] = sum(ms) / len(ms)
        out["balancer_share"] = out["balancer_ms"] / out["step_ms"]
    if PROFILE:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us:
                kernels[ev.key[:160]] = kernels.get(ev.key[:160], 0.0) + us / 1e3
        out["_profile"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
    return out


PROFILE = False  # set by --profile


def moelab_row(impl: str, preset: str, overrides: dict, warmup: int, steps: int, check_grads: bool,
               compile_model: bool = False, device: str = "cuda") -> dict:
    cfg = load_config(preset, overrides)
    torch.manual_seed(0)
    model = MoELab(cfg.model).to(device)
    if compile_model:  # as train.compile=true does in the trainer; the KDA op stays eager
        model.compile()
        impl += "_compiled"
    B, T = cfg.train.batch_size, cfg.data.seq_len
    n_params = sum(p.numel() for p in model.parameters())
    balance = bool(balanced_routers(model))
    row = {"impl": impl, "preset": preset, **{k: str(v) for k, v in overrides.items()}, "params": n_params,
           "params_activated": param_counts(cfg.model)["activated"], "B": B, "T": T}
    if balance:
        row["balancer"] = cfg.model.moe.balancer
    if check_grads:
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

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x, x, return_logits=False)
        return out.loss + out.aux_loss  # what LitMoELab.training_step minimizes

    res = time_training(model, loss_fn, B, T, cfg.model.vocab_size, warmup, steps, balance, device)
    row.update(res)
    _save_profile(row)
    peak = device == "cuda"
    row["mfu"] = 6 * n_params * res["tok_per_s"] / ANCHOR_PEAK if peak else None
    row["mfu_convention"] = MFU_CONVENTION
    row["mfu_model_flops"] = 3 * flops_per_token(cfg.model, T) * res["tok_per_s"] / DATASHEET_PEAK if peak else None
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


# --smoke: k3-mini's structure (3:1 KDA/MLA + final MLA, Block AttnRes, LatentMoE, QB histogram) at toy
# sizes, so the CPU can run the rows in seconds; m k / n = 2 * 32 * 2 / 8 is an integer, as QB needs.
SMOKE_K3_MINI = {
    "model.vocab_size": 512, "data.vocab_size": 512, "model.d_model": 64, "model.n_layers": 5,
    "model.dense_ffn_dim": 128, "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2,
    "model.kda.num_heads": 2, "model.kda.head_dim": 32, "model.kda.decay_rank": 8, "model.kda.chunk_size": 16,
    "model.mla.num_heads": 2, "model.mla.head_dim": 32, "model.mla.kv_latent_dim": 32,
    "model.mla.q_latent_dim": 32, "model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.latent_dim": 32,
    "model.moe.expert_dim": 32, "model.moe.shared_dim": 32, "model.moe.quantile_balancing_bins": 64,
}


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
    res = time_training(model, lambda m, x: m(input_ids=x, labels=x).loss, B, T, V, warmup, steps)
    row = {"impl": "fla_kda", "params": n_params, "B": B, "T": T, **res,
           "mfu": 6 * n_params * res["tok_per_s"] / ANCHOR_PEAK, "mfu_convention": MFU_CONVENTION}
    _save_profile(row)
    del model
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="studies/throughput_h200.json")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--only", choices=["fla", "gpu-small", "k3-mini"], default=None, help="run one group of rows")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU check of the harness: the k3-mini rows at toy sizes, fp32, 1 warm-up + 2 timed steps")
    ap.add_argument("--profile", default=None, help="also write each row's per-kernel device time to this JSON")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for the moelab_fla_shape rows (e.g. model.kda.chunk_size=32); "
                         "the row's impl gets a '+' suffix and the overrides are recorded in it")
    ap.add_argument("--compile", action="store_true",
                    help="also time moelab_fla_shape with torch.compile (row moelab_fla_shape_compiled)")
    args = ap.parse_args()
    global PROFILE, PROFILE_OUT
    PROFILE, PROFILE_OUT = args.profile is not None, args.profile
    if args.smoke:
        if args.only not in (None, "k3-mini") or args.profile or args.compile:
            sys.exit(f"--smoke runs the k3-mini rows only (got --only {args.only}, --profile {args.profile}, "
                     f"--compile {args.compile})")
        args.only, args.warmup, args.steps = "k3-mini", 1, 2
    elif not torch.cuda.is_available():
        sys.exit("bench_model.py needs a CUDA device (or --smoke for the CPU check)")
    device = "cpu" if args.smoke else "cuda"
    command = "python " + " ".join(sys.argv)
    rows = []

    def add(row: dict | None) -> None:
        # recorded as soon as measured: a run cut by a time limit keeps the rows it finished
        rows.append(row)
        if row is not None:
            record_throughput(args.out, row, command)
            print(json.dumps(row), flush=True)

    if args.only in (None, "fla"):
        over = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
        name = "moelab_fla_shape" + ("+" + ",".join(args.set) if args.set else "")
        add(moelab_row(name, "fla-shape", over, args.warmup, args.steps, check_grads=False))
        if args.compile:
            add(moelab_row(name, "fla-shape", over, args.warmup, args.steps, check_grads=False, compile_model=True))
        add(fla_row(args.warmup, args.steps))
    if args.only in (None, "gpu-small"):
        for impl, mode, blocks in (("prenorm", "prenorm", None), ("full_attnres", "full_attnres", None),
                                   ("block_attnres", "block_attnres", 6), ("block_attnres_8", "block_attnres", 8)):
            over = {"model.residual.mode": mode}
            if blocks is not None:
                over["model.residual.num_blocks"] = blocks
            add(moelab_row(f"moelab_gpu_small_{impl}", "gpu-small", over, args.warmup, args.steps, check_grads=True))
    if args.only in (None, "k3-mini"):
        base = SMOKE_K3_MINI if args.smoke else {}
        none = moelab_row("moelab_k3_mini_balancer_none", "k3-mini", {**base, "model.moe.balancer": "none"},
                          args.warmup, args.steps, check_grads=True, device=device)
        add(none)
        qb = moelab_row("moelab_k3_mini", "k3-mini", base, args.warmup, args.steps, check_grads=True, device=device)
        qb["balancer_cost"] = 1.0 - qb["tok_per_s"] / none["tok_per_s"]
        add(qb)
    print(f"\n{'impl':32s} {'params':>8s} {'ms/step':>9s} {'host ms':>8s} {'tok/s':>10s} {'MFU(6N)':>8s} "
          f"{'peak GB':>8s} {'balancer':>9s}")
    for r in rows:
        if r is not None:
            mfu = f"{100 * r['mfu']:7.1f}%" if r["mfu"] is not None else f"{'-':>8s}"
            mem = f"{r['peak_mem_gb']:8.1f}" if r["peak_mem_gb"] is not None else f"{'-':>8s}"
            share = f"{100 * r['balancer_share']:8.2f}%" if "balancer_share" in r else f"{'-':>9s}"
            print(f"{r['impl']:32s} {r['params'] / 1e6:7.1f}M {r['step_ms']:9.1f} {r['host_ms']:8.1f} "
                  f"{r['tok_per_s'] / 1e3:9.1f}K {mfu} {mem} {share}")
    by = {r["impl"]: r for r in rows if r is not None}
    if "moelab_gpu_small_prenorm" in by:
        base = by["moelab_gpu_small_prenorm"]
        for name, target in (("full_attnres", 0.75), ("block_attnres", 0.9), ("block_attnres_8", 0.9)):
            r = by.get(f"moelab_gpu_small_{name}")
            if r is not None:
                print(f"gpu-small {name} / prenorm: tokens/s {r['tok_per_s'] / base['tok_per_s']:.3f} "
                      f"(target >= {target}), peak memory {r['peak_mem_gb'] / base['peak_mem_gb']:.3f}"
                      + (" (target <= 1.2)" if name.startswith("block") else ""))
    if "moelab_k3_mini" in by:
        print(f"k3-mini quantile_balancing vs none: {100 * by['moelab_k3_mini']['balancer_cost']:.2f}% fewer "
              f"tokens/s (target <= 2%)")
    if "fla_kda" in by and "moelab_fla_shape" in by:
        ratio = by["moelab_fla_shape"]["tok_per_s"] / by["fla_kda"]["tok_per_s"]
        print(f"moelab_fla_shape / fla_kda tokens/s = {ratio:.3f} (target >= 1.0)")
    if any(not math.isfinite(r.get("loss", 0.0)) or r.get("nonfinite_grads") for r in rows if r is not None):
        sys.exit("non-finite loss or gradients: see the rows above")


if __name__ == "__main__":
    main()
