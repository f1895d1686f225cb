"""A study split across calls (``make study-N RUNS=arm:seed,...``) equals the study run in one go, and a study
stopped by a signal (or killed) resumes: through the runner, on the ``tiny`` preset."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jupytext
import nbformat
import pandas as pd
import pytest

from moelab.studies import common
from moelab.studies.runner import run_study
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
# The study module (its train(preset, out_dir), which a split call runs) and the notebook that calls the same train.
MODULE = '''from moelab.studies import common


def train(preset, out_dir):
    return common.run_grid("{name}", "tiny", {{"bounded": {{"model.kda.gate": "bounded"}},
                                              "softplus": {{"model.kda.gate": "softplus"}}}}, {seeds}, out_dir,
                           common={{"train.max_steps": {steps}, "train.warmup_steps": 1, "train.val_every": {val},
                                   "train.val_batches": 1, "tracking.log_system_metrics": False}}, checkpoints="final")
'''
GRID = '''# %% tags=["parameters"]
preset = "cpu"
out_dir = "."

# %%
import json

import study_{name} as study

from moelab.studies import common

grid = study.train(preset, out_dir)
grid.table().to_csv("runs.csv", index=False)
json.dump({{"meta": common.study_meta("{name}", preset, grid), "runs": len(grid.records)}}, open("summary.json", "w"))
'''
LOSSES = ["arm", "seed", "steps", "best_val_loss", "final_val_loss", "final_train_loss", "train_val_gap", "tokens"]


def _notebook(folder: Path, name: str, seeds: list[int], steps: int = 4, val: int = 2) -> Path:
    """``folder/<name>.ipynb`` and its study module ``folder/study_<name>.py`` (importable with ``folder`` on the
    path: :func:`_importable`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"study_{name}.py").write_text(MODULE.format(name=name, seeds=seeds, steps=steps, val=val))
    nb = jupytext.reads(GRID.format(name=name), fmt="py:percent")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, folder / f"{name}.ipynb")
    return folder


def _importable(folder: Path, monkeypatch) -> None:
    """The study modules in ``folder`` import here (a split call) and in the notebook's kernel (PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))


def _store(tmp_path: Path, template: Path, name: str) -> str:
    db = tmp_path / f"{name}.db"
    shutil.copy(template, db)
    return f"sqlite:///{db}"


# The code state every call shares: other work in the checkout between calls must not count as a code change.
CODE = json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None, "source_sha256": "5" * 16})


@pytest.mark.slow
def test_three_split_calls_and_a_final_one_equal_one_go(tmp_path, tracking_uri, mlflow_template_db,  # noqa: F811
                                                         monkeypatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv(common.GIT_ENV, CODE)

    nbs = _notebook(tmp_path / "nbs", "07_split", [0, 1])
    _importable(nbs, monkeypatch)
    one_go = run_study(7, "cpu", nbs_dir=nbs, out_root=tmp_path / "one", log_output=False,
                       tracking_uri=_store(tmp_path, mlflow_template_db, "one"))
    lines: list[str] = []
    # Three calls "on other machines" (each its own MLflow store, as on a GPU machine), then the final call here.
    for i, runs in enumerate(("bounded:0", "softplus:1", "bounded:1")):
        out = run_study(7, "cpu", runs=runs, nbs_dir=nbs, out_root=tmp_path / "split", log_output=False,
                        tracking_uri=_store(tmp_path, mlflow_template_db, f"machine{i}"), echo=lines.append,
                        module="study_07_split")
        records = sorted(p.name for p in (out / "records" / "cpu").glob("*.json"))
        assert len(records) == i + 1 and f"{runs.replace(':', '_s')}.json" in records
        assert lines[-1].startswith(f"study 7, split call: trained {runs}; records in ")
        assert not (out / "07_split.ipynb").exists()  # the report's folder holds no notebook of a split call
    start = len(lines)
    final = run_study(7, "cpu", nbs_dir=nbs, out_root=tmp_path / "split", tracking_uri=tracking_uri, log_output=False,
                      echo=lines.append)
    # the terminal gets every run's line (the progress file), then the grid's line on the runs read from records
    trained = [ln for ln in lines[start:] if ln.startswith("[")]
    assert [("recorded" in ln) for ln in trained] == [True, True, False, True]  # only softplus:0 trained here
    assert any(ln.startswith("3 of the grid's 4 runs read from their records") for ln in lines[start:]), lines[start:]

    table = pd.read_csv(final / "runs.csv")
    pd.testing.assert_frame_equal(table[LOSSES], pd.read_csv(one_go / "runs.csv")[LOSSES])
    assert json.loads((final / "summary.json").read_text())["runs"] == 4

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name("study/07_split")
    parent = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == "07_split-cpu"]
    assert len(parent) == 1 and parent[0].info.status == "FINISHED"
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent[0].info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["bounded/s0", "bounded/s1", "softplus/s0", "softplus/s1"]
    imported = {c.info.run_name: c for c in children if common.IMPORTED_TAG in c.data.tags}
    assert sorted(imported) == ["bounded/s0", "bounded/s1", "softplus/s1"]
    for name, c in imported.items():
        assert c.info.status == "FINISHED" and c.data.params["record.device"].startswith("CPU")
        assert float(c.data.params["record.wall_s"]) > 0 and c.data.params["record.gpu_minutes"] == "0.0"
        assert c.data.params["model.kda.gate"] == name.split("/")[0]
        assert len(client.get_metric_history(c.info.run_id, "train/loss")) == 4
    # A second final call logs nothing again and trains nothing.
    run_study(7, "cpu", nbs_dir=nbs, out_root=tmp_path / "split", tracking_uri=tracking_uri, log_output=False,
              echo=lines.append)
    assert len(client.search_runs([exp.experiment_id], f"tags.`{common.IMPORTED_TAG}` != ''")) == 3
    again = [ln for ln in lines[start:] if ln.startswith("[")][4:]
    assert len(again) == 4 and all("recorded" in ln for ln in again)


def test_a_bad_split_is_refused_before_anything_runs(tmp_path) -> None:
    with pytest.raises(ValueError, match="expected arm:seed"):
        run_study(7, "cpu", runs="bounded", nbs_dir=tmp_path)
    with pytest.raises(ValueError, match="1 <= i <= n"):
        run_study(7, "cpu", shard="3/2", nbs_dir=tmp_path)
    with pytest.raises(ValueError, match="give one of them"):
        run_study(7, "cpu", runs="a:1", shard="1/2", nbs_dir=tmp_path)


DRIVER = """
import sys
from pathlib import Path
from moelab.studies.runner import StudyStopped, run_study
try:
    run_study(8, "cpu", nbs_dir=Path({nbs!r}), out_root=Path({out!r}), tracking_uri={uri!r}, log_output=False)
