"""A split call (``make study-N RUNS=...``) runs the study module's ``train(preset, out_dir)`` in the runner's process:
no notebook, no Jupyter kernel, no papermill, and no MLflow needed. Checked in a subprocess where mlflow, papermill,
nbformat, nbclient, nbconvert, ipykernel, jupytext, latex2mathml and IPython cannot be imported (a meta-path blocker
in a ``sitecustomize``, as on the GPU machine without the lab wheels): two split calls record the grid's runs, equal to
the grid trained in one go here, and a later call with MLflow logs the untracked records into its store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moelab.studies import common
from moelab.studies.runner import StudyFailed, run_study, split_groups
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("mlflow", "papermill", "nbformat", "nbclient", "nbconvert", "ipykernel", "jupytext", "latex2mathml",
           "IPython")
SITECUSTOMIZE = f'''
import sys


class _Blocked:
    """Refuses the lab's notebook and tracking packages, as a GPU image without the lab wheels does."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
'''
# The study module: the convention's train(preset, out_dir), one grid of two arms x one seed, 4 steps each.
MODULE = '''
from moelab.studies import common

ARMS = {"bounded": {"model.kda.gate": "bounded"}, "softplus": {"model.kda.gate": "softplus"}}
COMMON = {"train.max_steps": 4, "train.warmup_steps": 1, "train.val_every": 2, "train.val_batches": 1,
          "tracking.log_system_metrics": False}


def train(preset, out_dir):
    return common.run_grid("07_nowheels", "tiny", ARMS, [0], out_dir, common=COMMON, checkpoints="final",
                           source_pin="s7test-1")
'''


def _study_package(tmp_path: Path, name: str, max_steps: int | None = None) -> tuple[Path, Path]:
    """A package folder with the toy split study ``split_<name>`` (MODULE as ``07_<name>``, ``max_steps`` per run
    where given) and a notebook folder naming it; returns both."""
    pkg, nbs = tmp_path / "pkg", tmp_path / "nbs"
    for d in (pkg, nbs):
        d.mkdir()
    source = MODULE.replace("07_nowheels", f"07_{name}")
    if max_steps is not None:
        source = source.replace('"train.max_steps": 4', f'"train.max_steps": {max_steps}')
    (pkg / f"split_{name}.py").write_text(source)
    (nbs / f"07_{name}.ipynb").write_text("{}")
    return pkg, nbs


DRIVER = '''
import sys
from pathlib import Path

from moelab.studies.runner import run_study

for name in {blocked!r}:
    try:
        __import__(name)
    except ImportError:
        continue
    raise SystemExit(f"{{name}} was importable")
lines = []
for runs in ("bounded:0", "softplus:0"):
    run_study(7, "cpu", runs=runs, nbs_dir=Path({nbs!r}), out_root=Path({out!r}), module="split_nowheels",
              echo=lines.append)
