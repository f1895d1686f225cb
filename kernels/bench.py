"""One benchmark runner for moelab's ops and model on one GPU, over a small registry of entries.

    python kernels/bench.py --list                              # the entries, their shapes and output files
    python kernels/bench.py --entry kda                         # -> kernels/results/kda_h200.json
    python kernels/bench.py --entry kda_infer --shapes B1-T32768-H16
    python kernels/bench.py --entry model --shapes k3-mini --rounds 8 --budget-s 280
    python kernels/bench.py --entry kda --base HEAD~3           # A/B: that commit beside this tree, with ratios
    python kernels/bench.py --entry moe --smoke --out /tmp/moe.json   # CPU: tiny shapes (Triton interpreter)

Entries: ``ENTRIES`` (``--list`` names them with their shapes; kernels/README.md says what each measures); each
row says what ran, with the times in ms and peak memory.

Timing (:func:`time_ms`): CUDA events around back-to-back calls, after warm-up; the median over rounds. The rows
of a shape are timed in passes over them (:func:`time_passes`) or interleaved rounds (model), in a Williams order.
Provenance: ``moelab/provenance.py`` (the same block the study harness writes). ``--base REV`` checks REV
out in a temporary ``git worktree``, runs the same entry there (this file, that tree's moelab), then here,
and prints both side by side: speedup = base time / this time (> 1: this tree is faster)."""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import importlib.util
import inspect
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START = time.perf_counter()  # --budget-s counts from here, as a time limit on the whole process does
ROOT = Path(__file__).resolve().parents[1]
# The tree whose moelab is measured: this checkout, or a worktree of another commit (--base).
CODE = Path(os.environ.get("MOELAB_BENCH_CODE") or ROOT).resolve()
if str(CODE) not in sys.path:
    sys.path.insert(0, str(CODE))

import torch  # noqa: E402


