"""Benchmark: the whole LatentMoE layer (router, dispatch, grouped experts, combine, shared experts)
forward+backward in bf16 on one GPU, against dense matmul chains of equal FLOPs, in one run.

    python kernels/bench_moe.py                  # GPU: writes kernels/results/moe_h200.json
    python kernels/bench_moe.py --smoke          # CPU, tiny sizes, prints only (add --out to write)

Default problem (the issue): 32768 tokens, d_model 1024, 64 routed experts top-8, latent 512, expert
width 512, 2 shared experts of width 512 (fused into one GLU FFN of width 1024), SiTU-GLU, dispatch
"grouped". Parameters and activations bf16; router scores, top-k and weights fp32.

FLOPs: matmul FLOPs of the forward (2 per multiply-add): router d*E, W_down d*l, experts
k*(l*2f + f*l), W_up l*d, shared d*2S + S*d, per token (``LatentMoE.matmul_flops``); fwd+bwd counts
3x that. Elementwise work (activation, norm, sort, gather, combine) is not counted: it is overhead.

Rows (every one timed forward+backward w.r.t. every input and weight, and forward alone):
  moelab_moe            the layer.
  dense_equal_flops     THE TARGET BASELINE. The layer's matmul chain with the same (M, K, N) shapes
                        and FLOPs as plain dense bf16 matmuls, WITH the same GLU activation (same
                        kernel) between the two matmuls of each GLU pair: router x[N,d]W[d,E];
                        W_down x[N,d]W[d,l]; experts a[N k,l]W[l,2f] -> GLU -> [N k,f]W[f,l]; W_up
                        z[N,l]W[l,d]; shared x[N,d]W[d,2S] -> GLU -> [N,S]W[S,d]. This is the anchor's
                        "dense_equal_flops" (its grouped-GEMM benchmark) for the whole layer:
                        no routing, dispatch, combine or norm.
  dense_bare_matmuls    the same GEMMs with no activation: the pure matmul speed of those shapes.
  experts_grouped_only  the routed experts alone through grouped GEMM + activation on the layer's own
                        routing (the anchor's "grouped"): what the experts cost without the layer around.
  experts_dense_only    the expert chain alone as dense matmuls + activation (the anchor's dense row).
  dense_ffn_equal_flops one dense [N, d] x [d, F] x [F, d] chain (no activation) of the layer's FLOPs.
  moelab_moe_fp32_params_autocast  (extra) the layer as trained: fp32 parameters, bf16 autocast.
``extra.ratios`` holds moelab_moe TFLOP/s over each row's; the target is ratio_vs_dense_equal_flops >= 0.70.
``extra.profile`` is a CUDA kernel-time profile of one layer step (grads reset each step, as in the timing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from moelab.model.config import MoEConfig  # noqa: E402
from moelab.model.moe import LatentMoE  # noqa: E402
from moelab.ops.glu import glu  # noqa: E402
from moelab.ops.moe import _grouped_mm_fn, experts_grouped, make_plan  # noqa: E402

TARGET = 0.70


def _bench(fn, grad_to_none: list[torch.Tensor], cuda: bool, reps: int) -> float:
    """Median milliseconds of ``fn``; triton's do_bench on CUDA, a wall-clock median on CPU."""
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")
    times = []
    fn()
    for _ in range(reps):
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time(forward, leaves: list[torch.Tensor], cuda: bool) -> tuple[float, float]:
    """(fwd+bwd ms, fwd ms) of ``forward() -> list of outputs``, backward with fixed random output grads."""
    with torch.no_grad():
        grads = [torch.randn_like(o) for o in forward()]

    def step():
        torch.autograd.backward(forward(), grads)

    def fwd():
        with torch.no_grad():
            forward()

    step()  # the first call autotunes the combine kernels: keep it out of do_bench's runtime estimate
    return _bench(step, leaves, cuda, reps=3), _bench(fwd, [], cuda, reps=3)


def _profile(step, leaves: list[torch.Tensor], cuda: bool, iters: int = 3, top: int = 25) -> list[dict]:
    """Self device time per kernel over ``iters`` steps (CUDA only), largest first, per step."""
    if not cuda:
        return []
    from torch.profiler import ProfilerActivity, profile

    def clean_step():
        for t in leaves:  # as do_bench's grad_to_none: no gradient-accumulation adds in the profile
            t.grad = None
        step()

    try:
        clean_step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                clean_step()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0)
            if us > 0:
                rows.append({"kernel": e.key[:120], "us_per_step": us / iters, "calls_per_step": e.count / iters})
        rows.sort(key=lambda r: -r["us_per_step"])
        total = sum(r["us_per_step"] for r in rows)
        print(f"profile: {total / 1e3:.3f} ms of kernel time per step; top kernels:")
        for r in rows[:top]:
            print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:<5g} {r['kernel']}")
        return [{"total_kernel_ms_per_step": total / 1e3}] + rows[:top]
    except Exception as exc:  # the profile is a diagnostic; never lose the timings for it
        print(f"profile failed: {exc!r}")
        return [{"error": repr(exc)[:300]}]


