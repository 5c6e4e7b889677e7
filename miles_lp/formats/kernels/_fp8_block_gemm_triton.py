"""Triton kernel: the FP8 blockwise GEMM for few tokens (decode), the activation quantization in its prologue.

Loaded by ``miles_lp.formats.kernels.fp8_block_decode`` through ``load_jit_module``: compiled on CUDA (sm_90:
``tl.dot`` on ``float8e4nv`` operands, fp32 accumulation), or under ``TRITON_INTERPRET=1`` on CPU tensors for the
tests (the E4M3 bytes decoded to fp32 with integer code, then an fp32 ``tl.dot``: products of two E4M3 values are
exact in fp32, so only the order of the sums differs from the hardware's).

``y[M, N] = sum over K blocks kb of (a_q[M, kb] . w_q[N, kb]^T) * sa[M, kb] * sw[N/128, kb]``: ``a_q`` / ``sa`` the
1x128 grid of the bf16 / fp32 input ``x`` computed here with the act kernel's rules (``_fp8_block_triton.py``'s
``_scale`` and ``_e4m3_byte``: byte-identical to ``miles_lp.formats.fp8``; ``STORE_ACT`` writes them for the
tests), ``w_q`` ``[N, K]`` E4M3 (read as bytes) with decode multipliers ``sw [ceil(N/128), ceil(K/128)]``. Each
128-long K block is one ``tl.dot`` from zero, then scaled in fp32 and added (the emulation's per-block scaling;
DeepSeek-V3's promotion interval). ``SPLIT`` > 1: program ``pk`` sums K blocks ``[pk ITERS, (pk + 1) ITERS)`` into
its fp32 partial ``[SPLIT, M, N]``; ``split_sum_kernel`` adds the partials in split order (deterministic).

Compiled for sm_90 with the launch's specialization (16-byte aligned pointers, N and K multiples of 16; checked on
CPU by ``tests/unit/test_fp8_block_decode.py``, Triton 3.6): the x and w tile loads are software-pipelined
(cp.async, ``STAGES`` deep), no register spills at 16..64 x 32..128 tiles (68-255 registers), and the dot is
``wgmma ... e4m3.e4m3`` at 64-row tiles (its partial sums added into fp32 registers every 32 products:
``max_num_imprecise_acc=32``) while at 16 / 32 rows Triton widens E4M3 to fp16 (exact) for ``mma.sync.m16n8k16``
(fp32 accumulation): the same products, the same bytes read.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from miles_lp.formats.kernels.runtime import load_jit_module

HW = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"))
# the act kernel's exactness rules, loaded in this module's mode (Triton reads TRITON_INTERPRET at decoration)
_codec = load_jit_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fp8_block_triton.py"),
                         "miles_lp.formats.kernels._fp8_block_triton_gemm", not HW.value)
_scale = _codec._scale
_e4m3_byte = _codec._e4m3_byte
_load = _codec._load


@triton.jit
def _e4m3_value(b):
    """E4M3 byte (int32 0..255) -> its fp32 value, exactly (the interpreter's float8 casts are not trusted):
    normal (1 + m/8) 2^(e-7), subnormal m 2^-9, 0x7F / 0xFF NaN."""
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where(sign != 0, -sub, sub)
    v = tl.where(e == 0, sub, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _bf16_out(v):
    """fp32 -> bf16 bits as int16, RNE (``_triton.py``'s rule): cvt.rn.bf16.f32 on CUDA, integer code in the
    interpreter (whose bf16 cast is not trusted)."""
    if HW:
        return v.to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        b = v.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
        nan = (b & 0x7FFFFFFF) > 0x7F800000
        return tl.where(nan, ((b >> 16) & 0x8000) | 0x7FC0, r).to(tl.int16)


@triton.jit
def decode_gemm_kernel(x_ptr, w_ptr, sw_ptr, y_ptr, aq_ptr, as_ptr, M, N, K, KB,
                       VALUE_FOR_INF: tl.constexpr, POW2: tl.constexpr, BF16_BITS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ITERS: tl.constexpr,
                       OUT_BF16: tl.constexpr, STORE_ACT: tl.constexpr, DOT_BF16: tl.constexpr,
                       STAGES: tl.constexpr):
    """x [M, K] row-major (bf16 / fp32; bf16 as int16 bits when BF16_BITS), w [N, K] uint8, sw [ceil(N/128), KB]
    fp32 -> y: SPLIT == 1: [M, N] (bf16 as int16 bits when OUT_BF16, else fp32); else fp32 partials [SPLIT, M, N].
    STORE_ACT: aq [M, K] uint8 and as [M, KB] fp32, the fused quantization's bytes (programs of the first N tile).
    DOT_BF16 (CUDA): the dot on the E4M3 values widened to bf16 (bf16 tensor cores), else on float8e4nv.
    STAGES: the software pipeline's depth (tiles of x and w in flight per program)."""
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    pm = tl.program_id(2)
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    ks = tl.arange(0, 128)
    row_in = rows < M
    col_in = cols < N
    sw_row = (cols // 128).to(tl.int64) * KB  # [BN]: each output column's weight-scale row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.range(ITERS, num_stages=STAGES):  # (ITERS a constexpr: the interpreter loops to constants only)
        kb = pk * ITERS + i  # this split's K blocks: [pk * ITERS, (pk + 1) * ITERS), those < KB
        kk = kb * 128 + ks
        k_in = (kk < K) & (kb < KB)
        a_mask = row_in[:, None] & k_in[None, :]
        x = _load(x_ptr, rows[:, None].to(tl.int64) * K + kk[None, :], a_mask, BF16_BITS)  # [BM, 128] fp32
        a = tl.abs(x)
        a = tl.where(a == a, a, 0.0)
        s = _scale(tl.max(a, axis=1), VALUE_FOR_INF, POW2)  # [BM]
        q = _e4m3_byte(x * s[:, None])  # [BM, 128] uint8, the codec's bytes
        sa = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)  # [BM]: the codec's scale_inv
        if STORE_ACT:
            first = pn == 0
            tl.store(aq_ptr + rows[:, None].to(tl.int64) * K + kk[None, :], q, mask=a_mask & first)
            tl.store(as_ptr + rows.to(tl.int64) * KB + kb, sa, mask=row_in & first & (kb < KB))
        wb = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + kk[None, :], mask=col_in[:, None] & k_in[None, :],
                     other=0)  # [BN, 128] uint8
        if HW:
            a8 = q.to(tl.float8e4nv, bitcast=True)
            w8 = tl.trans(wb.to(tl.float8e4nv, bitcast=True))
            if DOT_BF16:  # E4M3 values are exact in bf16: the same products, fp32 accumulation throughout
                d = tl.dot(a8.to(tl.bfloat16), w8.to(tl.bfloat16), out_dtype=tl.float32)
            else:  # wgmma's FP8 accumulator keeps ~14 bits: promoted to the fp32 registers every 32 products
                d = tl.dot(a8, w8, out_dtype=tl.float32, max_num_imprecise_acc=32)
        else:
            d = tl.dot(_e4m3_value(q.to(tl.int32)), tl.trans(_e4m3_value(wb.to(tl.int32))),
                       input_precision="ieee", out_dtype=tl.float32)
        sw = tl.load(sw_ptr + sw_row + kb, mask=col_in & (kb < KB), other=0.0)  # [BN]
        acc += d * sa[:, None] * sw[None, :]
    out_mask = row_in[:, None] & col_in[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    if SPLIT == 1:
        if OUT_BF16:
            tl.store(y_ptr + offs, _bf16_out(acc), mask=out_mask)
        else:
            tl.store(y_ptr + offs, acc, mask=out_mask)
    else:
        tl.store(y_ptr + pk.to(tl.int64) * M * N + offs, acc, mask=out_mask)


@triton.jit
def split_sum_kernel(p_ptr, y_ptr, MN, SPLIT: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """y [MN] = the SPLIT fp32 partials [SPLIT, MN] added in order (bf16 as int16 bits when OUT_BF16)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + i * MN + offs, mask=mask, other=0.0)
    if OUT_BF16:
        tl.store(y_ptr + offs, _bf16_out(acc), mask=mask)
    else:
        tl.store(y_ptr + offs, acc, mask=mask)
