"""Bit-level helpers for E4M3, E2M1 and E8M0: exact encoders, decode tables, fp32 constants.

Two kinds of function live here:

* vectorised tensor encoders used by the codecs (``e4m3_satfinite``, ``e2m1_codes``, ``e8m0_round_up``,
  ``e8m0_inverse``, ``e8m0_value``, ``pack_fp4`` / ``unpack_fp4``); they run on CPU and CUDA and never
  depend on how a torch build casts out-of-range values;
* scalar oracles written with exact rational arithmetic (``e4m3_encode_exact``, ``e2m1_encode_exact``,
  ``e8m0_closed_form``, ``e8m0_bit_rule``), used by the tests and ``scripts/check_formats_cuda.py`` to
  check the vectorised encoders independently of torch's own casts.

The hardware conversions being emulated are PTX ``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even,
finite overflow and +-inf saturate to +-448, NaN becomes the canonical NaN 0x7F),
``cvt.rn.satfinite.e2m1x2.f32`` (round to nearest even, saturate to +-6, NaN becomes +6: see the note
on ``stochastic_round_fp4_e2m1`` in TE ``transformer_engine/common/util/ptx.cuh``) and
``cvt.rp.satfinite.ue8m0x2.f32`` / TE's software ``float_to_e8m0``
(``transformer_engine/common/util/ptx_arch_spec.cuh``).
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import torch

from miles_lp.formats.spec import E2M1_MAX, E4M3_MAX

# ---------------------------------------------------------------------------------------------------------
# fp32 constants, named by their bit patterns (CONTRACT 1 and 2: the kernels multiply by these constants)
# ---------------------------------------------------------------------------------------------------------
FP32_INV_448_BITS = 0x3B124925  # fp32(1/448): the MXFP8 scale multiplies amax by this (not a divide)
FP32_INV_6_BITS = 0x3E2AAAAB  # fp32(1/6): NVFP4's S_enc * fp32(1/6)
FP32_MAX_BITS = 0x7F7FFFFF  # FLT_MAX
FP32_2_POW_M127_BITS = 0x00400000  # 2^-127, an fp32 subnormal (E8M0 byte 0 decodes to it)

E4M3_NAN_BYTE = 0x7F  # canonical E4M3 NaN produced by cvt.rn.satfinite for any NaN input
E2M1_NAN_CODE = 0x7  # cvt.rn.satfinite.e2m1x2 maps NaN to +MAX_NORM (+6)


def f32_from_bits(bits: int) -> float:
    """The Python float whose fp32 bit pattern is ``bits`` (exact: every fp32 is a double)."""
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def f32_bits(value: float) -> int:
    """The fp32 bit pattern of ``value`` rounded to fp32 (round to nearest even)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def f32_round(value: float) -> float:
    """``value`` rounded to fp32 and back (RNE, subnormals kept, overflow to +-inf).

    Models one fp32 operation: the double result of +, *, / on fp32 operands rounded to fp32 equals the
    correctly rounded fp32 result (53 >= 2 * 24 + 2, so double rounding is innocuous).
    """
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


FP32_INV_448 = f32_from_bits(FP32_INV_448_BITS)
FP32_INV_6 = f32_from_bits(FP32_INV_6_BITS)
FP32_MAX = f32_from_bits(FP32_MAX_BITS)


