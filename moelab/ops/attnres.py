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
every ``dv_i`` in its source's dtype; the row sums of B go into per-program fp32 partials
(summed in torch, so the result is deterministic). fp32 math throughout.

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
that saw the source first hands the sum to autograd (see ``GradSlot``).

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


# Measured launches per width (kernels/bench_attnres.py --sweep on the H200); other widths take the rule
# in ``launch_config``.
LAUNCH_TABLE: Mapping[int, LaunchConfig] = MappingProxyType({})


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


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    """dv_i for the tiles ``pid, pid + NPROG, ...`` and this program's partial of B (``part [NPROG, D]``).

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
    gq = tl.load(q + cols, mask=cm, other=0.0).to(tl.float32) * tl.load(w + cols, mask=cm, other=0.0).to(tl.float32)
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
    tl.store(part + pid.to(tl.int64) * D + cols, tl.sum(b_acc, axis=0), mask=cm)


_RESIDENT: dict[tuple, int] = {}  # backward launch signature -> its programs that fit on one SM at once
_SMS: dict[int, int] = {}  # device index -> multiprocessor count (a driver query, asked once)


def _bwd_programs(n_tiles: int, device: torch.device, cfg: LaunchConfig, key: tuple) -> int:
    """Persistent grid of the backward: ``SMs * programs_per_sm``; with programs_per_sm = 0 as
    many programs as are resident at once, so that the grid is one wave and every program walks
    the same number of tiles (one per SM until the first launch of ``key`` has told its registers)."""
    if _interpret():
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
    launch-bound): one Triton launch per direction plus three small torch ops for dq, dw; no
    per-source work beyond the tuples the kernels take and the slots' bookkeeping."""

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
            ctx.owner = tuple(not sl.taken for sl in slots)
            for sl in slots:
                sl.taken = True
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
        else:
            srcs, dsrcs = tuple(inputs), []
            for i, (x, sl) in enumerate(zip(srcs, slots)):
                if sl.grad is None:
                    sl.grad = torch.empty_like(x)
                else:
                    acc |= 1 << i
                dsrcs.append(sl.grad)
            dsrcs = tuple(dsrcs)
        x0 = srcs[0]
        D = x0.shape[-1]
        N, L = x0.numel() // D, len(srcs)
        rows, warps = cfg.bwd
        if not dh.is_contiguous():
            dh = dh.contiguous()
        key = (dh.device.index, cfg, L, h is not None, acc, tuple(x.dtype for x in srcs), dh.dtype)
        nprog = _bwd_programs(-(-N // rows), dh.device, cfg, key)
        part = torch.empty(nprog, D, device=dh.device, dtype=torch.float32)
        kernel = _attnres_bwd_kernel[(nprog,)](
            srcs, dsrcs, query, norm_weight, dh if h is None else h, dh, stats, part, N, D, nprog,
            L=L, BN=rows, BD=_pow2(D), C_FROM_H=h is not None, ACC=acc, num_warps=warps)
        if not (cfg.programs_per_sm or key in _RESIDENT or _interpret()):
            _note_resident(key, kernel, dh.device, warps)
        b = part.sum(0)
        dq = (b * norm_weight).to(query.dtype)
        dw = (b * query).to(norm_weight.dtype)
        if ctx.stacked:
            return dq, dw, None, None, None, None, None, None, dstack
        if slots is None:
            return dq, dw, None, None, None, None, None, None, *dsrcs
        grads = []
        for d, sl, own in zip(dsrcs, slots, ctx.owner):
            if own:
                sl.grad = None
            grads.append(d if own else None)
        return dq, dw, None, None, None, None, None, None, *grads


def depth_attention_torch(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor,
                          eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference, fp32 math (autocast or not): ``sources`` L tensors ``[..., D]`` -> ``h [..., D]``
    (out_dtype), ``p [L, ...]`` fp32."""
    with torch.autocast(sources[0].device.type, enabled=False):
        v = torch.stack([x.float() for x in sources])
        keys = F.rms_norm(v, (v.shape[-1],), norm_weight.float(), eps)
        p = (keys @ query.float()).softmax(dim=0)
        return torch.einsum("l...,l...d->...d", p, v).to(out_dtype), p


def _check(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float,
           backend: str) -> torch.dtype:
    """Validate the arguments (one cheap test per source: a model calls this ~50 times a step) and
    return the promoted dtype of the sources (what ``torch.stack`` gives), with or without autocast."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed: expected one of {BACKENDS}")
    if len(sources) == 0:
        raise ValueError("sources is empty: expected at least one source")
    shape, dev = sources[0].shape, sources[0].device
    if len(shape) == 0:
        raise ValueError("sources must be [..., D] tensors, got a 0-d tensor")
    dtypes = set()
    for i, x in enumerate(sources):
        dt = x.dtype
        if x.shape != shape or x.device != dev or dt not in DTYPES:
            if x.shape != shape:
                raise ValueError(f"sources[{i}] has shape {tuple(x.shape)}, expected {tuple(shape)} (as sources[0])")
            if x.device != dev:
                raise ValueError(f"sources[{i}] is on {x.device}, expected {dev} (as sources[0])")
            raise ValueError(f"sources[{i}] dtype {dt} is not allowed: expected bf16, fp16 or fp32")
        dtypes.add(dt)
    D = shape[-1]
    for name, t in (("query", query), ("norm_weight", norm_weight)):
        if t.shape != (D,):
            raise ValueError(f"{name} must be [D] with D = {D}, got shape {tuple(t.shape)}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, expected {dev} (as the sources)")
    if not eps > 0:
        raise ValueError(f"eps={eps!r} is not allowed: expected a positive number")
    out = dtypes.pop()
    for dt in dtypes:
        out = torch.promote_types(out, dt)
    return out


@torch.compiler.disable  # a compiled model calls the op eagerly (its kernels launch themselves)
def depth_attention(sources: torch.Tensor | Sequence[torch.Tensor], query: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float = 1e-6, backend: str = "auto",
                    config: LaunchConfig | None = None, weights: bool = True,
                    slots: Sequence[GradSlot] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax over depth with one pseudo-query and an RMSNorm on the keys (see the module docstring).

    Args:
        sources: L tensors ``[..., D]`` of one shape (bf16 / fp16 / fp32, dtypes may differ), or
            one stacked tensor ``[L, ..., D]``. A list is the fast form for a model: nothing is
            stacked, and each gradient comes back in its source's dtype.
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
            this relies on). Ignored by the torch backend (autograd sums there).

    Returns:
        ``h [..., D]`` in the promoted dtype of the sources (autocast or not: with the model's
        fp32 embedding among the sources that is fp32, the dtype of prenorm's running sum, and the
        next RMSNorm then keeps this very tensor instead of an fp32 copy); the depth weights
        ``p [L, ...]`` fp32 (no gradient), or None with ``weights=False``. Gradients flow to every
        source, query and norm_weight.
    """
    stacked = isinstance(sources, torch.Tensor)
    if stacked and sources.dim() < 2:
        raise ValueError(f"stacked sources must be [L, ..., D], got shape {tuple(sources.shape)}")
    seq = tuple(sources.unbind(0)) if stacked else tuple(sources)
    out_dtype = _check(seq, query, norm_weight, eps, backend)
    x0 = seq[0]
    if backend == "auto":
        backend = "triton" if x0.is_cuda else "torch"
    if slots is not None:
        if stacked or len(slots) != len(seq):
            raise ValueError(f"slots: expected one GradSlot per source in list form ({len(seq)}), got "
                             f"{len(slots)} for {'a stacked tensor' if stacked else 'a list'}")
        slots = tuple(slots)
        if len(set(map(id, slots))) != len(slots):  # the backward prefetches slot i + 1 before it writes slot i
            raise ValueError("slots: expected a distinct GradSlot per source, got one GradSlot twice")
    if backend == "torch":
        h, p = depth_attention_torch(seq, query, norm_weight, eps, out_dtype)
        return h, (p if weights else None)
    if not (x0.is_cuda or _interpret()):
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {x0.device}")
    lead, D = x0.shape[:-1], x0.shape[-1]
    if D > MAX_D:
        raise ValueError(f"D={D} is not allowed with backend='triton': expected 1..{MAX_D} (use backend='torch')")
    if config is None:
        config = launch_config(D)
    else:
        config.validate()
    if stacked:
        inputs = (sources.reshape(len(seq), -1, D).contiguous(),)
    elif all(x.is_contiguous() for x in seq):  # the kernels index rows of D elements: any contiguous [..., D]
        inputs = seq
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
