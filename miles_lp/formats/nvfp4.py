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

import torch

from miles_lp.errors import FormatError
from miles_lp.formats import bits, native
from miles_lp.formats._checks import NVFP4_SCOPES, check_input, check_nvfp4, what
from miles_lp.formats._chunks import row_slices
from miles_lp.formats.spec import NVFP4_BLOCK, NVFP4_GLOBAL_DIVISOR
from miles_lp.formats.tensors import NVFP4Tensor, Scope

_SCOPES = NVFP4_SCOPES
FP32_2688_BITS = bits.f32_bits(NVFP4_GLOBAL_DIVISOR)  # 2688.0 is exact in fp32
_CHUNK_ELEMS = 1 << 18  # eager CPU slice (elements); measured best for NVFP4 (tests lower it to force slices)


def _global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = fminf(fp32(2688 / amax), FLT_MAX); 1 when amax == 0 or S_enc == 0 (amax = inf)."""
    s = torch.div(bits.fp32_scalar(FP32_2688_BITS, amax.device), amax)
    s = torch.fmin(s, bits.fp32_scalar(bits.FP32_MAX_BITS, amax.device))  # also NaN -> FLT_MAX (fminf)
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def _matrix_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax over the last two dims: [..., 1, 1] fp32 (row maxima slice by slice, then their max)."""
    x2 = x.detach().reshape(-1, x.shape[-1])  # [R, K]
    if native.usable(x2):  # CPU: one pass, NaN ignored (formats.native)
        return native.row_amax(x2.contiguous()).view(x.shape[:-1]).amax(dim=-1, keepdim=True).unsqueeze(-1)
    row_max = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    for s in row_slices(x2.shape[0], x2.shape[1], x.device, chunk_elems=_CHUNK_ELEMS):
        m = x2[s].abs().amax(dim=-1)  # NaN-propagating; exact in the input dtype
        if bool(m.isnan().any()):  # eager only (never traced): the NaN-ignoring form for this slice
            m = bits.nan_ignoring_abs(x2[s]).amax(dim=-1)
        row_max[s] = m
    return row_max.view(x.shape[:-1]).amax(dim=-1, keepdim=True).unsqueeze(-1)


