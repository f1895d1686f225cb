"""LR schedule and optimizer groups of LitMoELab."""

from __future__ import annotations

import math

import pytest

from moelab.config import load_config
from moelab.train import LitMoELab, lr_factor


def test_warmup_then_cosine_to_min_ratio() -> None:
    w, n, r = 10, 110, 0.1
    f = [lr_factor(s, w, n, r) for s in range(n + 20)]
    assert all(a < b for a, b in zip(f[:w], f[1:w + 1]))  # rising through warmup
    assert f[w] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[w:n], f[w + 1:n + 1]))  # non-increasing after it
    assert f[n] == pytest.approx(r) and f[-1] == pytest.approx(r)  # floor from max_steps on
    mid = w + (n - w) // 2
    assert f[mid] == pytest.approx(r + (1 - r) * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_no_warmup_starts_at_peak() -> None:
    assert lr_factor(0, 0, 100, 0.0) == pytest.approx(1.0)
    assert lr_factor(100, 0, 100, 0.0) == pytest.approx(0.0)


def test_optimizer_decays_matrices_only_and_covers_every_parameter() -> None:
    cfg = load_config("tiny", {"train.lr": 2e-3, "train.warmup_steps": 4})
    module = LitMoELab(cfg)
    opt_cfg = module.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.train.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in module.parameters()) and len(set(ids)) == len(ids)
    assert opt.defaults["betas"] == cfg.train.betas
    # LambdaLR has already applied step 0's factor.
    first = lr_factor(0, 4, cfg.train.max_steps, cfg.train.min_lr_ratio)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * first)
    assert sched.get_last_lr()[0] == pytest.approx(opt.param_groups[0]["lr"])
