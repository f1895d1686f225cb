"""The bias-free GLU feed-forward of the dense layers and of the shared experts.

    GLUFFN(x) = W_down act(x W_gate, x W_up)      act: SiTU-GLU or SwiGLU (``moelab.ops.glu``)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moelab.base import ConfigError
from moelab.ops.glu import check_activation, glu


class GLUFFN(nn.Module):
    """Bias-free GLU feed-forward: ``down( act(x W_g, x W_u) )``, ``[..., d_in] -> [..., d_in]``.

    ``gate_up`` holds W_g and W_u stacked as one Linear ``d_in -> 2 * d_hidden`` (gate rows first)
    so the input is read once. A sum of n such FFNs of width w equals one of width n * w (hidden
    units are independent and ``down`` sums over them), which is how LatentMoE fuses its shared experts.
    ``backend`` ("auto" | "triton" | "torch") picks the activation's implementation (``glu``).
    """

    def __init__(self, d_in: int, d_hidden: int, activation: str, beta1: float = 4.0, beta2: float = 25.0,
                 backend: str = "auto") -> None:
        super().__init__()
        if d_in < 1 or d_hidden < 1:
            raise ConfigError(f"GLUFFN: d_in={d_in}, d_hidden={d_hidden}: both must be >= 1")
        self.activation = check_activation(activation)
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.d_in, self.d_hidden = d_in, d_hidden
        self.gate_up = nn.Linear(d_in, 2 * d_hidden, bias=False)
        self.down = nn.Linear(d_hidden, d_in, bias=False)
        self.backend = backend  # of the activation, see glu()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate_up.weight, std=std)
        nn.init.normal_(self.down.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: ``[..., d_in]`` -> ``[..., d_in]``."""
        return self.down(glu(self.gate_up(x), self.activation, self.beta1, self.beta2, self.backend))

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_hidden={self.d_hidden}, activation={self.activation}"
