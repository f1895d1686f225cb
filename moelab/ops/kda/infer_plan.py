"""KDA inference forward, the host side: public entry ``kda_infer`` and its plan (kernels: triton_infer.py).

``kda_infer`` computes what ``naive_recurrent_kda`` computes, with the op's prep (SiLU, L2 norm, the
bounded gate, beta's sigmoid) inside, for callers that need no gradient (prefill, evaluation); the
training op is ``triton_chunk.chunk_kda``. Semantics, chunk 16 and precision: triton_infer.py.

``InferPlan`` holds one call: the checked inputs, the intermediates of the token-parallel kernel
(head-major, ``[H, slots * 16, ...]``), the outputs, and the launches. Two things are chosen per call:

* the recurrence's path, by a cost model of its chain of chunk steps against the state columns the
  GPU holds at once (``recur_cost``, ``choose_segment_chunks``): plain, one program per sequence,
  head and V-block over all chunks; or segmented, for few sequences x heads with long sequences
  (``InferPlan``'s docstring);
* each kernel's launch config, from the fixed table ``LAUNCH`` (``pick_recur`` takes the widest
  V-block whose launch fills the GPU).

Packed documents' chunk-slot offsets are computed on the device (no host sync; the grids are upper
bounds); fixed-length segment offsets depend on the shape only and are cached per shape.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton

from moelab.ops.kda.bounds import max_safe_g_min
from moelab.ops.kda.gate import check_op_shapes
from moelab.ops.kda.triton_common import LOG2E
from moelab.ops.kda.triton_infer import _kda_infer_intra, _kda_infer_join, _kda_infer_recur
from moelab.ops.varlen import check_cu_seqlens

CHUNK = 16  # tokens per chunk: what the bounded gate's exponent range allows (triton_infer.py)
GATES = ("none", "bounded")
_GATE_ID = {"none": 0, "bounded": 1}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Launch configs on the GPU, fixed (not autotuned), each the fastest passing one of the H200 launch sweeps at
# D = 128 (kernels/README.md, "Inference forward"); registers: ``make kda-aot ARGS=--infer`` (sm_90a, no GPU):
# intra: (num_warps, num_stages), one chunk slot and all of K per program. The kernel waits on each
#   program's memory latency, not on bandwidth, so registers (programs per SM) matter: at 2 warps it
#   takes 204 without spills.
# recur: candidates (BV, num_warps, num_stages, columns per SM, maxnreg), widest V-block first; the op
#   takes the first whose BV fits the state and whose launch holds at least that many state columns
#   per SM (``pick_recur``). BV = 16 x num_warps: each warp owns 16 rows of the transposed state, so
#   the products chain in registers. 64-wide blocks (warpgroup MMA) win once the GPU is saturated
#   (``SAT_COLS_PER_SM``), where every V-block's re-read of the head's K-side tiles costs throughput,
#   32-wide ones below it. Three stages: the pipeline issues a chunk's copies two chunks ahead.
#   maxnreg: ptxas's register cap; on the 4-warp launch, 168 gives a third program per SM where a
#   launch saturates the GPU (the 2-warp launches, already 5 programs per SM, ran slower capped).
# join: (BV, num_warps); exact fp32 (FMA) products, one [BV, K] x [K, K] per segment: 16-wide blocks
#   at 4 warps compile without spills at K = 128.
LAUNCH: dict = {"intra": (2, 1), "recur": ((64, 4, 3, 96, 168), (32, 2, 3, 0, 0), (16, 1, 3, 0, 0)), "join": (16, 4)}
_INTERP_BV = 16  # the interpreter: 16-wide V-blocks so that small test shapes take several

# Recurrence cost model, for the choice between the plain and the segmented recurrence and of the
# segment length, in units of one latency-bound chunk step (about 1 us on the H200). A launch's state
# columns (sequences x heads x V, padded, plus K identity columns per pair in phase 1) spread over the
# SMs in 16-row warps; below about SAT_COLS_PER_SM columns per SM (3 programs of 32 columns) each chunk
# step costs that fixed latency, above it the GPU is saturated and time grows with the columns:
# ``chain (1 + (cols / sat)^3)^(1/3)``, the larger of the two bounds with a soft knee.
# JOIN_STEPS: one step of the join (a [K, K] fp32 product per segment, one segment after another),
# fitted to the H200 segment-length sweeps; SEG_FIXED_STEPS: the segmented path's fixed cost (two more
# launches, the segment offsets, the final state's gather); SEG_MIN_LEN: no shorter segments (slower
# where measured); SEG_MIN_GAIN: the segmented recurrence must be predicted that much faster (the model
# was within ~15% of the sweeps).
SAT_COLS_PER_SM = 96
JOIN_STEPS = 12
SEG_FIXED_STEPS = 20
SEG_MIN_LEN = 64
SEG_MIN_GAIN = 1.2


def recur_cost(cols: int, chain: int, sms: int) -> float:
    """Modelled time of one recurrence launch in latency-bound chunk steps (see above): ``cols`` state
    columns in flight over ``sms`` SMs, ``chain`` chunks per program."""
    x = cols / (SAT_COLS_PER_SM * sms)
    return chain * (1.0 + x**3) ** (1.0 / 3.0)


def choose_segment_chunks(seqs: int, H: int, chunks: int, K: int, V: int, sms: int) -> int:
    """Segment length in chunks for the segmented recurrence, or 0 for the plain one: the length of
    least modelled cost (``recur_cost``) over 2, 4, 8, ... segments of at least SEG_MIN_LEN chunks,
    taken if it beats the plain recurrence by SEG_MIN_GAIN. Plain costs ``chunks`` steps at
    ``seqs H V`` columns; P segments of L chunks cost L steps at ``P seqs H (K + V)`` columns
    (phase 1), ``P JOIN_STEPS`` (phase 2), L steps at ``P seqs H V`` columns (phase 3) and
    ``SEG_FIXED_STEPS``. Throughput-bound, the segments cost ``(K + 2V) / V`` times the plain work, so
    segmenting pays only where the plain launch holds under ``V / (K + 2V)`` of saturation. On 132 SMs:
    B1 T32768 H16 (2048 chunks, 2048 columns: 0.16 of saturation) takes 8 segments of 256 chunks;
    B1 T8192 H64 / H96, B8 T4096 H16 and packed documents at those sizes stay plain (their plain
    launches are at 0.65-1.3 of saturation, so the segments' extra columns cost more than the shorter
    chain saves).

    Args:
        seqs: sequences (B, or packed documents); H: heads; chunks: 16-token chunks per sequence (the
            mean for packed documents); K, V: head dims; sms: the GPU's SM count."""
    Kp = max(16, triton.next_power_of_2(K))
    Vp = max(16, triton.next_power_of_2(V))
    pairs = seqs * H
    best, best_len = recur_cost(pairs * Vp, chunks, sms) / SEG_MIN_GAIN, 0
    P = 2
    while triton.cdiv(chunks, P) >= SEG_MIN_LEN:
        L = triton.cdiv(chunks, P)
        n = triton.cdiv(chunks, L)  # segments actually made
        cost = (recur_cost(n * pairs * (Kp + Vp), L, sms) + n * JOIN_STEPS + SEG_FIXED_STEPS
                + recur_cost(n * pairs * Vp, L, sms))
        if cost < best:
            best, best_len = cost, L
        P *= 2
    return best_len


