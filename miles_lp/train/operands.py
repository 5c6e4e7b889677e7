"""Operand quantizers and views of quantized tensors: thin calls into ``miles_lp.formats`` (the codecs own
every bit of the rule), the compiled twins from ``miles_lp.train.fused`` (same bytes), and the slicing of a
quantized tensor into an expert's or a row range's quantization (rowwise blocks lie inside a row).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.schemes.fp8_block import COL_BLOCK as FP8_COL_BLOCK
from miles_lp.formats.schemes.fp8_block import ROW_BLOCK as FP8_ROW_BLOCK
from miles_lp.formats.schemes.fp8_block import WEIGHT_BLOCK as FP8_WEIGHT_BLOCK
from miles_lp.formats.spec import Format
from miles_lp.train import fused
from miles_lp.train.recipe import LinearRecipe

__all__ = ["FP8_COL_BLOCK", "FP8_ROW_BLOCK", "FP8_WEIGHT_BLOCK"]  # TE Float8BlockScaling's tiles (the fp8_block scheme)


def quantize_weight(w: torch.Tensor, recipe: LinearRecipe, *, amax: torch.Tensor | None = None,
                    compile: bool = False):
    """The forward (rowwise) grid of a weight ``[..., N, K]`` from its master values (the scheme's weight grid:
    the converter writes the same)."""
    return recipe.scheme.quantize_weight(w, amax=amax, block_2d=recipe.block_2d, pow2_scales=recipe.pow2_scales,
                                         compile=compile)


def quantize_activation(x: torch.Tensor, recipe: LinearRecipe):
    """The forward grid of the input ``[M, K]`` (per token under NVFP4 with ``activation_scale: token``)."""
    return recipe.scheme.quantize_activation(x, scope=recipe.nvfp4_row_scope, pow2_scales=recipe.pow2_scales)


def quantize_columnwise(t: torch.Tensor, recipe: LinearRecipe, *, compiled: bool = False):
    """A backward operand blocked along dim -2 (``quantized`` mode): MXFP8 32x1, FP8 blockwise 128x1 (the 1x128
    tiles of the transposed operand, quantized from the high-precision values as TE does)."""
    return recipe.scheme.quantize_grad(t, -2, pow2_scales=recipe.pow2_scales, compile=compiled)


def quantize_rowwise(t: torch.Tensor, recipe: LinearRecipe):
    return recipe.scheme.quantize_grad(t, -1, pow2_scales=recipe.pow2_scales)


def weight_amax(w: torch.Tensor) -> torch.Tensor:
    """Per-matrix amax ``[..., 1, 1]`` (fp32) of a weight ``[..., N, K]``, NaN ignored."""
    a = torch.nan_to_num(w.detach().abs().float(), nan=0.0)
    return a.amax(dim=(-2, -1), keepdim=True)



def reference_dequantize(q: Any, dtype: torch.dtype) -> torch.Tensor:
    return q.dequantize(dtype)


#: the compiled twins of ``miles_lp.train.fused`` (same bytes) for the formats whose scheme uses them
#: (``FormatScheme.use_compiled``): decode, activation grid + decode, weight grid + decode
_FUSED_DEQUANTIZE = {Format.MXFP8: fused.mxfp8_dequantize, Format.NVFP4: fused.nvfp4_dequantize}
_FUSED_ACTIVATION = {
    Format.MXFP8: lambda x, recipe, dtype: fused.mxfp8_qdq(x, -1, dtype),
    Format.NVFP4: lambda x, recipe, dtype: fused.nvfp4_qdq(x, recipe.nvfp4_row_scope, dtype),
}
_FUSED_WEIGHT = {
    Format.MXFP8: lambda w, recipe, dtype, amax: fused.mxfp8_qdq(w, -1, dtype),
    Format.NVFP4: lambda w, recipe, dtype, amax: fused.nvfp4_qdq(w, "tensor", dtype, amax=amax,
                                                                 block_2d=recipe.block_2d),
}


def fused_dequantize(q: Any, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` through the compiled decode (same bytes)."""
    return _FUSED_DEQUANTIZE[q.format](q, dtype)


