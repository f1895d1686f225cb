"""KDA inference forward in Triton: chunk 16, two kernels, no autograd graph.

Same semantics as ``naive_recurrent_kda`` (moelab/ops/kda/naive.py), per document and head::

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale * S_t^T q_t

with the op's input prep inside (optional SiLU and L2 norm of q and k, the bounded gate
``g = g_min * sigmoid(exp(A_log_h) (z + dt_bias))``, optional sigmoid of beta), an initial
state in, the final state out, and packed documents (``cu_seqlens``: the state restarts at each
document boundary). Used where no gradient is needed (prefill, evaluation); the training op is
``triton_chunk.chunk_kda``.

Why chunk 16: the training op's 64-token chunks need ``(I + A)^-1`` over 64 rows, which costs a
blockwise solve and a merge, and gated scores that cannot be one product (``e^{G}`` over 64
tokens at g = -5 spans e^{-320}). Over 16 tokens a bounded gate keeps ``G`` (the chunk-local
cumsum of g) inside ``[16 g_min, 0]``, so with a fixed reference ``ref = 8 g_min``
the factors ``e^{G - ref}`` and ``e^{ref - G}`` both stay within ``e^{8 |g_min|}`` (e^{44.4}
at the floor ``max_safe_g_min("fp32", 16)``): each score matrix is one ``[16, K] x [K, 16]``
product, and the 16x16 inverse takes 8 small products (below). All of that is per chunk and
independent of the state, so it runs token-parallel; only the state recurrence is sequential.

Kernels (bases of exponentials are 2: G is kept in log2 units, ``exp2(G)`` is ``e^{G ln 2}``):

* ``_kda_infer_intra``, grid ``[chunks / per_program, H]`` (token-parallel): loads the raw q, k, z,
  v, beta of one 16-token chunk and one head (all five reads issued before any math, so their
  latencies overlap; with several chunks per program, in a pipelined loop); SiLU / L2 norm, gate, ``G``;
  ``A_qk = scale lower(sum_d q_id k_jd e^{G_id - G_jd})``,
  ``L = strict_lower(beta_i sum_d k_id k_jd e^{G_id - G_jd})``,
  ``Ai = (I + L)^-1`` by block doubling (4 levels of two small products instead of a 15-step
  substitution; see ``_unit_lower_inv``), then ``w = Ai (beta k e^G)``, ``u = Ai (beta v)``,
  ``qg = scale q e^G``, ``kd = k e^{G_last - G}``, ``gl = e^{G_last}``: everything the recurrence
  reads, so its loop carries no exp, cumsum or solve.
* ``_kda_infer_recur``, grid ``[docs * H * V-blocks]`` (head x V-block parallel, sequential over
  chunks): the state's V columns evolve independently given the K-side tiles, so each program
  owns ``BV`` of them (``pick_recur``: 32, or 64 once the launch saturates the GPU). It holds
  that slice transposed, ``hv = h^T`` ``[BV, K]``, fp32 in
  registers: ``U^T = u^T - hv w^T``, ``o^T = hv qg^T + U^T A_qk^T`` (written straight to the
  output), ``hv <- hv Diag(gl) + U^T kd``. Both quantities that the chunk loop carries from one
  product to the next (hv, U^T) are left operands, whose mma.sync layout is the accumulator's, so
  the chain from one chunk's state to the next's has no shared-memory round trip; the per-chunk
  tiles (w^T, qg^T, kd, A_qk^T) are right operands, copied to shared memory two chunks ahead by the
  software pipeline. Output and state in one pass: the chunk states are never stored (at chunk
  16 they would be ``K V / 16`` values per token).
* Segmented recurrence, for few sequences x heads and long sequences (``choose_segment_chunks``,
  by a cost model of the recurrence in chunk steps and state columns per SM, ``recur_cost``):
  the same kernel on segments of the sequences, first for each segment's state transition
  ``S_end = A S_start + B`` (identity V-blocks, no output), then ``_kda_infer_join`` chains the
  transitions into each segment's start state, then the kernel again for the output
  (``InferPlan``): a chain of ``n / P + P + n / P`` steps instead of ``n`` over P segments.
* ``fold_v`` (the default, ``FOLD_V``; measured on the H200 at fdd7e59): the intra kernel stores
  ``Ab = (I + L)^-1 Diag(beta)`` instead of u and the recurrence forms ``u = Ab v`` from the raw v
  (448 B fewer per token and head at K = V = 128): B1 T8192 H64 0.903 ms against 1.113 with u
  materialised, in one run. ``fold_v=False`` runs the u path.
* Candidates, off by default: ``pieces`` (``PIECES``) overlaps the intra kernel and the plain
  recurrence, piece by piece of every document, on two streams (``InferPlan._run_pieces``); measured
  at fdd7e59 it gains 2-4% on the u path and loses 28% with ``fold_v`` (1.153 ms at 4 pieces).
* ``recur_maxnreg`` (the default, ``RECUR_MAXNREG`` = 168): a register cap on the recurrence's 4-warp
  launches, for a third program per SM where a launch saturates the GPU (bfaed65, every 4-warp row 1-6%
  faster, e.g. packed B1 T8192 H96 1.104 ms against 1.168; the 2-warp launches, 6-15% slower capped,
  stay uncapped). ``recur_maxnreg=0`` runs without it.
* ``longest_first`` (the default, ``LONGEST_FIRST``, packed documents): the recurrence's programs take
  the documents longest first (B1 T32768 H16 packed: 1.079 ms against 1.173 in document order).

Bytes per token and head of each kernel and path, what the H200 measured against them, and the
parallelism: kernels/README.md, "Inference forward".

Intermediates are stored head-major (``[H, slots * 16, Kp]``) so that the recurrence reads one
contiguous block per chunk. Documents are padded to whole chunks inside the kernels (masked
loads; padded rows have q = k = v = beta = 0 and g = 0, so they change nothing). Packed
documents get consecutive chunk slots; ``coff[n]`` is the first slot of document n, and the
intra kernel finds its document by a binary search in ``coff`` (no host sync: the grid is the
upper bound ``cdiv(T, 16) + N`` slots, and slots past the last are masked out).

Precision: fp32 inputs take exact fp32 products (``input_precision="ieee"``, the reference use);
bf16 inputs store the intermediates in bf16 and take bf16 operands in the recurrence's products
(the state stays fp32 between them), the intra kernel's products take fp32 (TF32) operands;
fp16 inputs keep fp32 intermediates and TF32 products.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import triton
import triton.language as tl

from moelab.ops.kda.bounds import max_safe_g_min
from moelab.ops.kda.gate import check_op_shapes
from moelab.ops.kda.triton_common import LOG2E, _cast, _dot
from moelab.ops.kda.triton_prep import _gate, _qk_fwd

CHUNK = 16  # tokens per chunk: the bound on |G - ref| (module docstring) is what allows 16
GATES = ("none", "bounded")
_GATE_ID = {"none": 0, "bounded": 1}
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Launch configs on the GPU. The H200 sweep ``kernels/bench_kda.py --part infer --infer-sweep``
# times every candidate per kernel and shape and prints the fastest (the JSON records what ran,
# ``meta.launch``); sweeps so far: kernels/results/history/kda_infer_sweep_h200_{1aca9ee,6d91d0b}.json.
# intra: (num_warps, num_stages, per_program), all of K in one program: 2 warps was the fastest at all
# four shapes in both sweeps, 0.51-0.54 ms against 0.72 (4 warps), 0.97 (1 warp) and 1.16 (8 warps) at
# B1 T8192 H64 (2.1 TB/s of the least bytes), so the wait is each program's memory latency, not bandwidth.
# per_program > 1: one program takes that many consecutive chunk slots of a head in a loop pipelined
# over num_stages, the next slot's loads in flight while one computes: 20-25% slower in the second
# sweep. Registers at D = 128 (sm_90a, Triton 3.9, ptxas -v), fold_v kernel: (2, 1, 1) 204, no spills (255 and
# 36 B spilled before it kept only three [16, K] tiles live). The fold_v sweep at 503d12f (B1 T8192 H64): 2 warps
# 0.416 ms, 4 warps 0.621; a maxnreg cap (the optional 4th entry: 168 at 2 warps, 128 at 4) changed neither.
# recur: candidates (BV, num_warps, num_stages, columns per SM), widest V-block first; the op takes the
# first whose BV fits the state and whose launch holds at least that many state columns per SM
# (``pick_recur``). BV = 16 x num_warps: each warp owns 16 rows of the transposed state, so products
# chain in registers (``_kda_infer_recur``); 2 warps on a 16-row block only duplicate the work (Triton
# gives both warps the same 16 rows). Measured (ms, both sweeps): B1 T8192 H64 32/2/3 0.59, 64/4/3 0.60,
# 16/1/3 0.61; H96 0.64 / 0.66 / 0.67; B8 T4096 H16 64/4/3 0.35, 32/2/3 0.36; plain B1 T32768 H16 32/2/3
# 2.06, 16/1/3 2.12, 64/4/3 2.24; its segmented recurrence (9 segments) 64/4/3 1.20, 16/1/3 1.28, 32/2/3
# 1.37. So 64-wide blocks (4 warps, warpgroup MMA) win once the GPU is saturated (``recur_cost``: 96
# columns per SM, the B8 T4096 H16 grid has 124, the segmented one 140-280), where every V-block's
# re-read of the head's K-side tiles costs throughput, and 32 below it. Three stages: the pipeline then
# issues a chunk's copies two chunks ahead; with two it issues them at the end of the chunk before.
# join (phase 2 of the segmented recurrence, below): (BV, num_warps); its products are exact fp32
# (FMA, not tensor cores), one [BV, K] x [K, K] per segment: 16-wide blocks, 4 warps compile without
# spills at K = 128 (241 registers, sm_90a with Triton 3.9; 2 warps spill).
LAUNCH: dict = {"intra": (2, 1, 1, 0), "recur": ((64, 4, 3, 96), (32, 2, 3, 0), (16, 1, 3, 0)), "join": (16, 4)}
_INTERP_BV = 16  # the interpreter: 16-wide V-blocks so that small test shapes take several

# Paths measured on the H200 (kernels/README.md, "Inference forward"; kernels/results/history/
# kda_infer_cand_h200_fdd7e59.json, kda_infer_foldv_h200_fdd7e59.json):
# FOLD_V (on): the intra kernel stores (I + L)^-1 Diag(beta) (16 x 16 per chunk) instead of u = that times v
# (16 x V), and the recurrence forms u from v itself (one small product per chunk, off its chain):
# 448 B fewer per token and head at K = V = 128 (the intra kernel neither reads v nor writes u).
# PIECES (1: off; 2 and 4 gained 2-4% on the u path, and 4 lost 28% with FOLD_V): the plain recurrence and
# the intra kernel overlapped in time: each document cut into that many
# pieces; the intra kernel runs piece by piece on the current stream, the recurrence of piece p on a
# high-priority stream as soon as the intra kernel has finished piece p (the recurrence holds a few
# programs per SM; the intra kernel fills the rest of the GPU meanwhile).
FOLD_V = True
PIECES = 1
# Packed documents cost the intra kernel ~22% over fixed-length rows of the same tokens (H200, a5a5968-4f11d11:
# 0.497-0.519 ms against 0.409-0.415 at 524,288 token-heads, B1 T32768 H16, B1 T8192 H64, B8 T4096 H16), with the
# same registers (203 / 204) and vector loads in the sm_90a compile (``make kda-aot ARGS=--infer``). The one
# difference in the code is the chunk slot's document: found by a binary search in ``coff``, so every load of
# the program waits on that search. Tried and reverted (kernels/results/history/kda_infer_table_ab_h200_deb6edd.json,
# kda_infer_intra_ab_h200_4f11d11.json): a table of slot spans written by a small kernel first (one dependent
# load instead of four: 1-3% slower with its launch), the heads of a slot numbered next to each other (a 1-D grid,
# +-1%), 2 or 4 slots per program pipelined over 2 stages (7-10% slower, also at fixed length), cu and coff
# loaded whole with a vector compare for the document (kda_infer_vecdoc_ab_h200_bcb31d1.json: equal at 6
# documents, 4% slower at 48). The same tokens as one packed document (N = 1, one step of search) take 0.490 ms
# against 0.409 fixed. The lookup is not the cause either (session 17, B1 T32768 H16, intra alone): the documents
# passed as kernel arguments from a host copy of cu_seqlens, so that no load precedes the main loads, took 0.486-0.497
# ms (kda_infer_argd_ab_h200_d022d02.json: the whole op 0.4-1% faster at the four packed shapes; reverted, not worth
# a host sync and 17 kernel arguments); one document that way, with every int argument and the slot count as in the
# fixed launch, 0.486 against 0.408 (kda_infer_ns_ab_h200_19f6724.json, kda_infer_sass_ab_h200_19f6724.json). The two
# compiled kernels hold the same loads and stores (12 LDG.128, 8 LDG.U16, 12 STG.128; ptxas 202-204 registers) and
# differ in the address arithmetic, the row masks' predicates and the schedule; the fixed kernel's own rows masked
# as "every row of a live slot" instead of "rows before the end" (one predicate for all rows in both) take 0.46
# (kda_infer_uniform_rows_ab_h200_19f6724.json). So the 0.41 of fixed rows is the compiler's schedule of that exact
# code, and small changes of the index arithmetic move it by 10-20%.
# (WHOLE_CHUNK_BRANCH, below, takes back about half of it.)
# LONGEST_FIRST (on since the H200 run at 9c4e7c3, kernels/results/history/kda_infer_h200_9c4e7c3.json; faster on
# every packed row it ran: B1 T32768 H16 1.079 ms against 1.173 in document order, B1 T8192 H64 0.911 / 0.939,
# B8 T4096 H16 0.945 / 0.953): packed documents' recurrence programs ordered by the document's chunk count, longest
# first. A launch of more programs than fit on the GPU at once starts them in about the order of their ids, so a long
# document whose programs start late sets the end of the launch; longest first is the classic list-scheduling order
# against that tail.
LONGEST_FIRST = True
# WHOLE_CHUNK_BRANCH (on since session 17): in the packed intra kernel, a chunk whose 16 rows all lie in its document
# (every chunk but a document's last) loads z, k and q in a branch of its own under one mask for all rows; the
# document's last chunk takes the other branch, with rows past the document's end masked. H200, intra alone, packed
# B1 T32768 H16: 0.448-0.451 ms against 0.497-0.500; the whole op 0.916 / 0.965-0.971 ms, B1 T8192 H64 0.702 /
# 0.752-0.755, B8 T4096 H16 0.722 / 0.775-0.787, B1 T8192 H96 1.021 / 1.098-1.100 (kernels/results/history/
# kda_infer_maskv_ab_h200_263a987.json, variant 3; two other formulations of the row mask, t0 + r < end and
# r < min(end - t0, 16), changed nothing). On fixed-length rows the same branch cost 2% (0.418-0.423 / 0.408-0.410):
# they keep the one load path.
WHOLE_CHUNK_BRANCH = True
# RECUR_MAXNREG (on since the H200 run at bfaed65, kernels/results/history/kda_infer_cap_h200_bfaed65.json): ptxas's
# register cap on the recurrence's launches of at least RECUR_CAP_MIN_WARPS warps. Where a launch holds more programs
# than fit on the GPU at once, each SM runs as many programs as its 64K registers allow, and each program's chain of
# small products waits on latency, so more programs per SM mean more throughput. sm_90a compile (``make kda-aot
# ARGS='--infer --maxnreg 168'``, Triton 3.9, bf16, K = V = 128, fold_v), registers uncapped -> at 168, 64/4/3: packed
# documents 214 -> 168 and fixed rows 174 -> 168 without spills (2 -> 3 programs per SM), phase 3 211 -> 168 with 12 B
# spilled (2 -> 3), phase 1 158 -> 145 (3 either way); 32/2/3: 184 -> 168, 24 B spilled (5 -> 6). Measured against no
# cap in that run: every 64/4/3 row faster (packed B1 T8192 H64 0.757 ms / 0.793, H96 1.104 / 1.168, B8 T4096 H16 0.776
# / 0.814, fixed B8 T4096 H16 0.653 / 0.662, segmented B1 T32768 H16 1.258 / 1.281), every 32/2/3 row slower (fixed B1
# T8192 H64 0.900 / 0.781, H96 1.155 / 1.086, packed B1 T32768 H16 1.071 / 0.963): the 2-warp launches, whose programs
# already fill the SMs 5 at a time, stay uncapped.
RECUR_MAXNREG = 168
RECUR_CAP_MIN_WARPS = 4

# Recurrence cost model, for the choice between the plain and the segmented recurrence and of the
# segment length, in units of one latency-bound chunk step (~1.0 us on the H200: plain B1 T32768 H16,
# 2048 columns, 2.06 ms for 2048 chunks). A launch's state columns (sequences x heads x V, padded, plus K
# identity columns per pair in phase 1) spread over the SMs in 16-row warps; below about SAT_COLS_PER_SM
# columns per SM (3 programs of 32 columns) each chunk step costs that fixed latency, above it the GPU
# is saturated and time grows with the columns: ``chain (1 + (cols / sat)^3)^(1/3)``, the larger of the
# two bounds with a soft knee. Against the sweeps (at 1.0 us a step): plain B1 T8192 H64 (0.65 sat)
# 0.56 ms predicted, 0.59 measured; H96 (0.97 sat) 0.64 / 0.64; B8 T4096 H16 (1.29 sat) 0.38 / 0.35;
# segmented B1 T32768 H16 at 8 and 16 segments 1.10 / 1.23 each, at 32 1.19 / 1.37; segmented B1 T8192
# H64 at 2 and 4 segments 1.07 and 1.03 / 1.18, against 0.56 / 0.59 plain. JOIN_STEPS: one step of the
# join (a [K, K] product per segment, fp32 FMA, reading [A | B] from memory, one segment after another), fitted to
# the segment sweep at bfaed65 (kernels/results/history/kda_infer_seg_sweep_h200_bfaed65.json, B1 T32768 H16, the
# whole op, register cap on): with 12, 4 / 8 / 16 segments model 1.37 / 1.17 / 1.21 ms against 1.38 / 1.13-1.18 /
# 1.25-1.28 measured, and 32 / 64 segments (6d91d0b sweep) 1.40 / 1.78 against 1.37 / 1.75. At 6 (until bfaed65)
# the model put 8 and 16 segments level and took 16, the slower of the two by 0.1 ms;
# SEG_FIXED_STEPS: the segmented path's fixed cost (two more launches, the segment offsets, the final
# state's gather: ~20 us). SEG_MIN_LEN: no shorter segments (measured down to 32 chunks, slower there).
# SEG_MIN_GAIN: the segmented recurrence must be predicted that much faster (the model is within ~15%).
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


def pick_recur(cols: int, width: int, sms: int) -> tuple[int, int, int]:
    """(BV, num_warps, num_stages) of a recurrence launch of ``cols`` state columns whose V-blocks must
    divide ``width``: the first of ``LAUNCH["recur"]`` that fits and whose column floor per SM
    ``cols`` reaches, else the narrowest."""
    cands = [c for c in LAUNCH["recur"] if c[0] <= width] or [min(LAUNCH["recur"], key=lambda c: c[0])]
    c = next((c for c in cands if cols >= c[3] * sms), cands[-1])
    return c[0], c[1], c[2]


@contextlib.contextmanager
def launch_overrides(intra: tuple | None = None, recur: tuple | None = None):
    """Run the op with ``LAUNCH["intra"]`` = ``(num_warps, num_stages, per_program, maxnreg)`` (or a
    prefix of it: one chunk slot per program, no register cap) and/or ``LAUNCH["recur"]`` =
    ``((BV, num_warps, num_stages[, columns per SM]), ...)`` replaced (a missing column floor is 0),
    restored on exit (launch sweeps, A/B runs)."""
    saved = dict(LAUNCH)
    if intra is not None:
        if len(intra) not in (2, 3, 4) or any(int(x) < 1 for x in intra[:3]) or (
                len(intra) >= 3 and int(intra[2]) & (int(intra[2]) - 1)) or (
                len(intra) == 4 and not _maxnreg_ok(int(intra[3]))):
            raise ValueError(f"intra={intra!r} is not allowed: expected (num_warps, num_stages[, per_program[, "
                             "maxnreg]]), each >= 1, per_program a power of two (maxnreg: 0 for no cap, or 32..255)")
        LAUNCH["intra"] = tuple(int(x) for x in intra) + (1, 0)[len(intra) - 2:]
    if recur is not None:
        if not recur or any(len(c) not in (3, 4) for c in recur):
            raise ValueError(f"recur={recur!r} is not allowed: expected ((BV, num_warps, num_stages[, columns "
                             "per SM]), ...)")
        LAUNCH["recur"] = tuple(tuple(int(x) for x in c) + (0,) * (4 - len(c)) for c in recur)
    try:
        yield
    finally:
        LAUNCH.clear()
        LAUNCH.update(saved)


def _maxnreg_ok(maxnreg) -> bool:
    """A register cap as the launches take it: 0 (none) or an int in ptxas's range 32..255."""
    return isinstance(maxnreg, int) and not isinstance(maxnreg, bool) and (maxnreg == 0 or 32 <= maxnreg <= 255)


