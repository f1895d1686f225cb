"""``python -m moelab``: info answers fast, bad input exits 2 with a one-line message (never a traceback),
data prepares the corpus, train runs and reports; exit codes 1 (NaN, tracking store down), 130 (Ctrl-C),
143 (SIGTERM)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moelab.cli import build_parser, main
from tests.train.helpers import AtStep
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


def test_study_split_arguments() -> None:
    parser = build_parser()
    args = parser.parse_args(["study", "1", "--preset", "gpu", "--runs", "bounded:0,softplus:1"])
    assert (args.runs, args.shard) == ("bounded:0,softplus:1", None)
    assert parser.parse_args(["study", "1", "--shard", "2/3"]).shard == "2/3"
    with pytest.raises(SystemExit):
        parser.parse_args(["study", "1", "--runs", "a:0", "--shard", "1/2"])
    assert parser.parse_args(["study", "1", "--from-results"]).from_results


@pytest.mark.parametrize(("raised", "code", "line"), [
    ("stopped", 143, "stopped: study 1 stopped by SIGTERM: ... `make study-1 PRESET=cpu` resumes"),
    ("stopped-int", 130, "stopped: study 1 stopped by SIGINT: ... `make study-1 PRESET=cpu` resumes"),
    ("failed", 1, "error: study 1: cell 3 ('x') raised ValueError: bad; the executed notebook with the traceback: s"),
    ("bad-split", 2, "error: RUNS item 'bounded' is not allowed: expected arm:seed (e.g. bounded:0), comma-separated"),
])
def test_study_outcomes_are_one_line_and_an_exit_code(raised, code, line, monkeypatch, capsys) -> None:
    """A stopped study exits 128 + the signal, a failed cell 1, a bad split 2: each with one line, no traceback."""
    from moelab.studies import common, runner

    def fake(number, preset, runs=None, shard=None, **render):
        if raised.startswith("stopped"):
            signum = signal.SIGINT if raised == "stopped-int" else signal.SIGTERM
            raise runner.StudyStopped(f"study 1 stopped by {signal.Signals(signum).name}: ... "
                                      f"`make study-1 PRESET=cpu` resumes", signum)
        if raised == "failed":
            raise runner.StudyFailed("study 1: cell 3 ('x') raised ValueError: bad; the executed notebook with the "
                                     "traceback: s")
        common.parse_runs(runs)

    monkeypatch.setattr(runner, "run_study", fake)
    assert main(["study", "1", "--runs", "bounded"]) == code
    err = capsys.readouterr().err
    assert err.strip() == line


def test_from_results_renders_at_the_committed_preset(monkeypatch, capsys) -> None:
    """--from-results re-renders the committed report: it runs at the preset that made it on any machine, and refuses
    a cpu preset or a split call (either would write other tables over the committed report)."""
    from moelab.studies import runner

    seen = []
    monkeypatch.setattr(runner, "run_study", lambda number, preset, **kw: seen.append((preset, kw)) or "out")
    assert main(["study", "1", "--from-results"]) == 0
    made = runner.committed_preset(runner.STUDIES[1])  # research since study 1's research report landed
    assert seen[0][0] == made and made in ("research", "gpu") and seen[0][1]["parameters"] == {"from_results": True}
    for extra in (["--preset", "cpu"], ["--runs", "bounded-5:0"]):
        assert main(["study", "1", "--from-results", *extra]) == 2
        assert "--from-results renders the committed report" in capsys.readouterr().err
    assert len(seen) == 1


def test_data_prepares_the_default_corpus(capsys) -> None:
    assert main(["data", "--config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "cache:" in out and "512 ids" in out and "train" in out


@pytest.mark.slow  # a training subprocess: ~10 s
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


@pytest.mark.slow  # a training subprocess: ~8 s
def test_sigterm_exits_143_with_summary_and_checkpoint(tmp_path, tracking_uri) -> None:  # noqa: F811
    """SIGTERM (what a scheduler or `docker stop` sends) stops after the step under way, like Ctrl-C."""
    ckpt = tmp_path / "ckpt"
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                "MLFLOW_TRACKING_URI": tracking_uri}
    proc = subprocess.Popen([sys.executable, "-m", "moelab", "train", "--config", "tiny", "--set",
                             "train.max_steps=100000", "--set", "train.val_every=2", "--set", f"train.ckpt_dir={ckpt}",
                             "--set", "tracking.log_system_metrics=false"], cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (ckpt / "last.ckpt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    assert "training stopped by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["status"] == "terminated" and summary["steps"] >= 2
    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri).get_run(summary["run_id"]).info.status == "KILLED"


def _train_args(tmp_path: Path, *sets: str) -> list[str]:
    args = ["train", "--config", "tiny", "--set", f"train.ckpt_dir={tmp_path / 'run'}",
            "--set", "tracking.enabled=false"]
    for s in sets:
        args += ["--set", s]
    return args


@pytest.mark.parametrize("sets, message", [
    (["train.lr=.inf"], "train.lr=inf is not allowed: expected a finite number"),
    (["model.init_std=0"], "model.init_std=0.0 is not allowed: expected a positive number"),
    (["model.init_std=-0.02"], "model.init_std=-0.02 is not allowed"),
    (["model.moe.top_k=9"], "model.moe.top_k=9 is not allowed"),  # named as --set takes it
    (["model.kda.conv_size=0"], "model.kda.conv_size=0 is not allowed"),
])
def test_user_errors_exit_2_with_one_line(tmp_path, sets, message, capsys) -> None:
    assert main(_train_args(tmp_path, *sets)) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: "), err


def test_machine_errors_exit_2_before_training(tmp_path, monkeypatch, capsys) -> None:
    import torch

    if not torch.cuda.is_available():
        assert main(_train_args(tmp_path, "train.accelerator=gpu")) == 2
        assert "train.accelerator='gpu' is not allowed here: no CUDA device" in capsys.readouterr().err
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(_train_args(tmp_path, "model.kda.backend=triton", "train.accelerator=cpu")) == 2
    assert "model.kda.backend='triton' is not allowed without a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_duplicate_yaml_key_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("train:\n  lr: 1e-3\n  max_steps: 5\n  lr: 3e-3\n")
    assert main(["info", "--config", str(path)]) == 2
    assert "key 'lr' appears twice in one mapping (lines 2 and 4" in capsys.readouterr().err


def test_bad_resume_targets_exit_2_naming_the_file(tmp_path, capsys) -> None:
    bad = tmp_path / "notes.ckpt"
    bad.write_text("not a checkpoint")
    assert main(_train_args(tmp_path) + ["--resume", str(bad)]) == 2
    assert f"{bad} is not a readable checkpoint" in capsys.readouterr().err
    folder = tmp_path / "empty_run"
    folder.mkdir()
    assert main(_train_args(tmp_path) + ["--resume", str(folder)]) == 2
    assert f"{folder / 'last.ckpt'} does not exist" in capsys.readouterr().err


def test_a_damaged_corpus_archive_exits_2_naming_it(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "data").mkdir()
    archive = (REPO / "data" / "shakespeare.tar.xz").read_bytes()
    (tmp_path / "data" / "shakespeare.tar.xz").write_bytes(archive[: len(archive) // 2])
    monkeypatch.setenv("MOELAB_ROOT", str(tmp_path))
    assert main(["data", "--config", "tiny"]) == 2
    err = capsys.readouterr().err
    assert f"the corpus archive {tmp_path / 'data' / 'shakespeare.tar.xz'} is damaged" in err, err


def test_unreachable_tracking_server_exits_1(tmp_path, monkeypatch, capsys) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    code = main(["train", "--config", "tiny", "--set", f"train.ckpt_dir={tmp_path / 'run'}",
                 "--set", f"tracking.tracking_uri=http://127.0.0.1:{port}"])
    assert code == 1
    assert f"the MLflow tracking server http://127.0.0.1:{port} does not answer" in capsys.readouterr().err


def _fit_with(monkeypatch, callback) -> None:
    """Make the CLI's fit() run with one extra Lightning callback (the CLI takes none)."""
    import moelab.train

    real = moelab.train.fit
    monkeypatch.setattr(moelab.train, "fit", lambda cfg, resume=None: real(cfg, resume=resume, callbacks=[callback]))


def test_nan_exits_1_naming_the_step(tmp_path, monkeypatch, capsys) -> None:
    poison = AtStep(3, lambda trainer, module: module.model.lm_head.weight.data.fill_(float("nan")))
    _fit_with(monkeypatch, poison)
    assert main(_train_args(tmp_path, "train.max_steps=10", "train.val_every=2", "train.warmup_steps=1")) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: train/loss=nan at step 4: training stopped; last good checkpoint: ") and \
        "Traceback" not in err, err


def test_ctrl_c_exits_130_after_saving(tmp_path, monkeypatch, capsys) -> None:
    _fit_with(monkeypatch, AtStep(2, lambda trainer, module: os.kill(os.getpid(), signal.SIGINT)))
    assert main(_train_args(tmp_path, "train.max_steps=10", "train.val_every=5", "train.warmup_steps=1")) == 130
    err = capsys.readouterr().err
    assert "interrupted: training stopped by SIGINT at step 3; resume from" in err, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "interrupted"
    assert (tmp_path / "run" / "last.ckpt").is_file()