def fused_activation(x: torch.Tensor, recipe: LinearRecipe, dtype: torch.dtype):
    """``(quantize_activation(x, recipe), its dequantization)`` in one compiled pass."""
    return _FUSED_ACTIVATION[recipe.format](x, recipe, dtype)


def fused_weight(w: torch.Tensor, recipe: LinearRecipe, dtype: torch.dtype, amax: torch.Tensor | None):
    """``(quantize_weight(w, recipe, amax=amax), its dequantization)`` in one compiled pass."""
    return _FUSED_WEIGHT[recipe.format](w, recipe, dtype, amax)


def check_operand(t: torch.Tensor, recipe: LinearRecipe, axis: int, what: str) -> None:
    """The codecs' refusals, before a compiled kernel sees the tensor (same rule, named after the layer)."""
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16) or t.numel() == 0:
        raise FormatError(f"{recipe.name}: {what} of shape {tuple(t.shape)} and dtype {t.dtype} cannot be "
                          "quantized (float32/bfloat16/float16, non-empty)")
    scheme = recipe.scheme
    if not scheme.aligned:  # partial edge tiles are part of the format: no alignment rule
        return
    block = scheme.scale_block
    if t.shape[axis] % block:
        raise FormatError(f"{recipe.name}: {what} of shape {tuple(t.shape)}: dim {axis} has {t.shape[axis]} "
                          f"elements, not a multiple of the {recipe.format.value} block of {block}; keep this "
                          "layer BF16 with a policy rule")


def quantize_columnwise_checked(t: torch.Tensor, recipe: LinearRecipe, what: str, *, compiled: bool = False):
    try:
        return quantize_columnwise(t, recipe, compiled=compiled)
    except FormatError as exc:
        raise FormatError(f"{recipe.name}: columnwise {what} of shape {tuple(t.shape)}: {exc}") from exc



_LAYOUT: dict[type, tuple[tuple[str, ...], str | None]] = {}


def _layout(q: Any) -> tuple[tuple[str, ...], str | None]:
    """(init field names, the logical-shape field or None) of a quantized-tensor dataclass, once per class
    (``dataclasses.fields`` per call was a measurable share of the sync's per-expert export on the H200 host)."""
    cls = type(q)
    got = _LAYOUT.get(cls)
    if got is None:
        names = tuple(f.name for f in dataclasses.fields(q) if f.init)
        shape = next((n for n in ("logical_shape", "shape") if n in names), None)
        got = _LAYOUT[cls] = (names, shape)
    return got


def _replace_tensors(q: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], **static: Any) -> Any:
    """A copy of quantized tensor ``q`` with every tensor field mapped through ``fn(name, t)``."""
    kw = {}
    for name in _layout(q)[0]:
        v = getattr(q, name)
        kw[name] = fn(name, v) if isinstance(v, torch.Tensor) else static.get(name, v)
    return type(q)(**kw)


def _shape_field(q: Any) -> str | None:
    return _layout(q)[1]


_PER_MATRIX_SCALARS = ("global_scale", "amax")


def select_expert(q: Any, e: int) -> Any:
    """Expert ``e`` of a quantized ``[E, N, K]`` tensor, as the quantized ``[N, K]`` tensor it equals.

    A per-matrix global scale (and amax) ``[E, 1, 1]`` becomes the 0-d one of a 2-D quantization.
    """
    per_matrix = getattr(q, "scale_scope", "tensor") == "tensor"
    names, shape_field = _layout(q)
    kw = {}
    for name in names:
        v = getattr(q, name)
        if isinstance(v, torch.Tensor):
            v = v[e]
            if per_matrix and name in _PER_MATRIX_SCALARS and v.shape == (1, 1):
                v = v.reshape(())
        kw[name] = v
    if shape_field is not None:
        kw[shape_field] = type(kw[shape_field])(tuple(q.shape)[1:])
    return type(q)(**kw)


