"""The mutation tool's mechanics on a toy repository: caught, survived, stale; the source tree never changes."""

from __future__ import annotations

import subprocess

from tests.mutation.mutate import Edit, Mutation, run

TOY = "def add(a: int, b: int) -> int:\n    return a + b\n"
TOY_TEST = "from toy import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def test_caught_survived_and_stale_on_a_toy_repo(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the toy needs no plugin: 0.5 s per pytest run, not 3
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy.py").write_text(TOY)
    (src / "test_toy.py").write_text(TOY_TEST)
    (src / ".gitignore").write_text("ignored.txt\n")
    (src / "ignored.txt").write_text("not copied")
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", "toy.py"], check=True)  # test_toy.py stays untracked: copied too
    mutations = [
        Mutation("minus", "a - b", (Edit("toy.py", "a + b", "a - b"),), ("test_toy.py",)),
        Mutation("swap", "b + a (same result)", (Edit("toy.py", "a + b", "b + a"),), ("test_toy.py",)),
        Mutation("stale", "snippet gone", (Edit("toy.py", "a * b", "a / b"),), ("test_toy.py",)),
        Mutation("missing-test", "no such test", (Edit("toy.py", "a + b", "a - b"),), ("test_nothing.py",)),
    ]
    outcomes = run(mutations, src=src, timeout=120, baseline=False, echo=False)
    assert [(o.name, o.status) for o in outcomes] == [("minus", "caught"), ("swap", "survived"), ("stale", "error"),
                                                      ("missing-test", "error")]
    assert "test_add" in outcomes[0].detail and "occurs 0 times" in outcomes[2].detail
    assert (src / "toy.py").read_text() == TOY  # the working tree is never written
    (src / "test_toy.py").write_text(TOY_TEST.replace("== 5", "== 6"))
    (baseline,) = run(mutations[:1], src=src, timeout=120, baseline=True, echo=False)
    assert baseline.name == "(baseline)" and baseline.status == "error"
    (baseline,) = run(mutations[:2], src=src, timeout=120, baseline=True, echo=False, jobs=2)
    assert baseline.name == "(baseline)" and baseline.status == "error"
    (src / "test_toy.py").write_text(TOY_TEST)
    # Two at a time, each job in its own copy: the same outcomes, in the order asked.
    parallel = run(mutations, src=src, timeout=120, baseline=False, echo=False, jobs=2)
    assert [(o.name, o.status) for o in parallel] == [(o.name, o.status) for o in outcomes]
    assert (src / "toy.py").read_text() == TOY


def test_every_catalogue_edit_still_matches_the_tree() -> None:
    """A refactor that removes a mutated snippet makes its mutation 'stale' (an error in `make mutate`, which
    CI does not run): every edit's old text must occur in its file as often as the edit says."""
    from pathlib import Path

    from tests.mutation.mutations import MUTATIONS

    root = Path(__file__).resolve().parents[2]
    stale = []
    for m in MUTATIONS:
        for e in m.edits:
            n = (root / e.path).read_text().count(e.old)
            if n == 0 or (e.count is not None and n != e.count):
                stale.append(f"{m.name}: {e.path} has {n} of {e.old!r}")
    assert not stale, "\n".join(stale)
