"""BF16 (high precision): not quantized. The weight is stored and served as it is."""

from __future__ import annotations

from typing import Any

from miles_lp.errors import FormatError
from miles_lp.formats.scheme import Part, check_target
from miles_lp.formats.schemes.base import BaseScheme
from miles_lp.formats.spec import Format


class BF16Scheme(BaseScheme):
    format = Format.BF16
    vllm_emulation = True  # nothing to emulate: the input as it is

    def stored_bytes(self, n: int, shape: tuple[int, ...]) -> float:
        return 2 * n

    def quantize(self, x: Any, **opts: Any) -> Any:
        raise FormatError("quantize: BF16 is the unquantized format; keep the tensor as it is")

    def parts(self, target: str) -> tuple[Part, ...]:
        check_target(target)
        return ()

    def from_components(self, comps: dict[str, Any], shape: tuple[int, ...], lead: tuple[int, ...] = ()) -> None:
        return None

    def quantize_activation(self, x: Any, *, scope: str = "row", pow2_scales: bool = False) -> Any:
        return x

    def vllm_input(self, x: Any, dtype: Any, static_amax: Any) -> Any:
        return x

    def kernel_state(self, q: Any, n: int, k: int, dtype: Any) -> dict[str, Any]:
        """``q`` is the weight itself: the operand is a copy in the operand dtype where that differs."""
        return {"operand": q.detach().to(dtype)} if q.dtype != dtype else {}


SCHEME = BF16Scheme()
