"""atomic_write / atomic_path / write_json and the atomic, checksummed checkpoint writer."""

from __future__ import annotations

import json

import pytest
import torch

from moelab.train.runner import AtomicCheckpointIO, sha256_file
from moelab.utils import atomic_path, atomic_write, write_json
from tests.helpers import assert_close


def test_atomic_write_replaces_whole_file(tmp_path) -> None:
    path = tmp_path / "sub" / "out.txt"
    with atomic_write(path) as f:
        f.write("first")
        assert not path.exists()  # nothing visible before the block ends
    assert path.read_text() == "first"
    with atomic_write(path, "wb") as f:
        f.write(b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]


def test_failed_write_keeps_the_old_file_and_no_temp(tmp_path) -> None:
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(path) as f:
            f.write("half")
            raise RuntimeError("crash mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_atomic_path_keep_on_error_publishes_what_was_written(tmp_path) -> None:
    path = tmp_path / "nb.ipynb"
    with pytest.raises(ValueError):
        with atomic_path(path, keep_on_error=True) as tmp:
            assert tmp.suffix == ".ipynb" and tmp.parent == tmp_path
            tmp.write_text("executed up to the error")
            raise ValueError("cell failed")
    assert path.read_text() == "executed up to the error"


def test_atomic_write_rejects_other_modes(tmp_path) -> None:
    with pytest.raises(ValueError, match="mode='a'"):
        with atomic_write(tmp_path / "x", "a"):
            pass


def test_write_json_turns_non_finite_into_null(tmp_path) -> None:
    path = tmp_path / "s.json"
    write_json(path, {"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": 2}})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.0, None], "c": {"d": 2}}


def test_atomic_checkpoint_io_round_trip(tmp_path) -> None:
    io = AtomicCheckpointIO()
    state = {"w": torch.randn(4, 3), "step": 7}
    io.save_checkpoint(state, tmp_path / "c.ckpt")
    back = io.load_checkpoint(tmp_path / "c.ckpt")
    assert back["step"] == 7
    assert_close(state["w"], back["w"], 0.0, "w")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt", "c.ckpt.sha256"]
    assert (tmp_path / "c.ckpt.sha256").read_text() == f"{sha256_file(tmp_path / 'c.ckpt')}  c.ckpt\n"
    io.remove_checkpoint(tmp_path / "c.ckpt")
    assert list(tmp_path.iterdir()) == []
