"""Corpus preparation: documents -> train/val split -> tokenizer -> cached token streams.

``prepare(cfg)`` builds once, then reuses, a cache directory named after a hash of every config
field that changes its content (source and its content hash, tokenizer, vocab size, split)::

    <cache_dir>/<source>-<tokenizer><vocab>-<key>/
        manifest.json     config, counts, versions, sha256 of every other file
        tokenizer.json    the trained BPE (tokenizers JSON) or the byte tokenizer's stub
        split.json        document ids of each split
        train/, val/      the layout of datasets.save_to_disk (Arrow stream data-00000-of-00001.arrow,
                          state.json, dataset_info.json), written and read with pyarrow alone: one
                          column "ids", one token per row, uint16 (vocab <= 65536) or int32;
                          documents joined by end-of-text (id 0)

Every reuse re-hashes the files against the manifest; a missing or corrupt cache is reported on
stderr and rebuilt. A build happens in a temporary sibling directory that is renamed into place
only when complete, so an interrupted build never leaves a half cache behind and concurrent
builders (DDP ranks) cannot corrupt each other.

:func:`archive_stream` encodes part of a committed corpus with a given tokenizer, uncached: text a
run was not trained on, under the run's own tokenizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from glob import glob
from pathlib import Path

import numpy as np

from moelab.base import ConfigError, repo_root
from moelab.data.config import DataConfig, resolve_path
from moelab.data.tokenizer import EOS_ID, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe
from moelab.utils import write_json

FORMAT_VERSION = 1
# Corpora committed under data/ (see data/README.md): source name -> (archive, its sha256). The hash
# is checked on every read, so a truncated checkout or a Git LFS pointer fails with a clear error.
ARCHIVES = {
    "shakespeare": ("data/shakespeare.tar.xz", "ab195c685df602af65f474529b1c1c3d405609aa916a3f54743e09ca02954b2e"),
    "gutenberg": ("data/gutenberg.tar.xz", "913c6baa84bddd4bf87e27e329b24c4443a746271155ac5eaaff384f04a54e5e"),
}
SPLITS = ("train", "val")
_ENCODE_BATCH = 1000  # documents per tokenizer call: bounds memory on large hub datasets


@dataclass
class Documents:
    """The corpus before tokenization.

    ``ids[i]`` names document i stably (archive member, file path, or hub row index); the split
    is a function of these ids, so it does not depend on the order documents are listed in.
    ``texts(indices)`` yields the documents' strings in the order of ``indices``.
    """

    ids: list[str]
    texts: Callable[[Sequence[int]], Iterator[str]]
    info: dict


@dataclass
class PreparedCorpus:
    """A verified cache directory and what it holds."""

    cache_dir: Path
    tokenizer_path: Path
    vocab_size: int  # ids actually in the tokenizer (a tiny corpus may give fewer than asked)
    n_train_tokens: int
    n_val_tokens: int
    manifest: dict

    def load_tokens(self, split: str) -> np.ndarray:
        """The ``split`` ("train" | "val") token stream, ``[N]`` uint16 or int32, documents joined by id 0."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not allowed: expected one of {SPLITS}")
        import pyarrow as pa

        with pa.memory_map(str(self.cache_dir / split / ARROW_FILE)) as source:
            return pa.ipc.open_stream(source).read_all().column("ids").to_numpy()

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the streams were encoded with."""
        return load_tokenizer(self.tokenizer_path)


def prepare(cfg: DataConfig, force: bool = False, progress: bool = True) -> PreparedCorpus:
    """Return the cache for ``cfg``, building it if missing, corrupt, or ``force``.

    ``progress`` prints build stages and timings to stderr; problems with an existing cache are
    printed whatever its value.
    """
    cfg.validate()
    log = _logger(progress)
    key_fields = cache_key_fields(cfg)
    key = _sha256_json(key_fields)[:16]
    vocab = cfg.effective_vocab_size
    root = resolve_path(cfg.cache_dir)
    final = root / f"{cfg.source}-{cfg.tokenizer}{vocab}-{key}"

    if final.exists() and not force:
        manifest, problem = _verify(final, key)
        if manifest is not None:
            return _prepared(final, manifest)
        _warn(f"cache {final} is invalid ({problem}); rebuilding it")
    elif force and final.exists():
        log(f"force=True: rebuilding {final}")

    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root):
        # processes preparing the same corpus at once (a split call's jobs, DDP ranks): one builds, the rest wait
        # for it here and find its build
        built = final.exists() and not force and _verify(final, key)[0] is not None
        if not built:
            _build(cfg, key, key_fields, final, log)
    manifest, problem = _verify(final, key)
    if manifest is None:
        raise RuntimeError(f"cache {final} failed verification right after it was built: {problem}")
    return _prepared(final, manifest)


def cache_key_fields(cfg: DataConfig) -> dict:
    """Everything the cache content depends on; its hash names the cache directory.

    ``seq_len``, ``num_workers`` and ``cache_dir`` are left out: they do not change the streams.
    For ``hf`` the hub coordinates stand for the content (the dataset is not downloaded to key it).
    """
    fields: dict = {"format": FORMAT_VERSION, "source": cfg.source, "tokenizer": cfg.tokenizer,
                    "vocab_size": cfg.effective_vocab_size, "val_fraction": float(cfg.val_fraction),
                    "split_seed": cfg.split_seed}
    if cfg.source in ARCHIVES:
        fields["content_sha256"] = _sha256_file(_archive(cfg.source))
    elif cfg.source == "files":
        paths = _match_files(cfg.files)
        fields["content_sha256"] = _sha256_json({_doc_id(p): _sha256_file(p) for p in paths})
    else:
        fields.update(hf_name=cfg.hf_name, hf_config=cfg.hf_config, hf_split=cfg.hf_split,
                      text_field=cfg.text_field)
    return fields


def load_documents(cfg: DataConfig) -> Documents:
    """Read the documents of ``cfg.source`` (see :class:`moelab.data.config.DataConfig`)."""
    if cfg.source in ARCHIVES:
        return _archive_documents(cfg.source)
    if cfg.source == "files":
        return _file_documents(cfg.files)
    return _hf_documents(cfg)


def split_documents(ids: Sequence[str], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic document-level split: ``(train_indices, val_indices)``, both sorted.

    Documents are ranked by a hash of ``(seed, id)``; the first ``round(val_fraction * n)``
    (at least 1, at most n - 1) go to validation. Adding or reordering documents never moves
    the others between splits beyond the change in the validation count.
    """
    n = len(ids)
    if n < 2:
        raise ConfigError(f"the corpus has {n} document(s): a document-level train/val split needs at least 2 "
                          "(split a single file into several, or add files)")
    n_val = min(max(1, round(val_fraction * n)), n - 1)
    rank = sorted(range(n), key=lambda i: hashlib.blake2b(f"{seed}\0{ids[i]}".encode(), digest_size=8).digest())
    return sorted(rank[n_val:]), sorted(rank[:n_val])


