"""Study 4, research preset: equal tokens and a fixed retrieval share per step in every arm (resolved configs and
real batches), >= 8 sequences per step at the longest length, the pilot and the research findings' rules."""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace

import pytest

from moelab.base import repo_root
from moelab.config import load_config
from moelab.data.curriculum import plan as stage_plan
from moelab.data.datamodule import TextDataModule
from moelab.data.synthetic import IGNORE
from moelab.studies import common
from moelab.studies import context_curriculum as cc


def test_research_arms_train_equal_tokens_and_retrieval_per_step() -> None:
    p = cc.plan("research")
    assert set(cc.arms_factor("research")) == {"data.curriculum"}  # common.check_arms_differ_only
    budget = cc.retrieval_budget("research")
    stages = [st for v in budget.values() for st in v["stages"]]
    assert {st["tokens_per_step"] for st in stages} == {65536}
    assert {st["retrieval_share"] for st in stages} == {0.25}
    assert budget["direct"]["stages"][0]["sequences_per_step"] == 8  # >= 8 sequences at the longest length
    assert budget["direct"]["stages"][0]["retrieval_sequences_per_step"] == 2
    assert budget["short"]["stages"][0]["sequences_per_step"] == 64
    assert [st["seq_len"] for st in budget["curriculum"]["stages"]] == list(p.lengths)
    # training MQAR with a pair per 8 tokens (more answers per retrieval sequence), evaluated at 16 pairs
    assert [st["mqar_pairs"] for st in budget["curriculum"]["stages"]] == [128, 512, 1024] and p.eval.mqar_pairs == 16
    # so every arm trains the same MQAR answers per step: retrieval sequences / 2 (the tasks take turns) x pairs
    answers = {st["retrieval_sequences_per_step"] // 2 * st["mqar_pairs"] for st in stages}
    assert answers == {8 * 128}
    for name, ov in cc.pilot_arms("research").items():  # the pilot: the short schedule, fewer steps
        cfg = load_config(p.base, {**p.common, **ov})
        (st,) = stage_plan(cfg.data.curriculum, cfg.train.batch_size, cfg.data.seq_len,
                           cfg.train.accumulate_grad_batches, cfg.train.max_steps)
        assert cc.pilot_recipe(name) in ("", name.removeprefix("pilot")) and st.seq_len == p.lengths[0]
        assert name.startswith(f"pilot{st.steps}")
        assert st.synthetic_per_batch == 16
        assert (cfg.model.n_layers, cfg.train.lr) == (4, 3e-3)  # the grid's model and learning rate in every pilot
        if cc.pilot_recipe(name):  # a variant: the earlier batch, 2 micro-batches of 4 x 16K (131K tokens a step)
            assert (cfg.train.accumulate_grad_batches, cfg.data.seq_len, cfg.train.batch_size) == (2, 16384, 4)
        else:  # the grid's own settings: one micro-batch of 8 x 8K
            assert (cfg.train.accumulate_grad_batches, cfg.data.seq_len, cfg.train.batch_size) == (1, 8192, 8)
    assert sorted(cc.pilot_arms("research")) == ["pilot2048L4", "pilot3072L4", "pilot4096"]
    assert p.pilot_monitor_every == 64
    batch = ("model.max_seq_len=16384, data.seq_len=16384, train.batch_size=4, train.accumulate_grad_batches=2, "
             "train.val_every=48, train.log_every=8")
    assert cc.pilot_recipes("research") == {"": "the grid's settings",
                                            **{f"{n}L4": f"{batch}, {n} steps" for n in (2048, 3072)}}
    assert cc.pilot_recipe("pilot3072L4") == "3072L4" and cc.pilot_recipe("pilot4096") == ""
    with pytest.raises(ValueError, match="'short' is not a pilot arm"):
        cc.pilot_recipe("short")
    assert cc.pilot_eval_settings("research")["passkey"]["lengths"] == [1024]
    # the other presets keep the per-sequence draw, as their committed reports trained
    assert cc.retrieval_budget("gpu")["direct"]["stages"][0]["retrieval_share"] == 0.1


def test_retrieval_share_holds_in_real_batches_of_every_arm() -> None:
    """The research plan's schedules on the tiny preset (256 -> 512 -> 1024, 2 micro-batches of 4096 tokens per
    step): every step of every arm is 8,192 tokens of which exactly 25% are retrieval sequences."""
    p = dataclasses.replace(cc.plan("research"), lengths=(256, 512, 1024), shares=(0.5, 0.25, 0.25), steps=4,
                            train_mqar_density=1 / 16)  # 16 pairs at 256 tokens (a pair needs 4 tokens)
    tiny = {"model.max_seq_len": 1024, "data.seq_len": 1024, "train.batch_size": 4,
            "train.accumulate_grad_batches": 2, "train.max_steps": 4, "train.warmup_steps": 1}
    arms = {name: {"data.curriculum": st} for name, st in cc.schedules(p).items()}
    cfgs = common.resolve_arms("tiny", arms, tiny)
    seen = {}
    for name, cfg in cfgs.items():
        dm = TextDataModule(cfg.data, batch_size=cfg.train.batch_size, seed=0, max_steps=cfg.train.max_steps)
        dm.trainer = SimpleNamespace(global_step=0, global_rank=0, world_size=1, accumulate_grad_batches=2,
                                     max_steps=4, _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))
        batches = list(dm.train_dataloader())
        assert len(batches) == 8
        for step in range(4):
            micro = batches[2 * step: 2 * step + 2]
            tokens = sum(b["targets"].numel() for b in micro)
            retrieval = sum(int((b["targets"] == IGNORE).any(dim=1).sum()) * b["targets"].shape[1] for b in micro)
            assert tokens == 8192 and retrieval / tokens == 0.25, (name, step, retrieval)
        seen[name] = sorted({b["targets"].shape[1] for b in batches})
    assert seen == {"curriculum": [256, 512, 1024], "direct": [1024], "short": [256]}


