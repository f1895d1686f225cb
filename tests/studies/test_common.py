"""The study harness: arm checks, the resumable grid under a parent run, aggregation, figures, quiet output."""

from __future__ import annotations

import json
import logging
import math
import os
import warnings

import pandas as pd
import pytest

from moelab.studies import common
from moelab.tracking import start_run
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

GATES = {"bounded": {"model.kda.gate": "bounded"}, "softplus": {"model.kda.gate": "softplus"}}
TINY = {"train.max_steps": 4, "train.warmup_steps": 1, "train.val_every": 2, "train.val_batches": 1,
        "train.log_every": 1, "tracking.log_system_metrics": False}


def test_arms_differ_only_in_the_factor() -> None:
    assert common.check_arms_differ_only("tiny", GATES) == {
        "model.kda.gate": {"bounded": "bounded", "softplus": "softplus"}}
    # One arm changing a second key that the other leaves at the preset's value is a confound.
    confounded = {"bounded": {"model.kda.gate": "bounded"},
                  "softplus": {"model.kda.gate": "softplus", "train.lr": 1e-2}}
    with pytest.raises(ValueError, match=r"differ in \['train.lr'\] besides the factor studied"):
        common.check_arms_differ_only("tiny", confounded)
    # Common overrides apply to every arm, so they are no confound.
    assert list(common.check_arms_differ_only("tiny", GATES, {"train.lr": 1e-2})) == ["model.kda.gate"]
    with pytest.raises(ValueError, match="resolve to the same config"):
        common.check_arms_differ_only("tiny", {"a": {"train.lr": 1e-3}, "b": {"train.lr": 1e-3}})
    with pytest.raises(ValueError, match="arms is empty"):
        common.check_arms_differ_only("tiny", {})


def test_aggregate_mean_and_spread_over_seeds() -> None:
    table = pd.DataFrame({"arm": ["a", "a", "b"], "seed": [0, 1, 0], "best_val_loss": [1.0, 2.0, 3.0]})
    agg = common.aggregate(table, ["best_val_loss"])
    assert agg.loc["a", "best_val_loss_mean"] == 1.5
    assert agg.loc["a", "best_val_loss_std"] == pytest.approx(math.sqrt(0.5))
    assert agg.loc["a", "best_val_loss"] == "1.5 ± 0.71" and agg.loc["a", "n_seeds"] == 2
    assert math.isnan(agg.loc["b", "best_val_loss_std"]) and agg.loc["b", "best_val_loss"] == "3"
    assert list(agg.index) == ["a", "b"]


def test_seed_note_names_the_count_and_the_degrees_of_freedom() -> None:
    assert common.seed_note(1, "arm") is None  # one seed: no noise measured, the verdicts say so
    three = common.seed_note(3, "schedule")
    assert three.startswith("- Seeds: three per schedule") and "(2 degrees of freedom)" in three
    assert "rough estimate" in three
    assert "(1 degree of freedom)" in common.seed_note(2, "arm")
    many = common.seed_note(common.FEW_SEEDS + 1, "arm")
    assert f"{common.FEW_SEEDS + 1} paired differences" in many and "rough" not in many


