"""The GLU FFN (moelab.model.ffn): against an fp64 transcription, both activation backends, init, errors."""

import pytest
import torch

from moelab.base import ConfigError
from moelab.model.ffn import GLUFFN
from moelab.ops.glu import glu
from tests.helpers import assert_close
from tests.ops.test_glu import _situ_ref

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("activation", ["situ_glu", "swiglu"])
def test_glu_ffn_forward_and_grads(activation):
    torch.manual_seed(0)
    ffn = GLUFFN(16, 24, activation, beta1=2.0, beta2=5.0)
    with torch.no_grad():  # larger weights so the caps are exercised
        ffn.gate_up.weight.mul_(50)
    x = torch.randn(3, 5, 16, requires_grad=True)
    y = ffn(x)
    assert y.shape == x.shape
    go = torch.randn_like(y)
    y.backward(go)

    x64 = x.detach().double().requires_grad_()
    wg, wu = (w.detach().double().requires_grad_() for w in ffn.gate_up.weight.chunk(2, 0))
    wd = ffn.down.weight.detach().double().requires_grad_()
    g, u = x64 @ wg.T, x64 @ wu.T
    a = _situ_ref(g, u, 2.0, 5.0) if activation == "situ_glu" else g * torch.sigmoid(g) * u
    ref = a @ wd.T
    ref.backward(go.double())
    assert_close(ref, y, 1e-5, "ffn out")
    assert_close(x64.grad, x.grad, 1e-5, "ffn dx")
    assert_close(torch.cat([wg.grad, wu.grad]), ffn.gate_up.weight.grad, 1e-5, "ffn dW_gate_up")
    assert_close(wd.grad, ffn.down.weight.grad, 1e-5, "ffn dW_down")

    fused = GLUFFN(16, 24, activation, beta1=2.0, beta2=5.0, backend="triton")
    fused.load_state_dict(ffn.state_dict())  # the Triton activation gives the same function
    assert_close(ref, fused.to(DEV)(x.to(DEV)).cpu(), 1e-5, "ffn fused out")


def test_glu_ffn_init_and_errors():
    torch.manual_seed(0)
    ffn = GLUFFN(256, 512, "situ_glu")
    assert ffn.gate_up.weight.shape == (1024, 256) and ffn.down.weight.shape == (256, 512)
    assert ffn.gate_up.bias is None and ffn.down.bias is None
    assert abs(ffn.gate_up.weight.std().item() - 0.02) < 1e-3
    with pytest.raises(ConfigError, match=r"activation='gelu'.*'situ_glu', 'swiglu'"):
        GLUFFN(8, 8, "gelu")
    with pytest.raises(ConfigError, match="relu"):
        glu(torch.randn(2, 4), "relu")
