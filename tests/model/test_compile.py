"""``train.compile``: none | default | graphs | compiled_graphs (``moelab.train.module``).

``default`` (``model.compile()``): dynamo traces the model with graph breaks at the parts that run
eagerly (the fused KDA op, the grouped-GEMM experts) and computes the same loss and gradients as the
eager model; the ``eager`` backend checks the tracing without a C++/Triton compile, the ``slow`` test
trains through inductor. ``graphs`` (the whole step as one CUDA graph, ``CapturedStep``) needs CUDA: on
the CPU a clear error; its Lightning wiring (manual optimization, schedule, step count, balancer records)
runs on the CPU with the capture left out and trains as the automatic loop does; on a GPU (``gpu`` tests)
the captured steps give the eager steps' losses.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from moelab.base import ConfigError
from moelab.config import load_config
from moelab.model import MoELab
from moelab.train.module import CapturedStep, LitMoELab, compile_model, train_step_fn
from tests.train.helpers import EagerStep


@pytest.fixture(autouse=True)
def _restore_dynamo_config():
    """compile_model sets process-wide dynamo flags: put them back after each test."""
    dyn = torch._dynamo.config
    saved = dyn.recompile_limit, dyn.fail_on_recompile_limit_hit
    yield
    dyn.recompile_limit, dyn.fail_on_recompile_limit_hit = saved


def tiny_lit(**overrides) -> LitMoELab:
    cfg = load_config("tiny", {"tracking.enabled": False, **overrides})
    torch.manual_seed(0)
    return LitMoELab(cfg)


def batches(vocab: int, n: int, B: int = 2, T: int = 32, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (B, T + 1), generator=gen).to(device)
        out.append({"input_ids": ids[:, :-1].contiguous(), "targets": ids[:, 1:].contiguous()})
    return out


def test_compiled_model_matches_eager():
    cfg = load_config("tiny", {})
    torch.manual_seed(0)
    model = MoELab(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(x, x).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compile_model(model, "default", torch.device("cpu"), backend="eager")
    loss_c = model(x, x).loss
    loss_c.backward()
    assert torch.allclose(loss_c, loss, rtol=1e-6, atol=1e-6)
    assert grads, "no parameter got a gradient"
    for n, g in grads.items():
        gc = dict(model.named_parameters())[n].grad
        assert gc is not None, n
        torch.testing.assert_close(gc, g, rtol=1e-5, atol=1e-6, msg=n)


def test_compile_passes_float_args_as_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """inductor would hand a Python float (an eps, a scale) to our Triton kernels as fp64 where Triton's own launcher
    passes fp32; compile_model turns that off, so compiled kernels compute in the precision eager ones do. (On an
    H100 the MoE combine's backward failed to compile with it on: its loop-carried fp32 dgamma turned fp64.)"""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "_use_fp64_for_unbacked_floats"):
        pytest.skip("this torch has no such inductor setting")
    model = MoELab(load_config("tiny", {}).model)
    seen: dict = {}
    monkeypatch.setattr(model, "compile", lambda **kw: seen.update(kw))
    compile_model(model, "default", torch.device("cpu"))
    assert seen == {"backend": "inductor", "options": {"_use_fp64_for_unbacked_floats": False}}
    torch.compile(torch.nn.Identity(), options=seen["options"])  # an option torch.compile accepts
    seen.clear()
    compile_model(model, "default", torch.device("cpu"), backend="eager")
    assert seen == {"backend": "eager"}


def test_compile_modes() -> None:
    """none leaves the model eager, and graphs too (it captures the step, not the model) where CUDA is; default
    compiles it and makes a recompile loop an error; bad modes and combinations name what is allowed."""
    model = MoELab(load_config("tiny", {}).model)
    compile_model(model, "none", torch.device("cpu"))
    assert model._compiled_call_impl is None
    compile_model(model, "graphs", torch.device("cuda"))
    assert model._compiled_call_impl is None
    with pytest.raises(ConfigError, match=r"train.compile='compiled_graphs' needs a CUDA device .* trains on cpu"):
        compile_model(model, "compiled_graphs", torch.device("cpu"))
    assert model._compiled_call_impl is None
    compile_model(model, "default", torch.device("cpu"), backend="eager")
    assert model._compiled_call_impl is not None
    assert torch._dynamo.config.fail_on_recompile_limit_hit
    both = MoELab(load_config("tiny", {}).model)  # compiled_graphs compiles the model too (and captures the step)
    compile_model(both, "compiled_graphs", torch.device("cuda"), backend="eager")
    assert both._compiled_call_impl is not None
    with pytest.raises(ConfigError, match=r"train.compile='fast' is not allowed: expected one of 'none', "
                                          r"'default', 'graphs', 'compiled_graphs'"):
        compile_model(model, "fast", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"train.compile=True is not allowed: expected one of 'none', "
                                          r"'default', 'graphs', 'compiled_graphs'"):
        load_config("tiny", {"train.compile": True})
    with pytest.raises(ConfigError, match=r"train.accumulate_grad_batches=2 is not allowed: expected 1 with "
                                          r"train.compile='graphs'"):
        load_config("tiny", {"train.compile": "graphs", "train.accumulate_grad_batches": 2})
    stages = [{"seq_len": 16, "steps": 5}, {"seq_len": 32, "steps": 15}]
    for mode in ("graphs", "compiled_graphs"):  # a curriculum captures one graph per stage
        cfg = load_config("tiny", {"train.compile": mode, "data.curriculum": stages, "train.max_steps": 20})
        assert cfg.train.compile == mode
    with pytest.raises(ConfigError, match=r"train.accumulate_grad_batches=4 is not allowed: expected 1 with "
                                          r"train.compile='compiled_graphs'"):
        load_config("tiny", {"train.compile": "compiled_graphs", "train.accumulate_grad_batches": 4})


def test_per_depth_specializations_fit_but_a_recompile_loop_raises() -> None:
    """Block AttnRes at k3-mini's depth (13 layers) recompiles its depth aggregation once per source count: that
    must fit under the limit (dynamo's default 8 made the H200's compiled k3-mini fail); a frame that recompiles
    on every call must raise, not run on eagerly."""
    over = {**TOY, "model.n_layers": 13, "model.mla.q_latent_dim": 32, "model.moe.shared_dim": 32,
            "model.moe.quantile_balancing_bins": 64}
    model = MoELab(load_config("k3-mini", over).model)
    compile_model(model, "default", torch.device("cpu"), backend="eager")
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    out = model(x, x, return_logits=False, check_ids=False)
    (out.loss + out.aux_loss).backward()
    assert torch.isfinite(out.loss)

    class Loop(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[int] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(0)
            return x * len(self.seen)  # a new constant every call: a recompile every call

    loop = Loop()
    compile_model(loop, "default", torch.device("cpu"), backend="eager")
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for _ in range(64):
            loop(torch.ones(2))


def test_graphs_needs_cuda() -> None:
    """On the CPU train.compile='graphs' fails when the trainer sets the module up, naming the device."""
    lit = tiny_lit(**{"train.compile": "graphs"})
    lit._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"train.compile='graphs' needs a CUDA device .* trains on cpu"):
        lit.setup("fit")
    assert lit.model._compiled_call_impl is None
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CapturedStep needs a CUDA device"):
            CapturedStep(lambda batch: {})


def test_setup_compiles_once() -> None:
    lit = tiny_lit(**{"train.compile": "default"})
    lit._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    lit.setup("fit")
    first = lit.model._compiled_call_impl
    assert first is not None
    lit.setup("validate")
    assert lit.model._compiled_call_impl is first


def run_steps(lit: LitMoELab, mode: str, data: list[dict[str, torch.Tensor]], dtype: torch.dtype | None = None,
              captured: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    device = data[0]["input_ids"].device
    compile_model(lit.model, mode, device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(lit.parameters(), lr=torch.tensor(1e-3, device=device) if cuda else 1e-3,
                            fused=cuda or None, capturable=cuda)
    step = train_step_fn(lit.model, opt, lit.cfg.train.grad_clip, dtype)
    if captured:
        step = CapturedStep(step, warmup=2)
    losses = [float(step(b)["loss"]) for b in data]
    return losses, {n: p.detach().float().clone() for n, p in lit.named_parameters()}


@pytest.mark.slow
def test_default_compile_trains_as_eager() -> None:
    """Three optimizer steps through inductor on the CPU (~90 s of compilation on 2 cores): the losses and the
    parameters after them equal the eager steps' within fp32 rounding."""
    data = batches(load_config("tiny", {}).model.vocab_size, 3)
    eager = run_steps(tiny_lit(), "none", data)
    compiled = run_steps(tiny_lit(), "default", data)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    for n, p in eager[1].items():
        torch.testing.assert_close(compiled[1][n], p, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.gpu
@pytest.mark.parametrize("balancer", ["quantile_balancing", "loss_free_sign"])
def test_captured_step_trains_as_eager_gpu(balancer: str) -> None:
    """CapturedStep (2 eager warm-up steps, then the whole step as one CUDA graph) against the eager step on
    8 steps of one batch, bf16: every loss within bf16 noise, the loss falling past the warm-up (the replays
    update the weights), the weights after them within bf16 noise."""
    over = {"model.moe.balancer": balancer, "model.moe.quantile_balancing_mode": "histogram"}
    data = batches(load_config("tiny", {}).model.vocab_size, 1, device="cuda") * 8  # one batch: the loss falls
    eager = run_steps(tiny_lit(**over).cuda(), "none", data, torch.bfloat16)
    lit = tiny_lit(**over).cuda()
    captured = run_steps(lit, "none", data, torch.bfloat16, captured=True)
    torch.testing.assert_close(captured[0], eager[0], rtol=2e-2, atol=2e-2)
    assert captured[0][-1] < captured[0][2] - 0.1  # the replayed steps train
    for n, p in eager[1].items():
        torch.testing.assert_close(captured[1][n], p, rtol=5e-2, atol=5e-3, msg=n)


# gpu-small's structure at toy sizes (as kernels/bench.py --entry model --smoke): the benchmark's code runs on the CPU.
TOY = {"model.vocab_size": 512, "data.vocab_size": 512, "model.d_model": 64, "model.dense_ffn_dim": 128,
       "model.max_seq_len": 32, "data.seq_len": 32, "train.batch_size": 2, "model.kda.num_heads": 2,
       "model.kda.head_dim": 32, "model.kda.decay_rank": 8, "model.kda.chunk_size": 16, "model.mla.num_heads": 2,
       "model.mla.head_dim": 32, "model.mla.kv_latent_dim": 32, "model.moe.num_experts": 8, "model.moe.top_k": 2,
       "model.moe.latent_dim": 32, "model.moe.expert_dim": 32}


def test_capture_bench_runs_on_cpu(tmp_path) -> None:
    """moelab.train.perf.capture_bench at toy sizes on the CPU: eager rows with every field, the CUDA-only modes
    recorded with their error (not raised), the packed-document arms, the JSON written."""
    import json

    from moelab.train.perf import capture_bench

    out = tmp_path / "capture.json"
    res = capture_bench(("gpu-small",), ("eager", "graphs"), steps=8, window=2, warm=2, docs=True,
                        budget_s=600, out=out, log=lambda m: None, device="cpu", overrides=TOY,
                        variants={"eager_torch_norm": ("eager", {"model.norm_backend": "torch"})})
    rows = {r.get("arm", r["mode"]): r for r in res["rows"]}
    # a variant arm: timed in the same rounds, compared with plain eager; here it sets the default, so it trains alike
    same = rows["eager_torch_norm"]
    assert same["mode"] == "eager" and same["overrides"] == {"model.norm_backend": "torch"}
    assert same["rounds"] == 2 and "speedup_vs_eager" in same and same["loss_max_abs_diff_vs_eager"] == 0.0
    assert same["speedup_vs_mode"]["ratios"] == same["speedup_vs_eager"]["ratios"]  # its mode's arm is eager here
    assert res["meta"]["variants"] == {"eager_torch_norm": {"mode": "eager",
                                                            "overrides": {"model.norm_backend": "torch"}}}
    eager = rows["eager"]
    assert eager["rounds"] == 2 and eager["steps"] == 2 + 2 * 3 and len(eager["losses"]) == 8
    assert eager["tok_per_s"] > 0 and eager["host_ms"] > 0 and eager["mfu_activated"] > 0
    assert all(torch.isfinite(torch.tensor(eager["losses"])))
    assert "needs a CUDA device" in rows["graphs"]["error"]
    arms = {r["arm"]: r for r in res["docs16k"]}
    assert set(arms) == {"unmasked", "masked_flex", "masked_dense"}
    assert arms["masked_flex"]["docs_per_row"] > 1 and arms["unmasked"]["docs_per_row"] == 1
    assert "speedup_vs_eager" in arms["masked_flex"] and "error" not in arms["masked_dense"]
    assert json.loads(out.read_text())["rows"][0]["mode"] == "eager"


def test_step_profile_on_cpu() -> None:
    """moelab.train.perf.step_profile at toy sizes on the CPU: the families partition the profiled time (their sum
    is the total, every kernel in exactly one), the top list is sorted, the step's wall and host times are there."""
    from moelab.train.perf import step_profile

    r = step_profile("gpu-small", steps=1, overrides=TOY, device="cpu", top=10)
    fam = r["families"]
    assert abs(sum(v["ms"] for v in fam.values()) - r["kernel_ms"]) < 1e-6 * max(1.0, r["kernel_ms"])
    assert abs(sum(v["calls"] for v in fam.values()) - r["launches"]) < 1e-6 * r["launches"]
    assert r["kernel_ms"] > 0 and r["step_ms"] > 0 and r["host_ms"] > 0 and len(r["top"]) == 10
    assert [k["ms"] for k in r["top"]] == sorted((k["ms"] for k in r["top"]), reverse=True)
    assert {"gemm", "optimizer"} <= set(fam)  # aten::mm / addmm and the AdamW step on the CPU
    ops = r["top_ops"]  # the kernels' launching ops, with shapes and the moelab lines that called them
    assert ops and [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert all(o["op"].startswith("aten::") and o["calls"] > 0 for o in ops)
    assert {o["dir"] for o in ops} <= {"fwd", "bwd"} and "bwd" in {o["dir"] for o in ops}
    assert any(w.startswith(("model", "ops", "train")) for o in ops if o["dir"] == "bwd" for w in o["where"])


def test_perf_set_overrides() -> None:
    """perf's ``--set KEY=VALUE``: values parsed as the training CLI parses them; a malformed item names itself."""
    from moelab.base import ConfigError
    from moelab.config import parse_sets as _overrides

    assert _overrides(["model.norm_backend=triton", "train.lr=3e-4", "model.mla.fp32_output_precision=high"]) == {
        "model.norm_backend": "triton", "train.lr": 3e-4, "model.mla.fp32_output_precision": "high"}
    with pytest.raises(ConfigError, match="'norm_backend' is not allowed: expected KEY=VALUE"):
        _overrides(["norm_backend"])
    from moelab.train.perf import _variants

    assert _variants(["fast=graphs:model.norm_backend=triton,model.mla.fp32_output_precision=high", "plain=eager"]) == {
        "fast": ("graphs", {"model.norm_backend": "triton", "model.mla.fp32_output_precision": "high"}),
        "plain": ("eager", {})}
    with pytest.raises(ConfigError, match="MODE one of eager, default, graphs"):
        _variants(["fast=captured:model.norm_backend=triton"])
    with pytest.raises(ConfigError, match="the name 'graphs' is taken"):
        _variants(["graphs=graphs:model.norm_backend=triton"])


def fit(mode: str, steps: int = 6, device: str = "cpu") -> tuple[LitMoELab, L.Trainer]:
    lit = tiny_lit(**{"train.compile": mode, "train.max_steps": steps, "train.warmup_steps": 2,
                      "model.moe.balancer": "quantile_load"})
    data = batches(lit.cfg.model.vocab_size, steps + 2)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu" if device == "cpu" else "gpu", devices=1,
                        precision="32-true" if device == "cpu" else "bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=None if mode in ("graphs", "compiled_graphs") else lit.cfg.train.grad_clip,
                        val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=1,
                        num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.fit(lit, loader, torch.utils.data.DataLoader(data[:1], batch_size=None))
    return lit, trainer


def test_graphs_wiring_trains_as_the_automatic_loop(monkeypatch) -> None:
    """train.compile='graphs' under Lightning (capture left out: the CPU): manual optimization with the step's
    own clipping, schedule and step count, the balancer's records handed to BalancerCallback, a validation in
    between. Six steps end where the automatic loop's six steps end: the same weights, router biases and
    expert loads, the same learning rate, the same step numbers."""
    from moelab.train.balancer import BalancerCallback

    eager, t_eager = fit("none")
    monkeypatch.setattr("moelab.train.module.CapturedStep", EagerStep)
    monkeypatch.setattr("moelab.train.module.compile_model", lambda *a, **k: None)
    graphs, t_graphs = fit("graphs")
    assert not graphs.automatic_optimization and t_graphs.global_step == t_eager.global_step == 6
    weights = dict(eager.named_parameters())
    for name, p in graphs.named_parameters():
        torch.testing.assert_close(p, weights[name], rtol=1e-4, atol=1e-6, msg=name)
    for (name, b), (_, e) in zip(graphs.model.named_buffers(), eager.model.named_buffers()):
        torch.testing.assert_close(b, e, rtol=1e-4, atol=1e-6, msg=name)
    assert t_graphs.optimizers[0].param_groups[0]["lr"] == pytest.approx(t_eager.optimizers[0].param_groups[0]["lr"])
    cb = {name: next(c for c in t.callbacks if isinstance(c, BalancerCallback))
          for name, t in (("eager", t_eager), ("graphs", t_graphs))}
    assert cb["graphs"].steps == cb["eager"].steps == [1, 2, 3, 4, 5, 6]
    assert torch.equal(torch.stack(cb["graphs"].loads), torch.stack(cb["eager"].loads))
    assert cb["graphs"].timings == [] and len(cb["eager"].timings) == 6
    assert {"train/grad_norm", "balance/maxvio_batch"} <= graphs.step_scalars.keys()
    assert graphs._captured.check_syncs  # graphs checks the last warm-up step for host syncs


def test_graphs_with_a_curriculum_of_packed_documents(monkeypatch) -> None:
    """train.compile='graphs' with a context curriculum of packed documents (capture left out: the CPU): the step is
    given the documents, their offsets padded to one capacity per stage shape (grown when a batch holds more), the
    stage's length is recorded, and six steps end where the automatic loop's six end."""
    from moelab.data.datamodule import collate

    over = {"data.curriculum": [{"seq_len": 16, "steps": 3}, {"seq_len": 32, "steps": 3}], "data.seq_len": 32,
            "train.batch_size": 2, "train.max_steps": 6, "train.warmup_steps": 2, "data.document_mask": True}
    gen = torch.Generator().manual_seed(2)
    data = []
    for B, T, docs in ((4, 16, 1), (4, 16, 3), (4, 16, 1), (2, 32, 2), (2, 32, 9), (2, 32, 1), (2, 32, 1)):
        ids = torch.randint(0, 64, (B, T + 1), generator=gen)
        seg = (torch.arange(T) * docs // T).expand(B, T).clone()  # docs documents per row
        data.append(collate([{"input_ids": ids[b, :-1], "targets": ids[b, 1:], "segment_ids": seg[b]}
                             for b in range(B)]))
    runs = {}
    for mode in ("none", "graphs"):
        if mode == "graphs":
            monkeypatch.setattr("moelab.train.module.CapturedStep", EagerStep)
            monkeypatch.setattr("moelab.train.module.compile_model", lambda *a, **k: None)
        lit = tiny_lit(**{"train.compile": mode, **over})
        trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0,
                            gradient_clip_val=None if mode == "graphs" else lit.cfg.train.grad_clip)
        trainer.fit(lit, torch.utils.data.DataLoader(data, batch_size=None))
        runs[mode] = lit
    step = runs["graphs"]._captured
    assert step.recapture
    # capacity B + max(4, B // 8): 8 documents at 4 x 16, its margin doubled (12) by the batch of 12 and kept; 6 at
    # 2 x 32, doubled twice (10, 18) by the batch of 18
    assert [s["cu_seqlens"] for s in step.shapes] == [(9,), (13,), (13,), (7,), (19,), (19,)]
    assert [s["segment_ids"] for s in step.shapes] == [(4, 16)] * 3 + [(2, 32)] * 3
    assert runs["graphs"].step_scalars["train/seq_len"] == 32.0
    weights = dict(runs["none"].named_parameters())
    for name, p in runs["graphs"].named_parameters():  # fp32 rounding (the padded offsets sum in another order)
        drift = ((p - weights[name]).norm() / weights[name].norm()).item()
        assert drift < 1e-4, f"{name}: relative drift {drift:.3g} from the automatic loop"


def test_capture_error_names_the_moelab_frame() -> None:
    """A capture CUDA refuses is reported at the innermost moelab frame of its traceback (the piece to change)."""
    from moelab.ops.varlen import check_cu_seqlens
    from moelab.train.module import _where_raised

    try:
        check_cu_seqlens(torch.tensor([0, 5]), 2, 5)
    except ValueError as e:
        where = _where_raised(e)
    assert where.startswith("moelab/ops/varlen.py:") and where.endswith(" check_cu_seqlens"), where
    try:
        int("x")
    except ValueError as e:
        assert _where_raised(e).endswith("test_capture_error_names_the_moelab_frame")  # no moelab frame: the last one
    assert _where_raised(ValueError("never raised")) == "an unknown place"


def test_compiled_graphs_wiring(monkeypatch) -> None:
    """train.compile='compiled_graphs' compiles the model and captures the step (manual optimization, as graphs),
    with the host-sync check left to the capture (a torch-function mode would recompile the compiled model)."""
    modes: list[str] = []
    monkeypatch.setattr("moelab.train.module.CapturedStep", EagerStep)
    monkeypatch.setattr("moelab.train.module.compile_model", lambda model, mode, *a, **k: modes.append(mode))
    lit, trainer = fit("compiled_graphs", steps=2)
    assert modes == ["compiled_graphs"] and not lit.automatic_optimization and trainer.global_step == 2
    assert not lit._captured.check_syncs


@pytest.mark.gpu
def test_captured_step_recaptures_per_shape_gpu() -> None:
    """``CapturedStep(recapture=True)``: a curriculum's two stage shapes, each warmed up and captured once (two
    graphs in all), give the eager steps' losses, padded packed-document offsets included."""
    from moelab.ops.varlen import cu_seqlens, pad_cu_seqlens

    def stage(B: int, T: int, n: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
        out = []
        for i in range(n):
            ids = torch.randint(0, 512, (B, T + 1), generator=gen)
            seg = (torch.arange(T) * (1 + i % 2) // T).expand(B, T).contiguous()  # 1 or 2 documents per row
            out.append({"input_ids": ids[:, :-1].cuda(), "targets": ids[:, 1:].cuda(), "segment_ids": seg.cuda(),
                        "cu_seqlens": pad_cu_seqlens(cu_seqlens(seg), 2 * B).cuda()})
        return out

    gen = torch.Generator().manual_seed(0)
    data = stage(4, 64, 6, gen) + stage(2, 128, 6, gen)
    losses = {}
    for name in ("eager", "captured"):
        torch.manual_seed(0)
        # the Triton KDA op and conv: the GPU's path, which reads no offsets on the host (the torch ones do)
        model = MoELab(load_config("tiny", {"model.kda.backend": "triton", "model.kda.conv_backend": "triton"}).model)
        model = model.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True, capturable=True)
        # bf16 autocast, as training runs: fp32 grouped_mm has no CUDA kernel on sm90, its fallback copies from the host
        step = train_step_fn(model, opt, 1.0, torch.bfloat16)
        if name == "captured":
            step = CapturedStep(step, warmup=2, recapture=True)
        losses[name] = torch.stack([step(b)["loss"] for b in data]).cpu()
    assert step.captures == 2
    torch.testing.assert_close(losses["captured"], losses["eager"], rtol=2e-2, atol=1e-3)  # bf16 over 12 steps


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["graphs", "compiled_graphs"])
def test_graphs_trains_as_the_automatic_loop_gpu(mode: str) -> None:
    """The same on a GPU with the capture: 12 steps of train.compile='graphs' (3 eager, the capture, 8 replays)
    against the automatic loop, bf16: the weights, the biases and the step numbers; compiled_graphs the same
    with the model compiled inside the captured step."""
    from moelab.train.balancer import BalancerCallback

    eager, t_eager = fit("none", steps=12, device="cuda")
    graphs, t_graphs = fit(mode, steps=12, device="cuda")
    assert graphs._captured is not None and graphs._captured.graph is not None and t_graphs.global_step == 12
    # bf16 over 12 steps, fused capturable AdamW against the default one and routing that amplifies rounding: on
    # the H200 every parameter ended within 4.3e-2 of the eager run in relative norm (MoE weights the most), the
    # dense ones within 1.1e-2; an element-wise bound fails on the embedding's rows that few tokens touched.
    weights = dict(eager.named_parameters())
    for name, p in graphs.named_parameters():
        ref = weights[name].float()
        drift = ((p.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert drift < 0.1, f"{name}: relative drift {drift:.3g} from the eager run (bf16 noise is < 0.05)"
    cb = next(c for c in t_graphs.callbacks if isinstance(c, BalancerCallback))
    assert cb.steps == list(range(1, 13))


def test_fp32_captured_moe_is_refused_up_front(monkeypatch) -> None:
    """fp32 expert GEMMs on a GPU read their offsets on the host, which a CUDA graph cannot hold: the run is
    refused before it starts, naming the precision, the mode and what to use; bf16, eager and dense models pass."""
    from moelab.train import runner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config("tiny", {"train.compile": "graphs", "train.precision": "32-true"})
    with pytest.raises(ConfigError, match=r"train.precision='32-true' \(fp32 on this GPU\) is not allowed with "
                                          r"train.compile='graphs' and MoE layers: .*use train.precision='bf16-mixed'"):
        runner.check_device(cfg)
    runner.check_device(load_config("tiny", {"train.compile": "graphs"}))  # auto: bf16-mixed on a GPU
    runner.check_device(load_config("tiny", {"train.compile": "none", "train.precision": "32-true"}))
    dense = load_config("tiny", {"train.compile": "compiled_graphs", "train.precision": "32-true"})
    dense.model.dense_layers = dense.model.n_layers
    runner.check_device(dense)


def test_default_compile_takes_a_curriculum_of_lengths() -> None:
    """train.compile='default' under a context curriculum: every new sequence length recompiles the model's frames
    (dynamo marks the length dynamic from the second), within the limit compile_model sets, so the stages train on
    (and a return to an earlier length reuses what was compiled) instead of raising."""
    lit = tiny_lit()
    compile_model(lit.model, "default", torch.device("cpu"), backend="eager")
    opt = torch.optim.AdamW(lit.parameters(), lr=1e-3)
    step = train_step_fn(lit.model, opt, lit.cfg.train.grad_clip, None)
    torch._dynamo.reset()
    lengths = (16, 32, 64, 32, 128)
    assert max(lengths) <= lit.cfg.model.max_seq_len
    losses = [float(step(batches(lit.cfg.model.vocab_size, 1, T=T)[0])["loss"]) for T in lengths]
    assert all(torch.isfinite(torch.tensor(losses)))
