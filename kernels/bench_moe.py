"""Benchmark: the whole LatentMoE layer (router, dispatch, grouped experts, combine, shared experts)
forward+backward in bf16 on one GPU, against dense matmuls of equal FLOPs.

    python kernels/bench_moe.py                  # GPU: writes kernels/results/moe_h200.json
    python kernels/bench_moe.py --smoke          # CPU, tiny sizes, prints only (add --out to write)

Default problem (the brief): 32768 tokens, d_model 1024, 64 routed experts top-8, latent 512, expert
width 512, 2 shared experts of width 512 (K3 has 2 full-width shared experts; the layer fuses them
into one GLU FFN of width 1024), SiTU-GLU, dispatch "grouped". Parameters and activations bf16;
the router computes in fp32 (K3 does).

FLOPs: matmul FLOPs of the forward (2 per multiply-add): router d*E, W_down d*l, experts
k*(l*2f + f*l), W_up l*d, shared d*2S + S*d, per token (``LatentMoE.matmul_flops``); fwd+bwd counts
3x that. Elementwise work (activation, norm, sort, gather, combine) is not counted: it is overhead.

Rows:
  moelab_moe         the layer, forward + backward w.r.t. input and every parameter.
  dense_equal_flops  the layer's GEMMs with the same (M, K, N) shapes, as plain dense bf16 matmuls
                     (expert GEMMs as one [N*k, l] x [l, 2f] and one [N*k, f] x [f, l] matmul), no
                     router math, dispatch, activation or norm: what the layer's FLOPs cost if they
                     were one dense chain. Its TFLOP/s is the target the layer is compared to.
Extra (not a row): ``dense_ffn_equal_flops``, one dense [N, d] x [d, F] x [F, d] chain of the same
FLOPs (F rounded to 128), the speed of a plain dense FFN; and a CUDA kernel-time profile of one
layer step (top kernels), to show where the non-GEMM time goes.
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
from moelab.model.moe import LatentMoE, _grouped_mm_fn  # noqa: E402


def _bench(fn, grad_to_none: list[torch.Tensor], cuda: bool, reps: int) -> float:
    """Median milliseconds of ``fn``; triton's do_bench on CUDA, a wall-clock median on CPU."""
    if cuda:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")
    times = []
    fn()
    for _ in range(reps):
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _profile(step, cuda: bool, iters: int = 3, top: int = 20) -> list[dict]:
    """Self device time per kernel over ``iters`` steps (CUDA only), largest first, per step."""
    if not cuda:
        return []
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                step()
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
    ap.add_argument("--no-fused", action="store_true", help="plain PyTorch gather/combine/activation")
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
                    activation=args.activation, dispatch=args.dispatch)
    moe = LatentMoE(args.d_model, cfg, norm_eps=1e-6).to(dev, dtype)
    if args.no_fused:
        moe.set_fused(False)
    n, d = args.tokens, args.d_model
    x = torch.randn(1, n, d, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(1, n, d, device=dev, dtype=dtype)
    params = [x, *moe.parameters()]
    flops = moe.matmul_flops(n)

    with torch.no_grad():
        load = moe(x)[1].tokens_per_expert.float()
    max_vio = ((load.max() - load.mean()) / load.mean()).item()
    grouped = moe.use_grouped(dev, dtype)

    def moe_step():
        y, _ = moe(x)
        y.backward(dy)

    def moe_fwd():
        with torch.no_grad():
            moe(x)

    ms_fb = _bench(moe_step, params, cuda, reps=5)
    ms_f = _bench(moe_fwd, [], cuda, reps=5)

    # Dense reference: the same GEMM shapes, plain matmuls.
    r, f, k, e = moe.routed_dim, args.expert_dim, args.top_k, args.experts
    shapes = [(n, d, e), (n * k, r, 2 * f), (n * k, f, r)]
    if moe.latent:
        shapes += [(n, d, r), (n, r, d)]
    if moe.shared is not None:
        w = moe.shared.d_hidden
        shapes += [(n, d, 2 * w), (n, w, d)]
    dense_flops = sum(2 * m_ * k_ * n_ for m_, k_, n_ in shapes)
    assert dense_flops == flops, (dense_flops, flops)
    mats = [(torch.randn(m_, k_, device=dev, dtype=dtype).requires_grad_(),
             (torch.randn(k_, n_, device=dev, dtype=dtype) / k_ ** 0.5).requires_grad_()) for m_, k_, n_ in shapes]
    grads = [torch.randn(m_, n_, device=dev, dtype=dtype) for m_, _, n_ in shapes]
    dense_leaves = [t for pair in mats for t in pair]

    def dense_step():
        torch.autograd.backward([a @ b for a, b in mats], grads)

    ms_dense = _bench(dense_step, dense_leaves, cuda, reps=5)
    del mats, grads, dense_leaves

    f_ffn = max(128, round(flops / (4 * n * d) / 128) * 128)
    ffn_flops = 4 * n * d * f_ffn
    xa = torch.randn(n, d, device=dev, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(d, f_ffn, device=dev, dtype=dtype) / d ** 0.5).requires_grad_()
    w2 = (torch.randn(f_ffn, d, device=dev, dtype=dtype) / f_ffn ** 0.5).requires_grad_()
    gffn = torch.randn(n, d, device=dev, dtype=dtype)
    ms_ffn = _bench(lambda: ((xa @ w1) @ w2).backward(gffn), [xa, w1, w2], cuda, reps=5)
    del xa, w1, w2, gffn

    profile = [] if args.no_profile else _profile(moe_step, cuda)

    tf = lambda fl, ms: fl / ms / 1e9  # noqa: E731  FLOP / ms -> TFLOP/s
    common = dict(tokens=n, experts=e, top_k=k, d_model=d, latent_dim=args.latent, expert_dim=f,
                  num_shared=args.num_shared, shared_dim=moe.shared_width if args.num_shared else 0,
                  gflop_fwd=flops / 1e9)
    rows = [
        dict(impl="moelab_moe", **common, fwd_ms=ms_f, fwdbwd_ms=ms_fb, tflops=tf(3 * flops, ms_fb),
             fwd_tflops=tf(flops, ms_f), dispatch=args.dispatch, grouped_gemm=grouped, activation=args.activation,
             fused_kernels=moe.fused if moe.fused is not None else cuda),
        dict(impl="dense_equal_flops", **common, fwdbwd_ms=ms_dense, tflops=tf(3 * dense_flops, ms_dense),
             gemm_shapes_mkn=shapes),
    ]
    ratio = rows[0]["tflops"] / rows[1]["tflops"]
    extra = dict(ratio_moe_over_dense=ratio, routing_max_vio=max_vio,
                 dense_ffn_equal_flops=dict(ffn_dim=f_ffn, gflop_fwd=ffn_flops / 1e9, fwdbwd_ms=ms_ffn,
                                            tflops=tf(3 * ffn_flops, ms_ffn)),
                 profile=profile)
    gm = _grouped_mm_fn()
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu (smoke)", torch=torch.__version__,
                triton=_triton_version(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv), dtype=str(dtype).replace("torch.", ""),
                grouped_mm=getattr(gm, "__module__", "none") + "." + getattr(gm, "__name__", "none") if gm else "none",
                float32_matmul_precision=torch.get_float32_matmul_precision(),
                flops="matmul FLOPs only; fwd+bwd = 3 x fwd")

    for row in rows:
        print(f"{row['impl']:>18}: fwd+bwd {row['fwdbwd_ms']:8.3f} ms  {row['tflops']:7.1f} TFLOP/s"
              + (f"   (fwd {row['fwd_ms']:.3f} ms, {row['fwd_tflops']:.1f} TFLOP/s)" if "fwd_ms" in row else ""))
    ffn = extra["dense_ffn_equal_flops"]
    print(f"{'dense FFN (F=' + str(f_ffn) + ')':>18}: fwd+bwd {ms_ffn:8.3f} ms  {ffn['tflops']:7.1f} TFLOP/s")
    print(f"ratio moelab_moe / dense_equal_flops = {ratio:.1%} (target >= 70%); "
          f"forward GFLOP {flops / 1e9:.1f}; routing MaxVio {max_vio:.2f}; grouped GEMM: {grouped}")

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
