"""Gluon (Triton's explicit-layout dialect) operand kernels for FP8 blockwise on sm_90: TMA in, TMA out.

The same bytes as ``_fp8_block_triton.py``'s ``act_slab_kernel`` / ``weight_tile_kernel`` (the exactness rules are
the same: ``448 / amax`` and ``1 / scale`` through ``div_rn``, plain fp32 multiplies, ``cvt.rn.satfinite.e4m3``,
NaN taken as 0 in every max), written for bandwidth: those kernels move a 128x128 tile through registers and
let the compiler stage the transposed store; they ran at 59% of a device copy on the H200. Here each program is
persistent over tiles: a ring of ``STAGES`` TMA loads keeps DRAM busy while the current tile is quantized, and the
results leave through shared memory by TMA stores (the transposed grid written into a transposed shared tile, so
its global store is a plain box). A tile is two 128x64 halves (a TMA box row of bf16 is at most 128 bytes under
the 128-byte swizzle).

* ``act_tma_kernel`` (``x [M, K]``, bf16 / fp16): the 1x128 rowwise grid (ROWS) and the 128x1 grid written
  transposed ``[K, MP]``; rows past M read as zeros (TMA fills them), so the padding is zeros with scale 1.
* ``weight_tma_kernel`` (``w [N, K]``): one scale per 128x128 tile, the data as is and transposed, the scales as is
  and transposed.

Launch shapes (``fp8_block.TMA_VARIANTS``): STAGES, OUT (tiles whose stores may be in flight), warps, programs per
SM; LEAN reads each half twice from shared memory instead of holding both in registers; LC16 takes the columnwise
grid in 16x1 pieces per thread (shared-memory reads without bank conflicts).

Compiled only on CUDA (Gluon has no interpreter); ``tests/unit/test_fp8_block_gluon_ops.py`` compiles both for
sm_90 on the CPU, and ``fp8_block.selfcheck`` compares them with the codec on the device.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma


@gluon.jit
def _scale(amax, VALUE_FOR_INF: gl.constexpr, POW2: gl.constexpr):
    """TE compute_scale_from_amax (amax_epsilon 0): 448 / amax; inf -> the input dtype's max; amax inf or 0 -> 1;
    POW2: the scale's bits & 0xFF800000. (``_fp8_block_triton._scale`` restated: a Gluon kernel cannot call a
    ``triton.jit`` function; the selfcheck holds the two to the same bytes.)"""
    s = gl.div_rn(gl.zeros_like(amax) + 448.0, amax)
    s = gl.where(s == float("inf"), VALUE_FOR_INF, s)
    s = gl.where((amax == float("inf")) | (amax == 0.0), 1.0, s)
    if POW2:
        s = (s.to(gl.int32, bitcast=True) & -8388608).to(gl.float32, bitcast=True)
    return s


@gluon.jit
def _amax(x, axis: gl.constexpr):
    """max |x| along axis, NaN taken as 0: ``max.f32`` already returns the other operand of a NaN (CUDA fmaxf), so
    only an all-NaN line is left NaN, and that is mapped to 0 once per line instead of once per element."""
    a = gl.max(gl.abs(x), axis=axis)
    return gl.where(a == a, a, 0.0)


@gluon.jit
def _issue(x_desc, x_smem, bars, t, tiles_k, s, pred):
    """Both halves of tile t into stage s."""
    bar = bars.index(s)
    mbarrier.expect(bar, 2 * x_desc.block_type.nbytes, pred=pred)
    m0 = (t // tiles_k) * 128
    k0 = (t % tiles_k) * 128
    tma.async_copy_global_to_shared(x_desc, [m0, k0], bar, x_smem.index(2 * s), pred=pred)
    tma.async_copy_global_to_shared(x_desc, [m0, k0 + 64], bar, x_smem.index(2 * s + 1), pred=pred)


@gluon.jit
def _tile_loop(x_desc, rq_desc, cq_desc, rs_ptr, cs_ptr, MP, K, KB, tiles_k, tiles,
               ROWS: gl.constexpr, WEIGHT: gl.constexpr, VALUE_FOR_INF: gl.constexpr, POW2: gl.constexpr,
               STAGES: gl.constexpr, OUT: gl.constexpr, LEAN: gl.constexpr, LC16: gl.constexpr,
               num_warps: gl.constexpr):
    # rowwise path: 8 contiguous elements per thread along K (16-byte shared loads of bf16), 8 lanes span a half
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    # columnwise path: 8 rows x 2 columns per thread, so that the transposed bytes leave as 8-byte stores (its
    # 4-byte shared loads conflict 4-way: ``gl.bank_conflicts`` 3); LC16: 16 rows x 1 column per thread, 2-byte
    # loads without conflicts and 16-byte transposed stores
    if LC16:
        LC: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [4, num_warps // 4], [0, 1])
    else:
        LC: gl.constexpr = gl.BlockedLayout([8, 2], [4, 8], [num_warps // 4, 4], [0, 1])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    mine = (tiles - pid + nprog - 1) // nprog
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [2 * STAGES, 128, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if ROWS:
        rq_smem = gl.allocate_shared_memory(rq_desc.dtype, [2 * OUT, 128, 64], rq_desc.layout)
    cq_smem = gl.allocate_shared_memory(cq_desc.dtype, [2 * OUT, 64, 128], cq_desc.layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        _issue(x_desc, x_smem, bars, pid + i * nprog, tiles_k, i, i < mine)
    rows_r = gl.arange(0, 128, layout=gl.SliceLayout(1, LR))
    cols_c = gl.arange(0, 64, layout=gl.SliceLayout(0, LC))
    for i in range(mine):
        s = i % STAGES
        t = pid + i * nprog
        tm = t // tiles_k
        tk = t % tiles_k
        m0 = tm * 128
        k0 = tk * 128
        mbarrier.wait(bars.index(s), (i // STAGES) & 1)
        # the rowwise grid first, then the columnwise one half by half: fewer values live at once (registers for
        # two programs per SM), the stage refilled once both have read it
        # LEAN: each half read from shared memory twice (amax, then quantize) so that only one is in registers
        r0 = x_smem.index(2 * s).load(LR).to(gl.float32)
        ramax = _amax(r0, 1)
        if LEAN:
            ramax = gl.maximum(ramax, _amax(x_smem.index(2 * s + 1).load(LR).to(gl.float32), 1))
        else:
            r1 = x_smem.index(2 * s + 1).load(LR).to(gl.float32)
            ramax = gl.maximum(ramax, _amax(r1, 1))
        if WEIGHT:
            amax = gl.max(ramax, axis=0)  # the whole tile's
            sr = _scale(gl.zeros_like(ramax) + amax, VALUE_FOR_INF, POW2)
        else:
            sr = _scale(ramax, VALUE_FOR_INF, POW2)
        ob = (i % OUT) * 2
        if ROWS:
            qr0 = (r0 * sr[:, None]).to(rq_desc.dtype)
            if not LEAN:
                qr1 = (r1 * sr[:, None]).to(rq_desc.dtype)
            tma.store_wait(4 * (OUT - 1))  # this buffer's stores (OUT tiles ago) have left; later ones may run
        else:
            tma.store_wait(2 * (OUT - 1))
        gl.thread_barrier()
        if ROWS:
            rq_smem.index(ob).store(qr0)
            if LEAN:
                qr1 = (x_smem.index(2 * s + 1).load(LR).to(gl.float32) * sr[:, None]).to(rq_desc.dtype)
            rq_smem.index(ob + 1).store(qr1)
        c0 = x_smem.index(2 * s).load(LC).to(gl.float32)
        if WEIGHT:
            sc0 = _scale(gl.zeros([64], gl.float32, gl.SliceLayout(0, LC)) + amax, VALUE_FOR_INF, POW2)
        else:
            sc0 = _scale(_amax(c0, 0), VALUE_FOR_INF, POW2)
        cq_smem.index(ob).store(gl.permute((c0 * sc0[None, :]).to(cq_desc.dtype), [1, 0]))
        c1 = x_smem.index(2 * s + 1).load(LC).to(gl.float32)
        if WEIGHT:
            sc1 = sc0
        else:
            sc1 = _scale(_amax(c1, 0), VALUE_FOR_INF, POW2)
        cq_smem.index(ob + 1).store(gl.permute((c1 * sc1[None, :]).to(cq_desc.dtype), [1, 0]))
        fence_async_shared()
        gl.thread_barrier()  # stage s read by every warp, the results in shared memory
        _issue(x_desc, x_smem, bars, t + STAGES * nprog, tiles_k, s, i + STAGES < mine)
        if ROWS:
            tma.async_copy_shared_to_global(rq_desc, [m0, k0], rq_smem.index(ob))
            tma.async_copy_shared_to_global(rq_desc, [m0, k0 + 64], rq_smem.index(ob + 1))
        tma.async_copy_shared_to_global(cq_desc, [k0, m0], cq_smem.index(ob))
        tma.async_copy_shared_to_global(cq_desc, [k0 + 64, m0], cq_smem.index(ob + 1))
        if WEIGHT:  # (rs_ptr: the scales [ceil(N/128), KB]; cs_ptr: the same transposed, rows of MP)
            inv = gl.div_rn(gl.zeros_like(sr) + 1.0, sr)
            gl.store(rs_ptr + tm * KB + tk + rows_r * 0, inv, mask=rows_r == 0)
            gl.store(cs_ptr + tk * MP + tm + rows_r * 0, inv, mask=rows_r == 0)
        else:
            if ROWS:
                gl.store(rs_ptr + tk.to(gl.int64) * MP + m0 + rows_r, gl.div_rn(gl.zeros_like(sr) + 1.0, sr))
            cc = k0 + cols_c
            base = cs_ptr + tm.to(gl.int64) * K
            gl.store(base + cc, gl.div_rn(gl.zeros_like(sc0) + 1.0, sc0), mask=cc < K)
            gl.store(base + cc + 64, gl.div_rn(gl.zeros_like(sc1) + 1.0, sc1), mask=cc + 64 < K)
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def act_tma_kernel(x_desc, rq_desc, cq_desc, rs_ptr, cs_ptr, MP, K, tiles_k, tiles,
                   ROWS: gl.constexpr, VALUE_FOR_INF: gl.constexpr, POW2: gl.constexpr, STAGES: gl.constexpr,
                   OUT: gl.constexpr, LEAN: gl.constexpr, LC16: gl.constexpr, num_warps: gl.constexpr):
    """x [M, K] -> rowwise q [MP, K] + scale_inv stored [K/128, MP]; columnwise q stored [K, MP] + scale_inv
    [MP/128, K] (``act_slab_kernel``'s storage). ROWS=0: the columnwise grid alone (rq_desc is then unused)."""
    _tile_loop(x_desc, rq_desc, cq_desc, rs_ptr, cs_ptr, MP, K, 0, tiles_k, tiles, ROWS, False, VALUE_FOR_INF, POW2,
               STAGES, OUT, LEAN, LC16, num_warps)


@gluon.jit
def weight_tma_kernel(w_desc, q_desc, qt_desc, s_ptr, st_ptr, K, KB, LT, tiles_k, tiles,
                      VALUE_FOR_INF: gl.constexpr, POW2: gl.constexpr, STAGES: gl.constexpr, OUT: gl.constexpr,
                      LEAN: gl.constexpr, LC16: gl.constexpr, num_warps: gl.constexpr):
    """w [N, K] -> q [N, K], qt [K, N], scale_inv [ceil(N/128), KB] and the same transposed ``st [KB, LT]``
    (``weight_tile_kernel``'s storage with SCALE_T)."""
    _tile_loop(w_desc, q_desc, qt_desc, s_ptr, st_ptr, LT, K, KB, tiles_k, tiles, True, True, VALUE_FOR_INF, POW2,
               STAGES, OUT, LEAN, LC16, num_warps)
