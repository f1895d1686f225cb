"""moelab.config: presets load, bad keys/types/ranges fail at load time with the key, value and what is allowed."""

from __future__ import annotations

import pytest

from moelab.config import (
    RunConfig,
    flatten,
    from_dict,
    load_config,
    parse_value,
    preset_names,
    resume_changes,
    to_dict,
    to_yaml,
    with_overrides,
)
from moelab.model.accounting import param_counts
from moelab.model.config import ConfigError

OWN_PRESETS = ("tiny", "cpu", "gpu-small", "fla-shape")


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name: str) -> None:
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.name == name


@pytest.mark.parametrize("name", OWN_PRESETS)
def test_trainable_presets_pass_cross_checks(name: str) -> None:
    cfg = load_config(name)
    cfg.check_trainable()
    assert cfg.model.vocab_size == cfg.data.vocab_size


def test_gpu_small_is_a_100m_hybrid_at_4k() -> None:
    cfg = load_config("gpu-small")
    total = param_counts(cfg.model)["total"]
    assert 90e6 <= total <= 110e6, total
    kinds = set(cfg.model.layer_types())
    assert kinds == {"kda", "mla"}
    assert cfg.model.dense_layers < cfg.model.n_layers and cfg.model.moe.latent_dim > 0
    assert cfg.data.seq_len == 4096 and cfg.train.max_steps >= 200
    assert cfg.train.precision in ("auto", "bf16-mixed")


def test_fla_shape_matches_the_fla_anchor_model() -> None:
    m = load_config("fla-shape").model
    assert (m.pattern, m.final_mla, m.d_model, m.n_layers, m.vocab_size) == ("K", False, 1024, 12, 32000)
    # fla's GatedMLP with hidden_ratio 4 rounds 2/3 * 4 * 1024 up to a multiple of 256: 2816.
    assert set(m.layer_types()) == {"kda"} and m.dense_layers >= m.n_layers and m.ffn_dim() == 2816
    assert (m.kda.num_heads, m.kda.head_dim, m.kda.gate) == (8, 128, "bounded")


def test_overrides_parse_yaml_values() -> None:
    cfg = load_config("tiny", ["train.lr=1e-3", "train.betas=[0.8, 0.9]", "model.kda.gate=softplus",
                               "train.deterministic=warn", "tracking.enabled=false", "train.devices=2"])
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert cfg.train.betas == (0.8, 0.9)
    assert cfg.model.kda.gate == "softplus"
    assert cfg.train.deterministic == "warn"
    assert cfg.tracking.enabled is False
    assert cfg.train.devices == 2


def test_scientific_notation_is_a_float() -> None:
    assert parse_value("3e-4") == 3e-4
    assert parse_value("1E3") == 1000.0
    assert parse_value("12") == 12 and isinstance(parse_value("12"), int)


def test_int_given_for_float_is_accepted_as_float() -> None:
    cfg = load_config("tiny", {"train.lr": 1})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


@pytest.mark.parametrize("override, fragments", [
    ({"train.lrr": 0.1}, ["train.lrr", "unknown key", "did you mean 'lr'"]),
    ({"model.kda.gat": "bounded"}, ["model.kda.gat", "unknown key", "gate"]),
    ({"bogus": 1}, ["bogus", "unknown key"]),
    ({"train.max_steps": "ten"}, ["train.max_steps='ten'", "expected an integer"]),
    ({"train.max_steps": 1.5}, ["train.max_steps=1.5", "expected an integer"]),
    ({"train.compile": True}, ["train.compile=True", "'none', 'default', 'graphs', 'compiled_graphs'"]),
    ({"train.betas": [0.9]}, ["train.betas=[0.9]", "a list of 2 values"]),
    ({"model.kda.gate": "relu"}, ["model.kda.gate='relu'", "'bounded', 'softplus'"]),
    ({"train.precision": "16"}, ["train.precision='16'", "'auto', 'bf16-mixed', '32-true'"]),
    ({"model": 3}, ["model=3", "mapping"]),
    ({"train.lr": -1.0}, ["train.lr=-1.0", "positive"]),
    ({"train.warmup_steps": 1000}, ["train.warmup_steps=1000", "0..max_steps"]),
    ({"train.strategy": "fsdp2"}, ["train.strategy='fsdp2'", "'ddp'"]),
    ({"train.devices": "two"}, ["train.devices='two'", "'auto'"]),
    ({"data.seq_len": 0}, ["data.seq_len=0", ">= 1"]),
    ({"model.d_model": 4}, ["model.d_model=4", ">= 8"]),
    ({"name": "a b"}, ["name='a b'", "letters"]),
    ({"model.kda.chunk_size": 128, "model.kda.backend": "auto"},
     ["chunk_size=128", "16, 32 or 64 with backend='auto'"]),
    ({"model.moe.backend": "fused"}, ["model.moe.backend='fused'", "'auto', 'triton', 'torch'"]),
    ({"model.kda.conv_backend": "chunk"}, ["model.kda.conv_backend='chunk'", "'auto', 'triton', 'torch'"]),
    # old spellings point at what to write now
    ({"model.kda.subtile": 16}, ["model.kda.subtile=16", "no longer a setting", "SUBTILE = 16", "delete the key"]),
    ({"model.kda.precision": "bf16"}, ["model.kda.precision='bf16'", "no longer a setting", "G_MIN_FLOOR"]),
    ({"model.moe.fused": True}, ["model.moe.fused=True", "renamed to model.moe.backend"]),
    ({"train.lr": float("inf")}, ["train.lr=inf", "expected a finite number"]),
    ({"train.grad_clip": float("nan")}, ["train.grad_clip=nan", "finite"]),
    ({"model.norm_eps": float("inf")}, ["model.norm_eps=inf", "finite"]),
    ({"model.init_std": 0.0}, ["model.init_std=0.0", "a positive number"]),
    ({"model.moe.top_k": 9}, ["model.moe.top_k=9"]),  # the key as --set takes it, not moe.top_k
    ({"model.mla.num_heads": 0}, ["model.mla.num_heads=0"]),
])
def test_bad_values_fail_at_load_naming_key_value_and_allowed(override: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config("tiny", override)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_override_into_a_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"seed is a value, not a section"):
        load_config("tiny", ["seed.x=1"])


