"""What a study may conclude from its seeds, worded one way, and the figures that show it.

Every comparison of two arms is a difference over seeds with a 95% interval: paired by seed
(:func:`paired`, Student t on the per-seed differences) where both arms ran the same seeds, Welch's
t (:func:`welch`) where they did not, or a percentile bootstrap over seeds (:func:`bootstrap`).
:func:`judge` turns an interval into the one wording every report uses:

* ``better (interval excludes 0)`` / ``worse (interval excludes 0)``;
* ``inside the noise (interval includes 0)``;
* ``not tested at this scale (<reason>)`` when the study's precondition failed (the bound never
  binds, retrieval was never learned, the run is under-trained); the number is still shown.

A study states its answers as :class:`Finding` rules (question, answer, number, interval, status) and
:func:`render` turns the list into the findings section: at most :data:`MAX_LEAD` lead lines, then a
table, then the detail under a "Details" heading. :func:`summary_block` gives the same lines for
``summary.json`` (``headline``, ``verdicts``, ``compared``). A verdict never reads "holds" or "yes"
while its interval includes 0: :class:`Finding` refuses to be built that way.

Figures: :func:`palette` (one distinct colour per arm, the same arm the same colour in every
figure of a study) and :func:`difference_figure` (each arm minus a reference arm per step, mean over
seeds with its 95% band, the axis zoomed to the differences).

Summaries and re-rendering: :func:`attach` writes the lead lines into a study's ``summary.json`` and a
``low``/``high`` interval beside every mean over seeds (:func:`add_intervals`); with the notebooks'
``from_results = True`` (``make study-N PRESET=gpu ARGS=--from-results``), :func:`result_table` reads each
raw table from ``results/`` instead of computing it and :func:`committed_figure` shows the figures that
need the trained models as the training run drew them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import numpy as np

LEVEL = 0.95
MAX_LEAD = 6

Status = Literal["better", "worse", "noise", "not tested", "measured"]
STATUSES: tuple[Status, ...] = get_args(Status)
# Words a verdict may not use unless its interval excludes 0.
CLAIMS = re.compile(r"\b(holds|yes|better|worse|faster|slower|beats|wins)\b", re.IGNORECASE)


# ------------------------------------------------------------------------------------- intervals


@dataclass(frozen=True)
class Interval:
    """A mean (a difference or a single arm's value) with its ``level`` confidence interval.

    ``low``/``high`` are NaN when the interval cannot be computed (one seed, one value).
    ``method``: ``paired t``, ``Welch t``, ``t`` (one sample), ``bootstrap``.
    """

    mean: float
    low: float
    high: float
    n: int
    method: str
    level: float = LEVEL

    @property
    def known(self) -> bool:
        """Whether the interval is finite (needs at least two seeds)."""
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def includes_zero(self) -> bool:
        """True when 0 lies in [low, high], or when no interval could be computed."""
        return not self.known or self.low <= 0.0 <= self.high

    def to_dict(self) -> dict[str, Any]:
        """``{"mean", "low", "high", "n", "method", "level"}`` with None for an unknown bound (JSON-safe)."""
        def f(x: float) -> float | None:
            return float(x) if math.isfinite(x) else None
        return {"mean": f(self.mean), "low": f(self.low), "high": f(self.high), "n": self.n,
                "method": self.method, "level": self.level}

    def text(self, digits: int = 3, unit: str = "", signed: bool = True) -> str:
        """``+0.015 nats [-0.050, +0.080]`` (``[n/a: 1 seed]`` without an interval)."""
        sign = "+" if signed else ""
        u = f" {unit}" if unit else ""
        head = f"{self.mean:{sign}.{digits}f}{u}"
        if not self.known:
            return f"{head} [interval n/a: {self.n} seed{'s' * (self.n != 1)}]"
        return f"{head} [{self.low:{sign}.{digits}f}, {self.high:{sign}.{digits}f}]"


def _clean(values: Sequence[float]) -> np.ndarray:
    x = np.asarray([float(v) for v in values if v is not None], dtype=float)
    return x[np.isfinite(x)]


def mean_interval(values: Sequence[float], level: float = LEVEL,
                  bounds: tuple[float, float] | None = None) -> Interval:
    """One-sample Student t interval of the mean of ``values`` (None and NaN dropped). ``bounds``: the range the
    quantity cannot leave (an accuracy's ``(0, 1)``): the interval is clipped to it (method ``t, clipped``), as a t
    interval of a few bounded values can reach past them."""
    if bounds is not None:
        iv = mean_interval(values, level)
        if not iv.known:
            return iv
        lo, hi = bounds
        return Interval(iv.mean, max(iv.low, lo), min(iv.high, hi), iv.n, "t, clipped", level)
    from scipy import stats

    x = _clean(values)
    n = len(x)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0, "t", level)
    m = float(x.mean())
    if n < 2:
        return Interval(m, math.nan, math.nan, n, "t", level)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return Interval(m, m - half, m + half, n, "t", level)


def log_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Geometric mean of positive ``values`` with the t interval of their logs, mapped back (method ``t on
    log``): the interval for counts such as steps, which a plain t interval can take below 0 with 3 seeds."""
    x = _clean(values)
    if (x <= 0).any():
        raise ValueError(f"log_interval: every value must be > 0, got {sorted(x.tolist())}")
    iv = mean_interval(np.log(x).tolist(), level)
    return Interval(math.exp(iv.mean) if iv.n else math.nan, math.exp(iv.low) if iv.known else math.nan,
                    math.exp(iv.high) if iv.known else math.nan, iv.n, "t on log", level)


def paired(a: Mapping[Any, float], b: Mapping[Any, float], level: float = LEVEL) -> Interval:
    """``a - b`` over the seeds both ran: mean of the per-seed differences and its Student t interval.

    ``a``, ``b``: ``{seed: value}``. Seeds only one arm ran are left out; no common seed is an error.
    """
    common = [s for s in a if s in b and a[s] is not None and b[s] is not None
              and math.isfinite(float(a[s])) and math.isfinite(float(b[s]))]
    if not common:
        raise ValueError(f"paired: no seed with a value in both arms (seeds {sorted(a)} vs {sorted(b)})")
    iv = mean_interval([float(a[s]) - float(b[s]) for s in common], level)
    return Interval(iv.mean, iv.low, iv.high, iv.n, "paired t", level)


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval:
    """``mean(a) - mean(b)`` with Welch's t interval (unpaired seeds, unequal variances)."""
    from scipy import stats

    x, y = _clean(a), _clean(b)
    if len(x) == 0 or len(y) == 0:
        raise ValueError(f"welch: both samples need a value (got {len(x)} and {len(y)})")
    d = float(x.mean() - y.mean())
    n = min(len(x), len(y))
    if len(x) < 2 or len(y) < 2:
        return Interval(d, math.nan, math.nan, n, "Welch t", level)
    vx, vy = x.var(ddof=1) / len(x), y.var(ddof=1) / len(y)
    se = math.sqrt(vx + vy)
    if se == 0.0:
        return Interval(d, d, d, n, "Welch t", level)
    dof = (vx + vy) ** 2 / (vx ** 2 / (len(x) - 1) + vy ** 2 / (len(y) - 1))
    half = float(stats.t.ppf(0.5 + level / 2, dof) * se)
    return Interval(d, d - half, d + half, n, "Welch t", level)


def bootstrap(diffs: Sequence[float], level: float = LEVEL, resamples: int = 10_000, seed: int = 0) -> Interval:
    """Percentile bootstrap interval of the mean of per-seed ``diffs`` (resampling seeds with replacement).

    With 3 seeds there are only 10 distinct resamples: the t interval is the better choice there; the
    bootstrap is for designs with ~10 or more seeds, or skewed differences.
    """
    x = _clean(diffs)
    if len(x) < 2:
        m = float(x.mean()) if len(x) else math.nan
        return Interval(m, math.nan, math.nan, len(x), "bootstrap", level)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    lo, hi = np.quantile(means, [0.5 - level / 2, 0.5 + level / 2])
    return Interval(float(x.mean()), float(lo), float(hi), len(x), "bootstrap", level)


# ------------------------------------------------------------------------------------- wording


def judge(iv: Interval, lower_is_better: bool = True) -> Status:
    """``better`` / ``worse`` when the interval excludes 0 (the sign and ``lower_is_better`` decide which),
    else ``noise`` (also when there is no interval: one seed)."""
    if iv.includes_zero:
        return "noise"
    return "better" if (iv.mean < 0) == lower_is_better else "worse"


def status_text(status: Status, reason: str | None = None) -> str:
    """The one wording of each status (``reason`` is required for ``not tested``)."""
    if status == "not tested":
        if not reason:
            raise ValueError("status 'not tested' needs the failed precondition as reason")
        return f"not tested at this scale ({reason})"
    return {"better": "better (interval excludes 0)", "worse": "worse (interval excludes 0)",
            "noise": "inside the noise (interval includes 0)", "measured": "measured"}[status]


@dataclass
class Finding:
    """One answer of a study, rendered as one lead line.

    Attributes:
        question: what the study asks (``what does the bound cost in val loss``).
        status: ``better`` / ``worse`` / ``noise`` (from :func:`judge`), ``not tested`` (a precondition
            failed: ``reason`` says which), ``measured`` (a fact, no comparison).
        number: the compared difference (or measured value) with its interval; None for a fact
            without a number.
        answer: the short answer before the number (``bounded -5 minus softplus``); the status
            wording follows it.
        unit: of ``number`` (``nats``, ``steps``).
        reason: the failed precondition, for ``not tested``.
        digits: decimals shown.
    """

    question: str
    status: Status
    number: Interval | None = None
    answer: str = ""
    unit: str = ""
    reason: str | None = None
    digits: int = 3
    signed: bool = True

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status={self.status!r} is not allowed: expected one of {STATUSES}")
        if self.status == "not tested" and not self.reason:
            raise ValueError(f"{self.question!r}: status 'not tested' needs reason (the failed precondition)")
        if self.status in ("better", "worse"):
            if self.number is None or self.number.includes_zero:
                raise ValueError(f"{self.question!r}: status {self.status!r} needs an interval that excludes 0, "
                                 f"got {self.number}")
        if self.number is not None and self.number.includes_zero and CLAIMS.search(self.answer):
            raise ValueError(f"{self.question!r}: answer {self.answer!r} claims an effect while the interval "
                             f"{self.number.text(self.digits)} includes 0")

    def line(self) -> str:
        """``**question?** answer: number [low, high]; wording``."""
        num = self.number.text(self.digits, self.unit, self.signed) if self.number else ""
        parts = [p for p in (self.answer, num) if p]
        body = ": ".join(parts) if parts else ""
        verdict = status_text(self.status, self.reason)
        if self.status == "not tested":
            # The failed precondition leads; the number (if any) follows for the record.
            return f"**{self.question}?** {verdict}" + (f"; measured {body}" if body else "")
        if self.status == "measured":
            return f"**{self.question}?** {body}"
        return f"**{self.question}?** {body}; {verdict}"

    def plain(self) -> str:
        """:meth:`line` without markdown emphasis."""
        return self.line().replace("**", "")

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question, "status": self.status, "answer": self.answer, "unit": self.unit,
                "reason": self.reason, "line": self.plain(),
                **({"interval": self.number.to_dict()} if self.number is not None else {})}


def compare(question: str, a: Mapping[Any, float], b: Mapping[Any, float], *, answer: str = "",
            lower_is_better: bool = True, unit: str = "", digits: int = 3,
            precondition: str | None = None) -> Finding:
    """A paired comparison ``a - b`` over seeds, judged; ``precondition``: the reason it is not tested, or None."""
    iv = paired(a, b)
    if precondition:
        return Finding(question, "not tested", iv, answer, unit, precondition, digits)
    return Finding(question, judge(iv, lower_is_better), iv, answer, unit, None, digits)


def measured(question: str, values: Sequence[float] | Interval | None, answer: str = "", unit: str = "",
             digits: int = 3, signed: bool = False) -> Finding:
    """A fact the study measured (mean over seeds with its t interval), no comparison."""
    iv = values if isinstance(values, Interval) or values is None else mean_interval(values)
    return Finding(question, "measured", iv, answer, unit, None, digits, signed)


def not_tested(question: str, reason: str, number: Interval | None = None, answer: str = "",
               unit: str = "", digits: int = 3, signed: bool = True) -> Finding:
    """A question the study could not answer because ``reason`` (its precondition failed)."""
    return Finding(question, "not tested", number, answer, unit, reason, digits, signed)


# ------------------------------------------------------------------------------------- rendering


def headline(findings: Sequence[Finding]) -> str:
    """The study's answer in one sentence: its first lead line (plain text)."""
    if not findings:
        raise ValueError("headline: a study needs at least one finding")
    return findings[0].plain()


def summary_block(findings: Sequence[Finding], lead_finding: Finding | None = None) -> dict[str, Any]:
    """``{"headline", "verdicts", "compared"}`` for ``summary.json`` (lead lines only, at most MAX_LEAD); the
    headline is ``lead_finding``'s line when given, else the first lead line's."""
    lead = _lead(findings)
    return {"headline": lead_finding.plain() if lead_finding is not None else headline(lead),
            "verdicts": [f.plain() for f in lead],
            "compared": [f.to_dict() for f in lead]}


def _lead(findings: Sequence[Finding]) -> list[Finding]:
    if not 1 <= len(findings) <= MAX_LEAD:
        raise ValueError(f"a study leads with 1 to {MAX_LEAD} findings, got {len(findings)}")
    return list(findings)


def render(findings: Sequence[Finding], table: Any = None, details: Sequence[str] = (),
           note: str | None = None) -> str:
    """The findings section as markdown: the lead lines, a table, then ``### Details``.

    Args:
        findings: 1 to :data:`MAX_LEAD` rules, the study's question first.
        table: a DataFrame (rendered with ``to_markdown``-free pipes) or a ready markdown string.
        details: supporting lines, each one bullet under the heading.
        note: one line under the lead lines (how the intervals were computed).
    """
    lines = [f"- {f.line()}" for f in _lead(findings)]
    out = "\n".join(lines)
    out += "\n\n" + (note or interval_note(findings))
    if table is not None:
        out += "\n\n" + (table if isinstance(table, str) else markdown_table(table))
    if details:
        out += "\n\n### Details\n\n" + "\n".join(f"- {d}" for d in details)
    return out


def interval_note(findings: Sequence[Finding]) -> str:
    """What the brackets mean: level, method and seed count of the lead lines' intervals."""
    ivs = [f.number for f in findings if f.number is not None]
    names = {"paired t": "Student t on the per-seed differences", "t": "Student t on a mean over seeds",
             "t, clipped": "Student t on a mean over seeds, clipped to the quantity's range",
             "Welch t": "Welch's t, unpaired", "bootstrap": "bootstrap over seeds"}
    methods = [names.get(m, m) for m in sorted({iv.method for iv in ivs})]
    ns = sorted({iv.n for iv in ivs})
    seeds = "/".join(str(n) for n in ns) or "n/a"
    return (f"Brackets: {int(LEVEL * 100)}% interval ({'; '.join(methods) or 'n/a'}) over {seeds} seeds; "
            f"an effect is called better or worse only when its interval excludes 0.")


def markdown_table(df: Any, digits: int = 4) -> str:
    """A DataFrame as a pipe table (index as the first column), numbers to ``digits`` significant digits."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "n/a" if not math.isfinite(v) else f"{v:.{digits}g}"
        return str(v)
    cols = [df.index.name or ""] + [str(c) for c in df.columns]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for idx, r in df.iterrows():
        rows.append("| " + " | ".join([str(idx)] + [cell(v) for v in r.tolist()]) + " |")
    return "\n".join(rows)


def cell(iv: Interval, digits: int = 3, signed: bool = True) -> str:
    """A table cell: ``+0.015 [-0.050, +0.080]`` (``signed=False`` for a value rather than a difference)."""
    return iv.text(digits, signed=signed)


# --------------------------------------------------------------------------------------- figures

_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#7f7f7f", "#bcbd22", "#393b79", "#637939")


def palette(names: Sequence[str]) -> dict[str, str]:
    """One distinct colour per name, in order (12 colours; a 13th name reuses the first)."""
    return {n: _PALETTE[i % len(_PALETTE)] for i, n in enumerate(dict.fromkeys(names))}


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` points (the first points average what exists so far)."""
    if window <= 1:
        return values
    c = np.cumsum(np.insert(values, 0, 0.0))
    out = np.empty_like(values, dtype=float)
    for i in range(len(values)):
        lo = max(0, i + 1 - window)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def step_differences(histories: Any, reference: str, metric: str = "train/loss", window: int = 1,
                     level: float = LEVEL) -> dict[str, dict[str, np.ndarray]]:
    """Per arm other than ``reference``: per step, the mean over seeds of ``arm - reference`` and its t interval.

    Args:
        histories: long table with columns ``arm``, ``seed``, ``step``, ``metric``.
        window: each seed's curve is smoothed (trailing mean) before differencing.

    Returns ``{arm: {"step", "mean", "low", "high"}}`` (arrays; low/high NaN with one seed).
    """
    from scipy import stats

    df = histories.dropna(subset=[metric])
    if reference not in set(df.arm):
        raise ValueError(f"reference arm {reference!r} has no {metric!r} values (arms: {sorted(set(df.arm))})")
    wide = {}
    for (arm, seed), one in df.groupby(["arm", "seed"], sort=False):
        one = one.sort_values("step")
        wide[(arm, seed)] = dict(zip(one.step.to_numpy(), smooth(one[metric].to_numpy(float), window)))
    out = {}
    for arm in dict.fromkeys(df.arm):
        if arm == reference:
            continue
        seeds = [s for (a, s) in wide if a == arm and (reference, s) in wide]
        if not seeds:
            continue
        steps = sorted(set.intersection(*(set(wide[(arm, s)]) & set(wide[(reference, s)]) for s in seeds)))
        d = np.array([[wide[(arm, s)][t] - wide[(reference, s)][t] for t in steps] for s in seeds])
        m = d.mean(axis=0)
        if len(seeds) > 1:
            half = stats.t.ppf(0.5 + level / 2, len(seeds) - 1) * d.std(axis=0, ddof=1) / math.sqrt(len(seeds))
        else:
            half = np.full_like(m, np.nan)
        out[arm] = {"step": np.asarray(steps, float), "mean": m, "low": m - half, "high": m + half,
                    "n": len(seeds)}
    return out


def difference_figure(histories: Any, reference: str, title: str = "", metric: str = "train/loss",
                      window: int | None = None, skip: float = 0.25, colors: Mapping[str, str] | None = None,
                      ax: Any = None) -> Any:
    """Each arm minus ``reference`` per optimizer step: mean over seeds (line) and its 95% band.

    The training loss is smoothed per seed (trailing mean over ``window`` steps, default 1/20 of the
    run) before differencing; the y axis is zoomed to the 2-98% range of the bands after the first
    ``skip`` share of steps (the early steps, where arms part and meet again fast, would flatten the rest).
    Validation differences (paired by seed) are drawn as markers with their intervals.
    Returns a matplotlib Figure (or draws into ``ax`` and returns its figure).
    """
    from matplotlib.figure import Figure

    last = float(histories.step.max())
    window = window or max(1, int(round(last / 20)))
    diffs = step_differences(histories, reference, metric, window)
    val = (step_differences(histories, reference, "val/loss")
           if "val/loss" in histories and metric != "val/loss" else {})
    colors = dict(colors or palette(list(dict.fromkeys(histories.arm))))
    if ax is None:
        fig = Figure(figsize=(6.8, 4.2), dpi=100)
        ax = fig.subplots()
    else:
        fig = ax.figure
    lows, highs = [], []
    for arm, d in diffs.items():
        c = colors[arm]
        ax.plot(d["step"], d["mean"], color=c, lw=1.6, label=f"{arm} ({d['n']} seeds)")
        ax.fill_between(d["step"], d["low"], d["high"], color=c, alpha=0.18, lw=0)
        keep = d["step"] >= skip * last
        for arr, acc in ((d["low"], lows), (d["high"], highs), (d["mean"], lows), (d["mean"], highs)):
            vals = arr[keep]
            acc.extend(vals[np.isfinite(vals)].tolist())
        if arm in val:
            v = val[arm]
            err = np.vstack([v["mean"] - v["low"], v["high"] - v["mean"]])
            ax.errorbar(v["step"], v["mean"], yerr=None if not np.isfinite(err).all() else err, fmt="D",
                        color=c, ms=4, capsize=2, lw=0.8)
            lows.extend(v["low"][np.isfinite(v["low"])].tolist())
            highs.extend(v["high"][np.isfinite(v["high"])].tolist())
    ax.axhline(0.0, color="black", lw=0.8)
    if lows and highs:  # the 2-98% range of the bands: one early spike does not flatten the rest
        lo, hi = min(float(np.quantile(lows, 0.02)), 0.0), max(float(np.quantile(highs, 0.98)), 0.0)
        pad = 0.08 * (hi - lo or 1e-3)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("optimizer step")
    ylabel = metric.replace("/", " ")
    ax.set_ylabel(f"{ylabel} minus {reference} (nats)")
    ax.set_title(title or f"{ylabel}: each arm minus {reference}, 95% band over seeds", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def by_seed(df: Any, arm: str, column: str, arm_column: str = "arm") -> dict[int, float]:
    """``{seed: value}`` of ``column`` for one arm of a per-run table (NaN and missing values left out)."""
    sel = df[df[arm_column] == arm]
    return {int(s): float(v) for s, v in zip(sel.seed, sel[column]) if v is not None and math.isfinite(float(v))}


def add_intervals(obj: Any, level: float = LEVEL) -> Any:
    """Add ``low``/``high`` (the t interval of the mean) beside every ``{"mean", "std", "n"}`` in ``obj``.

    Walks dicts and lists in place and returns ``obj``; with one seed (no std) the bounds are None.
    """
    from scipy import stats

    if isinstance(obj, dict):
        if {"mean", "std", "n"} <= obj.keys() and not isinstance(obj["mean"], (dict, list)):
            m, sd, n = obj["mean"], obj["std"], obj["n"]
            if m is not None and sd is not None and n and n > 1:
                half = float(stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n))
                obj["low"], obj["high"] = m - half, m + half
            else:
                obj["low"] = obj["high"] = None
        for v in obj.values():
            add_intervals(v, level)
    elif isinstance(obj, list):
        for v in obj:
            add_intervals(v, level)
    return obj


def result_table(path: Any, compute: Any, from_results: bool) -> Any:
    """A study's raw table: read from ``path`` (CSV) when ``from_results``, else ``compute()`` it and write it there.

    ``compute``: ``() -> DataFrame | list[dict]``. Lets a notebook render its report from the committed
    raw results without training again (papermill parameter ``from_results = True``).
    """
    from pathlib import Path

    import pandas as pd

    path = Path(path)
    if from_results:
        if not path.exists():
            raise FileNotFoundError(f"from_results=True but {path} does not exist: run the study first")
        return pd.read_csv(path)
    df = compute()
    df = df if isinstance(df, pd.DataFrame) else pd.DataFrame(df)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)
    return df


