"""Parameter and FLOP accounting from a ModelConfig alone (no tensors allocated).

Counts are analytic, mirroring the modules of ``moelab.model`` one by one; a test builds small
models and checks every component's count against ``sum(p.numel())`` of the real module, so the
formulas cannot drift from the code. That makes the K3-sized config (2.8T parameters) answer in
microseconds.

Conventions:
- ``activated`` = parameters a token's forward touches: everything except the routed experts
  it is not sent to. Embedding and LM head are included (as in the Kimi / DeepSeek reports);
  ``activated_non_embedding`` leaves both out.
- FLOPs count a multiply-add as 2. Forward FLOPs per token = 2 x (activated matmul weights,
  LM head included, embedding lookup excluded) + the sequence-mixing terms: causal softmax
  attention ``4 H d_head * (seq_len + 1) / 2`` per MLA layer (scores + values, mean context), and
  for KDA Kimi Linear's chunkwise count ``H (6 d^2 + 3 C d + C^2)`` per layer (kernels.md; d =
  head_dim, C = chunk_size) plus the short convolutions. Norms, softmaxes and gates are omitted
  (a few per cent at most). Training = 3 x forward (backward = 2 x forward).
"""

from __future__ import annotations

from moelab.model.config import KDAConfig, MLAConfig, ModelConfig, MoEConfig


def _kda_params(d: int, c: KDAConfig) -> int:
    hk = c.num_heads * c.head_dim
    return (
        3 * d * hk  # W_q, W_k, W_v
        + 3 * hk * c.conv_size  # depthwise ShortConv on q, k, v
        + d * c.num_heads  # W_beta
        + d * c.decay_rank + c.decay_rank * hk + hk  # W_down, W_up, b
        + c.num_heads  # A
        + d * hk  # output gate W_g
        + c.head_dim  # per-head output RMSNorm weight (shared by heads)
        + hk * d  # W_o
    )


def _mla_params(d: int, c: MLAConfig) -> int:
    hd = c.num_heads * c.head_dim
    q = d * hd if c.q_latent_dim == 0 else d * c.q_latent_dim + c.q_latent_dim + c.q_latent_dim * hd
    kv = d * c.kv_latent_dim + c.kv_latent_dim + 2 * c.kv_latent_dim * hd  # W_dkv, norm, W_uk, W_uv
    gate = d * hd if c.output_gate else 0
    return q + kv + gate + hd * d


def _glu_params(d_in: int, d_hidden: int) -> int:
    return 3 * d_in * d_hidden


def _moe_params(d: int, c: MoEConfig) -> dict[str, tuple[int, int]]:
    """Per-part ``(total, activated)`` of one LatentMoE layer."""
    width = c.latent_dim or d
    expert = _glu_params(width, c.expert_dim)
    shared = c.num_shared * _glu_params(d, c.shared_dim or c.expert_dim)
    latent = 2 * d * c.latent_dim + c.latent_dim if c.latent_dim else 0  # W_down, W_up, RMSNorm(l)
    router = c.num_experts * d
    return {
        "moe_router": (router, router),
        "moe_shared": (shared, shared),
        "moe_latent_proj": (latent, latent),
        "moe_routed": (c.num_experts * expert, c.top_k * expert),
    }


def param_counts(cfg: ModelConfig) -> dict:
    """Parameter counts of ``MoELab(cfg)`` without building it.

    Returns:
        ``total``, ``activated`` (per token), ``activated_non_embedding``, ``embedding``
        (input embedding + untied LM head), ``sparsity`` (= activated / total) and
        ``components``: ``{name: {"total": int, "activated": int}}`` for embedding, lm_head,
        kda, mla, dense_ffn, moe_router, moe_shared, moe_latent_proj, moe_routed, norms, attnres.
    """
    d, L = cfg.d_model, cfg.n_layers
    comp: dict[str, list[int]] = {}

    def add(name: str, total: int, activated: int | None = None) -> None:
        t, a = comp.setdefault(name, [0, 0])
        comp[name] = [t + total, a + (total if activated is None else activated)]

    add("embedding", cfg.vocab_size * d)
    add("lm_head", 0 if cfg.tie_embeddings else cfg.vocab_size * d)
    for i, kind in enumerate(cfg.layer_types()):
        if kind == "kda":
            add("kda", _kda_params(d, cfg.kda))
        else:
            add("mla", _mla_params(d, cfg.mla))
        add("norms", 2 * d)  # pre-norms of mixer and FFN
        if i < cfg.dense_layers:
            add("dense_ffn", _glu_params(d, cfg.ffn_dim()))
        else:
            for name, (t, a) in _moe_params(d, cfg.moe).items():
                add(name, t, a)
    add("norms", d)  # final norm
    add("attnres", 0 if cfg.residual.mode == "prenorm" else (2 * L + 1) * 2 * d)  # query + key-norm weight
    components = {k: {"total": v[0], "activated": v[1]} for k, v in comp.items()}
    total = sum(v["total"] for v in components.values())
    activated = sum(v["activated"] for v in components.values())
    embedding = components["embedding"]["total"] + components["lm_head"]["total"]
    return {
        "total": total,
        "activated": activated,
        "activated_non_embedding": activated - embedding,
        "embedding": embedding,
        "sparsity": activated / total,
        "components": components,
    }