def pick_recur(cols: int, width: int, sms: int) -> tuple[int, int, int, int]:
    """(BV, num_warps, num_stages, maxnreg) of a recurrence launch of ``cols`` state columns whose
    V-blocks must divide ``width``: the first of ``LAUNCH["recur"]`` that fits and whose column floor per
    SM ``cols`` reaches, else the narrowest."""
    cands = [c for c in LAUNCH["recur"] if c[0] <= width] or [min(LAUNCH["recur"], key=lambda c: c[0])]
    c = next((c for c in cands if cols >= c[3] * sms), cands[-1])
    return c[0], c[1], c[2], c[4]


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cap(maxnreg: int) -> dict:
    """Launch keywords for the register cap ``maxnreg`` (0: none; none in the interpreter either)."""
    return {"maxnreg": maxnreg} if maxnreg and not _interpret() else {}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the intermediates (w, qg, kd, A_qk): bf16 for bf16 inputs, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _ab_dtype(dtype: torch.dtype, l2norm_qk: bool) -> torch.dtype:
    """Storage dtype of ``Ab = (I + L)^-1 Diag(beta)``: fp16 for bf16 inputs with L2-normalized keys,
    else fp32. With unit keys, beta <= 1 and decays <= 1 every ``|L_ij| <= 1``, so the entries of the
    unit lower inverse are bounded by ``2^(i - j - 1) <= 2^14`` over 16 rows: inside fp16's range, with
    11 significant bits (bf16 has 8) where entries of both signs cancel in ``u = Ab v``. Without the
    norm the keys' scale is unbounded: fp32."""
    return torch.float16 if dtype == torch.bfloat16 and l2norm_qk else torch.float32


