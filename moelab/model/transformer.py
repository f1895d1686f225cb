"""The hybrid stack: KDA and gated-MLA mixers, dense / LatentMoE FFNs, a chosen residual mode.

One forward pass, top to bottom (``MoELab.forward``)::

    x = Embed(ids)                                        [B, T, D]
    for each layer i (kind from cfg.layer_types()):
        h = stream.read(2i);    stream.write(2i,   Mixer(RMSNorm(h)))     KDA or MLA
        h = stream.read(2i+1);  stream.write(2i+1, FFN(RMSNorm(h)))       GLUFFN or LatentMoE
    logits = LMHead(RMSNorm(stream.read_final()))         [B, T, vocab]

``stream`` is the residual mode of ``cfg.residual`` (``moelab.model.attnres``): the running sum
for ``prenorm``, a softmax over depth for the AttnRes modes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from moelab.model.attnres import AttnResidual
from moelab.model.config import ModelConfig
from moelab.model.documents import Documents
from moelab.model.ffn import GLUFFN
from moelab.model.kda import KDALayer, KDAState
from moelab.model.mla import MLA
from moelab.model.moe import LatentMoE
from moelab.model.norm import RMSNorm
from moelab.ops.linear_ce import linear_cross_entropy


@dataclass
class ModelState:
    """Decoding state of the whole stack.

    Attributes:
        layers: per layer, a :class:`KDAState` (KDA) or the latent cache ``[B, T_seen,
            kv_latent_dim]`` (MLA).
        seq_len: tokens seen so far (checked against ``max_seq_len``).
    """

    layers: list[KDAState | torch.Tensor | None]
    seq_len: int = 0


@dataclass
class ModelOutput:
    """What ``MoELab.forward`` returns.

    Attributes:
        logits: ``[B, T, vocab]`` in the compute dtype; None for a forward with targets and
            ``return_logits=False`` (the loss then comes from ``linear_cross_entropy``).
        loss: mean next-token cross-entropy (fp32) over targets != -100, or None without targets.
        aux_loss: scalar, the sum of the MoE layers' auxiliary terms (zero without MoE / balancer).
        router_stats: one ``RouterStats`` per MoE layer, in layer order.
        state: the decoding state after the last token when ``use_cache``, else None.
        diagnostics: with ``return_diagnostics``: ``depth_weights`` (list, per residual read, mean
            weight per source ``[n_sources]``; AttnRes modes only), ``hidden_rms``
            ``[2 n_layers + 1]`` (RMS of each sublayer's input ``h_l``, last = final read),
            ``output_rms`` ``[2 n_layers]`` (RMS of each sublayer output) and ``g_min`` /
            ``g_mean`` (per KDA layer, of the log decay).
    """

    logits: torch.Tensor | None
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_stats: list = field(default_factory=list)
    state: ModelState | None = None
    diagnostics: dict | None = None


@dataclass
class PrefillChunk:
    """One piece of a chunked prefill (what ``MoELab.prefill_chunks`` yields).

    Attributes:
        start: index in ``input_ids`` of the piece's first token (0 for the first piece).
        logits: ``[B, c, vocab]`` logits of the piece's c tokens, in the compute dtype.
        token_loss: ``[B, c]`` fp32 next-token cross-entropy per token (0 where the target is
            -100), or None without targets.
        state: the decoding state after the piece's last token.
    """

    start: int
    logits: torch.Tensor
    token_loss: torch.Tensor | None
    state: ModelState


@dataclass
class PrefillOutput:
    """What ``MoELab.prefill`` returns.

    Attributes:
        state: the decoding state after the last token (for ``forward(..., state=)``, decoding, or
            another ``prefill(..., state=)``).
        last_logits: ``[B, vocab]`` logits at the last position (the next token's distribution).
        token_loss: ``[B, T]`` fp32 next-token cross-entropy per token (0 where the target is -100),
            or None without targets.
        loss: fp32 scalar, the mean of ``token_loss`` over targets != -100 (as ``forward``'s loss;
            NaN when every target is -100), or None without targets.
    """

    state: ModelState
    last_logits: torch.Tensor
    token_loss: torch.Tensor | None = None
    loss: torch.Tensor | None = None


PREFILL_CHUNK = 1024  # default tokens per prefill piece: bounds the [chunk, vocab] logits and activations


class Layer(nn.Module):
    """One layer: a token mixer and an FFN, each with its own pre-norm."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        d, eps = cfg.d_model, cfg.norm_eps
        self.kind = cfg.layer_types()[index]
        self.mixer_norm = RMSNorm(d, eps=eps)
        self.mixer = KDALayer(d, cfg.kda, eps) if self.kind == "kda" else MLA(d, cfg.mla, eps)
        self.ffn_norm = RMSNorm(d, eps=eps)
        self.is_moe = index >= cfg.dense_layers
        if self.is_moe:
            self.ffn = LatentMoE(d, cfg.moe, eps)
        else:
            self.ffn = GLUFFN(d, cfg.ffn_dim(), cfg.dense_activation, cfg.moe.situ_beta1, cfg.moe.situ_beta2,
                              cfg.moe.backend)


class MoELab(nn.Module):
    """Hybrid KDA / gated-MLA language model with (Latent)MoE FFNs. Plain ``torch.nn``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg.validate()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.n_layers))
        self.residual = AttnResidual(cfg.d_model, 2 * cfg.n_layers, cfg.residual, cfg.norm_eps)
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        for m in self.modules():  # every norm of the stack runs the configured backend
            if isinstance(m, RMSNorm):
                m.backend = cfg.norm_backend
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Model-wide init, then the component-specific ones.

        Linear / Embedding weights ~ N(0, init_std), biases 0. The projections that write into
        the residual stream are scaled by ``1 / sqrt(2 n_layers)``: each mixer's ``o_proj``, the
        dense FFN's ``down``, and in LatentMoE those its ``init_weights(std, out_scale)`` names
        (``proj_up`` or ``w_out``, shared ``down``; it also inits the stacked expert tensors and
        the router). Then KDA decay parameters (``KDALayer.reset_gate_parameters``) and AttnRes
        pseudo-queries 0.
        """
        std = self.cfg.init_std
        out_scale = 1.0 / math.sqrt(2 * self.cfg.n_layers)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for layer in self.layers:
            layer.mixer.o_proj.weight.mul_(out_scale)
            if layer.is_moe:
                layer.ffn.init_weights(std=std, out_scale=out_scale)
            else:
                layer.ffn.down.weight.mul_(out_scale)
            if layer.kind == "kda":
                layer.mixer.reset_gate_parameters()
        for depth in self.residual.depth:
            depth.query.zero_()

    def _check(self, input_ids: torch.Tensor, targets: torch.Tensor | None, past: int, check_ids: bool) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"input_ids must be a [B, T] long tensor, got shape {tuple(input_ids.shape)} "
                             f"dtype {input_ids.dtype}")
        T = input_ids.shape[1]
        if T < 1:
            raise ValueError("input_ids has T=0 tokens: expected T >= 1")
        if past + T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {past + T} (cached {past} + new {T}) exceeds "
                             f"max_seq_len={self.cfg.max_seq_len}")
        if check_ids:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} out of range: expected 0 <= id < vocab_size={self.cfg.vocab_size}")
        if targets is not None and targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} must equal input_ids shape "
                             f"{tuple(input_ids.shape)}")

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        state: ModelState | None = None,
        use_cache: bool = False,
        return_diagnostics: bool = False,
        return_logits: bool = True,
        check_ids: bool = True,
        segment_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Logits (and loss) for ``input_ids [B, T]`` long.

        Args:
            input_ids: token ids in ``[0, vocab_size)``.
            targets: ``[B, T]`` long next-token targets, ``-100`` = ignore; None: no loss.
            state: state after earlier tokens of the same sequences (from a previous call with
                ``use_cache=True``); None: the sequences start here.
            use_cache: return the state after the last token (for chunked prefill / decoding).
            return_diagnostics: fill ``ModelOutput.diagnostics`` (detached, cheap reductions).
            return_logits: False (with targets): the loss without the ``[B, T, vocab]`` logits,
                chunk by chunk (``moelab.ops.linear_ce``; what training uses), and ``logits=None``.
            check_ids: check that every id is in ``[0, vocab_size)`` (a host sync; a training loop
                that trusts its data passes False).
            segment_ids: ``[B, T]`` integer, the document number of each token within its row, for
                rows of packed documents (``moelab.model.documents``): every token mixer keeps the
                documents apart, equal to running each document alone. None: each row is one
                sequence. Not with ``state`` or ``use_cache``; one host sync (to count documents), unless
                ``cu_seqlens`` comes with them.
            cu_seqlens: ``[N + 1]`` int32, the offsets of ``segment_ids``' N documents in the flattened ``B * T``
                order (``moelab.ops.varlen.cu_seqlens``), made where counting them costs no sync (the CPU batch);
                only with ``segment_ids``.
        """
        past = state.seq_len if state is not None else 0
        self._check(input_ids, targets, past, check_ids)
        docs = None
        if cu_seqlens is not None and segment_ids is None:
            raise ValueError("cu_seqlens is only allowed with segment_ids (the documents it gives the offsets of)")
        if segment_ids is not None:
            if segment_ids.shape != input_ids.shape:
                raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} must equal input_ids shape "
                                 f"{tuple(input_ids.shape)}")
            if state is not None or use_cache:
                raise ValueError("segment_ids (packed documents) is not allowed with state or use_cache: decode "
                                 "or prefill one document per row")
            docs = Documents.from_segment_ids(segment_ids, cu_seqlens)
            if docs.one_per_row:
                docs = None
        prev = state.layers if state is not None else [None] * len(self.layers)
        stream = self.residual.stream(self.embed(input_ids), diagnostics=return_diagnostics)
        decay: list[torch.Tensor] = []  # per KDA layer, with return_diagnostics: (min, mean) of the log decay
        new_layers: list = []
        router_stats: list = []
        aux_loss = self.embed.weight.new_zeros((), dtype=torch.float32)
        for i, layer in enumerate(self.layers):
            h = layer.mixer_norm(stream.read(2 * i))
            if return_diagnostics and layer.kind == "kda":
                decay.append(layer.mixer.decay_stats(h))
            out, st = layer.mixer(h, prev[i], use_cache, docs=docs)
            new_layers.append(st)
            stream.write(2 * i, out)
            h = layer.ffn_norm(stream.read(2 * i + 1))
            if layer.is_moe:
                out, stats = layer.ffn(h)
                router_stats.append(stats)
                aux_loss = aux_loss + stats.aux_loss.float()
            else:
                out = layer.ffn(h)
            stream.write(2 * i + 1, out)
        h = self.norm(stream.read_final())
        logits = loss = None
        if targets is not None and not return_logits:
            loss = linear_cross_entropy(h.flatten(0, 1), self.lm_head.weight, targets.flatten(), ignore_index=-100,
                                        backend=self.cfg.loss_backend)
        else:
            logits = self.lm_head(h)
            if targets is not None:
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
        diagnostics = stream.diagnostics()
        if diagnostics is not None:
            if decay:
                diagnostics["g_min"], diagnostics["g_mean"] = torch.stack(decay).unbind(1)
        return ModelOutput(
            logits=logits,
            loss=loss,
            aux_loss=aux_loss,
            router_stats=router_stats,
            state=ModelState(new_layers, past + input_ids.shape[1]) if use_cache else None,
            diagnostics=diagnostics,
        )

    @contextmanager
    def _eval_mode(self) -> Iterator[None]:
        """Eval mode for the block (routing counts go to the balancer's eval statistics, not the training
        step's), then the mode as before."""
        was_training = self.training
        self.eval()
        try:
            yield
        finally:
            self.train(was_training)

    def prefill_chunks(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        chunk_size: int = PREFILL_CHUNK,
        state: ModelState | None = None,
        check_ids: bool = True,
    ) -> Iterator[PrefillChunk]:
        """Run ``input_ids [B, T]`` through the model ``chunk_size`` tokens at a time, carrying the
        decoding state (KDA recurrent state and conv tails, MLA latent cache), and yield each piece's
        logits and per-token loss as soon as it is computed.

        Equal to one ``forward`` over the whole sequence (tested), but the memory of a piece is
        bounded by ``chunk_size``: its activations and ``[B, chunk_size, vocab]`` logits, and MLA
        scores ``[B, H, chunk_size, T_seen]`` (``F.scaled_dot_product_attention``); what grows with T
        is only the MLA latent cache (``B T kv_latent_dim`` per MLA layer; the KDA state is
        ``B H K V`` per layer whatever T), never ``T^2`` or ``T vocab``. No gradients; the model is
        in eval mode while each piece runs (then as before). With ``kda.backend`` auto / triton on a
        GPU the KDA layers run the inference forward (``moelab.ops.kda.kda_path``).

        Args:
            input_ids: ``[B, T]`` long token ids in ``[0, vocab_size)``.
            targets: ``[B, T]`` long next-token targets (``-100`` = ignore), or None (no loss).
            chunk_size: tokens per piece (>= 1); the last piece may be shorter.
            state: the state after earlier tokens of the same sequences (from ``prefill`` or a
                ``forward(..., use_cache=True)``), or None: the sequences start here.
            check_ids: check every id once up front (one host sync).

        Yields:
            One :class:`PrefillChunk` per piece, in order; each holds the state after its last token.
        """
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} is not allowed: expected an int >= 1")
        self._check(input_ids, targets, state.seq_len if state is not None else 0, check_ids)
        T = input_ids.shape[1]
        for start in range(0, T, chunk_size):
            piece = slice(start, start + chunk_size)
            with torch.no_grad(), self._eval_mode():
                out = self(input_ids[:, piece], state=state, use_cache=True, check_ids=False)
                token_loss = None
                if targets is not None:
                    tgt = targets[:, piece]
                    token_loss = F.cross_entropy(out.logits.float().flatten(0, 1), tgt.flatten(), ignore_index=-100,
                                                 reduction="none").view(tgt.shape)
            state = out.state
            yield PrefillChunk(start=start, logits=out.logits, token_loss=token_loss, state=state)

    def prefill(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        chunk_size: int = PREFILL_CHUNK,
        state: ModelState | None = None,
        check_ids: bool = True,
    ) -> PrefillOutput:
        """Chunked prefill of ``input_ids [B, T]``: the state after the last token, the logits at the
        last position and, with targets, the per-token and mean loss. Arguments and memory as for
        :meth:`prefill_chunks` (which yields every piece's logits, for callers that need them);
        here the pieces' logits are dropped as soon as their loss is taken.
        """
        token_losses: list[torch.Tensor] = []
        for piece in self.prefill_chunks(input_ids, targets, chunk_size=chunk_size, state=state, check_ids=check_ids):
            if piece.token_loss is not None:
                token_losses.append(piece.token_loss)
            last = piece
        if targets is None:
            return PrefillOutput(state=last.state, last_logits=last.logits[:, -1])
        token_loss = torch.cat(token_losses, dim=1)
        loss = token_loss.sum() / (targets != -100).sum()
        return PrefillOutput(state=last.state, last_logits=last.logits[:, -1], token_loss=token_loss, loss=loss)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        *,
        prefill_chunk: int | None = None,
        return_logits: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Sample ``max_new_tokens`` after ``input_ids [B, T]``: prefill, then cached decoding.

        Args:
            temperature: softmax temperature; ``<= 0`` picks the argmax (greedy).
            top_k: sample among the k most likely tokens only; None: all.
            generator: RNG for sampling (reproducible generations).
            prefill_chunk: prefill the prompt in pieces of this many tokens (:meth:`prefill`,
                bounds the memory of long prompts); None: one piece.
            return_logits: also return the logits each new token was sampled from.

        Returns:
            ``[B, T + max_new_tokens]`` long; with ``return_logits`` also ``[B, max_new_tokens, vocab]``.
        """
        B, T = input_ids.shape
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if T + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt {T} + max_new_tokens {max_new_tokens} exceeds max_seq_len={self.cfg.max_seq_len}")
        if top_k is not None and not 1 <= top_k <= self.cfg.vocab_size:
            raise ValueError(f"top_k={top_k} must be in 1..vocab_size ({self.cfg.vocab_size})")
        with self._eval_mode():
            pre = self.prefill(input_ids, chunk_size=prefill_chunk or T)
            state, logits = pre.state, pre.last_logits
            tokens, seen = [input_ids], []
            for i in range(max_new_tokens):
                seen.append(logits)
                nxt = self._sample(logits, temperature, top_k, generator)
                tokens.append(nxt)
                if i + 1 < max_new_tokens:
                    out = self(nxt, state=state, use_cache=True, check_ids=False)
                    state, logits = out.state, out.logits[:, -1]
        ids = torch.cat(tokens, dim=1)
        if return_logits:
            empty = input_ids.new_zeros(B, 0, self.cfg.vocab_size, dtype=torch.float32)
            return ids, (torch.stack(seen, dim=1) if seen else empty)
        return ids

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> torch.Tensor:
        """Next token ``[B, 1]`` from ``logits [B, vocab]``."""
        if temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits.float() / temperature
        if top_k is not None:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
