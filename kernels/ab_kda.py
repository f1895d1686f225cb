"""A/B variants of moelab's KDA kernels on one GPU: correctness and speed of each variant, one
process per variant (a launch config that miscompiles may fault and take its process down).

A variant is a name plus ``MOELAB_KDA_LAUNCH`` / ``MOELAB_KDA_TUNING`` / ``MOELAB_KDA_MAXNREG``
overrides. Each one runs:

1. a bf16 forward + backward at B1 T1024 H16 D128 (both modes, bounded gate, initial state)
   against the fp32 token recurrence (``check_kda_gpu.py``'s reference): rel. errors, pass/fail at
   the op's targets (o, final state 5e-3; gradients 1e-2), and determinism (two runs bitwise equal);
2. only if that passed: fwd and fwd+bwd ``do_bench`` medians of ``chunk_kda`` with the fused prep
   (as ``bench_kda.py``'s moelab rows) at each ``--shapes`` entry, bounded mode (``--modes`` to add
   general), plus the device time per kernel of one bounded fwd+bwd at the first shape.

``--jobs N`` first runs every variant's check in N processes at once (``--warm`` children: they
compile each variant's kernels into the shared Triton cache and write nothing), so the timed runs,
one process at a time, do not each wait minutes for the compiler.

Prints one table and writes every row to ``--out`` (JSON lines are written as they finish, so a
run cut by a time limit keeps what it measured).

    python kernels/ab_kda.py --out /tmp/ab.json \\
        --variant base \\
        --variant 'dqkg64={"launch": {"dqkg": [64, 4, 1]}}' \\
        --variant 'subtile={"tuning": {"scores": "subtile"}}'
    python kernels/ab_kda.py --smoke --out /tmp/ab.json --variant base   # CPU interpreter dry run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_variant(text: str) -> tuple[str, dict]:
    """``name`` or ``name={"launch": {...}, "tuning": {...}}``."""
    name, _, spec = text.partition("=")
    spec = json.loads(spec) if spec else {}
    bad = set(spec) - {"launch", "tuning", "maxnreg"}
    if bad:
        raise SystemExit(f"variant {name!r}: keys {sorted(bad)} are not allowed: expected 'launch', 'tuning' "
                         f"and/or 'maxnreg'")
    return name, spec


def child(args: argparse.Namespace) -> None:
    """Runs inside the variant's process (environment already set)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    import bench_kda as bk
    import check_kda_gpu as ck

    from moelab.ops.kda import triton_chunk as tc

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    import datetime

    import triton

    row = dict(variant=args.name, launch=tc.launch_configs(), tuning=dict(tc.TUNING), maxnreg=dict(tc.MAXNREG),
               meta=dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (triton interpreter)",
                         torch=torch.__version__, triton=triton.__version__,
                         date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                         command=args.command))
    B, T = (1, 1024) if dev == "cuda" else (1, 130)
    H, D = (16, 128) if dev == "cuda" else (2, 32)
    ins, s0, do, dS = ck.make_inputs(B, T, H, D, "bounded", True, dt, dev, seed=0)
    with torch.no_grad():
        ref = ck.recurrent_reference(*ins, s0, do, dS)
    ok = True
    for mode in ("bounded", "general"):
        a = ck.fwd_bwd(tc.chunk_kda, ins, s0, do, dS, mode=mode, g_min=ck.g_min_for(mode))
        b = ck.fwd_bwd(tc.chunk_kda, ins, s0, do, dS, mode=mode, g_min=ck.g_min_for(mode))
        errs = {n: ck.rel_err(r, o) for n, r, o in zip(ck.NAMES, ref, a)}
        det = all(torch.equal(x, y) for x, y in zip(a, b))
        good = det and all(v <= (ck.O_TOL if n in ("o", "final_state") else ck.GRAD_TOL) for n, v in errs.items())
        row[f"check_{mode}"] = dict(errors=errs, deterministic=det, ok=good)
        ok = ok and good
    row["ok"] = ok
    if args.warm:  # compile only: one untimed fwd+bwd per shape (shape specializations), no row
        for shape in args.shapes if ok else []:
            Bs, Ts, Hs, Ds = (int(x) for x in shape.split(","))
            for mode in args.modes:
                bk.bench_one(f"moelab_{mode}", Bs, Ts, Hs, Ds, dev, 1, 1)
        return
    if ok:
        warmup, rep = (10, 50) if dev == "cuda" else (1, 1)
        row["timing"] = []
        for shape in args.shapes:
            Bs, Ts, Hs, Ds = (int(x) for x in shape.split(","))
            for mode in args.modes:
                impl = f"moelab_{mode}"
                f, fb, peak = bk.bench_one(impl, Bs, Ts, Hs, Ds, dev, warmup, rep)
                row["timing"].append(dict(impl=impl, B=Bs, T=Ts, H=Hs, D=Ds, fwd_ms=f, fwdbwd_ms=fb, peak_mem_gb=peak))
        if dev == "cuda":
            prof = bk.profile_kernels(*(int(x) for x in args.shapes[0].split(",")), dev, impls=("moelab_bounded",))
            row["kernel_ms"] = {k: round(v, 4) for k, v in prof["moelab_bounded"].items() if v >= 0.01}
    with open(args.out, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def variant_env(spec: dict) -> dict:
    env = dict(os.environ)
    for key, var in (("launch", "LAUNCH"), ("tuning", "TUNING"), ("maxnreg", "MAXNREG")):
        if key in spec:
            env[f"MOELAB_KDA_{var}"] = json.dumps(spec[key])
    return env


def child_cmd(args: argparse.Namespace, name: str, *extra: str) -> list[str]:
    """The command line of variant ``name``'s child process."""
    return [sys.executable, os.path.abspath(__file__), "--child", "--name", name, "--out", args.out,
            "--shapes", *args.shapes, "--modes", *args.modes, *extra]


def warm(args: argparse.Namespace, variants: list[tuple[str, dict]]) -> None:
    """Compile every variant's kernels (``--warm`` children, ``args.jobs`` at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        name, spec = item
        cmd = child_cmd(args, name, "--warm")
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=variant_env(spec), capture_output=True, text=True, timeout=args.timeout * 3)
            status = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        return f"warm {name}: {status}, {time.time() - t0:.0f} s"

    with ThreadPoolExecutor(args.jobs) as pool:
        for line in pool.map(one, variants):
            print(line, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variant", action="append", default=[], help="name or name=JSON (see the docstring)")
    ap.add_argument("--shapes", nargs="*", default=["8,4096,16,128", "1,32768,16,128"], help="B,T,H,D")
    ap.add_argument("--modes", nargs="*", default=["bounded"], choices=["bounded", "general"])
    ap.add_argument("--out", required=True, help="JSON-lines output, one row per variant")
    ap.add_argument("--timeout", type=float, default=150, help="seconds per variant")
    ap.add_argument("--jobs", type=int, default=1, help="compile this many variants at once first")
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pick-env", help="write the fastest passing variant's MOELAB_KDA_* exports to this file "
                    "(summed fwd+bwd over the shapes; the first variant unless another is >1%% faster)")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny shapes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--command", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    if args.smoke:
        args.shapes = ["1,128,2,32"]
    variants = [parse_variant(v) for v in (args.variant or ["base"])]
    if args.jobs > 1:
        warm(args, variants)
    rows = []
    for name, spec in variants:
        env = variant_env(spec)
        before = open(args.out).read().count("\n") if os.path.exists(args.out) else 0
        t0 = time.time()
        cmd = child_cmd(args, name, "--command", "python " + " ".join(sys.argv))
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            status = "exit 0" if proc.returncode == 0 else f"exit {proc.returncode}: {proc.stderr[-300:]!r}"
            if proc.returncode != 0:  # the whole error, next to the JSON lines
                with open(args.out + f".{name}.err", "w") as fh:
                    fh.write(proc.stderr)
        except subprocess.TimeoutExpired:
            status = "timeout"
        lines = open(args.out).read().splitlines() if os.path.exists(args.out) else []
        row = json.loads(lines[-1]) if len(lines) > before else dict(variant=name, ok=False)
        row["status"], row["seconds"] = status, round(time.time() - t0, 1)
        rows.append(row)
        t = row.get("timing") or []
        desc = "  ".join(f"{r['impl'][7:]} B{r['B']} T{r['T']}: {r['fwd_ms']:.3f}/{r['fwdbwd_ms']:.3f} ms"
                         for r in t)
        print(f"{name:20s} ok={row.get('ok')} {desc} [{status[:80]}, {row['seconds']} s]", flush=True)
    if args.pick_env:
        pick(rows, dict(variants), args.pick_env)
    return 0 if all(r.get("ok") for r in rows) else 1


def pick(rows: list[dict], specs: dict, path: str) -> None:
    """Write ``export MOELAB_KDA_...`` lines for the fastest passing variant to ``path``."""
    import shlex

    def total(r):
        t = r.get("timing") or []
        return sum(x["fwdbwd_ms"] for x in t) if r.get("ok") and t else float("inf")

    best = rows[0]
    for r in rows[1:]:
        if total(r) < 0.99 * total(best):
            best = r
    env = variant_env(specs[best["variant"]])
    with open(path, "w") as fh:
        fh.write(f"# picked {best['variant']} (summed fwd+bwd {total(best):.3f} ms)\n")
        for key in ("LAUNCH", "TUNING", "MAXNREG"):
            if f"MOELAB_KDA_{key}" in env and f"MOELAB_KDA_{key}" not in os.environ:
                fh.write(f"export MOELAB_KDA_{key}={shlex.quote(env[f'MOELAB_KDA_{key}'])}\n")
    print(f"picked {best['variant']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