def nvfp4_block_amax(x: torch.Tensor, block_2d: bool = False) -> torch.Tensor:
    """NaN-ignoring amax of each 1x16 block of ``x`` [..., rows, K]: [..., rows, K/16] fp32.

    ``block_2d``: the amax of each 16x16 tile instead, repeated over the tile's 16 rows (rows a multiple
    of 16). NaN is zeroed before the reduction (CUDA ``fmaxf`` ignores it; inf is kept), so there is no
    data-dependent branch; ``max_pool1d`` over the blocks is the fast reduction on CPU (a plain ``amax``
    over a last dim of 16 is ~2x slower) and compiles (max is exact, so both forms give the same bits).
    """
    k = x.shape[-1]
    a = bits.nan_ignoring_abs(x.to(torch.float32))  # |x|, NaN -> 0: [..., rows, K] fp32
    amax_b = torch.nn.functional.max_pool1d(a.reshape(1, -1, k), NVFP4_BLOCK, NVFP4_BLOCK)  # [1, R, K/16]
    amax_b = amax_b.reshape(*x.shape[:-1], k // NVFP4_BLOCK)
    if block_2d:
        tiles = amax_b.unflatten(-2, (-1, NVFP4_BLOCK))  # [..., rows/16, 16, K/16]
        amax_b = tiles.amax(dim=-2, keepdim=True).expand_as(tiles).flatten(-3, -2)
    return amax_b


def _scales(amax_g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global amax -> (S_dec = fp32(1 / S_enc), fp32(S_enc * fp32(1/6))), same shape."""
    s_enc = _global_encode_scale(amax_g)
    s_dec = torch.div(bits.fp32_scalar(bits.f32_bits(1.0), amax_g.device), s_enc)
    return s_dec, s_enc * bits.fp32_scalar(bits.FP32_INV_6_BITS, amax_g.device)


def nvfp4_core(x: torch.Tensor, amax_g: torch.Tensor | None = None, scope: Scope = "tensor",
               block_2d: bool = False, *, amax_b: torch.Tensor | None = None,
               scales: tuple[torch.Tensor, torch.Tensor] | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The NVFP4 rule on a whole tensor: ``x`` [..., rows, K] -> ``(data, scale, global_scale, amax)``.

    Shapes and dtypes as ``NVFP4Tensor``: data uint8 [..., rows, K/2], scale e4m3 [..., rows, K/16],
    global_scale (S_dec) and amax fp32 of the global-scale shape: ``[..., 1, 1]`` for scope "tensor"
    (0-d for a 2-D ``x``), ``[..., rows, 1]`` for scope "row". ``amax_g``: None (computed, NaN ignored)
    or an fp32 tensor already of the global-scale shape (``quantize_nvfp4`` validates and broadcasts it);
    ``amax_b``: the block amax (``nvfp4_block_amax``) when the caller has it already; ``scales``:
    ``_scales(amax_g)`` likewise (the eager slices: a dozen tiny ops per slice saved, ~5% on CPU).

    No validation, no slicing, no data-dependent Python control flow (only ``scope`` / ``block_2d`` /
    ``None`` choose the graph): ``quantize_nvfp4`` runs it eagerly on row slices and
    ``miles_lp.train.fused`` runs it under ``torch.compile``; the bytes are the same.
    """
    k = x.shape[-1]
    if amax_b is None:
        amax_b = nvfp4_block_amax(x, block_2d)  # [..., rows, K/16]
    if amax_g is None:  # the global amax is the max of the block amaxes (NaN already ignored)
        amax_g = amax_b.amax(dim=(-2, -1), keepdim=True) if scope == "tensor" else amax_b.amax(dim=-1, keepdim=True)
    s_dec, sf_scale = _scales(amax_g) if scales is None else scales  # [..., 1, 1] or [..., rows, 1]: broadcast
    sf = bits.e4m3_satfinite(amax_b * sf_scale, inplace=True)  # e4m3 (inf -> 448: clamp then cast)
    enc = torch.div(bits.fp32_scalar(bits.f32_bits(1.0), x.device), sf.to(torch.float32) * s_dec)
    enc = torch.fmin(enc, bits.fp32_scalar(bits.FP32_MAX_BITS, x.device))  # sf == 0 -> FLT_MAX
    y = x.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK)) * enc.unsqueeze(-1)  # fp32(x * enc), [..., K/16, 16]
    data = bits.pack_fp4(bits.e2m1_codes(y.flatten(-2)))
    if scope == "tensor" and x.dim() == 2:
        s_dec, amax_g = s_dec.reshape(()), amax_g.reshape(())
    return data, sf, s_dec, amax_g


_check_nvfp4 = check_nvfp4  # (the name the codec calls it by)


def broadcast_nvfp4_amax(amax, x: torch.Tensor, scope: str, name: str | None = None) -> torch.Tensor:
    """Caller-provided global amax -> fp32 [..., 1, 1] (tensor scope) or [..., rows, 1] (row scope), the
    ``amax_g`` that ``nvfp4_core`` takes. Checks its shape and sign (eager: reads the values)."""
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


