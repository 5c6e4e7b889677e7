"""A second reference codec for MXFP8 and NVFP4 (CONTRACT 1-3), written plainly, for ``verify`` and the tests.

Why a second one: ``miles-lp verify`` and the format tests must be able to catch a wrong byte in the codecs
(``miles_lp.formats.mxfp8`` / ``nvfp4`` / ``bits``), so they must not reuse them. This module imports
nothing from ``miles_lp`` but the error type and is written differently on purpose:

* every fp32 operation of TE's rule is computed in float64 and rounded to fp32 by an explicit cast
  (``_r32``). For operands that are fp32 values a float64 product is exact and a float64 quotient is
  rounded once more; 53 >= 2 * 24 + 2, so rounding that to fp32 gives the correctly rounded fp32 result
  (no double-rounding error), i.e. what the GPU's fp32 ``mul.rn`` / ``div.rn`` give;
* E4M3, E2M1 and E8M0 encoding is a nearest-value search (``torch.searchsorted``) in decode tables built
  here from the format definitions, ties to the even code; no bit tricks, no torch float8 casts;
* no slicing, no compile, no fast paths. It is slower than the codecs (float64, ~5-10x): fine for
  ``verify`` and tests.

The rules (quoted from CONTRACT 1 and 2, which cite TE):

MXFP8, per block of 32 along K::

    amax = max |x_i| (NaN ignored);  v = fp32(amax * fp32(1/448))
    e    = E8M0 byte of v rounded UP to a power of two: 0 -> 0, inf -> 254, v <= 2^-127 -> 0, else
           clamp(ceil(log2 v) + 127, 0, 254)
    q_i  = e4m3_rne_satfinite(fp32(x_i * 2^(127 - e)))          (NaN -> 0x7F, |.| > 448 -> 448)

NVFP4, per block of 16 along K, one fp32 global amax ``amax_g``::

    S_enc = fp32(2688 / amax_g), min FLT_MAX; 1 if amax_g == 0 or S_enc == 0;  S_dec = fp32(1 / S_enc)
    sf    = e4m3_rne_satfinite(fp32(amax_b * fp32(S_enc * fp32(1/6))))
    enc   = min(fp32(1 / fp32(sf * S_dec)), FLT_MAX)  (FLT_MAX when sf * S_dec == 0)
    q     = e2m1_rne_satfinite(fp32(x * enc))                      (NaN -> +6, |.| > 6 -> 6)

Storage (CONTRACT 3): FP4 byte j = code(x[2j]) | code(x[2j+1]) << 4; compact scales ``[N, K/32]`` (MXFP8,
uint8 E8M0) and ``[N, K/16]`` (NVFP4, E4M3 bytes).
"""

from __future__ import annotations

import math
import struct

import torch

# ---- constants, each derived here and checked against its published bit pattern -------------------------


def _fp32_of(value: float) -> float:
    """``value`` rounded to fp32 (RNE; beyond the fp32 range: +-inf), as a Python float."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def _bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


FP32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]  # FLT_MAX
FP32_RCP_448 = _fp32_of(1 / 448)  # TE: Quantized_Limits<fp8e4m3>::max_norm_rcp
FP32_RCP_6 = _fp32_of(1 / 6)  # TE: the fp32 constant 1/6 of compute_decoding_scaling_factor
if _bits(FP32_RCP_448) != 0x3B124925 or _bits(FP32_RCP_6) != 0x3E2AAAAB:  # CONTRACT 1 and 2 quote these bits
    raise RuntimeError("oracle: fp32(1/448) or fp32(1/6) is not the constant CONTRACT 1/2 quotes")
E4M3_MAX, E2M1_MAX, NVFP4_DIVISOR = 448.0, 6.0, 2688.0
MX_BLOCK, NV_BLOCK = 32, 16


def _e4m3_value(code: int) -> float:
    """E4M3 (fn) byte 0x00..0x7E -> value: 4 exponent bits (bias 7), 3 mantissa bits, subnormals at exp 0."""
    exp, man = code >> 3, code & 7
    return man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_TABLE = torch.tensor([_e4m3_value(c) for c in range(0x7F)], dtype=torch.float64)  # increasing, 0..448
E2M1_TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)  # codes 0..7


def _r32(t: torch.Tensor) -> torch.Tensor:
    """Round a float64 tensor to fp32 and back (one RNE rounding; overflow -> inf, subnormals kept)."""
    return t.to(torch.float32).to(torch.float64)


def _nearest_code(a: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the table value nearest to each ``a`` (>= 0, <= table max), ties to the even index (RNE:
    in both tables the even index is the even mantissa)."""
    hi = torch.searchsorted(table, a).clamp(max=table.numel() - 1)  # first value >= a
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(take_hi, hi, lo)


