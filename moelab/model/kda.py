"""KDA layer: Kimi Delta Attention as a token mixer (architecture.md, "KDA").

    q, k = L2Norm(Swish(ShortConv(W_q x))), L2Norm(Swish(ShortConv(W_k x)))   per head
    v    = Swish(ShortConv(W_v x))
    beta = Sigmoid(W_beta x)                                                   one per head
    z    = W_up W_down x + b                                                   per channel of each head
    g    = g_min * Sigmoid(exp(A_h) z)        (gate="bounded", K3; g in (g_min, 0))
         = -exp(A_h) * Softplus(z)            (gate="softplus", Kimi Linear; g in (-inf, 0))
    o    = KDA(q, k, v, g, beta)               moelab.ops.kda
    y    = W_o [ Sigmoid(W_g x) * RMSNorm(o) ]  RMSNorm per head

The layer carries a :class:`KDAState` (recurrent state + ShortConv tails) so that a prefill in
pieces followed by token-by-token decoding equals one pass over the whole sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moelab.model.attnres import RMSNorm
from moelab.model.config import KDAConfig
from moelab.ops.kda import kda


@dataclass
class KDAState:
    """Decoding state of one KDA layer.

    Attributes:
        S: ``[B, H, K, V]`` fp32 recurrent state after the last token seen.
        conv: the last ``conv_size - 1`` pre-convolution inputs of q, k and v, each
            ``[B, conv_size - 1, channels]`` (channels = H*K, H*K, H*V).
    """

    S: torch.Tensor
    conv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class ShortConv(nn.Module):
    """Causal depthwise 1-D convolution over time, kernel ``size``, no bias.

    Input ``[B, T, C]``; the ``size - 1`` inputs before the first token come from ``tail``
    (zeros when None), so chunked calls chain exactly. ``backend="triton"`` (``"auto"``: on CUDA
    tensors; torch otherwise): a call without a
    tail (training, the first prefill) runs ``moelab.ops.short_conv.causal_conv1d`` (one pass in
    the ``[B, T, C]`` layout, optional fused SiLU); calls with a tail take the torch path.
    """

    def __init__(self, channels: int, size: int, backend: str = "auto") -> None:
        super().__init__()
        self.size = size
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(channels, 1, size))
        # torch's Conv1d default (kaiming-uniform, fan_in = size): keeps the conv near identity
        # scale, unlike the model-wide N(0, init_std) used for projections.
        bound = 1.0 / math.sqrt(size)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, tail: torch.Tensor | None = None,
                activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, C]`` -> ``(y [B, T, C], new_tail [B, size-1, C])``; ``activation``: None or
        ``"silu"`` applied to y (the tail holds inputs, not outputs)."""
        B, T, C = x.shape
        fast = self.backend == "triton" or (self.backend == "auto" and x.is_cuda)
        if fast and tail is None and T > 0:
            from moelab.ops.short_conv import causal_conv1d

            y = causal_conv1d(x, self.weight[:, 0, :], activation)
            keep = self.size - 1
            new_tail = x[:, T - keep:] if T >= keep else F.pad(x, (0, 0, keep - T, 0))
            return y, new_tail
        if tail is None:
            tail = x.new_zeros(B, self.size - 1, C)
        full = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, size-1+T, C]
        y = F.conv1d(full.transpose(1, 2), self.weight.to(x.dtype), groups=C).transpose(1, 2)
        if activation == "silu":
            y = F.silu(y)
        return y, full[:, full.shape[1] - (self.size - 1):]