def test_grid_runs_nested_tagged_and_resumes(tmp_path, tracking_uri) -> None:  # noqa: F811
    from mlflow.tracking import MlflowClient

    lines: list[str] = []
    with start_run("99_grid", "99_grid-cpu", tracking_uri=tracking_uri, parent_run_id="",
                   log_system_metrics=False) as parent:
        os.environ[common.GIT_ENV] = json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None})
        os.environ["MOELAB_PARENT_RUN_ID"] = parent.run_id
        try:
            grid = common.run_grid("99_grid", "tiny", GATES, [0], tmp_path, common=TINY, echo=lines.append)
            again = common.run_grid("99_grid", "tiny", GATES, [0], tmp_path, common=TINY, echo=lines.append)
            # A run without its record trains again from scratch; the finished one is kept.
            common.record_path(tmp_path / "records", "softplus", 0).unlink()
            (tmp_path / "checkpoints" / "softplus-s0" / "stale.txt").write_text("left by the interrupted attempt")
            resumed = common.run_grid("99_grid", "tiny", GATES, [0], tmp_path, common=TINY, echo=lines.append)
        finally:
            del os.environ["MOELAB_PARENT_RUN_ID"], os.environ[common.GIT_ENV]

    assert [(r.arm, r.seed, r.skipped) for r in grid.records] == [("bounded", 0, False), ("softplus", 0, False)]
    assert [r.skipped for r in again.records] == [True, True]
    assert again.table().equals(grid.table())
    # a run read from its record: one line per grid in the report, its own line in the progress file only
    assert lines[2] == "2 of the grid's 2 runs read from their records, not retrained (bounded, softplus)"
    assert [r.skipped for r in resumed.records] == [True, False] and "recorded" not in lines[3]
    assert lines[4].startswith("1 of the grid's 2 runs read from their records")
    assert not (tmp_path / "checkpoints" / "softplus-s0" / "stale.txt").exists()
    assert resumed.records[1].summary["steps"] == 4 and len(resumed.records[1].history) == 4
    assert len(lines) == 5 and lines[0].startswith("[1/2] arm=bounded seed=0 steps=4 val_loss=")
    assert "ETA" in lines[0] and "grid done" in lines[1]
    table = grid.table()
    assert set(table.columns) >= {"arm", "seed", "steps", "best_val_loss", "train_val_gap", "tokens", "epochs",
                                  "gpu_minutes"}
    assert (table.tokens == 4 * 8 * 64).all()  # steps x batch 8 x seq_len 64 (tiny)
    assert (table.epochs > 0).all() and grid.corpus_tokens > 0
    assert (table.gpu_minutes == 0).all()  # trained on the CPU
    assert set(grid.histories().arm) == {"bounded", "softplus"}

    log = (tmp_path / "checkpoints" / "bounded-s0" / "train.log").read_text()
    assert log and not any(noise in log for noise in ("GPU available", "litlogger", "INFO mlflow"))
    assert "\x1b[" not in log  # no cursor movements or colours from rich's live progress bar

    # The portable record: config, code state, curves, timings, machine; no machine path.
    record = json.loads(common.record_path(tmp_path / "records", "bounded", 0).read_text())
    assert record["config"]["model.kda.gate"] == "bounded" and "train.ckpt_dir" not in record["config"]
    assert record["code"]["commit"] == "abc" and len(record["code"]["source_sha256"]) == 16
    assert len(record["history"]["rows"]) == 4 and record["timing"]["gpus"] == 0 and record["timing"]["wall_s"] > 0
    assert record["machine"]["device"].startswith("CPU") and record["mlflow"]["run_id"]
    assert not common.MACHINE_PATH.search(json.dumps(record)), "a machine path in the record"

    client = MlflowClient(tracking_uri)
    children = client.search_runs([parent.experiment_id], f"tags.mlflow.parentRunId = '{parent.run_id}'")
    # The retrained softplus run is a second MLflow run (the first one's record was lost).
    assert sorted(c.data.params["study.arm"] for c in children) == ["bounded", "softplus", "softplus"]
    for c in children:
        assert c.data.tags["moelab.arm"] == c.data.params["study.arm"] and c.data.params["study.seed"] == "0"
        assert {"study/epochs", "study/train_val_gap", "study/best_val_loss",
                "study/gpu_minutes"} <= set(c.data.metrics)
        assert c.data.params["record.gpus"] == "0" and c.data.params["record.device"].startswith("CPU")
        # All at step 0: MLflow then charts them as bars per run (or per arm), not as lone dots on a line chart.
        assert {m.step for m in client.get_metric_history(c.info.run_id, "study/best_val_loss")} == {0}
        assert len(client.get_metric_history(c.info.run_id, "train/loss")) == 4  # a curve: every step of 4
    assert {c.info.run_name for c in children} == {"bounded/s0", "softplus/s0"}

    meta = common.study_meta("99_grid", "cpu", grid)
    assert meta["tokens_per_run"] == meta["tokens_per_run_min"] == 2048
    assert set(meta["train_val_gap"]) == {"bounded", "softplus"}
    assert meta["runs"] == 2 and meta["runs_skipped"] == 0 and "commit" in meta and "device" in meta
    assert meta["gpu_minutes"] == 0.0  # trained on the CPU


