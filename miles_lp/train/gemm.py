"""The emulated quantized GEMM as an autograd function: the forward computes on the grid the sampler serves.

Emulated GEMM (CONTRACT 1, "exactness note"): ``y = deq(q(x)) @ deq(q(w)).T``. Each dequantized operand
is exactly representable in bf16, so a bf16 GEMM with fp32 accumulation computes what a native MXFP8 /
NVFP4 GEMM computes, up to accumulation order. With bf16 activations (``train.param_dtype: bf16`` or a bf16 master)
the operands are bf16 and the GEMM accumulates in fp32 (cuBLAS on CUDA; oneDNN / ATen's CPU BLAS on CPU); with
fp32 activations the GEMM runs in fp32 on the same bf16-exact values, which is the same result up to accumulation
order.

Forward quantization (from the BF16/FP32 master, never from an earlier quantized copy):

* MXFP8: weight and input rowwise (1x32 blocks along K).
* NVFP4: weight with a per-tensor global scale (per expert for ``[E, N, K]``; gate and up share one:
  the fused ``gate_up_proj`` is one matrix per expert, separate gate/up modules pass a joint amax),
  optional 16x16 2-D weight blocks; activations per token (``scale_scope="row"``, the RL recipe) or
  per tensor, as the plan entry says.

Backward modes (``BackwardMode``; TE's ``NVTE_BACKWARD_OVERRIDE``, CONTRACT 7):

* ``high_precision``: dgrad = dy @ w, wgrad = dy.T @ x on the original operands. Saves x and w.
* ``dequantized``: dgrad = dy @ deq(wq), wgrad = dy.T @ deq(xq) on the forward's rowwise operands.
  Saves only the compact quantized x and w (bytes + scales); nothing columnwise is kept.
* ``quantized`` (MXFP8 and FP8 blockwise; TE's default MXFP8 and Float8BlockScaling recipes): every operand is
  quantized along the reduction dim of its backward GEMM, from full precision. In TE ``module/linear.py`` the dgrad GEMM is
  ``general_gemm(weight, grad_output, layout="NN")`` and wgrad ``general_gemm(inputmat, grad_output,
  layout="NT")``; a non-transposed MXFP8 operand uses its columnwise data (``tensor/mxfp8_tensor.py``,
  rowwise and columnwise usages). Hence: dgrad (reduces over N) = deq(q_row(dy)) @ deq(q_col(w)); wgrad
  (reduces over tokens M) = deq(q_col(dy)).T @ deq(q_col(x)). Columnwise blocks run along tokens, so M is
  zero-padded to a multiple of 32 for the wgrad operands (zero rows change neither a block's amax nor the
  GEMM: this equals padding the batch with zero tokens, as TE's MoE token padding does).

FP8 blockwise (``fp8_block``, TE Float8BlockScaling): the weight in 128x128 tiles (one tile serves the weight and
its transpose, so the dgrad operand is the forward grid), x and dy in 1x128 tiles along the reduction of each GEMM
(rowwise for the forward / dgrad, 128x1 for wgrad). Its scales are arbitrary fp32 (unless ``pow2_scales``), so a
decode is not exact in bf16: the emulated GEMM decodes to fp32 and multiplies in fp32 (one rounding per element,
as DeepSeek's reference dequantization). On an sm_90 GPU with bf16 activations and N, K multiples of 128 the
GEMMs run natively on FP8 tensor cores instead (``miles_lp.train.fp8_block_gemm``; operands byte-identical to
the codec, from ``miles_lp.formats.kernels.fp8_block``), the forward in every mode and dgrad/wgrad in
``quantized`` mode; ``kernel="reference"`` keeps the emulation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from miles_lp.formats.spec import MXFP8_BLOCK, BackwardMode
from miles_lp.train import fused, lean
from miles_lp.train.grid import WeightGrid, no_grad_if_enabled
from miles_lp.train.operands import (
    check_operand,
    fused_activation,
    fused_dequantize,
    pad_rows,
    quantize_activation,
    quantize_columnwise_checked,
    quantize_rowwise,
    reference_dequantize,
)
from miles_lp.train.recipe import LinearRecipe

_FIELDS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _fields(q: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tensor field names, other init field names) of a quantized-tensor dataclass, once per class (which
    fields hold tensors is fixed per class: MXFP8Tensor, NVFP4Tensor)."""
    cls = type(q)
    got = _FIELDS.get(cls)
    if got is None:
        fs = [f.name for f in dataclasses.fields(q) if f.init]
        got = _FIELDS[cls] = (tuple(n for n in fs if isinstance(getattr(q, n), torch.Tensor)),
                              tuple(n for n in fs if not isinstance(getattr(q, n), torch.Tensor)))
    return got


