"""The one RMSNorm of the model: every pre-norm, the KDA output norm, the MoE latent norm, AttnRes keys."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moelab.ops.backend import use_triton


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed in fp32 whatever the input and weight dtypes; returns the input dtype.

    Under bf16 autocast the weights are fp32 and a projection's output is bf16; in a bf16-cast
    model both are bf16. Upcasting both here keeps one code path numerically the same in either
    case (and avoids torch's mixed-dtype fallback). Used for every norm of the stack.

    ``backend`` (``model.norm_backend``, set on every norm of a model by ``MoELab``): "torch" runs
    ``F.rms_norm`` on the upcast input; "triton" the fused kernels of ``moelab.ops.rms_norm`` (one pass each way,
    the same math, sums in another order); "auto" Triton on a CUDA tensor. A ``torch.compile``'d model takes the
    torch path (inductor fuses it itself).
    """

    backend: str = "torch"

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        if use_triton(self.backend, x) and len(self.normalized_shape) == 1 and not torch.compiler.is_compiling():
            from moelab.ops.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, gate=gate)
        w = self.weight.float() if self.weight is not None else None
        y = F.rms_norm(x.float(), self.normalized_shape, w, self.eps).to(x.dtype)
        return y if gate is None else torch.sigmoid(gate) * y
