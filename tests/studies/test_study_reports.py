"""The four committed study reports (studies/NN_name/summary.json) say exactly what their data say.

Every compared number carries its interval; no verdict says holds / yes / better / worse while its interval
includes 0; the lead lines are the rules of ``moelab.studies.report``; and a report rendered again from the
committed raw results (``from_results``) gives the same lead lines.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from moelab.base import repo_root
from moelab.studies import report
from moelab.studies.runner import STUDIES
from tests.train.mlflow_fixtures import mlflow_template_db, tracking_uri  # noqa: F401

SUMMARIES = {n: repo_root() / "studies" / name / "summary.json" for n, name in STUDIES.items()}
WORDS = ("better (interval excludes 0)", "worse (interval excludes 0)", "inside the noise (interval includes 0)",
         "not tested at this scale (")


def _load(n: int) -> dict[str, Any]:
    return json.loads(SUMMARIES[n].read_text())


def _includes_zero(iv: dict[str, Any]) -> bool:
    return iv.get("low") is None or iv.get("high") is None or iv["low"] <= 0.0 <= iv["high"]


def _walk(obj: Any, path: str = ""):
    if isinstance(obj, dict):
        yield path, obj
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")


@pytest.mark.parametrize("n", sorted(STUDIES))
def test_lead_lines_carry_intervals_and_never_claim_inside_the_noise(n: int) -> None:
    s = _load(n)
    # the headline: the first lead line, or the lead line the study is named for (Report.lead_finding) when its
    # lead opens with a precondition (study 2's research tier)
    assert isinstance(s["headline"], str) and s["headline"] in s["verdicts"]
    assert 1 <= len(s["verdicts"]) <= report.MAX_LEAD and len(s["compared"]) == len(s["verdicts"])
    for line, c in zip(s["verdicts"], s["compared"]):
        assert c["line"] == line and c["status"] in report.STATUSES
        answer = line.split("?", 1)[1]
        if c["status"] in ("better", "worse", "noise"):  # a comparison: its interval and its one wording
            iv = c["interval"]
            assert {"mean", "low", "high", "n"} <= iv.keys() and iv["n"] >= 2, (n, line)
            assert "[" in line and "]" in line, (n, line)
            assert any(w in line for w in WORDS), (n, line)
            assert (c["status"] == "noise") == _includes_zero(iv), (n, line)
        if c["status"] == "not tested":
            assert answer.startswith(" not tested at this scale ("), (n, line)
        if "interval" in c and _includes_zero(c["interval"]):
            said = answer.split("not tested at this scale (")[0]
            assert not report.CLAIMS.search(said.replace("inside the noise (interval includes 0)", "")), (n, line)


@pytest.mark.parametrize("n", sorted(STUDIES))
def test_every_compared_number_has_its_interval(n: int) -> None:
    """Every mean over seeds carries low/high; every paired comparison its interval; no verdict says holds/yes."""
    for path, d in _walk(_load(n)):
        if {"mean", "std", "n"} <= d.keys() and isinstance(d["mean"], (int, float)) and (d["n"] or 0) > 1:
            assert "low" in d and "high" in d, f"study {n}: {path} has a mean over seeds without its interval"
        for key in ("verdict", "order", "judgement", "equal_tokens", "equal_wall_clock", "effective_context"):
            v = d.get(key)
            if isinstance(v, str):
                assert not any(w in v.split() for w in ("holds", "yes", "yes.")), f"study {n}: {path}.{key} = {v!r}"
        if "verdict" in d and "low" in d and "high" in d and d.get("n", 0) > 1:  # a paired comparison
            if _includes_zero(d):
                assert d["verdict"] in ("within noise", "one seed"), f"study {n}: {path} {d['verdict']} inside 0"
    for key, arm in _load(n).get("arms", {}).items():  # study 2's flat per-arm means
        for k, v in arm.items():
            if k.endswith("_mean") and isinstance(v, float) and math.isfinite(v) and arm.get("n_seeds", 0) > 1 \
                    and arm.get(k[:-5] + "_std") is not None:
                assert arm.get(k[:-5] + "_low") is not None, f"study {n}: arms.{key}.{k} without its interval"


@pytest.mark.slow
@pytest.mark.parametrize("n", sorted(STUDIES))
def test_report_renders_again_from_the_committed_results(n: int, tmp_path: Path,
                                                         tracking_uri: str) -> None:  # noqa: F811
    """``from_results``: the notebook trains nothing and gives the committed lead lines again."""
    from moelab.studies.runner import run_study

    committed = _load(n)
    src = SUMMARIES[n].parent
    dst = tmp_path / "studies" / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "*.html", ".*"))
    out = run_study(n, committed["meta"]["preset"], out_root=tmp_path / "studies", tracking_uri=tracking_uri,
                    parameters={"from_results": True}, log_output=False)
    again = json.loads((out / "summary.json").read_text())
    assert again["verdicts"] == committed["verdicts"]
    assert again["meta"]["report"]["from_results"] is True
    for sub in ("results",):
        for f in (src / sub).iterdir():
            assert (out / sub / f.name).read_bytes() == f.read_bytes(), f"{sub}/{f.name} changed"
