"""The recipe's ``train:`` section: strict keys with file:line, checked values, defaults."""

from __future__ import annotations

import pytest

from miles_lp.config import load_yaml_text
from miles_lp.errors import ConfigError
from miles_lp.train.config import TrainConfig, load_train_config, parse_train_config


def parse(text: str) -> TrainConfig:
    doc = load_yaml_text(text, "recipe.yaml")
    return parse_train_config(doc.data.get("train"), doc.where("train"))


def test_defaults_and_values():
    cfg = parse("train:\n  lr: 1.0e-5\n  betas: [0.9, 0.95]\n  master_dtype: bf16\n  megatron: {tp: 2}\n")
    assert cfg.lr == 1e-5 and cfg.betas == (0.9, 0.95) and cfg.master_dtype == "bf16"
    assert cfg.megatron.tp == 2 and cfg.megatron.ep == 1 and cfg.backend == "embedded"
    assert parse("other: 1\n") == TrainConfig()


def test_unknown_key_names_line_and_suggestion():
    with pytest.raises(ConfigError, match=r"recipe\.yaml:3: 'train\.grad_clp': unknown key.*did you mean 'grad_clip'"):
        parse("train:\n  lr: 1.0e-5\n  grad_clp: 1.0\n")
    with pytest.raises(ConfigError, match=r"recipe\.yaml:4: 'train\.megatron\.tpp'.*did you mean 'tp'"):
        parse("train:\n  lr: 1.0e-5\n  megatron:\n    tpp: 2\n")


@pytest.mark.parametrize("text,match", [
    ("train:\n  lr: 0\n", r":2: 'train\.lr': must be > 0"),
    ("train:\n  betas: [0.9]\n", r":2: 'train\.betas': must be two numbers"),
    ("train:\n  grad_clip: -1\n", r"'train\.grad_clip': must be > 0 \(or null"),
    ("train:\n  master_dtype: fp16\n", r"'train\.master_dtype': must be one of 'fp32', 'bf16'"),
    ("train:\n  backend: megatorn\n", r"did you mean 'megatron'"),
    ("train:\n  micro_batch_tokens: 0\n", r"'train\.micro_batch_tokens': must be >= 1"),
    ("train:\n  megatron: {sequence_parallel: true}\n", r"sequence_parallel.*needs tp > 1"),
])
def test_bad_values(text, match):
    with pytest.raises(ConfigError, match=match):
        parse(text)


def test_grad_clip_null_disables(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("precision: {default: mxfp8}\ntrain:\n  grad_clip: null\n  seed: 7\n")
    cfg = load_train_config(p)
    assert cfg.grad_clip is None and cfg.seed == 7


@pytest.mark.parametrize("text,value", [("1e-5", 1e-5), ("3E-4", 3e-4), ("+2e3", 2000.0), ("5.", 5.0),
                                         ("1.0e-6", 1e-6), ("2", 2.0)])
def test_yaml11_exponent_floats_accepted(text, value):
    # PyYAML (YAML 1.1) loads `1e-5` as the string '1e-5'; float fields accept such plain decimal numbers.
    cfg = parse(f"train:\n  lr: {text}\n  eps: {text}\n  betas: [0.9, {text if value < 1 else 0.5}]\n")
    assert cfg.lr == value and cfg.eps == value and isinstance(cfg.lr, float)


@pytest.mark.parametrize("text", ["'fast'", "nan", "'inf'", "'1_000'", "'1e-5x'", "true", "''"])
def test_float_fields_still_refuse_non_numbers(text):
    with pytest.raises(ConfigError, match=r"recipe\.yaml:2: 'train\.lr': (expected a number|must be > 0)"):
        parse(f"train:\n  lr: {text}\n")