except StudyStopped as e:
    print(f"stopped: {{e}}", file=sys.stderr)
    sys.exit(128 + e.signum)
print("done")
"""


def _start(nbs: Path, out: Path, uri: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(nbs), str(ROOT))),
           common.GIT_ENV: CODE}
    return subprocess.Popen([sys.executable, "-c", DRIVER.format(nbs=str(nbs), out=str(out), uri=uri)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    end = time.time() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the study ended early: {proc.communicate()}"
        assert time.time() < end, f"{path} never appeared"
        time.sleep(0.2)


def _wait_training(client, experiment: str, run_name: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until ``run_name`` of ``experiment`` has logged a training loss (its training steps, signal handler set)."""
    end = time.time() + timeout_s
    while True:
        exp = client.get_experiment_by_name(experiment)
        runs = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == run_name] if exp else []
        if any(client.get_metric_history(r.info.run_id, "train/loss") for r in runs if r.info.status == "RUNNING"):
            return
        assert proc.poll() is None, f"the study ended early: {proc.communicate()}"
        assert time.time() < end, f"{run_name} never trained"
        time.sleep(0.5)


def _why_no_checkpoint(run_dir: Path, stderr: str) -> str:
    """What a stopped run left (its files, the end of its training output without the progress bar) and the study's
    stderr: the failure message of a stop that saved no checkpoint (seen twice in CI, never reproduced alone)."""
    from moelab.studies.runner import _ANSI

    log = run_dir / "train.log"
    text = _ANSI.sub("", log.read_text(errors="replace")) if log.is_file() else "(no train.log)"
    bar = ("train/", "val/", "tok/s", "lr")  # the progress bar's metric lines
    lines = [ln for ln in text.splitlines() if ln.strip() and "━" not in ln and not ln.strip().startswith(bar)]
    files = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else "(no folder)"
    return f"files {files}; train.log ends:\n" + "\n".join(lines[-25:]) + f"\nstderr ends:\n{stderr[-2000:]}"


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_a_rerun_resumes_also_after_kill_9(tmp_path, tracking_uri) -> None:  # noqa: F811
    from mlflow.tracking import MlflowClient

    nbs = _notebook(tmp_path / "nbs", "08_stop", [0], steps=300, val=100)
    out = tmp_path / "out"
    study = out / "08_stop"
    client = MlflowClient(tracking_uri)
    proc = _start(nbs, out, tracking_uri)
    _wait_for(study / "checkpoints" / "softplus-s0" / "train.log", proc)  # the first run is recorded, the second runs
    _wait_training(client, "study/08_stop", "softplus/s0", proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped: study 8 stopped by SIGTERM: finished runs are recorded in ") and "resumes" in last
    assert "Traceback" not in stderr
    assert not list(study.glob(".*.tmp.ipynb")) and not (study / "08_stop.ipynb").exists()
    stopped = study / "checkpoints" / "softplus-s0"
    assert (stopped / "last.ckpt").is_file(), _why_no_checkpoint(stopped, stderr)
    assert [p.name for p in (study / "records" / "cpu").glob("*.json")] == ["bounded_s0.json"]
    exp = client.get_experiment_by_name("study/08_stop")
    status = {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}
    assert status == {"08_stop-cpu": "KILLED", "bounded/s0": "FINISHED", "softplus/s0": "KILLED"}

    # kill -9 of the rerun while it trains: its runs stay RUNNING until the next call closes them.
    proc = _start(nbs, out, tracking_uri)
    end = time.time() + 300
    while not any(r.info.status == "RUNNING" and r.info.run_name == "softplus/s0"
                  for r in client.search_runs([exp.experiment_id])):
        assert proc.poll() is None and time.time() < end, proc.communicate()
        time.sleep(0.5)
    import psutil

    kernels = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(kernels, timeout=60)  # the kernel notices that its parent is gone and exits
    assert not alive, alive

    proc = _start(nbs, out, tracking_uri)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "done" in stdout, stderr[-3000:]
    assert "closed 2 MLflow run(s) left RUNNING by a process that was killed" in stderr
    statuses = [r.info.status for r in client.search_runs([exp.experiment_id])]
    assert "RUNNING" not in statuses
    record = json.loads((study / "records" / "cpu" / "softplus_s0.json").read_text())
    assert record["summary"]["steps"] == 300
    assert [h["step"] for h in common._unpack_history(record["history"])] == list(range(1, 301))
    table = pd.read_csv(study / "runs.csv")
    assert list(table.arm) == ["bounded", "softplus"] and (table.steps == 300).all()


BROKEN_STOP = '''# %% tags=["parameters"]
preset = "cpu"
out_dir = "."

# %%
import time
from pathlib import Path

Path({ready!r}).write_text("in the cell")
try:
    time.sleep(300)
except KeyboardInterrupt:
    raise ValueError("the checkpoint could not be written")
'''


@pytest.mark.slow
def test_a_stop_that_fails_in_the_kernel_is_shown_not_dropped(tmp_path, tracking_uri) -> None:  # noqa: F811
    """A kernel that fails while it stops (not the clean Interrupted of a saved run) has its error shown on stderr and
    named in the last line, instead of being dropped with its notebook."""
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    ready = tmp_path / "ready"
    nb = jupytext.reads(BROKEN_STOP.format(ready=str(ready)), fmt="py:percent")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nbs / "08_stop.ipynb")
    proc = _start(nbs, tmp_path / "out", tracking_uri)
    _wait_for(ready, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    assert "the run in progress failed while it stopped, in its kernel:" in stderr
    assert "ValueError: the checkpoint could not be written" in stderr and "\x1b[" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert "the run in progress failed while it stopped (ValueError, above)" in last, last


def test_a_stop_reaches_the_kernels_not_their_workers(monkeypatch) -> None:
    """The study's Ctrl-C goes to each Jupyter kernel, not to the processes a kernel forked (a DataLoader worker
    carries its kernel's command line; stopped mid-batch, it fails the run instead of letting it save at the end of
    its step): a kernel, its two workers and a second kernel give the two kernels."""
    import psutil

    from moelab.studies import runner

    class Proc:
        def __init__(self, pid, ppid, cmd):
            self.pid, self._ppid, self._cmd = pid, ppid, cmd

        def ppid(self):
            return self._ppid

        def cmdline(self):
            return self._cmd

    kernel = ["python", "-m", "ipykernel_launcher", "-f", "k.json"]
    procs = [Proc(10, 1, kernel), Proc(11, 10, kernel), Proc(12, 10, kernel), Proc(20, 1, kernel),
             Proc(30, 1, ["python", "-c", "pass"])]

    class Me:
        def children(self, recursive=False):
            assert recursive
            return procs

    monkeypatch.setattr(psutil, "Process", lambda *a: Me())
    assert runner._kernel_pids() == [10, 20]
