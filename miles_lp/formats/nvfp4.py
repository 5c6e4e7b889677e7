"""NVFP4: E2M1 elements, one E4M3 scale per 16 along K, one fp32 global scale (CONTRACT 2), TE's rule.

Order of fp32 operations (TE ``transformer_engine/common/cast/nvfp4/core_nvfp4.cuh``:
``compute_global_encode_scaling_factor_FP4`` and ``compute_decoding_scaling_factor``;
``cast/nvfp4/quantize_transpose_nvfp4.cuh`` and ``specialized/quantize_transpose_nvfp4_tuned_1D.cuh``:
``block_scale_inverse`` / ``compute_nvfp4_scaling_coefficient<float>``)::

    S_enc = fp32(2688 / amax_g); S_enc = fminf(S_enc, FLT_MAX); if amax_g == 0 or S_enc == 0: S_enc = 1
    S_dec = fp32(1 / S_enc)
    sf    = e4m3_rne_satfinite(fp32(amax_b * fp32(S_enc * fp32(1/6))))
    enc   = fminf(fp32(1 / fp32(float(sf) * S_dec)), FLT_MAX)          # sf == 0 -> 1/0 = inf -> FLT_MAX
    q     = cvt.rn.satfinite.e2m1(fp32(x * enc))                          # NaN -> +6, |.| > 6 -> 6

``amax_b`` and ``amax_g`` ignore NaN (``fmaxf`` / ``max.xorsign.abs``); ``fminf`` also maps a NaN S_enc
(a NaN amax passed by the caller) to FLT_MAX. One consequence worth knowing: a block whose scale
rounds to 0 gets ``enc = FLT_MAX`` and its non-zero elements saturate to +-6 (they decode to 0 anyway).

TE keeps ``amax`` and builds the GEMM alpha as ``amax_a * amax_b * fp32(1/(6*6*448*448))``
(``recipe/nvfp4.cu``) and dequantizes with ``sf * amax * fp32(1/2688)`` (``dequantize_nvfp4.cuh``);
we store the decode scale ``S_dec`` (ModelOpt's ``weight_scale_2``) as ``global_scale`` and keep ``amax``
beside it, so both conventions can be reproduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from miles_lp.errors import FormatError
from miles_lp.formats import bits
from miles_lp.formats._checks import check_input, check_multiple, what
from miles_lp.formats.spec import NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR, Format

Scope = Literal["tensor", "row"]
_SCOPES = ("tensor", "row")
FP32_2688_BITS = bits.f32_bits(NVFP4_GLOBAL_DIVISOR)  # 2688.0 is exact in fp32


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """NVFP4 payload, compact layout (CONTRACT 3).

    ``data``: uint8 ``[..., K/2]`` (two E2M1 codes per byte, even element in the low nibble).
    ``scale``: float8_e4m3fn ``[..., K/16]``. ``global_scale``: fp32 decode scale ``S_dec = 1/S_enc``
    (0-d for a 2-D tensor with scope "tensor", ``[..., 1, 1]`` with leading dims, ``[..., rows, 1]``
    for scope "row"). ``amax``: the global amax the scales were derived from (same shape).
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    amax: torch.Tensor
    logical_shape: tuple[int, ...]
    scale_scope: Scope = "tensor"
    block_2d: bool = False
    format: ClassVar[Format] = Format.NVFP4

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.logical_shape)

    def components(self) -> dict[str, torch.Tensor]:
        return {"data": self.data, "scale": self.scale, "global_scale": self.global_scale}

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """fp32(e2m1(q) * float(sf)) (exact) * S_dec, rounded once to ``dtype``."""
        codes = bits.unpack_fp4(self.data).to(torch.int64)  # [..., K]
        vals = bits.e2m1_table(self.data.device)[codes]
        sf = self.scale.to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=-1)  # [..., K]
        return ((vals * sf) * self.global_scale).to(dtype)  # global_scale broadcasts: 0-d / [..,1,1] / [..,R,1]


