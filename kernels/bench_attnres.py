"""Benchmark: the AttnRes depth aggregation (one read of the residual stream) forward and
forward+backward on one GPU, in one run: moelab's fused op, today's plain PyTorch path, fla's op.

    python kernels/bench_attnres.py                 # GPU: writes kernels/results/attnres_h200.json
    python kernels/bench_attnres.py --smoke         # CPU (Triton interpreter), tiny sizes, prints only
    python kernels/bench_attnres.py --sweep-only    # GPU: launch-config sweep at gpu-small's shape (below)
    python kernels/bench_attnres.py --host          # host microseconds per call (GPU: real launches;
                                                    # CPU: launches stubbed, the Python part only)

Problem (issue 16): N = 32768 tokens, D = 2048, L = 4, 9, 17 sources of bf16 ``[N, D]``, fp32
pseudo-query and key-norm weight (as trained), everything under bf16 autocast. Rows:
  moelab_fused         ``moelab.ops.attnres.depth_attention`` on the list of sources (no stack).
  torch_plain          ``DepthAttention`` with ``backend="torch"``: torch.stack of the list, then the
                       plain module (today's model path, the stack included).
  fla_fused_attnres    ``fla.ops.attnres.fused_attnres`` on the list of sources (fla versions differ:
                       some stack a list inside, some read the list as it is), when importable.
  fla_fused_attnres_stacked  the same on a pre-stacked ``[L, 1, N, D]`` tensor (the stack not timed).
  *_mixed              the same with source 0 in fp32 (the model's embedding) among bf16 outputs.
Every row: fwd_ms (no grad), fwdbwd_ms (forward + backward w.r.t. sources, query and norm weight,
fixed output gradient), peak_mem_gb (max allocated during one fwd+bwd step, inputs included) and
extra_mem_gb (that peak minus what was allocated before the step), and the relative errors of h
and of every gradient against the fp32 reference (``depth_attention_torch`` on the same values).

``--sweep`` (``--sweep-only``: without the rows above; defaults: D = 512, N = 32768, L = 4, 7, 13,
25: gpu-small's reads) times the fused op as the model calls it: source 0 fp32 (the embedding), the
others bf16, fp32 h, gradient slots (every source but the last adds into its slot, the last one is
the owner). For each tile (rows, warps) it
times the forward (no grad) and the backward alone (a retained graph), for the backward also under
a few persistent grid sizes (programs per SM), checks h and every gradient against the fp32
reference, and prints GB/s against the ideal traffic (every tensor read or written once). It ends
with the best forward and backward launch summed over the L values, as a ``LAUNCH_TABLE`` entry
for ``moelab/ops/attnres.py``; in the JSON as ``sweep`` and ``sweep_best`` (``--sweep-only`` GPU
default: kernels/results/attnres_sweep_h200.json).

``--host`` times the host side of one read (forward + backward) of a 24-sublayer stream at a
tiny N (the device never waits): ``AttnResidual`` in block (6) and full mode against prenorm, per
read, and the bare op per L; plus the Triton launches per read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

if not torch.cuda.is_available():  # must precede the first @triton.jit of moelab's kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

import moelab.ops.attnres as attnres_op  # noqa: E402
from moelab.model.attnres import AttnResidual, DepthAttention  # noqa: E402
from moelab.model.config import ResidualConfig  # noqa: E402
from moelab.ops.attnres import (  # noqa: E402
    GradSlot,
    LaunchConfig,
    depth_attention,
    depth_attention_torch,
    launch_config,
)
from tests.helpers import rel_err  # noqa: E402

OUT_TOL, GRAD_TOL = 5e-3, 1e-2
ANCHORS_FWDBWD_MS = {"fla_fused_attnres": {4: 1.10, 9: 1.46, 17: 2.70}, "torch_plain": {4: 9.1, 9: 19.3, 17: 32.9}}


def _bench(fn, grad_to_none: list[torch.Tensor], cuda: bool) -> float:
    """Median milliseconds of ``fn``; triton's do_bench on CUDA, a wall-clock median of 2 on CPU."""
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")
    fn()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _fla():
    """fla's fused op, or None with the reason."""
    try:
        from fla.ops.attnres import fused_attnres

        return fused_attnres, None
    except Exception as exc:  # not installed, or an import-time failure: the row says which
        return None, repr(exc)[:300]


