"""Dense decoders: Llama, Qwen2, Qwen3 (q_norm / k_norm), Mistral."""

from miles_lp.policy.layouts.base import ArchSpec, register

LLAMA = register(ArchSpec(
    name="llama", model_types=("llama", "mistral"),
    qkv_bias=lambda c: bool(c.get("attention_bias")), o_bias=lambda c: bool(c.get("attention_bias"))))
QWEN2 = register(ArchSpec(name="qwen2", model_types=("qwen2",), qkv_bias=lambda c: True))
QWEN3 = register(ArchSpec(name="qwen3", model_types=("qwen3",), qk_norm=True,
                          qkv_bias=lambda c: bool(c.get("attention_bias")),
                          o_bias=lambda c: bool(c.get("attention_bias"))))
