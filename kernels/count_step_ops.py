"""Host-side work of one training step per residual mode: what each AttnRes mode adds to prenorm.

The gpu-small model on one H200 is bound by the host: issuing a step (Python, autograd, launches)
takes about as long as the GPU runs it, so every op, launch and Python call a residual mode adds
can show in tokens/s. For each mode this tool builds the ``gpu-small`` preset
(``model.residual.backend=triton``, the fused op the GPU runs), runs warm-up steps and then counts,
for one forward + backward + fused AdamW step under bf16 autocast:

* ``aten_ops`` (``_fwd``, ``_bwd``, ``_opt``): aten ops dispatched (``TorchDispatchMode``, by op);
* ``triton_launches``: Triton kernel launches (by kernel);
* ``fn_applies``: ``torch.autograd.Function`` applications (by class);
* ``graph_nodes``: autograd nodes the backward runs (the graph from the loss, by node type);
* ``py_calls``: Python function calls in the step (cProfile, a separate step), in total, by
  function, and for every function of ``moelab/model/attnres.py`` and ``moelab/ops/attnres.py``;

and times ``attnres_host_ms``: host time per step inside the residual stream's reads and writes
(forward, the op's launch included) and the op's backward (least over ``--steps`` steps), split
into ``attnres_fwd_host_ms`` and ``attnres_bwd_host_ms``, and of that the time inside the AttnRes
kernels' Triton launches (``attnres_launch_host_ms``; 0 on the CPU, where the launches are
stubbed while timing). Every mode is reported with its deltas against prenorm, in total, per
residual read (``2 n_layers + 1`` reads per forward) and by op / kernel / node / function.

On the CPU (default without a GPU) the widths are shrunk (``SHRINK``: layer count, layer kinds
and block structure kept) so that the Triton kernels run in the interpreter; the interpreter's own
work is left out of every count and time (a launch counts as one). Op counts of the parts that take
other backends on the CPU (KDA, MoE, convolutions run their torch paths) differ from the GPU's,
but those parts are the same in every mode, so the deltas are the residual modes' own.
On a GPU (``--device cuda``) the model has gpu-small's real sizes and each mode also gets
``step_ms`` (mean of back-to-back steps, the tokens/s measure; ``step_ms_check_ids`` the same with
the model's id check on, as ``bench_model.py`` at 38ae496 timed its rows), ``host_ms`` (median host time to
issue one step from an idle GPU; ``host_fwd_ms``, ``host_bwd_ms``, ``host_opt_ms`` per phase) and
``tok_per_s``, and what in a step can make the host wait for the GPU: ``sync_calls``
(``torch.cuda.set_sync_debug_mode``: synchronizing calls, by the Python line that made them; those
made in the backward's engine thread come back at ``loss.backward()``) and ``allocator`` (the
caching allocator's device allocations, frees, failed allocations and all-stream syncs during one
steady-state step; all 0 when nothing serializes there).

    python kernels/count_step_ops.py [--modes prenorm block_attnres:8 ...] [--out counts.json]
    python kernels/count_step_ops.py --device cuda --steps 10 --out /tmp/counts_h200.json
    python kernels/count_step_ops.py --smoke   # CPU, 4 layers, prenorm and block_attnres:4
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import warnings

import torch

if not torch.cuda.is_available():  # before the first @triton.jit of moelab's kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import moelab.ops.attnres as attnres_op  # noqa: E402
from moelab.config import load_config  # noqa: E402
from moelab.model import MoELab  # noqa: E402
from moelab.model.attnres import ResidualStream  # noqa: E402

# gpu-small's structure (12 layers, KKKM + final MLA, dense first FFN, LatentMoE with a shared
# expert, top-4) at widths the interpreter runs quickly; B T = 32 tokens.
SHRINK = {
    "model.d_model": 32, "model.vocab_size": 512, "data.vocab_size": 512, "model.max_seq_len": 16,
    "data.seq_len": 16, "train.batch_size": 2, "model.dense_ffn_dim": 64,
    "model.kda.num_heads": 2, "model.kda.head_dim": 16, "model.kda.decay_rank": 8, "model.kda.chunk_size": 16,
    "model.mla.num_heads": 2, "model.mla.head_dim": 16, "model.mla.kv_latent_dim": 16,
    "model.moe.num_experts": 8, "model.moe.latent_dim": 16, "model.moe.expert_dim": 16,
}
MODES = ("prenorm", "block_attnres:6", "block_attnres:8", "full_attnres")
ATTNRES_FILES = (os.path.join("moelab", "model", "attnres.py"), os.path.join("moelab", "ops", "attnres.py"))
TOTALS = ("aten_ops", "aten_ops_fwd", "aten_ops_bwd", "aten_ops_opt", "triton_launches", "fn_applies", "graph_nodes",
          "py_calls", "attnres_py_calls", "attnres_host_ms", "attnres_fwd_host_ms", "attnres_bwd_host_ms",
          "attnres_launch_host_ms")
ATTNRES_KERNELS = ("_attnres_fwd_kernel", "_attnres_bwd_kernel")
ALLOC_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def parse_mode(spec: str) -> tuple[str, int | None]:
    """``"block_attnres:8"`` -> ("block_attnres", 8); the other modes take no block count."""
    mode, _, blocks = spec.partition(":")
    if mode not in ("prenorm", "full_attnres", "block_attnres"):
        raise ValueError(f"mode {spec!r} is not allowed: expected prenorm, full_attnres or block_attnres:N")
    if (mode == "block_attnres") != bool(blocks):
        raise ValueError(f"mode {spec!r}: block_attnres needs a block count (block_attnres:N), the others none")
    return mode, int(blocks) if blocks else None


class _CountOps(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher's Python mode, by overload packet, except
    while ``paused`` (the interpreter running a kernel: on a GPU that is one launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _Hooks:
    """Counters of Triton launches (by kernel) and autograd Function applications (by class),
    patched at the classes so that every kernel and Function of the process is seen. While a kernel
    runs (in the interpreter), ``ops`` stops counting and ``prof`` is off: the launch counts, not the
    interpreter's work. ``run_kernels=False`` skips the kernels (CPU timing: the interpreter's work
    would otherwise slow the host code around it, several times over, and its outputs are not needed).
    ``launch_s`` sums the seconds spent in the launches of the AttnRes kernels (``ATTNRES_KERNELS``)."""

    def __init__(self, ops: _CountOps | None = None, prof: cProfile.Profile | None = None,
                 run_kernels: bool = True) -> None:
        self.ops, self.prof, self.run_kernels = ops, prof, run_kernels
        self.launches: collections.Counter = collections.Counter()
        self.applies: collections.Counter = collections.Counter()
        self.launch_s = 0.0

    @contextlib.contextmanager
    def installed(self):
        import triton.runtime.jit as jit
        from triton.runtime.interpreter import InterpretedFunction

        saved = [(cls, cls.run) for cls in (jit.JITFunction, InterpretedFunction)]
        apply = torch.autograd.Function.apply.__func__
        hooks = self

        def counted_run(orig):
            def run(self, *args, **kwargs):
                name = self.fn.__name__
                if not kwargs.get("warmup", False):
                    hooks.launches[name] += 1
                if not hooks.run_kernels:
                    return None
                if name in ATTNRES_KERNELS and hooks.ops is None and hooks.prof is None:
                    t0 = time.perf_counter()
                    try:
                        return orig(self, *args, **kwargs)
                    finally:
                        hooks.launch_s += time.perf_counter() - t0
                if hooks.prof is not None:
                    hooks.prof.disable()
                if hooks.ops is not None:
                    hooks.ops.paused = True
                try:
                    return orig(self, *args, **kwargs)
                finally:
                    if hooks.ops is not None:
                        hooks.ops.paused = False
                    if hooks.prof is not None:
                        hooks.prof.enable()
            return run

        def counted_apply(cls, *args, **kwargs):
            hooks.applies[cls.__name__] += 1
            return apply(cls, *args, **kwargs)

        for cls, orig in saved:
            cls.run = counted_run(orig)
        torch.autograd.Function.apply = classmethod(counted_apply)
        try:
            yield self
        finally:
            for cls, orig in saved:
                cls.run = orig
            torch.autograd.Function.apply = classmethod(apply)


@contextlib.contextmanager
def attnres_host_time(clock=time.perf_counter):
    """Seconds spent in the residual stream's reads and writes (forward, the fused op's launches
    included; ``acc["fwd"]``) and in the fused op's backward (``acc["bwd"]``), on ``clock``."""
    acc = {"fwd": 0.0, "bwd": 0.0}
    fn = attnres_op._DepthAttentionFn
    saved = [(ResidualStream, "_read", ResidualStream._read), (ResidualStream, "write", ResidualStream.write),
             (fn, "backward", fn.backward)]

    def timed(orig, part):
        def wrapper(*args, **kwargs):
            t0 = clock()
            try:
                return orig(*args, **kwargs)
            finally:
                acc[part] += clock() - t0
        return wrapper

    for owner, name, orig in saved:
        setattr(owner, name, staticmethod(timed(orig, "bwd")) if owner is fn else timed(orig, "fwd"))
    try:
        yield acc
    finally:
        for owner, name, orig in saved:
            setattr(owner, name, staticmethod(orig) if owner is fn else orig)