def _global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = fminf(fp32(2688 / amax), FLT_MAX); 1 when amax == 0 or S_enc == 0 (amax = inf)."""
    s = torch.div(bits.fp32_scalar(FP32_2688_BITS, amax.device), amax)
    s = torch.fmin(s, bits.fp32_scalar(bits.FP32_MAX_BITS, amax.device))  # also NaN -> FLT_MAX (fminf)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _matrix_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax over the last two dims: [..., 1, 1] fp32."""
    return bits.nan_ignoring_abs(x).amax(dim=(-2, -1), keepdim=True).to(torch.float32)


def _row_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax per row: [..., rows, 1] fp32."""
    return bits.nan_ignoring_abs(x).amax(dim=-1, keepdim=True).to(torch.float32)


def _check_nvfp4(x: torch.Tensor, scope: str, block_2d: bool, name: str | None) -> None:
    check_input(x, "NVFP4", min_dim=2, name=name)
    if scope not in _SCOPES:
        raise FormatError(f"NVFP4: scale_scope={scope!r} is not one of {_SCOPES} ({what(name, x)})")
    check_multiple(x, "NVFP4", -1, NVFP4_BLOCK, name=name, axis_label="K (axis=-1, 16-blocks)")
    if block_2d:
        if scope == "row":
            raise FormatError(
                f"NVFP4: {what(name, x)}: block_2d=True cannot be combined with scale_scope='row' "
                "(TE refuses row-scaled 2D quantization); 2D tiles are for weights, use scope 'tensor'"
            )
        check_multiple(x, "NVFP4 block_2d", -2, NVFP4_BLOCK, name=name,
                       axis_label="rows (axis=-2, 16x16 tiles)")


def _broadcast_amax(amax, x: torch.Tensor, scope: str, name: str | None) -> torch.Tensor:
    """Caller-provided global amax -> fp32 [..., 1, 1] (tensor scope) or [..., rows, 1] (row scope)."""
    a = torch.as_tensor(amax, dtype=torch.float32, device=x.device)
    target = (*x.shape[:-2], 1, 1) if scope == "tensor" else (*x.shape[:-1], 1)
    try:
        a = torch.broadcast_to(a, target)
    except RuntimeError as exc:
        raise FormatError(
            f"NVFP4: amax of shape {tuple(a.shape)} does not broadcast to {target}, the global-scale shape of "
            f"{what(name, x)} with scale_scope={scope!r}"
        ) from exc
    if bool((a < 0).any()):
        raise FormatError(f"NVFP4: amax passed for {what(name, x)} has negative entries; an amax is |x|'s max")
    return a.contiguous()


def quantize_nvfp4(x: torch.Tensor, *, scale_scope: Scope = "tensor", amax=None, block_2d: bool = False,
                   name: str | None = None) -> NVFP4Tensor:
    """Quantize ``x`` [..., rows, K] to NVFP4 with TE's rule (CONTRACT 2).

    ``scale_scope="tensor"``: one global amax per 2-D matrix (each expert of an [E, N, K] stack has its
    own); ``"row"``: one per row (per-token activations: a row's bytes do not depend on the batch).
    ``amax``: the global amax to use instead (broadcastable to the global-scale shape), e.g. the max over
    gate and up so that both share one global scale. ``block_2d=True``: 16x16 tile amax (weights), the
    tile's scale repeated over its 16 rows; rows must be a multiple of 16.
    """
    _check_nvfp4(x, scale_scope, block_2d, name)
    x = x.contiguous()
    if amax is None:
        amax_g = _matrix_amax(x) if scale_scope == "tensor" else _row_amax(x)
    else:
        amax_g = _broadcast_amax(amax, x, scale_scope, name)
    s_enc = _global_encode_scale(amax_g)  # [..., 1, 1] or [..., rows, 1]
    s_dec = torch.div(bits.fp32_scalar(bits.f32_bits(1.0), x.device), s_enc)

    k = x.shape[-1]
    xb = x.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK)).to(torch.float32)  # [..., rows, K/16, 16]
    amax_b = bits.nan_ignoring_abs(xb).amax(dim=-1)  # [..., rows, K/16]
    if block_2d:
        rows = x.shape[-2]
        tiles = amax_b.unflatten(-2, (rows // NVFP4_BLOCK, NVFP4_BLOCK))  # [..., rows/16, 16, K/16]
        amax_b = tiles.amax(dim=-2, keepdim=True).expand_as(tiles).flatten(-3, -2)  # [..., rows, K/16]
    sf_scale = s_enc * bits.fp32_scalar(bits.FP32_INV_6_BITS, x.device)  # fp32(S_enc * fp32(1/6))
    sf = bits.e4m3_satfinite(amax_b * sf_scale)  # [..., rows, K/16] e4m3 (inf -> 448: fminf then cast)
    enc = torch.div(bits.fp32_scalar(bits.f32_bits(1.0), x.device), sf.to(torch.float32) * s_dec)
    enc = torch.fmin(enc, bits.fp32_scalar(bits.FP32_MAX_BITS, x.device))  # sf == 0 -> FLT_MAX
    codes = bits.e2m1_codes(xb * enc.unsqueeze(-1)).flatten(-2)  # [..., rows, K]
    data = bits.pack_fp4(codes)  # [..., rows, K/2]

    if scale_scope == "tensor" and x.dim() == 2:
        s_dec, amax_g = s_dec.reshape(()), amax_g.reshape(())
    return NVFP4Tensor(data=data, scale=sf, global_scale=s_dec, amax=amax_g, logical_shape=tuple(x.shape),
                       scale_scope=scale_scope, block_2d=block_2d)


def nvfp4_global_amax(*tensors: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax per 2-D matrix, max over all ``tensors`` (the shared scope of gate and up).

    Returns fp32, 0-d for 2-D inputs, ``[..., 1, 1]`` for stacks; all tensors need the same leading dims.
    """
    if not tensors:
        raise FormatError("nvfp4_global_amax: pass at least one tensor")
    for t in tensors:
        check_input(t, "NVFP4", min_dim=2)
    lead = {tuple(t.shape[:-2]) for t in tensors}
    if len(lead) != 1:
        raise FormatError(
            "nvfp4_global_amax: the tensors must share their leading (expert) dims to share per-matrix global "
            f"scales, got shapes {[tuple(t.shape) for t in tensors]}"
        )
    amax = _matrix_amax(tensors[0])
    for t in tensors[1:]:
        amax = torch.maximum(amax, _matrix_amax(t).to(amax.device))
    return amax.reshape(()) if tensors[0].dim() == 2 else amax


def quantize_nvfp4_pair(gate: torch.Tensor, up: torch.Tensor, **kw) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Quantize the gate and up projections with ONE global amax (max over both; CONTRACT 2, SwiGLU).

    The result equals quantizing the fused ``cat([gate, up], dim=-2)`` and splitting it. Accepts the
    keyword arguments of ``quantize_nvfp4`` except ``amax`` and ``scale_scope="row"`` (a per-row scale is
    never shared between two tensors, so there is nothing to pair).
    """
    if "amax" in kw:
        raise FormatError("quantize_nvfp4_pair computes the shared amax itself; do not pass amax=")
    if kw.get("scale_scope", "tensor") != "tensor":
        raise FormatError(
            f"quantize_nvfp4_pair: scale_scope={kw['scale_scope']!r} has no shared scale; quantize gate and up "
            "separately with quantize_nvfp4 (scope 'row' quantizes each row alone)"
        )
    amax = nvfp4_global_amax(gate, up)
    return quantize_nvfp4(gate, amax=amax, **kw), quantize_nvfp4(up, amax=amax, **kw)
