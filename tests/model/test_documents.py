"""Packed documents (``MoELab.forward(..., segment_ids=)``) against each document run alone.

Rows of several documents of uneven lengths (one token, fewer than the conv kernel, across the
16-token chunks, a document opening at a row's second token) must give, token for token, the
logits of each document fed on its own, and the same parameter gradients: no state, conv tap or
attention weight crosses a boundary. fp32 on CPU through the PyTorch KDA backend and the Triton
kernels in the interpreter: the training op (forward and backward) and the inference forward.
The ``gpu`` test repeats it in bf16 with the real kernels.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from moelab.model.documents import Documents, causal_conv_fix
from moelab.model.kda import ShortConv
from moelab.model.transformer import MoELab
from tests.helpers import assert_close
from tests.model.tiny import tiny_config

# Document lengths per row (each row sums to T = 40).
LENGTHS = [[13, 1, 3, 23], [1, 39], [40]]
T = 40
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def segments(lengths: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[n for n, size in enumerate(row) for _ in range(size)] for row in lengths])


def pieces(lengths: list[list[int]]):
    """``(row, start, end)`` of every document."""
    for b, row in enumerate(lengths):
        start = 0
        for size in row:
            yield b, start, start + size
            start += size


def build(kind: str, backend: str = "chunk", mask_backend: str = "auto", **kw) -> MoELab:
    patterns = {"hybrid": dict(pattern="KKKM"), "all_kda": dict(pattern="K", final_mla=False),
                "all_mla": dict(pattern="M")}
    torch.manual_seed(0)
    cfg = tiny_config(kda_backend=backend, **patterns[kind], **kw)
    return MoELab(replace(cfg, mla=replace(cfg.mla, mask_backend=mask_backend)).validate())


def packed_vs_alone(m: MoELab, grad: bool, tol: float) -> None:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 50, (len(LENGTHS), T), generator=gen)
    weights = torch.randn(len(LENGTHS), T, 50, generator=gen)  # a fixed random linear objective of the logits
    seg = segments(LENGTHS)
    with torch.set_grad_enabled(grad):
        packed = m(ids, segment_ids=seg).logits
        if grad:
            (packed * weights).sum().backward()
            g_packed = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
            m.zero_grad()
        alone = torch.zeros_like(packed)
        total = 0.0
        for b, s, e in pieces(LENGTHS):
            out = m(ids[b:b + 1, s:e]).logits
            alone[b, s:e] = out[0].detach()
            total = total + (out[0] * weights[b, s:e]).sum()
        if grad:
            total.backward()
            g_alone = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert_close(alone, packed.detach(), tol, "logits, packed vs each document alone")
    if grad:
        assert g_packed.keys() == g_alone.keys()
        for name in g_alone:
            assert_close(g_alone[name], g_packed[name], tol, f"grad {name}")


@pytest.mark.parametrize("mode", ["prenorm", "block_attnres"])
@pytest.mark.parametrize("kind", ["hybrid", "all_kda", "all_mla"])
def test_packed_equals_alone_torch(kind: str, mode: str) -> None:
    """PyTorch KDA backend, train mode (MoE routing is per token), outputs and every gradient."""
    packed_vs_alone(build(kind, mode=mode).train(), grad=True, tol=1e-5)


@pytest.mark.parametrize("kind", ["hybrid", "all_mla"])
def test_packed_equals_alone_flex(kind: str) -> None:
    """MLA through flex_attention's block mask (its eager reference on the CPU): outputs and every gradient."""
    packed_vs_alone(build(kind, mask_backend="flex").train(), grad=True, tol=1e-5)


def test_flex_equals_dense_mask() -> None:
    """The two MLA paths of packed documents agree, forward and every gradient (fp32, CPU)."""
    seg = segments(LENGTHS)
    ids = torch.randint(0, 50, (len(LENGTHS), T), generator=torch.Generator().manual_seed(2))
    out = {}
    for mask in ("dense", "flex"):
        m = build("all_mla", mask_backend=mask).train()
        logits = m(ids, segment_ids=seg).logits
        logits.square().mean().backward()
        out[mask] = logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert_close(out["dense"][0], out["flex"][0], 1e-6, "logits, flex vs dense")
    assert out["dense"][1].keys() == out["flex"][1].keys()
    for name, g in out["dense"][1].items():
        assert_close(g, out["flex"][1][name], 1e-5, f"grad {name}")


