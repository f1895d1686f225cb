"""Context curriculum: stage planning and its errors, constant tokens per step, document packs, the
synthetic mix, and sampler-level resume in the middle of a stage."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moelab.base import ConfigError
from moelab.config import load_config
from moelab.data.config import CurriculumStage, DataConfig
from moelab.data.curriculum import CurriculumSampler, DocumentPacker, plan, stage_at
from moelab.data.datamodule import TextDataModule
from moelab.data.synthetic import IGNORE
from moelab.data.tokenizer import EOS_ID

STAGES = [CurriculumStage(seq_len=8, steps=2), CurriculumStage(seq_len=16, steps=3),
          CurriculumStage(seq_len=32)]


def _trainer(step: int = 0, rank: int = 0, world: int = 1, accum: int = 1, max_steps: int = 8):
    return SimpleNamespace(global_step=step, global_rank=rank, world_size=world, accumulate_grad_batches=accum,
                           max_steps=max_steps, _accelerator_connector=SimpleNamespace(use_distributed_sampler=False))


def _module(cfg: DataConfig, stages=STAGES, max_steps: int = 8, trainer=None, batch_size: int = 4) -> TextDataModule:
    dm = TextDataModule(dataclasses.replace(cfg, curriculum=list(stages)), batch_size=batch_size, seed=5,
                        max_steps=max_steps)
    dm.prepare_data()
    dm.setup("fit")
    dm.trainer = trainer
    return dm


def test_plan_keeps_tokens_per_step_and_runs_the_last_stage_to_max_steps() -> None:
    stages = plan(STAGES, batch_size=4, seq_len=16, accumulate=2, max_steps=8)
    assert [(s.seq_len, s.batch_size, s.start_step, s.steps) for s in stages] == [
        (8, 8, 0, 2), (16, 4, 2, 3), (32, 2, 5, 3)]
    assert {s.seq_len * s.batch_size for s in stages} == {64}
    assert [stage_at(stages, k).index for k in range(8)] == [0, 0, 1, 1, 1, 2, 2, 2]
    # tokens count per device in whole optimizer steps: 4 x 16 x 2 = 128 per step
    by_tokens = plan([CurriculumStage(seq_len=8, tokens=256), CurriculumStage(seq_len=64, tokens=768)], 4, 16, 2, 8)
    assert [(s.batch_size, s.steps) for s in by_tokens] == [(8, 2), (1, 6)]
    with pytest.raises(ValueError, match="step=8 is not allowed"):
        stage_at(stages, 8)


@pytest.mark.parametrize(("stages", "max_steps", "match"), [
    ([CurriculumStage(seq_len=128)], 4, r"data.curriculum\[0\].seq_len=128 is not allowed: expected <= the tokens of "
                                       r"one micro-batch.*= 64 \(a longer stage would need a batch below 1"),
    ([CurriculumStage(seq_len=24)], 4, r"data.curriculum\[0\].seq_len=24 is not allowed: expected a divisor of "
                                      r"the tokens of one micro-batch"),
    ([CurriculumStage(seq_len=8, tokens=100), CurriculumStage(seq_len=16)], 4,
     r"data.curriculum\[0\].tokens=100 is not allowed: expected a multiple of the tokens per optimizer step.* = 64"),
    ([CurriculumStage(seq_len=8, steps=2), CurriculumStage(seq_len=16, steps=3)], 4,
     r"train.max_steps=4 is not allowed: expected the sum of the curriculum's stages, 2 \+ 3 = 5"),
    ([CurriculumStage(seq_len=8, steps=4), CurriculumStage(seq_len=16)], 4, r"train.max_steps=4 is not allowed: "
                                                                           r"expected > 4"),
])
def test_plan_errors_name_the_stage_and_the_rule(stages, max_steps: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        plan(stages, batch_size=4, seq_len=16, accumulate=1, max_steps=max_steps)


def test_config_refuses_stages_the_model_or_the_run_cannot_take() -> None:
    ok = load_config("tiny", {"train.max_steps": 6, "data.curriculum": [{"seq_len": 32, "steps": 2},
                                                                        {"seq_len": 128, "synthetic": 0.5}]})
    assert ok.data.curriculum[1] == CurriculumStage(seq_len=128, synthetic=0.5)
    cases = {
        r"data.curriculum\[1\].seq_len=256 is not allowed: expected <= model.max_seq_len \(128\)":
            [{"seq_len": 32, "steps": 2}, {"seq_len": 256}],
        r"data.curriculum\[0\].steps=0 is not allowed: expected an integer >= 1 \(or tokens >= 1\): only the last":
            [{"seq_len": 32}, {"seq_len": 64}],
        r"data.curriculum\[0\].tokens=512 is not allowed: expected 0 when data.curriculum\[0\].steps is given":
            [{"seq_len": 32, "steps": 2, "tokens": 512}],
        r"data.curriculum\[0\].seq_len=0 is not allowed": [{"steps": 6}],
        r"data.curriculum\[0\].synthetic=1.5 is not allowed: expected a share in \[0, 1\]":
            [{"seq_len": 32, "synthetic": 1.5}],
        r"data.curriculum\[0\].synthetic_tasks=\['passkey', 'copy'\] is not allowed":
            [{"seq_len": 32, "synthetic_tasks": ["passkey", "copy"]}],
        r"data.curriculum\[0\].seq_len=16 is not allowed: expected >= 31 for MQAR with mqar_pairs=8":
            [{"seq_len": 16, "synthetic": 0.1}],
        r"data.curriculum\[0\].sequence_length=.* unknown key": [{"sequence_length": 32}],
    }
    for match, stages in cases.items():
        with pytest.raises(ConfigError, match=match):
            load_config("tiny", {"train.max_steps": 6, "data.curriculum": stages})


def test_stage_transitions_keep_tokens_per_step(tiny_cfg: DataConfig) -> None:
    for accum in (1, 2):
        dm = _module(tiny_cfg, trainer=_trainer(accum=accum))
        batches = list(dm.train_dataloader())
        assert len(batches) == 8 * accum
        shapes = [tuple(b["input_ids"].shape) for b in batches]
        per_step = [shapes[k * accum: (k + 1) * accum] for k in range(8)]
        assert per_step == [[(8, 8)] * accum] * 2 + [[(4, 16)] * accum] * 3 + [[(2, 32)] * accum] * 3
        for b in batches:
            assert b["input_ids"].numel() == 4 * 16  # the tokens of one micro-batch never change
            assert torch.equal(b["targets"][:, :-1], b["input_ids"][:, 1:])
            assert b["segment_ids"].dtype == torch.int32 and b["segment_ids"].shape == b["input_ids"].shape


def test_resume_mid_stage_gives_the_same_batches_and_ranks_do_not_overlap(tiny_cfg: DataConfig) -> None:
    full = list(_module(tiny_cfg, trainer=_trainer(accum=2)).train_dataloader())
    for step in (1, 3, 6):  # inside stages 0, 1 and 2
        tail = list(_module(tiny_cfg, trainer=_trainer(step=step, accum=2)).train_dataloader())
        assert len(tail) == len(full) - 2 * step
        for a, b in zip(full[2 * step:], tail):
            assert all(torch.equal(a[k], b[k]) for k in a)
    stages = plan(STAGES, 4, 16, 2, 8)
    per_rank = [list(CurriculumSampler(stages, 2, rank=r, world_size=2)) for r in range(2)]
    for m in range(16):
        a, b = set(per_rank[0][m]), set(per_rank[1][m])
        assert len(a) == len(b) == stage_at(stages, m // 2).batch_size and not a & b
    items = [i for r in per_rank for batch in r for i in batch]
    assert len(items) == len(set(items))  # no item is read twice in the whole run


def test_document_packs_keep_document_boundaries(tiny_cfg: DataConfig) -> None:
    dm = _module(tiny_cfg)
    stream = dm._stream("train")
    packer = DocumentPacker(stream)
    starts = set((packer.ends[:-1] + 1).tolist()) | {0}
    for i in range(20):
        ids, seg = packer.pack(3000, np.random.Philox(key=1, counter=i))
        assert ids.shape == seg.shape == (3000,)
        bounds = np.flatnonzero(np.diff(seg)) + 1  # first token of each later document
        assert len(bounds) >= 1  # documents here are ~1100 tokens long
        assert all(ids[b - 1] == EOS_ID for b in bounds)  # each document ends with end-of-text ...
        assert (ids[:-1][np.diff(seg) == 0] != EOS_ID).all()  # ... and holds no other
        for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, 3000]):  # every piece is stream text, documents whole
            piece = ids[lo:hi]
            where = [s for s in starts if np.array_equal(stream[s: s + piece.size], piece)] if lo > 0 else [0]
            assert where, (i, lo)
    again = packer.pack(3000, np.random.Philox(key=1, counter=3))
    assert np.array_equal(again[0], packer.pack(3000, np.random.Philox(key=1, counter=3))[0])
    assert not np.array_equal(again[0], packer.pack(3000, np.random.Philox(key=1, counter=4))[0])


def test_synthetic_share_and_tasks(tiny_cfg: DataConfig) -> None:
    mixed = [CurriculumStage(seq_len=512, synthetic=0.5, mqar_pairs=4)]
    dm = _module(tiny_cfg, stages=mixed, max_steps=40, batch_size=32)  # one sequence per micro-batch
    rows = [(b["input_ids"][0], b["targets"][0], b["segment_ids"][0]) for b in dm.train_dataloader()]
    assert all(not (y == IGNORE).any() or not seg.any() for _, y, seg in rows)  # a sub-task is one segment
    synthetic = [(x, y) for x, y, _ in rows if (y == IGNORE).any()]
    assert 10 <= len(synthetic) <= 30  # 40 draws at p = 0.5
    tok = dm.tokenizer
    kinds = set()
    for x, y in synthetic:
        answers = y[y != IGNORE]
        if "pass key" in tok.decode(x.tolist()):
            kinds.add("passkey")
            assert tok.decode(answers.tolist()).strip() in tok.decode(x.tolist())  # the key was in the context
        else:
            kinds.add("mqar")
            assert len(answers) == 4 and (answers >= dm.vocab_size // 2).all()
    assert kinds == {"passkey", "mqar"}
    only = [CurriculumStage(seq_len=16, synthetic=1.0, synthetic_tasks=["passkey"])]
    with pytest.raises(ConfigError, match=r"data.curriculum\[0\] \(seq_len=16\) cannot hold its passkey sub-task"):
        list(_module(tiny_cfg, stages=only, max_steps=2).train_dataloader())


@pytest.mark.parametrize("document_mask", [True, False])
def test_val_windows_carry_documents_when_the_run_masks_them(tiny_cfg: DataConfig, document_mask: bool) -> None:
    """With a curriculum and ``data.document_mask`` the val windows carry ``segment_ids`` cut after each
    end-of-text id (as the packs' documents end), so validation keeps documents apart as training does."""
    dm = _module(dataclasses.replace(tiny_cfg, seq_len=700, document_mask=document_mask), trainer=_trainer())
    batches = list(dm.val_dataloader())
    if not document_mask:
        assert all("segment_ids" not in b for b in batches)
        return
    seen_boundary = False
    for b in batches:
        ids, seg = b["input_ids"], b["segment_ids"]
        assert seg.dtype == torch.int32 and seg.shape == ids.shape and (seg[:, 0] == 0).all()
        step = torch.diff(seg, dim=1)
        assert ((step == 0) | (step == 1)).all()
        assert torch.equal(step == 1, ids[:, :-1] == EOS_ID)  # a new document right after each end-of-text
        seen_boundary |= bool((step == 1).any())
    assert seen_boundary  # documents here are ~1100 tokens: some 700-token window crosses one
    plain = TextDataModule(tiny_cfg, batch_size=4, seed=5, max_steps=8)  # no curriculum: plain windows
    plain.trainer = _trainer()
    assert all("segment_ids" not in b for b in plain.val_dataloader())


def test_synthetic_batch_share_is_the_same_in_every_micro_batch(tiny_cfg: DataConfig) -> None:
    """``synthetic_batch_share``: every micro-batch of every stage opens with batch_k x share retrieval sequences
    (tasks taking turns), the rest document packs, so each step holds the same share of retrieval tokens."""
    stages = [CurriculumStage(seq_len=256, steps=3, synthetic_batch_share=0.25, mqar_pairs=4),
              CurriculumStage(seq_len=512, synthetic_batch_share=0.25, mqar_pairs=4)]
    dm = _module(dataclasses.replace(tiny_cfg, seq_len=512), stages=stages, max_steps=6,
                 trainer=_trainer(accum=2, max_steps=6), batch_size=4)
    batches = list(dm.train_dataloader())  # 2 micro-batches per step of 8 x 256 or 4 x 512 tokens
    assert len(batches) == 12
    tok, kinds = dm.tokenizer, []
    for b in batches:
        y = b["targets"]
        retrieval = (y == IGNORE).any(dim=1)  # a document pack scores every token; a sub-task its answers only
        B, T = y.shape
        assert retrieval[: B // 4].all() and not retrieval[B // 4:].any()
        assert retrieval.sum().item() * T / y.numel() == 0.25 and B * T == 2048
        kinds += ["passkey" if "pass key" in tok.decode(x.tolist()) else "mqar" for x in b["input_ids"][retrieval]]
    assert kinds.count("passkey") == kinds.count("mqar") == 9  # 3 x 2 x 2 + 3 x 2 x 1 slots, taking turns
    with pytest.raises(ConfigError, match=r"data.curriculum\[1\].synthetic_batch_share=0.3 is not allowed: "
                                          r"expected a multiple of 1/4"):
        plan([CurriculumStage(seq_len=4, steps=1), CurriculumStage(seq_len=4, synthetic_batch_share=0.3)],
             batch_size=1, seq_len=16, accumulate=1, max_steps=2)


def test_synthetic_batch_share_validation_names_value_and_range() -> None:
    with pytest.raises(ConfigError, match=r"data.curriculum\[0\].synthetic_batch_share=1.5 is not allowed: "
                                          r"expected a share in \[0, 1\]"):
        CurriculumStage(seq_len=64, synthetic_batch_share=1.5).validate()
    with pytest.raises(ConfigError, match=r"synthetic_batch_share=0.25 is not allowed: expected 0 when "
                                          r"data.curriculum\[0\].synthetic is given \(0.1\)"):
        CurriculumStage(seq_len=64, synthetic=0.1, synthetic_batch_share=0.25).validate()
    assert CurriculumStage(seq_len=64).synthetic_batch_share == 0.0  # default: the per-sequence draw, as before
    cfg = load_config("tiny", {"data.curriculum": [{"seq_len": 64, "synthetic_batch_share": 0.5}]})
    assert cfg.data.curriculum[0].synthetic_batch_share == 0.5


def test_repeat_task_takes_its_turn_in_the_retrieval_slots(tiny_cfg: DataConfig) -> None:
    """``synthetic_tasks`` with ``"repeat"``: in-context repetition sequences (a corpus span twice, every token a
    target) take turns with passkey and MQAR in the retrieval slots; the default task list stays passkey and MQAR
    (what the committed studies trained on)."""
    assert CurriculumStage(seq_len=64).synthetic_tasks == ["passkey", "mqar"]
    stages = [CurriculumStage(seq_len=256, synthetic_batch_share=0.5, mqar_pairs=4,
                              synthetic_tasks=["passkey", "mqar", "repeat"])]
    dm = _module(dataclasses.replace(tiny_cfg, seq_len=256), stages=stages, max_steps=3,
                 trainer=_trainer(max_steps=3), batch_size=6)
    kinds = []
    for b in dm.train_dataloader():
        for x, y, seg in zip(b["input_ids"][:3], b["targets"][:3], b["segment_ids"][:3]):  # the retrieval slots
            if (y == IGNORE).any():
                kinds.append("passkey" if "pass key" in dm.tokenizer.decode(x.tolist()) else "mqar")
            else:  # a repeat: the second half copies the first, every position scored
                span = (256 + 2) // 2
                assert torch.equal(x[span:], x[: 256 - span]) and (seg == 0).all()
                kinds.append("repeat")
    assert kinds == ["passkey", "mqar", "repeat"] * 3
    with pytest.raises(ConfigError, match=r"synthetic_tasks=\['copy'\] is not allowed: expected a non-empty list "
                                          r"of distinct names from \('passkey', 'mqar', 'repeat'\)"):
        CurriculumStage(seq_len=64, synthetic_tasks=["copy"]).validate()
