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
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in SYNC_OPS:
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
    package = here.parent.parent
    frames = [f for f in traceback.extract_stack() if Path(f.filename).resolve() != here]
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if package in path.parents:
            return f"{path.relative_to(package.parent)}:{frame.lineno} {frame.name}"
    frame = frames[-1]
    parts = Path(frame.filename).parts
    short = "/".join(parts[parts.index("torch"):] if "torch" in parts else parts[-2:])
    return f"{short}:{frame.lineno} {frame.name}"
