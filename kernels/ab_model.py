"""Where a whole-model training step spends its time: host (Python, aten dispatch, launches) or device.

Built for issue 11's before/after question (``bench_model.py --only gpu-small`` slower after the
restructure while every op alone kept its speed): it runs one model row on the code tree ``--root``
(this repository by default, or an exported older tree) and reports, for the same forward + backward
+ fused AdamW under bf16 autocast as ``bench_model.py``:

* ``step_ms``: mean synchronized step time with the model's per-call id range check on (what
  ``bench_model.py`` measures: the check reads min/max of the ids, a host sync per step);
* ``step_ms_nocheck``: the same without the id check (as training runs, ``LitMoELab``);
* ``host_ms``: host time to issue one step without any sync (id check off), mean over the timed
  steps; ``host_ms`` close to ``step_ms_nocheck`` means the step is host-bound;
* from ``torch.profiler`` over one step: ``device_ms`` (sum of kernel time), ``cpu_ops`` (aten ops
  issued), ``launches`` (kernel launch calls: CUDA runtime/driver), and ``cpu_self_ms`` of the 30
  ops with the most host time (``top_cpu``).

Run the old and the new tree in one device call, interleaved, so machine noise hits both alike:

    for i in 1 2; do
      python kernels/ab_model.py --root /path/to/old_tree --out /tmp/ab_old_$i.json
      python kernels/ab_model.py --out /tmp/ab_new_$i.json
    done

``--smoke``: CPU, toy sizes, fp32, torch backends (checks the script, times nothing meaningful).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="code tree holding the moelab package to measure (default: this repository)")
    ap.add_argument("--preset", default="gpu-small")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides (values parsed as YAML)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script at toy sizes")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    sys.path.insert(0, root)

    import torch
    import yaml

    import moelab
    from moelab.config import load_config
    from moelab.model import MoELab

    if not os.path.abspath(moelab.__file__).startswith(root + os.sep):
        sys.exit(f"moelab was imported from {moelab.__file__}, not from --root {root}")
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("ab_model.py needs a CUDA device (or --smoke for the CPU check)")
    over = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    if args.smoke:
        over = {"model.d_model": 64, "model.n_layers": 4, "model.max_seq_len": 32, "data.seq_len": 32,
                "train.batch_size": 2, "model.kda.num_heads": 2, "model.kda.head_dim": 32,
                "model.kda.decay_rank": 8, "model.kda.chunk_size": 16, "model.mla.num_heads": 2,
                "model.mla.head_dim": 32, "model.mla.kv_latent_dim": 32, "model.moe.num_experts": 8,
                "model.moe.top_k": 2, "model.moe.latent_dim": 32, "model.moe.expert_dim": 32,
                "model.vocab_size": 512, "data.vocab_size": 512, "model.dense_ffn_dim": 128, **over}
        args.warmup, args.steps = 1, 2
    cfg = load_config(args.preset, over)
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    model = MoELab(cfg.model).to(device)
    B, T, vocab = cfg.train.batch_size, cfg.data.seq_len, cfg.model.vocab_size
    x = torch.randint(0, vocab, (B, T), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda or None)
    # the id check is an argument of forward since the restructure, a module flag before it
    has_arg = "check_ids" in inspect.signature(model.forward).parameters

    def step(check: bool) -> torch.Tensor:
        if not has_arg:
            model.check_inputs = check
        kw = {"check_ids": check} if has_arg else {}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            out = model(x, x, return_logits=False, **kw)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(check: bool) -> tuple[float, float]:
        """(synchronized ms per step, host ms to issue one step)."""
        for _ in range(args.warmup):
            step(check)
        sync()
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            h0 = time.perf_counter()
            step(check)
            host += time.perf_counter() - h0
        sync()
        return 1e3 * (time.perf_counter() - t0) / args.steps, 1e3 * host / args.steps

    step_ms, _ = timed(True)
    step_ms_nocheck, host_ms = timed(False)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        step(False)
        sync()
    events = prof.key_averages()
    device_ms = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / 1e3
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC"))
    cpu_ops = sum(e.count for e in events if e.key.startswith("aten::"))
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:30]
    row = {
        "root": root, "moelab": moelab.__file__, "preset": args.preset, **{k: str(v) for k, v in over.items()},
        "B": B, "T": T, "step_ms": step_ms, "step_ms_nocheck": step_ms_nocheck, "host_ms": host_ms,
        "device_ms": device_ms, "cpu_ops": cpu_ops, "launches": launches,
        "top_cpu": {e.key[:120]: {"count": e.count, "cpu_self_ms": e.self_cpu_time_total / 1e3} for e in top},
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None,
        "command": "python " + " ".join(sys.argv),
    }
    print(f"{root}: step {step_ms:.1f} ms, without id check {step_ms_nocheck:.1f} ms, host {host_ms:.1f} ms, "
          f"device {device_ms:.1f} ms, {cpu_ops} aten ops, {launches} launches")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