# ---------------------------------------------------------------------------------------- sources


def _archive(source: str) -> Path:
    """The committed archive of ``source``, after checking its sha256 against ``ARCHIVES``."""
    rel, sha = ARCHIVES[source]
    path = resolve_path(rel)
    if not path.is_file():
        raise FileNotFoundError(f"the corpus archive {path} is missing: run from a moelab checkout or set "
                                f"MOELAB_ROOT to one (current root: {repo_root()})")
    actual = _sha256_file(path)
    if actual != sha:
        raise ConfigError(f"the corpus archive {path} is damaged: sha256 {actual[:16]}..., expected {sha[:16]}...; "
                          f"restore it with git checkout -- {rel} (data/README.md says how it was built; a Git LFS "
                          "pointer or a partial checkout gives a different file)")
    return path


def _archive_documents(source: str) -> Documents:
    """One document per ``.txt`` member. Ids: the file stem for shakespeare (as its split was
    first defined), the member path without ``.txt`` (``Author/Title``) for the others."""
    path = _archive(source)
    try:
        with tarfile.open(path, mode="r:xz") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")),
                             key=lambda m: m.name)
            texts = [tar.extractfile(m).read().decode("utf-8") for m in members]
    except (tarfile.TarError, EOFError, lzma.LZMAError) as e:
        raise ConfigError(f"the corpus archive {path} is damaged ({type(e).__name__}: {e}): restore it with "
                          f"git checkout -- {ARCHIVES[source][0]}") from e
    ids = [Path(m.name).stem if source == "shakespeare" else m.name.removesuffix(".txt") for m in members]
    return Documents(ids=ids, texts=lambda idx: (texts[i] for i in idx),
                     info={"archive": ARCHIVES[source][0], "archive_sha256": ARCHIVES[source][1]})


