"""Build ``data/gutenberg.tar.xz``, the GPU presets' corpus, from a snapshot of Project Gutenberg texts.

Source: the GitHub repository ``rcdm-uga/Gutenberg_Text`` (University of Georgia, Digital
Humanities; plain-text Project Gutenberg e-books, one folder per author) at commit
``a0b16d35a9851168ce9ac649851c17b7ab08d48e``. Only the folders in ``AUTHORS`` are taken: seven
English-language authors who died by 1891, about 107 MB of e-books.

For each ``.txt`` file, in path order:

1. keep the text between Project Gutenberg's start and end markers (a file without both is
   dropped), then drop every line that still names Project Gutenberg, so that neither its licence
   text nor its trademark is redistributed;
2. drop bodies under ``MIN_CHARS`` (indexes, illustration lists);
3. drop near-duplicates (other editions, single volumes of a kept whole, anthologies that repeat
   a kept story): a document goes when more than ``DUP_SHARE`` of its sentences, compared after
   collapsing whitespace and case, are already in a longer document kept before it.

Members are written as ``<author>/<title>.txt`` (ASCII-safe names) into an xz tar with fixed
metadata, so the same input gives the same archive bytes.

    git clone https://github.com/rcdm-uga/Gutenberg_Text && git -C Gutenberg_Text checkout a0b16d3
    python data/build_gutenberg.py Gutenberg_Text data/gutenberg.tar.xz
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import sys
import tarfile
import unicodedata
from pathlib import Path

SOURCE_COMMIT = "a0b16d35a9851168ce9ac649851c17b7ab08d48e"
AUTHORS = ("Austen, Jane", "Dickens, Charles", "Hawthorne, Nathaniel", "Irving, Washington", "Melville, Herman",
           "Poe, Edgar Allan", "Thoreau, Henry David")
MIN_CHARS = 20_000
DUP_SHARE = 0.3
_START = re.compile(r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$",
                    re.IGNORECASE | re.MULTILINE)
_END = re.compile(r"^\s*\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\s*End of (?:the )?Project Gutenberg.*$",
                  re.IGNORECASE | re.MULTILINE)
_SENTENCE = re.compile(r"[^.!?]{40,}[.!?]")


def body(text: str) -> str | None:
    """The e-book's text without Gutenberg's header, footer and mentions; None without both markers."""
    starts = list(_START.finditer(text))
    if not starts:
        return None
    start = starts[-1].end()
    end = _END.search(text, start)
    if end is None:
        return None
    lines = [ln for ln in text[start:end.start()].splitlines() if "gutenberg" not in ln.lower()]
    return "\n".join(lines).strip() + "\n"


def sentences(text: str) -> set[str]:
    """Normalized sentences of 40+ characters (whitespace collapsed, lower case): the duplicate check's units."""
    flat = re.sub(r"\s+", " ", text).lower()
    return {m.group(0).strip() for m in _SENTENCE.finditer(flat)}


def member_name(path: Path) -> str:
    """``Author_Name/Title.txt`` in ASCII letters, digits, ``_`` and ``-``."""
    def slug(s: str) -> str:
        s = unicodedata.normalize("NFKD", s).encode("ascii", "ignore").decode()
        return re.sub(r"[^A-Za-z0-9]+", "_", s).strip("_")[:80]

    return f"{slug(path.parent.name)}/{slug(path.stem)}.txt"


def select(root: Path) -> list[tuple[str, str]]:
    """``[(member name, text)]`` of the kept documents, sorted by name."""
    docs = []
    for author in AUTHORS:
        for path in sorted((root / author).glob("*.txt")):
            text = body(path.read_bytes().decode("utf-8", errors="replace"))
            if text is not None and len(text) >= MIN_CHARS:
                docs.append((member_name(path), text))
    kept: list[tuple[str, str]] = []
    seen: set[str] = set()
    for name, text in sorted(docs, key=lambda d: (-len(d[1]), d[0])):
        sents = sentences(text)
        if sents and len(sents & seen) / len(sents) > DUP_SHARE:
            continue
        kept.append((name, text))
        seen |= sents
    names = [n for n, _ in kept]
    if len(set(names)) != len(names):
        raise ValueError("two kept documents map to the same member name")
    return sorted(kept)


def write_archive(docs: list[tuple[str, str]], out: Path) -> None:
    """An xz tar of ``docs`` with fixed metadata (mtime 0, uid/gid 0, mode 0644)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, text in docs:
            data = text.encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
    import lzma

    out.write_bytes(lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path, help=f"checkout of rcdm-uga/Gutenberg_Text at {SOURCE_COMMIT[:7]}")
    p.add_argument("out", type=Path, help="the archive to write, e.g. data/gutenberg.tar.xz")
    args = p.parse_args(argv)
    missing = [a for a in AUTHORS if not (args.source / a).is_dir()]
    if missing:
        print(f"error: {args.source} has no folder {missing}: expected a checkout of rcdm-uga/Gutenberg_Text",
              file=sys.stderr)
        return 2
    docs = select(args.source)
    write_archive(docs, args.out)
    joined = "".join(text for _, text in docs).encode("utf-8")
    print(f"{len(docs)} documents, {len(joined):,} bytes of text; {args.out}: {args.out.stat().st_size:,} bytes")
    print(f"archive sha256 {hashlib.sha256(args.out.read_bytes()).hexdigest()}")
    print(f"members (name order, concatenated) sha256 {hashlib.sha256(joined).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
