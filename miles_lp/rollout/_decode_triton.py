"""Triton kernels of the CUDA decode step (``miles_lp.rollout.cuda_decode``): the elementwise work between the
GEMMs in a few launches instead of dozens.

Each kernel rounds where transformers' eager ops round (to the activation dtype after every op that returns a
tensor), so the result is the eager one's up to the reduction order of the mean square and the approximate
``rsqrt``:

* ``add_rms_kernel``: ``s = x + d`` (the residual add; optional) and ``weight * (s * rsqrt(mean(s^2) + eps))``
  (transformers' Llama/Qwen RMSNorm: fp32 statistics, the normalized row cast to the activation dtype, then
  multiplied by the weight), one row per program.
* ``head_kernel``: one head of one token: optional RMSNorm over the head (Qwen3's q_norm / k_norm), optional
  rotary embedding (``x * cos + rotate_half(x) * sin``, each product rounded), stored at a strided destination
  (the query tensor, or the KV cache at column ``col0 + t``, ``col0`` read from the device).
* ``silu_mul_kernel``: ``silu(gate) * up`` (each rounded).

Loaded through ``miles_lp.formats.kernels.runtime.load_jit_module`` (compiled on CUDA, interpreted on CPU for
the tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_kernel(x_ptr, d_ptr, w_ptr, xo_ptr, y_ptr, N, x_stride, d_stride, xo_stride, y_stride, eps,
                   HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=m, other=0.0)
    if HAS_RES:
        d = tl.load(d_ptr + row * d_stride + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
        tl.store(xo_ptr + row * xo_stride + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    r = tl.math.rsqrt(var + eps)
    h = (xf * r).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_stride + offs, (w * h).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def head_kernel(src_ptr, w_ptr, cos_ptr, sin_ptr, dst_ptr, col_ptr, T, src_stride, dst_sb, dst_sh, dst_ss, eps,
                D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr, USE_COL: tl.constexpr):
    """src ``[B*T, H*D]`` rows (row stride ``src_stride``) -> dst ``[b, h, col0 + t, :]`` (strides given)."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D)
    base = src_ptr + row * src_stride + h * D
    x = tl.load(base + d)
    r = 1.0
    if HAS_NORM:
        xf = x.to(tl.float32)
        r = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        w = tl.load(w_ptr + d).to(tl.float32)
        x = (w * (xf * r).to(x.dtype).to(tl.float32)).to(x.dtype)
    if HAS_ROPE:
        half: tl.constexpr = D // 2
        dp = (d + half) % D  # rotate_half: out[i] = -x[i + D/2] (i < D/2), x[i - D/2] (i >= D/2)
        xp = tl.load(base + dp)
        if HAS_NORM:
            wp = tl.load(w_ptr + dp).to(tl.float32)
            xp = (wp * (xp.to(tl.float32) * r).to(xp.dtype).to(tl.float32)).to(xp.dtype)
        xp = tl.where(d < half, -xp.to(tl.float32), xp.to(tl.float32)).to(x.dtype)
        c = tl.load(cos_ptr + row * D + d).to(tl.float32)
        s = tl.load(sin_ptr + row * D + d).to(tl.float32)
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        b = (xp.to(tl.float32) * s).to(x.dtype).to(tl.float32)
        x = (a + b).to(x.dtype)
    t = row % T
    bi = row // T
    col = t
    if USE_COL:
        col = col + tl.load(col_ptr)
    tl.store(dst_ptr + bi * dst_sb + h * dst_sh + col * dst_ss + d, x.to(dst_ptr.dtype.element_ty))


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, o_ptr, N, g_stride, u_stride, o_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(g_ptr + row * g_stride + offs, mask=m, other=0.0)
    u = tl.load(u_ptr + row * u_stride + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(o_ptr + row * o_stride + offs, (a * u.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=m)