def _dot_bf16(dtype: torch.dtype) -> bool:
    """Whether the recurrence's product operands are bf16 (bf16 inputs) rather than fp32 / TF32."""
    return dtype == torch.bfloat16


def _ieee(dtype: torch.dtype) -> bool:
    """fp32 inputs: exact fp32 products everywhere (the reference use)."""
    return dtype == torch.float32


def _recur_launch(pairs: int, Vp: int, device: torch.device, Kp: int = 0) -> tuple[int, int, int, int]:
    """(BV, num_warps, num_stages, maxnreg) of the recurrence for ``pairs`` = sequences x heads
    (``pick_recur``); ``Kp``: phase 1 of the segmented recurrence, with ``Kp`` identity columns beside
    the ``Vp``."""
    width = min(Vp, Kp) if Kp else Vp  # BV must divide both parts
    if _interpret():
        return min(_INTERP_BV, width), 1, 1, 0
    return pick_recur(pairs * (Vp + Kp), width, _sms(device))


def _check(q, k, v, g, beta, scale, initial_state, g_min, validate, gate, A_log, dt_bias, norm_eps,
           cu_seqlens) -> int:
    """Raise ValueError for anything outside what the kernels support; returns the number of
    sequences N (B, or the number of documents with ``cu_seqlens``)."""
    if gate not in GATES:
        hint = " (the softplus gate has no lower bound: use triton_chunk.chunk_kda with mode='general')" \
            if gate == "softplus" else ""
        raise ValueError(f"gate={gate!r} is not allowed: expected one of {GATES}{hint}")
    B, T, H, K, V = check_op_shapes(q, k, v, g, beta)
    if g.dtype not in _DTYPES or beta.dtype not in _DTYPES:
        raise ValueError(f"g and beta must be bf16/fp16/fp32, got {g.dtype}, {beta.dtype}")
    if any(t.device != q.device for t in (k, v, g, beta)):
        raise ValueError(f"q, k, v, g, beta must be on one device, got {[str(t.device) for t in (q, k, v, g, beta)]}")
    floor = max_safe_g_min("fp32", CHUNK)
    if not (math.isfinite(g_min) and floor <= g_min < 0):
        raise ValueError(f"g_min={g_min} is not allowed: expected {floor:.3f} <= g_min < 0 "
                         f"(|g_min| * {CHUNK} / 2 must stay inside the exp range of a {CHUNK}-token chunk)")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale={scale} is not allowed: expected a finite number or None")
    if not (norm_eps > 0 and math.isfinite(norm_eps)):
        raise ValueError(f"norm_eps={norm_eps} is not allowed: expected a finite value > 0")
    if gate == "none":
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log / dt_bias are only used with gate='bounded', got gate='none'")
    else:
        if A_log is None or A_log.shape != (H,) or A_log.dtype not in _DTYPES or A_log.device != q.device:
            got = None if A_log is None else (tuple(A_log.shape), A_log.dtype, str(A_log.device))
            raise ValueError(f"gate='bounded' needs A_log of shape [H] = ({H},), float, on {q.device}; got {got}")
        if dt_bias is not None and (dt_bias.numel() != H * K or dt_bias.dtype not in _DTYPES
                                    or dt_bias.device != q.device):
            raise ValueError(f"dt_bias must be None or hold H*K = {H * K} floats on {q.device}; got "
                             f"{(tuple(dt_bias.shape), dt_bias.dtype, str(dt_bias.device))}")
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on {q.device}, got {cu_seqlens.device}")
        check_cu_seqlens(cu_seqlens, B, T, read=validate)  # reading the values is a host sync
        N = cu_seqlens.numel() - 1
    if initial_state is not None and (initial_state.shape != (N, H, K, V) or initial_state.dtype not in _DTYPES
                                      or initial_state.device != q.device):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)} float on {q.device} (N = "
                         f"{'documents' if cu_seqlens is not None else 'B'}), got "
                         f"{(tuple(initial_state.shape), initial_state.dtype, str(initial_state.device))}")
    if validate and gate == "none":  # a host sync
        gmin, gmax = (x.item() for x in torch.aminmax(g.detach().float()))
        if gmax > 0 or gmin < g_min:
            raise ValueError(f"g must be a log decay in [g_min, 0] = [{g_min}, 0], got "
                             f"min(g)={gmin:.4g}, max(g)={gmax:.4g}")
    return N