SUMMARY = repo_root() / "studies/04_context_curriculum/summary.json"


def _lengths() -> tuple[int, int, int]:
    """The committed summary's shortest and longest evaluated lengths and its longest training length."""
    s = json.loads(SUMMARY.read_text())
    ev = sorted(int(k) for k in s["rows"][0]["passkey"])
    return ev[0], ev[-1], max(s["meta"]["lengths"])


LO, HI, LONGEST = _lengths()
SPAN = f"{LO:,}-{HI:,} tokens"


def _research_summary(pilot_passkey: tuple[float, ...], learned: bool) -> dict:
    """The committed summary with synthetic research fields: loss_beyond per row, a pilot, and passkey that every
    arm learns up to the longest training length (``learned``) or that no run learns."""
    s = copy.deepcopy(json.loads(SUMMARY.read_text()))
    for r in s["rows"]:
        off = {"curriculum": 0.0, "direct": 0.2, "short": 0.5}[r["schedule"]] + 0.01 * r["seed"]
        r["loss_beyond"] = 4.0 + off
        if learned:
            r["passkey"] = {k: (1.0 if int(k) <= LONGEST else 0.6 - off) for k in r["passkey"]}
            r["effective_context"] = LONGEST if r["schedule"] != "short" else LO
        else:
            r["passkey"] = {k: 0.0 for k in r["passkey"]}
            r["effective_context"] = 0
    s["pilot"] = [{"source": "pilot", "seed": 0, "steps": 96, "tokens": 12_582_912, "passkey": pilot_passkey[0],
                   "mqar": 0.1},
                  *({"source": "short", "seed": k, "steps": 384, "tokens": 50_331_648, "passkey": v, "mqar": 0.5}
                    for k, v in enumerate(pilot_passkey[1:]))]
    s["pilot_length"] = 1024
    return s


def test_pilot_finding_rules() -> None:
    yes = cc.pilot_finding(_research_summary((0.3, 0.92, 0.95, 0.9), True)["pilot"], 1024)
    assert yes.status == "measured" and "first at 50.3M tokens" in yes.answer and "12.6M tokens: 0.30" in yes.answer
    no = cc.pilot_finding(_research_summary((0.1, 0.5, 0.6, 0.4), False)["pilot"], 1024)
    assert no.status == "not tested" and "not learned within 50.3M tokens" in no.reason
    assert cc.pilot_finding([], 1024).status == "not tested"
    # the answer's NLL per key token, where the records have it, beside a uniform digit's
    rows = [{"tokens": 12_582_912, "passkey": 0.0, "passkey_nll": 6.9}, {"tokens": 25_165_824, "passkey": 0.0,
                                                                         "passkey_nll": 2.6}]
    nll = cc.pilot_finding(rows, 1024)
    assert nll.status == "not tested"
    assert "answer NLL per key token by budget: 12.6M: 6.90; 25.2M: 2.60 (a uniform digit: 2.30)" in nll.reason