def _dense_chain(links: list[tuple], dev, dtype, activation, act_args) -> tuple:
    """Leaves and forward of independent dense chains.

    links: ``(M, K, N)`` for one matmul, or ``(M, K, 2F, F, N)`` for matmul -> GLU (when
    ``activation``; else a second independent matmul ``[M, F] x [F, N]``) -> matmul.
    """
    leaves, chains = [], []
    for link in links:
        m, k, n = link[0], link[1], link[2]
        a = torch.randn(m, k, device=dev, dtype=dtype, requires_grad=True)
        w = (torch.randn(k, n, device=dev, dtype=dtype) / k ** 0.5).requires_grad_()
        leaves += [a, w]
        if len(link) == 3:
            chains.append((a, w, None, None))
            continue
        f, n2 = link[3], link[4]
        w2 = (torch.randn(f, n2, device=dev, dtype=dtype) / f ** 0.5).requires_grad_()
        mid = None if activation else torch.randn(m, f, device=dev, dtype=dtype, requires_grad=True)
        leaves += [w2] + ([mid] if mid is not None else [])
        chains.append((a, w, w2, mid))

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

    flops = 0
    for link in links:
        flops += 2 * link[0] * link[1] * link[2] + (2 * link[0] * link[3] * link[4] if len(link) == 5 else 0)
    return leaves, forward, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, no JSON unless --out")
    ap.add_argument("--out", default=None, help="JSON path (GPU default: kernels/results/moe_h200.json)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--expert-dim", type=int, default=512)
    ap.add_argument("--num-shared", type=int, default=2)
    ap.add_argument("--shared-dim", type=int, default=0, help="0: expert_dim")
    ap.add_argument("--activation", default="situ_glu", choices=["situ_glu", "swiglu"])
    ap.add_argument("--dispatch", default=None, choices=["auto", "grouped", "loop"],
                    help="default: grouped on GPU, auto in --smoke")
    ap.add_argument("--no-fused", action="store_true", help="plain PyTorch layer (the reference path)")
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        args.tokens, args.d_model, args.experts, args.top_k = 512, 64, 8, 2
        args.latent, args.expert_dim = 32, 32
    args.dispatch = args.dispatch or ("auto" if args.smoke else "grouped")
    if not cuda and not args.smoke:
        sys.exit("no CUDA device: run with --smoke on CPU")
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)

    cfg = MoEConfig(num_experts=args.experts, top_k=args.top_k, num_shared=args.num_shared,
                    latent_dim=args.latent, expert_dim=args.expert_dim, shared_dim=args.shared_dim,
                    activation=args.activation, dispatch=args.dispatch, backend="torch" if args.no_fused else "auto")
    moe = LatentMoE(args.d_model, cfg, norm_eps=1e-6).to(dev, dtype)
    fused = not args.no_fused and cuda
    n, d = args.tokens, args.d_model
    r, f, k, e = moe.routed_dim, args.expert_dim, args.top_k, args.experts
    act_args = (cfg.situ_beta1, cfg.situ_beta2, cfg.backend)
    x = torch.randn(1, n, d, device=dev, dtype=dtype, requires_grad=True)
    moe_leaves = [x, *moe.parameters()]
    flops = moe.matmul_flops(n)

    with torch.no_grad():
        stats = moe(x)[1]
    load = stats.tokens_per_expert.float()
    max_vio = ((load.max() - load.mean()) / load.mean()).item()
    grouped = moe.use_grouped(dev, dtype)

    rows, common = [], dict(tokens=n, experts=e, top_k=k, d_model=d, latent_dim=args.latent, expert_dim=f,
                            num_shared=args.num_shared, shared_dim=moe.shared_width if args.num_shared else 0)

    def add_row(impl, fl, ms_fb, ms_f, **kw):
        rows.append(dict(impl=impl, **common, gflop_fwd=fl / 1e9, fwdbwd_ms=ms_fb, tflops=3 * fl / ms_fb / 1e9,
                         fwd_ms=ms_f, fwd_tflops=fl / ms_f / 1e9, **kw))
        print(f"{impl:>22}: fwd+bwd {ms_fb:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s   "
              f"fwd {ms_f:7.3f} ms {rows[-1]['fwd_tflops']:7.1f} TFLOP/s   ({fl / 1e9:.1f} GFLOP fwd)", flush=True)

    ms_fb, ms_f = _time(lambda: [moe(x)[0]], moe_leaves, cuda)
    add_row("moelab_moe", flops, ms_fb, ms_f, dispatch=args.dispatch, grouped_gemm=grouped,
            activation=args.activation, fused=fused)

    if cuda:  # the training setting: fp32 parameters and input (the pre-norm output), bf16 autocast
        moe32 = LatentMoE(args.d_model, cfg, norm_eps=1e-6).to(dev)
        x32 = x.detach().float().requires_grad_()

        def forward32():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return [moe32(x32)[0]]

        add_row("moelab_moe_fp32_params_autocast", flops, *_time(forward32, [x32, *moe32.parameters()], cuda),
                note="extra, not a target row: fp32 master weights, router exact fp32 GEMMs")

    # The layer's matmul chain as dense matmuls: with the GLU (target), then bare.
    links = [(n, d, e)]
    if moe.latent:
        links += [(n, d, r), (n, r, d)]
    links.append((n * k, r, 2 * f, f, r))
    if moe.shared is not None:
        s = moe.shared.d_hidden
        links.append((n, d, 2 * s, s, d))
    for impl, activation in (("dense_equal_flops", args.activation), ("dense_bare_matmuls", None)):
        leaves, forward, fl = _dense_chain(links, dev, dtype, activation, act_args)
        assert fl == flops, (impl, fl, flops)
        add_row(impl, fl, *_time(forward, leaves, cuda), activation=activation or "none",
                gemm_links=[list(lk) for lk in links])

    # The routed experts alone: grouped GEMM on the layer's routing, and the same chain dense.
    plan = make_plan(stats.topk_idx, stats.tokens_per_expert)
    xs = torch.randn(n * k, r, device=dev, dtype=dtype, requires_grad=True)
    w_in = moe.w_in.detach().clone().requires_grad_()
    w_out = moe.w_out.detach().clone().requires_grad_()
    expert_flops = 2 * n * k * 3 * r * f
    if grouped:
        ms = _time(lambda: [experts_grouped(xs, w_in, w_out, plan.offs, args.activation, *act_args)],
                   [xs, w_in, w_out], cuda)
        add_row("experts_grouped_only", expert_flops, *ms, activation=args.activation)
    leaves, forward, fl = _dense_chain([(n * k, r, 2 * f, f, r)], dev, dtype, args.activation, act_args)
    add_row("experts_dense_only", fl, *_time(forward, leaves, cuda), activation=args.activation)

    f_ffn = max(128, round(flops / (4 * n * d) / 128) * 128)
    xa = torch.randn(n, d, device=dev, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(d, f_ffn, device=dev, dtype=dtype) / d ** 0.5).requires_grad_()
    w2 = (torch.randn(f_ffn, d, device=dev, dtype=dtype) / f_ffn ** 0.5).requires_grad_()
    add_row("dense_ffn_equal_flops", 4 * n * d * f_ffn, *_time(lambda: [(xa @ w1) @ w2], [xa, w1, w2], cuda),
            ffn_dim=f_ffn, activation="none")

    profile = [] if args.no_profile else _profile(lambda: moe(x)[0].backward(torch.ones_like(x)), moe_leaves, cuda)

    by = {row["impl"]: row for row in rows}
    moe_tf = by["moelab_moe"]["tflops"]
    ratios = {f"ratio_vs_{name}": moe_tf / row["tflops"] for name, row in by.items()
              if not name.startswith("moelab_moe")}
    if "experts_grouped_only" in by:  # the anchor's read-off: grouped experts vs the same chain dense
        ratios["experts_grouped_over_experts_dense"] = (by["experts_grouped_only"]["tflops"]
                                                        / by["experts_dense_only"]["tflops"])
    gm = _grouped_mm_fn()
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu (smoke)", torch=torch.__version__,
                triton=_triton_version(), date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv), dtype=str(dtype).replace("torch.", ""),
                grouped_mm=getattr(gm, "__module__", "none") + "." + getattr(gm, "__name__", "none") if gm else "none",
                flops="matmul FLOPs only; fwd+bwd = 3 x fwd",
                timing="triton.testing.do_bench median, warmup 25 ms, rep 200 ms; grads set to None before each step",
                target=f"moelab_moe TFLOP/s >= {TARGET:.0%} of dense_equal_flops TFLOP/s",
                target_baseline="dense_equal_flops",
                target_baseline_definition="the layer's matmuls (same M, K, N and FLOPs) as dense bf16 matmuls, "
                                           "with the same GLU activation kernel between the two matmuls of each "
                                           "GLU pair (as the anchor's dense_equal_flops); no routing/dispatch/norm",
                target_met=ratios.get("ratio_vs_dense_equal_flops", 0.0) >= TARGET)
    extra = dict(ratios=ratios, routing_max_vio=max_vio, profile=profile)

    print("; ".join(f"{key} = {val:.1%}" for key, val in ratios.items()))
    print(f"target: ratio_vs_dense_equal_flops >= {TARGET:.0%}: {'MET' if meta['target_met'] else 'NOT MET'}; "
          f"routing MaxVio {max_vio:.2f}; grouped GEMM: {grouped}")

    out = args.out or (None if args.smoke else os.path.join(ROOT, "kernels", "results", "moe_h200.json"))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(dict(meta=meta, rows=rows, extra=extra), fh, indent=1)
        print("wrote", out)


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "none"


if __name__ == "__main__":
    main()
