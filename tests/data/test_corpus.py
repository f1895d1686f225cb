"""prepare(): the default Shakespeare cache, a tiny files corpus and a local datasets corpus.

Checked: counts, dtype, a document-level split that is disjoint and complete, token streams that
decode back to exactly the split's documents, deterministic rebuilds, hash verification and
rebuild of a corrupt cache, and cache keys.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moelab.data.config import DataConfig
from moelab.data.corpus import PreparedCorpus, load_documents, prepare, split_documents
from moelab.data.tokenizer import EOS_ID
from moelab.model.config import ConfigError

from .conftest import write_tiny_corpus


def _split_ids(p: PreparedCorpus) -> dict[str, list[str]]:
    return json.loads((p.cache_dir / "split.json").read_text())


def _expected_stream_text(cfg: DataConfig, p: PreparedCorpus, split: str) -> str:
    """The split's documents, each followed by the end-of-text marker, as decoding must give back."""
    docs = load_documents(cfg)
    eot = p.tokenizer().decode([EOS_ID])
    wanted = set(_split_ids(p)[split])
    idx = [i for i, d in enumerate(docs.ids) if d in wanted]
    return "".join(text + eot for text in docs.texts(idx))


def test_shakespeare_default(shakespeare_cfg: DataConfig, shakespeare: PreparedCorpus) -> None:
    p, m = shakespeare, shakespeare.manifest
    assert p.vocab_size == 4096 and p.tokenizer().vocab_size == 4096
    assert m["counts"]["train"]["documents"] == 40 and m["counts"]["val"]["documents"] == 2
    assert m["tokenizer"]["dtype"] == "uint16"
    train, val = p.load_tokens("train"), p.load_tokens("val")
    assert train.dtype == np.uint16 and train.shape == (p.n_train_tokens,) and val.shape == (p.n_val_tokens,)
    assert 1_000_000 < p.n_train_tokens < 2_500_000 and 30_000 < p.n_val_tokens
    # one end-of-text per document, closing the stream
    assert int((train == EOS_ID).sum()) == 40 and int((val == EOS_ID).sum()) == 2 and val[-1] == EOS_ID
    assert int(train.max()) < p.vocab_size
    assert set(m["files"]) >= {"tokenizer.json", "split.json", "train/data-00000-of-00001.arrow",
                               "val/data-00000-of-00001.arrow"}
    assert m["versions"]["pyarrow"] and "datasets" not in m["versions"] and m["config"]["source"] == "shakespeare"


def test_shakespeare_split_and_round_trip(shakespeare_cfg: DataConfig, shakespeare: PreparedCorpus) -> None:
    ids = _split_ids(shakespeare)
    assert not set(ids["train"]) & set(ids["val"])
    assert len(set(ids["train"]) | set(ids["val"])) == 42
    assert "hamlet_gut" in ids["train"] + ids["val"]
    tok = shakespeare.tokenizer()
    # the val stream is exactly the held-out plays (decoding a whole stream is lossless)
    assert tok.decode(shakespeare.load_tokens("val")) == _expected_stream_text(shakespeare_cfg, shakespeare, "val")


def test_shakespeare_rebuild_is_deterministic(tmp_path: Path, shakespeare: PreparedCorpus) -> None:
    again = prepare(DataConfig(cache_dir=str(tmp_path)), progress=False)
    assert again.cache_dir.name == shakespeare.cache_dir.name  # same key
    assert again.manifest["files"] == shakespeare.manifest["files"]  # same sha256 for every file
    for split in ("train", "val"):
        np.testing.assert_array_equal(again.load_tokens(split), shakespeare.load_tokens(split))


def test_reuse_verifies_silently(shakespeare_cfg: DataConfig, shakespeare: PreparedCorpus,
                                 capsys: pytest.CaptureFixture) -> None:
    mtime = (shakespeare.cache_dir / "manifest.json").stat().st_mtime_ns
    again = prepare(shakespeare_cfg)
    assert again.cache_dir == shakespeare.cache_dir and again.manifest == shakespeare.manifest
    assert (shakespeare.cache_dir / "manifest.json").stat().st_mtime_ns == mtime  # not rebuilt
    assert capsys.readouterr().err == ""


