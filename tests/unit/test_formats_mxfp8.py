"""MXFP8 (CONTRACT 1): bytes equal torchao RCEIL on finite input, TE's rule on NaN / inf, bounds, errors."""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_lp.errors import FormatError
from miles_lp.formats import MXFP8Tensor, QuantizedTensor, bits, quantize_mxfp8

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _torchao(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao RCEIL bytes in our layout: (data uint8 same shape as x, scale uint8 compact)."""
    if axis == -1:
        s, d = to_mx(x.contiguous(), torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
        return _u8(d).reshape(x.shape), _u8(s).reshape(*x.shape[:-1], x.shape[-1] // 32)
    xt = x.transpose(-1, -2).contiguous()  # columnwise = rowwise of the transpose
    s, d = to_mx(xt, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL)
    d = _u8(d).reshape(xt.shape).transpose(-1, -2)
    s = _u8(s).reshape(*xt.shape[:-1], xt.shape[-1] // 32).transpose(-1, -2)
    return d, s


def _block_amax(x: torch.Tensor, axis: int) -> torch.Tensor:
    xb = x.float().unflatten(axis, (x.shape[axis] // 32, 32))
    return xb.abs().amax(dim=axis)  # finite input: NaN handling does not matter here


def _assert_equals_torchao(x: torch.Tensor, axis: int) -> None:
    q = quantize_mxfp8(x, axis=axis)
    d, s = _torchao(x, axis)
    amax = _block_amax(x, axis)
    # Our scale bytes always equal the exact closed form clamp(ceil(log2(amax/448)), -127, 127) + 127.
    assert q.scale.flatten().tolist() == [bits.e8m0_closed_form(a) for a in amax.flatten().tolist()]
    # torchao's eager RCEIL computes ceil(log2(amax / 448)) in fp32: for an fp32 amax a few ulps above
    # 448 * 2^k the fp32 log2 rounds to exactly k and it picks one exponent too low (TE rounds the
    # bits up). bf16 amax values are too coarse for that, so there the bytes are equal everywhere.
    ok = q.scale == s
    if x.dtype == torch.bfloat16:
        assert ok.all(), f"scale differs in {(~ok).sum()} blocks"
    else:
        rel = amax / 448 / torch.exp2(torch.floor(torch.log2(amax / 448)))  # in [1, 2)
        assert ((rel - 1).abs() < 1e-5)[~ok].all(), "torchao differs away from a power-of-two boundary"
    mask = ok.repeat_interleave(32, dim=axis)
    assert torch.equal(_u8(q.data)[mask], d[mask]), f"data differs in {(d != _u8(q.data))[mask].sum()} bytes"


def _boundary_values() -> torch.Tensor:
    """Powers of two times 448 (+-1 ulp), E4M3 rounding midpoints at several scales, bf16 max."""
    p = torch.tensor([448.0 * 2.0**k for k in range(-120, 120, 7)], dtype=torch.float32)
    grid = [bits.e4m3_value(c) for c in range(0x7F)]
    mids = torch.tensor([(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)], dtype=torch.float32)
    mids = torch.cat([mids * 2.0**k for k in (-40, 0, 40)])
    vals = torch.cat([p, torch.nextafter(p, p * 2), torch.nextafter(p, p * 0), mids,
                      torch.tensor([torch.finfo(torch.bfloat16).max, 1.0, 0.0])])
    return torch.cat([vals, -vals])


def _cases(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for mag in (1e-30, 1e-12, 1e-3, 1.0, 1e3, 1e12, 1e30):
        if dtype == torch.float16 and not 1e-3 <= mag <= 1e3:
            continue
        out[f"normal*{mag:g}"] = torch.randn(64, 256, generator=g) * mag
    out["student_t"] = torch.distributions.StudentT(1.5).sample((64, 256))
    out["cauchy"] = torch.distributions.Cauchy(0.0, 1.0).sample((64, 256)).clamp(-3e38, 3e38)
    b = _boundary_values()
    b = b[torch.randperm(b.numel(), generator=g)]
    n = b.numel() // 8192 * 8192 + 8192  # whole [32, 256] tiles
    out["boundary"] = torch.cat([b, torch.zeros(n - b.numel())]).reshape(-1, 256)
    z = torch.randn(64, 256, generator=g)
    z[::3] = 0.0
    z[1::5, :64] = 0.0
    out["zeros"] = z
    out["bf16_max"] = torch.full((32, 64), torch.finfo(torch.bfloat16).max) * torch.sign(torch.randn(32, 64))
    # subnormal elements (fp32 and bf16 subnormals: |x| < 2^-126) inside blocks with a normal amax; blocks of
    # only subnormals differ from torchao by design (test_tiny_blocks_follow_te_where_torchao_differs)
    sub = torch.randn(64, 256, generator=g)
    mask = torch.rand(64, 256, generator=g) < 0.5
    sub[mask] = torch.randn(int(mask.sum()), generator=g) * 1e-39
    out["subnormals"] = sub
    return {k: v.to(dtype) for k, v in out.items()}


@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_equal_torchao_rceil_on_finite_input(dtype, axis):
    for name, x in _cases(dtype).items():
        assert torch.isfinite(x).all(), name
        _assert_equals_torchao(x, axis)


def test_bytes_equal_torchao_on_expert_stacks_and_fp32_subnormal_free_tiny_values():
    x = torch.randn(4, 64, 96, dtype=torch.bfloat16)
    _assert_equals_torchao(x, -1)
    _assert_equals_torchao(x, -2)
    tiny = torch.randn(32, 64) * 1e-35  # amax/448 near 2^-127: the E == 0, M <= 0x400000 branch
    q = quantize_mxfp8(tiny)
    want = [bits.e8m0_closed_form(a) for a in tiny.abs().unflatten(-1, (2, 32)).amax(-1).flatten().tolist()]
    assert q.scale.flatten().tolist() == want


def test_tiny_blocks_follow_te_where_torchao_differs():
    # amax <= 448 * 2^-127: scale byte 0 (2^-127) and TE multiplies by exp2f_rcp(0) = 2^127, so the elements
    # keep their information. torchao RCEIL multiplies by 1.0 when the byte is 0 (all-zero elements).
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([1e-40, -3e-39, 2e-38, 0.0])  # fp32 subnormals and the smallest normal range
    q = quantize_mxfp8(x)
    assert q.scale.tolist() == [[0]]
    want = [bits.e4m3_encode_exact(v * 2.0**127) for v in x[0].tolist()]
    assert _u8(q.data)[0].tolist() == want
    assert any(want[:3])  # torchao gives 0 for all three


def test_nan_and_inf_follow_te():
    x = torch.randn(4, 64)
    x[0, 3] = math.nan  # one NaN: ignored by the amax, element -> 0x7F
    x[1, :32] = math.nan  # all-NaN block: amax 0 -> scale 0x00, elements 0x7F
    x[2, 5] = math.inf  # inf block: scale 0xFE, inf -> 448, finite elements * 2^-127 -> +-0
    x[3, 40] = -math.inf
    x[3, 41] = -math.nan
    q = quantize_mxfp8(x)
    d = _u8(q.data)
    clean = x[0].clone()
    clean[3] = 0.0
    ref0 = quantize_mxfp8(clean.unsqueeze(0))
    assert q.scale[0].tolist() == ref0.scale[0].tolist()
    assert d[0, 3].item() == 0x7F
    assert d[0, :3].tolist() == _u8(ref0.data)[0, :3].tolist()
    assert q.scale[1, 0].item() == 0x00 and d[1, :32].tolist() == [0x7F] * 32
    assert q.scale[2, 0].item() == 0xFE and d[2, 5].item() == 0x7E
    assert set(d[2, :32].tolist()) - {0x7E} <= {0x00, 0x80}
    assert q.scale[3, 1].item() == 0xFE and d[3, 40].item() == 0xFE and d[3, 41].item() == 0x7F
    # torchao propagates NaN through torch.amax: scale 0xFF and NaN elements for row 0 (TE: see above)
    _, s_ao = _torchao(x, -1)
    assert s_ao[0, 0].item() == 0xFF


def test_large_finite_values_in_a_block_with_inf_are_kept():
    x = torch.zeros(1, 32)
    x[0, 0] = math.inf
    x[0, 1] = 3e38  # 3e38 * 2^-127 ~ 1.76: representable
    q = quantize_mxfp8(x)
    assert _u8(q.data)[0, 1].item() == bits.e4m3_encode_exact(bits.f32_round(3e38) * 2.0**-127)


def test_rowwise_and_columnwise_shapes_and_protocol():
    x = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    r = quantize_mxfp8(x)
    c = quantize_mxfp8(x, axis=-2)
    assert isinstance(r, QuantizedTensor) and isinstance(r, MXFP8Tensor)
    assert r.data.dtype == torch.float8_e4m3fn and r.scale.dtype == torch.uint8
    assert r.scale.shape == (2, 64, 4) and c.scale.shape == (2, 2, 128)
    assert r.shape == c.shape == x.shape
    assert set(r.components()) == {"data", "scale"}
    assert quantize_mxfp8(x, axis=2).axis == -1 and quantize_mxfp8(x, axis=1).axis == -2
    # the two grids differ: columnwise is quantized from full precision, not from the rowwise result
    assert not torch.equal(_u8(r.data), _u8(c.data))


def test_chunked_eager_path_equals_one_call():
    import miles_lp.formats.mxfp8 as m

    x = torch.randn(3, 96, 320, dtype=torch.bfloat16)
    whole_r, whole_c = m._rowwise_core(x), m._colwise_core(x)
    old = m._ROWS_PER_CHUNK_ELEMS
    m._ROWS_PER_CHUNK_ELEMS = 5000  # forces many slices
    try:
        r, c = quantize_mxfp8(x), quantize_mxfp8(x, axis=-2)
    finally:
        m._ROWS_PER_CHUNK_ELEMS = old
    assert torch.equal(_u8(r.data), _u8(whole_r[0])) and torch.equal(r.scale, whole_r[1])
    assert torch.equal(_u8(c.data), _u8(whole_c[0])) and torch.equal(c.scale, whole_c[1])


def test_dequantize_is_exact_product_in_fp32():
    x = torch.randn(8, 64)
    q = quantize_mxfp8(x)
    deq = q.dequantize(torch.float32)
    want = q.data.float() * torch.exp2(q.scale.float() - 127).repeat_interleave(32, -1)
    assert torch.equal(deq, want)
    assert q.dequantize().dtype == torch.bfloat16
    assert torch.equal(q.dequantize(), deq.bfloat16())  # E4M3 * 2^k is exact in bf16


_finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None)
@given(st.lists(_finite, min_size=32, max_size=32), st.integers(-60, 60))
def test_decode_error_is_within_the_e4m3_bound(vals, shift):
    x = (torch.tensor(vals, dtype=torch.float32) * 2.0**shift).clamp(-3e38, 3e38).unsqueeze(0)
    q = quantize_mxfp8(x)
    unit = 2.0 ** (q.scale.item() - 127)
    deq = q.dequantize(torch.float32).double()
    err = (x.double() - deq).abs()
    # RNE in E4M3: relative 2^-4 for normals, half the smallest subnormal (2^-10) times the block scale
    bound = torch.maximum(x.double().abs() * 2.0**-4, torch.full_like(err, 2.0**-10 * unit))
    assert (err <= bound * (1 + 1e-6)).all()
    assert (q.data.float().abs() <= 448).all()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: torch.randn(4, 100), r"shape \(4, 100\).*axis=-1.*100 elements.*block of 32.*keep this tensor BF16"),
        (lambda: torch.randn(40, 64), r"shape \(40, 64\).*axis=-2.*40 elements.*keep this tensor BF16"),
        (lambda: torch.randint(0, 5, (4, 64)), r"shape \(4, 64\).*dtype torch.int64"),
        (lambda: torch.randn(4, 64).to(torch.float8_e4m3fn), r"shape \(4, 64\).*float8_e4m3fn"),
        (lambda: torch.empty(0, 64), r"shape \(0, 64\).*empty"),
        (lambda: torch.randn(64), r"axis=-2 is not supported for a tensor of shape \(64,\)"),
    ],
)
def test_refusals_name_shape_and_rule(make, match):
    x = make()
    axis = -2 if ("axis=-2" in match or x.dim() == 1) else -1
    with pytest.raises(FormatError, match=match):
        quantize_mxfp8(x, axis=axis)


def test_refusal_names_the_tensor_when_given():
    with pytest.raises(FormatError, match=r"'model.layers.0.mlp.down_proj.weight' of shape \(8, 48\)"):
        quantize_mxfp8(torch.randn(8, 48), name="model.layers.0.mlp.down_proj.weight")


@pytest.mark.slow
def test_compiled_path_is_byte_identical():
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16)
    x[0, 0, 3] = math.nan
    x[0, 1, :32] = math.nan
    x[1, 2, 7] = -math.inf
    x[1, 3] = 0.0
    t = time.perf_counter()
    for axis in (-1, -2):
        c, e = quantize_mxfp8(x, axis=axis, compile=True), quantize_mxfp8(x, axis=axis)
        assert torch.equal(_u8(c.data), _u8(e.data)) and torch.equal(c.scale, e.scale)
    print(f"compile + run: {time.perf_counter() - t:.1f} s")


def test_inputs_are_never_modified():
    from miles_lp.formats import quantize_fp8_blockwise, quantize_fp8_tensorwise, quantize_nvfp4

    x = torch.randn(64, 128) * 1e3
    x[0, 0] = math.nan
    before = x.clone()
    for fn in (quantize_mxfp8, lambda t: quantize_mxfp8(t, axis=-2), quantize_nvfp4, quantize_fp8_blockwise,
               quantize_fp8_tensorwise):
        fn(x)
        assert torch.equal(x.nan_to_num(), before.nan_to_num()) and torch.isnan(x[0, 0])


@pytest.mark.parametrize("axis", [-1, -2])
def test_dequantize_broadcast_equals_expanded_scales(axis):
    """``MXFP8Tensor.dequantize`` multiplies each block by broadcasting; the bytes equal the expanded-scales formula
    (every E4M3 code x every E8M0 byte incl. 0 (2^-127), 254, 255 (NaN), leading dims, fp32 and bf16 out)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    data = codes.view(1, 1, 256).expand(2, 64, 256).contiguous()  # [2, 64, 256]
    if axis == -1:
        scale = torch.arange(2 * 64 * 8, dtype=torch.int64).remainder(256).to(torch.uint8).view(2, 64, 8)
    else:
        scale = torch.arange(2 * 2 * 256, dtype=torch.int64).remainder(256).to(torch.uint8).view(2, 2, 256)
    q = MXFP8Tensor(data, scale, axis=axis)
    s = bits.e8m0_value(scale).repeat_interleave(32, dim=axis)
    for dtype in (torch.float32, torch.bfloat16):
        want = (data.to(torch.float32) * s).to(dtype)
        got = q.dequantize(dtype)
        assert got.shape == data.shape
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
