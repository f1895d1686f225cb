"""moelab.studies.report: intervals against hand-computed values, the one wording, the rendered findings."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from moelab.studies import report

T_975_2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (tables)


def test_paired_t_interval_matches_hand_computation():
    # per-seed differences a - b = 1.0, 1.1, 0.9: mean 1.0, sd 0.1, half width t * sd / sqrt(3)
    iv = report.paired({0: 6.0, 1: 6.1, 2: 5.9, 7: 1.0}, {0: 5.0, 1: 5.0, 2: 5.0})
    half = T_975_2 * 0.1 / math.sqrt(3)
    assert iv.n == 3 and iv.method == "paired t"
    assert iv.mean == pytest.approx(1.0)
    assert (iv.low, iv.high) == (pytest.approx(1.0 - half), pytest.approx(1.0 + half))
    assert report.judge(iv, lower_is_better=True) == "worse"
    assert report.judge(iv, lower_is_better=False) == "better"


def test_mean_interval_of_a_bounded_quantity_is_clipped_to_its_range():
    """Four accuracies 0.96, 0.85, 0.75, 0.05: the t interval reaches below 0 and above 1; with bounds it stops
    there, names itself, and the interval note says so."""
    v = [0.96, 0.85, 0.75, 0.05]
    plain = report.mean_interval(v)
    assert plain.low < 0 and plain.high > 1
    iv = report.mean_interval(v, bounds=(0.0, 1.0))
    assert (iv.mean, iv.low, iv.high, iv.n, iv.method) == (pytest.approx(plain.mean), 0.0, 1.0, 4, "t, clipped")
    inside = report.mean_interval([0.4, 0.5, 0.6], bounds=(0.0, 1.0))
    assert (inside.low, inside.high) == (pytest.approx(report.mean_interval([0.4, 0.5, 0.6]).low),
                                         pytest.approx(report.mean_interval([0.4, 0.5, 0.6]).high))
    assert not report.mean_interval([0.5], bounds=(0.0, 1.0)).known
    note = report.interval_note([report.measured("Q", iv)])
    assert "clipped to the quantity's range" in note


def test_log_interval_is_a_t_interval_of_the_logs_mapped_back():
    # steps 81, 176, 217: the plain t interval goes below 0; the log one stays positive around the geometric mean
    v = [81.0, 176.0, 217.0]
    assert report.mean_interval(v).low < 0
    iv = report.log_interval(v)
    logs = [math.log(x) for x in v]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    half = T_975_2 * sd / math.sqrt(3)
    assert iv.method == "t on log" and iv.n == 3 and iv.mean == pytest.approx(math.exp(m))
    assert (iv.low, iv.high) == (pytest.approx(math.exp(m - half)), pytest.approx(math.exp(m + half)))
    assert not report.log_interval([5.0]).known
    with pytest.raises(ValueError, match="must be > 0"):
        report.log_interval([3.0, 0.0])


def test_interval_that_includes_zero_is_inside_the_noise():
    iv = report.paired({0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.0, 1: 0.0, 2: 0.0})  # mean 2, sd 1
    assert iv.low == pytest.approx(2.0 - T_975_2 / math.sqrt(3)) and iv.low < 0 < iv.high
    assert report.judge(iv) == "noise"
    f = report.compare("does a beat b", {0: 1.0, 1: 2.0, 2: 3.0}, {0: 0.0, 1: 0.0, 2: 0.0}, answer="a minus b")
    assert f.status == "noise"
    assert "inside the noise (interval includes 0)" in f.line()
    assert not report.CLAIMS.search(f.line().split("?**", 1)[1])


def test_one_seed_has_no_interval_and_is_never_a_claim():
    iv = report.paired({0: 1.0}, {0: 0.0})
    assert not iv.known and iv.includes_zero and report.judge(iv) == "noise"
    assert "interval n/a: 1 seed" in iv.text()


def test_welch_matches_hand_computation():
    a, b = [1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 1.0]
    va, vb = 1.0 / 3, (1 / 3) / 4  # var(ddof=1)/n: 1/3 and 0.0833
    dof = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    from scipy import stats
    half = stats.t.ppf(0.975, dof) * math.sqrt(va + vb)
    iv = report.welch(a, b)
    assert iv.mean == pytest.approx(1.5) and iv.high - iv.mean == pytest.approx(half)


def test_bootstrap_brackets_the_mean_and_is_reproducible():
    d = [0.1, 0.12, 0.08, 0.11, 0.09, 0.1, 0.13, 0.07, 0.1, 0.1]
    a, b = report.bootstrap(d, seed=3), report.bootstrap(d, seed=3)
    assert a == b and a.low < 0.1 < a.high and a.low > 0.07 and a.high < 0.13


def test_failed_precondition_reads_not_tested_first():
    f = report.compare("what does the bound cost", {0: 5.0, 1: 5.1, 2: 5.2}, {0: 4.0, 1: 4.0, 2: 4.0},
                       precondition="no arm's trained g came within 5% of its bound")
    assert f.status == "not tested"
    assert f.line().startswith("**what does the bound cost?** not tested at this scale (no arm's trained g")
    with pytest.raises(ValueError, match="reason"):
        report.Finding("q", "not tested")


def test_a_claim_with_an_interval_including_zero_is_refused():
    iv = report.Interval(0.01, -0.02, 0.04, 3, "paired t")
    with pytest.raises(ValueError, match="excludes 0"):
        report.Finding("q", "better", iv)
    with pytest.raises(ValueError, match="claims an effect"):
        report.Finding("q", "noise", iv, answer="yes, it holds")
    with pytest.raises(ValueError, match="status="):
        report.Finding("q", "holds", iv)


def test_render_leads_with_the_verdicts_then_table_then_details():
    fs = [report.measured("how large", [1.0, 2.0, 3.0], unit="nats"),
          report.not_tested("does it transfer", "retrieval never learned")]
    md = report.render(fs, pd.DataFrame({"x": [1.0]}, index=pd.Index(["a"], name="arm")), ["a detail"])
    lines = md.splitlines()
    assert lines[0].startswith("- **how large?** 2.000 nats [")
    assert lines[1] == "- **does it transfer?** not tested at this scale (retrieval never learned)"
    assert md.index("| arm | x |") < md.index("### Details") < md.index("- a detail")
    block = report.summary_block(fs)
    assert block["headline"] == block["verdicts"][0] and block["compared"][0]["interval"]["n"] == 3
    # a lead that opens with a precondition names the answer the study is for as its headline
    named = report.Report(fs, lead_finding=fs[1]).summary()
    assert named["headline"] == fs[1].plain() and named["verdicts"] == block["verdicts"]
    with pytest.raises(ValueError, match="1 to 6"):
        report.render([fs[0]] * 7)


def test_step_differences_pair_seeds_per_step():
    rows = []
    for seed, off in ((0, 0.1), (1, 0.2), (2, 0.3)):
        for step in (1, 2):
            rows += [{"arm": "ref", "seed": seed, "step": step, "train/loss": 5.0},
                     {"arm": "b", "seed": seed, "step": step, "train/loss": 5.0 + off}]
    d = report.step_differences(pd.DataFrame(rows), "ref")["b"]
    assert d["n"] == 3 and d["mean"] == pytest.approx([0.2, 0.2])
    assert d["high"][0] - 0.2 == pytest.approx(T_975_2 * 0.1 / math.sqrt(3))
    with pytest.raises(ValueError, match="reference arm 'nope'"):
        report.step_differences(pd.DataFrame(rows), "nope")


def test_palette_is_distinct_and_stable():
    p = report.palette(["a", "b", "c", "a"])
    assert list(p) == ["a", "b", "c"] and len(set(p.values())) == 3
