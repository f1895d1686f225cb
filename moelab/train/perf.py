"""Throughput bookkeeping: peak FLOP/s by GPU, MFU, the shared throughput JSON file, host-sync detection.

MFU = achieved model FLOP/s / peak FLOP/s, with achieved = 3 x forward FLOPs per token
(``moelab.model.accounting.flops_per_token``; backward ~ 2x forward) x tokens/s per device.

:class:`HostSyncs` records the calls of a training step that would make the host wait for a GPU
(a value read to the host, a shape that depends on values), on any device: a step that must run
ahead of the GPU, or be captured as a CUDA graph, has none.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from moelab.utils import write_json

# Dense (no structured sparsity) bf16 tensor-core peaks per device, FLOP/s, from the vendors'
# data sheets. Measured on our H200: a bf16 8192^3 matmul reaches 792 TFLOP/s (80% of 989), so
# an MFU near 0.8 is the practical ceiling there.
# Longer names first: the first substring that matches the device name wins.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "GH200": 989e12,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
}


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of ``device_name`` (as ``torch.cuda.get_device_name()`` says it); None if unknown."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if key.lower() in device_name.lower():
            return flops
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of a CUDA ``device``; None on CPU (MFU is not reported there) or for an unknown GPU."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device))


def mfu(flops_per_token_fwd: float, tokens_per_s_per_device: float, peak: float | None) -> float:
    """Model FLOPs utilisation, ``3 * flops_per_token * tokens/s / peak``; NaN without a peak."""
    if not peak:
        return float("nan")
    return 3.0 * flops_per_token_fwd * tokens_per_s_per_device / peak


def record_throughput(path: str | os.PathLike, row: dict[str, Any] | list[dict[str, Any]],
                      command: str | None = None) -> dict:
    """Insert or replace ``row`` (keyed by ``row["impl"]``; a list: each of its rows, in one write) in the
    throughput JSON at ``path``.

    File layout: ``{"meta": {gpu, torch, triton, date, command}, "rows": [{"impl", ...}, ...]}``;
    other rows (other tools write theirs into the same file) are kept. Written atomically.
    """
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {"meta": {}, "rows": []}
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    data["meta"] = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "command": command or " ".join(sys.argv),
    }
    # Rows come from different tools and runs: each keeps its own command and date.
    new = [{**r, "command": data["meta"]["command"], "date": data["meta"]["date"]}
           for r in (row if isinstance(row, list) else [row])]
    impls = {r["impl"] for r in new}
    data["rows"] = [r for r in data.get("rows", []) if r.get("impl") not in impls] + new
    write_json(path, data)
    return data


# Tensor calls that wait for a CUDA device: a value read to the host (item, tolist, bool/int/float of a
# tensor: a Python branch on a tensor's value) or an output whose shape depends on values (nonzero,
# masked_select, unique, ...). Boolean-mask indexing (x[mask]) is caught in __getitem__ / __setitem__.
SYNC_OPS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
                      "masked_select", "unique", "unique_consecutive", "numpy", "bincount", "nonzero_static"})


class HostSyncs(TorchFunctionMode):
    """Within ``with HostSyncs() as s:``, ``s.calls`` lists every host-sync call as ``(op, where)``, ``where``
    being ``"path:line function"`` of the innermost frame in the ``moelab`` package (``"?"`` outside it).

    On any device (a CPU step shows the syncs it would make on a GPU; ``torch.cuda.set_sync_debug_mode``
    sees only CUDA ones, and only where they happen). Catches :data:`SYNC_OPS`, boolean-mask indexing and
    ``repeat_interleave`` without ``output_size``; not reads that bypass torch's function dispatch (C++).
    ``devices=("cuda",)``: only calls on a CUDA tensor (a CPU tensor's read does not wait for the GPU).
    """

    def __init__(self, devices: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.devices = devices  # record only calls on a tensor of these device types (None: any tensor)
        self.calls: list[tuple[str, str]] = []

    def _on_device(self, args: tuple, kwargs: dict) -> bool:
        if self.devices is None:
            return True
        items = [*args, *kwargs.values()]
        items += [i for a in args if isinstance(a, tuple) for i in a]
        return any(isinstance(a, torch.Tensor) and a.device.type in self.devices for a in items)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if not self._on_device(args, kwargs):
            pass
        elif name in SYNC_OPS:
            self.calls.append((name, _moelab_frame()))
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _has_mask(args[1]):
            self.calls.append((f"{name}[bool mask]", _moelab_frame()))
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and (
                len(args) > 1 and isinstance(args[1], torch.Tensor) or isinstance(kwargs.get("repeats"), torch.Tensor)):
            self.calls.append((name, _moelab_frame()))
        return func(*args, **kwargs)


def _has_mask(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _moelab_frame() -> str:
    import traceback

    here = Path(__file__).resolve()
    return moelab_site([f for f in traceback.extract_stack() if Path(f.filename).resolve() != here])


def moelab_site(frames: list[Any]) -> str:
    """The innermost of ``frames`` (``traceback.FrameSummary``, outermost first) inside the moelab package, as
    ``moelab/ops/moe.py:543 experts_grouped``; without one, the innermost frame, its path shortened (from ``torch``
    on, else its last two parts). Where a host sync (:class:`HostSyncs`) or a refused capture happened."""
    package = Path(__file__).resolve().parent.parent
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if package in path.parents:
            return f"{path.relative_to(package.parent)}:{frame.lineno} {frame.name}"
    frame = frames[-1]
    parts = Path(frame.filename).parts
    short = "/".join(parts[parts.index("torch"):] if "torch" in parts else parts[-2:])
    return f"{short}:{frame.lineno} {frame.name}"


# ---------------------------------------------------------------------------------------------
# Eager vs compiled vs captured training steps (issue 36), one GPU

ANCHOR_PEAK = 792e12  # measured bf16 8192^3 matmul on the H200: the "all parameters" MFU convention's peak
DATASHEET_PEAK = 989e12  # H200 dense bf16: the "activated parameters" (model FLOPs) convention's peak
CAPTURE_MODES = ("eager", "default", "graphs", "compiled_graphs")  # train.compile: none is eager


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


class TimedStep:
    """One model and its training step in one mode, kept on the device between its timing windows."""

    def __init__(self, preset: str, overrides: dict[str, Any], mode: str, data: list[dict[str, torch.Tensor]],
                 warm: int, lr: float) -> None:
        import time

        from moelab.config import CAPTURED_MODES, load_config
        from moelab.model import MoELab
        from moelab.train.module import CapturedStep, compile_model, train_step_fn

        self.mode, self.data, self.next, self.losses = mode, data, 0, []
        dev = self.device = data[0]["input_ids"].device
        cuda = dev.type == "cuda"
        before = _allocated(dev)
        _reset_peak(dev)
        t0 = time.perf_counter()
        self.cfg = load_config(preset, overrides)
        torch.manual_seed(0)
        self.model = MoELab(self.cfg.model).to(dev)
        compile_model(self.model, "none" if mode == "eager" else mode, dev)
        opt = torch.optim.AdamW(self.model.parameters(), lr=torch.tensor(lr, device=dev) if cuda else lr,
                                fused=cuda or None, capturable=cuda, betas=self.cfg.train.betas, weight_decay=0.0)
        step = train_step_fn(self.model, opt, self.cfg.train.grad_clip, torch.bfloat16 if cuda else None)
        if mode in CAPTURED_MODES:
            step = CapturedStep(step, warmup=warm - 1, check_syncs=mode == "graphs")
        self.step = step
        for _ in range(warm):  # untimed: compilation, autotuning, the capture (graphs: the last of them)
            self.run()
        _sync(dev)
        self.setup_s = time.perf_counter() - t0
        self.held = _allocated(dev) - before  # parameters, AdamW state, graph outputs
        self.peak = _peak(dev) - before

    def run(self) -> None:
        out = self.step(self.data[self.next % len(self.data)])
        self.next += 1
        self.losses.append(out["loss"])

    def window(self, steps: int) -> dict[str, float]:
        """``steps`` steps between two synchronizations, then the host time to issue one more from an idle GPU."""
        import time

        dev = self.device
        _sync(dev)
        others = _allocated(dev) - self.held
        _reset_peak(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.run()
        _sync(dev)
        dt = (time.perf_counter() - t0) / steps
        t1 = time.perf_counter()
        self.run()
        host = time.perf_counter() - t1
        _sync(dev)
        self.peak = max(self.peak, _peak(dev) - others)
        return {"step_ms": 1e3 * dt, "host_ms": 1e3 * host}


def interleaved_rounds(arms: dict[str, TimedStep], rounds: int, window: int, deadline: float, log: Any,
            errors: dict[str, str]) -> dict[str, list[dict]]:
    """Interleaved rounds: each round times every arm once, the order rotated round by round (each arm runs
    first once every len(arms) rounds), so drift between rounds cancels in the paired ratios. An arm that
    fails leaves the rounds (its error in ``errors``); the others go on."""
    import time

    names = list(arms)
    out: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        if time.perf_counter() > deadline:
            log(f"  budget: stopped after {r} rounds")
            break
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            if name in errors:
                continue
            try:
                out[name].append(arms[name].window(window))
            except Exception as e:  # noqa: BLE001 - recorded: which mode broke and why is the measurement
                errors[name] = f"round {r + 1}: {type(e).__name__}: {e}"[:2000]
                log(f"  {name} failed: {errors[name][:300]}")
        log(f"  round {r + 1}: " + ", ".join(f"{n} {out[n][-1]['step_ms']:.1f} ms" for n in names if out[n]))
    return out


def paired_speedup(base: list[dict], windows: list[dict]) -> dict[str, Any]:
    """Per-round step-time ratios ``base / windows`` (round i against round i) with their median, min and max."""
    ratios = [b["step_ms"] / w["step_ms"] for b, w in zip(base, windows)]
    return {"median": _median(ratios), "min": min(ratios), "max": max(ratios), "ratios": ratios}


def timing_row(arm: TimedStep, windows: list[dict], base: list[dict] | None,
               base_losses: list[float] | None) -> dict[str, Any]:
    from moelab.model.accounting import flops_per_token, param_counts

    B, T = arm.data[0]["input_ids"].shape
    step_ms = [w["step_ms"] for w in windows]
    med = _median(step_ms)
    tok = B * T / (med / 1e3)
    counts = param_counts(arm.cfg.model)
    losses = [float(x) for x in arm.losses]
    row = {"mode": arm.mode, "B": B, "T": T, "params": counts["total"], "params_activated": counts["activated"],
           "rounds": len(windows), "steps": len(losses), "step_ms": med, "step_ms_min": min(step_ms),
           "step_ms_max": max(step_ms), "tok_per_s": tok, "rounds_step_ms": step_ms,
           "host_ms": _median([w["host_ms"] for w in windows]), "rounds_host_ms": [w["host_ms"] for w in windows],
           "mfu_all_params": 6 * counts["total"] * tok / ANCHOR_PEAK,
           "mfu_activated": 3 * flops_per_token(arm.cfg.model, T) * tok / DATASHEET_PEAK,
           "peak_mem_gb": arm.peak / 2**30, "setup_s": arm.setup_s, "losses": losses}
    if base is not None:
        row["speedup_vs_eager"] = paired_speedup(base, windows)
    if base_losses is not None:
        n = min(len(base_losses), len(losses))
        row["loss_max_abs_diff_vs_eager"] = max(abs(a - b) for a, b in zip(base_losses[:n], losses[:n]))
        row["loss_last_vs_eager"] = [base_losses[n - 1], losses[n - 1]]
    return row


def random_batches(vocab: int, B: int, T: int, n: int, seed: int = 0, doc_lengths: tuple[int, int] | None = None,
                    device: torch.device | str = "cuda") -> list[dict[str, torch.Tensor]]:
    """``n`` batches of random ids on ``device`` (the same for every mode); ``doc_lengths=(lo, hi)``: packed
    documents of lengths uniform in [lo, hi], cut at the row's end (``segment_ids``, and their ``cu_seqlens``)."""
    from moelab.ops.varlen import cu_seqlens

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (B, T + 1), generator=gen)
        batch = {"input_ids": ids[:, :-1].contiguous().to(device), "targets": ids[:, 1:].contiguous().to(device)}
        if doc_lengths is not None:
            seg = torch.empty(B, T, dtype=torch.int32)
            for b in range(B):
                t, d = 0, 0
                while t < T:
                    size = int(torch.randint(doc_lengths[0], doc_lengths[1] + 1, (1,), generator=gen))
                    seg[b, t:t + size] = d
                    t, d = t + size, d + 1
            batch["segment_ids"] = seg.to(device)
            # counted on the CPU, as the data loaders do (moelab.data.datamodule.collate)
            batch["cu_seqlens"] = cu_seqlens(seg).to(device)
        out.append(batch)
    return out


