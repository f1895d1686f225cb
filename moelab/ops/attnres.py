"""AttnRes depth aggregation (attnres.md), fused in Triton: one softmax over depth per token.

For every token (row n) with sources ``v_i [D]`` (i < L), pseudo-query ``q [D]`` and key-norm
weight ``g [D]``:

    r_i = rsqrt(mean(v_i^2) + eps)          (RMSNorm of the key, weight g)
    s_i = r_i * <v_i, g * q>                 (the score of source i)
    p   = softmax_i(s)                       (over depth, per token)
    h   = sum_i p_i v_i                      (the values are the raw sources)

Gradients, with ``dp_i = <dh, v_i>`` and ``ds_i = p_i (dp_i - sum_j p_j dp_j)``:

    dv_i = p_i dh + ds_i r_i (g * q - s_i r_i v_i / D)
    dq   = g * B,  dg = q * B,  B = sum_n sum_i ds_i r_i v_i

The plain path stacks the L sources (one copy of all of them per read), materializes the
normalized keys in fp32 and saves both for the backward. Here the forward reads each source once
with an online softmax over depth and keeps only fp32 row statistics (r and s ``[L, N]``, the
log-sum-exp ``[N]``). The backward recomputes p from them and writes every ``dv_i`` in its
source's dtype; each program's row sums of B, times g and times q, go into fp32 partials of dq and
dw (one torch sum over the programs gives both, in a fixed order, so the result is deterministic).
fp32 math throughout.

The kernels loop over depth at run time: L and which gradients add into a slot (below) are plain
integer arguments, so one compiled kernel per direction serves every L (two with L = 1, where
source 0 is also the last one). Unrolling over a constexpr L made compile time grow with L and
compiled a kernel per L and slot pattern: 50 for a Full AttnRes step of 24 sublayers, 60 for
gpu-small's Full and Block (6, 8) steps together, where this op compiles 4
(the ``compile`` section of kernels/results/attnres_occupancy_cpu_sm90.json, from the retired
``bench_attnres.py --compile``). Source 0
(in the model the fp32 embedding) and the last source (the newest) are pointer arguments; the
sources between them are read through an int64 table of addresses, all in one dtype (the last
source's; a list whose sources 1.. differ in dtype is converted to their promoted one, and a
:class:`Sources` stores them so). The table belongs to a :class:`Sources`: the forward kernel writes
its last source's address into it, so the next read, where that source is one of the middle ones,
finds it there without host work. Gradients: source 0's and the last's are pointer arguments too,
the middle ones' addresses go into a second row of the table when a backward first meets them (in
a model: the last read's backward, once per step: one host-to-device copy from pinned memory), and
three flag bits say whose gradient adds into what its slot holds. A list (one read) gets a table
of its own per call, one such copy per direction.

``c = sum_j p_j dp_j`` in ``ds_i`` equals ``<dh, h>``. When h is fp32 (in the model: the fp32
embedding is always a source) the forward saves h (the next RMSNorm keeps that same tensor
anyway) and the backward reads each source once. A 16-bit h would carry its rounding into c
(about 4e-3 relative error in the gradients), so then h is not saved and the backward first sums
``sum_j p_j v_j`` over the tile's sources elementwise in fp32 (one row sum per tile, not one per
source) and then reads the same sources again for the ``dv_i``: a program's tiles (L rows of D per
token) are still in L2 by then, unless the rows in flight stream more than the L2 holds between the two
passes (large L times D); such a read of a list keeps an fp32 copy of h for its backward instead
(``keeps_h32``; a model's reads do not, to keep their memory).
Traffic per token and width element with bf16 sources, from HBM:
forward 2L + 2 bytes (+2 for an fp32 h); backward 4L + 8 with the fp32 h (and an fp32 dh), 4L + 2
without (6L + 2 where the second read misses L2; with the kept fp32 copy 2L + 6, and the forward
2L + 6). The plain path adds a stack copy of the sources,
fp32 keys and their saved copies on top; fla's ``fused_attnres`` (0.6.0, whose backward also reads
the sources twice by default) adds an fp32 ``[N, D]`` of per-token dq partials, written and read
back (8 bytes).

Those bytes are not what limits the kernels: a program waits a memory latency for each load, so
the bandwidth they reach is the bytes in flight per SM, and registers bound those (every source
tile in flight is held in fp32, next to the program's fp32 dh, g * q and B tiles in the backward).
Sources 1.. therefore come in groups (``LaunchConfig.group``): a group's tiles are loaded at once
and its row sums share one round of barriers, so a program keeps ``group`` tiles in flight where
one at a time kept one. ``LaunchConfig.stages`` lets Triton software-pipeline the loop over the
groups instead or as well (the next groups' tiles copied into shared memory while this one is
summed): the forward's fastest launches load one source at a time, pipelined, the backward's load groups.
``launch_config`` sets both by rule from D (and L, N where one read is all there is), fitted to a sweep
of launches at issue 37's grid (``kernels/results/attnres_sweep_h200.json``, ``grid_sweep``) within
register and shared-memory estimates fitted to what the kernels compile to (the committed
``kernels/results/attnres_occupancy_cpu_sm90.json``). D is a
compile-time constant (one per model, like the tile shape it sets): a power-of-two D drops the
column mask from every load and store.

A model reads every source many times (Full AttnRes: source i in every later read), so autograd
would write a fresh ``dv_i`` per read and then add them up, a write plus an add (two reads, one
write) of ``[N, D]`` per source and read. With a :class:`GradSlot` per source the backward kernel
sums ``dv_i`` in place into the slot's buffer instead (one read and one write), and only the read
that saw the source first hands the sum to autograd (see ``GradSlot``). A :class:`Sources` holds
such a growing list with its slots and its address table, each source checked once when added,
so that a read does no per-source host work.

``depth_attention`` is the front door (either backend); ``depth_attention_torch`` the fp32
PyTorch reference that defines the semantics.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moelab.ops.backend import BACKENDS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_D = 16384  # one program holds a whole row (next power of two) of a few [rows, D] fp32 tiles
_INTERP_PROGRAMS = 3  # interpreter: a few programs, so the persistent loop takes several turns


_SPEC = re.compile(r"^r(\d+)w(\d+)g(\d+)(?:c(\d+))?(?:s(\d+))?(?:-b(\d+)w(\d+)g(\d+)(?:c(\d+))?(?:s(\d+))?)?"
                   r"(?:p(\d+))?$")


@dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of the Triton path (tuning knobs; ``launch_config`` picks the default).

    rows: tokens per forward tile (a power of two); each tile is ``[rows, next_pow2(D)]``.
    warps: warps per forward program.
    group: sources 1.. whose tiles the forward loads at once (a power of two, at most 8): the loads in
        flight per program, and one round of row-sum barriers per group.
    stages: ``num_stages`` of the forward's loop over the groups (1: not software-pipelined; more:
        Triton copies the next groups' tiles into shared memory while this one is summed).
    programs_per_sm: the backward's persistent grid is ``SMs * programs_per_sm`` programs (each
        writes one fp32 ``[D]`` partial of B); 0: as many as fit on an SM at once. The forward
        launches one program per tile.
    bwd_rows, bwd_warps, bwd_group, bwd_stages: the same for the backward; 0 takes the forward's value.
    chunk: 0, the forward above (one pass, an online softmax over groups of sources); or the width of the
        chunks of D a second forward walks twice, one row per program (rows 1): every source's chunk at once
        (``[next_pow2(L), chunk]``), first for the row sums and scores, then for the weighted sum, whose reads
        find the row in L1 / L2 (``stages``: the pipelining of both loops). One compiled kernel per power of two
        of L.
    bwd_chunk: the same for the backward (0: the persistent one-pass backward): one row per program, every
        source's chunk at once, a first pass for each source's ``<v_i, dh>``, a second that writes each ``dv_i``
        (plus its slot's running sum) and the row's part of B into an fp32 ``[N, D]`` buffer that one sum over N
        turns into dq and dw (bwd_warps, bwd_stages as given; bwd_rows, bwd_group unused).
    """

    rows: int = 1
    warps: int = 8
    group: int = 1
    stages: int = 1
    programs_per_sm: int = 0
    bwd_rows: int = 0
    bwd_warps: int = 0
    bwd_group: int = 0
    bwd_stages: int = 0
    chunk: int = 0
    bwd_chunk: int = 0

    def validate(self) -> None:
        for name, value, lo, hi in (("rows", self.rows, 1, 64), ("warps", self.warps, 1, 16),
                                    ("group", self.group, 1, 8), ("bwd_rows", self.bwd_rows, 0, 64),
                                    ("bwd_warps", self.bwd_warps, 0, 16), ("bwd_group", self.bwd_group, 0, 8)):
            if value < lo or value > hi or value & (value - 1):
                what = "0 (as the forward) or a power of two" if lo == 0 else "a power of two"
                raise ValueError(f"LaunchConfig.{name}={value} is not allowed: expected {what} in {max(lo, 1)}..{hi}")
        for name, value, lo in (("stages", self.stages, 1), ("bwd_stages", self.bwd_stages, 0)):
            if not lo <= value <= 4:
                what = "0 (as the forward) or " if lo == 0 else ""
                raise ValueError(f"LaunchConfig.{name}={value} is not allowed: expected {what}1..4")
        if self.programs_per_sm < 0:
            raise ValueError(f"LaunchConfig.programs_per_sm={self.programs_per_sm} is not allowed: expected >= 0")
        if self.chunk and (self.chunk < 16 or self.chunk > MAX_D or self.chunk & (self.chunk - 1) or self.rows != 1):
            raise ValueError(f"LaunchConfig.chunk={self.chunk} (rows={self.rows}) is not allowed: expected 0, or a "
                             f"power of two in 16..{MAX_D} with rows=1")
        if self.bwd_chunk and (self.bwd_chunk < 16 or self.bwd_chunk > MAX_D or self.bwd_chunk & (self.bwd_chunk - 1)):
            raise ValueError(f"LaunchConfig.bwd_chunk={self.bwd_chunk} is not allowed: expected 0, or a power of two "
                             f"in 16..{MAX_D}")

    @classmethod
    def parse(cls, spec: str) -> LaunchConfig:
        """The launch ``spec`` spells (the names the AttnRes sweep and ``kernels/bench.py --impls`` use):
        ``r<rows>w<warps>g<group>[c<chunk>][s<stages>]`` for the forward, then optionally ``-b`` and the same for
        the backward (left out: the forward's), e.g. ``r1w4g1s3-b1w16g4``, and optionally ``p<n>``: the
        backward's persistent programs per SM (``programs_per_sm``; ``p0``: as many as fit); without it several-row
        forward tiles get 4, one-row tiles as many as fit. ValueError naming the spec (or ``validate``'s) otherwise."""
        m = _SPEC.match(spec)
        if m is None:
            raise ValueError(f"{spec!r} is not a launch spec: expected r<rows>w<warps>g<group>[c<chunk>][s<stages>]"
                             f"[-b<rows>w<warps>g<group>[c<chunk>][s<stages>]][p<programs per SM>]")
        r, w, g, ch, st, br, bw, bg, bch, bst, _ = (int(x) if x else 0 for x in m.groups())
        per_sm = int(m.group(11)) if m.group(11) is not None else 4 if r > 1 else 0
        cfg = cls(rows=r, warps=w, group=g, stages=st or 1, programs_per_sm=per_sm, bwd_rows=br,
                  bwd_warps=bw, bwd_group=bg, bwd_stages=bst, chunk=ch, bwd_chunk=bch)
        cfg.validate()
        return cfg

    @property
    def bwd(self) -> tuple[int, int]:
        """(rows, warps) of the backward."""
        return self.bwd_rows or self.rows, self.bwd_warps or self.warps

    @property
    def bwd_launch(self) -> tuple[int, int, int, int]:
        """(rows, warps, group, stages) of the backward (not through ``bwd``: one Python call less per read)."""
        return (self.bwd_rows or self.rows, self.bwd_warps or self.warps, self.bwd_group or self.group,
                self.bwd_stages or self.stages)


