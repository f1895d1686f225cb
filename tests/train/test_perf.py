"""Peak-FLOPs table, MFU formula, the shared throughput JSON."""

from __future__ import annotations

import json
import math

import pytest

from moelab.train.perf import mfu, peak_flops, record_throughput


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GH200 480GB", 989e12), ("Some Future GPU", None),
])
def test_peak_by_device_name(name: str, peak: float | None) -> None:
    assert peak_flops(name) == peak


def test_mfu_is_three_forward_flops_times_rate_over_peak() -> None:
    assert mfu(1e9, 1e5, 1e15) == pytest.approx(3 * 1e9 * 1e5 / 1e15)
    assert math.isnan(mfu(1e9, 1e5, None))


def test_record_throughput_upserts_rows_and_keeps_others(tmp_path) -> None:
    path = tmp_path / "throughput.json"
    record_throughput(path, {"impl": "fla_chunk_kda", "tok_per_s": 1.0}, command="bench")
    record_throughput(path, {"impl": "moelab_gpu_small", "tok_per_s": 2.0, "mfu": float("nan")}, command="train")
    record_throughput(path, {"impl": "moelab_gpu_small", "tok_per_s": 3.0}, command="train again")
    data = json.loads(path.read_text())
    assert [r["impl"] for r in data["rows"]] == ["fla_chunk_kda", "moelab_gpu_small"]
    assert data["rows"][1]["tok_per_s"] == 3.0
    assert set(data["meta"]) == {"gpu", "torch", "triton", "date", "command"}
    assert data["meta"]["command"] == "train again"
    assert [p.name for p in tmp_path.iterdir()] == ["throughput.json"]  # no temp files left


def test_record_throughput_writes_a_list_of_rows_at_once(tmp_path) -> None:
    """A group of rows (``kernels/bench.py --entry model``) replaces its old rows in one write and keeps the others."""
    path = tmp_path / "throughput.json"
    record_throughput(path, [{"impl": "a", "tok_per_s": 1.0}, {"impl": "other", "tok_per_s": 9.0}], command="one")
    data = record_throughput(path, [{"impl": "a", "tok_per_s": 2.0}, {"impl": "b", "tok_per_s": 3.0}], command="two")
    assert json.loads(path.read_text()) == data
    assert [(r["impl"], r["tok_per_s"], r["command"]) for r in data["rows"]] == [
        ("other", 9.0, "one"), ("a", 2.0, "two"), ("b", 3.0, "two")]