def test_grid_evaluates_in_the_training_process_and_checkpoints_once(tmp_path, monkeypatch) -> None:
    import torch

    from moelab.train.runner import AtomicCheckpointIO, load_checkpoint

    saves: list[tuple[str, int]] = []
    save = AtomicCheckpointIO.save_checkpoint

    def counted(self, checkpoint, path, storage_options=None):
        saves.append((os.path.basename(path), checkpoint["global_step"]))
        save(self, checkpoint, path, storage_options)

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", counted)
    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))
    modes: list[tuple[bool, bool]] = []

    def evaluate(model, cfg):
        modes.append((model.training, torch.is_grad_enabled()))
        name, p = next(model.named_parameters())
        return {"name": name, "sum": p.detach().double().sum().cpu(), "seed": cfg.seed}

    def grid():
        return common.run_grid("99_grid", "tiny", {"bounded": GATES["bounded"]}, [0], tmp_path,
                               common={**TINY, "tracking.enabled": False}, echo=lambda line: None,
                               evaluate=evaluate, checkpoints="final")

    first = grid().records[0]
    run_dir = tmp_path / "checkpoints" / "bounded-s0"
    # validations at steps 2 and 4 (val_every 2), one checkpoint: at the end, no best.ckpt
    assert [r["step"] for r in first.history if "val/loss" in r] == [2.0, 4.0]
    assert saves == [("last.ckpt", 4)] and sorted(p.name for p in run_dir.glob("*.ckpt")) == ["last.ckpt"]
    assert first.summary["best_checkpoint"] is None
    assert modes == [(False, False)]
    # evaluated on the trained weights, the ones the checkpoint holds
    weights = load_checkpoint(run_dir / "last.ckpt")["state_dict"][f"model.{first.evals['name']}"]
    assert first.evals["sum"] == weights.double().sum() and first.evals["seed"] == 0

    again = grid().records[0]
    assert again.skipped and len(saves) == 1 and len(modes) == 1
    assert again.evals["name"] == first.evals["name"] and torch.equal(again.evals["sum"], first.evals["sum"])
    evals = common.record_path(tmp_path / "records", "bounded", 0).with_suffix(".evals.pt")
    assert evals.is_file()
    evals.unlink()  # a record without its evaluation is not a finished run
    assert not grid().records[0].skipped and len(modes) == 2
    with pytest.raises(ValueError, match="checkpoints='best'"):
        from moelab.config import load_config
        from moelab.train import fit

        fit(load_config("tiny", {**TINY, "tracking.enabled": False}), checkpoints="best")


def test_a_changed_code_state_reruns(tmp_path, monkeypatch) -> None:
    from moelab.config import load_config

    cfg = load_config("tiny")
    a = common._fingerprint(cfg, {"commit": "abc", "diff_sha256": None})
    assert a == common._fingerprint(cfg, {"commit": "abc", "diff_sha256": None})
    assert a != common._fingerprint(cfg, {"commit": "abd", "diff_sha256": None})
    assert a != common._fingerprint(cfg, {"commit": "abc", "diff_sha256": "0123"})
    assert a != common._fingerprint(load_config("tiny", {"train.lr": 1e-2}), {"commit": "abc", "diff_sha256": None})
    # With the source hash, the commit does not count (a record made before its own commit still matches),
    # nor where the run lives (another checkout, another store); the source and the config do.
    src = {"commit": "abc", "diff_sha256": None, "source_sha256": "1" * 16}
    b = common._fingerprint(cfg, src)
    assert b == common._fingerprint(cfg, {**src, "commit": "abd", "diff_sha256": "0123"})
    assert b == common._fingerprint(load_config("tiny", {"train.ckpt_dir": "/elsewhere/run",
                                                         "tracking.tracking_uri": "sqlite:///other.db"}), src)
    assert b != common._fingerprint(cfg, {**src, "source_sha256": "2" * 16})
    assert b != common._fingerprint(load_config("tiny", {"seed": 1}), src)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"format": common.RECORD_FORMAT, "fingerprint": a,
                                "summary": {"status": "interrupted"}}))
    assert common._load_record(path, a) is None  # only finished runs are reused


