"""The sliced NVFP4 / FP8-blockwise codecs and the integer E2M1 encoder equal the previous implementations.

The previous implementation is kept here, verbatim in its arithmetic, as the reference: byte equality on
random, boundary, NaN/inf, subnormal, expert-stack inputs, every scope / 2-D / pair / given-amax option,
with slices forced small so that slice boundaries are exercised.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from miles_lp.formats import bits, crosscheck, nvfp4
from miles_lp.formats.spec import NVFP4_BLOCK


# ---- the previous implementation (reference) ------------------------------------------------------------
def _old_e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
            + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
            + (a > 5.0).to(torch.uint8))
    code = code | (torch.signbit(y).to(torch.uint8) << 3)
    return torch.where(torch.isnan(y), torch.full_like(code, bits.E2M1_NAN_CODE), code)


def _old_pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.unflatten(-1, (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _old_matrix_amax(x):
    return bits.nan_ignoring_abs(x).amax(dim=(-2, -1), keepdim=True).to(torch.float32)


def _old_quantize(x, scale_scope="tensor", amax=None, block_2d=False):
    x = x.contiguous()
    if amax is None:
        amax_g = (_old_matrix_amax(x) if scale_scope == "tensor"
                  else bits.nan_ignoring_abs(x).amax(dim=-1, keepdim=True).to(torch.float32))
    else:
        amax_g = nvfp4._broadcast_amax(amax, x, scale_scope, None)
    s_enc = nvfp4._global_encode_scale(amax_g)
    s_dec = torch.div(bits.fp32_scalar(bits.f32_bits(1.0)), s_enc)
    k = x.shape[-1]
    xb = x.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK)).to(torch.float32)
    amax_b = bits.nan_ignoring_abs(xb).amax(dim=-1)
    if block_2d:
        tiles = amax_b.unflatten(-2, (x.shape[-2] // NVFP4_BLOCK, NVFP4_BLOCK))
        amax_b = tiles.amax(dim=-2, keepdim=True).expand_as(tiles).flatten(-3, -2)
    sf = bits.e4m3_satfinite(amax_b * (s_enc * bits.fp32_scalar(bits.FP32_INV_6_BITS)))
    enc = torch.div(bits.fp32_scalar(bits.f32_bits(1.0)), sf.to(torch.float32) * s_dec)
    enc = torch.fmin(enc, bits.fp32_scalar(bits.FP32_MAX_BITS))
    data = _old_pack(_old_e2m1_codes(xb * enc.unsqueeze(-1)).flatten(-2))
    if scale_scope == "tensor" and x.dim() == 2:
        s_dec, amax_g = s_dec.reshape(()), amax_g.reshape(())
    return data, sf, s_dec, amax_g


@functools.cache
def _cases(seed: int) -> dict[str, torch.Tensor]:
    return crosscheck.cases(seed=seed)


# ---- tests ---------------------------------------------------------------------------------------------
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8) if a.element_size() == 1 else a, b.contiguous().view(torch.uint8)
        if b.element_size() == 1 else b)


def _assert_equal(new, old):
    data, sf, s_dec, amax_g = old
    assert _same(new.data, data)
    assert _same(new.scale, sf)
    assert torch.equal(new.global_scale, s_dec) and torch.equal(new.amax, amax_g)


def test_e2m1_codes_equal_the_comparison_form_on_random_bit_patterns():
    g = torch.Generator().manual_seed(1)
    y = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    y = y.view(torch.float32)
    small = torch.randn(1 << 20, generator=g) * torch.logspace(-4, 2, 1 << 20)
    grid = torch.tensor([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, math.inf, 1e-45, 3e38])
    near = torch.cat([grid, torch.nextafter(grid, grid * 2 + 1), torch.nextafter(grid, torch.zeros_like(grid))])
    snan = torch.tensor([0x7F800001, 0x7FC00000, -0x7FFFFF, -0x400000], dtype=torch.int32).view(torch.float32)
    for v in (y, small, near, -near, snan):
        assert torch.equal(bits.e2m1_codes(v), _old_e2m1_codes(v))
    for dt in (torch.bfloat16, torch.float16):
        assert torch.equal(bits.e2m1_codes(small.to(dt)), _old_e2m1_codes(small.to(dt)))


def test_pack_fp4_equals_the_strided_form():
    codes = torch.randint(0, 16, (3, 64, 256), dtype=torch.uint8)
    assert torch.equal(bits.pack_fp4(codes), _old_pack(codes))
    assert torch.equal(bits.pack_fp4(codes[:, 1:5, 8:40]), _old_pack(codes[:, 1:5, 8:40]))  # non-contiguous


@pytest.fixture(params=[1 << 30, 1000], ids=["one-slice", "many-slices"])
def chunk(request, monkeypatch):
    monkeypatch.setattr(nvfp4, "_CHUNK_ELEMS", request.param)
    return request.param


@pytest.mark.parametrize("case", list(crosscheck.cases(seed=3)))
@pytest.mark.parametrize("opts", [{}, {"scale_scope": "row"}, {"block_2d": True}], ids=["tensor", "row", "2d"])
def test_quantize_nvfp4_equals_previous_implementation(case, opts, chunk):
    x = _cases(3)[case]
    if opts.get("block_2d") and x.shape[-2] % NVFP4_BLOCK:
        pytest.skip("rows not a multiple of 16")
    _assert_equal(nvfp4.quantize_nvfp4(x, **opts), _old_quantize(x, **opts))


@pytest.mark.parametrize("case", ["randn_bf16(256, 512)", "nan_inf(64,128)", "experts(4,64,256)", "boundary(128,256)"])
def test_given_amax_and_pair_equal_previous_implementation(case, chunk):
    x = _cases(3)[case]
    up = x * 0.5
    amax = torch.maximum(_old_matrix_amax(x), _old_matrix_amax(up))
    amax = amax.reshape(()) if x.dim() == 2 else amax
    assert torch.equal(nvfp4.nvfp4_global_amax(x, up), amax)
    g, u = nvfp4.quantize_nvfp4_pair(x, up)
    _assert_equal(g, _old_quantize(x, amax=amax))
    _assert_equal(u, _old_quantize(up, amax=amax))
    _assert_equal(nvfp4.quantize_nvfp4(x, amax=0.37), _old_quantize(x, amax=0.37))  # smaller than the true amax


def test_requires_grad_input_is_accepted():
    w = torch.randn(32, 64, requires_grad=True)
    q = nvfp4.quantize_nvfp4(w)
    _assert_equal(q, _old_quantize(w.detach()))


# ---- FP8 blockwise: band-by-band path vs the previous padded-tiles implementation --------------------------
def _old_fp8_blockwise(x, block=(128, 128), pow2_scales=False, amax_epsilon=0.0):
    from miles_lp.formats.fp8 import _reciprocal, _scale_from_amax

    bm, bk = block
    value_for_inf = torch.finfo(x.dtype).max
    m, k = x.shape[-2], x.shape[-1]
    xf = x.contiguous().to(torch.float32)
    pm, pk = -m % bm, -k % bk
    if pm or pk:
        xf = torch.nn.functional.pad(xf, (0, pk, 0, pm))
    mb, kb = xf.shape[-2] // bm, xf.shape[-1] // bk
    tiles = xf.unflatten(-1, (kb, bk)).unflatten(-3, (mb, bm))
    amax = bits.nan_ignoring_abs(tiles).amax(dim=(-3, -1), keepdim=True)
    scale = _scale_from_amax(amax, value_for_inf=value_for_inf, pow2=pow2_scales, eps=amax_epsilon)
    q = bits.e4m3_satfinite(tiles * scale, inplace=True)
    return q.flatten(-2).flatten(-3, -2)[..., :m, :k].contiguous(), _reciprocal(scale).squeeze(-1).squeeze(-2)


@pytest.mark.parametrize("chunk_elems", [1 << 30, 1000], ids=["one-slice", "many-slices"])
@pytest.mark.parametrize("case", ["randn(64, 128)", "randn_bf16(96, 2048)", "wide_dynamic(128,256)", "boundary(128,256)",
                                  "zeros(64,64)", "bf16_max(32,64)", "nan_inf(64,128)", "subnormal(32,64)",
                                  "experts(4,64,256)", "experts_fp16(2,32,64)"])
@pytest.mark.parametrize("opts", [{}, {"pow2_scales": True}, {"block": (32, 48)}, {"block": (16, 16), "amax_epsilon": 1e-3}],
                         ids=["128", "pow2", "32x48", "16-eps"])
def test_fp8_blockwise_equals_previous_implementation(case, opts, chunk_elems, monkeypatch):
    from miles_lp.formats import fp8

    monkeypatch.setattr(fp8, "_CHUNK_ELEMS", chunk_elems)
    x = _cases(4)[case]
    q = fp8.quantize_fp8_blockwise(x, **opts)
    data, scale_inv = _old_fp8_blockwise(x, **opts)
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    # NaN where the previous implementation has NaN, and every other scale bit for bit (inf included)
    assert torch.equal(q.scale_inv.isnan(), scale_inv.isnan())
    nan = scale_inv.isnan()
    assert torch.equal(q.scale_inv.masked_fill(nan, 0).view(torch.int32), scale_inv.masked_fill(nan, 0).view(torch.int32))
    x300 = torch.randn(2, 300, 200)  # partial edge blocks, a stack whose bands cross nothing
    assert torch.equal(fp8.quantize_fp8_blockwise(x300, **opts).data.view(torch.uint8),
                       _old_fp8_blockwise(x300, **opts)[0].view(torch.uint8))
