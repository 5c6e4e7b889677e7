"""QuantLinearFn's forward and backward on the Triton kernels: the same GEMMs and bytes as ``gemm``'s compiled
path, with the least host work per call (QuantLinear at 2048x4096x4096 is host-bound on the H200).

What is cut against the general path (``gemm.QuantLinearFn`` on the compiled graphs / reference codecs): the
kernels called through ``miles_lp.train.launch`` (per-shape bound launches), the Triton/env selection asked
once per forward (not per kernel call), one ctx attribute for everything backward needs, the forward GEMM as
``F.linear`` (as the general path), and no saved weight tensors in ``dequantized`` mode when
the step's dequantized weight is cached (the grid holds the weight's grid anyway; dgrad reads the cached
decode). x's saved tensors are what its decode reads (MXFP8: data, scale; NVFP4: data, scale, global scale).
Operands used only decoded are not stored (``store_q=False``: MXFP8 high_precision's forward x, ``quantized``
mode's grad_output): no allocation for their E4M3 data and scales, 1.03 bytes per element and grid not written.
Everything else (modes, operands, padding, checks and their messages) is ``gemm``'s rule, unchanged; the
equality with the reference path is tested bit for bit (``tests/unit/test_train_lean.py``,
``test_train_kernel_launches.py``, ``pytest -m gpu``).
"""

from __future__ import annotations

import torch

from miles_lp.formats.nvfp4 import NVFP4Tensor
from miles_lp.formats.spec import MXFP8_BLOCK, BackwardMode, Format
from miles_lp.train import launch
from miles_lp.train.operands import check_operand, pad_rows, quantize_columnwise_checked

_HP, _DQ, _QN = BackwardMode.HIGH_PRECISION, BackwardMode.DEQUANTIZED, BackwardMode.QUANTIZED
_MX = Format.MXFP8
_mm = torch.mm
_linear = torch._C._nn.linear  # F.linear's own binding (F.linear is this object)


def _x_qdq(x: torch.Tensor, recipe, op: torch.dtype):
    """(quantized x, its decode in ``op``), rowwise / per token as the recipe says."""
    if recipe.format is _MX:
        q, d, _, _ = launch.mxfp8(x, True, False, op)
        return q, d
    return launch.nvfp4(x, recipe.nvfp4_row_scope, op)


def forward(ctx, x, weight, bias, grid, op):
    recipe = grid.recipe
    mode = recipe.backward
    check_operand(x, recipe, -1, "input")
    wc = xc = None
    if mode is _QN and weight.shape[-2] % MXFP8_BLOCK == 0:
        wq, w_deq, wc = grid.both_dequantized(weight, op)
    else:
        wq, w_deq = grid.rowwise_dequantized(weight, op)
    if mode is _QN and x.shape[0] % MXFP8_BLOCK == 0:
        xq, x_deq, xc, _ = launch.mxfp8(x, True, True, op, ("row",))
    elif mode is _HP and recipe.format is _MX:  # backward reads x itself: only the decode (store_q=False)
        xq, x_deq = None, launch.mxfp8(x, True, False, op, ("row", "col"), False)[1]
    else:
        xq, x_deq = _x_qdq(x, recipe, op)
    y = _linear(x_deq, w_deq)  # (the transpose inside the C++ op: one Python call fewer than mm(x, w.t()))
    del x_deq
    if bias is not None:
        y = y + bias.to(y.dtype)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    cached = w_deq if grid.cache_dequantized else None
    if mode is _HP:
        ctx.save_for_backward(x, weight)
        ctx.lean = (mode, op, x.dtype, weight.dtype, bias is not None, None, None)
    elif mode is _DQ:
        if recipe.format is _MX:
            xs = (xq.data, xq.scale)
            ws = () if cached is not None else (wq.data, wq.scale)
        else:
            xs = (xq.data, xq.scale, xq.global_scale)
            ws = () if cached is not None else (wq.data, wq.scale, wq.global_scale)
        ctx.save_for_backward(*xs, *ws)
        meta = (recipe.format, xq.logical_shape, xq.scale_scope, wq.logical_shape, wq.scale_scope,
                wq.block_2d) if recipe.format is not _MX else None
        ctx.lean = (mode, op, x.dtype, weight.dtype, bias is not None, cached, meta)
    else:  # QUANTIZED: columnwise copies from full precision (x along tokens, w along N)
        if wc is None:
            wc = grid.columnwise(weight)
        if xc is None:

            xc = quantize_columnwise_checked(pad_rows(x, MXFP8_BLOCK), recipe, "input", compiled=True)
        ctx.save_for_backward(xc.data, xc.scale, wc.data, wc.scale)
        ctx.lean = (mode, op, x.dtype, weight.dtype, bias is not None, recipe, None)
    return y


