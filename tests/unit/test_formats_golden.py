"""NVFP4 / MXFP8 golden vectors at the points where TE's fp32 operation order changes a byte,
derived by exact rational arithmetic (``fractions.Fraction``) written here from CONTRACT 1-2, not by the code
under test; and the second reference codec (``miles_lp.formats.oracle``) against the same derivation.

Each TE fp32 operation is the exact rational result rounded once to fp32 (``r32``: what IEEE-754 ``mul.rn`` /
``div.rn`` return). Every golden vector is checked twice: (1) it IS an edge: the alternative order a careless
implementation would use (``S_enc / 6`` for ``S_enc * fp32(1/6)``, ``S_enc / sf`` for ``1 / (sf * S_dec)``,
``amax / 2688`` for ``1 / S_enc``, round-half-up for RNE) gives a different byte; (2) the codec and the oracle
give TE's byte. The vectors' fp32 bit patterns were found by a search with these same helpers.
"""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest
import torch

from miles_lp.formats import nvfp4, oracle, quantize_mxfp8, quantize_nvfp4

# ---------------------------------------------------------------------------------------------------------
# exact arithmetic (no miles_lp import)
# ---------------------------------------------------------------------------------------------------------

INF = math.inf
FLT_MAX = Fraction((2**24 - 1) * 2**104)  # (2 - 2^-23) * 2^127
_MIN_EXP = -126  # fp32: smallest normal exponent; subnormal spacing 2^-149


def r32(q) -> Fraction | float:
    """The fp32 nearest to the rational ``q`` (RNE; subnormals; >= 2^128 after rounding -> +-inf)."""
    if isinstance(q, float) and math.isinf(q):
        return q
    q = Fraction(q)
    if q == 0:
        return Fraction(0)
    sign = -1 if q < 0 else 1
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^e <= a < 2^(e+2)
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (max(e, _MIN_EXP) - 23)
    m = a / ulp
    n = m.numerator // m.denominator
    rem = m - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    v = n * ulp
    if v >= Fraction(2) ** 128:
        return sign * INF
    return sign * v


def f32_bits(v) -> int:
    return struct.unpack("<I", struct.pack("<f", float(v)))[0]


def from_bits(b: int) -> Fraction:
    return Fraction(struct.unpack("<f", struct.pack("<I", b))[0])


def next_up(v: Fraction) -> Fraction:
    return from_bits(f32_bits(v) + 1) if v > 0 else from_bits(f32_bits(v) - 1)


def next_down(v: Fraction) -> Fraction:
    return from_bits(f32_bits(v) - 1) if v > 0 else from_bits(f32_bits(v) + 1)


R448 = r32(Fraction(1, 448))  # TE's fp32(1/448)
R6 = r32(Fraction(1, 6))  # TE's fp32(1/6)

# E4M3 (fn): codes 0x00..0x7E, increasing; E2M1 codes 0..7
E4M3 = [Fraction(c & 7, 8) * Fraction(2) ** -6 if c >> 3 == 0 else (1 + Fraction(c & 7, 8)) * Fraction(2) ** ((c >> 3) - 7)
        for c in range(0x7F)]
E2M1 = [Fraction(v) for v in ("0", "1/2", "1", "3/2", "2", "3", "4", "6")]


def _nearest(a: Fraction, table: list[Fraction]) -> int:
    best = 0
    for c, v in enumerate(table):
        d, db = abs(a - v), abs(a - table[best])
        if d < db or (d == db and c % 2 == 0):
            best = c
    return best


def e4m3(v, neg: bool | None = None) -> int:
    """RNE satfinite; the sign bit for negatives (``neg``: the sign of a product that rounded to zero)."""
    neg = v < 0 if neg is None else neg
    a = E4M3[-1] if isinstance(v, float) and math.isinf(v) else min(abs(Fraction(v)), E4M3[-1])
    return _nearest(a, E4M3) | (0x80 if neg else 0)


def e2m1(v, neg: bool | None = None) -> int:
    neg = v < 0 if neg is None else neg
    a = E2M1[-1] if isinstance(v, float) and math.isinf(v) else min(abs(Fraction(v)), E2M1[-1])
    return _nearest(a, E2M1) | (8 if neg else 0)


def fmin_max(v):
    return FLT_MAX if v == INF or v > FLT_MAX else v


# ---- TE's NVFP4 (CONTRACT 2) and the alternatives a careless implementation would use -------------------
def s_enc_of(amax_g: Fraction):
    if amax_g == 0:
        return Fraction(1)
    s = fmin_max(r32(Fraction(2688) / amax_g))
    return Fraction(1) if s == 0 else s


