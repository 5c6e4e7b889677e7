"""The benchmark models' shapes: `bench rollout --model 8b` is Qwen3-8B's widths, and `bench fp8-decode --model`'s
GEMM shapes are the decode GEMMs of the same configs (fused q/k/v and gate/up)."""

from __future__ import annotations

import pytest

from miles_lp.bench import fp8_decode, rollout


def _params(cfg) -> int:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * cfg.head_dim  # linears, 2 norms, q/k norms
    return cfg.num_hidden_layers * per_layer + v * h * (1 if cfg.tie_word_embeddings else 2) + h


def test_8b_config_has_qwen3_8b_widths():
    cfg = rollout.qwen3_8b_config()
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 12288, 36)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.vocab_size == 151936 and cfg.tie_word_embeddings is False
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert theta == 1e6
    assert 8.1e9 < _params(cfg) < 8.3e9  # Qwen3-8B: 8.19B parameters
    assert rollout.qwen3_8b_config(8).num_hidden_layers == 8
    assert rollout.MODELS["8b"][1] == 36 and rollout.MODELS["0.5b"][1] == 24


@pytest.mark.parametrize("model", ["0.5b", "8b"])
def test_fp8_decode_shapes_are_the_models_decode_gemms(model):
    cfg = rollout.MODELS[model][0]()
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert fp8_decode.MODEL_SHAPES[model] == {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h),
                                              "down": (h, i)}


def test_fp8_decode_8b_shapes_and_plan():
    from miles_lp.formats.kernels.fp8_block_decode import plan

    assert fp8_decode.MODEL_SHAPES["8b"] == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                                             "down": (4096, 12288)}
    assert fp8_decode.SHAPES is fp8_decode.MODEL_SHAPES["0.5b"]
    for n, k in fp8_decode.MODEL_SHAPES["8b"].values():
        assert n % 128 == 0 and k % 128 == 0  # whole 128 x 128 weight blocks
        for m in (1, 8, 32, 64):
            bm, bn, split = plan(m, n, k, 132)
            assert bm >= min(m, 16) and 1 <= split <= k // 128


def test_bench_model_choices():
    import argparse

    for mod, choice in ((rollout, "8b"), (fp8_decode, "8b")):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        assert p.parse_args(["--model", choice]).model == "8b"
        with pytest.raises(SystemExit):
            p.parse_args(["--model", "70b"])
