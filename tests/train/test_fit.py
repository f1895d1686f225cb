"""fit(): MLflow records, exact resume after Ctrl-C, SIGTERM, the NaN guard, FAILED on a crash."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from moelab.model.config import ConfigError
from moelab.train import NonFiniteLossError, fit, load_model
from moelab.train.callbacks import Interrupted
from moelab.train.runner import check_vocab, sha256_file
from tests.helpers import assert_close
from tests.train.helpers import AtStep, tiny_config


def _run(uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return client, client.get_run(run_id)


class FinalWeights(Callback):
    """Keeps a copy of the model's weights as training ends (before anything is reloaded)."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def test_fit_records_everything_in_mlflow(tmp_path, tracking_uri) -> None:
    cfg = tiny_config(tmp_path / "ckpt", tracking_uri, name="my-run", train__max_steps=10, train__val_every=5,
                      train__log_every=2)
    final = FinalWeights()
    result = fit(cfg, callbacks=[final])

    assert [int(r["step"]) for r in result.history] == list(range(1, 11))
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in result.history)
    assert [s for s, _ in result.val_history] == [5, 10]
    for name in ("config.yaml", "last.ckpt", "best.ckpt", "history.csv", "summary.json"):
        assert (tmp_path / "ckpt" / name).is_file(), name
    for name in ("last.ckpt", "best.ckpt"):  # sha256sum -c format
        path = tmp_path / "ckpt" / name
        assert (tmp_path / "ckpt" / f"{name}.sha256").read_text() == f"{sha256_file(path)}  {name}\n"
    assert result.summary["steps"] == 10 and result.summary["tok_per_s"] > 0
    assert result.summary["mfu"] is None and result.summary["precision"] == "32-true"  # CPU

    client, run = _run(tracking_uri, result.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "my-run"
    # Artifacts beside the database (not at the filesystem root, as a four-slash file URI had it).
    assert run.info.artifact_uri.startswith((tmp_path / "mlruns").as_uri() + "/"), run.info.artifact_uri
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "train/tiny" and exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["moelab.preset"] == "tiny"
    params = run.data.params
    assert params["model.d_model"] == str(cfg.model.d_model) and params["train.lr"] == str(cfg.train.lr)
    assert params["run.params_total"] == str(result.summary["params_total"])
    assert params["run.world_size"] == "1" and params["run.tokens_per_step"] == str(8 * 64)
    # Metrics only for what changes; train/* and perf/* at the same optimizer steps.
    metrics = set(run.data.metrics)
    assert {"train/loss", "train/lr", "val/loss", "val/best_loss", "perf/tokens_per_s"} <= metrics
    assert "epoch" not in metrics and not any(k.startswith("final/") for k in metrics), sorted(metrics)
    assert any(k.startswith("system/") for k in metrics), sorted(metrics)
    steps = {k: [m.step for m in client.get_metric_history(result.run_id, k)] for k in metrics
             if not k.startswith("system/")}
    assert all(len(v) >= 2 for v in steps.values()), steps
    assert steps["train/loss"] == [2, 4, 6, 8, 10] and steps["val/loss"] == [5, 10]
    assert set(steps["perf/tokens_per_s"]) <= set(steps["train/loss"])
    losses = client.get_metric_history(result.run_id, "train/loss")
    assert all(math.isfinite(m.value) for m in losses)
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"loss_curve.png", "metrics_table.json", "summary.json", "config.yaml", "model_summary.txt"} <= artifacts
    table = client.load_table(run.info.experiment_id, "metrics_table.json", run_ids=[result.run_id])
    assert len(table) == 10 and "train/loss" in table.columns

    model, loaded_cfg = load_model(result.last_checkpoint)
    assert loaded_cfg.model == cfg.model and not model.training
    # The weights the trainer held at its end (caught in memory, not read from the file) come back exactly.
    trained = final.state
    assert set(model.state_dict()) == set(trained)
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_resume_after_ctrl_c_matches_an_uninterrupted_run(tmp_path, tracking_uri) -> None:
    n = 12
    straight = fit(tiny_config(tmp_path / "a", None, train__max_steps=n, train__val_every=4))

    cfg = tiny_config(tmp_path / "b", tracking_uri, train__max_steps=n, train__val_every=4)
    ctrl_c = AtStep(n // 2 - 1, lambda trainer, module: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt, match="resume from"):
        fit(cfg, callbacks=[ctrl_c])
    ckpt = torch.load(tmp_path / "b" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == n // 2
    client, first = _run(tracking_uri, ckpt["moelab"]["mlflow_run_id"])
    assert first.info.status == "KILLED"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored

    first_rows = (tmp_path / "b" / "history.csv").read_text().splitlines()
    assert len(first_rows) == 1 + n // 2
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["status"] == "interrupted"

    resumed = fit(cfg, resume=True)
    # The whole run's history, in the result and in history.csv: the first part is kept, not replaced.
    assert [int(r["step"]) for r in resumed.history] == list(range(1, n + 1))
    rows = (tmp_path / "b" / "history.csv").read_text().splitlines()
    assert rows[:len(first_rows)] == first_rows and len(rows) == 1 + n
    assert [s for s, _ in resumed.val_history] == [4, 6, 8, 12]
    # Bitwise on CPU, as the README promises: the same losses, weights and optimizer state.
    assert [r["train/loss"] for r in straight.history] == [r["train/loss"] for r in resumed.history]
    a = torch.load(tmp_path / "a" / "last.ckpt", map_location="cpu", weights_only=False)
    b = torch.load(tmp_path / "b" / "last.ckpt", map_location="cpu", weights_only=False)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(sa[n], sb[n]) for n in sa)
    _, second = _run(tracking_uri, resumed.run_id)
    assert second.data.tags["moelab.resumed_from_run"] == first.info.run_id
    assert second.info.status == "FINISHED"


def test_gradient_accumulation_equals_one_batch_of_twice_the_size(tmp_path) -> None:
    """accumulate_grad_batches=2 of 4 sequences sees the same 8 windows per step as 8 at once (the sampler
    numbers micro-steps), and Lightning scales each micro-batch loss by 1/2: the same gradient norms and
    weights up to fp32 summation order. (A loss whose backward ignored that scale doubles the norm.)"""
    base = {"train__max_steps": 3, "train__val_every": 3, "train__warmup_steps": 1}
    one = fit(tiny_config(tmp_path / "one", None, train__batch_size=8, **base))
    two = fit(tiny_config(tmp_path / "two", None, train__batch_size=4, train__accumulate_grad_batches=2, **base))
    norms = [torch.tensor([r["train/grad_norm"] for r in res.history]) for res in (one, two)]
    assert_close(norms[0], norms[1], 1e-5, "grad norms")
    a = torch.load(tmp_path / "one" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "two" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    for k in a:
        if a[k].is_floating_point():
            assert_close(a[k], b[k], 2e-4, k)  # measured 5e-5 (Adam divides by small second moments)


def test_sigterm_stops_cleanly_and_marks_the_run_killed(tmp_path, tracking_uri) -> None:
    cfg = tiny_config(tmp_path / "ckpt", tracking_uri, train__max_steps=8, train__val_every=3)
    term = AtStep(3, lambda trainer, module: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(Interrupted, match="SIGTERM at step 4") as err:
        fit(cfg, callbacks=[term])
    assert err.value.signum == signal.SIGTERM
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["global_step"] == 4  # the step under way finished, then validation and a checkpoint
    summary = json.loads((tmp_path / "ckpt" / "summary.json").read_text())
    assert summary["status"] == "terminated" and summary["steps"] == 4
    assert _run(tracking_uri, state["moelab"]["mlflow_run_id"])[1].info.status == "KILLED"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_non_finite_loss_stops_with_step_metric_and_last_good_checkpoint(tmp_path, tracking_uri) -> None:
    cfg = tiny_config(tmp_path / "ckpt", tracking_uri, train__max_steps=20, train__val_every=2)
    poison = AtStep(5, lambda trainer, module: module.model.lm_head.weight.data.fill_(float("nan")))
    with pytest.raises(NonFiniteLossError) as err:
        fit(cfg, callbacks=[poison])
    last = tmp_path / "ckpt" / "last.ckpt"
    message = str(err.value)
    assert "train/loss=nan at step 6" in message and f"{last} (step 4, val/loss " in message, message
    assert err.value.step == 6 and err.value.last_good == last
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert state["global_step"] == 4
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
    runs = _run(tracking_uri, state["moelab"]["mlflow_run_id"])[1]
    assert runs.info.status == "FAILED"
    summary = json.loads((tmp_path / "ckpt" / "summary.json").read_text())
    assert summary["status"] == "failed" and "NonFiniteLossError" in summary["error"]


class PoisonBeforeValidation(Callback):
    """Sets one weight to NaN just before the validation at ``step``: the loss has not seen it yet."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            pl_module.model.lm_head.weight.data[0, 0] = float("nan")


def test_non_finite_weights_never_replace_the_last_good_checkpoint(tmp_path) -> None:
    cfg = tiny_config(tmp_path / "ckpt", None, train__max_steps=20, train__val_every=2)
    with pytest.raises(NonFiniteLossError, match=r"weight model.lm_head.weight=nan at step 4") as err:
        fit(cfg, callbacks=[PoisonBeforeValidation(4)])
    last = tmp_path / "ckpt" / "last.ckpt"
    assert err.value.last_good == last
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert state["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())


def test_crash_marks_the_run_failed(tmp_path, tracking_uri) -> None:
    def boom(trainer, module):
        raise RuntimeError("injected failure")

    cfg = tiny_config(tmp_path / "ckpt", tracking_uri, train__max_steps=6, train__val_every=3)
    with pytest.raises(RuntimeError, match="injected failure"):
        fit(cfg, callbacks=[AtStep(2, boom)])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"


def test_vocab_checks(tmp_path) -> None:
    cfg = tiny_config(tmp_path)
    with pytest.raises(ConfigError, match=r"model.vocab_size=512 .* 600 ids"):
        check_vocab(cfg, 600)
    with pytest.warns(UserWarning, match="fewer than model.vocab_size"):
        check_vocab(cfg, 500)


def test_resume_without_a_checkpoint_says_where_it_looked(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"last.ckpt does not exist"):
        fit(tiny_config(tmp_path / "empty"), resume=True)