def test_source_hash_follows_the_package_source(tmp_path, monkeypatch) -> None:
    import moelab

    pkg = tmp_path / "moelab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub" / "m.py").write_text("y = 2\n")
    monkeypatch.setattr(moelab, "__file__", str(pkg / "__init__.py"))
    first = common.source_sha256()
    (pkg / "notes.txt").write_text("not code")
    assert common.source_sha256() == first
    (pkg / "sub" / "m.py").write_text("y = 3\n")
    assert common.source_sha256() != first


def test_split_selection_parses_and_picks() -> None:
    assert common.parse_runs("bounded:0, softplus:12") == {("bounded", 0), ("softplus", 12)}
    assert common.parse_runs("a:b:1") == {("a:b", 1)}  # the seed follows the last colon
    for bad in ("bounded", "bounded:", ":1", "bounded:x"):
        with pytest.raises(ValueError, match="expected arm:seed"):
            common.parse_runs(bad)
    assert common.parse_shard("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "1", "a/b"):
        with pytest.raises(ValueError, match="1 <= i <= n"):
            common.parse_shard(bad)
    shard = common.Split(shard=(2, 3))
    assert [i for i in range(7) if shard.wants(i, "a", 0)] == [1, 4]
    named = common.Split(runs=frozenset({("a", 1)}))
    assert named.wants(5, "a", 1) and not named.wants(0, "a", 0) and not named.wants(0, "b", 1)


def test_split_calls_train_only_their_runs_and_stop_at_the_incomplete_grid(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))
    lines: list[str] = []

    def grid(split=None):
        return common.run_grid("99_grid", "tiny", GATES, [0, 1], tmp_path, echo=lines.append, split=split,
                               common={**TINY, "tracking.enabled": False, "train.max_steps": 2})

    with pytest.raises(common.GridIncomplete, match=r"trained softplus:1; .*3 run\(s\) of this grid still to train: "
                                                    r"bounded:0, bounded:1, softplus:0") as stop:
        grid(common.Split(runs=common.parse_runs("softplus:1")))
    assert stop.value.trained == ["softplus:1"] and len(stop.value.missing) == 3
    assert [p.name for p in sorted((tmp_path / "records").glob("*.json"))] == ["softplus_s1.json"]
    # A named run that is not in this grid: the grid returns (incomplete) for a later grid to meet it.
    partial = grid(common.Split(runs=common.parse_runs("bounded:0,other:3")))
    assert not partial.complete and [(r.arm, r.seed, r.skipped) for r in partial.records] == [
        ("bounded", 0, False), ("softplus", 1, True)]
    assert "other:3" in lines[-1]
    with pytest.raises(common.GridIncomplete, match=r"trained bounded:1; .*still to train: softplus:0"):
        grid(common.Split(shard=(2, 2)))  # runs 2 and 4 of the grid: bounded:1 (new), softplus:1 (recorded)
    whole = grid()
    assert whole.complete and [r.skipped for r in whole.records] == [True, True, False, True]


def test_a_stopped_run_resumes_from_its_checkpoint(tmp_path, monkeypatch) -> None:
    """SIGINT in the middle of a run: last.ckpt and an interrupted summary stay; the next call resumes from
    there (the steps before the stop are not trained again) and the record covers the whole run."""
    import signal

    from moelab.train.callbacks import Interrupted, StopControl

    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))
    start = StopControl.on_train_start

    def stop_at_step_2(self, trainer, pl_module):
        start(self, trainer, pl_module)
        if trainer.global_step == 0:
            self.on_step_end = lambda trainer, pl_module: (  # type: ignore[method-assign]
                self.request_stop(signal.SIGINT) if trainer.global_step == 2 else None,
                StopControl.on_step_end(self, trainer, pl_module))

    def grid():
        return common.run_grid("99_grid", "tiny", {"bounded": GATES["bounded"]}, [0], tmp_path,
                               echo=lambda line: None, checkpoints="final",
                               common={**TINY, "tracking.enabled": False})

    monkeypatch.setattr(StopControl, "on_train_start", stop_at_step_2)
    with pytest.raises(Interrupted):
        grid()
    run_dir = tmp_path / "checkpoints" / "bounded-s0"
    assert (run_dir / "last.ckpt").is_file() and not (tmp_path / "records").exists()
    monkeypatch.setattr(StopControl, "on_train_start", start)
    rec = grid().records[0]
    assert rec.timing["resumed"] and rec.summary["steps"] == 4
    assert [r["step"] for r in rec.history] == [1, 2, 3, 4]  # the whole run: before the stop, then after


