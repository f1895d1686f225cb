"""Mutation check: apply each curated bug in a throwaway copy of the repository and run the tests that must catch it.

    python tests/mutation/mutate.py                 # every mutation of tests/mutation/mutations.py
    python tests/mutation/mutate.py gate-exp ...    # only these (names as listed by --list)
    python tests/mutation/mutate.py --jobs 2        # two at a time, each in its own copy
    python tests/mutation/mutate.py --list

A mutation is *caught* when its tests fail (pytest exit status 1), *survived* when they pass, and
an *error* when pytest could not run them (import error, no test collected, timeout) or the
original snippet is no longer in the file (the mutation went stale: update it). The exit status
is 0 only when every selected mutation is caught. The working tree is never written: the copy
holds the tracked and untracked-but-not-ignored files (``git ls-files``), with ``data/cache``
linked in so the tests find the prepared corpus.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINKED = ("data/cache",)  # ignored build outputs the tests read; linked, never copied


@dataclasses.dataclass(frozen=True)
class Edit:
    """Replace ``old`` by ``new`` in ``path`` (relative to the repository root).

    ``count``: how many occurrences ``old`` must have (all of them are replaced); None: at least one.
    """

    path: str
    old: str
    new: str
    count: int | None = 1


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One deliberate bug: its edits and the pytest arguments (files or node ids) that must catch it."""

    name: str
    why: str
    edits: tuple[Edit, ...]
    tests: tuple[str, ...]


@dataclasses.dataclass
class Outcome:
    name: str
    status: str  # caught | survived | error
    seconds: float
    detail: str = ""


class StaleMutation(ValueError):
    """The original snippet of an edit is not in its file as often as the mutation says."""


def copy_repo(src: Path, dst: Path) -> None:
    """Copy the files git would commit (tracked + untracked, not ignored) of ``src`` into ``dst``; link LINKED."""
    listing = subprocess.run(["git", "-C", str(src), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout.decode()
    for rel in filter(None, listing.split("\0")):
        s = src / rel
        if not s.is_file():  # deleted in the working tree, still in the index
            continue
        d = dst / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(s, d)
    for rel in LINKED:
        if (src / rel).exists():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(src / rel, dst / rel)


def apply(root: Path, edits: Sequence[Edit]) -> dict[Path, str]:
    """Apply ``edits`` under ``root``; return the original text of every file touched (to restore it).

    Raises StaleMutation (before writing anything) when an original snippet is missing or its count is off.
    """
    texts: dict[Path, str] = {}
    for e in edits:
        path = root / e.path
        if not path.is_file():
            raise StaleMutation(f"{e.path} does not exist")
        texts.setdefault(path, path.read_text())
    originals = dict(texts)
    for e in edits:
        path = root / e.path
        n = texts[path].count(e.old)
        if n == 0 or (e.count is not None and n != e.count):
            want = "at least 1" if e.count is None else str(e.count)
            raise StaleMutation(f"{e.path}: {e.old!r} occurs {n} times, expected {want}")
        texts[path] = texts[path].replace(e.old, e.new)
    for path, text in texts.items():
        path.write_text(text)
    return originals


def run_tests(root: Path, tests: Sequence[str], timeout: float) -> tuple[int | None, str]:
    """pytest ``tests`` in ``root`` (its code first on the path); (exit status or None on timeout, output tail)."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    return proc.returncode, (proc.stdout + proc.stderr)[-2000:]


def check(mutation: Mutation, root: Path, timeout: float) -> Outcome:
    """Apply one mutation in ``root`` (a copy), run its tests, restore the files."""
    start = time.perf_counter()
    try:
        originals = apply(root, mutation.edits)
    except StaleMutation as e:
        return Outcome(mutation.name, "error", 0.0, f"stale: {e}")
    try:
        code, tail = run_tests(root, mutation.tests, timeout)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    seconds = time.perf_counter() - start
    if code == 1:
        failed = [line for line in tail.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return Outcome(mutation.name, "caught", seconds, failed[0] if failed else "")
    if code == 0:
        return Outcome(mutation.name, "survived", seconds, "every named test passed")
    return Outcome(mutation.name, "error", seconds, f"pytest exit {code}: {tail[-600:]}")


def run(mutations: Sequence[Mutation], src: Path = ROOT, timeout: float = 900.0, baseline: bool = True,
        echo: bool = True, jobs: int = 1) -> list[Outcome]:
    """Check ``mutations`` in temporary copies of ``src`` (one per job: ``jobs`` mutations at a time); with
    ``baseline``, first run all their tests unmutated (a failing baseline makes every "caught" meaningless, so
    then nothing else runs). Outcomes come back in the order of ``mutations``; lines print as they finish."""
    jobs = max(1, min(jobs, len(mutations) or 1))
    with tempfile.TemporaryDirectory(prefix="moelab-mutate-") as tmp:
        roots = [Path(tmp) / f"repo{i}" for i in range(jobs)]
        for root in roots:
            copy_repo(src, root)
        if baseline:  # the tests split over the jobs' copies, run side by side
            tests = sorted({t for m in mutations for t in m.tests})
            parts = [tests[i::jobs] for i in range(jobs) if tests[i::jobs]]
            with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
                results = list(pool.map(lambda rp: run_tests(rp[0], rp[1], timeout), zip(roots, parts)))
            code, tail = next(((c, t) for c, t in results if c != 0), results[0])
            if code != 0:
                out = Outcome("(baseline)", "error", 0.0, f"the unmutated tests do not pass (exit {code}): {tail}")
                if echo:
                    print(f"{out.name:<34} {out.status:<9} {out.detail}", flush=True)
                return [out]
        free: queue.Queue[Path] = queue.Queue()
        for root in roots:
            free.put(root)

        def one(m: Mutation) -> Outcome:
            root = free.get()  # a copy no other job is mutating now
            try:
                out = check(m, root, timeout)
            finally:
                free.put(root)
            if echo:
                print(f"{out.name:<34} {out.status:<9} {out.seconds:6.1f} s  {out.detail}", flush=True)
            return out

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            return list(pool.map(one, mutations))


def main(argv: Sequence[str] | None = None) -> int:
    from tests.mutation.mutations import MUTATIONS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutations to check (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and the tests that must catch them")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run (default 900)")
    p.add_argument("--jobs", "-j", type=int, default=1,
                   help="mutations checked at a time, each in its own copy of the repository (default 1)")
    args = p.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in by_name]
    if unknown:
        p.error(f"unknown mutation(s) {', '.join(unknown)}: expected some of {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.names] if args.names else list(MUTATIONS)
    if args.list:
        for m in chosen:
            print(f"{m.name:<34} {m.why}\n{'':<34} caught by: {' '.join(m.tests)}")
        return 0
    outcomes = run(chosen, timeout=args.timeout, baseline=not args.no_baseline, jobs=args.jobs)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("caught", "survived", "error")}
    print(f"mutations: {counts['caught']} caught, {counts['survived']} survived, {counts['error']} errors "
          f"(of {len(chosen)})")
    return 0 if counts["caught"] == len(chosen) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
