"""Tensor roles: what a tensor *does* in the model, independent of how an architecture names it.

A role (and a role family, for selectors) is what precision rules and invariants talk about, so that one
recipe reads the same on Llama, Qwen3-MoE or DeepSeek-V3.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    NORM = "norm"
    BIAS = "bias"
    ROUTER = "router"  # MoE router weight (HF `mlp.gate`, Megatron `mlp.router`)
    ROUTER_BIAS = "router_bias"  # DeepSeek-V3 `e_score_correction_bias`
    SHARED_EXPERT_GATE = "shared_expert_gate"  # Qwen2-MoE sigmoid gate of the shared expert
    ATTENTION_QKV = "attention_qkv"
    ATTENTION_OUT = "attention_out"
    MLA_Q_A = "mla_q_a"
    MLA_Q_B = "mla_q_b"
    MLA_KV_A = "mla_kv_a"
    MLA_KV_B = "mla_kv_b"
    DENSE_MLP = "dense_mlp"
    ROUTED_EXPERTS = "routed_experts"
    SHARED_EXPERTS = "shared_experts"
    MTP_PROJ = "mtp_proj"  # DeepSeek multi-token-prediction `eh_proj`
    OTHER = "other"


#: Selector families: `role: attention` selects every attention projection, and so on.
ROLE_FAMILIES: dict[str, frozenset[Role]] = {
    "attention": frozenset({Role.ATTENTION_QKV, Role.ATTENTION_OUT, Role.MLA_Q_A, Role.MLA_Q_B,
                            Role.MLA_KV_A, Role.MLA_KV_B}),
    "mla": frozenset({Role.MLA_Q_A, Role.MLA_Q_B, Role.MLA_KV_A, Role.MLA_KV_B}),
    "mlp": frozenset({Role.DENSE_MLP, Role.ROUTED_EXPERTS, Role.SHARED_EXPERTS}),
    "experts": frozenset({Role.ROUTED_EXPERTS, Role.SHARED_EXPERTS}),
    "moe_routing": frozenset({Role.ROUTER, Role.ROUTER_BIAS, Role.SHARED_EXPERT_GATE}),
    "linear": frozenset({Role.ATTENTION_QKV, Role.ATTENTION_OUT, Role.MLA_Q_A, Role.MLA_Q_B, Role.MLA_KV_A,
                         Role.MLA_KV_B, Role.DENSE_MLP, Role.ROUTED_EXPERTS, Role.SHARED_EXPERTS}),
}
# Short aliases used by the Miles write-up and the issue text.
ROLE_FAMILIES["mla_kv_b"] = frozenset({Role.MLA_KV_B})

#: Linear weights that `precision.default` applies to.
QUANTIZABLE_ROLES: frozenset[Role] = ROLE_FAMILIES["linear"]

#: Never quantized unless a rule says `allow_unsafe: true` with a `reason` (plus every 1-D tensor).
#: lm_head quantized gave NaN logits silently in a published run; routers decide which experts run;
#: SGLang builds DeepSeek's MTP `eh_proj` as a plain nn.Linear, so no engine can serve it quantized.
INVARIANT_ROLES: frozenset[Role] = frozenset({Role.EMBEDDING, Role.LM_HEAD, Role.NORM, Role.BIAS, Role.ROUTER,
                                              Role.ROUTER_BIAS, Role.SHARED_EXPERT_GATE, Role.MTP_PROJ})


def role_selector_values() -> list[str]:
    """Every spelling accepted by `role:` (single roles and families), for error suggestions."""
    return sorted({r.value for r in Role} | set(ROLE_FAMILIES))


def resolve_role_selector(value: str) -> frozenset[Role] | None:
    if value in ROLE_FAMILIES:
        return ROLE_FAMILIES[value]
    try:
        return frozenset({Role(value)})
    except ValueError:
        return None