def test_flex_attention_kernel_keeps_the_block_mask() -> None:
    """torch's flex_attention (its eager forward: no CPU backward) under Documents.block_mask equals the reference
    document_attention uses on the CPU (SDPA with block_mask_reference), and the dense document mask."""
    from torch.nn.attention.flex_attention import flex_attention

    from moelab.model.mla import block_mask_reference, document_attention

    d = Documents.from_segment_ids(segments(LENGTHS))
    q, k, v = torch.randn(3, len(LENGTHS), 2, T, 8, generator=torch.Generator().manual_seed(4)).unbind(0)
    bm = d.block_mask(16)
    assert torch.equal(block_mask_reference(bm), d.attention_mask())
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=d.attention_mask())
    assert_close(ref, flex_attention(q, k, v, block_mask=bm), 1e-6, "flex_attention")
    assert_close(ref, document_attention(q, k, v, bm), 1e-6, "document_attention")


@pytest.mark.parametrize("lengths,block", [(LENGTHS, 16), (LENGTHS, 8), ([[32, 32], [5, 59], [64]], 16),
                                           ([[16, 16, 16, 16], [1, 63], [48, 16]], 16)],
                         ids=["uneven16", "uneven8", "aligned", "tile_edges"])
def test_block_mask_tiles(lengths: list[list[int]], block: int) -> None:
    """Documents.block_mask's tile lists against torch's create_block_mask of the dense predicate: the same
    tiles kept; a tile marked full holds no masked element; with T a multiple of the tile, the same full tiles."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    seg = segments(lengths)
    d = Documents.from_segment_ids(seg)
    dense = d.attention_mask()[:, 0]  # [B, T, T]
    B, n = seg.shape
    mine = d.block_mask(block)
    ref = create_block_mask(lambda b, h, q, kv: dense[b, q, kv], B, 1, n, n, device="cpu", BLOCK_SIZE=block)
    assert torch.equal(mine.to_dense(), ref.to_dense())  # partial and full tiles together
    full = BlockMask.from_kv_blocks(mine.full_kv_num_blocks, mine.full_kv_indices, BLOCK_SIZE=block).to_dense()
    nb = full.shape[-1]
    padded = torch.ones(B, nb * block, nb * block, dtype=torch.bool)  # positions past T: the kernel drops them
    padded[:, :n, :n] = dense
    every = padded.view(B, nb, block, nb, block).all(dim=(2, 4))  # [B, nb, nb] tiles with no masked element
    assert not (full[:, 0].bool() & ~every).any(), "a full tile holds a masked element"
    assert full.sum() > 0 or every.tril(-1).sum() == 0
    if n % block == 0:
        ref_full = BlockMask.from_kv_blocks(ref.full_kv_num_blocks, ref.full_kv_indices, BLOCK_SIZE=block)
        assert torch.equal(full, ref_full.to_dense())


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter on CPU tensors (the gpu test runs the kernels)")
@pytest.mark.parametrize("conv", ["torch", "triton"])
@pytest.mark.parametrize("grad", [True, False], ids=["training_op", "inference_forward"])
def test_packed_equals_alone_triton_interpreter(grad: bool, conv: str) -> None:
    """Triton KDA kernels in the interpreter: with a graph the training op (cu_seqlens forward and
    backward), without one the inference forward; the ShortConvs through torch plus the boundary fix, or
    through the Triton conv, which masks the taps by document in the same pass."""
    m = build("hybrid", backend="triton").train(grad)
    for layer in m.layers:
        if layer.kind == "kda":
            for c in (layer.mixer.q_conv, layer.mixer.k_conv, layer.mixer.v_conv):
                c.backend = conv
    packed_vs_alone(m, grad=grad, tol=1e-4)


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter on CPU tensors (the gpu test runs the kernels)")
def test_packed_equals_alone_with_the_other_kda_variants() -> None:
    """The training op with the other choice of every switch of ``triton_chunk.VARIANTS`` at once (the inference
    forward, the backward's chains one after the other) and the Triton conv."""
    from moelab.ops.kda.triton_chunk import VARIANTS, launch_overrides

    m = build("hybrid", backend="triton").train(True)
    for layer in m.layers:
        if layer.kind == "kda":
            for c in (layer.mixer.q_conv, layer.mixer.k_conv, layer.mixer.v_conv):
                c.backend = "triton"
    with launch_overrides(**{name: choices[-1] for name, choices in VARIANTS.items()}):
        packed_vs_alone(m, grad=True, tol=1e-4)


def test_one_document_per_row_is_the_plain_forward() -> None:
    m = build("hybrid").eval()
    ids = torch.randint(0, 50, (2, T))
    with torch.no_grad():
        plain = m(ids).logits
        same = m(ids, segment_ids=torch.full((2, T), 7)).logits
    assert torch.equal(plain, same)


def test_documents_layout() -> None:
    seg = torch.tensor([[0, 0, 0, 1, 1], [4, 4, 9, 4, 4]])
    d = Documents.from_segment_ids(seg)
    assert d.num_docs == 5 and not d.one_per_row
    assert d.cu_seqlens.tolist() == [0, 3, 5, 7, 8, 10]
    assert d.doc.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 2, 2]]  # a repeated id after another is a new document
    assert d.pos.tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 0, 1]]
    mask = d.attention_mask()[1, 0]
    assert mask[4].tolist() == [False, False, False, True, True] and mask[1].tolist() == [True, True, False, False,
                                                                                           False]
    rows, cols, pos = d.conv_fix(4)  # tokens < 3 into a document that opens inside its row
    assert list(zip(rows.tolist(), cols.tolist(), pos.tolist())) == [(0, 3, 0), (0, 4, 1), (1, 2, 0), (1, 3, 0),
                                                                     (1, 4, 1)]