def graph_nodes(root: torch.Tensor) -> collections.Counter:
    """Autograd nodes reachable from ``root.grad_fn`` (what its backward runs), by node type."""
    counts: collections.Counter = collections.Counter()
    seen, todo = set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] += 1
        todo.extend(nxt for nxt, _ in node.next_functions)
    return counts


def _loss(model: torch.nn.Module, x: torch.Tensor, check_ids: bool = False) -> torch.Tensor:
    """What training minimizes (``LitMoELab.training_step``: no id check, which is a host sync)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x, x, return_logits=False, check_ids=check_ids)
    return out.loss + out.aux_loss


def _update(loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _attnres_function(key: tuple) -> str | None:
    """``"model/attnres.py:_read:105"``-style name of a cProfile key of a function in the AttnRes files."""
    path, line, name = key
    for f in ATTNRES_FILES:
        if path.endswith(f):
            return f"{f.split(os.sep, 1)[1]}:{name}:{line}"
    return None


def count_step(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> dict:
    """The counts of one training step (the caller warms up first): totals and ``by`` key."""
    ops = _CountOps()
    hooks = _Hooks(ops=ops)
    with hooks.installed(), ops:
        loss = _loss(model, x)
        fwd = collections.Counter(ops.counts)
        nodes = graph_nodes(loss)
        loss.backward()
        bwd = collections.Counter(ops.counts) - fwd
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt_ops = collections.Counter(ops.counts) - fwd - bwd
    prof = cProfile.Profile()
    with _Hooks(prof=prof).installed():
        prof.enable()
        _update(_loss(model, x), opt)
        prof.disable()
    stats = pstats.Stats(prof).stats  # key -> (primitive calls, total calls, tottime, cumtime, callers)
    py_calls = collections.Counter()
    for k, v in stats.items():
        py_calls[f"{os.path.basename(k[0])}:{k[2]}"] += v[1]
    attnres_calls = {name: v[1] for k, v in stats.items() if (name := _attnres_function(k)) is not None}
    return {
        "aten_ops": sum(ops.counts.values()), "aten_ops_fwd": sum(fwd.values()), "aten_ops_bwd": sum(bwd.values()),
        "aten_ops_opt": sum(opt_ops.values()), "triton_launches": sum(hooks.launches.values()),
        "fn_applies": sum(hooks.applies.values()), "graph_nodes": sum(nodes.values()),
        "py_calls": sum(py_calls.values()), "attnres_py_calls": sum(attnres_calls.values()),
        "by": {"aten_ops_fwd": dict(fwd), "aten_ops_bwd": dict(bwd), "aten_ops_opt": dict(opt_ops),
               "triton_launches": dict(hooks.launches), "fn_applies": dict(hooks.applies),
               "graph_nodes": dict(nodes), "py_calls": dict(py_calls),
               "attnres_py_calls": dict(sorted(attnres_calls.items(), key=lambda kv: -kv[1]))},
    }


def time_steps(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, steps: int) -> dict:
    """``attnres_host_ms`` with its forward, backward and launch parts (least over the steps;
    ``attnres_host_ms_median`` too); on a GPU also ``step_ms`` (mean of back-to-back steps),
    ``host_ms`` and ``host_{fwd,bwd,opt}_ms`` (median host time to issue a step, and each phase of it,
    from an idle GPU), ``tok_per_s`` and ``step_ms_check_ids`` (the same steps with the model's id
    check, two host syncs at the start of each forward). On the CPU the Triton kernels are skipped (``_Hooks``), so
    run this after the counts: the weights it leaves behind are garbage."""
    cuda = x.is_cuda

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    out = {}
    parts = collections.defaultdict(list)
    hooks = _Hooks(run_kernels=cuda)
    with hooks.installed(), attnres_host_time() as acc:
        for _ in range(steps):
            before = dict(acc, launch=hooks.launch_s)
            _update(_loss(model, x), opt)
            for k, v in dict(acc, launch=hooks.launch_s).items():
                parts[k].append(v - before[k])
    sync()
    total = [f + b for f, b in zip(parts["fwd"], parts["bwd"])]
    # the least of the steps: the work itself, without what a busy (shared) host adds now and then
    out["attnres_host_ms"] = 1e3 * min(total)
    out["attnres_host_ms_median"] = 1e3 * statistics.median(total)
    for k in ("fwd", "bwd", "launch"):
        out[f"attnres_{k}_host_ms"] = 1e3 * min(parts[k])
    if cuda:
        t0 = time.perf_counter()
        for _ in range(steps):
            _update(_loss(model, x), opt)
        sync()
        out["step_ms"] = 1e3 * (time.perf_counter() - t0) / steps
        out["tok_per_s"] = x.numel() / (out["step_ms"] / 1e3)
        t0 = time.perf_counter()
        for _ in range(steps):
            _update(_loss(model, x, check_ids=True), opt)
        sync()
        out["step_ms_check_ids"] = 1e3 * (time.perf_counter() - t0) / steps
        phases = collections.defaultdict(list)
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = _loss(model, x)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            sync()
            for k, v in (("host", t3 - t0), ("host_fwd", t1 - t0), ("host_bwd", t2 - t1), ("host_opt", t3 - t2)):
                phases[k].append(v)
        out.update({f"{k}_ms": 1e3 * statistics.median(v) for k, v in phases.items()})
    return out


def blocking(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> dict:
    """CUDA: what in one steady-state step can make the host wait for the GPU: ``sync_calls``
    (synchronizing calls that ``torch.cuda.set_sync_debug_mode`` reports, by file and line) and
    ``allocator`` (``ALLOC_COUNTERS`` of ``torch.cuda.memory_stats`` over the step)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _update(_loss(model, x), opt)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    syncs = collections.Counter(f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}" for w in caught
                                if "synchronizing" in str(w.message))
    return {"sync_calls": sum(syncs.values()), "sync_calls_by": dict(syncs),
            "allocator": {k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_COUNTERS}}


