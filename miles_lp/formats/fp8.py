"""FP8 E4M3 with fp32 scales: 2-D blockwise (DeepSeek-V3 / TE Float8BlockScaling) and per tensor.

Scale rule (TE ``compute_scale_from_amax`` in ``transformer_engine/common/recipe/recipe_common.cuh``,
used by ``transpose/quantize_transpose_square_blockwise.cu`` for blocks and by
``recipe/current_scaling.cu`` for Float8CurrentScaling)::

    amax  = max |x| over the block (or tensor), NaN ignored (fmaxf)
    if amax < eps: amax = eps
    if amax is inf, 0 or NaN: scale = 1
    else: scale = fp32(448 / amax)                 # __fdiv_rn: 448 / amax, not amax / 448
          if scale is inf: scale = value_for_inf   # max finite of the INPUT dtype for blocks, FLT_MAX per tensor
          if pow2: scale = bits(scale) & 0xFF800000 # round the scale DOWN to a power of two
    scale_inv = fp32(1 / scale)                     # what is stored (the decode multiplier)
    q = cvt.rn.satfinite.e4m3(fp32(x * scale))

DeepSeek-V3's own reference (``inference/kernel.py``) divides by ``s = amax / 448``; its bytes can differ
from TE's in the last bit of a few elements. We follow TE. Decoding is ``fp32(q) * scale_inv``, which is
how DeepSeek FP8 checkpoints' ``weight_scale_inv`` are read. It is not exact: an E4M3 value times an arbitrary
fp32 scale needs up to 28 significant bits, so the fp32 product is rounded once per element (as DeepSeek's
reference dequantization, before its bf16 cast in ``fp8_cast_bf16``). ``dequantize_fp8_blockwise(dtype=bf16)``
rounds that product once more, to the BF16 checkpoint ``fp8_cast_bf16`` writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from miles_lp.errors import FormatError
from miles_lp.formats import bits
from miles_lp.formats._checks import check_input, what
from miles_lp.formats._chunks import CHUNK_ELEMS, row_slices
from miles_lp.formats.spec import E4M3_MAX, FP8_BLOCK_SIZE, Format

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_CHUNK_ELEMS = CHUNK_ELEMS  # eager CPU slice (elements); tests lower it to force slices


@dataclass(frozen=True, eq=False)
class _FP8Scaled:
    """E4M3 ``data`` (the logical shape) with fp32 decode multipliers ``scale_inv``: what both FP8 layouts share."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def components(self) -> dict[str, torch.Tensor]:
        return {"data": self.data, "scale_inv": self.scale_inv}


@dataclass(frozen=True, eq=False)
class FP8BlockTensor(_FP8Scaled):
    """E4M3 data (logical shape) and fp32 ``scale_inv`` ``[..., ceil(M/bm), ceil(K/bk)]`` (decode)."""

    block: tuple[int, int] = (FP8_BLOCK_SIZE, FP8_BLOCK_SIZE)
    format: ClassVar[Format] = Format.FP8_BLOCK

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize_fp8_blockwise(self.data, self.scale_inv, block=self.block, dtype=dtype)


@dataclass(frozen=True, eq=False)
class FP8TensorwiseTensor(_FP8Scaled):
    """E4M3 data and one fp32 ``scale_inv`` (0-d, the decode multiplier)."""

    format: ClassVar[Format] = Format.FP8_TENSOR

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (self.data.to(torch.float32) * self.scale_inv).to(dtype)


def _scale_from_amax(amax: torch.Tensor, *, value_for_inf: float, pow2: bool, eps: float) -> torch.Tensor:
    """TE ``compute_scale_from_amax`` (recipe_common.cuh), vectorised; amax fp32, any shape."""
    amax = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    scale = torch.div(bits.fp32_scalar(bits.f32_bits(E4M3_MAX), amax.device), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    scale = torch.where(torch.isinf(amax) | (amax == 0) | torch.isnan(amax), torch.ones_like(scale), scale)
    if pow2:
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)  # & 0xFF800000
    return scale


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    return torch.div(bits.fp32_scalar(bits.f32_bits(1.0), scale.device), scale)


def _check_block(block, x: torch.Tensor, name: str | None) -> tuple[int, int]:
    try:
        bm, bk = (int(b) for b in block)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"FP8 blockwise: block={block!r} must be two positive ints (rows, cols)") from exc
    if bm <= 0 or bk <= 0:
        raise FormatError(f"FP8 blockwise: block={block!r} must be two positive ints (rows, cols) for {what(name, x)}")
    return bm, bk


