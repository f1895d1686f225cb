"""The one RMSNorm of the model: every pre-norm, the KDA output norm, the MoE latent norm, AttnRes keys."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed in fp32 whatever the input and weight dtypes; returns the input dtype.

    Under bf16 autocast the weights are fp32 and a projection's output is bf16; in a bf16-cast
    model both are bf16. Upcasting both here keeps one code path numerically the same in either
    case (and avoids torch's mixed-dtype fallback). Used for every norm of the stack.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        return F.rms_norm(x.float(), self.normalized_shape, w, self.eps).to(x.dtype)