def e4m3_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32-valued float64 tensor -> E4M3 bytes (uint8): RNE, satfinite (+-inf and |y| > 448 -> +-448),
    NaN -> 0x7F, the sign of zero kept (-0.0 -> 0x80)."""
    nan = torch.isnan(y)
    a = torch.where(nan, torch.zeros_like(y), y.abs()).clamp(max=E4M3_MAX)
    code = _nearest_code(a, E4M3_TABLE.to(y.device))
    code = code + torch.signbit(y).to(code.dtype) * 0x80
    return torch.where(nan, torch.full_like(code, 0x7F), code).to(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> float64 values (0x7F / 0xFF -> NaN)."""
    u = (b.view(torch.uint8) if b.dtype != torch.uint8 else b).to(torch.int64)
    mag = E4M3_TABLE.to(b.device)[(u & 0x7F).clamp(max=0x7E)]
    val = torch.where(u & 0x80 != 0, -mag, mag)
    return torch.where((u & 0x7F) == 0x7F, torch.full_like(val, math.nan), val)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """fp32-valued float64 tensor -> 4-bit E2M1 codes (uint8): RNE, satfinite to +-6, NaN -> +6 (code 7),
    the sign kept for zero (-0.0 and negatives that round to 0 -> 0x8)."""
    nan = torch.isnan(y)
    a = torch.where(nan, torch.zeros_like(y), y.abs()).clamp(max=E2M1_MAX)
    code = _nearest_code(a, E2M1_TABLE.to(y.device))
    code = code + torch.signbit(y).to(code.dtype) * 8
    return torch.where(nan, torch.full_like(code, 7), code).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int64)
    mag = E2M1_TABLE.to(codes.device)[c & 7]
    return torch.where(c & 8 != 0, -mag, mag)


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """fp32-valued float64 v >= 0 -> E8M0 byte of v rounded up to a power of two (CONTRACT 1): 0 -> 0,
    inf -> 254, NaN -> 255, v <= 2^-127 -> 0, otherwise clamp(ceil(log2 v) + 127, 0, 254)."""
    m, ex = torch.frexp(torch.where(torch.isfinite(v) & (v > 0), v, torch.ones_like(v)))  # v = m * 2^ex
    ceil_log2 = torch.where(m == 0.5, ex - 1, ex)  # exact: m == 0.5 iff v is a power of two
    e = (ceil_log2.to(torch.int64) + 127).clamp(0, 254)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 254), e)
    return torch.where(torch.isnan(v), torch.full_like(e, 255), e).to(torch.uint8)


