"""kernels/check_ddp.py, the data-parallel replica check: its comparison catches a one-ulp difference in
one rank's weights or biases, and its --smoke (2 gloo ranks training k3-mini's structure at toy
sizes through moelab.train.fit) passes end to end."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("check_ddp", ROOT / "kernels" / "check_ddp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_ddp = _script()
STEPS = 3


def _dump(rank: int, losses: list[float]) -> dict[str, Any]:
    """A rank file as the worker writes it: 2 routers of 4 experts, two parameters, STEPS steps of history."""
    g = torch.Generator().manual_seed(0)  # the same replica on every rank
    params = {"model.w": torch.randn(3, 5, generator=g), "model.norm": torch.randn(5, generator=g)}
    biases = {"L1": torch.randn(4, generator=g), "L2": torch.randn(4, generator=g)}
    bias_traj = torch.randn(STEPS, 2, 4, generator=g)
    bias_traj[-1] = torch.stack([biases["L1"], biases["L2"]])
    history = [{"step": float(s + 1), "train/loss": loss, "train/grad_norm": 0.5 + s,
                "balance/maxvio_batch": 1.0 / (s + 1)} for s, loss in enumerate(losses)]
    history[-1].update({"val/loss": 2.5, "val/maxvio_global": 0.1})
    return {"rank": rank, "world_size": 2, "steps": STEPS, "device": "cpu", "backend": "gloo",
            "precision": "32-true", "status": "finished", "params": params, "biases": biases,
            "trajectories": {"layers": ["L1", "L2"], "step": torch.arange(1, STEPS + 1), "bias": bias_traj,
                             "load": torch.full((STEPS, 2, 4), 6)},
            "replicas": {"bias": True, "weights": True}, "history": history,
            "hashes": {"weights": check_ddp.digest(params), "biases": check_ddp.digest(biases)}}


def _ranks() -> list[dict[str, Any]]:
    return [_dump(0, [3.0, 2.9, 2.8]), _dump(1, [3.1, 2.7, 2.85])]


def test_equal_ranks_pass() -> None:
    result = check_ddp.compare(_ranks(), STEPS, 2)
    assert result["ok"] and result["max_abs_diff"] == {"biases": 0.0, "weights": 0.0} and result["differing"] == []
    assert result["hashes"]["rank0"] == result["hashes"]["rank1"]
    assert result["final_train_loss"] == [2.8, 2.85] and result["final_val_loss"] == 2.5
    assert result["balance"]["maxvio_batch_first"] == 1.0 and result["balance"]["maxvio_global_last"] == 0.1


@pytest.mark.parametrize("group, name, check", [("params", "model.w", "identical_weights"),
                                                ("biases", "L2", "identical_biases")])
def test_one_ulp_on_one_rank_fails(group: str, name: str, check: str) -> None:
    dumps = _ranks()
    flat = dumps[1][group][name].view(-1)
    flat[2] = torch.nextafter(flat[2], torch.tensor(float("inf")))
    ulp = float(flat[2].double() - dumps[0][group][name].view(-1)[2].double())
    assert ulp > 0
    result = check_ddp.compare(dumps, STEPS, 2)
    assert not result["ok"] and not result[check]
    other = "identical_biases" if check == "identical_weights" else "identical_weights"
    assert result[other]
    assert result["max_abs_diff"]["biases" if group == "biases" else "weights"] == ulp
    assert result["differing"] == [f"rank 1: {name} max |diff| {ulp:.3g}"]
    assert check_ddp.digest(dumps[0][group]) != check_ddp.digest(dumps[1][group])
    assert check_ddp.verdict(result, check_ddp.load_config("k3-mini")).startswith(f"FAIL ({check}")


def test_other_disagreements_fail() -> None:
    cases = {
        "identical_bias_trajectories": lambda d: d[1]["trajectories"]["load"][0, 0].add_(1),
        "identical_grad_norms": lambda d: d[1]["history"][1].update({"train/grad_norm": 9.0}),
        "ranks_saw_different_batches": lambda d: d[1].update(history=copy.deepcopy(d[0]["history"])),
        "steps_done": lambda d: d[1].update(steps=STEPS - 1),
        "all_ranks_reported": lambda d: d.pop(),
        "biases_moved": lambda d: [b.zero_() for r in d for b in r["biases"].values()],
    }
    for check, spoil in cases.items():
        dumps = _ranks()
        spoil(dumps)
        result = check_ddp.compare(dumps, STEPS, 2)
        assert not result["ok"] and not result[check], check


def test_config_is_the_preset_under_ddp(tmp_path: Path) -> None:
    cfg = check_ddp.build_config("k3-mini", 2, 100, tmp_path, smoke=False,
                                 extra=["model.moe.quantile_balancing_ema=0.5"])
    preset = check_ddp.load_config("k3-mini")
    assert (cfg.train.strategy, cfg.train.devices, cfg.train.accelerator) == ("ddp", 2, "gpu")
    assert (cfg.train.max_steps, cfg.train.val_every, cfg.data.seq_len, cfg.train.batch_size) == (100, 100, 1024, 4)
    assert cfg.model.moe.quantile_balancing_ema == 0.5 and not cfg.tracking.enabled
    assert cfg.train.ckpt_dir == str(tmp_path / "run")
    cfg.model.moe.quantile_balancing_ema = preset.model.moe.quantile_balancing_ema
    assert cfg.model == preset.model  # the preset's model, not a look-alike
    assert cfg.train.precision == preset.train.precision and cfg.train.lr == preset.train.lr
    short = check_ddp.build_config("k3-mini", 2, 10, tmp_path, smoke=False, seq_len=512, batch_size=2)
    assert (short.train.warmup_steps, short.data.seq_len, short.train.batch_size) == (10, 512, 2)


def test_bad_override_is_refused_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        check_ddp.main(["--smoke", "--set", "train.lr=-1", "--workdir", str(tmp_path / "w"), "--out",
                        str(tmp_path / "x.json")])
    assert e.value.code == 2 and "train.lr" in capsys.readouterr().err
    assert not (tmp_path / "w").exists() and not (tmp_path / "x.json").exists()


@pytest.mark.slow  # two training processes: ~40 s on 2 busy cores
def test_smoke_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    env = {k: v for k, v in os.environ.items() if k not in check_ddp.RANK_VARIABLES}
    proc = subprocess.run([sys.executable, "kernels/check_ddp.py", "--smoke", "--out", str(out), "--commit", "abc123",
                           "--workdir", str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads(out.read_text())
    meta, result = data["meta"], data["result"]
    assert meta["commit"] == "abc123" and meta["preset"] == "k3-mini" and meta["smoke"]
    assert {"gpu", "torch", "triton", "lightning", "date", "command"} <= set(meta)
    run = meta["config"]
    assert (run["balancer"], run["quantile_balancing_mode"]) == ("quantile_balancing", "histogram")
    assert result["ok"] and result["world_size"] == 2 and result["backend"] == "gloo"
    assert result["steps"] == [check_ddp.SMOKE_STEPS] * 2 and result["status"] == ["finished"] * 2
    assert result["identical_biases"] and result["identical_weights"] and result["biases_moved"]
    assert result["hashes"]["rank0"] == result["hashes"]["rank1"]
    assert result["balancer_replica_check"] == [{"bias": True, "weights": True}] * 2  # the callback agrees
    assert result["final_train_loss"][0] != result["final_train_loss"][1]
    assert result["run_summary"]["status"] == "finished" and result["run_summary"]["replicas_identical"] is True
    assert result["balance"]["bias_abs_max_last"] > 0 and result["balance"]["maxvio_global_last"] is not None
    assert proc.stdout.splitlines()[-2].startswith("PASS: 2 ranks (gloo, cpu) trained k3-mini")
    assert not (tmp_path / "work").exists()  # removed without --keep