def _pow2(n: int) -> int:
    """Next power of two (plain Python: ``triton.next_power_of_2`` is a constexpr function now,
    about 3 us a call from host code, and the old wrapper made five calls per read)."""
    return 1 << (n - 1).bit_length()


# The launch rule's constants (``launch_config``). Hopper (H100 / H200): 132 SMs, at most 255 registers per
# thread, 227 KB of shared memory per program.
SMS = 132
MAX_REGS = 255
MAX_SHARED = 227 * 1024
TILE_ELEMS = 2048  # a several-row tile (D <= 512) holds at least this many elements
ONE_ROW_FROM = 1024  # from this width (next power of two) on, one row per program
IN_FLIGHT = 32  # fp32 source elements per thread that the backward's group of one-row tiles loads at once
FWD_IN_FLIGHT = 16  # the same for the forward, whose loop over the sources is software-pipelined instead
FWD_STAGES = 3  # stages of the forward's loop over the sources where it loads one source at a time
REG_MARGIN = 16  # registers the rule keeps free below MAX_REGS beyond its estimate
FWD_WARPS = 4  # warps per one-row forward program (wider rows: more elements per thread)


def estimate_regs(per_thread: int, group: int, backward: bool) -> int:
    """Registers per thread of a launch whose tile gives each thread ``per_thread`` fp32 elements, ``group``
    source tiles at once: forward ``32 + e (1.5 group + 1)``, backward ``44 + e (2.5 group + 2.5)``, least-
    squares fits to what the kernels compile to for sm_90 (the retired ``bench_attnres.py --occupancy``, one stage:
    kernels/results/attnres_occupancy_cpu_sm90.json, D 512 and D 2048, one-row
    tiles and several-row tiles of one source at a time; tests/ops/test_attnres_op.py checks how far off).
    At 16 warps the compiler holds a thread to 128 registers (one program per SM) and fits what it can:
    the rule's launches at D 4096 and 7168 compile with at most 8 bytes of spill
    (the same file, D 4096 and D 7168)."""
    if backward:
        return round(44 + per_thread * (2.5 * group + 2.5))
    return round(32 + per_thread * (1.5 * group + 1))


def estimate_shared(cfg: LaunchConfig, d: int) -> int:
    """Bytes of shared memory a program of ``cfg`` may take at most: the row reductions over a group's fp32
    tiles, times the stages a pipelined loop keeps (the occupancy files above stay under it)."""
    rows, _, group, stages = cfg.bwd_launch
    return max(cfg.rows * cfg.group * cfg.stages, rows * group * stages) * _pow2(d) * 4


