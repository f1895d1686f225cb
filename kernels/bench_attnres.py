"""Benchmark: the AttnRes depth aggregation (one read of the residual stream) forward and
forward+backward on one GPU, in one run: moelab's fused op, today's plain PyTorch path, fla's op.

    python kernels/bench_attnres.py                 # GPU: writes kernels/results/attnres_h200.json
    python kernels/bench_attnres.py --smoke         # CPU (Triton interpreter), tiny sizes, prints only
    python kernels/bench_attnres.py --sweep-only    # GPU: launch-config sweep at gpu-small's shape (below)
    python kernels/bench_attnres.py --host          # host microseconds per call (GPU: real launches;
                                                    # CPU: launches stubbed, the Python part only)
    python kernels/bench_attnres.py --replay full --replay block:8 [--replay-ops moelab,OLD_OP.py]
                                                    # GPU: a model step's AttnRes reads (below) ->
                                                    # kernels/results/attnres_replay_h200.json
    python kernels/bench_attnres.py --occupancy --sweep-d-model 2048 --sweep-inputs bf16
                                                    # registers and programs per SM of the sweep's launches,
                                                    # compiled for sm_90 (no GPU needed)
    python kernels/bench_attnres.py --compile [--compile-sublayers 24,8,16,32] [--replay-ops moelab,OLD_OP.py]
                                                    # the kernel variants a model step compiles and their
                                                    # time (GPU: -> kernels/results/attnres_compile_h200.json;
                                                    # CPU: compiled for sm_90, printed or --out)

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
25: gpu-small's reads) times the fused op as the model calls it (``--sweep-inputs model``: source 0
fp32, the embedding, the others bf16, fp32 h, gradient slots: every source but the last adds into
its slot, the last one is the owner) or as the rows above do (``--sweep-inputs bf16``: every source
bf16, no slots). For each launch (``--tiles`` x ``--groups`` x ``--stages``, or ``--sweep-configs``)
it times the forward (no grad) and the backward alone (a retained graph), for the backward also under
a few persistent grid sizes (programs per SM), checks h and every gradient against the fp32
reference, and prints GB/s against the ideal traffic (every tensor read or written once). It ends
with the best forward and backward launch summed over the L values, as a ``LAUNCH_TABLE`` entry
for ``moelab/ops/attnres.py``; in the JSON as ``sweep`` and ``sweep_best`` (``--sweep-only`` GPU
default: kernels/results/attnres_sweep_h200.json). ``--sweep-jobs K`` compiles the launches in K
processes first; ``--use-sweep-best`` (with ``--sweep-d-model`` = ``--d-model``) gives the rows above
the best launch, ``--config`` a given one (recorded in the JSON's meta either way).

``--host`` times the host side of one read (forward + backward) of a 24-sublayer stream at a
tiny N (the device never waits): ``AttnResidual`` in block (6) and full mode against prenorm, per
read, and the bare op per L; plus the Triton launches per read.

``--replay SPEC`` (``full`` or ``block:N``; repeatable) runs exactly a model step's sequence of
AttnRes reads and writes: ``moelab.model.attnres.AttnResidual``'s residual stream at gpu-small's
shape (24 sublayers, N = 32768 as 8 x 4096, D = 512; ``--replay-sublayers``, ``--tokens``,
``--sweep-d-model``), every sublayer a stand-in (pre-norm ``RMSNorm``, then a bias-free ``Linear``:
bf16 out under autocast, as the real mixers and FFNs), fp32 embedding, forward + backward under bf16
autocast. Every launch of the two AttnRes kernels is logged (L, dtypes, slots that add, grid, tile,
registers and spills of the compiled kernel, contiguity) and timed with CUDA events; per read the
median over ``--replay-steps`` steps, per step the sum, against the ideal bytes (``_read_bytes``)
and the floor at the measured device copy rate; plus one step under torch.profiler (the measure of
``kernels/bench_model.py --profile``) and, at gpu-small's shape, that profile's committed kernel
times beside it. ``--replay-configs`` lists launches of this op (``table`` = ``launch_config``, or
``ROWSxWARPS[xPROGRAMS_PER_SM][/BWD_ROWSxBWD_WARPS]``); ``--replay-ops`` adds op modules from files
(an older ``moelab/ops/attnres.py`` from ``git show``), replayed at their own launch;
``--replay-jobs K`` compiles the replays' kernels in K processes first (a Full stream has 50).
``--smoke``: CPU interpreter, 16 tokens, D = 72, 4 sublayers, one step.

``--compile`` counts the AttnRes kernel variants that one training step compiles, for each
``--replay`` spec (default full, block:6, block:8) at each depth of ``--compile-sublayers`` (default
24, gpu-small's; study 3's gpu preset: 8,16,32; a block count that does not divide a depth is
skipped), through the same replayed stream, per ``--replay-ops`` op; an op's variants accumulate
over the rows, as in one process that runs them all. On a GPU, from an empty Triton cache: the
seconds of each row's first step (it compiles) and of a second one, and the JIT caches' sizes. On
a CPU the kernels do not run: each launch's specialization is computed as Triton's JIT binder does
for an sm_90 target, and every new one is compiled for sm_90 (``triton.compile``, ptxas included;
``--compile-count-only`` skips that) in a process without the interpreter, with the binder's
microseconds per launch beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import importlib.util
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
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
from moelab.model.norm import RMSNorm  # noqa: E402
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


def _bench(fn, grad_to_none: list[torch.Tensor], cuda: bool, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn``; triton's do_bench on CUDA (``rep_ms`` of repeats), a wall-clock median
    of 2 on CPU."""
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median")
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


def _sweep_inputs(kind: str, L: int, N: int, D: int, dev: str, seed: int):
    """Sources as the sweep times them. ``model``: as a model's read sees them (source 0 fp32, the embedding;
    the others bf16; fp32 h and dh; every source but the last adds into its gradient slot). ``bf16``: the
    issue's benchmark read (every source bf16, h and dh bf16, no slots: the backward sums c in a first pass)."""
    srcs, q, w, dh = _make(L, N, D, kind == "model", dev, seed)
    srcs, dh = [x.view(N, D) for x in srcs], dh.view(N, D)
    return srcs, q, w, dh if kind == "model" else dh.bfloat16()


def _read_bytes(N: int, D: int, sizes: list[int], h_size: int, dh_size: int, acc: int, c_from_h: bool
                ) -> tuple[int, int]:
    """Forward and backward traffic of one read if every tensor its kernels touch is read or written
    once. ``sizes``: the sources' element sizes (their gradients have the same); ``acc``: bit i set
    when source i's gradient slot already holds a sum (the backward reads and writes it, else writes
    it). Forward: the sources, h (written) and the fp32 row statistics ``[2L + 1, N]``. Backward: dh,
    h when c comes from it, the sources, the statistics and the gradients (without c from h the kernel
    reads a tile's sources twice, the second time from L2: counted once)."""
    el, L = N * D, len(sizes)
    stats = (2 * L + 1) * N * 4
    src = sum(sizes) * el
    grads = sum(size * (2 if acc >> i & 1 else 1) for i, size in enumerate(sizes)) * el
    return src + h_size * el + stats, (dh_size + (h_size if c_from_h else 0)) * el + src + stats + grads


def _sweep_bytes(kind: str, srcs: list[torch.Tensor]) -> tuple[int, int]:
    """``_read_bytes`` of a sweep read (``_sweep_inputs``)."""
    N, D = srcs[0].shape
    model = kind == "model"
    return _read_bytes(N, D, [x.element_size() for x in srcs], 4 if model else 2, 4 if model else 2,
                       (1 << (len(srcs) - 1)) - 1 if model else 0, model)


