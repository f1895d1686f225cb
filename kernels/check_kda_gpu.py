"""Check moelab's Triton chunked KDA against the fp32 token-by-token reference on a GPU.

Real sizes in bf16 (what training uses): forward output, final state and every gradient (q, k, v, g, beta,
initial_state) of both modes, compared with ``rel_err`` = RMS(ref - out) / RMS(ref). Targets: o and final state <=
5e-3, gradients <= 1e-2. Then the gate computed inside the op (``gate="bounded"`` / ``"softplus"`` from the raw input z
with ``A_log`` and ``dt_bias``): the gradients of z, A_log and dt_bias against the fp32 chain rule through
``naive_kda_gate`` on the recurrence's dg, beside fla's ``chunk_kda`` with the same in-kernel gate on the same inputs
when fla is importable; target: moelab's error <= fla's for each of them (without fla: <= GATE_TOL). Then packed
documents (``cu_seqlens``, B = 1, uneven lengths including an empty and a one-token document, an initial state per
document) against each document's own recurrence, same targets. Prints tables (each row with its wall time and the time
since the start, so a run cut short still shows how far it got), writes JSON to ``--out`` after every row and exits 1
on any failure (or non-finite value). ``--part`` runs one of the three parts alone. ``--part backends`` (not in
``all``; ``kernels/kda_backends.py``) checks and times every KDA backend (triton, cudnn, fla) side by side.

    python kernels/check_kda_gpu.py --out kernels/results/kda_check_h200.json
    python kernels/check_kda_gpu.py --part gate --commit <sha> --out /tmp/kda_gate.json   # one part alone
    python kernels/check_kda_gpu.py --smoke --out /tmp/kda_check.json   # CPU, Triton interpreter
    python kernels/check_kda_gpu.py --smoke --emulate-bf16 --out /tmp/kda_bf16.json   # CPU, bf16 rounding

The reference is the fp32 token-by-token recurrence (TF32 off) on the bf16-rounded inputs, so only the kernel's own
rounding is measured: forward ``naive_recurrent_kda``, backward its hand-written reverse-time adjoint
(``recurrent_reference``): autograd through the token loop would materialize a full-size gradient for every ``x[:, t]``
slice, O(T^2) memory traffic. Every run first checks that adjoint against autograd at a small size.

``--emulate-bf16`` (CPU only) estimates the GPU's bf16 error before spending GPU time: the interpreter cannot run bf16
products, so the inputs stay fp32 (bf16-rounded) while every intermediate the GPU stores in bf16 is stored in bf16
(round-to-nearest-even, patched into the interpreter's conversion, which truncates), bf16 product operands are rounded
to bf16 and TF32 ones truncated to TF32 before an fp32 product, and o and the gradients are rounded to bf16 at the end.
Truncation, not rounding, because Triton hands fp32 registers to the TF32 tensor-core products, which read their top 19
bits: with truncation the emulation reproduced the H200's errors of the gate rows on the same inputs (o, dz, dA_log,
ddt_bias; issue 14), with rounding it did not.

fla autotunes each kernel over all its configs at every new autotune key (mostly H, K, V and the dtypes): its op's
backward and forward run about 14 autotuned kernels with 6-36 configs each, each config compiled, which took over 4
minutes for the kda bench's first shape on the H200. So by
default every fla autotuner here keeps only the first config its own pruning leaves (``pin_autotuners``): one
compilation per kernel and key. A config sets fla's tiling and launch, so fla's errors change at most by fp32 summation
order; ``--fla-full-autotune`` restores the search. The JSON records which was used (``meta.fla_autotune``)."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys
import time
import zlib
from collections.abc import Callable

import torch

if not torch.cuda.is_available():  # must precede the first @triton.jit of moelab's kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moelab.ops.kda.gate import naive_kda_gate  # noqa: E402
from moelab.ops.kda.naive import naive_recurrent_kda  # noqa: E402
from moelab.tracking import git_commit  # noqa: E402

os.environ.setdefault("FLA_FLASH_KDA", "0")  # fla's own kernels, not the FlashKDA hand-off (bench_kda.py)
try:
    from fla.ops.kda import chunk_kda as fla_chunk_kda  # noqa: E402
except Exception as exc:  # fla-core is optional: the gate rows then use GATE_TOL
    fla_chunk_kda = None
    print(f"fla not importable ({type(exc).__name__}: {exc}); gate gradients checked against GATE_TOL only")

O_TOL, GRAD_TOL = 5e-3, 1e-2
# Bound on the gate-parameter gradients when fla (the bar they must meet) is not installed: each is a
# sum over B*T tokens of per-token terms, so it carries the per-token error and any bias in it.
GATE_TOL = 5e-2
NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
GATE_NAMES = ["o", "dz", "dA_log", "ddt_bias"]
GATE_RULE = ("dz, dA_log, ddt_bias: moelab rel_err <= fla's on the same inputs (no slack); o: <= max(fla's, O_TOL); "
             "without fla: <= GATE_TOL (o: O_TOL); a row where an installed fla fails is a failure")
PARTS = ("main", "gate", "packed")
START = time.perf_counter()


def stamp() -> str:
    """Wall clock and seconds since the script started, for progress lines."""
    return f"[{datetime.datetime.now():%H:%M:%S} +{time.perf_counter() - START:.0f}s]"


def timed(dev: str, fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """``(fn(*args, **kwargs), seconds)``, the GPU's queued work included."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if dev == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _first_config(prune: Callable[..., list], *args, **kwargs) -> list:
    return prune(*args, **kwargs)[:1]


