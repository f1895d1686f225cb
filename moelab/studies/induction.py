"""How many steps a model needs to learn in-context copying, the mechanism behind passkey and MQAR retrieval.

Study 4 asks whether a context curriculum reaches a longer effective context, which it can only answer once the
model retrieves at all. This toy probe (CPU, minutes) measures the step at which a model learns to copy:

    a sequence of ``seq_len`` ids: ``seq_len / 2`` uniform random ids, then the same ids again;
    loss and accuracy on the repeat only, where each id follows from finding the previous occurrence
    of the current id and copying what came after it (an induction head).

Arms: moelab hybrids (KDA with its short convolution + NoPE gated MLA, K3's design: position comes from the KDA
layers only) beside a plain softmax-attention transformer with rotary positions and without positions, all at
the same width, weight initialisation (N(0, 0.02)), optimiser and data. The blocks are each model's own (moelab:
RMSNorm, gated mixers, SwiGLU FFNs; the reference: LayerNorm, GELU MLPs), so the probe compares designs, not one
factor: the two references differ only in positions. ``steps_to_learn``: the first evaluated step whose held-out
accuracy reaches ``threshold`` (None: not within the run).

    python -m moelab.studies.induction --out studies/04_context_curriculum/results/induction_cpu.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE = -100
# arm name -> (kind, n_layers, pattern): "reference" arms take rope True/False, "moelab" arms a layer pattern
ARMS: dict[str, tuple[str, int, str]] = {
    "attention-rope-L2": ("reference", 2, "rope"),
    "attention-nope-L2": ("reference", 2, "nope"),
    "moelab-KM-L2": ("moelab", 2, "KM"),
    "moelab-KKKM-L4": ("moelab", 4, "KKKM"),
}


def copy_batch(n: int, seq_len: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, targets)``, each ``[n, seq_len]`` int64: random ids in ``[1, vocab_size)`` repeated once;
    targets are the next ids on the repeat and ``IGNORE`` (-100) on the first half."""
    if seq_len < 4 or seq_len % 2:
        raise ValueError(f"seq_len={seq_len} is not allowed: expected an even number >= 4")
    if vocab_size < 3:
        raise ValueError(f"vocab_size={vocab_size} is not allowed: expected >= 3")
    rng = np.random.default_rng(seed)
    half = seq_len // 2
    x = rng.integers(1, vocab_size, size=(n, half))
    seq = np.concatenate([x, x, x[:, :1]], axis=1)  # one id past the end: the last input's target
    targets = seq[:, 1: seq_len + 1].copy()
    targets[:, :half] = IGNORE  # the first half, and the repeat's first id (random where it is asked for)
    return torch.from_numpy(seq[:, :seq_len].copy()), torch.from_numpy(targets)