def test_malformed_set_is_rejected() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config("tiny", ["train.lr"])


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ConfigError) as err:
        load_config("no-such-preset")
    assert "no-such-preset" in str(err.value) and "tiny" in str(err.value)


def test_yaml_path_and_default_name(tmp_path) -> None:
    path = tmp_path / "exp1.yaml"
    path.write_text("seed: 3\ntrain: {max_steps: 7, warmup_steps: 2}\n")
    cfg = load_config(str(path))
    assert (cfg.name, cfg.seed, cfg.train.max_steps) == ("exp1", 3, 7)
    assert cfg.model == RunConfig().model  # missing sections take the defaults


def test_yaml_inf_and_duplicate_keys_are_refused(tmp_path) -> None:
    path = tmp_path / "inf.yaml"
    path.write_text("train: {lr: .inf}\n")
    with pytest.raises(ConfigError, match="train.lr=inf is not allowed: expected a finite number"):
        load_config(str(path))
    path = tmp_path / "dup.yaml"
    path.write_text("seed: 1\nmodel:\n  kda: {gate: bounded,\n        gate: softplus}\n")
    with pytest.raises(ConfigError, match=r"dup.yaml': key 'gate' appears twice in one mapping \(lines 3 and 4\)"):
        load_config(str(path))


def test_preset_and_experiment_follow_one_rule(tmp_path) -> None:
    cfg = load_config("tiny", {"name": "my-run"})
    assert (cfg.name, cfg.preset, cfg.experiment) == ("my-run", "tiny", "train/tiny")
    assert load_config("tiny", {"tracking.experiment": "mine"}).experiment == "mine"
    path = tmp_path / "again.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)).preset == "tiny"  # a saved config.yaml keeps the preset it came from


def test_resume_changes_sort_refused_from_applied() -> None:
    old = load_config("tiny")
    new = with_overrides(old, {"train.lr": 1e-2, "train.max_steps": 100, "model.kda.gate": "softplus",
                               "data.tokenizer": "byte", "model.vocab_size": 256, "data.vocab_size": 256,
                               "seed": 3, "train.val_every": 7, "tracking.enabled": False, "name": "x"})
    refused, applied = resume_changes(old, new)
    assert applied == {"train.lr": (3e-3, 1e-2), "train.max_steps": (60, 100)}
    assert set(refused) == {"model.kda.gate", "data.tokenizer", "model.vocab_size", "data.vocab_size", "seed"}
    assert resume_changes(old, old) == ({}, {})


def test_invalid_yaml_and_non_mapping(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(str(lst))


def test_yaml_round_trip(tmp_path) -> None:
    cfg = load_config("tiny", ["model.kda.gate=softplus", "train.betas=[0.8, 0.99]"])
    path = tmp_path / "round.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(str(path))
    assert to_dict(again) == to_dict(cfg)


def test_with_overrides_returns_a_validated_copy() -> None:
    cfg = load_config("tiny")
    other = with_overrides(cfg, {"model.residual.mode": "full_attnres"})
    assert other.model.residual.mode == "full_attnres" and cfg.model.residual.mode == "prenorm"
    with pytest.raises(ConfigError, match="model.residual.mode"):
        with_overrides(cfg, {"model.residual.mode": "sideways"})


def test_flatten_has_one_dotted_key_per_leaf() -> None:
    cfg = load_config("k3")
    flat = flatten(cfg)
    assert flat["model.kda.num_heads"] == cfg.model.kda.num_heads
    # every implementation choice is a field, so it is logged as a param like the rest
    assert flat["model.kda.backend"] == flat["model.kda.conv_backend"] == flat["model.moe.backend"] == "auto"
    assert flat["train.betas"] == list(cfg.train.betas)
    assert not any(k.startswith("k3_reference") for k in flat)
    assert all(not isinstance(v, dict) for v in flat.values())


def test_k3_reference_is_kept_for_info() -> None:
    cfg = load_config("k3")
    assert cfg.k3_reference["total"] > 1e12


def test_vocab_mismatch_is_caught_before_training() -> None:
    cfg = load_config("tiny", {"model.vocab_size": 1000})
    with pytest.raises(ConfigError, match=r"model.vocab_size=1000 .*512"):
        cfg.check_trainable()
    cfg = load_config("tiny", {"data.seq_len": 512})
    with pytest.raises(ConfigError, match=r"data.seq_len=512 .*max_seq_len \(128\)"):
        cfg.check_trainable()


def test_ckpt_dir_defaults_to_runs_name_under_the_repo(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOELAB_ROOT", str(tmp_path))
    cfg = from_dict({"name": "abc"})
    assert cfg.ckpt_dir == tmp_path / "runs" / "abc"
    assert from_dict({"name": "abc", "train": {"ckpt_dir": "/x/y"}}).ckpt_dir.as_posix() == "/x/y"
