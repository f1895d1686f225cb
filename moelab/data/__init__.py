"""Data: the offline default corpus, tokenizers, a verified token cache, and the Lightning DataModule.

``prepare(DataConfig())`` turns the committed Shakespeare archive into cached train/val token
streams; ``TextDataModule`` serves them as ``[B, T]`` windows that resume exactly. The DataModule
is imported lazily so that corpus preparation does not pull in Lightning.
"""

from moelab.base import repo_root
from moelab.data.config import CurriculumStage, DataConfig, resolve_path
from moelab.data.corpus import PreparedCorpus, prepare
from moelab.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["CurriculumStage", "DataConfig", "PreparedCorpus", "TextDataModule", "Tokenizer", "load_tokenizer",
           "prepare", "repo_root", "resolve_path"]


def __getattr__(name: str):
    if name == "TextDataModule":
        from moelab.data.datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module 'moelab.data' has no attribute {name!r}")