def _matmul_weights(cfg: ModelConfig) -> int:
    """Activated weights used in matmuls per token (no embedding lookup, norms, convs, biases)."""
    counts = param_counts(cfg)["components"]
    skip = {"embedding", "norms", "attnres"}
    n = sum(v["activated"] for k, v in counts.items() if k not in skip)
    if cfg.tie_embeddings:  # the head still multiplies by the (shared) embedding matrix
        n += cfg.vocab_size * cfg.d_model
    kinds = cfg.layer_types()
    c = cfg.kda
    hk = c.num_heads * c.head_dim
    n -= kinds.count("kda") * (3 * hk * c.conv_size + hk + c.num_heads + c.head_dim)
    m = cfg.mla
    n -= kinds.count("mla") * (m.kv_latent_dim + m.q_latent_dim)
    if cfg.moe.latent_dim:
        n -= (len(kinds) - min(cfg.dense_layers, len(kinds))) * cfg.moe.latent_dim
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int, training: bool = False) -> float:
    """Forward FLOPs per token at context ``seq_len`` (x3 with ``training``); see module doc."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    kinds = cfg.layer_types()
    flops = 2.0 * _matmul_weights(cfg)
    m = cfg.mla
    flops += kinds.count("mla") * 4.0 * m.num_heads * m.head_dim * (seq_len + 1) / 2
    c = cfg.kda
    C = min(c.chunk_size, seq_len)
    per_head = 6 * c.head_dim**2 + 3 * C * c.head_dim + C**2
    flops += kinds.count("kda") * (c.num_heads * per_head + 2 * c.conv_size * 3 * c.num_heads * c.head_dim)
    return flops * (3 if training else 1)


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def summary(cfg: ModelConfig, seq_len: int | None = None, reference: dict | None = None) -> str:
    """A text table: per-component total / activated parameters, totals, FLOPs per token.

    ``reference``: optional ``{"total": float, "activated": float}`` (k3.yaml's ``k3_reference``)
    printed beside the counts with the relative difference.
    """
    seq_len = seq_len or cfg.max_seq_len
    pc = param_counts(cfg)
    kinds = cfg.layer_types()
    lines = [
        f"layers {cfg.n_layers} ({kinds.count('kda')} KDA + {kinds.count('mla')} MLA, "
        f"{min(cfg.dense_layers, cfg.n_layers)} dense FFN), d_model {cfg.d_model}, vocab {cfg.vocab_size}, "
        f"residual {cfg.residual.mode}",
        f"{'component':<18}{'total':>12}{'activated':>12}",
    ]
    for name, v in pc["components"].items():
        if v["total"]:
            lines.append(f"{name:<18}{_fmt(v['total']):>12}{_fmt(v['activated']):>12}")
    lines += [
        f"{'all':<18}{_fmt(pc['total']):>12}{_fmt(pc['activated']):>12}",
    ]
    if reference:
        ref_t, ref_a = float(reference["total"]), float(reference["activated"])
        lines.append(f"{'reference':<18}{_fmt(ref_t):>12}{_fmt(ref_a):>12}   (counted vs reference: "
                     f"{pc['total'] / ref_t - 1:+.1%} total, {pc['activated'] / ref_a - 1:+.1%} activated)")
    lines += [
        f"sparsity (activated / total) {pc['sparsity']:.4f}; activated without embeddings "
        f"{_fmt(pc['activated_non_embedding'])}",
        f"forward FLOPs/token at seq_len {seq_len}: {_fmt(flops_per_token(cfg, seq_len))} "
        f"(training x3: {_fmt(flops_per_token(cfg, seq_len, training=True))})",
    ]
    return "\n".join(lines)
