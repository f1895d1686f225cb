"""Packed documents in training: ``data.document_mask`` decides whether a batch's ``segment_ids`` reach the model."""

from __future__ import annotations

import pytest
import torch

from moelab.base import ConfigError
from moelab.config import load_config
from moelab.train import LitMoELab


@pytest.mark.parametrize("document_mask", [True, False])
def test_steps_pass_segment_ids_as_configured(document_mask: bool) -> None:
    module = LitMoELab(load_config("tiny", {"data.document_mask": document_mask}))
    seen = []
    real = module.model.forward

    def spy(*args, **kw):
        seen.append(kw.get("segment_ids"))
        return real(*args, **kw)

    module.model.forward = spy
    ids = torch.randint(0, 64, (2, 16))
    seg = torch.tensor([[0] * 5 + [1] * 11, [0] * 16], dtype=torch.int32)
    batch = {"input_ids": ids, "targets": ids.roll(-1, 1), "segment_ids": seg}
    loss = module.training_step(batch, 0)
    module.log = lambda *a, **k: None  # no Trainer to log to
    module.validation_step(batch, 0)
    module.training_step({"input_ids": ids, "targets": ids}, 0)  # plain windows carry none
    assert torch.isfinite(loss)
    assert [s is seg for s in seen] == [document_mask, document_mask, False]
    assert seen[2] is None


def test_document_mask_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="data.document_mask"):
        load_config("tiny", {"data.document_mask": "yes"})
