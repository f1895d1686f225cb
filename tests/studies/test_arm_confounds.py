"""check_arms_differ_only on grids of three arms where only a later arm carries the confound.

A check that compares each arm against the first one only, or each against its neighbour, passes
the two-arm cases of test_common.py; these grids put the fault in the last arm or between the
first and the last.
"""

from __future__ import annotations

import pytest

from moelab.studies import common


def test_only_the_last_arm_changes_a_second_key() -> None:
    arms = {"a": {"train.lr": 1e-3}, "b": {"train.lr": 2e-3}, "c": {"train.lr": 3e-3, "train.weight_decay": 0.37}}
    with pytest.raises(ValueError, match=r"differ in \['train.weight_decay'\] besides the factor studied "
                                         r"\['train.lr'\]") as info:
        common.check_arms_differ_only("tiny", arms)
    # The message shows every arm's value of the confounding key, the last arm's 0.37 among them.
    assert "'c': 0.37" in str(info.value)


def test_first_and_last_arm_resolve_to_the_same_config() -> None:
    # Neighbours differ (a != b, b != c) but a == c: a pairwise check over every pair finds it.
    arms = {"a": {"train.lr": 1e-3}, "b": {"train.lr": 2e-3}, "c": {"train.lr": 1e-3}}
    with pytest.raises(ValueError, match="arms 'a' and 'c' resolve to the same config"):
        common.check_arms_differ_only("tiny", arms)


def test_three_clean_arms_report_every_arm_value() -> None:
    arms = {"a": {"train.lr": 1e-3}, "b": {"train.lr": 2e-3}, "c": {"train.lr": 3e-3}}
    assert common.check_arms_differ_only("tiny", arms) == {
        "train.lr": {"a": 1e-3, "b": 2e-3, "c": 3e-3}}


def test_a_key_only_the_middle_arm_sets_is_a_confound() -> None:
    # The first and last arm agree on train.weight_decay (the preset's value); the middle one moves it.
    arms = {"a": {"train.lr": 1e-3}, "b": {"train.lr": 2e-3, "train.weight_decay": 0.37}, "c": {"train.lr": 3e-3}}
    with pytest.raises(ValueError, match=r"differ in \['train.weight_decay'\]"):
        common.check_arms_differ_only("tiny", arms)
