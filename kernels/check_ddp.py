"""Data-parallel replicas stay identical: N ranks train k3-mini with quantile balancing through
moelab's own training path and must end with bitwise equal router biases and weights.

Issue 15's acceptance: two ranks on two H200s train the ``k3-mini`` preset (quantile balancing in histogram mode,
bf16-mixed) for >= 100 optimizer steps and end with identical biases and weights. The run is shrunk to fit a 10-minute
command (default T = 1024, B = 4 per rank instead of the preset's 4096 x 8; the model is the preset's); everything else
is ``moelab.train.fit`` as ``make train`` runs it, under Lightning's ``ddp`` strategy (NCCL on GPUs, gloo on the CPU).

How: the launcher writes the config into a work folder and starts itself with ``--worker`` (Lightning relaunches
that once per extra rank). Each rank saves its parameters, router biases, bias/load trajectories and step history
to ``rank<r>.pt``; the launcher compares the ranks:

* router biases and parameters bitwise (max |difference| and the names that differ), a SHA-256 per
  rank over each group (computed by the rank itself);
* the whole bias and global-load trajectory (every step), the steps done, the world size. Equal
  final biases alone prove little: DDP broadcasts buffers (the router bias is one) from rank 0 at
  every forward, so they agree even when the balancer's all-reduce is skipped (tried: the final
  biases matched, the trajectories, recorded right after each update, did not);
* the pre-clipping gradient norms of every step (all-reduced gradients: equal on every rank);
* that the ranks trained on different batches (their local train losses differ) and that the
  balancer wrote non-zero biases, without which equal replicas would prove little.

Equality needs no deterministic kernels: every rank applies the same all-reduced gradient and balancer statistics
to the same state, so replicas agree bit for bit unless the collectives or the update rules differ across ranks.

Writes ``--out`` (``meta``: gpu, torch, triton, lightning, nccl, date, command, commit; ``result``),
prints a one-paragraph verdict, exits 0 when everything agrees, 1 when something differs or
training failed, 2 on bad arguments or a machine without the devices.

    python kernels/check_ddp.py --devices 2 --steps 100 --commit SHA --out kernels/results/ddp_check_h200.json
    python kernels/check_ddp.py --smoke --out /tmp/ddp.json    # CPU: 2 gloo ranks, k3-mini's structure at toy sizes
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kernels"))

from bench import SMOKE_K3_MINI  # noqa: E402

from moelab.base import ConfigError  # noqa: E402
from moelab.config import RunConfig, load_config, to_yaml, with_overrides  # noqa: E402
from moelab.tracking import git_commit  # noqa: E402
from moelab.utils import atomic_path, write_json  # noqa: E402

CONFIG_FILE = "check_config.yaml"
RUN_SUMMARY_KEYS = ("status", "steps", "tok_per_s", "peak_mem_gb", "balancer_ms", "balancer_share", "maxvio_global",
                    "replicas_identical", "tokens_per_step", "wall_s")
GPU_SIZE = {"data.seq_len": 1024, "train.batch_size": 4}  # per rank: 4096 tokens, m k / n = 2 * 4096 * 8 / 64
SMOKE_STEPS = 4
# bench.py's toy k3-mini, with the preset's 1000 histogram bins: at the toy's 64 (bins 1/32 wide) the
# toy router's margins mostly share a bin (every bias stayed 0 over the 4 smoke steps), and equal zeros
# would prove nothing.
SMOKE_TOY = {k: v for k, v in SMOKE_K3_MINI.items() if k != "model.moe.quantile_balancing_bins"}
# Variables by which torchrun or an enclosing Lightning run would make the worker believe it is a rank already.
RANK_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


# ---------------------------------------------------------------------------------------------
# Launcher side: the config, the worker process

def build_config(preset: str, devices: int, steps: int, workdir: Path, smoke: bool, seq_len: int | None = None,
                 batch_size: int | None = None, extra: Sequence[str] = ()) -> RunConfig:
    """The run's config: ``preset`` under DDP on ``devices`` ranks for ``steps`` optimizer steps, validated.

    One validation (the last step), no MLflow, checkpoints in ``workdir/run``. ``smoke``: CPU ranks
    and the toy sizes of ``SMOKE_TOY``. ``seq_len`` / ``batch_size`` (per rank) replace
    the size, ``extra`` (``["key=value", ...]``) is applied last. The preset's warmup is cut to
    ``steps`` when longer. Raises ConfigError naming the field."""
    base = load_config(preset)
    over: dict[str, Any] = {**SMOKE_TOY, "data.num_workers": 0} if smoke else dict(GPU_SIZE)
    if seq_len is not None:
        over["data.seq_len"] = seq_len
    if batch_size is not None:
        over["train.batch_size"] = batch_size
    over.update({
        "name": "ddp-check", "train.strategy": "ddp", "train.devices": devices,
        "train.accelerator": "cpu" if smoke else "gpu", "train.max_steps": steps, "train.val_every": steps,
        "train.warmup_steps": min(base.train.warmup_steps, steps), "train.ckpt_dir": str(workdir / "run"),
        "tracking.enabled": False})
    cfg = load_config(preset, over)
    return with_overrides(cfg, extra) if extra else cfg


def run_worker(workdir: Path, timeout_s: float) -> tuple[int | None, float]:
    """Train in a subprocess (``--worker``): ``(exit code or None on timeout, wall seconds)``.

    Its own session, so a timeout ends rank 0 and the ranks Lightning started from it together."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    # Two ranks gain nothing from NVLink multicast, and shared GPU hosts keep it off.
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", str(workdir)], cwd=ROOT,
                            env=env, start_new_session=True)
    try:
        code: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    return code, time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# Worker side: train, then save this rank's state

