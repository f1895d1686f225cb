"""Compile moelab's KDA Triton kernels for Hopper (sm_90a) on any machine, no GPU needed, and
print registers, spill bytes and shared memory per kernel (ptxas -v).

A register-pressure proxy for kernel work on a CPU-only machine: a kernel that spills here will spill on the
H200 too (it runs Triton 3.6; codegen differs in detail between versions: directional, time on the GPU).

    python kernels/aot_kda.py                       # every kernel at its LAUNCH config, bf16, D = 128
    python kernels/aot_kda.py --only dqkg wy --cfg dqkg=64,4,1
    python kernels/aot_kda.py --infer --maxnreg 128  # the inference forward's kernels at their launches, then capped
    python kernels/aot_kda.py --conv --cfg bwd=64,128,4  # the ShortConv kernels (rows, channels, warps[, stages])"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real JIT functions, not interpreted ones

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moelab.ops import short_conv as SC  # noqa: E402
from moelab.ops.kda import infer_plan as P  # noqa: E402
from moelab.ops.kda import triton_bwd as B  # noqa: E402
from moelab.ops.kda import triton_chunk as tc  # noqa: E402
from moelab.ops.kda import triton_fwd as F  # noqa: E402
from moelab.ops.kda import triton_infer as I  # noqa: E402

WORK = ["kd", "w", "u", "hbuf", "U", "qg", "Aqk", "o", "do", "dhbuf"]  # work dtype (bf16 for bf16 inputs)
FP32 = "gl h0 hT dht dU dh0 Gbuf Abuf dAs dkb dbv dbk dG dGl dbs dAp dbp".split()
INPUT = ["q", "k", "v", "g", "beta", "dq", "dk", "dv", "dg", "dbeta"]  # (with GATE, dg holds dL/dz: z's dtype)


def compile_one(kernel, consts: dict, warps: int, stages: int, dtype: str = "bf16",
                maxnreg: int | None = None, sig: dict[str, str] | None = None) -> str:
    """ptxas -v of ``kernel`` for sm_90a: registers, spills, shared memory; ``sig`` (argument -> Triton type,
    constexprs left out) replaces the KDA kernels' naming rules below."""
    if sig is not None:
        sig = {n: "constexpr" if n in consts else sig[n] for n in kernel.arg_names}
        return _ptxas(kernel, sig, consts, warps, stages, maxnreg)
    ptrs = {n: "*" + dtype for n in WORK + INPUT}
    ptrs.update({n: "*fp32" for n in FP32})
    ptrs["coff"] = "*i32"  # the packed documents' chunk offsets (state kernels)
    # the inference forward's own names: its gate input z, fp16 (I + L)^-1 Diag(beta), the segmented path's fp32
    # [A | B] and start states, int32 offsets and orders
    ptrs.update(z="*" + dtype, ab="*fp16" if dtype == "bf16" else "*fp32", A_log="*fp32", dt_bias="*fp32",
                M="*fp32", S0="*fp32", **{n: "*i32" for n in ("cu", "order", "soff")})
    if consts.get("G_IN"):
        ptrs["g"] = "*fp32"  # g holds the chunk-local G the prep wrote (fp32)
    sig = {}
    for n in kernel.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
        elif n in ("T", "NBH", "NC", "NS", "N", "H"):
            sig[n] = "i32"
        elif n in ("scale", "mid", "g_min", "eps"):
            sig[n] = "fp32"
        else:
            raise KeyError(f"no signature type for argument {n!r} of {kernel.__name__}")
    return _ptxas(kernel, sig, consts, warps, stages, maxnreg)


