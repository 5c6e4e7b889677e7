"""MXFP8: E4M3 elements, one E8M0 scale per 32 along the reduction dim (CONTRACT 1), TE's rule bit for bit.

The rule, per block of 32 (source: TE ``transformer_engine/common/cast/mxfp8/quantize_mxfp8.cuh``,
``ptx::float_to_e8m0`` in ``util/ptx_arch_spec.cuh``, ``ptx::exp2f_rcp`` / ``mul_cvt_2x`` in
``util/ptx.cuh``):

1. ``amax = max |x_i|`` with ``fmaxf`` / ``max.xorsign.abs`` semantics: NaN elements are ignored (a block
   of only NaN has amax 0); an inf element makes amax inf.
2. ``v = fp32(amax * fp32(1/448))`` (``Quantized_Limits<fp8e4m3>::max_norm_rcp``, 0x3B124925).
3. ``e = float_to_e8m0(v)`` (round up to a power of two; inf -> 0xFE).
4. ``inv = exp2f_rcp(e)`` = 2^(127-e) as fp32 (2^-127 subnormal for e = 254).
5. ``q_i = cvt.rn.satfinite.e4m3(fp32(x_i * inv))``: RNE, saturation to +-448, NaN -> 0x7F.

Consequences for special values (what TE does, asserted in the tests):

* a NaN element becomes 0x7F and does not affect its block's scale;
* a block of only NaN gets scale byte 0x00 and all elements 0x7F;
* a block holding +-inf gets scale 0xFE (2^127): inf -> +-448 (0x7E / 0xFE), finite elements are
  multiplied by 2^-127 and mostly become (signed) zero.

torchao's ``to_mx(..., scaling_mode=RCEIL)`` matches byte for byte on finite input but propagates NaN
through ``torch.amax`` (scale 0xFF and all-NaN elements for a block with one NaN).

Signed zero: we keep the sign (-0.0 -> 0x80) as TE's generic kernel (``mul.f32x2`` then ``cvt``) does.
TE's specialised bf16 rowwise cast-only kernel (``cast/mxfp8/specialized/quantize_mxfp8.cuh`` via
``ptx::mul_cvt_4x``) computes ``fma(x, s, +0.0)``, which turns -0.0 into +0.0 (0x00); both decode to 0.
"""

from __future__ import annotations

import torch

from miles_lp.errors import FormatError
from miles_lp.formats import bits, native
from miles_lp.formats._checks import check_input, check_multiple
from miles_lp.formats._chunks import CHUNK_ELEMS, row_slices
from miles_lp.formats._compile import compile_exact
from miles_lp.formats.spec import MXFP8_BLOCK
from miles_lp.formats.tensors import MXFP8Tensor

_ROWS_PER_CHUNK_ELEMS = CHUNK_ELEMS  # eager CPU path: elements per slice (tests lower it to force slices)