def committed_figure(path: Any) -> Any:
    """The figure a study's training run drew (``figures/*.png``), shown as it is.

    For figures that need the trained models (not kept in the committed raw results) when a report is
    rendered from the committed results.
    """
    from pathlib import Path

    from IPython.display import Image

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: it is drawn by the study's training run (from_results=False)")
    return Image(data=path.read_bytes(), format="png")


def attach(summary: dict[str, Any], rep: Report, from_results: bool) -> dict[str, Any]:
    """``summary`` with the report: ``headline``, ``verdicts``, ``compared`` (each with its interval) first
    after ``meta``, a ``low``/``high`` t interval beside every ``{"mean", "std", "n"}``, and
    ``meta.report`` (rendered from the committed results or by the run itself, code state, date)."""
    from datetime import UTC, datetime

    from moelab.studies.common import git_state

    git = git_state(exclude=("studies",))
    meta = dict(summary.get("meta", {}))
    meta["report"] = {"from_results": bool(from_results), "commit": git["commit"], "dirty": git["dirty"],
                      "date": datetime.now(UTC).isoformat(timespec="seconds")}
    rest = {k: v for k, v in summary.items() if k not in ("meta", "headline", "verdicts", "compared")}
    return add_intervals({"meta": meta, **rep.summary(), **rest})


@dataclass
class Report:
    """A study's findings: the lead rules, the table, the details (what :func:`render` takes)."""

    findings: list[Finding]
    table: Any = None
    details: list[str] = field(default_factory=list)
    # the answer the study is named for, as the README's headline, when the lead opens with a precondition
    lead_finding: Finding | None = None

    def markdown(self) -> str:
        return render(self.findings, self.table, self.details)

    def summary(self) -> dict[str, Any]:
        return summary_block(self.findings, self.lead_finding)


__all__ = ["CLAIMS", "Finding", "Interval", "LEVEL", "MAX_LEAD", "Report", "add_intervals", "attach", "bootstrap",
           "by_seed", "cell", "committed_figure", "compare", "difference_figure", "headline", "judge", "log_interval",
           "markdown_table", "mean_interval", "measured", "not_tested", "paired", "palette", "render", "result_table",
           "smooth", "status_text", "step_differences", "summary_block", "welch"]