def nvfp4_block(vals, amax_g, *, sf_scale_rule="te", enc_rule="te"):
    """(scale byte, codes, S_dec) of one block of 16 rationals, TE's rule by default.

    ``sf_scale_rule``: "te" fp32(S_enc * fp32(1/6)); "div" fp32(S_enc / 6) (one rounding of the exact quotient).
    ``enc_rule``: "te" fp32(1 / fp32(sf * S_dec)); "senc_div" fp32(S_enc / sf).
    """
    s_enc = s_enc_of(amax_g)
    s_dec = r32(1 / s_enc)
    sf_scale = r32(s_enc * R6) if sf_scale_rule == "te" else r32(s_enc / 6)
    amax_b = max(abs(Fraction(v)) for v in vals)
    sf = e4m3(r32(amax_b * sf_scale))
    sfv = E4M3[sf]
    if enc_rule == "te":
        denom = r32(sfv * s_dec)
        enc = FLT_MAX if denom == 0 else fmin_max(r32(1 / denom))
    else:
        enc = FLT_MAX if sfv == 0 else fmin_max(r32(s_enc / sfv))
    codes = [e2m1(r32(Fraction(v) * enc), neg=v < 0) for v in vals]  # fp32 keeps -0's sign
    return sf, codes, s_dec


def pack(codes: list[int]) -> list[int]:
    return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]


# ---- MXFP8 (CONTRACT 1) ------------------------------------------------------------------------------
def e8m0_up(v) -> int:
    """E8M0 byte of v rounded up to a power of two (0 -> 0, inf -> 254, v <= 2^-127 -> 0)."""
    if v == INF:
        return 254
    if v == 0:
        return 0
    k = 0
    while Fraction(2) ** k < v:
        k += 1
    while Fraction(2) ** (k - 1) >= v:
        k -= 1
    return max(0, min(254, k + 127))


def mxfp8_block(vals, *, rcp_rule="te"):
    """(scale byte, codes) of one block of 32 rationals. ``rcp_rule``: "te" fp32(amax * fp32(1/448)), "div"
    fp32(amax / 448)."""
    amax = max(abs(Fraction(v)) for v in vals)
    v = r32(amax * R448) if rcp_rule == "te" else r32(amax / 448)
    e = e8m0_up(v)
    inv = Fraction(2) ** (127 - e)
    return e, [e4m3(r32(Fraction(x) * inv), neg=x < 0) for x in vals]