def _make(L: int, N: int, D: int, mixed: bool, dev: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    # [B = 1, T = N, D]: the plain module's layout
    srcs = [(torch.randn(1, N, D, generator=gen) * (0.5 + 0.25 * i)).to(dev) for i in range(L)]
    srcs = [x if (mixed and i == 0) else x.bfloat16() for i, x in enumerate(srcs)]
    query = (torch.randn(D, generator=gen) * 3 / D ** 0.5).to(dev)
    weight = (torch.rand(D, generator=gen) + 0.5).to(dev)
    dh = torch.randn(1, N, D, generator=gen).to(dev)
    return srcs, query, weight, dh


def _impls(fla_fn, cfg: LaunchConfig | None):
    """name -> prepare(srcs, q, w) -> (leaves, forward() -> h, grads() -> [*source grads, dq, dw])."""

    def _leaves(srcs, q, w):
        return [x.detach().clone().requires_grad_() for x in [*srcs, q, w]]

    def moelab(srcs, q, w):
        leaves = _leaves(srcs, q, w)
        return (leaves, lambda: depth_attention(leaves[:-2], leaves[-2], leaves[-1], backend="triton", config=cfg)[0],
                lambda: [x.grad for x in leaves])

    def plain(srcs, q, w):
        att = DepthAttention(q.numel(), backend="torch").to(q.device)
        with torch.no_grad():
            att.query.copy_(q)
            att.key_norm.weight.copy_(w)
        leaves = [x.detach().clone().requires_grad_() for x in srcs] + [att.query, att.key_norm.weight]
        return leaves, lambda: att(leaves[:-2])[0], lambda: [x.grad for x in leaves]

    def fla(srcs, q, w):
        leaves = _leaves(srcs, q, w)
        return (leaves, lambda: fla_fn(leaves[-2], leaves[:-2], leaves[-1], rms_eps=1e-6),
                lambda: [x.grad for x in leaves])

    def fla_stacked(srcs, q, w):
        stacked = torch.stack(srcs).requires_grad_()  # mixed dtypes promote to fp32 here
        leaves = [stacked, q.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
        return (leaves, lambda: fla_fn(leaves[1], leaves[0], leaves[2], rms_eps=1e-6),
                lambda: [*stacked.grad.unbind(0), leaves[1].grad, leaves[2].grad])

    impls = {"moelab_fused": moelab, "torch_plain": plain}
    if fla_fn is not None:
        impls.update(fla_fused_attnres=fla, fla_fused_attnres_stacked=fla_stacked)
    return impls


def _errors(out_h, grads, ref) -> dict:
    errs = dict(h_err=rel_err(ref[0], out_h.float()),
                dsrc_err=max(rel_err(a, b.float()) for a, b in zip(ref[1], grads[:-2])),
                dquery_err=rel_err(ref[2], grads[-2].float()), dnorm_weight_err=rel_err(ref[3], grads[-1].float()))
    errs["ok"] = errs["h_err"] <= OUT_TOL and max(v for k, v in errs.items() if k != "h_err") <= GRAD_TOL
    return errs


def _reference(srcs, q, w, dh):
    """fp32 h and gradients (sources, query, norm weight) of (h * dh).sum()."""
    leaves = [x.detach().to(torch.float32, copy=True).requires_grad_() for x in [*srcs, q, w]]
    h, _ = depth_attention_torch(leaves[:-2], leaves[-2], leaves[-1], 1e-6, torch.float32)
    h.backward(dh)
    return h.detach(), [x.grad for x in leaves[:-2]], leaves[-2].grad, leaves[-1].grad


def _run_impl(name, prepare, srcs, q, w, dh, ref, cuda: bool) -> dict:
    leaves, forward, grads = prepare(srcs, q, w)
    dev_type = "cuda" if cuda else "cpu"
    with torch.autocast(dev_type, dtype=torch.bfloat16):
        h = forward()
    dh = dh.to(h.dtype)
    h.backward(dh)
    row = dict(impl=name, L=len(srcs), out_dtype=str(h.dtype).replace("torch.", ""),
               **_errors(h.detach(), grads(), ref))
    del h

    def fwd():
        with torch.no_grad(), torch.autocast(dev_type, dtype=torch.bfloat16):
            forward()

    def step():
        with torch.autocast(dev_type, dtype=torch.bfloat16):
            h = forward()
        h.backward(dh)

    row["fwdbwd_ms"] = _bench(step, leaves, cuda)
    row["fwd_ms"] = _bench(fwd, [], cuda)
    if cuda:
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        row.update(peak_mem_gb=peak / 1e9, extra_mem_gb=(peak - base) / 1e9)
    else:
        row.update(peak_mem_gb=None, extra_mem_gb=None)
    return row


def _sweep_tiles(D: int) -> list[tuple[int, int]]:
    """(rows, warps) with 8 or 16 elements of a ``[rows, next_pow2(D)]`` tile per thread, 4..16 warps."""
    bd = attnres_op._pow2(D)
    return [(rows, warps) for warps in (4, 8, 16) for ept in (8, 16)
            if (rows := ept * 32 * warps // bd) >= 1 and rows * bd == ept * 32 * warps and rows <= 64]


def _model_like(L: int, N: int, D: int, dev: str, seed: int):
    """Sources as a model's read sees them: source 0 fp32 (the embedding), the others bf16."""
    srcs, q, w, dh = _make(L, N, D, True, dev, seed)
    return [x.view(N, D) for x in srcs], q, w, dh.view(N, D)


def _ideal_bytes(srcs: list[torch.Tensor]) -> tuple[int, int]:
    """Forward and backward traffic if every tensor is read or written once: forward reads the
    sources, writes fp32 h and the fp32 row statistics ``[2L + 1, N]``; backward reads dh, h, the
    sources and the statistics, adds into L - 1 slots (read + write) and writes the last one."""
    N, D = srcs[0].shape
    L, el = len(srcs), N * D
    src = sum(x.element_size() for x in srcs) * el
    stats = (2 * L + 1) * N * 4
    fwd = src + 4 * el + stats
    bwd = 8 * el + src + stats + sum(2 * x.element_size() for x in srcs[:-1]) * el + srcs[-1].element_size() * el
    return fwd, bwd


def _sweep_one(srcs, q, w, dh, ref, rows: int, warps: int, pps_list, cuda: bool) -> list[dict]:
    """Rows of one tile: forward, then the backward under each programs-per-SM in ``pps_list``."""
    fwd_bytes, bwd_bytes = _ideal_bytes(srcs)
    L = len(srcs)
    out = []
    for pps in pps_list:
        cfg = LaunchConfig(rows=rows, warps=warps, programs_per_sm=pps)
        leaves = [x.detach().clone().requires_grad_() for x in [*srcs, q, w]]
        slots = [GradSlot() for _ in srcs]
        for x, sl in zip(leaves[:L - 1], slots):
            sl.taken, sl.grad = True, torch.zeros_like(x)
        h, _ = depth_attention(leaves[:L], leaves[L], leaves[L + 1], backend="triton", config=cfg, weights=False,
                               slots=slots)
        h.backward(dh, retain_graph=True)
        grads = [sl.grad.clone() for sl in slots[:L - 1]] + [leaves[L - 1].grad, leaves[L].grad, leaves[L + 1].grad]
        row = dict(L=L, rows=rows, warps=warps, programs_per_sm=pps, **_errors(h.detach(), grads, ref))

        def bwd(h=h):
            h.backward(dh, retain_graph=True)

        row["bwd_ms"] = _bench(bwd, leaves, cuda)
        row["bwd_gbps"] = bwd_bytes / row["bwd_ms"] / 1e6
        if pps == pps_list[0]:
            def fwd(xs=leaves, cfg=cfg):
                with torch.no_grad():
                    depth_attention(xs[:L], xs[L], xs[L + 1], backend="triton", config=cfg, weights=False)

            row["fwd_ms"] = _bench(fwd, [], cuda)
            row["fwd_gbps"] = fwd_bytes / row["fwd_ms"] / 1e6
        out.append(row)
        print("sweep", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        del h, leaves, slots, grads
    return out


def run_sweep(args, cuda: bool, dev: str) -> tuple[list[dict], dict]:
    """The launch sweep (see the module docstring); returns its rows and the best launch."""
    N, D = args.tokens, args.sweep_d_model
    Ls = [int(x) for x in args.sweep_sources.split(",")]
    tiles = ([tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")] if args.tiles
             else _sweep_tiles(D))
    pps_list = [int(x) for x in args.programs_per_sm.split(",")]
    if args.smoke:
        tiles, pps_list = tiles[:2], pps_list[:2]
    rows = []
    for L in Ls:
        srcs, q, w, dh = _model_like(L, N, D, dev, seed=L)
        ref = _reference(srcs, q, w, dh)
        for r, wp in tiles:
            rows += _sweep_one(srcs, q, w, dh, ref, r, wp, pps_list, cuda)
        del srcs, ref
        if cuda:
            torch.cuda.empty_cache()
    ok = [r for r in rows if r["ok"]]

    def total(key: str, match) -> float:
        picked = [r[key] for r in ok if match(r)]
        return sum(picked) if len(picked) == len(Ls) else float("inf")

    fwd_best = min(tiles, key=lambda t: total("fwd_ms", lambda r: (r["rows"], r["warps"]) == t and "fwd_ms" in r))
    bwd_best = min(((t, p) for t in tiles for p in pps_list),
                   key=lambda tp: total("bwd_ms", lambda r: ((r["rows"], r["warps"]), r["programs_per_sm"]) == tp))
    cur = launch_config(D)
    best = dict(rows=fwd_best[0], warps=fwd_best[1], programs_per_sm=bwd_best[1], bwd_rows=bwd_best[0][0],
                bwd_warps=bwd_best[0][1],
                fwd_ms_sum=total("fwd_ms", lambda r: (r["rows"], r["warps"]) == fwd_best and "fwd_ms" in r),
                bwd_ms_sum=total("bwd_ms", lambda r: ((r["rows"], r["warps"]), r["programs_per_sm"]) == bwd_best),
                current=dict(rows=cur.rows, warps=cur.warps, programs_per_sm=cur.programs_per_sm, bwd=cur.bwd),
                all_ok=len(ok) == len(rows))
    print(f"\n{'L':>3s} {'rows':>4s} {'warps':>5s} {'pps':>4s} {'fwd ms':>8s} {'fwd GB/s':>9s} {'bwd ms':>8s} "
          f"{'bwd GB/s':>9s} ok")
    for r in rows:
        f = f"{r['fwd_ms']:8.3f} {r['fwd_gbps']:9.0f}" if "fwd_ms" in r else f"{'':8s} {'':9s}"
        print(f"{r['L']:3d} {r['rows']:4d} {r['warps']:5d} {r['programs_per_sm']:4d} {f} {r['bwd_ms']:8.3f} "
              f"{r['bwd_gbps']:9.0f} {r['ok']}")
    print(f"\nbest over L={Ls}: forward {fwd_best} ({best['fwd_ms_sum']:.3f} ms summed), backward {bwd_best[0]} "
          f"at programs_per_sm={bwd_best[1]} ({best['bwd_ms_sum']:.3f} ms summed); current {best['current']}")
    print(f"LAUNCH_TABLE entry: {D}: LaunchConfig(rows={best['rows']}, warps={best['warps']}, "
          f"programs_per_sm={best['programs_per_sm']}, bwd_rows={best['bwd_rows']}, bwd_warps={best['bwd_warps']})")
    return rows, best


class _LaunchCounter:
    """Counts launches of a Triton kernel (CPU: and skips them, so only the Python part is timed)."""

    def __init__(self, kernel, run: bool) -> None:
        self.kernel, self.run, self.n = kernel, run, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid] if self.run else (lambda *a, **k: None)


def run_host(args, cuda: bool, dev: str) -> dict:
    """Host microseconds per read (see the module docstring): min over repeats of the mean over steps."""
    N, D, n_sub = 256 if cuda else 16, args.sweep_d_model, 24
    counters = [_LaunchCounter(k, cuda) for k in (attnres_op._attnres_fwd_kernel, attnres_op._attnres_bwd_kernel)]
    attnres_op._attnres_fwd_kernel, attnres_op._attnres_bwd_kernel = counters

    def timed(step, reps=7, iters=20) -> float:
        for _ in range(3):
            step()
        for c in counters:
            c.n = 0
        best = float("inf")
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            if cuda:
                torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t0) / iters)
        return best * 1e6

    out = dict(n_tokens=N, d_model=D, sublayers=n_sub, stubbed_launches=not cuda, stream={}, op={})
    base = None
    for mode, blocks in (("prenorm", None), ("block_attnres", 6), ("full_attnres", None)):
        res = AttnResidual(D, n_sub, ResidualConfig(mode=mode, num_blocks=blocks or 4, backend="triton")).to(dev)
        emb = torch.randn(1, N, D, device=dev, requires_grad=True)
        ws = [torch.randn(D, device=dev, requires_grad=True) for _ in range(n_sub)]

        def step(res=res, emb=emb, ws=ws):
            st = res.stream(emb)
            for i in range(n_sub):
                st.write(i, (st.read(i) * ws[i]).to(torch.bfloat16))
            st.read_final().float().sum().backward()

        us = timed(step)
        launches = sum(c.n for c in counters) / (7 * 20)
        base = base if base is not None else us
        per_read = (us - base) / (n_sub + 1)
        out["stream"][mode] = dict(step_us=us, host_us_per_read=per_read, triton_launches_per_step=launches)
        print(f"stream {mode:14s} step {us:9.1f} us   over prenorm per read (fwd+bwd) {per_read:7.1f} us   "
              f"Triton launches per step {launches:g}")
    for L in (2, 4, 7, 13, 25):
        srcs = [torch.randn(N, D, device=dev, dtype=torch.float32 if i == 0 else torch.bfloat16, requires_grad=True)
                for i in range(L)]
        q, w = torch.zeros(D, device=dev, requires_grad=True), torch.ones(D, device=dev, requires_grad=True)
        dh = torch.randn(N, D, device=dev)
        fixed = [GradSlot() for _ in range(L - 1)]

        def call(srcs=srcs, q=q, w=w, dh=dh, fixed=fixed):
            for sl, x in zip(fixed, srcs):  # every source but the last adds into its slot, as in a model
                sl.taken, sl.grad = True, sl.grad if sl.grad is not None else torch.zeros_like(x)
            h, _ = depth_attention(srcs, q, w, backend="triton", weights=False, slots=[*fixed, GradSlot()])
            h.backward(dh)

        us = timed(call, iters=50)
        out["op"][L] = dict(host_us=us, triton_launches=sum(c.n for c in counters) / (7 * 50))
        print(f"op L={L:2d}: forward + backward {us:7.1f} us per call (host), Triton launches per call "
              f"{out['op'][L]['triton_launches']:g}")
    return out
def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, no JSON unless --out")
    ap.add_argument("--out", default=None, help="JSON path (GPU default: kernels/results/attnres_h200.json, "
                    "with --sweep-only kernels/results/attnres_sweep_h200.json)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--sources", default="4,9,17", help="comma-separated L values")
    ap.add_argument("--no-mixed", action="store_true", help="skip the rows with an fp32 source 0")
    ap.add_argument("--sweep", action="store_true", help="also the launch-config sweep of the fused op (see above)")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep without the comparison rows")
    ap.add_argument("--sweep-d-model", type=int, default=512, help="--sweep: width")
    ap.add_argument("--sweep-sources", default="4,7,13,25", help="--sweep: comma-separated L values")
    ap.add_argument("--tiles", default=None, help="--sweep: rowsxwarps list, e.g. 4x8,8x8 (default: a grid by D)")
    ap.add_argument("--programs-per-sm", default="0,2,4", help="--sweep: backward grid sizes (0: all resident)")
    ap.add_argument("--host", action="store_true", help="only the host time per call, at --sweep-d-model (see above)")
    args = ap.parse_args()
    args.sweep = args.sweep or args.sweep_only

    cuda = torch.cuda.is_available() and not args.smoke
    if args.host:
        res = run_host(args, cuda, "cuda" if cuda else "cpu")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(dict(meta=dict(commit=_commit(), gpu=torch.cuda.get_device_name() if cuda else "cpu",
                                         torch=torch.__version__, triton=triton.__version__), **res), fh, indent=1)
        return 0
    if args.smoke:
        args.tokens, args.d_model, args.sources = 37, 72, "1,3"
        args.sweep_d_model, args.sweep_sources = 72, "1,3"
    elif not cuda:
        ap.error("no CUDA device: use --smoke for the CPU run")
    dev = "cuda" if cuda else "cpu"
    sweep, best = run_sweep(args, cuda, dev) if args.sweep else ([], None)
    sweep_meta = dict(sweep_d_model=args.sweep_d_model, sweep_sources=args.sweep_sources,
                      sweep_inputs="source 0 fp32, others bf16, fp32 q/w/h/dh; slots: all but the last source add",
                      sweep_timing="do_bench median; backward alone on a retained graph") if args.sweep else {}
    if args.sweep_only:
        out = args.out or (None if args.smoke else os.path.join(ROOT, "kernels", "results", "attnres_sweep_h200.json"))
        if out:
            meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu (smoke, Triton interpreter)",
                        torch=torch.__version__, triton=triton.__version__, commit=_commit(),
                        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                        command=" ".join([os.path.basename(sys.executable)] + sys.argv), tokens=args.tokens,
                        tolerances=dict(h=OUT_TOL, grads=GRAD_TOL), all_ok=best["all_ok"], **sweep_meta)
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as fh:
                json.dump(dict(meta=meta, sweep=sweep, sweep_best=best), fh, indent=1)
            print(f"wrote {out}")
        return 0 if best["all_ok"] else 1
    N, D = args.tokens, args.d_model
    Ls = [int(x) for x in args.sources.split(",")]
    fla_fn, fla_err = _fla() if cuda else (None, "not run on CPU")
    rows = []
    for L in Ls:
        for mixed in (False, True) if not args.no_mixed else (False,):
            srcs, q, w, dh = _make(L, N, D, mixed, dev, seed=L)
            ref = _reference(srcs, q, w, dh)
            for name, prepare in _impls(fla_fn, None).items():
                name = name + ("_mixed" if mixed else "")
                try:
                    row = _run_impl(name, prepare, srcs, q, w, dh, ref, cuda)
                except Exception as exc:  # fla under autocast with mixed dtypes fails to compile: record it
                    row = dict(impl=name, L=L, error=repr(exc)[:500])
                rows.append(row)
                print(json.dumps(row))
                if cuda:
                    torch.cuda.empty_cache()
            del ref, srcs
            if cuda:
                torch.cuda.empty_cache()

    by = {(r["impl"], r["L"]): r for r in rows if "fwdbwd_ms" in r}
    summary = []
    for L in Ls:
        ours = by.get(("moelab_fused", L))
        fla_rows = [by[(n, L)] for n in ("fla_fused_attnres", "fla_fused_attnres_stacked") if (n, L) in by]
        others = {"torch_plain": by.get(("torch_plain", L)),
                  "fla_best": min(fla_rows, key=lambda r: r["fwdbwd_ms"]) if fla_rows else None}
        line = dict(L=L)
        for other, row in others.items():
            if ours and row:
                line[f"fwdbwd_speedup_vs_{other}"] = row["fwdbwd_ms"] / ours["fwdbwd_ms"]
                line[f"fwd_speedup_vs_{other}"] = row["fwd_ms"] / ours["fwd_ms"]
        summary.append(line)
        print(json.dumps(line))
    cfg = launch_config(D)
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu (smoke, Triton interpreter)",
                torch=torch.__version__, triton=triton.__version__, fla=_fla_version(),
                fla_import_error=fla_err, date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                commit=_commit(), command=" ".join([os.path.basename(sys.executable)] + sys.argv),
                tokens=N, d_model=D, sources=Ls, autocast="bf16", source_dtype="bf16 (source 0 fp32 in *_mixed)",
                param_dtype="fp32", launch_config=dict(rows=cfg.rows, warps=cfg.warps,
                                                       programs_per_sm=cfg.programs_per_sm, bwd=cfg.bwd),
                timing="triton.testing.do_bench median, warmup 25 ms, rep 200 ms; grads set to None each step",
                tolerances=dict(h=OUT_TOL, grads=GRAD_TOL), anchors_fwdbwd_ms=ANCHORS_FWDBWD_MS,
                target="moelab_fused fwd+bwd >= 5x faster than torch_plain and at least the faster fla row's speed",
                target_met=bool(summary) and all(
                    line.get("fwdbwd_speedup_vs_torch_plain", 0) >= 5
                    and line.get("fwdbwd_speedup_vs_fla_best", 1) >= 1 for line in summary),
                all_ok=all(r.get("ok", False) for r in rows + sweep if r.get("impl", "moelab").startswith("moelab")),
                **sweep_meta)
    out = args.out or (None if args.smoke else os.path.join(ROOT, "kernels", "results", "attnres_h200.json"))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows, summary=summary, sweep=sweep, sweep_best=best), fh, indent=1)
        print(f"wrote {out}")
    return 0 if meta["all_ok"] else 1


def _fla_version() -> str | None:
    try:
        import fla

        return getattr(fla, "__version__", "unknown")
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