print("\\n".join(lines))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
print("LOADED", loaded)
'''
KEYS = ("fingerprint", "arm", "seed", "tokens", "epochs", "train_val_gap", "val_history", "trajectory", "config")


def _computed(history: dict) -> dict[str, list]:
    """A packed history's columns without the timings (``perf/*``: wall-clock measures differ run to run)."""
    cols = history["columns"]
    return {c: [row[i] for row in history["rows"]] for i, c in enumerate(cols) if not c.startswith("perf/")}


def _records(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


@pytest.mark.slow
def test_split_calls_without_mlflow_or_papermill_record_runs_equal_to_one_go(tmp_path, tracking_uri,  # noqa: F811
                                                                             monkeypatch) -> None:
    site, pkg, nbs = tmp_path / "site", tmp_path / "pkg", tmp_path / "nbs"
    for d in (site, pkg, nbs):
        d.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (pkg / "split_nowheels.py").write_text(MODULE)
    (nbs / "07_nowheels.ipynb").write_text("{}")  # names the study; a split call never reads it
    code = json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None, "source_sha256": "5" * 16})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(site), str(pkg), str(ROOT))),
           common.GIT_ENV: code}
    env.pop("MLFLOW_TRACKING_URI", None)
    out = tmp_path / "split"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(DRIVER.format(blocked=BLOCKED, nbs=str(nbs),
                                                                                out=str(out)))],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "LOADED []"  # nothing of the lab's notebook or tracking stack was imported
    untracked = [ln for ln in lines if "MLflow cannot be imported here" in ln]
    assert len(untracked) == 2 and "the final call (`make study-7 PRESET=cpu`) logs them" in untracked[0]
    said = [ln for ln in lines if ln.startswith("study 7, split call: ") and "MLflow" not in ln]
    assert said[0].startswith("study 7, split call: trained bounded:0; records in ")
    assert said[0].endswith("1 run(s) of this grid still to train: softplus:0; when every run is recorded, "
                            "`make study-7 PRESET=cpu` trains what is missing and writes the report")
    assert said[1].startswith("study 7, split call: every run of the study is recorded in ")
    assert sum(ln.startswith("[") and "arm=" in ln for ln in lines) == 2  # bounded, then softplus
    assert sum(ln.startswith("1 of the grid's 2 runs read from their records") for ln in lines) == 1  # bounded
    split_records = _records(out / "07_nowheels" / "records" / "cpu")
    assert sorted(split_records) == ["bounded_s0.json", "softplus_s0.json"]
    assert not (out / "07_nowheels" / "07_nowheels.ipynb").exists()  # no notebook ran
    assert (out / "07_nowheels" / "split" / "checkpoints" / "softplus-s0" / "last.ckpt").is_file()
    for rec in split_records.values():
        assert rec["mlflow"]["run_id"] is None and rec["code"]["source_pin"] == "s7test-1"
        assert rec["code"]["source_sha256"] == "5" * 16 and rec["command"].startswith("make study-7 PRESET=cpu RUNS=")

    # The same grid in one go, here (MLflow importable, a test store), gives the same records.
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv(common.GIT_ENV, code)
    import split_nowheels

    one = split_nowheels.train("cpu", tmp_path / "one")
    one_records = _records(tmp_path / "one" / "records")
    assert sorted(one_records) == sorted(split_records) and not any(r.skipped for r in one.records)
    for name, rec in split_records.items():
        mine = one_records[name]
        assert {k: rec[k] for k in KEYS} == {k: mine[k] for k in KEYS}, name
        assert _computed(rec["history"]) == _computed(mine["history"]), name  # every curve but the timings
        assert rec["summary"]["final_val_loss"] == mine["summary"]["final_val_loss"] and rec["summary"]["steps"] == 4

    # A later call with MLflow reads the records (trains nothing) and logs each untracked run into its store once.
    from mlflow.tracking import MlflowClient

    again = common.run_grid("07_nowheels", "tiny", split_nowheels.ARMS, [0], tmp_path / "final",
                            common=split_nowheels.COMMON, records_dir=out / "07_nowheels" / "records" / "cpu",
                            source_pin="s7test-1", echo=lambda line: None)
    assert all(r.skipped for r in again.records)
    client = MlflowClient(tracking_uri)
    imported = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  f"tags.`{common.IMPORTED_TAG}` != ''")
    assert sorted(r.data.tags["moelab.arm"] for r in imported) == ["bounded", "softplus"]
    assert all(len(client.get_metric_history(r.info.run_id, "train/loss")) == 4 for r in imported)


def test_a_split_call_needs_the_study_modules_train(tmp_path) -> None:
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    (nbs / "07_notrain.ipynb").write_text("{}")
    with pytest.raises(StudyFailed, match=r"study 7 \(07_notrain\): json has no train\(preset, out_dir\)"):
        run_study(7, "cpu", runs="a:0", nbs_dir=nbs, out_root=tmp_path / "out", module="json", echo=lambda s: None)
    with pytest.raises(ModuleNotFoundError, match="moelab.studies.notrain"):
        run_study(7, "cpu", runs="a:0", nbs_dir=nbs, out_root=tmp_path / "out", echo=lambda s: None)


def test_split_groups_deal_runs_and_shards_over_jobs() -> None:
    assert split_groups("a:0,b:0,c:0,a:0", None, 2) == [("a:0,c:0", None), ("b:0", None)]
    assert split_groups("a:0", None, 3) == [("a:0", None)]  # never an empty call
    assert split_groups(None, "2/3", 2) == [(None, "2/6"), (None, "5/6")]  # runs 2, 5, 8, ... as 2, 8, ... and 5, 11
    with pytest.raises(ValueError, match="RUNS item 'a' is not allowed"):
        split_groups("a", None, 2)
    with pytest.raises(ValueError, match=r"jobs=0 is not allowed: expected a whole number >= 1"):
        run_study(7, "cpu", runs="a:0", jobs=0, echo=lambda s: None)
    with pytest.raises(ValueError, match=r"jobs=2 is not allowed.*> 1 only with runs or shard"):
        run_study(7, "cpu", jobs=2, echo=lambda s: None)


def test_gpu_share_names_a_bad_value(monkeypatch) -> None:
    monkeypatch.setenv(common.GPU_SHARE_ENV, "0")
    with pytest.raises(ValueError, match=r"MOELAB_GPU_SHARE='0' is not allowed: expected a whole number >= 1"):
        common.gpu_share()
    monkeypatch.setenv(common.GPU_SHARE_ENV, "3")
    assert common.gpu_share() == 3


@pytest.mark.slow
def test_a_split_call_in_two_processes_records_what_one_process_does(tmp_path, tracking_uri,  # noqa: F811
                                                                     monkeypatch) -> None:
    pkg, nbs = _study_package(tmp_path, "jobs")
    code = json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None, "source_sha256": "5" * 16})
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(pkg), str(ROOT))))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(common.GIT_ENV, code)
    lines: list[str] = []
    out = run_study(7, "cpu", runs="bounded:0,softplus:0", jobs=2, nbs_dir=nbs, out_root=tmp_path / "jobs",
                    module="split_jobs", echo=lines.append)
    assert lines[0].startswith("study 7, split call in 2 processes: their runs train untracked")  # MLflow imports here
    assert lines[1] == "[1/2] make study-7 PRESET=cpu RUNS=bounded:0" and lines[2].endswith("RUNS=softplus:0")
    assert any(ln.startswith("[2/2] study 7, split call: ") for ln in lines)
    jobs = _records(out / "records" / "cpu")
    assert sorted(jobs) == ["bounded_s0.json", "softplus_s0.json"]

    monkeypatch.syspath_prepend(str(pkg))
    import split_jobs

    split_jobs.train("cpu", tmp_path / "one")
    one = _records(tmp_path / "one" / "records")
    for name, rec in jobs.items():
        assert {k: rec[k] for k in KEYS} == {k: one[name][k] for k in KEYS}, name
        assert _computed(rec["history"]) == _computed(one[name]["history"]), name
        assert rec["timing"]["gpu_share"] == 2 and one[name]["timing"]["gpu_share"] == 1
        assert rec["mlflow"]["run_id"] is None  # k processes never write one store at once: the final call logs them
    path = out / "records" / "cpu" / "bounded_s0.json"
    row = common._load_record(path, jobs["bounded_s0.json"]["fingerprint"]).row()
    assert row["gpu_share"] == 2 and row["tok_per_s"] is None  # a shared device's tokens/s is not a speed


@pytest.mark.slow
def test_a_probe_times_the_named_runs_and_records_nothing(tmp_path, monkeypatch) -> None:
    pkg, nbs = _study_package(tmp_path, "probe", max_steps=40)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))
    lines: list[str] = []
    out = run_study(7, "cpu", runs="softplus:0", probe=10, nbs_dir=nbs, out_root=tmp_path / "p", module="split_probe",
                    echo=lines.append)
    assert not (out / "records").exists() or not list((out / "records").rglob("*.json"))  # nothing recorded
    probe = [ln for ln in lines if ln.startswith("[probe] arm=softplus seed=0: ")]
    assert len(probe) == 1 and "its 40 steps ~" in probe[0] and "plus 20 validations" in probe[0]
    assert lines[-1].startswith("study 7, split call: probed softplus:0 (nothing recorded)")
    rows = [json.loads(ln) for ln in (tmp_path / "p" / "07_probe" / "split" / "probe" / "probe.json").read_text()
            .splitlines()]
    assert [(r["arm"], r["probe_steps"], r["full_steps"], r["gpu_share"]) for r in rows] == [("softplus", 10, 40, 1)]
    assert rows[0]["step_ms"] > 0 and rows[0]["projected_train_min"] == pytest.approx(40 * rows[0]["step_ms"] / 6e4,
                                                                                          abs=0.01)
    assert common.PROBE_ENV not in os.environ  # the call's environment is restored
    with pytest.raises(ValueError, match="probe=10 is not allowed without runs or shard"):
        run_study(7, "cpu", probe=10, echo=lambda s: None)
    monkeypatch.setenv(common.PROBE_ENV, "3")
    with pytest.raises(ValueError, match=r"MOELAB_STUDY_PROBE='3' is not allowed: expected a whole number of steps"):
        common.probe_steps()


CHAIN = '''
from moelab.studies import common

