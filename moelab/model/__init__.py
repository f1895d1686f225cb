"""The moelab model: plain ``torch.nn`` modules, configured by ``moelab.model.config``.

Reading order: ``config`` (every option) -> ``kda`` / ``mla`` (token mixers) -> ``activations`` /
``moe`` (FFNs) -> ``attnres`` (residual modes) -> ``transformer`` (the stack, ``prefill``, ``generate``);
``accounting`` counts parameters and FLOPs from a config without building the model; ``documents``
keeps packed documents apart (``MoELab.forward(..., segment_ids=)``).
"""

from moelab.model.accounting import flops_per_token, param_counts, summary
from moelab.model.config import (
    ConfigError,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    ResidualConfig,
)
from moelab.model.documents import Documents
from moelab.model.kda import KDALayer, KDAState
from moelab.model.mla import MLA
from moelab.model.transformer import ModelOutput, ModelState, MoELab, PrefillChunk, PrefillOutput

__all__ = [
    "ConfigError",
    "Documents",
    "KDAConfig",
    "KDALayer",
    "KDAState",
    "MLA",
    "MLAConfig",
    "ModelConfig",
    "ModelOutput",
    "ModelState",
    "MoEConfig",
    "MoELab",
    "PrefillChunk",
    "PrefillOutput",
    "ResidualConfig",
    "flops_per_token",
    "param_counts",
    "summary",
]
