"""RMSNorm over the last dim in one Triton pass each way, fp32 math, the input's dtype out.

    y = x * rsqrt(mean(x^2) + eps) * w                       per row of ``x [..., D]``, ``w [D]`` (or none)
    y = x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate)       with an output gate ``gate [..., D]`` (KDA's output)

``moelab.model.norm.RMSNorm`` with ``backend="torch"`` computes ``F.rms_norm(x.float(), w.float()).to(x.dtype)``:
a cast of x up, the norm, a cast back, and in the backward torch's generic layer-norm gradient kernels (the
weight's gradient through a column reduction that took 3.6 ms of a 120 ms k3-mini step on the H200,
kernels/results/model_profile_h200.json). Here the forward reads x once and writes y once (and one fp32 rstd per
row); the backward reads x and dy once and writes dx, with the weight's gradient as per-program partial sums
(summed in torch, so the result is deterministic). The same math as the torch path; the sums run in another
order, so results agree to fp32 rounding, not bit for bit.

The gated form is KDA's output norm and gate, ``sigmoid(W_g x) * RMSNorm(o)`` per head: on the torch path a cast up,
the norm, a cast back, the sigmoid and the product, each a kernel (and about as many again backward), storing the
normed output and the sigmoid for the backward; here one pass each way that reads o and the gate and writes y
(backward: dx and dgate), the product formed in fp32 and rounded once.
"""

from __future__ import annotations

import torch

from moelab.ops.backend import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

# A program's tile holds at least TILE elements (several rows when D is small), 16 per thread; the backward runs on
# at most PROGRAMS programs, each looping over row tiles, so the weight's partial sums stay small.
TILE = 2048
PROGRAMS = 1056  # 8 per SM of an H100 / H200