def test_documents_counted_before_the_forward() -> None:
    """``cu_seqlens`` made beforehand (on the CPU batch) gives the documents and the model's output that counting
    them in the forward gives; it is refused without segment_ids, and in a shape that cannot be the offsets."""
    from moelab.ops.varlen import cu_seqlens

    seg = torch.tensor([[0, 0, 0, 1, 1], [4, 4, 9, 4, 4]])
    d, e = Documents.from_segment_ids(seg), Documents.from_segment_ids(seg, cu_seqlens(seg))
    assert torch.equal(d.cu_seqlens, e.cu_seqlens) and d.num_docs == e.num_docs == 5
    assert torch.equal(d.doc, e.doc) and torch.equal(d.pos, e.pos)
    m = build("hybrid").eval()
    ids = torch.randint(0, 50, (2, T))
    segs = torch.zeros(2, T, dtype=torch.long)
    segs[:, T // 3:] = 1
    with torch.no_grad():
        counted = m(ids, segment_ids=segs).logits
        given = m(ids, segment_ids=segs, cu_seqlens=cu_seqlens(segs)).logits
    assert torch.equal(counted, given)
    with pytest.raises(ValueError, match="cu_seqlens is only allowed with segment_ids"):
        m(ids, cu_seqlens=cu_seqlens(segs))
    with pytest.raises(ValueError, match=r"cu_seqlens must be \[N \+ 1\] int32 with N >= B = 2"):
        Documents.from_segment_ids(seg, torch.tensor([0, 10], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["chunk", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRET, reason="the Triton KDA op on CPU tensors needs the interpreter"))])
def test_offsets_padded_with_empty_documents_change_nothing(backend: str) -> None:
    """``pad_cu_seqlens`` (one shape of offsets for every batch, as a captured step needs): empty documents at the end
    leave the logits and every gradient as they are; a capacity below the documents is refused, naming both."""
    from moelab.ops.varlen import cu_seqlens, pad_cu_seqlens

    seg = segments(LENGTHS)
    cu = cu_seqlens(seg)
    padded = pad_cu_seqlens(cu, cu.numel() + 4)
    assert padded.tolist() == cu.tolist() + [cu[-1].item()] * 5 and padded.dtype == torch.int32
    ids = torch.randint(0, 50, (len(LENGTHS), T), generator=torch.Generator().manual_seed(3))
    out = {}
    for name, offsets in (("counted", cu), ("padded", padded)):
        m = build("hybrid", backend=backend).train()
        logits = m(ids, segment_ids=seg, cu_seqlens=offsets).logits
        logits.square().mean().backward()
        out[name] = (logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert_close(out["counted"][0], out["padded"][0], 1e-5, "logits, padded offsets")
    for n, g in out["counted"][1].items():
        assert_close(g, out["padded"][1][n], 1e-5, f"grad {n}, padded offsets")
    with pytest.raises(ValueError, match=r"7 documents do not fit capacity=6"):
        pad_cu_seqlens(cu, 6)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRET, reason="the Triton conv on CPU tensors needs the interpreter"))])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_fix_equals_conv_per_document(activation: str | None, backend: str) -> None:
    """torch: the conv, then the boundary fix (``causal_conv_fix``); triton: the taps masked by ``Documents.pos``
    in the conv kernel itself, forward and backward."""
    conv = ShortConv(6, 4, backend=backend)
    x = torch.randn(3, T, 6, requires_grad=True)
    y, _ = conv(x, activation=activation, docs=Documents.from_segment_ids(segments(LENGTHS)))
    w = torch.randn_like(y)
    (y * w).sum().backward()
    gx, gw = x.grad.clone(), conv.weight.grad.clone()
    x.grad = None
    conv.weight.grad = None
    ref = torch.zeros_like(y)
    total = 0.0
    for b, s, e in pieces(LENGTHS):
        out, _ = conv(x[b:b + 1, s:e], activation=activation)
        ref[b, s:e] = out[0].detach()
        total = total + (out[0] * w[b, s:e]).sum()
    total.backward()
    assert_close(ref, y.detach(), 1e-6, "conv output")
    assert_close(x.grad, gx, 1e-6, "dx")
    assert_close(conv.weight.grad, gw, 1e-6, "dweight")