def pin_autotuners(package: str) -> int:
    """Make every Triton autotuner in the imported modules of ``package`` keep only the first config its
    own pruning leaves, so a new key compiles one config instead of benchmarking all. Returns how many."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction, KernelInterface

    pinned = set()
    for name, mod in list(sys.modules.items()):
        if name != package and not name.startswith(package + "."):
            continue
        for obj in list(getattr(mod, "__dict__", {}).values()):
            while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):  # heuristics wrap autotune
                if isinstance(obj, Autotuner) and id(obj) not in pinned:
                    pinned.add(id(obj))
                    obj.prune_configs = functools.partial(_first_config, obj.prune_configs)
                obj = getattr(obj, "fn", None)
    return len(pinned)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(ref - out) / RMS(ref) in fp64 (same definition as tests/helpers.py); inf if out is not finite."""
    if not torch.isfinite(out).all():
        return float("inf")
    ref, out = ref.double(), out.double()
    den = ref.pow(2).mean().sqrt().item()
    num = (ref - out).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


G_MIN = -5.0  # the bounded inputs' floor, and the bound bounded mode is told


def g_min_for(mode: str) -> float | None:
    """The ``g_min`` to call ``chunk_kda`` with in ``mode`` (general mode takes no bound)."""
    return G_MIN if mode == "bounded" else None


