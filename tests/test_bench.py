"""kernels/bench.py, the one benchmark runner, on the CPU: its registry and arguments, the timing helper's median,
the provenance block, the model file's merge, the --base worktree plumbing; and the kernels/ layout (issue 35)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moelab.provenance import git_state, provenance

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "kernels" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("kernels.bench")  # kernels/ is a folder of scripts: a namespace package here


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_list_and_help_run_anywhere():
    res = _run("--list")
    assert res.returncode == 0, res.stderr
    for name in ("kda", "kda_long", "kda_infer", "attnres", "moe", "model"):
        assert f"kernels/results/{name}_h200.json" in res.stdout
    assert "B1-T32768-H16" in res.stdout and "k3-mini" in res.stdout
    res = _run("--help")
    assert res.returncode == 0 and "--base REV" in res.stdout and "--entry" in res.stdout


@pytest.mark.parametrize("args, message", [
    ((), "--entry NAME is required"),
    (("--entry", "kda", "--shapes", "B9-T1"), "--shapes B9-T1: not a shape of entry kda; allowed: B8-T4096"),
    (("--entry", "nope"), "invalid choice: 'nope'"),
    (("--entry", "kda_infer", "--rounds", "0"), "--rounds must be >= 1, got 0"),
    (("--entry", "kda", "--budget-s", "60"), "--budget-s needs entry model"),
])
def test_argument_errors_name_the_bad_value(bench, args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(list(args))
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_no_cuda_fails_with_one_clear_line():
    res = _run("--entry", "kda_infer")
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "kernels/bench.py: no CUDA device: entry kda_infer measures GPU kernels (--smoke runs its tiny CPU check)"]


def test_time_ms_is_the_median_of_rounds(bench):
    """Each round times ``reps`` calls on the clock (reps from one call to fill min_round_ms); the result is the
    median of the rounds' per-call means, warm-up calls and ``before`` untimed by themselves."""
    now = [0.0]
    durations = iter([9.0, 9.0,                      # warm-up: not counted
                      2e-3,                          # the estimate: 2 ms -> 3 reps fill 5 ms
                      1e-3, 1e-3, 1e-3,              # round 1: 1 ms per call
                      4e-3, 4e-3, 4e-3,              # round 2: 4 ms
                      2e-3, 2e-3, 5e-3])             # round 3: 3 ms
    calls = []

    def fn():
        now[0] += next(durations)

    t = bench.time_ms(fn, warmup=2, rounds=3, min_round_ms=5.0, before=lambda: calls.append(1), cuda=False,
                      clock=lambda: now[0])
    assert t.reps == 3 and t.rounds_ms == pytest.approx([1.0, 4.0, 3.0]) and t.ms == pytest.approx(3.0)
    assert len(calls) == 2 + 1 + 9  # before() ran before every call
    even = bench.time_ms(lambda: None, rounds=4, warmup=0, cuda=False, clock=iter(
        [0, 1e-3, 0, 1e-3, 0, 2e-3, 0, 6e-3, 0, 9e-3]).__next__, min_round_ms=0.0)
    assert even.rounds_ms == pytest.approx([1.0, 2.0, 6.0, 9.0]) and even.ms == pytest.approx(4.0)
    with pytest.raises(ValueError, match="rounds >= 1"):
        bench.time_ms(lambda: None, rounds=0, cuda=False)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()


