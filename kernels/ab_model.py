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

Compare mode settles "same speed within noise" between an old tree and this one in one call:

    mkdir -p /tmp/old && git archive 9e7d213 moelab kernels | tar -x -C /tmp/old
    python kernels/ab_model.py --compare /tmp/old --old-commit 9e7d213 --commit <new sha> \\
        --rounds 4 --steps 30 --out kernels/results/restructure_h200/ab_compare.json

Every round of every tree is a fresh process (two moelab trees cannot share one, and the noise to
beat is the spread between processes) on the same GPU, timing only the training step without the
id check (``step_ms_nocheck``) and its host issue time (``host_ms``). One warm-up round per tree
runs first and is discarded (Triton compilation and cache fills would otherwise bias round 1);
then the rounds alternate old, new, new, old, ... so a drift of the machine over the call hits
both trees alike. Per tree the JSON gives median, min, max and range (max - min) of the rounds;
then the difference of medians (new - old) against a noise estimate, the larger of the two trees'
ranges: a difference no larger than what re-running the same tree gave in this call cannot be
told from noise. That rule, not a bootstrap or permutation interval, because the rounds are few
(4 per tree fit a 5-minute device call): a bootstrap of 4 values takes a handful of distinct
medians and covers too little, a permutation test of 4 against 4 has 70 splits. The range grows
with more rounds, so past ~10 rounds per tree an interval would be the better rule. ``verdict``:
"same within noise" when |difference| <= noise, else "new slower by X% (beyond noise)" or
"new faster by X% (beyond noise)", X relative to the old median.

``--smoke``: CPU, toy sizes, fp32 (checks the script, times nothing meaningful); with
``--compare`` two rounds unless ``--rounds`` says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
SMOKE_SETS = {"model.d_model": 64, "model.n_layers": 4, "model.max_seq_len": 32, "data.seq_len": 32,
              "train.batch_size": 2, "model.kda.num_heads": 2, "model.kda.head_dim": 32,
              "model.kda.decay_rank": 8, "model.kda.chunk_size": 16, "model.mla.num_heads": 2,
              "model.mla.head_dim": 32, "model.mla.kv_latent_dim": 32, "model.moe.num_experts": 8,
              "model.moe.top_k": 2, "model.moe.latent_dim": 32, "model.moe.expert_dim": 32,
              "model.vocab_size": 512, "data.vocab_size": 512, "model.dense_ffn_dim": 128}


def summarize(values: list[float]) -> dict:
    """Median, min, max and range (max - min) of one tree's per-round times (ms)."""
    lo, hi = min(values), max(values)
    return {"values": list(values), "median": statistics.median(values), "min": lo, "max": hi, "range": hi - lo}


def compare(old: list[float], new: list[float]) -> dict:
    """Difference of medians (new - old, ms and % of the old median) against the noise, the larger of
    the two trees' ranges, and the verdict string (see the module docstring for the rule and why)."""
    if len(old) < 2 or len(new) < 2:
        raise ValueError(f"need >= 2 rounds per tree for a noise estimate, got old={len(old)}, new={len(new)}")
    o, n = summarize(old), summarize(new)
    diff = n["median"] - o["median"]
    noise = max(o["range"], n["range"])
    pct = 100 * diff / o["median"]
    if abs(diff) <= noise:
        verdict = "same within noise"
    else:
        verdict = f"new {'slower' if diff > 0 else 'faster'} by {abs(pct):.1f}% (beyond noise)"
    return {"old": o, "new": n, "diff_ms": diff, "diff_pct": pct, "noise_ms": noise,
            "noise_pct": 100 * noise / o["median"], "noise_method": "max of the two trees' ranges (max - min)",
            "verdict": verdict}


def round_order(rounds: int) -> list[str]:
    """Tree order of the timed runs: old, new, new, old, old, new, ... (each round holds both trees)."""
    return [t for r in range(rounds) for t in (("old", "new") if r % 2 == 0 else ("new", "old"))]


