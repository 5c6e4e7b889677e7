"""MXFP8 (CONTRACT 1): E4M3 elements, one E8M0 scale per 32 along K; TE's MXFP8 recipe, every backward mode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from miles_lp.formats.scheme import Part
from miles_lp.formats.schemes.base import BaseScheme, swizzled_kernel_state
from miles_lp.formats.spec import MXFP8_BLOCK, Format

_DATA = Part("weight", "data", "F8_E4M3", "data")


class MXFP8Scheme(BaseScheme):
    format = Format.MXFP8
    scale_block = MXFP8_BLOCK
    aligned = True
    trainable = True
    vllm_emulation = True
    modelopt_algo = "MXFP8"
    megatron_recipe = {"fp8": "e4m3", "fp8_recipe": "mxfp8"}
    _parts = {
        "sglang": (_DATA, Part("weight_scale_inv", "scale", "U8", "kblock")),
        "vllm": (_DATA, Part("weight_scale", "scale", "U8", "kblock")),  # modelopt_mxfp8 names it weight_scale
        "compressed-tensors": (_DATA, Part("weight_scale", "scale", "U8", "kblock")),  # mxfp8-quantized
    }

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        return n + n / 32  # 1 B + 1 B E8M0 per 32

    def ct_scheme(self) -> dict[str, Any]:
        """compressed-tensors' ``MXFP8`` preset (v0.20)."""
        w = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
             "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": "torch.uint8"}
        return {"weights": w, "input_activations": dict(w, dynamic=True), "format": "mxfp8-quantized"}

    def quantize(self, x: Any, **opts: Any) -> Any:
        from miles_lp.formats.mxfp8 import quantize_mxfp8

        return quantize_mxfp8(x, **opts)

    def weight_options(self, *, amax: Any = None, block_2d: bool = False, pow2_scales: bool = False,
                       compile: bool = False, name: str | None = None) -> dict[str, Any]:
        return {"axis": -1, "compile": compile, "name": name}

    def quantize_activation(self, x: Any, *, scope: str = "row", pow2_scales: bool = False) -> Any:
        return self.quantize(x, axis=-1)

    def quantize_grad(self, t: Any, axis: int, *, pow2_scales: bool = False, compile: bool = False) -> Any:
        return self.quantize(t.detach(), axis=axis, compile=compile)

    def dequantize(self, q: Any, dtype: Any) -> Any:
        import torch

        from miles_lp.formats import kernels

        if dtype in (torch.bfloat16, torch.float32) and kernels.enabled(q.data):
            return kernels.mxfp8_dequantize(q, dtype)
        return q.dequantize(dtype)

    def use_compiled(self, kernel: str, x: Any) -> bool:
        return x.is_cuda if kernel == "auto" else kernel == "compiled"

    def from_components(self, comps: dict[str, Any], shape: tuple[int, ...], lead: tuple[int, ...] = ()) -> Any:
        from miles_lp.formats.mxfp8 import MXFP8Tensor

        return MXFP8Tensor(comps["data"], comps["scale"], -1)

    def kernel_state(self, q: Any, n: int, k: int, dtype: Any) -> dict[str, Any]:
        return swizzled_kernel_state(self, q, n, k, dtype)

    def vllm_input(self, x: Any, dtype: Any, static_amax: Callable[[], Any]) -> Any:
        """vLLM's ``EmulationMxfp8LinearKernel`` does not quantize activations."""
        return x.to(dtype)


SCHEME = MXFP8Scheme()
