"""Chunked KDA in Triton: public entry ``chunk_kda`` and its autograd Function.

Same semantics as ``naive_recurrent_kda`` (moelab/ops/kda/naive.py)::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

Kernels: triton_prep.py (optional SiLU, q/k L2 norm and gate, fused into the Function),
triton_fwd.py (intra-chunk scores + UT transform, state recurrence, output) and triton_bwd.py
(state-gradient recurrence, per-chunk dA / dv, per-sub-tile dq / dk / dG, reverse cumsum of dg);
the two modes differ only in how the 16x16 diagonal sub-tiles of the gated scores are formed
(``_diag`` in triton_fwd.py, ``_kda_bwd_dqkg`` in triton_bwd.py):

* ``mode="bounded"``: one tensor-core product per sub-tile on ``q exp(G - G_mid)`` and
  ``k exp(G_mid - G)``; exact while ``g >= g_min`` with ``|g_min| * 16 / 2`` inside
  the fp32/bf16 exponent range (``g_min >= bounds.G_MIN_FLOOR``, about -5.5).
* ``mode="general"``: element-wise ``exp(G_i - G_j)`` per position pair, masked to ``i >= j``
  before ``exp``; correct for any ``g <= 0``.

The forward keeps the raw inputs and its intra-chunk intermediates; the backward reruns the prep
and the state kernel (on a second CUDA stream, beside the state-gradient chain). Inputs are
zero-padded (only when needed) to T a multiple of the chunk and K, V powers of two >= 16, so the
kernels need no masks. Packed documents (``cu_seqlens``) are laid out on whole chunks
(``Packing``); only the two state kernels then walk documents (``VARLEN``).
Each kernel runs with one fixed launch config (``LAUNCH``), checked and timed on an H200
(kernels/README.md, "Launch configs"). fp32 inputs take exact fp32 products everywhere (the
reference path); bf16 / fp16 inputs take bf16 / TF32 tensor-core products (the fast path).
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
import triton
from triton.runtime.errors import OutOfResources

from moelab.ops.kda.bounds import G_MIN_FLOOR, SUBTILE, max_safe_g_min
from moelab.ops.kda.gate import check_op_shapes
from moelab.ops.kda.triton_bwd import (
    _kda_bwd_dg,
    _kda_bwd_dh,
    _kda_bwd_dqkg,
    _kda_bwd_dqkg_dg,
    _kda_bwd_sterm,
    _kda_bwd_wy,
)
from moelab.ops.kda.triton_common import LOG2E
from moelab.ops.kda.triton_fwd import (
    _kda_fwd_kkt_row,
    _kda_fwd_merge,
    _kda_fwd_out,
    _kda_fwd_state,
    _kda_fwd_wu,
)
from moelab.ops.kda.triton_prep import _GATE_ID, prep_bwd, prep_fwd, prep_fwd_chunked, prep_fwd_packed
from moelab.ops.varlen import check_cu_seqlens

MODES = ("bounded", "general")
GATES = ("none", "bounded", "softplus")
CHUNK_SIZES = (16, 32, 64)


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Launch configuration per kernel on the GPU: (block size, num_warps, num_stages); the block is
# the K-block (BK) of the intra-chunk and gradient kernels and the V-block (BV) of the others. Fixed,
# not autotuned: with Triton 3.6 on Hopper, configs whose products have a 16- or 32-wide block at
# 4 or 8 warps (warpgroup MMA) were miscompiled in an H200 sweep (illegal memory accesses in the
# dh and gradient kernels; wrong, nondeterministic states in the state kernel; fla excludes the
# same kind of config), and an autotuner would run them. Every entry passed a per-launch or
# end-to-end bf16 check against fp32 and a determinism check, and was the fastest passing one
# where timed (kernels/README.md, "Launch configs"). A block clamped below its entry (small head
# dims) runs at 2 warps (mma.sync, no warpgroup MMA), which passed for every kernel.
# ``launch_overrides`` swaps entries for A/B runs.
LAUNCH: dict[str, tuple[int, int, int]] = {
    "kktr": (32, 1, 1),
    "merge": (0, 1, 1),  # no block: [16, 16] tiles
    "wu": (32, 4, 1),
    "state": (64, 4, 2),
    "out": (64, 4, 1),
    # two stages: the per-chunk loads do not depend on the carried state gradient; at D = 256 they need more shared
    # memory than Hopper has (an H100 check, 272 of 227 KB) and the launcher drops to one (FITTED_STAGES)
    "dh": (64, 8, 2),
    "wy": (64, 4, 1),
    "sterm": (64, 4, 1),
    # two stages pipeline the partner chunks' loads (an H100: the kernel 1.77 -> 1.46 ms at B8 T4096, 7.09 -> 5.91
    # at B2 T65536; kernels/results/kda_candidates.json run 5); its bf16 check passed on the H200
    # (kernels/results/kda_check_h200.json); two warps spill less but took 1.7x the time
    "dqkg": (32, 1, 2),
    "dqkg_dg": (32, 1, 2),  # VARIANTS["dg"] "dqkg": the score kernel per chunk with dg's reverse cumsum, as dqkg
    "dg": (64, 4, 1),
    # the sequential state kernel when B * H * V / 32 <= SMALL_GRID (B1 H16: 64 programs at 32-wide
    # blocks, under one per SM): 16-wide blocks give 128 programs, and two stages prefetch the next
    # chunk's loads, which do not depend on the carried state
    "state_small": (16, 2, 2),
}
SMALL_GRID = 128
# Kernel variants of the op: {switch: choices}, the first the default, measured on the H200 (fwd+bwd, bf16, H16
# D128); ``launch_overrides(**{switch: choice})`` picks another for A/B runs:
# * chains: the backward's two sequential chains (state recompute, state gradient): "concurrent" on two CUDA
#   streams (``_chains``: 1.10x / 1.07x fwd+bwd at B1 T32768 / B2 T65536, on par at B8 T4096) or "serial";
# * forward: the training forward: "train" (the chunk-64 kernels, which keep their intra-chunk intermediates
#   for the backward) or "infer" (bounded mode: the inference forward's kernels, ``infer_plan.kda_infer``,
#   which keep nothing; the backward recomputes the intermediates): slower fwd+bwd, kept as the memory option.
# Timed beside them and removed as slower (kernels/results/kda_candidates.json): a fused gradient kernel (which
# also faulted at its launch entry), a fused intra-chunk kernel and a state-gradient chain with hoisted terms.
# * out: the training forward's output: "split" (``_kda_fwd_out`` after the state kernel, which stores every
#   chunk's entering state and U for it) or "fused" (the state kernel forms each chunk's output itself and stores
#   neither: ~1.5 KB less HBM traffic per token and head at D128, one launch less; more work on the sequential
#   chain). Timed on an H100 (kernels/results/kda_candidates.json, run 4, H16 D128): fused forward 1.80 vs 2.01 ms at
#   B8 T4096, 2.53 vs 2.79 ms at B1 T32768; fwd+bwd 7.80 vs 8.05 and 10.81 vs 11.03 ms. In the same run the state-
#   gradient kernel ("dh") at two stages took fwd+bwd 7.79 / 9.27 ms (one stage: 8.05 / 11.03): both are the defaults.
# * prep: what the backward starts from: "rerun" (the prep and the padding again, from the raw inputs: nothing more kept
#   between the forward and the backward) or "kept" (the forward keeps the prep's padded q, k, v, G (fp32), beta and h0:
#   ~1 KB more per token and head at D128 in bf16, one prep pass less in the backward; on an H100 the rerun's
#   _prep_fwd_chunk took 0.32 ms of 7.63 at B8 T4096 H16, kernels/results/kda_sweep_h200.json, kernel_split_h100).
# * states: the chunk states (``hbuf``) and corrected values (``U``) of the forward's state kernel: "rerun" (the
#   backward's state recompute forms them again) or "kept" (the forward stores them, with the fused output too, and
#   the backward skips the recompute: ~0.75 KB more per token and head at D128 in bf16 kept between the two; on an
#   H100 the recompute's _kda_fwd_state took 0.42 of 7.63 ms at B8 T4096 H16, kernel_split_h100 as above).
# * gate_bwd: where the gate's backward runs: "dg" (the dg kernel turns dg into dL/dz itself and sums dA_log and
#   dt_bias per program: no fp32 dg buffer; calls with padding or packed documents take the prep path) or "prep"
#   (the prep's backward kernel). prep, states and gate_bwd at kept / kept / dg together, fwd+bwd on an H100
#   (session 44, kernels/results/kda_candidates.json run 7; geometric mean of 3 paired passes, 95% CI): 1.085x
#   (1.070-1.100) the rerun / rerun / prep op at B8 T4096, 1.077x (0.935-1.240) at B1 T32768, 1.077x (0.994-1.166)
#   at B2 T65536: each of the 9 passes above 1, one slow pass of the old op widening the long shapes' intervals;
#   peak memory of the op alone 2.7% lower.
# * das: the score gradients dA_qk, dA_kk the wy kernel hands the gated-score kernel (per chunk and head, [2, C, C]):
#   "bf16" for bf16 inputs (half the scratch's traffic; the score kernel's products take them at bf16's 8-bit
#   mantissa instead of TF32's 11; both sides of each dG pair still read the same stored value), or "fp32".
# * du: the gradient of the corrected values, dU [B, T, H, V], that the state-gradient kernel hands the wy kernel:
#   "bf16" for bf16 inputs (half its traffic; its other products take it in bf16 already, only dv = beta Tm^T dU
#   read it in fp32), or "fp32".
# * dg: where dG's reverse cumsum over the chunk (and the gate's backward) runs: "kernel" (``_kda_bwd_dg``, after the
#   score kernel, which stores dG in fp32 for it) or "dqkg" (``_kda_bwd_dqkg_dg``: the score kernel per chunk, its
#   sub-tiles last to first, summing each one's dG as it forms: ~1 KB less traffic per token and head, one launch
#   less, a quarter of the programs, each four times as long, 255 registers with spills): 0.95-0.96x the default at
#   the three shapes on an H100 (kda_candidates.json run 12).
# * dkb: dk's partial sums between the wy, state-term and score kernels ([B, T, H, K], written twice, read twice):
#   "bf16" for bf16 inputs (each partial rounded as dk itself is at the end), or "fp32". das, du, dkb at bf16
#   together, fwd+bwd on an H100 (run 13, 5 paired passes, 95% CI): 1.064x (1.053-1.075) / 1.046x (1.042-1.051) /
#   1.056x (1.054-1.057) the fp32 scratch at B8 T4096 / B1 T32768 / B2 T65536; their bf16 check passed.
VARIANTS: dict[str, tuple[str, ...]] = {"chains": ("concurrent", "serial"), "forward": ("train", "infer"),
                                        "out": ("fused", "split"), "prep": ("kept", "rerun"),
                                        "states": ("kept", "rerun"), "gate_bwd": ("dg", "prep"),
                                        "das": ("bf16", "fp32"), "du": ("bf16", "fp32"),
                                        "dkb": ("bf16", "fp32"), "dg": ("kernel", "dqkg")}
VARIANT: dict[str, str] = {name: choices[0] for name, choices in VARIANTS.items()}  # what the op runs now


def _infer_forward_ok(bounded: bool, prep, g_min: float | None) -> bool:
    """Whether the "infer" forward (``VARIANT["forward"]``) can take this call: bounded mode with a bound
    the inference chunk (16 tokens) holds; other calls keep the training forward."""
    from moelab.ops.kda.infer_plan import CHUNK

    return bounded and prep.gate in ("none", "bounded") and g_min is not None and \
        max_safe_g_min("fp32", CHUNK) <= g_min < 0


# the interpreter: 16-wide blocks so that small test shapes still take the multi-block paths
_INTERP_LAUNCH = (16, 4, 1)
# Register cap per kernel (ptxas ``maxnreg``): the 1-warp kktr takes ~216 registers uncapped; the
# cap trades spills for occupancy.
MAXNREG: dict[str, int] = {"kktr": 168}


def parse_launch(text: str) -> dict[str, list[int]]:
    """``"dqkg=32,1,2;dh=64,8,2"`` -> ``{"dqkg": [32, 1, 2], "dh": [64, 8, 2]}``: ``launch_overrides``' ``launch``
    from a command line (``kernels/check_kda_gpu.py --launch``); the entries are checked there."""
    out = {}
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, cfg = item.partition("=")
        try:
            out[name.strip()] = [int(x) for x in cfg.split(",")]
        except ValueError:
            raise ValueError(f"{item!r} is not allowed: expected KERNEL=BLOCK,WARPS,STAGES (three integers)") from None
    return out


@contextlib.contextmanager
def launch_overrides(launch: dict | None = None, maxnreg: dict | None = None, **variant: str):
    """Run the op with some ``LAUNCH`` / ``MAXNREG`` entries and kernel variants replaced, restored on
    exit (A/B runs and launch-config sweeps, e.g. ``kernels/bench.py --entry kda --base REV``).

    Args:
        launch: ``{kernel: (block, num_warps, num_stages)}`` for kernels named in ``LAUNCH``.
        maxnreg: ``{kernel: registers}`` (32..255) for kernels named in ``LAUNCH``; ``None`` as a
            value removes that kernel's cap.
        variant: ``switch=choice`` for switches of ``VARIANTS`` (e.g. ``chains="serial"``); a None value
            keeps the switch as it is.
    """
    variant = {name: val for name, val in variant.items() if val is not None}
    for name, val in variant.items():
        if name not in VARIANTS:
            raise ValueError(f"variant {name}={val!r} is not allowed: expected a switch of {sorted(VARIANTS)}")
        if val not in VARIANTS[name]:
            raise ValueError(f"{name}={val!r} is not allowed: expected one of {VARIANTS[name]}")
    launch, maxnreg = dict(launch or {}), dict(maxnreg or {})
    for name, cfg in launch.items():
        if name not in LAUNCH or len(cfg) != 3:
            raise ValueError(f"launch entry {name!r}: {cfg!r} is not allowed: expected one of {sorted(LAUNCH)} "
                             f"mapped to (block, num_warps, num_stages)")
    for name, val in maxnreg.items():
        if name not in LAUNCH or not (val is None or 32 <= int(val) <= 255):
            raise ValueError(f"maxnreg entry {name!r}: {val!r} is not allowed: expected one of {sorted(LAUNCH)} "
                             f"mapped to a register count in 32..255 or None")
    saved = dict(LAUNCH), dict(MAXNREG), dict(VARIANT)
    VARIANT.update(variant)
    LAUNCH.update({name: tuple(int(x) for x in cfg) for name, cfg in launch.items()})
    for name, val in maxnreg.items():
        if val is None:
            MAXNREG.pop(name, None)
        else:
            MAXNREG[name] = int(val)
    try:
        yield
    finally:
        for table, old in zip((LAUNCH, MAXNREG, VARIANT), saved):
            table.clear()
            table.update(old)


# Fewer pipeline stages than LAUNCH asks, where the compiled kernel did not fit the GPU's shared memory:
# {(kernel, block, warps, stages asked, K, V, input dtype): stages that fit}.
FITTED_STAGES: dict[tuple, int] = {}


class _Launcher:
    """Launch ``kernel`` with the config ``LAUNCH[name]`` (``_INTERP_LAUNCH`` in the interpreter);
    ``block`` names the kernel's block-size parameter (``BK`` or ``BV``).

    A multi-stage entry that needs more shared memory than the GPU has (e.g. ``dh`` at two stages with
    D = 256 on Hopper: 272 KB of 227 KB) is compiled again with one stage fewer until it fits; the
    stages that fit are kept in :data:`FITTED_STAGES` so that later calls of that shape compile once.
    Stages change only the prefetching of loads, not what the kernel computes."""

    def __init__(self, name: str, kernel, block: str):
        self.name, self.kernel, self.block = name, kernel, block

    def config(self, K: int, V: int) -> tuple[int, int, int]:
        size, warps, stages = _INTERP_LAUNCH if _interpret() else LAUNCH[self.name]
        if self.block is None:
            return 0, LAUNCH[self.name][1], stages
        dim = K if self.block == "BK" else V
        if dim < size and not _interpret():
            return dim, 2, stages  # see LAUNCH: narrow blocks only at 2 warps
        return min(size, dim), warps, stages

    def __call__(self, grid, *args, **kwargs):
        size, warps, stages = self.config(kwargs["K"], kwargs["V"])
        key = None
        if FITTED_STAGES:  # the key only where some launch did not fit: no extra host work per launch otherwise
            key = self._fit_key(size, warps, stages, args, kwargs)
            stages = FITTED_STAGES.get(key, stages)
        grid = grid(size) if callable(grid) else grid
        block = {self.block: size} if self.block is not None else {}
        cap = {"maxnreg": MAXNREG[self.name]} if self.name in MAXNREG and not _interpret() else {}
        while True:
            try:
                return self.kernel[grid](*args, **kwargs, **block, num_warps=warps, num_stages=stages, **cap)
            except OutOfResources as e:  # raised when the compiled kernel is loaded, before it runs
                if stages <= 1 or "shared memory" not in str(e):
                    raise
                key = key or self._fit_key(size, warps, stages, args, kwargs)
                stages -= 1
                FITTED_STAGES[key] = stages

    def _fit_key(self, size: int, warps: int, stages: int, args: tuple, kwargs: dict) -> tuple:
        """The :data:`FITTED_STAGES` key of a launch: kernel, launch asked, head dims and the inputs' dtype."""
        dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
        return (self.name, size, warps, stages, kwargs["K"], kwargs["V"], dtype)