def select_experts(q: Any) -> list[Any]:
    """``[select_expert(q, e) for e in range(E)]`` with one ``unbind`` per tensor field instead of E
    indexing calls each (the same views: same storage, offsets, shapes)."""
    per_matrix = getattr(q, "scale_scope", "tensor") == "tensor"
    names, shape_field = _layout(q)
    n = q.shape[0]
    cols: dict[str, tuple] = {}
    static: dict[str, Any] = {}
    for name in names:
        v = getattr(q, name)
        if isinstance(v, torch.Tensor):
            if per_matrix and name in _PER_MATRIX_SCALARS and v.dim() == 3 and v.shape[1:] == (1, 1):
                v = v.reshape(v.shape[0])  # [E, 1, 1] -> E 0-d scalars
            cols[name] = v.unbind(0)
        else:
            static[name] = v
    if shape_field is not None:
        static[shape_field] = type(static[shape_field])(tuple(q.shape)[1:])
    cls = type(q)
    return [cls(**static, **{name: parts[e] for name, parts in cols.items()}) for e in range(n)]


def select_expert_rows(q: Any, parts: int) -> list[Any]:
    """``[select_rows(select_expert(q, e), rows p of parts) for e in range(E) for p in range(parts)]``: the row
    blocks of every expert of a rowwise-quantized ``[E, N, K]`` tensor (gate and up of a fused ``gate_up`` for
    ``parts=2``), with one ``unflatten`` + ``unbind`` per tensor field instead of ``E * parts`` indexing calls
    each. The same views (storage, offsets, shapes, strides); a per-matrix global scale stays the expert's and
    is shared by its parts, as ``select_rows`` keeps it."""
    per_matrix = getattr(q, "scale_scope", "tensor") == "tensor"
    names, shape_field = _layout(q)
    n_exp, n = q.shape[0], q.shape[-2]
    if n % parts or len(q.shape) != 3:
        raise ValueError(f"select_expert_rows: {list(q.shape)} does not split into {parts} row blocks per expert")
    rows = n // parts
    cols: dict[str, list] = {}
    static: dict[str, Any] = {}
    for name in names:
        v = getattr(q, name)
        if not isinstance(v, torch.Tensor):
            static[name] = v
        elif v.dim() == 3 and v.shape[-2] == n:  # the row-indexed fields (data, scales, a per-row global scale)
            cols[name] = [p for ve in v.unflatten(1, (parts, rows)).unbind(0) for p in ve.unbind(0)]
        else:
            if per_matrix and name in _PER_MATRIX_SCALARS and v.dim() == 3 and v.shape[1:] == (1, 1):
                v = v.reshape(n_exp)  # [E, 1, 1] -> E 0-d scalars (select_expert's reshape)
            cols[name] = [s for s in v.unbind(0) for _ in range(parts)]
    if shape_field is not None:
        static[shape_field] = type(static[shape_field])((rows, q.shape[-1]))
    cls = type(q)
    return [cls(**static, **{name: c[i] for name, c in cols.items()}) for i in range(n_exp * parts)]


def select_rows(q: Any, rows: slice | torch.Tensor) -> Any:
    """Rows of a rowwise-quantized ``[N, K]`` tensor (data, scales and a per-row global scale follow).

    Rowwise blocks lie inside a row, so the rows of the quantized whole are the quantization of the rows,
    except for a per-tensor global scale, which stays the whole tensor's (gate/up share it by design).
    """
    n = q.shape[-2]
    names, shape_field = _layout(q)
    is_slice = isinstance(rows, slice)
    kw = {}
    for name in names:
        t = getattr(q, name)
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] == n:
            t = t[..., rows, :] if is_slice else t.index_select(-2, rows.to(t.device))
        kw[name] = t
    if shape_field is not None:
        count = len(range(n)[rows]) if is_slice else int(rows.numel())
        kw[shape_field] = type(kw[shape_field])((*tuple(q.shape)[:-2], count, q.shape[-1]))
    return type(q)(**kw)


def pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` with zero rows appended so that its row count (dim -2) is a multiple of ``multiple`` (the columnwise
    operands' blocks run along the rows)."""
    pad = (-t.shape[-2]) % multiple
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t