def _blockwise_rows(xs: torch.Tensor, bm: int, bk: int, *, value_for_inf: float, pow2: bool,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [r, K] starting at a block-row boundary -> (e4m3 [r, K], scale_inv [ceil(r/bm), ceil(K/bk)]).

    Per band of ``bm`` rows: column maxima first (a reduction over rows, fast), then the max of each
    ``bk`` columns; a partial last band / column block takes the max over the elements it has (zero
    padding never changes an amax).
    """
    r, k = xs.shape
    xf = xs.to(torch.float32)
    a = xf.abs()
    if r % bm:
        a = torch.nn.functional.pad(a, (0, 0, 0, -r % bm))  # [ru(r, bm), K]
    col = a.unflatten(0, (-1, bm)).amax(dim=1)  # [bands, K], NaN-propagating
    if bool(col.isnan().any()):
        col = a.nan_to_num(nan=0.0, posinf=math.inf).unflatten(0, (-1, bm)).amax(dim=1)
    if k % bk:
        col = torch.nn.functional.pad(col, (0, -k % bk))
    amax = col.unflatten(-1, (-1, bk)).amax(dim=-1)  # [bands, K/bk]
    scale = _scale_from_amax(amax, value_for_inf=value_for_inf, pow2=pow2, eps=eps)
    per_elem = scale.repeat_interleave(bk, dim=-1)[:, :k].repeat_interleave(bm, dim=0)[:r]  # [r, K]
    y = xf.mul_(per_elem) if xf.data_ptr() != xs.data_ptr() else xf * per_elem  # fp32(x * scale)
    return bits.e4m3_satfinite(y, inplace=True), _reciprocal(scale)


def quantize_fp8_blockwise(x: torch.Tensor, block: tuple[int, int] = (FP8_BLOCK_SIZE, FP8_BLOCK_SIZE),
                           pow2_scales: bool = False, *, amax_epsilon: float = 0.0,
                           name: str | None = None) -> FP8BlockTensor:
    """E4M3 with one fp32 scale per ``block`` tile of the last two dims (partial edge tiles allowed).

    ``pow2_scales`` = TE Float8BlockQuantizer ``force_pow_2_scales``; ``amax_epsilon`` = its
    ``amax_epsilon``. Leading dims (experts) are independent matrices.
    """
    check_input(x, "FP8 blockwise", min_dim=2, name=name)
    bm, bk = _check_block(block, x, name)
    value_for_inf = torch.finfo(x.dtype).max  # TE: TypeInfo<IType>::max_finite_value
    x = x.detach().contiguous()
    m, k = x.shape[-2], x.shape[-1]
    mb, kb = math.ceil(m / bm), math.ceil(k / bk)
    # Bands of bm rows never cross matrices when m % bm == 0: then all matrices are sliced as one [R, K].
    mats = x.reshape(1, -1, k) if m % bm == 0 else x.reshape(-1, m, k)
    data = torch.empty(mats.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_inv = torch.empty((mats.shape[0], math.ceil(mats.shape[1] / bm), kb), dtype=torch.float32,
                            device=x.device)
    for i, mat in enumerate(mats):
        for s in row_slices(mat.shape[0], k, x.device, multiple=bm, chunk_elems=_CHUNK_ELEMS):
            data[i, s], scale_inv[i, s.start // bm:math.ceil(s.stop / bm)] = _blockwise_rows(
                mat[s], bm, bk, value_for_inf=value_for_inf, pow2=pow2_scales, eps=amax_epsilon)
    return FP8BlockTensor(data=data.view(x.shape), scale_inv=scale_inv.view(*x.shape[:-2], mb, kb),
                          block=(bm, bk))


def dequantize_fp8_blockwise(data: torch.Tensor, scale_inv: torch.Tensor,
                             block: tuple[int, int] = (FP8_BLOCK_SIZE, FP8_BLOCK_SIZE),
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``fp32(q) * scale_inv`` of the q's tile, rounded once to ``dtype`` (DeepSeek ``weight_scale_inv``)."""
    if not isinstance(data, torch.Tensor) or data.dtype not in _FP8_DTYPES:
        got = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise FormatError(f"dequantize_fp8_blockwise: data must be float8_e4m3fn or float8_e5m2, got {got}")
    if data.dim() < 2:
        raise FormatError(f"dequantize_fp8_blockwise: data of shape {tuple(data.shape)} must be 2-D or more")
    bm, bk = _check_block(block, data, None)
    m, k = data.shape[-2], data.shape[-1]
    want = (*data.shape[:-2], math.ceil(m / bm), math.ceil(k / bk))
    if tuple(scale_inv.shape) != want:
        raise FormatError(
            f"dequantize_fp8_blockwise: scale_inv of shape {tuple(scale_inv.shape)} does not match data of shape "
            f"{tuple(data.shape)} with block {(bm, bk)}: expected {want} (ceil(M/{bm}), ceil(K/{bk}))"
        )
    s = scale_inv.to(torch.float32).repeat_interleave(bm, dim=-2).repeat_interleave(bk, dim=-1)
    return (data.to(torch.float32) * s[..., :m, :k]).to(dtype)


def quantize_fp8_tensorwise(x: torch.Tensor, *, amax_epsilon: float = 0.0, pow2_scales: bool = False,
                            name: str | None = None) -> FP8TensorwiseTensor:
    """E4M3 with one fp32 scale for the whole tensor (TE Float8CurrentScaling: scale = 448 / amax)."""
    check_input(x, "FP8 tensorwise", min_dim=1, name=name)
    xf = x.contiguous().to(torch.float32)
    amax = bits.nan_ignoring_abs(xf).amax()
    scale = _scale_from_amax(amax, value_for_inf=bits.FP32_MAX, pow2=pow2_scales, eps=amax_epsilon)
    data = bits.e4m3_satfinite(xf * scale, inplace=True)
    return FP8TensorwiseTensor(data=data, scale_inv=_reciprocal(scale))
