"""A training step (forward, backward, the balancer's update, clipping, AdamW) makes no host sync.

Every call that would make the host wait for a GPU (``moelab.train.perf.HostSyncs``: ``.item()``,
``.tolist()``, a Python branch on a tensor's value, ``nonzero`` and other value-dependent shapes) is
recorded in the second step of a tiny model on the CPU (the first one probes the grouped GEMM and
fills caches, as a captured step's warm-up does), for every balancer and residual mode. What a GPU
step may not have, a CPU step shows too. Packed documents keep exactly their documented syncs (the
document count of the KDA layers' ``cu_seqlens`` and the ShortConv boundary fix): MLA's flex block
mask adds none.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from moelab.config import load_config
from moelab.model.balance import balance_step
from moelab.train.module import LitMoELab
from moelab.train.perf import HostSyncs

# Reads of CPU tensors on a GPU run too, so no device sync: the CPU branch of RouterBalance.check_tokens reads
# the step's token count at once (on a GPU the count goes to pinned memory behind the step and is read a step
# later), and AdamW outside capturable / fused mode keeps its step count on the CPU (_get_value).
CPU_ONLY = {("moelab/model/balance.py", "check_tokens"), ("torch/optim/optimizer.py", "_get_value")}


def lit(overrides: dict) -> LitMoELab:
    cfg = load_config("tiny", {"tracking.enabled": False, **overrides})
    torch.manual_seed(0)
    return LitMoELab(cfg)


def train_step(m: LitMoELab, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What Lightning's automatic optimization runs per step with LitMoELab and the BalancerCallback."""
    loss = m.training_step(batch, 0)
    loss.backward()
    m.on_before_optimizer_step(opt)
    balance_step(m)
    torch.nn.utils.clip_grad_norm_(m.parameters(), m.cfg.train.grad_clip, foreach=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def syncs_of_second_step(m: LitMoELab, batch: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
    train_step(m, opt, batch)
    with HostSyncs() as seen:
        train_step(m, opt, batch)
    return [(op, where) for op, where in seen.calls if (where.split(":")[0], where.split(" ")[-1]) not in CPU_ONLY]


def batch_of(m: LitMoELab, B: int = 2, T: int = 32) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, m.cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "targets": ids.roll(-1, 1)}


BALANCERS = [{"model.moe.balancer": b} for b in ("none", "aux_loss", "loss_free_sign", "quantile_load")] + [
    {"model.moe.balancer": "quantile_balancing", "model.moe.quantile_balancing_mode": mode}
    for mode in ("exact", "histogram")]


@pytest.mark.parametrize("overrides", BALANCERS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_training_step_has_no_host_sync(overrides: dict) -> None:
    m = lit(overrides)
    assert syncs_of_second_step(m, batch_of(m)) == []


@pytest.mark.parametrize("mode", ["full_attnres", "block_attnres"])
def test_residual_modes_have_no_host_sync(mode: str) -> None:
    m = lit({"model.residual.mode": mode})
    assert syncs_of_second_step(m, batch_of(m)) == []


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_kda_gates_on_the_triton_op_have_no_host_sync(gate: str) -> None:
    """Study 1's arms on the Triton op (the interpreter here): the bounded gate (bounded mode) and the softplus gate
    (general mode, whose step no study has captured yet) leave nothing that would stop a CUDA graph capture."""
    m = lit({"model.kda.gate": gate, "model.kda.g_min": -5.0, "model.kda.backend": "triton"})
    assert syncs_of_second_step(m, batch_of(m)) == []


def test_detector_sees_the_syncs_it_names() -> None:
    """The detector is not blind: a branch on a value, item, tolist, nonzero and a bool mask are recorded."""
    x = torch.arange(4.0)
    with HostSyncs() as seen:
        if x.sum() > 0:
            x.max().item()
        x.tolist()
        x.nonzero()
        x[x > 1]
        x.repeat_interleave(torch.tensor([1, 2, 1, 0]))
    assert [op for op, _ in seen.calls] == ["__bool__", "item", "tolist", "nonzero", "__getitem__[bool mask]",
                                            "repeat_interleave"]


@pytest.mark.parametrize("conv", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton conv on CPU tensors needs the interpreter"))])
def test_packed_documents_keep_their_documented_syncs(conv: str) -> None:
    """With packed documents (train mode, flex MLA mask) every sync comes from counting the documents or the
    ShortConv boundary fix, none from MLA or its block mask; the Triton conv (the GPU's) makes no fix at all; and with
    the documents counted by the data loader the Triton conv's step makes none."""
    m = lit({"data.document_mask": True, "model.kda.conv_backend": conv})
    for layer in m.model.layers:
        if layer.kind == "mla":
            layer.mixer.cfg = replace(layer.mixer.cfg, mask_backend="flex")
    batch = batch_of(m)
    batch["segment_ids"] = torch.tensor([[0] * 10 + [1] * 22, [0] * 3 + [1] * 29])
    calls = syncs_of_second_step(m, batch)
    assert calls, "packed documents count their documents on the host (cu_seqlens)"
    allowed = ("moelab/model/documents.py", "moelab/ops/varlen.py", "moelab/ops/kda/")
    assert all(where.startswith(allowed) for _, where in calls), calls
    assert any("conv_fix" in where for _, where in calls) == (conv == "torch"), calls
    assert not any("block_mask" in where or "mla.py" in where for _, where in calls), calls
    # as a training run gets it: the documents counted by the data loader (moelab.data.datamodule.collate, in its
    # workers), so the step itself does not count them: what syncs is left comes from the torch paths only (the
    # conv's boundary fix, the torch KDA op reading the offsets to run document by document)
    from moelab.data.datamodule import collate

    moved = collate([{k: v[b] for k, v in batch.items()} for b in range(2)])
    assert torch.equal(moved["cu_seqlens"], torch.tensor([0, 10, 32, 35, 64], dtype=torch.int32))
    after = syncs_of_second_step(m, moved)
    assert not any("documents.py" in where and "conv_fix" not in where for _, where in after), after
    assert len(after) < len(calls), (after, calls)
