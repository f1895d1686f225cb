"""The atomic, checksummed checkpoint writer (the file helpers it shares are tested in tests/test_utils.py)."""

from __future__ import annotations

import torch

from moelab.train.runner import AtomicCheckpointIO, sha256_file
from tests.helpers import assert_close


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