def _ptxas(kernel, sig: dict[str, str], consts: dict, warps: int, stages: int, maxnreg: int | None) -> str:
    # 16-byte aligned pointers, as the JIT specializes them at run time (without the hint loads are
    # not vectorized and the register counts come out too high)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    opts = dict(num_warps=warps, num_stages=stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cands = (os.path.join(bindir, "ptxas-blackwell"), os.path.join(bindir, "ptxas"))
    ptxas = next(p for p in cands if os.path.exists(p))
    res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    info = " | ".join(line.split(":", 1)[-1].strip() for line in res.stderr.splitlines()
                      if "spill" in line or "registers" in line)
    return f"{info} | smem {compiled.metadata.shared} B" if res.returncode == 0 else res.stderr[-400:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", help="kernel names (LAUNCH keys)")
    ap.add_argument("--cfg", nargs="*", default=[], help="NAME=block,warps,stages overrides")
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--infer", action="store_true", help="the inference forward's kernels (triton_infer) instead")
    ap.add_argument("--conv", action="store_true", help="the ShortConv kernels (--cfg fwd= / bwd= / slide=)")
    ap.add_argument("--maxnreg", type=int, nargs="*", default=[],
                    help="--infer: also compile every kernel at these register caps (0: uncapped)")
    args = ap.parse_args()
    cfgs = {name: tuple(int(x) for x in val.split(",")) for name, val in (item.split("=") for item in args.cfg)}
    if args.infer:
        return infer_main(args.K, args.maxnreg)
    if args.conv:
        return conv_main(cfgs)
    base = dict(H=16, K=args.K, V=args.K, C=64)
    bf = dict(DOT_BF16=True, IEEE=False)
    st = dict(base, HAS_H0=True, STORE_HT=True, VARLEN=False, **bf)  # the state kernel's
    # (kernel, constexprs as the op launches them for bf16 inputs, block parameter, mode: the gate's, or "out" for
    # the state kernel forming the output itself); kktr reads
    # the prep's G (fp32) in bounded mode and forms G itself in general mode
    kernels = {
        "kktr": [(F._kda_fwd_kkt_row, dict(base, BC=16, BOUNDED=m, IEEE=False, G_IN=m), "BK", m)
                 for m in (True, False)],
        "merge": [(F._kda_fwd_merge, dict(base, BC=16), None, None)],
        "wu": [(F._kda_fwd_wu, dict(base, BV=64, IEEE=False), "BK", None)],
        "state": [(F._kda_fwd_state, dict(st, OUT=out, STORE=not out), "BV", "out" if out else None) for out in (0, 1)],
        "state_small": [(F._kda_fwd_state, dict(st, OUT=out, STORE=not out), "BV", "out" if out else None)
                        for out in (0, 1)],
        "out": [(F._kda_fwd_out, dict(base, **bf), "BV", None)],
        "dh": [(B._kda_bwd_dh, dict(base, HAS_DHT=True, STORE_DH0=True, VARLEN=False, **bf), "BV", None)],
        "wy": [(B._kda_bwd_wy, dict(base, BV=64, **bf), "BK", None)],
        "sterm": [(B._kda_bwd_sterm, dict(base, BV=64, **bf), "BK", None)],
        "dqkg": [(B._kda_bwd_dqkg, dict(base, BC=16, BOUNDED=m, IEEE=False), "BK", m) for m in (True, False)],
        "dg": [(B._kda_bwd_dg, dict(base, GATE=gt, HAS_BIAS=gt > 0), "BK", "gate" if gt else None) for gt in (0, 1)],
        "dqkg_dg": [(B._kda_bwd_dqkg_dg, dict(base, BC=16, BOUNDED=m, IEEE=False, GATE=1, HAS_BIAS=True), "BK", m)
                    for m in (True, False)],
    }
    with tc.launch_overrides(launch=cfgs):
        for name, variants in kernels.items():
            if args.only and name not in args.only:
                continue
            size, warps, stages = tc.LAUNCH[name]
            for kernel, consts, block, bounded in variants:
                if block is not None:
                    consts = dict(consts, **{block: min(size, args.K)})
                tag = "" if bounded is None else (f" {bounded}" if isinstance(bounded, str) else
                                                   (" bounded" if bounded else " general"))
                blk = f"{block}={consts[block]}" if block is not None else "all-K"
                cap = tc.MAXNREG.get(name)  # the launch's register cap, as the real launch applies it
                capped = f" maxnreg={cap}" if cap else ""
                print(f"{name:11s}{tag:9s} {blk} warps={warps} stages={stages}{capped}: "
                      f"{compile_one(kernel, consts, warps, stages, maxnreg=cap)}", flush=True)
    return 0


def conv_main(cfgs: dict[str, tuple[int, ...]]) -> int:
    """The ShortConv kernels (W 4, bf16 x, fp32 weight) with and without SiLU and document positions, at
    ``short_conv.LAUNCH`` / ``SLIDE_LAUNCH`` or the ``--cfg fwd=rows,channels,warps`` / ``bwd=...`` /
    ``slide=rows,channels,warps,stages`` given: the forward, the tile backward the op runs at W 4 without
    ``BWD_SLIDE`` (``bwd``), and the one-pass backward (``slide``)."""
    bwd = SC._conv_bwd4_kernel if SC.BWD_TAPS4 else SC._conv_bwd_kernel
    for which, kernel in (("fwd", SC._conv_fwd_kernel), ("bwd", bwd), ("slide", SC._conv_bwd_slide_kernel)):
        bt, bc, warps, *stages = cfgs.get(which, SC.SLIDE_LAUNCH if which == "slide" else SC.LAUNCH[which])
        for silu in (True, False):
            for pos in (False, True):
                sig = {n: {"x": "*bf16", "y": "*bf16", "dy": "*bf16", "dx": "*bf16", "w": "*fp32", "dw": "*fp32",
                           "pos": "*i32"}.get(n, "i32") for n in kernel.arg_names}
                full = dict(BT=bt, BC=bc, SILU=silu, HAS_POS=pos, W=4, STAGES=(*stages, 1)[0])
                consts = {k: v for k, v in full.items() if k in sig}
                print(f"conv {which} {bt}x{bc} warps={warps} silu={int(silu)} pos={int(pos)}: "
                      f"{compile_one(kernel, consts, warps, 1, sig=sig)}", flush=True)
    return 0


def infer_main(K: int, caps: list[int]) -> int:
    """The inference forward's kernels for bf16 inputs at head dim K, L2 norm, bounded gate and beta sigmoid in the
    op: the intra kernel (fixed-length rows and packed documents) at ``infer_plan.LAUNCH["intra"]``, and the
    recurrence at each ``LAUNCH["recur"]`` block of 32 or more columns in its four uses (fixed-length rows, packed
    documents, the segmented path's phase 1 and phase 3), each at its launch's register cap; then everything again
    at each cap of ``caps`` (0: uncapped)."""
    Kp = max(16, triton.next_power_of_2(K))
    intra = dict(K=K, BK=Kp, C=P.CHUNK, LOG_N=1, VARLEN=False, GATE=1, HAS_BIAS=True, SILU=False, L2NORM=True,
                 BETA_SIGMOID=True, IEEE=False)
    recur = dict(K=K, V=K, BK=Kp, BVF=Kp, C=P.CHUNK, HAS_H0=False, STORE_HT=True, DOT_BF16=True, IEEE=False,
                 ORDER=False, AUG=False, STORE_O=True, VARLEN=False)
    uses = {"fixed": {}, "packed": dict(VARLEN=True, ORDER=True), "phase 1": dict(VARLEN=True, AUG=True, STORE_O=False),
            "phase 3": dict(VARLEN=True, HAS_H0=True)}
    warps, stages = P.LAUNCH["intra"]
    for cap in [None, *caps]:  # None: each launch's own cap
        capped = "" if cap is None else f" maxnreg={cap or 'none'}"
        for use, extra in (("fixed", {}), ("packed", dict(VARLEN=True, LOG_N=3))):
            print(f"infer intra {use:6s} warps={warps}{capped}: "
                  f"{compile_one(I._kda_infer_intra, dict(intra, **extra), warps, stages, maxnreg=cap)}", flush=True)
        for BV, w, st, _, own in P.LAUNCH["recur"]:
            if BV < 32 or BV > Kp:
                continue
            reg = own if cap is None else cap
            for use, extra in uses.items():
                print(f"infer recur {use:8s} {BV}/{w}/{st}{f' maxnreg={reg}' if reg else ''}: "
                      f"{compile_one(I._kda_infer_recur, dict(recur, BV=BV, **extra), w, st, maxnreg=reg)}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
