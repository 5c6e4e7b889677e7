"""Tiny random-weight Hugging Face checkpoints, built locally (no hub access).

Used by smoke tests, the embedded default run and ``miles-lp make-tiny-model``. Every dimension that a
linear layer reduces over is a multiple of 32, so every format (MXFP8 blocks of 32, NVFP4 of 16) can hold it.
"""

from __future__ import annotations

import json
from pathlib import Path

ARCHS = ("qwen3", "qwen3_wide", "qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "llama")

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def tiny_config(arch: str, num_layers: int = 4):
    """A transformers config object for ``arch`` with small, block-aligned dimensions."""
    import transformers

    if arch == "qwen3":
        return transformers.Qwen3Config(**_COMMON, num_hidden_layers=num_layers, intermediate_size=128,
                                        head_dim=32)
    if arch == "qwen3_wide":  # every fused shard (q, k, v, gate, up) a whole number of 128-row FP8 blocks, as
        # SGLang's and vLLM's block-FP8 linears require of a merged weight
        return transformers.Qwen3Config(**dict(_COMMON, hidden_size=128), num_hidden_layers=num_layers,
                                        intermediate_size=256, head_dim=64)
    if arch == "llama":
        return transformers.LlamaConfig(**_COMMON, num_hidden_layers=num_layers, intermediate_size=128)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**_COMMON, num_hidden_layers=num_layers, intermediate_size=128,
                                           head_dim=32, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**_COMMON, num_hidden_layers=num_layers, intermediate_size=128,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=64, decoder_sparse_step=1,
                                           mlp_only_layers=[])
    if arch == "mixtral":
        return transformers.MixtralConfig(**_COMMON, num_hidden_layers=num_layers, intermediate_size=64,
                                          num_local_experts=4, num_experts_per_tok=2)
    if arch == "deepseek_v3":
        common = dict(_COMMON, num_key_value_heads=4)
        return transformers.DeepseekV3Config(
            **common, num_hidden_layers=num_layers, intermediate_size=128, moe_intermediate_size=64,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=32,
            qk_nope_head_dim=32, v_head_dim=32, routed_scaling_factor=1.0)
    raise ValueError(f"unknown tiny architecture '{arch}'; supported: {', '.join(ARCHS)}")


def make_tiny_model(arch: str, out: str | Path, *, seed: int = 0, num_layers: int = 4,
                    dtype: str = "bfloat16", max_shard_size: str | int = "5GB") -> Path:
    """Build a random-weight model of ``arch`` and ``save_pretrained`` it (safetensors) into ``out``."""
    import torch
    import transformers

    config = tiny_config(arch, num_layers=num_layers)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    from miles_lp.io.atomic import normal_file_modes

    index = out / "model.safetensors.index.json"  # only what save_pretrained wrote (0600; config.json is 0644)
    names = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    normal_file_modes(out, names)
    return out
