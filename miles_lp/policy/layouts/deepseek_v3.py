"""DeepSeek-V3 (and V2-style MLA): ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, shared experts,
``first_k_dense_replace`` dense layers, router bias ``e_score_correction_bias``, and the multi-token-prediction
layer(s) ``model.layers.{num_hidden_layers + k}`` (``num_nextn_predict_layers``) with ``enorm``, ``hnorm``,
``eh_proj``, ``embed_tokens`` and ``shared_head.{norm,head}``.
"""

from miles_lp.policy.layouts.base import ArchSpec, register


def _is_moe_layer(c, i: int) -> bool:
    freq = int(c.get("moe_layer_freq") or 1)
    return c.get("n_routed_experts") is not None and i >= int(c.get("first_k_dense_replace") or 0) and i % freq == 0


DEEPSEEK_V3 = register(ArchSpec(
    name="deepseek_v3", model_types=("deepseek_v3", "deepseek_v2", "kimi_k2"), shared="shared_experts",
    router_bias=True, mla=True, num_experts=lambda c: int(c.get("n_routed_experts") or 0),
    is_moe_layer=_is_moe_layer, mtp_layers=lambda c: int(c.get("num_nextn_predict_layers") or 0),
    shared_intermediate=lambda c: int(c["moe_intermediate_size"]) * int(c.get("n_shared_experts") or 1)))
