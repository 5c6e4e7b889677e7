"""NVFP4 (CONTRACT 2): E2M1 elements, one E4M3 scale per 16 along K, one fp32 global scale per matrix (gate and up
share one), activations per token or per tensor; backward ``high_precision`` or ``dequantized``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles_lp.formats.scheme import Part
from miles_lp.formats.schemes.base import BaseScheme, swizzled_kernel_state
from miles_lp.formats.spec import NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR, Format

_MODELOPT = (
    Part("weight", "data", "U8", "packed"),
    Part("weight_scale", "scale", "F8_E4M3", "kblock"),
    Part("weight_scale_2", "global_scale", "F32", "scalar"),
    Part("input_scale", None, "F32", "scalar"),
)
_COMPRESSED_TENSORS = (
    Part("weight_packed", "data", "U8", "packed"),
    Part("weight_scale", "scale", "F8_E4M3", "kblock"),
    Part("weight_global_scale", "global_scale", "F32", "one", transform="reciprocal"),
    # W4A4 (the config group declares input_activations): vLLM's CompressedTensorsW4A4Fp4 creates this with
    # torch.empty and reads it from the checkpoint; stored as the ENCODE scale, like weight_global_scale
    Part("input_global_scale", None, "F32", "one", transform="reciprocal"),
)


class NVFP4Scheme(BaseScheme):
    format = Format.NVFP4
    scale_block = NVFP4_BLOCK
    aligned = True
    trainable = True
    quantized_backward_refusal = (
        "NVFP4 with backward 'quantized' (FP4 backward GEMMs, which need stochastic rounding and Hadamard "
        "transforms) is not part of the RL recipe")
    activation_scopes = ("token", "tensor")
    weight_scale_2d = True
    joint_global_scale = True
    scaled_activations = True  # the engine's activation_scale: "token" (the RL recipe) or "tensor"
    vllm_emulation = True
    modelopt_algo = "NVFP4"
    megatron_recipe = {"fp4": "e2m1", "fp4_recipe": "nvfp4"}
    _parts = {"sglang": _MODELOPT, "vllm": _MODELOPT, "compressed-tensors": _COMPRESSED_TENSORS}

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        return n / 2 + n / 16 + 4  # 0.5 B + 1 B E4M3 per 16 + a 4 B global scale

    def ct_scheme(self) -> dict[str, Any]:
        """compressed-tensors' ``NVFP4`` preset (v0.20): activations ``tensor_group`` with ``dynamic: "local"`` (a
        static per-tensor global input scale, dynamic block scales)."""
        w = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
             "dynamic": False, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}
        return {"weights": w, "input_activations": dict(w, dynamic="local", observer="static_minmax"),
                "format": "nvfp4-pack-quantized"}

    def quantize(self, x: Any, **opts: Any) -> Any:
        from miles_lp.formats.nvfp4 import quantize_nvfp4

        return quantize_nvfp4(x, **opts)

    def weight_options(self, *, amax: Any = None, block_2d: bool = False, pow2_scales: bool = False,
                       compile: bool = False, name: str | None = None) -> dict[str, Any]:
        return {"scale_scope": "tensor", "amax": amax, "block_2d": bool(block_2d), "name": name}

    def quantize_activation(self, x: Any, *, scope: str = "row", pow2_scales: bool = False) -> Any:
        return self.quantize(x, scale_scope=scope)

    def dequantize(self, q: Any, dtype: Any) -> Any:
        import torch

        from miles_lp.formats import kernels

        if dtype in (torch.bfloat16, torch.float32) and kernels.enabled(q.data):
            return kernels.nvfp4_dequantize(q, dtype)
        return q.dequantize(dtype)

    def dequantize_graph_safe(self, q: Any, dtype: Any) -> Any:
        """``NVFP4Tensor.dequantize``'s torch ops in the same order (the same bytes), with the E2M1 decode table
        made once per device and kept instead of built from a Python list at each call (a host->device copy,
        which a CUDA graph capture refuses)."""
        import torch

        from miles_lp.formats import bits

        dev = q.data.device
        table = _E2M1.get(str(dev))
        if table is None:
            table = _E2M1[str(dev)] = bits.e2m1_table(dev)
        vals = table[bits.unpack_fp4(q.data).to(torch.int64)]  # [..., K]
        sf = q.scale.to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=-1)  # [..., K]
        return ((vals * sf) * q.global_scale).to(dtype)

    def use_compiled(self, kernel: str, x: Any) -> bool:
        """``auto``: on CUDA where this torch's Inductor compiles exact fp32 division (NVFP4's scale math
        divides; byte-equal to the reference on the H200, ``pytest -m gpu``)."""
        if kernel == "auto":
            return x.is_cuda and _exact_division()
        return kernel == "compiled"

    def from_components(self, comps: dict[str, Any], shape: tuple[int, ...], lead: tuple[int, ...] = ()) -> Any:
        import torch

        from miles_lp.formats.nvfp4 import NVFP4Tensor

        gs = comps["global_scale"].to(torch.float32)
        gs = gs.reshape(()) if not lead else gs.reshape(*lead, 1, 1)
        return NVFP4Tensor(comps["data"], comps["scale"], gs, gs * NVFP4_GLOBAL_DIVISOR, (*lead, *shape), "tensor",
                           False)

    def kernel_state(self, q: Any, n: int, k: int, dtype: Any) -> dict[str, Any]:
        return swizzled_kernel_state(self, q, n, k, dtype)

    def vllm_input(self, x: Any, dtype: Any, static_amax: Callable[[], Any]) -> Any:
        """vLLM's ``EmulationNvFp4LinearKernel``: NVFP4 with the static per-tensor ``input_scale``."""
        return self.quantize(x, scale_scope="tensor", amax=static_amax()).dequantize(dtype)


_EXACT_DIV: list[bool] = []
_E2M1: dict[str, Any] = {}  # device -> the E2M1 decode table (dequantize_graph_safe)


def _exact_division() -> bool:
    """(asked once: it is a property of this torch build)"""
    if not _EXACT_DIV:
        from miles_lp.formats._compile import exact_division_available

        _EXACT_DIV.append(exact_division_available())
    return _EXACT_DIV[0]


SCHEME = NVFP4Scheme()
