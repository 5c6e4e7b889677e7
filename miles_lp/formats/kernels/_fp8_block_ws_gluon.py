"""The Gluon kernel of ``fp8_block_ws`` (imported on first use: Gluon is Triton's experimental dialect)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _load(a_desc, b_desc, a_smem, b_smem, ready, empty, off_m, off_n, kbs, HALF: gl.constexpr,
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
def _math(a_smem, b_smem, ready, empty, sa_ptr, sb_ptr, c_ptr, off_m, off_n, M, N, kbs, s_sam, s_sak, s_sbn, s_sbk,
          s_cm, WG: gl.constexpr, B_DIV: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr):
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
    for kb in range(kbs):
        s = kb % STAGES
        mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
        # One FP8 product per 128-long K block, from zero (use_acc=False: the registers of the last block's product
        # are reused, their values ignored). The default max_num_imprecise_acc (2^30 on sm_90) matters: a smaller
        # one makes Triton add partial products while the wgmma is in flight, and ptxas serializes every wgmma.
        tok = warpgroup_mma(a_smem.index(2 * s + WG), b_smem.index(s).permute((1, 0)), d, use_acc=False,
                            is_async=True)
        sa = gl.load(sa_rows + kb * s_sak, mask=row_in, other=0.0)
        sb = gl.convert_layout(gl.load(sb_1 + kb * s_sbk, mask=col_in_1, other=0.0), gl.SliceLayout(0, mma))
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
                       STAGES: gl.constexpr, MATH_REGS: gl.constexpr, num_warps: gl.constexpr):
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
        (_math, (a_smem, b_smem, ready, empty, sa_ptr, sb_ptr, c_ptr, off_m, off_n, M, N, kbs, s_sam, s_sak, s_sbn,
                 s_sbk, s_cm, 0, B_DIV, HALF, BLOCK_N, STAGES)),
        (_math, (a_smem, b_smem, ready, empty, sa_ptr, sb_ptr, c_ptr, off_m, off_n, M, N, kbs, s_sam, s_sak, s_sbn,
                 s_sbk, s_cm, 1, B_DIV, HALF, BLOCK_N, STAGES)),
        (_load, (a_desc, b_desc, a_smem, b_smem, ready, empty, off_m, off_n, kbs, HALF, STAGES)),
    ], [4, 1], [MATH_REGS, 24])
