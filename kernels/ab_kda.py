"""A/B variants of moelab's KDA launch configs on one GPU: correctness and speed of each variant,
one process per variant (a launch config that miscompiles may fault and take its process down).

A variant is a name plus ``launch`` / ``maxnreg`` entries, applied in its process with
``triton_chunk.launch_overrides`` (kernel names as in ``triton_chunk.LAUNCH``). Each one runs:

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
        --variant 'nocap={"maxnreg": {"kktr": null}}'
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
    """``name`` or ``name={"launch": {...}, "maxnreg": {...}}``."""
    name, _, spec = text.partition("=")
    spec = json.loads(spec) if spec else {}
    bad = set(spec) - {"launch", "maxnreg"}
    if bad:
        raise SystemExit(f"variant {name!r}: keys {sorted(bad)} are not allowed: expected 'launch' and/or 'maxnreg'")
    return name, spec


def child(args: argparse.Namespace) -> None:
    """Runs inside the variant's process: the variant's launch configs for the whole measurement."""
    import torch

    if not torch.cuda.is_available():  # before moelab's kernels are defined
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.dirname(HERE))
    sys.path.insert(0, HERE)
    from moelab.ops.kda import triton_chunk as tc

    with tc.launch_overrides(**json.loads(args.spec)):
        measure(args, tc)


def measure(args: argparse.Namespace, tc) -> None:
    """Check, then (if it passed) time ``tc.chunk_kda`` at the current launch configs; appends a row."""
    import bench_kda as bk
    import check_kda_gpu as ck
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    import datetime

    import triton

    row = dict(variant=args.name, spec=json.loads(args.spec), launch=tc.launch_configs(), maxnreg=dict(tc.MAXNREG),
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


def child_cmd(args: argparse.Namespace, name: str, spec: dict, *extra: str) -> list[str]:
    """The command line of variant ``name``'s child process."""
    return [sys.executable, os.path.abspath(__file__), "--child", "--name", name, "--spec", json.dumps(spec),
            "--out", args.out, "--shapes", *args.shapes, "--modes", *args.modes, *extra]


def warm(args: argparse.Namespace, variants: list[tuple[str, dict]]) -> None:
    """Compile every variant's kernels (``--warm`` children, ``args.jobs`` at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(item):
        name, spec = item
        cmd = child_cmd(args, name, spec, "--warm")
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * 3)
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
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny shapes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="{}", help=argparse.SUPPRESS)
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
        before = open(args.out).read().count("\n") if os.path.exists(args.out) else 0
        t0 = time.time()
        cmd = child_cmd(args, name, spec, "--command", "python " + " ".join(sys.argv))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
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
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