def test_files_corpus_round_trip(tiny_cfg: DataConfig, capsys: pytest.CaptureFixture) -> None:
    p = prepare(tiny_cfg)
    err = capsys.readouterr().err
    assert "building files-bpe300-" in err and "cache ready" in err  # progress=True reports the stages
    ids = _split_ids(p)
    assert len(ids["train"]) == 6 and len(ids["val"]) == 2 and not set(ids["train"]) & set(ids["val"])
    assert all(i.endswith(".txt") for i in ids["train"])
    tok = p.tokenizer()
    for split in ("train", "val"):
        assert tok.decode(p.load_tokens(split)) == _expected_stream_text(tiny_cfg, p, split)
    text = "the naïve queen dreams of 東京 ✓"
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_corpus(tiny_cfg: DataConfig) -> None:
    tiny_cfg.tokenizer = "byte"
    p = prepare(tiny_cfg, progress=False)
    assert p.vocab_size == 256 and p.cache_dir.name.startswith("files-byte256-")
    docs = load_documents(tiny_cfg)
    n_bytes = sum(len(t.encode()) for t in docs.texts(range(len(docs.ids))))
    assert p.n_train_tokens + p.n_val_tokens == n_bytes + len(docs.ids)  # bytes + one end-of-text per doc


@pytest.mark.parametrize("damage", ["flip_byte", "delete_file", "truncate_manifest"])
def test_corrupt_cache_is_rebuilt(tiny_cfg: DataConfig, damage: str, capsys: pytest.CaptureFixture) -> None:
    first = prepare(tiny_cfg, progress=False)
    tokens = first.load_tokens("train").copy()
    arrow = first.cache_dir / "train" / "data-00000-of-00001.arrow"
    if damage == "flip_byte":
        data = bytearray(arrow.read_bytes())
        data[len(data) // 2] ^= 0xFF
        arrow.write_bytes(bytes(data))
        reason = "train/data-00000-of-00001.arrow has sha256"
    elif damage == "delete_file":
        (first.cache_dir / "tokenizer.json").unlink()
        reason = "tokenizer.json is missing"
    else:
        (first.cache_dir / "manifest.json").write_text("{\"files\": ")
        reason = "manifest.json is unreadable"
    capsys.readouterr()
    second = prepare(tiny_cfg, progress=False)
    err = capsys.readouterr().err
    assert "is invalid" in err and reason in err and "rebuilding" in err
    assert second.manifest["files"] == first.manifest["files"]
    np.testing.assert_array_equal(second.load_tokens("train"), tokens)
    # nothing left behind from the build or the replaced cache
    assert sorted(x.name for x in second.cache_dir.parent.iterdir()) == [second.cache_dir.name]


def test_force_rebuilds(tiny_cfg: DataConfig, capsys: pytest.CaptureFixture) -> None:
    first = prepare(tiny_cfg, progress=False)
    second = prepare(tiny_cfg, force=True)
    assert "force=True" in capsys.readouterr().err
    assert second.manifest["files"] == first.manifest["files"]


def test_cache_key(tiny_cfg: DataConfig, tmp_path: Path) -> None:
    base = prepare(tiny_cfg, progress=False).cache_dir.name
    tiny_cfg.seq_len, tiny_cfg.num_workers = 512, 2  # do not change the streams
    assert prepare(tiny_cfg, progress=False).cache_dir.name == base
    tiny_cfg.split_seed = 99
    assert prepare(tiny_cfg, progress=False).cache_dir.name != base
    tiny_cfg.split_seed = 1234
    (tmp_path / "corpus" / "doc00.txt").write_text("new content of the first document\n")
    assert prepare(tiny_cfg, progress=False).cache_dir.name != base  # keyed by file content


def test_split_documents() -> None:
    ids = [f"doc{i}" for i in range(100)]
    train, val = split_documents(ids, 0.1, seed=3)
    assert len(val) == 10 and sorted(train + val) == list(range(100))
    # independent of listing order: the same ids land in val
    rev_train, rev_val = split_documents(ids[::-1], 0.1, seed=3)
    assert {ids[::-1][i] for i in rev_val} == {ids[i] for i in val}
    assert split_documents(ids, 0.1, seed=4)[1] != val
    assert len(split_documents(ids[:3], 0.01, seed=0)[1]) == 1  # at least one val document
    assert len(split_documents(ids[:3], 0.99, seed=0)[0]) == 1  # at least one train document


def test_unusable_inputs(tmp_path: Path) -> None:
    write_tiny_corpus(tmp_path / "one", n_docs=1)
    with pytest.raises(ConfigError, match="needs at least 2"):
        prepare(DataConfig(source="files", files=[str(tmp_path / "one" / "*.txt")], cache_dir=str(tmp_path / "c")),
                progress=False)
    with pytest.raises(ConfigError, match=r"data.files pattern .*matches no file"):
        prepare(DataConfig(source="files", files=[str(tmp_path / "none" / "*.txt")], cache_dir=str(tmp_path / "c")),
                progress=False)


def test_hf_source_with_local_text_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub path, served by datasets' own "text" builder over local files (no network)."""
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    paths = write_tiny_corpus(tmp_path / "hf", n_docs=10, words_per_doc=100)
    real_load = datasets.load_dataset
    calls = []

    def local_load(name: str, config: str | None = None, split: str | None = None, **kwargs):
        calls.append((name, config, split))
        return real_load("text", data_files={"train": [str(p) for p in paths]}, sample_by="document",
                         split=split, cache_dir=str(tmp_path / "hf_cache"))

    monkeypatch.setattr(datasets, "load_dataset", local_load)
    cfg = DataConfig(source="hf", hf_name="someone/tiny-stories", hf_config="", hf_split="train", vocab_size=300,
                     val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    p = prepare(cfg, progress=False)
    assert calls[0] == ("someone/tiny-stories", None, "train")
    ids = _split_ids(p)
    assert sorted(ids["train"] + ids["val"], key=int) == [str(i) for i in range(10)] and len(ids["val"]) == 2
    texts = [x.read_text() for x in paths]  # "text" builder keeps file order: row i is file i
    eot = p.tokenizer().decode([EOS_ID])
    assert p.tokenizer().decode(p.load_tokens("val")) == "".join(texts[int(i)] + eot for i in ids["val"])
    with pytest.raises(ConfigError, match="data.text_field='story'"):
        prepare(DataConfig(**{**cfg.__dict__, "text_field": "story"}), progress=False)


def test_archive_stream_encodes_whole_documents_in_a_seeded_order() -> None:
    from moelab.data.corpus import _archive_documents, archive_stream
    from moelab.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    docs = _archive_documents("shakespeare")
    texts = dict(zip(docs.ids, docs.texts(range(len(docs.ids)))))
    ids, names = archive_stream("shakespeare", tok, min_tokens=200_000, seed=3)
    assert ids.dtype == np.int32 and int(ids.max()) < tok.vocab_size
    # the named plays, each closed by end-of-text, and no more than min_tokens needs
    assert tok.decode(ids.tolist()) == "".join(texts[n] + "\x00" for n in names)
    sizes = [len(texts[n].encode("utf-8")) + 1 for n in names]
    assert sum(sizes) >= 200_000 > sum(sizes[:-1]) and len(names) > 1
    again, same = archive_stream("shakespeare", tok, 200_000, seed=3)
    assert same == names and np.array_equal(again, ids)
    assert archive_stream("shakespeare", tok, 200_000, seed=4)[1][0] != names[0]  # another seed, another order
    everything, all_names = archive_stream("shakespeare", tok, 10**9)  # more than the corpus: all of it
    assert sorted(all_names) == sorted(docs.ids) and everything.size == sum(len(t.encode()) + 1 for t in texts.values())
    with pytest.raises(ValueError, match="committed archives"):
        archive_stream("files", tok, 10)


def test_processes_preparing_one_corpus_at_once_build_it_once(tiny_cfg: DataConfig, tmp_path: Path) -> None:
    """A split call's jobs (or DDP ranks) preparing the same corpus: one builds, the others wait and read its build."""
    import subprocess
    import sys
    from dataclasses import asdict

    script = ("import json, sys; from moelab.data import DataConfig, prepare; "
              "c = prepare(DataConfig(**json.loads(sys.argv[1]))); print('ROOT', c.cache_dir)")
    procs = [subprocess.Popen([sys.executable, "-c", script, json.dumps(asdict(tiny_cfg))], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    builds = sum(err.count("building ") for _, err in outs)
    assert builds == 1, [err for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1  # every process got the same cache
    assert len(list(Path(tiny_cfg.cache_dir).glob(".tmp-*"))) == 0