def _sweep_one(kind: str, srcs, q, w, dh, ref, base: LaunchConfig, pps_list, cuda: bool, rep_ms: int) -> list[dict]:
    """Rows of one launch ``base`` (its programs_per_sm ignored): forward, then the backward under each
    programs-per-SM in ``pps_list``."""
    fwd_bytes, bwd_bytes = _sweep_bytes(kind, srcs)
    L = len(srcs)
    out = []
    for pps in pps_list:
        cfg = dataclasses.replace(base, programs_per_sm=pps)
        leaves = [x.detach().clone().requires_grad_() for x in [*srcs, q, w]]
        slots = None
        if kind == "model":
            slots = [GradSlot() for _ in srcs]
            for x, sl in zip(leaves[:L - 1], slots):
                sl.taken, sl.grad = True, torch.zeros_like(x)
        h, _ = depth_attention(leaves[:L], leaves[L], leaves[L + 1], backend="triton", config=cfg, weights=False,
                               slots=slots)
        h.backward(dh, retain_graph=True)
        grads = ([sl.grad.clone() for sl in slots[:L - 1]] if slots else [x.grad for x in leaves[:L - 1]])
        grads += [leaves[L - 1].grad, leaves[L].grad, leaves[L + 1].grad]
        row = dict(L=L, config=_config_text(cfg), rows=cfg.rows, warps=cfg.warps, group=cfg.group,
                   stages=cfg.stages, programs_per_sm=pps, **_errors(h.detach(), grads, ref))

        def bwd(h=h):
            h.backward(dh, retain_graph=True)

        row["bwd_ms"] = _bench(bwd, leaves, cuda, rep_ms)
        row["bwd_gbps"] = bwd_bytes / row["bwd_ms"] / 1e6
        if pps == pps_list[0]:
            def fwd(xs=leaves, cfg=cfg):
                with torch.no_grad():
                    depth_attention(xs[:L], xs[L], xs[L + 1], backend="triton", config=cfg, weights=False)

            row["fwd_ms"] = _bench(fwd, [], cuda, rep_ms)
            row["fwd_gbps"] = fwd_bytes / row["fwd_ms"] / 1e6
        out.append(row)
        print("sweep", json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        del h, leaves, slots, grads
    return out


def _sweep_launches(args, D: int) -> list[LaunchConfig]:
    """The sweep's launches: ``--sweep-configs``, else every ``--tiles`` x ``--groups`` x ``--stages``."""
    if args.sweep_configs:
        return [_parse_config(t) for t in args.sweep_configs.split(",")]
    tiles = ([tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")] if args.tiles
             else _sweep_tiles(D))
    groups = [int(x) for x in args.groups.split(",")]
    stages = [int(x) for x in args.stages.split(",")]
    if args.smoke:
        tiles, groups, stages = tiles[:1], groups[-1:], stages[-1:]
    out = []
    for (rows, warps), group, st in itertools.product(tiles, groups, stages):
        cfg = LaunchConfig(rows=rows, warps=warps, group=group, stages=st)
        cfg.validate()
        out.append(cfg)
    return out


def _precompile_sweep(args, launches: list[LaunchConfig]) -> None:
    """Fill Triton's on-disk cache with every sweep launch's kernels in ``--sweep-jobs`` processes at once
    (each runs its share of the launches once at a few tokens, untimed), so that the timed sweep only
    loads them."""
    shares = [launches[i::args.sweep_jobs] for i in range(args.sweep_jobs)]
    t0 = time.perf_counter()
    procs = []
    for share in shares:
        if not share:
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--sweep-only", "--sweep-compile-only", "--tokens", "256",
               "--sweep-d-model", str(args.sweep_d_model), "--sweep-sources", args.sweep_sources.split(",")[-1],
               "--sweep-inputs", args.sweep_inputs, "--programs-per-sm", args.programs_per_sm.split(",")[0],
               "--sweep-configs", ",".join(_config_text(c) for c in share)]
        procs.append((cmd, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True)))
    for cmd, proc in procs:
        log = proc.communicate()[0]
        if proc.returncode:
            print(f"precompile failed ({' '.join(cmd[2:])}):\n{log[-2000:]}")
    print(f"precompiled {len(launches)} sweep launches in {time.perf_counter() - t0:.0f} s "
          f"({args.sweep_jobs} processes)")


def run_sweep(args, cuda: bool, dev: str) -> tuple[list[dict], dict | None]:
    """The launch sweep (see the module docstring); returns its rows and the best launch."""
    N, D = args.tokens, args.sweep_d_model
    Ls = [int(x) for x in args.sweep_sources.split(",")]
    launches = _sweep_launches(args, D)
    pps_list = [int(x) for x in args.programs_per_sm.split(",")]
    if args.smoke:
        pps_list = pps_list[:2]
    if args.sweep_compile_only:
        srcs, q, w, dh = _sweep_inputs(args.sweep_inputs, Ls[-1], N, D, dev, seed=0)
        leaves = [x.detach().clone().requires_grad_() for x in [*srcs, q, w]]
        for cfg in launches:
            h, _ = depth_attention(leaves[:-2], leaves[-2], leaves[-1], backend="triton", weights=False,
                                   config=dataclasses.replace(cfg, programs_per_sm=pps_list[0]))
            h.backward(dh)
        return [], None
    if cuda and args.sweep_jobs > 1:
        _precompile_sweep(args, launches)
    rows = []
    for L in Ls:
        srcs, q, w, dh = _sweep_inputs(args.sweep_inputs, L, N, D, dev, seed=L)
        ref = _reference(srcs, q, w, dh)
        for cfg in launches:
            rows += _sweep_one(args.sweep_inputs, srcs, q, w, dh, ref, cfg, pps_list, cuda, args.sweep_rep_ms)
        del srcs, ref
        if cuda:
            torch.cuda.empty_cache()
    ok = [r for r in rows if r["ok"]]

    def total(key: str, match) -> float:
        picked = [r[key] for r in ok if match(r) and key in r]
        return sum(picked) if len(picked) == len(Ls) else float("inf")

    def fwd_key(r):
        return r["rows"], r["warps"], r["group"], r["stages"]

    fwd_keys = sorted({fwd_key(r) for r in rows})
    bwd_keys = sorted({(fwd_key(r), r["programs_per_sm"]) for r in rows})
    fwd_best = min(fwd_keys, key=lambda k: total("fwd_ms", lambda r: fwd_key(r) == k))
    bwd_best = min(bwd_keys, key=lambda k: total("bwd_ms", lambda r: (fwd_key(r), r["programs_per_sm"]) == k))
    cfg = LaunchConfig(rows=fwd_best[0], warps=fwd_best[1], group=fwd_best[2], stages=fwd_best[3],
                       programs_per_sm=bwd_best[1], bwd_rows=bwd_best[0][0], bwd_warps=bwd_best[0][1],
                       bwd_group=bwd_best[0][2], bwd_stages=bwd_best[0][3])
    cur = launch_config(D)
    best = dict(config=_config_text(cfg), launch=dataclasses.asdict(cfg),
                fwd_ms_sum=total("fwd_ms", lambda r: fwd_key(r) == fwd_best),
                bwd_ms_sum=total("bwd_ms", lambda r: (fwd_key(r), r["programs_per_sm"]) == bwd_best),
                current=_config_text(cur), current_fwd_ms_sum=None, current_bwd_ms_sum=None,
                all_ok=len(ok) == len(rows))
    cur_f = (cur.rows, cur.warps, cur.group, cur.stages)
    if cur_f in fwd_keys:
        best["current_fwd_ms_sum"] = total("fwd_ms", lambda r: fwd_key(r) == cur_f)
    if (cur.bwd_launch, cur.programs_per_sm) in bwd_keys:
        best["current_bwd_ms_sum"] = total("bwd_ms", lambda r: (fwd_key(r), r["programs_per_sm"]) == (
            cur.bwd_launch, cur.programs_per_sm))
    print(f"\n{'L':>3s} {'launch':>14s} {'pps':>4s} {'fwd ms':>8s} {'fwd GB/s':>9s} {'bwd ms':>8s} {'bwd GB/s':>9s} ok")
    for r in rows:
        f = f"{r['fwd_ms']:8.3f} {r['fwd_gbps']:9.0f}" if "fwd_ms" in r else f"{'':8s} {'':9s}"
        print(f"{r['L']:3d} {r['config'].split('/')[0]:>14s} {r['programs_per_sm']:4d} {f} {r['bwd_ms']:8.3f} "
              f"{r['bwd_gbps']:9.0f} {r['ok']}")
    print(f"\nbest over L={Ls} ({args.sweep_inputs} inputs): {best['config']} (forward {best['fwd_ms_sum']:.3f} ms, "
          f"backward {best['bwd_ms_sum']:.3f} ms summed); current {best['current']} (forward "
          f"{best['current_fwd_ms_sum']}, backward {best['current_bwd_ms_sum']})")
    print(f"LAUNCH_TABLE entry: {D}: {cfg!r}")
    return rows, best