def _commit(state: dict[str, Any]) -> str | None:
    """``git_state``'s commit, with ``-dirty`` when its tree had edits (the GPU machine's copy: ``MOELAB_COMMIT``)."""
    return None if state["commit"] is None else state["commit"] + ("-dirty" if state["dirty"] else "")


def capture_bench(presets: tuple[str, ...] = ("k3-mini", "gpu-small"), modes: tuple[str, ...] = CAPTURE_MODES,
                  steps: int = 100, window: int = 10, warm: int = 4, docs: bool = True, budget_s: float = 450.0,
                  out: str | os.PathLike | None = None, log: Any = print, device: str = "cuda",
                  overrides: dict[str, Any] | None = None,
                  on_save: Any = None, variants: dict[str, tuple[str, dict[str, Any]]] | None = None
                  ) -> dict[str, Any]:
    """Training steps per second of each preset in each ``train.compile`` mode on one GPU, in one process.

    Modes as ``train.compile`` runs them: ``eager`` (none), ``default`` (torch.compile of the model:
    ``moelab.train.module.compile_model``), ``graphs`` (the whole step as one CUDA graph: ``CapturedStep``) and
    ``compiled_graphs`` (both). Every mode trains its own copy of
    the same initial model (seed 0) on the same ``steps`` batches of random ids (B, T of the preset, bf16
    autocast, fused capturable AdamW at a constant lr 3e-4, clipping as the preset): ``warm`` untimed steps
    (compilation, capture), then interleaved rounds of ``window`` timed steps plus one host-timed step per mode.
    Per row: median step time / tokens/s over rounds, the paired speed-up over eager (per round, median /
    min / max), host ms, MFU in both conventions, peak memory, setup seconds, every step's loss and the
    largest loss difference from eager. ``docs`` (first): gpu-small's 16K stage of study 4 (B 2 x T 16384)
    eager, without documents, with packed documents through flex_attention, and through the dense mask; on a GPU
    also captured (``graphs``) without documents and through flex_attention, the offsets padded to one shape
    (``pad_cu_seqlens``); a masked row's ``speedup_vs_eager`` is over the unmasked arm of its own mode.
    A mode that fails is recorded with its error. Written to ``out`` after each part (atomic).
    ``device="cpu"`` with ``overrides`` (toy sizes) runs the same code without the GPU (tests; no memory,
    modes eager and default only). ``on_save(result)`` is called at each write too. ``variants``: more arms in
    the same rounds, ``{name: (mode, overrides)}`` (e.g. ``{"graphs_norm_triton": ("graphs", {"model.norm_backend":
    "triton"})}``): a setting timed beside the modes on the same batches, its speed-up still over the plain eager
    arm, and over the plain arm of its own mode where that ran (``speedup_vs_mode``; row ``arm``: the name).
    """
    import time

    from moelab.config import load_config
    from moelab.provenance import command_line, git_state

    start = time.perf_counter()
    deadline = start + budget_s
    dev = torch.device(device)
    over = dict(overrides or {})
    result: dict[str, Any] = {"meta": {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                                       "torch": torch.__version__,
                                       "commit": _commit(git_state()),
                                       "command": command_line(sys.argv), "steps": steps,
                                       "window": window, "warm": warm, "budget_s": budget_s, "overrides": over,
                                       "variants": {k: {"mode": m, "overrides": o} for k, (m, o) in
                                                    (variants or {}).items()},
                                       "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")},
                              "rows": [], "docs16k": []}

    def save() -> None:
        result["meta"]["elapsed_s"] = time.perf_counter() - start
        if out is not None:
            write_json(Path(out), result)
        if on_save is not None:
            on_save(result)

    if docs and time.perf_counter() < deadline:
        T = 16384 if dev.type == "cuda" else 64
        stage = {**over, "model.max_seq_len": T, "data.seq_len": T, "train.batch_size": 2}
        cfg = load_config("gpu-small", stage)
        d_rounds, d_window = (4, 5) if dev.type == "cuda" else (2, 1)
        n = 3 + d_rounds * (d_window + 1)
        lengths = (256, 6144) if dev.type == "cuda" else (4, 24)
        plain = random_batches(cfg.model.vocab_size, 2, T, n, seed=1, device=dev)
        packed = random_batches(cfg.model.vocab_size, 2, T, n, seed=1, doc_lengths=lengths, device=dev)
        result["meta"]["docs16k_doc_lengths"] = list(lengths)
        flex = {**stage, "model.mla.mask_backend": "flex"}
        specs = {"unmasked": (stage, plain, "eager"), "masked_flex": (flex, packed, "eager"),
                 "masked_dense": ({**stage, "model.mla.mask_backend": "dense"}, packed, "eager")}
        if dev.type == "cuda":
            # captured: the offsets padded to one shape (empty documents at the end), as a captured step needs
            from moelab.ops.varlen import pad_cu_seqlens

            cap = max(b["cu_seqlens"].numel() - 1 for b in packed)
            padded = [{**b, "cu_seqlens": pad_cu_seqlens(b["cu_seqlens"], cap)} for b in packed]
            result["meta"]["docs16k_doc_capacity"] = cap
            specs |= {"unmasked_graphs": (stage, plain, "graphs"), "masked_flex_graphs": (flex, padded, "graphs")}
        arms = {}
        errors = {}
        for name, (o, d, mode) in specs.items():
            log(f"docs16k {name}: set-up ({time.perf_counter() - start:.0f} s)")
            try:
                arms[name] = TimedStep("gpu-small", o, mode, d, 3, 3e-4)
            except Exception as e:  # noqa: BLE001
                errors[name] = f"set-up: {type(e).__name__}: {e}"[:2000]
        windows = interleaved_rounds(arms, d_rounds, d_window, deadline, log, errors)
        base = windows.get("unmasked") if "unmasked" not in errors else None
        for name in specs:
            arm = arms.get(name)
            if arm is None or name in errors or not windows.get(name):
                result["docs16k"].append({"arm": name, "error": errors.get(name, "no rounds")})
                continue
            ref = windows.get("unmasked_graphs") if name == "masked_flex_graphs" else base
            row = timing_row(arm, windows[name], ref if name not in ("unmasked", "unmasked_graphs") else None, None)
            row.pop("losses")
            row["docs_per_row"] = (float(sum(int(b["segment_ids"][r].max()) + 1 for b in arm.data for r in range(2)))
                                   / (2 * len(arm.data)) if "segment_ids" in arm.data[0] else 1.0)
            result["docs16k"].append({"arm": name, **row})
        del arms
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save()

    rounds = max(1, (steps - warm) // (window + 1))
    for preset in presets:
        if time.perf_counter() > deadline:
            result["rows"].append({"preset": preset, "skipped": "budget"})
            continue
        cfg = load_config(preset, over)
        n = warm + rounds * (window + 1)
        data = random_batches(cfg.model.vocab_size, cfg.train.batch_size, cfg.data.seq_len, n, device=dev)
        arms: dict[str, TimedStep] = {}
        errors: dict[str, str] = {}
        specs = {mode: (mode, {}) for mode in modes} | dict(variants or {})
        for name, (mode, extra) in specs.items():
            log(f"{preset} {name}: set-up ({time.perf_counter() - start:.0f} s)")
            try:
                arms[name] = TimedStep(preset, {**over, **extra}, mode, data, warm, 3e-4)
                log(f"  {arms[name].setup_s:.1f} s")
            except Exception as e:  # noqa: BLE001 - recorded: which mode broke and why is the measurement
                errors[name] = f"set-up: {type(e).__name__}: {e}"[:2000]
                log(f"  failed: {errors[name][:300]}")
        windows = interleaved_rounds(arms, rounds, window, deadline, log, errors)
        base = windows.get("eager") if "eager" in arms and "eager" not in errors else None
        base_losses = [float(x) for x in arms["eager"].losses] if base else None
        for name, (mode, extra) in specs.items():
            if name in arms and name not in errors and windows.get(name):
                row = timing_row(arms[name], windows[name], base if name != "eager" else None,
                                 base_losses if name != "eager" else None)
            else:
                row = {"mode": mode, "error": errors.get(name, "no rounds")}
            if name not in modes:  # a variant: also paired with the plain arm of its mode, round by round
                own = windows.get(mode) if mode in arms and mode not in errors else None
                if own and "error" not in row:
                    row["speedup_vs_mode"] = paired_speedup(own, windows[name])
                row = {"arm": name, **row, "overrides": extra}
            result["rows"].append({"preset": preset, **row})
        del arms
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        save()

    save()
    return result


def kernel_times(fn: Callable[[], Any], *, calls: int = 5, before: Callable[[], None] | None = None,
                 cuda: bool | None = None, top: int = 24) -> list[dict[str, Any]]:
    """Where ``fn``'s time goes: ``[{"name", "ms", "calls"}]`` per kernel (CUDA: self device time of each kernel; CPU:
    self CPU time of each aten op), per call of ``fn`` (mean over ``calls`` profiled calls after one warm call), the
    ``top`` largest first and the rest summed into one ``"(other)"`` entry. ``before`` runs before every call."""
    from torch.profiler import ProfilerActivity, profile

    if calls < 1:
        raise ValueError(f"kernel_times needs calls >= 1, got calls={calls}")
    cuda = torch.cuda.is_available() if cuda is None else cuda

    def call() -> None:
        if before is not None:
            before()
        fn()

    call()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU], acc_events=True) as prof:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us > 0 and (not cuda or ev.device_type.name == "CUDA"):
            rows.append({"name": ev.key[:120], "ms": us / 1e3 / calls, "calls": ev.count / calls})
    rows.sort(key=lambda r: -r["ms"])
    rest = rows[top:]
    if rest:
        rows = rows[:top] + [{"name": "(other)", "ms": sum(r["ms"] for r in rest),
                              "calls": sum(r["calls"] for r in rest)}]
    return rows


