"""Mixtral: ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down), router ``block_sparse_moe.gate``.

In memory (transformers 5) the module is ``mlp`` with fused ``experts.gate_up_proj``; both map here.
"""

from miles_lp.policy.layouts.base import ArchSpec, register

MIXTRAL = register(ArchSpec(
    name="mixtral", model_types=("mixtral",), moe_module="block_sparse_moe", expert_proj=("w1", "w3", "w2"),
    num_experts=lambda c: int(c.get("num_local_experts") or 0), is_moe_layer=lambda c, i: True))
