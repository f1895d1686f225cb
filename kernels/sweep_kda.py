"""Sweep the launch configs of moelab's KDA Triton kernels on one GPU: which configs are correct
(Triton 3.6 miscompiles some on Hopper) and how fast the correct ones are.

Phase 1 (parallel workers, one process each, restarted after a crash): for every candidate config
of one kernel (the others at a base config), run a bf16 forward + backward of chunk_kda in both
modes with a synchronize after every kernel launch; check every launch IN ISOLATION against fp32
torch computed from that launch's own inputs (state, out, dh), the gradients end to end
against the fp32 recurrence (wy, dqkg), and determinism (two runs bitwise equal). A crash is pinned
to the kernel whose launch was in flight. Phase 2 (one process): per-kernel device time of the
passing configs at B8 T4096 H16 D128 (CUDA events around each launch). Writes JSON, and the
fastest passing config per kernel to best_launch.json beside it (a ``launch_overrides(launch=...)``
value; a new default goes into ``triton_chunk.LAUNCH``).

    python kernels/sweep_kda.py --out kernels/results/kda_sweep_h200.json   # GPU, ~2 min
    KDA_SWEEP_SMOKE=1 python kernels/sweep_kda.py --workers 2 --deadline 600 --out /tmp/s.json  # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import check_kda_gpu as ck  # noqa: E402

from moelab.ops.kda import triton_chunk as tc  # noqa: E402

# Candidates per kernel (block, num_warps, num_stages). The 2026-11-30 sweep of the fused gradient
# kernel and of 16/32-wide blocks at 4/8 warps (faults, wrong states; kernels/README.md) narrowed
# these to the families that passed, plus the configs not timed then.
CANDS = {
    "wy": [(32, 2, 1), (64, 2, 1), (64, 4, 1), (64, 8, 1)],
    "dqkg": [(32, 2, 1), (64, 2, 1), (64, 4, 1), (64, 8, 1)],
    "state": [(32, 2, 1), (64, 2, 1), (64, 4, 1), (64, 8, 1)],
    "dh": [(32, 2, 1), (64, 2, 1), (64, 4, 1), (64, 8, 1)],
    "out": [(64, 4, 1), (128, 4, 1), (128, 8, 1), (64, 8, 1)],
}
ORDER = ["dqkg", "wy", "dh", "state", "out"]
SMOKE = os.environ.get("KDA_SWEEP_SMOKE") == "1"  # CPU interpreter dry run of the harness itself
DEV, DT = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
CHECK_SHAPE = (1, 130, 2, 32) if SMOKE else (1, 1024, 16, 128)
TIME_SHAPE = (1, 128, 2, 32) if SMOKE else (8, 4096, 16, 128)
if SMOKE:
    CANDS = {k: v[:2] for k, v in CANDS.items()}


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


class _Ev:
    """CUDA event, or a wall clock on CPU."""

    def __init__(self):
        self.e = torch.cuda.Event(enable_timing=True) if DEV == "cuda" else None

    def record(self):
        if self.e is not None:
            self.e.record()
        else:
            self.t = time.perf_counter()

    def elapsed_time(self, other):
        return self.e.elapsed_time(other.e) if self.e is not None else (other.t - self.t) * 1e3
TOL_ISO = 3e-2  # isolated launch vs fp32 torch (bf16 storage gives ~3e-3; a miscompile gives O(1))


def tests():
    out = []
    for name in ORDER:
        for cfg in CANDS[name]:
            out.append((name, tuple(cfg)))
    return out


# ---------------------------------------------------------------- isolated references (fp32 torch)
def _chunks(x, C):
    """[B, T, H, N] -> [B, H, NT, C, N] fp32."""
    B, T, H, N = x.shape
    return x.float().view(B, T // C, C, H, N).permute(0, 3, 1, 2, 4)


def _h_chunks(x):
    """[B, NT, H, K, V] -> [B, H, NT, K, V] fp32."""
    return x.float().permute(0, 2, 1, 3, 4)


def ref_state(a):
    C = a["C"]
    kd, w, u = (_chunks(a[n], C) for n in ("kd", "w", "u"))
    gl = a["gl"].float().permute(0, 2, 1, 3)  # [B, H, NT, K]
    B, H, NT, _, K = kd.shape
    V = u.shape[-1]
    h = a["h0"].float().clone() if a["HAS_H0"] else kd.new_zeros(B, H, K, V)
    hs, Us = [], []
    for c in range(NT):
        hs.append(h)
        U = u[:, :, c] - w[:, :, c] @ h
        Us.append(U)
        h = gl[:, :, c, :, None] * h + kd[:, :, c].transpose(-1, -2) @ U
    out = dict(hbuf=ck.rel_err(torch.stack(hs, 2), _h_chunks(a["hbuf"])),
               U=ck.rel_err(torch.stack(Us, 2), _chunks(a["U"], C)))
    if a["STORE_HT"]:
        out["hT"] = ck.rel_err(h, a["hT"].float())
    return out


def ref_out(a):
    C = a["C"]
    qg, A, U = _chunks(a["qg"], C), _chunks(a["Aqk"], C), _chunks(a["U"], C)
    o = qg @ _h_chunks(a["hbuf"]) + A @ U
    return dict(o=ck.rel_err(o, _chunks(a["o"], C)))


def ref_dh(a):
    C = a["C"]
    qg, kd, w, A, do = (_chunks(a[n], C) for n in ("qg", "kd", "w", "Aqk", "do"))
    gl = a["gl"].float().permute(0, 2, 1, 3)
    B, H, NT, _, K = kd.shape
    V = do.shape[-1]
    dh = a["dht"].float().clone() if a["HAS_DHT"] else kd.new_zeros(B, H, K, V)
    dhs, dUs = [None] * NT, [None] * NT
    for c in reversed(range(NT)):
        dhs[c] = dh
        dU = A[:, :, c].transpose(-1, -2) @ do[:, :, c] + kd[:, :, c] @ dh
        dUs[c] = dU
        dh = gl[:, :, c, :, None] * dh + qg[:, :, c].transpose(-1, -2) @ do[:, :, c] - w[:, :, c].transpose(-1, -2) @ dU
    out = dict(dhbuf=ck.rel_err(torch.stack(dhs, 2), _h_chunks(a["dhbuf"])),
               dU=ck.rel_err(torch.stack(dUs, 2), _chunks(a["dU"], C)))
    if a["STORE_DH0"]:
        out["dh0"] = ck.rel_err(dh, a["dh0"].float())
    return out


REFS = dict(state=ref_state, out=ref_out, dh=ref_dh)


# ---------------------------------------------------------------- launch instrumentation
class Probe:
    mode = "off"  # off | check | time
    log = None
    iso: dict = {}
    events: list = []


_orig_call = tc._Launcher.__call__


def _call(self, grid, *args, **kwargs):
    if Probe.mode == "time":
        s, e = _Ev(), _Ev()
        s.record()
        res = _orig_call(self, grid, *args, **kwargs)
        e.record()
        Probe.events.append((self.name, s, e))
        return res
    if Probe.mode == "check":
        Probe.log.write(f"launch {self.name} {tc.LAUNCH[self.name]}\n")
        Probe.log.flush()
        if os.environ.get("KDA_SWEEP_FAKE_CRASH") == f"{self.name}{tuple(tc.LAUNCH[self.name])}":
            os._exit(3)  # harness self-test: behave like an illegal memory access in this launch
    res = _orig_call(self, grid, *args, **kwargs)
    if Probe.mode == "check":
        _sync()
        Probe.log.write(f"done {self.name}\n")
        Probe.log.flush()
        if self.name in REFS:
            a = dict(zip(self.kernel.arg_names, args))
            a.update(kwargs)
            errs = REFS[self.name](a)
            Probe.log.write(f"iso {self.name} {json.dumps(errs)}\n")
            Probe.log.flush()
            prev = Probe.iso.setdefault(self.name, {})
            for n, v in errs.items():
                prev[n] = max(prev.get(n, 0.0), v)
    return res


tc._Launcher.__call__ = _call


# ---------------------------------------------------------------- worker
def worker(args):
    todo = [tuple(json.loads(x)) for x in args.todo]
    base = json.loads(args.base)
    ins, s0, do, dS = ck.make_inputs(*CHECK_SHAPE, "bounded", True, DT, DEV, seed=0)
    with torch.no_grad():
        ref = ck.recurrent_reference(*ins, s0, do, dS)
    Probe.log = open(args.log, "a")
    for name, cfg in todo:
        cfg = tuple(cfg)
        Probe.log.write(f"start {json.dumps([name, list(cfg)])} base {json.dumps(base)}\n")
        Probe.log.flush()
        t0 = time.time()
        res = dict(kernel=name, cfg=list(cfg), base=base, modes={})
        for mode in ("bounded", "general"):
            with tc.launch_overrides(launch={**base, name: cfg}):
                Probe.mode, Probe.iso = "check", {}
                out1 = ck.fwd_bwd(tc.chunk_kda, ins, s0, do, dS, mode=mode, g_min=ck.g_min_for(mode))
                Probe.mode = "off"
                out2 = ck.fwd_bwd(tc.chunk_kda, ins, s0, do, dS, mode=mode, g_min=ck.g_min_for(mode))
            det = all(torch.equal(x, y) for x, y in zip(out1, out2))
            e2e = {n: ck.rel_err(r, o) for n, r, o in zip(ck.NAMES, ref, out1)}
            res["modes"][mode] = dict(iso=Probe.iso, e2e=e2e, deterministic=det)
        res["seconds"] = round(time.time() - t0, 1)
        Probe.log.write("result " + json.dumps(res) + "\n")
        Probe.log.flush()


def verdict(res):
    """(ok, why) of a phase-1 result for the kernel under test."""
    name = res["kernel"]
    why = []
    for mode, r in res["modes"].items():
        if not r["deterministic"]:
            why.append(f"{mode}: nondeterministic")
        if name in REFS:
            bad = {n: v for n, v in r["iso"].get(name, {}).items() if not v <= TOL_ISO}
            if bad:
                why.append(f"{mode}: {bad}")
        tol = {n: (ck.O_TOL if n in ("o", "final_state") else ck.GRAD_TOL) for n in r["e2e"]}
        bad = {n: round(v, 4) for n, v in r["e2e"].items() if not v <= tol[n]}
        if bad and name in ("wy", "dqkg"):
            why.append(f"{mode} e2e: {bad}")
    return not why, "; ".join(why)


def e2e_ok(res):
    return all(v <= (ck.O_TOL if n in ("o", "final_state") else ck.GRAD_TOL)
               for r in res["modes"].values() for n, v in r["e2e"].items())


# ---------------------------------------------------------------- driver
def _time_mode(name, mode, leaves, do):
    """Device ms of kernel ``name`` (median of 3 fwd+bwd), the fwd+bwd ms, every kernel's ms and
    whether the 3 runs' gradients are bitwise equal, at the current launch configs."""
    def step():
        for x in leaves:
            x.grad = None
        o, _ = tc.chunk_kda(*leaves, mode=mode, g_min=ck.g_min_for(mode), validate=False)
        o.backward(do)
    step()
    _sync()
    per, tot, grads = [], [], []
    for _ in range(3):
        Probe.mode, Probe.events = "time", []
        s, e = _Ev(), _Ev()
        s.record()
        step()
        e.record()
        _sync()
        Probe.mode = "off"
        acc = {}
        for n, a, b in Probe.events:
            acc[n] = acc.get(n, 0.0) + a.elapsed_time(b)
        per.append(acc)
        tot.append(s.elapsed_time(e))
        grads.append([x.grad.clone() for x in leaves])
    det = all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))
    return dict(kernel_ms=round(sorted(p[name] for p in per)[1], 4), fwdbwd_ms=round(sorted(tot)[1], 3),
                all_ms={n: round(sorted(p[n] for p in per)[1], 4) for n in per[0]}, deterministic=det)


