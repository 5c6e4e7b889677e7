"""Gluon FP8 blockwise GEMMs for the 1x128 x 1x128 wgrad, for one H200 call: correctness, then time them beside cuBLAS.

Why: the learner's fp8_block wgrad (TE's Float8BlockScaling: dy and x in 1x128 tiles along the tokens) is the
slowest of QuantLinear's three FP8 GEMMs on the H200 and the main reason QuantLinear misses 0.70x bf16 at 8192^3.
``formats.kernels.fp8_block_mm`` (Triton) lost to cuBLAS because Triton waits for each wgmma before scaling its
product. Gluon (Triton's explicit-layout dialect) exposes the asynchronous wgmma. Two kernels here:

* one partition (``block_mm_lag_kernel``): issues block kb's wgmma and scales block kb - 1's product while it runs
  (``wgmma.wait_group 1``). ptxas serializes its wgmmas for exactly that (note C7514: an accumulator of an
  in-flight wgmma is read; ``sass.ptxas_notes``), so the overlap never happens;
* warp-specialized (``block_mm_ws_kernel``, DeepGEMM's scheme): a loader warp fills a ring of TMA stages; two math
  warpgroups own half of the output tile's rows each, wait for their own wgmma and scale while the other's runs.
  ptxas keeps it asynchronous and nothing spills (``tests/unit/test_fp8_block_gluon_compile.py``).

Both are correct on the H200 and both are slower than cuBLAS (docs/results/h200-fp8-block-gluon-2026-12-02): the
learner keeps cuBLAS. Run:

    python3 scripts/h200_fp8_block_gluon.py --out DIR [--linear]

1. each warp-specialized plan through ``fp8_block_mm.selfcheck`` (both scale rules and layouts on b, fp32 and bf16
   results), the one-partition kernel against the emulation; a 90 s watchdog per check (a hung pipeline exits);
2. at 8192^3 and 2048x4096x4096 (tokens x N x K): bf16 ``torch.mm``, cuBLAS's block-scaled wgrad, the Triton GEMM
   and each kernel at each plan (CUDA events, median of 20 after 3 warm-up calls), host time per call, and the
   forward GEMM (128x128 scales on b) on the warp-specialized kernel beside cuBLAS; DIR/gluon.json;
3. ``--linear``: ``bench linear`` with the fastest warp-specialized plan as the learner's wgrad, beside cuBLAS's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from miles_lp.bench.cuda_timing import host_us, median_us

#: (BLOCK_M, BLOCK_N, warps, STAGES): sm_90 compiles of each without spills (128 x 128 at 8 warps and 4 stages
#: spills 8 bytes; ``tests/unit/test_fp8_block_gluon_compile.py``)
PLANS = [(128, 128, 8, 3), (128, 64, 8, 4), (64, 128, 4, 4), (128, 128, 8, 4)]


@gluon.jit
def _issue(a_desc, b_desc, a_smem, b_smem, bars, kb, off_m, off_n, STAGES: gl.constexpr, pred):
    s = kb % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, kb * 128], bar, a_smem.index(s), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [off_n, kb * 128], bar, b_smem.index(s), pred=pred)


@gluon.jit
def block_mm_lag_kernel(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, M, N, K, s_sam, s_sak, s_sbn, s_sbk, s_cm,
                        B_DIV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                        STAGES: gl.constexpr, num_warps: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    tile = gl.program_id(0)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(tiles_m - first_m, GROUP_M)
    pm = first_m + (tile % per_group) % group_m
    pn = (tile % per_group) // group_m
    off_m = pm * BLOCK_M
    off_n = pn * BLOCK_N
    rows = off_m + gl.arange(0, BLOCK_M, layout=row_l)
    cols = off_n + gl.arange(0, BLOCK_N, layout=col_l)
    row_in = rows < M
    col_in = cols < N
    sa_rows = sa_ptr + rows.to(gl.int64) * s_sam
    sb_rows = sb_ptr + (cols // B_DIV).to(gl.int64) * s_sbn

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, 128], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, 128], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    kbs = K // 128
    for i in gl.static_range(STAGES):
        _issue(a_desc, b_desc, a_smem, b_smem, bars, i, off_m, off_n, STAGES, i < kbs)

    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    # block 0: issued before the loop, scaled in iteration 1 while block 1's MMA runs
    mbarrier.wait(bars.index(0), 0)
    tok = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    sa = gl.load(sa_rows, mask=row_in, other=0.0)
    sb = gl.load(sb_rows, mask=col_in, other=0.0)
    for kb in range(1, kbs):
        st = kb % STAGES
        mbarrier.wait(bars.index(st), (kb // STAGES) & 1)
        nxt = warpgroup_mma(a_smem.index(st), b_smem.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        sa_n = gl.load(sa_rows + kb * s_sak, mask=row_in, other=0.0)
        sb_n = gl.load(sb_rows + kb * s_sbk, mask=col_in, other=0.0)
        d = warpgroup_mma_wait(num_outstanding=1, deps=(tok, ))  # block kb - 1 done; block kb still running
        acc += (d * sb[None, :]) * sa[:, None]
        # stage of block kb - 1 is free once both warpgroups' MMAs of it are done (each waits for its own):
        # all warps meet, then block kb - 1 + STAGES is loaded into it
        gl.thread_barrier()
        _issue(a_desc, b_desc, a_smem, b_smem, bars, kb - 1 + STAGES, off_m, off_n, STAGES, kb - 1 + STAGES < kbs)
        tok = nxt
        sa = sa_n
        sb = sb_n
    d = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
    acc += (d * sb[None, :]) * sa[:, None]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    offs = rows[:, None].to(gl.int64) * s_cm + cols[None, :]
    gl.store(c_ptr + offs, acc.to(gl.bfloat16), mask=row_in[:, None] & col_in[None, :])


def compile_sm90(plan, b_block: int = 1):
    """Triton's CompiledKernel of the kernel at ``plan`` for sm_90, compiled here (no GPU needed)."""
    from triton import compiler
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bm, bn, warps, stages = plan
    la = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bm}, 128],{la!r}>", "b_desc": f"tensordesc<fp8e4nv[{bn}, 128],{lb!r}>",
           "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*bf16"}
    sig.update(dict.fromkeys(("M", "N", "K", "s_sam", "s_sak", "s_sbn", "s_sbk", "s_cm"), "i32"))
    consts = dict(B_DIV=b_block, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, STAGES=stages, num_warps=warps)
    sig.update(dict.fromkeys(consts, "constexpr"))
    return compiler.compile(GluonASTSource(block_mm_lag_kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})


