"""Benchmark chunked KDA on one GPU: moelab's Triton paths vs fla (optional) vs causal SDPA.

Median ``triton.testing.do_bench`` time of a forward (no grad) and of a forward + backward with a
random output gradient, plus peak memory of the forward + backward, bf16. Both KDA sides compute
the same thing: L2-normalized q, k and the bounded gate ``g = -5 sigmoid(exp(A_log) * (x + dt_bias))``
(A_log = log U(1, 16), as in fla's own KDA benchmark setup):

* ``moelab_bounded`` / ``moelab_general``: ``chunk_kda(mode=..., gate="bounded", A_log=..., dt_bias=...,
  l2norm_qk=True)``: L2 norm and gate fused into the op (moelab/ops/kda/triton_prep.py);
* ``fla_safe_gate``: ``fla.ops.kda.chunk_kda(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
  safe_gate=True, lower_bound=-5)``; ``fla_softplus``: same without safe_gate (softplus gate);
* ``sdpa_flash``: ``F.scaled_dot_product_attention(is_causal=True)`` on the flash backend.

On a GPU it ends with a per-kernel device-time breakdown of one moelab forward + backward at
B8 T4096 (torch.profiler; JSON key ``kernel_ms``).

    python kernels/bench_kda.py                 # full run -> kernels/results/kda_h200.json
    python kernels/bench_kda.py --part main --out kernels/results/kda_h200_main.json   # split across
    python kernels/bench_kda.py --part long --out kernels/results/kda_h200_long.json   #  two calls
    python kernels/bench_kda.py --quick         # B8 T4096 only, shorter timing
    python kernels/bench_kda.py --smoke --out /tmp/kda_bench.json   # CPU interpreter, tiny shape
    python kernels/bench_kda.py --part infer    # inference forward vs fla -> kernels/results/kda_infer_h200.json
    python kernels/bench_kda.py --part infer --smoke --out /tmp/kda_infer.json   # CPU interpreter
    python kernels/bench_kda.py --part infer --infer-sweep   # then a sweep of its launch configs and paths
    python kernels/bench_kda.py --part infer --infer-shapes 3 --out /tmp/x.json   # B1 T32768 H16 only
    python kernels/bench_kda.py --part infer --infer-shapes 0 3 2 1 --infer-candidates --infer-sweep \
        --sweep-shapes 0 2 3   # the candidate paths beside fla at every shape, then the sweep at three
    python kernels/bench_kda.py --part infer --infer-impls moelab_infer fla_chunk_kda \
        --infer-candidates fold_v+longest_first   # fewer rows: one candidate, no training-forward rows

``--part infer`` times forwards only (no grad), bf16, output and final state returned by every side:
``moelab_infer`` (``moelab.ops.kda.triton_infer.kda_infer``: chunk 16, gate, L2 norm and beta sigmoid in its
kernels) against ``fla_chunk_kda`` (the same in-kernel gate, L2 norm, beta sigmoid and bound) and
``moelab_train_fwd`` (the training op's forward, fixed length only: it takes no ``cu_seqlens``), at fixed
length and packed (``cu_seqlens``: each row's T tokens cut into 6 uneven documents, all rows packed into
one), with the relative difference of moelab's output and final state from fla's as a check. Each
``moelab_infer`` row records which recurrence ran (``path``: plain, or segmented with its segment length and
count); where it is segmented (B1 T32768 H16 fixed on an H200), a ``moelab_infer_plain`` row times the plain
recurrence on the same inputs, and ``diff_vs_plain`` compares the two. ``--infer-candidates [NAME ...]``
adds a ``moelab_infer[NAME]`` row per candidate path (``INFER_CANDIDATES``: ``kda_infer``'s ``fold_v`` /
``pieces`` / ``longest_first``; the named ones, or every one) that differs from the op's default there
(``longest_first`` on packed rows only). ``--infer-impls`` keeps only some of the comparison rows. Each
printed row ends with the seconds since its shape began (compilation and fla's autotuning show there).
``--infer-sweep`` then times, at the fixed-length sweep shapes (``--sweep-shapes``), each launch config of
the inference forward's two kernels apart for the paths whose kernels differ (``INFER_SWEEP_INTRA``,
``INFER_SWEEP_RECUR``; JSON key ``sweep``: ms, GB/s of the least bytes each kernel must move, error against
the training forward), the whole op per candidate path and, where the op segments, per segment length; and
adds a ``moelab_infer_tuned`` row per shape and layout where the fastest passing configs differ from the
defaults. The comparison rows come first, so a run cut short keeps them (the JSON is written after every row
and sweep shape).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import torch

# fla 0.6.0 hands chunk_kda to FlashKDA under inference_mode when that package is installed; its
# wheel rejects CUDA tensors on the H200 machine, and the comparison is with fla's own kernels
os.environ.setdefault("FLA_FLASH_KDA", "0")
if not torch.cuda.is_available():  # must precede the first @triton.jit of moelab's kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.nn.attention  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from moelab.ops.kda import triton_chunk, triton_infer  # noqa: E402

try:
    import fla  # noqa: E402
    from fla.ops.kda import chunk_kda as fla_chunk_kda  # noqa: E402

    FLA_VERSION = getattr(fla, "__version__", "unknown")
except Exception as exc:  # fla-core is optional
    fla_chunk_kda, FLA_VERSION = None, None
    print(f"fla not importable ({type(exc).__name__}: {exc}); skipping fla_* rows", flush=True)

G_MIN = -5.0  # the bounded gate's floor, on both sides (fla calls it lower_bound)
DEFAULT_OUT = "kernels/results/kda_h200.json"
SHAPES = [(8, 4096, 16, 128), (1, 32768, 16, 128), (2, 65536, 16, 128)]
LONG_SHAPES = [(1, 131072, 16, 128), (1, 262144, 16, 128), (1, 524288, 16, 128)]
IMPLS = ["moelab_bounded", "moelab_general", "fla_safe_gate", "fla_softplus", "sdpa_flash"]


def make_inputs(impl, B, T, H, D, dev):
    dt = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter gets bf16 wrong
    req = dict(device=dev, dtype=dt, requires_grad=True)
    q, k, v, x = (torch.randn(B, T, H, D, **req) for _ in range(4))
    beta = torch.randn(B, T, H, device=dev, dtype=dt).sigmoid().requires_grad_()
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16)).requires_grad_()
    dt_bias = torch.zeros(H * D, device=dev, requires_grad=True)
    if impl == "sdpa_flash":
        qs, ks, vs = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        return [qs, ks, vs]
    return [q, k, v, x, beta, A_log, dt_bias]


def make_fn(impl, ins):
    if impl.startswith("moelab"):
        q, k, v, x, beta, A_log, dt_bias = ins
        mode = impl.split("_")[1]
        # the same computation as fla's: L2 norm of q, k and the bounded gate inside the op
        return lambda: triton_chunk.chunk_kda(q, k, v, x, beta, mode=mode, g_min=G_MIN, gate="bounded",
                                              A_log=A_log, dt_bias=dt_bias, l2norm_qk=True)[0]
    if impl.startswith("fla"):
        q, k, v, x, beta, A_log, dt_bias = ins
        kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)
        if impl == "fla_safe_gate":
            kw.update(safe_gate=True, lower_bound=G_MIN)
        return lambda: fla_chunk_kda(q, k, v, x, beta, **kw)[0]
    qs, ks, vs = ins

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    return sdpa


def timed(fn, dev, warmup, rep):
    if dev == "cuda":
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()
    ts = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def bench_one(impl, B, T, H, D, dev, warmup, rep):
    ins = make_inputs(impl, B, T, H, D, dev)
    fn = make_fn(impl, ins)

    def fwd():
        with torch.no_grad():
            return fn()

    o = fn()
    do = torch.randn_like(o)
    del o

    def fb():
        for t in ins:
            t.grad = None
        fn().backward(do)

    fb()
    fwd_ms = timed(fwd, dev, warmup, rep)
    fb_ms = timed(fb, dev, warmup, rep)
    peak = None
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fb()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 1e9  # inputs + grads + everything the step allocates
    return fwd_ms, fb_ms, peak


def run_rows(impls, shapes, dev, warmup, rep, rows, save=None):
    for (B, T, H, D) in shapes:
        for impl in impls:
            if impl.startswith("fla") and fla_chunk_kda is None:
                continue
            row = dict(impl=impl, B=B, T=T, H=H, D=D, fwd_ms=None, fwdbwd_ms=None, peak_mem_gb=None)
            try:
                row["fwd_ms"], row["fwdbwd_ms"], row["peak_mem_gb"] = bench_one(impl, B, T, H, D, dev, warmup, rep)
            except torch.cuda.OutOfMemoryError:
                row["error"] = "OOM"
            except Exception as exc:  # record and go on: one failing baseline must not hide the rest
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            if save is not None:
                save()  # after every row: a run cut short by a time limit keeps what it measured
            fmt = lambda x: f"{x:9.3f}" if x is not None else "        -"  # noqa: E731
            print(f"{impl:16s} B{B:<2d} T{T:<7d} H{H} D{D}  fwd {fmt(row['fwd_ms'])} ms  fwd+bwd "
                  f"{fmt(row['fwdbwd_ms'])} ms  peak {fmt(row['peak_mem_gb'])} GB  {row.get('error', '')}", flush=True)
            if dev == "cuda":
                torch.cuda.empty_cache()


def profile_kernels(B, T, H, D, dev, impls=("moelab_bounded", "moelab_general")):
    """Device time per kernel of one forward + backward (torch.profiler) of each impl (moelab's
    modes by default; fla's rows work too where fla is installed)."""
    out = {}
    for impl in impls:
        ins = make_inputs(impl, B, T, H, D, dev)
        fn = make_fn(impl, ins)
        do = torch.randn_like(fn())
        fn().backward(do)  # compile outside the profile
        for t in ins:
            t.grad = None  # else the profiled backward also accumulates into .grad (an extra add kernel)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn().backward(do)
            torch.cuda.synchronize()
        times = {}
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if us:
                times[ev.key] = times.get(ev.key, 0.0) + us / 1e3
        out[impl] = dict(sorted(times.items(), key=lambda kv: -kv[1]))
        print(f"\nkernel times, one fwd+bwd, {impl} B{B} T{T} H{H} D{D} (ms):")
        for name, ms in list(out[impl].items())[:14]:
            print(f"  {ms:8.3f}  {name[:90]}")
        del ins, fn, do
        torch.cuda.empty_cache()
    return out


def print_ratios(rows):
    by = {(r["impl"], r["B"], r["T"]): r for r in rows if "tuning" not in r}
    print("\nratios (>1: the second-named path is faster)")
    for (impl, B, T), r in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if impl != "moelab_bounded" or r["fwd_ms"] is None:
            continue
        for other, label in [("fla_safe_gate", "fla_safe_gate / moelab_bounded"),
                             ("moelab_general", "moelab_general / moelab_bounded"),
                             ("sdpa_flash", "sdpa_flash / moelab_bounded")]:
            o = by.get((other, B, T))
            if o and o["fwd_ms"] is not None:
                print(f"  B{B} T{T}: {label:34s} fwd {o['fwd_ms'] / r['fwd_ms']:.2f}x  "
                      f"fwd+bwd {o['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x")


# ---------------------------------------------------------------------------------------------
# --part infer: the inference forward (issue 18)
# ---------------------------------------------------------------------------------------------
INFER_SHAPES = [(1, 8192, 64, 128), (1, 8192, 96, 128), (8, 4096, 16, 128), (1, 32768, 16, 128)]
INFER_DOCS = 6  # documents per row in the packed layout
# moelab_infer_plain: moelab_infer on the plain recurrence (segment_chunks=0), timed only where the op
# picks the segmented one (B1 T32768 H16 fixed on an H200), so one run measures both paths
INFER_IMPLS = ["moelab_infer", "moelab_infer_plain", "fla_chunk_kda", "moelab_train_fwd"]


def doc_offsets(B: int, T: int, n_docs: int = INFER_DOCS, seed: int = 0) -> list[int]:
    """``cu_seqlens`` of B rows of T tokens, each row cut into ``n_docs`` documents of uneven
    length (seeded), all packed into one row of B*T tokens."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for _ in range(B):
        w = torch.rand(n_docs, generator=gen) + 0.15
        lens = (w / w.sum() * T).floor().long()
        lens[-1] += T - lens.sum()
        for n in lens.tolist():
            cu.append(cu[-1] + n)
    return cu


def _fla_takes_beta_logits() -> bool:
    import inspect

    return fla_chunk_kda is not None and "use_beta_sigmoid_in_kernel" in inspect.signature(fla_chunk_kda).parameters


def infer_inputs(B, T, H, D, dev, packed, beta_logits):
    """bf16 (fp32 on CPU) q, k, v, z, beta, A_log, dt_bias as in ``make_inputs``; packed: one row
    of B*T tokens and its ``cu_seqlens``. ``beta_logits``: beta holds logits (sigmoid in the ops)."""
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    rows, cols = (1, B * T) if packed else (B, T)
    q, k, v, z = (torch.randn(rows, cols, H, D, device=dev, dtype=dt) for _ in range(4))
    beta = torch.randn(rows, cols, H, device=dev, dtype=dt)
    if not beta_logits:
        beta = beta.sigmoid()
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
    dt_bias = torch.zeros(H * D, device=dev)
    cu = torch.tensor(doc_offsets(B, T), device=dev, dtype=torch.int64) if packed else None
    return dict(q=q, k=k, v=v, z=z, beta=beta, A_log=A_log, dt_bias=dt_bias, cu=cu)


def _infer_kw(x, beta_logits, impl) -> dict:
    """Keywords of ``kda_infer`` (and ``InferPlan``) for a ``moelab_infer*`` impl on inputs ``x``;
    ``moelab_infer[NAME]``: at the ``INFER_CANDIDATES[NAME]`` path."""
    cand = INFER_CANDIDATES[impl[impl.index("[") + 1:-1]] if impl.endswith("]") else {}
    return dict(gate="bounded", A_log=x["A_log"], dt_bias=x["dt_bias"], g_min=G_MIN, l2norm_qk=True,
                beta_sigmoid=beta_logits, output_final_state=True, cu_seqlens=x["cu"], validate=False,
                segment_chunks=0 if impl == "moelab_infer_plain" else None, **cand)


def infer_path(impl, x, beta_logits) -> dict:
    """Which recurrence a ``moelab_infer*`` impl runs on ``x`` (``InferPlan.path``: segmented or not,
    segments, launch configs); builds the plan's buffers, runs nothing."""
    plan = triton_infer.InferPlan(*(x[n] for n in ("q", "k", "v", "z", "beta")), **_infer_kw(x, beta_logits, impl))
    return plan.path()


def infer_fn(impl, x, beta_logits, tuned=None, segment_chunks=None, cand=None):
    """A no-grad forward returning ``(o, final state)``; ``tuned``: (intra, recur) launch configs of
    ``moelab_infer_tuned``; ``segment_chunks``: forces the recurrence's path, ``cand``: the candidate path
    (``kda_infer``'s keywords)."""
    q, k, v, z, beta, A_log, dt_bias, cu = (x[n] for n in ("q", "k", "v", "z", "beta", "A_log", "dt_bias", "cu"))
    if impl.startswith("moelab_infer"):
        kw = _infer_kw(x, beta_logits, impl)
        if segment_chunks is not None:
            kw["segment_chunks"] = segment_chunks
        kw.update(cand or {})

        def infer():
            return triton_infer.kda_infer(q, k, v, z, beta, **kw)
        if impl != "moelab_infer_tuned":
            return infer
        intra, recur = tuned  # moelab_infer_tuned: the sweep's fastest configs at this shape

        def infer_tuned():
            with triton_infer.launch_overrides(intra=intra, recur=(recur,)):
                return infer()
        return infer_tuned
    if impl == "fla_chunk_kda":
        kw = dict(use_beta_sigmoid_in_kernel=True) if beta_logits else {}

        def fla():
            with torch.no_grad():
                return fla_chunk_kda(q, k, v, z, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                     use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=G_MIN,
                                     output_final_state=True, cu_seqlens=cu, **kw)
        return fla
    # the training op takes beta in (0, 1): the sigmoid is precomputed, outside the timed call
    b = beta.sigmoid() if beta_logits else beta

    def train():
        with torch.no_grad():
            return triton_chunk.chunk_kda(q, k, v, z, b, mode="bounded", g_min=G_MIN, gate="bounded",
                                          A_log=A_log, dt_bias=dt_bias, l2norm_qk=True, output_final_state=True)
    return train


# --infer-sweep: the inference forward's two kernels timed apart, one launch config at a time, for the
# candidate paths whose kernels differ (the keys of INFER_SWEEP_INTRA; pieces only overlap the base path's
# kernels), then the whole op per candidate path side by side.
# intra, per path, (num_warps, num_stages, per_program[, maxnreg]): 2 warps, one slot per program was the
# fastest at every shape in both u-path sweeps (1 warp +80%, 4 warps +40%, 8 warps +125%, pipelined slots
# +20-25%). The fold_v kernel now keeps three [16, K] tiles live instead of six (sm_90a compile,
# Triton 3.9: 204 registers at 2 warps, 168 at 4, no spills; before, 255 with 36 B spilled and 235): 5 programs
# per SM at 2 warps, 3 at 4; register caps make room for more (2 warps at 168: 6 per SM, 16 B spilled; 4 warps
# at 128: 4 per SM, 60 B spilled)
INFER_SWEEP_INTRA = {"base": [(2, 1, 1)], "fold_v": [(2, 1, 1), (4, 1, 1), (2, 1, 1, 168), (4, 1, 1, 128)]}
# (BV, num_warps, num_stages[, maxnreg]): the two the op picks at D = 128 (triton_infer.pick_recur); 16/1 was never
# the fastest, 2 or 4 stages never faster than 3, 128/8 always the slowest (both sweeps); each also at a register
# cap of 168 (triton_infer.RECUR_MAXNREG, the default on 4-warp launches: more programs per SM; an entry without a
# cap runs at the op's own rule)
INFER_SWEEP_RECUR = [(32, 2, 3), (64, 4, 3), (32, 2, 3, 168), (64, 4, 3, 168)]
# a config whose o or final state is further than this from the training forward's is wrong (both
# sides are bf16 paths ~3e-3 from the fp32 recurrence; a miscompile is off by O(1))
INFER_SWEEP_TOL = 2e-2
# segment lengths in chunks (0: the plain recurrence), timed as the whole op at its default launches at every
# shape, so the cost model's choice (triton_infer.choose_segment_chunks) meets a measurement where it says plain
# too (packed B1 T8192 H64 ran 11% faster than fixed at 6d91d0b: shorter chains); lengths >= the chunks of a
# sequence are skipped
INFER_SWEEP_SEGMENTS = [0, 64, 128, 256, 512]
# candidate paths: kda_infer's fold_v / pieces / longest_first / recur_maxnreg (triton_infer.FOLD_V, PIECES,
# LONGEST_FIRST, RECUR_MAXNREG); "base" is u materialised, one
# launch of each kernel. Pieces apply to the plain recurrence only: skipped where the op segments.
INFER_CANDIDATES = {"base": dict(fold_v=False, pieces=1, longest_first=False),
                    "fold_v": dict(fold_v=True, pieces=1, longest_first=False),
                    "pieces2": dict(fold_v=False, pieces=2, longest_first=False),
                    "pieces4": dict(fold_v=False, pieces=4, longest_first=False),
                    "fold_v+pieces4": dict(fold_v=True, pieces=4, longest_first=False),
                    "fold_v+longest_first": dict(fold_v=True, pieces=1, longest_first=True),
                    "nocap": dict(fold_v=True, pieces=1, longest_first=True, recur_maxnreg=0)}
# candidates that change nothing on fixed-length rows (they order packed documents): timed on packed rows only
PACKED_ONLY = ("longest_first",)


def infer_bytes(plan) -> dict:
    """Least bytes each kernel of ``plan`` moves: its inputs read once, its outputs written once (the
    intermediates with their padding, the fp32 decay ``gl`` and the read-ahead row included)."""
    inter = [t for t in (plan.w, plan.u, plan.ab, plan.qg, plan.kd, plan.Aqk, plan.gl) if t is not None]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    q, k, v, z, beta = plan.inputs
    state = plan.hT.numel() * 4 if plan.hT is not None else 0
    if plan.fold_v:  # v is read by the recurrence, not by the intra kernel
        return dict(intra=nbytes((q, k, z, beta)) + nbytes(inter), recur=nbytes(inter) + nbytes((v, plan.o)) + state)
    return dict(intra=nbytes(plan.inputs) + nbytes(inter), recur=nbytes(inter) + nbytes((plan.o,)) + state)


def _checked(row, fn, ref_o, ref_S, dev, warmup, rep, out=None, time_fn=None):
    """Run ``fn`` (returning nothing if ``out`` gives the outputs, else ``(o, S)``), record its error
    against the training forward (``ok`` within INFER_SWEEP_TOL), then the time of ``time_fn`` (default
    ``fn``); a failure is recorded, not raised."""
    from tests.helpers import rel_err

    try:
        res = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        o, S = out() if out is not None else res
        row.update(err_o=rel_err(ref_o.float(), o.float()), err_S=rel_err(ref_S.float(), S))
        row["ok"] = bool(row["err_o"] <= INFER_SWEEP_TOL and row["err_S"] <= INFER_SWEEP_TOL)
        row["ms"] = timed(time_fn or fn, dev, warmup, rep)
    except Exception as exc:  # a config that fails to compile or run is recorded, not fatal
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    return row


def _fmt_row(row) -> str:
    ms = f"{row['ms']:8.3f} ms" if row.get("ms") is not None else "       -   "
    gb = f" {row['gbps']:6.0f} GB/s" if row.get("gbps") else ""
    err = f"  err o {row['err_o']:.1e} S {row['err_S']:.1e}" if "err_o" in row else "  " + row.get("error", "")
    return f"{ms}{gb}{err}{'' if row.get('ok') else '  FAILED'}"


def infer_sweep(shapes, dev, beta_logits, warmup, rep) -> dict:
    """Per fixed-length shape, against the training forward's o and final state:
    1. for each path of INFER_SWEEP_INTRA, each of its configs of the token-parallel kernel (the
       recurrence at its default) and every ``INFER_SWEEP_RECUR`` config of the recurrence (after the
       default intra launch), timed apart, with GB/s of ``infer_bytes``; the fastest passing of each;
    2. the whole op at its default launches for every ``INFER_CANDIDATES`` path;
    3. the whole op at every ``INFER_SWEEP_SEGMENTS`` length (forced, whichever path the op picks)."""
    out = {}
    for (B, T, H, D) in shapes:
        x = infer_inputs(B, T, H, D, dev, False, beta_logits)
        ref_o, ref_S = infer_fn("moelab_train_fwd", x, beta_logits)()
        tag = f"B{B} T{T} H{H}"
        res: dict = dict(kernels={}, candidates=[], segments=[])
        for name in INFER_SWEEP_INTRA:
            plan = triton_infer.InferPlan(x["q"], x["k"], x["v"], x["z"], x["beta"], **_infer_kw(x, beta_logits,
                                          "moelab_infer"), **INFER_CANDIDATES[name])
            default = dict(intra=plan.intra_launch(), recur=plan.recur_launch())
            kres: dict = dict(default=default, path=plan.path(), min_bytes=infer_bytes(plan), intra=[], recur=[])
            recur = [c for c in INFER_SWEEP_RECUR if c[0] <= plan.dims[6]]  # V-blocks no wider than V (padded)
            outputs = lambda plan=plan: (plan.o, plan.hT)  # noqa: E731
            for kernel, cands in (("intra", INFER_SWEEP_INTRA[name]), ("recur", recur)):
                for cfg in cands:
                    run = functools.partial(getattr(plan, kernel), *cfg)

                    def first(run=run, kernel=kernel, plan=plan, default=default):  # the other kernel at its default
                        if kernel == "recur":
                            plan.intra(*default["intra"])
                        run()
                        if kernel == "intra":
                            plan.recur(*default["recur"])
                    row = _checked(dict(cfg=list(cfg), ms=None), first, ref_o, ref_S, dev, warmup, rep, outputs, run)
                    if row.get("ms") is not None:
                        row["gbps"] = kres["min_bytes"][kernel] / row["ms"] / 1e6
                    kres[kernel].append(row)
                    print(f"  sweep {tag} {name:7s} {kernel:5s} {str(tuple(cfg)):10s} {_fmt_row(row)}", flush=True)
                ok = [r for r in kres[kernel] if r["ok"] and r["ms"] is not None]
                kres["best_" + kernel] = min(ok, key=lambda r: r["ms"])["cfg"] if ok else None
            res["kernels"][name] = kres
        seg = res["kernels"]["base"]["path"]["segment_chunks"]
        for name, kw in INFER_CANDIDATES.items():
            if any(kw.get(key) for key in PACKED_ONLY):  # the sweep's rows are fixed length
                continue
            row = dict(candidate=name, ms=None)
            if kw["pieces"] > 1 and seg:
                row.update(ok=False, error=f"not run: the op segments here (segment_chunks={seg}); pieces need "
                                           "the plain recurrence")
            else:
                _checked(row, infer_fn("moelab_infer", x, beta_logits, cand=kw), ref_o, ref_S, dev, warmup, rep)
            res["candidates"].append(row)
            print(f"  sweep {tag} whole op {name:15s} {_fmt_row(row)}", flush=True)
        ok = [r for r in res["candidates"] if r["ok"] and r["ms"] is not None]
        res["best_candidate"] = min(ok, key=lambda r: r["ms"])["candidate"] if ok else None
        nc = triton.cdiv(T, triton_infer.CHUNK)
        for L in [L for L in INFER_SWEEP_SEGMENTS if L < nc]:
            row = _checked(dict(segment_chunks=L, ms=None), infer_fn("moelab_infer", x, beta_logits, segment_chunks=L),
                           ref_o, ref_S, dev, warmup, rep)
            res["segments"].append(row)
            print(f"  sweep {tag} whole op, segments of {L:3d} chunks {_fmt_row(row)}", flush=True)
        ok = [r for r in res["segments"] if r["ok"] and r["ms"] is not None]
        res["best_segments"] = min(ok, key=lambda r: r["ms"])["segment_chunks"] if ok else None
        base = res["kernels"]["base"]
        res["best_intra"], res["best_recur"] = base["best_intra"], base["best_recur"]
        out[f"B{B}_T{T}_H{H}"] = res
        print(f"  sweep {tag}: default {base['default']} segments {seg}; fastest passing: intra "
              f"{base['best_intra']} recur {base['best_recur']} candidate {res['best_candidate']} segments "
              f"{res['best_segments']}", flush=True)
        del x, ref_o, ref_S
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def run_infer(args, dev) -> int:
    """``--part infer``: every impl at every shape, fixed and packed (JSON after every row); with
    ``--infer-sweep`` then the sweep at the sweep shapes (JSON after every shape) and a
    ``moelab_infer_tuned`` row where its fastest launch configs differ from the op's defaults. The
    comparison with fla comes first, so that a run cut short by a time limit keeps it."""
    if args.infer_rounds is not None and args.infer_rounds < 1:
        raise SystemExit(f"--infer-rounds must be >= 1, got {args.infer_rounds}")
    rounds = args.infer_rounds or (1 if dev == "cpu" else 3)
    if args.smoke or dev == "cpu":
        shapes, warmup, rep = [(1, 64, 2, 32)], 1, 1
    else:
        shapes, warmup, rep = (INFER_SHAPES[2:3] if args.quick else INFER_SHAPES), 25, 100
        if args.infer_shapes:
            shapes = [INFER_SHAPES[i] for i in args.infer_shapes]
    sweep_shapes = [INFER_SHAPES[i] for i in args.sweep_shapes] if args.sweep_shapes and dev == "cuda" else shapes
    beta_logits = dev == "cpu" or _fla_takes_beta_logits()
    out = args.out if args.out != DEFAULT_OUT else "kernels/results/kda_infer_h200.json"
    try:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        commit = None
    meta = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (triton interpreter)",
                host=os.uname().nodename, torch=torch.__version__, triton=triton.__version__, fla=FLA_VERSION,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                commit=args.commit or commit, command=" ".join(sys.argv), dtype=str(torch.bfloat16 if dev == "cuda"
                                                                                     else torch.float32),
                launch=triton_infer.LAUNCH, sm_count=torch.cuda.get_device_properties(0).multi_processor_count
                if dev == "cuda" else None, beta_sigmoid_in_kernel=beta_logits, docs_per_row=INFER_DOCS, g_min=G_MIN,
                rounds=rounds,
                note="forward only, no grad, output and final state from every impl; gate, L2 norm of q, k, "
                     "fwd_ms: the median over `rounds` timings of the row (fwd_ms_rounds, the rows of a shape and "
                     "layout timed in turn), each a do_bench median; host_ms (GPU runs): the host's time per call, "
                     "calls issued back to back without a sync (near fwd_ms or above: host-bound, or a sync); "
                     "beta sigmoid (where fla takes beta logits) and the bound inside the ops; packed: each "
                     "row's T tokens cut into 6 uneven documents (doc_offsets), rows packed into one; "
                     "path: the path moelab_infer ran (InferPlan.path: segmented or plain, segment length "
                     "in chunks, segments per sequence or document, launch configs, candidate path); "
                     "moelab_infer_plain: the plain recurrence forced (segment_chunks=0), only where "
                     "moelab_infer is segmented, diff_vs_plain: the two paths' relative RMS difference; "
                     "moelab_infer[NAME] (with --infer-candidates): moelab_infer on the candidate path NAME "
                     "(candidates: kda_infer keywords); diff_vs_fla: relative RMS difference of a moelab_infer* "
                     "row's o and final state from fla's; sweep (with --infer-sweep, fixed length): per path "
                     "(kernels) and kernel and launch config, ms, GB/s of the least bytes the kernel must move "
                     "(min_bytes), error vs the training forward; candidates: the whole op per candidate path; "
                     "segments: the whole op per segment length, where the op segments; moelab_infer_tuned: "
                     "moelab_infer at the sweep's fastest passing launch configs, where they differ from the "
                     "defaults (packed rows too)",
                candidates=INFER_CANDIDATES)
    rows: list[dict] = []
    sweep: dict = {}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    def write():
        with open(out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, **(dict(sweep=sweep) if sweep else {})), f, indent=1)

    impls = [i for i in (args.infer_impls or INFER_IMPLS) if not (i.startswith("fla") and fla_chunk_kda is None)]
    for shape in shapes:
        for packed in (False, True):
            infer_rows(shape, packed, impls, args.infer_candidates, None, dev, beta_logits, warmup, rep, rows, write,
                       rounds=rounds)
    if args.infer_sweep:
        for shape in sweep_shapes:
            sweep.update(infer_sweep([shape], dev, beta_logits, *((1, 1) if dev == "cpu" else (10, 40))))
            write()
        for (B, T, H, D) in sweep_shapes:
            sw = sweep[f"B{B}_T{T}_H{H}"]
            base = sw["kernels"]["base"]
            tuned = (sw["best_intra"], sw["best_recur"])
            if None in tuned or (tuple(tuned[0]), tuple(tuned[1])) == (tuple(base["default"]["intra"]),
                                                                       tuple(base["default"]["recur"])):
                continue
            for packed in (False, True):
                infer_rows((B, T, H, D), packed, ["moelab_infer_tuned", "fla_chunk_kda"] if "fla_chunk_kda" in impls
                           else ["moelab_infer_tuned"], False, tuned, dev, beta_logits, warmup, rep, rows, write)
    print_infer_ratios(rows)
    print(f"wrote {out}")
    return 0


