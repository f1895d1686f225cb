"""``python -m moelab``: info answers fast, bad input exits 2 with a message, data prepares the corpus,
train runs and reports, Ctrl-C handling is covered in tests/train/test_fit.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moelab.cli import build_parser, main
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def _moelab(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.run([sys.executable, "-m", "moelab", *args], capture_output=True, text=True, cwd=REPO,
                          env=full_env, timeout=timeout)


def test_info_k3_answers_in_seconds_with_reference_totals() -> None:
    start = time.monotonic()
    proc = _moelab("info", "--config", "k3")
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 30, f"info took {elapsed:.1f} s"
    out = proc.stdout
    assert "config: k3" in out and "reference (k3_reference):" in out
    assert "total" in out and "accounting" in out and "activated" in out


def test_info_prints_accounting_summary(capsys) -> None:
    assert main(["info", "--config", "tiny", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "config: tiny" in out and "seq_len 64" in out


@pytest.mark.parametrize("args, message", [
    (["info", "--config", "tiny", "--set", "train.lrr=1"], "train.lrr=1 is not allowed: unknown key"),
    (["info", "--config", "nope"], "config='nope' is not allowed"),
    (["info", "--config", "tiny", "--set", "model.kda.gate=relu"], "model.kda.gate='relu'"),
    (["train", "--config", "tiny", "--set", "oops"], "expected KEY=VALUE"),
])
def test_bad_config_exits_2_with_the_reason(args: list[str], message: str, capsys) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_resume_without_checkpoint_exits_2(tmp_path, capsys) -> None:
    code = main(["train", "--config", "tiny", "--set", f"train.ckpt_dir={tmp_path}", "--set",
                 "tracking.enabled=false", "--resume"])
    assert code == 2
    assert "last.ckpt does not exist" in capsys.readouterr().err


def test_parser_knows_every_command() -> None:
    parser = build_parser()
    assert parser.parse_args(["study", "2", "--preset", "gpu"]).number == 2
    assert parser.parse_args(["train", "--config", "x", "--resume"]).resume is True
    assert parser.parse_args(["train", "--config", "x", "--resume", "a.ckpt"]).resume == "a.ckpt"
    with pytest.raises(SystemExit):
        parser.parse_args(["study", "1", "--preset", "tpu"])


def test_data_prepares_the_default_corpus(capsys) -> None:
    assert main(["data", "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "cache:" in out and "512 ids" in out and "train" in out


def test_train_subprocess_prints_summary_and_records_throughput(tmp_path, tracking_uri) -> None:  # noqa: F811
    table = tmp_path / "throughput.json"
    proc = _moelab("train", "--config", "tiny", "--set", "train.max_steps=4", "--set", "train.warmup_steps=1",
                   "--set", "train.val_every=2", "--set", "train.log_every=1",
                   "--set", f"train.ckpt_dir={tmp_path / 'ckpt'}", "--throughput", str(table),
                   env={"MLFLOW_TRACKING_URI": tracking_uri})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"): proc.stdout.rindex("}") + 1])
    assert summary["steps"] == 4 and summary["status"] == "finished" and summary["run_id"]
    (row,) = json.loads(table.read_text())["rows"]
    assert row["impl"] == "moelab_tiny" and row["B"] == 8 and row["T"] == 64 and row["tok_per_s"] > 0
    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri).get_run(summary["run_id"]).info.status == "FINISHED"  # env URI honoured
