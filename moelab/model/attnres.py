"""How sublayers read the residual stream: PreNorm, Full AttnRes, Block AttnRes (attnres.md).

Every mixer and every FFN is one sublayer ``f_l``; with ``v_0`` the token embedding and
``v_l = f_l(Norm(h_l))`` a sublayer's output:

- ``prenorm``:        ``h_l = v_0 + sum_{i<l} v_i`` (the running sum).
- ``full_attnres``:   ``h_l = sum_{i<l} a_{i->l} v_i``, ``a_{.->l} = softmax_i(w_l^T RMSNorm_l(v_i))``.
- ``block_attnres``:  the same softmax over block summaries ``[b_0 = v_0, b_1, ..., b_{n-1},
  partial b_n]`` where ``b_n`` sums the outputs of the sublayers of block n (``S = L / N``
  sublayers each; with ``uneven_blocks`` sizes differ by one at most) and the partial sum of the
  current block is a source once it is non-empty. Full AttnRes is the special case ``S = 1``, and
  is computed by the same code.

``w_l`` is a learned pseudo-query per sublayer, initialized to zero (training starts from a
uniform average); ``RMSNorm_l`` (learned weight) normalizes the keys only, the values are the raw
``v_i``. One more pseudo-query reads the stream for the final norm and LM head. The mixing runs
over depth, separately for every token, so it is causal whenever the sublayers are.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from moelab.model.config import ResidualConfig
from moelab.model.norm import RMSNorm
from moelab.ops.attnres import GradSlot, LaunchConfig, Sources, depth_attention, read_sources


class DepthAttention(nn.Module):
    """Softmax over depth with one pseudo-query: ``sources [S, B, T, D] -> h [B, T, D]``.

    ``backend="triton"`` (``"auto"``: on CUDA tensors) runs the fused ``moelab.ops.attnres`` op on
    the sources as they are (no stack, fp32 math; h in the sources' promoted dtype, so fp32 with the
    embedding among them, where the torch path under autocast returns bf16), with each source's
    gradient summed in place in its GradSlot when ``slots`` are given or the sources are a
    :class:`~moelab.ops.attnres.Sources` (what the residual stream passes).
    """

    def __init__(self, d_model: int, norm_eps: float = 1e-6, backend: str = "auto",
                 launch: LaunchConfig | None = None) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(d_model))
        self.key_norm = RMSNorm(d_model, eps=norm_eps)
        self.backend = backend
        self.launch = launch  # the fused op's launch (None: its rule, launch_config(d_model))

    def forward(self, sources: torch.Tensor | list[torch.Tensor] | Sources, weights: bool = True,
                slots: list[GradSlot] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mix ``sources`` (``[S, B, T, D]``, S tensors ``[B, T, D]`` or a Sources); return ``h [B, T, D]``
        and the weights ``[S, B, T]`` (fp32; None when ``weights`` is False)."""
        if isinstance(sources, Sources):
            if self.backend == "triton" or (self.backend == "auto" and sources.tensors[0].is_cuda):
                if torch.compiler.is_compiling():  # depth_attention is the op's graph break
                    return depth_attention(sources, self.query, self.key_norm.weight, self.key_norm.eps,
                                           backend="triton", config=self.launch, weights=weights)
                return read_sources(sources, self.query, self.key_norm.weight, self.key_norm.eps, weights, self.launch)
            sources = sources.tensors
        elif self.backend == "triton" or (self.backend == "auto" and sources[0].is_cuda):
            return depth_attention(sources, self.query, self.key_norm.weight, self.key_norm.eps, backend="triton",
                                   config=self.launch, weights=weights, slots=slots)
        if not isinstance(sources, torch.Tensor):
            sources = torch.stack(sources)
        logits = self.key_norm(sources).float() @ self.query.float()  # [S, B, T]
        p = logits.softmax(dim=0)
        h = torch.einsum("sbt,sbtd->btd", p.to(sources.dtype), sources)
        return h, (p if weights else None)


