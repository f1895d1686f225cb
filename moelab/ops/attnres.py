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
normalized keys in fp32 and saves both for the backward. Here the sources are passed as L
separate pointers (a tuple kernel argument, so no stack and mixed dtypes are fine), the forward
reads each source once with an online softmax over depth and keeps only fp32 row statistics
(r and s ``[L, N]``, the log-sum-exp ``[N]``). The backward recomputes p from them and writes
every ``dv_i`` in its source's dtype; each program's row sums of B, times g and times q, go into
fp32 partials of dq and dw (one torch sum over the programs gives both, in a fixed order, so the
result is deterministic). fp32 math throughout.

``c = sum_j p_j dp_j`` in ``ds_i`` equals ``<dh, h>``. When h is fp32 (in the model: the fp32
embedding is always a source) the forward saves h (the next RMSNorm keeps that same tensor
anyway) and the backward reads each source once. A 16-bit h would carry its rounding into c
(about 4e-3 relative error in the gradients), so then h is not saved and the backward sums c in
a first pass over the sources instead. Traffic per token and width element with bf16 sources:
forward 2L + 2 bytes (+2 for an fp32 h); backward 4L + 8 with the fp32 h, 6L + 2 without. The
plain path adds a stack copy of the sources, fp32 keys and their saved copies on top.

A model reads every source many times (Full AttnRes: source i in every later read), so autograd
would write a fresh ``dv_i`` per read and then add them up, a write plus an add (two reads, one
write) of ``[N, D]`` per source and read. With a :class:`GradSlot` per source the backward kernel
sums ``dv_i`` in place into the slot's buffer instead (one read and one write), and only the read
that saw the source first hands the sum to autograd (see ``GradSlot``). A :class:`Sources` holds
such a growing list with its slots, each source checked once when added, so that a read does no
per-source host work beyond the kernels' pointer tuples.

``depth_attention`` is the front door (either backend); ``depth_attention_torch`` the fp32
PyTorch reference that defines the semantics.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BACKENDS = ("auto", "torch", "triton")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_D = 16384  # one program holds a whole row (next power of two) of a few [rows, D] fp32 tiles
_INTERP_PROGRAMS = 3  # interpreter: a few programs, so the persistent loop takes several turns


@dataclass(frozen=True)
class LaunchConfig:
    """Launch parameters of the Triton path (tuning knobs; ``launch_config`` picks the default).

    rows: tokens per forward tile (a power of two); each tile is ``[rows, next_pow2(D)]``.
    warps: warps per forward program.
    programs_per_sm: the backward's persistent grid is ``SMs * programs_per_sm`` programs (each
        writes one fp32 ``[D]`` partial of B); 0: as many as fit on an SM at once. The forward
        launches one program per tile.
    bwd_rows, bwd_warps: the same for the backward; 0 takes the forward's value.
    """

    rows: int = 1
    warps: int = 8
    programs_per_sm: int = 0
    bwd_rows: int = 0
    bwd_warps: int = 0

    def validate(self) -> None:
        for name, value, lo, hi in (("rows", self.rows, 1, 64), ("warps", self.warps, 1, 16),
                                    ("bwd_rows", self.bwd_rows, 0, 64), ("bwd_warps", self.bwd_warps, 0, 16)):
            if value < lo or value > hi or value & (value - 1):
                what = "0 (as the forward) or a power of two" if lo == 0 else "a power of two"
                raise ValueError(f"LaunchConfig.{name}={value} is not allowed: expected {what} in {max(lo, 1)}..{hi}")
        if self.programs_per_sm < 0:
            raise ValueError(f"LaunchConfig.programs_per_sm={self.programs_per_sm} is not allowed: expected >= 0")

    @property
    def bwd(self) -> tuple[int, int]:
        """(rows, warps) of the backward."""
        return self.bwd_rows or self.rows, self.bwd_warps or self.warps


# Measured launches per width (kernels/bench_attnres.py --sweep-only on the H200, L = 4, 7, 13, 25 with an fp32
# source 0 and gradient slots as in gpu-small; kernels/results/attnres_sweep_h200.json); other widths take the
# rule in ``launch_config``.
LAUNCH_TABLE: Mapping[int, LaunchConfig] = MappingProxyType({
    512: LaunchConfig(rows=4, warps=4, programs_per_sm=4, bwd_rows=4, bwd_warps=4),
})


def _pow2(n: int) -> int:
    """Next power of two (plain Python: ``triton.next_power_of_2`` is a constexpr function now,
    about 3 us a call from host code, and the old wrapper made five calls per read)."""
    return 1 << (n - 1).bit_length()