def infer_rows(shape, packed, impls, candidates, tuned, dev, beta_logits, warmup, rep, rows, write,
               rounds: int = 1) -> None:
    """Time ``impls`` (and, with ``candidates``, moelab_infer on every candidate path other than its
    default) at one shape and layout; append a row each to ``rows`` and ``write()`` after each. With
    ``rounds`` > 1 every row is timed again in ``rounds - 1`` more rounds, the rows in turn within each, and
    its ``fwd_ms`` is the median over the rounds (``fwd_ms_rounds``: each round's): one timing of a row can sit
    10-15% off a later one of the same code on the H200 (the B1 T32768 H16 segmented row at 503d12f: 1.607 ms in
    the bench, 1.38 in an A/B on the next machine), and rounds taken in turn share whatever drifts. On the GPU each
    timed row also gets ``host_ms`` (the host's time per call, ``host_ms()``): whether the host keeps ahead of
    the GPU."""
    from tests.helpers import rel_err

    B, T, H, D = shape
    x = infer_inputs(B, T, H, D, dev, packed, beta_logits)
    layout = "packed" if packed else "fixed"
    results = {}
    path = infer_path("moelab_infer", x, beta_logits)
    # candidate paths other than the op's default here; pieces need the plain recurrence
    cands = [f"moelab_infer[{n}]" for n, kw in INFER_CANDIDATES.items() if candidates is not None
             and (not candidates or n in candidates)
             and any(kw[key] != path[key] for key in kw if packed or key not in PACKED_ONLY)
             and not (kw["pieces"] > 1 and path["segmented"])]
    start = len(rows)
    t0 = time.perf_counter()
    fns = {}
    for impl in impls + cands:
        if (impl == "moelab_train_fwd" and packed) or (impl == "moelab_infer_plain" and not path["segmented"]):
            continue
        row = dict(impl=impl, layout=layout, B=B, T=T, H=H, D=D, fwd_ms=None)
        if packed:
            row["cu_seqlens"] = x["cu"].tolist()
        if impl != "moelab_infer_tuned" and impl.startswith("moelab_infer"):
            row["path"] = path if impl == "moelab_infer" else infer_path(impl, x, beta_logits)
        try:
            fn = infer_fn(impl, x, beta_logits, tuned)
            results[impl] = fn()
            row["fwd_ms"] = timed(fn, dev, warmup, rep)
            fns[impl] = fn
        except torch.cuda.OutOfMemoryError:
            row["error"] = "OOM"
        except Exception as exc:  # record and go on: one failing side must not hide the rest
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if impl == "moelab_infer_tuned":
            row["launch"] = dict(intra=tuned[0], recur=tuned[1])
        rows.append(row)
        write()
        ms = f"{row['fwd_ms']:9.3f}" if row["fwd_ms"] is not None else "        -"
        seg = row.get("path", {}).get("segment_chunks")
        seg = f"  segments of {seg} chunks" if seg else ""
        print(f"{impl:30s} {layout:6s} B{B:<2d} T{T:<6d} H{H:<3d} D{D}  fwd {ms} ms  {row.get('error', '')}{seg}"
              f"  [{time.perf_counter() - t0:.0f} s into the shape, compilation and autotuning included]", flush=True)
    timed_rows = [r for r in rows[start:] if r["impl"] in fns]
    if rounds > 1 and timed_rows:
        for r in timed_rows:
            r["fwd_ms_rounds"] = [r["fwd_ms"]]
        for _ in range(rounds - 1):
            for r in timed_rows:
                r["fwd_ms_rounds"].append(timed(fns[r["impl"]], dev, warmup, rep))
        for r in timed_rows:
            ms = r["fwd_ms_rounds"]
            r["fwd_ms"] = statistics.median(ms)
            print(f"  {r['impl']:30s} {layout:6s} over {rounds} rounds: median {r['fwd_ms']:.3f} ms "
                  f"({min(ms):.3f}-{max(ms):.3f})", flush=True)
        write()
    if dev == "cuda":
        for r in timed_rows:
            r["host_ms"] = host_ms(fns[r["impl"]])
            print(f"  {r['impl']:30s} {layout:6s} host time per call {r['host_ms']:.3f} ms (GPU {r['fwd_ms']:.3f})",
                  flush=True)
        write()
    del fns
    if "fla_chunk_kda" in results:
        fo, fS = results["fla_chunk_kda"]
        for row in rows[start:]:
            impl = row["impl"]
            if impl in results and impl.startswith("moelab_infer") and impl != "moelab_infer_plain":
                o, S = results[impl]
                row["diff_vs_fla"] = diff = dict(o=rel_err(fo.float(), o.float()),
                                                 final_state=rel_err(fS.float(), S.float()))
                print(f"  {row['impl']} vs fla: o {diff['o']:.2e}  final state {diff['final_state']:.2e}", flush=True)
        write()
    if "moelab_infer" in results and "moelab_infer_plain" in results:
        (o, S), (po, pS) = results["moelab_infer"], results["moelab_infer_plain"]
        diff = dict(o=rel_err(po.float(), o.float()), final_state=rel_err(pS, S))
        next(r for r in rows[::-1] if r["impl"] == "moelab_infer")["diff_vs_plain"] = diff
        print(f"  segmented vs plain: o {diff['o']:.2e}  final state {diff['final_state']:.2e}", flush=True)
        write()
    del x, results
    if dev == "cuda":
        torch.cuda.empty_cache()


