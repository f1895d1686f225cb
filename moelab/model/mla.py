"""Gated multi-head latent attention with no positional encoding (architecture.md, "Gated MLA").

    c_kv = RMSNorm(W_dkv x)                      [B, T, kv_latent_dim]   (the only thing cached)
    k, v = W_uk c_kv, W_uv c_kv                  [B, T, H, d_head]
    q    = W_q x  or  W_uq RMSNorm(W_dq x)       full rank (q_latent_dim = 0) or low rank
    o    = softmax(q k^T / sqrt(d_head) + causal) v      (NoPE: position comes from the KDA layers;
                                                        packed documents: causal within each document,
                                                        through flex_attention or a dense SDPA mask:
                                                        ``MLAConfig.mask_backend``)
    y    = W_o [ Sigmoid(W_g x) * o ]            output gate (output_gate=True), else W_o o

``fp32_output`` keeps ``o`` in fp32 through the gate and the output projection (K3 does so in
training) even under bf16 autocast; ``fp32_output_precision`` picks those matmuls' float32 precision
(``"high"``: TF32 tensor cores, forward and backward; ``"tf32x3"``: fp32 accuracy from three TF32 products).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from moelab.model.attnres import RMSNorm
from moelab.model.config import MLAConfig
from moelab.model.documents import Documents
from moelab.ops.fanout import fan_out

_COMPILED_FLEX: list = []


@contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """``torch.set_float32_matmul_precision(precision)`` for the block, the process's setting restored after it.
    Where the process set TF32 through torch's newer ``fp32_precision`` flags (which the older call cannot read
    back without raising), the block runs at the process's setting, untouched."""
    try:
        before = torch.get_float32_matmul_precision()
    except RuntimeError:
        yield
        return
    if before == precision:
        yield
        return
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


_TF32_MASK = -8192  # 0xFFFFE000 as int32: sign, exponent and the 10 mantissa bits a TF32 operand keeps


def tf32_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (fp32) as ``hi + lo``: ``hi`` its TF32 part (mantissa cut to 10 bits, exact as a TF32 operand) and
    ``lo = x - hi`` (exact in fp32, at most 2^-10 of ``|x|``)."""
    hi = (x.view(torch.int32) & _TF32_MASK).view(torch.float32)  # a same-size dtype view: any strides
    return hi, x - hi


def tf32x3_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (fp32 ``[M, K] @ [K, N]``) to about fp32 accuracy on TF32 tensor cores: with ``a = a_hi + a_lo`` and
    ``b = b_hi + b_lo`` (:func:`tf32_split`), ``a_lo b_hi + a_hi b_lo + a_hi b_hi`` as three TF32 GEMMs, the small
    products first and each added in the next GEMM's epilogue (``addmm``). The dropped ``a_lo b_lo`` and TF32's
    rounding of ``a_lo`` and ``b_lo`` are ~2^-21 of ``|a| |b|`` per product, against fp32's own 2^-24 (IEEE fp32
    SIMT GEMMs run several times slower on a Hopper GPU). On the CPU, which has no TF32, the three products are fp32.
    No autograd through it (the split has no gradient): ``fp32_linear`` wraps it with its own backward."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        raise ValueError("tf32x3_mm takes no autograd graph (its split has no gradient): call it under torch.no_grad()"
                         " or through fp32_linear(x, w, 'tf32x3'), which has its own backward")
    a_hi, a_lo = tf32_split(a)
    b_hi, b_lo = tf32_split(b)
    with matmul_precision("high"):
        out = a_lo @ b_hi
        out = torch.addmm(out, a_hi, b_lo)
        return torch.addmm(out, a_hi, b_hi)


def _mm(a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    """``a @ b`` of 2-D fp32 operands at ``precision`` ("highest", "high" or "tf32x3")."""
    if precision == "tf32x3":
        return tf32x3_mm(a, b)
    with matmul_precision(precision):
        return a @ b


class _Fp32Linear(torch.autograd.Function):
    """``F.linear(x, w)`` for fp32 ``x [..., K]`` and ``w [M, K]`` with every matmul, forward and backward, at
    ``precision`` (:func:`matmul_precision`, or "tf32x3": :func:`tf32x3_mm`): the backward runs outside the
    forward's block, so a plain F.linear would take the process's precision there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, precision: str) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.precision = precision
        x2 = x.reshape(-1, x.shape[-1])
        return _mm(x2, w.t(), precision).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dx = dw = None
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[0]:
            dx = _mm(dy2, w, ctx.precision).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = _mm(dy2.t(), x.reshape(-1, x.shape[-1]), ctx.precision)
        return dx, dw, None