def _load_provenance():
    """``moelab/provenance.py`` of this file's tree, also when ``CODE`` is an older commit without it."""
    spec = importlib.util.spec_from_file_location("_bench_provenance", ROOT / "moelab" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


provenance = _load_provenance().provenance
G_MIN = -5.0  # the bounded gate's floor on every KDA side (fla calls it lower_bound)


# ------------------------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """``ms``: the median of ``rounds_ms``, each round's mean time per call of ``reps`` back-to-back calls."""

    ms: float
    rounds_ms: list[float]
    reps: int


def time_ms(fn: Callable[[], Any], *, warmup: int = 3, rounds: int = 15, min_round_ms: float = 5.0,
            before: Callable[[], None] | None = None, cuda: bool | None = None,
            clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Time ``fn``: ``warmup`` calls, then ``rounds`` rounds of ``reps`` back-to-back calls each (``reps`` from one
    more timed call, so that a round lasts about ``min_round_ms``), ``before`` (host work, e.g. resetting ``.grad``)
    before every call inside the round; CUDA events on the current stream (default: when available) or ``clock``
    (seconds). Returns the median over the rounds."""
    if rounds < 1 or warmup < 0:
        raise ValueError(f"time_ms needs rounds >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    cuda = torch.cuda.is_available() if cuda is None else cuda

    def call() -> None:
        if before is not None:
            before()
        fn()

    def timed(n: int) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                call()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / n
        t = clock()
        for _ in range(n):
            call()
        return (clock() - t) * 1e3 / n

    for _ in range(warmup):
        call()
    if cuda:
        torch.cuda.synchronize()
    one = timed(1)
    reps = max(1, math.ceil(min_round_ms / one)) if one > 0 else 1
    samples = [timed(reps) for _ in range(rounds)]
    return Timing(statistics.median(samples), samples, reps)


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, int]:
    """``(peak, before)``: the most bytes allocated while ``fn`` ran (everything already held included) and
    what was allocated before it; (0, 0) without CUDA."""
    if not torch.cuda.is_available():
        fn()
        return 0, 0
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), before


def host_ms(fn: Callable[[], Any], calls: int = 20) -> float:
    """Host time per call (ms) of ``calls`` calls issued back to back without a sync, median of 3 bursts: below
    the GPU time the host keeps ahead; near or above it the call is host-bound or synchronizes."""
    out = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e3)
        torch.cuda.synchronize()
    return statistics.median(out)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(ref - out) / RMS(ref) in fp64 (the tests' measure; this file must not need the tests of ``CODE``)."""
    ref, out = ref.double(), out.double()
    denom = ref.pow(2).mean().sqrt().item()
    num = (ref - out).pow(2).mean().sqrt().item()
    return num / denom if denom > 0 else num


def _fla_import(what: str):
    """An fla object (``"fla.ops.kda:chunk_kda"``), or None with the reason printed: fla is optional."""
    os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla 0.6 hands no-grad chunk_kda to FlashKDA when installed
    module, name = what.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as exc:  # not installed, or failing at import: the rows say it was skipped
        print(f"fla: {what} not importable ({type(exc).__name__}: {str(exc)[:200]}); its rows are skipped", flush=True)
        return None


def fb_calls(forward: Callable[[], list], leaves: Sequence[torch.Tensor], scope: Callable = contextlib.nullcontext):
    """``{"fwd": (call, None), "fwdbwd": (call, clear)}`` for ``time_ms``: ``forward() -> [outputs]`` under no_grad,
    and forward + backward of fixed random output gradients, ``clear`` resetting the leaves' ``.grad``; each call
    inside ``scope()`` (e.g. a kernel variant in force for the forward and the backward)."""
    with torch.no_grad(), scope():
        grads = [torch.randn_like(o) for o in forward()]

    def fwd():
        with torch.no_grad(), scope():
            forward()

    def step():
        with scope():
            torch.autograd.backward(forward(), grads)
    return {"fwd": (fwd, None), "fwdbwd": (step, lambda: [setattr(t, "grad", None) for t in leaves])}


def time_passes(calls: dict[str, dict[str, tuple]], passes: int, timing: dict) -> dict[tuple[str, str], list]:
    """``{(name, kind): [Timing per pass]}`` of ``calls`` (``{name: {kind: (fn, before)}}``): ``passes`` passes, each
    in a Williams order (``round_order``: drift reaches each alike) of ``timing["rounds"] / passes`` rounds."""
    timing = dict(timing, rounds=max(1, -(-timing.get("rounds", 15) // passes)))
    got, names = collections.defaultdict(list), list(calls)
    for p in range(passes):
        for name in (names[j] for j in round_order(len(names), p)):
            for kind, (fn, before) in calls[name].items():
                got[name, kind].append(time_ms(fn, before=before, **timing))
    return got


# ---------------------------------------------------------------------------------------- registry


@dataclass
class Ctx:
    """What an entry's ``run`` gets: the shapes to run, the device, the timing knobs, and ``save`` (write what
    is measured so far: a run cut short by a time limit keeps its rows)."""

    shapes: list[str]
    cuda: bool
    rounds: int
    budget_s: float | None
    save: Callable[[dict[str, Any]], None]
    impls: tuple[str, ...] | None = None  # the rows to run, where the entry has named rows (kda, model)
    kernels: bool = False  # kda: each row also lists its time per kernel (``kernel_times``), forward and fwd+bwd
    dtype: torch.dtype = field(init=False)
    timing: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.dtype = torch.bfloat16 if self.cuda else torch.float32  # the interpreter gets bf16 wrong
        # the CPU check runs kernels in the interpreter (seconds per call): one warm-up, two single-call rounds
        self.timing = dict(cuda=True) if self.cuda else dict(cuda=False, warmup=1, rounds=2, min_round_ms=0.0)

    @property
    def dev(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class Entry:
    """A benchmark: named ``shapes`` (``default`` ones run unless ``--shapes`` says), a CPU ``smoke`` shape for
    tests, ``run(ctx) -> {"rows": [...], ...}``, the row fields that identify a row (``keys``, for ``--base``),
    and whether its rows are merged by ``keys`` into the existing file (``merge``: model, attnres), the file's
    derived part then computed from all of them by ``summarize(rows) -> {"rows", ...}``."""

    name: str
    summary: str
    shapes: dict[str, Any]
    default: tuple[str, ...]
    smoke: str
    run: Callable[[Ctx], dict[str, Any]]
    keys: tuple[str, ...]
    merge: bool = False
    rounds: int = 1
    summarize: Callable[[list[dict]], dict[str, Any]] | None = None

    def out(self, gpu: str) -> str:
        """The ledger file: ``kernels/results/<entry>_<gpu>.json`` (gpu: ``NVIDIA H200`` -> ``h200``)."""
        short = gpu.lower().replace("nvidia", "").replace("geforce", "").strip().split()[0] if gpu else "cpu"
        return f"kernels/results/{self.name}_{short.replace('-', '')}.json"


# ---------------------------------------------------------------------------------- kda, kda_long

# rows timed under ``triton_chunk.launch_overrides``: the op's non-default VARIANTS beside its default in one run;
# all_rerun: the backward reruns the prep and the chunk states, the gate's backward in the prep (before session 44)
KDA_VARIANTS = {f"moelab_bounded_{k}_{v}": {k: v} for k, v in (s.split("=") for s in (
    "chains=serial", "forward=infer", "out=split", "prep=rerun", "states=rerun", "gate_bwd=prep"))}
KDA_VARIANTS |= {"moelab_bounded_all_rerun": {"prep": "rerun", "states": "rerun", "gate_bwd": "prep"}}
KDA_IMPLS = ("moelab_bounded", *KDA_VARIANTS, "moelab_general", "fla_safe_gate", "fla_softplus", "sdpa_flash")
# launch candidates (``LAUNCH`` entries) timed where --impls names them: dh at 1 stage, or 16 / 32 wide on 2 warps
# (more SMs busy at B1 H16), dqkg at 1 or 3 stages; sterm 32 wide or on 8 warps (no spill), wy and wu at 2 stages
KDA_LAUNCH_ROWS = {f"moelab_bounded_{name}": dict(launch={kernel: cfg}) for name, kernel, cfg in (
    ("dh_stages1", "dh", (64, 8, 1)), ("dh_16", "dh", (16, 2, 2)), ("dh_32", "dh", (32, 2, 2)),
    ("dqkg_stages1", "dqkg", (32, 1, 1)), ("dqkg_stages3", "dqkg", (32, 1, 3)), ("sterm_32", "sterm", (32, 4, 1)),
    ("sterm_warps8", "sterm", (64, 8, 1)), ("wy_stages2", "wy", (64, 4, 2)), ("wu_stages2", "wu", (32, 4, 2)))}
KDA_BWD_OTHER = dict(das="fp32", du="fp32", dkb="fp32", dg="dqkg")  # the backward's non-default VARIANTS: each alone,
KDA_LAUNCH_ROWS |= {f"moelab_bounded_{k}_{v}": {k: v} for k, v in KDA_BWD_OTHER.items()} | {  # the scratch in fp32
    "moelab_bounded_scratch_fp32": dict(das="fp32", du="fp32", dkb="fp32")}  # (bf16 for bf16 inputs since session 49)
KDA_ROWS = (*KDA_IMPLS, *KDA_LAUNCH_ROWS)  # every row --impls takes
KDA_TARGET = 1.5  # issue 37: our own training op's fwd+bwd speed-up over fla (safe gate)
KDA_PAIRED = {"fla_safe_gate": "vs_fla", "moelab_bounded": "vs_default"}  # base row -> the field of paired ratios


def _shape_name(B: int, T: int, H: int | None = None) -> str:
    return f"B{B}-T{T}" + (f"-H{H}" if H is not None else "")


KDA_SHAPES = {_shape_name(B, T): (B, T, 16, 128) for B, T in ((8, 4096), (1, 32768), (2, 65536))}
KDA_SHAPES["smoke"] = (1, 128, 2, 32)
KDA_LONG_SHAPES = {_shape_name(1, T): (1, T, 16, 128) for T in (131072, 262144, 524288)}
KDA_LONG_SHAPES["smoke"] = (1, 256, 2, 32)


def _kda_leaves(B: int, T: int, H: int, D: int, ctx: Ctx) -> dict[str, torch.Tensor]:
    """One input set of a shape, shared by every impl timed there: q, k, v, the gate input x ``[B, T, H, D]``, beta
    ``[B, T, H]`` in (0, 1), A_log ``[H]`` (as fla's benchmark), dt_bias ``[H * D]``."""
    dev, dt = ctx.dev, ctx.dtype
    t = {name: torch.randn(B, T, H, D, device=dev, dtype=dt) for name in ("q", "k", "v", "x")}
    t.update(beta=torch.randn(B, T, H, device=dev, dtype=dt).sigmoid(), dt_bias=torch.zeros(H * D, device=dev),
             A_log=torch.log(torch.empty(H, device=dev).uniform_(1, 16)))
    return {name: x.requires_grad_() for name, x in t.items()}


def _kda_case(impl: str, t: dict[str, torch.Tensor], ctx: Ctx, fla_chunk_kda) -> tuple[list, Callable]:
    """Leaves and a forward returning the output ``[B, T, H, D]`` (SDPA: ``[B, H, T, D]``) of one impl on the inputs
    ``t`` (:func:`_kda_leaves`)."""
    from moelab.ops.kda import triton_chunk

    q, k, v, x, beta, A_log, dt_bias = (t[n] for n in ("q", "k", "v", "x", "beta", "A_log", "dt_bias"))
    if impl == "sdpa_flash":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qs, ks, vs = (a.detach().transpose(1, 2).contiguous().requires_grad_() for a in (q, k, v))

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        return [qs, ks, vs], sdpa
    leaves = [q, k, v, x, beta, A_log, dt_bias]
    if impl.startswith("moelab"):
        mode = impl.split("_")[1]
        return leaves, lambda: triton_chunk.chunk_kda(q, k, v, x, beta, mode=mode, g_min=G_MIN, gate="bounded",
                                                      A_log=A_log, dt_bias=dt_bias, l2norm_qk=True)[0]
    kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True)
    if impl == "fla_safe_gate":
        kw.update(safe_gate=True, lower_bound=G_MIN)
    return leaves, lambda: fla_chunk_kda(q, k, v, x, beta, **kw)[0]


def _kda_rows(ctx: Ctx, table: dict[str, tuple], impls: tuple[str, ...]) -> dict[str, Any]:
    """The rows of every shape: all impls on one input set, timed in ``ctx.rounds`` passes (``time_passes``); a row's
    ms: the median over all its rounds, ``*_ms_passes`` its pass medians; each moelab row's fwd+bwd speed-up over
    each base of ``KDA_PAIRED`` paired by pass (``compare_rounds``; against fla with issue 37's target)."""
    from moelab.ops.kda.triton_chunk import launch_overrides

    fla_chunk_kda = _fla_import("fla.ops.kda:chunk_kda") if ctx.cuda else None
    passes, rows = ctx.rounds, []
    for name in ctx.shapes:
        B, T, H, D = table[name]
        shape_rows = {i: dict(impl=i, B=B, T=T, H=H, D=D, fwd_ms=None, fwdbwd_ms=None, peak_mem_gb=None) for i in impls
                      if not ((i.startswith("fla") and fla_chunk_kda is None) or (not ctx.cuda and i == "sdpa_flash"))}
        calls, train, leaves = {}, {}, _kda_leaves(B, T, H, D, ctx)  # train: the forward with autograd, its scope
        for impl in shape_rows:  # every impl built and run once (compiles, autotunes) before any is timed
            try:
                held, fn = _kda_case(impl, leaves, ctx, fla_chunk_kda)
                scope = functools.partial(launch_overrides, **(KDA_VARIANTS | KDA_LAUNCH_ROWS).get(impl, {}))
                calls[impl], train[impl] = fb_calls(lambda fn=fn: [fn()], held, scope), (fn, scope)
                for call in calls[impl]["fwdbwd"]:
                    call()
                _progress(f"{name} {impl}: compiled and run once")
            except Exception as exc:  # one failing baseline must not hide the rest: recorded in its row
                calls.pop(impl, None)
                oom = isinstance(exc, torch.cuda.OutOfMemoryError)
                shape_rows[impl]["error"] = "OOM" if oom else f"{type(exc).__name__}: {str(exc)[:300]}"
                ctx.free()
        got = time_passes(calls, passes, ctx.timing)
        for impl in calls:
            row, (step, clear), (fn, scope) = shape_rows[impl], calls[impl]["fwdbwd"], train[impl]
            for kind in ("fwd", "fwdbwd"):
                row[f"{kind}_ms"] = statistics.median(x for t in got[impl, kind] for x in t.rounds_ms)
                row[f"{kind}_ms_passes"] = [t.ms for t in got[impl, kind]]
            if ctx.kernels:  # the training forward (autograd on, no backward) and the whole step, per kernel
                from moelab.train.perf import kernel_times
                with scope():
                    row["kernels_fwd"] = kernel_times(fn, cuda=ctx.cuda)
                row["kernels_fwdbwd"] = kernel_times(step, before=clear, cuda=ctx.cuda)
            clear()
            row["peak_mem_gb"] = peak_bytes(step)[0] / 1e9 if ctx.cuda else None
            clear()
        for base, key in ((b, k) for b, k in KDA_PAIRED.items() if b in calls):
            for impl in (i for i in calls if i != base and i.startswith("moelab")):
                shape_rows[impl][f"fwdbwd_{key}"] = compare_rounds(
                    shape_rows[base]["fwdbwd_ms_passes"], shape_rows[impl]["fwdbwd_ms_passes"],
                    KDA_TARGET if base == "fla_safe_gate" else None)
        del calls, train, leaves
        rows.extend(shape_rows.values())
        ctx.save({"rows": rows})
        for row in shape_rows.values():
            _print_row(row, ("fwd_ms", "fwdbwd_ms", "peak_mem_gb"))
            for key, x in ((k, row[k]) for k in ("fwdbwd_vs_fla", "fwdbwd_vs_default") if k in row):
                print(f"    {key}: {x['median']:.3f}x [{x['min']:.3f}, {x['max']:.3f}] {x.get('verdict', '')}")
            for k in (row.get("kernels_fwdbwd") or [])[:10]:
                print(f"    {k['ms']:8.3f} ms {k['calls']:5.1f}x  {k['name'][:70]}", flush=True)
        ctx.free()
    return {"rows": rows, "passes": passes, "note": "both KDA sides: L2 norm of q, k and the bounded gate (with "
            "dt_bias) inside the op; every impl of a shape on one input set, timed in passes (Williams order); "
            "fwdbwd_vs_fla / _vs_default: base ms / row ms per pass, with issue 37's verdict against fla"}


def run_kda(ctx: Ctx) -> dict[str, Any]:
    impls = KDA_IMPLS if ctx.cuda else ("moelab_bounded", *KDA_VARIANTS, "moelab_general")
    return _kda_rows(ctx, KDA_SHAPES, ctx.impls or impls)


def run_kda_long(ctx: Ctx) -> dict[str, Any]:
    return _kda_rows(ctx, KDA_LONG_SHAPES, ("moelab_bounded", "moelab_general"))


# ------------------------------------------------------------------------------------------ kda_infer

INFER_SHAPES = {_shape_name(B, T, H): (B, T, H, 128) for B, T, H in ((1, 8192, 64), (1, 8192, 96), (8, 4096, 16),
                                                                     (1, 32768, 16))}
INFER_SHAPES["smoke"] = (1, 64, 2, 32)
INFER_DOCS = 6  # documents per row in the packed layout


def doc_offsets(B: int, T: int, n_docs: int = INFER_DOCS, seed: int = 0) -> list[int]:
    """``cu_seqlens`` of B rows of T tokens, each cut into ``n_docs`` documents of uneven (seeded) length, all
    packed into one row of B*T tokens."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for _ in range(B):
        w = torch.rand(n_docs, generator=gen) + 0.15
        lens = (w / w.sum() * T).floor().long()
        lens[-1] += T - lens.sum()
        for n in lens.tolist():
            cu.append(cu[-1] + n)
    return cu


def _infer_fns(B: int, T: int, H: int, D: int, packed: bool, ctx: Ctx, fla_chunk_kda) -> dict[str, Callable]:
    """No-grad forwards returning ``(o [rows, cols, H, D], final state [N, H, D, D])`` per impl, on one input set
    (bf16 on the GPU; beta as logits, the sigmoid inside every op; packed: one row of B*T tokens)."""
    from moelab.ops.kda import triton_chunk

    infer = _infer_module()
    rows, cols = (1, B * T) if packed else (B, T)
    q, k, v, z = (torch.randn(rows, cols, H, D, device=ctx.dev, dtype=ctx.dtype) for _ in range(4))
    beta = torch.randn(rows, cols, H, device=ctx.dev, dtype=ctx.dtype)
    A_log = torch.log(torch.empty(H, device=ctx.dev).uniform_(1, 16))
    dt_bias = torch.zeros(H * D, device=ctx.dev)
    cu = torch.tensor(doc_offsets(B, T), device=ctx.dev, dtype=torch.int64) if packed else None
    fns: dict[str, Callable] = {
        "moelab_infer": lambda: infer.kda_infer(
            q, k, v, z, beta, gate="bounded", A_log=A_log, dt_bias=dt_bias, g_min=G_MIN, l2norm_qk=True,
            beta_sigmoid=True, output_final_state=True, cu_seqlens=cu, validate=False)}
    if fla_chunk_kda is not None:
        # fla versions without the in-kernel beta sigmoid get beta after its sigmoid (outside the timed call)
        in_kernel = "use_beta_sigmoid_in_kernel" in inspect.signature(fla_chunk_kda).parameters
        fla_beta, fla_kw = (beta, dict(use_beta_sigmoid_in_kernel=True)) if in_kernel else (beta.sigmoid(), {})

        def fla():
            with torch.no_grad():
                return fla_chunk_kda(q, k, v, z, fla_beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                     use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=G_MIN,
                                     output_final_state=True, cu_seqlens=cu, **fla_kw)
        fns["fla_chunk_kda"] = fla
    if not packed:  # the training op takes no cu_seqlens, and beta in (0, 1): its sigmoid is outside the call
        b = beta.sigmoid()

        def train():
            with torch.no_grad():
                return triton_chunk.chunk_kda(q, k, v, z, b, mode="bounded", g_min=G_MIN, gate="bounded",
                                              A_log=A_log, dt_bias=dt_bias, l2norm_qk=True, output_final_state=True)
        fns["moelab_train_fwd"] = train
    fns["_plan"] = lambda: _infer_path(infer, (q, k, v, z, beta), dict(
        gate="bounded", A_log=A_log, dt_bias=dt_bias, g_min=G_MIN, l2norm_qk=True, beta_sigmoid=True,
        output_final_state=True, cu_seqlens=cu, validate=False))
    return fns


def _infer_module():
    """The module with ``kda_infer`` and ``InferPlan``: ``infer_plan`` (host planning beside the kernels), or
    ``triton_infer`` in trees before that split (a ``--base`` run)."""
    try:
        from moelab.ops.kda import infer_plan
    except ImportError:
        from moelab.ops.kda import triton_infer as infer_plan
    return infer_plan


def _infer_path(module, tensors: tuple, kw: dict) -> dict | None:
    """Which recurrence the op runs (``InferPlan.path()``), where this tree's op describes it."""
    plan = getattr(module, "InferPlan", None)
    try:
        return plan(*tensors, **kw).path() if plan is not None else None
    except Exception as exc:  # the description is a diagnostic: never lose a timing to it
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def run_kda_infer(ctx: Ctx) -> dict[str, Any]:
    fla_chunk_kda = _fla_import("fla.ops.kda:chunk_kda") if ctx.cuda else None
    passes = ctx.rounds
    rows: list[dict] = []
    for name in ctx.shapes:
        B, T, H, D = INFER_SHAPES[name]
        for packed in (False, True):
            layout = "packed" if packed else "fixed"
            shape_rows: dict[str, dict] = {}
            try:
                fns = _infer_fns(B, T, H, D, packed, ctx, fla_chunk_kda)
                path = fns.pop("_plan")()
                outs = {impl: fn() for impl, fn in fns.items()}
                # the rows of a shape and layout timed in turn, `passes` times: they share whatever drifts
                got = time_passes({i: {"fwd": (fn, None)} for i, fn in fns.items()}, passes,
                                  dict(ctx.timing, rounds=passes * ctx.timing.get("rounds", 15)))
                for impl in fns:
                    row = shape_rows[impl] = dict(impl=impl, layout=layout, B=B, T=T, H=H, D=D,
                                                  fwd_ms_rounds=[t.ms for t in got[impl, "fwd"]])
                    row["fwd_ms"] = statistics.median(row["fwd_ms_rounds"])
                    if packed:
                        row["cu_seqlens"] = doc_offsets(B, T)
                    if ctx.cuda:
                        row["host_ms"] = host_ms(fns[impl])
                if path is not None:
                    shape_rows["moelab_infer"]["path"] = path
                if "fla_chunk_kda" in outs:
                    fo, fS = outs["fla_chunk_kda"]
                    o, S = outs["moelab_infer"]
                    shape_rows["moelab_infer"]["diff_vs_fla"] = dict(o=rel_err(fo.float(), o.float()),
                                                                     final_state=rel_err(fS.float(), S.float()))
                del fns, outs
            except Exception as exc:  # OOM or a failing side: recorded, and the next shape still runs
                error = "OOM" if isinstance(exc, torch.cuda.OutOfMemoryError) else f"{type(exc).__name__}: {exc}"
                shape_rows = {"moelab_infer": dict(impl="moelab_infer", layout=layout, B=B, T=T, H=H, D=D,
                                                   fwd_ms=None, error=error[:300])}
            rows.extend(shape_rows.values())
            ctx.save({"rows": rows})
            for row in shape_rows.values():
                _print_row(row, ("fwd_ms", "host_ms"), ("layout",))
            ctx.free()
    return {"rows": rows, "docs_per_row": INFER_DOCS, "g_min": G_MIN,
            "note": "forward only, no grad, output and final state from every impl; gate, L2 norm of q, k, beta "
                    "sigmoid and the bound inside the ops; fwd_ms: the median of fwd_ms_rounds (the rows of a "
                    "shape and layout timed in turn); host_ms: host time per call issued back to back; "
                    "diff_vs_fla: relative RMS difference of moelab's o and final state from fla's"}


# -------------------------------------------------------------------------------------------- attnres

# Issue 37's grid (N{N}_D{D}_L{L}; groups grid_D{D}, grid) beside L4 / L9 / L17 (N 32768, D 2048, plain PyTorch too)
ATTNRES_GRID = {f"N{N}_D{D}_L{L}": (L, N, D) for D in (512, 1024, 2048, 4096, 7168) for N in (8192, 32768)
                for L in (3, 9, 17, 33)}
ATTNRES_SHAPES: dict[str, Any] = {f"L{L}": (L, 32768, 2048) for L in (4, 9, 17)} | ATTNRES_GRID
ATTNRES_SHAPES |= {f"grid_D{D}": tuple(s for s in ATTNRES_GRID if f"_D{D}_" in s)
                   for D in (512, 1024, 2048, 4096, 7168)} | {"grid": tuple(ATTNRES_GRID)}
ATTNRES_SHAPES |= {"smoke": (3, 37, 72), "smoke_grid": (4, 45, 72)}
ATTNRES_TOL = {"h": 5e-3, "grads": 1e-2}
ATTNRES_REF_CHUNK = 2 ** 27  # source elements per chunk of the fp32 reference (~4 GB of its fp32 and fp64 copies)
FLA_ATTNRES = ("fla_fused_attnres", "fla_fused_attnres_stacked")
ATTNRES_ROWS = ("moelab_fused", "torch_plain", *FLA_ATTNRES)  # every named row --impls takes
# a launch candidate row, timed where --impls names it: CANDIDATE + a LaunchConfig.parse spec, e.g.
# moelab_fused@r2w16g2, moelab_fused@r1w8g4-b1w16g2s2 or moelab_fused@r1w4g1c512s3-b1w4g1c256s2
CANDIDATE = "moelab_fused@"


def attnres_launch(name: str) -> Any:
    """The ``LaunchConfig`` a ``moelab_fused@<spec>`` row name spells (ValueError naming the name otherwise)."""
    from moelab.ops.attnres import LaunchConfig

    if not name.startswith(CANDIDATE):
        raise ValueError(f"{name!r} is not an AttnRes launch candidate: expected {CANDIDATE}<spec>")
    return LaunchConfig.parse(name.removeprefix(CANDIDATE))


def _attnres_inputs(L: int, N: int, D: int, dev: str, seed: int) -> tuple:
    """L bf16 sources ``[1, N, D]`` (made on ``dev``), an fp32 query and norm weight ``[D]``, an output gradient
    ``[1, N, D]`` (bf16 values in fp32: the impls and the reference see the same)."""
    gen = torch.Generator(dev).manual_seed(seed)
    srcs = [(torch.randn(1, N, D, generator=gen, device=dev) * (0.5 + 0.25 * i)).bfloat16() for i in range(L)]
    query = torch.randn(D, generator=gen, device=dev) * 3 / D ** 0.5
    weight = torch.rand(D, generator=gen, device=dev) + 0.5
    return srcs, query, weight, torch.randn(1, N, D, generator=gen, device=dev).bfloat16().float()


def _attnres_impls(fla_fn, plain: bool, names: Sequence[str] | None = None) -> dict[str, Callable]:
    """name -> prepare(srcs, q, w) -> (leaves, forward() -> h, grads() -> [*source grads, dq, dw]); ``names``: only
    these rows, launch candidates (``CANDIDATE``) included."""
    from moelab.model.attnres import DepthAttention
    from moelab.ops.attnres import depth_attention

    def leaves_of(srcs, q, w):
        return [x.detach().clone().requires_grad_() for x in [*srcs, q, w]]

    def moelab(srcs, q, w, config=None):  # h alone, as fla's op returns it and a model reads (no depth weights)
        lv = leaves_of(srcs, q, w)
        return (lv, lambda: depth_attention(lv[:-2], lv[-2], lv[-1], backend="triton", config=config,
                                            weights=False)[0], lambda: [x.grad for x in lv])

    def torch_plain(srcs, q, w):
        att = DepthAttention(q.numel(), backend="torch").to(q.device)
        with torch.no_grad():
            att.query.copy_(q)
            att.key_norm.weight.copy_(w)
        lv = [x.detach().clone().requires_grad_() for x in srcs] + [att.query, att.key_norm.weight]
        return lv, lambda: att(lv[:-2])[0], lambda: [x.grad for x in lv]

    def fla(srcs, q, w):
        lv = leaves_of(srcs, q, w)
        return lv, lambda: fla_fn(lv[-2], lv[:-2], lv[-1], rms_eps=1e-6), lambda: [x.grad for x in lv]

    def fla_stacked(srcs, q, w):
        stacked = torch.stack(srcs).requires_grad_()  # the stack is not timed
        lv = [stacked, q.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()]
        return (lv, lambda: fla_fn(lv[1], lv[0], lv[2], rms_eps=1e-6),
                lambda: [*stacked.grad.unbind(0), lv[1].grad, lv[2].grad])

    impls = {"moelab_fused": moelab} | ({"torch_plain": torch_plain} if plain else {})
    impls |= dict(zip(FLA_ATTNRES, (fla, fla_stacked))) if fla_fn is not None else {}
    if names is None:
        return impls
    cands = {n: functools.partial(moelab, config=attnres_launch(n)) for n in names if n.startswith(CANDIDATE)}
    return {n: f for n, f in impls.items() if n in names} | cands


def _attnres_errors(srcs, q, w, dh, outs: dict[str, tuple]) -> dict[str, dict[str, float]]:
    """Each impl's ``(h, grads)`` against the fp32 reference (``depth_attention_torch``) over chunks of
    ``ATTNRES_REF_CHUNK`` source elements: RMS errors of h and of each source's gradient (``dsrc_err``: the worst
    source) summed over the chunks, dq and dw from the reference's gradients summed over them."""
    from moelab.ops.attnres import depth_attention_torch

    L, N, D = len(srcs), srcs[0].shape[1], srcs[0].shape[2]
    qr, wr = (x.detach().float().requires_grad_() for x in (q, w))
    sums = {name: torch.zeros(2, L + 1, dtype=torch.float64, device=q.device) for name in outs}  # [err, ref] sums
    step = max(1, ATTNRES_REF_CHUNK // (L * D))
    for a in range(0, N, step):
        vr = [x[:, a:a + step].float().requires_grad_() for x in srcs]
        h, _ = depth_attention_torch(vr, qr, wr, 1e-6, torch.float32)
        h.backward(dh[:, a:a + step])
        ref = torch.stack([h.detach(), *(v.grad for v in vr)]).double()  # [L + 1, 1, n, D]
        for name, (oh, og) in outs.items():
            got = torch.stack([oh[:, a:a + step], *(g[:, a:a + step] for g in og[:-2])]).double()
            sums[name] += torch.stack([(ref - got).pow(2).sum((1, 2, 3)), ref.pow(2).sum((1, 2, 3))])
        del vr, h, ref
    out = {}
    for name, (_, og) in outs.items():
        e = (sums[name][0] / sums[name][1]).sqrt().tolist()
        r = dict(h_err=e[0], dsrc_err=max(e[1:]), dquery_err=rel_err(qr.grad, og[-2].float()),
                 dnorm_weight_err=rel_err(wr.grad, og[-1].float()))
        out[name] = r | {"ok": r["h_err"] <= ATTNRES_TOL["h"] and max(list(r.values())[1:]) <= ATTNRES_TOL["grads"]}
    return out


ATTNRES_PASSES = 3  # timing passes over the impls of a point that are held together (their rounds interleave)
_free_bytes = lambda ctx: torch.cuda.mem_get_info()[0] if ctx.cuda else math.inf  # free GPU memory (tests patch it)


def _attnres_point(shape: str, impls: dict[str, Callable], ctx: Ctx) -> list[dict[str, Any]]:
    """The rows of one shape: every impl run once, checked against a chunked fp32 reference, timed (fwd+bwd, fwd
    under no_grad), its peak memory taken. Impls that fit in free memory together are timed in ``ATTNRES_PASSES``
    passes over them (host drift at the host-bound small points reaches each alike; a row's time: the median over
    all its rounds), else (D 7168 L 33 N 32768: 15.5 GB per copy) each is run, checked, timed, freed in turn."""
    L, N, D = ATTNRES_SHAPES[shape]
    srcs, q, w, dh = _attnres_inputs(L, N, D, ctx.dev, seed=L)
    together = L * N * D * srcs[0].element_size() * (2 * len(impls) + 2) < 0.8 * _free_bytes(ctx)
    rows: dict[str, dict[str, Any]] = {}
    for names in ([list(impls)] if together else [[n] for n in impls]):
        outs, runs = {}, {}
        for name in names:
            rows[name] = dict(impl=name, shape=shape, L=L, N=N, D=D)
            try:
                leaves, forward, grads = impls[name](srcs, q, w)
                with torch.autocast(ctx.dev, dtype=torch.bfloat16):
                    h = forward()
                h.backward(dh.to(h.dtype))
                outs[name], runs[name] = (h.detach(), grads()), (leaves, forward)
                rows[name]["out_dtype"] = str(h.dtype).removeprefix("torch.")
            except Exception as exc:  # an fla failure (compile, memory) is recorded, the others still run
                rows[name]["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        for name, err in _attnres_errors(srcs, q, w, dh, outs).items():
            rows[name].update(err)
        del outs
        for leaves, _ in runs.values():  # every impl's gradients freed before any is timed
            for t in leaves:
                t.grad = None
        _attnres_time(runs, rows, ATTNRES_PASSES if len(runs) > 1 else 1, ctx)
        del runs
        ctx.free()
    del srcs
    ctx.free()
    return list(rows.values())


def _attnres_time(runs: dict[str, tuple], rows: dict[str, dict[str, Any]], passes: int, ctx: Ctx) -> None:
    """Time the impls of ``runs`` (fwd+bwd, fwd) in ``passes`` passes over them, then take each one's peak memory."""
    def amp(forward: Callable[[], torch.Tensor]) -> list[torch.Tensor]:  # the forward under autocast, not the backward
        with torch.autocast(ctx.dev, dtype=torch.bfloat16):
            return [forward()]
    calls = {name: fb_calls(functools.partial(amp, forward), leaves) for name, (leaves, forward) in runs.items()}
    got = time_passes(calls, passes, ctx.timing)
    for name, kinds in calls.items():
        row, (step, clear) = rows[name], kinds["fwdbwd"]
        row.update({f"{kind}_ms": statistics.median(x for t in got[name, kind] for x in t.rounds_ms) for kind in kinds})
        clear()
        peak, before = peak_bytes(step)
        row.update(peak_mem_gb=peak / 1e9 if ctx.cuda else None,
                   extra_mem_gb=(peak - before) / 1e9 if ctx.cuda else None)
        clear()
        _print_row(row, ("fwd_ms", "fwdbwd_ms", "peak_mem_gb", "h_err", "dsrc_err"), ("shape",))


def attnres_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The file's derived part from all its rows (rows sorted by shape as ``ATTNRES_SHAPES`` lists them):
    ``summary`` per L shape (others' time over moelab's), ``grid`` per grid point (fla's best: the faster of its
    two rows at each of fwd, fwd+bwd) with the minimum over the points measured and whether issue 37's target
    (>= 1.0x at all 40) is met; ``all_ok``: every moelab row within the tolerances."""
    order = {s: i for i, s in enumerate(ATTNRES_SHAPES)}
    rows = sorted(rows, key=lambda r: order.get(r.get("shape"), len(order)))
    by = {(r.get("shape"), r["impl"]): r for r in rows if r.get("fwdbwd_ms")}
    lines = []
    for shape in dict.fromkeys(r.get("shape") for r in rows):
        ours = by.get((shape, "moelab_fused"))
        if ours is None:
            continue
        line = {k: ours.get(k) for k in ("shape", "L", "N", "D")}
        for other in ("torch_plain", "fla_best"):
            them = [by[(shape, n)] for n in ((other,) if other == "torch_plain" else FLA_ATTNRES) if (shape, n) in by]
            for m in ("fwdbwd", "fwd") if them else ():
                line[f"{m}_speedup_vs_{other}"] = min(r[f"{m}_ms"] for r in them) / ours[f"{m}_ms"]
        lines.append(line)
    grid = [x for x in lines if x["shape"] in ATTNRES_GRID and "fwd_speedup_vs_fla_best" in x]
    mins = {f"min_{m}_speedup_vs_fla_best": min((x[f"{m}_speedup_vs_fla_best"] for x in grid), default=None)
            for m in ("fwd", "fwdbwd")}
    return {"rows": rows, "summary": [x for x in lines if x["shape"] not in ATTNRES_GRID],
            "grid": {"points": grid, "measured": len(grid), "of": len(ATTNRES_GRID), **mins,
                     "met": len(grid) == len(ATTNRES_GRID) and all(v >= 1.0 for v in mins.values())},
            "tolerances": ATTNRES_TOL, "all_ok": all(r.get("ok", False) for r in rows if r["impl"] == "moelab_fused"),
            "note": "bf16 sources under bf16 autocast, fp32 query and norm weight; errors against the fp32 reference "
                    "(depth_attention_torch, over chunks of tokens); speedups: the other's time over moelab's; fla "
                    "autotunes once per (D, next_pow2(L) >= 8) in a process, at the first N it meets; rows carry "
                    "their own commit and are merged into the file by (impl, shape)"}


# fla autotunes 24 + 24 launches per D and bucket of L, compiled serially (the 40-point grid: most of a 10-minute call):
# a process per (D, L) puts them in the Triton cache first, calling it at 64 tokens, fwd + bwd, list and stacked
_FLA_WARM = ("import sys, torch; from fla.ops.attnres import fused_attnres as f; D, L = map(int, sys.argv[1:3]); "
             "s = [torch.randn(1, 64, D, device='cuda').bfloat16().requires_grad_() for _ in range(L)]; "
             "a = lambda: torch.randn(D, device='cuda', requires_grad=True)\nwith torch.autocast('cuda', "
             "dtype=torch.bfloat16):\n f(a(), s, a(), rms_eps=1e-6).float().sum().backward()\n"
             " f(a(), torch.stack(s).detach().requires_grad_(), a(), rms_eps=1e-6).float().sum().backward()")


def warm_fla(names: Sequence[str]) -> list[tuple[int, int]]:
    """Runs ``_FLA_WARM`` for each ``(D, L)`` of the attnres points ``names`` in a pool of processes; returns them."""
    pts, t0 = sorted({(ATTNRES_SHAPES[n][2], ATTNRES_SHAPES[n][0]) for n in names}), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers := min(16, os.cpu_count() or 1, len(pts))) as pool:
        rcs = list(pool.map(lambda p: subprocess.run(["timeout", "900", sys.executable, "-c", _FLA_WARM, *map(str, p)],
                                                     capture_output=True).returncode, pts))  # a hang: status 124
    print(f"fla: compiled for {len(pts)} (D, L) points in {workers} processes, {time.perf_counter() - t0:.0f} s"
          + (f" ({sum(map(bool, rcs))} failed: those compile when timed)" if any(rcs) else ""), flush=True)
    return pts


def run_attnres(ctx: Ctx) -> dict[str, Any]:
    fla_fn = _fla_import("fla.ops.attnres:fused_attnres") if ctx.cuda else None
    names = [s for n in ctx.shapes for s in (ATTNRES_SHAPES[n] if isinstance(ATTNRES_SHAPES[n][0], str) else (n,))]
    if fla_fn is not None and (ctx.impls is None or any(n.startswith("fla") for n in ctx.impls)) and len(names) > 1:
        warm_fla(names)
    rows: list[dict] = []
    for shape in dict.fromkeys(names):
        rows += _attnres_point(shape, _attnres_impls(fla_fn, shape.startswith("L") or shape == "smoke", ctx.impls),
                               ctx)
        ctx.save({"rows": rows})
    return {"rows": rows}


# ------------------------------------------------------------------------------------------------ moe

CONV_SHAPES = {"k3-mini": (8, 4096, 512), "B1-T32768-C1536": (1, 32768, 1536), "smoke": (2, 40, 24)}


def run_conv(ctx: Ctx) -> dict[str, Any]:
    """ShortConv launches and backward kernels beside F.conv1d: ``moelab.ops.short_conv.launch_rows``."""
    from moelab.ops.short_conv import launch_rows
    dev, timer = "cuda" if ctx.cuda else "cpu", functools.partial(time_ms, **ctx.timing)
    return {"rows": [r for n in ctx.shapes
                     for r in launch_rows(*CONV_SHAPES[n], dev, ctx.dtype, timer, rel_err, ctx.cuda, {"shape": n})]}


MOE_SHAPES = {"N32768": dict(tokens=32768, d_model=1024, experts=64, top_k=8, latent=512, expert_dim=512,
                             num_shared=2),
              "smoke": dict(tokens=512, d_model=64, experts=8, top_k=2, latent=32, expert_dim=32, num_shared=2)}
MOE_TARGET = 0.70  # moelab_moe TFLOP/s over dense_equal_flops'


def _dense_chain(links: list[tuple], dev: str, dtype: torch.dtype, activation: str | None, act_args: tuple):
    """Leaves, forward and forward FLOPs of independent dense chains: ``(M, K, N)`` one matmul, ``(M, K, 2F, F,
    N)`` matmul -> GLU (``activation``; None: a second independent ``[M, F] x [F, N]`` matmul) -> matmul."""
    from moelab.ops.glu import glu

    leaves, chains, flops = [], [], 0
    for link in links:
        m, k, n = link[:3]
        a = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
        w = (torch.randn(k, n, device=dev, dtype=dtype) / k ** 0.5).requires_grad_()
        leaves += [a, w]
        flops += 2 * m * k * n
        if len(link) == 3:
            chains.append((a, w, None, None))
            continue
        f, n2 = link[3], link[4]
        w2 = (torch.randn(f, n2, device=dev, dtype=dtype) / f ** 0.5).requires_grad_()
        mid = None if activation else torch.randn(m, f, device=dev, dtype=dtype, requires_grad=True)
        leaves += [w2] + ([mid] if mid is not None else [])
        chains.append((a, w, w2, mid))
        flops += 2 * m * f * n2

    def forward():
        outs = []
        for a, w, w2, mid in chains:
            h = a @ w
            if w2 is None:
                outs.append(h)
            elif mid is None:
                outs.append(glu(h, activation, *act_args) @ w2)
            else:
                outs += [h, mid @ w2]
        return outs

    return leaves, forward, flops


def _fb_times(forward: Callable[[], list[torch.Tensor]], leaves: list[torch.Tensor],
              timing: dict) -> tuple[float, float]:
    """(fwd+bwd ms, fwd ms) of ``forward() -> outputs`` (``fb_calls``)."""
    calls = fb_calls(forward, leaves)
    return tuple(time_ms(fn, before=before, **timing).ms for fn, before in (calls["fwdbwd"], calls["fwd"]))


def run_moe(ctx: Ctx) -> dict[str, Any]:
    from moelab.model.config import MoEConfig
    from moelab.model.moe import LatentMoE
    from moelab.ops.moe import experts_grouped, make_plan

    if len(ctx.shapes) != 1:
        raise SystemExit(f"entry moe runs one shape at a time, got --shapes {' '.join(ctx.shapes)}")
    s = MOE_SHAPES[ctx.shapes[0]]
    dev, dtype, activation = ctx.dev, ctx.dtype, "situ_glu"
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=s["experts"], top_k=s["top_k"], num_shared=s["num_shared"], latent_dim=s["latent"],
                    expert_dim=s["expert_dim"], activation=activation, dispatch="grouped" if ctx.cuda else "auto")
    moe = LatentMoE(s["d_model"], cfg, norm_eps=1e-6).to(dev, dtype)
    n, d, f, k, e = s["tokens"], s["d_model"], s["expert_dim"], s["top_k"], s["experts"]
    r = moe.routed_dim
    act_args = (cfg.situ_beta1, cfg.situ_beta2, cfg.backend)
    x = torch.randn(1, n, d, device=dev, dtype=dtype, requires_grad=True)
    flops = moe.matmul_flops(n)
    with torch.no_grad():
        stats = moe(x)[1]
    load = stats.tokens_per_expert.float()
    grouped = moe.use_grouped(torch.device(dev), dtype)
    common = dict(tokens=n, experts=e, top_k=k, d_model=d, latent_dim=s["latent"], expert_dim=f,
                  num_shared=s["num_shared"], shared_dim=moe.shared_width if s["num_shared"] else 0)
    rows: list[dict] = []

    def add(impl: str, fl: int, times: tuple[float, float], **kw: Any) -> None:
        ms_fb, ms_f = times
        rows.append(dict(impl=impl, **common, gflop_fwd=fl / 1e9, fwdbwd_ms=ms_fb, tflops=3 * fl / ms_fb / 1e9,
                         fwd_ms=ms_f, fwd_tflops=fl / ms_f / 1e9, **kw))
        ctx.save({"rows": rows})
        _print_row(rows[-1], ("fwd_ms", "fwdbwd_ms", "tflops"))

    add("moelab_moe", flops, _fb_times(lambda: [moe(x)[0]], [x, *moe.parameters()], ctx.timing),
        dispatch=cfg.dispatch, grouped_gemm=grouped, activation=activation)
    if ctx.cuda:  # as trained: fp32 parameters and input, bf16 autocast
        moe32 = LatentMoE(d, cfg, norm_eps=1e-6).to(dev)
        x32 = x.detach().float().requires_grad_()

        def forward32():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return [moe32(x32)[0]]
        add("moelab_moe_fp32_params_autocast", flops, _fb_times(forward32, [x32, *moe32.parameters()], ctx.timing),
            note="fp32 master weights under bf16 autocast (not a target row)")
    links: list[tuple] = [(n, d, e)]
    if moe.latent:
        links += [(n, d, r), (n, r, d)]
    links.append((n * k, r, 2 * f, f, r))
    if moe.shared is not None:
        sh = moe.shared.d_hidden
        links.append((n, d, 2 * sh, sh, d))
    for impl, act in (("dense_equal_flops", activation), ("dense_bare_matmuls", None)):
        leaves, forward, fl = _dense_chain(links, dev, dtype, act, act_args)
        add(impl, fl, _fb_times(forward, leaves, ctx.timing), activation=act or "none",
            gemm_links=[list(lk) for lk in links])
    plan = make_plan(stats.topk_idx, stats.tokens_per_expert)
    xs = torch.randn(n * k, r, device=dev, dtype=dtype, requires_grad=True)
    w_in, w_out = (p.detach().clone().requires_grad_() for p in (moe.w_in, moe.w_out))
    if grouped:
        add("experts_grouped_only", 2 * n * k * 3 * r * f, _fb_times(
            lambda: [experts_grouped(xs, w_in, w_out, plan.offs, activation, *act_args)], [xs, w_in, w_out],
            ctx.timing), activation=activation)
    leaves, forward, fl = _dense_chain([(n * k, r, 2 * f, f, r)], dev, dtype, activation, act_args)
    add("experts_dense_only", fl, _fb_times(forward, leaves, ctx.timing), activation=activation)
    by = {row["impl"]: row for row in rows}
    ratios = {f"ratio_vs_{name}": by["moelab_moe"]["tflops"] / row["tflops"] for name, row in by.items()
              if not name.startswith("moelab_moe")}
    if "experts_grouped_only" in by:
        ratios["experts_grouped_over_experts_dense"] = by["experts_grouped_only"]["tflops"] / by[
            "experts_dense_only"]["tflops"]
    print("; ".join(f"{key} = {val:.1%}" for key, val in ratios.items()), flush=True)
    max_vio = ((load.max() - load.mean()) / load.mean()).item()
    return {"rows": rows, "extra": {"ratios": ratios, "routing_max_vio": max_vio},
            "target": f"moelab_moe TFLOP/s >= {MOE_TARGET:.0%} of dense_equal_flops'",
            "target_met": ratios.get("ratio_vs_dense_equal_flops", 0.0) >= MOE_TARGET,
            "flops": "matmul FLOPs only; fwd+bwd = 3 x fwd"}


# ---------------------------------------------------------------------------------------------- model

ANCHOR_PEAK = 792e12  # measured bf16 8192^3 matmul on the H200: the anchor's MFU convention (all parameters)
DATASHEET_PEAK = 989e12
MFU_CONVENTION = "6 x all params x tok/s / 792e12 (anchor convention)"
# group -> (preset, [(row, config overrides)]); "fla": the fla-anchor shape beside fla's own model
MODEL_GROUPS: dict[str, tuple[str, list[tuple[str, dict]]]] = {
    "fla": ("fla-shape", [("moelab_fla_shape", {}),
                          # cuDNN's engine serves no-grad calls only (moelab.ops.kda.cudnn): training falls back
                          ("moelab_fla_shape_cudnn", {"model.kda.backend": "cudnn"}),
                          # the pre-norms and KDA's gated output norm through moelab.ops.rms_norm (fla fuses both)
                          ("moelab_fla_shape_norm_triton", {"model.norm_backend": "triton"}),
                          # the whole step as one CUDA graph (train.compile graphs: moelab.train.module.CapturedStep)
                          ("moelab_fla_shape_graphs", {"train.compile": "graphs"}),
                          # ... with the pre-norms and the loss through their Triton kernels (fla's model fuses both)
                          ("moelab_fla_shape_graphs_fast", {"train.compile": "graphs", "model.norm_backend": "triton",
                                                            "model.loss_backend": "triton"}),
                          ("fla_kda", {})]),
    "gpu-small": ("gpu-small", [
        ("moelab_gpu_small_prenorm", {"model.residual.mode": "prenorm"}),
        ("moelab_gpu_small_full_attnres", {"model.residual.mode": "full_attnres"}),
        ("moelab_gpu_small_block_attnres", {"model.residual.mode": "block_attnres", "model.residual.num_blocks": 6}),
        ("moelab_gpu_small_block_attnres_8", {"model.residual.mode": "block_attnres",
                                              "model.residual.num_blocks": 8})]),
    "k3-mini": ("k3-mini", [("moelab_k3_mini_balancer_none", {"model.moe.balancer": "none"}), ("moelab_k3_mini", {}),
                            # every RMSNorm through moelab.ops.rms_norm (model.norm_backend, "torch" by default)
                            ("moelab_k3_mini_norm_triton", {"model.norm_backend": "triton"}),
                            # MLA's fp32 gate and output projection on TF32 tensor cores (SIMT fp32 GEMMs otherwise)
                            ("moelab_k3_mini_tf32_output", {"model.mla.fp32_output_precision": "high"}),
                            # the same matmuls to fp32 accuracy from three TF32 products (moelab.model.mla.tf32x3_mm)
                            ("moelab_k3_mini_tf32x3_output", {"model.mla.fp32_output_precision": "tf32x3"})]),
}
MODEL_ROWS = [impl for _, specs in MODEL_GROUPS.values() for impl, _ in specs]  # what --impls may name
# row -> (the row it is compared with, the field holding the paired tokens/s ratios, the least ratio allowed)
MODEL_TARGETS = {
    "fla_kda": ("moelab_fla_shape", "ratio_vs_moelab", None),
    "moelab_fla_shape_cudnn": ("moelab_fla_shape", "ratio_vs_moelab", None),
    "moelab_fla_shape_norm_triton": ("moelab_fla_shape", "ratio_vs_moelab", None),
    "moelab_fla_shape_graphs": ("fla_kda", "ratio_vs_fla", 1.3),  # issue 36: >= 1.3x fla's tokens/s
    "moelab_fla_shape_graphs_fast": ("fla_kda", "ratio_vs_fla", 1.3),
    "moelab_gpu_small_full_attnres": ("moelab_gpu_small_prenorm", "ratio_vs_prenorm", 0.75),  # issue 16
    "moelab_gpu_small_block_attnres": ("moelab_gpu_small_prenorm", "ratio_vs_prenorm", 0.9),
    "moelab_gpu_small_block_attnres_8": ("moelab_gpu_small_prenorm", "ratio_vs_prenorm", 0.9),
    "moelab_k3_mini": ("moelab_k3_mini_balancer_none", "ratio_vs_balancer_none", 0.98),  # issue 15: cost <= 2%
    "moelab_k3_mini_norm_triton": ("moelab_k3_mini", "ratio_vs_torch_norm", None),
    "moelab_k3_mini_tf32_output": ("moelab_k3_mini", "ratio_vs_fp32_output", None),
    "moelab_k3_mini_tf32x3_output": ("moelab_k3_mini", "ratio_vs_fp32_output", None),
}
MEM_TARGETS = {"moelab_gpu_small_block_attnres": 1.2, "moelab_gpu_small_block_attnres_8": 1.2}  # of prenorm's
# --smoke: each group's structure at toy sizes (gpu-small's 12 layers kept: every residual mode reads as on the GPU)
SMOKE_MODEL = {
    "model.vocab_size": 512, "data.vocab_size": 512, "model.d_model": 64, "model.dense_ffn_dim": 128,
    "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2,
    "model.kda.num_heads": 2, "model.kda.head_dim": 32, "model.kda.decay_rank": 8, "model.kda.chunk_size": 16,
    "model.mla.num_heads": 2, "model.mla.head_dim": 32, "model.mla.kv_latent_dim": 32,
    "model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.latent_dim": 32, "model.moe.expert_dim": 32,
}
SMOKE_K3_MINI = {**SMOKE_MODEL, "model.n_layers": 5, "model.mla.q_latent_dim": 32, "model.moe.shared_dim": 32,
                 "model.moe.quantile_balancing_bins": 64}


class Runner:
    """One model's training step with its optimizer and batch, kept between timing windows so that several
    models are timed in turn. CUDA: bf16 autocast, fused AdamW, the balancer timed with CUDA events."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, B: int, T: int, vocab: int, balance: bool,
                 device: str) -> None:
        self.model, self.loss_fn, self.balance = model, loss_fn, balance
        self.cuda = device == "cuda"
        self.tokens = B * T
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=self.cuda or None)
        self.x = torch.randint(0, vocab, (B, T), device=device)  # [B, T] token ids
        self.held_bytes: int | None = None  # what this model keeps allocated between its steps
        self.setup_peak = 0  # a captured step's: its warm-up's peak (the graph's pool holds its tensors after)

    def step(self, spans: list | None = None) -> torch.Tensor:
        """One training step (as ``BalancerCallback``: the balancer after the backward, before the optimizer)."""
        from moelab.model.balance import balance_step

        loss = self.loss_fn(self.model, self.x)
        loss.backward()
        if self.balance:
            if self.cuda:
                span = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                span[0].record()
                balance_step(self.model)
                span[1].record()
            else:
                t = time.perf_counter()
                balance_step(self.model)
                span = time.perf_counter() - t
            if spans is not None:
                spans.append(span)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def count_ops(self) -> dict[str, Any]:
        """One step's host work (:func:`moelab.train.host_work.count_step`, without Python calls)."""
        from moelab.train.host_work import count_step  # the measured tree's (--base: that commit's, if it has it)

        counts = count_step(self.model, self.x, self.opt, self.loss_fn, python_calls=False)
        return {k: v for k, v in counts.items() if k != "by"} | {"launches_by_kernel": counts["by"]["triton_launches"]}

    def warm(self, steps: int) -> float:
        """``steps`` untimed steps; their wall seconds."""
        t = time.perf_counter()
        for _ in range(steps):
            self.step()
        self.sync()
        return time.perf_counter() - t

    def window(self, steps: int) -> dict[str, Any]:
        """Mean time of ``steps`` synchronized steps, then the host time to issue one more from an idle GPU, the
        window's own peak memory (GiB; what the other models hold subtracted), the balancer's mean time."""
        self.sync()
        others = 0 if self.held_bytes is None or not self.cuda else torch.cuda.memory_allocated() - self.held_bytes
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        spans: list = []
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = self.step(spans)
        self.sync()
        dt = (time.perf_counter() - t0) / steps
        t1 = time.perf_counter()
        self.step()
        host = time.perf_counter() - t1
        self.sync()
        out = {"step_ms": dt * 1e3, "tok_per_s": self.tokens / dt, "host_ms": host * 1e3,
               "peak_mem_gb": max(self.setup_peak, torch.cuda.max_memory_allocated() - others) / 2**30 if self.cuda
               else None, "loss": float(loss.detach())}
        if self.balance:
            ms = [a.elapsed_time(b) for a, b in spans] if self.cuda else [1e3 * t for t in spans]
            out["balancer_ms"] = sum(ms) / len(ms)
            out["balancer_share"] = out["balancer_ms"] / out["step_ms"]
        return out


class CapturedRunner(Runner):
    """A Runner whose step is the whole training step as one CUDA graph (``train.compile: graphs``): the step
    :class:`~moelab.train.module.LitMoELab` captures (``train_step_fn``: forward, backward, the balancer, clipping
    to ``grad_clip``, fused capturable AdamW at a tensor lr), replayed on a static batch."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, B: int, T: int, vocab: int, grad_clip: float,
                 device: str) -> None:
        from moelab.train.module import CapturedStep, train_step_fn

        super().__init__(model, loss_fn, B, T, vocab, False, device)
        self.opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device=device), fused=True,
                                     capturable=True)
        self.captured = CapturedStep(train_step_fn(model, self.opt, grad_clip, torch.bfloat16), warmup=2)
        self.batch = {"input_ids": self.x, "targets": self.x}

    def step(self, spans: list | None = None) -> torch.Tensor:
        return self.captured(self.batch)["loss"]

    def count_ops(self) -> dict[str, Any]:
        return {"note": "one CUDA graph replay per step: no aten ops or launches issued from Python"}


@dataclass
class Built:
    """A built config of a group: its row's fixed fields, its runner, its model config (None: fla's model)."""

    row: dict[str, Any]
    runner: Runner
    model_cfg: Any = None


def build_moelab(impl: str, preset: str, overrides: dict, device: str) -> Built:
    """The model of ``preset`` with ``overrides``, its row's fixed fields and one checked training step (loss and
    every gradient finite; the first step also compiles every Triton kernel the cache lacks)."""
    from moelab.config import load_config
    from moelab.model import MoELab
    from moelab.model.accounting import param_counts
    from moelab.model.balance import balance_step, balanced_routers

    t0 = time.perf_counter()
    cfg = load_config(preset, overrides)
    torch.manual_seed(0)
    model = MoELab(cfg.model).to(device)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    balance = bool(balanced_routers(model))
    row: dict[str, Any] = {"impl": impl, "preset": preset, **{k: str(v) for k, v in overrides.items()
                                                              if k not in SMOKE_K3_MINI},
                           "params": sum(p.numel() for p in model.parameters()),
                           "params_activated": param_counts(cfg.model)["activated"], "B": B, "T": T}
    if balance:
        row["balancer"] = cfg.model.moe.balancer
    row["setup_s"] = {"build": time.perf_counter() - t0}
    t1 = time.perf_counter()
    x = torch.randint(0, cfg.model.vocab_size, (B, T), device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = model(x, x, return_logits=False)
    (out.loss + out.aux_loss).backward()
    row.update(first_loss=float(out.loss.detach()), loss_finite=bool(torch.isfinite(out.loss)),
               nonfinite_grads=[n for n, p in model.named_parameters()
                                if p.grad is not None and not torch.isfinite(p.grad).all()],
               params_without_grad=[n for n, p in model.named_parameters() if p.requires_grad and p.grad is None])
    model.zero_grad(set_to_none=True)
    if balance:
        balance_step(model)  # this forward's statistics must not enter the first timed update
    row["setup_s"]["grad_check"] = time.perf_counter() - t1

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            o = m(ids, ids, return_logits=False, check_ids=False)
        return o.loss + o.aux_loss

    if cfg.train.compile == "graphs":
        runner: Runner = CapturedRunner(model, loss_fn, B, T, cfg.model.vocab_size, cfg.train.grad_clip, device)
    elif cfg.train.compile != "none":
        raise ValueError(f"{impl}: train.compile={cfg.train.compile!r} is not timed here: expected none or graphs")
    else:
        runner = Runner(model, loss_fn, B, T, cfg.model.vocab_size, balance, device)
    return Built(row, runner, cfg.model)


def build_fla() -> Built | None:
    """fla's ``KDAForCausalLM`` at the anchor shape (hidden 1024, 12 layers, 8 heads x 128, vocab 32000, B8
    T4096, safe gate at -5), or None without flash-linear-attention."""
    try:
        from fla.models import KDAConfig, KDAForCausalLM
    except ImportError as exc:
        print(f"fla_kda: skipped (flash-linear-attention not importable: {exc})", flush=True)
        return None
    B, T, V = 8, 4096, 32000
    cfg = KDAConfig(hidden_size=1024, num_hidden_layers=12, num_heads=8, head_dim=128, vocab_size=V,
                    fuse_cross_entropy=True, safe_gate=True, lower_bound=G_MIN)
    torch.manual_seed(0)
    model = KDAForCausalLM(cfg).cuda()

    def loss_fn(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return m(input_ids=ids, labels=ids).loss

    return Built({"impl": "fla_kda", "params": sum(p.numel() for p in model.parameters()), "B": B, "T": T},
                 Runner(model, loss_fn, B, T, V, False, "cuda"))


def round_order(n: int, r: int) -> list[int]:
    """Order of ``n`` configs in round ``r``: a Williams design (a balanced Latin square; odd ``n``: the square and
    its mirror, 2n rounds). Over every period each config runs once in each position and right after each other
    config equally often, so drift and carry-over from the previous model cancel in the paired ratios."""
    first, lo, hi = [0], 1, n - 1
    while lo <= hi:
        first.append(lo)
        lo += 1
        if lo <= hi:
            first.append(hi)
            hi -= 1
    order = [(c + r) % n for c in first]
    return order[::-1] if n % 2 and (r // n) % 2 else order


def verdict(ratios: list[float], target: float) -> str:
    """``"met"`` when every paired ratio reaches ``target``, ``"not met"`` when none does, else ``"within
    noise"``. [min, max] of n independent rounds holds their median with probability 1 - 2^(1-n)."""
    if not ratios:
        raise ValueError("verdict needs at least one paired ratio, got none")
    if min(ratios) >= target:
        return "met"
    if max(ratios) < target:
        return "not met"
    return "within noise"


def compare_rounds(base_ms: list[float], other_ms: list[float], target: float | None) -> dict[str, Any]:
    """Per-round step times of a row and of its base, paired by round: the tokens/s ratios other / base
    (= base_ms / other_ms), their median, min, max, and the verdict against ``target`` (None: no target)."""
    if len(base_ms) != len(other_ms) or not base_ms:
        raise ValueError(f"need the same number (>= 1) of rounds on both sides, got base={len(base_ms)}, "
                         f"other={len(other_ms)}")
    ratios = [b / o for b, o in zip(base_ms, other_ms)]
    out = {"base_median_ms": statistics.median(base_ms), "median_ms": statistics.median(other_ms), "ratios": ratios,
           "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "target": target}
    if target is not None:
        out["verdict"] = verdict(ratios, target)
    return out


def rounds_result(windows: list[dict], tokens: int) -> dict[str, Any]:
    """One row's measured fields from its per-round windows (:meth:`Runner.window`, in round order): medians of
    step, host and balancer time, tokens/s from the median step, the largest peak, the last loss."""
    ms = [w["step_ms"] for w in windows]
    step = statistics.median(ms)
    out = {"step_ms": step, "tok_per_s": tokens / (step / 1e3),
           "host_ms": statistics.median(w["host_ms"] for w in windows),
           "peak_mem_gb": None if windows[0]["peak_mem_gb"] is None else max(w["peak_mem_gb"] for w in windows),
           "loss": windows[-1]["loss"]}
    if "balancer_ms" in windows[0]:
        out["balancer_ms"] = statistics.median(w["balancer_ms"] for w in windows)
        out["balancer_share"] = out["balancer_ms"] / step
    out.update(rounds_done=len(windows), rounds_step_ms=ms, step_ms_min=min(ms), step_ms_max=max(ms),
               rounds_host_ms=[w["host_ms"] for w in windows])
    return out


def model_rows(built: list[Built], windows: list[list[dict]], planned: int) -> list[dict[str, Any]]:
    """A group's rows so far: measured fields, MFU, the paired ratios of ``MODEL_TARGETS``, memory verdicts."""
    from moelab.model.accounting import flops_per_token

    rows = []
    for b, w in zip(built, windows):
        row = {**b.row, **rounds_result(w, b.runner.tokens), "rounds_planned": planned, "complete": len(w) == planned}
        cuda = b.runner.cuda
        row["mfu"] = 6 * row["params"] * row["tok_per_s"] / ANCHOR_PEAK if cuda else None
        row["mfu_convention"] = MFU_CONVENTION
        if b.model_cfg is not None:
            row["mfu_model_flops"] = (3 * flops_per_token(b.model_cfg, row["T"]) * row["tok_per_s"] / DATASHEET_PEAK
                                      if cuda else None)
        rows.append(row)
    by = {r["impl"]: r for r in rows}
    for row in rows:
        if row["impl"] in MODEL_TARGETS and MODEL_TARGETS[row["impl"]][0] in by:
            base_impl, key, target = MODEL_TARGETS[row["impl"]]
            base = by[base_impl]
            row[key] = {"base": base_impl, **compare_rounds(base["rounds_step_ms"], row["rounds_step_ms"], target)}
            if key == "ratio_vs_balancer_none":
                row["balancer_cost"] = 1.0 - row[key]["median"]
            limit = MEM_TARGETS.get(row["impl"])
            if limit and row.get("peak_mem_gb") and base.get("peak_mem_gb"):
                ratio = row["peak_mem_gb"] / base["peak_mem_gb"]
                row["mem_vs_prenorm"] = {"base": base_impl, "ratio": ratio, "target": limit,
                                         "verdict": "met" if ratio <= limit else "not met"}
    return rows


def elapsed() -> float:
    return time.perf_counter() - START


def budget_stop(budget_s: float | None, now_s: float, round_s: float | None) -> str | None:
    """Why the next round must not start (it would end, ``now_s`` + ``round_s``, past ``budget_s`` seconds from
    the start), or None when it may; without a budget or an estimate every round starts."""
    if budget_s is None or round_s is None or now_s + round_s <= budget_s:
        return None
    return f"--budget-s {budget_s:g}: the next round (about {round_s:.1f} s) would end at {now_s + round_s:.1f} s"


def _progress(msg: str) -> None:
    print(f"[bench {elapsed():7.1f} s] {msg}", file=sys.stderr, flush=True)


def run_group(group: str, ctx: Ctx, warmup: int, steps: int, record: Callable[[list[dict]], None]) -> list[dict]:
    """Build every config of ``group`` (all stay on the device), time them in ``ctx.rounds`` interleaved rounds
    (:func:`round_order`), ``record`` the rows after every round (``complete`` false until the last), then count
    one step's host work per config (:func:`count_step`, without Python calls)."""
    preset, specs = MODEL_GROUPS[group]
    smoke = {} if ctx.cuda else (SMOKE_K3_MINI if group == "k3-mini" else SMOKE_MODEL)
    built: list[Built] = []
    warm_s: list[float] = []
    for impl, over in (s for s in specs if not ctx.impls or s[0] in ctx.impls):  # --impls: these rows only
        before = torch.cuda.memory_allocated() if ctx.cuda else 0
        torch.cuda.reset_peak_memory_stats() if ctx.cuda else None
        b = build_fla() if impl == "fla_kda" else build_moelab(impl, preset, {**smoke, **over}, ctx.dev)
        if b is None:
            continue
        t = b.runner.warm(warmup)
        b.row.setdefault("setup_s", {})["warmup"] = t
        b.runner.held_bytes = (torch.cuda.memory_allocated() if ctx.cuda else 0) - before
        if ctx.cuda and b.row.get("train.compile") in ("graphs", "compiled_graphs"):  # replays allocate nothing
            b.runner.setup_peak = torch.cuda.max_memory_allocated() - before
        built.append(b)
        warm_s.append(b.runner.warm(1))  # a step after the warm-up's compiling and autotuning: the round estimate
        _progress(f"set up {impl}: {b.row['setup_s']}")
    n = len(built)
    windows: list[list[dict]] = [[] for _ in built]
    round_s: list[float] = []
    rows: list[dict] = []
    for r in range(ctx.rounds):
        est = max(round_s) if round_s else sum(warm_s) * (steps + 2)
        stop = budget_stop(ctx.budget_s, elapsed(), est)
        if stop:
            _progress(f"stopped before round {r + 1}/{ctx.rounds}: {stop}")
            rows = [{**row, "stopped": stop} for row in rows]
            if rows:
                record(rows)
            break
        t_round = time.perf_counter()
        for i in round_order(n, r):
            built[i].runner.warm(1)  # the window starts from this model's own step, not another model's
            windows[i].append(built[i].runner.window(steps))
        round_s.append(time.perf_counter() - t_round)
        rows = model_rows(built, windows, ctx.rounds)
        record(rows)
        _progress(f"round {r + 1}/{ctx.rounds}: " + ", ".join(
            f"{b.row['impl']} {w[-1]['step_ms']:.1f}" for b, w in zip(built, windows)) + " ms/step")
    if rows:
        for b, row in zip(built, rows):
            row["step_ops"] = b.runner.count_ops()
        record(rows)
    return rows


def run_model(ctx: Ctx) -> dict[str, Any]:
    warmup, steps = (5, 10) if ctx.cuda else (1, 2)
    rows: list[dict] = []

    def record(group_rows: list[dict]) -> None:
        done = {r["impl"] for r in group_rows}
        rows[:] = [r for r in rows if r["impl"] not in done] + group_rows
        ctx.save({"rows": rows})

    for group in ctx.shapes:
        if group == "fla" and not ctx.cuda:
            raise SystemExit("entry model, shape fla: fla's model runs on CUDA only (--smoke takes gpu-small or "
                             "k3-mini)")
        try:
            run_group(group, ctx, warmup, steps, record)
        except torch.cuda.OutOfMemoryError as exc:
            held = ", ".join(impl for impl, _ in MODEL_GROUPS[group][1] if not ctx.impls or impl in ctx.impls)
            raise SystemExit(f"entry model, shape {group}: its configs ({held}) stay on the GPU at once and ran out "
                             f"of memory; time fewer with --impls (a captured one keeps its pool): {exc}") from None
        ctx.free()
    for row in rows:
        extra = "".join(f"  {k} {row[k]['median']:.3f} ({row[k]['min']:.3f}-{row[k]['max']:.3f})"
                        f" {row[k].get('verdict', '')}" for k in row if k.startswith("ratio_vs_"))
        print(f"{row['impl']:34s} {row['step_ms']:8.1f} ms/step {row['tok_per_s'] / 1e3:8.1f}K tok/s  host "
              f"{row['host_ms']:6.1f} ms  launches {row.get('step_ops', {}).get('triton_launches', '-')}{extra}",
              flush=True)
    bad = [r["impl"] for r in rows if r.get("loss_finite") is False or r.get("nonfinite_grads")]
    if bad:
        raise SystemExit(f"entry model: non-finite loss or gradients in {', '.join(bad)}")
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------- runner

ENTRIES: dict[str, Entry] = {e.name: e for e in (
    Entry("kda", "KDA training op fwd / fwd+bwd: moelab bounded, general vs fla (safe gate, softplus) vs SDPA",
          KDA_SHAPES, ("B8-T4096", "B1-T32768", "B2-T65536"), "smoke", run_kda, ("impl", "B", "T", "H", "D"),
          rounds=5),
    Entry("kda_long", "KDA training op at T = 128K-512K, B = 1: moelab only (time and peak memory)",
          KDA_LONG_SHAPES, tuple(s for s in KDA_LONG_SHAPES if s != "smoke"), "smoke", run_kda_long,
          ("impl", "B", "T", "H", "D"), rounds=3),
    Entry("kda_infer", "KDA inference forward (chunk 16, no grad) vs fla chunk_kda and the training forward, "
          "fixed and packed", INFER_SHAPES, tuple(s for s in INFER_SHAPES if s != "smoke"), "smoke", run_kda_infer,
          ("impl", "layout", "B", "T", "H", "D"), rounds=3),
    Entry("attnres", "fused AttnRes depth aggregation fwd / fwd+bwd vs fla fused_attnres (and plain PyTorch at L*)",
          ATTNRES_SHAPES, ("L4", "L9", "L17"), "smoke", run_attnres, ("impl", "shape"), merge=True,
          summarize=attnres_summary),
    Entry("moe", "LatentMoE layer fwd+bwd vs dense matmul chains of equal FLOPs", MOE_SHAPES, ("N32768",), "smoke",
          run_moe, ("impl",)),
    Entry("conv", "ShortConv per launch and backward kernel vs F.conv1d", CONV_SHAPES, ("k3-mini", "B1-T32768-C1536"),
          "smoke", run_conv, ("impl", "shape")),
    Entry("model", "whole-model training step: fla shape vs fla, gpu-small residual modes, k3-mini balancer cost",
          {g: MODEL_GROUPS[g][0] for g in MODEL_GROUPS}, tuple(MODEL_GROUPS), "k3-mini", run_model, ("impl",),
          merge=True, rounds=4),
)}


def _print_row(row: dict[str, Any], metrics: tuple[str, ...], extra: tuple[str, ...] = ()) -> None:
    shape = " ".join(f"{k}{row[k]}" for k in ("B", "T", "H", "D", "L") if k in row)
    vals = "  ".join(f"{m} {row[m]:.3f}" if isinstance(row.get(m), float) else f"{m} -" for m in metrics)
    print(f"{row['impl']:32s} {' '.join(str(row[k]) for k in extra)} {shape}  {vals}  {row.get('error', '')}",
          flush=True)


def write_json(path: str | os.PathLike, data: dict[str, Any], indent: int) -> None:
    """``data`` to ``path`` through a temporary file beside it (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent) + "\n")
    os.replace(tmp, path)


def make_saver(entry: Entry, out: str | None, meta: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """``save(result)``: the entry's file with ``meta`` and ``result``. ``merge`` entries replace their rows by
    ``keys`` among the file's others; each row carries its own commit and date (an older row without them gets
    its file's), and the file's meta names no commit (its rows come from different runs)."""
    def save(result: dict[str, Any]) -> None:
        if out is None:
            return
        if not entry.merge:
            write_json(out, {"meta": meta, **result}, indent=1)
            return
        old = json.loads(Path(out).read_text()) if Path(out).exists() else {"rows": []}
        stamp = {k: meta[k] for k in ("commit", "dirty", "command", "date")}
        new = [{**r, **stamp} for r in result["rows"]]
        keys = {row_key(entry, r) for r in new}
        rows = [{**{k: old["meta"].get(k) for k in stamp}, **r} if "meta" in old else r
                for r in old.get("rows", []) if row_key(entry, r) not in keys] + new
        file_meta = {k: v for k, v in meta.items() if k not in ("commit", "dirty", "diff_sha256")}
        write_json(out, {"meta": file_meta, **(entry.summarize(rows) if entry.summarize else {"rows": rows})},
                   indent=2)
    return save


def run_entry(entry: Entry, shapes: list[str], out: str | None, cuda: bool, rounds: int | None,
              budget_s: float | None, impls: Sequence[str] | None = None, kernels: bool = False) -> dict[str, Any]:
    """Run ``entry`` at ``shapes``, writing ``out`` as it goes; returns ``{"meta", **result}``."""
    meta = provenance(root=None if CODE == ROOT and os.environ.get("MOELAB_COMMIT") else CODE)
    meta.update(entry=entry.name, shapes=shapes, device="cuda" if cuda else "cpu (Triton interpreter)",
                timing="CUDA events around back-to-back calls after warm-up; median over rounds (kernels/bench.py "
                       "time_ms)" if entry.name != "model" else "mean of synchronized steps per window; median over "
                       "interleaved rounds")
    ctx = Ctx(shapes, cuda, rounds or (entry.rounds if cuda else 1), budget_s, make_saver(entry, out, meta),
              tuple(impls) if impls else None, kernels)
    result = entry.run(ctx)
    ctx.save(result)
    return {"meta": meta, **result}


def row_key(entry: Entry, row: dict[str, Any]) -> tuple:
    return tuple(row.get(k) for k in entry.keys)


def compare(entry: Entry, base: list[dict], new: list[dict]) -> list[dict[str, Any]]:
    """Rows present on both sides (matched by ``entry.keys``), per time field (``*_ms``) and ``tok_per_s``: both
    values and the speedup of this tree over the base (base time / this time; this tokens/s / base's)."""
    by = {row_key(entry, r): r for r in base}
    out = []
    for r in new:
        b = by.get(row_key(entry, r))
        if b is None:
            continue
        for metric, value in r.items():
            if not (metric.endswith("_ms") or metric == "tok_per_s"):
                continue
            old = b.get(metric)
            if not isinstance(value, (int, float)) or not isinstance(old, (int, float)) or not value or not old:
                continue
            speedup = value / old if metric == "tok_per_s" else old / value
            out.append({"key": dict(zip(entry.keys, row_key(entry, r))), "metric": metric, "base": old, "new": value,
                        "speedup": speedup})
    return out


def run_base(rev: str, argv: list[str], repo: Path = ROOT) -> dict[str, Any]:
    """Run this file with ``argv`` on commit ``rev`` of ``repo``: a temporary ``git worktree`` (detached), its
    moelab first on the path (``MOELAB_BENCH_CODE``), the result read back; the worktree is removed after."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=repo,
                             capture_output=True, text=True, check=True).stdout.strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"--base {rev}: not a commit of {repo}") from None
    tmp = Path(tempfile.mkdtemp(prefix="moelab-base-"))
    tree, out = tmp / "tree", tmp / "base.json"
    try:
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(tree), sha], cwd=repo, check=True,
                       capture_output=True, text=True)
        env = {**os.environ, "MOELAB_BENCH_CODE": str(tree), "MOELAB_ROOT": str(tree),
               "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
        print(f"--base {rev}: running on {sha[:12]} in {tree}", flush=True)
        res = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--out", str(out)], env=env,
                             cwd=tree)
        if res.returncode != 0:
            raise SystemExit(f"--base {rev}: the run on {sha[:12]} failed (exit {res.returncode}; its output above)")
        return json.loads(out.read_text())
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def print_compare(rows: list[dict[str, Any]], base_meta: dict, new_meta: dict) -> None:
    print(f"\nbase {str(base_meta.get('commit'))[:12]} vs this tree {str(new_meta.get('commit'))[:12]}"
          f"{' (dirty)' if new_meta.get('dirty') else ''}; speedup > 1: this tree is faster")
    for c in rows:
        key = " ".join(f"{k}={v}" for k, v in c["key"].items())
        print(f"  {key:48s} {c['metric']:12s} {c['base']:12.4g} {c['new']:12.4g}  {c['speedup']:.3f}x")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kernels/bench.py", description=__doc__.split("\n\n")[0],
                                 epilog="entries: " + ", ".join(ENTRIES) + " (--list for their shapes)")
    ap.add_argument("--list", action="store_true", help="list the entries, their shapes and default output files")
    ap.add_argument("--entry", choices=tuple(ENTRIES), help="the benchmark to run")
    ap.add_argument("--shapes", nargs="+", metavar="NAME", help="run only these shapes of the entry (--list)")
    ap.add_argument("--impls", nargs="+", metavar="NAME", help="kda: run only these rows (default: all of "
                    + ", ".join(KDA_IMPLS) + "; launch candidates only when named: " + ", ".join(KDA_LAUNCH_ROWS)
                    + "); attnres: of " + ", ".join(ATTNRES_ROWS) + " and launch candidates "
                    "moelab_fused@r<rows>w<warps>g<group>[c<chunk>][s<stages>][-b<rows>w<warps>g<group>[c<chunk>][s<stages>]]"
                    "; model: of " + ", ".join(MODEL_ROWS) + " (default: all of each group)")
    ap.add_argument("--out", help="JSON to write (default kernels/results/<entry>_<gpu>.json; with --base or --smoke "
                                  "nothing unless given)")
    ap.add_argument("--rounds", type=int, help="kda, kda_long, kda_infer: timing passes over a shape's rows "
                                               "(default 5, 3, 3); model: interleaved rounds per group (default 4)")
    ap.add_argument("--budget-s", type=float, help="model: start no round that would end later than this many "
                                                   "seconds after the start")
    ap.add_argument("--base", metavar="REV", help="also run the entry on commit REV (a temporary git worktree) and "
                                                  "print both with speedups")
    ap.add_argument("--smoke", action="store_true", help="CPU (Triton interpreter), the entry's tiny shape: a check "
                                                         "that the harness runs, not a measurement")
    ap.add_argument("--kernels", action="store_true", help="kda: each row also lists its time per kernel (torch "
                                                           "profiler), the training forward and forward + backward")
    args = ap.parse_args(argv)
    if args.list:
        return args
    if args.entry is None:
        ap.error("--entry NAME is required (or --list); entries: " + ", ".join(ENTRIES))
    entry = ENTRIES[args.entry]
    if args.shapes:
        bad = [s for s in args.shapes if s not in entry.shapes]
        if bad:
            ap.error(f"--shapes {' '.join(bad)}: not a shape of entry {entry.name}; allowed: "
                     + ", ".join(entry.shapes))
    if args.impls and entry.name == "attnres":
        for name in args.impls:
            if name not in ATTNRES_ROWS:
                try:
                    attnres_launch(name)
                except ValueError as e:
                    ap.error(f"--impls {name}: not a row of entry attnres ({', '.join(ATTNRES_ROWS)}) nor a launch "
                             f"candidate: {e}")
    elif args.impls:
        bad = [i for i in args.impls if i not in (KDA_ROWS if entry.name == "kda" else MODEL_ROWS)]
        if entry.name not in ("kda", "model") or bad:
            ap.error(f"--impls {' '.join(bad or args.impls)}: needs entry kda (rows of {', '.join(KDA_ROWS)}), model "
                     f"(rows of {', '.join(MODEL_ROWS)}) or attnres, got entry {entry.name}")
    if args.kernels and entry.name != "kda":
        ap.error(f"--kernels needs entry kda, got entry {entry.name}")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.budget_s is not None and (args.budget_s <= 0 or entry.name != "model"):
        ap.error(f"--budget-s needs entry model and a budget > 0 seconds, got entry {entry.name}, "
                 f"--budget-s {args.budget_s:g}")
    return args


def base_argv(args: argparse.Namespace, shapes: list[str]) -> list[str]:
    """The arguments that rerun this call's entry on the base commit (its output file comes from ``run_base``)."""
    out = ["--entry", args.entry, "--shapes", *shapes] + (["--impls", *args.impls] if args.impls else [])
    if args.rounds is not None:
        out += ["--rounds", str(args.rounds)]
    if args.budget_s is not None:
        out += ["--budget-s", f"{args.budget_s:g}"]
    return out + (["--smoke"] if args.smoke else [])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.list:
        for e in ENTRIES.values():
            print(f"{e.name:10s} {e.summary}\n{'':10s} shapes: {', '.join(e.shapes)} (default: "
                  f"{', '.join(e.default)}); writes {e.out('NVIDIA H200')} on an H200")
        return 0
    entry = ENTRIES[args.entry]
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit(f"kernels/bench.py: no CUDA device: entry {entry.name} measures GPU kernels (--smoke runs "
                         "its tiny CPU check)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first @triton.jit of moelab's kernels is made
    shapes = args.shapes or ([entry.smoke] if args.smoke else list(entry.default))
    out = args.out
    if out is None and not args.smoke and not args.base:
        out = str(ROOT / entry.out(torch.cuda.get_device_name()))
    base = None
    if args.base:
        base = run_base(args.base, base_argv(args, shapes))
    result = run_entry(entry, shapes, out, cuda, args.rounds, args.budget_s, args.impls, args.kernels)
    if base is not None:
        rows = compare(entry, base["rows"], result["rows"])
        print_compare(rows, base["meta"], result["meta"])
        if out:
            write_json(out, {**result, "base": base, "compare": rows}, indent=1)
    if out:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
