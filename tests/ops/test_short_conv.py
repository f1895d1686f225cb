"""Triton causal depthwise conv (moelab/ops/short_conv.py) against its PyTorch reference, forward
and gradients; CPU runs use the Triton interpreter (tests/conftest.py), so shapes stay small."""

from __future__ import annotations

import pytest
import torch

from moelab.ops.short_conv import causal_conv1d, causal_conv1d_torch
from tests.helpers import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (B, T, C, W, dtype): T shorter than the taps, T and C not multiples of the blocks, fp16
CASES = [
    (1, 2, 8, 4, torch.float32),
    (2, 37, 40, 4, torch.float32),
    (1, 50, 24, 3, torch.float16),
    (2, 33, 16, 1, torch.float32),
]


def _run(fn, x, w, act, dy):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = fn(x, w, act)
    (y.float() * dy).sum().backward()
    return y, x.grad, w.grad


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}C{c[2]}W{c[3]}-{str(c[4])[6:]}")
def test_matches_reference(case, act):
    B, T, C, W, dtype = case
    gen = torch.Generator().manual_seed(T * 100 + C + W)
    x = torch.randn(B, T, C, generator=gen).to(DEV, dtype)
    w = (torch.rand(C, W, generator=gen) - 0.5).to(DEV)
    dy = torch.randn(B, T, C, generator=gen).to(DEV)
    ref = _run(causal_conv1d_torch, x.float(), w, act, dy)
    out = _run(causal_conv1d, x, w, act, dy)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert out[0].dtype == dtype
    for name, a, b in zip(("y", "dx", "dw"), ref, out):
        assert_close(a, b.float(), tol, name)


def test_short_conv_layer_paths_agree():
    """The KDA layer's ShortConv gives the same output, new tail and gradients on both paths."""
    from moelab.model.kda import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(12, 4).to(DEV)
    x = torch.randn(2, 9, 12, device=DEV)
    outs = {}
    for backend in ("torch", "triton"):
        conv.backend = backend
        xi = x.clone().requires_grad_()
        y, tail = conv(xi)
        y.square().sum().backward()
        outs[backend] = (y, tail, xi.grad, conv.weight.grad.clone())
        conv.weight.grad = None
    for a, b in zip(outs["torch"], outs["triton"]):
        assert_close(a, b, 1e-5, "ShortConv")


def test_bad_arguments_raise():
    x = torch.randn(1, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="activation='gelu'"):
        causal_conv1d(x, torch.randn(8, 4, device=DEV), "gelu")
    with pytest.raises(ValueError, match=r"weight must be \[C, W\] with C = 8"):
        causal_conv1d(x, torch.randn(6, 4, device=DEV))
    with pytest.raises(ValueError, match=r"x must be \[B, T, C\]"):
        causal_conv1d(x[0], torch.randn(8, 4, device=DEV))
    with pytest.raises(ValueError, match=r"pos must be an int32/int64 \[B, T\] = \(1, 4\) tensor"):
        causal_conv1d(x, torch.randn(8, 4, device=DEV), pos=torch.zeros(1, 5, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match=r"pos must be an int32/int64"):
        causal_conv1d(x, torch.randn(8, 4, device=DEV), pos=torch.zeros(1, 4, device=DEV))


def test_model_conv_backends_agree():
    """The tiny model with ``model.kda.conv_backend=triton``: the same loss and gradients as with
    the torch convolution, and prefill-then-decode still equals the full forward."""
    from moelab.config import load_config
    from moelab.model import MoELab

    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEV)
    runs = {}
    for backend in ("torch", "triton"):
        cfg = load_config("tiny", {"model.kda.conv_backend": backend})
        torch.manual_seed(0)
        model = MoELab(cfg.model).to(DEV)
        loss = model(x, x).loss
        loss.backward()
        runs[backend] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert_close(runs["torch"][0], runs["triton"][0], 1e-6, "loss")
    for n, g in runs["torch"][1].items():
        assert_close(g, runs["triton"][1][n], 1e-4, n)
    # the first prefill chunk takes the Triton conv (no tail), later chunks and decoding the torch one
    model.eval()
    ids, logits = model.generate(x[:, :10], 5, temperature=0, prefill_chunk=4, return_logits=True)
    with torch.no_grad():
        full = model(ids).logits
    assert_close(full[:, 9:14], logits, 1e-5, "decoded vs full-forward logits")


@pytest.mark.gpu
@pytest.mark.parametrize("slide", [False, True], ids=["tile_bwd", "one_pass_bwd"])
@pytest.mark.parametrize("act", [None, "silu"])
def test_bf16_on_gpu(act, slide, monkeypatch):
    """bf16 at a model size (B8 T4096 C1024, the fla-shape layer) on the GPU's real kernels, both backwards."""
    from moelab.ops import short_conv

    monkeypatch.setattr(short_conv, "BWD_SLIDE", slide)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 4096, 1024, generator=gen).to(DEV, torch.bfloat16)
    w = (torch.rand(1024, 4, generator=gen) - 0.5).to(DEV)
    dy = torch.randn(8, 4096, 1024, generator=gen).to(DEV)
    ref = _run(causal_conv1d_torch, x.float(), w, act, dy)
    out = _run(causal_conv1d, x, w, act, dy)
    for name, a, b in zip(("y", "dx", "dw"), ref, out):
        assert_close(a, b.float(), 1e-2, name)