# ---------------------------------------------------------------------------------------------------------
# the vectors
# ---------------------------------------------------------------------------------------------------------
def _f(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _row(amax_g: float, block1: list[float]) -> list[float]:
    """Two blocks: block 0 holds the global amax (so the codec derives it itself), block 1 the probe."""
    return [amax_g] + [0.0] * 15 + block1 + [0.0] * (16 - len(block1))


def _expected(row: list[float], **rules) -> tuple[list[int], list[int], Fraction]:
    amax_g = max(abs(Fraction(v)) for v in row)
    s0, c0, s_dec = nvfp4_block(row[:16], amax_g, **rules)
    s1, c1, _ = nvfp4_block(row[16:], amax_g, **rules)
    return [s0, s1], pack(c0 + c1), s_dec


def _check_codecs(row: list[float], scales: list[int], data: list[int], s_dec: Fraction) -> None:
    x = torch.tensor([row], dtype=torch.float32)
    q = quantize_nvfp4(x)  # on CPU: the fused native kernel where it builds (formats.native)
    assert q.scale.view(torch.uint8).tolist() == [scales], "codec scale bytes"
    assert q.data.tolist() == [data], "codec data bytes"
    assert Fraction(q.global_scale.item()) == s_dec, "codec S_dec"
    cd, cs, cg, _ = nvfp4.nvfp4_core(x)  # the torch rule (what CUDA and train.fused compile)
    assert cs.view(torch.uint8).tolist() == [scales] and cd.tolist() == [data] and Fraction(cg.item()) == s_dec, \
        "nvfp4_core"
    d, s, g = oracle.nvfp4_quantize(x)
    assert s.tolist() == [scales] and d.tolist() == [data] and Fraction(g) == s_dec, "oracle"


# (amax_g bits, block amax bits): fp32(S_enc * fp32(1/6)) != fp32(S_enc / 6) and the block scale byte changes
SF_SCALE_ORDER = [(0x41571F0D, 0x3D029BFF), (0x41FDFF91, 0x3D50A437), (0x41ED2B2A, 0x3FB1E060),
                  (0x428C9D35, 0x3E670244)]


@pytest.mark.parametrize("amax_bits,amax_b_bits", SF_SCALE_ORDER, ids=[hex(a) for a, _ in SF_SCALE_ORDER])
def test_sf_scale_is_s_enc_times_fp32_one_sixth(amax_bits, amax_b_bits):
    amax_g, amax_b = _f(amax_bits), _f(amax_b_bits)
    s_enc = s_enc_of(Fraction(amax_g))
    assert r32(s_enc * R6) != r32(s_enc / 6)  # an S_enc where the order matters
    row = _row(amax_g, [amax_b, -amax_b / 3, amax_b / 7])
    te, alt = _expected(row), _expected(row, sf_scale_rule="div")
    assert te[0][1] != alt[0][1], "the vector must change the block scale byte"
    _check_codecs(row, *te)


# block amax whose scaled value fp32(amax_b * fp32(S_enc / 6)) is EXACTLY halfway between two E4M3 values:
# (amax_g, amax_b, lower code of the tie). S_enc = 1 (amax_g = 2688) and three S_enc from a search.
E4M3_TIES = [(2688.0, 0x40CC0000, 0x38), (2688.0, 0x40E3FFFF, 0x39), (2688.0, 0x42640000, 0x51),
             (2688.0, 0x3E63FFFF, 0x11), (_f(0x436EBA07), 0x42E63362, 0x75), (_f(0x441C860E), 0x3FBE107E, 0x38)]


@pytest.mark.parametrize("amax_g,amax_b_bits,lo", E4M3_TIES, ids=[f"{a:g}-{hex(b)}" for a, b, _ in E4M3_TIES])
def test_block_scale_at_an_e4m3_tie_rounds_to_even(amax_g, amax_b_bits, lo):
    amax_b = _f(amax_b_bits)
    sf_scale = r32(s_enc_of(Fraction(amax_g)) * R6)
    y = r32(Fraction(amax_b) * sf_scale)
    assert y == (E4M3[lo] + E4M3[lo + 1]) / 2, "the vector must sit exactly on a tie"
    row = _row(amax_g, [amax_b, amax_b / 2, -amax_b / 5])
    scales, data, s_dec = _expected(row)
    assert scales[1] == (lo if lo % 2 == 0 else lo + 1)  # RNE; round-half-up would give lo + 1 for even lo
    _check_codecs(row, scales, data, s_dec)


# (amax_g bits, block scale byte sf, element bits): fp32(1 / fp32(sf * S_dec)) != fp32(S_enc / sf) and the
# element's E2M1 code changes
RECIPROCAL = [(0x42B797B8, 0x6E, 0x3F74CA4B), (0x41D16F4A, 0x7E, 0x3F8B9F87), (0x4024B7B2, 0x5A, 0x3B9CDFB6),
              (0x41D974DB, 0x1D, 0x39869DAD)]


def _amax_b_for(sf: int, amax_g: float) -> float:
    """An fp32 block amax whose TE block scale byte is ``sf``."""
    sf_scale = r32(s_enc_of(Fraction(amax_g)) * R6)
    a = r32(E4M3[sf] / sf_scale)
    for _ in range(8):
        if e4m3(r32(a * sf_scale)) == sf:
            return float(a)
        a = next_down(a) if e4m3(r32(a * sf_scale)) > sf else next_up(a)
    raise AssertionError("no block amax found for the scale byte")


@pytest.mark.parametrize("amax_bits,sf,x_bits", RECIPROCAL, ids=[hex(a) for a, _, _ in RECIPROCAL])
def test_element_encode_scale_is_the_reciprocal_of_sf_times_s_dec(amax_bits, sf, x_bits):
    amax_g, x = _f(amax_bits), _f(x_bits)
    amax_b = _amax_b_for(sf, amax_g)
    assert abs(x) <= amax_b <= amax_g
    row = _row(amax_g, [amax_b, x, -x])
    te, alt = _expected(row), _expected(row, enc_rule="senc_div")
    assert te[0] == alt[0] and te[1] != alt[1], "the vector must change an element code, not a scale"
    _check_codecs(row, *te)


# S_dec = fp32(1 / S_enc), which differs from fp32(amax / 2688) for these amax
S_DEC = [0x42792CFF, 0x42945CD1, 0x4293FC24]


@pytest.mark.parametrize("amax_bits", S_DEC, ids=[hex(a) for a in S_DEC])
def test_global_decode_scale_is_the_reciprocal_of_s_enc(amax_bits):
    amax_g = _f(amax_bits)
    s_dec = r32(1 / s_enc_of(Fraction(amax_g)))
    assert s_dec != r32(Fraction(amax_g) / 2688)
    row = _row(amax_g, [amax_g / 3, 1.0])
    _check_codecs(row, *_expected(row))


def test_reciprocal_overflow_and_zero_scale_saturate_the_encode_scale_at_flt_max():
    """amax_g = 1e-38: S_enc clamps at FLT_MAX, S_dec = fp32(1 / FLT_MAX) is subnormal, and block 1's
    fp32(sf * S_dec) is so small that 1 / it overflows (inf -> FLT_MAX). A block whose scale rounds to 0 also
    gets FLT_MAX (its non-zero elements saturate to +-6)."""
    amax_g = float(r32(Fraction(1, 10**38)))
    assert s_enc_of(Fraction(amax_g)) == FLT_MAX
    row = _row(amax_g, [amax_g / 2, -amax_g / 3, amax_g / 1e6])
    scales, data, s_dec = _expected(row)
    assert r32(1 / r32(E4M3[scales[1]] * s_dec)) == INF  # the overflow branch is taken
    _check_codecs(row, scales, data, s_dec)
    big = 2688.0  # S_enc = 1: a block of 1e-4 has scale 0 -> enc = FLT_MAX -> its elements saturate
    row = _row(big, [1e-4, -1e-4, 5e-5])
    scales, data, s_dec = _expected(row)
    assert scales[1] == 0 and data[8] == 0x7 | 0xF << 4
    _check_codecs(row, scales, data, s_dec)


def test_exact_reference_equals_the_oracle_and_the_codec_on_random_blocks():
    """The Fraction reference and both codecs agree on 64 random blocks over a wide range of magnitudes."""
    rnd = random.Random(7)
    rows = [[rnd.gauss(0, 1) * 10 ** rnd.randint(-30, 30) for _ in range(16)] for _ in range(64)]
    x = torch.tensor(rows, dtype=torch.float32)
    fx = [[Fraction(v) for v in r] for r in x.tolist()]
    amax_g = max(abs(v) for r in fx for v in r)
    want_s, want_c = [], []
    for r in fx:
        s, c, s_dec = nvfp4_block(r, amax_g)
        want_s.append([s])
        want_c.append(pack(c))
    q = quantize_nvfp4(x)
    assert q.scale.view(torch.uint8).tolist() == want_s and q.data.tolist() == want_c
    d, s, g = oracle.nvfp4_quantize(x)
    assert s.tolist() == want_s and d.tolist() == want_c and Fraction(g) == s_dec
    xm = torch.tensor([[rnd.gauss(0, 1) * 10 ** rnd.randint(-30, 30) for _ in range(32)] for _ in range(16)])
    qm, (dm, sm) = quantize_mxfp8(xm), oracle.mxfp8_quantize(xm)
    for i, r in enumerate(xm.tolist()):
        e, codes = mxfp8_block([Fraction(v) for v in r])
        assert qm.scale[i].tolist() == [e] == sm[i].tolist()
        assert qm.data[i].view(torch.uint8).tolist() == codes == dm[i].tolist()


def test_exact_helpers_themselves():
    """The helpers against hand facts: fp32 rounding, the constants' bits, E4M3/E2M1 ties."""
    assert f32_bits(R6) == 0x3E2AAAAB and f32_bits(R448) == 0x3B124925
    assert r32(Fraction(1, 3)) == Fraction(_f(0x3EAAAAAB)) and r32(Fraction(2) ** -150) == 0  # tie to 0 (even)
    assert r32(Fraction(3, 2) * Fraction(2) ** -149) == Fraction(2) ** -148  # subnormal tie to even
    assert r32(FLT_MAX + (Fraction(2) ** 104) / 2) == INF and r32(FLT_MAX) == FLT_MAX
    assert e4m3(Fraction(1) + Fraction(1, 16)) == 0x38 and e4m3(Fraction(1) + Fraction(3, 16)) == 0x3A
    assert e4m3(Fraction(500)) == 0x7E and e4m3(Fraction(-1, 2**12)) == 0x80
    assert [e2m1(Fraction(v)) for v in ("1/4", "3/4", "5/4", "7/4", "5/2", "7/2", "5", "7")] == [0, 2, 2, 4, 4, 6, 6, 7]
    assert e8m0_up(Fraction(1)) == 127 and e8m0_up(Fraction(2) ** -127) == 0 and e8m0_up(Fraction(3, 2)) == 128
    assert math.isinf(INF)
