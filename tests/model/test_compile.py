"""``train.compile=true`` (``model.compile()``): dynamo traces the model with graph breaks at the
parts that run eagerly (the fused KDA op, the grouped-GEMM experts) and computes the same loss and
gradients as the eager model. The ``eager`` backend checks the tracing without a C++/Triton compile."""

from __future__ import annotations

import torch

from moelab.config import load_config
from moelab.model import MoELab


def test_compiled_model_matches_eager():
    cfg = load_config("tiny", {})
    torch.manual_seed(0)
    model = MoELab(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(x, x).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.compile(backend="eager")
    loss_c = model(x, x).loss
    loss_c.backward()
    assert torch.allclose(loss_c, loss, rtol=1e-6, atol=1e-6)
    assert grads, "no parameter got a gradient"
    for n, g in grads.items():
        gc = dict(model.named_parameters())[n].grad
        assert gc is not None, n
        torch.testing.assert_close(gc, g, rtol=1e-5, atol=1e-6, msg=n)