def test_auto_backend_takes_triton_only_on_cuda(monkeypatch):
    """``conv_backend="auto"`` (the default) runs the Triton conv on CUDA tensors and the torch
    conv on CPU ones; an unknown backend is refused with the allowed values."""
    import moelab.ops.short_conv as sc
    from moelab.config import load_config
    from moelab.model.kda import ShortConv

    calls = []
    orig = sc.causal_conv1d
    monkeypatch.setattr(sc, "causal_conv1d", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    conv = ShortConv(16, 4).to(DEV)
    assert conv.backend == load_config("tiny").model.kda.conv_backend == "auto"
    x = torch.randn(2, 9, 16, device=DEV)
    y, _ = conv(x)
    assert len(calls) == (1 if DEV == "cuda" else 0)
    conv.backend = "torch"
    assert_close(conv(x)[0], y, 1e-5, "auto vs torch")
    with pytest.raises(ValueError, match="'cudnn'.*auto"):
        load_config("tiny", {"model.kda.conv_backend": "cudnn"})


def _backward_kernels_agree(act, monkeypatch, flag: str, seed: int, starts: list[int], dw_tol: float) -> None:
    """x, w, dy at B2 T45 C24 with ``short_conv.<flag>`` False and True, with the documents starting at ``starts``
    and without: dx equal, dw equal (``dw_tol`` 0) or within ``dw_tol``; without documents both against the fp32
    reference too."""
    from moelab.ops import short_conv

    B, T, C = 2, 45, 24
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(DEV)
    w = (torch.rand(C, 4, generator=gen) - 0.5).to(DEV)
    dy = torch.randn(B, T, C, generator=gen).to(DEV)
    pos = torch.stack([torch.arange(T) - torch.tensor([max(s for s in starts if s <= t) for t in range(T)])] * B)
    for p in (None, pos.to(DEV)):
        grads = {}
        for on in (False, True):
            monkeypatch.setattr(short_conv, flag, on)
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            (causal_conv1d(xi, wi, act, pos=p) * dy).sum().backward()
            grads[on] = (xi.grad, wi.grad)
        if DEV == "cpu" or flag != "BWD_SLIDE":  # the interpreter: the same terms in the same order
            assert torch.equal(grads[True][0], grads[False][0])
        else:  # compiled, the one-pass kernel contracts its multiply-adds its own way (H100: equal to 4 digits shown,
            assert_close(grads[False][0], grads[True][0], 1e-6, "dx")  # not in every bit)
        if dw_tol:
            assert_close(grads[False][1], grads[True][1], dw_tol, "dw")
        else:
            assert torch.equal(grads[True][1], grads[False][1])
        if p is None:
            ref = _run(causal_conv1d_torch, x, w, act, dy)
            assert_close(ref[1], grads[True][0], 1e-5, "dx")
            assert_close(ref[2], grads[True][1], 1e-5, "dw")


@pytest.mark.parametrize("act", [None, "silu"])
def test_four_tap_backward_matches_the_generic_kernel(act, monkeypatch):
    """The 4-tap backward (each of the 7 x tiles loaded once) gives exactly the generic kernel's dx and dw, with packed
    documents (a tap across a document start reads zero) and without; both against the fp32 reference too."""
    from moelab.ops import short_conv

    monkeypatch.setattr(short_conv, "BWD_SLIDE", False)
    _backward_kernels_agree(act, monkeypatch, "BWD_TAPS4", 4, [0, 2, 3, 17, 40], 0.0)  # documents of 2, 1, 14, 23, 5


@pytest.mark.parametrize("act", [None, "silu"])
def test_one_pass_backward_matches_the_tile_kernel(act, monkeypatch):
    """The one-pass 4-tap backward (``BWD_SLIDE``: each x and dy row loaded once, the pre-activation formed once per
    row) gives the tile kernel's dx exactly in the interpreter (the same terms in the same order; compiled, within
    1e-6) and its dw within fp32 rounding (the block's rows summed in order, not as a tile), with packed documents
    (starts on and off the interpreter's 16-row block edges) and without, T not a multiple of the block (the last
    block's rows past T, and dy's 3 rows past a block); both against the fp32 reference too."""
    from moelab.ops import short_conv

    _backward_kernels_agree(act, monkeypatch, "BWD_SLIDE", 7, [0, 1, 4, 16, 17, 33], 1e-6)
    assert short_conv.bwd_row_name(slide=True) == "bwd_slide_" + "x".join(map(str, short_conv.SLIDE_LAUNCH))