@pytest.mark.parametrize("learned", [True, False])
def test_research_findings_on_synthetic_records(learned: bool) -> None:
    s = cc.refresh_comparisons(_research_summary((0.3, 0.95, 0.95, 0.95) if learned else (0.0, 0.1, 0.0, 0.1),
                                                 learned))
    rep = cc.study_report(s)
    by_q = {f.question: f for f in rep.findings}
    # the question leads, its precondition (the pilot) next
    assert rep.findings[0].question == f"Mean passkey accuracy over {SPAN}, curriculum minus direct"
    assert rep.findings[1].question.startswith("Is passkey retrieval learnable")
    loss = by_q[f"Held-out loss past {LONGEST:,} tokens (loss by position), curriculum minus direct"]
    assert loss.status == "better" and loss.number.mean == pytest.approx(-0.2) and loss.number.high < 0
    far = by_q[f"Passkey accuracy at {HI:,} tokens ({HI // LONGEST}x the longest training length), curriculum "
               "minus direct"]
    pk = by_q[f"Mean passkey accuracy over {SPAN}, curriculum minus direct"]
    pk_short = by_q[f"Mean passkey accuracy over {SPAN}, curriculum minus short"]
    lengths = [int(k) for k in s["rows"][0]["passkey"]]
    far_share = sum(n > LONGEST for n in lengths) / len(lengths)  # past the training length, where they differ
    also = " ".join(rep.details)  # the findings past the lead, effective context against short among them
    if learned:
        assert far.status == "better" and far.number.mean == pytest.approx(0.2)
        assert pk.status == "better" and pk.number.mean == pytest.approx(0.2 * far_share)
        assert pk_short.status == "better" and pk_short.number.mean == pytest.approx(0.5 * far_share)
        assert f"effective context than short training? +{LONGEST - LO} tokens" in also
    else:
        assert far.status == pk.status == pk_short.status == "not tested"
        assert "retrieval never learned" in pk_short.reason
        assert "effective context than short training? not tested" in also


def test_effective_context_is_not_tested_where_no_run_holds_the_bar() -> None:
    """Retrieval learned (some run passes 0.5 somewhere) but no run of either arm holds 0.9 at the shortest length:
    every effective context is 0, and the comparison says so instead of calling [0, 0] inside the noise; the mean
    passkey accuracy over the lengths still compares the arms."""
    s = _research_summary((0.3, 0.95, 0.95, 0.95), True)
    for r in s["rows"]:
        r["effective_context"] = 0
        r["passkey"] = {k: {"curriculum": 0.8, "direct": 0.0, "short": 0.85}[r["schedule"]] - 0.01 * r["seed"]
                        for k in r["passkey"]}
    by_q = {f.question: f for f in cc.study_report(cc.refresh_comparisons(s)).findings}
    eff = by_q["Does the curriculum reach a longer effective context than direct training"]
    assert eff.status == "not tested" and "effective context 0 in every run" in eff.reason
    pk = by_q[f"Mean passkey accuracy over {SPAN}, curriculum minus direct"]
    assert pk.status == "better" and pk.number.mean == pytest.approx(0.8)


def test_pilot_finding_names_a_handful_of_a_learning_curves_points() -> None:
    """A monitored pilot has a point every 64 steps: the finding's text names six budgets, the first and the last
    among them, and the first budget that reached the threshold is found among all of them."""
    step = 8_388_608  # 64 steps of 131,072 tokens
    rows = [{"tokens": k * step, "passkey": 0.95 if k >= 11 else 0.01 * k, "passkey_nll": 7.0 - 0.3 * k}
            for k in range(1, 17)]
    f = cc.pilot_finding(rows, 1024)
    assert f.status == "measured" and f"first at {11 * step / 1e6:.1f}M tokens" in f.answer
    budgets = f.answer.split("passkey by budget: ")[1].split("; answer NLL")[0].split("; ")
    assert len(budgets) == 6 and budgets[0].startswith("8.4M tokens") and budgets[-1].startswith("134.2M tokens")
    assert cc._few(list(range(3))) == [0, 1, 2] and cc._few(list(range(16))) == [0, 3, 6, 9, 12, 15]