def test_quiet_known_noise_drops_only_the_noise(capsys) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    common.quiet_known_noise()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        rank_zero_info("GPU available: False, used: False")
        rank_zero_info("💡 Tip: try installing [litlogger](https://pypi.org/project/litlogger/)")
        rank_zero_info("Ctrl-C: stopping after this step")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    assert seen == ["Ctrl-C: stopping after this step"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        common.quiet_known_noise()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("something else", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else"]
    assert logging.getLogger("mlflow").getEffectiveLevel() >= logging.WARNING


# tqdm.auto imported inside a Jupyter kernel that has no ipywidgets (the GPU machines' kernels): tqdm
# warns "IProgress not found" with the path of its own file, once, when Lightning first imports it.
_TQDM_IN_A_KERNEL = """
import sys, types
import IPython  # noqa: F401  (tqdm reads sys.modules["IPython"])
sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")  # what tqdm looks for
sys.modules["ipywidgets"] = None  # import fails
if sys.argv[1] == "quiet":
    from moelab.studies import common
    common.quiet_known_noise()
import tqdm.auto
"""


@pytest.mark.parametrize("quiet", [False, True])
def test_tqdm_ipywidgets_warning_is_known_noise_and_filtered(quiet: bool) -> None:
    import re
    import subprocess
    import sys

    from moelab.base import repo_root

    done = subprocess.run([sys.executable, "-c", _TQDM_IN_A_KERNEL, "quiet" if quiet else "loud"], cwd=repo_root(),
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo_root()), "PYTHONWARNINGS": ""})
    assert done.returncode == 0, done.stderr
    if quiet:
        assert "IProgress" not in done.stderr
    else:  # the line the GPU notebook showed; the report test counts it as noise
        assert "TqdmWarning: IProgress not found" in done.stderr
        assert any(re.search(noise, done.stderr) for noise in common.KNOWN_NOISE)


def test_output_to_moves_print_stderr_and_handlers(tmp_path, capsys) -> None:
    import sys

    logger = logging.getLogger("moelab.test.output_to")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with common.output_to(tmp_path / "log.txt"):
            print("printed")
            logger.warning("logged")
            print("to stderr", file=sys.stderr)  # where warnings.showwarning writes
        logger.warning("after")
    finally:
        logger.removeHandler(handler)
    text = (tmp_path / "log.txt").read_text()
    assert "printed" in text and "logged" in text and "to stderr" in text and "after" not in text
    out = capsys.readouterr()
    assert "printed" not in out.out and "after" in out.err
    assert handler.stream is sys.stderr


def test_show_returns_an_inline_png(tmp_path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    fig.subplots().plot([0, 1], [1, 0])
    img = common.show(fig, tmp_path / "f" / "plot.png")
    png = (tmp_path / "f" / "plot.png").read_bytes()
    from IPython.core.formatters import format_display_data

    assert png.startswith(b"\x89PNG") and img.data == png
    assert "image/png" in format_display_data(img)[0]


def test_loss_curves_one_colour_per_arm() -> None:
    recs = [common.RunRecord(arm=a, seed=s, summary={"steps": 3}, tokens=1, epochs=1.0, train_val_gap=0.0,
                             fingerprint="x", history=[{"step": i, "train/loss": 5.0 - i + s} for i in (1, 2, 3)],
                             val_history=[[3, 4.5 + s]])
            for a in ("a", "b") for s in (0, 1)]
    fig = common.loss_curves(common.Grid("s", "tiny", recs))
    ax = fig.axes[0]
    train_lines = [ln for ln in ax.lines if ln.get_linestyle() == "-"]
    assert len(train_lines) == 6  # 2 arms x (2 seeds thin + 1 mean bold)
    bold = [ln for ln in train_lines if ln.get_linewidth() == 2.0]
    assert len(bold) == 2 and bold[0].get_color() != bold[1].get_color()
    assert list(bold[0].get_ydata()) == [4.5, 3.5, 2.5]  # mean over the two seeds
    assert [t.get_text() for t in ax.get_legend().get_texts()][:2] == ["a train (2 seeds)", "a val"]


def test_measured_commit_prefers_the_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"meta": {"commit": "0123456789abcdef"}}))
    assert common.measured_commit(path) == {"commit": "0123456789ab", "how": "recorded in the file"}
    assert common.measured_commit(tmp_path / "none.json")["commit"] is None


