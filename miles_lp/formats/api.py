"""The format-generic surface: the ``QuantizedTensor`` protocol and the ``quantize`` dispatch."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.fp8 import quantize_fp8_blockwise, quantize_fp8_tensorwise
from miles_lp.formats.mxfp8 import quantize_mxfp8
from miles_lp.formats.nvfp4 import quantize_nvfp4
from miles_lp.formats.spec import Format


@runtime_checkable
class QuantizedTensor(Protocol):
    """What every codec returns: the format, the logical shape, a decode and the named components
    (``data``, ``scale``, and where present ``global_scale`` / ``scale_inv``)."""

    @property
    def format(self) -> Format: ...

    @property
    def shape(self) -> torch.Size: ...

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor: ...

    def components(self) -> dict[str, torch.Tensor]: ...


_QUANTIZERS = {
    Format.MXFP8: quantize_mxfp8,
    Format.NVFP4: quantize_nvfp4,
    Format.FP8_BLOCK: quantize_fp8_blockwise,
    Format.FP8_TENSOR: quantize_fp8_tensorwise,
}


def quantize(x: torch.Tensor, fmt: Format | str, **opts) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt`` (a ``Format`` or its value); ``opts`` go to that format's quantizer."""
    try:
        fmt = Format(fmt)
    except ValueError as exc:
        raise FormatError(f"quantize: unknown format {fmt!r}; known: {[f.value for f in Format]}") from exc
    if fmt is Format.BF16:
        raise FormatError("quantize: BF16 is the unquantized format; keep the tensor as it is")
    return _QUANTIZERS[fmt](x, **opts)
