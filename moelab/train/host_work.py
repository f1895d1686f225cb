"""The host work of one training step, counted: aten ops (by overload), Triton launches (by kernel), autograd
Function applications and graph nodes (by type), and Python calls; what makes a step host-bound.

``count_step`` is what ``kernels/bench.py --entry model`` records per config (``step_ops``) and what the
AttnRes and MoE tests bound; it runs on any device (on CPU the Triton kernels run in the interpreter, and
``Hooks`` counts each as one launch, not the interpreter's work).
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import os
import pstats
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher's Python mode, by overload packet, except while
    ``paused`` (the Triton interpreter running a kernel: on a GPU that is one launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class Hooks:
    """Counters of Triton launches (by kernel) and autograd Function applications (by class), patched at the
    classes so that every kernel and Function of the process is seen. While a kernel runs (in the interpreter),
    ``ops`` stops counting and ``prof`` is off: the launch counts, not the interpreter's work."""

    def __init__(self, ops: CountOps | None = None, prof: cProfile.Profile | None = None) -> None:
        self.ops, self.prof = ops, prof
        self.launches: collections.Counter = collections.Counter()
        self.applies: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def installed(self) -> Iterator[Hooks]:
        import triton.runtime.jit as jit
        from triton.runtime.interpreter import InterpretedFunction

        saved = [(cls, cls.run) for cls in (jit.JITFunction, InterpretedFunction)]
        apply = torch.autograd.Function.apply.__func__
        hooks = self

        def counted_run(orig):
            def run(self, *args, **kwargs):
                if not kwargs.get("warmup", False):
                    hooks.launches[self.fn.__name__] += 1
                if hooks.prof is not None:
                    hooks.prof.disable()
                if hooks.ops is not None:
                    hooks.ops.paused = True
                try:
                    return orig(self, *args, **kwargs)
                finally:
                    if hooks.ops is not None:
                        hooks.ops.paused = False
                    if hooks.prof is not None:
                        hooks.prof.enable()
            return run

        def counted_apply(cls, *args, **kwargs):
            hooks.applies[cls.__name__] += 1
            return apply(cls, *args, **kwargs)

        for cls, orig in saved:
            cls.run = counted_run(orig)
        torch.autograd.Function.apply = classmethod(counted_apply)
        try:
            yield self
        finally:
            for cls, orig in saved:
                cls.run = orig
            torch.autograd.Function.apply = classmethod(apply)


def graph_nodes(root: torch.Tensor) -> collections.Counter:
    """Autograd nodes reachable from ``root.grad_fn`` (what its backward runs), by node type."""
    counts: collections.Counter = collections.Counter()
    seen, todo = set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] += 1
        todo.extend(nxt for nxt, _ in node.next_functions)
    return counts


def train_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What training minimizes (``LitMoELab.training_step``): loss + aux loss under bf16 autocast, no id check
    (its min/max reads would make the host wait on the GPU every step). ``x``: token ids ``[B, T]``."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x, x, return_logits=False, check_ids=False)
    return out.loss + out.aux_loss


def train_update(loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


ATTNRES_FILES = (os.path.join("model", "attnres.py"), os.path.join("ops", "attnres.py"))


def count_step(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer,
               loss_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = train_loss,
               python_calls: bool = True) -> dict[str, Any]:
    """The host work of one training step (forward, backward, optimizer; the caller warms up first).

    Totals and ``by`` key of: ``aten_ops`` (``_fwd``, ``_bwd``, ``_opt``), ``triton_launches``, ``fn_applies``
    (autograd Functions), ``graph_nodes`` (what the backward runs); with ``python_calls`` also ``py_calls``
    and ``attnres_py_calls`` (cProfile over a second step; calls into ``model/attnres.py``, ``ops/attnres.py``).
    """
    ops = CountOps()
    hooks = Hooks(ops=ops)
    with hooks.installed(), ops:
        loss = loss_fn(model, x)
        fwd = collections.Counter(ops.counts)
        nodes = graph_nodes(loss)
        loss.backward()
        bwd = collections.Counter(ops.counts) - fwd
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt_ops = collections.Counter(ops.counts) - fwd - bwd
    out: dict[str, Any] = {
        "aten_ops": sum(ops.counts.values()), "aten_ops_fwd": sum(fwd.values()), "aten_ops_bwd": sum(bwd.values()),
        "aten_ops_opt": sum(opt_ops.values()), "triton_launches": sum(hooks.launches.values()),
        "fn_applies": sum(hooks.applies.values()), "graph_nodes": sum(nodes.values()),
        "by": {"aten_ops_fwd": dict(fwd), "aten_ops_bwd": dict(bwd), "aten_ops_opt": dict(opt_ops),
               "triton_launches": dict(hooks.launches), "fn_applies": dict(hooks.applies),
               "graph_nodes": dict(nodes)}}
    if python_calls:
        prof = cProfile.Profile()
        with Hooks(prof=prof).installed():
            prof.enable()
            train_update(loss_fn(model, x), opt)
            prof.disable()
        stats = pstats.Stats(prof).stats  # key (file, line, name) -> (primitive calls, total calls, ...)
        py_calls: collections.Counter = collections.Counter()
        attnres: dict[str, int] = {}
        for (path, line, name), v in stats.items():
            py_calls[f"{os.path.basename(path)}:{name}"] += v[1]
            if path.endswith(ATTNRES_FILES):
                attnres[f"{os.path.basename(path)}:{name}:{line}"] = v[1]
        out.update(py_calls=sum(py_calls.values()), attnres_py_calls=sum(attnres.values()))
        out["by"].update(py_calls=dict(py_calls), attnres_py_calls=attnres)
    return out