class AttnResidual(nn.Module):
    """Parameters of a residual mode: ``n_sublayers + 1`` pseudo-queries (none for prenorm).

    Use :meth:`stream` once per forward pass to get the per-pass bookkeeping.
    """

    def __init__(self, d_model: int, n_sublayers: int, cfg: ResidualConfig, norm_eps: float = 1e-6) -> None:
        super().__init__()
        cfg.validate(n_sublayers)
        self.mode = cfg.mode
        self.n_sublayers = n_sublayers
        self.block_ends = frozenset(cfg.block_ends(n_sublayers))  # sublayer counts that close a block
        n_queries = 0 if cfg.mode == "prenorm" else n_sublayers + 1
        launch = cfg.launch_config()
        self.depth = nn.ModuleList(DepthAttention(d_model, norm_eps, cfg.backend, launch) for _ in range(n_queries))

    def stream(self, embedding: torch.Tensor, diagnostics: bool = False) -> ResidualStream:
        """Start a pass from the token embedding ``[B, T, D]``."""
        return ResidualStream(self, embedding, diagnostics)


class ResidualStream:
    """Per-forward state of the residual stream: ``read(l)`` before sublayer l, ``write(l, out)`` after.

    Diagnostics (when enabled), all detached: ``depth_weights`` (per read, the mean depth-
    attention weight of each source over batch and tokens, ``[n_sources]``; AttnRes modes only),
    ``hidden_rms`` (RMS of each read ``h_l``, the last one is the final read) and ``output_rms``
    (RMS of each sublayer output ``v_l``).
    """

    def __init__(self, module: AttnResidual, embedding: torch.Tensor, diagnostics: bool) -> None:
        self.m = module
        self.x = embedding  # prenorm: the running sum
        # AttnRes: b_0, every completed block, then the partial sum of the open block while it is not
        # empty. Each source is checked once as it comes and carries a gradient slot (fused path): a
        # block is read by every later sublayer, and its gradient is summed in place there instead of
        # by autograd (moelab.ops.attnres).
        self.sources = Sources(embedding) if module.mode != "prenorm" else None
        self.open = False  # whether the last source is the open block's partial sum
        self.diag: dict[str, list] | None = (
            {"depth_weights": [], "hidden_rms": [], "output_rms": []} if diagnostics else None
        )

    def _read(self, idx: int) -> torch.Tensor:
        if self.m.mode == "prenorm":
            h = self.x
        else:
            h, w = self.m.depth[idx](self.sources, weights=self.diag is not None)
            if self.diag is not None:
                self.diag["depth_weights"].append(w.detach().mean(dim=(1, 2)))
        if self.diag is not None:
            self.diag["hidden_rms"].append(h.detach().float().pow(2).mean().sqrt())
        return h

    def read(self, i: int) -> torch.Tensor:
        """Input ``h_i`` ``[B, T, D]`` of sublayer ``i`` (0-based), before its pre-norm."""
        return self._read(i)

    def write(self, i: int, out: torch.Tensor) -> None:
        """Record the output ``v_i`` ``[B, T, D]`` of sublayer ``i``."""
        if self.diag is not None:
            self.diag["output_rms"].append(out.detach().float().pow(2).mean().sqrt())
        if self.m.mode == "prenorm":
            self.x = self.x + out
            return
        if self.open:
            self.sources.replace_last(self.sources.tensors[-1] + out)
        else:
            self.sources.append(out)
        self.open = i + 1 not in self.m.block_ends

    def read_final(self) -> torch.Tensor:
        """The stream as the final norm + LM head see it, ``[B, T, D]``."""
        return self._read(self.m.n_sublayers)

    def diagnostics(self) -> dict | None:
        """The recorded diagnostics, norms stacked to ``[n_reads]`` / ``[n_sublayers]`` tensors."""
        if self.diag is None:
            return None
        return {
            "depth_weights": self.diag["depth_weights"],
            "hidden_rms": torch.stack(self.diag["hidden_rms"]),
            "output_rms": torch.stack(self.diag["output_rms"]),
        }