_state = _Launcher("state", _kda_fwd_state, "BV")
_out = _Launcher("out", _kda_fwd_out, "BV")
_dh = _Launcher("dh", _kda_bwd_dh, "BV")
_wy = _Launcher("wy", _kda_bwd_wy, "BK")
_dqkg = _Launcher("dqkg", _kda_bwd_dqkg, "BK")
_dg = _Launcher("dg", _kda_bwd_dg, "BK")
_dqkg_dg = _Launcher("dqkg_dg", _kda_bwd_dqkg_dg, "BK")
_sterm = _Launcher("sterm", _kda_bwd_sterm, "BK")
_kktr = _Launcher("kktr", _kda_fwd_kkt_row, "BK")
_merge = _Launcher("merge", _kda_fwd_merge, None)
_wu = _Launcher("wu", _kda_fwd_wu, "BK")
_state_small = _Launcher("state_small", _kda_fwd_state, "BV")


def _small_grid(B: int, H: int, V: int) -> bool:
    """Whether the state kernel takes its ``state_small`` launch (see ``SMALL_GRID``)."""
    return B * H * triton.cdiv(V, 32) <= SMALL_GRID


def _dot_bf16(dtype: torch.dtype) -> bool:
    """Whether tensor-core operands are bf16 (bf16 inputs) rather than fp32/TF32."""
    return dtype == torch.bfloat16