def timer(args):
    """Phase-2 worker: per-kernel device ms at B8 T4096 H16 D128 of each given config (others at
    its base), plus a determinism check at that size (grads of 3 runs bitwise equal)."""
    ins, s0, do, dS = ck.make_inputs(*TIME_SHAPE, "bounded", False, DT, DEV, seed=1)
    leaves = [x.detach().clone().requires_grad_() for x in ins]
    log = open(args.log, "a")
    for item in args.todo:
        res = json.loads(item)
        name, cfg = res["kernel"], tuple(res["cfg"])
        log.write(f"start {json.dumps([name, list(cfg)])}\n")
        log.flush()
        row = dict(kernel=name, cfg=list(cfg), base=res["base"])
        with tc.launch_overrides(launch={**res["base"], name: cfg}):
            for mode in ("bounded", "general"):
                row[mode] = _time_mode(name, mode, leaves, do)
        log.write("row " + json.dumps(row) + "\n")
        log.flush()


def run_workers(kind, items, nworkers, deadline, outdir, base=None, tag="result "):
    """Run items over nworkers restartable subprocesses; returns (rows, crashes, base)."""
    base = dict(base or {})
    bad_base = {k: set() for k in CANDS}
    rows, crashes, procs = [], [], {}
    t_start = time.time()

    def spawn(i, its):
        if not its:
            return
        log = os.path.join(outdir, f"{kind}{i}_{time.time():.3f}.log")
        cmd = [sys.executable, __file__, "--" + kind, "--log", log, "--base", json.dumps(base), "--todo"]
        cmd += [json.dumps(x) for x in its]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log + ".err", "w"))
        procs[i] = dict(p=p, log=log, items=its, t=time.time(), pos=0)

    for i in range(nworkers):
        spawn(i, items[i::nworkers])
    while procs:
        time.sleep(0.5)
        for i in list(procs):
            w = procs[i]
            lines = open(w["log"]).read().splitlines() if os.path.exists(w["log"]) else []
            done = [json.loads(x[len(tag):]) for x in lines if x.startswith(tag)]
            rc = w["p"].poll()
            if len(done) > w["pos"]:
                w["pos"], w["t"] = len(done), time.time()
            late = time.time() - t_start >= deadline
            stuck = time.time() - w["t"] > 100
            if rc is None and not stuck and not late:
                continue
            if rc is None:
                w["p"].kill()
                w["p"].wait()
            rows.extend(done)
            del procs[i]
            rest = w["items"][len(done):]
            if rc == 0 or not rest:
                continue
            launches = [x for x in lines if x.startswith("launch ")]
            dones = [x for x in lines if x.startswith("done ")]
            culprit = launches[-1].split()[1] if len(launches) > len(dones) else None
            cur = rest[0]
            why = "deadline" if late else ("hang" if rc is None else f"exit {rc}")
            tail = open(w["log"] + ".err").read()[-700:]
            crashes.append(dict(phase=kind, test=cur, culprit=culprit, why=why, stderr_tail=tail))
            print(f"CRASH[{kind}] {cur if kind == 'worker' else (cur['kernel'], cur['cfg'])} culprit={culprit} {why}: "
                  f"{tail[-300:]!r}", flush=True)
            if late:
                continue
            starts = [x for x in lines if x.startswith("start ")]
            used = json.loads(starts[-1].split(" base ", 1)[1]) if starts and " base " in starts[-1] else {}
            crashes[-1]["iso"] = [x[4:] for x in lines[len(lines) - lines[::-1].index(starts[-1]) if starts else 0:]
                                  if x.startswith("iso ")] if starts else []
            if kind == "worker" and culprit is not None and culprit != cur[0] and culprit in used:
                bad_base[culprit].add(tuple(used[culprit]))
                if tuple(base[culprit]) in bad_base[culprit]:
                    nxt = [c for c in CANDS[culprit] if c not in bad_base[culprit]]
                    if nxt:
                        base[culprit] = list(nxt[0])
                if tuple(base[culprit]) not in bad_base[culprit]:
                    spawn(i, rest)
                    continue
            spawn(i, rest[1:])
    return rows, crashes, base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--timer", action="store_true")
    ap.add_argument("--log")
    ap.add_argument("--base")
    ap.add_argument("--todo", nargs="*")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--deadline", type=float, default=120)
    ap.add_argument("--time-seconds", type=float, default=40)
    ap.add_argument("--out", default="/tmp/kda_sweep.json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.timer:
        timer(args)
        return 0
    outdir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "sweep_logs")
    os.makedirs(outdir, exist_ok=True)
    t0 = time.time()
    base = {k: list(v) for k, v in tc.LAUNCH.items()}
    results, crashes, base = run_workers("worker", [[n, list(c)] for n, c in tests()], args.workers,
                                         args.deadline, outdir, base)
    print(f"phase 1: {len(results)} results, {len(crashes)} crashes in {time.time() - t0:.0f} s; base {base}",
          flush=True)
    for c in crashes:
        print(f"crashed: {c['test']} culprit={c['culprit']} {c['why']} iso={c.get('iso')}", flush=True)
    for r in results:
        r["ok"], r["why"] = verdict(r)
        iso = {m: {k: round(max(v.values()), 4) for k, v in x["iso"].items()} for m, x in r["modes"].items()}
        e2e = {m: round(max(x["e2e"].values()), 4) for m, x in r["modes"].items()}
        print(f"{r['kernel']:6s} {str(tuple(r['cfg'])):13s} {'ok ' if r['ok'] else 'BAD'} e2e_max {e2e} "
              f"iso_max {iso} {r['why']} ({r['seconds']} s)", flush=True)
    passed = sorted([r for r in results if r["ok"]], key=lambda r: (ORDER.index(r["kernel"]), r["cfg"]))
    t1 = time.time()
    rows, crashes2, _ = run_workers("timer", [dict(kernel=r["kernel"], cfg=r["cfg"], base=base) for r in passed],
                                    1, args.time_seconds, outdir, base, tag="row ")
    print(f"phase 2: {len(rows)} timed in {time.time() - t1:.0f} s", flush=True)
    for r in rows:
        print(f"time {r['kernel']:6s} {str(tuple(r['cfg'])):13s} bounded {r['bounded']['kernel_ms']:.3f} ms "
              f"(fwd+bwd {r['bounded']['fwdbwd_ms']:.2f}, det {r['bounded']['deterministic']}) general "
              f"{r['general']['kernel_ms']:.3f} ms (fwd+bwd {r['general']['fwdbwd_ms']:.2f}, det "
              f"{r['general']['deterministic']})", flush=True)
    best = dict(base)
    for name in ORDER:
        cand = [r for r in rows if r["kernel"] == name and r["bounded"]["deterministic"]
                and r["general"]["deterministic"]]
        if cand:
            best[name] = min(cand, key=lambda r: r["bounded"]["kernel_ms"] + r["general"]["kernel_ms"])["cfg"]
    print("best", json.dumps(best), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(results=results, crashes=crashes + crashes2, base=base, timing=rows, best=best,
                       triton=__import__("triton").__version__, torch=torch.__version__), f, indent=1)
    with open(os.path.join(os.path.dirname(os.path.abspath(args.out)), "best_launch.json"), "w") as f:
        json.dump(best, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