def _rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary positions on ``x`` ``[B, H, T, D]`` (base 10000, the two halves of D as pairs)."""
    T, D = x.shape[-2], x.shape[-1]
    half = D // 2
    freq = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    angle = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * freq[None]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, rope: bool) -> None:
        super().__init__()
        self.n_heads, self.rope = n_heads, rope
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = _rotate(q), _rotate(k)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(o.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.norm2(x))


class ReferenceTransformer(nn.Module):
    """A plain pre-LayerNorm softmax-attention transformer (the probe's reference), with rotary positions
    (``rope``) or none; ``forward(input_ids [B, T]) -> logits [B, T, vocab_size]``."""

    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, rope: bool,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, rope) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)
        for m in self.modules():  # moelab's N(0, init_std) for every weight, so the arms differ in the mixer only
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(arm: str, vocab_size: int, d_model: int, seq_len: int) -> nn.Module:
    """The arm's model at the probe's width: ``d_model`` wide, 2 heads, dense FFNs, N(0, 0.02) weights."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r} is not allowed: expected one of {sorted(ARMS)}")
    kind, n_layers, spec = ARMS[arm]
    if kind == "reference":
        return ReferenceTransformer(vocab_size, d_model, n_layers, 2, rope=spec == "rope")
    from moelab.config import load_config
    from moelab.model import MoELab

    head = d_model // 2
    cfg = load_config("tiny", {"model.vocab_size": vocab_size, "model.d_model": d_model, "model.n_layers": n_layers,
                               "model.pattern": spec, "model.final_mla": False, "model.dense_layers": n_layers,
                               "model.max_seq_len": seq_len, "model.kda.num_heads": 2, "model.kda.head_dim": head,
                               "model.mla.num_heads": 2, "model.mla.head_dim": head,
                               "model.mla.kv_latent_dim": d_model})
    return MoELab(cfg.model)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def train_arm(arm: str, seed: int, *, steps: int = 2000, every: int = 100, seq_len: int = 64, vocab_size: int = 512,
              d_model: int = 64, batch_size: int = 32, lr: float = 3e-3, warmup: int = 50, eval_samples: int = 128,
              threshold: float = 0.9) -> dict[str, Any]:
    """Train ``arm`` on fresh copy batches (AdamW, linear warmup then constant ``lr``, clip 1.0, one thread) and
    evaluate every ``every`` steps on ``eval_samples`` held-out sequences.

    Returns ``{"arm", "seed", "params", "curve": [{"step", "accuracy", "nll"}], "steps_to_learn", "wall_s"}``.
    """
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = build(arm, vocab_size, d_model, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    ev_ids, ev_tg = copy_batch(eval_samples, seq_len, vocab_size, seed=10**9 + seed)
    mask = ev_tg != IGNORE
    curve, t0 = [], time.perf_counter()
    for step in range(steps + 1):
        if step % every == 0 or step == steps:
            model.eval()
            with torch.no_grad():
                logits = _logits(model, ev_ids)[mask].float()
                curve.append({"step": step, "accuracy": (logits.argmax(-1) == ev_tg[mask]).float().mean().item(),
                              "nll": F.cross_entropy(logits, ev_tg[mask]).item()})
            model.train()
        if step == steps:
            break
        ids, tg = copy_batch(batch_size, seq_len, vocab_size, seed=seed * 10**6 + step)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        loss = F.cross_entropy(_logits(model, ids).reshape(-1, vocab_size).float(), tg.reshape(-1),
                               ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    learned = next((p["step"] for p in curve if p["accuracy"] >= threshold), None)
    return {"arm": arm, "seed": seed, "params": sum(p.numel() for p in model.parameters()), "curve": curve,
            "steps_to_learn": learned, "wall_s": round(time.perf_counter() - t0, 1)}


def _defaults() -> dict[str, Any]:
    """:func:`train_arm`'s settings and their defaults (what a result file records beside the ones given)."""
    return {k: p.default for k, p in inspect.signature(train_arm).parameters.items()
            if p.default is not inspect.Parameter.empty}


def _job(args: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
    arm, seed, kw = args
    return train_arm(arm, seed, **kw)


def run(arms: list[str], seeds: list[int], jobs: int = 1, **kw: Any) -> list[dict[str, Any]]:
    """Every (arm, seed) of the probe, ``jobs`` at a time (processes of one thread each); runs in arm order."""
    work = [(a, s, kw) for a in arms for s in seeds]
    if jobs <= 1:
        return [_job(w) for w in work]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(_job, work))


def summarize(runs: list[dict[str, Any]], steps: int) -> dict[str, dict[str, Any]]:
    """Per arm: ``steps_to_learn`` per seed, how many seeds learned, and the final accuracy's mean."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        a = out.setdefault(r["arm"], {"steps_to_learn": [], "final_accuracy": []})
        a["steps_to_learn"].append(r["steps_to_learn"])
        a["final_accuracy"].append(r["curve"][-1]["accuracy"])
    for a in out.values():
        done = [s for s in a["steps_to_learn"] if s is not None]
        a["learned"] = f"{len(done)} of {len(a['steps_to_learn'])} seeds within {steps} steps"
        a["median_steps_to_learn"] = float(np.median(done)) if len(done) == len(a["steps_to_learn"]) else None
        a["mean_final_accuracy"] = float(np.mean(a["final_accuracy"]))
    return out


RESULT = "studies/04_context_curriculum/results/induction_cpu.json"  # the committed probe, relative to the repo


def load(path: str | Path | None = None) -> dict[str, Any] | None:
    """The probe's result file (default: the committed :data:`RESULT`), None where there is none."""
    from moelab.base import repo_root

    p = Path(path) if path is not None else repo_root() / RESULT
    return json.loads(p.read_text()) if p.is_file() else None


def table(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per arm: its mixers, positions, parameters, steps to ``threshold`` accuracy per seed (None: not
    within the run) and the final accuracy's mean over seeds."""
    rows = []
    steps = result["meta"]["settings"]["steps"]
    for arm, s in result["summary"].items():
        kind, n_layers, spec = ARMS[arm]
        params = next(r["params"] for r in result["runs"] if r["arm"] == arm)
        rows.append({"arm": arm, "layers": n_layers,
                     "mixers": "softmax attention" if kind == "reference" else f"{spec} (K: KDA, M: NoPE gated MLA)",
                     "positions": {"rope": "rotary", "nope": "none"}.get(spec, "from the KDA layers"),
                     "params": params,
                     "steps to 0.9 (per seed)": ", ".join(str(v) if v is not None else f"> {steps}"
                                                          for v in s["steps_to_learn"]),
                     "final accuracy": round(s["mean_final_accuracy"], 3)})
    return rows


def figure(result: dict[str, Any]) -> Any:
    """Held-out copy accuracy against training steps, one colour per arm, one line per seed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), dpi=100)
    ax = fig.subplots()
    colors = dict(zip(ARMS, ("tab:green", "tab:grey", "tab:blue", "tab:purple")))
    for arm in result["summary"]:
        for i, r in enumerate(x for x in result["runs"] if x["arm"] == arm):
            ax.plot([p["step"] for p in r["curve"]], [p["accuracy"] for p in r["curve"]], color=colors.get(arm),
                    lw=1.2, alpha=0.85, label=arm if i == 0 else None)
    ax.axhline(result["meta"]["settings"].get("threshold", 0.9), color="firebrick", ls="--", lw=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("copy accuracy on the repeat")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def caption(result: dict[str, Any], number: str = "2c") -> str:
    """The figure's caption (Markdown), its settings read from ``result``."""
    st = result["meta"]["settings"]
    seeds = sorted({r["seed"] for r in result["runs"]})
    return (f"**Figure {number}.** Why retrieval comes late: a toy probe on a CPU "
            f"(`python -m moelab.studies.induction`, width {st.get('d_model', 64)}, {st['seq_len']}-token sequences "
            "whose second half repeats the first, the "
            f"loss on the repeat only; {len(seeds)} seed(s) per arm, {st['steps']} steps). Held-out copy accuracy "
            "against training steps for softmax attention with rotary positions and without positions, and for "
            "moelab's KDA + NoPE gated MLA hybrids (K3's design: positions come from the KDA layers only; each "
            "with its own norms and FFNs, so only the two references differ in one factor, positions); the table "
            f"gives each seed's first evaluated step at {st.get('threshold', 0.9)} accuracy. Copying is what passkey "
            "and MQAR ask for: find the earlier occurrence, read what followed it.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moelab.studies.induction", description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help=f"JSON file for the curves (the committed one: {RESULT})")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.every < 1:
        ap.error(f"--steps {a.steps} and --every {a.every} must be >= 1")
    from moelab.provenance import provenance

    settings = {"steps": a.steps, "every": a.every, "seq_len": a.seq_len}
    runs = run(a.arms, a.seeds, jobs=a.jobs, **settings)
    summary = summarize(runs, a.steps)
    for arm, s in summary.items():
        print(f"{arm:>20}: steps to 0.9 accuracy {s['steps_to_learn']} ({s['learned']}); "
              f"final accuracy {s['mean_final_accuracy']:.3f}")
    if a.out is not None:
        meta = {**provenance(["python", "-m", "moelab.studies.induction", *(argv or sys.argv[1:])]),
                "task": "copy: seq_len/2 random ids then the same ids again; accuracy on the repeat",
                "settings": {**_defaults(), **settings}}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0 if all(math.isfinite(p["nll"]) for r in runs for p in r["curve"]) else 1


__all__ = ["ARMS", "RESULT", "ReferenceTransformer", "build", "caption", "copy_batch", "figure", "load", "run",
           "summarize", "table", "train_arm"]

if __name__ == "__main__":
    sys.exit(main())
