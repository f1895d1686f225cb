"""``train.balancer_start_step``: a warm start trains the first S optimizer steps with the balancer off
(bias held at zero, no auxiliary loss), then switches it on from zero bias (study 2's research tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moelab.config import ConfigError, flatten
from moelab.train import fit
from tests.train.helpers import tiny_config

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
    with pytest.raises(ConfigError, match="balancer_start_step.*train.compile='graphs'"):
        tiny_config(tmp_path, None, train__max_steps=10, train__balancer_start_step=2, train__compile="graphs")