@gluon.jit
def _ws_load(a_desc, b_desc, a_smem, b_smem, ready, empty, off_m, off_n, kbs, HALF: gl.constexpr,
          STAGES: gl.constexpr):
    for kb in range(kbs):
        s = kb % STAGES
        # a stage is empty once both math warpgroups have arrived (an mbarrier starts with phase 1 complete)
        mbarrier.wait(empty.index(s), ((kb // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, kb * 128], bar, a_smem.index(2 * s))
        tma.async_copy_global_to_shared(a_desc, [off_m + HALF, kb * 128], bar, a_smem.index(2 * s + 1))
        tma.async_copy_global_to_shared(b_desc, [off_n, kb * 128], bar, b_smem.index(s))


@gluon.jit
def _ws_math(a_smem, b_smem, ready, empty, sa_ptr, sb_ptr, c_ptr, off_m, off_n, M, N, kbs, s_sam, s_sak, s_sbn, s_sbk,
          s_cm, WG: gl.constexpr, B_DIV: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, PREFETCH: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    rows = off_m + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    row_in = rows < M
    col_in = cols < N
    sa_rows = sa_ptr + rows.to(gl.int64) * s_sam
    # Each thread of the MMA layout holds BLOCK_N / 4 columns: their scales are loaded one per thread and spread
    # by a layout conversion, not through BLOCK_N / 4 pointers per thread (registers the 12-warp CTA lacks)
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    cols_1 = off_n + gl.arange(0, BLOCK_N, layout=flat)
    sb_1 = sb_ptr + (cols_1 // B_DIV).to(gl.int64) * s_sbn
    col_in_1 = cols_1 < N
    acc = gl.zeros((HALF, BLOCK_N), dtype=gl.float32, layout=mma)
    d = gl.zeros((HALF, BLOCK_N), dtype=gl.float32, layout=mma)
    # PREFETCH: block kb + 1's scales are loaded while block kb's MMA runs (3 registers: the row scales and one
    # column scale per thread before its spreading), so their latency is hidden by a whole iteration
    sa_n = gl.load(sa_rows, mask=row_in, other=0.0)
    sbf_n = gl.load(sb_1, mask=col_in_1, other=0.0)
    for kb in range(kbs):
        s = kb % STAGES
        mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
        # One FP8 product per 128-long K block, from zero (use_acc=False: the registers of the last block's product
        # are reused, their values ignored). The default max_num_imprecise_acc (2^30 on sm_90) matters: a smaller
        # one makes Triton add partial products while the wgmma is in flight, and ptxas serializes every wgmma.
        tok = warpgroup_mma(a_smem.index(2 * s + WG), b_smem.index(s).permute((1, 0)), d, use_acc=False,
                            is_async=True)
        if PREFETCH:
            sa = sa_n
            sbf = sbf_n
            more = kb + 1 < kbs
            sa_n = gl.load(sa_rows + (kb + 1) * s_sak, mask=row_in & more, other=0.0)
            sbf_n = gl.load(sb_1 + (kb + 1) * s_sbk, mask=col_in_1 & more, other=0.0)
        else:
            sa = gl.load(sa_rows + kb * s_sak, mask=row_in, other=0.0)
            sbf = gl.load(sb_1 + kb * s_sbk, mask=col_in_1, other=0.0)
        sb = gl.convert_layout(sbf, gl.SliceLayout(0, mma))
        # waiting for this warpgroup's product only: the other warpgroup's MMA keeps the tensor cores busy while
        # this one scales (reading an accumulator of a wgmma still in flight would make ptxas serialize them)
        d = warpgroup_mma_wait(num_outstanding=0, deps=(tok, ))
        mbarrier.arrive(empty.index(s), count=1)
        acc += (d * sb[None, :]) * sa[:, None]
    offs = rows[:, None].to(gl.int64) * s_cm + cols[None, :]
    gl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@gluon.jit
def block_mm_ws_kernel(a_desc, b_desc, sa_ptr, sb_ptr, c_ptr, M, N, K, s_sam, s_sak, s_sbn, s_sbk, s_cm,
                       B_DIV: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, MATH_REGS: gl.constexpr, PREFETCH: gl.constexpr,
                       num_warps: gl.constexpr):
    """One loader warp feeds a STAGES-deep TMA ring; two math warpgroups (this partition and a worker) each take
    BLOCK_M / 2 rows of the tile with a wgmma stream of their own, and each frees a stage by arriving on its
    mbarrier (count 2)."""
    HALF: gl.constexpr = BLOCK_M // 2
    tile = gl.program_id(0)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(tiles_m - first_m, GROUP_M)
    off_m = (first_m + (tile % per_group) % group_m) * BLOCK_M
    off_n = ((tile % per_group) // group_m) * BLOCK_N
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF, 128], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, 128], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    kbs = K // 128
    gl.warp_specialize([
        (_ws_math, (a_smem, b_smem, ready, empty, sa_ptr, sb_ptr, c_ptr, off_m, off_n, M, N, kbs, s_sam, s_sak, s_sbn,
                 s_sbk, s_cm, 0, B_DIV, HALF, BLOCK_N, STAGES, PREFETCH)),
        (_ws_math, (a_smem, b_smem, ready, empty, sa_ptr, sb_ptr, c_ptr, off_m, off_n, M, N, kbs, s_sam, s_sak, s_sbn,
                 s_sbk, s_cm, 1, B_DIV, HALF, BLOCK_N, STAGES, PREFETCH)),
        (_ws_load, (a_desc, b_desc, a_smem, b_smem, ready, empty, off_m, off_n, kbs, HALF, STAGES)),
    ], [4, 1], [MATH_REGS, 24])


#: the warp-specialized kernel's defaults: BLOCK_M (two math warpgroups of BLOCK_M / 2 rows), BLOCK_N, STAGES (TMA
#: ring depth), MATH_REGS (registers per thread of the worker math warpgroup; the loader warp keeps 24)
WS_CONFIG = {"bm": 128, "bn": 128, "stages": 6, "math_regs": 232, "group": 8, "prefetch": 0}
#: WS_CONFIG overrides timed (the first is the default)
WS_PLANS = [{}, {"stages": 4}, {"bn": 64, "stages": 8}, {"stages": 5}]
#: registers per thread for the whole CTA at launch: 12 warps (two math warpgroups and the loader's) x 32 x 168
#: fit the 64K register file; ``setmaxnreg`` then moves them from the loader to the math warpgroups
WS_MAXNREG = 168


def compile_ws_sm90(config: dict | None = None, b_block: int = 1, out: str = "bf16"):
    """Triton's CompiledKernel of the warp-specialized kernel for sm_90 at ``config`` (WS_CONFIG overrides), compiled
    here without a GPU (Triton's compiler and ptxas)."""
    from triton import compiler
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = {**WS_CONFIG, **(config or {})}
    bm, bn = int(cfg["bm"]), int(cfg["bn"])
    la = gl.NVMMASharedLayout.get_default_for([bm // 2, 128], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bm // 2}, 128],{la!r}>", "b_desc": f"tensordesc<fp8e4nv[{bn}, 128],{lb!r}>",
           "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": f"*{out}"}
    sig.update(dict.fromkeys(("M", "N", "K", "s_sam", "s_sak", "s_sbn", "s_sbk", "s_cm"), "i32"))
    consts = dict(B_DIV=b_block, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=int(cfg["group"]), STAGES=int(cfg["stages"]),
                  MATH_REGS=int(cfg["math_regs"]), PREFETCH=int(cfg["prefetch"]), num_warps=4)
    sig.update(dict.fromkeys(consts, "constexpr"))
    return compiler.compile(GluonASTSource(block_mm_ws_kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": WS_MAXNREG})


def block_mm_ws(a, sa, b, sb, b_block: int, plan=None, *, out_dtype=None, config=None):
    """``fp8_block_mm.block_mm``'s contract (its checks) on the warp-specialized kernel; ``plan``: WS_CONFIG
    overrides (``config``: the same, as ``fp8_block_mm.selfcheck`` passes it)."""
    import torch

    from miles_lp.formats.kernels import fp8_block_mm as mm

    out_dtype = out_dtype or torch.bfloat16
    a8, b8 = mm.check_operands(a, sa, b, sb, b_block, out_dtype)
    cfg = {**WS_CONFIG, **(plan or {}), **(config or {})}
    bm, bn = int(cfg["bm"]), int(cfg["bn"])
    m, k = a8.shape
    n = b8.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    ad, bd = _descs(a8, b8, bm // 2, bn)
    grid = (-(-m // bm) * -(-n // bn),)
    block_mm_ws_kernel[grid](ad, bd, sa, sb, c, m, n, k, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
                             c.stride(0), B_DIV=b_block, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=int(cfg["group"]),
                             STAGES=int(cfg["stages"]), MATH_REGS=int(cfg["math_regs"]),
                             PREFETCH=int(cfg["prefetch"]), num_warps=4,
                             maxnreg=WS_MAXNREG)
    return c


def _descs(a, b, bm: int, bn: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    la = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    return (TensorDescriptor(a, list(a.shape), list(a.stride()), [bm, 128], la),
            TensorDescriptor(b, list(b.shape), list(b.stride()), [bn, 128], lb))


def block_mm_lag(a, sa, b, sb, b_block: int, plan=PLANS[0]):
    """c [M, N] bf16 = sum_kb (a[:, kb] @ b[:, kb].T) * sa[:, kb] * sb[., kb] (``fp8_block_mm.block_mm``'s contract;
    a, b float8_e4m3fn, K-major, K a multiple of 128)."""
    import torch

    bm, bn, warps, stages = plan
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    ad, bd = _descs(a, b, bm, bn)
    grid = (-(-m // bm) * -(-n // bn),)
    block_mm_lag_kernel[grid](ad, bd, sa, sb, c, m, n, k, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
                              c.stride(0), B_DIV=b_block, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, STAGES=stages,
                              num_warps=warps)
    return c


def _run(plan):
    """The kernel a plan is for: a warp-specialized plan is a dict, a one-partition plan a tuple."""
    return block_mm_ws if isinstance(plan, dict) else block_mm_lag


def check(plan) -> list[str]:
    """The kernel at ``plan`` against the fp32 emulation on the codec's operands (small shapes); a warp-specialized
    plan through the product's selfcheck (both scale rules, fp32 and bf16 results)."""
    import torch

    if isinstance(plan, dict):
        from miles_lp.formats.kernels import fp8_block_mm

        return fp8_block_mm.selfcheck("cuda", config=plan, gemm=block_mm_ws)

    from miles_lp.formats.fp8 import quantize_fp8_blockwise
    from miles_lp.formats.kernels import fp8_block_mm as bm

    g = torch.Generator().manual_seed(0)
    bad = []
    for m, n, k in ((128, 128, 256), (256, 384, 512), (200, 136, 384)):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[1] = 0
        x[2, 5] = 1e4
        y = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        for b_block in (1, 128):
            xa = quantize_fp8_blockwise(x, (1, 128), False)
            yb = quantize_fp8_blockwise(y, (b_block, 128), False)
            ref = bm.emulated_mm(xa.data, xa.scale_inv, yb.data, yb.scale_inv, b_block)
            sa = xa.scale_inv.t().contiguous().t().cuda()
            c = _run(plan)(xa.data.cuda(), sa, yb.data.cuda(), yb.scale_inv.cuda(), b_block, plan)
            e = bm.rel_err(c.cpu(), ref)
            if not e <= 2.0 ** -8 + bm.FP32_REL_TOL:
                bad.append(f"{m}x{n}x{k} b_block={b_block} plan={plan}: rel err {e:.2e}")
    return bad


def shape_row(m: int, n: int, k: int, plans) -> dict:
    """The wgrad at tokens m, weight [n, k]: bf16, cuBLAS, the Triton GEMM and this kernel at each plan (us), and
    each of this kernel's results against cuBLAS's."""
    import torch

    from miles_lp.config import runtime_override
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.formats.kernels import fp8_block_mm as bm
    from miles_lp.train import fp8_block_gemm as G

    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _, _, (_, gcs) = k8.quantize_act(dy, False, rows=False, cols=True, grids=False)
    _, _, (_, xcs) = k8.quantize_act(x, False, rows=False, cols=True, grids=False)
    with runtime_override(fp8_wgrad_gemm="scaled_mm"):
        ref = G.wgrad_mm(gcs, xcs)
        row = {"shape": f"{m}x{n}x{k}", "bf16": median_us(lambda: torch.mm(dy.t(), x)),
               "scaled_mm": median_us(lambda: G.wgrad_mm(gcs, xcs))}
    row["triton"] = median_us(lambda: bm.block_mm(gcs.data, gcs.scale_inv, xcs.data, xcs.scale_inv, 1))
    row["host scaled_mm"] = host_us(lambda: G.wgrad_mm(gcs, xcs))
    for plan in plans:
        fn = lambda plan=plan: _run(plan)(gcs.data, gcs.scale_inv, xcs.data, xcs.scale_inv, 1, plan)  # noqa: E731
        row[f"gluon {plan}"] = median_us(fn)
        row[f"gluon {plan} diff"] = bm.rel_err(fn(), ref)
        row[f"host gluon {plan}"] = host_us(fn)
    # the forward GEMM (x 1x128 x w 128x128), the same kernel with one scale per 128 columns of b
    _, _, (xs, _) = k8.quantize_act(x, False, rows=True, cols=False, grids=False)
    wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, wt = k8.quantize_weight(wb, False)
    w = G.WeightOperands(wq, wt)
    fref = G.forward_mm(xs, w)
    row["fwd bf16"] = median_us(lambda: torch.mm(x, wb.t()))
    row["fwd scaled_mm"] = median_us(lambda: G.forward_mm(xs, w))
    for plan in [p for p in plans if isinstance(p, dict)]:
        fn = lambda plan=plan: block_mm_ws(xs.data, xs.scale_inv, wq.data, wq.scale_inv, 128, plan)  # noqa: E731
        row[f"fwd gluon {plan}"] = median_us(fn)
        row[f"fwd gluon {plan} diff"] = bm.rel_err(fn()[:m], fref)
    return row


def _hung(out: Path, res: dict, plan) -> None:
    res["hung"] = str(plan)
    (out / "gluon.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"HUNG: plan {plan} did not finish its check in 90 s", flush=True)
    os._exit(3)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plans", default=None,
                    help="a JSON list of WS_CONFIG overrides to check and time instead of WS_PLANS and the "
                         "one-partition kernel")
    ap.add_argument("--linear", action="store_true",
                    help="then bench linear with the fastest warp-specialized plan as the wgrad, beside cuBLAS's")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res: dict = {"device": torch.cuda.get_device_name(), "checks": {}, "rows": []}
    ok_plans = []
    for plan in json.loads(args.plans) if args.plans else [*WS_PLANS, PLANS[2]]:
        # a pipeline whose barriers never complete hangs the GPU: the watchdog writes what is known and exits
        dog = threading.Timer(90.0, _hung, (out, res, plan))
        dog.start()
        try:
            bad = check(plan)
        except Exception as e:  # a plan that does not compile or launch is a result
            bad = [f"ERR {type(e).__name__}: {str(e).splitlines()[0][:200]}"]
        finally:
            dog.cancel()
        res["checks"][str(plan)] = bad
        print(f"check plan {plan}:", bad or "pass", flush=True)
        if not bad:
            ok_plans.append(plan)
        if any("illegal" in b or "CUDA error" in b for b in bad):
            break  # the context is lost
    for m, n, k in ((8192, 8192, 8192), (2048, 4096, 4096)):
        row = shape_row(m, n, k, ok_plans)
        print(row["shape"], json.dumps(row), flush=True)
        res["rows"].append(row)
    ws_ok = [p for p in ok_plans if isinstance(p, dict)]
    if args.linear and ws_ok:
        res["linear"] = linear_rounds(min(ws_ok, key=lambda p: res["rows"][0][f"gluon {p}"]))
    res["seconds"] = time.time() - t0
    (out / "gluon.json").write_text(json.dumps(res, indent=1, default=str))
    return 0 if ok_plans else 1


def linear_rounds(plan, rounds: int = 2) -> list[dict]:
    """``bench linear`` (fp8_block quantized, large and small, eager and graphed) with the learner's wgrad on
    cuBLAS and on the warp-specialized kernel at ``plan`` (``fp8_block_gemm.wgrad_mm`` replaced for the run),
    alternating, ``rounds`` times each."""
    from miles_lp.bench import linear as BL
    from miles_lp.train import fp8_block_gemm as G

    cublas = G.wgrad_mm

    def ws(gc, xc, out_dtype=None):
        return block_mm_ws(gc.data, gc.scale_inv, xc.data, xc.scale_inv, 1, plan, out_dtype=out_dtype)

    shapes = [BL._parse_shape(s) for s in ("large", "small")]
    runs = []
    for rnd in range(rounds):
        for name, fn in (("scaled_mm", cublas), ("gluon", ws)):
            G.wgrad_mm = fn
            try:
                rows = BL.bench(shapes, modes=[("fp8_block", "quantized")], kernels=["compiled"], graph=True,
                                warmup=3, iters=10)
            finally:
                G.wgrad_mm = cublas
            print(f"--- bench linear, wgrad {name} {plan} (round {rnd + 1})", flush=True)
            print(BL.format_table(rows), flush=True)
            runs.append({"wgrad": name, "plan": plan, "round": rnd + 1, "rows": rows})
    return runs

if __name__ == "__main__":
    sys.exit(main())