def fp32_linear(x: torch.Tensor, w: torch.Tensor, precision: str = "highest") -> torch.Tensor:
    """``F.linear(x.float(), w.float())`` with its matmuls at ``precision`` ("highest": plain F.linear)."""
    x, w = x.float(), w.float()
    return F.linear(x, w) if precision == "highest" else _Fp32Linear.apply(x, w, precision)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """``softmax(q k^T / sqrt(Dh))`` over the keys ``block_mask`` keeps, times v: ``q, k, v [B, H, T, Dh]`` ->
    ``[B, H, T, Dh]``. On a GPU flex_attention's fused kernel (compiled once per shape; inside a compiled
    model dynamo traces it itself), which skips the masked tiles. On the CPU, where flex_attention has no
    backward, the reference: SDPA with the mask the block lists and the mask function describe
    (:func:`block_mask_reference`), so a CPU test checks the block mask itself."""
    if q.is_cuda:
        if torch.compiler.is_compiling():
            return flex_attention(q, k, v, block_mask=block_mask)
        if not _COMPILED_FLEX:
            _COMPILED_FLEX.append(torch.compile(flex_attention, dynamic=False))
        return _COMPILED_FLEX[0](q, k, v, block_mask=block_mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask_reference(block_mask))


def block_mask_reference(block_mask: BlockMask) -> torch.Tensor:
    """What flex_attention keeps under ``block_mask``, as a dense ``[B, 1, Q, KV]`` bool: every element of a full
    tile, the elements of a partial tile where its mask function holds, nothing elsewhere (the kernel's rule)."""
    B = block_mask.kv_num_blocks.shape[0]
    Q, KV = block_mask.seq_lengths
    bq, bkv = block_mask.BLOCK_SIZE

    def tiles(num: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor:
        if num is None:
            return torch.zeros(B, 1, Q, KV, dtype=torch.bool, device=block_mask.kv_num_blocks.device)
        t = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(bq, bkv)).to_dense().bool()  # [B, 1, nq, nkv]
        return t.repeat_interleave(bq, 2).repeat_interleave(bkv, 3)[:, :, :Q, :KV]

    dev = block_mask.kv_num_blocks.device
    b = torch.arange(B, device=dev)[:, None, None, None]
    q = torch.arange(Q, device=dev)[None, None, :, None]
    kv = torch.arange(KV, device=dev)[None, None, None, :]
    keep = block_mask.mask_mod(b, torch.zeros_like(b), q, kv)
    partial = tiles(block_mask.kv_num_blocks, block_mask.kv_indices)
    return (partial & keep) | tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)


