"""FP8 blockwise (DeepSeek-V3 style, TE Float8BlockScaling): E4M3, weights in 128x128 tiles with one fp32 decode
scale each (partial edge tiles allowed; one tile serves the weight and its transpose), activations and gradients in
1x128 tiles along the GEMM's reduction dim; ``pow2_scales`` rounds the scales down to powers of two."""

from __future__ import annotations

from typing import Any

from miles_lp.formats.scheme import Part
from miles_lp.formats.schemes.base import BaseScheme
from miles_lp.formats.spec import FP8_BLOCK_SIZE, Format

#: TE Float8BlockScaling's tiles: weights 128x128, activations and gradients 1x128 along the reduction dim: rows of
#: 128 along K / N (``ROW``) for the forward and dgrad, columns of 128 tokens (``COL``, the 1x128 tiles of the
#: transposed operand) for wgrad
WEIGHT_BLOCK = (FP8_BLOCK_SIZE, FP8_BLOCK_SIZE)
ROW_BLOCK = (1, FP8_BLOCK_SIZE)
COL_BLOCK = (FP8_BLOCK_SIZE, 1)

_DATA = Part("weight", "data", "F8_E4M3", "data")


class FP8BlockScheme(BaseScheme):
    format = Format.FP8_BLOCK
    scale_block = FP8_BLOCK_SIZE
    aligned = False  # partial edge tiles are part of the format
    trainable = True
    pow2_scales = True
    transposable_weight = True
    native_gemm = True
    megatron_recipe = {"fp8": "e4m3", "fp8_recipe": "blockwise"}
    engine_activation_scales = ("pow2", "fp32")  # the engine's 1x128 activation tile scales
    scaled_activations = True
    _parts = {  # SGLang's / vLLM's Fp8Config with weight_block_size; compressed-tensors' FP8_BLOCK: weight_scale
        "sglang": (_DATA, Part("weight_scale_inv", "scale_inv", "F32", "tiles")),
        "vllm": (_DATA, Part("weight_scale_inv", "scale_inv", "F32", "tiles")),
        "compressed-tensors": (_DATA, Part("weight_scale", "scale_inv", "F32", "tiles")),
    }

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        rows = shape[-2] if len(shape) > 1 else 1  # 1 B + a 4 B scale per 128x128 tile of each matrix
        return n + 4 * -(-rows // 128) * -(-shape[-1] // 128) * (n // max(rows * shape[-1], 1))

    def ct_scheme(self) -> dict[str, Any]:
        """compressed-tensors' ``FP8_BLOCK`` preset (v0.20): 128x128 weight blocks, 1x128 dynamic activations."""
        w = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True,
             "dynamic": False}
        return {"weights": w, "input_activations": {"num_bits": 8, "type": "float", "strategy": "group",
                                                    "group_size": 128, "symmetric": True, "dynamic": True},
                "format": "float-quantized"}

    def quantize(self, x: Any, **opts: Any) -> Any:
        from miles_lp.formats.fp8 import quantize_fp8_blockwise

        return quantize_fp8_blockwise(x, **opts)

    def weight_options(self, *, amax: Any = None, block_2d: bool = False, pow2_scales: bool = False,
                       compile: bool = False, name: str | None = None) -> dict[str, Any]:
        return {"block": WEIGHT_BLOCK, "pow2_scales": bool(pow2_scales), "name": name}

    def quantize_activation(self, x: Any, *, scope: str = "row", pow2_scales: bool = False) -> Any:
        return self.quantize(x.detach(), block=ROW_BLOCK, pow2_scales=pow2_scales)

    def quantize_grad(self, t: Any, axis: int, *, pow2_scales: bool = False, compile: bool = False) -> Any:
        return self.quantize(t.detach(), block=ROW_BLOCK if axis == -1 else COL_BLOCK, pow2_scales=pow2_scales)

    def bf16_exact(self, pow2_scales: bool = False) -> bool:
        """Arbitrary fp32 scales: a decode is not exact in bf16 (the emulation decodes to and multiplies in fp32,
        one rounding per element, as DeepSeek's reference dequantization)."""
        return pow2_scales

    def from_components(self, comps: dict[str, Any], shape: tuple[int, ...], lead: tuple[int, ...] = ()) -> Any:
        from miles_lp.formats.fp8 import FP8BlockTensor

        return FP8BlockTensor(comps["data"], comps["scale_inv"], WEIGHT_BLOCK)

    def kernel_state(self, q: Any, n: int, k: int, dtype: Any) -> dict[str, Any]:
        """The block kernels read ``weight_scale_inv`` as stored (no swizzled copy): only the operand."""
        return {"operand": q.dequantize(dtype)}  # fp32(q) * scale_inv of its block, rounded once


SCHEME = FP8BlockScheme()