def make_inputs(B, T, H, D, gate, h0, dtype, dev, seed):
    """q, k L2-normalized (as the layer feeds them); gate 'bounded': g = G_MIN sigmoid(z);
    gate 'softplus': g = -exp(A) softplus(z), A_log = log U(1, 16) (reaches g ~ -50)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1)
    v = rnd(B, T, H, D)
    z = rnd(B, T, H, D)
    if gate == "bounded":
        g = G_MIN * torch.sigmoid(z)
    else:
        a = torch.empty(H).uniform_(1, 16, generator=gen)
        g = -a[:, None] * torch.nn.functional.softplus(z)
    beta = torch.sigmoid(rnd(B, T, H))
    s0 = rnd(B, H, D, D) if h0 else None
    do = rnd(B, T, H, D)
    dS = rnd(B, H, D, D)
    ins = [x.to(dev, dtype) for x in (q, k, v, g, beta)]
    return ins, (s0.to(dev) if h0 else None), do.to(dev), dS.to(dev)


def recurrent_reference(q, k, v, g, beta, s0, do, dS, scale=None):
    """fp32 outputs and gradients of loss = <o, do> + <S_T, dS> by the token recurrence.

    Forward ``S_t = (I - b_t k_t k_t^T) Diag(e^{g_t}) S_{t-1} + b_t k_t v_t^T``, ``o_t = scale S_t^T q_t``;
    backward walks t = T..1 with the stored states. Returns [o, S_T, dq, dk, dv, dg, dbeta(, dh0)]."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, V) if s0 is None else s0.float().clone()
    states = [S]
    o = q.new_empty(B, T, H, V)
    for t in range(T):
        Sa = S * g[:, t].exp()[..., None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], Sa)
        u = beta[:, t, :, None] * (v[:, t] - pred)
        S = Sa + k[:, t, :, :, None] * u[:, :, None, :]
        o[:, t] = scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        states.append(S)
    dq, dk, dv, dg = (torch.empty_like(x) for x in (q, k, v, g))
    db = torch.empty_like(beta)
    dS_t = dS.float().clone()
    for t in reversed(range(T)):
        S_t, S_prev = states[t + 1], states[t]
        dS_t = dS_t + scale * q[:, t, :, :, None] * do[:, t, :, None, :]
        dq[:, t] = scale * torch.einsum("bhkv,bhv->bhk", S_t, do[:, t])
        eg = g[:, t].exp()
        Sa = S_prev * eg[..., None]
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], Sa)
        u = beta[:, t, :, None] * (v[:, t] - pred)
        du = torch.einsum("bhkv,bhk->bhv", dS_t, k[:, t])
        dk_t = torch.einsum("bhkv,bhv->bhk", dS_t, u)
        db[:, t] = (du * (v[:, t] - pred)).sum(-1)
        dv[:, t] = beta[:, t, :, None] * du
        dpred = -beta[:, t, :, None] * du
        dSa = dS_t + k[:, t, :, :, None] * dpred[:, :, None, :]
        dk[:, t] = dk_t + torch.einsum("bhkv,bhv->bhk", Sa, dpred)
        dg[:, t] = (dSa * Sa).sum(-1)
        dS_t = dSa * eg[..., None]
    return [o, states[-1], dq, dk, dv, dg, db] + ([dS_t] if s0 is not None else [])


@triton.jit
def _emulated_cast(x, DOT_BF16: tl.constexpr):
    """Stand-in for triton_common._cast under --emulate-bf16: round, then multiply in fp32."""
    if DOT_BF16:
        return x.to(tl.bfloat16).to(tl.float32)
    else:  # TF32: the top 19 bits (10-bit mantissa), the rest dropped
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        return (bits & 0xFFFFE000).to(tl.float32, bitcast=True)


def emulate_bf16():
    """Patch the interpreter and moelab's operand cast so fp32 runs round like the bf16 GPU path
    (see the module docstring); returns chunk_kda. Must run before moelab's kernels are imported."""
    import numpy as np
    import triton.runtime.interpreter as interp

    convert = interp._convert_float

    def rne(data, src, dst, rounding):
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32)).bfloat16()
            return t.view(torch.int16).numpy().view(np.uint16)
        return convert(data, src, dst, rounding)

    interp._convert_float = rne
    from moelab.ops.kda import triton_common

    triton_common._cast = _emulated_cast
    from moelab.ops.kda import triton_chunk

    triton_chunk._dot_bf16 = lambda dtype: True
    triton_chunk._work_dtype = lambda dtype: torch.bfloat16
    # the fast path's TF32 products, not the fp32 inputs' IEEE ones: the kernels round some TF32
    # operands themselves (triton_common._tf32) only off the IEEE path
    triton_chunk._ieee = lambda dtype: False

    def chunk_kda(*args, **kw):
        o, S = triton_chunk.chunk_kda(*args, **kw)
        return _RoundGrad.apply(o), S

    return chunk_kda


