"""Bit-exact codecs: MXFP8, NVFP4, FP8 blockwise / tensorwise, and the cuBLAS scale swizzle.

Pure PyTorch, CPU and CUDA, any leading dims (experts ``[E, N, K]``); bytes equal Transformer Engine's
quantizers (CONTRACT 1-3). See docs/ARCHITECTURE.md for the interface. ``scheme_for(fmt)``
(``miles_lp.formats.schemes``) is each format's one object for the rest of miles-lp: its operand grids, decode and
kernel choice, GEMM operand dtype and engine tensors.

The codecs are exported lazily (PEP 562) so that ``from miles_lp.formats.spec import Format`` (the
policy, the CLI) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from miles_lp.errors import FormatError
from miles_lp.formats.spec import BackwardMode, Format

_LAZY = {
    "QuantizedTensor": "api", "quantize": "api",
    "MXFP8Tensor": "mxfp8", "quantize_mxfp8": "mxfp8", "quantize_mxfp8_compiled": "mxfp8",
    "NVFP4Tensor": "nvfp4", "quantize_nvfp4": "nvfp4", "quantize_nvfp4_pair": "nvfp4",
    "nvfp4_global_amax": "nvfp4",
    "FP8BlockTensor": "fp8", "FP8TensorwiseTensor": "fp8", "quantize_fp8_blockwise": "fp8",
    "dequantize_fp8_blockwise": "fp8", "quantize_fp8_tensorwise": "fp8",
    "swizzle_scales": "swizzle", "unswizzle_scales": "swizzle", "swizzled_offset": "swizzle",
    "scheme_for": "schemes",
}

if TYPE_CHECKING:  # pragma: no cover
    from miles_lp.formats.api import QuantizedTensor, quantize
    from miles_lp.formats.fp8 import (
        FP8BlockTensor,
        FP8TensorwiseTensor,
        dequantize_fp8_blockwise,
        quantize_fp8_blockwise,
        quantize_fp8_tensorwise,
    )
    from miles_lp.formats.mxfp8 import MXFP8Tensor, quantize_mxfp8, quantize_mxfp8_compiled
    from miles_lp.formats.nvfp4 import NVFP4Tensor, nvfp4_global_amax, quantize_nvfp4, quantize_nvfp4_pair
    from miles_lp.formats.schemes import scheme_for
    from miles_lp.formats.swizzle import swizzle_scales, swizzled_offset, unswizzle_scales


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'miles_lp.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"miles_lp.formats.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [  # grouped by module, as _LAZY
    "BackwardMode", "Format", "FormatError",
    "QuantizedTensor", "quantize",
    "MXFP8Tensor", "quantize_mxfp8", "quantize_mxfp8_compiled",
    "NVFP4Tensor", "quantize_nvfp4", "quantize_nvfp4_pair", "nvfp4_global_amax",
    "FP8BlockTensor", "FP8TensorwiseTensor", "quantize_fp8_blockwise", "dequantize_fp8_blockwise",
    "quantize_fp8_tensorwise",
    "swizzle_scales", "unswizzle_scales", "swizzled_offset",
    "scheme_for",
]
assert set(__all__) == {"BackwardMode", "Format", "FormatError", *_LAZY}