def _cap(maxnreg: int) -> dict:
    """Launch keywords for the register cap ``maxnreg`` (0: none; none in the interpreter either)."""
    return {"maxnreg": maxnreg} if maxnreg and not _interpret() else {}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _doc_of_slot(coff, i_s, N, LOG_N: tl.constexpr):
    """Document of chunk slot ``i_s``: the largest n in ``[0, N)`` with ``coff[n] <= i_s`` (the
    last of equal entries, so an empty document, which owns no slot, is skipped)."""
    lo = i_s * 0
    hi = lo + N - 1
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi + 1) // 2
        ok = tl.load(coff + mid) <= i_s
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _load_zkq(z, k, q, off, mask):
    """The gate input, k and q tiles of one chunk at offsets ``off`` ``[C, BK]``, masked lanes 0."""
    return (tl.load(z + off, mask=mask, other=0.0), tl.load(k + off, mask=mask, other=0.0),
            tl.load(q + off, mask=mask, other=0.0))


@triton.jit
def _unit_lower_inv(L, IEEE: tl.constexpr, C: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[C, C]`` fp32 tile (C a power of two) by block doubling:
    with ``X`` the block-diagonal inverse at block size s, the inverse at 2s is ``X - X L_s X``,
    ``L_s`` = the entries of L in the lower-left s x s block of each 2s x 2s diagonal block
    (``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``). Every intermediate is a block
    of the true inverse, so rounding is not amplified; the Neumann product
    ``(I - L)(I + L^2)(I + L^4)(I + L^8)`` (two products fewer) forms powers of L whose entries
    reach ~1e3 when keys are correlated and the decay is weak, and lost 1.7e-5 in fp32 on such
    inputs (tests/ops/test_kda_infer.py, ``hard``: final state) against 4.6e-7 of this form."""
    r = tl.arange(0, C)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for lvl in tl.static_range(C.bit_length() - 1):
        bi = r[:, None] >> lvl  # block index at size s = 2^lvl (no constexpr reassignment in the loop)
        bj = r[None, :] >> lvl
        sel = ((bi % 2) == 1) & (bj == bi - 1)
        X = X - _dot(_dot(X, tl.where(sel, L, 0.0), IEEE), X, IEEE)
    return X


@triton.jit
def _kda_infer_intra(
    q, k, v, z, beta, A_log, dt_bias, cu, coff, poff, pbase,
    w, u, ab, qg, kd, Aqk, gl,
    scale, g_min, mid, eps, T, NC, NS, N, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, C: tl.constexpr,
    LOG_N: tl.constexpr, VARLEN: tl.constexpr, GATE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, IEEE: tl.constexpr, PER: tl.constexpr, STAGES: tl.constexpr,
    FOLD_V: tl.constexpr, PIECE: tl.constexpr, WHOLE_BRANCH: tl.constexpr,
):
    """Chunk slots ``[PER i, PER (i + 1))`` of one head, ``i`` = program 0 (see the module docstring).
    ``mid`` is the reference ``C/2 * g_min`` in log2 units; ``BK``, ``BVF`` are K, V padded to powers of
    two >= 16 (the intermediates' widths).

    ``FOLD_V``: no v read and no u written; ``ab`` gets ``(I + L)^-1 Diag(beta)`` ``[C, C]`` per slot
    instead (the recurrence forms u from v). ``PIECE``: the slots of one piece of every document
    (``InferPlan.run`` with pieces): this launch's i-th slot is chunk ``pbase[n] + i - poff[n]`` of
    document n, the last n with ``poff[n] <= i`` (``cu``, ``coff`` describe the documents; fixed-length
    rows come as documents of T tokens).

    Several slots per program: the loop over them is software-pipelined (``STAGES``), so the next
    slot's loads are in flight while this one computes; each slot computes exactly as with
    ``PER = 1``. Slots past the last (the grid's tail, or past the last document's end) are masked
    out of every load and store, not returned from: a return cannot leave a pipelined loop.

    ``WHOLE_BRANCH`` (packed): a chunk with all its rows in its document loads under one mask for every
    row, in a branch of its own (``WHOLE_CHUNK_BRANCH``)."""
    i_h = tl.program_id(1)
    r = tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BVF)
    km = ck < K
    pk = r[:, None] * (H * K) + ck[None, :]
    pw = r[:, None] * BK + ck[None, :]
    if PIECE:
        last = tl.load(poff + N)  # slots of this piece
    elif VARLEN:
        last = tl.load(coff + N)  # slots in use
    else:
        last = NS
    if GATE != 0:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if HAS_BIAS:
            bias = tl.load(dt_bias + i_h * K + ck, mask=km, other=0.0).to(tl.float32)
    if VARLEN and not PIECE:
        # the documents of all PER slots found up front, side by side: every load of a slot waits on its
        # document's lookup, so the program waits on the lookups once, not once per slot
        js = tl.program_id(0) * PER + tl.arange(0, PER)
        ns = _doc_of_slot(coff, js, N, LOG_N)
        t0_all = tl.load(cu + ns).to(tl.int64) + (js - tl.load(coff + ns)).to(tl.int64) * C
        eos_all = tl.load(cu + ns + 1).to(tl.int64)
    for j in tl.range(0, PER, num_stages=STAGES):
        i_s = tl.program_id(0) * PER + j
        live = i_s < last
        if PIECE:
            n = _doc_of_slot(poff, i_s, N, LOG_N)
            bos = tl.load(cu + n).to(tl.int64)
            eos = tl.load(cu + n + 1).to(tl.int64)
            c = tl.load(pbase + n) + i_s - tl.load(poff + n)
            i_s = tl.load(coff + n) + c  # the chunk's slot in the intermediates
            t0 = bos + c * C  # first token of the chunk (int64: B*T*H*K may pass 2^31)
        elif VARLEN:
            t0 = tl.sum(tl.where(tl.arange(0, PER) == j, t0_all, 0))
            eos = tl.sum(tl.where(tl.arange(0, PER) == j, eos_all, 0))
        else:
            n = i_s // NC
            c = i_s % NC
            bos = n.to(tl.int64) * T
            eos = bos + T
            t0 = bos + c * C
        # a slot past the last reads no row and writes none (the interpreter cannot broadcast a scalar mask)
        rm = r < tl.where(live, eos - t0, 0)
        sm = r[:, None] < tl.where(live, C, 0)
        mk = rm[:, None] & km[None, :]
        src = t0 * H + i_h

        # every load first, in the input dtype: the five reads are independent, and issued together
        # they wait out one memory latency instead of five in a row (the kernel is bound by memory)
        if VARLEN and WHOLE_BRANCH:
            if eos - t0 >= C:  # a whole chunk: every row under one mask (``WHOLE_CHUNK_BRANCH``)
                x, kr, qr = _load_zkq(z, k, q, src * K + pk, (r < tl.where(live, C, 0))[:, None] & km[None, :])
            else:
                x, kr, qr = _load_zkq(z, k, q, src * K + pk, mk)
        else:
            x, kr, qr = _load_zkq(z, k, q, src * K + pk, mk)
        if not FOLD_V:
            vr = tl.load(v + src * V + r[:, None] * (H * V) + cv[None, :], mask=rm[:, None] & (cv < V)[None, :],
                         other=0.0)
        b = tl.load(beta + src + r * H, mask=rm, other=0.0).to(tl.float32)

        x = x.to(tl.float32)
        if GATE != 0:
            if HAS_BIAS:
                x += bias[None, :]
            x = _gate(x, a, g_min, GATE)
        # padded rows and channels: g = 0, so G stays flat there and G at the last row is G_last
        G = tl.cumsum(tl.where(mk, x, 0.0) * 1.4426950408889634, axis=0)
        Gl = tl.sum(tl.where(r[:, None] == C - 1, G, 0.0), axis=0)
        if BETA_SIGMOID:
            b = tl.where(rm, tl.sigmoid(b), 0.0)
        hs = (i_h * NS + i_s).to(tl.int64)  # the slot's row block in the head-major intermediates
        tl.store(gl + hs * BK + ck, tl.exp2(Gl), mask=ck < tl.where(live, BK, 0))

        # |G - mid| <= C/2 |g_min| for g in [g_min, 0]: both factors stay finite, and
        # the entries above the diagonal (which may overflow) are dropped by selects, not products.
        # Only three [C, K] tiles stay live after this block (k up, k down, q up): e^G = up 2^mid is a
        # scalar multiple of up, so neither G nor the normalised k and q outlive it (register pressure
        # sets how many programs share an SM, and the kernel waits on each program's memory latency)
        up = tl.exp2(G - mid)
        kn = _qk_fwd(kr.to(tl.float32), eps, SILU, L2NORM)
        kup = kn * up
        kdn = kn * tl.exp2(mid - G)
        qup = _qk_fwd(qr.to(tl.float32), eps, SILU, L2NORM) * up
        emid = tl.exp2(mid)
        # e^{G_last - G} = e^{G_last - mid} e^{mid - G}: one exp of a K-vector instead of a tile
        tl.store(kd + hs * (C * BK) + pw, (kdn * tl.exp2(Gl - mid)[None, :]).to(kd.dtype.element_ty), mask=sm)
        tl.store(qg + hs * (C * BK) + pw, (qup * (scale * emid)).to(qg.dtype.element_ty), mask=sm)
        kT = tl.trans(_cast(kdn, False))
        sk = _dot(_cast(kup, False), kT, IEEE)
        sq = _dot(_cast(qup, False), kT, IEEE)
        tl.store(Aqk + hs * (C * C) + r[:, None] * C + r[None, :],
                 tl.where(r[:, None] >= r[None, :], sq * scale, 0.0).to(Aqk.dtype.element_ty), mask=sm)
        Ai = _unit_lower_inv(tl.where(r[:, None] > r[None, :], sk * b[:, None], 0.0), IEEE, C)
        tl.store(w + hs * (C * BK) + pw, _dot(Ai, kup * (b * emid)[:, None], IEEE).to(w.dtype.element_ty), mask=sm)
        if FOLD_V:  # beta folded into the inverse's columns: the recurrence forms u = Ab v
            tl.store(ab + hs * (C * C) + r[:, None] * C + r[None, :], (Ai * b[None, :]).to(ab.dtype.element_ty),
                     mask=sm)
        else:
            tl.store(u + hs * (C * BVF) + r[:, None] * BVF + cv[None, :],
                     _dot(Ai, vr.to(tl.float32) * b[:, None], IEEE).to(u.dtype.element_ty), mask=sm)


@triton.jit
def _kda_infer_recur(
    w, u, v, ab, qg, kd, Aqk, gl, h0, o, hT, cu, coff, pbase, psize, order,
    T, NC, NS, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_BF16: tl.constexpr,
    IEEE: tl.constexpr, AUG: tl.constexpr, STORE_O: tl.constexpr, FOLD_V: tl.constexpr, PIECE: tl.constexpr,
    ORDER: tl.constexpr,
):
    """Columns ``[i_v BV, (i_v + 1) BV)`` of the state of one document and head, over its chunks,
    held transposed (``hv = h^T``, ``[BV, K]``): ``U^T = u^T - hv w^T``,
    ``o^T = hv qg^T + U^T A_qk^T``, ``hv <- hv Diag(gl) + U^T kd``; initial state in, final out.

    Transposed, the state and ``U^T`` are the left operands of the products that read them, so
    a product's fp32 result becomes the next product's operand in registers (the accumulator
    and left-operand layouts of mma.sync match; a right operand needs a shared-memory round trip
    each chunk), and everything loaded per chunk is a right operand, which the software pipeline
    copies to shared memory ahead of use (``num_stages``).

    ``AUG`` (phase 1 of the segmented recurrence, ``InferPlan``): the state gets ``K`` more columns
    in front, ``BK / BV`` V-blocks that start from the identity and read ``u = 0`` (nothing loaded),
    so the final state is ``[A | B]`` (``S_end = A S_start + B``), stored ``[K, K + V]`` per document
    and head; no initial state. ``STORE_O`` false: no output, and none of the loads and products
    that only feed it.

    ``FOLD_V``: u is not read but formed per chunk, ``u^T = v^T Ab^T`` from the raw v (``[B, T, H, V]``
    or packed) and the intra kernel's ``Ab = (I + L)^-1 Diag(beta)``, in fp32 (TF32) products: off the
    chain from one state to the next, and u is never rounded to the work dtype. ``PIECE`` (with
    ``VARLEN``): only chunks ``[pbase[n], pbase[n] + psize[n])`` of document n, from ``h0`` to ``hT``
    (``InferPlan.run`` with pieces). ``ORDER`` (with ``VARLEN``): the programs take the documents in the
    order ``order[0], order[1], ...`` (``InferPlan``'s ``longest_first``: longest first), not 0, 1, ...;
    what each program computes is unchanged."""
    NI: tl.constexpr = BK // BV if AUG else 0  # identity V-blocks
    NV: tl.constexpr = BVF // BV + NI
    VS: tl.constexpr = K + V if AUG else V  # columns of the stored final state
    pid = tl.program_id(0)
    i_v = pid % NV  # the V-blocks of one head are neighbours: they read the same K-side tiles
    i_nh = pid // NV
    n = i_nh // H
    i_h = i_nh % H
    if ORDER:
        n = tl.load(order + n)
        i_nh = n * H + i_h
    if VARLEN:
        bos = tl.load(cu + n).to(tl.int64)
        eos = tl.load(cu + n + 1).to(tl.int64)
        s0 = tl.load(coff + n)
        nc = tl.load(coff + n + 1) - s0
        if PIECE:
            first = tl.load(pbase + n)
            s0 += first
            nc = tl.load(psize + n)
            bos += first.to(tl.int64) * C
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
        s0 = n * NC
        nc = NC
    r = tl.arange(0, C)
    dk = tl.arange(0, BK)
    if AUG:
        ident = i_v < NI
        cv = tl.where(ident, i_v, i_v - NI) * BV + tl.arange(0, BV)  # the column among K, or among V
        vm = cv < tl.where(ident, K, V)
        col = cv + tl.where(ident, 0, K)  # the column of [A | B]
        h = tl.where((cv[:, None] == dk[None, :]) & vm[:, None] & ident, 1.0, 0.0)
    else:
        cv = i_v * BV + tl.arange(0, BV)
        vm = cv < V
        col = cv
    hm = vm[:, None] & (dk < K)[None, :]
    ph = i_nh.to(tl.int64) * (K * VS) + col[:, None] + dk[None, :] * VS
    if HAS_H0:
        h = tl.load(h0 + ph, mask=hm, other=0.0).to(tl.float32)
    elif not AUG:
        h = tl.zeros([BV, BK], dtype=tl.float32)
    hs = (i_h * NS + s0).to(tl.int64)
    w += hs * (C * BK)
    qg += hs * (C * BK)
    kd += hs * (C * BK)
    u += hs * (C * BVF)
    ab += hs * (C * C)
    Aqk += hs * (C * C)
    gl += hs * BK
    o += (bos * H + i_h) * V
    v += (bos * H + i_h) * V
    pkT = dk[:, None] + r[None, :] * BK  # [BK, C]: w^T and qg^T out of their [C, BK] chunk blocks
    pk = r[:, None] * BK + dk[None, :]
    paT = r[:, None] + r[None, :] * C  # A_qk^T: [j, i] <- A_qk[i, j]
    puT = cv[:, None] + r[None, :] * BVF
    po = cv[:, None] + r[None, :] * (H * V)
    left = eos - bos  # tokens of the document not yet written
    if AUG:
        um = puT < tl.where(ident, 0, C * BVF)  # [BV, C]: u is read by the value blocks only
        vrows = tl.where(ident, 0, C)  # v likewise (FOLD_V)
    else:
        vrows = C
    # the decay of the next chunk is loaded one chunk ahead by hand (gl has a spare slot at the
    # end): a vector operand of an element-wise product is not software-pipelined
    gn = tl.load(gl + dk)
    for _ in range(nc):
        gt = gn
        gn = tl.load(gl + BK + dk)
        wT = _cast(tl.load(w + pkT), DOT_BF16)
        if STORE_O:
            qT = _cast(tl.load(qg + pkT), DOT_BF16)
        kt = _cast(tl.load(kd + pk), DOT_BF16)
        if STORE_O:
            aT = _cast(tl.load(Aqk + paT), DOT_BF16)
        if FOLD_V:  # rows past the document's end: v masked to 0 (their Ab columns are 0 too: beta = 0)
            vT = tl.load(v + po, mask=vm[:, None] & (r < tl.minimum(left, vrows))[None, :], other=0.0)
            uT = _dot(vT.to(tl.float32), tl.load(ab + paT).to(tl.float32), IEEE)
        elif AUG:  # the identity blocks' u is 0: masked off, not read
            uT = tl.load(u + puT, mask=um, other=0.0).to(tl.float32)
        else:
            uT = tl.load(u + puT).to(tl.float32)
        hb = _cast(h, DOT_BF16)
        # layout changes go through shared memory behind a barrier: the decay's before the
        # chain of products, the output's after the state update, not between its two products
        h = h * gt[None, :]
        Ub = _cast(uT - _dot(hb, wT, IEEE), DOT_BF16)
        if STORE_O:
            ot = _dot(hb, qT, IEEE)
        h += _dot(Ub, kt, IEEE)
        if STORE_O:
            ot += _dot(Ub, aT, IEEE)
            tl.store(o + po, ot.to(o.dtype.element_ty), mask=vm[:, None] & (r < left)[None, :])
            qg += C * BK
            Aqk += C * C
            o += C * H * V
        left -= C
        w += C * BK
        kd += C * BK
        u += C * BVF
        ab += C * C
        v += C * H * V
        gl += BK
    if STORE_HT:
        tl.store(hT + ph, h, mask=hm)


@triton.jit
def _kda_infer_join(
    M, h0, S0, soff, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
    HAS_H0: tl.constexpr,
):
    """Phase 2 of the segmented recurrence: the start states of the segments of one document and
    head (segments ``soff[n] .. soff[n + 1] - 1``), columns ``[i_v BV, (i_v + 1) BV)``:
    ``S_0 = h0`` (or 0), ``S_{s+1} = A_s S_s + B_s`` with ``[A_s | B_s]`` from phase 1 (``M``
    ``[segments, H, K, K + V]``), into ``S0`` ``[segments, H, K, V]``. Transposed like the
    recurrence, ``hv <- hv A_s^T + B_s^T``; exact fp32 products (one per segment: small next to
    the recurrences, and the start states carry the whole history of the sequence). The product
    runs over K in slices of ``KC``, the state's slice read back from the ``S0`` just written: an
    fp32 (FMA) product over all of K at once holds whole rows and columns of both operands in
    registers per thread and spilled ~14 KB per thread (sm_90a compile, K = 128)."""
    NV: tl.constexpr = BVF // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    n = i_nh // H
    i_h = i_nh % H
    j0 = tl.load(soff + n)
    j1 = tl.load(soff + n + 1)  # > j0: every document has a segment, an empty one too
    dk = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    km = dk < K
    hm = (cv < V)[:, None] & km[None, :]
    ph = cv[:, None] + dk[None, :] * V
    if HAS_H0:
        h = tl.load(h0 + i_nh.to(tl.int64) * (K * V) + ph, mask=hm, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BV, BK], dtype=tl.float32)
    kc = tl.arange(0, KC)
    pb = K + cv[:, None] + dk[None, :] * (K + V)  # B^T: [v, d] <- B[d, v]
    js = (j0 * H + i_h).to(tl.int64)
    for _ in range(j1 - j0 - 1):  # the last segment's [A | B] is not needed
        tl.store(S0 + js * (K * V) + ph, h, mask=hm)
        tl.debug_barrier()  # the slices are read back by other threads than wrote them
        h = tl.load(M + js * (K * (K + V)) + pb, mask=hm, other=0.0)
        for c0 in tl.static_range(0, BK, KC):
            c = c0 + kc
            hc = tl.load(S0 + js * (K * V) + cv[:, None] + c[None, :] * V,
                         mask=(cv < V)[:, None] & (c < K)[None, :], other=0.0)
            # A^T rows c: [c, d] <- A[d, c]
            ac = tl.load(M + js * (K * (K + V)) + c[:, None] + dk[None, :] * (K + V),
                         mask=(c < K)[:, None] & km[None, :], other=0.0)
            h += tl.dot(hc, ac, input_precision="ieee")
        js += H
    tl.store(S0 + js * (K * V) + ph, h, mask=hm)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the intermediates (w, u, qg, kd, A_qk): bf16 for bf16 inputs, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _ab_dtype(dtype: torch.dtype, l2norm_qk: bool) -> torch.dtype:
    """Storage dtype of ``(I + L)^-1 Diag(beta)`` (``FOLD_V``): fp16 for bf16 inputs with L2-normalized
    keys, else fp32. With unit keys, beta <= 1 and decays <= 1 every ``|L_ij| <= 1``, so the entries of
    the unit lower inverse are bounded by ``2^(i - j - 1) <= 2^14`` over 16 rows: inside fp16's range,
    with 11 significant bits (bf16 has 8) where entries of both signs cancel in ``u = Ab v``. Without the
    norm the keys' scale is unbounded: fp32."""
    return torch.float16 if dtype == torch.bfloat16 and l2norm_qk else torch.float32


@functools.cache
def _high_priority_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream of the pieces' recurrence (``InferPlan._run_pieces``): high priority, so that its few
    programs are placed as soon as the intra kernel's programs leave room on an SM."""
    return torch.cuda.Stream(device=device, priority=-1)


def _dot_bf16(dtype: torch.dtype) -> bool:
    """Whether the recurrence's product operands are bf16 (bf16 inputs) rather than fp32 / TF32."""
    return dtype == torch.bfloat16


def _ieee(dtype: torch.dtype) -> bool:
    """fp32 inputs: exact fp32 products everywhere (the reference use)."""
    return dtype == torch.float32


def _recur_launch(pairs: int, Vp: int, device: torch.device, Kp: int = 0) -> tuple[int, int, int]:
    """(BV, num_warps, num_stages) of the recurrence for ``pairs`` = sequences x heads (``pick_recur``);
    ``Kp``: phase 1 of the segmented recurrence, with ``Kp`` identity columns beside the ``Vp``."""
    width = min(Vp, Kp) if Kp else Vp  # BV must divide both parts
    if _interpret():
        return min(_INTERP_BV, width), 1, 1
    return pick_recur(pairs * (Vp + Kp), width, _sms(device))


def _sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


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
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor of N + 1 >= 2 offsets, got "
                             f"{(tuple(cu_seqlens.shape), cu_seqlens.dtype)}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens must be on {q.device}, got {cu_seqlens.device}")
        if B != 1:
            raise ValueError(f"with cu_seqlens the documents are packed in one row: expected B = 1, got B = {B}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and (initial_state.shape != (N, H, K, V) or initial_state.dtype not in _DTYPES
                                      or initial_state.device != q.device):
        raise ValueError(f"initial_state must be [N, H, K, V] = {(N, H, K, V)} float on {q.device} (N = "
                         f"{'documents' if cu_seqlens is not None else 'B'}), got "
                         f"{(tuple(initial_state.shape), initial_state.dtype, str(initial_state.device))}")
    if validate:  # one host sync each
        if cu_seqlens is not None:
            cu = cu_seqlens.tolist()
            if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T = {T}, got "
                                 f"{cu if len(cu) <= 16 else cu[:8] + ['...'] + cu[-8:]}")
        if gate == "none":
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
    fold_v: bool | None = None,
    pieces: int | None = None,
    longest_first: bool | None = None,
    recur_maxnreg: int | None = None,
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
        fold_v: the recurrence forms u from v (``FOLD_V``, the default when None); same result up
            to rounding.
        pieces: overlap the intra kernel and the plain recurrence in that many pieces of every
            sequence (``PIECES``, the default when None; 1: no overlap; > 1 only with the plain
            recurrence). Same result bit for bit.
        longest_first: with ``cu_seqlens``, the recurrence's programs take the documents longest first
            (``LONGEST_FIRST``, the default when None), so that the longest chains start in the first
            wave of programs instead of wherever their documents lie. Same result bit for bit.
        recur_maxnreg: register cap (ptxas ``maxnreg``, 32..255) of the recurrence's launches of at least
            ``RECUR_CAP_MIN_WARPS`` warps, 0 for none (``RECUR_MAXNREG``, the default when None): more
            programs per SM where a launch saturates the GPU, at the price of spills. Same result bit for bit.

    Returns:
        ``o`` ``[B, T, H, V]`` in v's dtype and the final state ``[N, H, K, V]`` fp32 (or None).
    """
    p = InferPlan(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  g_min=g_min, validate=validate, gate=gate, A_log=A_log, dt_bias=dt_bias, l2norm_qk=l2norm_qk,
                  silu_qk=silu_qk, beta_sigmoid=beta_sigmoid, norm_eps=norm_eps, cu_seqlens=cu_seqlens,
                  segment_chunks=segment_chunks, fold_v=fold_v, pieces=pieces, longest_first=longest_first,
                  recur_maxnreg=recur_maxnreg)
    p.run()
    return p.o, p.hT


class InferPlan:
    """One call of ``kda_infer``: its checked inputs, intermediates and outputs, and its launches.

    ``kda_infer`` calls ``run``: ``intra`` then ``recur`` at the configs of ``LAUNCH`` (with pieces, the two
    overlapped piece by piece); the benchmark's launch sweep (kernels/bench_kda.py --infer-sweep) times
    the two apart, at other configs. Arguments as for ``kda_infer``; ``o`` and ``hT`` hold the outputs
    once both have run.

    The segmented recurrence (``seg`` = L > 0 chunks per segment). Each chunk maps the state affinely,
    ``S <- (Diag(gl) - kd^T w) S + kd^T u``, with the same K-side operator for every column of S
    (value channel), so a segment of chunks maps it as ``S_end = A S_start + B`` with A ``[K, K]`` and
    B ``[K, V]``; both are the segment's final state when run from ``[I_K | 0]`` on ``[0 | v]``:
    1. every segment as a document of its own, K identity columns beside the V value columns
       (``AUG``: extra V-blocks that start from the identity and read no u, so nothing is
       materialised) and no output: ``[A | B]``, fp32;
    2. per document, sequential over its segments: ``S_{s+1} = A_s S_s + B_s`` from the initial
       state (``_kda_infer_join``, fp32);
    3. every segment as a document again, from ``S_s``: the output, and the final state of each
       document's last segment.
    The sequential chain is L + P + L steps instead of P L (P segments), and the work (K + V) / V + 1
    times the plain recurrence's (phase 1 skips the output's loads and products). Segments are whole
    chunks: a sequence of n chunks gives ``cdiv(n, L)``, an empty document one empty segment.
    """

    def __init__(self, q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True, g_min=-5.0,
                 validate=True, gate="none", A_log=None, dt_bias=None, l2norm_qk=False, silu_qk=False,
                 beta_sigmoid=False, norm_eps=1e-6, cu_seqlens=None, segment_chunks=None, fold_v=None, pieces=None,
                 longest_first=None, recur_maxnreg=None):
        N = _check(q, k, v, g, beta, scale, initial_state, g_min, validate, gate, A_log, dt_bias, norm_eps,
                   cu_seqlens)
        if segment_chunks is not None and (isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int)
                                           or segment_chunks < 0):
            raise ValueError(f"segment_chunks={segment_chunks!r} is not allowed: expected None or an int >= 0")
        if fold_v is not None and not isinstance(fold_v, bool):
            raise ValueError(f"fold_v={fold_v!r} is not allowed: expected None, True or False")
        if longest_first is not None and not isinstance(longest_first, bool):
            raise ValueError(f"longest_first={longest_first!r} is not allowed: expected None, True or False")
        if pieces is not None and (isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1):
            raise ValueError(f"pieces={pieces!r} is not allowed: expected None or an int >= 1")
        if recur_maxnreg is not None and not _maxnreg_ok(recur_maxnreg):
            raise ValueError(f"recur_maxnreg={recur_maxnreg!r} is not allowed: expected None, 0 (no cap) or an int "
                             "in 32..255")
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
        if pieces is not None and pieces > 1 and self.seg:
            raise ValueError(f"pieces={pieces} is not allowed with the segmented recurrence (segment_chunks="
                             f"{self.seg}): pieces overlap the plain recurrence with the intra kernel")
        self.pieces = pieces if pieces is not None else (1 if self.seg else PIECES)
        self.fold_v = FOLD_V if fold_v is None else fold_v
        self.longest_first = LONGEST_FIRST if longest_first is None else longest_first
        self.recur_maxnreg = RECUR_MAXNREG if recur_maxnreg is None else recur_maxnreg
        # segments: exact for fixed length, an upper bound for packed documents (sum_n max(1, cdiv(n_n, L))
        # <= N + sum_n n_n / L); the bound's spare segments are empty ones at the end
        self.nseg = (B * triton.cdiv(NC, self.seg) if not varlen else N + triton.cdiv(NS, self.seg)) if self.seg else 0
        wd = _work_dtype(q.dtype)
        self.w, self.qg, self.kd = (torch.empty(H, NS * C, Kp, device=dev, dtype=wd) for _ in range(3))
        self.u = None if self.fold_v else torch.empty(H, NS * C, Vp, device=dev, dtype=wd)
        self.ab = torch.empty(H, NS * C, C, device=dev, dtype=_ab_dtype(q.dtype, l2norm_qk)) if self.fold_v else None
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

    def intra_launch(self) -> tuple[int, int, int, int]:
        """(num_warps, num_stages, per_program, maxnreg) of the token-parallel kernel (see ``LAUNCH``)."""
        return (1, 1, 1, 0) if _interpret() else LAUNCH["intra"]

    def recur_launch(self) -> tuple[int, int, int]:
        """(BV, num_warps, num_stages) of the recurrence (see ``LAUNCH``); segmented: of phase 3."""
        return _recur_launch((self.nseg or self.N) * self.dims[2], self.dims[6], self.o.device)

    def path(self) -> dict:
        """Which recurrence runs, for benchmark records: ``segment_chunks`` (0: plain) and, segmented,
        the segments per sequence (fixed length) or per document (packed: reads ``cu_seqlens``, a host
        sync) and the launch config of each phase."""
        cand = dict(fold_v=self.fold_v, pieces=self.pieces, longest_first=self.longest_first,
                    recur_maxnreg=self.recur_maxnreg)
        if not self.seg:
            return dict(segmented=False, segment_chunks=0, recur=list(self.recur_launch()), **cand)
        B, T, H, K, V, Kp, Vp = self.dims
        if self.varlen:
            per = [max(1, triton.cdiv(triton.cdiv(b - a, CHUNK), self.seg)) for a, b in
                   zip(self.cu.tolist(), self.cu.tolist()[1:])]
        else:
            per = triton.cdiv(self.NC, self.seg)
        return dict(segmented=True, segment_chunks=self.seg, segments=per,
                    phase1=list(_recur_launch(self.nseg * H, Vp, self.o.device, Kp)),
                    join=list(self._join_launch()), recur=list(self.recur_launch()), **cand)

    def run(self) -> None:
        """Both kernels at the configs of ``LAUNCH``: ``intra``, then ``recur``; with ``pieces`` > 1 the
        two overlapped (``_run_pieces``)."""
        if self.pieces > 1:
            self._run_pieces()
            return
        self.intra(*self.intra_launch())
        self.recur()

    def intra(self, warps: int, stages: int, per: int = 1, maxnreg: int = 0, piece: tuple | None = None) -> None:
        """The token-parallel kernel: w, u (or ab), qg, kd, A_qk, gl from the inputs; ``per`` chunk slots
        per program, their loop pipelined over ``stages``; ``maxnreg`` > 0: ptxas's register cap per
        thread (more programs per SM, at the price of spills). ``piece``: ``(poff, pbase, slots)`` of one
        piece (``_run_pieces``): only its chunks, ``slots`` at most."""
        if per < 1 or per & (per - 1):
            raise ValueError(f"per={per!r} is not allowed: expected chunk slots per program, a power of two >= 1")
        if not _maxnreg_ok(maxnreg):
            raise ValueError(f"maxnreg={maxnreg!r} is not allowed: expected 0 (no cap) or 32..255")
        B, T, H, K, V, Kp, Vp = self.dims
        dummy = self.gl
        if piece is None:
            cu, coff, poff, pbase, slots = self.cu, self.coff, dummy, dummy, self.NS
        else:
            (cu, coff), (poff, pbase, slots) = self._docs(), piece
        _kda_infer_intra[(triton.cdiv(slots, per), H)](
            *self.inputs, self.A_log if self.A_log is not None else dummy,
            self.dt_bias if self.dt_bias is not None else dummy, cu, coff, poff, pbase,
            self.w, _or(self.u, dummy), _or(self.ab, dummy), self.qg, self.kd, self.Aqk, self.gl,
            self.scale, self.g_min, (CHUNK / 2) * self.g_min * LOG2E, self.norm_eps, T, self.NC, self.NS, self.N, H,
            K=K, V=V, BK=Kp, BVF=Vp, C=CHUNK, LOG_N=max(1, self.N.bit_length()), VARLEN=self.varlen,
            GATE=_GATE_ID[self.gate], HAS_BIAS=self.dt_bias is not None, IEEE=_ieee(self.inputs[0].dtype),
            PER=per, STAGES=stages, **self.flags, FOLD_V=self.fold_v, PIECE=piece is not None,
            WHOLE_BRANCH=WHOLE_CHUNK_BRANCH,
            num_warps=warps if Kp <= 128 else 2 * warps, num_stages=stages, **_cap(maxnreg),
        )

    def recur(self, BV: int | None = None, warps: int | None = None, stages: int | None = None,
              maxnreg: int | None = None) -> None:
        """The recurrence over chunks (after ``intra``): o and the final state. ``(BV, warps, stages)``:
        one launch config for every recurrence kernel (launch sweeps); None: ``LAUNCH``'s per phase.
        ``maxnreg`` (with ``BV``): the register cap of every recurrence launch, 0 for none (None: the plan's
        ``recur_maxnreg``)."""
        if maxnreg is not None and (BV is None or not _maxnreg_ok(maxnreg)):
            raise ValueError(f"maxnreg={maxnreg!r} is not allowed: expected None, or with BV 0 (no cap) or 32..255")
        cfg = None if BV is None else (BV, warps, stages) + (() if maxnreg is None else (maxnreg,))
        if not self.seg:
            order = self._order(self.coff[1:] - self.coff[:-1]) if self.varlen else None
            self._recur(self.N, self.cu, self.coff, self.h0, self.o, self.hT, cfg or self.recur_launch(),
                        varlen=self.varlen, order=order)
            return
        B, T, H, K, V, Kp, Vp = self.dims
        dev, f32 = self.o.device, torch.float32
        cu, coff, soff = self._segments()
        # the segments' order, for both phases: only packed documents have segments of unequal lengths (fixed
        # length, longest first measured 1% slower at B1 T32768 H16, 1.294 ms against 1.280 in one run)
        order = self._order(coff[1:] - coff[:-1]) if self.varlen else None
        M = torch.empty(self.nseg, H, K, K + V, device=dev, dtype=f32)
        # phase 1 also computes each document's last [A | B], which the join never reads: skipping it (those
        # segments as pieces of 0 chunks) measured slower on the H200 at 503d12f, B1 T32768 H16 1.38 ms against
        # 1.28 (kernels/results/kda_infer_seg_ab_h200_503d12f.log)
        self._recur(self.nseg, cu, coff, None, None, M, cfg or _recur_launch(self.nseg * H, Vp, dev, Kp),
                    varlen=True, aug=True, order=order)
        S0 = torch.empty(self.nseg, H, K, V, device=dev, dtype=f32)
        jbv, jwarps = self._join_launch()
        _kda_infer_join[(self.N * H * (Vp // jbv),)](
            M, self.h0 if self.h0 is not None else M, S0, soff, H,
            K=K, V=V, BK=Kp, BVF=Vp, BV=jbv, KC=16, HAS_H0=self.h0 is not None, num_warps=jwarps, num_stages=1,
        )
        Send = torch.empty_like(S0) if self.hT is not None else None
        self._recur(self.nseg, cu, coff, S0, self.o, Send, cfg or self.recur_launch(), varlen=True, order=order)
        if self.hT is not None:
            torch.index_select(Send, 0, soff[1:] - 1, out=self.hT)

    def _run_pieces(self) -> None:
        """The intra kernel and the plain recurrence overlapped: every document cut into ``pieces`` runs of
        whole chunks (piece p: chunks ``[p n // P, (p + 1) n // P)`` of a document of n), the intra kernel
        run piece by piece on the current stream and the recurrence of piece p, from the state after
        piece p - 1, on a high-priority stream once the intra kernel has finished piece p. The states
        between pieces are fp32, as the recurrence keeps them, so the result equals ``intra`` + ``recur``
        bit for bit. On the interpreter the launches run in order on one stream."""
        B, T, H, K, V, Kp, Vp = self.dims
        P, N, dev = self.pieces, self.N, self.o.device
        cu, coff = self._docs()
        nc = (coff[1:] - coff[:-1]).to(torch.int64)
        ends = torch.arange(P + 1, device=dev)[:, None] * nc[None, :] // P  # [P + 1, N]: chunk bounds
        # one row per piece, each row 16-byte aligned: Triton specializes a kernel on its pointers' alignment,
        # so unaligned rows would compile every kernel twice
        width = 4 * triton.cdiv(N + 1, 4)
        pbase, psize, poff = (torch.zeros(P, width, device=dev, dtype=torch.int32) for _ in range(3))
        pbase[:, :N] = ends[:-1]
        psize[:, :N] = ends[1:] - ends[:-1]
        poff[:, 1:N + 1] = torch.cumsum(psize[:, :N], 1)
        # slots of one piece: exact for fixed length, a bound for packed documents (sum_n cdiv(n_n, P))
        slots = B * triton.cdiv(self.NC, P) if not self.varlen else triton.cdiv(self.NS, P) + N
        states = [torch.empty(N, H, K, V, device=dev, dtype=torch.float32) for _ in range(min(2, P - 1))]
        intra_cfg, recur_cfg = self.intra_launch(), self.recur_launch()
        side = _high_priority_stream(dev) if dev.type == "cuda" and not _interpret() else None
        if side is not None:
            cur = torch.cuda.current_stream(dev)
            side.wait_stream(cur)
        h = self.h0
        for p in range(P):
            self.intra(*intra_cfg, piece=(poff[p], pbase[p], slots))
            hT = self.hT if p == P - 1 else states[p % 2]
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                if side is not None:
                    side.wait_event(cur.record_event())
                self._recur(N, cu, coff, h, self.o, hT, recur_cfg, varlen=True, piece=(pbase[p], psize[p]),
                            order=self._order(psize[p, :N]))
            h = hT
        if side is not None:
            cur.wait_stream(side)

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
        on the shape only, so they are computed once per shape and device (``_fixed_segments``): that takes
        ``_segment_offsets``'s 29 small launches off every call, on the host and on the GPU's stream (B1 T32768
        H16 on an H200: 1.06 ms against 1.13, kernels/README.md)."""
        dev = self.o.device
        if not self.varlen and not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return _fixed_segments(self.dims[0], self.dims[1], self.NC, self.seg, self.nseg, dev)
        cu, coff = self._docs()
        return _segment_offsets(cu, coff, self.seg, self.nseg)

    def recur_cap(self, warps: int) -> int:
        """The register cap of a recurrence launch of ``warps`` warps at the plan's launch configs:
        ``recur_maxnreg`` from ``RECUR_CAP_MIN_WARPS`` warps up, else 0 (none)."""
        return self.recur_maxnreg if warps >= RECUR_CAP_MIN_WARPS else 0

    def _order(self, chunks: torch.Tensor) -> torch.Tensor | None:
        """The recurrence's document order for ``chunks`` ``[N]`` (chunks per document): longest first
        with ``longest_first`` and several documents, else None (document order)."""
        return _longest_first(chunks) if self.longest_first and chunks.numel() > 1 else None

    def _recur(self, seqs, cu, coff, h0, o, hT, cfg, varlen, aug=False, piece=None, order=None) -> None:
        """One launch of ``_kda_infer_recur`` over ``seqs`` documents (``cu``, ``coff``) or fixed-length rows;
        ``o`` None: no output (phase 1); ``aug``: with the identity columns (phase 1); ``piece``:
        ``(pbase, psize)``, only those chunks of each document (``_run_pieces``); ``order``: ``[seqs]`` the
        documents in the order the programs take them (``_order``), None: document order."""
        B, T, H, K, V, Kp, Vp = self.dims
        BV, warps, stages = cfg[:3]
        maxnreg = cfg[3] if len(cfg) > 3 else self.recur_cap(warps)
        if aug and Kp % BV:
            raise ValueError(f"BV={BV} is not allowed for the segmented recurrence: expected a divisor of K = {Kp}")
        dtype = self.inputs[0].dtype
        dummy = self.gl
        pbase, psize = piece if piece is not None else (dummy, dummy)
        _kda_infer_recur[(seqs * H * ((Vp + (Kp if aug else 0)) // BV),)](
            self.w, _or(self.u, dummy), self.inputs[2], _or(self.ab, dummy), self.qg, self.kd, self.Aqk, self.gl,
            _or(h0, dummy), _or(o, dummy), _or(hT, dummy), cu, coff, pbase, psize, _or(order, dummy),
            T, self.NC, self.NS, H,
            K=K, V=V, BK=Kp, BVF=Vp, BV=BV, C=CHUNK, VARLEN=varlen, HAS_H0=h0 is not None,
            STORE_HT=hT is not None, DOT_BF16=_dot_bf16(dtype), IEEE=_ieee(dtype), AUG=aug, STORE_O=o is not None,
            FOLD_V=self.fold_v, PIECE=piece is not None, ORDER=order is not None, num_warps=warps,
            num_stages=stages, **_cap(maxnreg),
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
