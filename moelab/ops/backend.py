"""Resolve a ``backend`` choice ("auto" | "triton" | "torch") for the tensor an op is about to run on.

Every op with a Triton kernel and a PyTorch reference takes the same three names (KDA's PyTorch
side has two algorithms, named "chunk" and "recurrent", see ``moelab.ops.kda``).
"""

from __future__ import annotations

import importlib.util
from typing import Literal, get_args

import torch

from moelab.base import ConfigError

# "auto": Triton on a CUDA tensor, PyTorch otherwise; "triton": the Triton kernels (also on CPU under
# TRITON_INTERPRET=1); "torch": plain PyTorch.
Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(backend: str, t: torch.Tensor) -> bool:
    """True when ``backend`` runs the Triton kernels for ``t``: "triton", or "auto" on a CUDA tensor.

    "triton" without Triton installed raises (it would otherwise fail deep inside an op).
    """
    if backend == "auto":
        return HAS_TRITON and t.is_cuda
    if backend == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend='triton' needs triton, which is not installed; use 'auto' or 'torch'")
        return True
    if backend == "torch":
        return False
    raise ConfigError(f"backend={backend!r} is not allowed: expected one of {', '.join(map(repr, BACKENDS))}")
