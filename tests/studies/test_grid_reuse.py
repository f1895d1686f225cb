"""The study grid reuses a finished run only when nothing it computes changed: the same config and code state
give the recorded run back untrained; a changed config key or a changed code state (source hash) trains again,
with a new record that covers the whole new run. On the ``tiny`` preset, two training steps per run."""

from __future__ import annotations

import json

import pytest

from moelab.studies import common

ARM = {"bounded": {"model.kda.gate": "bounded"}}
FEW = {"train.max_steps": 2, "train.warmup_steps": 1, "train.val_every": 2, "train.val_batches": 1,
       "train.log_every": 1, "tracking.log_system_metrics": False, "tracking.enabled": False}


def _code(source: str) -> str:
    return json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None, "source_sha256": source})


@pytest.fixture
def grid(tmp_path, monkeypatch):
    """``grid(**overrides)``: run the one-run grid in ``tmp_path``; returns (its record, whether it trained, the
    JSON record on disk), counting the trainings through the harness's ``_train``."""
    trainings: list[str] = []
    train = common._train

    def counted(*args, **kwargs):
        trainings.append(args[1])
        return train(*args, **kwargs)

    monkeypatch.setattr(common, "_train", counted)
    monkeypatch.setenv(common.GIT_ENV, _code("1" * 16))

    def call(**overrides):
        before = len(trainings)
        rec = common.run_grid("98_reuse", "tiny", ARM, [0], tmp_path, common={**FEW, **overrides},
                              echo=lambda line: None).records[0]
        saved = json.loads(common.record_path(tmp_path / "records", "bounded", 0).read_text())
        return rec, len(trainings) > before, saved

    return call


def test_the_same_config_and_code_reuse_the_finished_run(grid) -> None:
    first, trained, saved = grid()
    assert trained and not first.skipped and first.summary["steps"] == 2
    again, trained_again, saved_again = grid()
    assert not trained_again and again.skipped
    assert saved_again == saved  # the record is read, not rewritten: same timing, same fingerprint
    assert again.fingerprint == first.fingerprint and again.timing == first.timing
    assert again.history == first.history and again.summary["steps"] == 2


def test_a_changed_config_key_retrains(grid) -> None:
    first, _, saved = grid()
    changed, trained, saved_changed = grid(**{"train.lr": 1e-2})
    assert trained and not changed.skipped and changed.summary["steps"] == 2 and len(changed.history) == 2
    assert changed.fingerprint != first.fingerprint and saved_changed["fingerprint"] == changed.fingerprint
    assert saved_changed["config"]["train.lr"] == 1e-2 and saved["config"]["train.lr"] != 1e-2
    assert saved_changed["timing"]["started"] >= saved["timing"]["started"]
    assert not changed.timing["resumed"]  # trained from scratch, not resumed from the old run's checkpoint
    # ... and back to the first config: its record was replaced, so it trains again too.
    back, trained_back, _ = grid()
    assert trained_back and not back.skipped and back.fingerprint == first.fingerprint


def test_a_changed_code_state_retrains(grid, monkeypatch) -> None:
    first, _, saved = grid()
    monkeypatch.setenv(common.GIT_ENV, _code("2" * 16))
    changed, trained, saved_changed = grid()
    assert trained and not changed.skipped and changed.summary["steps"] == 2 and len(changed.history) == 2
    assert changed.fingerprint != first.fingerprint
    assert saved_changed["code"]["source_sha256"] == "2" * 16 and saved["code"]["source_sha256"] == "1" * 16
    assert not changed.timing["resumed"]
    # The commit alone changing (same source) is not a code change: reused.
    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "def", "dirty": True, "diff_sha256": "0123",
                                                   "source_sha256": "2" * 16}))
    same, trained_same, _ = grid()
    assert not trained_same and same.skipped and same.fingerprint == changed.fingerprint