ARMS = {"bounded": {"model.kda.gate": "bounded"}, "softplus": {"model.kda.gate": "softplus"}}
COMMON = {"train.max_steps": 12, "train.warmup_steps": 1, "train.val_every": 6, "train.val_batches": 1,
          "tracking.log_system_metrics": False}


def train(preset, out_dir):  # the second grid needs the first one's records (study 3's deep arms its lr sweep)
    kw = dict(common=COMMON, checkpoints="final", source_pin="s7test-1")
    first = common.run_grid("07_chain", "tiny", {"bounded": ARMS["bounded"]}, [0], out_dir, **kw)
    if not first.complete:
        raise common.GridIncomplete("the first grid is incomplete", missing=["bounded:0"])
    return common.run_grid("07_chain", "tiny", {"softplus": ARMS["softplus"]}, [0], out_dir, **kw)
'''


@pytest.mark.slow
def test_a_probe_reaches_runs_of_a_grid_that_needs_an_earlier_one(tmp_path, monkeypatch,
                                                                   tracking_uri) -> None:  # noqa: F811
    """A probe of a later grid's run reads the earlier grids' records as a training call would: before they exist it
    says which runs it could not reach and why; afterwards it times the run. A probed run's record still counts."""
    pkg, nbs = tmp_path / "pkg", tmp_path / "nbs"
    for d in (pkg, nbs):
        d.mkdir()
    (pkg / "split_chain.py").write_text(CHAIN)
    (nbs / "07_chain.ipynb").write_text("{}")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))

    def call(runs: str, probe: int | None) -> list[str]:
        lines: list[str] = []
        run_study(7, "cpu", runs=runs, probe=probe, nbs_dir=nbs, out_root=tmp_path / "p", module="split_chain",
                  tracking_uri=tracking_uri, echo=lines.append)  # never the repository's mlflow.db
        return lines

    assert call("softplus:0", 10)[-1] == ("study 7, split call: probed nothing (nothing recorded); the other named "
                                          "runs not reached: the first grid is incomplete")
    call("bounded:0", None)  # trains and records the first grid
    lines = call("softplus:0", 10)
    assert [ln for ln in lines if ln.startswith("[probe] arm=")] == [ln for ln in lines
                                                                     if ln.startswith("[probe] arm=softplus seed=0")]
    assert lines[-1].startswith("study 7, split call: probed softplus:0 (nothing recorded)")
    assert call("bounded:0,softplus:0", 10)[-1].startswith("study 7, split call: probed bounded:0, softplus:0 ")
    records = sorted(p.name for p in (tmp_path / "p" / "07_chain" / "records").rglob("*.json"))
    assert records == ["bounded_s0.json"]  # the probes recorded nothing


JOBS_DRIVER = '''
import sys
from pathlib import Path

