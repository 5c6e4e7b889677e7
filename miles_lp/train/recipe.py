"""The recipe of one quantized linear: what the plan entry of its weight says (format, backward, scales).

Backward modes (``BackwardMode``; TE's ``NVTE_BACKWARD_OVERRIDE``, CONTRACT 7): ``high_precision`` (backward
GEMMs on the original operands), ``dequantized`` (on the forward's rowwise quantized operands), ``quantized``
(MXFP8 and FP8 blockwise: every operand quantized along its backward GEMM's reduction dim; see
``miles_lp.train.gemm``).

FP8 blockwise (``fp8_block``) is TE's Float8BlockScaling: weights in 128x128 blocks, activations and gradients in
1x128 tiles along the GEMM's reduction dim, E4M3 with FP32 scales (``pow2_scales``: rounded down to powers of
two, TE's ``force_pow_2_scales``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.formats.spec import BackwardMode, Format

TRAINABLE_FORMATS = (Format.MXFP8, Format.NVFP4, Format.FP8_BLOCK)


@dataclasses.dataclass(frozen=True)
class LinearRecipe:
    """How one quantized linear computes: its format, backward mode and activation scale scope."""

    format: Format
    backward: BackwardMode = BackwardMode.DEQUANTIZED
    activation_scale: str | None = None  # NVFP4: "token" (per-row global scale) | "tensor"
    block_2d: bool = False  # NVFP4 weights: 16x16 scale tiles
    name: str = "<linear>"  # for error messages
    pow2_scales: bool = False  # fp8_block: power-of-two block scales

    def __post_init__(self):
        fmt = Format(self.format)
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "backward", BackwardMode(self.backward))
        if fmt not in TRAINABLE_FORMATS:
            raise ConfigError(
                f"{self.name}: format {fmt.value} cannot be trained by miles-lp's QuantLinear "
                f"(trainable: {', '.join(f.value for f in TRAINABLE_FORMATS)}); keep the tensor bf16 in the "
                "policy or convert it to one of those")
        if fmt is Format.NVFP4 and self.backward is BackwardMode.QUANTIZED:
            raise ConfigError(
                f"{self.name}: NVFP4 with backward 'quantized' (FP4 backward GEMMs, which need stochastic "
                "rounding and Hadamard transforms) is not part of the RL recipe; use backward "
                "'high_precision' or 'dequantized' for NVFP4 tensors (seed 002)")
        if self.pow2_scales and fmt is not Format.FP8_BLOCK:
            raise ConfigError(f"{self.name}: pow2_scales applies to fp8_block only, not {fmt.value}")
        if fmt is Format.NVFP4 and self.activation_scale not in (None, "token", "tensor"):
            raise ConfigError(f"{self.name}: activation_scale must be 'token' or 'tensor', "
                              f"got {self.activation_scale!r}")

    @classmethod
    def from_entry(cls, entry: Any, name: str | None = None) -> LinearRecipe | None:
        """The recipe of a ``PlanEntry`` (``None`` for a BF16 entry: the layer stays high precision)."""
        fmt = Format(entry.format)
        if not fmt.quantized:
            return None
        backward = getattr(entry, "backward", None) or BackwardMode.DEQUANTIZED
        scope = getattr(entry, "activation_scale", None)
        scope = {"per_token": "token", "per_tensor": "tensor"}.get(scope, scope)
        if fmt is Format.NVFP4 and scope is None:
            scope = "token"
        return cls(fmt, BackwardMode(backward), scope if fmt is Format.NVFP4 else None,
                   bool(getattr(entry, "block_2d", False)), name or getattr(entry, "name", "<linear>"),
                   bool(getattr(entry, "pow2_scales", False)) and fmt is Format.FP8_BLOCK)

    @property
    def nvfp4_row_scope(self) -> str:
        return "row" if self.activation_scale in (None, "token") else "tensor"
