"""Balancers (moelab.model.balance): the rules against their formulas and the LP, the statistics a
training forward accumulates, metrics, and bad configurations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from moelab.config import load_config
from moelab.model import MoELab, balance
from moelab.model.balance import (
    BIAS_BALANCERS,
    RouterBalance,
    aux_loss,
    balance_step,
    balanced_routers,
    clear_eval_loads,
    dead_experts,
    eval_loads,
    histogram_range,
    load_average,
    load_cv,
    loss_free_sign_update,
    margin_histogram,
    max_vio,
    qb_exact,
    qb_histogram,
    qb_target,
    quantile_load_update,
    routing_margins,
    token_entropy,
    z_loss,
)
from moelab.model.config import ConfigError, MoEConfig
from moelab.model.moe import LatentMoE
from tests.helpers import assert_close
from tests.model.tiny import tiny_config

# The fused-step tests run on CUDA tensors where a GPU is present, else in the Triton interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _loads(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.topk(scores + bias, k, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=scores.shape[1])


def _skewed_scores(m: int, n: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(m, n, generator=g) + torch.linspace(spread, -spread, n))


def _model(balancer: str, n_layers: int = 2, **moe) -> MoELab:
    cfg = tiny_config(pattern="K", n_layers=n_layers, dense_layers=0)
    cfg.moe.balancer = balancer
    for key, value in moe.items():
        setattr(cfg.moe, key, value)
    torch.manual_seed(0)
    return MoELab(cfg.validate())


# ---------------------------------------------------------------------------------------------- quantile balancing

def _qb_layer(n: int, k: int, **moe) -> LatentMoE:
    return LatentMoE(16, MoEConfig(num_experts=n, top_k=k, balancer="quantile_balancing", **moe))


def _iterate(layer: LatentMoE, logits: torch.Tensor, steps: int) -> list[float]:
    """Route the same batch ``steps`` times, with a balancer step after each; MaxVio of each routing."""
    vio = []
    for _ in range(steps):
        vio.append(max_vio(layer.router.route(logits).tokens_per_expert).item())
        balance_step(layer)
        assert abs(layer.router.bias.sum().item()) < 1e-5  # re-centred
    return vio


@pytest.mark.parametrize("cutoff", ["k_plus_1", "excluding_self"])
@pytest.mark.parametrize("mode", ["exact", "histogram"])
def test_qb_balances_skewed_scores_within_30_steps(mode: str, cutoff: str) -> None:
    """The whole path (router, statistics, balance_step) on one fixed batch of skewed random scores."""
    layer = _qb_layer(16, 2, quantile_balancing_mode=mode, quantile_balancing_cutoff=cutoff)
    vio = _iterate(layer, torch.logit(_skewed_scores(2048, 16, seed=0)), 30)
    assert vio[0] > 2.0, vio[0]  # far from balance at the start
    assert vio[-1] < 0.05, vio


def test_qb_undoes_a_collapse_in_one_step_on_fresh_batches_of_fixed_scores() -> None:
    """The whole path on a stream of FRESH batches from one fixed score distribution whose tokens all
    prefer the same k experts (the collapse of study 2's early training, with no training here).

    The update is not rate-limited: one step takes the next batch from the collapse value n/k - 1 to
    within a small multiple of the sampling floor, and the stream stays there (each bias carries the
    previous batch's sampling error, so about sqrt 2 times the floor). A rate-limited update (EMA
    0.9) is still collapsed after one step. So the tens of steps study 2's QB needs in training come
    from scores that move between optimizer steps, not from this update.
    """
    m, n, k, d = 4096, 64, 8, 16
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, d, generator=g) * 0.05  # a token spread much smaller than the experts' offsets
    offset = torch.zeros(n)
    offset[:k] = 1.0
    batches = [torch.randn(m, d, generator=g) @ w.T + offset for _ in range(12)]
    floor = float(torch.stack([max_vio(_loads(torch.rand(m, n, generator=g), torch.zeros(n), k))
                               for _ in range(16)]).mean())
    vio = _iterate_stream(_qb_layer(n, k), batches)
    assert vio[0] > 0.95 * (n / k - 1)  # nearly every token picks the same k experts
    assert max(vio[1:]) < 2.5 * floor and float(np.median(vio[1:])) < 1.75 * floor, (vio, floor)
    smoothed = _iterate_stream(_qb_layer(n, k, quantile_balancing_ema=0.9), batches)
    assert smoothed[1] > 0.9 * (n / k - 1), smoothed


def _iterate_stream(layer: LatentMoE, batches: list[torch.Tensor]) -> list[float]:
    """Route each batch of logits once, with a balancer step after each; MaxVio of each routing."""
    vio = []
    for logits in batches:
        vio.append(max_vio(layer.router.route(logits).tokens_per_expert).item())
        balance_step(layer)
    return vio


def test_qb_cutoff_on_correlated_scores() -> None:
    """Scores driven by one shared input direction: the report's cutoff stalls, the best response does not.

    This pins down the behaviour ``routing_margins`` documents; the study measures it in training.
    """
    m, n, k = 2048, 16, 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, 16, generator=g)
    x[:, 0] = x[:, 0].abs() + 1
    w = torch.randn(n, 16, generator=g) * 0.3
    w[:, 0] += torch.linspace(6, -6, n)
    logits = x @ w.T
    report = _iterate(_qb_layer(n, k), logits, 30)
    best = _iterate(_qb_layer(n, k, quantile_balancing_cutoff="excluding_self"), logits, 30)
    assert best[-1] < 0.05, best
    assert report[-1] > 0.1, report


def test_qb_routing_scores_within_one_percent_of_the_lp_optimum() -> None:
    from scipy.optimize import linprog

    m, n, k = 256, 8, 2
    q = m * k // n
    s = _skewed_scores(m, n, seed=3, spread=1.5)
    b = torch.zeros(n)
    routings = {}
    for cutoff in ("k_plus_1", "excluding_self"):
        b = torch.zeros(n)
        for _ in range(50):
            b = qb_exact(routing_margins(s, b, k, cutoff), k)
        routings[cutoff] = b

    # max sum s x  s.t. each token picks k experts, each expert takes q tokens, 0 <= x <= 1
    a_eq = np.zeros((m + n, m * n))
    for t in range(m):
        a_eq[t, t * n:(t + 1) * n] = 1
    for j in range(n):
        a_eq[m + j, j::n] = 1
    lp = linprog(-s.double().numpy().ravel(), A_eq=a_eq, b_eq=np.r_[np.full(m, k), np.full(n, q)], bounds=(0, 1))
    assert lp.status == 0, lp.message
    optimum = -lp.fun
    for cutoff, b in routings.items():
        qb_score = s.gather(1, torch.topk(s + b, k, dim=-1).indices).double().sum().item()
        assert abs(qb_score - optimum) <= 0.01 * optimum, (cutoff, qb_score, optimum)
        assert max_vio(_loads(s, b, k)).item() < 0.1, cutoff  # and it is (nearly) the balanced assignment


def test_qb_histogram_agrees_with_exact_within_one_bin() -> None:
    m, n, k, bins = 4096, 32, 4, 1000
    s = _skewed_scores(m, n, seed=1)
    bias = torch.randn(n) * 0.3
    margins = routing_margins(s, bias, k)
    lo, hi = histogram_range(bias)
    assert margins.min() >= lo and margins.max() <= hi  # the range holds every margin
    exact = qb_exact(margins, k)
    hist = margin_histogram(margins, lo, hi, bins)
    assert hist.dtype == torch.long and hist.shape == (n, bins) and (hist.sum(-1) == m).all()
    approx = qb_histogram(hist, lo, hi, k, m)
    width = ((hi - lo) / bins).item()
    err = (approx - exact).abs().max().item()
    assert err <= width, (err, width)
    assert err > 0  # the histogram does round: the comparison is not against itself
    # A histogram summed over two halves of the tokens is the histogram of all of them.
    halves = margin_histogram(margins[: m // 2], lo, hi, bins) + margin_histogram(margins[m // 2:], lo, hi, bins)
    assert torch.equal(halves, hist)


def test_qb_exact_is_the_order_statistic() -> None:
    """b_j = -((q+1)-th largest margin of expert j), re-centred, on a hand-sized example."""
    margins = torch.tensor([[0.9, -0.1], [0.5, 0.2], [0.1, 0.6], [-0.3, 0.4]])  # m 4, n 2, k 1: q = 2
    raw = torch.tensor([-0.1, -0.2])  # minus the 3rd largest of each column: 0.1 and 0.2
    assert_close(raw - raw.mean(), qb_exact(margins, 1), 1e-7, "qb exact")


def test_qb_ema_smooths_towards_the_new_bias() -> None:
    s = _skewed_scores(512, 8, seed=2)
    cfg = MoEConfig(num_experts=8, top_k=2, balancer="quantile_balancing", quantile_balancing_ema=0.75)
    layer = LatentMoE(16, cfg)
    old = torch.linspace(-0.1, 0.1, 8)
    layer.router.bias.copy_(old)
    stats = layer.router.route(torch.logit(s))  # training mode: observed
    new = qb_exact(routing_margins(stats.scores.detach(), old, 2), 2)
    balance_step(layer)
    assert_close(0.75 * old + 0.25 * new, layer.router.bias, 1e-6, "ema")


# ---------------------------------------------------------------------------------------------- other rules

def test_sign_update_moves_each_bias_towards_the_mean_load() -> None:
    bias = torch.tensor([0.1, 0.0, -0.2, 0.05])
    load = torch.tensor([10, 5, 0, 5])  # mean 5: over, at, under, at
    new = loss_free_sign_update(bias, load, 1e-3)
    assert_close(bias + torch.tensor([-1e-3, 0.0, 1e-3, 0.0]), new, 1e-7, "sign step")


def test_quantile_load_update_moves_each_bias_the_right_way() -> None:
    load = torch.tensor([40, 20, 10, 10])  # mean 20
    avg = load_average(torch.ones(4), load, decay=0.5)
    assert_close(torch.tensor([1.5, 1.0, 0.75, 0.75]), avg, 1e-7, "average of normalized loads")
    bias = torch.zeros(4)
    new = quantile_load_update(bias, avg, rate=0.1, q=0.75)
    base = torch.quantile(avg, 0.75)  # 1.125
    assert_close(0.1 * (base - avg) - (0.1 * (base - avg)).mean(), new, 1e-6, "formula, re-centred")
    assert new[0] < 0 < new[2] and new[2] == new[3]  # the overloaded expert loses, the idle ones gain
    assert abs(new.sum().item()) < 1e-7


@pytest.mark.parametrize("balancer", ["loss_free_sign", "quantile_load", "quantile_balancing"])
def test_bias_rules_lower_the_busiest_expert(balancer: str) -> None:
    cfg = MoEConfig(num_experts=8, top_k=2, balancer=balancer)
    layer = LatentMoE(16, cfg)
    s = _skewed_scores(512, 8, seed=4)
    stats = layer.router.route(torch.logit(s))
    load = stats.tokens_per_expert
    balance_step(layer)
    b = layer.router.bias
    assert b[load.argmax()] < 0 < b[load.argmin()], (load, b)


def test_aux_loss_equals_its_formula_by_hand() -> None:
    scores = torch.tensor([[0.5, 0.25], [0.2, 0.2]], requires_grad=True)  # normalized: [2/3, 1/3], [1/2, 1/2]
    loss = aux_loss(scores, torch.tensor([2, 0]), top_k=1, alpha=0.01)
    # f = [1, 0], P = [7/12, 5/12]: 0.01 * 2 * (7/12)
    assert abs(loss.item() - 0.01 * 2 * 7 / 12) < 1e-8
    loss.backward()
    assert scores.grad.abs().sum() > 0  # through P; f is a count
    assert abs(z_loss(torch.zeros(3, 2), 0.1).item() - 0.1 * math.log(2) ** 2) < 1e-8


def test_aux_loss_balancer_adds_its_term_and_leaves_the_bias() -> None:
    m = _model("aux_loss", aux_loss_alpha=0.05, router_z_loss=1e-3)
    ids = torch.randint(0, 50, (2, 8))
    out = m(ids, ids)
    ref = sum(aux_loss(s.scores, s.tokens_per_expert, 2, 0.05) + z_loss(s.logits, 1e-3) for s in out.router_stats)
    assert_close(ref.detach(), out.aux_loss.detach(), 1e-6, "aux loss in ModelOutput")
    out.aux_loss.backward()
    assert m.layers[0].ffn.router.weight.grad.abs().sum() > 0
    balance_step(m)
    assert all(layer.ffn.router.bias.abs().sum() == 0 for layer in m.layers)
    assert _model("none")(ids, ids).aux_loss.item() == 0.0


# ---------------------------------------------------------------------------------------------- the bias

def test_bias_never_enters_mixture_weights_or_gradients() -> None:
    """A common shift of the bias (same selection) changes no output and no gradient; the bias gets none."""
    m = _model("quantile_balancing")
    ids = torch.randint(0, 50, (2, 8))
    results = []
    for shift in (0.0, 1.0):
        m.zero_grad()
        for layer in m.layers:
            layer.ffn.router.bias.copy_(torch.tensor([0.02, -0.01, 0.0, -0.01]) + shift)
        out = m(ids, ids)
        out.loss.backward()
        grads = {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), [s.topk_weight.detach() for s in out.router_stats], grads))
        for layer in m.layers:
            assert not layer.ffn.router.bias.requires_grad and layer.ffn.router.bias.grad is None
            layer.ffn.router.balance.clear()
    (l0, w0, g0), (l1, w1, g1) = results
    assert_close(l0, l1, 0.0, "loss")
    for a, b in zip(w0, w1):
        assert_close(a, b, 0.0, "routing weights")
    for k in g0:
        assert_close(g0[k], g1[k], 0.0, k)
    assert "layers.0.ffn.router.bias" in m.state_dict() and "bias" not in dict(m.named_parameters())


def test_training_forwards_accumulate_and_eval_freezes() -> None:
    m = _model("loss_free_sign", loss_free_sign_rate=1e-2)
    ids = torch.randint(0, 50, (4, 8))
    m.train()
    m(ids[:2])
    m(ids[2:])
    router = m.layers[0].ffn.router
    assert int(router.balance.load.sum()) == 4 * 8 * 2  # both micro-batches
    step = balance_step(m)
    assert router.balance.load is None and balance_step(m) is None  # cleared; nothing new to apply
    assert int(step.load[0].sum()) == 64 and step.metrics["maxvio_batch"].shape == (2,)
    before = router.bias.clone()
    m.eval()
    clear_eval_loads(m)
    with torch.no_grad():
        m(ids)
        m(ids[:1])
    assert balance_step(m) is None and torch.equal(before, router.bias)  # frozen in eval
    layers, load = eval_loads(m)
    assert layers == ["L0", "L1"] and load.shape == (2, 4) and int(load[0].sum()) == 5 * 8 * 2


@pytest.mark.parametrize("balancer,mode", [("loss_free_sign", "exact"), ("quantile_load", "exact"),
                                           ("quantile_balancing", "exact"), ("quantile_balancing", "histogram")])
def test_two_micro_batches_give_the_bias_of_one_batch(balancer: str, mode: str) -> None:
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(5))
    whole, parts = _model(balancer, quantile_balancing_mode=mode), _model(balancer, quantile_balancing_mode=mode)
    for _ in range(3):
        whole(ids)
        a = balance_step(whole)
        parts(ids[:2])
        parts(ids[2:])
        b = balance_step(parts)
        assert torch.equal(a.load, b.load)
        assert_close(a.bias, b.bias, 1e-6, "bias")
    assert a.bias.abs().sum() > 0


# ---------------------------------------------------------------------------------------------- metrics

def test_metrics() -> None:
    load = torch.tensor([[4, 4, 4, 4], [8, 4, 4, 0]])
    assert_close(torch.tensor([0.0, 1.0]), max_vio(load), 1e-7, "maxvio")
    assert_close(torch.tensor([0.0, math.sqrt(8) / 4]), load_cv(load), 1e-6, "cv")
    assert dead_experts(load).tolist() == [0, 1]
    h = token_entropy(torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.9, 0.0, 0.0, 0.0]]))
    assert_close(torch.tensor([math.log(4), 0.0]), h, 1e-6, "entropy")


# ---------------------------------------------------------------------------------------------- bad input

def test_bad_configs_name_the_key() -> None:
    with pytest.raises(ConfigError, match="moe.balancer='qb'"):
        MoEConfig(balancer="qb").validate()
    for key in ("aux_loss_alpha", "loss_free_sign_rate", "quantile_load_rate", "router_z_loss"):
        with pytest.raises(ConfigError, match=f"moe.{key}=-0.1 is not allowed: expected a number >= 0"):
            MoEConfig(**{key: -0.1}).validate()
    with pytest.raises(ConfigError, match="quantile_load_decay=1.0"):
        MoEConfig(quantile_load_decay=1.0).validate()
    with pytest.raises(ConfigError, match="quantile_balancing_bins=1"):
        MoEConfig(quantile_balancing_bins=1).validate()
    with pytest.raises(ConfigError, match="top_k=4 is not allowed: expected < num_experts"):
        MoEConfig(num_experts=4, top_k=4, balancer="quantile_balancing").validate()
    with pytest.raises(ConfigError, match="model.moe.balancer='loss_free_sign' is not allowed.*no MoE layer"):
        load_config("fla-shape", {"model.moe.balancer": "loss_free_sign"})
    with pytest.raises(ConfigError, match="quantile_balancing_mode='approx'"):
        load_config("tiny", {"model.moe.quantile_balancing_mode": "approx"})


def test_qb_refuses_a_fractional_target_load() -> None:
    assert qb_target(12, 2, 8) == 3
    with pytest.raises(ValueError, match=r"m=10 tokens .* k=2, n=8 .* multiple of 4"):
        qb_target(10, 2, 8)
    with pytest.raises(ValueError, match="m\\*k divisible by n"):
        qb_exact(torch.randn(10, 8), 2)


# ---------------------------------------------------------------------------------------------- host syncs

# Ops that read a device value on the host (a CUDA sync) or whose output shape depends on values.
_SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "bincount", "is_nonzero", "equal",
             "tolist")


class _SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _SYNC_OPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _syncs(m: MoELab, ids: torch.Tensor) -> tuple[list[str], list[str]]:
    """Sync ops of one training forward + backward, and of the balancer step after it."""
    with _SyncCounter() as step:
        m(ids, ids, check_ids=False).loss.backward()
    with _SyncCounter() as update:
        balance_step(m)
    return step.seen, update.seen


@pytest.mark.parametrize("mode", ["exact", "histogram"])
def test_quantile_balancing_adds_no_host_sync(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model is host-bound at one-GPU scale: a sync in the router's forward or in the update
    drains the launch queue every step. Counted against ``balancer='none'`` so that syncs elsewhere
    in the model do not count here. The token check reads its count at once on the CPU (a GPU
    defers the read by one step), so it is replaced by a recorder here."""
    checked: list[torch.Tensor] = []
    monkeypatch.setattr(RouterBalance, "check_tokens", lambda self, m: checked.append(m))
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    none, qb = _model("none", n_layers=3), _model("quantile_balancing", n_layers=3, quantile_balancing_mode=mode)
    for m in (none, qb):
        _syncs(m, ids)  # first call: one-time probes (grouped GEMM support)
    base_step, base_update = _syncs(none, ids)
    step, update = _syncs(qb, ids)
    assert step == base_step, (step, base_step)
    assert base_update == [] and update == [], update
    assert [float(m) for m in checked] == ([16.0, 16.0] if mode == "histogram" else [])  # 2 x 8 tokens, each step


def test_histogram_qb_refuses_a_fractional_target_in_the_step() -> None:
    m = _model("quantile_balancing", quantile_balancing_mode="histogram")  # n 4, k 2: m must be even
    ids = torch.randint(0, 50, (1, 7))
    m(ids, ids)
    with pytest.raises(ValueError, match=r"m=7 tokens per optimizer step, k=2, n=4"):
        balance_step(m)


def test_routers_of_different_configs_update_as_each_alone() -> None:
    """balance_step batches routers by config; interleaved configs come back in model order, each
    router with the bias and load it gets when stepped on its own."""
    def layers() -> list[LatentMoE]:
        torch.manual_seed(0)
        cfgs = [dict(balancer="quantile_balancing", quantile_balancing_mode="histogram"),
                dict(balancer="loss_free_sign", loss_free_sign_rate=0.01)]
        return [LatentMoE(16, MoEConfig(num_experts=8, top_k=2, **cfgs[i % 2])) for i in range(4)]

    logits = [torch.logit(_skewed_scores(64, 8, seed=i)) for i in range(4)]
    together, alone = nn.ModuleList(layers()), layers()
    for _ in range(2):
        for i in range(4):
            together[i].router.route(logits[i])
            alone[i].router.route(logits[i])
        got = balance_step(together)
        want = [balance_step(layer) for layer in alone]
        assert got.layers == [f"{i}.router" for i in range(4)]
        assert torch.equal(got.load, torch.cat([w.load for w in want]))
        assert_close(torch.cat([w.bias for w in want]), got.bias, 0.0, "bias")
        assert_close(torch.cat([w.metrics["router_entropy"] for w in want]), got.metrics["router_entropy"], 1e-6,
                     "entropy")
    assert got.bias[0].abs().sum() > 0 and got.bias[1].abs().sum() > 0


# ---------------------------------------------------------------------------------------------- fused step

@pytest.mark.parametrize("balancer,mode,ema", [("none", "exact", 0.0), ("loss_free_sign", "exact", 0.0),
                                               ("quantile_balancing", "histogram", 0.0),
                                               ("quantile_balancing", "histogram", 0.5),
                                               ("quantile_balancing", "exact", 0.0)])
def test_fused_step_matches_the_torch_step(balancer: str, mode: str, ema: float,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's fused step (here in the Triton interpreter) against the torch functions on the same
    forwards: the same loads and dead experts every step, biases within a few fp32 ulp (the histogram
    bins are bitwise the same, the re-centring mean sums in another order), metrics within fp32
    rounding, and every router keeps the bias the step reports."""
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(3)).to(DEV)
    moe = dict(quantile_balancing_mode=mode, quantile_balancing_ema=ema, loss_free_sign_rate=1e-2)
    ref, fused = _model(balancer, **moe).to(DEV), _model(balancer, **moe).to(DEV)
    for _ in range(3):
        ref(ids, ids)
        fused(ids, ids)
        with monkeypatch.context() as patch:
            patch.setattr(balance, "use_triton", lambda backend, t: False)
            a = balance_step(ref)
        with monkeypatch.context() as patch:
            patch.setattr(balance, "use_triton", lambda backend, t: True)
            b = balance_step(fused)
        assert torch.equal(a.load, b.load) and torch.equal(a.metrics["dead_experts"], b.metrics["dead_experts"])
        assert (a.bias - b.bias).abs().max() <= 8 * torch.finfo(torch.float32).eps * (1 + a.bias.abs().max())
        for key in ("maxvio_batch", "load_cv", "router_entropy"):
            assert_close(a.metrics[key], b.metrics[key], 1e-6, key)
        assert torch.equal(torch.stack([r.bias for _, r in balanced_routers(fused)]), b.bias)
    assert balancer not in BIAS_BALANCERS or a.bias.abs().sum() > 0


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("balancer", ["none", "quantile_balancing"])
def test_fused_step_does_not_grow_with_the_layers(balancer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model is host-bound at one-GPU scale, so every launch of the step costs wall time: the
    fused step issues the same ops for 2 layers as for 6 (no per-layer kernels), a handful in all
    (the Triton launches are not torch ops; the interpreter's own copies are kept out of the count)."""
    import moelab.ops.router_stats as ops

    launched: list[str] = []
    for name in ("_stats_kernel", "_finish_kernel"):
        kernel = getattr(ops, name)
        monkeypatch.setattr(ops, name, _Uncounted(kernel, name, launched))
    monkeypatch.setattr(RouterBalance, "check_tokens", lambda self, m: None)  # reads m on the CPU at once
    monkeypatch.setattr(balance, "use_triton", lambda backend, t: True)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEV)
    counts = []
    for n_layers in (2, 6):
        m = _model(balancer, n_layers=n_layers, quantile_balancing_mode="histogram").to(DEV)
        m(ids, ids)
        with _OpCounter() as c:
            balance_step(m)
        counts.append(c.ops)
    assert counts[0] == counts[1] <= 20, counts
    assert launched == ["_stats_kernel", "_finish_kernel"] * 2


class _Uncounted:
    """A Triton kernel whose launches run outside the dispatch mode (the interpreter copies every argument)."""

    def __init__(self, kernel, name: str, launched: list[str]) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append(self.name)
            with _disable_current_modes():
                return self.kernel[grid](*args, **kwargs)

        return launch
