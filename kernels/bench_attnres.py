"""Benchmark: the AttnRes depth aggregation (one read of the residual stream) forward and
forward+backward on one GPU, in one run: moelab's fused op, today's plain PyTorch path, fla's op.

    python kernels/bench_attnres.py                 # GPU: writes kernels/results/attnres_h200.json
    python kernels/bench_attnres.py --sweep         # also times a few launch configs of the fused op
    python kernels/bench_attnres.py --smoke         # CPU (Triton interpreter), tiny sizes, prints only

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

from moelab.model.attnres import DepthAttention  # noqa: E402
from moelab.ops.attnres import LaunchConfig, depth_attention, depth_attention_torch, launch_config  # noqa: E402
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


def _sweep_configs(D: int) -> list[LaunchConfig]:
    """A few launches around the default (programs_per_sm 0: as many as fit at once)."""
    return [LaunchConfig(rows, warps, pps) for rows, warps in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16))
            for pps in (0, 2, 4) if rows * triton.next_power_of_2(D) >= 32 * warps]


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
    ap.add_argument("--out", default=None, help="JSON path (GPU default: kernels/results/attnres_h200.json)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--sources", default="4,9,17", help="comma-separated L values")
    ap.add_argument("--no-mixed", action="store_true", help="skip the rows with an fp32 source 0")
    ap.add_argument("--sweep", action="store_true", help="also time the fused op under a few launch configs")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.tokens, args.d_model, args.sources = 37, 72, "1,3"
    elif not cuda:
        ap.error("no CUDA device: use --smoke for the CPU run")
    dev = "cuda" if cuda else "cpu"
    N, D = args.tokens, args.d_model
    Ls = [int(x) for x in args.sources.split(",")]
    fla_fn, fla_err = _fla() if cuda else (None, "not run on CPU")
    rows, sweep = [], []
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
            if args.sweep and not mixed:
                for cfg in _sweep_configs(D)[:2] if args.smoke else _sweep_configs(D):
                    row = _run_impl("moelab_fused", _impls(None, cfg)["moelab_fused"], srcs, q, w, dh, ref, cuda)
                    row.update(rows_per_tile=cfg.rows, warps=cfg.warps, programs_per_sm=cfg.programs_per_sm)
                    sweep.append(row)
                    print("sweep", json.dumps(row))
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
                                                       programs_per_sm=cfg.programs_per_sm),
                timing="triton.testing.do_bench median, warmup 25 ms, rep 200 ms; grads set to None each step",
                tolerances=dict(h=OUT_TOL, grads=GRAD_TOL), anchors_fwdbwd_ms=ANCHORS_FWDBWD_MS,
                target="moelab_fused fwd+bwd >= 5x faster than torch_plain and at least the faster fla row's speed",
                target_met=bool(summary) and all(
                    line.get("fwdbwd_speedup_vs_torch_plain", 0) >= 5
                    and line.get("fwdbwd_speedup_vs_fla_best", 1) >= 1 for line in summary),
                all_ok=all(r.get("ok", False) for r in rows + sweep if r["impl"].startswith("moelab")))
    out = args.out or (None if args.smoke else os.path.join(ROOT, "kernels", "results", "attnres_h200.json"))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows, summary=summary, sweep=sweep), fh, indent=1)
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