def _nan_ignoring_abs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), torch.zeros_like(x), x.abs())


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, the even element in the low nibble (CONTRACT 3)."""
    c = codes.to(torch.int64)
    return (c[..., 0::2] + c[..., 1::2] * 16).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    p = packed.to(torch.int64)
    return torch.stack([p % 16, p // 16], dim=-1).flatten(-2).to(torch.uint8)


# ---- MXFP8 -----------------------------------------------------------------------------------------------
def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise MXFP8 of ``x`` [..., K] (K a multiple of 32): (data uint8 E4M3 bytes [..., K], scale uint8
    E8M0 [..., K/32])."""
    k = x.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"oracle MXFP8: last dim {k} is not a multiple of {MX_BLOCK}")
    xb = x.detach().to(torch.float64).unflatten(-1, (k // MX_BLOCK, MX_BLOCK))  # exact upcast
    amax = _nan_ignoring_abs(xb).amax(dim=-1)
    e = e8m0_round_up(_r32(amax * FP32_RCP_448))
    inv = torch.pow(2.0, 127 - e.to(torch.float64))  # exact power of two (2^-127 is an fp32 subnormal)
    q = e4m3_encode(_r32(xb * inv.unsqueeze(-1)))
    return q.flatten(-2), e


def mxfp8_decode(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 e4m3(q) * 2^(e - 127) (exact), from E4M3 bytes [..., K] and E8M0 bytes [..., K/32]."""
    s = torch.pow(2.0, scale.to(torch.float64) - 127).repeat_interleave(MX_BLOCK, dim=-1)
    return e4m3_decode(data) * s


# ---- NVFP4 -----------------------------------------------------------------------------------------------
def nvfp4_amax(*tensors: torch.Tensor) -> float:
    """The NaN-ignoring max |x| over all ``tensors`` (the global amax of one tensor or of a fused group)."""
    return max(float(_nan_ignoring_abs(t.detach().to(torch.float64)).max()) for t in tensors)


def nvfp4_global_scales(amax_g: float) -> tuple[float, float]:
    """(S_enc, S_dec) of a global amax (fp32 values as Python floats)."""
    if amax_g == 0:
        return 1.0, 1.0
    s_enc = _fp32_of(NVFP4_DIVISOR / amax_g) if amax_g < math.inf else 0.0  # 2688 / inf = 0
    if math.isinf(s_enc) or s_enc > FP32_MAX:
        s_enc = FP32_MAX
    if s_enc == 0:
        s_enc = 1.0
    return s_enc, _fp32_of(1.0 / s_enc)


def nvfp4_quantize(x: torch.Tensor, amax_g: float | None = None, block_2d: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """NVFP4 of ``x`` [rows, K] (K a multiple of 16) with one global amax (``None``: x's own):
    (data uint8 [rows, K/2], scale E4M3 bytes uint8 [rows, K/16], S_dec as a float).

    ``block_2d``: the block amax is that of its 16x16 tile (weights), repeated over the tile's rows.
    """
    rows, k = x.shape[-2], x.shape[-1]
    if k % NV_BLOCK or (block_2d and rows % NV_BLOCK):
        raise ValueError(f"oracle NVFP4: shape {tuple(x.shape)} is not a multiple of {NV_BLOCK}")
    x64 = x.detach().to(torch.float64)
    if amax_g is None:
        amax_g = nvfp4_amax(x64)
    s_enc, s_dec = nvfp4_global_scales(float(amax_g))
    sf_scale = _fp32_of(s_enc * FP32_RCP_6)
    xb = x64.unflatten(-1, (k // NV_BLOCK, NV_BLOCK))  # [rows, K/16, 16]
    amax_b = _nan_ignoring_abs(xb).amax(dim=-1)  # [rows, K/16]
    if block_2d:
        t = amax_b.unflatten(-2, (rows // NV_BLOCK, NV_BLOCK)).amax(dim=-2, keepdim=True)
        amax_b = t.expand(*t.shape[:-2], NV_BLOCK, t.shape[-1]).flatten(-3, -2)
    sf = e4m3_encode(_r32(amax_b * sf_scale))
    denom = _r32(e4m3_decode(sf) * s_dec)
    enc = torch.where(denom == 0, torch.full_like(denom, FP32_MAX), _r32(1.0 / denom).clamp(max=FP32_MAX))
    codes = e2m1_encode(_r32(xb * enc.unsqueeze(-1)))
    return pack_fp4(codes.flatten(-2)), sf, s_dec


def nvfp4_decode(data: torch.Tensor, scale: torch.Tensor, s_dec: float) -> torch.Tensor:
    """float64 e2m1(q) * sf * S_dec from packed bytes [..., K/2], E4M3 scale bytes [..., K/16]."""
    vals = e2m1_decode(unpack_fp4(data))
    return vals * e4m3_decode(scale).repeat_interleave(NV_BLOCK, dim=-1) * s_dec


# ---- block-FP8 input (DeepSeek-V3 checkpoints) -------------------------------------------------------------
def fp8_block_decode(data: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32(e4m3(q) * fp32(scale_inv)) per 128x128 tile (what the model holds), as an fp32 tensor."""
    m, k = data.shape[-2], data.shape[-1]
    s = _r32(scale_inv.detach().to(torch.float64)).repeat_interleave(block, -2).repeat_interleave(block, -1)
    return _r32(e4m3_decode(data) * s[..., :m, :k]).to(torch.float32)


# ---- FP8 blockwise (TE Float8BlockScaling; the checkpoints' 128x128 weight blocks) ----------------------------
def fp8_block_quantize(x: torch.Tensor, block: int = 128, pow2: bool = False,
                       value_for_inf: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``x`` [M, K] -> (E4M3 bytes [M, K] uint8, fp32 decode scales [ceil(M/b), ceil(K/b)]), TE's rule::

        amax  = max |x| over the tile (partial edge tiles: the elements they have; NaN ignored)
        scale = fp32(448 / amax); inf -> value_for_inf (the input dtype's max finite); amax 0 / inf / NaN -> 1
        pow2: scale -> 2^floor(log2 scale)  (TE clears the fp32 mantissa bits)
        scale_inv = fp32(1 / scale);  q = e4m3_rne_satfinite(fp32(x * scale))
    """
    if value_for_inf is None:
        value_for_inf = float(torch.finfo(x.dtype).max)
    x64 = x.detach().to(torch.float64)
    m, k = x64.shape
    mb, kb = -(-m // block), -(-k // block)
    padded = torch.zeros(mb * block, kb * block, dtype=torch.float64, device=x64.device)
    padded[:m, :k] = _nan_ignoring_abs(x64)
    amax = padded.reshape(mb, block, kb, block).amax(dim=(1, 3))  # [mb, kb]
    scale = _r32(E4M3_MAX / amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    degenerate = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    scale = torch.where(degenerate, torch.ones_like(scale), scale)
    if pow2:
        _, e = torch.frexp(scale)  # scale = f * 2^e, f in [0.5, 1)
        scale = torch.pow(2.0, (e - 1).to(torch.float64))
    scale_inv = _r32(1.0 / scale)
    per_elem = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:m, :k]
    return e4m3_encode(_r32(x64 * per_elem)), scale_inv.to(torch.float32)