def count_mode(spec: str, device: str, n_layers: int | None = None, steps: int = 5, warmup: int = 2) -> dict:
    """Counts and host times of the mode ``spec`` on gpu-small (shrunk on the CPU, ``n_layers`` to
    override the layer count)."""
    mode, blocks = parse_mode(spec)
    over = {**(SHRINK if device == "cpu" else {}), "model.residual.mode": mode, "model.residual.backend": "triton"}
    if blocks is not None:
        over["model.residual.num_blocks"] = blocks
    if n_layers is not None:
        over["model.n_layers"] = n_layers
    cfg = load_config("gpu-small", over)
    torch.manual_seed(0)
    model = MoELab(cfg.model).to(device)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)  # as on the GPU: one fused update
    for _ in range(warmup):  # optimizer state, kernel compiles and caches
        _update(_loss(model, x), opt)
    row = {"mode": spec, "reads": 2 * cfg.model.n_layers + 1, "params": sum(1 for _ in model.parameters()),
           "B": x.shape[0], "T": x.shape[1], "d_model": cfg.model.d_model}
    row.update(count_step(model, x, opt))
    row.update(time_steps(model, x, opt, steps))
    if device == "cuda":
        row.update(blocking(model, x, opt))
    return row


def deltas(row: dict, base: dict, top: int = 12) -> dict:
    """``row`` minus ``base``: per total, in all and per residual read; per ``by`` key the largest
    positive and negative differences."""
    out = {k: {"delta": row[k] - base[k], "per_read": (row[k] - base[k]) / row["reads"]} for k in TOTALS}
    out["by"] = {}
    for k, by in row["by"].items():
        diff = collections.Counter(by)
        diff.subtract(base["by"][k])
        ranked = sorted(((n, v) for n, v in diff.items() if v), key=lambda nv: -abs(nv[1]))
        out["by"][k] = dict(ranked[:top])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="*", default=None, help=f"residual modes (default {' '.join(MODES)})")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (default: cuda 10, cpu 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: cuda 5, cpu 2)")
    ap.add_argument("--smoke", action="store_true", help="CPU, 4 layers, prenorm and block_attnres:4 (a quick check)")
    ap.add_argument("--out", default=None, help="write every count to this JSON")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA device")
    if args.smoke and cuda:
        sys.exit("--smoke is the CPU check")
    steps = args.steps or (10 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    modes = args.modes or (["prenorm", "block_attnres:4"] if args.smoke else list(MODES))
    modes = ["prenorm", *[m for m in modes if m != "prenorm"]]  # the deltas are against prenorm
    rows = []
    for m in modes:
        rows.append(count_mode(m, args.device, 4 if args.smoke else None, steps, warmup))
        if cuda:
            torch.cuda.empty_cache()
    base = rows[0]
    gpu_cols = ("step_ms", "step_ms_check_ids", "host_ms", "host_fwd_ms", "host_bwd_ms", "host_opt_ms", "tok_per_s",
                "sync_calls")
    cols = [*TOTALS, *(gpu_cols if cuda else ())]
    print(f"{'mode':<16}" + "".join(f"{k:>{len(k) + 2}}" for k in cols))
    for row in rows:
        print(f"{row['mode']:<16}" + "".join(f"{row[k]:>{len(k) + 2}.1f}" if isinstance(row[k], float)
                                             else f"{row[k]:>{len(k) + 2}}" for k in cols))
    if cuda:
        for row in rows:
            print(f"{row['mode']}: allocator {row['allocator']}, sync calls {row['sync_calls_by']}")
    for row in rows[1:]:
        row["vs_prenorm"] = d = deltas(row, base)
        print(f"\n{row['mode']} - prenorm ({row['reads']} reads): "
              + ", ".join(f"{k} {d[k]['delta']:+.4g} ({d[k]['per_read']:+.2f}/read)" for k in TOTALS))
        for k, top in d["by"].items():
            print(f"  {k}: " + ", ".join(f"{n} {v:+d}" for n, v in top.items()))
    if args.out:
        meta = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__, "device": args.device,
                "gpu": torch.cuda.get_device_name() if cuda else None, "shrink": None if cuda else SHRINK,
                "steps": steps, "warmup": warmup}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
