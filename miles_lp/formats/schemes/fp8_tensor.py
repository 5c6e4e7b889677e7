"""FP8 per tensor (TE Float8CurrentScaling): E4M3 with one fp32 scale for the whole tensor. A comparison format of
the policy (``miles-lp explain`` sizes it): not trained by QuantLinear and not written to engine checkpoints."""

from __future__ import annotations

from miles_lp.formats.schemes.base import BaseScheme
from miles_lp.formats.spec import Format


class FP8TensorScheme(BaseScheme):
    format = Format.FP8_TENSOR

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        return n + 4  # 1 B + one 4 B scale


SCHEME = FP8TensorScheme()