# Kernel families of a step profile, by kernel name (first match wins; "other" for the rest).
KERNEL_FAMILIES: tuple[tuple[str, str], ...] = (
    ("kda", r"_kda_|kda|_prep_(fwd|bwd)"), ("attnres", r"attnres"), ("attention", r"flash|fmha|sdpa|attention"),
    ("fp32 gemm", r"f32f32|sgemm|simt"), ("gemm", r"gemm|xmma|cutlass|cublas|nvjet|matmul|_mm_"),
    ("moe routing", r"moe|topk|sort|scatter|gather|index|histc|bincount|_combine_"), ("norm", r"norm|_rms_"),
    ("optimizer", r"adam|foreach|multi_tensor"), ("conv", r"conv"), ("glu", r"glu|silu"),
    ("copy / cast", r"copy"), ("elementwise", r"elementwise|reduce|fill|cat_|triton_"))


def step_profile(preset: str, steps: int = 3, overrides: dict[str, Any] | None = None, device: str = "cuda",
                 top: int = 40, doc_lengths: tuple[int, int] | None = None) -> dict[str, Any]:
    """Where one eager training step of ``preset`` spends its device time (``torch.profiler``): per step, the kernel
    time by family (:data:`KERNEL_FAMILIES`) with launch counts, the ``top`` kernels, their sum beside the step's
    wall time and host time (``TimedStep.window``). Eager: a captured step runs the same kernels from one graph
    launch, so its step time is at least this kernel time. On the CPU (tests, toy ``overrides``) the "kernels" are
    the aten ops' self CPU time. ``host_ops``: the ``top`` aten ops by their own host (CPU) time, by moelab site:
    where a host-bound step spends its issue time. ``doc_lengths=(lo, hi)``: batches of packed documents (as
    :func:`random_batches`), their offsets counted on the CPU as the data loaders do."""
    import collections
    import re

    from torch.profiler import ProfilerActivity, profile

    from moelab.config import load_config

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    cfg = load_config(preset, dict(overrides or {}))
    B, T = cfg.train.batch_size, cfg.data.seq_len
    arm = TimedStep(preset, dict(overrides or {}), "eager",
                    random_batches(cfg.model.vocab_size, B, T, 4, doc_lengths=doc_lengths, device=dev), 2, 3e-4)
    _sync(dev)
    # the CPU side too, with shapes and stacks: which aten op (and which line of moelab) launched each kernel
    from torch._C._profiler import _ExperimentalConfig

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU],
                 record_shapes=True, with_stack=True, experimental_config=_ExperimentalConfig(verbose=True)) as prof:
        for _ in range(steps):
            arm.run()
        _sync(dev)
    kernels = []
    for e in prof.key_averages():
        us = e.device_time_total if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or e.device_type.name == "CUDA"):
            kernels.append({"kernel": e.key[:200], "ms": us / steps / 1e3, "calls": e.count / steps})
    kernels.sort(key=lambda k: -k["ms"])
    fam: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"ms": 0.0, "calls": 0.0})
    for k in kernels:
        name = next((f for f, pat in KERNEL_FAMILIES if re.search(pat, k["kernel"], re.I)), "other")
        fam[name]["ms"] += k["ms"]
        fam[name]["calls"] += k["calls"]
    w = arm.window(3)
    return {"preset": preset, "B": B, "T": T, "steps_profiled": steps, "kernel_ms": sum(k["ms"] for k in kernels),
            "launches": sum(k["calls"] for k in kernels), "step_ms": w["step_ms"], "host_ms": w["host_ms"],
            "families": dict(sorted(fam.items(), key=lambda kv: -kv[1]["ms"])), "top": kernels[:top],
            "top_ops": _op_sites(prof, steps, cuda, top), "host_ops": _op_sites(prof, steps, False, top)}


