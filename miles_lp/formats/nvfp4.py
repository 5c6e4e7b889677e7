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
from miles_lp.formats._chunks import row_slices
from miles_lp.formats.spec import NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR, Format

Scope = Literal["tensor", "row"]
_SCOPES = ("tensor", "row")
FP32_2688_BITS = bits.f32_bits(NVFP4_GLOBAL_DIVISOR)  # 2688.0 is exact in fp32
_CHUNK_ELEMS = 1 << 18  # eager CPU slice (elements); measured best for NVFP4 (tests lower it to force slices)


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


def _block_amax_rows(x2: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax of each 1x16 block of ``x2`` [r, K]: [r, K/16] fp32.

    ``max_pool1d`` over |x| is the fast reduction on CPU (a plain ``amax`` over a last dim of 16 is ~3x
    slower); it propagates NaN, so a slice holding NaN is redone with the NaN-ignoring form (CUDA fmaxf).
    """
    xf = x2.to(torch.float32)
    amax_b = torch.nn.functional.max_pool1d(xf.abs().unsqueeze(0), NVFP4_BLOCK, NVFP4_BLOCK).squeeze(0)
    if bool(amax_b.isnan().any()):
        amax_b = bits.nan_ignoring_abs(xf.unflatten(-1, (-1, NVFP4_BLOCK))).amax(dim=-1)
    return amax_b


def _matrix_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax over the last two dims: [..., 1, 1] fp32 (row maxima slice by slice, then their max)."""
    x2 = x.detach().reshape(-1, x.shape[-1])  # [R, K]
    row_max = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    for s in row_slices(x2.shape[0], x2.shape[1], x.device, chunk_elems=_CHUNK_ELEMS):
        m = x2[s].abs().amax(dim=-1)  # NaN-propagating; exact in the input dtype
        if bool(m.isnan().any()):
            m = bits.nan_ignoring_abs(x2[s]).amax(dim=-1)
        row_max[s] = m
    return row_max.view(x.shape[:-1]).amax(dim=-1, keepdim=True).unsqueeze(-1)


def _tile_amax(amax_b: torch.Tensor) -> torch.Tensor:
    """[r, K/16] block amax -> 16x16 tile amax repeated over the tile's 16 rows (r a multiple of 16)."""
    tiles = amax_b.unflatten(-2, (-1, NVFP4_BLOCK))  # [r/16, 16, K/16]
    return tiles.amax(dim=-2, keepdim=True).expand_as(tiles).flatten(-3, -2)


def _block_amax(x2: torch.Tensor, slices: list[slice], block_2d: bool) -> torch.Tensor:
    """Block (or 16x16 tile) amax of every row of ``x2`` [R, K], slice by slice: [R, K/16] fp32."""
    out = torch.empty((x2.shape[0], x2.shape[1] // NVFP4_BLOCK), dtype=torch.float32, device=x2.device)
    for s in slices:
        ab = _block_amax_rows(x2[s])
        out[s] = _tile_amax(ab) if block_2d else ab
    return out


def _encode_rows(x2: torch.Tensor, amax_b: torch.Tensor, sf_scale: torch.Tensor,
                 s_dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [r, K] with their block amax [r, K/16] and per-row fp32(S_enc * fp32(1/6)), S_dec [r, 1]
    -> (data [r, K/2] uint8, scale [r, K/16] e4m3)."""
    one = bits.fp32_scalar(bits.f32_bits(1.0), x2.device)
    sf = bits.e4m3_satfinite(amax_b * sf_scale)  # [r, K/16] e4m3 (inf -> 448: fminf then cast)
    enc = torch.div(one, sf.to(torch.float32) * s_dec)
    enc = torch.fmin(enc, bits.fp32_scalar(bits.FP32_MAX_BITS, x2.device))  # sf == 0 -> FLT_MAX
    y = x2.unflatten(-1, (-1, NVFP4_BLOCK)) * enc.unsqueeze(-1)  # fp32(x * enc): [r, K/16, 16] fp32
    return bits.pack_fp4(bits.e2m1_codes(y.flatten(-2))), sf


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
    x = x.detach().contiguous()
    lead, rows, k = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    x2 = x.reshape(-1, k)  # [R, K], R = rows of every matrix
    slices = row_slices(x2.shape[0], k, x.device, multiple=NVFP4_BLOCK if block_2d else 1,
                        chunk_elems=_CHUNK_ELEMS)
    amax_b = None
    if amax is None:  # pass 1: block amax of every row; the global amax is their max (NaN ignored by both)
        amax_b = _block_amax(x2, slices, block_2d)  # [R, K/16]
        ab = amax_b.view(*lead, rows, k // NVFP4_BLOCK)
        amax_g = ab.amax(dim=(-2, -1), keepdim=True) if scale_scope == "tensor" else ab.amax(dim=-1, keepdim=True)
    else:
        amax_g = _broadcast_amax(amax, x, scale_scope, name)
    s_enc = _global_encode_scale(amax_g)  # [..., 1, 1] or [..., rows, 1]
    s_dec = torch.div(bits.fp32_scalar(bits.f32_bits(1.0), x.device), s_enc)
    sf_scale = s_enc * bits.fp32_scalar(bits.FP32_INV_6_BITS, x.device)  # fp32(S_enc * fp32(1/6))
    per_row = (*lead, rows, 1)
    sf_scale_r, s_dec_r = (t.expand(per_row).reshape(-1, 1) for t in (sf_scale, s_dec))  # [R, 1]

    data = torch.empty((x2.shape[0], k // 2), dtype=torch.uint8, device=x.device)
    sf = torch.empty((x2.shape[0], k // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
    for s in slices:  # pass 2 (the only pass when amax is given): scales and codes, slice by slice
        if amax_b is None:
            ab = _block_amax_rows(x2[s])
            ab = _tile_amax(ab) if block_2d else ab
        else:
            ab = amax_b[s]
        data[s], sf[s] = _encode_rows(x2[s], ab, sf_scale_r[s], s_dec_r[s])

    if scale_scope == "tensor" and x.dim() == 2:
        s_dec, amax_g = s_dec.reshape(()), amax_g.reshape(())
    return NVFP4Tensor(data=data.view(*lead, rows, k // 2), scale=sf.view(*lead, rows, k // NVFP4_BLOCK),
                       global_scale=s_dec, amax=amax_g, logical_shape=tuple(x.shape),
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
