"""The format-generic surface: the ``QuantizedTensor`` protocol and the ``quantize`` dispatch."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.schemes import scheme_for
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


def quantize(x: torch.Tensor, fmt: Format | str, **opts) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt`` (a ``Format`` or its value); ``opts`` go to that format's quantizer."""
    try:
        fmt = Format(fmt)
    except ValueError as exc:
        raise FormatError(f"quantize: unknown format {fmt!r}; known: {[f.value for f in Format]}") from exc
    return scheme_for(fmt).quantize(x, **opts)  # the format's codec (miles_lp.formats.schemes)