@torch.compiler.disable  # a compiled model calls the op eagerly (its kernels launch themselves)
@torch.no_grad()
def kda_infer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    g_min: float = -5.0,
    validate: bool = True,
    gate: str = "none",
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    l2norm_qk: bool = False,
    silu_qk: bool = False,
    beta_sigmoid: bool = False,
    norm_eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
    segment_chunks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward for inference (no autograd graph: the outputs carry no gradient).

    Inputs as for ``triton_chunk.chunk_kda`` (bounded mode), plus ``beta_sigmoid`` and ``cu_seqlens``.

    Args:
        q: ``[B, T, H, K]`` queries (raw if ``silu_qk`` / ``l2norm_qk`` are set).
        k: ``[B, T, H, K]`` keys, same dtype as q.
        v: ``[B, T, H, V]`` values, same dtype as q; bf16, fp16 or fp32 (accumulation is fp32).
        g: ``[B, T, H, K]``: with ``gate="none"`` the per-channel log decay (natural log) in
            ``[g_min, 0]``; with ``gate="bounded"`` the gate's raw input ``z``, turned into
            ``g = g_min * sigmoid(exp(A_log_h) (z + dt_bias))`` inside the op.
        beta: ``[B, T, H]`` write strength in (0, 1), or its logit with ``beta_sigmoid``.
        scale: multiplier on q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` state before the first token of each sequence (N = B, or
            the number of documents with ``cu_seqlens``), any float dtype; None: zeros.
        output_final_state: also return the state after the last token of each sequence.
        g_min: the bound of g (the bounded gate's floor), in
            ``[max_safe_g_min("fp32", 16), 0)`` (about -5.55 to 0).
        validate: check ``cu_seqlens`` (0 first, non-decreasing, T last) and, with ``gate="none"``,
            ``g_min <= g <= 0`` (a host sync each); with ``validate=False`` out-of-range values
            give undefined results.
        gate: ``"none" | "bounded"`` (the softplus gate is unbounded: not supported here).
        A_log: ``[H]`` log of the gate's per-head rate (``gate="bounded"`` only).
        dt_bias: ``[H * K]`` (or ``[H, K]``) per-channel gate bias, or None.
        l2norm_qk: L2-normalize q and k per head inside the op, ``x / max(||x||, norm_eps)``,
            after ``silu_qk``.
        silu_qk: apply SiLU to q and k first.
        beta_sigmoid: ``beta`` holds logits; the op applies the sigmoid.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of N documents packed in one row (B = 1):
            document n is tokens ``[cu_seqlens[n], cu_seqlens[n + 1])``, and the state restarts at
            each document (from ``initial_state[n]`` or zeros). Empty documents are allowed.
        segment_chunks: the recurrence's path. None: chosen by ``choose_segment_chunks`` (segmented
            only with few sequences x heads and long sequences, on the GPU); 0: the plain recurrence;
            L > 0: the segmented one, every sequence or document cut into pieces of L chunks (16 L
            tokens), run in parallel and joined by their state transitions (``InferPlan``). The
            result is the same up to rounding.

    Returns:
        ``o`` ``[B, T, H, V]`` in v's dtype and the final state ``[N, H, K, V]`` fp32 (or None).
    """
    p = InferPlan(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  g_min=g_min, validate=validate, gate=gate, A_log=A_log, dt_bias=dt_bias, l2norm_qk=l2norm_qk,
                  silu_qk=silu_qk, beta_sigmoid=beta_sigmoid, norm_eps=norm_eps, cu_seqlens=cu_seqlens,
                  segment_chunks=segment_chunks)
    p.run()
    return p.o, p.hT


class InferPlan:
    """One call of ``kda_infer``: its checked inputs, intermediates and outputs, and its launches.

    ``kda_infer`` calls ``run``: ``intra`` (the token-parallel kernel), then ``recur`` (the recurrence),
    each at its ``LAUNCH`` config; a benchmark can time the two apart. Arguments as for ``kda_infer``;
    ``o`` and ``hT`` hold the outputs once both have run.

    The segmented recurrence (``seg`` = L > 0 chunks per segment). Each chunk maps the state affinely,
    ``S <- (Diag(gl) - kd^T w) S + kd^T u``, with the same K-side operator for every column of S
    (value channel), so a segment of chunks maps it as ``S_end = A S_start + B`` with A ``[K, K]`` and
    B ``[K, V]``; both are the segment's final state when run from ``[I_K | 0]`` on ``[0 | v]``:

    1. every segment as a document of its own, K identity columns beside the V value columns
       (``AUG``: extra V-blocks that start from the identity and read no v) and no output:
       ``[A | B]``, fp32;
    2. per document, sequential over its segments: ``S_{s+1} = A_s S_s + B_s`` from the initial
       state (``_kda_infer_join``, fp32);
    3. every segment as a document again, from ``S_s``: the output, and the final state of each
       document's last segment.

    The sequential chain is L + P + L steps instead of P L (P segments), and the work (K + V) / V + 1
    times the plain recurrence's (phase 1 skips the output's loads and products). Segments are whole
    chunks: a sequence of n chunks gives ``cdiv(n, L)``, an empty document one empty segment.

    Packed documents' recurrence programs take the documents longest first (``_longest_first``): a
    launch of more programs than fit on the GPU at once starts them in about the order of their ids,
    so a long document whose programs start late would set the end of the launch.
    """

    def __init__(self, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True, g_min=-5.0,
                 validate=True, gate="none", A_log=None, dt_bias=None, l2norm_qk=False, silu_qk=False,
                 beta_sigmoid=False, norm_eps=1e-6, cu_seqlens=None, segment_chunks=None):
        N = _check(q, k, v, g, beta, scale, initial_state, g_min, validate, gate, A_log, dt_bias, norm_eps,
                   cu_seqlens)
        if segment_chunks is not None and (isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int)
                                           or segment_chunks < 0):
            raise ValueError(f"segment_chunks={segment_chunks!r} is not allowed: expected None or an int >= 0")
        B, T, H, K = q.shape
        V = v.shape[-1]
        C = CHUNK
        Kp = max(16, triton.next_power_of_2(K))
        Vp = max(16, triton.next_power_of_2(V))
        dev = q.device
        varlen = cu_seqlens is not None
        if varlen:
            cu = cu_seqlens.to(torch.int32)
            coff = torch.zeros(N + 1, device=dev, dtype=torch.int32)
            coff[1:] = torch.cumsum(torch.div(cu[1:] - cu[:-1] + (C - 1), C, rounding_mode="floor"), 0)
            NC = 0
            NS = triton.cdiv(T, C) + N  # >= sum_n cdiv(len_n, C), known without reading cu_seqlens
        else:
            cu = coff = torch.zeros(1, device=dev, dtype=torch.int32)
            NC = triton.cdiv(T, C)
            NS = B * NC
        if segment_chunks is None:
            chunks = triton.cdiv(T, C * N) if varlen else NC
            segment_chunks = 0 if _interpret() else choose_segment_chunks(N, H, chunks, K, V, _sms(dev))
        self.seg = segment_chunks
        # segments: exact for fixed length, an upper bound for packed documents (sum_n max(1, cdiv(n_n, L))
        # <= N + sum_n n_n / L); the bound's spare segments are empty ones at the end
        self.nseg = (B * triton.cdiv(NC, self.seg) if not varlen else N + triton.cdiv(NS, self.seg)) if self.seg else 0
        wd = _work_dtype(q.dtype)
        self.w, self.qg, self.kd = (torch.empty(H, NS * C, Kp, device=dev, dtype=wd) for _ in range(3))
        self.ab = torch.empty(H, NS * C, C, device=dev, dtype=_ab_dtype(q.dtype, l2norm_qk))
        self.Aqk = torch.empty(H, NS * C, C, device=dev, dtype=wd)
        self.gl = torch.empty(H * NS + 1, Kp, device=dev, dtype=torch.float32)  # + 1: the recurrence reads ahead
        self.o = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
        self.hT = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
        self.h0 = initial_state.contiguous() if initial_state is not None else None
        self.inputs = tuple(x.contiguous() for x in (q, k, v, g, beta))
        self.A_log, self.dt_bias, self.cu, self.coff = A_log, dt_bias, cu, coff
        self.scale = K**-0.5 if scale is None else float(scale)
        self.g_min, self.norm_eps, self.gate = float(g_min), float(norm_eps), gate
        self.flags = dict(SILU=bool(silu_qk), L2NORM=bool(l2norm_qk), BETA_SIGMOID=bool(beta_sigmoid))
        self.N, self.NC, self.NS, self.varlen, self.dims = N, NC, NS, varlen, (B, T, H, K, V, Kp, Vp)

    def intra_launch(self) -> tuple[int, int]:
        """(num_warps, num_stages) of the token-parallel kernel (``LAUNCH["intra"]``)."""
        return (1, 1) if _interpret() else LAUNCH["intra"]

    def recur_launch(self) -> tuple[int, int, int, int]:
        """(BV, num_warps, num_stages, maxnreg) of the recurrence (``LAUNCH["recur"]``); segmented: of
        phase 3."""
        return _recur_launch((self.nseg or self.N) * self.dims[2], self.dims[6], self.o.device)

    def path(self) -> dict:
        """Which recurrence runs, for benchmark records: ``segment_chunks`` (0: plain) and, segmented,
        the segments per sequence (fixed length) or per document (packed: reads ``cu_seqlens``, a host
        sync) and the launch config of each phase."""
        if not self.seg:
            return dict(segmented=False, segment_chunks=0, recur=list(self.recur_launch()))
        B, T, H, K, V, Kp, Vp = self.dims
        if self.varlen:
            per = [max(1, triton.cdiv(triton.cdiv(b - a, CHUNK), self.seg)) for a, b in
                   zip(self.cu.tolist(), self.cu.tolist()[1:])]
        else:
            per = triton.cdiv(self.NC, self.seg)
        return dict(segmented=True, segment_chunks=self.seg, segments=per,
                    phase1=list(_recur_launch(self.nseg * H, Vp, self.o.device, Kp)),
                    join=list(self._join_launch()), recur=list(self.recur_launch()))

    def run(self) -> None:
        """Both kernels: ``intra``, then ``recur``."""
        self.intra()
        self.recur()

    def intra(self) -> None:
        """The token-parallel kernel: w, Ab, qg, kd, A_qk, gl from the inputs, one chunk slot per program."""
        B, T, H, K, V, Kp, Vp = self.dims
        q, k, v, g, beta = self.inputs
        warps, stages = self.intra_launch()
        dummy = self.gl
        _kda_infer_intra[(self.NS, H)](
            q, k, g, beta, self.A_log if self.A_log is not None else dummy,
            self.dt_bias if self.dt_bias is not None else dummy, self.cu, self.coff,
            self.w, self.ab, self.qg, self.kd, self.Aqk, self.gl,
            self.scale, self.g_min, (CHUNK / 2) * self.g_min * LOG2E, self.norm_eps, T, self.NC, self.NS, self.N, H,
            K=K, BK=Kp, C=CHUNK, LOG_N=max(1, self.N.bit_length()), VARLEN=self.varlen, GATE=_GATE_ID[self.gate],
            HAS_BIAS=self.dt_bias is not None, **self.flags, IEEE=_ieee(q.dtype),
            num_warps=warps if Kp <= 128 else 2 * warps, num_stages=stages,
        )

    def recur(self) -> None:
        """The recurrence over chunks (after ``intra``): o and the final state; segmented, its three phases."""
        if not self.seg:
            order = self._order(self.coff[1:] - self.coff[:-1]) if self.varlen else None
            self._recur(self.N, self.cu, self.coff, self.h0, self.o, self.hT, self.recur_launch(),
                        varlen=self.varlen, order=order)
            return
        B, T, H, K, V, Kp, Vp = self.dims
        dev, f32 = self.o.device, torch.float32
        cu, coff, soff = self._segments()
        # the segments' order, for both phases: only packed documents have segments of unequal lengths
        order = self._order(coff[1:] - coff[:-1]) if self.varlen else None
        M = torch.empty(self.nseg, H, K, K + V, device=dev, dtype=f32)
        # phase 1 also computes each document's last [A | B], which the join never reads: skipping those
        # segments measured slower on the H200 than computing them
        self._recur(self.nseg, cu, coff, None, None, M, _recur_launch(self.nseg * H, Vp, dev, Kp),
                    varlen=True, aug=True, order=order)
        S0 = torch.empty(self.nseg, H, K, V, device=dev, dtype=f32)
        jbv, jwarps = self._join_launch()
        _kda_infer_join[(self.N * H * (Vp // jbv),)](
            M, self.h0 if self.h0 is not None else M, S0, soff, H,
            K=K, V=V, BK=Kp, BVF=Vp, BV=jbv, KC=16, HAS_H0=self.h0 is not None, num_warps=jwarps, num_stages=1,
        )
        Send = torch.empty_like(S0) if self.hT is not None else None
        self._recur(self.nseg, cu, coff, S0, self.o, Send, self.recur_launch(), varlen=True, order=order)
        if self.hT is not None:
            torch.index_select(Send, 0, soff[1:] - 1, out=self.hT)

    def _docs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token and chunk-slot offsets of the sequences (``[N + 1]`` each; fixed-length rows as documents
        of T tokens), on the device."""
        if self.varlen:
            return self.cu, self.coff
        return _row_offsets(self.dims[0], self.dims[1], self.NC, self.o.device)

    def _join_launch(self) -> tuple[int, int]:
        Vp = self.dims[6]
        return (min(_INTERP_BV, Vp), 1) if _interpret() else (min(LAUNCH["join"][0], Vp), LAUNCH["join"][1])

    def _segments(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Segments as documents, on the device (no host sync): their token offsets and chunk-slot
        offsets (``[nseg + 1]`` each, like ``cu`` and ``coff``: consecutive segments tile each
        document, consecutive documents follow each other, the bound's spare segments are empty at
        the end) and ``soff`` ``[N + 1]``, the first segment of each document. Fixed length: they depend
        on the shape only, so they are computed once per shape and device (``_fixed_segments``), which
        takes ``_segment_offsets``'s small launches off every call (not during CUDA graph capture: tensors
        made there come from the graph's memory pool and must not outlive it in a cache)."""
        dev = self.o.device
        if not self.varlen and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return _fixed_segments(self.dims[0], self.dims[1], self.NC, self.seg, self.nseg, dev)
        cu, coff = self._docs()
        return _segment_offsets(cu, coff, self.seg, self.nseg)

    def _order(self, chunks: torch.Tensor) -> torch.Tensor | None:
        """The recurrence's document order for ``chunks`` ``[N]`` (chunks per document): longest first
        with several documents, else None (document order)."""
        return _longest_first(chunks) if chunks.numel() > 1 else None

    def _recur(self, seqs, cu, coff, h0, o, hT, cfg, varlen, aug=False, order=None) -> None:
        """One launch of ``_kda_infer_recur`` at ``cfg`` = (BV, num_warps, num_stages, maxnreg) over ``seqs``
        documents (``cu``, ``coff``) or fixed-length rows; ``o`` None: no output (phase 1); ``aug``: with the
        identity columns (phase 1); ``order``: ``[seqs]`` the documents in the order the programs take them
        (``_order``), None: document order."""
        B, T, H, K, V, Kp, Vp = self.dims
        BV, warps, stages, maxnreg = cfg
        if aug and Kp % BV:
            raise ValueError(f"BV={BV} is not allowed for the segmented recurrence: expected a divisor of K = {Kp}")
        dtype = self.inputs[0].dtype
        dummy = self.gl
        _kda_infer_recur[(seqs * H * ((Vp + (Kp if aug else 0)) // BV),)](
            self.w, self.inputs[2], self.ab, self.qg, self.kd, self.Aqk, self.gl,
            _or(h0, dummy), _or(o, dummy), _or(hT, dummy), cu, coff, _or(order, dummy),
            T, self.NC, self.NS, H,
            K=K, V=V, BK=Kp, BVF=Vp, BV=BV, C=CHUNK, VARLEN=varlen, HAS_H0=h0 is not None,
            STORE_HT=hT is not None, DOT_BF16=_dot_bf16(dtype), IEEE=_ieee(dtype), AUG=aug, STORE_O=o is not None,
            ORDER=order is not None, num_warps=warps, num_stages=stages, **_cap(maxnreg),
        )


def _segment_offsets(cu: torch.Tensor, coff: torch.Tensor, L: int, nseg: int) -> tuple[torch.Tensor, ...]:
    """``InferPlan._segments`` from the documents' token and chunk-slot offsets ``cu``, ``coff`` ``[N + 1]``
    (on their device, no host sync): ``nseg`` segments of ``L`` chunks, the spare ones empty at the end."""
    N, dev = cu.numel() - 1, cu.device
    soff = torch.zeros(N + 1, device=dev, dtype=torch.int64)
    soff[1:] = torch.cumsum(torch.div(coff[1:] - coff[:-1] + (L - 1), L, rounding_mode="floor").clamp_min(1), 0)
    j = torch.arange(nseg, device=dev)
    n = torch.searchsorted(soff[1:], j, right=True).clamp_max(N - 1)  # spare segments: the last document
    s = j - soff[n]
    seg_cu = torch.cat([torch.minimum(cu[n] + s * (L * CHUNK), cu[n + 1]), cu[-1:]]).to(torch.int32)
    seg_coff = torch.cat([torch.minimum(coff[n] + s * L, coff[n + 1]), coff[-1:]]).to(torch.int32)
    return seg_cu, seg_coff, soff


@functools.lru_cache(maxsize=64)
def _fixed_segments(B: int, T: int, NC: int, L: int, nseg: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``_segment_offsets`` of ``B`` fixed-length rows of ``T`` tokens (``NC`` chunks each), computed on the
    host once per shape and copied to ``device``; the kernels only read them."""
    cpu = torch.device("cpu")
    return tuple(x.to(device) for x in _segment_offsets(*_row_offsets(B, T, NC, cpu), L, nseg))


def _row_offsets(B: int, T: int, NC: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token and chunk-slot offsets (``[B + 1]`` int32 each) of ``B`` fixed-length rows of ``T`` tokens and ``NC``
    chunks, as documents (``InferPlan._docs``)."""
    rows = torch.arange(B + 1, device=device, dtype=torch.int32)
    return rows * T, rows * NC


def _longest_first(chunks: torch.Tensor) -> torch.Tensor:
    """``[N]`` int32: the document indices by chunk count ``chunks`` ``[N]``, longest first (ties in index
    order), on the device (no host sync)."""
    return torch.argsort(chunks.to(torch.int32), descending=True, stable=True).to(torch.int32)


def _or(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """A kernel's pointer argument: ``t``, or ``dummy`` where the kernel's flags leave it unread."""
    return t if t is not None else dummy