def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``tensors`` in name order (CPU tensors)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def worker(workdir: Path) -> None:
    """One rank (Lightning starts the others by rerunning this): fit the saved config, save ``rank<r>.pt``."""
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback

    from moelab.model.balance import balanced_routers
    from moelab.train import fit
    from moelab.train.balancer import BalancerCallback
    from moelab.train.runner import resolve_precision

    class Keep(Callback):
        """Keeps the trainer and module for after ``fit`` (when the balancer's own replica check has run)."""

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.trainer, self.module = trainer, pl_module
            self.device = (torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda"
                           else "cpu")
            self.backend = dist.get_backend() if dist.is_initialized() else None

    cfg = load_config(workdir / CONFIG_FILE)
    keep = Keep()
    result = fit(cfg, callbacks=[keep], checkpoints="final")
    trainer, module = keep.trainer, keep.module
    params = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
    biases = {layer: r.bias.detach().cpu().clone() for layer, r in balanced_routers(module)}
    balancer = next((c for c in trainer.callbacks if isinstance(c, BalancerCallback)), None)
    state = {"rank": trainer.global_rank, "world_size": trainer.world_size, "steps": trainer.global_step,
             "device": keep.device, "backend": keep.backend, "precision": resolve_precision(cfg),
             "status": result.status, "params": params, "biases": biases,
             "trajectories": balancer.trajectories() if balancer else None,
             "replicas": balancer.replicas if balancer else None, "history": result.history,
             "hashes": {"weights": digest(params), "biases": digest(biases)}}
    with atomic_path(workdir / f"rank{trainer.global_rank}.pt") as tmp:
        torch.save(state, tmp)
    if dist.is_initialized():
        dist.barrier()  # rank 0 (the process the launcher waits for) ends only after every rank's file is there


# ---------------------------------------------------------------------------------------------
# The comparison

