"""Formats, named once. The same enum is used by the policy, the plan, the codecs and the kernels."""

from __future__ import annotations

import enum


class Format(enum.StrEnum):
    """Storage/compute format of one tensor (a linear weight and the activations that meet it)."""

    BF16 = "bf16"  # high precision: not quantized
    MXFP8 = "mxfp8"  # E4M3 elements, one E8M0 scale per 32 along K (CONTRACT 1)
    NVFP4 = "nvfp4"  # E2M1 elements, one E4M3 scale per 16 along K, plus an FP32 global scale (CONTRACT 2)
    FP8_BLOCK = "fp8_block"  # E4M3, one FP32 scale per 128x128 weight block (DeepSeek-V3 style)
    FP8_TENSOR = "fp8_tensor"  # E4M3, one FP32 scale per tensor

    @property
    def quantized(self) -> bool:
        return self is not Format.BF16

    @property
    def block_size(self) -> int | None:
        """Elements along the reduction dim that share one scale (None: not block-scaled along K)."""
        return {Format.MXFP8: MXFP8_BLOCK, Format.NVFP4: NVFP4_BLOCK, Format.FP8_BLOCK: FP8_BLOCK_SIZE}.get(self)


class BackwardMode(enum.StrEnum):
    """How backward GEMMs treat a quantized forward (TE's NVTE_BACKWARD_OVERRIDE; CONTRACT 7)."""

    HIGH_PRECISION = "high_precision"  # dgrad/wgrad on the original (unquantized) operands
    DEQUANTIZED = "dequantized"  # dgrad/wgrad on the dequantized rowwise forward operands
    QUANTIZED = "quantized"  # operands re-quantized columnwise from full precision (TE's default MXFP8)


MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
FP8_BLOCK_SIZE = 128

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_GLOBAL_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688: S_enc = 2688 / amax_g
