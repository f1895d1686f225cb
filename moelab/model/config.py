"""Model configuration: one dataclass per component, swapped by name.

Every alternative a study compares is a field here (``kda.gate``, ``residual.mode``,
``moe.activation``, ...), never a code edit. ``validate()`` rejects bad values with a message
naming the field, the value and what is allowed; YAML loading lives in ``moelab.config``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from moelab.base import ConfigError, _check, _one_of
from moelab.ops.backend import BACKENDS, Backend
from moelab.ops.glu import ACTIVATIONS, Activation
from moelab.ops.kda import BACKENDS as KDA_BACKENDS
from moelab.ops.kda import KDABackend
from moelab.ops.kda.bounds import G_MIN_FLOOR, SUBTILE
from moelab.ops.router_stats import CUTOFFS, Cutoff

__all__ = ["ConfigError", "KDAConfig", "MLAConfig", "ModelConfig", "MoEConfig", "ResidualConfig"]

# Each choice is a Literal type (what the YAML loader checks) and the tuple of its values (what
# validate() checks), derived from it. Which implementation runs a piece is a ``*backend`` field:
# ``Backend`` (moelab.ops.backend) for every op, KDA's own ``KDABackend`` (moelab.ops.kda).
KDAGate = Literal["bounded", "softplus"]
ResidualMode = Literal["prenorm", "full_attnres", "block_attnres"]
Dispatch = Literal["auto", "grouped", "loop"]
MaskBackend = Literal["auto", "flex", "dense"]
MatmulPrecision = Literal["highest", "high", "tf32x3"]
Balancer = Literal["none", "aux_loss", "loss_free_sign", "quantile_load", "quantile_balancing"]
QuantileMode = Literal["exact", "histogram"]
KDA_GATES: tuple[KDAGate, ...] = get_args(KDAGate)
RESIDUAL_MODES: tuple[ResidualMode, ...] = get_args(ResidualMode)
DISPATCHES: tuple[Dispatch, ...] = get_args(Dispatch)
MASK_BACKENDS: tuple[MaskBackend, ...] = get_args(MaskBackend)
MATMUL_PRECISIONS: tuple[MatmulPrecision, ...] = get_args(MatmulPrecision)
BALANCERS: tuple[Balancer, ...] = get_args(Balancer)
QUANTILE_MODES: tuple[QuantileMode, ...] = get_args(QuantileMode)


@dataclass
class KDAConfig:
    """Kimi Delta Attention (gated delta rule with per-channel decay).

    Shapes inside the layer: q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, log decay g
    ``[B, T, H, K]`` (natural log, <= 0), beta ``[B, T, H]``, state ``[B, H, K, V]`` fp32.
    """

    num_heads: int = 4
    head_dim: int = 64  # K = V = head_dim
    conv_size: int = 4  # causal depthwise ShortConv kernel on q, k, v
    # triton: moelab.ops.short_conv (one pass, fused SiLU on v); auto: triton on CUDA tensors
    conv_backend: Backend = "auto"
    decay_rank: int = 16  # low-rank W_up W_down for the decay logit z
    gate: KDAGate = "bounded"  # bounded: g = g_min*sigmoid(exp(A) z); softplus: g = -exp(A)*softplus(z)
    g_min: float = -5.0  # the bounded gate's floor (unused by softplus)
    backend: KDABackend = "auto"  # auto: triton on a CUDA device, else chunk
    chunk_size: int = 64

    def validate(self, prefix: str = "kda") -> None:
        _check(self.num_heads >= 1, f"{prefix}.num_heads", self.num_heads, "an integer >= 1")
        _check(1 <= self.head_dim <= 256, f"{prefix}.head_dim", self.head_dim, "1..256")
        _check(self.conv_size >= 1, f"{prefix}.conv_size", self.conv_size, "an integer >= 1")
        _one_of(f"{prefix}.conv_backend", self.conv_backend, BACKENDS)
        _check(self.decay_rank >= 1, f"{prefix}.decay_rank", self.decay_rank, "an integer >= 1")
        _one_of(f"{prefix}.gate", self.gate, KDA_GATES)
        _one_of(f"{prefix}.backend", self.backend, KDA_BACKENDS)
        _check(self.chunk_size in (16, 32, 64, 128), f"{prefix}.chunk_size", self.chunk_size, "16, 32, 64 or 128")
        if self.backend in ("auto", "triton", "cudnn"):  # auto takes the Triton op on a GPU, cudnn trains with it
            _check(self.chunk_size <= 64, f"{prefix}.chunk_size", self.chunk_size,
                   f"16, 32 or 64 with backend={self.backend!r} (the Triton op's chunks; 128 needs backend='chunk')")
        if self.gate == "bounded":
            _check(self.g_min < 0, f"{prefix}.g_min", self.g_min, "a negative number")
            if self.backend in ("auto", "triton", "cudnn"):
                _check(self.g_min >= G_MIN_FLOOR, f"{prefix}.g_min", self.g_min,
                       f">= {G_MIN_FLOOR:.2f}: the bounded fast path computes exp(-G) over {SUBTILE}-token "
                       f"tiles and would overflow below that (use gate='softplus' or backend='chunk')")


@dataclass
class MLAConfig:
    """Gated multi-head latent attention, NoPE.

    Keys and values are rebuilt from a shared latent ``c_kv = W_dkv x`` of width
    ``kv_latent_dim``; the decoding cache holds ``c_kv`` only ``[B, T, kv_latent_dim]``.
    """

    num_heads: int = 4
    head_dim: int = 64
    kv_latent_dim: int = 128
    q_latent_dim: int = 0  # 0: full-rank query projection
    output_gate: bool = True  # y = W_o [sigmoid(W_g x) * o]
    fp32_output: bool = False  # keep the attention output in fp32 (K3 does in training)
    # the fp32 gate and output projection's matmuls (fp32_output only), forward and backward, the process's own
    # setting restored after each: "highest" = IEEE fp32 (SIMT kernels on a GPU), "high" = TF32 tensor cores (10-bit
    # mantissa inputs, fp32 sums), "tf32x3" = fp32 accuracy on TF32 tensor cores (each operand split into a TF32 part
    # and its remainder, three products summed: moelab.model.mla.tf32x3_mm)
    fp32_output_precision: MatmulPrecision = "highest"
    # Packed documents (forward(segment_ids=)): "flex" = flex_attention with a block mask from the documents'
    # block ranges (memory linear in T; compiled on a GPU), "dense" = SDPA with a [B, 1, T, T] bool mask
    # (B T^2 bytes; leaves SDPA's flash kernel), "auto" = flex on a CUDA device (head_dim a power of two
    # >= 16, as its kernel needs), dense elsewhere.
    mask_backend: MaskBackend = "auto"

    def validate(self, prefix: str = "mla") -> None:
        _check(self.num_heads >= 1, f"{prefix}.num_heads", self.num_heads, "an integer >= 1")
        _check(1 <= self.head_dim <= 256, f"{prefix}.head_dim", self.head_dim, "1..256")
        _check(self.kv_latent_dim >= 1, f"{prefix}.kv_latent_dim", self.kv_latent_dim, "an integer >= 1")
        _check(self.q_latent_dim >= 0, f"{prefix}.q_latent_dim", self.q_latent_dim, "an integer >= 0")
        _one_of(f"{prefix}.mask_backend", self.mask_backend, MASK_BACKENDS)
        _one_of(f"{prefix}.fp32_output_precision", self.fp32_output_precision, MATMUL_PRECISIONS)


@dataclass
class MoEConfig:
    """Stable LatentMoE: shared full-width experts + routed experts in a latent width.

    ``y = sum_j shared_j(x) + W_up RMSNorm(sum_{i in TopK} p_i E_i(W_down x))``; with
    ``latent_dim == 0`` the routed experts work at full width (no down/up projection, no norm).
    """

    num_experts: int = 8  # routed
    top_k: int = 2
    num_shared: int = 1
    latent_dim: int = 0  # 0: routed experts at d_model (plain MoE)
    expert_dim: int = 128  # hidden width of each routed expert
    shared_dim: int = 0  # hidden width of each shared expert; 0: expert_dim
    activation: Activation = "situ_glu"
    situ_beta1: float = 4.0
    situ_beta2: float = 25.0
    dispatch: Dispatch = "auto"  # grouped: torch grouped GEMM; loop: per-expert loop (reference)
    # router logits + top-k, dispatch / combine (+ latent RMSNorm) and the GLU activations of every
    # FFN (the dense ones too): "triton" fuses them (moelab.ops.moe, moelab.ops.glu); same function
    backend: Backend = "auto"
    router_dtype: Literal["fp32"] = "fp32"
    # Load balancing (moelab.model.balance; formulas in its docstring). Each coefficient is read
    # only by the balancer its name starts with.
    balancer: Balancer = "none"
    aux_loss_alpha: float = 1e-2  # alpha of the Switch/GShard loss
    loss_free_sign_rate: float = 1e-3  # u: bias step per optimizer step
    quantile_load_rate: float = 1e-2  # eta, per unit of mean-normalized load
    quantile_load_decay: float = 0.9  # moving average of the normalized loads
    quantile_load_q: float = 0.75  # the quantile of the averaged loads the biases aim at
    quantile_balancing_mode: QuantileMode = "exact"  # histogram: one all-reduce, error <= 1 bin
    quantile_balancing_bins: int = 1000
    quantile_balancing_ema: float = 0.0  # b <- ema b_old + (1 - ema) b_new; 0: no smoothing
    # k_plus_1: the report's per-token cutoff; excluding_self: each expert's exact best response
    quantile_balancing_cutoff: Cutoff = "k_plus_1"
    router_z_loss: float = 0.0  # ST-MoE z-loss coefficient; with any balancer

    def validate(self, prefix: str = "moe") -> None:
        _check(self.num_experts >= 1, f"{prefix}.num_experts", self.num_experts, "an integer >= 1")
        _check(1 <= self.top_k <= self.num_experts, f"{prefix}.top_k", self.top_k,
               f"1..num_experts ({self.num_experts})")
        _check(self.num_shared >= 0, f"{prefix}.num_shared", self.num_shared, "an integer >= 0")
        _check(self.latent_dim >= 0, f"{prefix}.latent_dim", self.latent_dim, "an integer >= 0")
        _check(self.expert_dim >= 1, f"{prefix}.expert_dim", self.expert_dim, "an integer >= 1")
        _check(self.shared_dim >= 0, f"{prefix}.shared_dim", self.shared_dim, "an integer >= 0")
        _one_of(f"{prefix}.activation", self.activation, ACTIVATIONS)
        _one_of(f"{prefix}.dispatch", self.dispatch, DISPATCHES)
        _one_of(f"{prefix}.backend", self.backend, BACKENDS)
        _check(self.situ_beta1 > 0, f"{prefix}.situ_beta1", self.situ_beta1, "a positive number")
        _check(self.situ_beta2 > 0, f"{prefix}.situ_beta2", self.situ_beta2, "a positive number")
        _one_of(f"{prefix}.balancer", self.balancer, BALANCERS)
        for name in ("aux_loss_alpha", "loss_free_sign_rate", "quantile_load_rate", "router_z_loss"):
            _check(getattr(self, name) >= 0, f"{prefix}.{name}", getattr(self, name), "a number >= 0")
        _check(0.0 <= self.quantile_load_decay < 1.0, f"{prefix}.quantile_load_decay", self.quantile_load_decay,
               "a number in [0, 1)")
        _check(0.0 < self.quantile_load_q < 1.0, f"{prefix}.quantile_load_q", self.quantile_load_q,
               "a number in (0, 1)")
        _one_of(f"{prefix}.quantile_balancing_mode", self.quantile_balancing_mode, QUANTILE_MODES)
        _check(self.quantile_balancing_bins >= 2, f"{prefix}.quantile_balancing_bins", self.quantile_balancing_bins,
               "an integer >= 2")
        _check(0.0 <= self.quantile_balancing_ema < 1.0, f"{prefix}.quantile_balancing_ema",
               self.quantile_balancing_ema, "a number in [0, 1)")
        _one_of(f"{prefix}.quantile_balancing_cutoff", self.quantile_balancing_cutoff, CUTOFFS)
        if self.balancer == "quantile_balancing":
            # The per-token cutoff is the (k+1)-th largest score: there must be a (k+1)-th expert.
            _check(self.top_k < self.num_experts, f"{prefix}.top_k", self.top_k,
                   f"< num_experts ({self.num_experts}) with balancer='quantile_balancing'")


@dataclass
class ResidualConfig:
    """How sublayers read the residual stream (attnres.md).

    Each mixer and each FFN counts as one sublayer, so a stack of ``n_layers`` has
    ``2 * n_layers`` sublayers; ``block_attnres`` groups them into ``num_blocks`` blocks.
    """

    mode: ResidualMode = "prenorm"
    num_blocks: int = 4  # block_attnres only
    # block_attnres only: allow a num_blocks that does not divide the sublayer count; blocks then
    # differ in size by at most one sublayer (K3: 8 blocks over 93 layers = 186 sublayers).
    uneven_blocks: bool = False
    # the depth softmax of the AttnRes modes: triton = moelab.ops.attnres (fused, no stack of the
    # sources); torch = the plain path; auto = triton on CUDA tensors, else torch
    backend: Backend = "auto"
    # the fused op's launch for every read (moelab.ops.attnres.LaunchConfig.parse, e.g. "r4w4g1-b4w4g2": tile rows,
    # warps, sources at once, optionally -b and the backward's); "" keeps the op's rule (launch_config(d_model))
    launch: str = ""

    def validate(self, n_sublayers: int, prefix: str = "residual") -> None:
        _one_of(f"{prefix}.mode", self.mode, RESIDUAL_MODES)
        _one_of(f"{prefix}.backend", self.backend, BACKENDS)
        if self.launch:
            self.launch_config(prefix)
        if self.mode == "block_attnres":
            if self.uneven_blocks:
                _check(1 <= self.num_blocks <= n_sublayers, f"{prefix}.num_blocks", self.num_blocks,
                       f"1..{n_sublayers} (the sublayer count, 2 per layer)")
            else:
                _check(1 <= self.num_blocks <= n_sublayers and n_sublayers % self.num_blocks == 0,
                       f"{prefix}.num_blocks", self.num_blocks,
                       f"a divisor of the sublayer count {n_sublayers} (2 per layer), or set uneven_blocks")

    def launch_config(self, prefix: str = "residual"):
        """The fused op's ``LaunchConfig`` that ``launch`` spells (None for ""); ConfigError naming the field."""
        if not self.launch:
            return None
        from moelab.ops.attnres import LaunchConfig

        try:
            return LaunchConfig.parse(self.launch)
        except ValueError as exc:
            raise ConfigError(f"{prefix}.launch={self.launch!r} is not allowed: {exc}") from None

    def block_ends(self, n_sublayers: int) -> list[int]:
        """Sublayer counts after which a block closes: ``[S, 2S, ..., n_sublayers]``.

        ``full_attnres`` is one block per sublayer; ``prenorm`` has none (empty list). With
        ``uneven_blocks`` block j ends at ``floor((j + 1) * n_sublayers / num_blocks)``.
        """
        if self.mode == "prenorm":
            return []
        n = n_sublayers if self.mode == "full_attnres" else self.num_blocks
        return [(j + 1) * n_sublayers // n for j in range(n)]


@dataclass
class ModelConfig:
    """The whole hybrid stack.

    Layer kinds: ``pattern`` (``K`` = KDA, ``M`` = gated MLA) repeated over the first
    ``n_layers - final_mla`` layers, then one MLA layer if ``final_mla``. The first
    ``dense_layers`` layers use a dense FFN (width ``dense_ffn_dim``) instead of the MoE;
    ``dense_layers >= n_layers`` gives a dense model.
    """

    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    pattern: str = "KKKM"
    final_mla: bool = True
    dense_layers: int = 1
    dense_ffn_dim: int = 0  # 0: 8/3 * d_model rounded up to a multiple of 64
    dense_activation: Activation = "swiglu"
    max_seq_len: int = 4096  # only for validation of inputs and cache sizes; NoPE has no positions
    tie_embeddings: bool = False
    norm_eps: float = 1e-6
    # every RMSNorm: "torch" (F.rms_norm on the fp32-cast input), "triton" (moelab.ops.rms_norm: one fused pass each
    # way, the same math), "auto" (Triton on a GPU); "torch" until the fused one is timed in the model benchmark
    norm_backend: Backend = "torch"
    # the training loss (moelab.ops.linear_ce): "torch" (each chunk's softmax side as torch's fp32 passes), "triton"
    # (one kernel per chunk: loss rows and the logits gradient), "auto" (Triton on a GPU); "torch" until timed, as above
    loss_backend: Backend = "torch"
    init_std: float = 0.02
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)

    def layer_types(self) -> list[str]:
        """Per-layer mixer kind, ``"kda"`` or ``"mla"``, length ``n_layers``."""
        body = self.n_layers - int(self.final_mla)
        kinds = [{"K": "kda", "M": "mla"}[self.pattern[i % len(self.pattern)]] for i in range(body)]
        return kinds + (["mla"] if self.final_mla else [])

    def ffn_dim(self) -> int:
        """Width of the dense FFN."""
        if self.dense_ffn_dim:
            return self.dense_ffn_dim
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def validate(self) -> ModelConfig:
        """Check every field; return self so calls chain. Raises ConfigError."""
        _check(self.vocab_size >= 2, "model.vocab_size", self.vocab_size, "an integer >= 2")
        _check(self.d_model >= 8, "model.d_model", self.d_model, "an integer >= 8")
        _check(self.n_layers >= 1, "model.n_layers", self.n_layers, "an integer >= 1")
        _check(len(self.pattern) >= 1 and set(self.pattern) <= {"K", "M"}, "model.pattern", self.pattern,
               "a non-empty string of 'K' (KDA) and 'M' (MLA)")
        _check(self.dense_layers >= 0, "model.dense_layers", self.dense_layers, "an integer >= 0")
        _check(self.dense_ffn_dim >= 0, "model.dense_ffn_dim", self.dense_ffn_dim, "an integer >= 0")
        _one_of("model.dense_activation", self.dense_activation, ACTIVATIONS)
        _check(self.max_seq_len >= 1, "model.max_seq_len", self.max_seq_len, "an integer >= 1")
        _check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "a positive number")
        _one_of("model.norm_backend", self.norm_backend, BACKENDS)
        _one_of("model.loss_backend", self.loss_backend, BACKENDS)
        _check(self.init_std > 0, "model.init_std", self.init_std, "a positive number (0 trains a dead model)")
        kinds = self.layer_types()
        if "kda" in kinds:
            self.kda.validate("model.kda")
        if "mla" in kinds:
            self.mla.validate("model.mla")
        if self.dense_layers < self.n_layers:
            self.moe.validate("model.moe")
        else:
            _check(self.moe.balancer == "none", "model.moe.balancer", self.moe.balancer,
                   f"'none': the model has no MoE layer (dense_layers={self.dense_layers} >= n_layers={self.n_layers})")
            _check(self.moe.router_z_loss == 0, "model.moe.router_z_loss", self.moe.router_z_loss,
                   f"0: the model has no MoE layer (dense_layers={self.dense_layers} >= n_layers={self.n_layers})")
        self.residual.validate(2 * self.n_layers, "model.residual")
        return self
