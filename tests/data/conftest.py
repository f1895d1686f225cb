"""Shared corpora for the data tests: the default Shakespeare cache (built once per session) and a tiny files corpus."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from moelab.data.config import DataConfig
from moelab.data.corpus import PreparedCorpus, prepare

WORDS = ("the king queen night sword crown love death dream storm ghost lord lady fool wine sea "
         "ärger naïve café über 東京 ✓").split()


@pytest.fixture(scope="session")
def shakespeare_cfg(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def shakespeare(shakespeare_cfg: DataConfig) -> PreparedCorpus:
    return prepare(shakespeare_cfg, progress=False)


def write_tiny_corpus(root: Path, n_docs: int = 8, words_per_doc: int = 400, seed: int = 0) -> list[Path]:
    """``n_docs`` UTF-8 files of random sentences (with non-ASCII words) under ``root``."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in range(n_docs):
        words = [rng.choice(WORDS) for _ in range(words_per_doc)]
        text = " ".join(words).replace(" the ", ".\nThe ") + "\n"
        path = root / f"doc{d:02d}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture
def tiny_cfg(tmp_path: Path) -> DataConfig:
    write_tiny_corpus(tmp_path / "corpus")
    return DataConfig(source="files", files=[str(tmp_path / "corpus" / "*.txt")], vocab_size=300, seq_len=16,
                      val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
