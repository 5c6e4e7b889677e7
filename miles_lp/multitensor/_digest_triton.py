"""The C2 fingerprint as one Triton kernel over many tensors read in place (loaded by ``miles_lp.multitensor.kernels``,
with ``@triton.jit`` compiled or interpreted: Triton decides at decoration time).

Each program takes ``ROWS`` rows of 1024 little-endian int32 words of ONE tensor (the block table says which
tensor and which first row), reads them where they live (``base + offset``: a pointer table as apex's
multi_tensor_apply, no concatenation), and adds ``mult * sum_r wrow(r) * sum_c word[r, c] * wcol[c]`` into its
tensor's output slot (int64 atomic add: integer sums wrap mod 2^64, so the result does not depend on the order
the programs finish in). Words past a tensor's last byte read as 0: the zero padding of the reference
(``miles_lp.multitensor.digest._segment_sums``), so a tensor's value is the reference's, bit for bit.
"""

import triton
import triton.language as tl


@triton.jit
def fingerprint_kernel(base_ptr, meta_ptr, ntensors, wcol_ptr, out_ptr, ROWS: tl.constexpr, ALIGNED: tl.constexpr,
                       SUM64: tl.constexpr):
    # meta (int64): per tensor [offset from base in bytes, nbytes, output slot, multiplier], then per program
    # [tensor index, first row]
    pid = tl.program_id(0).to(tl.int64)
    blk = meta_ptr + 4 * ntensors + 2 * pid
    t = tl.load(blk)
    r0 = tl.load(blk + 1)
    ent = meta_ptr + 4 * t
    off = tl.load(ent)
    n = tl.load(ent + 1)
    slot = tl.load(ent + 2)
    mult = tl.load(ent + 3)
    cols = tl.arange(0, 1024)
    wcol = tl.load(wcol_ptr + cols)
    acc = (r0 * 0).to(tl.int64)
    for i in tl.static_range(ROWS):
        row = r0 + i
        if ALIGNED:  # offset and size multiples of 16 bytes: whole int32 words, vector loads
            off16 = tl.multiple_of(off, 16)
            nw = tl.multiple_of(n // 4, 4)
            wp = (base_ptr + off16).to(tl.pointer_type(tl.int32))
            widx = row * 1024 + cols
            w = tl.load(wp + widx, mask=widx < nw, other=0)
        else:  # any offset and size: the words assembled from bytes (a partial last word zero-padded)
            k = tl.arange(0, 4)
            bidx = row * 4096 + cols[:, None] * 4 + k[None, :]
            b = tl.load(base_ptr + off + bidx, mask=bidx < n, other=0).to(tl.int32)
            w = tl.sum(b << (k[None, :] * 8), axis=1)
        if SUM64:  # the interpreter (numpy) sums int32 in int64 and refuses to narrow: the same low 32 bits
            rs = tl.sum((w * wcol).to(tl.int64), axis=0).to(tl.int32)
        else:
            rs = tl.sum(w * wcol, axis=0)  # int32, wrapping (as the reference's int32 products and row sums)
        wrow = (row * -7046029254386353131 + 0x7F4A7C15) | 1  # int64, wrapping
        acc += rs.to(tl.int64) * wrow
    tl.atomic_add(out_ptr + slot, acc * mult)


@triton.jit
def copy_kernel(src_ptr, dst_ptr, meta_ptr, ntensors, wcol_ptr, out_ptr, ROWS: tl.constexpr, ALIGNED: tl.constexpr,
                DIGEST: tl.constexpr, SUM64: tl.constexpr):
    # meta (int64): per tensor [source offset from src_ptr in bytes, nbytes, destination offset in dst_ptr,
    # output slot, multiplier], then per program [tensor index, first row of 4096 bytes]: many tensors into one
    # buffer, each read in place. DIGEST: the words read are also summed into ``out[slot]`` exactly as
    # ``fingerprint_kernel`` does (mult * sum_r wrow(r) * sum_c word * wcol): the bytes' fingerprint for free.
    pid = tl.program_id(0).to(tl.int64)
    blk = meta_ptr + 5 * ntensors + 2 * pid
    t = tl.load(blk)
    r0 = tl.load(blk + 1)
    ent = meta_ptr + 5 * t
    soff = tl.load(ent)
    n = tl.load(ent + 1)
    doff = tl.load(ent + 2)
    cols = tl.arange(0, 1024)
    acc = (r0 * 0).to(tl.int64)
    if DIGEST:
        wcol = tl.load(wcol_ptr + cols)
    for i in tl.static_range(ROWS):
        row = r0 + i
        if ALIGNED:  # offsets and size multiples of 16 bytes: int32 words, vector loads and stores
            sp = (src_ptr + tl.multiple_of(soff, 16)).to(tl.pointer_type(tl.int32))
            dp = (dst_ptr + tl.multiple_of(doff, 16)).to(tl.pointer_type(tl.int32))
            nw = tl.multiple_of(n // 4, 4)
            widx = row * 1024 + cols
            m = widx < nw
            w = tl.load(sp + widx, mask=m, other=0)
            tl.store(dp + widx, w, mask=m)
        else:
            k = tl.arange(0, 4)
            bidx = row * 4096 + cols[:, None] * 4 + k[None, :]
            m = bidx < n
            v = tl.load(src_ptr + soff + bidx, mask=m, other=0)
            tl.store(dst_ptr + doff + bidx, v, mask=m)
            if DIGEST:
                w = tl.sum(v.to(tl.int32) << (k[None, :] * 8), axis=1)
        if DIGEST:
            if SUM64:
                rs = tl.sum((w * wcol).to(tl.int64), axis=0).to(tl.int32)
            else:
                rs = tl.sum(w * wcol, axis=0)
            acc += rs.to(tl.int64) * ((row * -7046029254386353131 + 0x7F4A7C15) | 1)
    if DIGEST:
        slot = tl.load(ent + 3)
        mult = tl.load(ent + 4)
        tl.atomic_add(out_ptr + slot, acc * mult)


@triton.jit
def ff_count_kernel(base_ptr, meta_ptr, ntensors, out_ptr, ROWS: tl.constexpr):
    # the fingerprint kernel's tables; adds the number of bytes equal to 0xFF (the staging fill) into the slot
    pid = tl.program_id(0).to(tl.int64)
    blk = meta_ptr + 4 * ntensors + 2 * pid
    t = tl.load(blk)
    r0 = tl.load(blk + 1)
    ent = meta_ptr + 4 * t
    off = tl.load(ent)
    n = tl.load(ent + 1)
    slot = tl.load(ent + 2)
    cols = tl.arange(0, 4096)
    acc = (r0 * 0).to(tl.int64)
    for i in tl.static_range(ROWS):
        b = (r0 + i) * 4096 + cols
        v = tl.load(base_ptr + off + b, mask=b < n, other=0)
        acc += tl.sum((v == 255).to(tl.int32), axis=0).to(tl.int64)
    tl.atomic_add(out_ptr + slot, acc)
