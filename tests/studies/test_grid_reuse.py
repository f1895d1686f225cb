"""The study grid reuses a finished run only when nothing it computes changed: the same config and code state
give the recorded run back untrained; a changed config key or a changed code state (source hash) trains again,
with a new record that covers the whole new run; under a source pin (a study preset's training-code epoch) a
changed source hash does not, a changed config still does. On the ``tiny`` preset, two training steps per run."""

from __future__ import annotations

import json

import pytest

from moelab.base import repo_root
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

    def call(pin=None, **overrides):
        before = len(trainings)
        with common.pinned(pin):
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


def test_a_source_pin_keeps_records_across_a_source_change_and_a_config_change_retrains(grid, tmp_path,
                                                                                       monkeypatch) -> None:
    first, trained, saved = grid(pin="s9test-1")
    assert trained and saved["code"]["source_pin"] == "s9test-1" and saved["code"]["source_sha256"] == "1" * 16
    # Any later commit in moelab changes the package hash: under the pin the record still counts.
    monkeypatch.setenv(common.GIT_ENV, _code("2" * 16))
    same, trained_same, saved_same = grid(pin="s9test-1")
    assert not trained_same and same.skipped and same.fingerprint == first.fingerprint
    assert saved_same == saved and same.code["source_sha256"] == "1" * 16  # the code it really trained at
    # Without the pin the hash counts again; a config change under the pin retrains; so does a bumped pin.
    unpinned, trained_unpinned, _ = grid()
    assert trained_unpinned and unpinned.fingerprint != first.fingerprint and "source_pin" not in unpinned.code
    changed, trained_changed, saved_changed = grid(pin="s9test-1", **{"train.lr": 1e-2})
    assert trained_changed and changed.fingerprint not in (first.fingerprint, unpinned.fingerprint)
    assert saved_changed["code"] == {"commit": "abc", "dirty": False, "diff_sha256": None,
                                     "source_sha256": "2" * 16, "source_pin": "s9test-1"}
    bumped, trained_bumped, _ = grid(pin="s9test-2", **{"train.lr": 1e-2})
    assert trained_bumped and bumped.fingerprint != changed.fingerprint
    # run_grid's own source_pin argument is the same pin as the pinned block's
    again = common.run_grid("98_reuse", "tiny", ARM, [0], tmp_path, common={**FEW, "train.lr": 1e-2},
                            echo=lambda line: None, source_pin="s9test-2")
    assert again.records[0].skipped and again.records[0].fingerprint == bumped.fingerprint


def test_a_pin_hashes_as_the_source_it_stands_for() -> None:
    """Study 1's research records were made with MOELAB_STUDY_GIT's source_sha256 = "s1research-1": under the pin
    "s1research-1" their fingerprints are the same bytes, whatever the real package hash."""
    from moelab.config import load_config

    cfg = load_config("tiny", {"seed": 0})
    old = common._fingerprint(cfg, {"commit": "a2149cc", "source_sha256": "s1research-1"})
    pinned = common._fingerprint(cfg, {"commit": "6740f3b", "source_sha256": "0123456789abcdef",
                                       "source_pin": "s1research-1"})
    assert old == pinned and old != common._fingerprint(cfg, {"source_sha256": "0123456789abcdef"})
    with pytest.raises(ValueError, match="source_pin='bad pin' is not allowed"):
        with common.pinned("bad pin"):
            pass


@pytest.mark.parametrize("name", ["bounded-1_s0", "softplus_s0"])
def test_study_1_research_records_are_valid_under_their_pin(name, monkeypatch) -> None:
    """The committed records' fingerprints recompute from their own config and the pin "s1research-1"."""
    path = repo_root() / "studies" / "01_decay_bound" / "records" / "research" / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} is not in this checkout")
    saved = json.loads(path.read_text())
    monkeypatch.setattr(common, "_run_config", lambda cfg: cfg)  # the record keeps _run_config(cfg) as "config"
    code = {**saved["code"], "source_sha256": "0123456789abcdef", "source_pin": "s1research-1"}
    assert common._fingerprint(saved["config"], code) == saved["fingerprint"]
