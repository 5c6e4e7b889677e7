"""``sgl_kernel.kvcacheio``: the CPU KV-slot move only (see the package)."""

from sgl_kernel import copy_all_layer_kv_cache_cpu

__all__ = ["copy_all_layer_kv_cache_cpu"]