def _op_sites(prof: Any, steps: int, cuda: bool, top: int) -> list[dict[str, Any]]:
    """The ``top`` aten ops by the device time of the kernels each launched itself (CPU: self CPU time), grouped by
    op, input shapes, direction and the innermost moelab frames that called it (a backward op: those of the forward
    op whose autograd node ran it): ``{"op", "dir", "shapes", "where", "ms", "calls"}`` per step. Where a kernel
    family's time comes from (a cast of which tensor, on which line)."""
    import collections

    def frames(stack: list[str]) -> tuple[str, ...]:
        keep = [f for f in stack or [] if "moelab" in f and "perf.py" not in f and "host_work.py" not in f]
        return tuple(f.split("moelab", 1)[-1].lstrip("/\\") for f in keep[:3])

    events = prof.events()
    forward = {}  # sequence number -> the frames of the forward op that made that autograd node
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::") and e.stack:
            forward.setdefault(e.sequence_nr, frames(e.stack))
    agg: dict[tuple, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us <= 0 or not e.name.startswith("aten::"):
            continue
        where, direction, p = frames(e.stack), "fwd", e.cpu_parent
        while p is not None:
            if p.name.startswith("autograd::engine::evaluate_function"):
                where, direction = forward.get(p.sequence_nr, ()), "bwd"
                break
            p = p.cpu_parent
        a = agg[(e.name, direction, str(e.input_shapes)[:160], where)]
        a[0] += us
        a[1] += 1
    rows = [{"op": k[0], "dir": k[1], "shapes": k[2], "where": list(k[3]), "ms": v[0] / steps / 1e3,
             "calls": v[1] / steps} for k, v in agg.items()]
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def _variants(items: list[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """``["graphs_tf32=graphs:model.mla.fp32_output_precision=high", ...]`` as ``{name: (mode, overrides)}``."""
    from moelab.base import ConfigError
    from moelab.config import parse_sets

    out = {}
    for item in items:
        name, sep, rest = item.partition("=")
        mode, sep2, sets = rest.partition(":")
        if not sep or not name.strip() or mode not in CAPTURE_MODES:
            raise ConfigError(f"--variant {item!r} is not allowed: expected NAME=MODE[:KEY=VALUE,...] with MODE one "
                              f"of {', '.join(CAPTURE_MODES)}, e.g. tf32=graphs:model.mla.fp32_output_precision=high")
        if name in CAPTURE_MODES or name in out:
            raise ConfigError(f"--variant {item!r} is not allowed: the name {name!r} is taken (a mode or a variant)")
        out[name] = (mode, parse_sets([x for x in sets.split(",") if x]) if sep2 else {})
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m moelab.train.perf --out FILE [--only k3-mini] [--modes eager,graphs] [--no-docs] [--set K=V]``;
    ``--profile PRESET`` (repeatable): :func:`step_profile` of each instead. ``--set`` overrides a field of every
    preset measured (recorded in the rows' ``overrides`` and the meta)."""
    import argparse

    ap = argparse.ArgumentParser(description=capture_bench.__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", action="append", help="a preset (repeatable; 'none': only the packed-document stage); "
                                                    "default k3-mini and gpu-small")
    ap.add_argument("--modes", default=",".join(CAPTURE_MODES))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--budget-s", type=float, default=450.0)
    ap.add_argument("--profile", action="append", metavar="PRESET", help="profile one eager step of PRESET instead")
    ap.add_argument("--doc-lengths", metavar="LO,HI", help="--profile on batches of packed documents of lengths "
                                                             "uniform in [LO, HI], e.g. 256,6144")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of every preset measured, e.g. --set model.norm_backend=triton")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=MODE:KEY=VALUE[,KEY=VALUE]",
                    help="one more arm in the same rounds, e.g. tf32=graphs:model.mla.fp32_output_precision=high")
    a = ap.parse_args(argv)
    from moelab.config import parse_sets

    over = parse_sets(a.overrides)
    variants = _variants(a.variant)
    if a.profile:
        from moelab.provenance import provenance

        docs = tuple(int(x) for x in a.doc_lengths.split(",")) if a.doc_lengths else None
        if docs is not None and (len(docs) != 2 or not 1 <= docs[0] <= docs[1]):
            raise SystemExit(f"--doc-lengths {a.doc_lengths!r} is not allowed: expected LO,HI with 1 <= LO <= HI")
        rows = [step_profile(p, overrides=over, doc_lengths=docs) | ({"overrides": over} if over else {})
                | ({"doc_lengths": list(docs)} if docs else {}) for p in a.profile]
        write_json(Path(a.out), {"meta": provenance(), "rows": rows})  # machine, versions, commit, date, command
        for r in rows:
            print(r["preset"], f"kernels {r['kernel_ms']:.1f} ms / step {r['step_ms']:.1f} ms,",
                  ", ".join(f"{f} {v['ms']:.1f}" for f, v in r["families"].items()))
        return
    presets = tuple(p for p in a.only if p != "none") if a.only else ("k3-mini", "gpu-small")
    res = capture_bench(presets, tuple(a.modes.split(",")), a.steps, a.window,
                        docs=not a.no_docs, budget_s=a.budget_s, out=a.out, overrides=over, variants=variants,
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    for r in res["rows"] + res["docs16k"]:
        keys = ("preset", "arm", "mode", "tok_per_s", "step_ms", "host_ms", "mfu_activated", "peak_mem_gb",
                "loss_max_abs_diff_vs_eager", "error")
        print({k: r[k] for k in keys if k in r} | ({"speedup": r["speedup_vs_eager"]["median"]}
                                                   if "speedup_vs_eager" in r else {}))


if __name__ == "__main__":
    main()