_broadcast_amax = broadcast_nvfp4_amax  # older private name


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
    if amax is not None:
        amax = broadcast_nvfp4_amax(amax, x, scale_scope, name)  # [..., 1, 1] or [..., rows, 1] fp32
    if x.is_cuda:  # CUDA + Triton: the kernels, same bytes (formats.kernels; runtime.kernels: reference: off)
        from miles_lp.formats import kernels
        if kernels.enabled(x):
            return kernels.quantize_nvfp4(x, scale_scope, amax, block_2d, name)
    lead, rows, k = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    x2 = x.reshape(-1, k)  # [R, K], R = rows of every matrix
    if native.usable(x2):  # CPU: the fused kernel, same bytes (formats.native)
        return _quantize_native(x, x2, amax, scale_scope, block_2d)
    slices = row_slices(x2.shape[0], k, x.device, multiple=NVFP4_BLOCK if block_2d else 1,
                        chunk_elems=_CHUNK_ELEMS)
    if len(slices) == 1:
        data, sf, s_dec, amax_g = nvfp4_core(x, amax, scale_scope, block_2d)
    else:  # CPU: the core on slices of whole rows (of 16-row tiles for block_2d), so temporaries stay cache-sized
        data = torch.empty((x2.shape[0], k // 2), dtype=torch.uint8, device=x.device)
        sf = torch.empty((x2.shape[0], k // NVFP4_BLOCK), dtype=torch.float8_e4m3fn, device=x.device)
        if amax is None and scale_scope == "row":  # one pass: a row's global amax is the max of its blocks
            s_dec = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
            amax_g = torch.empty_like(s_dec)
            for s in slices:
                data[s], sf[s], s_dec[s], amax_g[s] = nvfp4_core(x2[s], None, "row")
            s_dec, amax_g = s_dec.view(*lead, rows, 1), amax_g.view(*lead, rows, 1)
        else:
            amax_b = None
            if amax is not None:
                amax_g = amax
            else:  # pass 1: block amax of every row (kept for pass 2); the global amax is their max per matrix
                amax_b = torch.cat([nvfp4_block_amax(x2[s], block_2d) for s in slices])  # [R, K/16]
                amax_g = amax_b.view(*lead, rows, k // NVFP4_BLOCK).amax(dim=(-2, -1), keepdim=True)
            s_dec, sf_scale = _scales(amax_g)  # the core's elementwise ops, once, at the global-scale shape
            amax_r, s_dec_r, sf_scale_r = (t.expand(*lead, rows, 1).reshape(-1, 1) for t in (amax_g, s_dec, sf_scale))
            for s in slices:  # pass 2 (the only pass with a given amax): scales and codes
                ab = None if amax_b is None else amax_b[s]
                data[s], sf[s], _, _ = nvfp4_core(x2[s], amax_r[s], "row", block_2d, amax_b=ab,
                                                  scales=(s_dec_r[s], sf_scale_r[s]))
            if scale_scope == "tensor" and x.dim() == 2:
                s_dec, amax_g = s_dec.reshape(()), amax_g.reshape(())
    return NVFP4Tensor(data=data.view(*lead, rows, k // 2), scale=sf.view(*lead, rows, k // NVFP4_BLOCK),
                       global_scale=s_dec, amax=amax_g, logical_shape=tuple(x.shape),
                       scale_scope=scale_scope, block_2d=block_2d)


def _quantize_native(x: torch.Tensor, x2: torch.Tensor, amax: torch.Tensor | None, scope: Scope,
                     block_2d: bool) -> NVFP4Tensor:
    """``quantize_nvfp4`` on CPU with ``formats.native``: the global amax from the block (or row) amax,
    ``_scales`` at the global-scale shape as the eager path, then one fused pass for scales and codes.
    The block amax array is only built when it is needed (2D tiles, or the amax of a tensor scope)."""
    lead, rows, k = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    amax_b = None
    if block_2d:  # the 16x16 tile amax repeated over its rows, as nvfp4_block_amax
        tiles = native.block_amax16(x2).view(*lead, rows // NVFP4_BLOCK, NVFP4_BLOCK, k // NVFP4_BLOCK)
        amax_b = tiles.amax(dim=-2, keepdim=True).expand_as(tiles).reshape(-1, k // NVFP4_BLOCK)
    if amax is not None:
        amax_g = amax
    elif scope == "row":  # a row's global amax is the max of its blocks, i.e. of the row
        amax_g = native.row_amax(x2).view(*lead, rows, 1)
    else:  # NaN-ignoring max per matrix (the max of its block amaxes)
        amax_g = native.row_amax(x2).view(*lead, rows).amax(dim=-1, keepdim=True).unsqueeze(-1)
    s_dec, sf_scale = _scales(amax_g)
    shape = (*lead, rows, 1)
    data, sf = native.nvfp4_encode(x2, s_dec.expand(shape).reshape(-1), sf_scale.expand(shape).reshape(-1),
                                    amax_b)
    if scope == "tensor" and x.dim() == 2:
        s_dec, amax_g = s_dec.reshape(()), amax_g.reshape(())
    return NVFP4Tensor(data=data.view(*lead, rows, k // 2), scale=sf.view(*lead, rows, k // NVFP4_BLOCK),
                       global_scale=s_dec, amax=amax_g, logical_shape=tuple(x.shape),
                       scale_scope=scope, block_2d=block_2d)


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
    amax_of = _matrix_amax
    if tensors[0].is_cuda:  # the amax kernel (no host sync); same values
        from miles_lp.formats import kernels
        if kernels.enabled(tensors[0]):
            amax_of = kernels.matrix_amax
    amax = amax_of(tensors[0])
    for t in tensors[1:]:
        amax = torch.maximum(amax, amax_of(t).to(amax.device))
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
