"""KV cache precision (``kv_cache: bf16 | fp8_e4m3``): FP8 E4M3 KV emulated with the engines' per-tensor rule.

vLLM and SGLang store ``k / k_scale`` (and ``v / v_scale``) as E4M3 with saturation to +-448 and read back
``fp8 * scale``, with one fp32 scale per layer and tensor; checkpoints may carry calibrated ``k_scale`` /
``v_scale``, and without them both engines use 1.0 (vLLM docs, "FP8 E4M3 KV Cache"). The attention kernels
read every key/value through the cache, including the prompt's own during prefill, so the emulation rounds
every key and value once, before the attention reads them. The learner has no KV cache: under fp8_e4m3 this
rounding is a train/rollout mismatch source of the sampler alone (reported in ``health()``).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
KV_CACHE_DTYPES = ("bf16", "fp8_e4m3")


def fp8_kv_roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``e4m3_satfinite(x / scale) * scale`` in the dtype of ``x`` (round to nearest even, as the cast kernels)."""
    q = (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def make_cache(config, kv_cache: str, k_scale: float = 1.0, v_scale: float = 1.0):
    """A transformers ``DynamicCache`` for ``config``; under ``fp8_e4m3`` one that rounds what it stores."""
    from transformers import DynamicCache

    if kv_cache == "bf16":
        return DynamicCache(config=config)
    if kv_cache != "fp8_e4m3":
        raise ValueError(f"kv_cache must be one of {KV_CACHE_DTYPES}, got {kv_cache!r}")

    class FP8DynamicCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(fp8_kv_roundtrip(key_states, k_scale), fp8_kv_roundtrip(value_states, v_scale),
                                  layer_idx, *args, **kwargs)

    return FP8DynamicCache(config=config)