class _LaunchCounter:
    """Counts launches of a Triton kernel (``run=False``: and skips them, so only the Python part is
    timed). With a ``log`` list it also appends one record per launch (``_launch_record``) with
    start and end marks around it: CUDA events, or perf_counter seconds on CPU (where the
    interpreter runs the kernel inside the call)."""

    def __init__(self, kernel, run: bool, log: list[dict] | None = None, cuda: bool = False) -> None:
        self.kernel, self.run, self.n, self.log, self.cuda = kernel, run, 0, log, cuda

    def __getitem__(self, grid):
        self.n += 1
        if not self.run:
            return lambda *a, **k: None
        if self.log is None:
            return self.kernel[grid]
        return functools.partial(self._launch, grid)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _launch(self, grid, *args, **kw):
        start = self._mark()
        compiled = self.kernel[grid](*args, **kw)
        end = self._mark()
        self.log.append(dict(_launch_record(grid, args, kw), start=start, end=end,
                             regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None)))
        return compiled


_DT = {torch.float32: "f", torch.bfloat16: "b", torch.float16: "h"}


def _launch_record(grid, args, kw) -> dict:
    """One launch of either AttnRes kernel: its direction, L, grid and tile, the sources' dtypes (f/b/h),
    the slots it adds into, whether every ``[N, D]`` tensor it gets as an argument is contiguous, and its
    ideal bytes (``_read_bytes``). This op's kernels take source 0 and the last one (L - 1) as pointers,
    the others through an address table, L and the adding slots (``acc``: 1 source 0, 2 the last one,
    4 every middle one) as integers; an older op's took a tuple of sources (and of gradients) and L and
    the adding slots (bit i: source i) as constexprs."""
    if isinstance(args[0], tuple):  # an older op: (srcs, [dsrcs,] q, w, h, [dh,] stats, ...)
        bwd = "ACC" in kw
        srcs, L, acc = args[0], kw["L"], kw.get("ACC", 0)
        x0, h, dh = srcs[0], args[4] if bwd else args[3], args[5] if bwd else None
        dtypes = [x.dtype for x in srcs]
        tensors = [*srcs, h] + ([*args[1], dh] if bwd else [])
    else:  # (x0, xl, tab, q, w, h, stats, N, D, eps, L) / (x0, xl, g0, gl, tab, gofs, q, w, h, dh, ..., L, acc)
        bwd = "C_FROM_H" in kw
        x0, xl = args[0], args[1]
        L = args[15] if bwd else args[10]
        flags = args[16] if bwd else 0
        acc = (flags & 1) | ((flags >> 1 & 1) << (L - 1) if L > 1 else 0)
        if flags & 4 and L > 2:
            acc |= ((1 << (L - 2)) - 1) << 1
        h, dh = (args[8], args[9]) if bwd else (args[5], None)
        dtypes = [x0.dtype] + [xl.dtype] * (L - 1)
        tensors = [x0, xl, h] + ([args[2], args[3], dh] if bwd else [])
    D = x0.shape[-1]
    N = x0.numel() // D
    fwd_b, bwd_b = _read_bytes(N, D, [dt.itemsize for dt in dtypes], h.element_size(),
                               dh.element_size() if bwd else 0, acc, kw.get("C_FROM_H", True))
    return dict(kind="bwd" if bwd else "fwd", L=L, grid=grid[0], rows=kw["BN"], warps=kw.get("num_warps"),
                group=kw.get("GROUP", 1), stages=kw.get("STAGES", 1),
                dtypes="".join(_DT[dt] for dt in dtypes), h_dtype=_DT[h.dtype],
                dh_dtype=_DT[dh.dtype] if bwd else None,
                acc_slots=bin(acc).count("1"), contiguous=all(x.is_contiguous() for x in tensors),
                bytes=bwd_b if bwd else fwd_b)


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


REPLAY_SPECS = "full | block:N"
# The whole-model profile that the replay stands beside (kernels/bench_model.py --profile): its rows per spec.
MODEL_PROFILE = os.path.join(ROOT, "kernels", "results", "model_profile_gpu_small_h200.json")
_PROFILE_ROWS = {("full_attnres", None): "moelab_gpu_small_full_attnres",
                 ("block_attnres", 6): "moelab_gpu_small_block_attnres",
                 ("block_attnres", 8): "moelab_gpu_small_block_attnres_8"}
_PROFILE_SHAPE = (32768, 512, 24)  # the profile's gpu-small step: tokens, width, sublayers
_KERNELS = ("_attnres_fwd_kernel", "_attnres_bwd_kernel")


def _parse_spec(spec: str) -> tuple[str, int | None]:
    """``full`` -> Full AttnRes; ``block:N`` -> Block AttnRes with N blocks."""
    if spec == "full":
        return "full_attnres", None
    if spec.startswith("block:") and spec[6:].isdigit() and int(spec[6:]) >= 1:
        return "block_attnres", int(spec[6:])
    raise ValueError(f"--replay {spec!r} is not allowed: expected {REPLAY_SPECS} (N >= 1 blocks)")


_CONFIG_RE = re.compile(r"(\d+)x(\d+)(?:g(\d+))?(?:s(\d+))?(?:(?:x|p)(\d+))?")
_CONFIG_FORMAT = "ROWSxWARPS[gGROUP][sSTAGES][pPROGRAMS_PER_SM][/ROWSxWARPS[gGROUP][sSTAGES]]"


def _parse_config(text: str) -> LaunchConfig | None:
    """``table``: the op's own launch (``launch_config``); else ``_CONFIG_FORMAT``: the forward's rows x warps,
    group and stages (default 1 and 1) and the backward's programs per SM (default 0; ``xP`` is read as
    ``pP``), then after a slash the backward's rows x warps, group and stages (default: the forward's)."""
    if text == "table":
        return None
    fwd, _, bwd = text.partition("/")
    f, b = _CONFIG_RE.fullmatch(fwd), _CONFIG_RE.fullmatch(bwd) if bwd else None
    if f is None or (bwd and (b is None or b.group(5) is not None)):
        raise ValueError(f"launch entry {text!r} is not allowed: expected 'table' or {_CONFIG_FORMAT}, "
                         "e.g. 1x8g4s1p0/1x8g2")
    val = [int(v) if v else 0 for v in f.groups()]
    bval = [int(v) if v else 0 for v in b.groups()[:4]] if b else [0, 0, 0, 0]
    cfg = LaunchConfig(rows=val[0], warps=val[1], group=val[2] or 1, stages=val[3] or 1, programs_per_sm=val[4],
                       bwd_rows=bval[0], bwd_warps=bval[1], bwd_group=bval[2], bwd_stages=bval[3])
    cfg.validate()
    return cfg


def _config_text(cfg: LaunchConfig) -> str:
    """``cfg`` in ``_parse_config``'s format (the backward's part in full)."""
    rows, warps, group, stages = cfg.bwd_launch
    return (f"{cfg.rows}x{cfg.warps}g{cfg.group}s{cfg.stages}p{cfg.programs_per_sm}/"
            f"{rows}x{warps}g{group}s{stages}")


def _op_file(entry: str) -> str:
    """The file of an ``--replay-ops`` entry: the entry itself, or for ``COMMIT:PATH`` (not a file) that path at
    that commit of this repository, written once to a temporary file named after it (Triton reads a kernel's
    source from its file)."""
    if os.path.isfile(entry) or ":" not in entry:
        return entry
    commit, _, rel = entry.partition(":")
    path = os.path.join(tempfile.gettempdir(), "attnres_ops", f"{commit}_{rel.replace('/', '_')}")
    if not os.path.isfile(path):
        src = subprocess.run(["git", "show", entry], cwd=ROOT, capture_output=True, text=True)
        if src.returncode:
            return entry
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(src.stdout)
    return path


