"""Triton kernels for FP8 blockwise (TE Float8BlockScaling), byte-identical to ``miles_lp.formats.fp8``.

Loaded by ``miles_lp.formats.kernels.fp8_block`` through ``load_jit_module``: compiled on CUDA, or under
``TRITON_INTERPRET=1`` on CPU tensors for the tests. The exactness rules are ``_triton.py``'s: ``448 / amax`` and
``1 / scale`` through ``tl.math.div_rn`` (Triton's ``/`` is approximate), plain fp32 multiplies (``mul.rn``), the
E4M3 encode through ``cvt.rn.satfinite.e4m3`` on CUDA and integer code in the interpreter (whose float8 casts do
not round to nearest even), NaN replaced by 0 before every max (CUDA ``fmaxf``).

One program reads one 128x128 tile once and writes what the GEMMs need from it:

* ``act_tile_kernel`` (activations, gradients ``[M, K]``): the 1x128 rowwise tiles (forward / dgrad operand) and
  the 128x1 tiles (1x128 tiles of the transpose: the wgrad operand), the latter written transposed ``[K, M]``,
  so the GEMM reads both K-major. Rows past M (the padding to a multiple of 128) are written as zeros.
* ``act_slab_kernel``: the same grids from one launch (or the columnwise grid alone), the tile taken in row slabs
  (lower register pressure than one 128x128 tile per thread block holding both grids).
* ``weight_tile_kernel`` (weights ``[N, K]``): one scale per 128x128 tile, the data written as is and
  transposed (the dgrad operand: TE's square tiles serve both, with the same scales).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

HW = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"))


@triton.jit
def _e4m3_code(y):
    """fp32 -> E4M3 byte (int32): RNE, saturate to +-448, NaN -> 0x7F (cvt.rn.satfinite.e4m3); adding
    c = 2^(E+20) rounds |y| to the grid step of its binade in one fp32 add."""
    yb = y.to(tl.int32, bitcast=True)
    sign = (yb >> 24) & 0x80
    ab = yb & 0x7FFFFFFF
    nan = ab > 0x7F800000
    ab = tl.minimum(ab, 0x43E00000)
    eb = tl.maximum(ab >> 23, 121)
    cb = (eb + 20) << 23
    s = ab.to(tl.float32, bitcast=True) + cb.to(tl.float32, bitcast=True)
    k = s.to(tl.int32, bitcast=True) - cb
    code = ((eb - 121) * 8 + k) | sign
    return tl.where(nan, 0x7F, code)


@triton.jit
def _e4m3_byte(y):
    if HW:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return _e4m3_code(y).to(tl.uint8)


@triton.jit
def _load(ptr, offs, mask, BF16_BITS: tl.constexpr):
    """fp32 values; BF16_BITS: bf16 passed as int16 bit patterns, widened by a shift (exact; the interpreter's
    bf16 cast flushes subnormals)."""
    if BF16_BITS:
        b = tl.load(ptr + offs, mask=mask, other=0)
        return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _scale(amax, VALUE_FOR_INF: tl.constexpr, POW2: tl.constexpr):
    """TE compute_scale_from_amax (amax_epsilon 0): 448 / amax; inf -> the input dtype's max; amax inf or 0
    -> 1; POW2: the scale's bits & 0xFF800000."""
    s = tl.math.div_rn(tl.zeros_like(amax) + 448.0, amax)
    s = tl.where(s == float("inf"), VALUE_FOR_INF, s)
    s = tl.where((amax == float("inf")) | (amax == 0.0), 1.0, s)
    if POW2:
        s = (s.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    return s


@triton.jit
def act_tile_kernel(x_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, M, K, MP,
                    ROWS: tl.constexpr, COLS: tl.constexpr, VALUE_FOR_INF: tl.constexpr, POW2: tl.constexpr,
                    BLOCK: tl.constexpr, BF16_BITS: tl.constexpr):
    """x [M, K] (row-major) -> rowwise q [MP, K] + scale_inv stored [K/128, MP] (read as [MP, K/128], M-major),
    columnwise q stored [K, MP] + scale_inv [MP/128, K]."""
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pm * BLOCK + tl.arange(0, BLOCK)
    cols = pk * BLOCK + tl.arange(0, BLOCK)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = _load(x_ptr, rows[:, None].to(tl.int64) * K + cols[None, :], inside, BF16_BITS)
    a = tl.abs(x)
    a = tl.where(a == a, a, 0.0)
    store = (rows[:, None] < MP) & (cols[None, :] < K)
    if ROWS:
        s = _scale(tl.max(a, axis=1), VALUE_FOR_INF, POW2)  # [BLOCK]: one per row of this 1x128 tile column
        q = _e4m3_byte(x * s[:, None])
        tl.store(row_q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=store)
        tl.store(row_s_ptr + pk.to(tl.int64) * MP + rows, tl.math.div_rn(tl.zeros_like(s) + 1.0, s), mask=rows < MP)
    if COLS:
        s = _scale(tl.max(a, axis=0), VALUE_FOR_INF, POW2)  # [BLOCK]: one per column of 128 tokens
        q = _e4m3_byte(x * s[None, :])
        tl.store(col_q_ptr + cols[None, :].to(tl.int64) * MP + rows[:, None], q, mask=store)
        tl.store(col_s_ptr + pm.to(tl.int64) * K + cols, tl.math.div_rn(tl.zeros_like(s) + 1.0, s), mask=cols < K)


@triton.jit
def _raw(ptr, offs, mask, BF16_BITS: tl.constexpr):
    """The input as stored (bf16 stays 16-bit in registers until ``_widen``)."""
    if BF16_BITS:
        return tl.load(ptr + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def _widen(b, BF16_BITS: tl.constexpr):
    if BF16_BITS:
        return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return b.to(tl.float32)


@triton.jit
def _slab_offs(pm, i, cols, M, K, SLAB: tl.constexpr, BLOCK: tl.constexpr):
    rows = pm * BLOCK + i * SLAB + tl.arange(0, SLAB)
    return rows, rows[:, None].to(tl.int64) * K + cols[None, :], (rows[:, None] < M) & (cols[None, :] < K)


@triton.jit
def act_slab_kernel(x_ptr, row_q_ptr, row_s_ptr, col_q_ptr, col_s_ptr, M, K, MP,
                    ROWS: tl.constexpr, VALUE_FOR_INF: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr,
                    BF16_BITS: tl.constexpr, RSLAB: tl.constexpr, CSLAB: tl.constexpr, PREFETCH: tl.constexpr):
    """``act_tile_kernel``'s two grids (ROWS and the columnwise grid; ROWS=0: the columnwise grid alone) from one
    launch, the tile taken in row slabs so that no thread holds the whole 128x128 tile.

    Pass 1, slabs of RSLAB rows: the column amax over the tile (a running max) and, with ROWS, the rowwise grid of
    the slab (a 1x128 tile is one row of the slab: self-contained). Pass 2, slabs of CSLAB rows: the slab read
    again (from L2 / L1: the tile was just read) and quantized with the column scales, written to the transposed
    data ``[K, MP]`` through ``tl.trans`` of the byte slab (stored with the M index fastest). The column amax is
    kept per thread over the slabs (an elementwise max) and reduced across threads once. PREFETCH: each slab's
    load is issued one iteration ahead (two slabs in flight per thread, kept in the input's 16 / 32 bits). On the
    H200 a store of the untransposed slab at transposed addresses, and a cross-thread column max per slab, ran
    1.6-2.3x slower (docs/results/h200-fp8-block-act-2026-12-02)."""
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    cols = pk * BLOCK + tl.arange(0, BLOCK)
    col_in = cols < K
    acc = tl.zeros([RSLAB, BLOCK], dtype=tl.float32)
    NR: tl.constexpr = BLOCK // RSLAB
    if PREFETCH:
        _, offs, inside = _slab_offs(pm, 0, cols, M, K, RSLAB, BLOCK)
        nxt = _raw(x_ptr, offs, inside, BF16_BITS)
    for i in range(0, NR):
        rows, offs, inside = _slab_offs(pm, i, cols, M, K, RSLAB, BLOCK)
        if PREFETCH:
            b = nxt
            _, offs_n, inside_n = _slab_offs(pm, i + 1, cols, M, K, RSLAB, BLOCK)
            nxt = _raw(x_ptr, offs_n, inside_n & (i + 1 < NR), BF16_BITS)
        else:
            b = _raw(x_ptr, offs, inside, BF16_BITS)
        x = _widen(b, BF16_BITS)
        a = tl.abs(x)
        a = tl.where(a == a, a, 0.0)
        acc = tl.maximum(acc, a)
        if ROWS:
            s = _scale(tl.max(a, axis=1), VALUE_FOR_INF, POW2)
            q = _e4m3_byte(x * s[:, None])
            tl.store(row_q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q,
                     mask=(rows[:, None] < MP) & col_in[None, :])
            tl.store(row_s_ptr + pk.to(tl.int64) * MP + rows, tl.math.div_rn(tl.zeros_like(s) + 1.0, s),
                     mask=rows < MP)
    sc = _scale(tl.max(acc, axis=0), VALUE_FOR_INF, POW2)  # [BLOCK]: one per column of 128 tokens
    tl.store(col_s_ptr + pm.to(tl.int64) * K + cols, tl.math.div_rn(tl.zeros_like(sc) + 1.0, sc), mask=col_in)
    NC: tl.constexpr = BLOCK // CSLAB
    if PREFETCH:
        _, offs, inside = _slab_offs(pm, 0, cols, M, K, CSLAB, BLOCK)
        nxt = _raw(x_ptr, offs, inside, BF16_BITS)
    for j in range(0, NC):
        rows, offs, inside = _slab_offs(pm, j, cols, M, K, CSLAB, BLOCK)
        if PREFETCH:
            b = nxt
            _, offs_n, inside_n = _slab_offs(pm, j + 1, cols, M, K, CSLAB, BLOCK)
            nxt = _raw(x_ptr, offs_n, inside_n & (j + 1 < NC), BF16_BITS)
        else:
            b = _raw(x_ptr, offs, inside, BF16_BITS)
        q = _e4m3_byte(_widen(b, BF16_BITS) * sc[None, :])
        qt = tl.trans(q)  # [BLOCK, CSLAB]: row c of it is CSLAB consecutive bytes of the transposed data
        tl.store(col_q_ptr + cols[:, None].to(tl.int64) * MP + rows[None, :], qt,
                 mask=col_in[:, None] & (rows[None, :] < MP))


@triton.jit
def weight_tile_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, st_ptr, N, K, KB, LT, TRANSPOSED: tl.constexpr,
                       SCALE_T: tl.constexpr, VALUE_FOR_INF: tl.constexpr, POW2: tl.constexpr, BLOCK: tl.constexpr,
                       BF16_BITS: tl.constexpr):
    """w [N, K] -> q [N, K], (TRANSPOSED) qt [K, N], scale_inv [ceil(N/128), KB]: one scale per 128x128 tile;
    (SCALE_T) the scales also transposed, ``st [KB, LT]`` (the dgrad GEMM's scale_b storage)."""
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    rows = pn * BLOCK + tl.arange(0, BLOCK)
    cols = pk * BLOCK + tl.arange(0, BLOCK)
    inside = (rows[:, None] < N) & (cols[None, :] < K)
    w = _load(w_ptr, rows[:, None].to(tl.int64) * K + cols[None, :], inside, BF16_BITS)
    a = tl.abs(w)
    a = tl.where(a == a, a, 0.0)
    amax = tl.max(tl.max(a, axis=1), axis=0)
    s = _scale(tl.zeros([BLOCK], dtype=tl.float32) + amax, VALUE_FOR_INF, POW2)  # (a vector: one code path)
    q = _e4m3_byte(w * s[:, None])
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=inside)
    if TRANSPOSED:
        tl.store(qt_ptr + cols[None, :].to(tl.int64) * N + rows[:, None], q, mask=inside)
    inv = tl.math.div_rn(tl.zeros_like(s) + 1.0, s)
    first = tl.arange(0, BLOCK) == 0
    tl.store(s_ptr + pn * KB + pk + tl.arange(0, BLOCK) * 0, inv, mask=first)
    if SCALE_T:
        tl.store(st_ptr + pk * LT + pn + tl.arange(0, BLOCK) * 0, inv, mask=first)
