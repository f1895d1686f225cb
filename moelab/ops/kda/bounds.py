"""How negative the per-token log decay may be on the bounded fast path of the Triton KDA op.

The bounded mode forms each 16-token diagonal sub-tile of the gated scores as one product of
``q exp(G - G_mid)`` and ``k exp(G_mid - G)`` (``triton_common``), whose exponents reach
``|g_min| * SUBTILE / 2``; the config check, the op's own check and the decay-bound study all take
the bound from here.
"""

from __future__ import annotations

import math

# Largest |exponent| exp() may take before overflow, per dtype (ln of the dtype's max).
EXP_LIMIT = {"bf16": math.log(3.3895e38), "fp32": math.log(3.4028e38), "fp16": math.log(65504.0)}
SUBTILE = 16  # tokens per diagonal sub-tile of the Triton kernels (BC)


def max_safe_g_min(dtype: str, subtile: int) -> float:
    """Most negative per-token log decay a factored ``subtile``-token tile in ``dtype`` can hold.

    With a midpoint shift over the tile, exponents reach ``|g_min| * subtile / 2``; they must stay
    below ``EXP_LIMIT[dtype]``. bf16 with 16-token tiles gives about -11.1 in theory; we keep a
    factor-2 margin (products of two such factors must not overflow either), so the practical
    bound is ``-EXP_LIMIT / subtile`` (about -5.5 for bf16/fp32 at 16).
    """
    return -EXP_LIMIT[dtype] / subtile


# The kernels form the factors in fp32 over SUBTILE-token tiles: the bound of ``mode="bounded"``.
G_MIN_FLOOR = max_safe_g_min("fp32", SUBTILE)
