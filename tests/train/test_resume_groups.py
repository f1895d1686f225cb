"""On resume every optimizer param group trains with the config's lr, betas and weight decay.

The checkpoint restores the old run's optimizer state (its groups' hyper-parameters included);
the resumed config's values must win in both groups: the decayed matrices and the no-decay group
(norm gains, biases), whose weight decay stays 0.
"""

from __future__ import annotations

import pytest
import torch

from moelab.train import fit
from moelab.train.module import lr_factor
from tests.train.helpers import tiny_config


def test_resume_applies_lr_betas_and_weight_decay_to_every_group(tmp_path, tracking_uri) -> None:
    folder = tmp_path / "run"
    base = {"train__max_steps": 4, "train__val_every": 2, "train__warmup_steps": 1}
    first = tiny_config(folder, tracking_uri, **base)
    fit(first)
    old = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)["optimizer_states"][0]
    old_groups = old["param_groups"]
    assert [g["weight_decay"] for g in old_groups] == [first.train.weight_decay, 0.0]

    new_betas = (0.8, 0.9)
    assert tuple(first.train.betas) != new_betas and first.train.weight_decay != 0.25
    more = tiny_config(folder, tracking_uri, **{**base, "train__max_steps": 8}, train__lr=3e-2,
                       train__weight_decay=0.25, train__betas=new_betas)
    fit(more, resume=folder)
    state = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)["optimizer_states"][0]
    groups = state["param_groups"]
    assert len(groups) == 2, groups
    # The schedule has stepped past step 8: the saved rate is the one for the next step.
    want_lr = 3e-2 * lr_factor(8, 1, 8, more.train.min_lr_ratio)
    for group, decay in zip(groups, (0.25, 0.0)):
        assert float(group["lr"]) == pytest.approx(want_lr, rel=1e-6)
        assert group["initial_lr"] == 3e-2
        assert tuple(group["betas"]) == new_betas
        assert group["weight_decay"] == decay
    # Both groups hold the same parameters as before (the no-decay group was not merged or emptied).
    assert [len(g["params"]) for g in groups] == [len(g["params"]) for g in old_groups]
