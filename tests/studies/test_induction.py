"""The induction probe (moelab.studies.induction): its copy task, its arms, and that its reference learns."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moelab.base import repo_root
from moelab.studies import induction as ind


def test_copy_batch_asks_the_repeat_only() -> None:
    ids, tg = ind.copy_batch(3, 16, 50, seed=1)
    assert ids.shape == tg.shape == (3, 16) and ids.dtype == tg.dtype == torch.int64
    assert torch.equal(ids[:, :8], ids[:, 8:]) and int(ids.min()) >= 1 and int(ids.max()) < 50
    assert bool((tg[:, :8] == ind.IGNORE).all())
    # position t of the repeat predicts the id that followed the same id in the first half; the last wraps around
    assert torch.equal(tg[:, 8:15], ids[:, 1:8]) and torch.equal(tg[:, 15], ids[:, 0])
    assert torch.equal(ind.copy_batch(3, 16, 50, seed=1)[0], ids)  # seeded
    for bad in ({"seq_len": 7}, {"seq_len": 2}, {"vocab_size": 2}):
        kw = {"n": 1, "seq_len": 16, "vocab_size": 50, "seed": 0, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            ind.copy_batch(**kw)


@pytest.mark.parametrize("arm", list(ind.ARMS))
def test_every_arm_builds_and_trains_a_few_steps(arm: str) -> None:
    r = ind.train_arm(arm, 0, steps=4, every=2, seq_len=16, eval_samples=8, batch_size=4)
    assert [p["step"] for p in r["curve"]] == [0, 2, 4] and r["steps_to_learn"] is None
    assert all(math.isfinite(p["nll"]) and 0.0 <= p["accuracy"] <= 1.0 for p in r["curve"])
    # an untrained model's NLL on the repeat is about a uniform guess over the vocabulary
    assert r["curve"][0]["nll"] == pytest.approx(math.log(512), abs=0.1)
    kind, n_layers, spec = ind.ARMS[arm]
    if kind == "moelab":
        model = ind.build(arm, 512, 64, 16)
        assert "".join("K" if layer.kind == "kda" else "M" for layer in model.layers) == spec
        assert len(model.layers) == n_layers
    with pytest.raises(ValueError, match="arm='nope'"):
        ind.build("nope", 512, 64, 16)


def test_the_rotary_reference_learns_to_copy() -> None:
    """The probe can tell a model that learns from one that does not: softmax attention with rotary positions
    learns the copy task within a few hundred steps (it measured 200 of them at seq_len 128, d_model 64)."""
    r = ind.train_arm("attention-rope-L2", 0, steps=500, every=100, seq_len=32, eval_samples=32)
    assert r["steps_to_learn"] is not None and r["curve"][-1]["accuracy"] >= 0.9


def test_summary_counts_the_seeds_that_learned() -> None:
    runs = [{"arm": "a", "seed": s, "steps_to_learn": v, "curve": [{"accuracy": acc}]}
            for s, (v, acc) in enumerate([(200, 1.0), (300, 0.95), (None, 0.1)])]
    s = ind.summarize(runs, 1000)["a"]
    assert s["learned"] == "2 of 3 seeds within 1000 steps" and s["median_steps_to_learn"] is None
    assert s["mean_final_accuracy"] == pytest.approx((1.0 + 0.95 + 0.1) / 3)
    s = ind.summarize(runs[:2], 1000)["a"]
    assert s["median_steps_to_learn"] == 250.0


def test_committed_result_has_its_provenance() -> None:
    path = repo_root() / "studies/04_context_curriculum/results/induction_cpu.json"
    if not path.exists():
        pytest.skip("no committed probe result")
    d = json.loads(path.read_text())
    assert d["meta"]["commit"] and d["meta"]["date"] and d["meta"]["command"].startswith("python -m moelab")
    assert {r["arm"] for r in d["runs"]} == set(d["summary"]) and len(d["runs"]) >= len(d["summary"])


def test_table_and_figure_of_a_result() -> None:
    runs = ind.run(["attention-rope-L2", "moelab-KM-L2"], [0, 1], steps=4, every=2, seq_len=16, eval_samples=8,
                   batch_size=4)
    result = {"meta": {"settings": {"steps": 4, "seq_len": 16, "threshold": 0.9}}, "summary": ind.summarize(runs, 4),
              "runs": runs}
    rows = ind.table(result)
    assert [r["arm"] for r in rows] == ["attention-rope-L2", "moelab-KM-L2"]
    assert rows[0]["positions"] == "rotary" and rows[1]["positions"] == "from the KDA layers"
    assert rows[1]["steps to 0.9 (per seed)"] == "> 4, > 4" and rows[1]["params"] > 0
    fig = ind.figure(result)
    assert len(fig.axes[0].lines) == 2 * 2 + 1  # a line per run and the threshold
    assert ind.load(repo_root() / "no-such-file.json") is None
    assert ind.caption(result).startswith("**Figure 2c.**") and "2 seed(s) per arm, 4 steps" in ind.caption(result)
