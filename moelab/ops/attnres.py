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

import os
from collections.abc import Sequence
from dataclasses import dataclass

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

    rows: tokens per program tile (a power of two); each tile is ``[rows, next_pow2(D)]``.
    warps: warps per program.
    programs_per_sm: the backward's persistent grid is ``SMs * programs_per_sm`` programs (each
        writes one fp32 ``[D]`` partial of B); 0: as many as fit on an SM at once. The forward
        launches one program per tile.
    """

    rows: int = 1
    warps: int = 8
    programs_per_sm: int = 0

    def validate(self) -> None:
        for name, value, hi in (("rows", self.rows, 64), ("warps", self.warps, 16)):
            if value < 1 or value > hi or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name}={value} is not allowed: expected a power of two in 1..{hi}")
        if self.programs_per_sm < 0:
            raise ValueError(f"LaunchConfig.programs_per_sm={self.programs_per_sm} is not allowed: expected >= 0")


def launch_config(d: int) -> LaunchConfig:
    """Default launch for width ``d``: tiles of at least 2048 elements (several rows when d is
    small) at 8 elements per thread (one 16-byte load of bf16), at most 16 warps."""
    bd = triton.next_power_of_2(d)
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
def _attnres_fwd_kernel(srcs, q, w, h, r, s, lse, N, D, eps, L: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    """One ``[BN, D]`` tile of h; writes r, s ``[L, N]`` and lse ``[N]`` (fp32) for the backward.

    Per-source statistics go straight to memory as they come: holding them in ``[BN, L]``
    registers costs a layout conversion per source and spills at large L."""
    cols = tl.arange(0, BD)
    cm = cols < D
    gq = tl.load(q + cols, mask=cm, other=0.0).to(tl.float32) * tl.load(w + cols, mask=cm, other=0.0).to(tl.float32)
    rows, rm, offs, mask = _tile(tl.program_id(0), N, D, cols, BN)
    m = tl.full([BN], float("-inf"), tl.float32)
    den = tl.zeros([BN], tl.float32)
    acc = tl.zeros([BN, BD], tl.float32)
    for i in tl.static_range(L):
        v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
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
def _attnres_bwd_kernel(srcs, dsrcs, q, w, h, dh, r, s, lse, part, N, D, NPROG,
                        L: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, C_FROM_H: tl.constexpr,
                        ACC: tl.constexpr):
    """dv_i for the tiles ``pid, pid + NPROG, ...`` and this program's partial of B (``part [NPROG, D]``).

    ``c = sum_j p_j dp_j``: with C_FROM_H (an fp32 h) it is ``<dh, h>`` and each source is read once;
    otherwise a first pass over the sources sums it (h is not even saved then). Bit i of ACC: add
    dv_i to what ``dsrcs[i]`` holds (a gradient slot's running sum) instead of overwriting it."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    cm = cols < D
    gq = tl.load(q + cols, mask=cm, other=0.0).to(tl.float32) * tl.load(w + cols, mask=cm, other=0.0).to(tl.float32)
    b_acc = tl.zeros([BD], tl.float32)
    for blk in range(pid, tl.cdiv(N, BN), NPROG):
        rows, rm, offs, mask = _tile(blk, N, D, cols, BN)
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
            v = tl.load(srcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            si = tl.load(s + i * N + rows, mask=rm, other=0.0)
            ri = tl.load(r + i * N + rows, mask=rm, other=0.0)
            pi = tl.exp(si - lse_r)
            a = pi * (tl.sum(v * g, axis=1) - c) * ri  # ds_i r_i: the weight of g * q in dv_i and of v_i in B
            dv = pi[:, None] * g + a[:, None] * gq[None, :] - (a * si * ri / D)[:, None] * v
            if (ACC >> i) & 1:
                dv += tl.load(dsrcs[i] + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dsrcs[i] + offs, dv.to(dsrcs[i].dtype.element_ty), mask=mask)
            b_acc += tl.sum(a[:, None] * v, axis=0)
    tl.store(part + pid.to(tl.int64) * D + cols, b_acc, mask=cm)


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
    an optional :class:`GradSlot` (``slots``, None: a fresh gradient per source)."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, out_dtype, stacked, cfg, want_p, slots, *inputs):
        srcs = tuple(inputs[0].unbind(0)) if stacked else inputs
        D = srcs[0].shape[-1]
        N, L = srcs[0].numel() // D, len(srcs)
        dev = srcs[0].device
        h = torch.empty(N, D, device=dev, dtype=out_dtype)
        stats = torch.empty(2 * L + 1, N, device=dev, dtype=torch.float32)
        r, s, lse = stats[:L], stats[L:2 * L], stats[2 * L]
        _attnres_fwd_kernel[(triton.cdiv(N, cfg.rows),)](
            srcs, query, norm_weight, h, r, s, lse, N, D, eps,
            L=L, BN=cfg.rows, BD=triton.next_power_of_2(D), num_warps=cfg.warps)
        ctx.save_for_backward(query, norm_weight, h if out_dtype == torch.float32 else None, stats, *inputs)
        ctx.stacked, ctx.cfg = stacked, cfg
        ctx.slots = slots or (None,) * L
        ctx.owner = tuple(sl is not None and not sl.taken for sl in ctx.slots)
        for sl in ctx.slots:
            if sl is not None:
                sl.taken = True
        if not want_p:
            return h, None
        p = torch.exp(s - lse)
        ctx.mark_non_differentiable(p)
        return h, p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh, _dp):
        query, norm_weight, h, stats, *inputs = ctx.saved_tensors
        cfg = ctx.cfg
        acc = 0
        if ctx.stacked:
            dstack = torch.empty_like(inputs[0])
            srcs, dsrcs = tuple(inputs[0].unbind(0)), tuple(dstack.unbind(0))
        else:
            srcs, dsrcs = tuple(inputs), []
            for i, (x, sl) in enumerate(zip(srcs, ctx.slots)):
                if sl is None:
                    dsrcs.append(torch.empty_like(x))
                elif sl.grad is None:
                    sl.grad = torch.empty_like(x)
                    dsrcs.append(sl.grad)
                else:
                    acc |= 1 << i
                    dsrcs.append(sl.grad)
            dsrcs = tuple(dsrcs)
        D = srcs[0].shape[-1]
        N, L = srcs[0].numel() // D, len(srcs)
        consts = dict(L=L, BN=cfg.rows, BD=triton.next_power_of_2(D), C_FROM_H=h is not None, ACC=acc)
        dh = dh.contiguous()
        key = (dh.device.index, cfg, tuple(consts.items()), tuple(x.dtype for x in srcs), dh.dtype)
        nprog = _bwd_programs(triton.cdiv(N, cfg.rows), dh.device, cfg, key)
        part = torch.empty(nprog, D, device=dh.device, dtype=torch.float32)
        kernel = _attnres_bwd_kernel[(nprog,)](
            srcs, dsrcs, query, norm_weight, dh if h is None else h, dh, stats[:L], stats[L:2 * L], stats[2 * L],
            part, N, D, nprog, num_warps=cfg.warps, **consts)
        if not (cfg.programs_per_sm or _interpret() or key in _RESIDENT):
            _note_resident(key, kernel, dh.device, cfg.warps)
        b = part.sum(0)
        dq = (b * norm_weight.float()).to(query.dtype)
        dw = (b * query.float()).to(norm_weight.dtype)
        if ctx.stacked:
            grads = (dstack,)
        else:
            grads = []
            for d, sl, own in zip(dsrcs, ctx.slots, ctx.owner):
                if sl is not None and own:
                    sl.grad = None
                grads.append(d if sl is None or own else None)
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


def _out_dtype(sources: Sequence[torch.Tensor]) -> torch.dtype:
    """The promoted dtype of the sources (what ``torch.stack`` gives), with or without autocast."""
    dt = sources[0].dtype
    for x in sources[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return dt


def _check(sources: Sequence[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor, eps: float,
           backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed: expected one of {BACKENDS}")
    if len(sources) == 0:
        raise ValueError("sources is empty: expected at least one source")
    shape, dev = sources[0].shape, sources[0].device
    if len(shape) == 0:
        raise ValueError("sources must be [..., D] tensors, got a 0-d tensor")
    for i, x in enumerate(sources):
        if x.shape != shape:
            raise ValueError(f"sources[{i}] has shape {tuple(x.shape)}, expected {tuple(shape)} (as sources[0])")
        if x.device != dev:
            raise ValueError(f"sources[{i}] is on {x.device}, expected {dev} (as sources[0])")
        if x.dtype not in DTYPES:
            raise ValueError(f"sources[{i}] dtype {x.dtype} is not allowed: expected bf16, fp16 or fp32")
    D = shape[-1]
    for name, t in (("query", query), ("norm_weight", norm_weight)):
        if t.shape != (D,):
            raise ValueError(f"{name} must be [D] with D = {D}, got shape {tuple(t.shape)}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, expected {dev} (as the sources)")
    if not eps > 0:
        raise ValueError(f"eps={eps!r} is not allowed: expected a positive number")


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
    _check(seq, query, norm_weight, eps, backend)
    out_dtype = _out_dtype(seq)
    if backend == "auto":
        backend = "triton" if seq[0].is_cuda else "torch"
    if slots is not None and (stacked or len(slots) != len(seq)):
        raise ValueError(f"slots: expected one GradSlot per source in list form ({len(seq)}), got "
                         f"{len(slots)} for {'a stacked tensor' if stacked else 'a list'}")
    if backend == "torch":
        h, p = depth_attention_torch(seq, query, norm_weight, eps, out_dtype)
        return h, (p if weights else None)
    if not (seq[0].is_cuda or _interpret()):
        raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got {seq[0].device}")
    lead, D = seq[0].shape[:-1], seq[0].shape[-1]
    if D > MAX_D:
        raise ValueError(f"D={D} is not allowed with backend='triton': expected 1..{MAX_D} (use backend='torch')")
    cfg = config or launch_config(D)
    cfg.validate()
    if stacked:
        inputs = (sources.reshape(len(seq), -1, D).contiguous(),)
    else:  # the kernels index rows of D elements, so any contiguous [..., D] source goes in as it is
        inputs = tuple(x if x.is_contiguous() else x.contiguous() for x in seq)
    h, p = _DepthAttentionFn.apply(query.contiguous(), norm_weight.contiguous(), float(eps), out_dtype, stacked,
                                   cfg, weights, None if slots is None else tuple(slots), *inputs)
    return h.view(*lead, D), (p.view(len(seq), *lead) if weights else None)