def test_provenance_fields_and_the_dirty_flag(tmp_path):
    meta = provenance(["python", "kernels/bench.py", "--entry", "kda"])
    assert set(meta) == {"gpu", "python", "torch", "triton", "fla", "commit", "dirty", "diff_sha256", "command",
                         "date"}
    assert meta["command"] == "python kernels/bench.py --entry kda" and meta["date"].endswith("+00:00")
    assert meta["torch"] == torch.__version__ and len(meta["commit"]) == 40
    repo = tmp_path / "repo"
    (repo / "moelab").mkdir(parents=True)
    (repo / "kernels" / "results").mkdir(parents=True)
    (repo / "moelab" / "x.py").write_text("a = 1\n")
    (repo / "kernels" / "results" / "r.json").write_text("{}\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "init")
    assert git_state(repo) == {"commit": _git(repo, "rev-parse", "HEAD"), "dirty": False, "diff_sha256": None}
    (repo / "kernels" / "results" / "r.json").write_text('{"new": 1}\n')  # an output: not dirty
    assert git_state(repo)["dirty"] is False
    (repo / "moelab" / "x.py").write_text("a = 2\n")
    state = git_state(repo)
    assert state["dirty"] is True and len(state["diff_sha256"]) == 16
    assert git_state(tmp_path / "not_a_repo_dir_but_missing")["commit"] is None


def test_provenance_commit_from_the_environment(monkeypatch):
    """A copied tree whose .git is stale (the GPU machine's) names its commit in MOELAB_COMMIT; dirty is then unknown,
    and an explicit root (a --base worktree) still reads its own git."""
    monkeypatch.setenv("MOELAB_COMMIT", "0cfa430")
    assert git_state() == {"commit": "0cfa430", "dirty": None, "diff_sha256": None}
    assert provenance(["x"])["commit"] == "0cfa430"
    assert len(git_state(ROOT)["commit"]) == 40


def test_command_line_names_the_module_and_out(monkeypatch):
    """A result's command is what a user types: a moelab script run by its path becomes ``python -m`` its module, a
    script of this checkout its path from the root, and a path under the GPU machine's ``$OUT`` is spelled
    ``$OUT/...`` (its own path is no use anywhere else)."""
    from moelab.provenance import command_line

    monkeypatch.setenv("OUT", "/root/out/")
    perf = os.path.join(ROOT, "moelab", "train", "perf.py")
    argv = ["python3", perf, "--out", "/root/out/model_capture.json", "--only", "k3-mini", "--log=/root/out/x.log",
            "/elsewhere/y", "a b"]
    assert command_line(argv) == ("python -m moelab.train.perf --out $OUT/model_capture.json --only k3-mini "
                                  "--log=$OUT/x.log /elsewhere/y 'a b'")
    assert command_line([perf, "--profile", "k3-mini"]) == "python -m moelab.train.perf --profile k3-mini"
    bench = os.path.join(ROOT, "kernels", "bench.py")
    assert command_line(["python3", bench, "--entry", "kda"]) == "python3 kernels/bench.py --entry kda"
    assert command_line(["python3", "kernels/bench.py"]) == "python3 kernels/bench.py"
    monkeypatch.delenv("OUT")
    assert command_line(["a", "/root/out/z"]) == "a /root/out/z"


def test_compare_speedups_point_one_way(bench):
    entry = bench.ENTRIES["kda"]
    base = [dict(impl="moelab_bounded", B=8, T=4096, H=16, D=128, fwd_ms=2.0, fwdbwd_ms=8.0, peak_mem_gb=3.0),
            dict(impl="fla_safe_gate", B=8, T=4096, H=16, D=128, fwd_ms=1.0, fwdbwd_ms=None)]
    new = [dict(impl="moelab_bounded", B=8, T=4096, H=16, D=128, fwd_ms=1.0, fwdbwd_ms=10.0, peak_mem_gb=9.0),
           dict(impl="moelab_bounded", B=1, T=32768, H=16, D=128, fwd_ms=1.0)]  # no base row: left out
    rows = bench.compare(entry, base, new)
    assert [(c["metric"], c["speedup"]) for c in rows] == [("fwd_ms", 2.0), ("fwdbwd_ms", 0.8)]
    assert rows[0]["key"] == {"impl": "moelab_bounded", "B": 8, "T": 4096, "H": 16, "D": 128}
    model = bench.compare(bench.ENTRIES["model"], [{"impl": "m", "tok_per_s": 100.0, "step_ms": 50.0}],
                          [{"impl": "m", "tok_per_s": 125.0, "step_ms": 40.0}])
    assert {c["metric"]: c["speedup"] for c in model} == {"tok_per_s": 1.25, "step_ms": 1.25}


def test_model_file_merges_rows_and_keeps_their_commits(bench, tmp_path):
    out = tmp_path / "model_h200.json"
    old = {"meta": {"gpu": "x"}, "rows": [{"impl": "fla_kda", "tok_per_s": 1.0, "commit": "aaa"},
                                          {"impl": "moelab_k3_mini", "tok_per_s": 2.0, "commit": "aaa"}]}
    out.write_text(json.dumps(old))
    meta = {"gpu": "NVIDIA H200", "commit": "b" * 40, "dirty": False, "diff_sha256": None, "command": "c",
            "date": "d"}
    bench.make_saver(bench.ENTRIES["model"], str(out), meta)({"rows": [{"impl": "moelab_k3_mini", "tok_per_s": 3.0}]})
    data = json.loads(out.read_text())
    assert "commit" not in data["meta"] and data["meta"]["gpu"] == "NVIDIA H200"  # rows come from several runs
    assert [(r["impl"], r["tok_per_s"], r["commit"]) for r in data["rows"]] == [("fla_kda", 1.0, "aaa"),
                                                                                ("moelab_k3_mini", 3.0, "b" * 40)]
    other = tmp_path / "kda.json"
    bench.make_saver(bench.ENTRIES["kda"], str(other), meta)({"rows": [{"impl": "x"}]})
    assert json.loads(other.read_text()) == {"meta": meta, "rows": [{"impl": "x"}]}


def test_round_order_is_balanced_and_verdicts(bench):
    for n in (2, 3, 4):
        period = n if n % 2 == 0 else 2 * n
        orders = [bench.round_order(n, r) for r in range(period)]
        assert all(sorted(o) == list(range(n)) for o in orders)
        for pos in range(n):  # every config once in each position per half-period
            assert sorted(o[pos] for o in orders[:n]) == list(range(n))
        follows = [(o[i], o[i + 1]) for o in orders for i in range(n - 1)]
        assert len(set(follows)) == n * (n - 1) and all(follows.count(p) == follows.count(follows[0])
                                                        for p in follows)
    q = bench.compare_rounds([100.0, 110.0, 90.0], [100.0, 100.0, 100.0], 0.98)
    assert q["ratios"] == pytest.approx([1.0, 1.1, 0.9]) and q["verdict"] == "within noise"
    assert bench.verdict([0.99, 1.0], 0.98) == "met" and bench.verdict([0.9, 0.97], 0.98) == "not met"
    with pytest.raises(ValueError, match="same number"):
        bench.compare_rounds([1.0], [1.0, 2.0], 0.9)


@pytest.mark.slow
def test_base_runs_the_entry_on_another_commit(bench, tmp_path, capfd):
    """--base: a worktree of the commit, this file run there on that tree's moelab, the result read back and the
    worktree gone; a name that is not a commit is refused."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "moelab", repo / "moelab", ignore=shutil.ignore_patterns("__pycache__"))
    moe = repo / "moelab" / "model" / "moe.py"
    moe.write_text(moe.read_text() + "\nprint('moe.py of the throwaway commit')\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "throwaway")
    sha = _git(repo, "rev-parse", "HEAD")
    res = bench.run_base("HEAD", ["--entry", "moe", "--shapes", "smoke", "--smoke"], repo=repo)
    assert res["meta"]["commit"] == sha and res["meta"]["entry"] == "moe"
    assert {r["impl"] for r in res["rows"]} >= {"moelab_moe", "dense_equal_flops"}
    assert "moe.py of the throwaway commit" in capfd.readouterr().out
    assert _git(repo, "worktree", "list").count("\n") == 0  # only the main tree is left
    with pytest.raises(SystemExit, match="--base nope: not a commit"):
        bench.run_base("nope", [], repo=repo)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU smoke; a GPU runs the real thing")
def test_model_smoke_rows_as_the_readme_reads_them(tmp_path):
    """The k3-mini group at toy sizes: its rows paired over 2 rounds, the balancer's cost and time, the fused norms'
    and the TF32 output path's ratios to the default, one step's host work, the provenance on every row."""
    out = tmp_path / "model.json"
    res = _run("--entry", "model", "--smoke", "--rounds", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"moelab_k3_mini", "moelab_k3_mini_balancer_none", "moelab_k3_mini_norm_triton",
                         "moelab_k3_mini_tf32_output", "moelab_k3_mini_tf32x3_output"}
    assert len(rows["moelab_k3_mini_norm_triton"]["ratio_vs_torch_norm"]["ratios"]) == 2
    assert len(rows["moelab_k3_mini_tf32_output"]["ratio_vs_fp32_output"]["ratios"]) == 2
    assert len(rows["moelab_k3_mini_tf32x3_output"]["ratio_vs_fp32_output"]["ratios"]) == 2
    qb = rows["moelab_k3_mini"]
    q = qb["ratio_vs_balancer_none"]
    assert len(q["ratios"]) == 2 and qb["balancer_cost"] == pytest.approx(1 - q["median"])
    assert qb["complete"] and qb["rounds_planned"] == 2 and qb["balancer"] == "quantile_balancing"
    assert 0 < qb["balancer_ms"] < qb["step_ms"] and qb["loss_finite"] and not qb["nonfinite_grads"]
    assert qb["step_ops"]["aten_ops"] > 100 and qb["step_ops"]["fn_applies"] >= 1
    assert all(len(r["commit"]) == 40 and r["command"].endswith(str(out)) for r in rows.values())


def test_model_group_out_of_memory_names_its_configs_and_the_way_out(bench, monkeypatch):
    """A model group whose configs do not fit the GPU together stops with one line naming them and --impls."""
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(bench, "run_group", oom)
    ctx = bench.Ctx(["fla"], True, 2, None, lambda rows: None,
                    impls=("moelab_fla_shape_graphs", "moelab_fla_shape_graphs_fast", "fla_kda"))
    with pytest.raises(SystemExit, match=r"entry model, shape fla: its configs \(moelab_fla_shape_graphs, "
                                         r"moelab_fla_shape_graphs_fast, fla_kda\) stay on the GPU at once and ran out "
                                         r"of memory; time fewer with --impls .*Tried to allocate 64.00 MiB"):
        bench.run_model(ctx)


def test_fla_warm_up_compiles_each_d_and_l_once_in_a_pool(bench, monkeypatch, capsys):
    """The attnres grid warms fla's kernels per (D, L) in parallel processes; a failed one is counted, not fatal."""
    compile(bench._FLA_WARM, "warm", "exec")  # the script each process runs is valid Python
    monkeypatch.setattr(bench, "_FLA_WARM", "import sys; sys.exit(sys.argv[2] == '9')")  # no fla, no GPU here
    assert bench.warm_fla(["N8192_D512_L3", "N8192_D512_L9", "N32768_D512_L3"]) == [(512, 3), (512, 9)]
    out = capsys.readouterr().out
    assert "compiled for 2 (D, L) points in 2 processes" in out and "(1 failed: those compile when timed)" in out
    monkeypatch.setattr(bench, "_FLA_WARM", "pass")
    pts = bench.warm_fla(list(bench.ATTNRES_GRID))
    assert len(pts) == 20 and pts[0] == (512, 3) and pts[-1] == (7168, 33) and "failed" not in capsys.readouterr().out


def test_kernels_folder_is_small_and_results_are_a_ledger():
    """Issue 35: kernels/ holds at most 6 Python files of at most 3,000 lines, each run by a make target;
    kernels/results/ at most 20 files, no history/, no console logs, no autotune caches."""
    scripts = sorted((ROOT / "kernels").glob("*.py"))
    lines = sum(len(p.read_text().splitlines()) for p in scripts)
    assert len(scripts) <= 6 and lines <= 3000, (len(scripts), lines)
    makefile = (ROOT / "Makefile").read_text()
    reached = {p.name for p in scripts if f"kernels/{p.name}" in makefile}
    helpers = {p.name for p in scripts if p.name not in reached
               and any(f"import {p.stem}" in q.read_text() or f"from {p.stem} import" in q.read_text()
                       for q in scripts if q.name in reached)}
    assert reached | helpers == {p.name for p in scripts}, "not reachable from a make target"
    results = [p for p in (ROOT / "kernels" / "results").rglob("*") if p.is_file()]
    assert len(results) <= 20, sorted(p.name for p in results)
    assert not any(p.is_dir() for p in (ROOT / "kernels" / "results").iterdir())
    assert not [p.name for p in results if p.suffix in (".log", ".tgz", ".gz")]


def test_attnres_grid_rows_merge_by_shape_and_summarize(bench, tmp_path, monkeypatch):
    """Issue 37's 40 grid points are shapes of the attnres entry (groups per D and all); two saves into one file
    keep each other's rows (a shape measured again replaces its rows), each row stamped with its own commit, and
    the grid summary is fla's best time over moelab's per point and metric, with the minimum over the points."""
    entry = bench.ENTRIES["attnres"]
    assert len(bench.ATTNRES_GRID) == 40 and len(entry.shapes["grid"]) == 40
    assert entry.shapes["grid_D7168"] == tuple(f"N{N}_D7168_L{L}" for N in (8192, 32768) for L in (3, 9, 17, 33))
    assert entry.shapes["N32768_D4096_L9"] == (9, 32768, 4096)

    def rows(shape, ours, fla, stacked):
        L, N, D = entry.shapes[shape]
        return [dict(impl=i, shape=shape, L=L, N=N, D=D, fwd_ms=f, fwdbwd_ms=fb, ok=True) for i, (f, fb) in
                (("moelab_fused", ours), ("fla_fused_attnres", fla), ("fla_fused_attnres_stacked", stacked))]

    out = tmp_path / "attnres.json"
    for commit, new in (("aaa", rows("N8192_D512_L3", (1.0, 2.0), (2.0, 3.0), (1.5, 5.0))
                         + rows("N8192_D512_L9", (1.0, 2.0), (9.0, 9.0), (9.0, 9.0))),
                        ("bbb", rows("N8192_D512_L9", (2.0, 2.0), (1.0, 3.0), (1.8, 2.5)))):
        monkeypatch.setenv("MOELAB_COMMIT", commit)
        meta = bench.provenance()
        bench.make_saver(entry, str(out), meta)({"rows": new})
    d = json.loads(out.read_text())
    assert [(r["shape"], r["commit"]) for r in d["rows"] if r["impl"] == "moelab_fused"] == [
        ("N8192_D512_L3", "aaa"), ("N8192_D512_L9", "bbb")]
    assert len(d["rows"]) == 6 and "commit" not in d["meta"]
    pts = {p["shape"]: p for p in d["grid"]["points"]}
    assert pts["N8192_D512_L3"]["fwd_speedup_vs_fla_best"] == 1.5 and pts["N8192_D512_L3"][
        "fwdbwd_speedup_vs_fla_best"] == 1.5
    assert pts["N8192_D512_L9"]["fwd_speedup_vs_fla_best"] == 0.5
    assert d["grid"]["min_fwd_speedup_vs_fla_best"] == 0.5 and d["grid"]["min_fwdbwd_speedup_vs_fla_best"] == 1.25
    assert d["grid"]["measured"] == 2 and d["grid"]["met"] is False and d["summary"] == [] and d["all_ok"]


def test_attnres_errors_over_chunks_equal_the_whole(bench, monkeypatch):
    """The fp32 reference run over chunks of tokens gives the errors of one run over all of them (dq and dw from
    gradients summed over the chunks); an output off by 1% reads as 1e-2."""
    from moelab.ops.attnres import depth_attention_torch

    srcs, q, w, dh = bench._attnres_inputs(3, 40, 16, "cpu", seed=0)
    leaves = [x.float().requires_grad_() for x in [*srcs, q, w]]
    h, _ = depth_attention_torch(leaves[:3], leaves[3], leaves[4], 1e-6, torch.float32)
    h.backward(dh)
    outs = {"same": (h.detach(), [x.grad for x in leaves]), "off": (h.detach() * 1.01, [x.grad for x in leaves])}
    whole = bench._attnres_errors(srcs, q, w, dh, outs)
    monkeypatch.setattr(bench, "ATTNRES_REF_CHUNK", 3 * 16 * 7)  # 7 tokens a chunk: 6 chunks
    chunked = bench._attnres_errors(srcs, q, w, dh, outs)
    assert chunked["off"]["h_err"] == pytest.approx(whole["off"]["h_err"]) == pytest.approx(1e-2)
    assert max(chunked["same"][k] for k in ("h_err", "dsrc_err", "dquery_err", "dnorm_weight_err")) < 1e-6
    assert chunked["same"]["ok"] and not chunked["off"]["ok"]


def test_attnres_launch_candidates_are_named_rows(bench):
    """An AttnRes launch candidate is a row name that spells its LaunchConfig (timed only where --impls names it, beside
    the named rows it keeps); a name that spells no valid launch is refused at the command line with the reason."""
    cfg = bench.attnres_launch("moelab_fused@r2w16g1-b1w8g4")
    assert (cfg.rows, cfg.warps, cfg.group, cfg.stages, cfg.programs_per_sm) == (2, 16, 1, 1, 4)
    assert (cfg.bwd_rows, cfg.bwd_warps, cfg.bwd_group) == (1, 8, 4)
    assert bench.attnres_launch("moelab_fused@r1w8g2s2").stages == 2
    assert bench.attnres_launch("moelab_fused@r1w8g2-b1w8g4s2").bwd_launch == (1, 8, 4, 2)
    # p<n>: the backward's persistent programs per SM (p0: as many as fit), else 4 for several-row forward tiles
    assert [bench.attnres_launch(f"moelab_fused@r4w4g1-b1w4g2s2{p}").programs_per_sm for p in ("", "p0", "p6")] == [
        4, 0, 6]
    assert bench.attnres_launch("moelab_fused@r1w8g2p3").programs_per_sm == 3
    both = bench.attnres_launch("moelab_fused@r1w4g1c512s3-b1w4g1c256s2")
    assert (both.chunk, both.stages, both.bwd_chunk, both.bwd_stages) == (512, 3, 256, 2)
    assert (bench.attnres_launch("moelab_fused@r1w4g1c512s3").chunk, bench.attnres_launch(
        "moelab_fused@r1w4g1c512s3").stages) == (512, 3)
    impls = bench._attnres_impls(None, True, ("moelab_fused", "moelab_fused@r1w8g2"))
    assert list(impls) == ["moelab_fused", "moelab_fused@r1w8g2"]
    assert list(bench._attnres_impls(None, True)) == ["moelab_fused", "torch_plain"]
    res = _run("--entry", "attnres", "--smoke", "--impls", "moelab_fused@r3w8g1")
    assert res.returncode == 2 and "LaunchConfig.rows=3 is not allowed" in res.stderr
    res = _run("--entry", "moe", "--smoke", "--impls", "moelab_fused")
    assert res.returncode == 2 and "needs entry kda" in res.stderr


def test_model_impls_pick_rows_of_a_group(tmp_path):
    """--impls on the model entry builds only the rows it names (a group's configs all stay on the GPU at once: the
    fla group's captured rows beside fla's model need not fit with the rest); a name that is no model row is refused
    with the rows allowed."""
    out = tmp_path / "model.json"
    res = _run("--entry", "model", "--smoke", "--shapes", "gpu-small", "--impls", "moelab_gpu_small_prenorm",
               "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert [r["impl"] for r in json.loads(out.read_text())["rows"]] == ["moelab_gpu_small_prenorm"]
    res = _run("--entry", "model", "--smoke", "--impls", "moelab_fused")
    assert res.returncode == 2 and "--impls moelab_fused: needs entry kda" in res.stderr
    assert "moelab_fla_shape_graphs" in res.stderr


def test_model_rows_take_eager_or_a_captured_step(bench):
    """build_moelab: train.compile none -> the eager Runner, graphs -> CapturedRunner (CUDA only: on the CPU the
    capture's own error), any other mode a clear error naming the row and the value."""
    toy = {**bench.SMOKE_MODEL, "model.n_layers": 2, "model.dense_layers": 2}
    eager = bench.build_moelab("toy", "gpu-small", toy, "cpu")
    assert type(eager.runner) is bench.Runner and torch.isfinite(eager.runner.step())
    with pytest.raises(ValueError, match="toy: train.compile='default' is not timed here: expected none or graphs"):
        bench.build_moelab("toy", "gpu-small", {**toy, "train.compile": "default"}, "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="CapturedStep needs a CUDA device"):
            bench.build_moelab("toy", "gpu-small", {**toy, "train.compile": "graphs"}, "cpu")


@pytest.mark.gpu
def test_captured_model_row_trains_gpu(bench):
    """A captured row on the GPU: its steps replay one graph (loss finite, falling on the repeated batch) and it
    reports no host ops."""
    toy = {**bench.SMOKE_MODEL, "model.n_layers": 2, "model.dense_layers": 2, "train.compile": "graphs"}
    b = bench.build_moelab("toy", "gpu-small", toy, "cuda")
    assert isinstance(b.runner, bench.CapturedRunner)
    losses = [float(b.runner.step()) for _ in range(8)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert "CUDA graph" in b.runner.count_ops()["note"]


def test_kernel_times_lists_where_the_time_goes():
    """kernel_times (kda --kernels): per-kernel time per call of fn, largest first, the ops past ``top`` summed into
    one "(other)" entry; on the CPU the aten ops' self time (a GPU lists its kernels)."""
    a = torch.randn(192, 192)

    def fn():
        (a @ a).relu_().sum()

    from moelab.train.perf import kernel_times

    rows = kernel_times(fn, calls=3, cuda=False)
    by = {r["name"]: r for r in rows}
    assert by["aten::mm"]["calls"] == 1.0 and by["aten::mm"]["ms"] > 0
    assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
    short = kernel_times(fn, calls=2, cuda=False, top=1)
    assert len(short) == 2 and short[1]["name"] == "(other)" and short[1]["calls"] >= 2
    with pytest.raises(ValueError, match="calls >= 1, got calls=0"):
        kernel_times(fn, calls=0, cuda=False)
    res = _run("--entry", "moe", "--smoke", "--kernels")
    assert res.returncode == 2 and "--kernels needs entry kda, got entry moe" in res.stderr


def test_conv_entry_times_launches_and_kernels_beside_torch(bench, tmp_path):
    """The conv entry's CPU smoke run: torch's F.conv1d path, the forward at its first launch and the backward at
    its first launch in each of its three kernels, each with times and errors vs fp32 (the interpreter computes in
    fp32); the op's launch table and backward kernel are as before afterwards."""
    from moelab.ops import short_conv

    before = (dict(short_conv.LAUNCH), short_conv.BWD_TAPS4, short_conv.BWD_SLIDE, short_conv.SLIDE_LAUNCH)
    res = bench.run_entry(bench.ENTRIES["conv"], ["smoke"], str(tmp_path / "conv.json"), cuda=False, rounds=1,
                          budget_s=None)
    rows = {r["impl"]: r for r in res["rows"]}
    assert set(rows) == {"torch_conv1d", "fwd_16x128x4", "bwd_taps4_16x128x8", "bwd_generic_16x128x8",
                         "bwd_slide_64x256x1x3"}
    for r in rows.values():
        assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and "error" not in r, r
        assert max(r["err_y"], r["err_dx"], r["err_dw"]) < 1e-5, r
    assert (dict(short_conv.LAUNCH), short_conv.BWD_TAPS4, short_conv.BWD_SLIDE, short_conv.SLIDE_LAUNCH) == before


def test_attnres_point_without_room_runs_each_impl_in_turn(bench, monkeypatch):
    """Where the impls' copies of the sources do not fit in free memory together (D 7168, L 33, N 32768 on an
    80 GB card), each impl is run, checked, timed and freed in turn: the same rows, every one checked and timed."""
    ctx = bench.Ctx(["smoke"], False, 1, None, lambda d: None)
    impls = bench._attnres_impls(None, True)
    together = bench._attnres_point("smoke", impls, ctx)
    monkeypatch.setattr(bench, "_free_bytes", lambda ctx: 0.0)
    alone = bench._attnres_point("smoke", impls, ctx)
    assert [r["impl"] for r in alone] == [r["impl"] for r in together] == list(impls)
    for a, t in zip(alone, together):
        assert a["ok"] and t["ok"] and a["fwd_ms"] > 0 and a["fwdbwd_ms"] > 0
        assert a["h_err"] == pytest.approx(t["h_err"], rel=1e-6)


def test_kda_rows_time_every_impl_in_passes_on_one_input_set(bench, monkeypatch):
    """The kda entry holds every impl of a shape on one input set and times them in passes (Williams order): each
    row gets its pass medians, the moelab rows their per-pass speed-ups over fla and over the default row (with
    issue 37's verdict against fla), and an impl that fails is an error row while the others are still timed."""
    cost = {"moelab_bounded": 2.0, "moelab_bounded_states_rerun": 1.0, "fla_safe_gate": 4.0}
    inputs, calls = set(), []

    def case(impl, t, ctx, fla):
        inputs.add(t["q"].data_ptr())
        if impl not in cost:
            raise RuntimeError("no kernel for this")

        def fn():
            calls.append(impl)
            return t["v"] * cost[impl]
        return [t["v"]], fn

    def fake_time(fn, before=None, **kw):
        fn()
        ms = cost[calls[-1]]
        return bench.Timing(ms=ms, rounds_ms=[ms, ms], reps=1)

    monkeypatch.setattr(bench, "_kda_case", case)
    monkeypatch.setattr(bench, "_fla_import", lambda name: object())  # fla's rows, as on a GPU (stubbed above)
    monkeypatch.setattr(bench, "time_ms", fake_time)
    monkeypatch.setattr(bench, "peak_bytes", lambda step: (step(), (0, 0))[1])
    monkeypatch.setattr(bench.Ctx, "dev", property(lambda self: "cpu"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    ctx = bench.Ctx(["smoke"], True, 3, None, lambda d: None)
    out = bench._kda_rows(ctx, {"smoke": (1, 8, 2, 4)}, ("moelab_bounded", "moelab_bounded_states_rerun",
                                                         "moelab_general", "fla_safe_gate"))
    rows = {r["impl"]: r for r in out["rows"]}
    assert len(inputs) == 1 and out["passes"] == 3  # one input set for every impl
    assert rows["moelab_general"]["error"] == "RuntimeError: no kernel for this"
    assert rows["moelab_general"]["fwdbwd_ms"] is None and "fwdbwd_vs_fla" not in rows["moelab_general"]
    for impl, ms in cost.items():
        assert rows[impl]["fwdbwd_ms_passes"] == [ms] * 3 and rows[impl]["fwd_ms"] == ms
    other = rows["moelab_bounded_states_rerun"]
    assert other["fwdbwd_vs_fla"]["ratios"] == [4.0] * 3 and other["fwdbwd_vs_fla"]["verdict"] == "met"
    assert other["fwdbwd_vs_default"] == bench.compare_rounds([2.0] * 3, [1.0] * 3, None)
    assert rows["moelab_bounded"]["fwdbwd_vs_fla"]["ratios"] == [2.0] * 3
    assert "fwdbwd_vs_default" not in rows["moelab_bounded"] and "fwdbwd_vs_fla" not in rows["fla_safe_gate"]
    assert other["fwdbwd_vs_fla"]["target"] == bench.KDA_TARGET == 1.5
