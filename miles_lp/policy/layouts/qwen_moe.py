"""Qwen3-MoE (routed experts only) and Qwen2-MoE (plus a singular `shared_expert` and `shared_expert_gate`).

MoE layers: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (transformers' rule).
transformers 5 saves Qwen3-MoE's expert count as ``num_local_experts``; hub configs say ``num_experts``.
"""

from miles_lp.policy.layouts.base import ArchSpec, register


def expert_count(c) -> int:
    return int(c.get("num_experts") or c.get("num_local_experts") or 0)


def _is_moe_layer(c, i: int) -> bool:
    step = int(c.get("decoder_sparse_step") or 1)
    return i not in (c.get("mlp_only_layers") or []) and (i + 1) % step == 0


QWEN3_MOE = register(ArchSpec(
    name="qwen3_moe", model_types=("qwen3_moe",), qk_norm=True, num_experts=expert_count,
    is_moe_layer=_is_moe_layer, qkv_bias=lambda c: bool(c.get("attention_bias")),
    o_bias=lambda c: bool(c.get("attention_bias"))))

QWEN2_MOE = register(ArchSpec(
    name="qwen2_moe", model_types=("qwen2_moe",), shared="shared_expert", shared_gate=True,
    num_experts=expert_count, is_moe_layer=_is_moe_layer, qkv_bias=lambda c: c.get("qkv_bias", True) is not False,
    shared_intermediate=lambda c: int(c["shared_expert_intermediate_size"])))
