"""Fused quantize->dequantize for QuantLinear, under ``torch.compile`` (byte-identical to the codecs).

The reference path of ``QuantLinear`` calls the codecs (``miles_lp.formats``) eagerly: quantize, then
``.dequantize(op)``, each a chain of element-wise kernels over the whole operand. Here the same tensor
functions run inside one ``torch.compile`` graph, so Inductor fuses them into one pass over the input that
writes the compact bytes, the scales and the dequantized GEMM operand together:

* ``mxfp8_qdq(x, axis, dtype)`` -> ``(MXFP8Tensor, deq)``: the codec's own core (``mxfp8_core``, the
  function ``quantize_mxfp8`` runs eagerly per row slice and compiles with ``compile=True``) followed by
  the decode ``e4m3_value(q) * 2^(e-127)`` in fp32 and one rounding to ``dtype``;
* ``mxfp8_dequantize(q, dtype)``: the decode alone (backward of ``dequantized`` / ``quantized`` mode);
* ``nvfp4_qdq(x, scope, dtype, amax=None, block_2d=False)`` -> ``(NVFP4Tensor, deq)``: the codec's core
  ``nvfp4_core`` (what ``quantize_nvfp4`` runs per row slice) followed by ``NVFP4Tensor.dequantize``,
  traced as one graph; a given ``amax`` is validated and broadcast eagerly first (``_broadcast_amax``).

The cores have no data-dependent Python control flow (NaN in a block amax is zeroed, not branched on) and
no slicing (slices are the eager wrapper's business), so each entry point is ONE graph, no graph breaks.

Byte identity: the compiled graphs run the codecs' own functions (no second implementation of the rule);
every MXFP8 decode product is exact in fp32 (an E4M3 value times a power of two), so the single final
rounding is the same in both paths (NaN payloads aside: a NaN element decodes to some NaN either way).
Tested on CPU (``tests/unit/test_train_quant_linear.py``, ``slow``) and on CUDA (``gpu``) with
``torch.equal`` on the raw bytes. MXFP8 on the H200 (torch 2.11): equal, special values included.
NVFP4 divides in fp32, which Triton approximates by default: its bytes differed on the H200 before
the exact Inductor options (``miles_lp.formats._compile``, shared with ``quantize_mxfp8(compile=True)``)
were added; until the ``gpu`` test passes with it, ``kernel="auto"`` keeps NVFP4 on the
reference path (``QuantLinear(kernel="compiled")`` still selects this one).

Shapes vary between micro-batches: the first call compiles for static shapes, a second shape recompiles
with dynamic shapes (``torch.compile``'s default), after which token counts do not recompile.
"""

from __future__ import annotations

import torch

from miles_lp.formats import bits
from miles_lp.formats._compile import compile_exact, exact_division_available
from miles_lp.formats.mxfp8 import MXFP8Tensor, mxfp8_core  # codec cores (same bytes)
from miles_lp.formats.nvfp4 import NVFP4Tensor, broadcast_nvfp4_amax, nvfp4_core
from miles_lp.formats.spec import MXFP8_BLOCK

__all__ = ["exact_division_available", "mxfp8_dequantize", "mxfp8_qdq", "nvfp4_dequantize", "nvfp4_qdq"]

# ---------------------------------------------------------------------------------------------------------
# Traced functions (plain tensor code; eager calls give the reference result)
# ---------------------------------------------------------------------------------------------------------


