"""Bit helpers against exact oracles: E8M0 exhaustively over bf16 amax, E4M3 / E2M1 RNE, constants."""

from __future__ import annotations

import math

import pytest
import torch

from miles_lp.formats import bits


def _all_positive_finite_bf16() -> torch.Tensor:
    """Every positive finite bf16 (subnormals included): bit patterns 0x0001..0x7F7F, as fp32."""
    return torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def test_fp32_constants_have_the_contract_bit_patterns():
    assert bits.f32_bits(1 / 448) == bits.FP32_INV_448_BITS == 0x3B124925
    assert bits.f32_bits(1 / 6) == bits.FP32_INV_6_BITS == 0x3E2AAAAB
    assert bits.fp32_scalar(bits.FP32_INV_448_BITS).item() == bits.FP32_INV_448
    # 2^-127 is an fp32 subnormal: the bits give it exactly
    assert bits.f32_from_bits(bits.FP32_2_POW_M127_BITS) == 2.0**-127
    assert bits.FP32_MAX == torch.finfo(torch.float32).max


def test_e8m0_exhaustive_over_every_positive_finite_bf16_amax():
    amax = _all_positive_finite_bf16()  # 32639 values
    v = amax * bits.fp32_scalar(bits.FP32_INV_448_BITS)
    got = bits.e8m0_round_up(v).tolist()
    closed = [bits.e8m0_closed_form(a) for a in amax.tolist()]  # exact rational arithmetic
    rule = [bits.e8m0_bit_rule(x) for x in v.tolist()]  # TE's scalar float_to_e8m0
    assert got == rule
    assert got == closed


def test_e8m0_vectorised_form_equals_the_bit_rule_on_fp32_edges():
    exps = list(range(0, 256))
    mans = [0, 1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF]
    vals = [(e << 23) | m for e in exps for m in mans]
    v = torch.tensor(vals, dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = bits.e8m0_round_up(v).tolist()
    want = [bits.e8m0_bit_rule(x) for x in v.tolist()]
    assert got == want
    assert bits.e8m0_round_up(torch.tensor([math.nan, math.inf, 0.0])).tolist() == [0xFF, 0xFE, 0x00]


def test_e8m0_inverse_and_value_for_all_256_bytes():
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    inv = bits.e8m0_inverse(e).tolist()
    val = bits.e8m0_value(e).tolist()
    for b in range(255):
        assert inv[b] == 2.0 ** (127 - b), b  # includes 2^127 (b=0) and the subnormal 2^-127 (b=254)
        assert val[b] == 2.0 ** (b - 127) if b else val[b] == 2.0**-127
    assert math.isnan(inv[255]) and math.isnan(val[255])


def _e4m3_bytes(y: torch.Tensor) -> list[int]:
    return bits.e4m3_satfinite(y).view(torch.uint8).tolist()


def test_e4m3_satfinite_equals_exact_rne_on_every_bf16_and_every_midpoint():
    pos = _all_positive_finite_bf16()
    y = torch.cat([pos, -pos])
    assert _e4m3_bytes(y) == [bits.e4m3_encode_exact(v) for v in y.tolist()]
    # exact midpoints between neighbouring E4M3 values, and one fp32 ulp either side
    grid = [bits.e4m3_value(c) for c in range(0x7F)]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)] + [464.0]
    m = torch.tensor(mids, dtype=torch.float32)
    cases = torch.cat([m, torch.nextafter(m, torch.zeros_like(m)), torch.nextafter(m, m * 2)])
    cases = torch.cat([cases, -cases])
    assert _e4m3_bytes(cases) == [bits.e4m3_encode_exact(v) for v in cases.tolist()]


def test_e4m3_satfinite_specials():
    y = torch.tensor([448.0, 464.0, 480.0, 1e30, math.inf, -math.inf, math.nan, -math.nan, -0.0, 2.0**-10,
                      3 * 2.0**-10, 2.0**-127])  # 3 * 2^-10 = 1.5 min-subnormals: a tie, to even (2)
    # saturation to +-448 (0x7E / 0xFE), every NaN -> 0x7F, -0 keeps its sign, RNE on subnormals
    assert _e4m3_bytes(y) == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x7F, 0x80, 0x00, 0x02, 0x00]


def test_e2m1_codes_equal_exact_rne_including_every_tie():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    vals = sorted({*ties, *bits.E2M1_VALUES[:8], 5.5, 6.0, 6.5, 100.0, 1e-30, 0.2499, 0.2501, 4.99, 5.01})
    y = torch.tensor(vals + [-v for v in vals] + [math.inf, -math.inf, math.nan, -math.nan], dtype=torch.float32)
    got = bits.e2m1_codes(y).tolist()
    assert got == [bits.e2m1_encode_exact(v) for v in y.tolist()]
    # the ties by hand: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert bits.e2m1_codes(torch.tensor(ties)).tolist() == [0, 2, 2, 4, 4, 6, 6]
    assert bits.e2m1_codes(torch.tensor([math.nan, 7.0, -7.0, -0.0])).tolist() == [0x7, 0x7, 0xF, 0x8]


@pytest.mark.parametrize("k", [2, 16, 64])
def test_fp4_pack_round_trip_and_nibble_order(k):
    codes = torch.randint(0, 16, (3, k), dtype=torch.uint8)
    packed = bits.pack_fp4(codes)
    assert packed.shape == (3, k // 2)
    assert packed[0, 0].item() == codes[0, 0].item() | (codes[0, 1].item() << 4)  # even element low nibble
    assert torch.equal(bits.unpack_fp4(packed), codes)