def git_head(root: str) -> str | None:
    """HEAD of the git checkout at ``root`` with ``-dirty`` if tracked files changed; None for an exported
    tree (or a machine without git)."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def measure(args: argparse.Namespace) -> dict:
    """One tree in this process: the row described in the module docstring (``--step-only``: the step
    without id check and its host time only, no check timing and no profile)."""
    root = os.path.abspath(args.root)
    sys.path.insert(0, root)

    import torch
    import triton
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
        over = {**SMOKE_SETS, **over}
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

    row = {"root": root, "moelab": moelab.__file__, "preset": args.preset, **{k: str(v) for k, v in over.items()},
           "B": B, "T": T, "warmup": args.warmup, "steps": args.steps, "torch": torch.__version__,
           "triton": triton.__version__, "gpu": torch.cuda.get_device_name() if cuda else None}
    if args.step_only:
        row["step_ms_nocheck"], row["host_ms"] = timed(False)
        return row
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
    row.update(step_ms=step_ms, step_ms_nocheck=step_ms_nocheck, host_ms=host_ms, device_ms=device_ms,
               cpu_ops=cpu_ops, launches=launches,
               top_cpu={e.key[:120]: {"count": e.count, "cpu_self_ms": e.self_cpu_time_total / 1e3} for e in top},
               command="python " + " ".join(sys.argv))
    print(f"{root}: step {step_ms:.1f} ms, without id check {step_ms_nocheck:.1f} ms, host {host_ms:.1f} ms, "
          f"device {device_ms:.1f} ms, {cpu_ops} aten ops, {launches} launches")
    return row


def run_round(args: argparse.Namespace, root: str, tmp: str, tag: str) -> dict:
    """One ``--step-only`` measurement of the tree at ``root`` in a fresh process (its own PYTHONPATH)."""
    out = os.path.join(tmp, f"{tag}.json")
    cmd = [sys.executable, HERE, "--root", root, "--step-only", "--preset", args.preset, "--warmup",
           str(args.warmup), "--steps", str(args.steps), "--out", out]
    cmd += ["--set", *args.set] if args.set else []
    cmd += ["--smoke"] if args.smoke else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"round {tag} on {root} failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-4000:]}")
    with open(out) as f:
        row = json.load(f)
    row["seconds"] = time.perf_counter() - t0
    print(f"{tag:>10} {root}: step {row['step_ms_nocheck']:.1f} ms, host {row['host_ms']:.1f} ms "
          f"({row['seconds']:.0f} s)", flush=True)
    return row


def compare_trees(args: argparse.Namespace) -> dict:
    """Alternating fresh-process rounds of the old tree (``--compare``) and the new one (``--root``)."""
    roots = {"old": os.path.abspath(args.compare), "new": os.path.abspath(args.root)}
    for tree, root in roots.items():
        if not os.path.isfile(os.path.join(root, "moelab", "__init__.py")):
            sys.exit(f"{tree} tree {root} has no moelab package (expected {root}/moelab/__init__.py)")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        warm = {tree: run_round(args, root, tmp, f"warm-{tree}") for tree, root in roots.items()}
        rows = []
        for i, tree in enumerate(round_order(args.rounds)):
            row = run_round(args, roots[tree], tmp, f"r{i // 2}-{tree}")
            rows.append({"round": i // 2, "tree": tree, "step_ms": row["step_ms_nocheck"], "host_ms": row["host_ms"],
                         "seconds": row["seconds"]})

    def per_tree(key: str) -> dict:
        return compare(*([r[key] for r in rows if r["tree"] == tree] for tree in ("old", "new")))

    step, host = per_tree("step_ms"), per_tree("host_ms")
    first = warm["new"]
    meta = {"gpu": first["gpu"], "torch": first["torch"], "triton": first["triton"],
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv), "commit": args.commit or git_head(roots["new"]),
            "old_commit": args.old_commit or git_head(roots["old"]),
            "commits_from": {"new": "--commit" if args.commit else "git HEAD of the tree",
                             "old": "--old-commit" if args.old_commit else "git HEAD of the tree"},
            "new_root": roots["new"], "old_root": roots["old"],
            "preset": args.preset, "set": args.set, "smoke": args.smoke, "rounds": args.rounds, "steps": args.steps,
            "warmup_steps": args.warmup, "B": first["B"], "T": first["T"], "seconds": time.perf_counter() - t0,
            "measured": "step_ms: synchronized ms per training step without the id check; host_ms: host issue time"}
    result = {"meta": meta, "verdict": step["verdict"], "step_ms": step, "host_ms": host, "rounds": rows,
              "warmup_rounds": {t: {"step_ms": w["step_ms_nocheck"], "host_ms": w["host_ms"], "seconds": w["seconds"]}
                                for t, w in warm.items()}}
    for name, c in (("step", step), ("host", host)):
        print(f"{name}: old median {c['old']['median']:.1f} ms [{c['old']['min']:.1f}, {c['old']['max']:.1f}], "
              f"new {c['new']['median']:.1f} ms [{c['new']['min']:.1f}, {c['new']['max']:.1f}]; "
              f"diff {c['diff_ms']:+.1f} ms ({c['diff_pct']:+.1f}%), noise {c['noise_ms']:.1f} ms: {c['verdict']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=REPO,
                    help="code tree holding the moelab package to measure (default: this repository); "
                         "with --compare the new tree")
    ap.add_argument("--compare", metavar="OLD_ROOT", default=None,
                    help="compare mode: the old tree (e.g. from git archive) against --root")
    ap.add_argument("--rounds", type=int, default=None, help="compare mode: timed rounds per tree (default 4; smoke 2)")
    ap.add_argument("--commit", default=None, help="compare mode: commit of the new tree (default: git HEAD of --root)")
    ap.add_argument("--old-commit", default=None,
                    help="compare mode: commit of the old tree (default: git HEAD of OLD_ROOT, None if exported)")
    ap.add_argument("--step-only", action="store_true",
                    help="time only the step without id check and its host time (one compare round)")
    ap.add_argument("--preset", default="gpu-small")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides (values parsed as YAML)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before timing (default 5; smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 2)")
    ap.add_argument("--smoke", action="store_true", help="CPU check of the script at toy sizes")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args()
    args.warmup = (1 if args.smoke else 5) if args.warmup is None else args.warmup
    args.steps = (2 if args.smoke else 10) if args.steps is None else args.steps
    args.rounds = (2 if args.smoke else 4) if args.rounds is None else args.rounds
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.compare is not None and args.rounds < 2:
        ap.error(f"--rounds must be >= 2 (the noise estimate needs a spread per tree), got {args.rounds}")
    result = compare_trees(args) if args.compare is not None else measure(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