from moelab.studies.runner import StudyStopped, run_study

try:
    run_study(7, "cpu", runs="bounded:0,softplus:0", jobs=2, nbs_dir=Path({nbs!r}), out_root=Path({out!r}),
              module="split_stop", echo=lambda line: print(line, flush=True))
except StudyStopped as e:
    print(f"stopped: {{e}}", flush=True)
    sys.exit(128 + e.signum)
'''


@pytest.mark.slow
def test_sigterm_to_a_jobs_call_stops_every_process_cleanly_and_the_next_call_resumes(tmp_path) -> None:
    import signal
    import time

    pkg, nbs = tmp_path / "pkg", tmp_path / "nbs"
    for d in (pkg, nbs):
        d.mkdir()
    (pkg / "split_stop.py").write_text(MODULE.replace("07_nowheels", "07_stop").replace(
        '"train.max_steps": 4, "train.warmup_steps": 1, "train.val_every": 2',
        '"train.max_steps": 600, "train.warmup_steps": 1, "train.val_every": 50'))
    (nbs / "07_stop.ipynb").write_text("{}")
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join((str(pkg), str(ROOT))),
           common.GIT_ENV: json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None})}
    env.pop("MLFLOW_TRACKING_URI", None)
    script = textwrap.dedent(JOBS_DRIVER.format(nbs=str(nbs), out=str(out)))
    runs = out / "07_stop" / "split" / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    # both processes training: each run has validated once (step 50 of 600: its history.csv is written)
    while time.monotonic() < deadline and not all((runs / f"{a}-s0" / "history.csv").is_file()
                                                  for a in ("bounded", "softplus")):
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, text
    assert "stopped: study 7 stopped by SIGTERM" in text
    assert "[1/2], [2/2] were still training and saved their checkpoint" in text, text
    for arm in ("bounded", "softplus"):
        assert (runs / f"{arm}-s0" / "last.ckpt").is_file(), text  # each process finished its step and saved
    assert not list((out / "07_stop" / "records").rglob("*.json"))  # nothing half-recorded

    again = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    records = _records(out / "07_stop" / "records" / "cpu")
    assert sorted(records) == ["bounded_s0.json", "softplus_s0.json"]
    for rec in records.values():
        assert rec["timing"]["resumed"] is True and rec["summary"]["steps"] == 600 and rec["timing"]["gpu_share"] == 2


def test_a_signal_after_every_process_finished_stops_nothing(tmp_path, monkeypatch) -> None:
    """A time limit's SIGTERM that lands after both processes of a JOBS=2 call had finished (session 31: both runs
    recorded, the call still said the stopped runs saved their checkpoints) is not a stop: the call ends as done."""
    import io
    import signal
    import subprocess

    from moelab.studies import runner

    class Finished:
        def __init__(self) -> None:
            self.stdout = io.StringIO("run recorded\n")

        def poll(self) -> int:
            return 0

        def wait(self) -> int:
            os.kill(os.getpid(), signal.SIGTERM)  # the limit's signal, after the child's exit
            return 0

        def send_signal(self, signum: int) -> None:
            raise AssertionError("a finished process gets no signal")

    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))
    real = subprocess.Popen

    def popen(args, *a, **kw):  # the split call's children only; anything else (platform, git) runs for real
        return Finished() if list(args[:2]) == [sys.executable, "-c"] else real(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", popen)
    (tmp_path / "07_done.ipynb").write_text("{}")
    lines: list[str] = []
    out = runner._run_split_jobs(7, "cpu", [("a:0", None), ("b:0", None)], nbs_dir=tmp_path,
                                 out_root=tmp_path / "out", module="x", say=lines.append)
    assert out.name == "07_done"
    assert any("SIGTERM came after every process of the split call had finished: nothing was stopped" in x
               for x in lines), lines


def test_a_probe_of_a_curriculum_scales_its_stages() -> None:
    """A probe of a curriculum run (study 4's) trains each stage its share of the probe's steps, the last stage
    open-ended, so that the config still validates at the probe's ``max_steps``; too few steps for the stages raise."""
    from moelab.data.curriculum import plan as stage_plan
    from moelab.studies import context_curriculum as cc

    p = cc.plan("cpu")
    for steps, want in ((10, [(256, 5), (1024, 3), (2048, 2)]), (3, [(256, 1), (1024, 1), (2048, 1)])):
        cfg = common.resolve_arms(p.base, {"curriculum": cc.arms("cpu")["curriculum"]}, p.common)["curriculum"]
        assert [(s.seq_len, s.steps) for s in cfg.data.curriculum] == [(256, 40), (1024, 24), (2048, 16)]
        common._scale_curriculum(cfg, steps)
        t = cfg.train
        stages = stage_plan(cfg.data.curriculum, t.batch_size, cfg.data.seq_len, t.accumulate_grad_batches, steps)
        assert [(s.seq_len, s.steps) for s in stages] == want
    with pytest.raises(ValueError, match="probe steps=2 is not allowed for a curriculum of 3 stages"):
        common._scale_curriculum(cfg, 2)


def test_a_curriculum_probe_times_each_stage_on_its_steady_windows() -> None:
    """A probe's windows that hold a stage's first step (the new length's compilation and autotuning) are left out:
    each stage's time is the median of the windows wholly inside it, None where none is left."""
    from moelab.data.curriculum import StagePlan

    def stage(i: int, start: int, n: int) -> StagePlan:
        return StagePlan(i, 256 << i, 4 >> i, start, n, 0.0, (), 0)

    stages = [stage(0, 0, 8), stage(1, 8, 6), stage(2, 14, 2)]
    windows = [(0, 2, 9.0), (2, 4, 1.0), (4, 6, 1.2), (6, 8, 1.1),  # stage 0: the first holds compilation
               (8, 10, 7.0), (10, 12, 2.0), (12, 14, 2.2),          # stage 1: its first holds the new length's
               (14, 16, 8.0)]                                       # stage 2: only its first window
    assert common.stage_step_s(windows, stages) == [1.1, 2.1, None]
    # a window across a change of stage counts for neither
    assert common.stage_step_s([(0, 3, 1.0), (3, 6, 2.0), (6, 9, 5.0), (9, 12, 3.0)],
                               [stage(0, 0, 7), stage(1, 7, 5)]) == [2.0, 3.0]


def test_probes_of_a_jobs_call_meet_before_their_timed_steps(tmp_path, monkeypatch) -> None:
    """A jobs call's probes wait for each other after their first logging window (moelab.train.callbacks.Rendezvous),
    so the steps they are timed on run while the GPU is shared: round i waits for every process with an i-th run;
    one that never arrives lets the others go on after the timeout, and the probe says its time is optimistic."""
    import threading
    from types import SimpleNamespace

    from moelab.train.callbacks import Rendezvous

    at_step = SimpleNamespace(global_step=3)
    pair = [Rendezvous(tmp_path / "m", "0", str(j), expected=2, at=3, timeout_s=30.0) for j in (1, 2)]
    threads = [threading.Thread(target=r.on_train_batch_end, args=(at_step,)) for r in pair]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r.met and r.arrived == 2 for r in pair)
    early = Rendezvous(tmp_path / "m", "1", "1", expected=2, at=3, timeout_s=0.2)
    early.on_train_batch_end(SimpleNamespace(global_step=2))  # before its step: nothing yet
    assert not early.done and not (tmp_path / "m" / "1.1").exists()
    early.on_train_batch_end(at_step)  # the other process never comes: on after the timeout
    assert early.done and not early.met and early.arrived == 1

    monkeypatch.setattr(common, "_PROBE_ROUND", [0])
    monkeypatch.setenv(common.PROBE_BARRIER_ENV, json.dumps({"dir": str(tmp_path / "b"), "job": 2, "runs": [2, 1]}))
    first, second = common._probe_barrier(4), common._probe_barrier(4)
    assert (first.expected, first.at, first.me, first.name) == (2, 4, "2", "0")
    assert second is None  # only one process has a second run: nobody to wait for
    monkeypatch.delenv(common.PROBE_BARRIER_ENV)
    assert common._probe_barrier(4) is None  # not a jobs call


@pytest.mark.slow
def test_a_jobs_probe_times_its_runs_together(tmp_path, monkeypatch) -> None:
    pkg, nbs = _study_package(tmp_path, "jprobe", max_steps=40)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(pkg), str(ROOT))))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(common.GIT_ENV, json.dumps({"commit": "abc", "dirty": False, "diff_sha256": None}))
    lines: list[str] = []
    run_study(7, "cpu", runs="bounded:0,softplus:0", probe=10, jobs=2, nbs_dir=nbs, out_root=tmp_path / "p",
              module="split_jprobe", echo=lines.append)
    probes = [ln for ln in lines if "[probe] arm=" in ln]
    assert len(probes) == 2 and all("GPU shared by 2 (timed with the other 1 probe(s) of its round)" in ln
                                    for ln in probes), lines
    rows = [json.loads(ln) for ln in (tmp_path / "p" / "07_jprobe" / "split" / "probe" / "probe.json").read_text()
            .splitlines()]
    assert sorted((r["arm"], r["gpu_share"], r["timed_together"]) for r in rows) == [("bounded", 2, True),
                                                                                      ("softplus", 2, True)]


def test_a_gpu_preset_run_without_a_record_refuses_to_train_on_a_cpu(tmp_path, monkeypatch) -> None:
    """Rendering a GPU tier on a machine without CUDA before every record came back: the first missing run raises
    GPURequired naming itself and the command that trains it, instead of a days-long CPU run; the escape hatch
    lets it train all the same."""
    from types import SimpleNamespace

    monkeypatch.setattr(common, "_cuda", lambda: False)
    cfg = SimpleNamespace(preset="gpu-small")
    with pytest.raises(common.GPURequired, match=r"run curriculum:0 has no record and needs a GPU \(preset gpu-small; "
                                                 r"no CUDA here\): train it on one, `make study-4 PRESET=<tier> "
                                                 r"RUNS=curriculum:0`"):
        common._train("04_context_curriculum", "curriculum", 0, cfg, tmp_path / "run", "fp", {}, tmp_path / "r.json")
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv(common.CPU_GPU_PRESET_ENV, "1")
    with pytest.raises(AttributeError):  # past the check: it starts on the (stand-in) config
        common._train("04_context_curriculum", "curriculum", 0, cfg, tmp_path / "run", "fp", {}, tmp_path / "r.json")
