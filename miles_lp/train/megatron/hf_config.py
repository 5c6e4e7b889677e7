"""Reading a Hugging Face model config for the Megatron learner: a ``dict`` (``config.json``) or a transformers
``PretrainedConfig`` alike, and the two facts both the model builder and the parallel layout need."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: architectures whose attention is DeepSeek's multi-head latent attention (Megatron's MLA layer)
MLA_TYPES = ("deepseek_v3",)


def config_value(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def expert_count(cfg: Any) -> int:
    """Routed experts per MoE layer (0: a dense model), under each family's key."""
    return int(config_value(cfg, "n_routed_experts") or config_value(cfg, "num_experts")
               or config_value(cfg, "num_local_experts") or 0)
