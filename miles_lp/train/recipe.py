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
from miles_lp.formats.scheme import FormatScheme
from miles_lp.formats.schemes import has_scheme, scheme_for, trainable_formats
from miles_lp.formats.spec import BackwardMode, Format

TRAINABLE_FORMATS = trainable_formats()


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
        if not (has_scheme(fmt) and scheme_for(fmt).trainable):
            raise ConfigError(
                f"{self.name}: format {fmt.value} cannot be trained by miles-lp's QuantLinear "
                f"(trainable: {', '.join(f.value for f in TRAINABLE_FORMATS)}); keep the tensor bf16 in the "
                "policy or convert it to one of those")
        scheme = scheme_for(fmt)
        if scheme.quantized_backward_refusal and self.backward is BackwardMode.QUANTIZED:
            raise ConfigError(
                f"{self.name}: {scheme.quantized_backward_refusal}; use backward "
                f"'high_precision' or 'dequantized' for {fmt.value.upper()} tensors (seed 002)")
        if self.pow2_scales and not scheme.pow2_scales:
            raise ConfigError(f"{self.name}: pow2_scales applies to fp8_block only, not {fmt.value}")
        if scheme.activation_scopes and self.activation_scale not in (None, *scheme.activation_scopes):
            raise ConfigError(f"{self.name}: activation_scale must be "
                              f"{' or '.join(repr(s) for s in scheme.activation_scopes)}, "
                              f"got {self.activation_scale!r}")

    @property
    def scheme(self) -> FormatScheme:
        """The format's scheme (``miles_lp.formats.scheme``): its quantizers, decode and kernel choice."""
        return scheme_for(self.format)

    @classmethod
    def from_entry(cls, entry: Any, name: str | None = None) -> LinearRecipe | None:
        """The recipe of a ``PlanEntry`` (``None`` for a BF16 entry: the layer stays high precision)."""
        fmt = Format(entry.format)
        if not fmt.quantized:
            return None
        backward = getattr(entry, "backward", None) or BackwardMode.DEQUANTIZED
        scope = getattr(entry, "activation_scale", None)
        scope = {"per_token": "token", "per_tensor": "tensor"}.get(scope, scope)
        scopes = scheme_for(fmt).activation_scopes if has_scheme(fmt) else ()
        if scopes and scope is None:
            scope = scopes[0]
        pow2 = has_scheme(fmt) and scheme_for(fmt).pow2_scales
        return cls(fmt, BackwardMode(backward), scope if scopes else None,
                   bool(getattr(entry, "block_2d", False)), name or getattr(entry, "name", "<linear>"),
                   bool(getattr(entry, "pow2_scales", False)) and pow2)

    @property
    def nvfp4_row_scope(self) -> str:
        return "row" if self.activation_scale in (None, "token") else "tensor"