class _RoundGrad(torch.autograd.Function):
    """Identity that rounds the value and the incoming gradient's consumers' view to bf16: o is
    bf16 on the GPU, and so are dq, dk, dv, dg, dbeta (rounded in fwd_bwd)."""

    @staticmethod
    def forward(ctx, x):
        return x.bfloat16().float()

    @staticmethod
    def backward(ctx, dx):
        return dx


def fwd_bwd(fn, ins, s0, do, dS, round_grads=False, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in ins]
    s = s0.detach().clone().requires_grad_() if s0 is not None else None
    o, S = fn(*leaves, initial_state=s, output_final_state=True, **kw)
    ((o.float() * do).sum() + (S * dS).sum()).backward()
    grads = [x.grad.bfloat16() if round_grads else x.grad for x in leaves]
    outs = [o.detach(), S.detach()] + grads + ([s.grad] if s is not None else [])
    return [x.float() for x in outs]


def self_check(dev: str) -> float:
    """Largest rel_err of recurrent_reference vs autograd through naive_recurrent_kda (fp32, small)."""
    ins, s0, do, dS = make_inputs(2, 50, 2, 16, "bounded", True, torch.float32, dev, seed=123)
    auto = fwd_bwd(naive_recurrent_kda, ins, s0, do, dS)
    manual = recurrent_reference(*ins, s0, do, dS)
    return max(rel_err(a, m) for a, m in zip(auto, manual))


def packed_reference(ins, s0, do, dS, cu):
    """``recurrent_reference`` of each document ``[cu[n], cu[n+1])`` on its own (s0, dS ``[N, H, K, V]``),
    joined: tokens along T, states along N (an empty document passes its state and dS through)."""
    parts = []
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        doc = [x[:, a:b] for x in ins]
        parts.append(recurrent_reference(*doc, s0[n:n + 1], do[:, a:b], dS[n:n + 1]))
    return [torch.cat([p[i] for p in parts], dim=0 if i in (1, 7) else 1) for i in range(len(parts[0]))]


TOLS = {n: (O_TOL if n in ("o", "final_state") else GRAD_TOL) for n in NAMES}


def _compare(chunk_kda, ins, s0, do, dS, ref, mode, emulate, dev, case, **kw):
    """Errors of one ``chunk_kda`` run in ``mode`` against ``ref``, printed as a table row; the row dict."""
    out, sec = timed(dev, fwd_bwd, chunk_kda, ins, s0, do, dS, round_grads=emulate, mode=mode, g_min=g_min_for(mode),
                     **kw)
    errs = {n: rel_err(r, o) for n, r, o in zip(NAMES, ref, out)}
    tol = {n: TOLS[n] for n in errs}
    passed = all(errs[n] <= tol[n] for n in errs)
    print(f"{case:34s} {mode:8s} " + " ".join(f"{errs.get(n, float('nan')):11.2e}" for n in NAMES)
          + ("  ok  " if passed else "  FAIL") + f" {sec:6.1f}s {stamp()}", flush=True)
    return dict(mode=mode, dtype="bf16 (emulated)" if emulate else str(ins[0].dtype), errors=errs, tolerances=tol,
                passed=passed, seconds=sec)


def check_main(chunk_kda, cases, dtype, dev, emulate, rows, save) -> bool:
    """Fixed-length cases of both modes vs ``recurrent_reference`` (computed once per case); appends to ``rows``."""
    print(f"\nfixed length, rel_err vs the fp32 recurrence {stamp()}")
    print(f"{'case':34s} {'mode':8s} " + " ".join(f"{n:>11s}" for n in NAMES) + "  status   time")
    ok = True
    for i, (B, T, H, D, gate, h0) in enumerate(cases):
        ins, s0, do, dS = make_inputs(B, T, H, D, gate, h0, dtype, dev, seed=i)
        if emulate:
            ins = [x.bfloat16().float() for x in ins]
        with torch.no_grad():
            ref, sec = timed(dev, recurrent_reference, *ins, s0, do, dS)
        case = f"B{B} T{T} H{H} D{D} {gate} gate{' h0' if h0 else ''}"
        print(f"{case:34s} reference {sec:.1f}s {stamp()}", flush=True)
        for mode in (["bounded", "general"] if gate == "bounded" else ["general"]):
            row = _compare(chunk_kda, ins, s0, do, dS, ref, mode, emulate, dev, case)
            ok &= row["passed"]
            rows.append(dict(B=B, T=T, H=H, D=D, gate=gate, initial_state=h0, reference_seconds=sec, **row))
            save()
        del ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return ok