class KDALayer(nn.Module):
    """Kimi Delta Attention token mixer, ``[B, T, D] -> [B, T, D]``.

    With ``record_decay = True`` (the model sets it for a forward with ``return_diagnostics``),
    ``last_g_min`` and ``last_g_mean`` give scalar tensors of the log decay of the last forward
    (detached; None otherwise).
    """

    def __init__(self, d_model: int, cfg: KDAConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        H, Dh = cfg.num_heads, cfg.head_dim
        self.H, self.K, self.V = H, Dh, Dh
        self.q_proj = nn.Linear(d_model, H * Dh, bias=False)
        self.k_proj = nn.Linear(d_model, H * Dh, bias=False)
        self.v_proj = nn.Linear(d_model, H * Dh, bias=False)
        self.q_conv = ShortConv(H * Dh, cfg.conv_size, cfg.conv_backend)
        self.k_conv = ShortConv(H * Dh, cfg.conv_size, cfg.conv_backend)
        self.v_conv = ShortConv(H * Dh, cfg.conv_size, cfg.conv_backend)
        self.b_proj = nn.Linear(d_model, H, bias=False)
        self.f_down = nn.Linear(d_model, cfg.decay_rank, bias=False)
        self.f_up = nn.Linear(cfg.decay_rank, H * Dh, bias=True)  # its bias is b in z = W_up W_down x + b
        self.A_log = nn.Parameter(torch.zeros(H))
        self.g_proj = nn.Linear(d_model, H * Dh, bias=False)
        self.o_norm = RMSNorm(Dh, eps=norm_eps)
        self.o_proj = nn.Linear(H * Dh, d_model, bias=False)
        # With ``record_decay`` the forward keeps its gate input (detached) so that ``last_g_min`` /
        # ``last_g_mean`` can be computed when asked for (the fused Triton path never materializes g
        # in torch). Off by default: held across steps it would cost a [B, T, H*K] tensor per layer.
        # The model turns it on for a forward with ``return_diagnostics``.
        self.record_decay = False
        self._last_z: torch.Tensor | None = None
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """Decay init. Called at construction and again after the model-wide init.

        ``A``: 0 for the bounded gate (K3), ``log U(1, 16)`` for softplus (Kimi Linear / Mamba).
        ``b`` (bias of ``W_up``): per channel so that at ``z = b`` the decay is
        ``g = -exp(A) * dt`` with ``dt`` log-uniform in ``[dt_min, dt_max]`` (Mamba's spread of
        memory lengths, 10 to 1000 tokens). For softplus ``b = softplus^-1(dt)``; for the bounded
        gate, ``g_min * sigmoid(b) = -dt`` gives ``b = logit(dt / |g_min|)``.
        """
        H, K = self.H, self.K
        dt = torch.exp(torch.rand(H * K) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        if self.cfg.gate == "bounded":
            self.A_log.zero_()
            p = (dt / -self.cfg.g_min).clamp(max=0.5)
            self.f_up.bias.copy_(torch.log(p) - torch.log1p(-p))
        else:
            self.A_log.copy_(torch.log(torch.empty(H).uniform_(1.0, 16.0)))
            self.f_up.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay ``g`` ``[B, T, H, K]`` fp32 (natural log, <= 0) for ``x [B, T, D]``."""
        B, T, _ = x.shape
        return self._gate(self.f_up(self.f_down(x)).view(B, T, self.H, self.K))

    def _gate(self, z: torch.Tensor) -> torch.Tensor:
        """``z [B, T, H, K]`` (gate input) -> ``g`` fp32, the same formula the fused op computes."""
        a = self.A_log.float().exp()[:, None]  # [H, 1]
        if self.cfg.gate == "bounded":
            return self.cfg.g_min * torch.sigmoid(a * z.float())
        return -a * F.softplus(z.float())

    @property
    def last_g_min(self) -> torch.Tensor | None:
        """Smallest log decay of the last forward (detached scalar, computed on demand), or None
        unless ``record_decay`` was on."""
        return None if self._last_z is None else self._last_g().amin()

    @property
    def last_g_mean(self) -> torch.Tensor | None:
        """Mean log decay of the last forward (detached scalar), computed on demand."""
        return None if self._last_z is None else self._last_g().mean()

    @torch.no_grad()
    def _last_g(self) -> torch.Tensor:
        return self._gate(self._last_z)

    def forward(
        self, x: torch.Tensor, state: KDAState | None = None, use_cache: bool = False
    ) -> tuple[torch.Tensor, KDAState | None]:
        """``x [B, T, D]`` -> ``(y [B, T, D], new state or None)``.

        Args:
            x: input (already normalized by the caller).
            state: state after the previous tokens of the same sequences, or None (start).
            use_cache: return the state after the last token of ``x``.
        """
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        tails = state.conv if state is not None else (None, None, None)
        q, tq = self.q_conv(self.q_proj(x), tails[0])
        k, tk = self.k_conv(self.k_proj(x), tails[1])
        v, tv = self.v_conv(self.v_proj(x), tails[2], "silu")  # v = Swish(ShortConv(W_v x))
        beta = torch.sigmoid(self.b_proj(x).float())  # [B, T, H]
        z = self.f_up(self.f_down(x)).view(B, T, H, K)  # gate input
        self._last_z = z.detach() if self.record_decay else None
        bounded = self.cfg.gate == "bounded"
        # One decoding step is exactly one step of the recurrence: no chunk padding needed.
        backend = "recurrent" if T == 1 else self.cfg.backend
        if backend == "auto":
            backend = "triton" if x.is_cuda else "chunk"
        state_in = None if state is None else state.S
        if backend == "triton":
            # SiLU, L2 norm and the gate run inside the op (one fused pass each way; the raw
            # inputs are what it keeps for the backward); the gate bounds g by construction
            from moelab.ops.kda.triton_chunk import chunk_kda

            o, S = chunk_kda(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V), z, beta,
                             initial_state=state_in, output_final_state=use_cache,
                             mode="bounded" if bounded else "general", lower_bound=self.cfg.g_min if bounded else -5.0,
                             chunk_size=self.cfg.chunk_size, gate=self.cfg.gate, A_log=self.A_log,
                             l2norm_qk=True, silu_qk=True, norm_eps=1e-6)
        else:
            q = F.normalize(F.silu(q).float().view(B, T, H, K), dim=-1, eps=1e-6)
            k = F.normalize(F.silu(k).float().view(B, T, H, K), dim=-1, eps=1e-6)
            v = v.view(B, T, H, V)
            q, k = q.to(v.dtype), k.to(v.dtype)
            g = self._gate(z)
            # Both gates put g in [g_min, 0] (bounded) or (-inf, 0] (softplus) by construction, in
            # fp32: the op need not re-check the range (a host sync per layer on the GPU).
            o, S = kda(q, k, v, g, beta, initial_state=state_in, output_final_state=use_cache, backend=backend,
                       chunk_size=self.cfg.chunk_size, lower_bound=self.cfg.g_min if bounded else None,
                       validate=False)
        o = self.o_norm(o)  # [B, T, H, V], normalized per head
        y = torch.sigmoid(self.g_proj(x)) * o.reshape(B, T, H * V)
        y = self.o_proj(y)
        return y, (KDAState(S=S, conv=(tq, tk, tv)) if use_cache else None)
