"""KDA layer: Kimi Delta Attention as a token mixer (architecture.md, "KDA").

    q, k = L2Norm(Swish(ShortConv(W_q x))), L2Norm(Swish(ShortConv(W_k x)))   per head
    v    = Swish(ShortConv(W_v x))
    beta = Sigmoid(W_beta x)                                                   one per head
    z    = W_up W_down x + b                                                   per channel of each head
    g    = g_min * Sigmoid(exp(A_h) z)        (gate="bounded", K3; g in (g_min, 0))
         = -exp(A_h) * Softplus(z)            (gate="softplus", Kimi Linear; g in (-inf, 0))
    o    = KDA(q, k, v, g, beta)               moelab.ops.kda.kda, which also runs the L2 norms and the gate
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

from moelab.model.config import KDAConfig
from moelab.model.documents import Documents, causal_conv_fix
from moelab.model.norm import RMSNorm
from moelab.ops.backend import use_triton
from moelab.ops.fanout import fan_out
from moelab.ops.kda import kda, naive_kda_gate


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
    (zeros when None), so chunked calls chain exactly. ``backend`` ("auto" | "triton" | "torch",
    ``KDAConfig.conv_backend``; "auto": Triton on CUDA tensors): with Triton, a call without a
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
                activation: str | None = None, docs: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, C]`` -> ``(y [B, T, C], new_tail [B, size-1, C])``; ``activation``: None or
        ``"silu"`` applied to y (the tail holds inputs, not outputs). ``docs``: packed documents
        (``moelab.model.documents``; no tail then): no output reads an input of another document."""
        B, T, C = x.shape
        triton_conv = use_triton(self.backend, x) and tail is None and T > 0
        if docs is not None:
            if tail is not None:
                raise ValueError("ShortConv: packed documents (docs) start from zeros: tail must be None")
            if not triton_conv:  # the Triton kernel masks the taps by document itself (pos), in the same pass
                y, new_tail = self.forward(x, None, activation)
                return causal_conv_fix(y, x, self.weight[:, 0, :], docs, activation), new_tail
        if triton_conv:
            from moelab.ops.short_conv import causal_conv1d

            y = causal_conv1d(x, self.weight[:, 0, :], activation, pos=None if docs is None else docs.pos)
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

    The op (``moelab.ops.kda.kda``) gets the raw q, k and gate input and the gate's parameters;
    ``cfg.backend`` picks its implementation. ``log_decay`` / ``decay_stats`` recompute the decay
    for diagnostics.
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
        self.g_min = cfg.g_min if cfg.gate == "bounded" else None  # the op's bound on g (softplus: none)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """Decay init. Called at construction and again after the model-wide init.

        Both gates start from the same per-token log decay, so that arms differing only in the gate
        also start alike: ``A = 0`` (rate 1), and ``b`` (bias of ``W_up``) per channel such that at
        ``z = b`` the decay is ``g = -dt``, ``dt`` log-uniform in ``[dt_min, dt_max]`` (Mamba's spread
        of memory lengths, 10 to 1000 tokens), from one draw of ``H*K`` numbers whatever the gate
        (so every other parameter gets the same random numbers too). softplus: ``b =
        softplus^-1(dt)``; bounded: ``g_min * sigmoid(b) = -dt`` gives ``b = logit(dt / |g_min|)``.
        The slopes ``dg/dz`` at ``b`` then agree to first order in dt as well: ``-dt (1 - dt/|g_min|)``
        and ``-(1 - e^{-dt})``. (Kimi Linear draws ``A = log U(1, 16)`` for softplus: 1-16x faster
        initial decay than the bounded gate's, and extra random numbers.)
        """
        H, K = self.H, self.K
        dt = torch.exp(torch.rand(H * K) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        self.A_log.zero_()
        if self.cfg.gate == "bounded":
            p = (dt / -self.cfg.g_min).clamp(max=0.5)
            self.f_up.bias.copy_(torch.log(p) - torch.log1p(-p))
        else:
            self.f_up.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay ``g`` ``[B, T, H, K]`` fp32 (natural log, <= 0) for ``x [B, T, D]``."""
        B, T, _ = x.shape
        z = self.f_up(self.f_down(x)).view(B, T, self.H, self.K)
        return naive_kda_gate(z, self.A_log, self.cfg.gate, self.g_min)

    @torch.no_grad()
    def decay_stats(self, x: torch.Tensor) -> torch.Tensor:
        """``[2]`` detached: (min, mean) of the log decay the layer applies to ``x [B, T, D]``.

        Recomputed from x (the fused Triton op never materializes g), so a forward without
        diagnostics keeps nothing."""
        g = self.log_decay(x)
        return torch.stack([g.amin(), g.mean()])

    def forward(
        self, x: torch.Tensor, state: KDAState | None = None, use_cache: bool = False,
        docs: Documents | None = None,
    ) -> tuple[torch.Tensor, KDAState | None]:
        """``x [B, T, D]`` -> ``(y [B, T, D], new state or None)``.

        Args:
            x: input (already normalized by the caller).
            state: state after the previous tokens of the same sequences, or None (start).
            use_cache: return the state after the last token of ``x``.
            docs: packed documents (``moelab.model.documents``): the convs and the recurrence
                restart at each boundary (the op runs on the ``B*T`` tokens as one row with
                ``docs.cu_seqlens``). Not with ``state`` or ``use_cache``.
        """
        B, T, _ = x.shape
        H, K, V = self.H, self.K, self.V
        if docs is not None and (state is not None or use_cache):
            raise ValueError("KDALayer: packed documents (docs) run without a decoding state: "
                             "state must be None and use_cache False")
        tails = state.conv if state is not None else (None, None, None)
        xq, xk, xv, xb, xf, xg = fan_out(x, 6)  # under autocast: x cast once for the six projections
        q, tq = self.q_conv(self.q_proj(xq), tails[0], docs=docs)
        k, tk = self.k_conv(self.k_proj(xk), tails[1], docs=docs)
        v, tv = self.v_conv(self.v_proj(xv), tails[2], "silu", docs=docs)  # v = Swish(ShortConv(W_v x))
        beta = torch.sigmoid(self.b_proj(xb).float())  # [B, T, H]
        z = self.f_up(self.f_down(xf)).view(B, T, H, K)  # gate input
        # One decoding step is exactly one step of the recurrence: no chunk padding needed.
        backend = "recurrent" if T == 1 else self.cfg.backend
        # SiLU, L2 norm and the gate run inside the op (fused into the Triton kernels); the gate
        # bounds g by construction, so the op need not check its range (a host sync per layer).
        # Packed documents: the B rows become one row of B*T tokens and N documents (cu_seqlens).
        rows, cols = (1, B * T) if docs is not None else (B, T)
        o, S = kda(q.reshape(rows, cols, H, K), k.reshape(rows, cols, H, K), v.reshape(rows, cols, H, V),
                   z.reshape(rows, cols, H, K), beta.reshape(rows, cols, H),
                   initial_state=None if state is None else state.S, output_final_state=use_cache,
                   backend=backend, chunk_size=self.cfg.chunk_size, gate=self.cfg.gate, A_log=self.A_log,
                   g_min=self.g_min, silu_qk=True, l2norm_qk=True, norm_eps=1e-6, validate=False,
                   cu_seqlens=None if docs is None else docs.cu_seqlens)
        # sigmoid(W_g x) * RMSNorm(o) per head (one fused pass each way with the Triton norm)
        y = self.o_norm(o.view(B, T, H, V), gate=self.g_proj(xg).view(B, T, H, V))
        y = self.o_proj(y.reshape(B, T, H * V))
        return y, (KDAState(S=S, conv=(tq, tk, tv)) if use_cache else None)