def host_ms(fn, calls: int = 20) -> float:
    """Host time per call of ``fn`` in ms: ``calls`` calls issued back to back with no sync between them, the
    median of three such bursts. Below the GPU time the host keeps ahead and the GPU never waits on it; near or
    above it the call is host-bound, or syncs (the queue then drains every call)."""
    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


def print_infer_ratios(rows) -> None:
    by = {(r["impl"], r["layout"], r["B"], r["T"], r["H"]): r["fwd_ms"] for r in rows}
    print("\nratios, forward (>1: moelab_infer faster; targets: 1.85x fixed, 2x packed)")
    for (impl, layout, B, T, H), ms in by.items():
        if not impl.startswith("moelab_infer") or ms is None:
            continue
        parts = []
        for other in ("fla_chunk_kda", "moelab_train_fwd", "moelab_infer_plain"):
            if other == impl:
                continue
            o = by.get((other, layout, B, T, H))
            if o is not None:
                parts.append(f"{other} / {impl} {o / ms:.2f}x")
        print(f"  {impl:30s} {layout:6s} B{B} T{T} H{H}: " + ("  ".join(parts) or "-"))



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="--part infer: default kernels/results/kda_infer_h200.json")
    ap.add_argument("--quick", action="store_true", help="B8 T4096 only, shorter timing")
    ap.add_argument("--part", choices=("all", "main", "long", "infer"), default="all",
                    help="main: the three anchor shapes, all impls; long: T up to 524288 at B=1, moelab only; "
                         "infer: the inference forward vs fla (--quick: B8 T4096 only)")
    ap.add_argument("--infer-shapes", nargs="*", type=int, choices=range(len(INFER_SHAPES)),
                    help=f"--part infer: only these indices of {INFER_SHAPES} (to split a run)")
    ap.add_argument("--commit", help="commit to record (--part infer; default: git rev-parse HEAD)")
    ap.add_argument("--sweep-shapes", nargs="*", type=int, choices=range(len(INFER_SHAPES)),
                    help="--infer-sweep: only these indices of INFER_SHAPES (default: the shapes of the run)")
    ap.add_argument("--infer-candidates", nargs="*", choices=tuple(INFER_CANDIDATES), default=None, metavar="NAME",
                    help="--part infer: also time moelab_infer on these candidate paths of INFER_CANDIDATES "
                         f"({', '.join(INFER_CANDIDATES)}; none named: every one) where they differ from its "
                         "default (rows moelab_infer[NAME]), fixed and packed")
    ap.add_argument("--infer-impls", nargs="*", choices=INFER_IMPLS, default=None, metavar="IMPL",
                    help=f"--part infer: only these of {', '.join(INFER_IMPLS)} (default: all)")
    ap.add_argument("--infer-rounds", type=int, default=None,
                    help="--part infer: time every row this many times, the rows of a shape and layout in turn, and "
                         "record the median (fwd_ms) beside each round's (fwd_ms_rounds); default 3 on the GPU, 1 "
                         "on the CPU")
    ap.add_argument("--infer-sweep", action="store_true",
                    help="--part infer: first time the inference kernels' launch configs apart at every shape "
                         "(JSON key sweep), then also time moelab_infer at the fastest (moelab_infer_tuned)")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU (Triton interpreter), moelab only")
    ap.add_argument("--impls", nargs="*", choices=IMPLS, help="only these rows (default: all)")
    ap.add_argument("--no-profile", action="store_true", help="skip the per-kernel breakdown")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.part == "infer":
        return run_infer(args, dev)
    if args.smoke or dev == "cpu":
        shapes, long_shapes, impls, warmup, rep = [(1, 128, 2, 32)], [], ["moelab_bounded", "moelab_general"], 1, 1
    elif args.quick:
        shapes, long_shapes, impls, warmup, rep = SHAPES[:1], [], IMPLS, 10, 50
    else:
        shapes, long_shapes, impls, warmup, rep = SHAPES, LONG_SHAPES, IMPLS, 25, 100
    if args.part == "long":
        shapes = []
    elif args.part == "main":
        long_shapes = []
    if args.impls:
        impls = [i for i in impls if i in args.impls]
    if dev == "cpu" and fla_chunk_kda is not None:
        impls = [i for i in impls if not i.startswith("fla")]
    rows: list[dict] = []
    meta = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu (triton interpreter)",
                torch=torch.__version__, triton=triton.__version__, fla=FLA_VERSION,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                command=" ".join(sys.argv),
                launch_configs=triton_chunk.launch_configs(), maxnreg=dict(triton_chunk.MAXNREG),
                note="both sides: L2 norm of q, k and the bounded gate (with dt_bias) inside the op")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    profile: dict = {}

    def write():
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, kernel_ms=profile), f, indent=1)

    run_rows(impls, shapes, dev, warmup, rep, rows, save=write)
    run_rows(["moelab_bounded", "moelab_general"], long_shapes, dev, warmup, rep, rows, save=write)
    print_ratios(rows)
    write()  # the timings are safe before the optional breakdown runs
    if dev == "cuda" and args.part != "long" and not args.no_profile:
        try:
            profile.update(profile_kernels(*SHAPES[0], dev))
            write()
        except Exception as exc:  # the breakdown is a diagnostic; never lose the timings to it
            print(f"kernel breakdown failed: {type(exc).__name__}: {exc}", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