def test_machine_path_pattern() -> None:
    for bad in ("/work/main/x.py", "see /tmp/a.json", "'/root/out/k.json'", "/home/u/x"):
        assert common.MACHINE_PATH.search(bad), bad
    for ok in ("studies/01_decay_bound/x", "kernels/results/kda_h200.json", "1/tmp", "nats/token"):
        assert not common.MACHINE_PATH.search(ok), ok


def test_git_state_leaves_out_the_excluded_results(tmp_path, monkeypatch) -> None:
    """A changed result file under an excluded folder keeps the tree clean; a changed code file does not."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "summary.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    monkeypatch.setattr(common, "repo_root", lambda: tmp_path)
    (tmp_path / "studies" / "summary.json").write_text('{"new": 1}')
    assert common.git_state(exclude=("studies",))["dirty"] is False
    assert common.git_state()["dirty"] is False  # the outputs of studies and benchmarks by default
    assert common.git_state(exclude=())["dirty"] is True
    (tmp_path / "code.py").write_text("x = 2\n")
    state = common.git_state(exclude=("studies",))
    assert state["dirty"] is True and state["diff_sha256"]


def test_monitor_records_a_trajectory_without_changing_the_training(tmp_path, monkeypatch) -> None:
    """run_grid's monitor: points at steps 0, n, 2n and the last, measured in eval mode without autograd on the
    weights of that step; the training it watches is bitwise the one without it; the points live in the record."""
    import torch

    from moelab.train.runner import load_checkpoint

    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))
    modes: list[tuple[bool, bool]] = []

    def fn(model, cfg):
        modes.append((model.training, torch.is_grad_enabled()))
        name, p = next(model.named_parameters())
        return {"name": name, "sum": p.detach().double().sum(), "hist": torch.tensor([1, 2])}

    def grid(folder, monitor):
        return common.run_grid("99_grid", "tiny", {"bounded": GATES["bounded"]}, [0], tmp_path / folder,
                               common={**TINY, "train.max_steps": 5, "tracking.enabled": False},
                               echo=lambda line: None, checkpoints="final", monitor=monitor)

    watched = grid("watched", (2, fn)).records[0]
    plain = grid("plain", None).records[0]
    assert [p["step"] for p in watched.trajectory] == [0, 2, 4, 5]  # every 2 steps, and the last (5)
    assert modes == [(False, False)] * 4
    assert [h["train/loss"] for h in watched.history] == [h["train/loss"] for h in plain.history]
    assert plain.trajectory is None
    state = load_checkpoint(tmp_path / "watched" / "checkpoints" / "bounded-s0" / "last.ckpt")["state_dict"]
    name = watched.trajectory[-1]["name"]
    assert watched.trajectory[-1]["sum"] == state[f"model.{name}"].double().sum().item()
    assert watched.trajectory[0]["sum"] != watched.trajectory[-1]["sum"] and watched.trajectory[0]["hist"] == [1, 2]
    again = grid("watched", (2, fn)).records[0]  # read back from the record's JSON, not retrained
    assert again.skipped and len(modes) == 4 and again.trajectory == watched.trajectory
    table = common.Grid("99_grid", "tiny", [watched]).trajectories()
    assert list(table.columns) == ["arm", "seed", "step", "name", "sum"] and table.step.tolist() == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="monitor="):
        grid("bad", (0, fn))
    assert not list(tmp_path.rglob("*.trajectory.jsonl"))  # a finished record holds the whole trajectory


def test_a_stopped_monitored_run_leaves_its_trajectory_so_far(tmp_path, monkeypatch) -> None:
    """A run stopped before its record is written (here: the monitor itself fails at step 4) leaves the points
    measured so far beside where its record would be, one JSON line each: a call's time limit still returns them."""
    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))

    def fn(model, cfg):
        step = len(seen)
        seen.append(step)
        if step == 2:
            raise RuntimeError("stopped at the third point")
        return {"point": step}

    seen: list[int] = []
    with pytest.raises(Exception, match="stopped at the third point"):
        common.run_grid("99_grid", "tiny", {"bounded": GATES["bounded"]}, [0], tmp_path / "out",
                        common={**TINY, "train.max_steps": 5, "tracking.enabled": False},
                        echo=lambda line: None, checkpoints="final", monitor=(2, fn))
    partial = list(tmp_path.rglob("*.trajectory.jsonl"))
    assert [p.name for p in partial] == ["bounded_s0.trajectory.jsonl"]
    assert partial[0].parent.name == "records" or "records" in partial[0].parts
    assert [json.loads(line) for line in partial[0].read_text().splitlines()] == [
        {"step": 0, "point": 0}, {"step": 2, "point": 1}]