def _mxfp8_blocks(xb: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``xb`` whose blocks of 32 run along ``dim`` (a dim of size 32). Returns (q, e keepdim).

    Pure tensor ops, no Python loop over blocks; the same function runs eager and under torch.compile.
    """
    xf = xb.to(torch.float32)  # exact upcast (a no-op view for fp32 input: never written in place)
    amax = bits.nan_ignoring_abs(xf).amax(dim=dim, keepdim=True)  # [..., 1 at dim]
    v = amax * bits.fp32_scalar(bits.FP32_INV_448_BITS, xb.device)  # fp32(amax * fp32(1/448))
    e = bits.e8m0_round_up(v)
    inv = bits.e8m0_inverse(e)
    q = bits.e4m3_satfinite(xf * inv, inplace=True)  # fp32(x * 2^(127-e)), RNE, satfinite
    return q, e


def _rowwise_core(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (data [..., K] e4m3, scale [..., K/32] uint8)."""
    k = x.shape[-1]
    q, e = _mxfp8_blocks(x.unflatten(-1, (k // MXFP8_BLOCK, MXFP8_BLOCK)), -1)  # [..., K/32, 32]
    return q.flatten(-2), e.squeeze(-1)


def _colwise_core(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., M, K] -> (data [..., M, K] e4m3, scale [..., M/32, K] uint8)."""
    m = x.shape[-2]
    q, e = _mxfp8_blocks(x.unflatten(-2, (m // MXFP8_BLOCK, MXFP8_BLOCK)), -2)  # [..., M/32, 32, K]
    return q.flatten(-3, -2), e.squeeze(-2)


def mxfp8_core(x: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP8 rule on a whole tensor: ``x`` [..., M, K] -> ``(data e4m3, scale uint8 E8M0)``.

    ``axis=-1``: 1x32 blocks along K, scale ``[..., K/32]``; ``axis=-2``: 32x1 blocks along M, scale
    ``[..., M/32, K]``. No validation (``quantize_mxfp8`` checks first), no slicing, no data-dependent
    Python control flow: ``quantize_mxfp8`` runs it eagerly on row slices, ``compile=True`` and
    ``miles_lp.train.fused`` run it under ``torch.compile``; the bytes are the same.
    """
    return _rowwise_core(x) if axis == -1 else _colwise_core(x)


def _chunked(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``mxfp8_core`` over slices of whole rows (``row_slices``) so that the temporaries stay cache-sized.

    Each block lies entirely inside one slice, so the bytes equal one call on the whole tensor.
    """
    if axis == -1:
        flat = x.reshape(-1, x.shape[-1])  # [R, K]
        slices = row_slices(flat.shape[0], x.shape[-1], x.device, chunk_elems=_ROWS_PER_CHUNK_ELEMS)
        if len(slices) == 1:
            return mxfp8_core(x, -1)
        data = torch.empty(flat.shape, dtype=torch.float8_e4m3fn)
        scale = torch.empty((flat.shape[0], x.shape[-1] // MXFP8_BLOCK), dtype=torch.uint8)
        for s in slices:
            data[s], scale[s] = mxfp8_core(flat[s], -1)
        return data.view(x.shape), scale.view(*x.shape[:-1], -1)
    m, k = x.shape[-2], x.shape[-1]
    if x.numel() <= _ROWS_PER_CHUNK_ELEMS or x.device.type != "cpu":
        return mxfp8_core(x, -2)
    slices = row_slices(m, k, x.device, multiple=MXFP8_BLOCK, chunk_elems=_ROWS_PER_CHUNK_ELEMS)
    flat = x.reshape(-1, m, k)  # [B, M, K]
    data = torch.empty(flat.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty((flat.shape[0], m // MXFP8_BLOCK, k), dtype=torch.uint8)
    for b in range(flat.shape[0]):
        for s in slices:
            sb = slice(s.start // MXFP8_BLOCK, s.stop // MXFP8_BLOCK)
            data[b, s], scale[b, sb] = mxfp8_core(flat[b, s], -2)
    return data.view(x.shape), scale.view(*x.shape[:-2], m // MXFP8_BLOCK, k)


_COMPILED: dict[int, object] = {}


def _compiled_core(axis: int):
    """``mxfp8_core`` for one axis under ``torch.compile`` with the exact (no flush-to-zero) Inductor options
    that ``miles_lp.train.fused`` uses (``_compile.compile_exact``): the inverse scale 2^-127 is an fp32
    subnormal. Built lazily, once per axis."""
    if axis not in _COMPILED:
        _COMPILED[axis] = compile_exact(_rowwise_core if axis == -1 else _colwise_core)
    return _COMPILED[axis]


def _normalize_axis(x: torch.Tensor, axis: int, name: str | None) -> int:
    if axis in (-1, x.dim() - 1):
        return -1
    if axis in (-2, x.dim() - 2) and x.dim() >= 2:
        return -2
    raise FormatError(
        f"MXFP8: axis={axis} is not supported for a tensor of shape {tuple(x.shape)}"
        f"{f' ({name!r})' if name else ''}; use axis=-1 (rowwise, 1x32 blocks along K) or axis=-2 "
        "(columnwise, 32x1 blocks along M)"
    )


def quantize_mxfp8(x: torch.Tensor, *, axis: int = -1, compile: bool = False,
                   name: str | None = None) -> MXFP8Tensor:
    """Quantize ``x`` [..., M, K] to MXFP8 with TE's rule (CONTRACT 1), rowwise or columnwise.

    ``axis=-1``: blocks of 32 along K (forward GEMM operand), scale ``[..., K/32]``.
    ``axis=-2``: blocks of 32 along M (backward operand), scale ``[..., M/32, K]``; quantized from the
    full-precision input, not from the rowwise result (the two grids differ).
    ``compile=True`` runs the same function under ``torch.compile`` (identical bytes, faster on large
    tensors after a one-time compile). ``name`` is only used in error messages.
    Raises ``FormatError`` for non-float input, empty tensors and a block dim not a multiple of 32.
    """
    check_input(x, "MXFP8", min_dim=1, name=name)
    axis = _normalize_axis(x, axis, name)
    check_multiple(x, "MXFP8", axis, MXFP8_BLOCK, name=name,
                   axis_label=f"axis={axis} ({'rowwise' if axis == -1 else 'columnwise'} 32-blocks)")
    x = x.contiguous()
    if x.is_cuda:  # CUDA + Triton: the kernel, same bytes (formats.kernels; runtime.kernels: reference: off)
        from miles_lp.formats import kernels
        if kernels.enabled(x):
            return kernels.quantize_mxfp8(x, axis, name)
    if compile:
        data, scale = _compiled_core(axis)(x)
    elif axis == -1 and native.usable(x):  # CPU: the fused kernel, same bytes (formats.native)
        data, scale = native.mxfp8_rowwise(x.detach())
    else:
        data, scale = _chunked(x, axis)
    return MXFP8Tensor(data=data, scale=scale, axis=axis)


def quantize_mxfp8_compiled(x: torch.Tensor, *, axis: int = -1, name: str | None = None) -> MXFP8Tensor:
    """``quantize_mxfp8(x, axis=axis, compile=True)``: same bytes, torch.compile'd core."""
    return quantize_mxfp8(x, axis=axis, compile=True, name=name)
