"""Every study's ``cpu`` preset end to end through the runner, into a temporary folder and MLflow store.

The acceptance of each study is "PRESET=cpu under test in <= 4 minutes": these tests run
``run_study(N, "cpu")`` as ``make study-N PRESET=cpu`` does, check that the executed notebook reads as
a report (the checks of tests/test_notebooks.py) and that ``summary.json`` holds the study's verdicts,
and record each study's wall time (``summary_line``), which pytest prints in its summary under
"recorded by the tests", also from pytest-xdist's workers, so a CI log shows it. They do not assert on
the time: a shared machine's load decides it. Nothing is written into the repository's
``studies/`` folder or its ``mlflow.db``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import nbformat
import pytest

from moelab.studies import STUDIES, attnres_depth, balancing, context_curriculum, decay_bound, run_study
from tests.test_notebooks import report_problems
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
MIN_SEEDS = 3  # the project standard for arms whose losses are compared


def compared_seeds(number: int, preset: str) -> tuple[int, ...]:
    """Seeds of the arms whose losses study ``number`` compares under ``preset``."""
    return {1: lambda: decay_bound.PRESETS[preset]["seeds"],
            2: lambda: balancing.PRESETS[preset]["seeds"],
            3: lambda: attnres_depth.PRESETS[preset].seeds,
            4: lambda: context_curriculum.PRESETS[preset].seeds}[number]()


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
@pytest.mark.parametrize("number", sorted(STUDIES))
def test_compared_arms_run_three_seeds(number: int, preset: str) -> None:
    seeds = compared_seeds(number, preset)
    assert len(set(seeds)) >= MIN_SEEDS, f"study {number} preset {preset}: seeds {seeds}, the standard is {MIN_SEEDS}"


# --- the verdict fields each summary.json must hold ---------------------------------------------------

def _decay_bound(s: Mapping[str, Any]) -> None:
    for arm, a in s["arms"].items():
        assert a["best_val_loss"]["n"] >= MIN_SEEDS and a["best_val_loss"]["std"] is not None, arm
        assert a["extrapolation_d_4x"]["mean"] is not None, arm
    assert "first_nonfinite_bound" in s["kernel_overflow"] and s["speed"]["ratios"]


def _balancing(s: Mapping[str, Any]) -> None:
    for arm, a in s["arms"].items():
        assert a["n_seeds"] >= MIN_SEEDS and isinstance(a["final_val_loss_std"], float), arm
        assert a["shift_maxvio_first"] is not None, f"{arm}: no shift test"
    assert s["settings"]["threshold"] > 0 and s["settings"]["noise_floor"] is not None
    lim = s["qb_limits"]  # QB's update on the frozen trained model: next-batch MaxVio over a fresh-batch stream
    assert lim["arm"] == "qb" and lim["frozen_next"] > 0 and lim["train_tail"] > 0 and 0 <= lim["saturated"] <= 1


def _attnres_depth(s: Mapping[str, Any]) -> None:
    assert set(s["by_depth"]) == {str(L) for L in attnres_depth.PRESETS["cpu"].depths}
    for L, v in s["by_depth"].items():
        assert v["order"] and v["order"] != "one seed", L
        for key in ("block_vs_prenorm", "full_vs_prenorm", "full_vs_block"):
            assert v[key]["n"] >= MIN_SEEDS and v[key]["verdict"] in ("lower", "higher", "within noise"), (L, key)
    assert set(s["gain_trend"]) == {"block_attnres", "full_attnres"}
    assert all(t["verdict"] in attnres_depth.TREND_TEXT for t in s["gain_trend"].values())


def _context_curriculum(s: Mapping[str, Any]) -> None:
    assert set(s["verdict"]) == {"equal_tokens", "equal_wall_clock", "effective_context"}
    assert not any(v.startswith("not judged") for v in s["verdict"].values()), s["verdict"]
    for key in ("curriculum_vs_direct", "curriculum_vs_short"):
        for metric, d in s[key].items():
            assert d["n"] >= MIN_SEEDS and d["judgement"] in ("better", "worse", "tie"), (key, metric)


VERDICTS: dict[int, Callable[[Mapping[str, Any]], None]] = {
    1: _decay_bound, 2: _balancing, 3: _attnres_depth, 4: _context_curriculum}


def _repo_state() -> dict[str, float]:
    """mtime of every file under the repository's studies/ and of its mlflow.db (what the run must not touch)."""
    files = [p for p in (ROOT / "studies").rglob("*") if p.is_file()] + [ROOT / "mlflow.db"]
    return {str(p): p.stat().st_mtime for p in files if p.exists()}


@pytest.mark.slow
@pytest.mark.parametrize("number", sorted(STUDIES))
def test_cpu_preset_end_to_end(number: int, tmp_path: Path, tracking_uri: str,  # noqa: F811
                               record_property) -> None:
    before = _repo_state()
    start = time.perf_counter()
    out = run_study(number, "cpu", out_root=tmp_path / "studies", tracking_uri=tracking_uri, log_output=False)
    wall = time.perf_counter() - start
    record_property("summary_line", f"study {number} ({STUDIES[number]}) PRESET=cpu: {wall:.0f} s wall through the "
                                 "runner (acceptance: <= 240 s; make test runs two tests at a time on 2 cores)")

    assert out == tmp_path / "studies" / STUDIES[number]
    executed = out / f"{STUDIES[number]}.ipynb"
    problems = report_problems(nbformat.read(executed, as_version=4))
    assert not problems, f"{executed.name}:\n" + "\n".join(problems)
    html = executed.with_suffix(".html").read_text()
    # Offline: formulas as MathML, no script from the network (MathJax, require.js, mermaid).
    assert not re.search(r"<script[^>]*src=\"(https?:)?//|import\(\"https?://", html) and "mathjax" not in html.lower()
    if number == 1:
        assert html.count("<math") > 10
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["preset"] == "cpu" and summary["meta"]["study"] == STUDIES[number]
    VERDICTS[number](summary)
    assert _repo_state() == before, "the study wrote into the repository's studies/ or mlflow.db"