def fp32_scalar(bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A 0-d fp32 tensor with exactly this bit pattern (no double->float rounding questions)."""
    return torch.tensor(bits, dtype=torch.int32, device=device).view(torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Decode tables
# ---------------------------------------------------------------------------------------------------------
# E2M1 code -> value; bit 3 is the sign (CONTRACT 2).
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e4m3_value(code: int) -> float:
    """Value of an E4M3 (fn: no inf, NaN = S.1111.111) byte; NaN for 0x7F / 0xFF."""
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> 3) & 0xF
    man = code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9  # subnormal: m/8 * 2^-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def e2m1_table(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16-entry E2M1 decode table as a tensor (index = 4-bit code)."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------------------
# Vectorised encoders (the codecs use these)
# ---------------------------------------------------------------------------------------------------------
def e4m3_satfinite(y: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """fp32 -> float8_e4m3fn with PTX ``cvt.rn.satfinite`` semantics: RNE, saturate to +-448, NaN -> 0x7F.

    Torch's own cast rounds to nearest even but its overflow behaviour has changed between versions
    (older c10 builds give NaN at |y| >= 480, 2.13 saturates, inf included), so we clamp first:
    clamping is exact because every value in (448, 464) rounds to 448 anyway. ``clamp`` keeps NaN and
    the cast keeps a NaN's sign (0xFF for -NaN), so every NaN is first replaced by the positive quiet
    NaN, which casts to the canonical 0x7F that the hardware produces for any NaN.
    ``inplace=True`` reuses ``y``'s storage for the intermediate steps (the caller owns ``y``).
    """
    if inplace:
        y = y.clamp_(-E4M3_MAX, E4M3_MAX).nan_to_num_(nan=math.nan)
    else:
        y = y.clamp(-E4M3_MAX, E4M3_MAX).nan_to_num(nan=math.nan)
    return y.to(torch.float8_e4m3fn)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit E2M1 codes (uint8 0..15), PTX ``cvt.rn.satfinite.e2m1x2.f32`` semantics.

    Round to nearest even on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}: the midpoints 0.25, 1.25, 2.5 and 5
    go down (to the even code), 0.75, 1.75 and 3.5 go up; magnitudes above 6 (and inf) saturate to 6.
    The sign bit is kept (so -0.0 and tiny negatives give 0x8). NaN (any payload, either sign) gives +6
    (code 0x7). ``y`` is not modified.

    Computed on the fp32 bit patterns, in integer ops only (torch's CPU fmin/fmax/clamp do not treat
    signalling NaNs consistently), 4x faster than seven comparisons. With a = min(|y|, 6) and
    E = floor(log2(max(a, 1))) in {0, 1, 2}, the E2M1 grid near a has step 2^(E-1); adding
    c = 2^(E+22) (whose fp32 ulp is that step) rounds a to the grid in ONE fp32 rounding (RNE), and
    k = bits(a + c) - bits(c) counts the steps: code = k + 2E (E = 0: k = RNE(2a); E = 1: RNE(a) + 2;
    E = 2: RNE(a/2) + 4; ties to the even code in each case). Equal to the comparison form for all
    2^32 fp32 bit patterns (checked once exhaustively; the tests compare random bit patterns).
    """
    yi = y.view(torch.int32) if y.dtype == torch.float32 else y.to(torch.float32).view(torch.int32)
    a = yi & 0x7FFFFFFF  # bits of |y|; a non-negative fp32 orders like its bits
    sign = (a - 0x7F800001) >> 31  # -1 unless NaN (a > 0x7F800000), 0 for NaN
    sign &= yi
    sign >>= 31
    sign &= 0x8  # sign bit -> 0x8, NaN -> 0
    a.clamp_(max=0x40C00000)  # 6.0: saturate |y| > 6, inf and NaN to 6 (code 7)
    c = a.clamp(min=0x3F800000)  # bits of max(a, 1)
    c &= 0x7F800000  # 2^E
    c += 22 << 23  # c = 2^(E + 22)
    k = torch.add(a.view(torch.float32), c.view(torch.float32), out=a.view(torch.float32)).view(torch.int32)
    k -= c  # steps of 2^(E-1) from 0, rounded to nearest even
    c -= 0x4A800000  # bits(2^(E+22)) - bits(2^22) = E << 23
    c >>= 22  # 2E
    k += c
    k |= sign
    return k.to(torch.uint8)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes (0..15) -> [..., K/2] bytes; byte j = code[2j] | code[2j+1] << 4 (CONTRACT 3).

    Read as little-endian int16 pairs (torch runs on little-endian hosts only), a pair is
    ``c0 | c1 << 8``; or-ing it with itself shifted right by 4 puts ``c1 << 4`` next to ``c0`` in the low byte.
    """
    pairs = codes.contiguous().view(torch.int16)  # [..., K/2]
    return (pairs | (pairs >> 4)).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] 4-bit codes (even element from the low nibble)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """fp32 v >= 0 -> E8M0 byte rounding v UP to a power of two (CONTRACT 1; TE ``float_to_e8m0``).

    NaN -> 0xFF; +inf -> 0xFE; 0 -> 0x00. Otherwise E = bits >> 23, M = bits & 0x7FFFFF and
    E += 1 if M > 0 and E != 0xFE and not (E == 0 and M <= 0x400000): a subnormal v <= 2^-127 stays at
    byte 0 (which means 2^-127), and byte 0xFE never rounds up into the NaN byte (satfinite).
    Source: ``float_to_e8m0`` in TE ``transformer_engine/common/util/ptx_arch_spec.cuh`` (the software
    path; on Blackwell the same function is ``cvt.rp.satfinite.ue8m0x2.f32``).

    Vectorised form, equal to the rule above for every fp32 v >= 0 (checked exhaustively in the tests):
    ``(bits + 0x7FFFFF) >> 23`` adds one to E exactly when M > 0; clamping at 0xFE gives satfinite
    (and maps inf to 0xFE); ``bits <= 0x400000`` is "E == 0 and M <= 0x400000"; NaN -> 0xFF.
    Negative v is outside the rule's domain (an amax is never negative) and gives 0.
    """
    b = v.view(torch.int32)
    e = ((b + 0x7FFFFF) >> 23).clamp_(max=0xFE)  # NaN overflows here; it is replaced below
    e = torch.where(b <= 0x400000, 0, e)
    e = torch.where(b > 0x7F800000, 0xFF, e)
    return e.to(torch.uint8)


def e8m0_inverse(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> fp32 2^(127 - e), the factor that multiplies the elements before the cast.

    Built from bits like TE's ``exp2f_rcp<float>`` (``transformer_engine/common/util/ptx.cuh``):
    e = 254 -> 2^-127 (the subnormal 0x00400000), e = 255 -> NaN, otherwise (254 - e) << 23, so
    e = 0 -> 2^127.
    """
    e32 = e.to(torch.int32)
    bits = torch.where(e32 == 254, FP32_2_POW_M127_BITS, (254 - e32) << 23)
    bits = torch.where(e32 == 255, 0x7FFFFFFF, bits)
    return bits.view(torch.float32)


def e8m0_value(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> fp32 2^(e - 127) (decode); e = 0 -> 2^-127 (subnormal), e = 255 -> NaN.

    Same construction as TE's ``ptx::exp2f`` (``transformer_engine/common/util/ptx.cuh``).
    """
    e32 = e.to(torch.int32)
    bits = torch.where(e32 == 0, FP32_2_POW_M127_BITS, e32 << 23)
    bits = torch.where(e32 == 255, 0x7FFFFFFF, bits)
    return bits.view(torch.float32)


def nan_ignoring_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN replaced by 0 and inf kept: an amax over it has CUDA ``fmaxf`` semantics (NaN ignored).

    No data-dependent branch (it also runs under ``torch.compile``); the NaN replacement is done in place on
    the fresh ``abs`` result (one temporary, not two).
    """
    return x.abs().nan_to_num_(nan=0.0, posinf=math.inf)


# ---------------------------------------------------------------------------------------------------------
# Scalar oracles (exact arithmetic; tests and the CUDA check script compare the encoders against these)
# ---------------------------------------------------------------------------------------------------------
_E4M3_POS = [(Fraction(e4m3_value(c)), c) for c in range(0x7F)]  # 0x00..0x7E, increasing


def e4m3_encode_exact(x: float) -> int:
    """Exact RNE satfinite fp -> E4M3 byte of the real number ``x`` (no fp32 step)."""
    if math.isnan(x):
        return E4M3_NAN_BYTE
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    if math.isinf(x):
        return sign | 0x7E
    a = Fraction(abs(x))
    if a >= _E4M3_POS[-1][0]:
        return sign | 0x7E
    lo, hi = 0, len(_E4M3_POS) - 1  # invariant: value[lo] <= a < value[hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _E4M3_POS[mid][0] <= a:
            lo = mid
        else:
            hi = mid
    v_lo, c_lo = _E4M3_POS[lo]
    v_hi, c_hi = _E4M3_POS[hi]
    d_lo, d_hi = a - v_lo, v_hi - a
    if d_lo < d_hi or (d_lo == d_hi and c_lo % 2 == 0):
        return sign | c_lo
    return sign | c_hi


def e2m1_encode_exact(x: float) -> int:
    """Exact RNE satfinite real -> E2M1 code (NaN -> +6 as the hardware does)."""
    if math.isnan(x):
        return E2M1_NAN_CODE
    sign = 0x8 if math.copysign(1.0, x) < 0 else 0
    a = Fraction(abs(x)) if not math.isinf(x) else Fraction(E2M1_MAX) + 1
    grid = [Fraction(v) for v in E2M1_VALUES[:8]]
    best = 0
    for c in range(8):
        d_best, d_c = abs(a - grid[best]), abs(a - grid[c])
        if d_c < d_best or (d_c == d_best and c % 2 == 0 and best % 2 == 1):
            best = c
    return sign | best


def e8m0_bit_rule(v: float) -> int:
    """TE's ``float_to_e8m0`` on one fp32 value (scalar, from the bit pattern)."""
    if math.isnan(v):
        return 0xFF
    if math.isinf(v):
        return 0xFE
    if v == 0.0:
        return 0x00
    bits = f32_bits(v)
    exp, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if man > 0 and exp != 0xFE and not (exp == 0 and man <= 0x400000):
        exp += 1
    return exp


def e8m0_closed_form(amax: float) -> int:
    """clamp(ceil(log2(amax / 448)), -127, 127) + 127 computed exactly (Fractions, no fp rounding)."""
    if amax == 0:
        return 0
    q = Fraction(amax) / Fraction(int(E4M3_MAX))
    k = q.numerator.bit_length() - q.denominator.bit_length()  # 2^(k-1) < q < 2^(k+1)
    while Fraction(2) ** k < q:  # smallest k with 2^k >= q
        k += 1
    while Fraction(2) ** (k - 1) >= q:
        k -= 1
    return max(-127, min(127, k)) + 127
