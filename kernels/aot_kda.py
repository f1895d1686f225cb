"""Compile moelab's KDA Triton kernels for Hopper (sm_90a) on any machine, no GPU needed, and
print registers, spill bytes and shared memory per kernel (ptxas -v).

A register-pressure proxy for kernel work on a CPU-only machine: a kernel that spills here will
spill on the H200 too (the H200 runs Triton 3.6; codegen differs in detail between versions, so
treat it as directional and time on the GPU).

    python kernels/aot_kda.py                       # every kernel at its LAUNCH config, bf16, D = 128
    python kernels/aot_kda.py --only dqkg wy --cfg dqkg=64,4,1
"""

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

from moelab.ops.kda import triton_bwd as B  # noqa: E402
from moelab.ops.kda import triton_chunk as tc  # noqa: E402
from moelab.ops.kda import triton_fwd as F  # noqa: E402

WORK = ["kd", "w", "u", "hbuf", "U", "qg", "Aqk", "o", "do", "dhbuf"]  # work dtype (bf16 for bf16 inputs)
FP32 = ["gl", "h0", "hT", "dht", "dU", "dh0", "Gbuf", "Abuf", "dAs", "dkb", "dbv", "dbk", "dG", "dGl", "dbs"]
INPUT = ["q", "k", "v", "g", "beta", "dq", "dk", "dv", "dg", "dbeta"]


def compile_one(kernel, consts: dict, warps: int, stages: int, dtype: str = "bf16",
                maxnreg: int | None = None) -> str:
    ptrs = {n: "*" + dtype for n in WORK + INPUT}
    ptrs.update({n: "*fp32" for n in FP32})
    ptrs["coff"] = "*i32"  # the packed documents' chunk offsets (state kernels)
    if consts.get("G_IN"):
        ptrs["g"] = "*fp32"  # g holds the chunk-local G the prep wrote (fp32)
    sig = {}
    for n in kernel.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
        elif n in ("T", "NBH"):
            sig[n] = "i32"
        elif n in ("scale", "mid"):
            sig[n] = "fp32"
        else:
            raise KeyError(f"no signature type for argument {n!r} of {kernel.__name__}")
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
    args = ap.parse_args()
    cfgs = {}
    for item in args.cfg:
        name, val = item.split("=")
        cfgs[name] = tuple(int(x) for x in val.split(","))
    base = dict(H=16, K=args.K, V=args.K, C=64)
    bf = dict(DOT_BF16=True, IEEE=False)
    # (kernel, constexprs as the op launches them for bf16 inputs, block parameter, mode); kktr reads
    # the prep's G (fp32) in bounded mode and forms G itself in general mode
    kernels = {
        "kktr": [(F._kda_fwd_kkt_row, dict(base, BC=16, BOUNDED=m, IEEE=False, G_IN=m), "BK", m)
                 for m in (True, False)],
        "merge": [(F._kda_fwd_merge, dict(base, BC=16), None, None)],
        "wu": [(F._kda_fwd_wu, dict(base, BV=64, IEEE=False), "BK", None)],
        "state": [(F._kda_fwd_state, dict(base, HAS_H0=True, STORE_HT=True, VARLEN=False, **bf), "BV", None)],
        "state_small": [(F._kda_fwd_state, dict(base, HAS_H0=True, STORE_HT=True, VARLEN=False, **bf), "BV", None)],
        "out": [(F._kda_fwd_out, dict(base, **bf), "BV", None)],
        "dh": [(B._kda_bwd_dh, dict(base, HAS_DHT=True, STORE_DH0=True, VARLEN=False, **bf), "BV", None)],
        "wy": [(B._kda_bwd_wy, dict(base, BV=64, **bf), "BK", None)],
        "sterm": [(B._kda_bwd_sterm, dict(base, BV=64, **bf), "BK", None)],
        "dqkg": [(B._kda_bwd_dqkg, dict(base, BC=16, BOUNDED=m, IEEE=False), "BK", m) for m in (True, False)],
        "dg": [(B._kda_bwd_dg, dict(base), "BK", None)],
    }
    with tc.launch_overrides(launch=cfgs):
        for name, variants in kernels.items():
            if args.only and name not in args.only:
                continue
            size, warps, stages = tc.LAUNCH[name]
            for kernel, consts, block, bounded in variants:
                if block is not None:
                    consts = dict(consts, **{block: min(size, args.K)})
                tag = "" if bounded is None else (" bounded" if bounded else " general")
                blk = f"{block}={consts[block]}" if block is not None else "all-K"
                cap = tc.MAXNREG.get(name)  # the launch's register cap, as the real launch applies it
                capped = f" maxnreg={cap}" if cap else ""
                print(f"{name:11s}{tag:9s} {blk} warps={warps} stages={stages}{capped}: "
                      f"{compile_one(kernel, consts, warps, stages, maxnreg=cap)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