@functools.cache
def launch_config(d: int) -> LaunchConfig:
    """Default launch for width ``d``: ``LAUNCH_TABLE[d]`` when measured, else tiles of at least 2048
    elements (several rows when d is small) at 8 elements per thread (one 16-byte load of bf16), at
    most 16 warps."""
    if d in LAUNCH_TABLE:
        LAUNCH_TABLE[d].validate()
        return LAUNCH_TABLE[d]
    bd = _pow2(d)
    rows = max(1, 2048 // bd)
    return LaunchConfig(rows=rows, warps=min(16, max(1, rows * bd // 256)))


# Read once: Triton decides at each @triton.jit below whether the kernels run in its CPU interpreter, so
# the flag cannot change later (and an environment lookup per call is host time on the model's hot path).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile(blk, N, D, cols, BN: tl.constexpr):
    """Rows, row mask, element offsets and mask of the ``[BN, BD]`` tile ``blk``."""
    rows = blk * BN + tl.arange(0, BN)
    rm = rows < N
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    return rows, rm, offs, rm[:, None] & (cols < D)[None, :]


@triton.jit
def _attnres_fwd_kernel(srcs, q, w, h, stats, N, D, eps, L: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """One ``[BN, D]`` tile of h; writes ``stats [2L + 1, N]`` (fp32: r, s ``[L, N]`` and lse ``[N]``)
    for the backward.

    Per-source statistics go straight to memory as they come: holding them in ``[BN, L]``
    registers costs a layout conversion per source and spills at large L. The next source's load
    is issued before this one's row sums, so its latency hides behind their barriers."""
    r, s, lse = stats, stats + L * N, stats + 2 * L * N
    cols = tl.arange(0, BD)
    cm = cols < D
    gq = tl.load(q + cols, mask=cm, other=0.0).to(tl.float32) * tl.load(w + cols, mask=cm, other=0.0).to(tl.float32)
    rows, rm, offs, mask = _tile(tl.program_id(0), N, D, cols, BN)
    m = tl.full([BN], float("-inf"), tl.float32)
    den = tl.zeros([BN], tl.float32)
    acc = tl.zeros([BN, BD], tl.float32)
    nxt = tl.load(srcs[0] + offs, mask=mask, other=0.0)
    for i in tl.static_range(L):
        v = nxt.to(tl.float32)
        if i + 1 < L:
            nxt = tl.load(srcs[i + 1] + offs, mask=mask, other=0.0)
        ri = tl.rsqrt(tl.sum(v * v, axis=1) / D + eps)
        si = tl.sum(v * gq[None, :], axis=1) * ri
        tl.store(r + i * N + rows, ri, mask=rm)
        tl.store(s + i * N + rows, si, mask=rm)
        # online softmax: each source is read once; rescale what was summed when the max moves
        m_new = tl.maximum(m, si)
        alpha = tl.exp(m - m_new)
        e = tl.exp(si - m_new)
        acc = acc * alpha[:, None] + e[:, None] * v
        den = den * alpha + e
        m = m_new
    tl.store(h + offs, (acc / den[:, None]).to(h.dtype.element_ty), mask=mask)
    tl.store(lse + rows, m + tl.log(den), mask=rm)


@triton.jit
def _attnres_bwd_kernel(srcs, dsrcs, q, w, h, dh, stats, part, N, D, NPROG,
                        L: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, C_FROM_H: tl.constexpr,
                        ACC: tl.constexpr):
    """dv_i for the tiles ``pid, pid + NPROG, ...`` and this program's partials of dq = g * B and
    dw = q * B (``part [NPROG, 2, D]``; their sum over the programs is the two gradients).

    ``c = sum_j p_j dp_j``: with C_FROM_H (an fp32 h) it is ``<dh, h>`` and each source is read once;
    otherwise a first pass over the sources sums it (h is not even saved then). Bit i of ACC: add
    dv_i to what ``dsrcs[i]`` holds (a gradient slot's running sum) instead of overwriting it.
    B is summed over the rows of a ``[BN, BD]`` register tile and reduced across rows once per
    program (a reduction per source and tile costs a barrier each); the loads of source i + 1 (and of
    its slot) are issued before source i's row sums, as in the forward."""
    r, s, lse = stats, stats + L * N, stats + 2 * L * N
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    cm = cols < D
    qv = tl.load(q + cols, mask=cm, other=0.0).to(tl.float32)
    wv = tl.load(w + cols, mask=cm, other=0.0).to(tl.float32)
    gq = qv * wv
    b_acc = tl.zeros([BN, BD], tl.float32)
    for blk in range(pid, tl.cdiv(N, BN), NPROG):
        rows, rm, offs, mask = _tile(blk, N, D, cols, BN)
        nxt = tl.load(srcs[0] + offs, mask=mask, other=0.0)
        if ACC & 1:
            nxt_d = tl.load(dsrcs[0] + offs, mask=mask, other=0.0)
        g = tl.load(dh + offs, mask=mask, other=0.0).to(tl.float32)
        lse_r = tl.load(lse + rows, mask=rm, other=0.0)
        if C_FROM_H:
            c = tl.sum(g * tl.load(h + offs, mask=mask, other=0.0), axis=1)
        else:
            c = tl.zeros([BN], tl.float32)
            for i in tl.static_range(L):
                v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
                c += tl.exp(tl.load(s + i * N + rows, mask=rm, other=0.0) - lse_r) * tl.sum(v * g, axis=1)
        for i in tl.static_range(L):
            v = nxt.to(tl.float32)
            if (ACC >> i) & 1:
                prev = nxt_d.to(tl.float32)
            if i + 1 < L:
                nxt = tl.load(srcs[i + 1] + offs, mask=mask, other=0.0)
                if (ACC >> (i + 1)) & 1:
                    nxt_d = tl.load(dsrcs[i + 1] + offs, mask=mask, other=0.0)
            si = tl.load(s + i * N + rows, mask=rm, other=0.0)
            ri = tl.load(r + i * N + rows, mask=rm, other=0.0)
            pi = tl.exp(si - lse_r)
            a = pi * (tl.sum(v * g, axis=1) - c) * ri  # ds_i r_i: the weight of g * q in dv_i and of v_i in B
            dv = pi[:, None] * g + a[:, None] * gq[None, :] - (a * si * ri / D)[:, None] * v
            if (ACC >> i) & 1:
                dv += prev
            tl.store(dsrcs[i] + offs, dv.to(dsrcs[i].dtype.element_ty), mask=mask)
            b_acc += a[:, None] * v
    b = tl.sum(b_acc, axis=0)
    dq_part = part + pid.to(tl.int64) * 2 * D
    tl.store(dq_part + cols, b * wv, mask=cm)
    tl.store(dq_part + D + cols, b * qv, mask=cm)


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
    """

    __slots__ = ("grad", "taken")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.taken = False


class _DepthAttentionFn(torch.autograd.Function):
    """Inputs: query, norm_weight ``[D]``, then either one stacked ``[L, N, D]`` tensor
    (``stacked=True``; its gradient is one ``[L, N, D]`` buffer) or L tensors ``[N, D]``, each with
    an optional :class:`GradSlot` (``slots``, None: a fresh gradient per source).

    Host time matters here (a model calls this about twice per sublayer and step, and its step is
    launch-bound): one Triton launch per direction; forward two allocations (h, the row statistics),
    backward two plus one sum that gives dq and dw at once; no per-source work beyond the tuples the
    kernels take and the slots' bookkeeping."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, out_dtype, stacked, cfg, want_p, slots, *inputs):
        srcs = tuple(inputs[0].unbind(0)) if stacked else inputs
        x0 = srcs[0]
        D = x0.shape[-1]
        N, L = x0.numel() // D, len(srcs)
        h = torch.empty(x0.shape, device=x0.device, dtype=out_dtype)  # list form: the sources' [..., D]
        stats = torch.empty(2 * L + 1, N, device=x0.device, dtype=torch.float32)
        _attnres_fwd_kernel[(-(-N // cfg.rows),)](
            srcs, query, norm_weight, h, stats, N, D, eps,
            L=L, BN=cfg.rows, BD=_pow2(D), num_warps=cfg.warps)
        ctx.save_for_backward(query, norm_weight, h if out_dtype == torch.float32 else None, stats, *inputs)
        ctx.stacked, ctx.cfg, ctx.slots = stacked, cfg, slots
        if slots is not None:
            owner = 0  # bit i: this read took slot i first
            for i, sl in enumerate(slots):
                if not sl.taken:
                    owner |= 1 << i
                    sl.taken = True
            ctx.owner = owner
        if not want_p:
            return h, None
        p = torch.exp(stats[L:2 * L] - stats[2 * L])
        ctx.mark_non_differentiable(p)
        return h, p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh, _dp):
        query, norm_weight, h, stats, *inputs = ctx.saved_tensors
        cfg, slots = ctx.cfg, ctx.slots
        acc = 0
        if ctx.stacked:
            dstack = torch.empty_like(inputs[0])
            srcs, dsrcs = tuple(inputs[0].unbind(0)), tuple(dstack.unbind(0))
        elif slots is None:
            srcs, dsrcs = tuple(inputs), tuple(torch.empty_like(x) for x in inputs)
        else:  # the owner of a slot hands its sum to autograd and empties it; the others leave it there
            srcs, dsrcs, grads, owner = tuple(inputs), [], [], ctx.owner
            for i, (x, sl) in enumerate(zip(srcs, slots)):
                d = sl.grad
                if d is None:
                    d = torch.empty_like(x)
                else:
                    acc |= 1 << i
                own = (owner >> i) & 1
                sl.grad = None if own else d
                grads.append(d if own else None)
                dsrcs.append(d)
            dsrcs = tuple(dsrcs)
        x0 = srcs[0]
        D = x0.shape[-1]
        N, L = x0.numel() // D, len(srcs)
        rows, warps = cfg.bwd
        if not dh.is_contiguous():
            dh = dh.contiguous()
        # the grid is sized by the kernel's registers only when programs_per_sm is 0 (see _bwd_programs)
        key = None if cfg.programs_per_sm or _INTERPRET else (
            dh.device.index, cfg, L, h is not None, acc, tuple([x.dtype for x in srcs]), dh.dtype)
        nprog = _bwd_programs(-(-N // rows), dh.device, cfg, key)
        part = torch.empty(nprog, 2, D, device=dh.device, dtype=torch.float32)
        kernel = _attnres_bwd_kernel[(nprog,)](
            srcs, dsrcs, query, norm_weight, dh if h is None else h, dh, stats, part, N, D, nprog,
            L=L, BN=rows, BD=_pow2(D), C_FROM_H=h is not None, ACC=acc, num_warps=warps)
        if key is not None and key not in _RESIDENT:
            _note_resident(key, kernel, dh.device, warps)
        dq, dw = part.sum(0).unbind(0)
        if dq.dtype != query.dtype:
            dq = dq.to(query.dtype)
        if dw.dtype != norm_weight.dtype:
            dw = dw.to(norm_weight.dtype)
        if ctx.stacked:
            return dq, dw, None, None, None, None, None, None, dstack
        return dq, dw, None, None, None, None, None, None, *(dsrcs if slots is None else grads)


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
    host beyond the tuples the kernels take. Full AttnRes reads source i in every later read: a
    check per source and read would be O(L^2) Python per step.

    Attributes:
        tensors: the sources ``[..., D]`` (tuple, in order).
        slots: one GradSlot per source (a source added again, or put in place of the last one, gets a
            fresh slot).
        dtype: the promoted dtype of the sources (h's dtype).
    """

    __slots__ = ("tensors", "slots", "dtype")

    def __init__(self, first: torch.Tensor) -> None:
        _check_sources((first,))
        self.tensors: tuple[torch.Tensor, ...] = (first.contiguous(),)
        self.slots: tuple[GradSlot, ...] = (GradSlot(),)
        self.dtype: torch.dtype = first.dtype

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tensors[i]

    def _checked(self, x: torch.Tensor, i: int) -> torch.Tensor:
        x0 = self.tensors[0]
        _check_source(i, x, x0.shape, x0.device)
        return x if x.is_contiguous() else x.contiguous()

    def append(self, x: torch.Tensor) -> None:
        """Add source ``x`` ``[..., D]`` (the first source's shape and device)."""
        self.tensors += (self._checked(x, len(self.tensors)),)
        self.slots += (GradSlot(),)
        self.dtype = _promote(self.dtype, x.dtype)

    def replace_last(self, x: torch.Tensor) -> None:
        """Put ``x`` in place of the last source (the running sum of a block that is still open)."""
        old = self.tensors[-1]
        self.tensors = self.tensors[:-1] + (self._checked(x, len(self.tensors) - 1),)
        self.slots = self.slots[:-1] + (GradSlot(),)
        if x.dtype != old.dtype:
            self.dtype = functools.reduce(_promote, (t.dtype for t in self.tensors))


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
        config: Triton launch parameters; None takes ``launch_config(D)``.
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
        seq, slots, out_dtype = sources.tensors, sources.slots, sources.dtype
    else:
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
    if config is None:
        config = launch_config(D)
    else:
        config.validate()
    if stacked:
        inputs = (sources.reshape(len(seq), -1, D).contiguous(),)
    elif isinstance(sources, Sources) or all(x.is_contiguous() for x in seq):
        inputs = seq  # the kernels index rows of D elements: any contiguous [..., D] goes in as it is
    else:
        inputs = tuple(x.contiguous() for x in seq)
    if not query.is_contiguous():
        query = query.contiguous()
    if not norm_weight.is_contiguous():
        norm_weight = norm_weight.contiguous()
    h, p = _DepthAttentionFn.apply(query, norm_weight, float(eps), out_dtype, stacked, config, weights, slots,
                                   *inputs)
    if stacked:
        h = h.view(lead + (D,))
    return h, (p.view((len(seq),) + lead) if weights else None)