def check_packed(chunk_kda, cases, dtype, dev, emulate, rows, save) -> bool:
    """Packed documents through ``chunk_kda(cu_seqlens=...)`` vs ``packed_reference``; appends to ``rows``."""
    print(f"\npacked documents (cu_seqlens), rel_err vs each document's recurrence {stamp()}")
    print(f"{'case':34s} {'mode':8s} " + " ".join(f"{n:>11s}" for n in NAMES) + "  status   time")
    ok = True
    for i, (lens, H, D, gate) in enumerate(cases):
        T, N = sum(lens), len(lens)
        ins, _, do, _ = make_inputs(1, T, H, D, gate, False, dtype, dev, seed=200 + i)
        gen = torch.Generator(device="cpu").manual_seed(300 + i)
        s0, dS = (torch.randn(N, H, D, D, generator=gen).to(dev) for _ in range(2))
        if emulate:
            ins = [x.bfloat16().float() for x in ins]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        with torch.no_grad():
            ref, sec = timed(dev, packed_reference, ins, s0, do, dS, cu)
        case = f"T{T} N{N} H{H} D{D} {gate} gate h0"
        print(f"{case:34s} reference {sec:.1f}s {stamp()}", flush=True)
        for mode in (["bounded", "general"] if gate == "bounded" else ["general"]):
            row = _compare(chunk_kda, ins, s0, do, dS, ref, mode, emulate, dev, case,
                           cu_seqlens=torch.tensor(cu, device=dev, dtype=torch.int32))
            ok &= row["passed"]
            rows.append(dict(lengths=lens, H=H, D=D, gate=gate, reference_seconds=sec, **row))
            save()
        del ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return ok


def make_gate_inputs(B, T, H, D, dtype, dev, seed):
    """q, k L2-normalized, v, beta, the gate input z ``[B, T, H, D]`` in ``dtype``; A_log = log U(1, 16)
    ``[H]`` and dt_bias ~ 0.5 N(0, 1) ``[H*D]`` fp32 (as the layer keeps them); do, dS fp32."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1)
    k = torch.nn.functional.normalize(rnd(B, T, H, D), dim=-1)
    v, z = rnd(B, T, H, D), rnd(B, T, H, D)
    beta = torch.sigmoid(rnd(B, T, H))
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    dt_bias = 0.5 * rnd(H * D)
    do, dS = rnd(B, T, H, D), rnd(B, H, D, D)
    ins = [x.to(dev, dtype) for x in (q, k, v, z, beta)]
    return ins, A_log.to(dev), dt_bias.to(dev), do.to(dev), dS.to(dev)


def gate_reference(ins, A_log, dt_bias, gate, do, dS):
    """fp32 ``[o, dz, dA_log, ddt_bias]``: the recurrence's dg pulled back through ``naive_kda_gate``."""
    q, k, v, z, beta = (x.float() for x in ins)
    z, A_log, dt_bias = (x.detach().clone().requires_grad_() for x in (z, A_log, dt_bias))
    g = naive_kda_gate(z, A_log, gate, g_min_for("bounded") if gate == "bounded" else None, dt_bias)
    with torch.no_grad():
        o, _, _, _, _, dg, _ = recurrent_reference(q, k, v, g, beta, None, do, dS)
    dz, dA, ddt = torch.autograd.grad(g, (z, A_log, dt_bias), dg)
    return [o, dz, dA, ddt]