def _load_op(entry: str):
    """An AttnRes op module from a file, or from ``COMMIT:PATH`` (e.g. an older ``moelab/ops/attnres.py``)."""
    path = _op_file(entry)
    if not os.path.isfile(path):
        raise ValueError(f"--replay-ops entry {entry!r} is not allowed: expected 'moelab', an existing file or "
                         "COMMIT:PATH of this repository")
    spec = importlib.util.spec_from_file_location(f"attnres_op_{hashlib.sha1(path.encode()).hexdigest()[:8]}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    missing = [n for n in ("depth_attention", *_KERNELS) if not hasattr(mod, n)]
    if missing:
        raise ValueError(f"--replay-ops entry {path!r} has no {', '.join(missing)}: expected an AttnRes op module")
    return mod


def _model_profile(mode: str, blocks: int | None) -> dict | None:
    """The whole-model profile's AttnRes kernel times for this spec (ms per step), where recorded."""
    key = _PROFILE_ROWS.get((mode, blocks))
    if key is None or not os.path.exists(MODEL_PROFILE):
        return None
    data = json.load(open(MODEL_PROFILE))
    if key not in data:
        return None
    k = data[key]["kernels"]
    return dict(fwd_ms=k.get("_attnres_fwd_kernel"), bwd_ms=k.get("_attnres_bwd_kernel"),
                commit=data.get("meta", {}).get("commit"), file=os.path.relpath(MODEL_PROFILE, ROOT))


def _replay_one(mode: str, blocks: int | None, cfg: LaunchConfig | None, op, args, cuda: bool, dev: str
                ) -> dict | None:
    """One spec, op and launch: the model's residual stream (``AttnResidual``) with every sublayer
    replaced by a pre-norm ``RMSNorm`` and a bias-free ``Linear`` (bf16 out under autocast, as the
    real mixers and FFNs), the fp32 embedding as source 0, the final read through an RMSNorm into a
    fixed random projection as the loss; forward + backward under bf16 autocast. Each AttnRes launch
    is logged and timed; the per-read times are medians over ``--replay-steps`` steps (None with 0
    steps: the warm-up alone, to fill Triton's cache)."""
    import moelab.model.attnres as model_attnres

    N, D, n_sub = args.tokens, args.sweep_d_model, args.replay_sublayers
    B = 8 if N % 8 == 0 else 1  # gpu-small's batch (8 x 4096 tokens); only N reaches the kernels
    torch.manual_seed(0)
    res = AttnResidual(D, n_sub, ResidualConfig(mode=mode, num_blocks=blocks or 1, backend="triton")).to(dev)
    norms = torch.nn.ModuleList(RMSNorm(D) for _ in range(n_sub + 1)).to(dev)
    subs = torch.nn.ModuleList(torch.nn.Linear(D, D, bias=False) for _ in range(n_sub)).to(dev)
    with torch.no_grad():  # queries as after some training: the depth softmax is not uniform
        for att in res.depth:
            att.query.normal_(0.0, D ** -0.5)
    emb = torch.randn(B, N // B, D, device=dev, requires_grad=True)
    probe = torch.randn(B, N // B, D, device=dev)
    params = [emb, *res.parameters(), *norms.parameters(), *subs.parameters()]

    def step() -> torch.Tensor:
        for x in params:
            x.grad = None
        with torch.autocast(dev, dtype=torch.bfloat16):
            st = res.stream(emb)
            for i in range(n_sub):
                st.write(i, subs[i](norms[i](st.read(i))))
            loss = (norms[n_sub](st.read_final()) * probe).sum()
        loss.backward()
        return loss.detach()

    call_op, model_op, model_read = op.depth_attention, model_attnres.depth_attention, model_attnres.read_sources

    def read(sources, query, norm_weight, eps, backend="auto", weights=True, slots=None):
        if op is not attnres_op:  # an older op: the list and the Sources' slots
            return call_op(list(sources.tensors), query, norm_weight, eps, backend=backend, config=cfg,
                           weights=weights, slots=sources.slots)
        return call_op(sources, query, norm_weight, eps, backend=backend, config=cfg, weights=weights, slots=slots)

    def read_stream(sources, query, norm_weight, eps, weights, config=None, stacked=None):
        return read(sources, query, norm_weight, eps, backend="triton", weights=weights)

    log: list[dict] = []
    kernels = {name: getattr(op, name) for name in _KERNELS}
    # the model's two doors to the op: depth_attention (lists, compiling) and read_sources (its stream)
    model_attnres.depth_attention, model_attnres.read_sources = read, read_stream
    for name, k in kernels.items():
        setattr(op, name, _LaunchCounter(k, True, log, cuda))
    try:
        for _ in range(args.replay_warmup):  # compiles every read's kernels and sizes the resident grids
            step()
        if args.replay_steps == 0:
            return None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        steps, losses = [], []
        for _ in range(args.replay_steps):
            log.clear()
            losses.append(step())
            if cuda:
                torch.cuda.synchronize()
            steps.append([dict(r, ms=r["start"].elapsed_time(r["end"]) if cuda else (r["end"] - r["start"]) * 1e3)
                          for r in log])
        peak_gb = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None
        prof = None
        if cuda:  # the model profile's measure (CUPTI device time per kernel name) over one more step
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                step()
                torch.cuda.synchronize()
            evs = [(ev.key, getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0))
                   for ev in p.key_averages()]
            prof = {f"{kind}_ms": sum(us for key, us in evs if name in key) / 1e3
                    for kind, name in zip(("fwd", "bwd"), _KERNELS)}
        grads_finite = all(torch.isfinite(x.grad).all() for x in params if x.grad is not None)
    finally:
        model_attnres.depth_attention, model_attnres.read_sources = model_op, model_read
        for name, k in kernels.items():
            setattr(op, name, k)

    reads = []
    for i in range(n_sub + 1):
        # forward launches come in read order, backward ones in reverse (each read's backward needs the
        # complete gradient of every later read's sources)
        fwd = [s[i] for s in steps if s[i]["kind"] == "fwd"]
        bwd = [s[-1 - i] for s in steps if s[-1 - i]["kind"] == "bwd"]
        row = dict(read=i)
        for kind, recs in (("fwd", fwd), ("bwd", bwd)):
            if len(recs) != len(steps):
                continue
            r = recs[0]
            ms = statistics.median(x["ms"] for x in recs)
            row.update({f"{kind}_{k}": r[k] for k in ("L", "dtypes", "grid", "rows", "warps", "group", "stages",
                                                      "regs", "spills", "bytes", "contiguous")},
                       **{f"{kind}_ms": ms, f"{kind}_gbps": r["bytes"] / ms / 1e6})
            if kind == "bwd":
                row.update(bwd_acc_slots=r["acc_slots"], bwd_h_dtype=r["h_dtype"], bwd_dh_dtype=r["dh_dtype"])
        reads.append(row)
    launches = {k: [sum(r["kind"] == k for r in s) for s in steps] for k in ("fwd", "bwd")}
    order_ok = all("fwd_L" in r and "bwd_L" in r and r["fwd_L"] == r["bwd_L"] for r in reads)
    out = dict(mode=mode, blocks=blocks, n_reads=n_sub + 1, launches_per_step=launches, order_ok=order_ok,
               sources_per_read=[r.get("fwd_L") for r in reads], loss=float(losses[-1]), peak_mem_gb=peak_gb,
               profiler=prof, model_profile=_model_profile(mode, blocks) if (N, D, n_sub) == _PROFILE_SHAPE else None)
    for kind in ("fwd", "bwd"):
        ms = sum(r.get(f"{kind}_ms", 0.0) for r in reads)
        nbytes = sum(r.get(f"{kind}_bytes", 0) for r in reads)
        out.update({f"{kind}_ms": ms, f"{kind}_bytes": nbytes, f"{kind}_tbps": nbytes / ms / 1e9,
                    f"{kind}_floor_ms": nbytes / (args.copy_tbps * 1e9) if args.copy_tbps else None})
    out["ok"] = bool(order_ok and grads_finite and torch.isfinite(losses[-1])
                     and all(n == n_sub + 1 for v in launches.values() for n in v)
                     and all(r.get("fwd_contiguous") and r.get("bwd_contiguous") for r in reads))
    out["reads"] = reads
    return out


def _copy_tbps() -> float:
    """Device-to-device copy rate of 1 GiB (bytes read + written per second, in TB/s): the floor's bandwidth."""
    from triton.testing import do_bench

    src = torch.empty(2 ** 28, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e9


def _precompile(args, jobs: list[tuple[str, str, str]]) -> None:
    """Fill Triton's on-disk cache with every job's kernels in ``--replay-jobs`` processes at once (a
    Full AttnRes stream compiles two kernels per read, one at a time in one process), so that the
    timed runs after it only load them."""
    base = [sys.executable, os.path.abspath(__file__), "--tokens", str(args.tokens), "--sweep-d-model",
            str(args.sweep_d_model), "--replay-sublayers", str(args.replay_sublayers), "--replay-steps", "0",
            "--replay-warmup", "1"]
    pending, running = list(jobs), []
    t0 = time.perf_counter()
    while pending or running:
        while pending and len(running) < args.replay_jobs:
            spec, cfg, op = pending.pop(0)
            cmd = base + ["--replay", spec, "--replay-configs", cfg, "--replay-ops",
                          op if op == "moelab" or not os.path.isfile(op) else os.path.abspath(op)]
            running.append((cmd, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True)))
        cmd, proc = running.pop(0)
        log = proc.communicate()[0]
        if proc.returncode:
            print(f"precompile failed ({' '.join(cmd[2:])}):\n{log[-2000:]}")
    print(f"precompiled {len(jobs)} replays in {time.perf_counter() - t0:.0f} s ({args.replay_jobs} at a time)")


def _replay_plan(args, validate: bool = True) -> tuple[dict, dict, dict]:
    """The parsed ``--replay`` specs, ``--replay-ops`` modules and ``--replay-configs`` launches (ValueError
    naming a bad entry; ``validate``: also a block count that does not divide ``--replay-sublayers``)."""
    specs = {s: _parse_spec(s) for s in args.replay}
    for mode, blocks in specs.values() if validate else ():
        ResidualConfig(mode=mode, num_blocks=blocks or 1).validate(args.replay_sublayers)
    ops = {name: (attnres_op if name == "moelab" else _load_op(name)) for name in args.replay_ops.split(",")}
    configs = {c: _parse_config(c) for c in args.replay_configs.split(",")}
    return specs, ops, configs


def run_replay(args, plan: tuple[dict, dict, dict], cuda: bool, dev: str) -> list[dict]:
    """Every ``--replay`` spec x ``--replay-ops`` op x launch (``--replay-configs`` for this op, the op's
    own for a file); prints each row's totals against the floor and the model profile, and its reads."""
    specs, ops, configs = plan
    jobs = [(s, c if name == "moelab" else "table", name) for s in specs for name in ops
            for c in (configs if name == "moelab" else ["table"])]
    if cuda and args.replay_jobs > 1 and args.replay_steps > 0:
        _precompile(args, jobs)
    rows = []
    for spec, cfg_text, op_name in jobs:
        mode, blocks = specs[spec]
        cfg = configs[cfg_text] if op_name == "moelab" else None
        row = _replay_one(mode, blocks, cfg, ops[op_name], args, cuda, dev)
        if row is None:
            continue
        row = dict(spec=spec, op=op_name, config=cfg_text, **row)
        rows.append(row)
        ref = row["model_profile"]
        floor = (f"; floor at {args.copy_tbps:.2f} TB/s: fwd {row['fwd_floor_ms']:.2f}, "
                 f"bwd {row['bwd_floor_ms']:.2f} ms" if args.copy_tbps else "")
        print(f"\nreplay {spec} op={op_name} launch={cfg_text}: fwd {row['fwd_ms']:.2f} ms "
              f"({row['fwd_bytes'] / 1e9:.1f} GB, {row['fwd_tbps']:.2f} TB/s), bwd {row['bwd_ms']:.2f} ms "
              f"({row['bwd_bytes'] / 1e9:.1f} GB, {row['bwd_tbps']:.2f} TB/s) per step{floor}; "
              f"launches/step {row['launches_per_step']}; ok {row['ok']}")
        if row["profiler"]:
            print(f"  torch.profiler, one step: fwd {row['profiler']['fwd_ms']:.2f} ms, "
                  f"bwd {row['profiler']['bwd_ms']:.2f} ms")
        if ref and ref["fwd_ms"] is not None and ref["bwd_ms"] is not None:
            print(f"  model profile ({ref['commit'][:7] if ref['commit'] else '?'}): fwd {ref['fwd_ms']:.2f} ms, "
                  f"bwd {ref['bwd_ms']:.2f} ms")
        print(f"  {'read':>4s} {'L':>3s} {'slots+':>6s} {'fwd ms':>7s} {'GB/s':>6s} {'bwd ms':>7s} {'GB/s':>6s} "
              f"{'grid':>5s} {'bwd tile':>9s} {'regs':>4s} {'spill':>5s}")
        for r in row["reads"]:
            tile = f"{r.get('bwd_rows', 0)}x{r.get('bwd_warps', 0)}g{r.get('bwd_group', 1)}"
            print(f"  {r['read']:4d} {r.get('fwd_L', 0):3d} {r.get('bwd_acc_slots', 0):6d} {r.get('fwd_ms', 0):7.3f} "
                  f"{r.get('fwd_gbps', 0):6.0f} {r.get('bwd_ms', 0):7.3f} {r.get('bwd_gbps', 0):6.0f} "
                  f"{r.get('bwd_grid', 0):5d} {tile:>9s} "
                  f"{r.get('bwd_regs') or 0:4d} {r.get('bwd_spills') or 0:5d}")
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _spec(a):
    """A launch argument as Triton's JIT specializes on it, in JSON: a tensor's dtype and 16-byte alignment,
    a tuple's items, a number as it is."""
    if isinstance(a, torch.Tensor):
        return {"dtype": str(a.dtype).removeprefix("torch."), "aligned": a.data_ptr() % 16 == 0}
    if isinstance(a, (tuple, list)):
        return {"tuple": [_spec(x) for x in a]}
    return a


def _unspec(s):
    """A CPU stand-in for a ``_spec``: the JIT's binder specializes it the same way."""
    if isinstance(s, dict) and "tuple" in s:
        return tuple(_unspec(x) for x in s["tuple"])
    if isinstance(s, dict):
        t = torch.empty(16, dtype=getattr(torch, s["dtype"]))
        return t if s["aligned"] else t[1:]
    return s


class _SpecRecorder:
    """Stands in for a Triton kernel: logs each launch's ``(kernel name, argument specs, keyword specs)``,
    then runs it (``run``) or skips it (the CPU: only the launches' specializations are wanted)."""

    def __init__(self, kernel, log: list, run: bool) -> None:
        self.kernel, self.log, self.run = kernel, log, run

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.log.append((self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__,
                             [_spec(a) for a in args], {k: _spec(v) for k, v in kw.items()}))
            return self.kernel[grid](*args, **kw) if self.run else None
        return launch


def _jit_variants(op, launches: list, compile_: bool) -> tuple[list[dict], list[float]]:
    """The distinct compiled kernels that ``launches`` (``_SpecRecorder`` logs) need on an sm_90 GPU, in order
    of first use: the key that Triton's JIT binder computes for each launch (dtypes, alignment and the values
    it specializes on, constexprs, options) and, with ``compile_``, the seconds of ``triton.compile`` of each
    new one for sm_90 (ptxas included; a CPU suffices). Also the binder's microseconds per launch (least of
    20 calls): the part of a launch's host time that grows with the number of tensor arguments. Needs the
    real JIT functions (no interpreter)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binders, seen, out, bind_us = {}, set(), [], []
    for i, (name, a, k) in enumerate(launches):
        fn = getattr(op, name)
        if name not in binders:
            binders[name] = create_function_from_signature(fn.signature, fn.params, backend)
        args, kw = [_unspec(x) for x in a], {key: _unspec(v) for key, v in k.items()}
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            bound, specialization, options = binders[name](*args, **kw)
            best = min(best, time.perf_counter() - t0)
        bind_us.append(best * 1e6)
        key = (name, repr(specialization), repr(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        row = dict(kernel=name, launch=i, compile_s=None)
        if compile_:
            opts, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
            t0 = time.perf_counter()
            triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)
            row["compile_s"] = time.perf_counter() - t0
        out.append(row)
    return out, bind_us


def _compile_child(path: str) -> int:
    """``--compile-child FILE``: ``_jit_variants`` of the launches that ``run_compile`` wrote to FILE, for each op
    and spec in order (an op's variants accumulate over its specs): per spec its new variants and the mean
    binder microseconds per launch of each kernel; the result replaces the file's content."""
    job = json.load(open(path))
    res = {}
    for op_name, specs in job["ops"].items():
        op = attnres_op if op_name == "moelab" else _load_op(op_name)
        launches = [x for spec in specs for x in spec["launches"]]
        found, bind_us = _jit_variants(op, launches, job["compile"])
        bounds = list(itertools.accumulate(len(spec["launches"]) for spec in specs))
        res[op_name] = []
        for lo, hi in zip([0] + bounds[:-1], bounds):
            us = {name: [t for t, x in zip(bind_us[lo:hi], launches[lo:hi]) if x[0] == name] for name in _KERNELS}
            res[op_name].append(dict(variants=[v for v in found if lo <= v["launch"] < hi],
                                     bind_us={name: statistics.mean(t) for name, t in us.items() if t}))
    with open(path, "w") as fh:
        json.dump(res, fh)
    return 0


# sm_90 (H100 / H200) limits per SM that decide how many programs of a kernel are resident at once
_SM90 = dict(regs=65536, warps=64, programs=32, shared=233472)


def _occupancy_child(path: str) -> int:
    """``--occupancy-child FILE``: compile every launch that ``run_occupancy`` wrote to FILE for sm_90 (Triton's
    binder and ``triton.compile``, ptxas included; no GPU needed) and add each one's registers per thread,
    local-memory stack bytes (spills) and shared memory, read from its cubin with the wheel's cuobjdump."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    job = json.load(open(path))
    ops = {name: attnres_op if name == "moelab" else _load_op(name) for name in {rec["op"] for rec in job}}
    for rec in job:
        fn = getattr(ops[rec["op"]], rec["kernel"])
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        args, kw = [_unspec(x) for x in rec["args"]], {k: _unspec(v) for k, v in rec["kw"].items()}
        bound, specialization, options = binder(*args, **kw)
        opts, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, specialization, options)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=opts.__dict__)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
            fh.write(compiled.asm["cubin"])
            fh.flush()
            usage = subprocess.run([tool, "-res-usage", fh.name], capture_output=True, text=True, check=True).stdout
        rec.update(regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                   stack=int(re.search(r"STACK:(\d+)", usage).group(1)), shared=compiled.metadata.shared)
        del rec["args"], rec["kw"]
    with open(path, "w") as fh:
        json.dump(job, fh)
    return 0


def _child(flag: str, job: dict | list) -> dict | list:
    """Run this script with ``flag`` on ``job`` (written to a JSON file) in a fresh process without the
    Triton interpreter and with its own Triton cache; return what the child wrote back to that file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        with open(path, "w") as fh:
            json.dump(job, fh)
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=os.path.join(tmp, "cache"),
                   PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        res = subprocess.run([sys.executable, os.path.abspath(__file__), flag, path], cwd=ROOT,
                             env=env, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"{flag} failed:\n{res.stderr[-3000:]}")
        with open(path) as fh:
            return json.load(fh)


def run_occupancy(args, cuda: bool) -> list[dict]:
    """``--occupancy``: for each sweep launch (``_sweep_launches`` at ``--sweep-d-model``, ``--sweep-inputs``)
    and each ``--replay-ops`` op (an older op, without groups or stages, at each distinct rows x warps), the
    forward and backward kernels as the op launches them, compiled for sm_90 in a process without the
    interpreter: registers, spills, shared memory, the programs that fit on one SM (``_SM90``) and the source
    tiles those programs load at once (programs x group x rows x D elements of the sources' dtype)."""
    D, L = args.sweep_d_model, int(args.sweep_sources.split(",")[-1])
    dev = "cuda" if cuda else "cpu"
    srcs, q, w, dh = _sweep_inputs(args.sweep_inputs, L, 64, D, dev, seed=0)
    job = []
    for op_name in args.replay_ops.split(","):
        op = attnres_op if op_name == "moelab" else _load_op(op_name)
        launches = _sweep_launches(args, D)
        if op is not attnres_op:
            launches = list({(c.rows, c.warps): LaunchConfig(rows=c.rows, warps=c.warps) for c in launches}.values())
        saved = {name: getattr(op, name) for name in _KERNELS}
        try:
            for cfg in launches:
                log: list = []
                for name, k in saved.items():
                    setattr(op, name, _SpecRecorder(k, log, run=False))
                leaves = [x.detach().clone().requires_grad_() for x in [*srcs, q, w]]
                h, _ = op.depth_attention(leaves[:-2], leaves[-2], leaves[-1], backend="triton", config=cfg,
                                          weights=False)
                h.backward(dh)
                for name, a, kw in log:
                    tile = (cfg.rows, cfg.warps, cfg.group, cfg.stages) if name == _KERNELS[0] else cfg.bwd_launch
                    job.append(dict(op=op_name, config=_config_text(cfg), kernel=name, rows=tile[0], warps=tile[1],
                                    group=tile[2], stages=tile[3], args=a, kw=kw))
        finally:
            for name, k in saved.items():
                setattr(op, name, k)
    rows = _child("--occupancy-child", job)
    src_bytes = srcs[-1].element_size()
    print(f"{'op':>12s} {'kernel':>4s} {'launch':>10s} {'regs':>4s} {'stack':>5s} {'smem':>6s} {'prog/SM':>7s} "
          f"{'KB at once/SM':>13s}")
    for r in rows:
        threads = 32 * r["warps"]
        fit = [_SM90["regs"] // (-(-max(r["regs"], 8) // 8) * 8 * threads), _SM90["warps"] // r["warps"],
               _SM90["programs"]]
        if r["shared"]:
            fit.append(_SM90["shared"] // r["shared"])
        r["programs_per_sm"] = min(fit)
        r["source_kb_at_once_per_sm"] = r["programs_per_sm"] * r["group"] * r["rows"] * D * src_bytes / 1024
        op = r["op"] if r["op"] == "moelab" else os.path.basename(r["op"])
        print(f"{op[-12:]:>12s} {'fwd' if r['kernel'] == _KERNELS[0] else 'bwd':>4s} "
              f"{'{rows}x{warps}g{group}s{stages}'.format(**r):>10s} {r['regs']:4d} {r['stack']:5d} "
              f"{r['shared']:6d} {r['programs_per_sm']:7d} {r['source_kb_at_once_per_sm']:13.0f}")
    return rows


def run_compile(args, plan: tuple[dict, dict, dict], sublayers: list[int], cuda: bool) -> list[dict]:
    """The AttnRes kernels that one training step of each ``--replay`` spec compiles, at each depth in
    ``sublayers`` (see the module docstring). Rows in order, per op; an op's variants accumulate over the rows
    (what one process running every spec compiles)."""
    specs, ops, _ = plan
    dev = "cuda" if cuda else "cpu"
    combos = []
    for n_sub in sublayers:
        for spec, (mode, blocks) in specs.items():
            try:
                ResidualConfig(mode=mode, num_blocks=blocks or 1).validate(n_sub)
            except ValueError as exc:
                print(f"compile: skip {spec} at {n_sub} sublayers ({exc})")
                continue
            combos.append((spec, mode, blocks, n_sub))
    rows, job = [], dict(ops={}, compile=not (cuda or args.compile_count_only))
    for op_name, op in ops.items():
        kernels = {name: getattr(op, name) for name in _KERNELS}
        job["ops"][op_name] = []
        try:
            for spec, mode, blocks, n_sub in combos:
                log: list = []
                for name, k in kernels.items():
                    setattr(op, name, _SpecRecorder(k, log, run=cuda))
                sub_args = argparse.Namespace(**{**vars(args), "replay_sublayers": n_sub, "replay_steps": 0,
                                                 "replay_warmup": 1})
                times = []
                for _ in range(2 if cuda else 1):  # GPU: the first step compiles, the second shows the rest
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    _replay_one(mode, blocks, None, op, sub_args, cuda, dev)
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                row = dict(op=op_name, spec=spec, sublayers=n_sub, launches=len(log) // len(times),
                           max_sources=max(kw["L"] if "L" in kw else a[10]  # an older op's L was a constexpr
                                           for name, a, kw in log if name == _KERNELS[0]))
                if cuda:  # the JIT caches: every compiled variant of each kernel so far
                    dev_index = torch.cuda.current_device()
                    row.update(first_step_s=times[0], second_step_s=times[1],
                               variants_total={name: len(k.device_caches[dev_index][0]) for name, k in kernels.items()})
                rows.append(row)
                job["ops"][op_name].append(dict(launches=log[:row["launches"]]))
        finally:
            for name, k in kernels.items():
                setattr(op, name, k)
    if not cuda:  # count (and compile) the variants for sm_90 in a process without the interpreter
        found = _child("--compile-child", job)
        per_op = {name: iter(v) for name, v in found.items()}
        totals: dict = {}
        for row in rows:
            got = next(per_op[row["op"]])
            new = got["variants"]
            acc = totals.setdefault(row["op"], {name: 0 for name in _KERNELS})
            for v in new:
                acc[v["kernel"]] += 1
            row.update(new_variants={name: sum(v["kernel"] == name for v in new) for name in _KERNELS},
                       variants_total=dict(acc), bind_us=got["bind_us"],
                       compile_s=None if args.compile_count_only else sum(v["compile_s"] for v in new))
    return rows


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git checkout)"


def _write_json(path: str, data: dict) -> None:
    """``data`` to ``path`` as indented JSON, through a temporary file (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny sizes, no JSON unless --out")
    ap.add_argument("--out", default=None, help="JSON path (GPU default: kernels/results/attnres_h200.json, "
                    "with --sweep-only kernels/results/attnres_sweep_h200.json)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD; a copied "
                    "tree without .git records 'unknown' unless given)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--sources", default="4,9,17", help="comma-separated L values")
    ap.add_argument("--no-mixed", action="store_true", help="skip the rows with an fp32 source 0")
    ap.add_argument("--impls", default=None, help="comma-separated rows to run (default all): moelab_fused, "
                    "torch_plain, fla_fused_attnres, fla_fused_attnres_stacked (each with its _mixed row)")
    ap.add_argument("--sweep", action="store_true", help="also the launch-config sweep of the fused op (see above)")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep without the comparison rows")
    ap.add_argument("--sweep-d-model", type=int, default=512, help="--sweep: width")
    ap.add_argument("--sweep-sources", default="4,7,13,25", help="--sweep: comma-separated L values")
    ap.add_argument("--tiles", default=None, help="--sweep: rowsxwarps list, e.g. 4x8,8x8 (default: a grid by D)")
    ap.add_argument("--groups", default="1,2,4", help="--sweep: comma-separated LaunchConfig.group values")
    ap.add_argument("--stages", default="1", help="--sweep: comma-separated LaunchConfig.stages values")
    ap.add_argument("--sweep-configs", default=None, help="--sweep: comma-separated launches (format of "
                    "--config; their programs per SM are replaced by --programs-per-sm) instead of the grid")
    ap.add_argument("--programs-per-sm", default="0,2,4", help="--sweep: backward grid sizes (0: all resident)")
    ap.add_argument("--sweep-inputs", choices=("model", "bf16"), default="model", help="--sweep: 'model' (fp32 "
                    "source 0, bf16 others, fp32 h, gradient slots) or 'bf16' (the comparison rows' all-bf16 read)")
    ap.add_argument("--sweep-rep-ms", type=int, default=100, help="--sweep: do_bench repeat time per timing")
    ap.add_argument("--sweep-jobs", type=int, default=1, help="--sweep on a GPU: compile the sweep's kernels in "
                    "this many processes at once first")
    ap.add_argument("--sweep-compile-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help="the comparison rows' launch of the fused op (format "
                    f"{_CONFIG_FORMAT}; default: launch_config(D))")
    ap.add_argument("--use-sweep-best", action="store_true", help="with --sweep at --sweep-d-model = --d-model: "
                    "the comparison rows take the sweep's best launch")
    ap.add_argument("--host", action="store_true", help="only the host time per call, at --sweep-d-model (see above)")
    ap.add_argument("--replay", action="append", default=[], metavar="SPEC",
                    help=f"replay a model's AttnRes reads ({REPLAY_SPECS}; repeatable; see above)")
    ap.add_argument("--replay-configs", default="table", help="--replay: comma-separated launches of this op: "
                    f"'table' (launch_config) or {_CONFIG_FORMAT}")
    ap.add_argument("--replay-ops", default="moelab", help="--replay: comma-separated ops: 'moelab' (this tree's) "
                    "or the path of an AttnRes op module file, replayed at its own launch")
    ap.add_argument("--replay-sublayers", type=int, default=None, help="--replay: sublayers (default 24, smoke 4)")
    ap.add_argument("--replay-steps", type=int, default=5, help="--replay: timed steps (0: warm-up only)")
    ap.add_argument("--replay-warmup", type=int, default=2, help="--replay: untimed steps first (compiles)")
    ap.add_argument("--replay-jobs", type=int, default=1, help="--replay on a GPU: compile the replays' kernels "
                    "in this many processes at once first")
    ap.add_argument("--compile", action="store_true", help="the AttnRes kernel variants one step of each --replay "
                    "spec (default full, block:6, block:8) compiles, and their time (see above)")
    ap.add_argument("--compile-sublayers", default=None, help="--compile: comma-separated depths in sublayers "
                    "(default 24, gpu-small's, or 4 with --smoke; study 3's gpu preset: 8,16,32)")
    ap.add_argument("--compile-count-only", action="store_true", help="--compile on a CPU: count the variants, "
                    "do not compile them")
    ap.add_argument("--compile-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--occupancy", action="store_true", help="registers, spills, shared memory and programs per "
                    "SM of each --sweep launch's kernels, compiled for sm_90 (CPU or GPU; see above)")
    ap.add_argument("--occupancy-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sweep = args.sweep or args.sweep_only
    if args.compile_child:
        return _compile_child(args.compile_child)
    if args.occupancy_child:
        return _occupancy_child(args.occupancy_child)

    cuda = torch.cuda.is_available() and not args.smoke
    if args.compile:
        return _compile_main(args, ap, cuda)
    if args.occupancy:
        return _occupancy_main(args, ap, cuda)
    if args.replay:
        return _replay_main(args, ap, cuda)
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
    try:
        row_cfg = _parse_config(args.config) if args.config else None
        for text in args.sweep_configs.split(",") if args.sweep_configs else ():
            _parse_config(text)
    except ValueError as exc:
        ap.error(str(exc))
    known = ("moelab_fused", "torch_plain", "fla_fused_attnres", "fla_fused_attnres_stacked")
    for name in args.impls.split(",") if args.impls else ():
        if name not in known:
            ap.error(f"--impls entry {name!r} is not allowed: expected some of {', '.join(known)}")
    if args.use_sweep_best and not (args.sweep and not args.sweep_only and args.sweep_d_model == args.d_model):
        ap.error("--use-sweep-best needs --sweep (not --sweep-only) with --sweep-d-model equal to --d-model")
    sweep, best = run_sweep(args, cuda, dev) if args.sweep else ([], None)
    if args.sweep_compile_only:
        return 0
    sweep_inputs = {"model": "source 0 fp32, others bf16, fp32 q/w/h/dh; slots: all but the last source add",
                    "bf16": "all sources bf16, bf16 h and dh, fp32 q/w; no slots (c from a first pass)"}
    sweep_meta = dict(sweep_d_model=args.sweep_d_model, sweep_sources=args.sweep_sources,
                      sweep_inputs=sweep_inputs[args.sweep_inputs],
                      sweep_timing=f"do_bench median, rep {args.sweep_rep_ms} ms; backward alone on a retained graph"
                      ) if args.sweep else {}
    if args.use_sweep_best:
        row_cfg = _parse_config(best["config"])
    N, D = args.tokens, args.d_model
    Ls = [] if args.sweep_only else [int(x) for x in args.sources.split(",")]
    fla_fn, fla_err = _fla() if cuda else (None, "not run on CPU")
    impls = set(args.impls.split(",")) if args.impls else None
    commit = args.commit or _commit()
    gpu = torch.cuda.get_device_name() if cuda else "cpu (smoke, Triton interpreter)"
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    default_name = "attnres_sweep_h200.json" if args.sweep_only else "attnres_h200.json"
    out = args.out or (None if args.smoke else os.path.join(ROOT, "kernels", "results", default_name))
    rows = []
    for L in Ls:
        for mixed in (False, True) if not args.no_mixed else (False,):
            srcs, q, w, dh = _make(L, N, D, mixed, dev, seed=L)
            ref = _reference(srcs, q, w, dh)
            for name, prepare in _impls(fla_fn, row_cfg).items():
                if impls and name not in impls:
                    continue
                name = name + ("_mixed" if mixed else "")
                try:
                    row = _run_impl(name, prepare, srcs, q, w, dh, ref, cuda)
                except Exception as exc:  # fla under autocast with mixed dtypes fails to compile: record it
                    row = dict(impl=name, L=L, error=repr(exc)[:500])
                rows.append(row)
                print(json.dumps(row))
                if out:  # a run cut short (a time limit) keeps the rows it measured, marked partial
                    _write_json(out, dict(meta=dict(partial=True, commit=commit, gpu=gpu, date=started,
                                                    command=command), rows=rows))
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
    cfg = row_cfg or launch_config(D)
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, fla=_fla_version(),
                fla_import_error=fla_err, date=started, commit=commit, command=command,
                tokens=N, d_model=D, sources=Ls, autocast="bf16", source_dtype="bf16 (source 0 fp32 in *_mixed)",
                param_dtype="fp32", launch_config=dataclasses.asdict(cfg), launch=_config_text(cfg),
                launch_from="--config" if args.config and not args.use_sweep_best else
                ("the sweep's best" if args.use_sweep_best else "launch_config(D)"),
                timing="triton.testing.do_bench median, warmup 25 ms, rep 200 ms; grads set to None each step",
                tolerances=dict(h=OUT_TOL, grads=GRAD_TOL), anchors_fwdbwd_ms=ANCHORS_FWDBWD_MS,
                target="moelab_fused fwd+bwd >= 5x faster than torch_plain and at least the faster fla row's speed",
                target_met=None if impls or args.sweep_only else bool(summary) and all(  # None: rows left out
                    line.get("fwdbwd_speedup_vs_torch_plain", 0) >= 5
                    and line.get("fwdbwd_speedup_vs_fla_best", 1) >= 1 for line in summary),
                all_ok=all(r.get("ok", False) for r in rows + sweep if r.get("impl", "moelab").startswith("moelab")),
                **sweep_meta)
    if out:
        _write_json(out, dict(meta=meta, rows=rows, summary=summary, sweep=sweep, sweep_best=best))
        print(f"wrote {out}")
    return 0 if meta["all_ok"] else 1


def _replay_main(args, ap: argparse.ArgumentParser, cuda: bool) -> int:
    """``--replay``: sizes (gpu-small's, or tiny with --smoke), the copy bandwidth, the rows, the JSON."""
    if args.smoke:
        args.tokens, args.sweep_d_model, args.replay_steps = 16, 72, min(args.replay_steps, 1)
        args.replay_warmup = min(args.replay_warmup, 1)
    elif not cuda:
        ap.error("no CUDA device: use --smoke for the CPU run")
    if args.replay_sublayers is None:
        args.replay_sublayers = 4 if args.smoke else 24
    for name in ("replay_sublayers", "replay_steps", "replay_warmup", "replay_jobs"):
        lo = 0 if name == "replay_steps" else 1
        if getattr(args, name) < lo:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: expected >= {lo}")
    try:
        plan = _replay_plan(args)
    except ValueError as exc:
        ap.error(str(exc))
    args.copy_tbps = _copy_tbps() if cuda and args.replay_steps > 0 else None
    rows = run_replay(args, plan, cuda, "cuda" if cuda else "cpu")
    if args.replay_steps == 0:
        return 0
    out = args.out or (None if args.smoke else os.path.join(ROOT, "kernels", "results", "attnres_replay_h200.json"))
    if out:
        meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu (smoke, Triton interpreter)",
                    torch=torch.__version__, triton=triton.__version__, commit=_commit(),
                    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    command=" ".join([os.path.basename(sys.executable)] + sys.argv), tokens=args.tokens,
                    d_model=args.sweep_d_model, sublayers=args.replay_sublayers, steps=args.replay_steps,
                    warmup=args.replay_warmup, ops=_ops_meta(args), copy_tbps=args.copy_tbps, autocast="bf16",
                    stand_ins="sublayer: RMSNorm + Linear(D, D) (bf16 out); loss: RMSNorm(final read) . fixed probe",
                    timing="per read: CUDA events around each launch, median over the steps; profiler: one step",
                    all_ok=all(r["ok"] for r in rows))
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
        print(f"wrote {out}")
    return 0 if all(r["ok"] for r in rows) else 1


def _ops_meta(args) -> dict:
    """``--replay-ops`` for the JSON: ``moelab``, or a file (or ``COMMIT:PATH``) with its SHA-1."""
    return {name: name if name == "moelab" else dict(file=name, sha1=hashlib.sha1(open(_op_file(name), "rb").read())
                                                     .hexdigest()) for name in args.replay_ops.split(",")}


def _occupancy_main(args, ap: argparse.ArgumentParser, cuda: bool) -> int:
    """``--occupancy``: the launches, the rows, the JSON (``--out``, default none)."""
    try:
        rows = run_occupancy(args, cuda)
    except ValueError as exc:
        ap.error(str(exc))
    if args.out:
        meta = dict(gpu="none: kernels compiled for sm_90, not run", limits_per_sm=_SM90, triton=triton.__version__,
                    torch=torch.__version__, commit=_commit(), command=" ".join(
                        [os.path.basename(sys.executable)] + sys.argv),
                    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    d_model=args.sweep_d_model, sweep_inputs=args.sweep_inputs, ops=_ops_meta(args),
                    source_kb_at_once_per_sm="programs per SM x group x rows x D x the sources' element size: "
                    "what the resident programs load in one go (an older op also prefetched one source ahead)")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
        print(f"wrote {args.out}")
    return 0


def _compile_main(args, ap: argparse.ArgumentParser, cuda: bool) -> int:
    """``--compile``: the specs (default full, block:6, block:8), the depths, the rows, the JSON."""
    args.replay = args.replay or (["full", "block:2"] if args.smoke else ["full", "block:6", "block:8"])
    if args.smoke:
        args.sweep_d_model = 72
    if args.compile_sublayers is None:
        args.compile_sublayers = "4" if args.smoke else "24"
    if not cuda:
        args.tokens = 16  # the kernels do not run: only their specializations count, and N is not one of them
    try:
        sublayers = [int(x) for x in args.compile_sublayers.split(",")]
        if min(sublayers) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--compile-sublayers={args.compile_sublayers!r} is not allowed: expected integers >= 1, "
                 "e.g. 24 or 8,16,32")
    try:
        plan = _replay_plan(args, validate=False)
    except ValueError as exc:
        ap.error(str(exc))
    if cuda:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnres_compile_")  # read at each compile
        print(f"empty Triton cache: {os.environ['TRITON_CACHE_DIR']}")
    t0 = time.perf_counter()
    rows = run_compile(args, plan, sublayers, cuda)
    wall = time.perf_counter() - t0
    print(f"\n{'op':>12s} {'spec':>8s} {'subl':>4s} {'maxL':>4s} {'launch':>6s} {'fwd var':>7s} {'bwd var':>7s} "
          + ("first step s  second step s" if cuda else "sm_90 compile s (new variants)  binder us fwd/bwd"))
    for r in rows:
        op = r["op"] if r["op"] == "moelab" else os.path.basename(r["op"])
        v, new = r["variants_total"], r.get("new_variants", {})
        tail = (f"{r['first_step_s']:12.1f} {r['second_step_s']:14.2f}" if cuda
                else f"{r['compile_s'] or 0:14.1f} ({new[_KERNELS[0]]} + {new[_KERNELS[1]]})  "
                     f"{r['bind_us'].get(_KERNELS[0], 0):8.1f} / {r['bind_us'].get(_KERNELS[1], 0):.1f}")
        print(f"{op[-12:]:>12s} {r['spec']:>8s} {r['sublayers']:4d} {r['max_sources']:4d} {r['launches']:6d} "
              f"{v[_KERNELS[0]]:7d} {v[_KERNELS[1]]:7d} {tail}")
    out = args.out or (os.path.join(ROOT, "kernels", "results", "attnres_compile_h200.json") if cuda else None)
    if out:
        meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu (kernels compiled for sm_90, not run)",
                    torch=torch.__version__, triton=triton.__version__, commit=_commit(),
                    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    command=" ".join([os.path.basename(sys.executable)] + sys.argv), tokens=args.tokens,
                    d_model=args.sweep_d_model, sublayers=sublayers, ops=_ops_meta(args), wall_s=wall,
                    measure=("GPU: an empty Triton cache; each row one replayed step (forward + backward, the first "
                             "compiles) and a second one; variants_total: the JIT caches' sizes after the row"
                             if cuda else "CPU: each distinct JIT specialization of the row's launches (not seen "
                             "in an earlier row of the op) compiled for sm_90 with triton.compile, one at a time; "
                             "bind_us: the JIT binder's microseconds per launch (sm_90 target), mean over the row"))
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
        print(f"wrote {out}")
    return 0


def _fla_version() -> str | None:
    try:
        import fla

        return getattr(fla, "__version__", "unknown")
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
