"""``pip install moelab`` is the library (model, ops, training), not the lab: the split of pyproject.toml's
dependencies, and training without the lab's packages."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# What the lab brings (tracking, notebooks, studies' statistics): never a dependency of the library.
LAB = ("mlflow", "jupyterlab", "ipykernel", "ipywidgets", "papermill", "jupytext", "nbformat", "nbconvert",
       "scipy", "latex2mathml", "psutil", "nvidia-ml-py")


def _names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!;\[ ~]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def test_the_library_does_not_depend_on_the_lab() -> None:
    core = _names(PYPROJECT["project"]["dependencies"])
    assert {"torch", "lightning", "numpy", "pyyaml"} <= core
    assert not core & set(LAB), f"lab packages in the library's dependencies: {sorted(core & set(LAB))}"
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(LAB) <= _names(extras["lab"])
    # make setup (EXTRAS) and CI install dev, which must bring the lab: the tests need it.
    assert "moelab[lab]" in extras["dev"]


def _core_site(tmp_path: Path) -> Path:
    """A folder of links to the installed distributions ``pip install moelab`` brings (its dependencies'
    closure, by their metadata) and nothing else: this interpreter's site-packages as without the lab."""
    from importlib import metadata

    from packaging.requirements import Requirement

    todo = [Requirement(r).name for r in PYPROJECT["project"]["dependencies"] if Requirement(r).marker is None
            or Requirement(r).marker.evaluate()]
    core: set[str] = set()
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in core:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        core.add(name)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    site = tmp_path / "site"
    site.mkdir()
    for dist in metadata.distributions():
        if dist.metadata["Name"].lower().replace("_", "-") not in core:
            continue
        for top in {Path(str(f)).parts[0] for f in dist.files or ()}:
            src = Path(str(dist.locate_file(top)))
            if src.exists() and not (site / top).exists() and not top.endswith((".pth", "..")):
                (site / top).symlink_to(src)
    return site


def test_training_works_without_the_lab(tmp_path) -> None:
    """The tiny preset trains from Python with only the library's dependencies importable: untracked, one line;
    a study names the extra."""
    site = _core_site(tmp_path)
    assert not (site / "mlflow").exists() and not (site / "pandas").exists() and (site / "torch").exists()
    script = f"""
import sys
sys.path[:0] = [{str(site)!r}, {str(ROOT)!r}]
import moelab, moelab.studies  # noqa: E401
from moelab.config import load_config
from moelab.train import fit
cfg = load_config("tiny", {{"train.max_steps": 6, "train.val_every": 3, "train.ckpt_dir": {str(tmp_path / "run")!r}}})
res = fit(cfg)
print("trained", res.summary["steps"], res.run_id)
for name in ("mlflow", "pandas", "matplotlib", "datasets", "rich", "papermill"):
    assert name not in sys.modules, name
try:
    from moelab.studies.runner import run_study
    run_study(1, "cpu")
except ModuleNotFoundError as e:
    print("study:", e)
"""
    out = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "trained 6 None" in out.stdout
    assert "MLflow is not installed: this run is not tracked (install the lab extra, pip install 'moelab[lab]'" in text
    assert "study: a study run needs papermill, nbformat, nbconvert, latex2mathml, mlflow, psutil" in out.stdout
    assert "pip install 'moelab[lab]'" in out.stdout.split("study:")[1]


def test_the_token_cache_is_written_and_read_without_datasets(tmp_path) -> None:
    """The cache's Arrow splits are written and read with pyarrow alone, in the layout datasets.load_from_disk
    reads too (caches built earlier by datasets stay valid)."""
    import datasets
    import numpy as np

    from moelab.data.corpus import PreparedCorpus, _save_stream

    for dtype in (np.uint16, np.int32):
        x = (np.arange(2500) * 7919 % 60000).astype(dtype)
        _save_stream(x, tmp_path / dtype.__name__ / "train")
        back = datasets.load_from_disk(str(tmp_path / dtype.__name__ / "train")).data.column("ids").to_numpy()
        assert back.dtype == dtype and np.array_equal(back, x)
        corpus = PreparedCorpus.__new__(PreparedCorpus)
        object.__setattr__(corpus, "cache_dir", tmp_path / dtype.__name__)
        ours = corpus.load_tokens("train")
        assert ours.dtype == dtype and np.array_equal(ours, x)
    # and a split that datasets itself wrote reads back the same
    y = np.arange(3000, dtype=np.uint16)
    datasets.Dataset.from_dict({"ids": y}).save_to_disk(str(tmp_path / "by_datasets" / "val"), num_shards=1)
    corpus = PreparedCorpus.__new__(PreparedCorpus)
    object.__setattr__(corpus, "cache_dir", tmp_path / "by_datasets")
    assert np.array_equal(corpus.load_tokens("val"), y)
