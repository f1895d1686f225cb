"""Host (CPU-side) cost of one AttnRes read of gpu-small's residual stream, with the kernels stubbed.

gpu-small on the H200 is host-bound (kernels/results/count_step_ops_h200.json), so what one read of the
residual stream costs the host (Python, autograd, allocations, launch arguments) shows in tokens/s. This
tool runs the stream's read/write pattern alone: an ``AttnResidual`` of ``--d-model`` (512) over
``--sublayers`` (24) sublayers plus the final read, under bf16 autocast, with an fp32 embedding and bf16
sublayer outputs (each sublayer a cheap stand-in, ``h.bf16() * w_l``, the same in every mode) at a few
tokens, so that tensors cost nothing. The Triton launches of the fused op are replaced by no-op stubs
(``stubbed``: the call ``kernel[grid](...)`` still happens, Triton's own launch work and the interpreter
do not), so only our host path is timed; the counts run with ``count_step_ops``' hooks. Per mode, per read:

* ``fwd_us``: host time in the stream's reads and writes (the op's forward, its stubbed launch included);
* ``bwd_us``: host time in the op's backward (``_DepthAttentionFn.backward``, stubbed launch included);
* ``step_us``: a whole forward + backward of the pattern, minus prenorm's (what autograd's engine,
  ``Function.apply`` and the AccumulateGrad of the queries add too);
* ``py_calls``: Python calls of a forward + backward (cProfile) over prenorm's; ``attnres_py_calls``:
  those of functions in ``moelab/model/attnres.py`` and ``moelab/ops/attnres.py``;
* ``aten_ops``: aten ops dispatched in a forward + backward over prenorm's (by op in ``by``).

Times are CPU time of the thread (``time.thread_time``: what the host spends, not the time others'
processes take it away), the least over ``--rounds`` x ``--steps`` steps (a shared host adds noise, never removes work),
per read (``sublayers + 1`` reads per step).

    python kernels/attnres_host.py [--modes block_attnres:8 full_attnres] [--out kernels/results/x.json]
    python kernels/attnres_host.py --smoke   # 3 steps, 8 sublayers
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import platform
import pstats
import subprocess
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kernels.count_step_ops import _attnres_function, _CountOps, _Hooks, attnres_host_time, parse_mode  # noqa: E402
from moelab.model.attnres import AttnResidual  # noqa: E402
from moelab.model.config import ResidualConfig  # noqa: E402

MODES = ("prenorm", "block_attnres:8", "full_attnres")


@contextlib.contextmanager
def stubbed(on: bool = True):
    """Every Triton kernel's launch returns at once (the kernel object's class, interpreter or JIT)."""
    if not on:
        yield
        return
    from moelab.ops.attnres import _attnres_fwd_kernel

    cls = type(_attnres_fwd_kernel)
    saved = cls.run
    cls.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        cls.run = saved


class Pattern:
    """The read/write pattern of a residual mode: ``n_sub`` stand-in sublayers ``v_l = bf16(h_l) * w_l``
    between the stream's reads, then the final read; ``step`` runs it forward and backward."""

    def __init__(self, spec: str, d_model: int, n_sub: int, tokens: int, device: str) -> None:
        mode, blocks = parse_mode(spec)
        cfg = ResidualConfig(mode=mode, num_blocks=blocks or 1, backend="triton")
        self.res = AttnResidual(d_model, n_sub, cfg).to(device)
        self.w = [torch.randn(d_model, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(n_sub)]
        self.emb = torch.randn(1, tokens, d_model, device=device, requires_grad=True)
        self.n_sub, self.device = n_sub, device
        self.params = [self.emb, *self.w, *self.res.parameters()]

    def forward(self) -> torch.Tensor:
        with torch.autocast(self.device, dtype=torch.bfloat16):
            stream = self.res.stream(self.emb * 1.0)
            for i in range(self.n_sub):
                h = stream.read(i)
                stream.write(i, h.to(torch.bfloat16) * self.w[i])
            return stream.read_final().float().sum()

    def step(self) -> None:
        self.forward().backward()
        for p in self.params:
            p.grad = None


def times(pat: Pattern, steps: int) -> dict[str, float]:
    """Least seconds over ``steps`` steps: in the reads and writes (``fwd``), in the op's backward (``bwd``)
    and of the whole step (``step``)."""
    best = {"fwd": float("inf"), "bwd": float("inf"), "step": float("inf")}
    with attnres_host_time(time.thread_time) as acc:
        for _ in range(steps):
            before = dict(acc)
            t0 = time.thread_time()
            pat.step()
            best["step"] = min(best["step"], time.thread_time() - t0)
            for k in ("fwd", "bwd"):
                best[k] = min(best[k], acc[k] - before[k])
    return best


def counts(pat: Pattern) -> dict:
    """Python calls (in all, and by function of the AttnRes files) and aten ops of one step."""
    prof = cProfile.Profile()
    prof.enable()
    pat.step()
    prof.disable()
    stats = pstats.Stats(prof).stats
    attnres = collections.Counter()
    for k, v in stats.items():
        if (name := _attnres_function(k)) is not None:
            attnres[name] += v[1]
    ops = _CountOps()
    with _Hooks(ops=ops).installed(), ops:
        pat.step()
    return {"py_calls_total": sum(v[1] for v in stats.values()), "attnres_py_calls": sum(attnres.values()),
            "aten_ops_total": sum(ops.counts.values()),
            "by": {"attnres_py_calls": dict(attnres.most_common()), "aten_ops": dict(ops.counts)}}


def measure(specs: list[str], d_model: int, n_sub: int, tokens: int, steps: int, rounds: int, device: str) -> list:
    """One row per mode: times (least over ``rounds`` x ``steps`` steps, the modes taking turns so that a
    busy spell of the host hits them alike) per read, and the counts of one step."""
    pats = {m: Pattern(m, d_model, n_sub, tokens, device) for m in specs}
    best = {m: {"fwd": float("inf"), "bwd": float("inf"), "step": float("inf")} for m in specs}
    rows = []
    with stubbed(device == "cpu"):
        for pat in pats.values():
            for _ in range(3):
                pat.step()
        for _ in range(rounds):
            for m, pat in pats.items():
                for k, v in times(pat, steps).items():
                    best[m][k] = min(best[m][k], v)
        for m, pat in pats.items():
            us = 1e6 / (n_sub + 1)
            rows.append({"mode": m, "reads": n_sub + 1, "fwd_us": best[m]["fwd"] * us, "bwd_us": best[m]["bwd"] * us,
                         "step_total_us": best[m]["step"] * 1e6, **counts(pat)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="*", default=list(MODES[1:]), help="AttnRes modes (prenorm is the base)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--sublayers", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50, help="timed steps per mode and round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the modes taking turns")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="8 sublayers, 3 steps (a quick check)")
    ap.add_argument("--out", default=None, help="write the rows to this JSON")
    args = ap.parse_args()
    if args.smoke:
        args.sublayers, args.steps, args.rounds = 8, 3, 1
    specs = ["prenorm", *[m for m in args.modes if m != "prenorm"]]
    rows = measure(specs, args.d_model, args.sublayers, args.tokens, args.steps, args.rounds, args.device)
    base = rows[0]
    for row in rows[1:]:
        r = row["reads"]
        row["step_us"] = (row["step_total_us"] - base["step_total_us"]) / r
        row["py_calls"] = (row["py_calls_total"] - base["py_calls_total"]) / r
        row["aten_ops"] = (row["aten_ops_total"] - base["aten_ops_total"]) / r
        diff = collections.Counter(row["by"]["aten_ops"])
        diff.subtract(base["by"]["aten_ops"])
        row["by"]["aten_ops_vs_prenorm"] = {k: v for k, v in diff.most_common() if v}
        print(f"{row['mode']:<16} per read: fwd {row['fwd_us']:.1f} us, bwd {row['bwd_us']:.1f} us, "
              f"step +{row['step_us']:.1f} us, py_calls +{row['py_calls']:.1f} ({row['attnres_py_calls'] / r:.1f} "
              f"in attnres), aten_ops +{row['aten_ops']:.2f} {row['by']['aten_ops_vs_prenorm']}")
    if args.out:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        meta = {"command": "python " + " ".join(sys.argv), "commit": commit, "torch": torch.__version__,
                "device": args.device, "machine": f"{platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}",
                "d_model": args.d_model, "sublayers": args.sublayers, "tokens": args.tokens, "steps": args.steps,
                "rounds": args.rounds}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
