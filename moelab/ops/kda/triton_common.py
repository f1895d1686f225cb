"""Device helpers shared by the KDA Triton kernels (chunked training op and inference forward).

Decays enter the chunk kernels as ``G``: the chunk-local cumulative sum of the log decay,
**already multiplied by log2(e)** (``LOG2E``), so ``exp2(G_i - G_j)`` is the natural
``exp(G_i - G_j)``. ``G`` is non-increasing along a chunk because ``g <= 0``. How the gated
products ``sum_d a_id b_jd exp(G_id - G_jd)`` are formed without overflow is described in
triton_fwd.py (``_pair``, ``_diag``) and kernels/README.md ("The two modes").

The chunk kernels assume padded shapes (triton_chunk pads): ``T`` a multiple of the chunk, ``K``
and ``V`` powers of two >= 16. Padded tokens have ``q = k = v = beta = 0`` and ``g = 0`` and
contribute nothing, so no load or store needs a mask (masked tile loads feeding ``tl.dot`` cost
about 2.5x the registers on Hopper).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _cast(x, DOT_BF16: tl.constexpr):
    """Operand dtype for tensor-core products: bf16 for bf16 inputs, fp32 (TF32 on the GPU)
    otherwise or where precision matters. Every TF32 product goes through here too (one place
    to change the operand precision of all of them)."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation. ``IEEE`` (fp32 inputs): exact fp32 products instead of
    TF32, so the fp32 path matches the fp32 reference to ~1e-5 (the accuracy / reference use;
    bf16 and fp16 inputs are the fast path and keep TF32 / bf16 tensor-core products)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tf32(x, IEEE: tl.constexpr):
    """``x`` (fp32) rounded to the nearest TF32 value (10-bit mantissa, ties away from zero), still
    fp32: an operand that is already a TF32 value enters a TF32 product unchanged, whether the
    tensor cores round or truncate, so a kernel that rounds a factor itself knows the exact value
    the product used and can reuse it elsewhere (the dG terms of triton_bwd.py). ``IEEE`` (fp32
    products): ``x`` as it is."""
    if IEEE:
        return x
    else:
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
