"""The GPU presets' corpus: data/gutenberg.tar.xz as committed, and the script that built it."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
from pathlib import Path

import pytest

from moelab.data.config import DataConfig
from moelab.data.corpus import ARCHIVES, load_documents

ROOT = Path(__file__).resolve().parents[2]


def _builder():
    spec = importlib.util.spec_from_file_location("build_gutenberg", ROOT / "data" / "build_gutenberg.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_archive_is_the_documented_build() -> None:
    docs = load_documents(DataConfig(source="gutenberg"))
    texts = list(docs.texts(range(len(docs.ids))))
    joined = "".join(texts).encode("utf-8")
    # data/README.md: 187 e-books, 86,130,121 bytes of text, and this hash of the members in name order.
    assert len(docs.ids) == 187 and len(joined) == 86_130_121
    assert hashlib.sha256(joined).hexdigest() == "adf9926ce5120f3c6a422433f972f28a2ec2f0f72dfa223b19954d2ac3391049"
    assert docs.ids == sorted(docs.ids) and all(i.count("/") == 1 for i in docs.ids)
    authors = {_builder().member_name(Path(a) / "x.txt").split("/")[0] for a in _builder().AUTHORS}
    assert {i.split("/")[0] for i in docs.ids} == authors
    assert not any("gutenberg" in t.lower() for t in texts)  # neither licence text nor trademark is carried


def test_a_changed_archive_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rel = ARCHIVES["gutenberg"][0]
    (tmp_path / "data").mkdir()
    shutil.copy(ROOT / rel, tmp_path / rel)
    with open(tmp_path / rel, "ab") as f:
        f.write(b"\0")
    monkeypatch.setenv("MOELAB_ROOT", str(tmp_path))
    with pytest.raises(ValueError, match=r"data/gutenberg.tar.xz has sha256 .* expected 913c6baa"):
        load_documents(DataConfig(source="gutenberg"))
    (tmp_path / rel).unlink()
    with pytest.raises(FileNotFoundError, match="is missing"):
        load_documents(DataConfig(source="gutenberg"))


def test_builder_strips_the_licence_and_drops_duplicates(tmp_path: Path) -> None:
    b = _builder()
    story = " ".join(f"Sentence number {i} of the tale, long enough to be compared." for i in range(800))
    book = ("The Project Gutenberg EBook of A Tale\n\n*** START OF THIS PROJECT GUTENBERG EBOOK A TALE ***\n"
            f"Produced by volunteers of Project Gutenberg.\n{story}\n"
            "*** END OF THIS PROJECT GUTENBERG EBOOK A TALE ***\nThe licence text.\n")
    assert b.body(book) == story + "\n"
    assert b.body(story) is None  # no markers: not taken
    author = tmp_path / b.AUTHORS[0]
    author.mkdir()
    (author / "A Tale.txt").write_text(book)
    half = story[: len(story) // 2]
    assert len(half) > b.MIN_CHARS  # long enough to be kept but for the duplicate check
    (author / "A Tale, Volume 1.txt").write_text(book.replace(story, half))
    (author / "Index.txt").write_text(book.replace(story, "short"))
    other = " ".join(f"Another line {i} of a different book, long enough as well." for i in range(800))
    (author / "Other.txt").write_text(book.replace(story, other))
    docs = b.select(tmp_path)
    assert [name for name, _ in docs] == [f"{b.member_name(author / 'A Tale.txt')}",
                                          f"{b.member_name(author / 'Other.txt')}"]
    out = tmp_path / "g.tar.xz"
    b.write_archive(docs, out)
    first = out.read_bytes()
    b.write_archive(docs, out)
    assert out.read_bytes() == first  # fixed metadata: the same input gives the same bytes
