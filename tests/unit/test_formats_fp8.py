"""FP8 blockwise (DeepSeek-V3 / TE Float8BlockScaling) and tensorwise (TE Float8CurrentScaling)."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lp.errors import FormatError
from miles_lp.formats import (
    Format,
    FP8BlockTensor,
    FP8TensorwiseTensor,
    QuantizedTensor,
    bits,
    dequantize_fp8_blockwise,
    quantize,
    quantize_fp8_blockwise,
    quantize_fp8_tensorwise,
)


def test_blockwise_scale_rule_and_partial_edge_blocks():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=g)  # partial blocks on both edges
    q = quantize_fp8_blockwise(x)
    assert isinstance(q, QuantizedTensor) and isinstance(q, FP8BlockTensor)
    assert q.data.shape == x.shape and q.data.dtype == torch.float8_e4m3fn
    assert q.scale_inv.shape == (3, 2) and q.scale_inv.dtype == torch.float32
    for i in range(3):
        for j in range(2):
            tile = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale = bits.f32_round(448.0 / tile.abs().max().item())  # 448 / amax, not amax / 448
            assert q.scale_inv[i, j].item() == bits.f32_round(1.0 / scale)
            want = [bits.e4m3_encode_exact(bits.f32_round(v * scale)) for v in tile.flatten()[:50].tolist()]
            assert q.data[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].flatten()[:50].view(torch.uint8).tolist() == want


def test_blockwise_round_trip_bound():
    x = torch.randn(2, 256, 384, dtype=torch.bfloat16) * torch.logspace(-3, 3, 256).unsqueeze(1).bfloat16()
    q = quantize_fp8_blockwise(x)
    assert q.scale_inv.shape == (2, 2, 3)
    deq = q.dequantize(torch.float32)
    si = q.scale_inv.repeat_interleave(128, -2).repeat_interleave(128, -1)
    err = (x.float() - deq).abs()
    # E4M3: 2^-4 relative for normals, half the smallest subnormal (2^-10) times the decode scale
    assert (err <= torch.maximum(x.float().abs() * 2**-4, si * 2**-10) * (1 + 1e-6)).all()


def test_pow2_scales_are_powers_of_two_rounded_down():
    x = torch.randn(256, 256) * 3.7
    q = quantize_fp8_blockwise(x, pow2_scales=True)
    m, e = torch.frexp(q.scale_inv)
    assert (m == 0.5).all()
    plain = quantize_fp8_blockwise(x)
    assert (q.scale_inv >= plain.scale_inv).all()  # scale rounded down -> scale_inv up: no saturation
    assert (q.dequantize(torch.float32) - x).abs().max() <= x.abs().max() * 2**-3


def test_blockwise_special_amax():
    x = torch.zeros(128, 256)
    x[0, 128] = math.inf
    x[1, 129] = 3.0
    q = quantize_fp8_blockwise(x)
    assert q.scale_inv.tolist() == [[1.0, 1.0]]  # amax 0 and amax inf: scale 1
    assert q.data.view(torch.uint8)[0, 128].item() == 0x7E and q.data[1, 129].item() == 3.0
    tiny = torch.full((128, 128), 1e-42)  # 448 / amax overflows: scale = max finite of the INPUT dtype
    assert quantize_fp8_blockwise(tiny).scale_inv.item() == bits.f32_round(1.0 / bits.FP32_MAX)
    tiny_bf16 = torch.full((128, 128), 1e-40, dtype=torch.bfloat16)
    bf16_max = torch.finfo(torch.bfloat16).max
    assert quantize_fp8_blockwise(tiny_bf16).scale_inv.item() == bits.f32_round(1.0 / bf16_max)
    eps = quantize_fp8_blockwise(torch.full((128, 128), 1e-9), amax_epsilon=1e-3)
    assert eps.scale_inv.item() == bits.f32_round(1.0 / bits.f32_round(448.0 / bits.f32_round(1e-3)))


def test_dequantize_fp8_blockwise_hand_example():
    data = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 0.5, 448.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[0.5, 10.0]])  # block (2, 2): columns 0-1 use 0.5, column 2 uses 10
    out = dequantize_fp8_blockwise(data, scale_inv, block=(2, 2), dtype=torch.float32)
    assert out.tolist() == [[0.5, 1.0, 30.0], [-2.0, 0.25, 4480.0]]
    with pytest.raises(FormatError, match=r"scale_inv of shape \(1, 1\) does not match data of shape \(2, 3\)"):
        dequantize_fp8_blockwise(data, torch.ones(1, 1), block=(2, 2))
    with pytest.raises(FormatError, match="float8_e4m3fn or float8_e5m2"):
        dequantize_fp8_blockwise(data.float(), scale_inv, block=(2, 2))


def test_tensorwise_current_scaling_rule():
    x = torch.randn(64, 96, dtype=torch.bfloat16)
    q = quantize_fp8_tensorwise(x)
    assert isinstance(q, FP8TensorwiseTensor) and q.scale_inv.shape == ()
    scale = bits.f32_round(448.0 / x.float().abs().max().item())
    assert q.scale_inv.item() == bits.f32_round(1.0 / scale)
    want = [bits.e4m3_encode_exact(bits.f32_round(v * scale)) for v in x.float().flatten()[:200].tolist()]
    assert q.data.flatten()[:200].view(torch.uint8).tolist() == want
    err = (q.dequantize(torch.float32) - x.float()).abs()
    assert (err <= torch.maximum(x.float().abs() * 2**-4, q.scale_inv * 2**-10) * (1 + 1e-6)).all()
    assert quantize_fp8_tensorwise(torch.zeros(4)).scale_inv.item() == 1.0


def test_dispatch():
    x = torch.randn(32, 64)
    assert quantize(x, Format.MXFP8).format is Format.MXFP8
    assert quantize(x, "nvfp4", scale_scope="row").format is Format.NVFP4
    assert quantize(x, Format.FP8_BLOCK, block=(1, 32)).scale_inv.shape == (32, 2)
    assert quantize(x, Format.FP8_TENSOR).format is Format.FP8_TENSOR
    with pytest.raises(FormatError, match="BF16 is the unquantized format"):
        quantize(x, Format.BF16)
    with pytest.raises(FormatError, match="unknown format 'int4'"):
        quantize(x, "int4")


@pytest.mark.parametrize(
    "fn, make, match",
    [
        (quantize_fp8_blockwise, lambda: torch.randn(128), r"shape \(128,\) has 1 dim"),
        (quantize_fp8_blockwise, lambda: torch.ones(4, 4, dtype=torch.int8), r"shape \(4, 4\) has dtype torch.int8"),
        (quantize_fp8_tensorwise, lambda: torch.empty(0), r"shape \(0,\) is empty"),
        (quantize_fp8_tensorwise, lambda: torch.ones(3).to(torch.float8_e4m3fn), r"shape \(3,\) has dtype"),
    ],
)
def test_refusals(fn, make, match):
    with pytest.raises(FormatError, match=match):
        fn(make())