def _mxfp8_decode(data: torch.Tensor, scale: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """e4m3_value(data) * 2^(scale-127), exact in fp32, rounded once to ``dtype`` (= MXFP8Tensor.dequantize)."""
    s = bits.e8m0_value(scale)
    if axis == -1:  # data [..., K], scale [..., K/32]
        k = data.shape[-1]
        v = data.to(torch.float32).unflatten(-1, (k // MXFP8_BLOCK, MXFP8_BLOCK)) * s.unsqueeze(-1)
        return v.flatten(-2).to(dtype)
    m = data.shape[-2]  # data [..., M, K], scale [..., M/32, K]
    v = data.to(torch.float32).unflatten(-2, (m // MXFP8_BLOCK, MXFP8_BLOCK)) * s.unsqueeze(-2)
    return v.flatten(-3, -2).to(dtype)


def _mxfp8_qdq_row(x: torch.Tensor, dtype: torch.dtype):
    data, scale = mxfp8_core(x, -1)
    return data, scale, _mxfp8_decode(data, scale, -1, dtype)


def _mxfp8_qdq_col(x: torch.Tensor, dtype: torch.dtype):
    data, scale = mxfp8_core(x, -2)
    return data, scale, _mxfp8_decode(data, scale, -2, dtype)


def _mxfp8_dq_row(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _mxfp8_decode(data, scale, -1, dtype)


def _mxfp8_dq_col(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _mxfp8_decode(data, scale, -2, dtype)


def _nvfp4_qdq(x: torch.Tensor, amax: torch.Tensor | None, scope: str, block_2d: bool, dtype: torch.dtype):
    data, scale, gs, amax_g = nvfp4_core(x, amax, scope, block_2d)
    q = NVFP4Tensor(data=data, scale=scale, global_scale=gs, amax=amax_g, logical_shape=tuple(x.shape),
                    scale_scope=scope, block_2d=block_2d)
    return data, scale, gs, amax_g, q.dequantize(dtype)


# ---------------------------------------------------------------------------------------------------------
# Compiled entry points (built lazily, once per function)
# ---------------------------------------------------------------------------------------------------------

_COMPILED: dict[str, object] = {}


def _compiled(fn):
    c = _COMPILED.get(fn.__name__)
    if c is None:
        c = _COMPILED[fn.__name__] = compile_exact(fn)
    return c


def mxfp8_qdq(x: torch.Tensor, axis: int, dtype: torch.dtype) -> tuple[MXFP8Tensor, torch.Tensor]:
    """``(quantize_mxfp8(x, axis=axis), its dequantization in dtype)`` in one compiled pass.

    ``x`` must already satisfy the codec's checks (float dtype, block dim a multiple of 32): the callers
    validate through the reference quantizers' messages first (see ``quant_linear._check_mxfp8``).
    """
    fn = _compiled(_mxfp8_qdq_row if axis == -1 else _mxfp8_qdq_col)
    data, scale, deq = fn(x.detach().contiguous(), dtype)  # detach: one graph, no requires_grad guard
    return MXFP8Tensor(data=data, scale=scale, axis=axis), deq


def mxfp8_dequantize(q: MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)``, compiled."""
    fn = _compiled(_mxfp8_dq_row if q.axis == -1 else _mxfp8_dq_col)
    return fn(q.data, q.scale, dtype)


def nvfp4_qdq(x: torch.Tensor, scope: str, dtype: torch.dtype, *, amax: torch.Tensor | None = None,
              block_2d: bool = False):
    """``(quantize_nvfp4(x, ...), its dequantization in dtype)`` traced as one compiled graph.

    ``x`` must already satisfy the codec's checks (as for ``mxfp8_qdq``); a given ``amax`` is checked and
    broadcast to the global-scale shape here, eagerly (its sign check reads the values).
    """
    x = x.detach().contiguous()  # detach: one graph, no requires_grad guard
    if amax is not None:
        amax = broadcast_nvfp4_amax(amax, x, scope)
    data, scale, gs, amax_g, deq = _compiled(_nvfp4_qdq)(x, amax, scope, block_2d, dtype)
    q = NVFP4Tensor(data=data, scale=scale, global_scale=gs, amax=amax_g, logical_shape=tuple(x.shape),
                    scale_scope=scope, block_2d=block_2d)
    return q, deq


def nvfp4_dequantize(q, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` for an ``NVFP4Tensor``, compiled."""
    return _compiled(_nvfp4_dq)(q.data, q.scale, q.global_scale, dtype)


def _nvfp4_dq(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype):
    q = NVFP4Tensor(data=data, scale=scale, global_scale=global_scale, amax=global_scale,
                    logical_shape=(*data.shape[:-1], data.shape[-1] * 2))
    return q.dequantize(dtype)