class MLA(nn.Module):
    """Gated MLA token mixer, ``[B, T, D] -> [B, T, D]``, with a latent cache for decoding."""

    def __init__(self, d_model: int, cfg: MLAConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        H, Dh = cfg.num_heads, cfg.head_dim
        self.H, self.Dh = H, Dh
        if cfg.q_latent_dim > 0:
            self.q_down = nn.Linear(d_model, cfg.q_latent_dim, bias=False)
            self.q_norm = RMSNorm(cfg.q_latent_dim, eps=norm_eps)
            self.q_up = nn.Linear(cfg.q_latent_dim, H * Dh, bias=False)
        else:
            self.q_proj = nn.Linear(d_model, H * Dh, bias=False)
        self.kv_down = nn.Linear(d_model, cfg.kv_latent_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_latent_dim, eps=norm_eps)
        self.k_up = nn.Linear(cfg.kv_latent_dim, H * Dh, bias=False)
        self.v_up = nn.Linear(cfg.kv_latent_dim, H * Dh, bias=False)
        self.g_proj = nn.Linear(d_model, H * Dh, bias=False) if cfg.output_gate else None
        self.o_proj = nn.Linear(H * Dh, d_model, bias=False)
        # flex_attention's GPU kernel wants a power-of-two head size of at least 16 (tensor-core tiles).
        self._flex_shape = Dh >= 16 and Dh & (Dh - 1) == 0

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_latent_dim > 0:
            return self.q_up(self.q_norm(self.q_down(x)))
        return self.q_proj(x)

    def forward(
        self, x: torch.Tensor, cache: torch.Tensor | None = None, use_cache: bool = False,
        docs: Documents | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [B, T, D]`` -> ``(y [B, T, D], latent cache [B, T_past + T, kv_latent_dim] or None)``.

        Args:
            x: input (already normalized by the caller).
            cache: normalized latents ``c_kv`` of the previous tokens, ``[B, T_past, kv_latent_dim]``.
            use_cache: return the cache extended by this call's latents.
            docs: packed documents (``moelab.model.documents``): each query attends to the earlier
                keys of its own document only (``MLAConfig.mask_backend``: flex_attention's block mask,
                or SDPA with a ``[B, 1, T, T]`` mask). Not with a cache.
        """
        B, T, _ = x.shape
        H, Dh = self.H, self.Dh
        if docs is not None and (cache is not None or use_cache):
            raise ValueError("MLA: packed documents (docs) run without a cache: cache must be None and "
                             "use_cache False")
        gated16 = self.g_proj is not None and not self.cfg.fp32_output  # the gate reads x in 16 bits too
        xk, xq, *xg = fan_out(x, 3 if gated16 else 2)  # under autocast: x cast once for its projections
        c_kv = self.kv_norm(self.kv_down(xk))
        if cache is not None:
            c_kv = torch.cat([cache.to(c_kv.dtype), c_kv], dim=1)
        S = c_kv.shape[1]
        q = self._query(xq).view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_up(c_kv).view(B, S, H, Dh).transpose(1, 2)  # [B, H, S, Dh]
        v = self.v_up(c_kv).view(B, S, H, Dh).transpose(1, 2)
        past = S - T
        if docs is not None:
            if self.cfg.mask_backend == "flex" or (self.cfg.mask_backend == "auto" and x.is_cuda and self._flex_shape):
                o = document_attention(q, k, v, docs.block_mask())
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=docs.attention_mask())
        elif past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif T == 1:
            o = F.scaled_dot_product_attention(q, k, v)  # one new query sees every cached key
        else:
            # SDPA's is_causal aligns the mask top-left; with a cache the queries sit at the end.
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=past)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(1, 2).reshape(B, T, H * Dh)
        if self.cfg.fp32_output:
            prec = self.cfg.fp32_output_precision
            with torch.autocast(device_type=x.device.type, enabled=False):
                o = o.float()
                if self.g_proj is not None:
                    o = torch.sigmoid(fp32_linear(x, self.g_proj.weight, prec)) * o
                # Back to the stream's dtype (fp32 under autocast, bf16 in a bf16-cast model).
                y = fp32_linear(o, self.o_proj.weight, prec).to(x.dtype)
        else:
            if self.g_proj is not None:
                o = torch.sigmoid(self.g_proj(xg[0])) * o
            y = self.o_proj(o)
        return y, (c_kv if use_cache else None)
