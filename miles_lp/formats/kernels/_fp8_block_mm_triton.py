"""Triton kernel: the FP8 blockwise GEMM on pre-quantized operands (training shapes), per-128 block scales.

Loaded by ``miles_lp.formats.kernels.fp8_block_mm`` through ``load_jit_module``: compiled on CUDA (sm_90:
``tl.dot`` on ``float8e4nv`` operands, wgmma reading both tiles from shared memory), or under ``TRITON_INTERPRET=1``
on CPU tensors for the tests (the E4M3 bytes decoded to fp32 with integer code, then an fp32 ``tl.dot``: products of
two E4M3 values are exact in fp32, so only the order of the sums differs from the hardware's).

``c[M, N] = sum over K blocks kb of (a[M, kb] . b[N, kb]^T) * sa[M, kb] * sb[N / B_DIV, kb]``: ``a`` ``[M, K]`` and
``b`` ``[N, K]`` E4M3, both K-major (what FP8 wgmma reads), ``sa`` one fp32 multiplier per row and 128-long K block
(BlockWise1x128), ``sb`` one per row of ``b`` (``B_DIV`` 1: BlockWise1x128, the wgrad's 1D x 1D case) or per 128
rows (``B_DIV`` 128: BlockWise128x128, a weight). Scales are read through their strides, so the layouts
``scaled_mm`` takes serve as they are. Each K block is one ``tl.dot`` from zero, scaled in fp32 and added
(DeepSeek-V3's promotion interval: the FP8 tensor cores' reduced-precision accumulation never spans more than one
block; ``IMPRECISE`` caps it further, ``max_num_imprecise_acc``). Programs walk the output tiles in groups of
``GROUP_M`` tile rows (the A tiles of a group stay in L2 while its B tiles stream).

The dot's result is needed by the scaling right after it, so Triton waits for each wgmma before the next K block's
(no MMA / scaling overlap): on the H200 this kernel ran at 1.23x cuBLAS's time for the 1D x 1D wgrad at 8192^3
(docs/gpu.md). Tensor-descriptor (TMA) loads ran slower; Triton 3.6's warp specialization of this loop gave wrong
results on the H200 at 128x128 tiles (right but 2.35x cuBLAS at 64x128); both were dropped.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from miles_lp.formats.kernels.runtime import load_jit_module

HW = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"))
# the decode GEMM's exact E4M3 decode (interpreter) and bf16 rounding, loaded in this module's mode (Triton reads
# TRITON_INTERPRET at decoration)
_decode = load_jit_module(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fp8_block_gemm_triton.py"),
                          "miles_lp.formats.kernels._fp8_block_gemm_triton_mm", not HW.value)
_e4m3_value = _decode._e4m3_value
_bf16_bits = _decode._bf16_out


@triton.jit
def block_mm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K,
                    s_am, s_bn, s_sam, s_sak, s_sbn, s_sbk, s_cm,
                    B_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                    STAGES: tl.constexpr, IMPRECISE: tl.constexpr, EVEN: tl.constexpr, OUT_BF16: tl.constexpr,
                    KB_INTERP: tl.constexpr):
    """a [M, K] E4M3 (row stride s_am), b [N, K] E4M3 (s_bn): float8e4nv on CUDA, uint8 bytes in the interpreter,
    sa: [M, K/128] fp32 read at rows * s_sam + kb * s_sak, sb: [N / B_DIV, K/128] at (cols // B_DIV) * s_sbn +
    kb * s_sbk -> c [M, N] (row stride s_cm; bf16 as int16 bits when OUT_BF16, else fp32). K a multiple of 128;
    EVEN: M and N multiples of the tiles (no masks). KB_INTERP: K / 128 under the interpreter, which loops to
    constants only (0 on CUDA: a runtime value there)."""
    tile = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pm = first_m + (tile % per_group) % group_m
    pn = (tile % per_group) // group_m
    rows = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, 128)
    lr = tl.arange(0, BLOCK_M)
    lc = tl.arange(0, BLOCK_N)
    # 64-bit tile bases, 32-bit offsets inside the tile (fewer registers per address)
    a_rows = a_ptr + (pm * BLOCK_M).to(tl.int64) * s_am + (lr[:, None] * s_am + ks[None, :])
    b_rows = b_ptr + (pn * BLOCK_N).to(tl.int64) * s_bn + (lc[:, None] * s_bn + ks[None, :])
    sa_rows = sa_ptr + rows.to(tl.int64) * s_sam
    sb_rows = sb_ptr + (cols // B_DIV).to(tl.int64) * s_sbn
    row_in = rows < M
    col_in = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in tl.range(0, K // 128 if HW else KB_INTERP, num_stages=STAGES):
        k0 = kb * 128
        if EVEN:
            a = tl.load(a_rows + k0)
            b = tl.load(b_rows + k0)
            sa = tl.load(sa_rows + kb * s_sak)
            sb = tl.load(sb_rows + kb * s_sbk)
        else:
            # (rows past M / columns past N reach only output elements that are never stored)
            a = tl.load(a_rows + k0, mask=row_in[:, None])
            b = tl.load(b_rows + k0, mask=col_in[:, None])
            sa = tl.load(sa_rows + kb * s_sak, mask=row_in, other=0.0)
            sb = tl.load(sb_rows + kb * s_sbk, mask=col_in, other=0.0)
        if HW:  # float8e4nv tiles straight from shared memory into wgmma
            d = tl.dot(a, tl.trans(b), out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE)
        else:
            d = tl.dot(_e4m3_value(a.to(tl.int32)), tl.trans(_e4m3_value(b.to(tl.int32))), input_precision="ieee",
                       out_dtype=tl.float32)
        acc += (d * sb[None, :]) * sa[:, None]
    offs = rows[:, None].to(tl.int64) * s_cm + cols[None, :]
    out = _bf16_bits(acc) if OUT_BF16 else acc
    if EVEN:
        tl.store(c_ptr + offs, out)
    else:
        tl.store(c_ptr + offs, out, mask=row_in[:, None] & col_in[None, :])
