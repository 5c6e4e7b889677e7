"""Fused quantize->dequantize for QuantLinear: Triton kernels on CUDA, ``torch.compile`` elsewhere.

Same bytes as the codecs (``miles_lp.formats``) on every path. Entry points (shapes as the codecs):

* ``mxfp8_qdq(x, axis, dtype)`` -> ``(MXFP8Tensor, deq)``: the grid and its decode in ``dtype``;
* ``mxfp8_qdq_both(x, dtype, dequant=("row", "col"))`` -> ``(row, row_deq, col, col_deq)``: the rowwise
  AND columnwise grids from ONE read of ``x`` (the ``quantized`` backward mode needs both of the input in
  forward, and both of ``grad_output`` in backward); a decode is None where not in ``dequant``;
* ``mxfp8_dequantize(q, dtype)``: the decode alone (backward of ``dequantized`` / ``quantized`` mode);
* ``nvfp4_qdq(x, scope, dtype, amax=None, block_2d=False)`` -> ``(NVFP4Tensor, deq)``;
* ``nvfp4_dequantize(q, dtype)``.

Selection, per call: a CUDA tensor with Triton importable (``miles_lp.formats.kernels.enabled``) and an
fp32 / bf16 ``dtype`` goes to the Triton kernels (``miles_lp.formats.kernels``): one launch per MXFP8 call
(both grids, their decodes), one per per-token NVFP4 call, an amax pass + one launch for per-tensor NVFP4;
no host synchronisation (CUDA-graph friendly) except where a caller passes an ``amax`` to validate. Any
other tensor runs the codecs' own cores (``mxfp8_core``, ``nvfp4_core``) under ``torch.compile`` with the
exact Inductor options (``miles_lp.formats._compile``), as before: one graph per entry point, no graph
breaks; a second shape recompiles with dynamic shapes (``torch.compile``'s default).

Byte identity: the Triton kernels are checked against the reference codecs by
``miles_lp.formats.kernels.selfcheck`` (interpreter on CPU, compiled on CUDA: ``pytest -m gpu``); the
compiled graphs run the codecs' own functions. Every MXFP8 decode product is exact in fp32 (an E4M3 value
times a power of two), so the single final rounding is the same in both paths (NaN payloads aside).
"""

from __future__ import annotations

import torch

from miles_lp.formats import bits
from miles_lp.formats._compile import compile_exact, exact_division_available
from miles_lp.formats.mxfp8 import MXFP8Tensor, mxfp8_core  # codec cores (same bytes)
from miles_lp.formats.nvfp4 import NVFP4Tensor, broadcast_nvfp4_amax, nvfp4_core
from miles_lp.formats.spec import MXFP8_BLOCK
from miles_lp.train import launch

__all__ = ["exact_division_available", "mxfp8_dequantize", "mxfp8_qdq", "mxfp8_qdq_both", "nvfp4_dequantize",
           "nvfp4_qdq", "uses_kernels"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


_K: list = []  # miles_lp.formats.kernels, imported on first use (a function-level import costs per call)


def _kernels():
    if not _K:
        from miles_lp.formats import kernels

        _K.append(kernels)
    return _K[0]


def uses_kernels(x: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether a call on ``x`` (output ``dtype``) runs the Triton kernels (else the compiled graphs)."""
    return (dtype is None or dtype in _KERNEL_DTYPES) and _kernels().enabled(x)


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
    if uses_kernels(x, dtype):
        row, row_deq, col, col_deq = launch.mxfp8(x, axis == -1, axis == -2, dtype)
        return (row, row_deq) if axis == -1 else (col, col_deq)
    fn = _compiled(_mxfp8_qdq_row if axis == -1 else _mxfp8_qdq_col)
    data, scale, deq = fn(x.detach().contiguous(), dtype)  # detach: one graph, no requires_grad guard
    return MXFP8Tensor(data=data, scale=scale, axis=axis), deq


def mxfp8_qdq_both(x: torch.Tensor, dtype: torch.dtype, dequant: tuple[str, ...] = ("row", "col")):
    """``(row, row_deq, col, col_deq)``: both MXFP8 grids of ``x`` [..., M, K] (M, K multiples of 32) and
    the decodes named in ``dequant`` (else None). One kernel launch on CUDA; two compiled passes elsewhere."""
    if uses_kernels(x, dtype):
        return launch.mxfp8(x, True, True, dtype, dequant)
    row, row_deq = mxfp8_qdq(x, -1, dtype)
    col, col_deq = mxfp8_qdq(x, -2, dtype)
    return row, row_deq if "row" in dequant else None, col, col_deq if "col" in dequant else None


def mxfp8_dequantize(q: MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)``: one kernel launch on CUDA, compiled elsewhere."""
    if uses_kernels(q.data, dtype):
        return launch.mxfp8_decode(q.data, q.scale, q.axis, dtype)
    fn = _compiled(_mxfp8_dq_row if q.axis == -1 else _mxfp8_dq_col)
    return fn(q.data, q.scale, dtype)


def nvfp4_qdq(x: torch.Tensor, scope: str, dtype: torch.dtype, *, amax: torch.Tensor | None = None,
              block_2d: bool = False):
    """``(quantize_nvfp4(x, ...), its dequantization in dtype)`` traced as one compiled graph.

    ``x`` must already satisfy the codec's checks (as for ``mxfp8_qdq``); a given ``amax`` is checked and
    broadcast to the global-scale shape here, eagerly (its sign check reads the values).
    """
    if amax is None and uses_kernels(x, dtype):  # (the kernels read x as it is: no detach / contiguous)
        return launch.nvfp4(x, scope, dtype, None, block_2d)
    x = x.detach().contiguous()  # detach: one graph, no requires_grad guard
    if amax is not None:
        amax = broadcast_nvfp4_amax(amax, x, scope)
    if uses_kernels(x, dtype):
        return launch.nvfp4(x, scope, dtype, amax, block_2d)
    data, scale, gs, amax_g, deq = _compiled(_nvfp4_qdq)(x, amax, scope, block_2d, dtype)
    q = NVFP4Tensor(data=data, scale=scale, global_scale=gs, amax=amax_g, logical_shape=tuple(x.shape),
                    scale_scope=scope, block_2d=block_2d)
    return q, deq


def nvfp4_dequantize(q, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` for an ``NVFP4Tensor``: one kernel launch on CUDA, compiled elsewhere."""
    if uses_kernels(q.data, dtype):
        return launch.nvfp4_dequantize(q, dtype)
    return _compiled(_nvfp4_dq)(q.data, q.scale, q.global_scale, dtype)


def _nvfp4_dq(data: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype):
    q = NVFP4Tensor(data=data, scale=scale, global_scale=global_scale, amax=global_scale,
                    logical_shape=(*data.shape[:-1], data.shape[-1] * 2))
    return q.dequantize(dtype)