def backward(ctx, dy):
    mode, op, x_dtype, w_dtype, has_bias, extra, meta = ctx.lean
    saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_x, need_w = need[0], need[1]
    dx = dw = db = None
    if mode is _HP:
        x, weight = saved
        g = dy if dy.dtype == op else dy.to(op)
        if need_x:
            dx = _mm(g, weight if weight.dtype == op else weight.to(op))
        if need_w:
            dw = _mm(g.t(), x if x.dtype == op else x.to(op))
    elif mode is _DQ:
        g = dy if dy.dtype == op else dy.to(op)
        if meta is None:  # MXFP8
            if need_x:
                w_deq = extra if extra is not None else launch.mxfp8_decode(saved[2], saved[3], -1, op)
                dx = _mm(g, w_deq)
            if need_w:
                dw = _mm(g.t(), launch.mxfp8_decode(saved[0], saved[1], -1, op))
        else:
            _, x_shape, x_scope, w_shape, w_scope, w_2d = meta
            if need_x:
                if extra is not None:
                    w_deq = extra
                else:
                    w_deq = launch.nvfp4_dequantize(NVFP4Tensor(saved[3], saved[4], saved[5], saved[5], w_shape,
                                                                w_scope, w_2d), op)
                dx = _mm(g, w_deq)
            if need_w:
                xq = NVFP4Tensor(saved[0], saved[1], saved[2], saved[2], x_shape, x_scope, False)
                dw = _mm(g.t(), launch.nvfp4_dequantize(xq, op))
    else:
        recipe = extra
        xcd, xcs, wcd, wcs = saved
        g_row = g_col = None
        if need_x and need_w and dy.shape[0] % MXFP8_BLOCK == 0:
            check_operand(dy, recipe, -1, "grad_output")
            check_operand(dy, recipe, -2, "grad_output")
            _, g_row, _, g_col = launch.mxfp8(dy, True, True, op, ("row", "col"), False)  # both decodes, one read
        if need_x:  # blocks along N (dgrad reduces over N)
            if g_row is None:
                check_operand(dy, recipe, -1, "grad_output")
                g_row = launch.mxfp8(dy, True, False, op, ("row", "col"), False)[1]
            dx = _mm(g_row, launch.mxfp8_decode(wcd, wcs, -2, op))
        if need_w:
            if g_col is None:

                dy_p = pad_rows(dy, MXFP8_BLOCK)
                check_operand(dy_p, recipe, -2, "grad_output")
                g_col = launch.mxfp8(dy_p, False, True, op, ("row", "col"), False)[3]
            dw = _mm(g_col.t(), launch.mxfp8_decode(xcd, xcs, -2, op))  # padded zero rows add nothing
    if has_bias:
        db = dy.float().sum(0)
    if dx is not None and dx.dtype != x_dtype:
        dx = dx.to(x_dtype)
    if dw is not None and dw.dtype != w_dtype:
        dw = dw.to(w_dtype)
    ctx.lean = None
    return dx, dw, db, None