def test_evaluate_gets_the_trainer_when_it_takes_one(tmp_path, monkeypatch) -> None:
    """An evaluate with a ``trainer`` parameter gets the Lightning Trainer (its optimizer state, its step);
    one without it is called as before (``common.wants_trainer``)."""
    import functools

    import torch

    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))

    def evaluate(model, cfg, trainer, scale=1.0):
        opt = trainer.optimizers[0]
        params = [p for g in opt.param_groups for p in g["params"]]
        states = [opt.state[p] for p in params if p in opt.state]
        return {"step": trainer.global_step, "max_steps": trainer.max_steps, "params": len(params),
                "with_state": len(states), "state_steps": sorted({int(s["step"]) for s in states}),
                "same_shapes": all(s["exp_avg"].shape == p.shape for p, s in zip(params, states)),
                "sq": scale * sum(float(s["exp_avg_sq"].sum()) for s in states)}

    rec = common.run_grid("99_trainer", "tiny", {"bounded": GATES["bounded"]}, [0], tmp_path,
                          common={**TINY, "tracking.enabled": False}, echo=lambda line: None,
                          evaluate=functools.partial(evaluate, scale=2.0), checkpoints="final").records[0]
    ev = rec.evals
    assert ev["step"] == ev["max_steps"] == TINY["train.max_steps"] == rec.summary["steps"]
    assert ev["params"] > 0 and ev["with_state"] == ev["params"] and ev["same_shapes"]  # AdamW's moments per param
    assert ev["state_steps"] == [TINY["train.max_steps"]] and ev["sq"] > 0.0

    assert common.wants_trainer(evaluate) and common.wants_trainer(functools.partial(evaluate, scale=2.0))
    assert common.wants_trainer(lambda model, cfg, *, trainer: None)
    assert not common.wants_trainer(lambda model, cfg: None)
    assert not common.wants_trainer(lambda model, cfg, **kw: None)  # only a parameter named trainer asks for it
    assert not common.wants_trainer(torch.add)  # no signature: called as before


def test_records_code_reads_a_pin_an_older_harness_kept_in_place_of_the_hash() -> None:
    def rec(code: dict) -> common.RunRecord:
        return common.RunRecord(arm="a", seed=0, summary={}, history=[], val_history=[], tokens=0, epochs=0.0,
                                train_val_gap=None, fingerprint="f", code=code)

    got = common.records_code([rec({"commit": "abc", "source_sha256": "s1research-1"}),
                               rec({"commit": "def", "dirty": True, "source_sha256": "0123abcd",
                                    "source_pin": "s1research-1"})])
    assert got == {"commits": ["abc", "def-dirty"], "source_sha256": ["0123abcd"], "source_pins": ["s1research-1"]}


def test_a_field_added_at_its_old_behaviour_keeps_fingerprints():
    """``common.ADDED_KEYS``: a config key added after records were made is left out of a run's fingerprint (and
    record config) at the value that computes what the code did before it, so committed records still count; any
    other value of it is part of the fingerprint."""
    from moelab.config import flatten, load_config
    from moelab.studies import common

    code = {"source_pin": "test-1"}
    for key, old in common.ADDED_KEYS.items():
        cfg = load_config("tiny", {key: old})
        assert key in flatten(cfg) and key not in common._run_config(cfg)
        other = {"model.norm_backend": "triton", "model.mla.fp32_output_precision": "high",
                 "model.loss_backend": "triton", "model.residual.launch": "r4w4g1-b4w4g1s2"}[key]
        changed = load_config("tiny", {key: other})
        assert common._run_config(changed)[key] == other
        assert common._fingerprint(changed, code) != common._fingerprint(cfg, code)