@functools.cache
def launch_config(d: int, L: int | None = None, n: int | None = None) -> LaunchConfig:
    """The launch of width ``d`` (``L`` sources of ``n`` tokens, where known) by rule, for every shape.

    The rule is fitted to a sweep of launches at every point of issue 37's grid (D 512..7168, L 3..33,
    N 8192 / 32768; ``kernels/results/attnres_sweep_h200.json``, section ``grid_sweep``: 30-58 forward and
    18-30 backward launches per width on one H100):

    - D <= 512: tiles of at least ``TILE_ELEMS`` elements (``rows = 2048 // next_pow2(d)``), halved while
      there would be fewer than 4 forward programs per SM (small n only; one row: as below), threads of 16
      elements (1..16 warps), one source at a time, ``4 * SMS`` persistent backward programs, both directions
      alike;
    - from ``ONE_ROW_FROM`` (1024) on, one row per program. The forward: ``FWD_WARPS`` = 4 warps (a wider
      row gives each thread more elements: 8 at D 1024, 64 at D 7168), loading ``FWD_IN_FLIGHT // e``
      sources at once (2 at D 1024, else 1) and, where that is one, the loop over the sources software-
      pipelined over ``FWD_STAGES`` = 3 stages (the next sources' rows copied into shared memory while this
      one is summed). The sweep's best forward at D 2048..7168 was 4 warps, 1 source, 3 stages at 15 of 16
      points (within 2.5% at the 16th), 10-25% ahead of the 8-warp groups the rule gave before;
    - the backward (not pipelined) at the forward's warps where a thread of it holds at most
      ``IN_FLIGHT / 2`` elements (D 1024, 2048), else on 16 warps (D 4096, 7168), with ``IN_FLIGHT // e``
      sources at once, at most the L - 1 after the first, and fewer while ``estimate_regs`` (plus
      ``REG_MARGIN``) passes ``MAX_REGS``: 4 at D 1024, 2 at D 2048, 4 at D 4096, 2 at D 7168, as many as
      fit on an SM (``programs_per_sm = 0``).

    A row of D stays in one program (its RMS and score are row sums); D is not split across programs.
    A model passes neither L nor n, so that one compiled kernel per direction serves every read of its
    residual stream (the launch at large L and n).
    """
    bd = _pow2(d)
    rows = max(1, TILE_ELEMS // bd) if bd < ONE_ROW_FROM else 1
    if n is not None:
        while rows > 1 and -(-n // rows) < 4 * SMS:
            rows //= 2
    if rows > 1:
        warps = min(16, max(1, rows * bd // (32 * 16)))
        return LaunchConfig(rows=rows, warps=warps, group=1, stages=1, programs_per_sm=4)
    warps, group = _one_row(bd, FWD_WARPS, L, FWD_IN_FLIGHT)
    stages = FWD_STAGES if group == 1 else 1
    wide = bd // (32 * warps) > IN_FLIGHT // 2
    bwd_warps, bwd_group = _one_row(bd, 16 if wide else warps, L, IN_FLIGHT)
    return LaunchConfig(rows=1, warps=warps, group=group, stages=stages, programs_per_sm=0,
                        bwd_warps=0 if bwd_warps == warps else bwd_warps,
                        bwd_group=0 if bwd_group == group else bwd_group, bwd_stages=0 if stages == 1 else 1)


def _one_row(bd: int, max_warps: int, L: int | None, in_flight: int = IN_FLIGHT) -> tuple[int, int]:
    """(warps, group) of a one-row tile of width ``bd``: threads of at least 8 elements on at most ``max_warps``
    warps, ``in_flight // elements`` sources at once (at most the L - 1 after the first, and fewer while the
    backward's ``estimate_regs`` plus ``REG_MARGIN`` passes ``MAX_REGS``)."""
    warps = min(max_warps, max(1, bd // (32 * 8)))
    per_thread = max(1, bd // (32 * warps))
    group = max(1, min(8, in_flight // per_thread))
    if L is not None:
        group = min(group, _pow2(max(1, L - 1)))
    while group > 1 and estimate_regs(per_thread, group, backward=True) + REG_MARGIN > MAX_REGS:
        group //= 2
    return warps, group


# The L2 cache of an H100 / H200 (50 MB): a 16-bit h's backward finds a tile's sources there on its second pass
# only while what its programs in flight stream between the two passes fits (``keeps_h32``).
L2_BYTES = 50 * 2 ** 20


@functools.cache
def keeps_h32(cfg: LaunchConfig, d: int, L: int, itemsize: int) -> bool:
    """Whether a read of a list of ``L`` 16-bit sources of width ``d`` keeps an fp32 copy of h for its backward
    (a model's reads, of a :class:`Sources` or with slots, never do: their memory per read matters more).

    Without one the backward first sums ``sum_j p_j v_j`` over a tile's sources (c needs h in fp32) and then
    reads them again for the ``dv_i``. Between the two reads of a source its programs in flight stream the rest
    of their rows' sources and gradients, ``rows in flight * L * d * 2 * itemsize`` bytes; past ``L2_BYTES`` the
    second read comes from HBM (6L + 2 bytes per token and width element instead of 4L + 2). The copy costs 4
    bytes written by the forward and 4 read by the backward, and ``[N, d]`` fp32 of memory kept per read. Rows
    in flight: ``SMS`` times the backward's programs per SM (registers by ``estimate_regs``; at 16 warps one)
    times its tile rows (``programs_per_sm`` where set). At the grid's launches (bf16): from L 17 at D 512,
    2048 and 7168, at L 33 at D 1024 and 4096."""
    rows, warps, group, _ = cfg.bwd_launch
    bd = _pow2(d)
    per_thread = max(1, rows * bd // (32 * warps))
    regs = min(MAX_REGS, estimate_regs(per_thread, group, backward=True))
    if warps >= 16:
        regs = max(regs, 128)
    resident = cfg.programs_per_sm or max(1, min(64 // warps, 65536 // (32 * warps * regs)))
    return SMS * resident * rows * L * d * 2 * itemsize > L2_BYTES


@functools.cache
def _launch_numbers(cfg: LaunchConfig, N: int, D: int) -> tuple[tuple[int], int, int, tuple[int, int, int, int]]:
    """The forward's grid, ``BD`` (D's next power of two), the backward's tile count and (rows, warps, group,
    stages): the same for every read of a step, so computed once per shape and config (host time per read)."""
    bwd = cfg.bwd_launch
    return (-(-N // cfg.rows),), _pow2(D), -(-N // bwd[0]), bwd


# Read once: Triton decides at each @triton.jit below whether the kernels run in its CPU interpreter, so
# the flag cannot change later (and an environment lookup per call is host time on the model's hot path).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile(blk, N, D, BN: tl.constexpr, BD: tl.constexpr):
    """Rows ``[1, BN]``, their mask, element offsets ``[1, BN, BD]`` and mask of tile ``blk``. Every tensor
    in the kernels has a leading source axis (1, or S for a group of sources), so that Triton lays all of
    them out alike: a ``[BN, BD]`` tile broadcast into ``[S, BN, BD]`` instead makes it compute the same
    values in several layouts."""
    rows = blk * BN + tl.arange(0, BN)[None, :]
    rm = rows < N
    cols = tl.arange(0, BD)[None, None, :]
    return rows, rm, rows.to(tl.int64)[:, :, None] * D + cols, rm[:, :, None] & (cols < D)


@triton.jit
def _gq(q, w, D, BD: tl.constexpr):
    """``g * q`` as ``[1, 1, BD]`` fp32."""
    cols = tl.arange(0, BD)[None, None, :]
    return (tl.load(q + cols, mask=cols < D, other=0.0).to(tl.float32)
            * tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32))


@triton.jit
def _src(i, L, last, tab, ALIGNED: tl.constexpr):
    """Pointers (of ``last``'s type) to the sources or gradients ``i [S]`` of 1..L-1: ``last`` itself for
    i = L - 1, entry i of the address table ``tab`` below it; null past L - 1 (every load from it is masked
    off). ALIGNED: the host found every address in the table 16-byte aligned, so that the loads and stores
    through them are 16-byte vectors as through a pointer argument (an address loaded from memory has no
    known alignment otherwise)."""
    p = tl.where(i == L - 1, last, tl.load(tab + i, mask=i < L - 1, other=0).to(last.dtype))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def _group(i, L, last, tab, offs, mask, ALIGNED: tl.constexpr):
    """Pointers ``[S, BN, BD]`` and mask of the tiles of the sources (or gradients) ``i [S]``, and which of
    them exist (``i < L``)."""
    ok = i < L
    return _src(i, L, last, tab, ALIGNED)[:, None, None] + offs, ok[:, None, None] & mask, ok


@triton.jit
def _add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _fwd_group(v, i, ok, gq, r, s, rows, rm, m, den, acc, N, D, eps):
    """The statistics of the sources ``i [S]`` from their fp32 tiles ``v [S, BN, BD]`` (zero where ``ok``
    is False) and the online softmax's update of (running max, denominator, weighted sum) ``[1, BN]``,
    ``[1, BN]``, ``[1, BN, BD]``. Both row sums of every source of the group go through one reduction: one
    round of barriers per group."""
    sq, dot = tl.reduce((v * v, v * gq), 2, _add2)
    ri = tl.rsqrt(sq / D + eps).to(tl.float32)
    si = dot * ri
    at, sm = i[:, None] * N + rows, ok[:, None] & rm
    tl.store(r + at, ri, mask=sm)
    tl.store(s + at, si, mask=sm)
    si = tl.where(ok[:, None], si, float("-inf"))
    m_new = tl.maximum(m, tl.max(si, axis=0, keep_dims=True))  # rescale what was summed when the max moves
    alpha = tl.exp(m - m_new)
    e = tl.exp(si - m_new)
    return (m_new, den * alpha + tl.sum(e, axis=0, keep_dims=True),
            acc * alpha[:, :, None] + tl.sum(e[:, :, None] * v, axis=0, keep_dims=True))


@triton.jit(do_not_specialize=["N", "L"])
def _attnres_fwd_kernel(x0, xl, tab, q, w, h, h32, stats, N, D: tl.constexpr, eps, L, BN: tl.constexpr,
                        BD: tl.constexpr, ALIGNED: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr,
                        H32: tl.constexpr):
    """One ``[BN, D]`` tile of h from the L sources: ``x0`` (source 0), ``tab[1..L-2]`` (addresses,
    of ``xl``'s dtype), ``xl`` (source L - 1); writes ``stats [2L + 1, N]`` (fp32: r, s ``[L, N]`` and
    lse ``[N]``) for the backward, and ``tab[L - 1] = xl`` for the next read of the same sources.
    ``H32``: also h in fp32 into ``h32`` (a 16-bit h's read whose backward would read the sources twice from
    HBM: ``keeps_h32``).

    Sources 1.. come in groups of GROUP, each group's tiles loaded at once (``[GROUP, BN, BD]``): that
    many loads per program in flight, however long the row sums between them take. ``STAGES`` > 1 lets
    Triton software-pipeline the loop over the groups (the next groups' loads as asynchronous copies into
    shared memory)."""
    r, s, lse = stats, stats + L * N, stats + 2 * L * N
    gq = _gq(q, w, D, BD)
    rows, rm, offs, mask = _tile(tl.program_id(0), N, D, BN, BD)
    if tl.program_id(0) == 0:
        tl.store(tab + L - 1, xl.to(tl.int64))
    first = tl.arange(0, 1)
    m, den, acc = _fwd_group(tl.load(x0 + offs, mask=mask, other=0.0).to(tl.float32), first, first < L, gq, r, s,
                             rows, rm, tl.full([1, BN], float("-inf"), tl.float32), tl.zeros([1, BN], tl.float32),
                             tl.zeros([1, BN, BD], tl.float32), N, D, eps)
    for i0 in tl.range(1, L, GROUP, num_stages=STAGES):
        i = i0 + tl.arange(0, GROUP)
        ptr, gm, ok = _group(i, L, xl, tab, offs, mask, ALIGNED)
        m, den, acc = _fwd_group(tl.load(ptr, mask=gm, other=0.0).to(tl.float32), i, ok, gq, r, s, rows, rm, m, den,
                                 acc, N, D, eps)
    hv = acc / den[:, :, None]
    tl.store(h + offs, hv.to(h.dtype.element_ty), mask=mask)
    if H32:
        tl.store(h32 + offs, hv, mask=mask)
    tl.store(lse + rows, m + tl.log(den), mask=rm)


@triton.jit
def _chunk_tile(x0, ptr, rest, i, row, d0, D, BD: tl.constexpr):
    """The fp32 ``[S, BD]`` chunk ``d0`` of one row of every source: source 0 through ``x0``, the others through
    the pointers ``ptr [S]`` (zero where ``rest`` is False), and the chunk's column mask ``[1, BD]``."""
    c = d0 + tl.arange(0, BD)[None, :]
    cm = c < D
    v = tl.load(ptr[:, None] + row + c, mask=rest[:, None] & cm, other=0.0).to(tl.float32)
    v0 = tl.load(x0 + row + c, mask=cm, other=0.0).to(tl.float32)
    return tl.where((i == 0)[:, None], v0, v), c, cm


@triton.jit(do_not_specialize=["N", "L"])
def _attnres_fwd_chunked_kernel(x0, xl, tab, q, w, h, stats, N, D: tl.constexpr, eps, L, S: tl.constexpr,
                                BD: tl.constexpr, ALIGNED: tl.constexpr, STAGES: tl.constexpr):
    """``_attnres_fwd_kernel``'s outputs for one row (token) per program, in two passes over chunks of ``BD``
    columns: the row sums of all ``L <= S`` sources at once (so every source's chunk is in flight together), then
    the softmax, then the weighted sum from a second read of the same row (L1 / L2 hits, not HBM)."""
    n = tl.program_id(0)
    row = n.to(tl.int64) * D
    r, s, lse = stats, stats + L * N, stats + 2 * L * N
    if n == 0:
        tl.store(tab + L - 1, xl.to(tl.int64))
    i = tl.arange(0, S)
    ok = i < L
    rest = ok & (i > 0)
    ptr = _src(tl.where(rest, i, 1), L, xl, tab, ALIGNED)  # i = 0 reads x0 (its own dtype), not the table
    sq = tl.zeros([S], tl.float32)
    dot = tl.zeros([S], tl.float32)
    for d0 in tl.range(0, D, BD, num_stages=STAGES):
        v, c, cm = _chunk_tile(x0, ptr, rest, i, row, d0, D, BD)
        gq = tl.load(q + c, mask=cm, other=0.0).to(tl.float32) * tl.load(w + c, mask=cm, other=0.0).to(tl.float32)
        sq += tl.sum(v * v, axis=1)
        dot += tl.sum(v * gq, axis=1)
    ri = tl.rsqrt(sq / D + eps).to(tl.float32)
    si = dot * ri
    tl.store(r + i * N + n, ri, mask=ok)
    tl.store(s + i * N + n, si, mask=ok)
    si = tl.where(ok, si, float("-inf"))
    m = tl.max(si, axis=0)
    e = tl.exp(si - m)
    den = tl.sum(e, axis=0)
    tl.store(lse + n, m + tl.log(den))
    p = (e / den)[:, None]
    for d0 in tl.range(0, D, BD, num_stages=STAGES):
        v, c, cm = _chunk_tile(x0, ptr, rest, i, row, d0, D, BD)
        tl.store(h + row + c, tl.sum(p * v, axis=0, keep_dims=True).to(h.dtype.element_ty), mask=cm)


@triton.jit
def _bwd_group(v, prev, i, ok, g, c, gq, r, s, lse_r, rows, rm, N, D):
    """``dv + prev`` ``[S, BN, BD]`` (prev: what each source's slot holds, or 0) and ``a = ds r [S, BN]``
    (the weight of g * q in dv and of v in B) of the sources ``i [S]``, from their fp32 tiles ``v``
    (zero where ``ok`` is False: a is 0 there, and nothing is stored)."""
    at, sm = i[:, None] * N + rows, ok[:, None] & rm
    si = tl.load(s + at, mask=sm, other=0.0)
    ri = tl.load(r + at, mask=sm, other=0.0)
    pi = tl.exp(si - lse_r)
    a = pi * (tl.sum(v * g, axis=2) - c) * ri
    return pi[:, :, None] * g + a[:, :, None] * gq - (a * si * ri / D)[:, :, None] * v + prev, a


@triton.jit(do_not_specialize=["gofs", "N", "NPROG", "L", "acc"])
def _attnres_bwd_kernel(x0, xl, g0, gl, tab, gofs, q, w, h, dh, stats, part, N, D: tl.constexpr, NPROG, L,
                        acc, BN: tl.constexpr, BD: tl.constexpr, C_FROM_H: tl.constexpr, ALIGNED: tl.constexpr,
                        GROUP: tl.constexpr, STAGES: tl.constexpr):
    """dv_i for the tiles ``pid, pid + NPROG, ...`` and this program's partials of dq = g * B and
    dw = q * B (``part [NPROG, 2, D]``; their sum over the programs is the two gradients).

    Sources as in the forward (groups of GROUP, STAGES); gradients: ``g0`` (source 0's, its dtype),
    ``tab[gofs + 1..gofs + L - 2]`` and ``gl`` (source L - 1's), all of ``gl``'s dtype. Bits of ``acc``:
    1: dv_0 adds to what ``g0`` holds (a gradient slot's running sum) instead of overwriting it, 2: dv_{L-1}
    adds, 4: every middle source's dv adds. ``c = sum_j p_j dp_j = <dh, sum_j p_j v_j>``: with C_FROM_H
    (an fp32 h) it is ``<dh, h>`` and each source is read once; otherwise a first pass over the tile's
    sources sums ``sum_j p_j v_j`` elementwise in fp32 (one row sum per tile; h is not even saved then),
    and the second pass finds those tiles in L2. B is summed in a ``[BN, BD]`` register tile and reduced
    across rows once per program."""
    r, s, lse = stats, stats + L * N, stats + 2 * L * N
    gtab = tab + gofs
    add0 = (acc & 1) != 0
    pid = tl.program_id(0)
    gq = _gq(q, w, D, BD)
    first = tl.arange(0, 1)
    b_acc = tl.zeros([1, BN, BD], tl.float32)
    for blk in range(pid, tl.cdiv(N, BN), NPROG):
        rows, rm, offs, mask = _tile(blk, N, D, BN, BD)
        g = tl.load(dh + offs, mask=mask, other=0.0).to(tl.float32)
        lse_r = tl.load(lse + rows, mask=rm, other=0.0)
        if C_FROM_H:
            c = tl.sum(g * tl.load(h + offs, mask=mask, other=0.0), axis=2)
        else:
            mix = tl.exp(tl.load(s + rows, mask=rm, other=0.0) - lse_r)[:, :, None] * tl.load(
                x0 + offs, mask=mask, other=0.0).to(tl.float32)
            for i0 in tl.range(1, L, GROUP, num_stages=STAGES):
                i = i0 + tl.arange(0, GROUP)
                ptr, gm, ok = _group(i, L, xl, tab, offs, mask, ALIGNED)
                pi = tl.exp(tl.load(s + i[:, None] * N + rows, mask=ok[:, None] & rm, other=float("-inf")) - lse_r)
                mix += tl.sum(pi[:, :, None] * tl.load(ptr, mask=gm, other=0.0).to(tl.float32), axis=0,
                              keep_dims=True)
            c = tl.sum(g * mix, axis=2)
        v = tl.load(x0 + offs, mask=mask, other=0.0).to(tl.float32)
        prev = tl.load(g0 + offs, mask=tl.where(add0, mask, False), other=0.0).to(tl.float32)
        dv, a = _bwd_group(v, prev, first, first < L, g, c, gq, r, s, lse_r, rows, rm, N, D)
        tl.store(g0 + offs, dv.to(g0.dtype.element_ty), mask=mask)
        b_acc += a[:, :, None] * v
        for i0 in tl.range(1, L, GROUP, num_stages=STAGES):
            i = i0 + tl.arange(0, GROUP)
            ptr, gm, ok = _group(i, L, xl, tab, offs, mask, ALIGNED)
            vi = tl.load(ptr, mask=gm, other=0.0).to(tl.float32)
            dptr, _, _ = _group(i, L, gl, gtab, offs, mask, ALIGNED)
            adds = tl.where(i == L - 1, acc & 2, acc & 4) != 0
            prev_i = tl.load(dptr, mask=gm & adds[:, None, None], other=0.0).to(tl.float32)
            dv_i, a_i = _bwd_group(vi, prev_i, i, ok, g, c, gq, r, s, lse_r, rows, rm, N, D)
            tl.store(dptr, dv_i.to(gl.dtype.element_ty), mask=gm)
            b_acc += tl.sum(a_i[:, :, None] * vi, axis=0, keep_dims=True)
    b = tl.sum(tl.sum(b_acc, axis=1), axis=0)
    cols = tl.arange(0, BD)
    dq_part = part + pid.to(tl.int64) * 2 * D
    # q and w loaded again rather than held in registers through the loop (more resident programs per SM)
    tl.store(dq_part + cols, b * tl.load(w + cols, mask=cols < D, other=0.0).to(tl.float32), mask=cols < D)
    tl.store(dq_part + D + cols, b * tl.load(q + cols, mask=cols < D, other=0.0).to(tl.float32), mask=cols < D)


@triton.jit(do_not_specialize=["gofs", "N", "L", "acc"])
def _attnres_bwd_chunked_kernel(x0, xl, g0, gl, tab, gofs, q, w, dh, stats, base, N, D: tl.constexpr, L, acc,
                                S: tl.constexpr, BD: tl.constexpr, ALIGNED: tl.constexpr, STAGES: tl.constexpr):
    """The backward of one row (token) per program in two passes over chunks of ``BD`` columns, every source's
    chunk at once: ``dp_i = <v_i, dh>`` first (so ``c = sum_i p_i dp_i`` and ``a_i = p_i (dp_i - c) r_i``), then
    ``dv_i = p_i dh + a_i g q - (a_i s_i r_i / D) v_i`` plus what its slot holds where ``acc`` says it adds (as
    ``_attnres_bwd_kernel``), and the row's ``B = sum_i a_i v_i`` into ``base [N, D]`` (fp32)."""
    n = tl.program_id(0)
    row = n.to(tl.int64) * D
    r, s, lse = stats, stats + L * N, stats + 2 * L * N
    i = tl.arange(0, S)
    ok = i < L
    rest = ok & (i > 0)
    idx = tl.where(rest, i, 1)  # source 0 and its gradient go through x0 and g0 (their own dtypes)
    ptr = _src(idx, L, xl, tab, ALIGNED)
    gptr = _src(idx, L, gl, tab + gofs, ALIGNED)
    adds = rest & (tl.where(i == L - 1, acc & 2, acc & 4) != 0)
    add0 = (acc & 1) != 0
    ri = tl.load(r + i * N + n, mask=ok, other=0.0)
    si = tl.load(s + i * N + n, mask=ok, other=0.0)
    pi = tl.exp(tl.where(ok, si, float("-inf")) - tl.load(lse + n))
    dp = tl.zeros([S], tl.float32)
    for d0 in tl.range(0, D, BD, num_stages=STAGES):
        v, c, cm = _chunk_tile(x0, ptr, rest, i, row, d0, D, BD)
        dp += tl.sum(v * tl.load(dh + row + c, mask=cm, other=0.0).to(tl.float32), axis=1)
    a = pi * (dp - tl.sum(pi * dp, axis=0)) * ri
    k = (a * si * ri / D)[:, None]
    for d0 in tl.range(0, D, BD, num_stages=STAGES):
        v, c, cm = _chunk_tile(x0, ptr, rest, i, row, d0, D, BD)
        g = tl.load(dh + row + c, mask=cm, other=0.0).to(tl.float32)
        gq = tl.load(q + c, mask=cm, other=0.0).to(tl.float32) * tl.load(w + c, mask=cm, other=0.0).to(tl.float32)
        prev = tl.load(gptr[:, None] + row + c, mask=adds[:, None] & cm, other=0.0).to(tl.float32)
        prev0 = tl.load(g0 + row + c, mask=tl.where(add0, cm, False), other=0.0).to(tl.float32)
        dv = pi[:, None] * g + a[:, None] * gq - k * v + tl.where((i == 0)[:, None], prev0, prev)
        tl.store(gptr[:, None] + row + c, dv.to(gl.dtype.element_ty), mask=rest[:, None] & cm)
        dv0 = tl.sum(tl.where((i == 0)[:, None], dv, 0.0), axis=0, keep_dims=True)
        tl.store(g0 + row + c, dv0.to(g0.dtype.element_ty), mask=cm)
        tl.store(base + row + c, tl.sum(a[:, None] * v, axis=0, keep_dims=True), mask=cm)


_RESIDENT: dict[tuple, int] = {}  # backward launch signature -> its programs that fit on one SM at once
_SMS: dict[int, int] = {}  # device index -> multiprocessor count (a driver query, asked once)


def _bwd_programs(n_tiles: int, device: torch.device, cfg: LaunchConfig, key: tuple) -> int:
    """Persistent grid of the backward: ``SMs * programs_per_sm``; with programs_per_sm = 0 as
    many programs as are resident at once, so that the grid is one wave and every program walks
    the same number of tiles (one per SM until the first launch of ``key`` has told its registers)."""
    if _INTERPRET:
        return max(1, min(n_tiles, _INTERP_PROGRAMS))
    sms = _SMS.get(device.index)
    if sms is None:
        sms = _SMS[device.index] = triton.runtime.driver.active.utils.get_device_properties(
            device.index)["multiprocessor_count"]
    return max(1, min(n_tiles, sms * (cfg.programs_per_sm or _RESIDENT.get(key, 1))))


def _note_resident(key: tuple, kernel, device: torch.device, warps: int) -> None:
    """Programs of a compiled kernel that fit on one SM: registers (allocated per thread in units
    of 8), shared memory, and 64 warps per SM."""
    if getattr(kernel, "n_regs", None) is None:
        return  # no compiled kernel came back (a recorder stood in for the kernel: nothing was compiled)
    props = triton.runtime.driver.active.utils.get_device_properties(device.index)
    regs = -(-kernel.n_regs // 8) * 8
    fit = [props["max_num_regs"] // (max(regs, 8) * 32 * warps), 64 // warps]
    if kernel.metadata.shared:
        fit.append(props["max_shared_mem"] // kernel.metadata.shared)
    _RESIDENT[key] = max(1, min(fit))


class GradSlot:
    """Where the backward of the reads of one source sums that source's gradient, in place.

    Contract (what makes the sum complete when it is handed over): the first read that takes the
    slot (in the forward) owns it; every later read of the source depends, through the sublayers
    in between, on the owner's output, so autograd runs the owner's backward after all of theirs.
    Non-owners add their ``dv`` into ``grad`` and give autograd None; the owner adds its own, returns
    the sum as the source's gradient and empties the slot (so a retained graph can run again). A
    model's residual stream keeps this order by construction: source i first appears in the read
    right after it is made, and every later read mixes a source that contains it.

    ``table``: the address table whose gradient row holds ``grad``'s address at this source's
    position (so that a backward finds it there), or None.
    """

    __slots__ = ("grad", "taken", "table")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.taken = False
        self.table: torch.Tensor | None = None


# One read's address table by (device, stream, addresses of sources 1..L-1): a list read again at the same
# addresses (a benchmark's loop, a training loop whose allocator hands out the same blocks) reuses its table
# instead of making one and copying the addresses in (host time on a host-bound read). The addresses a table
# holds are its key, and the kernel's own write (source L - 1) is one of them; the gradient row is rewritten
# unless the last write to it (``_grad_row``, tracked on the table) put the same addresses there. Reads that
# share a table run on one stream, so each write lands before the kernel that reads it.
LIST_TABLES = 64
_LIST_TABLES: dict[tuple, torch.Tensor] = {}


def _write_table(dst: torch.Tensor, values: list[int]) -> None:
    """``dst[:] = values`` (int64 addresses), in stream order and without the host waiting for the device:
    from pinned memory on CUDA (a copy from pageable memory would synchronize the stream, a stall that a
    host-bound step cannot hide)."""
    dst.copy_(torch.tensor(values, dtype=torch.int64, pin_memory=dst.is_cuda), non_blocking=True)


def _table_grads(tab: torch.Tensor, slots: Sequence[GradSlot], srcs: Sequence[torch.Tensor],
                 fresh: Sequence[torch.Tensor] | None) -> int:
    """The backward's slow path: put the gradient buffers of the middle sources (1..L-2) into the table's
    gradient row, making the missing ones (from ``fresh`` when given; zeroed when other middle slots hold
    sums, so that one flag says that all of them add). Returns the kernel's middle flag (4: they add).
    In a model this is the backward of the last read (every slot still empty), once per step: the reads
    before it find the same buffers there."""
    L = len(slots)
    missing = [i for i in range(1, L - 1) if slots[i].grad is None]
    for i in missing:
        slots[i].grad = torch.empty_like(srcs[i]) if fresh is None else fresh[i]
        if len(missing) < L - 2:
            slots[i].grad.zero_()
    for sl in slots[1:L - 1]:
        sl.table = tab
    cap = tab.shape[0] // 2
    row = [sl.grad.data_ptr() for sl in slots[1:L - 1]]
    if getattr(tab, "_grad_row", None) != row:  # (tracked on the cached tables of list reads only)
        _write_table(tab[cap + 1:cap + L - 1], row)
        if hasattr(tab, "_grad_row"):
            tab._grad_row = row
    return 0 if len(missing) == L - 2 else 4


def _forward_kernels(query: torch.Tensor, norm_weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
                     cfg: LaunchConfig, src: Sources, grad: bool) -> tuple:
    """The forward's launch for the sources of ``src``: ``(h, h32, stats, tab, aligned, (N, D, BD, tiles, bwd))``
    with ``h32`` the fp32 h the backward takes c from (h itself when fp32; a kept copy, ``keeps_h32``, only where
    ``grad``; else None) and ``stats [2L + 1, N]`` fp32."""
    srcs = src.tensors
    x0, xl = srcs[0], srcs[-1]
    D = x0.shape[-1]
    N, L = x0.numel() // D, len(srcs)
    tab = src._tab
    if src._synced < L - 1 or src._cap < L:
        tab = src._sync(L)
    src._synced = L  # the kernel writes the address of source L - 1
    aligned = not src._misaligned
    h = torch.empty(x0.shape, device=x0.device, dtype=out_dtype)  # the sources' [..., D]
    stats = torch.empty((2 * L + 1, N), device=x0.device, dtype=torch.float32)
    grid, BD, tiles, bwd = _launch_numbers(cfg, N, D)
    if cfg.chunk:
        _attnres_fwd_chunked_kernel[(N,)](
            x0, xl, tab, query, norm_weight, h, stats, N, D, eps, L, S=_pow2(L),
            BD=min(cfg.chunk, BD), ALIGNED=aligned, STAGES=cfg.stages, num_warps=cfg.warps)
        h32 = h if out_dtype is torch.float32 else None
    else:
        # c from <dh, h> needs h in fp32: a 16-bit h's read of a list keeps an fp32 copy where its backward
        # would otherwise read the sources twice from HBM (a model's reads do not: one more [N, D] fp32 per read
        # of a residual stream, kept until the backward, is memory a model would rather have)
        keep = (grad and out_dtype is not torch.float32 and src._one_read
                and keeps_h32(cfg, D, L, xl.element_size()))
        h32 = h if out_dtype is torch.float32 else (torch.empty(h.shape, device=h.device, dtype=torch.float32)
                                                    if keep else None)
        _attnres_fwd_kernel[grid](
            x0, xl, tab, query, norm_weight, h, h if h32 is None else h32, stats, N, D, eps, L,
            BN=cfg.rows, BD=BD, ALIGNED=aligned, GROUP=cfg.group, STAGES=cfg.stages, H32=keep,
            num_warps=cfg.warps)
    return h, h32, stats, tab, aligned, (N, D, BD, tiles, bwd)


def _weights(stats: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """The depth weights ``p [L, ...]`` (fp32) from the forward's row statistics ``[2L + 1, N]``."""
    L = (stats.shape[0] - 1) // 2
    return torch.exp(stats[L:2 * L] - stats[2 * L]).view((L,) + x0.shape[:-1])


class _DepthAttentionFn(torch.autograd.Function):
    """Inputs: query, norm_weight ``[D]``, the read's plan ``(eps, out_dtype, cfg, want_p, src, stacked,
    owned)`` with ``src`` a :class:`Sources` (the sources ``[N, D]``, their slots and address table), then
    the sources whose slots this read owns (``owned``, the indices of the slots it took first) or, with
    ``stacked=True``, the one ``[L, N, D]`` tensor the sources are views of (its gradient is one
    ``[L, N, D]`` buffer).

    Only the owned sources are autograd inputs: every other source's gradient goes into its slot, and the
    slot's owner hands it over, so an input for it would only be an edge that gets None (autograd's work
    per input and per edge, about 0.4 us each on the host, x L per read; Full AttnRes reads up to 25). The
    order the slots need still holds with these edges alone: a later read depends on the owner of a source
    it reads through that read's own outputs, and each step of that dependence goes through a source that
    some read owns (``GradSlot``). In a model a read owns the newest source, made from the read before.

    Host time matters here (a model calls this about twice per sublayer and step, and its step is
    launch-bound): one Triton launch per direction, with the same few arguments at every L; forward
    two allocations (h, the row statistics), backward two plus one sum that gives dq and dw at once,
    plus one gradient buffer per slot that is still empty; no per-source host work in the forward
    beyond the new slots a read takes, and in the backward one attribute check per source that its
    gradient buffer is in the table (``_table_grads`` when it is not: once per step in a model).
    ``ctx`` keeps the sources of the read, the slots and the table, never the Sources: it holds later
    sources, whose graph leads back to this node (a reference cycle through autograd's nodes would keep
    the step's activations alive)."""

    @staticmethod
    def forward(ctx, query, norm_weight, plan, *inputs):
        eps, out_dtype, cfg, want_p, src, stacked, owned = plan
        h, h32, stats, tab, aligned, (N, D, BD, tiles, bwd) = _forward_kernels(query, norm_weight, eps, out_dtype, cfg,
                                                                              src, True)
        srcs = src.tensors
        ctx.save_for_backward(query, norm_weight, h32, *inputs)
        # stats: made here, read only by the backward (a plain reference: no saved-tensor packing per read)
        ctx.plan = (stacked, cfg, src.slots, owned, tab, aligned, None if stacked else srcs, stats, N, D, BD, tiles,
                    bwd)
        if not want_p:
            return h, None
        p = _weights(stats, srcs[0])
        ctx.mark_non_differentiable(p)
        return h, p

    @staticmethod
    def backward(ctx, dh, _dp):
        """dq, dw, None for the plan, then the gradients of the inputs (the owned sources, or the stacked
        tensor). once_differentiable only where a graph of the backward is asked for (its wrapper costs
        host time at every read otherwise)."""
        if torch.is_grad_enabled():  # create_graph=True: a second derivative through this op raises
            return _backward_once(ctx, dh, _dp)
        query, norm_weight, h, *inputs = ctx.saved_tensors
        stacked, cfg, slots, owned, tab, aligned, srcs, stats, N, D, BD, tiles, (rows, warps, group, stages) = ctx.plan
        L = len(slots)
        if stacked:
            dstack = torch.empty_like(inputs[0])
            srcs, fresh = inputs[0].unbind(0), dstack.unbind(0)
        else:
            fresh = None
        x0, xl = srcs[0], srcs[-1]
        # each gradient buffer: the slot's running sum (it adds) or a fresh one; the owners hand theirs over below
        acc = 0
        s0 = slots[0]
        g0 = s0.grad
        if g0 is None:
            g0 = s0.grad = torch.empty_like(x0) if fresh is None else fresh[0]
        else:
            acc = 1
        gl = g0
        if L > 1:
            sl = slots[-1]
            gl = sl.grad
            if gl is None:
                gl = sl.grad = torch.empty_like(xl) if fresh is None else fresh[-1]
            else:
                acc |= 2
            if L > 2:  # the middle slots' sums are in the table, or the slow path puts them there
                acc |= 4
                for s in slots[1:-1]:
                    if s.table is not tab:
                        acc = acc & 3 | _table_grads(tab, slots, srcs, fresh)
                        break
        if not dh.is_contiguous():
            dh = dh.contiguous()
        if cfg.bwd_chunk:
            base = torch.empty((N, D), device=dh.device, dtype=torch.float32)
            _attnres_bwd_chunked_kernel[(N,)](
                x0, xl, g0, gl, tab, tab.shape[0] // 2, query, norm_weight, dh, stats, base, N, D, L, acc,
                S=_pow2(L), BD=min(cfg.bwd_chunk, BD), ALIGNED=aligned, STAGES=stages, num_warps=warps)
            b = base.sum(0)
            return _returned_grads(b * norm_weight.float(), b * query.float(), query, norm_weight, stacked, dstack if
                              stacked else None, owned, slots)
        # the grid is sized by the kernel's registers only when programs_per_sm is 0 (see _bwd_programs)
        key = None if cfg.programs_per_sm or _INTERPRET else (
            dh.device.index, cfg, h is not None, x0.dtype, xl.dtype, dh.dtype, aligned)
        nprog = _bwd_programs(tiles, dh.device, cfg, key)
        part = torch.empty((nprog, 2, D), device=dh.device, dtype=torch.float32)
        kernel = _attnres_bwd_kernel[(nprog,)](
            x0, xl, g0, gl, tab, tab.shape[0] // 2, query, norm_weight, dh if h is None else h, dh, stats, part,
            N, D, nprog, L, acc, BN=rows, BD=BD, C_FROM_H=h is not None, ALIGNED=aligned, GROUP=group,
            STAGES=stages, num_warps=warps)
        if key is not None and key not in _RESIDENT:
            _note_resident(key, kernel, dh.device, warps)
        dq, dw = part.sum(0).unbind(0)
        return _returned_grads(dq, dw, query, norm_weight, stacked, dstack if stacked else None, owned, slots)


def _returned_grads(dq: torch.Tensor, dw: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, stacked: bool,
               dstack: torch.Tensor | None, owned: Sequence[int], slots: Sequence[GradSlot]) -> tuple:
    """The backward's return: dq and dw in the parameters' dtypes, None for the plan, then the stacked tensor's
    gradient or the owned sources' (their slots handed over and emptied)."""
    if dq.dtype != query.dtype:
        dq = dq.to(query.dtype)
    if dw.dtype != norm_weight.dtype:
        dw = dw.to(norm_weight.dtype)
    if stacked:
        return dq, dw, None, dstack
    grads = []
    for i in owned:
        sl = slots[i]
        grads.append(sl.grad)
        sl.grad, sl.table = None, None
    return dq, dw, None, *grads


_backward_once = torch.autograd.function.once_differentiable(_DepthAttentionFn.backward)


def depth_attention_torch(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference, fp32 math (autocast or not): ``sources`` L tensors ``[..., D]`` -> ``h [..., D]``
    (out_dtype), ``p [L, ...]`` fp32."""
    with torch.autocast(sources[0].device.type, enabled=False):
        v = torch.stack([x.float() for x in sources])
        keys = F.rms_norm(v, (v.shape[-1],), norm_weight.float(), eps)
        p = (keys @ query.float()).softmax(dim=0)
        return torch.einsum("l...,l...d->...d", p, v).to(out_dtype), p


def _promote(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types`` on ``DTYPES`` (two different ones give fp32, bf16 with fp16 too), in plain
    Python: the torch function dispatches an op, and a read would make one per step and read."""
    return a if a == b else torch.float32


def _check_source(i: int, x: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
    """Raise unless source ``i`` has ``shape``, lies on ``device`` and has one of ``DTYPES``."""
    if x.shape != shape:
        raise ValueError(f"sources[{i}] has shape {tuple(x.shape)}, expected {tuple(shape)} (as sources[0])")
    if x.device != device:
        raise ValueError(f"sources[{i}] is on {x.device}, expected {device} (as sources[0])")
    if x.dtype not in DTYPES:
        raise ValueError(f"sources[{i}] dtype {x.dtype} is not allowed: expected bf16, fp16 or fp32")


def _check_sources(sources: Sequence[torch.Tensor]) -> torch.dtype:
    """Validate a list of sources and return their promoted dtype (what ``torch.stack`` gives, with or
    without autocast)."""
    if len(sources) == 0:
        raise ValueError("sources is empty: expected at least one source")
    x0 = sources[0]
    if x0.dim() == 0:
        raise ValueError("sources must be [..., D] tensors, got a 0-d tensor")
    out = x0.dtype
    for i, x in enumerate(sources):
        _check_source(i, x, x0.shape, x0.device)
        out = _promote(out, x.dtype)
    return out


def _check_params(query: torch.Tensor, norm_weight: torch.Tensor, eps: float, D: int, dev: torch.device) -> None:
    """Raise unless query and norm_weight are ``[D]`` on the sources' device and eps > 0 (O(1) per read)."""
    for name, t in (("query", query), ("norm_weight", norm_weight)):
        if t.shape != (D,):
            raise ValueError(f"{name} must be [D] with D = {D}, got shape {tuple(t.shape)}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, expected {dev} (as the sources)")
    if not eps > 0:
        raise ValueError(f"eps={eps!r} is not allowed: expected a positive number")


class Sources:
    """A growing list of sources that is read many times (a model's residual stream).

    Each source is checked once, when it is added (the first one's shape and device, an allowed
    dtype; kept contiguous), gets its own :class:`GradSlot`, and the promoted dtype of all of them
    is kept up to date, so that ``depth_attention(sources, ...)`` does no per-source work on the
    host. Full AttnRes reads source i in every later read: a check per source and read would be
    O(L^2) Python per step. The fused kernels read sources 1.. through one pointer type, so they are
    stored in one dtype, their promoted one: a source of another dtype is stored converted (a model
    whose attention outputs stay fp32 among bf16 ones, K3's ``fp32_output``), and when a new source
    widens the dtype the ones before it are converted once (with fresh slots: a slot's buffer has its
    source's dtype; autograd takes each gradient back through the conversion). The fused op keeps the
    sources' addresses in a device table here (made by the first read, grown by doubling): each
    read's kernel writes the address of the newest source, the one that the next read finds among
    the middle ones (reads of one Sources run on one CUDA stream, in order).

    Attributes:
        tensors: the sources ``[..., D]`` as the kernels read them (tuple, in order).
        slots: one GradSlot per source (a source added again, put in place of the last one, or
            converted, gets a fresh slot).
        dtype: the promoted dtype of the sources (h's dtype).
        rest_dtype: the dtype of sources 1.. (None while there is one source).
    """

    __slots__ = ("tensors", "slots", "dtype", "rest_dtype", "_tab", "_cap", "_synced", "_taken", "_misaligned",
                 "_one_read")

    def __init__(self, first: torch.Tensor) -> None:
        _check_sources((first,))
        self._start((first.contiguous(),), (GradSlot(),), first.dtype)

    def _start(self, tensors: tuple[torch.Tensor, ...], slots: tuple[GradSlot, ...], dtype: torch.dtype) -> None:
        self.tensors, self.slots, self.dtype = tensors, slots, dtype
        self.rest_dtype = tensors[-1].dtype if len(tensors) > 1 else None
        self._tab: torch.Tensor | None = None  # int64 [2 * cap]: the sources' addresses, then their gradients'
        self._cap = 0
        self._synced = 1  # sources 1.._synced-1 have their address in the table (or an enqueued kernel writes it)
        self._taken = 0  # every slot before this one was taken by a read
        self._misaligned = 0  # OR of the low 4 bits of the addresses of sources 1..
        self._one_read = False  # a list (or stacked tensor) read once, not a model's residual stream

    @classmethod
    def _of(cls, seq: Sequence[torch.Tensor], slots: Sequence[GradSlot] | None, dtype: torch.dtype) -> Sources:
        """A Sources for one read of a checked list: every source contiguous, sources 1.. converted to their
        promoted dtype where theirs differs (autograd takes each gradient back to its source's dtype), and the
        given GradSlot per source, or a fresh one where none is given or the source was converted."""
        one_read = slots is None
        rest = functools.reduce(_promote, (x.dtype for x in seq[1:]), seq[-1].dtype)
        tensors = tuple(x.contiguous() if i == 0 or x.dtype == rest else x.to(rest).contiguous()
                        for i, x in enumerate(seq))
        slots = tuple(GradSlot() if slots is None or (i and x.dtype != rest) else slots[i] for i, x in enumerate(seq))
        self = cls.__new__(cls)
        self._start(tensors, slots, dtype)
        self._one_read = one_read
        ptrs = tuple(x.data_ptr() for x in tensors[1:])
        for p in ptrs:
            self._misaligned |= p & 15
        x0 = tensors[0]
        if len(tensors) > 2 and (x0.is_cuda or _INTERPRET):  # a table of these addresses may be cached already
            key = (x0.device.index, torch.cuda.current_stream(x0.device).cuda_stream if x0.is_cuda else 0, ptrs)
            tab = _LIST_TABLES.pop(key, None)
            if tab is None:
                tab = self._sync(len(tensors))
                tab._grad_row = None
                if len(_LIST_TABLES) >= LIST_TABLES:
                    del _LIST_TABLES[next(iter(_LIST_TABLES))]
            self._tab, self._cap, self._synced = tab, tab.shape[0] // 2, len(tensors) - 1
            _LIST_TABLES[key] = tab  # most recently used last
        return self

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i]

    def _stored(self, x: torch.Tensor, i: int, rest: torch.dtype) -> torch.Tensor:
        """Source i (>= 1) as the kernels read it: checked (raises before anything changes), in ``rest``,
        contiguous."""
        x0 = self.tensors[0]
        _check_source(i, x, x0.shape, x0.device)
        if x.dtype != rest:
            x = x.to(rest)
        x = x if x.is_contiguous() else x.contiguous()
        self._misaligned |= x.data_ptr() & 15
        return x

    def _widen(self, rest: torch.dtype, end: int) -> None:
        """Store sources 1..end-1 in ``rest`` (a wider dtype came), with fresh slots and in a new address table:
        the reads before keep theirs (their backward reads the old sources' addresses there)."""
        self.tensors = self.tensors[:1] + tuple(x.to(rest) for x in self.tensors[1:end]) + self.tensors[end:]
        self.slots = self.slots[:1] + tuple(GradSlot() for _ in range(1, end)) + self.slots[end:]
        self._tab, self._cap, self._synced, self._taken = None, 0, 1, min(self._taken, 1)
        for x in self.tensors[1:end]:
            self._misaligned |= x.data_ptr() & 15

    def append(self, x: torch.Tensor) -> None:
        """Add source ``x`` ``[..., D]`` (the first source's shape and device)."""
        n = len(self.tensors)
        rest = x.dtype if n == 1 else _promote(self.rest_dtype, x.dtype)
        x = self._stored(x, n, rest)
        if n > 1 and rest != self.rest_dtype:
            self._widen(rest, n)
        self.tensors += (x,)
        self.slots += (GradSlot(),)
        self.rest_dtype = rest
        self.dtype = _promote(self.dtype, rest)

    def replace_last(self, x: torch.Tensor) -> None:
        """Put ``x`` in place of the last source (the running sum of a block that is still open)."""
        n = len(self.tensors)
        if n == 1:
            _check_source(0, x, self.tensors[0].shape, self.tensors[0].device)
            self.tensors, self.dtype = (x.contiguous(),), x.dtype
        else:
            rest = x.dtype if n == 2 else _promote(self.rest_dtype, x.dtype)
            x = self._stored(x, n - 1, rest)
            if n > 2 and rest != self.rest_dtype:
                self._widen(rest, n - 1)
            self.tensors = self.tensors[:-1] + (x,)
            self.rest_dtype = rest
            self.dtype = _promote(self.tensors[0].dtype, rest)
        self.slots = self.slots[:-1] + (GradSlot(),)
        self._synced = min(self._synced, n - 1)
        self._taken = min(self._taken, n - 1)

    def _sync(self, L: int) -> torch.Tensor:
        """The address table, made (or grown) to hold L sources, with the addresses of sources 1..L-2 in it:
        the forward's slow path (a Sources' first read, or one after two or more new sources)."""
        tab, cap = self._tab, self._cap
        if cap < L:
            self._cap = max(64, 2 * L)
            new = torch.empty(2 * self._cap, dtype=torch.int64, device=self.tensors[0].device)
            if tab is not None:
                new[:cap].copy_(tab[:cap])
                new[self._cap:self._cap + cap].copy_(tab[cap:])
            self._tab = tab = new
        if self._synced < L - 1:
            _write_table(tab[self._synced:L - 1], [x.data_ptr() for x in self.tensors[self._synced:L - 1]])
        return tab


@torch.compiler.disable  # a compiled model calls the op eagerly (its kernels launch themselves)
def depth_attention(sources: torch.Tensor | Sequence[torch.Tensor] | Sources, query: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float = 1e-6, backend: str = "auto",
                    config: LaunchConfig | None = None, weights: bool = True,
                    slots: Sequence[GradSlot] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax over depth with one pseudo-query and an RMSNorm on the keys (see the module docstring).

    Args:
        sources: L tensors ``[..., D]`` of one shape (bf16 / fp16 / fp32, dtypes may differ), one
            stacked tensor ``[L, ..., D]``, or a :class:`Sources`. A list is the fast form for one
            read: nothing is stacked, and each gradient comes back in its source's dtype. A Sources
            is the fast form for many reads of a growing list (a model's residual stream): its
            sources were checked when added and carry their gradient slots.
        query: the pseudo-query ``[D]``.
        norm_weight: the key RMSNorm's weight ``[D]``.
        eps: the RMSNorm epsilon (> 0).
        backend: ``"triton"`` (CUDA tensors, or any under ``TRITON_INTERPRET=1``), ``"torch"``
            (``depth_attention_torch``), or ``"auto"``: triton on CUDA tensors, else torch.
        config: Triton launch parameters; None takes ``launch_config(D, L, N)`` (``launch_config(D)``
            with a Sources or slots: a model's reads).
        weights: also return the depth weights p (False: None in their place, and the Triton
            path skips the two kernels that make them).
        slots: one :class:`GradSlot` per source (list form, Triton path): the sources' gradients
            are summed in place over the reads that share a slot (see ``GradSlot`` for the order
            this relies on). Ignored by the torch backend (autograd sums there). None with a
            Sources (it has its own).

    Returns:
        ``h [..., D]`` in the promoted dtype of the sources (autocast or not: with the model's
        fp32 embedding among the sources that is fp32, the dtype of prenorm's running sum, and the
        next RMSNorm then keeps this very tensor instead of an fp32 copy); the depth weights
        ``p [L, ...]`` fp32 (no gradient), or None with ``weights=False``. Gradients flow to every
        source, query and norm_weight.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed: expected one of {BACKENDS}")
    stacked = isinstance(sources, torch.Tensor)
    if isinstance(sources, Sources):
        if slots is not None:
            raise ValueError("slots: a Sources carries one GradSlot per source, expected slots=None with it")
        src, seq, slots, out_dtype = sources, sources.tensors, sources.slots, sources.dtype
    else:
        src = None
        if stacked and sources.dim() < 2:
            raise ValueError(f"stacked sources must be [L, ..., D], got shape {tuple(sources.shape)}")
        seq = tuple(sources.unbind(0)) if stacked else tuple(sources)
        out_dtype = _check_sources(seq)
        if slots is not None:
            if stacked or len(slots) != len(seq):
                raise ValueError(f"slots: expected one GradSlot per source in list form ({len(seq)}), got "
                                 f"{len(slots)} for {'a stacked tensor' if stacked else 'a list'}")
            slots = tuple(slots)
            if len(set(map(id, slots))) != len(slots):  # the backward prefetches slot i + 1 before it writes slot i
                raise ValueError("slots: expected a distinct GradSlot per source, got one GradSlot twice")
    x0 = seq[0]
    lead, D = x0.shape[:-1], x0.shape[-1]
    _check_params(query, norm_weight, eps, D, x0.device)
    if backend == "auto":
        backend = "triton" if x0.is_cuda else "torch"
    if backend == "torch":
        h, p = depth_attention_torch(seq, query, norm_weight, eps, out_dtype)
        return h, (p if weights else None)
    if not (x0.is_cuda or _INTERPRET):
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x0.device}")
    if D > MAX_D:
        raise ValueError(f"D={D} is not allowed with backend='triton': expected 1..{MAX_D} (use backend='torch')")
    if config is None:  # a model's reads (a Sources, or slots) share one launch: one compiled kernel for all L
        model = src is not None or slots is not None
        config = launch_config(D) if model else launch_config(D, len(seq), x0.numel() // D)
    else:
        config.validate()
    if stacked:
        inputs = (sources.reshape(len(seq), -1, D).contiguous(),)
        src = Sources._of(inputs[0].unbind(0), None, out_dtype)
    elif src is None:
        src = Sources._of(seq, slots, out_dtype)
    h, p = read_sources(src, query, norm_weight, eps, weights, config, inputs if stacked else None)
    if stacked:
        h = h.view(lead + (D,))
    return h, (p.view((len(seq),) + lead) if weights else None)


def read_sources(src: Sources, query: torch.Tensor, norm_weight: torch.Tensor, eps: float, weights: bool,
                 config: LaunchConfig | None = None,
                 stacked: tuple[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``depth_attention(src, query, norm_weight, eps, backend="triton", weights=weights)`` for a model's
    residual stream, without the checks a Sources has made already (its sources, the backend) and without
    ``torch.compiler.disable``'s wrapper (call ``depth_attention`` when compiling). ``config``: None takes
    ``launch_config(D)``; ``stacked``: the one ``[L, N, D]`` tensor the sources are views of."""
    x0 = src.tensors[0]
    D = x0.shape[-1]
    if (query.shape != (D,) or norm_weight.shape != (D,) or query.device != x0.device
            or norm_weight.device != x0.device or not eps > 0 or not (x0.is_cuda or _INTERPRET) or D > MAX_D):
        return depth_attention(src, query, norm_weight, eps, backend="triton", weights=weights)  # raises
    if not query.is_contiguous():
        query = query.contiguous()
    if not norm_weight.is_contiguous():
        norm_weight = norm_weight.contiguous()
    if not torch.is_grad_enabled():  # no graph to record: the kernel alone (no autograd node, no slot taken)
        h, _, stats, *_ = _forward_kernels(query, norm_weight, float(eps), src.dtype, config or launch_config(D), src,
                                           False)
        return h, (_weights(stats, x0) if weights else None)
    slots, owned = src.slots, []  # the slots no read took before: this one takes them
    for i in range(src._taken, len(slots)):  # a Sources' slots before src._taken are all taken
        sl = slots[i]
        if not sl.taken:
            sl.taken = True
            owned.append(i)
    src._taken = len(slots)
    if stacked is None:
        srcs = src.tensors
        inputs = [srcs[i] for i in owned]
    else:
        inputs = stacked
    plan = (float(eps), src.dtype, config or launch_config(D), weights, src, stacked is not None, owned)
    return _DepthAttentionFn.apply(query, norm_weight, plan, *inputs)
