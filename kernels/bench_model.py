"""Whole-model training throughput on one GPU, moelab beside fla, in one run.

Rows (added to ``studies/throughput_h200.json`` by ``impl``):

* ``moelab_fla_shape`` and ``fla_kda``: the fla anchor shape (all-KDA, dense SwiGLU FFN 4096, hidden
  1024, 12 layers, 8 heads x 128, vocab 32000), B = 8, T = 4096, bf16 autocast, fused AdamW, bounded
  gate (``g_min = -5``; fla: ``safe_gate=True, lower_bound=-5``). fla-core/flash-linear-attention are
  optional: without them the fla row is skipped and the script says so.
* ``moelab_gpu_small_<residual>``: the ``gpu-small`` preset (~100M total, hybrid KDA + gated MLA,
  LatentMoE) for each residual mode, with a check that loss and every gradient are finite.

Timing as the H200 anchor measurement of fla's model: 5 warm-up steps, then the mean of 10
timed steps on random tokens. MFU columns: ``mfu`` = 6 x params x tokens/s / 792e12 (the anchor's
convention: all parameters, the measured bf16 matmul ceiling), and ``mfu_model_flops`` = 3 x forward
FLOPs per token (moelab accounting, activated parameters + attention/KDA terms) x tokens/s / 989e12.

    python kernels/bench_model.py --out studies/throughput_h200.json [--steps 10] [--only fla]
    python kernels/bench_model.py --only fla --profile kernels/results/model_profile_h200.json

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
from moelab.train.perf import record_throughput  # noqa: E402

ANCHOR_PEAK = 792e12  # measured bf16 8192^3 matmul on the H200 (anchors/h200.md)
DATASHEET_PEAK = 989e12
MFU_CONVENTION = "6 x all params x tok/s / 792e12 (anchor convention)"


def time_training(model: torch.nn.Module, loss_fn, B: int, T: int, vocab: int, warmup: int, steps: int) -> dict:
    """Mean step time of forward + backward + fused AdamW under bf16 autocast, and peak memory."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    x = torch.randint(0, vocab, (B, T), device="cuda")

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    out = {"step_ms": dt * 1e3, "tok_per_s": B * T / dt, "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
           "loss": float(loss)}
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
               compile_model: bool = False) -> dict:
    cfg = load_config(preset, overrides)
    torch.manual_seed(0)
    model = MoELab(cfg.model).cuda()
    if compile_model:  # as train.compile=true does in the trainer; the KDA op stays eager
        model.compile()
        impl += "_compiled"
    B, T = cfg.train.batch_size, cfg.data.seq_len
    n_params = sum(p.numel() for p in model.parameters())
    row = {"impl": impl, "preset": preset, **{k: str(v) for k, v in overrides.items()}, "params": n_params,
           "params_activated": param_counts(cfg.model)["activated"], "B": B, "T": T}
    if check_grads:
        x = torch.randint(0, cfg.model.vocab_size, (B, T), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, x, return_logits=False)
        (out.loss + out.aux_loss).backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        row.update(first_loss=float(out.loss), loss_finite=bool(torch.isfinite(out.loss)), nonfinite_grads=bad,
                   params_without_grad=no_grad)
        model.zero_grad(set_to_none=True)
    res = time_training(model, lambda m, x: m(x, x, return_logits=False).loss, B, T, cfg.model.vocab_size, warmup,
                        steps)
    row.update(res)
    _save_profile(row)
    row["mfu"] = 6 * n_params * res["tok_per_s"] / ANCHOR_PEAK
    row["mfu_convention"] = MFU_CONVENTION
    row["mfu_model_flops"] = 3 * flops_per_token(cfg.model, T) * res["tok_per_s"] / DATASHEET_PEAK
    del model
    torch.cuda.empty_cache()
    return row


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
    ap.add_argument("--only", choices=["fla", "gpu-small"], default=None, help="run one group of rows")
    ap.add_argument("--profile", default=None, help="also write each row's per-kernel device time to this JSON")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for the moelab_fla_shape rows (e.g. model.kda.chunk_size=32); "
                         "the row's impl gets a '+' suffix and the overrides are recorded in it")
    ap.add_argument("--compile", action="store_true",
                    help="also time moelab_fla_shape with torch.compile (row moelab_fla_shape_compiled)")
    args = ap.parse_args()
    global PROFILE, PROFILE_OUT
    PROFILE, PROFILE_OUT = args.profile is not None, args.profile
    if not torch.cuda.is_available():
        sys.exit("bench_model.py needs a CUDA device")
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
        for mode in ("prenorm", "full_attnres", "block_attnres"):
            over = {"model.residual.mode": mode}
            if mode == "block_attnres":
                over["model.residual.num_blocks"] = 6
            add(moelab_row(f"moelab_gpu_small_{mode}", "gpu-small", over, args.warmup, args.steps, check_grads=True))
    print(f"\n{'impl':32s} {'params':>8s} {'ms/step':>9s} {'tok/s':>10s} {'MFU(6N)':>8s} {'peak GB':>8s}")
    for r in rows:
        if r is not None:
            print(f"{r['impl']:32s} {r['params'] / 1e6:7.1f}M {r['step_ms']:9.1f} {r['tok_per_s'] / 1e3:9.1f}K "
                  f"{100 * r['mfu']:7.1f}% {r['peak_mem_gb']:8.1f}")
    by = {r["impl"]: r for r in rows if r is not None}
    if "fla_kda" in by and "moelab_fla_shape" in by:
        ratio = by["moelab_fla_shape"]["tok_per_s"] / by["fla_kda"]["tok_per_s"]
        print(f"moelab_fla_shape / fla_kda tokens/s = {ratio:.3f} (target >= 1.0)")
    if any(not math.isfinite(r.get("loss", 0.0)) or r.get("nonfinite_grads") for r in rows if r is not None):
        sys.exit("non-finite loss or gradients: see the rows above")


if __name__ == "__main__":
    main()