def test_pilot_variants_are_reported_apart_from_the_grids_recipe() -> None:
    """A pilot variant (another model or learning rate) has its own curve in the finding's text and its own line
    in the figure; whether retrieval is learnable is answered from the runs with the grid's settings only, so a
    variant that learns does not turn the grid's "not learned" into a yes."""
    step = 8_388_608
    own = [{"source": "pilot", "recipe": "", "seed": 0, "tokens": k * step, "passkey": 0.0, "passkey_nll": 2.45,
            "mqar": 0.0} for k in range(1, 5)]
    var = [{"source": "pilot", "recipe": "L4", "seed": 0, "tokens": k * step, "passkey": 0.95 if k >= 3 else 0.1,
            "passkey_nll": 0.1, "mqar": 0.5} for k in range(1, 9)]
    recipes = {"": "the grid's settings", "L4": "model.n_layers=4, train.lr=0.003"}
    f = cc.pilot_finding(own + var, 1024, recipes)
    assert f.status == "not tested" and "not learned within 33.6M tokens" in f.reason
    assert "pilot variant L4 (model.n_layers=4, train.lr=0.003): learned, first at 25.2M tokens" in f.reason
    g = cc.pilot_finding(own + [{**d, "passkey": 0.0} for d in var], 1024, recipes)
    assert "pilot variant L4 (model.n_layers=4, train.lr=0.003): not learned within 67.1M tokens" in g.reason
    h = cc.pilot_finding(var, 1024, recipes)  # variants only: not tested, their curves still told
    assert h.status == "not tested" and h.reason.startswith("no pilot run of the grid's recipe recorded. pilot "
                                                            "variant L4 (model.n_layers=4, train.lr=0.003): learned")
    assert cc.pilot_finding([], 1024, recipes).reason == "no pilot run of the grid's recipe recorded"
    fig = cc.pilot_figure(own + var, 1024, {"passkey": 0.0, "mqar": 0.0})
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels[:2] == ["pilot", "pilot L4"]
    (blue,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "pilot"]
    assert list(blue.get_xdata()) == pytest.approx([k * step / 1e6 for k in range(1, 5)])


def test_a_pilot_variant_may_change_the_short_stages_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant's ``"data.curriculum"`` mapping sets fields of the short stage (here its task list); its recipe
    text names them flat; the stage keeps the short schedule's length, share and MQAR pairs, at the variant's steps."""
    p = cc.plan("research")
    tasks = ["passkey", "mqar", "repeat"]
    variant = ("Rep", 512, {"train.lr": 2e-3, "data.curriculum": {"synthetic_tasks": tasks}})
    monkeypatch.setitem(cc.PRESETS, "research", dataclasses.replace(p, pilot_variants=(variant,)))
    ov = cc.pilot_arms("research")["pilot512Rep"]
    (stage,) = ov["data.curriculum"]
    short = cc.schedules(cc.plan("research"))["short"][0]
    assert stage == {**short, "steps": 512, "synthetic_tasks": tasks} and ov["train.max_steps"] == 512
    assert cc.pilot_recipes("research")["512Rep"] == ("train.lr=0.002, data.curriculum.synthetic_tasks="
                                                    "passkey+mqar+repeat, 512 steps")
    cfg = load_config(p.base, {**p.common, **ov})
    assert cfg.data.curriculum[0].synthetic_tasks == tasks and cfg.train.lr == 2e-3


def test_pilot_finding_counts_runs_and_says_yes_only_when_every_run_learned() -> None:
    """The research grid's shape: a monitored pilot that reaches 0.9 late and three short runs measured at their end,
    one of which does not learn. The answer counts the runs that reached the bar (no "yes" while some run did
    not) and lists every run's value at the largest budget."""
    step = 8_388_608
    pilot = [{"source": "pilot", "seed": 0, "tokens": k * step, "passkey": 0.95 if k >= 24 else 0.0}
             for k in range(1, 33)]
    short = [{"source": "short", "seed": s, "tokens": 32 * step, "passkey": v}
             for s, v in enumerate((0.85, 0.05, 0.75))]
    f = cc.pilot_finding(pilot + short, 1024)
    assert f.status == "measured" and f.number is not None
    assert f.answer.startswith(f"1 of 4 runs reached it, the first at {24 * step / 1e6:.1f}M tokens")
    assert f"passkey at {32 * step / 1e6:.1f}M tokens by run: 0.95, 0.85, 0.75, 0.05" in f.answer
    every = cc.pilot_finding(pilot + [{**d, "passkey": 0.92} for d in short], 1024)
    assert every.answer.startswith("yes, 4 of 4 runs reached it") and not every.number.includes_zero


