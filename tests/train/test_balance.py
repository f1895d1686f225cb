"""The balancer's training side: one update per optimizer step under gradient accumulation, exact
resume of the bias trajectory, and LitMoELab wiring (metrics in the history, MaxVio_global, errors)."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from moelab.model.config import ConfigError
from moelab.train import fit
from moelab.train.balancer import BalancerCallback, compare_replicas, load_heatmap
from tests.helpers import assert_close
from tests.train.balance_probe import Probe, batches, trainer
from tests.train.helpers import tiny_config


def _run(module: Probe, steps: int, root: Path, **kwargs) -> BalancerCallback:
    callback = BalancerCallback()
    trainer(steps, callback, root, **kwargs).fit(module)
    return callback


def test_two_micro_batches_give_the_bias_trajectory_of_one_batch(tmp_path: Path) -> None:
    data = batches(3, 4)
    whole = _run(Probe(data), 3, tmp_path / "a").trajectories()
    parts = _run(Probe(data, micro_batches=2), 3, tmp_path / "b", accumulate_grad_batches=2).trajectories()
    assert whole["step"].tolist() == parts["step"].tolist() == [1, 2, 3]  # one update per optimizer step
    assert torch.equal(whole["load"], parts["load"])
    assert_close(whole["bias"], parts["bias"], 1e-6, "bias trajectory")
    assert whole["bias"][-1].abs().amin(-1).gt(0).all()  # every rule moved every layer's bias


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resume_reproduces_the_bias_trajectory(tmp_path: Path) -> None:
    data = batches(1, 4).repeat(4, 1, 1)  # the same batch every step: resume cannot pick other data
    straight_module = Probe(data, lr=1e-2, adam=True)
    straight = _run(straight_module, 4, tmp_path / "a").trajectories()

    first = Probe(data, lr=1e-2, adam=True)
    t = trainer(2, BalancerCallback(), tmp_path / "b")
    t.fit(first)
    t.save_checkpoint(tmp_path / "b" / "step2.ckpt")
    resumed_module = Probe(data, lr=1e-2, adam=True)
    callback = BalancerCallback()
    trainer(4, callback, tmp_path / "b").fit(resumed_module, ckpt_path=tmp_path / "b" / "step2.ckpt")
    resumed = callback.trajectories()

    # The checkpoint carries the trajectories: the resumed callback holds steps 1-2 too.
    assert resumed["step"].tolist() == [1, 2, 3, 4] and resumed["layers"] == straight["layers"]
    assert torch.equal(straight["load"], resumed["load"])
    assert_close(straight["bias"], resumed["bias"], 0.0, "resumed bias trajectory")
    ref, out = straight_module.state_dict(), resumed_module.state_dict()
    assert any(k.endswith("load_avg") for k in ref)  # quantile_load's moving average is checkpointed
    for k in ref:
        assert_close(ref[k].float(), out[k].float(), 0.0, k)


@pytest.mark.slow  # three tiny fit() runs: ~15 s
@pytest.mark.parametrize("balancer", ["quantile_balancing", "quantile_load"])
def test_fit_resume_continues_the_bias_trajectory(tmp_path: Path, balancer: str) -> None:
    """Through ``fit`` (LitMoELab adds its own BalancerCallback): a run stopped at step 4 and resumed
    ends with the biases, balancer state and weights of the uninterrupted run, bitwise on CPU."""
    from tests.train.helpers import AtStep

    n = 8
    base = {"train__max_steps": n, "train__val_every": n, "model__moe__balancer": balancer}
    fit(tiny_config(tmp_path / "a", None, **base))
    cfg = tiny_config(tmp_path / "b", None, **base)

    def stop(trainer, module) -> None:  # Ctrl-C, as a user stops a run
        os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt, match="resume from"):
        fit(cfg, callbacks=[AtStep(n // 2 - 1, stop)])
    half = torch.load(tmp_path / "b" / "last.ckpt", map_location="cpu", weights_only=False)
    assert half["global_step"] == n // 2
    fit(cfg, resume=True)
    a, b = (torch.load(tmp_path / x / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
            for x in ("a", "b"))
    biases = [k for k in a if k.endswith("router.bias")]
    assert biases and all(a[k].abs().amax() > 0 for k in biases), biases  # the balancer moved them
    assert not any(torch.equal(half["state_dict"][k], a[k]) for k in biases)  # and kept moving after step 4
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_balancer_time_is_measured_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moelab.train.balancer as train_balance

    update = train_balance.balance_step

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return update(*args, **kwargs)

    monkeypatch.setattr(train_balance, "balance_step", slow)
    callback = _run(Probe(batches(3, 4)), 3, tmp_path)
    assert [s for s, _, _ in callback.timings] == [1, 2, 3]
    assert all(ms >= 50 for _, ms, _ in callback.timings)
    shares = [share for _, _, share in callback.timings]
    assert shares[0] is None and all(0.0 < x < 1.0 for x in shares[1:])  # no previous update to measure from
    summary = callback.summary()
    assert summary["balancer_ms"] >= 50 and 0 < summary["balancer_share"] < 1 and summary["maxvio_global"] is None


class _Grab(Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.balancer = next(c for c in trainer.callbacks if isinstance(c, BalancerCallback))


def test_fit_logs_the_balancer_to_mlflow_and_the_run_folder(tmp_path: Path, tracking_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    cfg = tiny_config(tmp_path / "ckpt", tracking_uri, train__max_steps=4, train__warmup_steps=1,
                      train__val_every=2, train__log_every=2, model__moe__balancer="quantile_balancing")
    grab = _Grab()
    result = fit(cfg, callbacks=[grab])
    row = result.history[-1]
    for metric in ("maxvio_batch", "load_cv", "dead_experts", "router_entropy"):
        assert math.isfinite(row[f"balance/{metric}/L1"]) and row[f"balance/{metric}"] == row[f"balance/{metric}/L1"]
    assert 0 < row["balance/router_entropy"] <= math.log(cfg.model.moe.num_experts) + 1e-6
    assert row["perf/balancer_ms"] > 0 and 0 < row["perf/balancer_share"] < 1
    cb = grab.balancer
    assert [s for s, _ in cb.val_history] == [2, 4] and all(v.shape == (1,) for _, v in cb.val_history)
    assert row["val/maxvio_global"] == row["val/maxvio_global/L1"] == pytest.approx(float(cb.val_history[-1][1][0]))
    state = torch.load(result.last_checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    assert_close(cb.trajectories()["bias"][-1, 0], state["model.layers.1.ffn.router.bias"], 0.0, "bias in ckpt")

    # Through the real tracking path: the names, at the train/* and val/* steps.
    client = MlflowClient(tracking_uri)
    run = client.get_run(result.run_id)
    per_layer = [f"balance/{m}/L1" for m in ("maxvio_batch", "load_cv", "dead_experts", "router_entropy")]
    for name in [*per_layer, "balance/maxvio_batch", "perf/balancer_ms", "perf/balancer_share", "train/loss"]:
        assert [m.step for m in client.get_metric_history(result.run_id, name)] == [2, 4], name
    for name in ("val/maxvio_global", "val/maxvio_global/L1", "val/loss"):
        history = client.get_metric_history(result.run_id, name)
        assert [m.step for m in history] == [2, 4], name
    assert history[-1].value == pytest.approx(row["val/loss"])
    logged = client.get_metric_history(result.run_id, "balance/maxvio_batch/L1")[-1].value
    assert logged == pytest.approx(row["balance/maxvio_batch/L1"])
    params = run.data.params  # the coefficients, as params
    assert params["model.moe.balancer"] == "quantile_balancing"
    assert params["model.moe.quantile_balancing_mode"] == "exact" and params["model.moe.aux_loss_alpha"] == "0.01"
    assert {"load_heatmap.png", "balance_trajectories.pt"} <= {a.path for a in client.list_artifacts(result.run_id)}

    # The run folder: the heatmap, the trajectories behind it, the balancer's summary.
    folder = tmp_path / "ckpt"
    assert (folder / "load_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    traj = torch.load(folder / "balance_trajectories.pt", weights_only=False)
    assert traj["step"].tolist() == [1, 2, 3, 4] and traj["layers"] == ["L1"]
    k = cfg.model.moe.top_k
    assert (traj["load"].sum(-1) == cfg.train.batch_size * cfg.data.seq_len * k).all()
    assert_close(traj["bias"][-1, 0], state["model.layers.1.ffn.router.bias"], 0.0, "saved bias trajectory")
    summary = result.summary
    assert summary["balancer_ms"] > 0 and 0 < summary["balancer_share"] < 1
    assert summary["maxvio_global"] == pytest.approx(row["val/maxvio_global"])
    fig = load_heatmap(traj["step"], traj["load"], traj["layers"])
    assert len(fig.axes) == 2  # one panel per MoE layer + the colour bar


def test_compare_replicas_finds_a_differing_bias_or_weight() -> None:
    def two_ranks(mine: Probe, other: Probe) -> dict[str, bool]:
        seen = []
        compare_replicas(other, lambda t: seen.append(t) or t[None])  # what rank 1 would send
        return compare_replicas(mine, lambda t: torch.stack([t, seen[0]]))

    a, b = Probe(batches(1, 4)), Probe(batches(1, 4))
    assert two_ranks(a, b) == {"bias": True, "weights": True}
    with torch.no_grad():
        b.models[2].layers[1].ffn.router.bias[3] += 1e-6
    assert two_ranks(a, b) == {"bias": False, "weights": True}
    c = Probe(batches(1, 4))
    with torch.no_grad():
        c.models[0].layers[0].ffn.w_out.view(-1)[5] += 1e-6
    assert two_ranks(a, c) == {"bias": True, "weights": False}


def test_fit_refuses_quantile_balancing_with_a_fractional_target(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=2, train__warmup_steps=1,
                      model__moe__balancer="quantile_balancing", model__moe__num_experts=3)
    with pytest.raises(ConfigError, match=r"512 tokens per optimizer step .* k=2, n=3 .* multiple of 3"):
        fit(cfg)


def test_k3_mini_turns_every_k3_technique_on() -> None:
    from moelab.config import load_config
    from moelab.model.balance import qb_target

    cfg = load_config("k3-mini")
    cfg.check_trainable()
    m, k3 = cfg.model, load_config("k3").model
    kinds = m.layer_types()
    assert m.pattern == k3.pattern and m.final_mla and kinds[-1] == "mla"
    assert kinds.count("kda") == 3 * (kinds.count("mla") - 1)  # 3:1 before the final MLA, as in K3
    assert m.kda.gate == "bounded" and m.kda.g_min == k3.kda.g_min
    assert (m.mla.output_gate, m.mla.fp32_output, m.mla.q_latent_dim > 0) == (True, True, True)
    assert (m.residual.mode, m.residual.num_blocks) == ("block_attnres", k3.residual.num_blocks)
    assert m.moe.num_shared == k3.moe.num_shared and m.moe.latent_dim * 2 == m.d_model
    assert m.moe.activation == m.dense_activation == "situ_glu"
    assert m.moe.num_experts >= 64 and m.moe.top_k == 8 and m.moe.balancer == "quantile_balancing"
    assert qb_target(cfg.train.batch_size * cfg.data.seq_len, m.moe.top_k, m.moe.num_experts) > 0