def _layout(d: int) -> tuple[int, int, int]:
    """(BD, ROWS, warps): the padded width, rows per tile and warps of a launch over rows of width ``d``."""
    bd = triton.next_power_of_2(d)
    rows = max(1, TILE // bd)
    return bd, rows, max(1, min(16, rows * bd // (32 * 16)))


if HAS_TRITON:

    @triton.jit
    def _rms_fwd_kernel(x, w, gate, y, rstd, N, D, eps, HAS_W: tl.constexpr, GATED: tl.constexpr, BD: tl.constexpr,
                        ROWS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BD)
        m = (r < N)[:, None] & (c < D)[None, :]
        p = r.to(tl.int64)[:, None] * D + c[None, :]
        xv = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
        s = (1.0 / tl.sqrt(tl.sum(xv * xv, axis=1) / D + eps)).to(tl.float32)
        out = xv * s[:, None]
        if HAS_W:
            out = out * tl.load(w + c, mask=c < D, other=0.0).to(tl.float32)[None, :]
        if GATED:
            out = out * tl.sigmoid(tl.load(gate + p, mask=m, other=0.0).to(tl.float32))
        tl.store(y + p, out.to(y.dtype.element_ty), mask=m)
        tl.store(rstd + r, s, mask=r < N)

    @triton.jit
    def _rms_bwd_kernel(x, w, gate, dy, rstd, dx, dw, dgate, N, D, HAS_W: tl.constexpr, GATED: tl.constexpr,
                        BD: tl.constexpr, ROWS: tl.constexpr):
        """dx = rstd (dy w - xhat mean(dy w xhat)) per row; this program's partial of dw = sum_rows dy xhat. Gated:
        dy there is dy sigmoid(gate), and dgate = dy xhat w sigmoid(gate) (1 - sigmoid(gate))."""
        pid = tl.program_id(0)
        c = tl.arange(0, BD)
        cm = c < D
        if HAS_W:
            wv = tl.load(w + c, mask=cm, other=0.0).to(tl.float32)
        else:
            wv = tl.full([BD], 1.0, tl.float32)
        acc = tl.zeros([BD], dtype=tl.float32)
        for tile in range(pid, tl.cdiv(N, ROWS), tl.num_programs(0)):
            r = tile * ROWS + tl.arange(0, ROWS)
            m = (r < N)[:, None] & cm[None, :]
            p = r.to(tl.int64)[:, None] * D + c[None, :]
            s = tl.load(rstd + r, mask=r < N, other=0.0)
            xh = tl.load(x + p, mask=m, other=0.0).to(tl.float32) * s[:, None]
            g = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
            if GATED:
                sg = tl.sigmoid(tl.load(gate + p, mask=m, other=0.0).to(tl.float32))
                tl.store(dgate + p, (g * xh * wv[None, :] * sg * (1.0 - sg)).to(dgate.dtype.element_ty), mask=m)
                g = g * sg
            gw = g * wv[None, :]
            mean = tl.sum(gw * xh, axis=1) / D
            tl.store(dx + p, (s[:, None] * (gw - xh * mean[:, None])).to(dx.dtype.element_ty), mask=m)
            acc += tl.sum(g * xh, axis=0)
        if HAS_W:
            tl.store(dw + pid * D + c, acc, mask=cm)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                gate: torch.Tensor | None) -> torch.Tensor:
        d = x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()
        g2 = gate.reshape(-1, d).contiguous() if gate is not None else None
        n = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(n, device=x.device, dtype=torch.float32)
        bd, rows, warps = _layout(d)
        w = weight.contiguous() if weight is not None else x2
        if n:
            _rms_fwd_kernel[(triton.cdiv(n, rows),)](x2, w, g2 if g2 is not None else x2, y, rstd, n, d, eps,
                                                     HAS_W=weight is not None, GATED=g2 is not None, BD=bd,
                                                     ROWS=rows, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd, g2)
        ctx.shape, ctx.gate_shape = x.shape, (gate.shape if gate is not None else None)
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd, g2 = ctx.saved_tensors
        n, d = x2.shape
        bd, rows, warps = _layout(d)
        programs = max(1, min(PROGRAMS, triton.cdiv(n, rows)))
        dx = torch.empty_like(x2)
        dw = torch.empty(programs, d, device=x2.device, dtype=torch.float32) if weight is not None else None
        dg = torch.empty_like(g2) if g2 is not None else None
        if n:
            _rms_bwd_kernel[(programs,)](x2, weight if weight is not None else x2, g2 if g2 is not None else x2,
                                         dy.reshape(n, d).contiguous(), rstd, dx, dw if dw is not None else rstd,
                                         dg if dg is not None else dx, n, d, HAS_W=weight is not None,
                                         GATED=g2 is not None, BD=bd, ROWS=rows, num_warps=warps)
        dweight = None
        if weight is not None:
            dweight = (dw.sum(0) if n else torch.zeros(d, device=x2.device)).to(weight.dtype)
        return dx.view(ctx.shape), dweight, None, (dg.view(ctx.gate_shape) if dg is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = None,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x [..., D]`` over D with ``weight [D]`` (or None), fp32 math, ``x``'s dtype out; with ``gate``
    (``x``'s shape, any float dtype) the normed output times ``sigmoid(gate)``, formed in fp32 and rounded once.

    ``eps`` None takes fp32's machine epsilon, as ``F.rms_norm`` does on the fp32 input of the torch path. Runs the
    Triton kernels (on CPU only under ``TRITON_INTERPRET=1``); ``moelab.model.norm.RMSNorm`` chooses between this and
    the torch path by its ``backend``.
    """
    if not HAS_TRITON:
        raise RuntimeError("rms_norm needs triton, which is not installed; use RMSNorm with backend='torch'")
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} is not allowed: expected ({d},), the last "
                         f"dim of x {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"rms_norm: x dtype {x.dtype} is not allowed: expected float32, float16 or bfloat16")
    if gate is not None:
        if gate.shape != x.shape:
            raise ValueError(f"rms_norm: gate shape {tuple(gate.shape)} is not allowed: expected x's shape "
                             f"{tuple(x.shape)}")
        if gate.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"rms_norm: gate dtype {gate.dtype} is not allowed: expected float32, float16 or "
                             f"bfloat16")
    return _RMSNorm.apply(x, weight, float(torch.finfo(torch.float32).eps if eps is None else eps), gate)
