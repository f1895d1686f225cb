"""Run configuration: dataclasses, YAML presets, ``--set`` overrides, validation at load time.

One run is described by a :class:`RunConfig`::

    name, preset, seed
    model:    moelab.model.config.ModelConfig     (the architecture)
    data:     moelab.data.config.DataConfig       (corpus, tokenizer, seq_len)
    train:    TrainConfig                         (optimizer, schedule, precision, devices, checkpoints)
    tracking: TrackingConfig                      (MLflow experiment, URI, run name)

Presets live in ``moelab/presets/<name>.yaml`` and are loaded by name or by path::

    cfg = load_config("tiny", ["train.max_steps=20", "model.kda.gate=softplus"])

Loading builds the dataclasses from the YAML mapping field by field, checking every value
against the field's annotation (unknown keys, wrong types) and then each section's
``validate()`` (ranges), so a bad value fails before anything is built, with a message naming
the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from moelab.base import ConfigError, _check, _one_of
from moelab.data.config import DataConfig, resolve_path
from moelab.data.curriculum import plan
from moelab.model.config import ModelConfig
from moelab.tracking import experiment_name
from moelab.utils import flatten_dict

PRESET_DIR = Path(__file__).resolve().parent / "presets"

Precision = Literal["auto", "bf16-mixed", "32-true"]
Compile = Literal["none", "default", "graphs", "compiled_graphs"]
COMPILE_MODES: tuple[str, ...] = typing.get_args(Compile)
# the modes that run the whole step as one CUDA graph (moelab.train.module.CapturedStep)
CAPTURED_MODES: tuple[str, ...] = ("graphs", "compiled_graphs")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
STRATEGIES = ("auto", "ddp", "ddp_find_unused_parameters_true")


@dataclass
class TrainConfig:
    """Optimizer, schedule, precision, devices and checkpoint cadence.

    The learning rate warms up linearly from 0 to ``lr`` over ``warmup_steps`` optimizer steps,
    then follows a cosine down to ``lr * min_lr_ratio`` at ``max_steps``.
    """

    max_steps: int = 100  # optimizer steps
    batch_size: int = 8  # sequences per device per micro-batch
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1  # on matrices only; norms, biases and gains are not decayed
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # global L2 norm; 0 disables clipping
    precision: Precision = "auto"  # auto: bf16-mixed on a CUDA device, 32-true otherwise
    accelerator: str = "auto"
    devices: int | str = "auto"  # an integer or "auto"
    strategy: str = "auto"
    val_every: int = 50  # optimizer steps between validations (and checkpoints); the last step always validates
    val_batches: int = 8
    log_every: int = 10
    ckpt_dir: str = ""  # "": runs/<name> under the repository root
    # True: bitwise-reproducible kernels (torch.use_deterministic_algorithms); "warn" only warns when
    # an op has no deterministic implementation (MoE scatter on CUDA), so GPU runs keep going.
    deterministic: bool | Literal["warn"] = True
    accumulate_grad_batches: int = 1
    # none: eager; default: torch.compile of the model (dynamo + inductor; the fused Triton ops run eagerly
    # between the compiled pieces); graphs: the whole step (forward, backward, balancer, clipping, AdamW) as one
    # CUDA graph (one CUDA device, one micro-batch per step, fixed shapes); compiled_graphs: both, the compiled
    # model inside the captured step (inductor's fused kernels without their launch cost). moelab.train.module
    # applies it.
    compile: Compile = "none"
    # Optimizer steps trained with the MoE balancer off before it switches on (a warm start): during the first
    # balancer_start_step steps the router bias stays zero (the update's result is discarded, its loads still
    # recorded) and the auxiliary loss is not added; from the next step on the balancer runs as configured,
    # starting from zero bias. 0: on from the first step. moelab.train.balancer and .module apply it
    # (eager: host branches; graphs: the same switch as arithmetic on a device step counter).
    balancer_start_step: int = 0

    def validate(self) -> TrainConfig:
        _check(self.max_steps >= 1, "train.max_steps", self.max_steps, "an integer >= 1")
        _check(self.batch_size >= 1, "train.batch_size", self.batch_size, "an integer >= 1")
        _check(self.lr > 0, "train.lr", self.lr, "a positive number")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "train.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _check(0 <= self.warmup_steps <= self.max_steps, "train.warmup_steps", self.warmup_steps,
               f"an integer in 0..max_steps ({self.max_steps})")
        _check(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "a number >= 0")
        _check(all(0.0 <= b < 1.0 for b in self.betas), "train.betas", self.betas, "two numbers in [0, 1)")
        _check(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "a number >= 0 (0 disables clipping)")
        _one_of("train.accelerator", self.accelerator, ACCELERATORS)
        _check(self.devices == "auto" or (isinstance(self.devices, int) and self.devices >= 1), "train.devices",
               self.devices, "an integer >= 1 or 'auto'")
        _one_of("train.strategy", self.strategy, STRATEGIES)
        _check(self.val_every >= 1, "train.val_every", self.val_every, "an integer >= 1")
        _check(self.val_batches >= 1, "train.val_batches", self.val_batches, "an integer >= 1")
        _check(self.log_every >= 1, "train.log_every", self.log_every, "an integer >= 1")
        _check(self.accumulate_grad_batches >= 1, "train.accumulate_grad_batches", self.accumulate_grad_batches,
               "an integer >= 1")
        _one_of("train.compile", self.compile, COMPILE_MODES)
        _check(0 <= self.balancer_start_step < self.max_steps, "train.balancer_start_step", self.balancer_start_step,
               f"an integer in 0..max_steps - 1 ({self.max_steps - 1}): the balancer must act on at least one step")
        if self.compile in CAPTURED_MODES:
            _check(self.accumulate_grad_batches == 1, "train.accumulate_grad_batches", self.accumulate_grad_batches,
                   f"1 with train.compile={self.compile!r} (one captured step per optimizer step)")
        return self


@dataclass
class TrackingConfig:
    """Where and under which names a run is recorded in MLflow."""

    experiment: str = ""  # "": train/<preset> (moelab.tracking.experiment_name)
    tracking_uri: str = ""  # "": $MLFLOW_TRACKING_URI, else sqlite:///<repo>/mlflow.db
    run_name: str = ""  # "": the config's name
    log_system_metrics: bool = True  # CPU/RAM/disk/network and NVIDIA GPUs every interval
    system_metrics_interval_s: float = 10.0
    retry_timeout_s: float = 60.0  # at the end of a run, how long to wait for a failing store to come back
    enabled: bool = True  # False: no MLflow at all (unit tests, quick experiments)

    def validate(self) -> TrackingConfig:
        _check(self.system_metrics_interval_s > 0, "tracking.system_metrics_interval_s",
               self.system_metrics_interval_s, "a positive number of seconds")
        _check(self.retry_timeout_s >= 0, "tracking.retry_timeout_s", self.retry_timeout_s, "a number of seconds >= 0")
        return self


@dataclass
class RunConfig:
    """Everything one training run needs. ``k3_reference`` carries reference totals (k3.yaml) for ``moelab info``.

    ``name`` names the run and its folder (``runs/<name>``); ``preset`` records the preset it was
    loaded from (``load_config`` fills it in: the preset's name, or the YAML file's stem).
    """

    name: str = "run"
    preset: str = ""
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    k3_reference: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> RunConfig:
        _check(re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name) is not None, "name", self.name,
               "letters, digits, '_', '-' or '.' (it names the checkpoint folder)")
        _check(self.seed >= 0, "seed", self.seed, "an integer >= 0")
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.tracking.validate()
        for i, stage in enumerate(self.data.curriculum):
            _check(stage.seq_len <= self.model.max_seq_len, f"data.curriculum[{i}].seq_len", stage.seq_len,
                   f"<= model.max_seq_len ({self.model.max_seq_len})")
        if self.data.curriculum:
            plan(self.data.curriculum, self.train.batch_size, self.data.seq_len, self.train.accumulate_grad_batches,
                 self.train.max_steps)
        return self

    def check_trainable(self) -> None:
        """Cross-section checks a training run needs (``moelab info`` does not: k3.yaml has no data section)."""
        want = self.data.effective_vocab_size
        _check(self.model.vocab_size == want, "model.vocab_size", self.model.vocab_size,
               f"the tokenizer's vocabulary size {want} (data.tokenizer={self.data.tokenizer!r}, "
               f"data.vocab_size={self.data.vocab_size}); set both to the same value")
        _check(self.data.seq_len <= self.model.max_seq_len, "data.seq_len", self.data.seq_len,
               f"<= model.max_seq_len ({self.model.max_seq_len})")

    @property
    def ckpt_dir(self) -> Path:
        """Checkpoint folder: ``train.ckpt_dir`` (relative to the repository root) or ``runs/<name>``."""
        return resolve_path(self.train.ckpt_dir or f"runs/{self.name}")

    @property
    def experiment(self) -> str:
        """The MLflow experiment: ``tracking.experiment``, else ``train/<preset>`` (one rule for all runs)."""
        return self.tracking.experiment or experiment_name("train", self.preset or self.name)


# ---------------------------------------------------------------------------------------------
# Resume: which differences between a checkpoint's config and the new one are allowed

# Applied on resume: the optimizer and schedule read them from the new config from the first resumed step.
RESUME_APPLIED = ("train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.max_steps", "train.weight_decay",
                  "train.betas", "train.grad_clip")
# Free to differ: where and how the run executes and is recorded, not what it computes.
RESUME_FREE = ("name", "preset", "tracking.", "train.precision", "train.accelerator", "train.devices",
               "train.strategy", "train.val_every", "train.val_batches", "train.log_every", "train.ckpt_dir",
               "train.deterministic", "train.compile", "data.cache_dir", "data.num_workers", "model.kda.backend",
               "model.kda.conv_backend", "model.moe.dispatch", "model.residual.launch")


def resume_changes(old: RunConfig, new: RunConfig) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """``(refused, applied)``: the ``{key: (old, new)}`` differences a resume must refuse, and those it applies.

    Everything that defines the model, the data, the tokenizer or the batch sequence (``model.*``,
    ``data.*``, ``seed``, ``train.batch_size``, ...) is refused; ``RESUME_APPLIED`` is applied;
    ``RESUME_FREE`` is neither.
    """
    a, b = flatten(old), flatten(new)
    refused, applied = {}, {}
    for key in a.keys() | b.keys():
        if a.get(key) == b.get(key) or key.startswith(RESUME_FREE):
            continue
        (applied if key in RESUME_APPLIED else refused)[key] = (a.get(key), b.get(key))
    return dict(sorted(refused.items())), dict(sorted(applied.items()))


# ---------------------------------------------------------------------------------------------
# YAML

class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``3e-4`` as a float (YAML 1.1 wants ``3.0e-4``; people write ``3e-4``) and
    refuses a key given twice in one mapping (PyYAML would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                  f"{key_node.start_mark.line + 1}): keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def parse_value(text: str) -> Any:
    """A ``--set`` value as YAML: ``8`` -> int, ``3e-4`` -> float, ``[0.9, 0.95]`` -> list, ``KKM`` -> str."""
    return yaml.load(text, Loader=_Loader) if text.strip() else ""


def preset_names() -> list[str]:
    """Names of the bundled presets (``moelab/presets/*.yaml``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(spec: str | Path) -> Path:
    """The YAML file for a preset name (``tiny``) or a path (``my.yaml``, relative to cwd or the repo)."""
    spec = str(spec)
    named = PRESET_DIR / f"{spec}.yaml"
    if "/" not in spec and not spec.endswith((".yaml", ".yml")) and named.is_file():
        return named
    for candidate in (Path(spec).expanduser(), resolve_path(spec)):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"config={spec!r} is not allowed: expected a preset name ({', '.join(preset_names())}) "
                      f"or the path of a YAML file")


def load_config(spec: str | Path, overrides: Sequence[str] | Mapping[str, Any] = ()) -> RunConfig:
    """Load a preset (name or path), apply ``overrides``, type-check and validate.

    ``overrides``: ``["train.lr=1e-3", ...]`` (CLI form, values parsed as YAML) or
    ``{"train.lr": 1e-3}``. ``name`` defaults to the file's stem. Raises ConfigError.
    """
    path = preset_path(spec)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.load(f, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ConfigError(f"config={str(path)!r} is not valid YAML: {e}") from e
    except ConfigError as e:
        raise ConfigError(f"config={str(path)!r}: {e}") from e
    raw = {} if raw is None else raw
    _check(isinstance(raw, dict), "config", str(path), "a YAML mapping at the top level")
    raw.setdefault("name", path.stem)
    raw.setdefault("preset", path.stem)
    return from_dict(_apply_overrides(raw, overrides))


def from_dict(raw: Mapping[str, Any]) -> RunConfig:
    """Build and validate a RunConfig from a nested mapping (what YAML gives)."""
    return build(RunConfig, raw).validate()


def with_overrides(cfg: RunConfig, overrides: Sequence[str] | Mapping[str, Any]) -> RunConfig:
    """A new, validated RunConfig equal to ``cfg`` with ``overrides`` applied (``{"model.kda.gate": "softplus"}``)."""
    return from_dict(_apply_overrides(to_dict(cfg), overrides))


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of a config dataclass (tuples become lists, as YAML would give them)."""
    return _plain(dataclasses.asdict(cfg))


def to_yaml(cfg: RunConfig) -> str:
    """The resolved config as YAML; ``load_config`` of this text gives back an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """``{"model.kda.gate": "bounded", ...}``: one entry per leaf field (MLflow params), reference data left out."""
    tree = to_dict(cfg)
    tree.pop("k3_reference", None)
    return flatten_dict(tree)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def parse_sets(items: Sequence[str]) -> dict[str, Any]:
    """``["train.lr=1e-3", ...]`` (``--set`` items) as ``{key: value}``, values parsed by :func:`parse_value`."""
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is not allowed: expected KEY=VALUE, e.g. train.lr=1e-3")
        out[key.strip()] = parse_value(text)
    return out


def _apply_overrides(raw: dict[str, Any], overrides: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    pairs = list((overrides if isinstance(overrides, Mapping) else parse_sets(overrides)).items())
    for key, value in pairs:
        node = raw
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{key}={value!r} is not allowed: {'.'.join(parts[:i + 1])} is a value, "
                                  f"not a section")
            node = child
        node[parts[-1]] = value
    return raw


# ---------------------------------------------------------------------------------------------
# Type-checked construction from a mapping

T = typing.TypeVar("T")

# Settings that were removed or renamed: a config that still has one fails with this pointer
# (instead of "unknown key"), so an old preset or --set line says what to write now.
RETIRED = {
    "model.kda.subtile": "removed (it never reached the kernels, whose diagonal sub-tile is fixed at "
                         "moelab.ops.kda.bounds.SUBTILE = 16 tokens); delete the key",
    "model.kda.precision": "removed (it only fed the g_min check, which now uses the kernels' own fp32 bound "
                           "moelab.ops.kda.bounds.G_MIN_FLOOR); delete the key",
    "model.moe.fused": "renamed to model.moe.backend: 'auto' (Triton on CUDA), 'triton' or 'torch' "
                       "(LatentMoE.set_fused is gone too)",
}


def build(cls: type[T], raw: Any, prefix: str = "") -> T:
    """Construct dataclass ``cls`` from mapping ``raw``, checking each value against its annotation.

    Missing keys take the dataclass default; unknown keys and mistyped values raise ConfigError
    naming the dotted key (``prefix``). Ranges are left to the classes' ``validate()``.
    """
    section = prefix or "config"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{section}={raw!r} is not allowed: expected a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            if dotted in RETIRED:
                raise ConfigError(f"{dotted}={value!r} is no longer a setting: {RETIRED[dotted]}")
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{dotted}={value!r} is not allowed: unknown key{hint}; "
                              f"{section} takes {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, name: str) -> Any:
    ok, out = _match(value, tp, name)
    if not ok:
        raise ConfigError(f"{name}={value!r} is not allowed: expected {_describe(tp)}")
    return out


def _match(value: Any, tp: Any, name: str) -> tuple[bool, Any]:
    """(True, converted value) when ``value`` fits annotation ``tp``; nested dataclasses raise their own errors."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return True, value
    if dataclasses.is_dataclass(tp):
        return True, build(tp, value, name)
    if origin is Literal:
        # type check too: 1 == True, so `1 in (True,)` alone would accept an int for a bool literal.
        return any(value == a and type(value) is type(a) for a in args), value
    if origin in (Union, types.UnionType):
        for arg in args:
            ok, out = _match(value, arg, name)
            if ok:
                return True, out
        return False, None
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        # inf and nan are floats to YAML (.inf, .nan) but no setting means them.
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else None
    if tp is str:
        return isinstance(value, str), value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False, None
        elems = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(elems) != len(value):
            return False, None
        pairs = [_match(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, elems))]
        return all(ok for ok, _ in pairs), tuple(v for _, v in pairs)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, None
        pairs = [_match(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)] if args else []
        return all(ok for ok, _ in pairs), [v for _, v in pairs] if args else list(value)
    if origin is dict:
        return isinstance(value, Mapping), dict(value) if isinstance(value, Mapping) else None
    raise TypeError(f"{name}: moelab.config cannot check annotation {tp!r}")


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is tuple:
        return f"a list of {len(args)} values ({', '.join(_describe(a) for a in args)})"
    if origin is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin is dict:
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
            type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))