def test_conv_fix_sums_in_fp32_under_autocast() -> None:
    """The recomputed boundary outputs are summed in fp32 under bf16 autocast too (einsum would run in bf16)."""
    d = Documents.from_segment_ids(segments(LENGTHS))
    gen = torch.Generator().manual_seed(6)
    x, y, w = torch.randn(3, T, 6, generator=gen), torch.randn(3, T, 6, generator=gen), torch.randn(6, 4, generator=gen)
    plain = causal_conv_fix(y, x, w, d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = causal_conv_fix(y, x, w, d)
    assert under.dtype == torch.float32 and torch.equal(under, plain)
    assert not torch.equal(plain, y)  # the boundary tokens were recomputed


def test_conv_fix_no_boundary_returns_input() -> None:
    y = torch.randn(2, 5, 3)
    d = Documents.from_segment_ids(torch.zeros(2, 5, dtype=torch.long))
    assert causal_conv_fix(y, y, torch.randn(3, 4), d) is y


def test_bad_segment_ids_name_the_value() -> None:
    m = build("hybrid").eval()
    ids = torch.randint(0, 50, (2, 8))
    with pytest.raises(ValueError, match=r"segment_ids shape \(2, 7\) must equal input_ids shape \(2, 8\)"):
        m(ids, segment_ids=torch.zeros(2, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor, got dtype torch.float32"):
        m(ids, segment_ids=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="not allowed with state or use_cache"):
        m(ids, segment_ids=torch.zeros(2, 8, dtype=torch.long), use_cache=True)


def gpu_model(mask_backend: str = "auto") -> MoELab:
    cfg = tiny_config(kda_backend="auto", max_seq_len=4096)
    cfg = replace(cfg, kda=replace(cfg.kda, num_heads=4, head_dim=128, chunk_size=64),
                  mla=replace(cfg.mla, num_heads=2, head_dim=64, mask_backend=mask_backend)).validate()
    torch.manual_seed(0)
    return MoELab(cfg).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [True, False], ids=["training_op", "inference_forward"])
def test_packed_equals_alone_bf16_gpu(grad: bool) -> None:
    """bf16 autocast, real KDA head size, the Triton conv and kernels: 6 uneven documents in each of
    2 rows of 1500 tokens against each document alone."""
    m = gpu_model().train(grad)
    lengths = [[700, 1, 3, 250, 400, 146], [64, 1000, 17, 2, 300, 117]]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 1500), generator=gen).cuda()
    seg = segments(lengths).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        packed = m(ids, segment_ids=seg).logits.float()
        alone = torch.cat([torch.cat([m(ids[b:b + 1, s:e]).logits.float() for _, s, e in
                                      (p for p in pieces(lengths) if p[0] == b)], dim=1) for b in range(2)])
    assert_close(alone.detach(), packed.detach(), 2e-2, "logits, bf16, packed vs alone")


@pytest.mark.gpu
def test_flex_equals_dense_bf16_gpu() -> None:
    """On a GPU the MLA layers of packed documents take compiled flex_attention: equal to the dense SDPA mask
    in bf16 (logits and every gradient), 6 uneven documents per row of 1500 tokens (a partial last tile)."""
    lengths = [[700, 1, 3, 250, 400, 146], [64, 1000, 17, 2, 300, 117]]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 1500), generator=gen).cuda()
    seg = segments(lengths).cuda()
    out = {}
    for mask in ("dense", "flex"):
        m = gpu_model(mask).train()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(ids, segment_ids=seg).logits.float()
        logits.square().mean().backward()
        out[mask] = logits.detach(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}
    assert_close(out["dense"][0], out["flex"][0], 2e-2, "logits, flex vs dense, bf16")
    for name, g in out["dense"][1].items():
        assert_close(g, out["flex"][1][name], 5e-2, f"grad {name}, bf16")
