"""Triton kernels for MXFP8 / NVFP4 (CONTRACT 1-3), byte-identical to the reference codecs.

Only ``miles_lp.formats.kernels`` imports this module (through ``_load``): once normally (CUDA) and, when
asked, once more with ``TRITON_INTERPRET=1`` (Triton's interpreter, CPU tensors, numpy) for the CPU tests.

Exactness: every rounding step is an IEEE fp32 operation or integer arithmetic on bit patterns, never a
conversion whose rounding or saturation a backend may choose:

* E4M3, E2M1 and BF16 encodes are integer/bit code (``_e4m3_code``, ``_e2m1_code``, ``_bf16_bits``): the
  interpreter's float8/bf16 casts do not round to nearest even, and the encode must not depend on them;
  the one float operation inside each encoder is an fp32 add whose RNE rounding IS the encode's rounding
  (the ``bits.e2m1_codes`` trick: adding 2^(E+p) rounds to the grid step in one operation);
* divisions (NVFP4's ``2688 / amax``, ``1 / S_enc``, ``1 / (sf * S_dec)``) use ``tl.math.div_rn``
  (Triton's ``/`` is the approximate ``div.full.f32``);
* plain fp32 multiplies compile to ``mul.rn.f32`` without flush-to-zero (Triton's ``enable_reflect_ftz``
  only concerns libdevice calls, which these kernels do not make); MXFP8's inverse scale 2^-127 is an
  fp32 subnormal, so this matters, and the ``subnormal`` / ``inf_huge`` test cases check it;
* no ``a * b + c`` whose contraction into an FMA would change a rounding (the adds in the encoders take
  operands rebuilt from bit patterns).

NaN-ignoring amax (CUDA ``fmaxf`` semantics): NaN is replaced by 0 before every max (inf kept).
Inputs: bf16 arrives as its int16 bit pattern (widened by a shift, exact), fp32 / fp16 as themselves.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from miles_lp.config import switch
from miles_lp.formats import bits

# Hardware conversions on CUDA (sm_89+: cvt.rn.satfinite.e4m3x2.f32, cvt.rn.f16x2.e4m3x2, cvt.rn.bf16.f32,
# max.f32 / min.f32 that ignore NaN); the integer forms in Triton's interpreter, whose float8 / bf16 casts do
# not round to nearest even and whose max propagates NaN. Fixed when this module is imported (kernels.runtime.load,
# at the process's first kernel use: after a run has applied its recipe's runtime section);
# runtime.kernels_hw: false runs the integer forms on CUDA too (same bytes, more instructions: for A/B checks).
HW = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes")
                  and switch("kernels_hw"))
INV448 = tl.constexpr(bits.FP32_INV_448)  # 0x3B124925, exactly an fp32 value
INV6 = tl.constexpr(bits.FP32_INV_6)  # 0x3E2AAAAB
FLT_MAX = tl.constexpr(bits.FP32_MAX)
TWO_M9 = tl.constexpr(2.0 ** -9)


# ---------------------------------------------------------------------------------------------------------
# Element helpers
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _load_f32(ptr, offs, mask, IN_KIND: tl.constexpr, EVICT: tl.constexpr = 0):
    """IN_KIND 1: bf16 passed as int16 bits (widened exactly); 0: fp32 / fp16 loaded and upcast.
    EVICT 1: an evict-first load (the input is read once; a launch-shape option, ``CONFIG[..]["EVICT"]``)."""
    if EVICT:
        if IN_KIND == 1:
            b = tl.load(ptr + offs, mask=mask, other=0, eviction_policy="evict_first")
            if HW:
                return b.to(tl.bfloat16, bitcast=True).to(tl.float32)
            else:
                return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            return tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    if IN_KIND == 1:
        b = tl.load(ptr + offs, mask=mask, other=0)
        if HW:
            return b.to(tl.bfloat16, bitcast=True).to(tl.float32)
        else:
            return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_f32_full(ptr, offs, IN_KIND: tl.constexpr, EVICT: tl.constexpr = 0):
    """``_load_f32`` without a mask (every element exists: no zero fill, no predicates)."""
    if IN_KIND == 1:
        if EVICT:
            b = tl.load(ptr + offs, eviction_policy="evict_first")
        else:
            b = tl.load(ptr + offs)
        if HW:
            return b.to(tl.bfloat16, bitcast=True).to(tl.float32)
        else:
            return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        if EVICT:
            return tl.load(ptr + offs, eviction_policy="evict_first").to(tl.float32)
        else:
            return tl.load(ptr + offs).to(tl.float32)


@triton.jit
def _abs_nz(x):
    """|x| for a NaN-ignoring max (CUDA fmaxf): on CUDA max.f32 ignores NaN itself (``_amax_fix`` then maps
    an all-NaN block's NaN to 0); in the interpreter (numpy max propagates NaN) NaN -> 0 here. inf kept."""
    a = tl.abs(x)
    if not HW:
        a = tl.where(a == a, a, 0.0)
    return a


@triton.jit
def _amax_fix(amax):
    """A block amax from ``_abs_nz`` values: NaN (a block of only NaN, CUDA) -> 0, as fmaxf from 0 gives."""
    if HW:
        amax = tl.where(amax == amax, amax, 0.0)
    return amax


@triton.jit
def _e4m3_byte(y):
    """fp32 -> E4M3 byte (uint8), cvt.rn.satfinite.e4m3 semantics: the instruction on CUDA, else _e4m3_code."""
    if HW:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return _e4m3_code(y).to(tl.uint8)


@triton.jit
def _e4m3_byte_value(q):
    """E4M3 byte (uint8) -> fp32: cvt.rn.f16x2.e4m3x2 (exact) on CUDA, else _e4m3_value."""
    if HW:
        return q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return _e4m3_value(q.to(tl.int32))


@triton.jit
def _e8m0_round_up(v):
    """fp32 v >= 0 -> E8M0 byte (int32), TE float_to_e8m0 (bits.e8m0_round_up)."""
    b = v.to(tl.int32, bitcast=True)
    e = tl.minimum((b + 0x7FFFFF) >> 23, 0xFE)
    e = tl.where(b <= 0x400000, 0, e)
    return tl.where(b > 0x7F800000, 0xFF, e)


@triton.jit
def _e8m0_inverse(e):
    """E8M0 byte -> fp32 2^(127 - e) (254 -> the subnormal 2^-127; 255 -> NaN)."""
    b = tl.where(e == 254, 0x400000, (254 - e) << 23)
    b = tl.where(e == 255, 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_value(e):
    """E8M0 byte -> fp32 2^(e - 127) (0 -> the subnormal 2^-127; 255 -> NaN)."""
    b = tl.where(e == 0, 0x400000, e << 23)
    b = tl.where(e == 255, 0x7FFFFFFF, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_code(y):
    """fp32 -> E4M3 byte (int32 0..255): RNE, saturate to +-448, NaN -> 0x7F (cvt.rn.satfinite.e4m3).

    With a = min(|y|, 448) and E = max(floor(log2 a), -6), E4M3's step near a is 2^(E-3); c = 2^(E+20) has
    that ulp, so fp32(a + c) rounds a to the grid (RNE) and k = bits(a + c) - bits(c) counts the steps:
    code = 8 (E + 6) + k (a carry into the next binade lands on the right code). E = -6 covers the
    subnormals (step 2^-9 too).
    """
    yb = y.to(tl.int32, bitcast=True)
    sign = (yb >> 24) & 0x80
    ab = yb & 0x7FFFFFFF
    nan = ab > 0x7F800000
    ab = tl.minimum(ab, 0x43E00000)  # 448.0 (inf and NaN too; NaN is replaced below)
    eb = tl.maximum(ab >> 23, 121)  # biased max(E, -6)
    cb = (eb + 20) << 23
    s = ab.to(tl.float32, bitcast=True) + cb.to(tl.float32, bitcast=True)
    k = s.to(tl.int32, bitcast=True) - cb
    code = ((eb - 121) * 8 + k) | sign
    return tl.where(nan, 0x7F, code)


@triton.jit
def _with_sign(mag, sign_bit):
    """mag (>= 0 or NaN) with the sign bit or-ed in: Triton's unary minus is ``0 - x``, which turns -0.0
    into +0.0; the codecs keep the sign of zero (0x80 decodes to -0.0)."""
    return (mag.to(tl.int32, bitcast=True) | sign_bit).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_value(code):
    """E4M3 byte (int32) -> fp32 (0x7F / 0xFF -> NaN)."""
    m = code & 7
    ef = (code >> 3) & 15
    normal = (((ef + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(ef == 0, m.to(tl.float32) * TWO_M9, normal)
    mag = tl.where((code & 0x7F) == 0x7F, float("nan"), mag)
    return _with_sign(mag, (code & 0x80) << 24)


@triton.jit
def _e2m1_code(y):
    """fp32 -> E2M1 code (int32 0..15), cvt.rn.satfinite.e2m1 semantics (RNE on {0, .5, 1, 1.5, 2, 3, 4, 6},
    saturate to 6, NaN -> +6, sign kept: ``bits.e2m1_codes``).

    With a = min(|y|, 6) and E = floor(log2(max(a, 1))) in {0, 1, 2}, c = 2^(E+22) has the grid step
    2^(E-1) as its ulp, so fp32(a + c) rounds a to the grid (RNE) and k = bits(a + c) - bits(c) counts
    the steps: code = k + 2E. On CUDA mostly in float ops (min.f32 maps NaN to +6: instruction issue is
    NVFP4's limit, so the fewest ops); in the interpreter on the bit patterns (numpy's min propagates NaN).
    """
    if HW:
        ys = tl.maximum(tl.minimum(y, 6.0), -6.0)  # min.f32 maps NaN to +6 (then max keeps it); -0.0 kept
        a = tl.abs(ys)
        c = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 4194304.0
        cb = c.to(tl.int32, bitcast=True)
        code = (a + c).to(tl.int32, bitcast=True) - cb + ((cb >> 22) - 298)
        return code + ((ys.to(tl.int32, bitcast=True) >> 28) & 8)  # the sign bit -> 8
    else:
        yb = y.to(tl.int32, bitcast=True)
        a = yb & 0x7FFFFFFF
        sign = (((a - 0x7F800001) >> 31) & yb) >> 31
        sign = sign & 0x8
        a = tl.minimum(a, 0x40C00000)  # 6.0
        c = (tl.maximum(a, 0x3F800000) & 0x7F800000) + (22 << 23)  # 2^(E + 22)
        s = a.to(tl.float32, bitcast=True) + c.to(tl.float32, bitcast=True)
        k = s.to(tl.int32, bitcast=True) - c
        return (k + ((c - 0x4A800000) >> 22)) | sign


@triton.jit
def _e2m1_value(code):
    """E2M1 code (int32) -> fp32 value (bit 3 = sign; 8 -> -0.0)."""
    c3 = code & 7
    e = c3 >> 1
    m = c3 & 1
    normal = ((2 + m) << tl.maximum(e - 1, 0)).to(tl.float32) * 0.5
    mag = tl.where(e == 0, c3.to(tl.float32) * 0.5, normal)
    return _with_sign(mag, (code & 8) << 28)


@triton.jit
def _bf16_bits(v):
    """fp32 -> bf16 bit pattern (int32 holding 16 bits): RNE, subnormals kept, NaN -> quiet NaN."""
    b = v.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, ((b >> 16) & 0x8000) | 0x7FC0, r)


@triton.jit
def _bf16_out(v):
    """fp32 -> bf16 bits as int16, RNE: cvt.rn.bf16.f32 on CUDA, ``_bf16_bits`` in the interpreter."""
    if HW:
        return v.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        return _bf16_bits(v).to(tl.int16)


@triton.jit
def _store_out(ptr, offs, v, mask, OUT_KIND: tl.constexpr):
    """OUT_KIND 1: fp32; 2: bf16 (stored as its int16 bits)."""
    if OUT_KIND == 2:
        tl.store(ptr + offs, _bf16_out(v), mask=mask)
    else:
        tl.store(ptr + offs, v, mask=mask)


@triton.jit
def _swizzled(r, c, rows, cols):
    """cuBLAS 128x4 offset of compact scale (r, c) in the swizzled [ru(rows,128), ru(cols,4)] layout of one
    matrix, plus the matrix's base (r counts the rows of all matrices; each has ``rows``)."""
    mat = r // rows
    rl = r % rows
    rp = (rows + 127) // 128 * 128
    cp = (cols + 3) // 4 * 4
    off = ((rl // 128) * (cp // 4) + c // 4) * 512 + (rl % 32) * 16 + ((rl % 128) // 32) * 4 + c % 4
    return mat.to(tl.int64) * rp * cp + off


# ---------------------------------------------------------------------------------------------------------
# MXFP8: rowwise and/or columnwise in one pass, optional dequantized copies and swizzled scales
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def mxfp8_quantize_kernel(
    x_ptr, R, K, M,
    qr_ptr, sr_ptr, dr_ptr, wr_ptr,
    qc_ptr, sc_ptr, dc_ptr, wc_ptr,
    IN_KIND: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr, OUT_KIND: tl.constexpr,
    DQ_ROW: tl.constexpr, DQ_COL: tl.constexpr, SWZ: tl.constexpr, BMB: tl.constexpr, NB: tl.constexpr,
    EVICT: tl.constexpr = 0, STV: tl.constexpr = 0, FULL: tl.constexpr = 0, STQ: tl.constexpr = 1,
):
    """One [BMB*32, NB*32] tile of x [R, K] (R = all rows; M rows per matrix, for the swizzle).

    FULL 1 (the plan's choice when R and K are multiples of the tile): no load or store masks.
    STQ 0: the E4M3 data and compact scales are not stored (decode-only callers; q* / s* are placeholders).

    STV 8: the E4M3 tiles are stored through ``_store_q2`` (the 2-D tile, column offsets that show runs of
    8 contiguous bytes: the run one thread holds from its 16-byte load), so they leave from the load's layout
    as 8-byte stores instead of being re-laid out through shared memory for 16-byte stores.

    The tile is loaded once as a 2-D block; rowwise 1x32 blocks are its [BM, NB, 32] view reduced over the
    last axis, columnwise 32x1 blocks its [BMB, 32, BK] view reduced over the middle one.
    Outputs (each only when its flag is set): q* uint8 E4M3 like x; sr [R, K/32] / sc [R/32, K] uint8
    E8M0; d* the decode in fp32 / bf16 (OUT_KIND 1 / 2; DQ_ROW / DQ_COL say which); wr / wc the swizzled
    scales (SWZ): rowwise [R/M, ru(M,128), ru(K/32,4)], columnwise of the transposed operand
    [R/M, ru(K,128), ru(M/32,4)] (the layout a GEMM over the transposed matrix reads).
    """
    BM: tl.constexpr = BMB * 32
    BK: tl.constexpr = NB * 32
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    r2 = pid_m * BM + tl.arange(0, BM)[:, None]  # [BM, 1]
    c2 = pid_k * BK + tl.arange(0, BK)[None, :]  # [1, BK]
    if FULL:
        x = _load_f32_full(x_ptr, r2.to(tl.int64) * K + c2, IN_KIND, EVICT)  # [BM, BK]
    else:
        x = _load_f32(x_ptr, r2.to(tl.int64) * K + c2, (r2 < R) & (c2 < K), IN_KIND, EVICT)  # [BM, BK]
    a = _abs_nz(x)
    if ROW:
        rows = pid_m * BM + tl.arange(0, BM)[:, None, None]  # [BM, 1, 1]
        jb = tl.arange(0, NB)[None, :, None]
        cols = pid_k * BK + jb * 32 + tl.arange(0, 32)[None, None, :]  # [1, NB, 32]
        mask = (rows < R) & (cols < K)
        if FULL:
            mask = None
        offs = rows.to(tl.int64) * K + cols
        xr = tl.reshape(x, [BM, NB, 32])
        e = _e8m0_round_up(_amax_fix(tl.max(tl.reshape(a, [BM, NB, 32]), axis=2, keep_dims=True)) * INV448)
        q = _e4m3_byte(xr * _e8m0_inverse(e))  # [BM, NB, 32]
        if STQ:  # STQ 0: the decodes only (no E4M3 bytes stored)
            _store_q(qr_ptr, q, offs, mask, r2, c2, R, K, BM, BK, STV, EVICT, FULL)
        scol = pid_k * NB + jb  # [1, NB, 1]
        smask = (rows < R) & (scol < K // 32)
        if FULL:
            smask = None
        if STQ:
            tl.store(sr_ptr + rows.to(tl.int64) * (K // 32) + scol, e.to(tl.uint8), mask=smask)
        if SWZ:
            tl.store(wr_ptr + _swizzled(rows, scol, M, K // 32), e.to(tl.uint8), mask=smask)
        if DQ_ROW:
            _store_out(dr_ptr, offs, _e4m3_byte_value(q) * _e8m0_value(e), mask, OUT_KIND)
    if COL:
        ib = tl.arange(0, BMB)[:, None, None]
        rows = pid_m * BM + ib * 32 + tl.arange(0, 32)[None, :, None]  # [BMB, 32, 1]
        cols = pid_k * BK + tl.arange(0, BK)[None, None, :]  # [1, 1, BK]
        mask = (rows < R) & (cols < K)
        if FULL:
            mask = None
        offs = rows.to(tl.int64) * K + cols
        xc = tl.reshape(x, [BMB, 32, BK])
        e = _e8m0_round_up(_amax_fix(tl.max(tl.reshape(a, [BMB, 32, BK]), axis=1, keep_dims=True)) * INV448)
        q = _e4m3_byte(xc * _e8m0_inverse(e))  # [BMB, 32, BK]
        if STQ:
            _store_q(qc_ptr, q, offs, mask, r2, c2, R, K, BM, BK, STV, EVICT, FULL)
        srow = pid_m * BMB + ib  # [BMB, 1, 1]
        smask = (srow < R // 32) & (cols < K)
        if FULL:
            smask = None
        if STQ:
            tl.store(sc_ptr + srow.to(tl.int64) * K + cols, e.to(tl.uint8), mask=smask)
        if SWZ:  # the transposed scale [K, M/32] of each matrix: (col, scale row within its matrix)
            mat = srow // (M // 32)
            t_r = mat * K + cols  # row of the stacked transposed scales [R/M * K, M/32]
            t_c = srow % (M // 32)
            tl.store(wc_ptr + _swizzled(t_r, t_c, K, M // 32), e.to(tl.uint8), mask=smask)
        if DQ_COL:
            _store_out(dc_ptr, offs, _e4m3_byte_value(q) * _e8m0_value(e), mask, OUT_KIND)


@triton.jit
def _store_q(ptr, q, offs, mask, r2, c2, R, K, BM: tl.constexpr, BK: tl.constexpr, STV: tl.constexpr,
             EVICT: tl.constexpr, FULL: tl.constexpr):
    """The E4M3 byte tile ``q`` at ``offs``: from the load's layout (``STV``), or one store per element with
    streaming (``.cs``: not read again by this kernel) or default caching."""
    if STV:
        _store_q2(ptr, q, r2, c2, R, K, BM, BK, STV, EVICT, FULL)
    elif EVICT:
        tl.store(ptr + offs, q, mask=mask, cache_modifier=".cs")
    else:
        tl.store(ptr + offs, q, mask=mask)


@triton.jit
def _store_q2(ptr, q, r2, c2, R, K, BM: tl.constexpr, BK: tl.constexpr, STV: tl.constexpr, EVICT: tl.constexpr,
              FULL: tl.constexpr = 0):
    """Store the byte tile ``q`` (any [.., ..] view of the [BM, BK] tile) at rows r2 [BM, 1] / columns c2
    [1, BK] of a [R, K] byte matrix. The column offsets are written (c // STV) * STV + c % STV: the same
    addresses, but Triton's coalescing then sees runs of STV contiguous bytes, not BK, and keeps the
    layout the values are already in (no shared-memory re-layout and barrier for wider stores)."""
    c = (c2 // STV) * STV + c2 % STV
    v = tl.reshape(q, [BM, BK])
    m = (r2 < R) & (c2 < K)
    if FULL:
        m = None
    if EVICT:
        tl.store(ptr + r2.to(tl.int64) * K + c, v, mask=m, cache_modifier=".cs")
    else:
        tl.store(ptr + r2.to(tl.int64) * K + c, v, mask=m)


@triton.jit
def mxfp8_dequantize_kernel(q_ptr, s_ptr, out_ptr, R, K, COLWISE: tl.constexpr, OUT_KIND: tl.constexpr,
                            BMB: tl.constexpr, NB: tl.constexpr):
    """e4m3_value(q) * 2^(e - 127) -> fp32 / bf16, for a rowwise ([R, K/32]) or columnwise ([R/32, K]) scale."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    ib = tl.arange(0, BMB)[:, None, None, None]
    ir = tl.arange(0, 32)[None, :, None, None]
    jb = tl.arange(0, NB)[None, None, :, None]
    jc = tl.arange(0, 32)[None, None, None, :]
    rows = pid_m * (BMB * 32) + ib * 32 + ir
    cols = pid_k * (NB * 32) + jb * 32 + jc
    mask = (rows < R) & (cols < K)
    offs = rows.to(tl.int64) * K + cols
    q = tl.load(q_ptr + offs, mask=mask, other=0)
    if COLWISE:
        srow = pid_m * BMB + ib
        e = tl.load(s_ptr + srow.to(tl.int64) * K + cols, mask=(srow < R // 32) & (cols < K), other=0)
    else:
        scol = pid_k * NB + jb
        e = tl.load(s_ptr + rows.to(tl.int64) * (K // 32) + scol, mask=(rows < R) & (scol < K // 32), other=0)
    _store_out(out_ptr, offs, _e4m3_byte_value(q) * _e8m0_value(e.to(tl.int32)), mask, OUT_KIND)


# ---------------------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def amax_kernel(x_ptr, M, K, out_ptr, PER_ROW: tl.constexpr, IN_KIND: tl.constexpr,
                BM: tl.constexpr, BK: tl.constexpr, K_ITERS: tl.constexpr):
    """NaN-ignoring max |x| of ``BM`` rows of matrix ``program_id(1)`` over all K.

    PER_ROW: out[row] = the row's amax (plain store); else out[matrix] = max over its rows (an atomic max
    on the fp32 bit pattern, which orders like the value for x >= 0; ``out`` starts at 0).
    """
    pid = tl.program_id(0)
    mat = tl.program_id(1)
    r = pid * BM + tl.arange(0, BM)[:, None]
    base = mat.to(tl.int64) * M * K
    acc = tl.zeros([BM, BK], dtype=tl.float32)
    for it in range(K_ITERS):  # K_ITERS = cdiv(K, BK), a constexpr (Triton's interpreter cannot loop to a
        c = it * BK + tl.arange(0, BK)[None, :]  # run-time bound with numpy >= 2.3)
        m = (r < M) & (c < K)
        acc = tl.maximum(acc, _abs_nz(_load_f32(x_ptr + base, r.to(tl.int64) * K + c, m, IN_KIND)))
    if PER_ROW:
        row_max = tl.max(acc, axis=1)
        rr = pid * BM + tl.arange(0, BM)
        tl.store(out_ptr + mat.to(tl.int64) * M + rr, row_max, mask=rr < M)
    else:
        tile_max = tl.max(tl.max(acc, axis=1), axis=0)
        tl.atomic_max(out_ptr + mat, tile_max.to(tl.int32, bitcast=True))


@triton.jit
def _global_scales(amax_g):
    """amax_g -> (S_dec, S_enc * fp32(1/6)) by TE's order of fp32 operations (nvfp4._scales)."""
    s = tl.math.div_rn(tl.zeros_like(amax_g) + 2688.0, amax_g)
    s = tl.where(s < FLT_MAX, s, FLT_MAX)  # fminf(s, FLT_MAX): NaN and inf -> FLT_MAX
    s = tl.where((amax_g == 0) | (s == 0), 1.0, s)
    s_dec = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
    return s_dec, s * INV6


@triton.jit
def _nvfp4_tile(x, amax_b, s_dec, sf_scale):
    """Blocks of 16 on the last axis of x [..., 16]; amax_b / s_dec / sf_scale broadcast as [..., 1].
    Returns (codes [..., 16] int32, sf byte [..., 1] uint8, sf value fp32)."""
    sf = _e4m3_byte(amax_b * sf_scale)  # uint8; amax_b >= 0: no sign, no NaN; inf saturates to 448
    sf_f = _e4m3_byte_value(sf)
    den = sf_f * s_dec
    enc = tl.math.div_rn(tl.zeros_like(den) + 1.0, den)
    enc = tl.where(enc < FLT_MAX, enc, FLT_MAX)  # sf == 0 -> 1/0 = inf -> FLT_MAX
    return _e2m1_code(x * enc), sf, sf_f


@triton.jit
def nvfp4_quantize_kernel(
    x_ptr, M, K, amax_ptr,
    q_ptr, s_ptr, gs_ptr, d_ptr,
    IN_KIND: tl.constexpr, SCOPE: tl.constexpr, OUT_KIND: tl.constexpr,
    TA: tl.constexpr, TB: tl.constexpr, NB: tl.constexpr,
):
    """One [TA*TB, NB*16] tile of matrix ``program_id(2)`` of x [E, M, K], loaded as a 2-D block and viewed
    as [TA, TB, NB, 16].

    TB = 16: 16x16 tiles (the block amax is the max over the tile's 16 rows, repeated); TB = 1: 1x16.
    SCOPE 0: the global amax is amax_ptr[matrix]; 1: amax_ptr[row] (per token, given or computed first).
    Writes q [E, M, K/2] (packed E2M1), s [E, M, K/16] (E4M3 bytes), gs (S_dec, the amax's shape: the
    program at tile (0, 0) writes the matrix's in scope 0, the programs of column tile 0 their rows' in
    scope 1) and, with OUT_KIND 1 / 2, the dequantized d [E, M, K] in fp32 / bf16.
    """
    BM: tl.constexpr = TA * TB
    BK: tl.constexpr = NB * 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    mat = tl.program_id(2)
    base = mat.to(tl.int64) * M
    r2 = pid_m * BM + tl.arange(0, BM)[:, None]  # [BM, 1]
    c2 = pid_k * BK + tl.arange(0, BK)[None, :]  # [1, BK]
    mask2 = (r2 < M) & (c2 < K)
    x2 = _load_f32(x_ptr, (base + r2) * K + c2, mask2, IN_KIND)  # [BM, BK]
    x = tl.reshape(x2, [TA, TB, NB, 16])
    amax_b = _amax_fix(tl.max(_abs_nz(x), axis=3, keep_dims=True))  # [TA, TB, NB, 1]
    if TB > 1:
        amax_b = tl.max(amax_b, axis=1, keep_dims=True)  # [TA, 1, NB, 1]: the 16x16 tile
    rows = pid_m * BM + tl.arange(0, TA)[:, None, None, None] * TB + tl.arange(0, TB)[None, :, None, None]
    if SCOPE == 0:
        amax_g = tl.load(amax_ptr + mat)
    else:
        amax_g = tl.load(amax_ptr + base + rows, mask=rows < M, other=1.0)  # [TA, TB, 1, 1]
    s_dec, sf_scale = _global_scales(amax_g)
    codes, sf, sf_f = _nvfp4_tile(x, amax_b, s_dec, sf_scale)  # codes [TA, TB, NB, 16]
    lo, hi = tl.split(tl.reshape(codes, [BM, BK // 2, 2]))
    pc = pid_k * (BK // 2) + tl.arange(0, BK // 2)[None, :]  # [1, BK/2]
    tl.store(q_ptr + (base + r2) * (K // 2) + pc, (lo | (hi << 4)).to(tl.uint8), mask=(r2 < M) & (pc < K // 2))
    scol = pid_k * NB + tl.arange(0, NB)[None, None, :, None]  # [1, 1, NB, 1]
    sf_full = tl.broadcast_to(sf, [TA, TB, NB, 1])  # the 2-D tile scale, repeated over its rows
    tl.store(s_ptr + (base + rows) * (K // 16) + scol, sf_full, mask=(rows < M) & (scol < K // 16))
    if SCOPE == 0:
        if (pid_m == 0) & (pid_k == 0):
            tl.store(gs_ptr + mat, s_dec)
    else:
        if pid_k == 0:
            tl.store(gs_ptr + base + rows, s_dec, mask=rows < M)
    if OUT_KIND != 0:
        d = tl.reshape((_e2m1_value(codes) * sf_f) * s_dec, [BM, BK])
        _store_out(d_ptr, (base + r2) * K + c2, d, mask2, OUT_KIND)


@triton.jit
def nvfp4_dequantize_kernel(q_ptr, s_ptr, gs_ptr, out_ptr, M, K, GS_PER_ROW: tl.constexpr,
                            OUT_KIND: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr):
    """fp32(e2m1(q) * float(sf)) * S_dec -> fp32 / bf16 (NVFP4Tensor.dequantize)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    mat = tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)[:, None, None]  # [BM, 1, 1]
    jb = tl.arange(0, NB)[None, :, None]
    jp = tl.arange(0, 8)[None, None, :]
    pc = pid_k * (NB * 8) + jb * 8 + jp  # packed byte column [1, NB, 8]
    base = mat.to(tl.int64) * M
    pmask = (rows < M) & (pc < K // 2)
    byte = tl.load(q_ptr + (base + rows) * (K // 2) + pc, mask=pmask, other=0).to(tl.int32)
    scol = pid_k * NB + jb  # [1, NB, 1]
    sf = tl.load(s_ptr + (base + rows) * (K // 16) + scol, mask=(rows < M) & (scol < K // 16), other=0)
    sf_f = _e4m3_byte_value(sf)
    if GS_PER_ROW:
        gs = tl.load(gs_ptr + base + rows, mask=rows < M, other=1.0)
    else:
        gs = tl.load(gs_ptr + mat)
    lo = (_e2m1_value(byte & 0xF) * sf_f) * gs
    hi = (_e2m1_value(byte >> 4) * sf_f) * gs
    v = tl.reshape(tl.join(lo, hi), [BM, NB, 16])  # element 2j from the low nibble, 2j+1 from the high
    cols = pid_k * (NB * 16) + tl.arange(0, NB)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    _store_out(out_ptr, (base + rows) * K + cols, v, (rows < M) & (cols < K), OUT_KIND)


@triton.jit
def _rows_chunk(x, amax_b, s_dec, sf_scale, k0, rows, rmask, base, K, q_ptr, s_ptr, d_ptr,
                ROWS: tl.constexpr, NB: tl.constexpr, OUT_KIND: tl.constexpr):
    """Quantize and store one [ROWS, NB, 16] chunk of rows starting at column k0 (nvfp4_quantize_rows_kernel)."""
    jb = tl.arange(0, NB)[None, :, None]
    codes, sf, sf_f = _nvfp4_tile(x, amax_b, s_dec, sf_scale)
    lo, hi = tl.split(tl.reshape(codes, [ROWS, NB, 8, 2]))
    pc = k0 // 2 + jb * 8 + tl.arange(0, 8)[None, None, :]
    tl.store(q_ptr + (base + rows) * (K // 2) + pc, (lo | (hi << 4)).to(tl.uint8), mask=rmask & (pc < K // 2))
    scol = k0 // 16 + jb  # [1, NB, 1]
    tl.store(s_ptr + (base + rows) * (K // 16) + scol, sf, mask=rmask & (scol < K // 16))
    if OUT_KIND != 0:
        cols = k0 + jb * 16 + tl.arange(0, 16)[None, None, :]
        _store_out(d_ptr, (base + rows) * K + cols, (_e2m1_value(codes) * sf_f) * s_dec, rmask & (cols < K),
                   OUT_KIND)


@triton.jit
def nvfp4_quantize_rows_kernel(
    x_ptr, M, K, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr,
    IN_KIND: tl.constexpr, OUT_KIND: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, K_ITERS: tl.constexpr,
):
    """Per-token NVFP4 in one launch: ``ROWS`` whole rows of matrix ``program_id(1)`` per program.

    K_ITERS == 1 (a row fits the tile: ``kernels`` picks NB = next power of two of K/16 up to a bound): the
    rows are read once into registers, their amax (the global amax of scope "row") taken, then quantized.
    Otherwise loop 1 takes the amax and loop 2 reads the rows again (from cache) and quantizes them.
    Writes amax [E*M], gs (S_dec) [E*M], q, s and optionally d as ``nvfp4_quantize_kernel``.
    """
    pid = tl.program_id(0)
    mat = tl.program_id(1)
    rows = pid * ROWS + tl.arange(0, ROWS)[:, None, None]  # [ROWS, 1, 1]
    jb = tl.arange(0, NB)[None, :, None]
    jc = tl.arange(0, 16)[None, None, :]
    base = mat.to(tl.int64) * M
    rmask = rows < M
    if K_ITERS == 1:
        cols = jb * 16 + jc
        x = _load_f32(x_ptr, (base + rows) * K + cols, rmask & (cols < K), IN_KIND)
        amax_b = _amax_fix(tl.max(_abs_nz(x), axis=2, keep_dims=True))  # [ROWS, NB, 1]
        amax_g = tl.max(amax_b, axis=1, keep_dims=True)  # [ROWS, 1, 1]
        s_dec, sf_scale = _global_scales(amax_g)
        tl.store(amax_ptr + base + rows, amax_g, mask=rmask)
        tl.store(gs_ptr + base + rows, s_dec, mask=rmask)
        _rows_chunk(x, amax_b, s_dec, sf_scale, 0, rows, rmask, base, K, q_ptr, s_ptr, d_ptr, ROWS, NB, OUT_KIND)
    else:
        acc = tl.zeros([ROWS, NB, 16], dtype=tl.float32)
        for it in range(K_ITERS):  # cdiv(K, NB * 16), constexpr (see amax_kernel)
            cols = it * (NB * 16) + jb * 16 + jc
            x = _load_f32(x_ptr, (base + rows) * K + cols, rmask & (cols < K), IN_KIND)
            acc = tl.maximum(acc, _abs_nz(x))
        amax_g = tl.max(tl.max(acc, axis=2, keep_dims=True), axis=1, keep_dims=True)  # [ROWS, 1, 1]
        s_dec, sf_scale = _global_scales(amax_g)
        tl.store(amax_ptr + base + rows, amax_g, mask=rmask)
        tl.store(gs_ptr + base + rows, s_dec, mask=rmask)
        for it in range(K_ITERS):
            k0 = it * (NB * 16)
            cols = k0 + jb * 16 + jc  # [1, NB, 16]
            x = _load_f32(x_ptr, (base + rows) * K + cols, rmask & (cols < K), IN_KIND)
            amax_b = _amax_fix(tl.max(_abs_nz(x), axis=2, keep_dims=True))  # [ROWS, NB, 1]
            _rows_chunk(x, amax_b, s_dec, sf_scale, k0, rows, rmask, base, K, q_ptr, s_ptr, d_ptr, ROWS, NB,
                        OUT_KIND)


@triton.jit
def encoders_kernel(x_ptr, code_ptr, e4_ptr, e2_ptr, bf_ptr, v4_ptr, v2_ptr, e2p_ptr, r2p_ptr, bfp_ptr, e2a_ptr,
                    r2a_ptr, n, one, BLOCK: tl.constexpr):
    """The element encoders / decoders on a flat fp32 array (selfcheck.check_encoders compares them with
    the exact scalar oracles): e4m3 / e2m1 codes and bf16 bits of x; decodes of the byte codes[i];
    ``_e2m1_pair_code``'s code and value (e2p, r2p) and ``_bf16x2``'s bits of (x, -x) (bfp);
    ``_e2m1_pair_code_abs``'s code and value (e2a, r2a) of the product x * one (``one`` = 1.0 passed at run
    time, so the multiply is not folded away: that encoder's input is always such a product)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    ca, ra = _e2m1_pair_code_abs(x * one)
    tl.store(e2a_ptr + i, ca, mask=m)
    tl.store(r2a_ptr + i, ra, mask=m)
    tl.store(e4_ptr + i, _e4m3_byte(x).to(tl.int32), mask=m)  # the paths the kernels take (HW on CUDA)
    tl.store(e2_ptr + i, _e2m1_code(x), mask=m)
    c2, r2 = _e2m1_pair_code(x)
    tl.store(e2p_ptr + i, c2, mask=m)
    tl.store(r2p_ptr + i, r2, mask=m)
    neg = (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)  # -x, sign of zero too
    tl.store(bfp_ptr + i, _bf16x2(x, neg), mask=m)
    tl.store(bf_ptr + i, _bf16_out(x).to(tl.int32) & 0xFFFF, mask=m)
    c = tl.load(code_ptr + i, mask=m, other=0)
    tl.store(v4_ptr + i, _e4m3_byte_value(c.to(tl.uint8)), mask=m)
    tl.store(v2_ptr + i, _e2m1_value(c & 15), mask=m)


# ---------------------------------------------------------------------------------------------------------
# NVFP4 per token, bf16 input read as int32 pairs (the hot path: QuantLinear's activations, sync's rows)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _e2m1_pair_code(y):
    """fp32 -> (E2M1 code int32 0..15, its value fp32 with the sign): ``_e2m1_code``'s rule and bytes, fewer
    instructions (SASS per element, ``python -m miles_lp.formats.kernels.sass``): the magic constant is kept
    as 2^E (``cm``), so one FFMA both scales it by 2^22 and adds (exact: a power of two times 2^22), and the
    code is bits(a + c) - bits(cm) + (2E - (22 << 23)) with 2E = (bits(cm) >> 22) - 254 (no float c
    materialised for the subtraction). The value ``r`` = (a + c) - c is exact (same binade), so the decode
    (qdq) needs no code-to-value conversion. NaN -> +6 (min.f32 on CUDA; a where() in the interpreter).
    """
    ys = tl.maximum(tl.minimum(y, 6.0), -6.0)  # min.f32 maps NaN to +6 (then max keeps it); -0.0 kept
    if not HW:
        ys = tl.where(y == y, ys, 6.0)
    a = tl.abs(ys)
    cm = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000  # bits of 2^E, E in {0, 1, 2}
    cf = cm.to(tl.float32, bitcast=True) * 4194304.0  # c = 2^(E + 22), exact
    s = a + cf  # RNE onto the grid step 2^(E - 1)
    yb = ys.to(tl.int32, bitcast=True)
    code = (s.to(tl.int32, bitcast=True) - cm) + ((cm >> 22) - ((22 << 23) + 254))
    code = code | ((yb >> 28) & 8)
    r = ((s - cf).to(tl.int32, bitcast=True) | (yb & -2147483648)).to(tl.float32, bitcast=True)
    return code, r


@triton.jit
def _bf16x2(lo, hi):
    """Two fp32 -> one int32 holding their bf16 bit patterns (lo in bits 0-15), RNE: one cvt.rn.bf16x2.f32
    per pair on CUDA, ``_bf16_bits`` in the interpreter."""
    if HW:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,r,r", [hi, lo], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return _bf16_bits(lo) | (_bf16_bits(hi) << 16)


@triton.jit
def _bmax2_abs(a, b):
    """Two int32 holding bf16 pairs -> max(|a|, |b|) per half (``max.xorsign.abs.bf16x2``: the result's sign
    is junk, every level of a tree takes |.| again; NaN-ignoring like max.f32: one NaN operand gives the other,
    two give NaN). A reduction combine: 1 instruction per 2 elements instead of 1 per element."""
    return tl.inline_asm_elementwise("max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _rcp_rn(d):
    """1 / d correctly rounded (``rcp.rn.f32``: IEEE, subnormals kept; the same value as div.rn(1, d)) on CUDA,
    ``tl.math.div_rn`` in the interpreter (no PTX there)."""
    if HW:
        return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.math.div_rn(tl.zeros_like(d) + 1.0, d)


@triton.jit
def _e2m1_pair_code_abs(y):
    """``_e2m1_pair_code`` with one clamp fewer (ENC 1, CUDA): a = min(|y|, 6) in one min.f32 (|y| is an operand
    modifier; NaN -> 6), the sign taken from y itself. Exact only when a NaN y carries no sign, which holds for
    the kernels' y = x * enc: the GPU's fp32 multiply returns the canonical NaN 0x7FFFFFFF (checked on the
    device: selfcheck's NaN of both signs, ``specials_bf16``, and the encoder check's products). In the
    interpreter (numpy keeps a NaN's sign) the sign of a NaN is cleared first."""
    yb = y.to(tl.int32, bitcast=True)
    if not HW:
        yb = tl.where(y == y, yb, 0)
    a = tl.minimum(tl.abs(y), 6.0)  # min.f32 maps NaN to 6
    if not HW:
        a = tl.where(y == y, a, 6.0)
    cm = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000  # bits of 2^E, E in {0, 1, 2}
    cf = cm.to(tl.float32, bitcast=True) * 4194304.0  # c = 2^(E + 22), exact
    s = a + cf  # RNE onto the grid step 2^(E - 1)
    code = (s.to(tl.int32, bitcast=True) - cm) + ((cm >> 22) - ((22 << 23) + 254))
    code = code | ((yb >> 28) & 8)
    r = ((s - cf).to(tl.int32, bitcast=True) | (yb & -2147483648)).to(tl.float32, bitcast=True)
    return code, r


@triton.jit
def _pairs_row(w, row, ok, pc, cmask, jb, K2, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ: tl.constexpr,
               ENC: tl.constexpr = 0, FULL: tl.constexpr = 0):
    """Quantize one row held as int32 pairs ``w`` [NB, 8] and store everything (``ok``: the row exists).

    ENC 1 (CUDA; the same bytes): the 16-block amax as a bf16x2 max tree on the raw pairs (``_bmax2_abs``),
    the scale's reciprocal by ``rcp.rn.f32`` and the one-clamp encoder ``_e2m1_pair_code_abs``; in the
    interpreter ENC 1 runs the fp32 amax and the division (no PTX) and the encoder's exact NaN form.
    FULL 1: the row exists and fills the tile (K/2 == NB*8): the stores take no mask."""
    lo = (w << 16).to(tl.float32, bitcast=True)
    hi = (w & -65536).to(tl.float32, bitcast=True)
    if ENC and HW:
        m2 = tl.reduce(w, 1, _bmax2_abs, keep_dims=True)  # [NB, 1] two bf16 halves, |.| up to the sign bit
        m_lo = (m2 << 16).to(tl.float32, bitcast=True)
        m_hi = (m2 & -65536).to(tl.float32, bitcast=True)
        amax_b = _amax_fix(tl.maximum(tl.abs(m_lo), tl.abs(m_hi)))
    else:
        amax_b = _amax_fix(tl.max(tl.maximum(_abs_nz(lo), _abs_nz(hi)), axis=1, keep_dims=True))  # [NB, 1]
    amax_g = tl.max(amax_b, axis=0, keep_dims=True)  # [1, 1]
    s_dec, sf_scale = _global_scales(amax_g)
    one = tl.zeros([1, 1], tl.int64) + row
    if FULL:
        tl.store(amax_ptr + one, amax_g)
        tl.store(gs_ptr + one, s_dec)
    else:
        tl.store(amax_ptr + one, amax_g, mask=ok)
        tl.store(gs_ptr + one, s_dec, mask=ok)
    sf = _e4m3_byte(amax_b * sf_scale)  # [NB, 1]
    sf_f = _e4m3_byte_value(sf)
    if ENC:
        enc = _rcp_rn(sf_f * s_dec)
    else:
        enc = tl.math.div_rn(tl.zeros_like(sf_f) + 1.0, sf_f * s_dec)
    enc = tl.where(enc < FLT_MAX, enc, FLT_MAX)
    if ENC:
        c_lo, r_lo = _e2m1_pair_code_abs(lo * enc)
        c_hi, r_hi = _e2m1_pair_code_abs(hi * enc)
    else:
        c_lo, r_lo = _e2m1_pair_code(lo * enc)
        c_hi, r_hi = _e2m1_pair_code(hi * enc)
    if FULL:
        tl.store(q_ptr + row * K2 + pc, (c_lo + (c_hi << 4)).to(tl.uint8))
        tl.store(s_ptr + row * (K2 // 8) + jb, sf)
        if DQ:
            tl.store(d_ptr + row * K2 + pc, _bf16x2((r_lo * sf_f) * s_dec, (r_hi * sf_f) * s_dec))
    else:
        pmask = cmask & ok
        tl.store(q_ptr + row * K2 + pc, (c_lo + (c_hi << 4)).to(tl.uint8), mask=pmask)  # one LEA per pair
        tl.store(s_ptr + row * (K2 // 8) + jb, sf, mask=(jb < K2 // 8) & ok)
        if DQ:
            tl.store(d_ptr + row * K2 + pc, _bf16x2((r_lo * sf_f) * s_dec, (r_hi * sf_f) * s_dec), mask=pmask)


@triton.jit
def _load_pairs_full(ptrs, EVICT: tl.constexpr):
    if EVICT:
        return tl.load(ptrs, eviction_policy="evict_first")
    else:
        return tl.load(ptrs)


@triton.jit
def _load_pairs(ptrs, mask, EVICT: tl.constexpr):
    if EVICT:
        return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def nvfp4_rows_pairs_kernel(
    x_ptr, M, K2, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr,
    DQ: tl.constexpr, NB: tl.constexpr, RS: tl.constexpr, EVICT: tl.constexpr = 0, ENC: tl.constexpr = 0,
    FULL: tl.constexpr = 0,
):
    """Per-token NVFP4 of bf16 rows: ``RS`` rows of matrix ``program_id(1)`` per program, one after the
    other, each whole row in registers (K/16 <= NB groups); row i+1 is loaded before row i is quantized, so
    its load is in flight during that work.

    x is read as int32 pairs [E*M, K/2] (``x_ptr``: the bf16 tensor viewed as int32; K2 = K/2): element 2j is
    the low half of pair j, 2j+1 the high half, so widening to fp32 is one shift / one mask per element, and
    the packed byte j of q is code(2j) | code(2j+1) << 4 with no split or interleave. Same outputs as
    ``nvfp4_quantize_rows_kernel`` (amax, gs, q, s; with DQ the bf16 decode written as int32 pairs).
    """
    r0 = tl.program_id(0) * RS
    base = tl.program_id(1).to(tl.int64) * M
    jb = tl.arange(0, NB)[:, None]  # [NB, 1]: the 16-blocks of the row
    pc = jb * 8 + tl.arange(0, 8)[None, :]  # pair column [NB, 8]
    cmask = pc < K2
    ok = r0 < M
    if FULL:  # RS 1 and K/2 == NB*8 (the plan's choice): every program's row exists and fills the tile, so
        # no load mask (no zero fill, no predicates) and no store masks
        w = _load_pairs_full(x_ptr + (base + r0) * K2 + pc, EVICT)
        _pairs_row(w, base + r0, ok, pc, cmask, jb, K2, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ, ENC, 1)
        return
    w = _load_pairs(x_ptr + (base + r0) * K2 + pc, cmask & ok, EVICT)
    for i in tl.static_range(RS):
        if i + 1 < RS:
            ok_next = r0 + i + 1 < M
            w_next = _load_pairs(x_ptr + (base + r0 + i + 1) * K2 + pc, cmask & ok_next, EVICT)
        _pairs_row(w, base + r0 + i, ok, pc, cmask, jb, K2, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ, ENC)
        if i + 1 < RS:
            w = w_next
            ok = ok_next


@triton.jit
def nvfp4_rows_persist_kernel(
    x_ptr, N, K2, P, ITERS, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr,
    DQ: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr, PF: tl.constexpr, EVICT: tl.constexpr = 0,
    ITERS_C: tl.constexpr = 0,
):
    """``nvfp4_rows_pairs_kernel``'s rows (the same ``_pairs_row``, the same bytes) from a persistent grid:
    program p of the P launched (a multiple of the SM count) takes the flat rows p, p + P, p + 2P, ... of all
    N = E*M rows (ITERS = cdiv(N, P) iterations, the last one masked where p + i*P >= N), so the next row's
    load can be issued while this row computes without the unrolled ``RS`` form's second copy of the code.
    STAGES > 1: Triton's software pipeliner on the row loop (``tl.range(num_stages=...)``: cp.async into
    shared memory); PF = 1: the next row is loaded into registers at the top of each iteration instead (one
    loop-carried row). Per-token scope has no matrix boundary inside a row, so the matrices' rows are one
    flat index. The interpreter's ``range`` takes Python ints only (a runtime int arrives as a 1-element
    array), so there the trip count comes as the constexpr ITERS_C (on CUDA 0: no recompile per row count)."""
    pid = tl.program_id(0).to(tl.int64)
    jb = tl.arange(0, NB)[:, None]  # [NB, 1]
    pc = jb * 8 + tl.arange(0, 8)[None, :]  # [NB, 8]
    cmask = pc < K2
    if PF:
        row = pid
        w = _load_pairs(x_ptr + row * K2 + pc, cmask & (row < N), EVICT)
        if HW:
            for _ in tl.range(0, ITERS):
                w, row = _persist_pf_step(w, row, x_ptr, N, K2, P, pc, cmask, jb, amax_ptr, q_ptr, s_ptr, gs_ptr,
                                          d_ptr, DQ, EVICT)
        else:
            for _ in tl.static_range(ITERS_C):
                w, row = _persist_pf_step(w, row, x_ptr, N, K2, P, pc, cmask, jb, amax_ptr, q_ptr, s_ptr, gs_ptr,
                                          d_ptr, DQ, EVICT)
    else:
        if HW:
            for i in tl.range(0, ITERS, num_stages=STAGES):
                _persist_step(pid + i * P, x_ptr, N, K2, pc, cmask, jb, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ,
                              EVICT)
        else:
            for i in tl.static_range(ITERS_C):
                _persist_step(pid + i * P, x_ptr, N, K2, pc, cmask, jb, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ,
                              EVICT)


@triton.jit
def _persist_step(row, x_ptr, N, K2, pc, cmask, jb, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ: tl.constexpr,
                  EVICT: tl.constexpr):
    """One row of ``nvfp4_rows_persist_kernel`` (STAGES form): load, quantize, store (``row`` may be >= N)."""
    ok = row < N
    # the last iteration's rows past N re-read row N-1 (from cache) instead of a masked load: the mask made
    # the pipelined loop keep 125 registers against 96 (offline SASS); their stores are masked by ``ok``
    w = _load_pairs(x_ptr + tl.minimum(row, N - 1) * K2 + pc, cmask, EVICT)
    _pairs_row(w, row, ok, pc, cmask, jb, K2, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ)


@triton.jit
def _persist_pf_step(w, row, x_ptr, N, K2, P, pc, cmask, jb, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr,
                     DQ: tl.constexpr, EVICT: tl.constexpr):
    """One row of ``nvfp4_rows_persist_kernel`` (PF form): issue the next row's load, quantize this one."""
    nxt = row + P
    w_next = _load_pairs(x_ptr + nxt * K2 + pc, cmask & (nxt < N), EVICT)
    _pairs_row(w, row, row < N, pc, cmask, jb, K2, amax_ptr, q_ptr, s_ptr, gs_ptr, d_ptr, DQ)
    return w_next, nxt