def test_passkey_comparisons_at_the_floor_are_not_tested() -> None:
    """Short training learns retrieval, but curriculum and direct never do (passkey 0.00 in every run, as in the
    research grid): curriculum minus direct is 0 - 0, no measurement, so it is "not tested" with the floor named;
    curriculum minus short is still compared."""
    s = _research_summary((0.3, 0.95, 0.95, 0.95), True)
    for r in s["rows"]:
        r["effective_context"] = 0
        r["passkey"] = {k: (0.8 - 0.1 * r["seed"] if r["schedule"] == "short" else 0.0) for k in r["passkey"]}
    by_q = {f.question: f for f in cc.study_report(cc.refresh_comparisons(s)).findings}
    pk = by_q[f"Mean passkey accuracy over {SPAN}, curriculum minus direct"]
    assert pk.status == "not tested" and pk.reason.startswith("floor: passkey 0.00 at every length in every run of "
                                                              "curriculum and direct")
    assert "short retrieves in 3 of 3 runs (passkey at 1,024 tokens by run: 0.80, 0.70, 0.60)" in pk.reason
    short = by_q[f"Mean passkey accuracy over {SPAN}, curriculum minus short"]
    assert short.status == "worse" and short.number.mean == pytest.approx(-0.7)
    assert cc.refresh_comparisons(s)["verdict"]["effective_context"].startswith("not tested")
    assert cc.effective_floor(s["rows"]).endswith("their passkey accuracy is 0 at every length as well")
    s["rows"][0]["passkey"] = {k: 0.5 for k in s["rows"][0]["passkey"]}  # some retrieval, under the bar at 1K
    assert cc.effective_floor(s["rows"]).endswith("the mean passkey accuracy over the lengths compares them")


def test_curriculum_timing_compares_the_short_stage_with_the_pilots_onset() -> None:
    """The details say when the curriculum left the pilot's length against when the pilot began to retrieve there,
    computed from the stages and the pilot's curve."""
    s = _research_summary((0.3, 0.95, 0.95, 0.95), True)
    stages = s["budget"]["per_step"]["curriculum"]["stages"]
    first = [r for r in s["rows"] if r["schedule"] == "curriculum"][0]["stages"].split(" -> ")[0]
    assert stages[0]["seq_len"] == int(first.split("x")[0]) == 1024
    end = stages[0]["tokens_per_step"] * int(first.split("x")[1])
    after = cc.curriculum_timing(s)  # the pilot's one point, 0.3 at 12.6M tokens: onset before the stage ends
    assert after == (f"Timing: the curriculum's 1,024-token stage ends at {end / 1e6:.1f}M tokens, after the pilot's "
                     f"passkey at that length first passed 0.1 (12.6M tokens).")
    s["pilot"] = [{"source": "pilot", "seed": 0, "tokens": t, "passkey": v}
                  for t, v in ((end // 2, 0.0), (end + 65536, 0.2), (2 * end, 0.95))]
    assert cc.curriculum_timing(s).endswith(f"before the pilot's passkey at that length first passed 0.1 "
                                            f"({(end + 65536) / 1e6:.1f}M tokens; 0.9 at {2 * end / 1e6:.1f}M).")
    s["pilot"] = s["pilot"][:1]
    assert "never passed 0.1" in cc.curriculum_timing(s)
    assert cc.curriculum_timing({**s, "pilot": []}) is None