def _ieee(dtype: torch.dtype) -> bool:
    """fp32 inputs: every product in exact fp32 (no TF32), the accuracy / reference path."""
    return dtype == torch.float32


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the intermediates (w, u, U, h, A_qk, qg, kd, dh): bf16 inputs keep bf16
    (the bf16 rounding budget fits the 5e-3 / 1e-2 targets, see kernels/check_kda_gpu.py
    --emulate-bf16), fp16/fp32 inputs keep fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _scratch_dtype(switch: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the backward's scratch buffer ``switch`` (``VARIANTS`` das / du / dkb) for inputs of ``dtype``:
    bf16 where the switch says so and the inputs are bf16, else fp32."""
    return torch.bfloat16 if VARIANT[switch] == "bf16" and dtype == torch.bfloat16 else torch.float32


def _forward(q, k, v, g, beta, scale, h0, output_final_state, bounded, C, g_min, pack, o=None, keep=False):
    """Intra-chunk and state kernels on padded inputs; returns the intermediates. ``o``: the state kernel
    writes the output there itself (``VARIANTS["out"]`` "fused") and stores the chunk states only with ``keep``."""
    inter = _intra_pass(q, k, v, g, beta, scale, bounded, C, g_min)
    inter.update(_state_pass(inter, h0, output_final_state, q.dtype, C, pack, o=o, keep=keep))
    return inter


def _intra_pass(q, k, v, g, beta, scale, bounded, C, g_min):
    """The intra-chunk kernels (kktr, merge, wu): A_qk, Tm, w, u, qg, kd, e^{G_last}.

    Bounded mode: ``g`` already holds G (``prep_fwd_chunked``) and ``g_min`` places the diagonal
    sub-tiles' reference. General mode: ``g`` is the log decay; kktr forms G and writes it for wu
    and for the backward's element-wise diagonal pairs (returned as ``Gbuf``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = T // C
    dev = q.device
    wd = _work_dtype(q.dtype)
    Gbuf = g if bounded else torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    Abuf = torch.empty(B, T, H, C, device=dev, dtype=torch.float32)
    Aqk = torch.empty(B, T, H, C, device=dev, dtype=wd)
    w, qg, kd = (torch.empty(B, T, H, K, device=dev, dtype=wd) for _ in range(3))
    u = torch.empty(B, T, H, V, device=dev, dtype=wd)
    gl = torch.empty(B, NT, H, K, device=dev, dtype=torch.float32)
    mid = (SUBTILE / 2) * (g_min if bounded else 0.0) * LOG2E
    _kktr(
        (NT * (C // SUBTILE), B * H), q, k, g, beta, Gbuf, Abuf, Aqk, scale, mid, T,
        H=H, K=K, V=V, C=C, BC=SUBTILE, BOUNDED=bounded, IEEE=_ieee(q.dtype), G_IN=bounded,
    )
    if C > SUBTILE:
        _merge((NT, B * H), Abuf, T, H=H, K=K, V=V, C=C, BC=SUBTILE)
    _wu(
        (NT, B * H), q, k, v, Gbuf, beta, Abuf, w, u, qg, kd, gl, scale, T,
        H=H, K=K, V=V, C=C, BV=min(V, 64), IEEE=_ieee(q.dtype),
    )
    if bounded:  # bounded mode's backward reruns the chunked prep for G: keep only a placeholder
        Gbuf = q.new_empty(1, dtype=torch.float32)
    return dict(Gbuf=Gbuf, Abuf=Abuf, Aqk=Aqk, w=w, u=u, qg=qg, kd=kd, gl=gl)


def _state_pass(inter, h0, output_final_state, dtype, C, pack, stream=None, o=None, keep=False):
    """The state kernel: chunk states ``hbuf`` ``[B, NT, H, K, V]``, ``U``, optional final state
    ``[N, H, K, V]`` (N = B, or the documents of ``pack``: one program per document and head).
    ``stream``: a CUDA stream to launch on, after what the current stream has issued so far (the
    outputs are allocated on the current stream, which must wait for ``stream`` before reading them).
    ``o`` ``[B, T, H, V]``: the kernel writes the output there instead of ``hbuf`` and ``U`` (None then), and both
    with ``keep`` (the forward keeping the chunk states for the backward: ``VARIANTS["states"]``)."""
    kd, w, u = inter["kd"], inter["w"], inter["u"]
    B, T, H, K = kd.shape
    V = u.shape[-1]
    NT = T // C
    N = B if pack is None else pack.N
    dev = kd.device
    wd = _work_dtype(dtype)
    store = o is None or keep
    if store:
        # packed: the slots past the last document are never written here but read (and discarded) by
        # the per-chunk kernels; zeros keep those discarded rows finite
        hbuf = (torch.empty if pack is None else torch.zeros)(B, NT, H, K, V, device=dev, dtype=wd)
        U = torch.empty(B, T, H, V, device=dev, dtype=wd)
    else:  # never stored: placeholders whose dtype tells the kernel the work dtype the output's operands round to
        hbuf = U = torch.empty(1, device=dev, dtype=wd)
    hT = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(dev))  # the inputs, and hbuf's zeros when packed
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        (_state_small if _small_grid(N, H, V) else _state)(
            lambda bv: (V // bv, N * H),
            kd, inter["gl"], w, u, h0 if h0 is not None else U, hbuf, U, hT if hT is not None else U,
            pack.coff if pack is not None else U, *((inter["qg"], inter["Aqk"], o) if o is not None else (U,) * 3),
            T, N * H, H=H, K=K, V=V, C=C, HAS_H0=h0 is not None, STORE_HT=hT is not None,
            DOT_BF16=_dot_bf16(dtype), IEEE=_ieee(dtype), VARLEN=pack is not None, OUT=o is not None, STORE=store,
        )
    return dict(hbuf=hbuf, U=U, hT=hT) if store else dict(hT=hT)


# what the forward keeps for the backward besides the raw inputs; the backward reruns the prep and
# the state kernel (the other choices measured: kernels/README.md, "A/B record")
_INTRA_KEYS = ("Gbuf", "Abuf", "Aqk", "w", "u", "qg", "kd", "gl")


class Prep:
    """What the op does to its raw inputs before the chunk kernels (``triton_prep``), fused into
    ChunkKDAFunction so that only the raw inputs are kept for the backward (which recomputes the
    prep: one memory-bound pass)."""

    def __init__(self, gate: str, g_min: float, silu_qk: bool, l2norm_qk: bool, eps: float):
        self.gate, self.g_min, self.silu_qk, self.l2norm_qk, self.eps = gate, g_min, silu_qk, l2norm_qk, eps

    @property
    def active(self) -> bool:
        return self.gate != "none" or self.silu_qk or self.l2norm_qk

    def kw(self) -> dict:
        return dict(gate=self.gate, g_min=self.g_min, silu_qk=self.silu_qk, l2norm_qk=self.l2norm_qk,
                    eps=self.eps)


def _padded(q, k, v, g, beta, h0, C):
    """Zero-pad to T a multiple of C and K, V powers of two >= 16 (no copy when already so).
    Padded tokens (q = k = v = beta = 0, g = 0) leave the state unchanged and padded channels stay
    0, so slicing the outputs back is exact."""
    T, K, V = q.shape[1], q.shape[3], v.shape[3]
    Tp = triton.cdiv(T, C) * C
    Kp = max(16, triton.next_power_of_2(K))
    Vp = max(16, triton.next_power_of_2(V))
    q, k, g = (_pad(x, {1: Tp, 3: Kp}).contiguous() for x in (q, k, g))
    v = _pad(v, {1: Tp, 3: Vp}).contiguous()
    beta = _pad(beta, {1: Tp}).contiguous()
    if h0 is not None:
        h0 = _pad(h0, {2: Kp, 3: Vp}).contiguous()
    return q, k, v, g, beta, h0


class Packing:
    """Packed documents (``cu_seqlens``, B = 1) laid out so that each starts on a chunk: document
    n takes chunk slots ``[coff[n], coff[n + 1])`` of a zeroed row of ``NS = cdiv(T, C) + N`` slots
    (an upper bound of ``sum_n cdiv(len_n, C)``, so no host sync), and token t goes to row
    ``pos[t]``. The padded rows (q = k = v = beta = 0, g = 0) leave the state as it is, so only the
    state kernels need to know the documents (they restart at each ``coff[n]``).

    Attributes:
        N: documents; coff: ``[N + 1]`` int32 chunk offsets; pos: ``[T]`` int64 rows; rows: NS * C;
        cu_seqlens: the offsets it was made from.
    """

    def __init__(self, cu_seqlens: torch.Tensor, T: int, C: int):
        self.cu_seqlens = cu_seqlens
        cu = cu_seqlens.to(torch.int64)
        self.N = cu.numel() - 1
        coff = torch.zeros(self.N + 1, device=cu.device, dtype=torch.int64)
        coff[1:] = torch.cumsum(torch.div(cu[1:] - cu[:-1] + (C - 1), C, rounding_mode="floor"), 0)
        t = torch.arange(T, device=cu.device)
        doc = torch.searchsorted(cu[1:], t, right=True)  # the document of each token
        self.pos = coff[doc] * C + (t - cu[doc])
        self.coff = coff.to(torch.int32)
        self.rows = (triton.cdiv(T, C) + self.N) * C
        # what each chunk slot of the layout holds: document n's chunk j is tokens cu[n] + j C on, at most C of them
        # (slots past the last document hold none)
        slot = torch.arange(self.rows // C, device=cu.device)
        n = torch.searchsorted(coff[1:], slot, right=True).clamp_(max=self.N - 1)
        self.chunk_src = cu[n] + (slot - coff[n]) * C
        self.chunk_len = (cu[n + 1] - self.chunk_src).clamp(0, C).to(torch.int32)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, ...]`` -> ``[1, rows, ...]``, zeros outside the documents' rows."""
        out = x.new_zeros(1, self.rows, *x.shape[2:])
        out[0, self.pos] = x[0]
        return out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, rows, ...]`` -> ``[1, T, ...]``: the documents' rows back in token order."""
        return x[:, self.pos]

    _last: tuple | None = None  # (weakref to cu_seqlens, its version, T, C, the Packing)

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, T: int, C: int) -> Packing:
        """The Packing of ``cu_seqlens``: the last one made when the same tensor (unchanged) comes again, as it
        does from every KDA layer of a model's forward (``Documents.cu_seqlens``): about a dozen ops per layer
        saved on a host-bound step."""
        last = cls._last
        if last is not None and last[0]() is cu_seqlens and last[1:4] == (cu_seqlens._version, T, C):
            return last[4]
        pack = cls(cu_seqlens, T, C)
        cls._last = (weakref.ref(cu_seqlens), cu_seqlens._version, T, C, pack)
        return pack


def _inputs(q, k, v, g, beta, A_log, dt_bias, h0, prep, C, pack, bounded):
    """Prep (when active) and padding, the same in the forward and the backward: q, k, v, the
    decay, beta and h0, zero-padded (``_padded``) or laid out on whole chunks per document
    (``pack``; the prep runs first, so the padded rows keep g = 0 whatever the gate gives at
    z = 0). The decay is the log decay g in general mode (kktr forms G from it; reading G in was
    slower there), and in bounded mode G itself (fp32, ``prep_fwd_chunked``: one pass writes the
    padded qn, kn and G; packed: ``prep_fwd_packed``, the same pass writing the documents' chunk layout of
    qn, kn, G, v and beta, each chunk's G the cumsum over its document's tokens)."""
    if pack is None and bounded:
        qn, kn, gn = prep_fwd_chunked(q, k, g, A_log, dt_bias, chunk_size=C, **prep.kw(), qk=prep.active)
        if qn is None:
            qn, kn = q, k
        return _padded(qn, kn, v, gn, beta, h0, C)
    if pack is not None and bounded:  # the prep writes the documents' chunk layout itself, v and beta too
        qp, kp, gp, vp, bp = prep_fwd_packed(q, k, g, v, beta, A_log, dt_bias, pack.chunk_src, pack.chunk_len,
                                             chunk_size=C, **prep.kw())
        return qp, kp, vp, gp, bp, (_pad(h0, {2: kp.shape[3], 3: vp.shape[3]}).contiguous() if h0 is not None
                                    else None)
    qn, kn, gn = prep_fwd(q, k, g, A_log, dt_bias, **prep.kw()) if prep.active else (q, k, g)
    if pack is not None:
        qn, kn, v, gn, beta = (pack.scatter(x) for x in (qn, kn, v, gn, beta))
    return _padded(qn, kn, v, gn, beta, h0, C)


def _dh_pass(inter, do, dht, has_h0, dtype, C, pack):
    """The state-gradient kernel (``_kda_bwd_dh``, sequential over chunks in reverse): ``dhbuf``
    ``[B, NT, H, K, V]`` (the gradient of each chunk's entering state), ``dU`` (fp32, for ``_kda_bwd_wy``)
    and d(initial state) ``[N, H, K, V]`` (or None). ``dU`` is bf16 with ``VARIANT["du"] == "bf16"`` and bf16 inputs."""
    kd, u = inter["kd"], inter["u"]
    B, T, H, K = kd.shape
    V = u.shape[-1]
    NT = T // C
    N = B if pack is None else pack.N
    dev = kd.device
    # packed: zeros for the same reason as hbuf (_state_pass)
    dhbuf = (torch.empty if pack is None else torch.zeros)(B, NT, H, K, V, device=dev, dtype=_work_dtype(dtype))
    dU = torch.empty(B, T, H, V, device=dev, dtype=_scratch_dtype("du", dtype))
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if has_h0 else None
    _dh(
        lambda bv: (V // bv, N * H),
        inter["qg"], kd, inter["gl"], inter["w"], inter["Aqk"], do, dht if dht is not None else dU,
        dhbuf, dU, dh0 if dh0 is not None else dU, pack.coff if pack is not None else dU, T, N * H,
        H=H, K=K, V=V, C=C, HAS_DHT=dht is not None, STORE_DH0=has_h0, DOT_BF16=_dot_bf16(dtype),
        IEEE=_ieee(dtype), VARLEN=pack is not None,
    )
    return dhbuf, dU, dh0


_SIDE_STREAMS: dict = {}


def _chains(inter, h0, do, dht, dtype, C, pack):
    """The backward's two sequential chains: the forward state's recompute (``_state_pass``, into
    ``inter``) and the state gradient (``_dh_pass``, returned). Neither reads the other, so with
    ``VARIANT["chains"] == "concurrent"`` on a GPU the recompute runs on a side stream while the state gradient runs
    on the current one (each chain has only ``N * H * V / BV`` programs, too few to fill the GPU at
    small batch); ``"serial"`` runs one after the other. Chunk states the forward kept (``VARIANTS["states"]``, in
    ``inter`` already) leave only the state gradient."""
    dev = inter["kd"].device
    if "hbuf" in inter:
        return _dh_pass(inter, do, dht, h0 is not None, dtype, C, pack)
    if VARIANT["chains"] == "serial" or dev.type != "cuda":
        inter.update(_state_pass(inter, h0, False, dtype, C, pack))
        return _dh_pass(inter, do, dht, h0 is not None, dtype, C, pack)
    side = _SIDE_STREAMS.get(dev)
    if side is None:
        side = _SIDE_STREAMS[dev] = torch.cuda.Stream(dev)
    # the recompute's buffers come from the current stream (no record_stream, which graph capture would not
    # take), its kernel runs on the side stream, and the current stream waits for it before anything reads them
    inter.update(_state_pass(inter, h0, False, dtype, C, pack, stream=side))
    out = _dh_pass(inter, do, dht, h0 is not None, dtype, C, pack)
    torch.cuda.current_stream(dev).wait_stream(side)
    return out


def _gate_args(z, A_log, dt_bias, prep, B, NT, H, K, V):
    """``_kda_bwd_dg``'s fused gate backward (``VARIANT["gate_bwd"] == "dg"``): ``((z, A_log, dt_bias, dAp, dbp,
    g_min), constexprs)`` for ``_grad_pass`` and the fp32 buffers of its per-program sums, ``dAp [K // BK, NT, B*H]``
    and ``dbp [NT, B*H, K]`` (None without dt_bias)."""
    bk = (_dqkg_dg if VARIANT["dg"] == "dqkg" else _dg).config(K, V)[0]  # the kernel that runs the gate's backward
    dAp = torch.empty(K // bk, NT, B * H, device=z.device, dtype=torch.float32)
    dbp = torch.empty(NT, B * H, K, device=z.device, dtype=torch.float32) if dt_bias is not None else None
    g_min = float(prep.g_min) if prep.gate == "bounded" else 0.0
    args = (z, A_log, dt_bias if dt_bias is not None else dAp, dAp, dbp if dbp is not None else dAp, g_min)
    return (args, dict(GATE=_GATE_ID[prep.gate], HAS_BIAS=dt_bias is not None)), dAp, dbp


def _grad_pass(q, k, G, beta, inter, dhbuf, do, dAs, dkb, dq, dk, dg, dbv, scale, bounded, C, gate=None):
    """The gradient kernels: ``_kda_bwd_sterm`` (state terms per chunk), then
    ``_kda_bwd_dqkg`` (gated-score terms per 16-row sub-tile), then ``_kda_bwd_dg`` (reverse cumsum;
    with ``gate``, the arguments of its fused gate backward from ``_gate_args``, dg receives dL/dz);
    with ``VARIANT["dg"] == "dqkg"`` the last two as one kernel per chunk (``_kda_bwd_dqkg_dg``).
    Fills dq, dk, dg and returns dbeta (``dbv`` plus the K-block partial sums)."""
    B, T, H, K = q.shape
    V = do.shape[-1]
    NT = T // C
    dot_bf16, ieee = _dot_bf16(q.dtype), _ieee(q.dtype)
    fused = VARIANT["dg"] == "dqkg"
    nk = K // (_dqkg_dg if fused else _dqkg).config(K, V)[0]
    nks = K // _sterm.config(K, V)[0]
    dbk = torch.empty(nk, B, T, H, device=q.device, dtype=torch.float32)  # per-K-block dbeta terms
    dbs = torch.empty(nks, B, T, H, device=q.device, dtype=torch.float32)  # same, state terms
    dGs = torch.empty(B, T, H, K, device=q.device, dtype=torch.float32)  # dG before the reverse cumsum
    dGl = torch.empty(B, NT, H, K, device=q.device, dtype=torch.float32)  # d(G_last)
    # the state terms per chunk first, then the per-sub-tile kernel adds the gated-score terms
    _sterm(
        lambda bk: (K // bk, NT, B * H), q, k, G, beta, inter["hbuf"], dhbuf, inter["U"], do, dkb, dq, dGs,
        dGl, dbs, scale, T, B * H, H=H, K=K, V=V, C=C, BV=min(V, 64), DOT_BF16=dot_bf16, IEEE=ieee,
    )
    dbeta = dbv + dbs.sum(0)
    args, const = gate or ((dGs,) * 5 + (0.0,), dict(GATE=0, HAS_BIAS=False))  # (z, A_log, dt_bias, dAp, dbp, g_min)
    if fused:
        _dqkg_dg(
            lambda bk: (K // bk, NT, B * H), q, k, G, beta, dAs, dkb, dq, dk, dGs, dbk, dGl, dg, *args, T, B * H,
            H=H, K=K, V=V, C=C, BC=SUBTILE, BOUNDED=bounded, IEEE=ieee, **const,
        )
        return dbeta + dbk.sum(0)
    _dqkg(
        lambda bk: (K // bk, NT * (C // SUBTILE), B * H), q, k, G, beta, dAs, dkb, dq, dk, dGs, dbk, T, B * H,
        H=H, K=K, V=V, C=C, BC=SUBTILE, BOUNDED=bounded, IEEE=ieee,
    )
    _dg(lambda bk: (K // bk, NT, B * H), dGs, dGl, dg, T, *args, B * H, H=H, K=K, V=V, C=C, **const)
    return dbeta + dbk.sum(0)


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd wrapper: optional fused prep (``Prep``), padding, the chunk kernels; gradients for
    q, k, v, g (or the gate's z, A_log, dt_bias), beta and initial_state."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, bounded, C, prep,
                g_min, pack):
        B, T, H, K = q.shape
        V = v.shape[-1]
        ctx.scale, ctx.bounded, ctx.chunk_size, ctx.prep, ctx.pack, ctx.g_min = scale, bounded, C, prep, pack, g_min
        ctx.recompute = VARIANT["forward"] == "infer" and _infer_forward_ok(bounded, prep, g_min)
        if ctx.recompute:  # the inference kernels; the backward recomputes the intra-chunk intermediates
            from moelab.ops.kda.infer_plan import kda_infer

            gated = prep.gate != "none"
            ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state)
            return kda_infer(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, g_min=g_min, validate=False, gate=prep.gate,
                             A_log=A_log if gated else None, dt_bias=dt_bias if gated else None,
                             l2norm_qk=prep.l2norm_qk, silu_qk=prep.silu_qk, norm_eps=prep.eps,
                             cu_seqlens=pack.cu_seqlens if pack is not None else None)
        qp, kp, vp, gp, bp, h0p = _inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, prep, C, pack, bounded)
        Tp, Kp, Vp = qp.shape[1], qp.shape[3], vp.shape[3]
        o = torch.empty_like(vp)
        fused = VARIANT["out"] == "fused"
        ctx.states = VARIANT["states"] == "kept"
        inter = _forward(qp, kp, vp, gp, bp, scale, h0p, output_final_state, bounded, C, g_min, pack,
                         o=o if fused else None, keep=ctx.states)
        if not fused:
            _out(
                (Tp // C, B * H), inter["qg"], inter["Aqk"], inter["hbuf"], inter["U"], o, Tp, B * H,
                H=H, K=Kp, V=Vp, C=C, DOT_BF16=_dot_bf16(q.dtype), IEEE=_ieee(q.dtype),
            )
        # raw inputs + kept intermediates, and the prep's padded outputs where VARIANT["prep"] keeps them (else the
        # backward redoes the prep and the padding)
        ctx.kept = VARIANT["prep"] == "kept"
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, *(inter[key] for key in _INTRA_KEYS),
                              *((inter["hbuf"], inter["U"]) if ctx.states else ()),
                              *((qp, kp, vp, gp, bp, h0p) if ctx.kept else ()))
        hT = inter["hT"]
        if pack is not None:
            o = pack.gather(o)[..., :V]
        elif (Tp, Vp) != (T, V):
            o = o[:, :T, :, :V]
        if hT is not None and (Kp, Vp) != (K, V):
            hT = hT[:, :, :K, :V]
        return o, hT

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q_raw, k_raw, v_raw, g_raw, beta_raw, A_log, dt_bias, h0_raw, *saved = ctx.saved_tensors
        scale, bounded, C, prep, pack = ctx.scale, ctx.bounded, ctx.chunk_size, ctx.prep, ctx.pack
        B, T0, H, K0 = q_raw.shape
        V0 = v_raw.shape[-1]
        states = {}
        if not ctx.recompute and ctx.states:  # the chunk states the forward kept: no recompute below
            states = dict(zip(("hbuf", "U"), saved[len(_INTRA_KEYS):len(_INTRA_KEYS) + 2]))
            saved = saved[:len(_INTRA_KEYS)] + saved[len(_INTRA_KEYS) + 2:]
        if not ctx.recompute and ctx.kept:
            q, k, v, gp, beta, h0 = saved[len(_INTRA_KEYS):]
            saved = saved[:len(_INTRA_KEYS)]
        else:
            q, k, v, gp, beta, h0 = _inputs(q_raw, k_raw, v_raw, g_raw, beta_raw, A_log, dt_bias, h0_raw, prep, C,
                                            pack, bounded)
        T, K, V = q.shape[1], q.shape[3], v.shape[3]
        NT = T // C
        do = _pad(pack.scatter(do) if pack is not None else do, {1: T, 3: V}).contiguous()
        if dht is not None:
            dht = _pad(dht, {2: K, 3: V}).contiguous()
        # the intra-chunk intermediates: kept by the forward, or recomputed (the "infer" forward)
        inter = (_intra_pass(q, k, v, gp, beta, scale, bounded, C, ctx.g_min) if ctx.recompute
                 else dict(zip(_INTRA_KEYS, saved), **states))
        # G for the gradient kernels: bounded mode's prep just wrote it, general mode's kktr kept it
        G = gp if bounded else inter["Gbuf"]
        del gp
        dhbuf, dU, dh0 = _chains(inter, h0, do, dht, q.dtype, C, pack)
        dot_bf16 = _dot_bf16(q.dtype)
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        # the gradient of the log decay: fp32 when the prep made it (the gate's parameters sum it over
        # tokens), else in g's dtype; with the gate's backward fused into dg's kernel, dL/dz in z's dtype
        fuse = VARIANT["gate_bwd"] == "dg" and prep.gate != "none" and pack is None and (T, K) == (T0, K0)
        dg = torch.empty(B, T, H, K, device=q.device,
                         dtype=g_raw.dtype if fuse or not prep.active else torch.float32)
        gate, dAp, dbp = _gate_args(g_raw.contiguous(), A_log, dt_bias, prep, B, NT, H, K, V) if fuse else (
            None, None, None)
        # per-chunk dA_qk, dA_kk scratch
        dAs = torch.empty(B, NT, H, 2, C, C, device=q.device, dtype=_scratch_dtype("das", q.dtype))
        # the gradient of beta k e^G through w, then dk's partial sums
        dkb = torch.empty(B, T, H, K, device=q.device, dtype=_scratch_dtype("dkb", q.dtype))
        dbv = torch.empty(B, T, H, device=q.device, dtype=torch.float32)  # value-side dbeta
        _wy(
            (NT, B * H), v, beta, inter["Abuf"], inter["w"], inter["u"], inter["hbuf"], inter["U"], dU, do, dAs,
            dkb, dv, dbv, scale, T, B * H,
            H=H, K=K, V=V, C=C, BV=min(V, 64), DOT_BF16=dot_bf16, IEEE=_ieee(q.dtype),
        )
        del dU  # only dh (writes) and wy (reads) use it: freed before the largest allocations below
        dbeta = _grad_pass(q, k, G, beta, inter, dhbuf, do, dAs, dkb, dq, dk, dg, dbv, scale, bounded, C, gate)
        del inter, G, dAs, dkb, dhbuf
        # packed documents: the prep's backward reads dq, dk, dg in the documents' layout itself; the rest comes back
        # to token order here
        rows = pack.pos if pack is not None and prep.active else None
        if pack is not None:
            dv, dbeta = pack.gather(dv), pack.gather(dbeta)
            if rows is None:
                dq, dk, dg = (pack.gather(x) for x in (dq, dk, dg))
        dbeta = dbeta[:, :T0].to(beta_raw.dtype)
        if rows is None:
            dq, dk, dg = (x[:, :T0, :, :K0] for x in (dq, dk, dg))
        dv = dv[:, :T0, :, :V0]
        dh0 = dh0[:, :, :K0, :V0].to(h0_raw.dtype) if dh0 is not None else None
        dA_log = ddt_bias = None
        if fuse:  # dg holds dL/dz already: the prep's backward does q and k
            dA_log = dAp.view(-1, B, H).sum((0, 1))
            ddt_bias = dbp.view(NT, B, H * K).sum((0, 1)) if dbp is not None else None
            dq, dk = prep_bwd(q_raw, k_raw, g_raw, A_log, dt_bias, dq, dk, None, **prep.kw(), rows=rows)[:2]
        elif prep.active:
            dq, dk, dg, dA_log, ddt_bias = prep_bwd(q_raw, k_raw, g_raw, A_log, dt_bias, dq, dk, dg, **prep.kw(),
                                                     rows=rows)
        return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, None, dh0, None, None, None, None, None, None


def launch_configs(K: int = 128, V: int = 128) -> dict:
    """The launch config of every kernel at head dims K, V: {name: {block: size, num_warps, num_stages}}."""
    out = {}
    for lau in (_kktr, _merge, _wu, _state, _state_small, _out, _dh, _wy, _sterm, _dqkg, _dg, _dqkg_dg):
        size, warps, stages = lau.config(K, V)
        out[lau.name] = {**({lau.block: size} if lau.block else {}), "num_warps": warps, "num_stages": stages}
    return out


def _pad(x: torch.Tensor, dims: dict[int, int]) -> torch.Tensor:
    """Zero-pad ``x`` at the end of each dim in ``dims`` (dim -> target size); no copy if none grows."""
    pads = [0] * (2 * x.dim())
    for dim, size in dims.items():
        pads[2 * (x.dim() - 1 - dim) + 1] = size - x.shape[dim]
    return torch.nn.functional.pad(x, pads) if any(pads) else x


@torch.compiler.disable  # a torch.compile'd model calls the op eagerly (its kernels launch themselves)
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    mode: str | None = None,
    g_min: float | None = None,
    validate: bool = True,
    chunk_size: int = 64,
    *,
    gate: str = "none",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    l2norm_qk: bool = False,
    silu_qk: bool = False,
    norm_eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward (Triton) with an autograd backward.

    Args:
        q: ``[B, T, H, K]`` queries (normalized by the caller unless ``l2norm_qk``).
        k: ``[B, T, H, K]`` keys, same dtype as q.
        v: ``[B, T, H, V]`` values, same dtype as q; bf16, fp16 or fp32 (accumulation is fp32).
        g: ``[B, T, H, K]``: with ``gate="none"`` the per-channel log decay (natural log, ``<= 0``);
            otherwise the gate's raw input ``z`` (any float dtype), turned into the log decay
            inside the op: ``gate="bounded"``: ``g = g_min * sigmoid(exp(A_log_h) (z + dt_bias))``
            (so ``g >= g_min`` by construction); ``gate="softplus"``:
            ``g = -exp(A_log_h) softplus(z + dt_bias)`` (unbounded: needs ``mode="general"``).
        beta: ``[B, T, H]`` write strength.
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 state before the first token of each sequence (N = B,
            or the number of documents with ``cu_seqlens``), or None (zeros).
        output_final_state: also return the state after the last token.
        mode: ``"bounded"`` (fast diagonal sub-tiles, needs ``g >= g_min``) or ``"general"``
            (any ``g <= 0``); None: bounded when ``g_min`` is given, else general.
        g_min: the lower bound of g: the bounded gate's floor (required with ``gate="bounded"``),
            or with ``gate="none"`` a promise ``g >= g_min``; None: no bound. Bounded mode needs
            ``g_min >= bounds.G_MIN_FLOOR`` (about -5.5), else the 16-token diagonal sub-tile
            would overflow.
        validate: with ``gate="none"``, check ``max(g) <= 0`` and, in bounded mode,
            ``min(g) >= g_min`` (one reduction over g and a host sync), and the values of
            ``cu_seqlens`` (another sync); ``validate=False``
            skips it for speed, and then out-of-range g gives undefined (possibly non-finite)
            results. A gate computed inside the op needs no check.
        chunk_size: tokens per chunk, one of 16, 32, 64.
        gate: ``"none" | "bounded" | "softplus"``, see ``g``.
        A_log: ``[H]`` fp32 log of the gate's per-head rate (required with a gate).
        dt_bias: ``[H * K]`` per-channel gate bias, or None.
        l2norm_qk: L2-normalize q and k per head inside the op (``F.normalize`` semantics,
            ``eps=norm_eps``), after ``silu_qk``.
        silu_qk: apply SiLU to q and k first (as the KDA layer does after its short convolution).
        cu_seqlens: ``[N + 1]`` int32/int64 offsets (on q's device) of N documents packed in one
            row (B = 1): document n is tokens ``[cu_seqlens[n], cu_seqlens[n + 1])`` (empty ones
            allowed) and the state restarts at each boundary, from ``initial_state[n]`` or zeros.
            The documents are laid out on whole chunks (``Packing``: at most N more chunks of
            work) and only the state kernels walk them one by one.

    Returns:
        ``o`` ``[B, T, H, V]`` in v's dtype and the final state ``[N, H, K, V]`` fp32 (or None).
        Gradients flow to q, k, v, g (or z, A_log, dt_bias), beta and initial_state.
    """
    if mode is None:
        mode = "general" if g_min is None else "bounded"
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed: expected one of {MODES}")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size={chunk_size} is not allowed: expected one of {CHUNK_SIZES}")
    if gate not in GATES:
        raise ValueError(f"gate={gate!r} is not allowed: expected one of {GATES}")
    B, T, H, K, V = check_op_shapes(q, k, v, g, beta)
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on q's device {q.device}, got {cu_seqlens.device}")
        check_cu_seqlens(cu_seqlens, B, T, read=validate)
        N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)} (N = "
                         f"{'documents' if cu_seqlens is not None else 'B'}), got {tuple(initial_state.shape)}")
    bounded = mode == "bounded"
    if gate == "bounded" and g_min is None:
        raise ValueError("gate='bounded' needs g_min, the gate's floor (a number < 0)")
    if bounded:
        if gate == "softplus":
            raise ValueError("gate='softplus' is not allowed with mode='bounded': the softplus decay has no lower "
                             "bound; use mode='general' or gate='bounded'")
        if g_min is None or not (G_MIN_FLOOR <= g_min <= 0):
            raise ValueError(
                f"g_min={g_min} is not allowed in bounded mode: expected {G_MIN_FLOOR:.3f} <= g_min <= 0 "
                f"(|g_min| * {SUBTILE} / 2 must stay inside the exp range of a {SUBTILE}-token sub-tile); "
                f"use mode='general' for lower decays")
    if gate == "none":
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log / dt_bias are only used with gate='bounded' or 'softplus', got gate='none'")
        if validate:
            gmin, gmax = (x.item() for x in torch.aminmax(g.detach()))
            if gmax > 0:
                raise ValueError(f"g must be a log decay <= 0, got max(g)={gmax:.4g}")
            if bounded and gmin < g_min:
                raise ValueError(
                    f"min(g)={gmin:.4g} is below g_min={g_min} in bounded mode: "
                    f"use mode='general' or bound the gate (g = g_min * sigmoid(...))")
    elif A_log is None:
        raise ValueError(f"gate={gate!r} needs A_log [H] (the gate's per-head log rate)")
    scale = K**-0.5 if scale is None else float(scale)
    prep = Prep(gate, g_min if gate == "bounded" else None, silu_qk, l2norm_qk, norm_eps)
    return ChunkKDAFunction.apply(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                                  bounded, chunk_size, prep, g_min,
                                  Packing.of(cu_seqlens, T, chunk_size) if cu_seqlens is not None else None)
