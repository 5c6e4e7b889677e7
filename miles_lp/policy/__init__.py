"""The precision policy: one declarative object, compiled to a per-tensor plan, explained, and emitted to every
consumer (SGLang, vLLM, ModelOpt, compressed-tensors, Megatron-Core/TE). See docs/precision_policy.md."""

from miles_lp.policy.layouts import (
           ArchSpec,
           ModelLayout,
           TensorInfo,
           get_layout,
           register,
           supported_model_types,
)
from miles_lp.policy.plan import PlanEntry, PrecisionPlan, compile_plan
from miles_lp.policy.policy import PrecisionPolicy, Rule, load_policy, parse_policy, policy_from_flags
from miles_lp.policy.roles import Role

__all__ = ["ArchSpec", "ModelLayout", "PlanEntry", "PrecisionPlan", "PrecisionPolicy", "Role", "Rule",
           "TensorInfo", "compile_plan", "get_layout", "load_policy", "parse_policy", "policy_from_flags",
           "register", "supported_model_types"]
