"""Triton kernels for the MXFP8 / NVFP4 codecs on CUDA, byte-identical to the reference (``miles_lp.formats``).

The reference codecs stay the CPU path and the oracle; these kernels are what the codecs
(``quantize_mxfp8`` / ``quantize_nvfp4``) and ``miles_lp.train.fused`` select for CUDA tensors when Triton
imports (``enabled(x)``). Calling a kernel entry point directly where it cannot run raises
``BackendUnavailable`` naming what is missing. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors
through Triton's interpreter (slow; the CPU tests use it).

Entry points (inputs validated with the codecs' own messages; no host synchronisation on the hot paths,
so they can be captured in a CUDA graph, except where a caller passes a Python/CPU ``amax``):

* ``mxfp8_quantize(x, rowwise=True, colwise=False, dequant_dtype=None, swizzle=False)`` -> ``MXFP8Result``:
  both grids from ONE read of ``x`` (one launch), optionally their dequantized copies (the emulated GEMM
  operands) and the cuBLAS 128x4 swizzled scales;
* ``mxfp8_dequantize(q, dtype)``; ``quantize_mxfp8(x, axis)`` (the codec hook);
* ``nvfp4_quantize(x, scope, amax=None, block_2d=False, dequant_dtype=None)`` -> ``(NVFP4Tensor, deq)``:
  scope "tensor" = an amax pass + a quantize pass (two launches and a memset; one launch when ``amax`` is
  given), scope "row" = one launch (each program takes whole rows: amax, then quantize from cache);
  ``block_2d`` = 16x16 tiles (weights);
* ``nvfp4_dequantize(q, dtype)``, ``nvfp4_amax(x)``; ``quantize_nvfp4(...)`` (the codec hook).

Bound launches (``kernels.bound``, for hot paths that repeat one call per input shape: QuantLinear's
``miles_lp.train.launch``): after an entry-point call, ``bind_mxfp8_quantize`` / ``bind_mxfp8_dequantize`` /
``bind_nvfp4_quantize`` / ``bind_nvfp4_dequantize`` with the same arguments return a ``Binding`` whose
``launch(*args)`` calls the compiled kernel's C launcher directly (same kernel, same bytes), or None where that
is not possible (CPU, a launch hook, ``runtime.kernels_fast_launch: false``, a changed kernel signature, ...).

``runtime.kernels: reference`` (or ``MILES_LP_KERNELS=reference``) turns the automatic selection off (the codecs
then run their torch code on CUDA too), e.g. to time or compare the reference there.
"""

from __future__ import annotations

from miles_lp.formats.kernels.bound import (
    Binding,
    BoundLaunch,
    bind_mxfp8_dequantize,
    bind_mxfp8_quantize,
    bind_nvfp4_dequantize,
    bind_nvfp4_quantize,
)
from miles_lp.formats.kernels.mxfp8 import MXFP8Result, mxfp8_dequantize, mxfp8_quantize, quantize_mxfp8
from miles_lp.formats.kernels.nvfp4 import (
    matrix_amax,
    nvfp4_amax,
    nvfp4_dequantize,
    nvfp4_quantize,
    quantize_nvfp4,
)
from miles_lp.formats.kernels.runtime import (
    cached_jit_module as cached_jit_module,  # the Triton loader miles_lp.multitensor.kernels shares
)
from miles_lp.formats.kernels.runtime import (
    enabled,
    launch_hooks_set,
    unavailable_reason,
)
from miles_lp.formats.kernels.runtime import (
    load_jit_module as load_jit_module,
)
from miles_lp.formats.kernels.runtime import (
    triton_cdiv as triton_cdiv,
)
from miles_lp.formats.kernels.runtime import (
    triton_next_pow2 as triton_next_pow2,
)
from miles_lp.formats.kernels.tuning import CONFIG

__all__ = [
    "MXFP8Result", "enabled", "unavailable_reason", "mxfp8_quantize", "mxfp8_dequantize", "quantize_mxfp8",
    "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_amax", "matrix_amax", "quantize_nvfp4", "CONFIG",
    "launch_hooks_set", "Binding", "BoundLaunch", "bind_mxfp8_quantize", "bind_mxfp8_dequantize",
    "bind_nvfp4_quantize", "bind_nvfp4_dequantize",
]
