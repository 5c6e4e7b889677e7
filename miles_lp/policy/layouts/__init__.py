"""Registered model layouts. Import order registers every architecture."""

from miles_lp.policy.layouts import deepseek_v3, llama, mixtral, qwen_moe  # noqa: F401  (registration)
from miles_lp.policy.layouts.base import (
    ArchSpec,
    ModelLayout,
    TensorInfo,
    get_layout,
    register,
    supported_model_types,
)

__all__ = ["ArchSpec", "ModelLayout", "TensorInfo", "get_layout", "register", "supported_model_types"]
