"""``train.balancer_start_step``: a warm start trains the first S optimizer steps with the balancer off
(bias held at zero, no auxiliary loss), then switches it on from zero bias (study 2's research tier)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from moelab.config import ConfigError, flatten, load_config
from moelab.model.balance import balance_step
from moelab.train import fit
from moelab.train.balancer import BalancerCallback, hold_off
from moelab.train.module import LitMoELab, train_step_fn
from tests.train.helpers import EagerStep, tiny_config

STEPS, START = 6, 3


def _fit(root: Path, balancer: str, start: int) -> tuple[dict, list[dict]]:
    cfg = tiny_config(root, None, train__max_steps=STEPS, train__warmup_steps=1, train__val_every=STEPS,
                      train__log_every=1, train__balancer_start_step=start, model__moe__balancer=balancer)
    res = fit(cfg)
    return torch.load(root / "balance_trajectories.pt", weights_only=False), res.history


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, list[dict]]]:
    """Four tiny fits of the same seed: no balancer, and QB, the sign rule, the aux loss switched on at START."""
    root = tmp_path_factory.mktemp("warm")
    return {name: _fit(root / name, balancer, start) for name, balancer, start in (
        ("none", "none", 0), ("qb", "quantile_balancing", START), ("sign", "loss_free_sign", START),
        ("aux", "aux_loss", START))}


@pytest.mark.slow  # four tiny fit() runs: ~25 s
@pytest.mark.parametrize("arm", ["qb", "sign"])
def test_bias_stays_zero_before_the_start_step_and_moves_after(runs: dict, arm: str) -> None:
    traj, off = runs[arm][0], runs["none"][0]
    assert traj["step"].tolist() == list(range(1, STEPS + 1))
    bias = traj["bias"]  # [S, L, n], recorded after each step's update
    assert bias[:START].abs().max() == 0  # steps 1..S: the update ran and was undone
    assert bias[START].abs().amax(-1).gt(0).all()  # step S + 1: every layer's bias moved, from zero
    # Before the switch the run is the unbalanced run: the same loads step by step; after it, not.
    assert torch.equal(traj["load"][:START], off["load"][:START])
    assert not torch.equal(traj["load"][START + 1:], off["load"][START + 1:])


@pytest.mark.slow
def test_aux_loss_is_off_before_the_start_step(runs: dict) -> None:
    aux = {int(r["step"]): r["train/aux_loss"] for r in runs["aux"][1] if "train/aux_loss" in r}
    assert sorted(aux) == list(range(1, STEPS + 1))
    assert all(aux[s] == 0.0 for s in range(1, START + 1))
    assert all(aux[s] > 0.0 for s in range(START + 1, STEPS + 1))
    # The same losses as the unbalanced run until the switch (no aux gradient, zero bias), different after.
    loss = {int(r["step"]): r["train/loss"] for r in runs["aux"][1]}
    none = {int(r["step"]): r["train/loss"] for r in runs["none"][1]}
    assert all(loss[s] == pytest.approx(none[s], abs=1e-6) for s in range(1, START + 1))
    assert loss[STEPS] != pytest.approx(none[STEPS], abs=1e-6)


def test_start_step_is_a_config_param_and_checked(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, None, train__max_steps=10, train__balancer_start_step=4)
    assert flatten(cfg)["train.balancer_start_step"] == 4  # logged with every other config key
    assert tiny_config(tmp_path, None).train.balancer_start_step == 0
    for bad in (-1, 10, 11):
        with pytest.raises(ConfigError, match=rf"train.balancer_start_step.*{bad}.*0..max_steps - 1 \(9\)"):
            tiny_config(tmp_path, None, train__max_steps=10, train__balancer_start_step=bad)
    # A captured step switches the balancer on by device arithmetic (train_step_fn): graphs takes a warm start.
    assert tiny_config(tmp_path, None, train__max_steps=10, train__balancer_start_step=2,
                       train__compile="graphs").train.balancer_start_step == 2


# --- the capturable switch (train.compile='graphs'): the step CapturedStep captures, run eagerly on the CPU ---

BALANCERS = ["quantile_balancing", "loss_free_sign", "quantile_load", "aux_loss"]


def _lit(balancer: str, **over) -> LitMoELab:
    torch.manual_seed(0)
    return LitMoELab(load_config("tiny", {"tracking.enabled": False, "model.moe.balancer": balancer,
                                          "train.max_steps": 8, "train.warmup_steps": 1, **over}))


def _batches(vocab: int, n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, vocab, (2, 33), generator=gen) for _ in range(n)]
    return [{"input_ids": i[:, :-1].contiguous(), "targets": i[:, 1:].contiguous()} for i in ids]


def _host_gated_step(model: torch.nn.Module, opt: torch.optim.Optimizer, grad_clip: float, start: int):
    """The eager path's switch (LitMoELab.training_step's zeroed aux loss, BalancerCallback's hold_off) around
    train_step_fn's other pieces, with the step index on the host: the reference the device switch must equal."""
    params = [p for p in model.parameters() if p.requires_grad]
    done = [0]

    def step(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = model(batch["input_ids"], batch["targets"], return_logits=False, check_ids=False)
        aux = torch.zeros_like(out.aux_loss) if done[0] < start else out.aux_loss
        loss = out.loss + aux
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        balanced = balance_step(model)
        if done[0] < start:
            hold_off(model, balanced)
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done[0] += 1
        return {"loss": loss.detach(), "aux_loss": aux.detach(), "balance/load": balanced.load,
                "balance/bias": balanced.bias}

    return step


@pytest.mark.parametrize("balancer", BALANCERS)
def test_device_switch_equals_the_host_switch_step_by_step(balancer: str) -> None:
    """train_step_fn with balancer_start_step=3 (the switch as arithmetic on a device step counter, the code
    CapturedStep captures) against the host-branched switch, 6 steps of the tiny model: every step's loss, aux
    loss, expert loads, recorded bias and every router buffer (bias; quantile_load's averages) equal exactly;
    the bias is zero through step 3 and has moved at step 4 (aux_loss: the aux loss is 0 through step 3, > 0 after)."""
    data = _batches(load_config("tiny", {}).model.vocab_size, STEPS)
    runs = {}
    for name in ("device", "host"):
        lit = _lit(balancer)
        opt = torch.optim.AdamW(lit.parameters(), lr=1e-3)
        clip = lit.cfg.train.grad_clip
        step = (train_step_fn(lit.model, opt, clip, None, START) if name == "device"
                else _host_gated_step(lit.model, opt, clip, START))
        outs = [step(b) for b in data]
        runs[name] = (outs, dict(lit.model.named_buffers()), step)
    (dev, dev_buf, dev_step), (host, host_buf, _) = runs["device"], runs["host"]
    assert int(dev_step.index) == STEPS  # the counter counted every step on the device
    for i, (d, h) in enumerate(zip(dev, host)):
        for key in ("loss", "aux_loss", "balance/load", "balance/bias"):
            assert torch.equal(d[key], h[key]), (i + 1, key)
    for name, b in host_buf.items():
        assert torch.equal(dev_buf[name], b), name
    bias = torch.stack([d["balance/bias"] for d in dev])  # [S, L, n]
    if balancer == "aux_loss":
        aux = [float(d["aux_loss"]) for d in dev]
        assert aux[:START] == [0.0] * START and min(aux[START:]) > 0
        assert bias.abs().max() == 0
    else:
        assert bias[:START].abs().max() == 0 and bias[START].abs().amax(-1).gt(0).all()


def test_device_switch_continues_from_the_first_step() -> None:
    """A resumed captured step (first_step = the optimizer steps done) is on from the first call when S is passed."""
    lit = _lit("loss_free_sign")
    step = train_step_fn(lit.model, torch.optim.AdamW(lit.parameters(), lr=1e-3), 1.0, None, START, first_step=START)
    out = step(_batches(lit.cfg.model.vocab_size, 1)[0])
    assert out["balance/bias"].abs().amax(-1).gt(0).all() and int(step.index) == START + 1


def _lightning(mode: str, balancer: str) -> tuple[LitMoELab, BalancerCallback]:
    lit = _lit(balancer, **{"train.compile": mode, "train.max_steps": STEPS, "train.balancer_start_step": START})
    data = _batches(lit.cfg.model.vocab_size, STEPS)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, precision="32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=None if mode == "graphs" else lit.cfg.train.grad_clip,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=None))
    return lit, next(c for c in trainer.callbacks if isinstance(c, BalancerCallback))


def test_graphs_wiring_warm_start_trains_as_the_eager_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.compile='graphs' with train.balancer_start_step=3 under Lightning (capture left out) against the
    automatic eager loop: the same recorded loads and biases at every step (zero bias through step 3), the same
    router biases and weights at the end."""
    eager, cb_eager = _lightning("none", "quantile_balancing")
    monkeypatch.setattr("moelab.train.module.CapturedStep", EagerStep)
    monkeypatch.setattr("moelab.train.module.compile_model", lambda *a, **k: None)
    graphs, cb_graphs = _lightning("graphs", "quantile_balancing")
    assert cb_graphs.steps == cb_eager.steps == list(range(1, STEPS + 1))
    assert torch.equal(torch.stack(cb_graphs.loads), torch.stack(cb_eager.loads))
    bias = torch.stack(cb_graphs.biases)
    torch.testing.assert_close(bias, torch.stack(cb_eager.biases), rtol=1e-5, atol=1e-6)
    assert bias[:START].abs().max() == 0 and bias[START].abs().amax(-1).gt(0).all()
    weights = dict(eager.named_parameters())
    for name, p in graphs.named_parameters():
        torch.testing.assert_close(p, weights[name], rtol=1e-4, atol=1e-6, msg=name)
