"""FP8 per tensor (TE Float8CurrentScaling): E4M3 with one fp32 scale for the whole tensor. A comparison format of
the policy (``miles-lp explain`` sizes it): not trained by QuantLinear and not written to engine checkpoints."""

from __future__ import annotations

from typing import Any

from miles_lp.formats.schemes.base import BaseScheme
from miles_lp.formats.spec import Format


class FP8TensorScheme(BaseScheme):
    format = Format.FP8_TENSOR
    megatron_recipe = {"fp8": "e4m3", "fp8_recipe": "tensorwise"}

    def ct_scheme(self) -> dict[str, Any]:
        """The weights of compressed-tensors' ``FP8`` preset; activations dynamic per tensor (the plan's current
        scaling), not the preset's static ones."""
        w = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        return {"weights": w, "input_activations": dict(w, dynamic=True), "format": "float-quantized"}

    def quantize(self, x: Any, **opts: Any) -> Any:
        from miles_lp.formats.fp8 import quantize_fp8_tensorwise

        return quantize_fp8_tensorwise(x, **opts)

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        return n + 4  # 1 B + one 4 B scale


SCHEME = FP8TensorScheme()
