"""The compiled Triton kernels on CUDA equal the reference codecs on CPU, byte for byte (pytest -m gpu).

Run on the H200 (scripts/h200_kernels.sh does it in one device call):
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_formats_kernels_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _u8(t: torch.Tensor) -> torch.Tensor:
    from miles_lp.formats.crosscheck import as_bytes

    return as_bytes(t)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_u8(a), _u8(b))


@needs_cuda
def test_every_kernel_on_every_case_and_the_encoders():
    from miles_lp.formats.kernels import selfcheck

    rows = list(selfcheck.compare("cuda"))
    assert len(rows) > 200
    bad = [r for r in rows if r.mismatches]
    assert not bad, "\n".join(f"{r.format} / {r.case}: {r.mismatches} of {r.bytes_compared} bytes" for r in bad)
    assert selfcheck.check_encoders("cuda") == []


def _big_cases():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 4096, generator=g).bfloat16()
    x[5, 100] = math.nan
    x[900, 7] = math.inf
    return {
        "randn_bf16(2048,4096)+nan/inf": x,
        "experts(8,256,2048)": (torch.randn(8, 256, 2048, generator=g) * 3).bfloat16(),
        "rows1000_k2880": torch.randn(1000, 2880, generator=g),  # K not a multiple of the tile: masks
        "fp16(512,1536)": torch.randn(512, 1536, generator=g).half(),
    }


@needs_cuda
@pytest.mark.parametrize("case", list(_big_cases()))
def test_large_inputs(case):
    from miles_lp.errors import FormatError
    from miles_lp.formats import kernels, quantize_mxfp8, quantize_nvfp4, swizzle_scales

    x = _big_cases()[case]
    xc = x.cuda()
    col = x.shape[-2] % 32 == 0
    r = kernels.mxfp8_quantize(xc, rowwise=True, colwise=col, dequant_dtype=torch.bfloat16, swizzle=True)
    a = quantize_mxfp8(x)
    assert _same(r.row.data, a.data) and _same(r.row.scale, a.scale)
    assert _same(r.row_deq, a.dequantize(torch.bfloat16))
    assert _same(r.row_swizzled, swizzle_scales(a.scale))
    if col:
        c = quantize_mxfp8(x, axis=-2)
        assert _same(r.col.data, c.data) and _same(r.col.scale, c.scale)
        assert _same(r.col_deq, c.dequantize(torch.bfloat16))
    for kw in ({"scale_scope": "tensor"}, {"scale_scope": "row"}, {"block_2d": True}):
        try:
            want = quantize_nvfp4(x, **kw)
        except FormatError:
            continue
        got, deq = kernels.nvfp4_quantize(xc, kw.get("scale_scope", "tensor"), block_2d=kw.get("block_2d", False),
                                          dequant_dtype=torch.float32)
        for name in ("data", "scale", "global_scale", "amax"):
            assert _same(getattr(got, name), getattr(want, name)), (kw, name)
        assert _same(deq, want.dequantize(torch.float32)), kw


@needs_cuda
def test_codec_hooks_select_the_kernels_and_match_the_torch_path(monkeypatch):
    from miles_lp.formats import kernels, quantize_mxfp8, quantize_nvfp4, quantize_nvfp4_pair

    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16)
    assert kernels.enabled(x)
    via_kernel = [quantize_mxfp8(x), quantize_mxfp8(x, axis=-2), quantize_nvfp4(x), quantize_nvfp4(x, scale_scope="row"),
                  quantize_nvfp4(x, block_2d=True), *quantize_nvfp4_pair(x, x * 0.5)]
    monkeypatch.setenv("MILES_LP_KERNELS", "reference")
    assert not kernels.enabled(x)
    via_torch = [quantize_mxfp8(x), quantize_mxfp8(x, axis=-2), quantize_nvfp4(x), quantize_nvfp4(x, scale_scope="row"),
                 quantize_nvfp4(x, block_2d=True), *quantize_nvfp4_pair(x, x * 0.5)]
    for a, b in zip(via_kernel, via_torch, strict=True):
        for name, t in a.components().items():
            assert _same(t, b.components()[name]), name


@needs_cuda
def test_fused_entry_points_use_the_kernels_and_match_the_reference():
    from miles_lp.formats import quantize_mxfp8, quantize_nvfp4
    from miles_lp.train import fused

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    assert fused.uses_kernels(x, torch.bfloat16)
    xr = x.cpu()
    q, deq = fused.mxfp8_qdq(x, -1, torch.bfloat16)
    ref = quantize_mxfp8(xr)
    assert _same(q.data, ref.data) and _same(deq, ref.dequantize(torch.bfloat16))
    row, row_deq, col, col_deq = fused.mxfp8_qdq_both(x, torch.bfloat16)
    refc = quantize_mxfp8(xr, axis=-2)
    assert _same(col.scale, refc.scale) and _same(col_deq, refc.dequantize(torch.bfloat16))
    assert _same(row_deq, ref.dequantize(torch.bfloat16))
    assert _same(fused.mxfp8_dequantize(col, torch.float32), refc.dequantize(torch.float32))
    for scope in ("tensor", "row"):
        nq, ndeq = fused.nvfp4_qdq(x, scope, torch.bfloat16)
        nref = quantize_nvfp4(xr, scale_scope=scope)
        assert _same(nq.data, nref.data) and _same(nq.scale, nref.scale)
        assert _same(ndeq, nref.dequantize(torch.bfloat16))
        assert _same(fused.nvfp4_dequantize(nq, torch.float32), nref.dequantize(torch.float32))


@needs_cuda
def test_kernels_capture_in_a_cuda_graph():
    """No host synchronisation on the hot paths: a captured graph replays with new input values."""
    from miles_lp.formats import kernels, quantize_mxfp8, quantize_nvfp4

    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compiles) outside the capture
        kernels.mxfp8_quantize(x, rowwise=True, colwise=True, dequant_dtype=torch.bfloat16)
        kernels.nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16)
        kernels.nvfp4_quantize(x, "tensor", dequant_dtype=torch.bfloat16)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mx = kernels.mxfp8_quantize(x, rowwise=True, colwise=True, dequant_dtype=torch.bfloat16)
        nr, _ = kernels.nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16)
        nt, _ = kernels.nvfp4_quantize(x, "tensor", dequant_dtype=torch.bfloat16)
    x.copy_(torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16) * 5)
    g.replay()
    torch.cuda.synchronize()
    xr = x.cpu()
    assert _same(mx.col.data, quantize_mxfp8(xr, axis=-2).data)
    assert _same(mx.row_deq, quantize_mxfp8(xr).dequantize(torch.bfloat16))
    assert _same(nr.data, quantize_nvfp4(xr, scale_scope="row").data)
    assert _same(nt.scale, quantize_nvfp4(xr).scale) and _same(nt.global_scale, quantize_nvfp4(xr).global_scale)


@needs_cuda
def test_pair_encoder_on_random_fp32_bit_patterns():
    """``_e2m1_pair_code`` and ``_e2m1_pair_code_abs`` (the per-token bf16 kernel's encoders, ENC 0 / 1: code and
    value) and ``_bf16x2`` against the torch reference (``bits.e2m1_codes``, torch's bf16 cast) on 2^24 random
    fp32 bit patterns (every sign, exponent, NaN payload) plus every value of the E2M1 range [-8, 8] on a fine
    grid."""
    from miles_lp.formats import bits
    from miles_lp.formats import kernels as k

    g = torch.Generator(device="cuda").manual_seed(3)
    raw = torch.randint(-2**31, 2**31, (1 << 24,), dtype=torch.int64, device="cuda", generator=g).to(torch.int32)
    fine = torch.linspace(-8, 8, 1 << 20, device="cuda")
    x = torch.cat([raw.view(torch.float32), fine, torch.nextafter(fine, fine * 2)])
    n = x.numel()
    i32 = [torch.empty(n, dtype=torch.int32, device="cuda") for _ in range(6)]
    f32 = [torch.empty(n, dtype=torch.float32, device="cuda") for _ in range(4)]
    codes = torch.zeros(n, dtype=torch.int32, device="cuda")
    mod = k.runtime.module_for(x)
    mod.encoders_kernel[(-(-n // 1024),)](x, codes, i32[0], i32[1], i32[2], f32[0], f32[1], i32[3], f32[2], i32[4],
                                          i32[5], f32[3], n, 1.0, BLOCK=1024)
    want = bits.e2m1_codes(x).to(torch.int32)
    assert torch.equal(i32[3], want)
    values = bits.e2m1_table("cuda")[want.long()]
    assert torch.equal(f32[2].view(torch.int32), values.view(torch.int32))  # -0.0 included
    # the one-clamp encoder (ENC 1) on x * 1.0: exact because the GPU's multiply returns the canonical NaN
    # (about half of the random patterns' NaNs carry the sign bit: a NaN keeping it would give code 15, not 7)
    assert torch.equal(i32[5], want)
    assert torch.equal(f32[3].view(torch.int32), values.view(torch.int32))
    ok = ~torch.isnan(x)  # NaN: any quiet NaN is right (selfcheck.check_encoders checks that)
    ref = x.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal((i32[4] & 0xFFFF)[ok], ref[ok])
    neg = (-x).bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(((i32[4] >> 16) & 0xFFFF)[ok], neg[ok])