def gate_run(fn, ins, A_log, dt_bias, do, dS, round_z_grad=False, **kw):
    """``[o, dz, dA_log, ddt_bias]`` of ``fn`` (moelab's or fla's chunk_kda) with the gate in the op."""
    q, k, v, z, beta = (x.detach().clone().requires_grad_() for x in ins)
    A, dt = (x.detach().clone().requires_grad_() for x in (A_log, dt_bias))
    o, S = fn(q, k, v, z, beta, A_log=A, dt_bias=dt, output_final_state=True, **kw)
    ((o.float() * do).sum() + (S.float() * dS).sum()).backward()
    dz = z.grad.bfloat16() if round_z_grad else z.grad  # z is bf16 on the GPU, so is its gradient
    return [x.float() for x in (o.detach(), dz, A.grad, dt.grad)]


def check_gate_grads(chunk_kda, cases, dtype, dev, emulate, rows, save, fla=None) -> bool:
    """Gate-parameter gradient errors of moelab and of ``fla`` (fla's ``chunk_kda``, or None: GATE_TOL) against
    one reference per case on the same inputs (``GATE_RULE``); appends to ``rows``."""
    who = "fla" if fla is not None else f"tol {GATE_TOL:g}"
    print(f"\ngate inside the op: moelab rel_err (bar: {who}) {stamp()}")
    print(f"{'case':28s} {'mode':8s} " + " ".join(f"{n:>19s}" for n in GATE_NAMES) + "  status")
    ok = True
    for B, T, H, D, gate in cases:
        # The seed follows from the case, not its position: reordering or subsetting keeps each case's inputs.
        seed = zlib.crc32(repr((B, T, H, D, gate)).encode()) % 2**31
        ins, A_log, dt_bias, do, dS = make_gate_inputs(B, T, H, D, dtype, dev, seed=seed)
        if emulate:  # bf16-rounded fp32 values, z a real bf16 tensor as on the GPU (the prep has no products)
            ins = [x.bfloat16().float() for x in ins]
            ins[3] = ins[3].bfloat16()
        case = f"B{B} T{T} H{H} D{D} {gate}"
        mode = "bounded" if gate == "bounded" else "general"
        seconds = {}
        ref, seconds["reference"] = timed(dev, gate_reference, ins, A_log, dt_bias, gate, do, dS)
        print(f"{case:28s} reference {seconds['reference']:.1f}s {stamp()}", flush=True)
        out, seconds["moelab"] = timed(dev, gate_run, chunk_kda, ins, A_log, dt_bias, do, dS, round_z_grad=emulate,
                                       mode=mode, gate=gate, g_min=g_min_for(mode))
        print(f"{case:28s} moelab {seconds['moelab']:.1f}s {stamp()}", flush=True)
        errs = {n: rel_err(r, o) for n, r, o in zip(GATE_NAMES, ref, out)}
        fla_errs, fla_failed = None, None
        if fla is not None:
            kw = dict(use_gate_in_kernel=True, safe_gate=gate == "bounded")
            if gate == "bounded":
                kw["lower_bound"] = G_MIN
            try:
                fla_out, seconds["fla"] = timed(dev, gate_run, fla, ins, A_log, dt_bias, do, dS, **kw)
                fla_errs = {n: rel_err(r, o) for n, r, o in zip(GATE_NAMES, ref, fla_out)}
            except Exception as exc:  # record it and go on: one failing fla call must not hide the other rows
                fla_failed = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(f"{case:28s} fla failed ({fla_failed}); the row fails (a pinned config that does not fit: "
                      "rerun with --fla-full-autotune)", flush=True)
            else:
                print(f"{case:28s} fla {seconds['fla']:.1f}s {stamp()}", flush=True)
        bar = fla_errs or {n: (O_TOL if n == "o" else GATE_TOL) for n in GATE_NAMES}
        passed = (all(errs[n] <= bar[n] for n in GATE_NAMES if n != "o") and errs["o"] <= max(bar["o"], O_TOL)
                  and not fla_failed)
        ok &= passed
        print(f"{case:28s} {mode:8s} " + " ".join(f"{errs[n]:9.2e} ({bar[n]:7.2e})" for n in GATE_NAMES)
              + ("  ok" if passed else "  FAIL") + f" {stamp()}", flush=True)
        rows.append(dict(B=B, T=T, H=H, D=D, gate=gate, mode=mode,
                         dtype="bf16 (emulated)" if emulate else str(dtype), errors=errs,
                         bar="fla" if fla_errs else "tolerance",
                         **({"fla_errors": fla_errs} if fla_errs else {"tolerances": bar}),
                         **({"fla_failed": fla_failed} if fla_failed else {}), passed=passed, seconds=seconds))
        save()
        del ref, out
        if dev == "cuda":
            torch.cuda.empty_cache()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="kernels/results/kda_check.json", help="JSON output path")
    ap.add_argument("--part", choices=("all",) + PARTS + ("backends",), default="all",
                    help="main: fixed-length o/state/gradients; gate: gate-parameter gradients beside fla's; "
                         "packed: cu_seqlens documents; all: the three in that order; backends: every KDA "
                         "backend (triton, cudnn, fla) against the reference and timed (kernels/kda_backends.py)")
    ap.add_argument("--commit", default=git_commit(),
                    help="the moelab commit being checked, for the JSON (default: git rev-parse HEAD here)")
    ap.add_argument("--fla-full-autotune", action="store_true",
                    help="let fla autotune over all its configs (default: the first config left by its pruning)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU in the Triton interpreter")
    ap.add_argument("--emulate-bf16", action="store_true", help="CPU only: emulate the GPU's bf16 rounding")
    ap.add_argument("--variant", default="", metavar="KEY=VALUE,...",
                    help="the training op's kernel variants, as triton_chunk.launch_overrides keywords, e.g. "
                         "chains=serial,forward=infer (default: the op's own)")
    ap.add_argument("--launch", default="", metavar="KERNEL=BLOCK,WARPS,STAGES;...", help="triton_chunk.LAUNCH "
                    "entries to check instead of the defaults (a candidate before it becomes one), e.g. dqkg=32,1,2")
    args = ap.parse_args()
    if args.emulate_bf16 and torch.cuda.is_available():
        ap.error("--emulate-bf16 is for CPU runs; on the GPU the real bf16 path runs")
    parts = PARTS if args.part == "all" else (args.part,)
    if args.emulate_bf16:
        chunk_kda = emulate_bf16()
    else:
        from moelab.ops.kda.triton_chunk import chunk_kda
    from moelab.ops.kda import triton_chunk as chunk_module  # after emulate_bf16(), which patches it first

    try:
        variant = dict(item.split("=", 1) for item in args.variant.split(",") if item)
        launch = chunk_module.parse_launch(args.launch)
        with chunk_module.launch_overrides(launch=launch, **variant):
            variant = dict(chunk_module.VARIANT)
    except (TypeError, ValueError) as exc:
        ap.error(f"--variant {args.variant!r} / --launch {args.launch!r}: {exc}")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fla_autotune = None
    if fla_chunk_kda is not None and dev == "cuda" and ("gate" in parts or "backends" in parts):
        if args.fla_full_autotune:
            fla_autotune = "full (fla's own search over all configs)"
        else:
            fla_autotune = f"first config left by fla's pruning, {pin_autotuners('fla')} autotuners pinned"
        print(f"fla autotune: {fla_autotune}", flush=True)
    if args.emulate_bf16:
        dtype = torch.float32  # bf16-rounded values; the emulation rounds the rest
        cases = [(1, 300, 2, 64, "bounded", True), (1, 200, 1, 128, "bounded", False),
                 (1, 300, 2, 64, "softplus", True)]
        gate_cases = [(1, 300, 2, 64, "bounded"), (1, 300, 2, 64, "softplus")]
        packed_cases = [([130, 0, 1, 64, 105], 2, 64, "bounded")]
    elif args.smoke:
        dtype = torch.float32 if dev == "cpu" else torch.bfloat16  # the interpreter gets bf16 wrong
        cases = [(1, 100, 2, 32, "bounded", False), (1, 70, 1, 32, "bounded", True), (1, 90, 1, 32, "softplus", False)]
        gate_cases = [(1, 100, 2, 32, "bounded"), (1, 90, 1, 32, "softplus")]
        packed_cases = [([65, 0, 1, 64, 70], 1, 32, "bounded"), ([40, 1, 0, 60], 1, 32, "softplus")]
    else:
        dtype = torch.bfloat16
        cases = [(2, 4096, 16, 128, "bounded", False), (2, 1000, 16, 128, "bounded", False),
                 (2, 1000, 16, 128, "bounded", True), (2, 2048, 16, 128, "softplus", True)]
        # the shapes where the gate gradients were found least accurate (odd T: a padded last chunk)
        gate_cases = [(2, 4097, 16, 128, "bounded"), (4, 1000, 6, 64, "bounded"), (2, 2048, 16, 128, "softplus"),
                      (1, 4097, 4, 256, "softplus")]
        # 6 uneven documents per row, one empty and one of a single token
        packed_cases = [([3000, 0, 1, 64, 1777, 3350], 16, 128, "bounded"),
                        ([1000, 1, 2047, 0, 63, 985], 16, 128, "softplus")]
    # backends: issue 37's accuracy shapes, then its timing shapes
    backend_cases = ([(1, 40, 2, 32)], [(1, 64, 2, 32)]) if args.smoke or args.emulate_bf16 else (
        [(1, 2048, 4, 128), (2, 1024, 8, 128)], [(8, 4096, 16, 128), (1, 32768, 16, 128), (2, 65536, 16, 128)])
    ref_err = self_check(dev)
    print(f"reference adjoint vs autograd: max rel_err {ref_err:.2e} {stamp()}", flush=True)
    if ref_err > 1e-5:
        print("FAILURES: the reference adjoint disagrees with autograd")
        return 1
    meta = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (triton interpreter)",
                emulate_bf16=args.emulate_bf16, parts=list(parts), commit=args.commit,
                torch=torch.__version__, triton=triton.__version__,
                fla=getattr(sys.modules.get("fla"), "__version__", None), fla_autotune=fla_autotune,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                command=" ".join(sys.argv), reference_self_check=ref_err, gate_rule=GATE_RULE, variant=variant,
                launch={name: list(chunk_module.LAUNCH[name]) for name in sorted(chunk_module.LAUNCH)} | launch,
                complete=False, passed=None)
    result = dict(meta=meta, rows=[], gate_rows=[], packed_rows=[], backend_rows=[])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after every row: a run cut short by a time limit keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    # fla's kernels need a GPU: on CPU the gate rows are held to GATE_TOL
    gate_check = functools.partial(check_gate_grads, fla=fla_chunk_kda if dev == "cuda" else None)
    def backends_check(chunk_kda, part_cases, dtype, dev, emulate, rows, save) -> bool:
        import kda_backends  # kernels/ is the script's directory

        fla = fla_chunk_kda if dev == "cuda" else None
        ok = kda_backends.check_accuracy(part_cases[0], dtype, dev, rows, save, fla=fla,
                                         recurrent_reference=recurrent_reference, rel_err=rel_err)
        kda_backends.check_timing(part_cases[1], dtype, dev, rows, save, fla=fla)
        return ok

    checks = dict(main=(check_main, cases, "rows"), gate=(gate_check, gate_cases, "gate_rows"),
                  packed=(check_packed, packed_cases, "packed_rows"),
                  backends=(backends_check, backend_cases, "backend_rows"))
    ok = True
    with chunk_module.launch_overrides(launch=launch, **variant):
        for part in parts:
            check, part_cases, key = checks[part]
            ok &= check(chunk_kda, part_cases, dtype, dev, args.emulate_bf16, result[key], save)
    meta.update(complete=True, passed=ok, seconds=time.perf_counter() - START)
    save()
    print(("ALL PASSED" if ok else "FAILURES") + f" ({', '.join(parts)}); wrote {args.out} {stamp()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