def _compare_group(dumps: Sequence[Mapping[str, Any]], group: str) -> tuple[bool, float, list[str]]:
    """Bitwise comparison of ``dumps[r][group]`` (name -> tensor) with rank 0's: (equal, max |diff|, what differs)."""
    ref = dumps[0][group]
    worst, differ = 0.0, []
    for r, dump in enumerate(dumps[1:], start=1):
        mine = dump[group]
        for name in sorted(set(ref) ^ set(mine)):
            differ.append(f"rank {r}: {name} {'missing' if name in ref else 'extra'}")
        for name in sorted(set(ref) & set(mine)):
            a, b = ref[name], mine[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                differ.append(f"rank {r}: {name} {tuple(b.shape)} {b.dtype} vs {tuple(a.shape)} {a.dtype}")
                continue
            if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                continue
            d = float((a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max())
            worst = max(worst, d)
            differ.append(f"rank {r}: {name} max |diff| {d:.3g}")
    return not differ, worst, differ


def _same(values: Sequence[Any]) -> bool:
    return all(v == values[0] for v in values[1:])


def _maxvio(history: Sequence[Mapping[str, float]], trajectories: Mapping[str, Any] | None) -> dict[str, Any]:
    """MaxVio_batch over training, MaxVio_global at the last validation, and how the biases moved."""
    vio = [r["balance/maxvio_batch"] for r in history if "balance/maxvio_batch" in r]
    tail = vio[-max(1, len(vio) // 5):]
    out: dict[str, Any] = {
        "maxvio_batch_first": vio[0] if vio else None, "maxvio_batch_last": vio[-1] if vio else None,
        "maxvio_batch_last20pct_mean": sum(tail) / len(tail) if vio else None,
        "maxvio_global_last": history[-1].get("val/maxvio_global") if history else None}
    if trajectories is not None and trajectories.get("bias") is not None:
        bias = trajectories["bias"].double()  # [S, L, n]
        out.update({
            "bias_std_first": float(bias[0].std(-1).mean()), "bias_std_last": float(bias[-1].std(-1).mean()),
            "bias_abs_max_last": float(bias[-1].abs().max()),
            "bias_change_last_step": float((bias[-1] - bias[-2]).abs().max()) if len(bias) > 1 else None})
    return out


def compare(dumps: Sequence[Mapping[str, Any]], steps: int, devices: int) -> dict[str, Any]:
    """The verdict's numbers from every rank's ``rank<r>.pt`` (in rank order); ``ok`` when all agree."""
    same_bias, bias_diff, bias_differ = _compare_group(dumps, "biases")
    same_weights, weight_diff, weight_differ = _compare_group(dumps, "params")
    trajectories = [d["trajectories"] for d in dumps]
    same_traj = trajectories[0] is not None and all(
        t is not None and t["step"].tolist() == trajectories[0]["step"].tolist()
        and torch.equal(t["bias"], trajectories[0]["bias"]) and torch.equal(t["load"], trajectories[0]["load"])
        for t in trajectories[1:])
    losses = [[r["train/loss"] for r in d["history"]] for d in dumps]
    norms = [[r["train/grad_norm"] for r in d["history"]] for d in dumps]
    steps_done = [int(d["steps"]) for d in dumps]
    worlds = [int(d["world_size"]) for d in dumps]
    checks = {
        "all_ranks_reported": len(dumps) == devices and worlds == [devices] * devices,
        "steps_done": steps_done == [steps] * len(dumps) and [len(x) for x in losses] == [steps] * len(dumps),
        "identical_biases": same_bias and len(dumps[0]["biases"]) > 0,
        # all-zero biases on every rank would agree without the balancer's collectives ever being tested
        "biases_moved": any(bool(b.ne(0).any()) for b in dumps[0]["biases"].values()),
        "identical_weights": same_weights,
        "identical_bias_trajectories": same_traj,
        "identical_grad_norms": _same(norms),
        "ranks_saw_different_batches": len(dumps) > 1 and not _same(losses),
    }
    hist0 = dumps[0]["history"]
    return {
        "ok": all(checks.values()), **checks,
        "world_size": worlds[0], "steps": steps_done, "backend": dumps[0].get("backend"),
        "devices": [d.get("device") for d in dumps], "precision": dumps[0].get("precision"),
        "status": [d.get("status") for d in dumps],
        "max_abs_diff": {"biases": bias_diff, "weights": weight_diff},
        "differing": (bias_differ + weight_differ)[:20], "n_differing": len(bias_differ) + len(weight_differ),
        "n_bias_tensors": len(dumps[0]["biases"]), "n_bias_values": sum(b.numel() for b in dumps[0]["biases"].values()),
        "n_params": sum(p.numel() for p in dumps[0]["params"].values()), "n_param_tensors": len(dumps[0]["params"]),
        "hashes": {f"rank{d['rank']}": d["hashes"] for d in dumps},
        "balancer_replica_check": [d.get("replicas") for d in dumps],
        "final_train_loss": [x[-1] if x else None for x in losses],
        "final_val_loss": hist0[-1].get("val/loss") if hist0 else None,
        "balance": _maxvio(hist0, trajectories[0]),
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def _same_word(same: bool) -> str:
    return "identical" if same else "DIFFERENT"


def verdict(result: Mapping[str, Any], cfg: RunConfig) -> str:
    """One paragraph for the console: what ran, what agreed, what did not."""
    m = cfg.model.moe
    devices = ", ".join(sorted({str(d) for d in result.get("devices") or []})) or "?"
    what = (f"{result.get('world_size', cfg.train.devices)} ranks ({result.get('backend')}, {devices}) trained "
            f"{cfg.preset} (balancer {m.balancer}/{m.quantile_balancing_mode}, {result.get('precision')}, "
            f"T={cfg.data.seq_len}, B={cfg.train.batch_size} per rank)")
    if "error" in result:
        return f"FAIL: {what}: {result['error']}"
    b, diff = result["balance"], result["max_abs_diff"]
    hashes = sorted({v["weights"][:12] for v in result["hashes"].values()})
    batches = "different batches per rank" if result["ranks_saw_different_batches"] else "SAME batches on every rank"
    text = (f"{what} for {'/'.join(map(str, result['steps']))} optimizer steps. Router biases "
            f"({result['n_bias_tensors']} tensors, {result['n_bias_values']} values): "
            f"{_same_word(result['identical_biases'])} (max |diff| {diff['biases']:.3g}, largest |bias| "
            f"{_fmt(b.get('bias_abs_max_last'))}); parameters "
            f"({result['n_param_tensors']} tensors, {result['n_params'] / 1e6:.1f}M values): "
            f"{_same_word(result['identical_weights'])} (max |diff| {diff['weights']:.3g}; sha256 "
            f"{', '.join(hashes)}); bias and load trajectories {_same_word(result['identical_bias_trajectories'])} "
            f"over all steps; gradient norms {_same_word(result['identical_grad_norms'])}; final train loss per rank "
            f"{', '.join(_fmt(x) for x in result['final_train_loss'])} ({batches}), val loss "
            f"{_fmt(result['final_val_loss'])}; MaxVio_batch {_fmt(b['maxvio_batch_first'])} -> "
            f"{_fmt(b['maxvio_batch_last'])} (last 20%: {_fmt(b['maxvio_batch_last20pct_mean'])}), "
            f"MaxVio_global {_fmt(b['maxvio_global_last'])}.")
    if result["differing"]:
        text += f" Differs ({result['n_differing']}): {'; '.join(result['differing'][:5])}."
    failed = [k for k, v in result.items() if isinstance(v, bool) and k != "ok" and not v]
    return ("PASS: " if result["ok"] else f"FAIL ({', '.join(failed)}): ") + text


# ---------------------------------------------------------------------------------------------

def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _meta(args: argparse.Namespace, cfg: RunConfig, date: str) -> dict[str, Any]:
    """Called after training: a CUDA query would otherwise hold a context on GPU 0 throughout."""
    import lightning
    import triton

    cuda = torch.cuda.is_available() and not args.smoke
    return {"gpu": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": torch.cuda.device_count() if cuda else 0,
            "torch": torch.__version__, "triton": triton.__version__, "lightning": lightning.__version__,
            "nccl": _nccl_version() if cuda else None, "python": platform.python_version(), "date": date,
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "commit": args.commit,
            "smoke": args.smoke, "preset": cfg.preset, "overrides": list(args.set),
            "config": {"seq_len": cfg.data.seq_len, "batch_size_per_rank": cfg.train.batch_size,
                       "tokens_per_step": cfg.data.seq_len * cfg.train.batch_size * cfg.train.devices,
                       "devices": cfg.train.devices, "max_steps": cfg.train.max_steps,
                       "balancer": cfg.model.moe.balancer,
                       "quantile_balancing_mode": cfg.model.moe.quantile_balancing_mode,
                       "deterministic": cfg.train.deterministic}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=2, help="data-parallel ranks (GPUs; CPU processes with --smoke)")
    ap.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default 100; --smoke {SMOKE_STEPS})")
    ap.add_argument("--config", default="k3-mini", help="preset or YAML path (default k3-mini)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help=f"tokens per sequence (default {GPU_SIZE['data.seq_len']})")
    ap.add_argument("--batch-size", type=int, default=None,
                    help=f"sequences per rank and step (default {GPU_SIZE['train.batch_size']})")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config override")
    ap.add_argument("--out", default="kernels/results/ddp_check.json", help="JSON output path")
    ap.add_argument("--commit", default=git_commit(),
                    help="the moelab commit checked (default: git rev-parse HEAD here)")
    ap.add_argument("--workdir", default=None,
                    help="folder for the run and the rank files (default: a temporary folder, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (rank<r>.pt, the run's checkpoint)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds before training is stopped (default 540)")
    ap.add_argument("--smoke", action="store_true", help="CPU: gloo ranks, k3-mini's structure at toy sizes")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        worker(Path(args.worker))
        return 0
    steps = args.steps if args.steps is not None else (SMOKE_STEPS if args.smoke else 100)
    if args.devices < 2:
        ap.error(f"--devices={args.devices} is not allowed: a replica check needs >= 2 ranks")
    if steps < 2:
        ap.error(f"--steps={steps} is not allowed: expected >= 2 (the bias trajectory needs two steps)")
    if not args.smoke and torch.cuda.device_count() < args.devices:
        print(f"check_ddp.py: --devices={args.devices} needs that many CUDA devices, this machine has "
              f"{torch.cuda.device_count()} (--smoke runs the CPU check)", file=sys.stderr)
        return 2

    if args.workdir and Path(args.workdir).is_dir() and any(Path(args.workdir).iterdir()):
        ap.error(f"--workdir={args.workdir} is not empty: give a new or empty folder")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="moelab-ddp-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        try:
            cfg = build_config(args.config, args.devices, steps, workdir, args.smoke, args.seq_len, args.batch_size,
                               args.set)
        except ConfigError as e:
            ap.error(str(e))
        (workdir / CONFIG_FILE).write_text(to_yaml(cfg))
        code, wall = run_worker(workdir, args.timeout)
        files = [workdir / f"rank{r}.pt" for r in range(args.devices)]
        if code != 0 or not all(f.is_file() for f in files):
            why = "timed out" if code is None else f"exit code {code}"
            result: dict[str, Any] = {"ok": False, "error": f"training {why} after {wall:.0f} s; rank files found: "
                                      f"{[f.name for f in files if f.is_file()]}"}
        else:
            result = compare([torch.load(f, weights_only=False, mmap=True) for f in files], steps, args.devices)
        result["wall_s"] = wall
        summary = workdir / "run" / "summary.json"  # rank 0's run summary (moelab.train.runner)
        if summary.is_file():
            run = json.loads(summary.read_text())
            result["run_summary"] = {k: run.get(k) for k in RUN_SUMMARY_KEYS}
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    write_json(args.out, {"meta": _meta(args, cfg, date), "result": result})
    print(verdict(result, cfg), flush=True)
    print(f"check_ddp.py: wrote {args.out}" + (f"; work folder kept: {workdir}" if args.keep else ""))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
