"""DataConfig.validate: defaults pass; each bad value raises ConfigError naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab.data.config import DataConfig, repo_root, resolve_path
from moelab.data.corpus import prepare
from moelab.model.config import ConfigError


def test_defaults_are_valid() -> None:
    cfg = DataConfig()
    assert cfg.validate() is cfg
    assert cfg.effective_vocab_size == 4096
    assert DataConfig(tokenizer="byte", vocab_size=7).validate().effective_vocab_size == 256  # vocab ignored


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"source": "web"}, "data.source"),
        ({"tokenizer": "wordpiece"}, "data.tokenizer"),
        ({"vocab_size": 100}, "data.vocab_size"),
        ({"vocab_size": 4096.0}, "data.vocab_size"),
        ({"seq_len": 0}, "data.seq_len"),
        ({"val_fraction": 0.0}, "data.val_fraction"),
        ({"val_fraction": 1.0}, "data.val_fraction"),
        ({"split_seed": -1}, "data.split_seed"),
        ({"num_workers": -2}, "data.num_workers"),
        ({"cache_dir": ""}, "data.cache_dir"),
        ({"source": "files"}, "data.files"),
        ({"files": "corpus/*.txt"}, "data.files"),
        ({"source": "hf"}, "data.hf_name"),
        ({"source": "hf", "hf_name": "x/y", "text_field": ""}, "data.text_field"),
    ],
)
def test_bad_values_name_the_field(overrides: dict, field: str) -> None:
    cfg = DataConfig(**overrides)
    with pytest.raises(ConfigError, match=rf"^{field}=") as err:
        cfg.validate()
    assert "expected" in str(err.value)
    with pytest.raises(ConfigError, match=field):  # prepare validates before touching anything
        prepare(cfg, progress=False)


def test_repo_root_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MOELAB_ROOT", raising=False)
    assert (repo_root() / "moelab" / "data" / "config.py").is_file()
    assert (repo_root() / "data" / "shakespeare.tar.xz").is_file()
    monkeypatch.setenv("MOELAB_ROOT", str(tmp_path))
    assert repo_root() == tmp_path.resolve()
    assert resolve_path("data/cache") == tmp_path.resolve() / "data" / "cache"
    assert resolve_path("/abs/dir") == Path("/abs/dir")