class _Packed:
    """The static part of a quantized-tensor dataclass; its tensor fields travel via save_for_backward."""

    __slots__ = ("cls", "static", "names")

    def __init__(self, q: Any):
        self.cls = type(q)
        self.names, static = _fields(q)
        self.static: dict[str, Any] = {n: getattr(q, n) for n in static}

    def tensors(self, q: Any) -> list[torch.Tensor]:
        return [getattr(q, n) for n in self.names]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        return self.cls(**self.static, **dict(zip(self.names, tensors, strict=True)))



def gemm_operand_dtype(x: torch.Tensor) -> torch.dtype:
    """bf16 operands for bf16 activations (fp32 accumulation: cuBLAS on CUDA, oneDNN / ATen's CPU BLAS on CPU, where
    AVX512-BF16 or AMX run them ~4x faster than fp32), fp32 otherwise."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def _recipe_operand_dtype(x: torch.Tensor, recipe: LinearRecipe) -> torch.dtype:
    """``gemm_operand_dtype``, except fp32 for FP8 blockwise with arbitrary fp32 scales (their decode is not exact in
    bf16)."""
    if not recipe.scheme.bf16_exact(recipe.pow2_scales):
        return torch.float32
    return gemm_operand_dtype(x)


def _fp8_native(x: torch.Tensor, weight: torch.Tensor, grid: WeightGrid) -> bool:
    if not grid.scheme.native_gemm or grid.kernel == "reference" or not x.is_cuda:
        return False
    from miles_lp.train import fp8_block_gemm

    return fp8_block_gemm.unavailable_reason(x, weight) is None


def _step_dequantized(grid: WeightGrid, wq: Any, op: torch.dtype) -> torch.Tensor:
    """The reference path's dequantized forward weight, decoded once per step: kept on the grid beside the rowwise
    grid it decodes (``WeightGrid.rowwise`` drops both when the weight changes) when ``cache_dequantized``. A grid
    that serves a slice of another (an expert's view of a fused grid) manages no cache of its own: decoded per call."""
    if type(grid) is not WeightGrid:
        return wq.dequantize(op)
    deq = grid._deq
    if deq is not None and deq.dtype == op:
        return deq
    deq = wq.dequantize(op)
    if grid.cache_dequantized:
        grid._deq = deq
    return deq


class InputCache:
    """The last (input, activation grid) -> (quantized input, its decode) of sibling linears that read one input
    tensor (q/k/v, gate/up: ``quant_linear.share_input_caches``): the reference path quantizes that input once, as the
    engine's layers (``rollout.layers.InputCache``) and a fused kernel do; the same bytes either way. It holds the
    input, so no other tensor can take its storage (the ``data_ptr`` in the key) while it is cached."""

    __slots__ = ("x", "key", "value")

    def __init__(self):
        self.x = self.key = self.value = None


def _activation_grid(x: torch.Tensor, recipe: LinearRecipe, op: torch.dtype, cache: InputCache | None):
    """(forward grid of ``x``, its decode in ``op``), shared through ``cache`` by siblings reading the same input."""
    if cache is None:
        xq = quantize_activation(x, recipe)
        return xq, xq.dequantize(op)
    key = (recipe.format, recipe.nvfp4_row_scope, recipe.pow2_scales, op, x.data_ptr(), x._version, x.shape,
           x.stride(), x.dtype)
    if cache.x is not None and cache.key == key:
        return cache.value
    xq = quantize_activation(x, recipe)
    value = (xq, xq.dequantize(op))
    cache.x, cache.key, cache.value = x.detach(), key, value
    return value


class QuantLinearFn(torch.autograd.Function):
    """y = deq(q(x)) @ deq(wq).T (+ b); backward per ``recipe.backward``. x is ``[M, K]``.

    Two implementations of every quantize/dequantize, with the same bytes: the reference (the codecs,
    eager) and the compiled one (``miles_lp.train.fused``: one fused pass per operand), chosen by
    ``grid.use_compiled(x)`` (``kernel="auto"``: compiled on CUDA, reference elsewhere).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: WeightGrid):
        recipe = grid.recipe
        op = _recipe_operand_dtype(x, recipe)
        compiled = grid.use_compiled(x)
        if compiled and fused.uses_kernels(x, op):  # the Triton kernels: the lean path (miles_lp.train.lean)
            return lean.forward(ctx, x, weight, bias, grid, op)
        ctx.lean = None
        ctx.native = None
        if _fp8_native(x, weight, grid):
            return _fp8_forward(ctx, x, weight, bias, grid)
        w_deq_cached = wc = xc = None
        # quantized mode on the compiled path: both grids of the weight, and of x when its tokens need no
        # padding, from one read each
        both = compiled and recipe.backward is BackwardMode.QUANTIZED
        if compiled:
            check_operand(x, recipe, -1, "input")
            if both and weight.shape[-2] % MXFP8_BLOCK == 0:
                wq, w_deq, wc = grid.both_dequantized(weight, op)
            else:
                wq, w_deq = grid.rowwise_dequantized(weight, op)
            w_deq_cached = w_deq if grid.cache_dequantized else None
            if both and x.shape[0] % MXFP8_BLOCK == 0:
                xq, x_deq, xc, _ = fused.mxfp8_qdq_both(x.detach(), op, dequant=("row",))
            else:
                xq, x_deq = fused_activation(x, recipe, op)
        else:
            wq = grid.rowwise(weight)
            w_deq = _step_dequantized(grid, wq, op)
            w_deq_cached = w_deq if grid.cache_dequantized else None
            xq, x_deq = _activation_grid(x, recipe, op, grid.input_cache)
        y = F.linear(x_deq, w_deq)
        del x_deq, w_deq
        if bias is not None:
            y = y + bias.to(y.dtype)
        if y.dtype != x.dtype:  # (a no-op .to() still costs a dispatch on the hot path)
            y = y.to(x.dtype)

        ctx.recipe, ctx.op, ctx.x_dtype, ctx.w_dtype = recipe, op, x.dtype, weight.dtype
        ctx.has_bias, ctx.compiled = bias is not None, compiled
        ctx.w_deq = None
        mode = recipe.backward
        if mode is BackwardMode.HIGH_PRECISION:
            ctx.save_for_backward(x, weight)
        elif mode is BackwardMode.DEQUANTIZED:
            ctx.xp, ctx.wp = _Packed(xq), _Packed(wq)
            ctx.save_for_backward(*ctx.xp.tensors(xq), *ctx.wp.tensors(wq))
            # The step's dequantized weight (held by the grid for the whole step, not per micro-batch): dgrad
            # reuses it instead of decoding wq again.
            ctx.w_deq = w_deq_cached
        else:  # QUANTIZED: columnwise copies from full precision (x along tokens, w along N)
            if wc is None:
                wc = grid.columnwise(weight)
            if xc is None:
                xc = quantize_columnwise_checked(pad_rows(x, MXFP8_BLOCK), recipe, "input", compiled=compiled)
            ctx.xp, ctx.wp = _Packed(xc), _Packed(wc)
            ctx.save_for_backward(*ctx.xp.tensors(xc), *ctx.wp.tensors(wc))
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.lean is not None:
            return lean.backward(ctx, dy)
        if ctx.native is not None:
            return _fp8_backward(ctx, dy)
        recipe, op, mode, compiled = ctx.recipe, ctx.op, ctx.recipe.backward, ctx.compiled
        saved = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias
        dequantize = fused_dequantize if compiled else reference_dequantize
        dx = dw = db = None
        if mode is BackwardMode.HIGH_PRECISION:
            x, weight = saved
            g = _as_dtype(dy, op)
            if need_x:
                dx = torch.mm(g, _as_dtype(weight, op))
            if need_w:
                dw = torch.mm(g.t(), _as_dtype(x, op))
        elif mode is BackwardMode.DEQUANTIZED:
            nx = len(ctx.xp.names)
            g = _as_dtype(dy, op)
            if need_x:
                w_deq = ctx.w_deq if ctx.w_deq is not None else dequantize(ctx.wp.rebuild(saved[nx:]), op)
                dx = torch.mm(g, w_deq)
            if need_w:
                dw = torch.mm(g.t(), dequantize(ctx.xp.rebuild(saved[:nx]), op))
        else:
            nx = len(ctx.xp.names)
            xc, wc = ctx.xp.rebuild(saved[:nx]), ctx.wp.rebuild(saved[nx:])
            g_row = g_col = None
            if compiled and need_x and need_w and dy.shape[0] % MXFP8_BLOCK == 0:
                check_operand(dy, recipe, -1, "grad_output")
                check_operand(dy, recipe, -2, "grad_output")
                _, g_row, _, g_col = fused.mxfp8_qdq_both(dy, op)  # both grids of dy from one read
            if need_x:  # blocks along N (dgrad reduces over N)
                if g_row is None and compiled:
                    check_operand(dy, recipe, -1, "grad_output")
                    g_row = fused.mxfp8_qdq(dy, -1, op)[1]
                elif g_row is None:
                    g_row = quantize_rowwise(dy, recipe).dequantize(op)
                dx = torch.mm(g_row, dequantize(wc, op))
            if need_w:
                if g_col is None:
                    dy_p = pad_rows(dy, MXFP8_BLOCK)
                    if compiled:
                        check_operand(dy_p, recipe, -2, "grad_output")
                        g_col = fused.mxfp8_qdq(dy_p, -2, op)[1]
                    else:
                        g_col = quantize_columnwise_checked(dy_p, recipe, "grad_output").dequantize(op)
                dw = torch.mm(g_col.t(), dequantize(xc, op))  # padded zero rows add nothing
        if need_b:
            db = dy.float().sum(0)
        if dx is not None:
            dx = _as_dtype(dx, ctx.x_dtype)
        if dw is not None:
            dw = _as_dtype(dw, ctx.w_dtype)
        ctx.w_deq = None
        return dx, dw, db, None


def _fp8_forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: WeightGrid):
    """The forward on FP8 tensor cores; saves what the mode's backward reads (see the module docstring)."""
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.train import fp8_block_gemm

    recipe, mode = grid.recipe, grid.recipe.backward
    quantized = mode is BackwardMode.QUANTIZED
    with no_grad_if_enabled():
        xq, _, (xs, xcs) = k8.quantize_act(x, recipe.pow2_scales, rows=True, cols=quantized,
                                           grids=mode is BackwardMode.DEQUANTIZED)
        w = grid.fp8_block_native(weight)
        y = fp8_block_gemm.forward_mm(xs, w)
    if bias is not None:
        y = y + bias.to(y.dtype)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    ctx.x_dtype, ctx.w_dtype, ctx.has_bias = x.dtype, weight.dtype, bias is not None
    if mode is BackwardMode.HIGH_PRECISION:
        ctx.save_for_backward(x, weight)
        ctx.native = (mode, recipe, None, None)
    elif mode is BackwardMode.DEQUANTIZED:  # the forward's operands, decoded in the backward (fp32 unless pow2)
        ctx.save_for_backward(xq.data, xq.scale_inv, w.q.data, w.q.scale_inv)
        ctx.native = (mode, recipe, None, None)
    else:  # the step's weight operands are held by the grid; the backward reads them from ctx (not saved tensors)
        ctx.save_for_backward(xcs.data, xcs.scale_inv)
        ctx.native = (mode, recipe, xcs.rows, w)
    del xq, xs
    return y


def _fp8_backward(ctx, dy: torch.Tensor):
    from miles_lp.formats.fp8 import FP8BlockTensor
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.train import fp8_block_gemm
    from miles_lp.train.operands import FP8_ROW_BLOCK, FP8_WEIGHT_BLOCK

    mode, recipe, rows, w = ctx.native
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    saved = ctx.saved_tensors
    dx = dw = db = None
    if mode is BackwardMode.HIGH_PRECISION:
        x, weight = saved
        g = _as_dtype(dy, torch.bfloat16)
        dx = torch.mm(g, weight.to(g.dtype)) if need_x else None
        dw = torch.mm(g.t(), x.to(g.dtype)) if need_w else None
    elif mode is BackwardMode.DEQUANTIZED:
        op = _recipe_operand_dtype(dy, recipe)
        xd, xs, wd, ws = saved
        g = _as_dtype(dy, op)
        if need_x:
            dx = torch.mm(g, FP8BlockTensor(wd, ws, FP8_WEIGHT_BLOCK).dequantize(op))
        if need_w:
            dw = torch.mm(g.t(), FP8BlockTensor(xd, xs, FP8_ROW_BLOCK).dequantize(op))
    else:
        xcd, xcs = saved
        with no_grad_if_enabled():
            _, _, (gs, gcs) = k8.quantize_act(dy, recipe.pow2_scales, rows=need_x, cols=need_w, grids=False)
            if need_x:
                dx = fp8_block_gemm.dgrad_mm(gs, w)
            if need_w:
                dw = fp8_block_gemm.wgrad_mm(gcs, k8.NativeOperand(xcd, xcs, rows))
        ctx.native = None
    if ctx.has_bias:
        db = dy.float().sum(0)
    if dx is not None:
        dx = _as_dtype(dx, ctx.x_dtype)
    if dw is not None:
        dw = _as_dtype(dw, ctx.w_dtype)
    return dx, dw, db, None


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when it already is (the common case on CUDA: bf16 throughout)."""
    return t if t.dtype == dtype else t.to(dtype)



def quantized_linear(x: torch.Tensor, weight: torch.Tensor, entry: Any, bias: torch.Tensor | None = None,
                     *, grid: WeightGrid | None = None) -> torch.Tensor:
    """Functional QuantLinear: ``x [..., K]`` times ``weight [N, K]`` on the grid of plan ``entry``.

    ``entry`` is a ``PlanEntry`` or a ``LinearRecipe``; a BF16 entry runs ``F.linear``.
    """
    recipe = entry if isinstance(entry, LinearRecipe) else LinearRecipe.from_entry(entry)
    if recipe is None:
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    if grid is None:
        grid = WeightGrid(recipe)
    apply = FUNCTION_APPLY if not functorch_active() else QuantLinearFn.apply
    if x.dim() == 2:  # (no reshape dispatches on the common 2-D path)
        return apply(x, weight, bias, grid)
    k = x.shape[-1]
    y = apply(x.reshape(-1, k), weight, bias, grid)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ``Function.apply`` in Python binds default arguments (no setup_context here), asks whether functorch
# transforms are active and unwraps dead functorch wrappers (none outside functorch) before calling the C
# ``_FunctionBase.apply``; without functorch the C call alone does the same (a few us per call on the H200 host).
FUNCTION_APPLY = super(torch.autograd.Function, QuantLinearFn).apply
functorch_active = torch._C._are_functorch_transforms_active