def archive_stream(source: str, tokenizer: Tokenizer, min_tokens: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """A committed corpus encoded with ``tokenizer``: whole documents in a seeded order until ``min_tokens``.

    For text a model was not trained on under the tokenizer it was trained with (study 2's shift
    test continues a ``gutenberg`` run on ``shakespeare`` and vice versa). The documents of the
    archive ``source`` (a key of ``ARCHIVES``, both splits) are taken in a random order fixed by
    ``seed`` and encoded one at a time, each followed by end-of-text as in the cached streams, until
    the stream holds at least ``min_tokens`` ids; a corpus that runs out first gives all its documents.

    Returns (ids ``[N]`` int32, every id below ``tokenizer.vocab_size``; the documents' ids in stream order).
    """
    if source not in ARCHIVES:
        raise ValueError(f"source={source!r} is not allowed: expected one of the committed archives {tuple(ARCHIVES)}")
    if min_tokens < 1:
        raise ValueError(f"archive_stream: min_tokens must be >= 1, got {min_tokens}")
    docs = _archive_documents(source)
    order = np.random.default_rng(seed).permutation(len(docs.ids)).tolist()
    parts: list[np.ndarray] = []
    names: list[str] = []
    n = 0
    for i in order:
        part, _ = _encode_stream(tokenizer, docs.texts([i]), np.int32)
        parts.append(part)
        names.append(docs.ids[i])
        n += part.size
        if n >= min_tokens:
            break
    return np.concatenate(parts), names


def _match_files(patterns: Sequence[str]) -> list[Path]:
    paths: set[Path] = set()
    for pattern in patterns:
        matched = [Path(p) for p in glob(str(resolve_path(pattern)), recursive=True)]
        matched = [p.resolve() for p in matched if p.is_file()]
        if not matched:
            raise ConfigError(f"data.files pattern {pattern!r} matches no file (relative patterns start at "
                              f"{repo_root()})")
        paths.update(matched)
    return sorted(paths)


def _doc_id(path: Path) -> str:
    """Path relative to the repo root when inside it, so ids (and the split) survive a moved checkout."""
    try:
        return path.relative_to(repo_root()).as_posix()
    except ValueError:
        return path.as_posix()


def _file_documents(patterns: Sequence[str]) -> Documents:
    paths = _match_files(patterns)

    def texts(idx: Sequence[int]) -> Iterator[str]:
        for i in idx:
            try:
                yield paths[i].read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{paths[i]} is not UTF-8 text ({e})") from e

    return Documents(ids=[_doc_id(p) for p in paths], texts=texts, info={"n_files": len(paths)})


def _hf_documents(cfg: DataConfig) -> Documents:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(f"data.source={cfg.source!r} reads a Hugging Face hub dataset, which needs the datasets "
                          f"package: pip install datasets (or the lab extra, pip install 'moelab[lab]')") from e

    ds = datasets.load_dataset(cfg.hf_name, cfg.hf_config or None, split=cfg.hf_split)
    if cfg.text_field not in ds.column_names:
        raise ConfigError(f"data.text_field={cfg.text_field!r} is not allowed: expected one of the columns "
                          f"of {cfg.hf_name!r}: {ds.column_names}")
    ds = ds.select_columns([cfg.text_field])

    def texts(idx: Sequence[int]) -> Iterator[str]:
        sub = ds.select(idx)
        for batch in sub.iter(batch_size=_ENCODE_BATCH):
            yield from batch[cfg.text_field]

    return Documents(ids=[str(i) for i in range(len(ds))], texts=texts,
                     info={"hf_fingerprint": getattr(ds, "_fingerprint", None), "n_rows": len(ds)})


# ----------------------------------------------------------------------------------------- build


@contextlib.contextmanager
def _build_lock(root: Path) -> Iterator[None]:
    """An exclusive lock on the cache folder ``root`` for the block (``fcntl.flock`` on the folder itself: no lock
    file left behind, released when the process ends however it ends; builds into one folder take turns); where
    fcntl is missing (Windows) no lock, and concurrent builds publish one of identical copies."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _build(cfg: DataConfig, key: str, key_fields: dict, final: Path, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        docs = load_documents(cfg)
        train_idx, val_idx = split_documents(docs.ids, cfg.val_fraction, cfg.split_seed)
        log(f"building {final.name}: {len(train_idx)} train / {len(val_idx)} val documents")

        t = time.perf_counter()
        if cfg.tokenizer == "bpe":
            tok: Tokenizer = train_bpe(docs.texts(train_idx), cfg.vocab_size, length=len(train_idx))
        else:
            tok = ByteTokenizer()
        tok.save(tmp / "tokenizer.json")
        log(f"{cfg.tokenizer} tokenizer: {tok.vocab_size} ids in {time.perf_counter() - t:.2f} s")

        dtype = np.uint16 if tok.vocab_size <= 2**16 else np.int32
        counts: dict = {}
        for split, idx in zip(SPLITS, (train_idx, val_idx)):
            t = time.perf_counter()
            stream, n_chars = _encode_stream(tok, docs.texts(idx), dtype)
            _save_stream(stream, tmp / split)
            counts[split] = {"documents": len(idx), "chars": n_chars, "tokens": int(stream.size)}
            log(f"{split}: {stream.size:,} tokens from {n_chars:,} chars in {time.perf_counter() - t:.2f} s")

        write_json(tmp / "split.json", {s: [docs.ids[i] for i in idx] for s, idx in zip(SPLITS, (train_idx, val_idx))})
        manifest = {
            "format": FORMAT_VERSION,
            "key": key,
            "key_fields": key_fields,
            "config": asdict(cfg),
            "source_info": docs.info,
            "tokenizer": {"kind": tok.kind, "vocab_size": tok.vocab_size, "eos_id": EOS_ID,
                          "dtype": np.dtype(dtype).name},
            "counts": counts,
            "files": {p.relative_to(tmp).as_posix(): _sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()},
            "versions": _versions(),
            "build_seconds": round(time.perf_counter() - t0, 3),
        }
        write_json(tmp / "manifest.json", manifest)  # last: its presence marks a complete build
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"cache ready in {time.perf_counter() - t0:.2f} s: {final}")


def _encode_stream(tok: Tokenizer, texts: Iterator[str], dtype: type) -> tuple[np.ndarray, int]:
    """All documents encoded and each followed by end-of-text: ``[N]`` of ``dtype``; and the char count."""
    parts: list[np.ndarray] = []
    n_chars = 0
    batch: list[str] = []

    def flush() -> None:
        for ids in tok.encode_batch(batch):
            ids.append(EOS_ID)
            parts.append(np.asarray(ids, dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        n_chars += len(text)
        if len(batch) == _ENCODE_BATCH:
            flush()
    flush()
    return (np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)), n_chars


ARROW_FILE = "data-00000-of-00001.arrow"  # datasets' name for a one-shard split
_ARROW_BATCH = 1000  # rows per record batch, as datasets writes them


def _save_stream(stream: np.ndarray, path: Path) -> None:
    """``stream`` in the layout of ``datasets.save_to_disk`` (``datasets.load_from_disk`` reads it), with pyarrow:
    ``pip install moelab`` trains without the datasets package."""
    import pyarrow as pa

    features = {"ids": {"dtype": np.dtype(stream.dtype).name, "_type": "Value"}}
    schema = pa.schema([("ids", pa.from_numpy_dtype(stream.dtype))],
                       metadata={"huggingface": json.dumps({"info": {"features": features}})})
    path.mkdir(parents=True, exist_ok=True)
    table = pa.table({"ids": pa.array(stream)}, schema=schema)
    with pa.OSFile(str(path / ARROW_FILE), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in table.to_batches(max_chunksize=_ARROW_BATCH):
            writer.write_batch(batch)
    # A fingerprint derived from the content keeps state.json (and so the manifest) reproducible.
    fingerprint = hashlib.sha256(stream.tobytes()).hexdigest()[:16]
    write_json(path / "state.json", {"_data_files": [{"filename": ARROW_FILE}], "_fingerprint": fingerprint,
                                     "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                                     "_output_all_columns": False, "_split": None})
    write_json(path / "dataset_info.json", {"citation": "", "description": "", "features": features,
                                            "homepage": "", "license": ""})


def _publish(tmp: Path, final: Path) -> None:
    """Move a complete build into place; an invalid old cache is moved aside first, then deleted."""
    trash = None
    if final.exists():
        trash = final.with_name(f".trash-{final.name}-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "manifest.json").exists():
            raise
        # Another process (a DDP rank) published the same build first; ours is identical, drop it.
    finally:
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


# ------------------------------------------------------------------------------------ verification


def _verify(path: Path, key: str) -> tuple[dict | None, str]:
    """``(manifest, "")`` when every file matches its recorded sha256, else ``(None, reason)``."""
    mpath = path / "manifest.json"
    if not mpath.is_file():
        return None, "manifest.json is missing"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        return None, f"manifest.json is unreadable: {e!r}"
    if manifest.get("key") != key or manifest.get("format") != FORMAT_VERSION:
        return None, "manifest.json was written for another configuration or format"
    for rel, sha in files.items():
        f = path / rel
        if not f.is_file():
            return None, f"{rel} is missing"
        actual = _sha256_file(f)
        if actual != sha:
            return None, f"{rel} has sha256 {actual[:12]}..., the manifest expects {sha[:12]}..."
    return manifest, ""


def _prepared(path: Path, manifest: dict) -> PreparedCorpus:
    return PreparedCorpus(
        cache_dir=path,
        tokenizer_path=path / "tokenizer.json",
        vocab_size=int(manifest["tokenizer"]["vocab_size"]),
        n_train_tokens=int(manifest["counts"]["train"]["tokens"]),
        n_val_tokens=int(manifest["counts"]["val"]["tokens"]),
        manifest=manifest,
    )


# ---------------------------------------------------------------------------------------- helpers


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_json(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _versions() -> dict:
    import pyarrow
    import tokenizers

    import moelab

    return {"moelab": moelab.__version__, "python": platform.python_version(), "numpy": np.__version__,
            "tokenizers": tokenizers.__version__, "pyarrow": pyarrow.__version__}


def _warn(msg: str) -> None:
    print(f"[moelab.data] {msg}", file=sys.stderr, flush=True)


def _logger(progress: bool) -> Callable[[str], None]:
    return _warn if progress else (lambda msg: None)


__all__ = ["Documents", "PreparedCorpus", "archive_stream", "cache_key_fields", "load_documents", "prepare",
           "split_documents"]
