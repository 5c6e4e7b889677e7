"""Fused CPU kernels for the MXFP8 and NVFP4 codecs: one pass per tensor, the reference rule's bytes.

The eager codecs run a dozen torch ops per slice, each writing an fp32 temporary; on the 2-core CPU
(2026-12-01) that is ~1.1 GB/s of bf16 input for MXFP8 and ~0.5 GB/s for NVFP4 on one core, and
``torch.compile`` (Inductor's C++ backend) measured 0.62 GB/s there (it does not vectorize the e4m3 cast).
These loops read each element once, keep everything in registers and write the bytes.

They are plain C (no torch headers: compiled in ~0.3 s), built once per source, compiler and CPU with the
system C compiler (``$CC``, else ``cc``) into a cache folder (``$MILES_LP_CACHE_DIR``, else
``~/.cache/miles-lp``; the build is written under a temporary name and renamed), and called through
``ctypes``, which releases the GIL during the call: Python threads run them on both cores.

Numerics (why the bytes equal the reference codecs in ``mxfp8.py`` / ``nvfp4.py``):

* every fp32 operation the reference does (``amax * fp32(1/448)``, ``x * inv``, ``2688 / amax``,
  ``sf * S_dec``, ``1 / (...)``, ``x * enc``) is done here in the same order, one IEEE fp32 operation at a
  time: the file is compiled with ``-ffp-contract=off`` (no fused multiply-add) and without fast-math;
  subnormals are kept (the caller's MXCSR: Python and torch leave flush-to-zero off);
* the NaN-ignoring amax is an integer max over ``|x|``'s bit patterns with NaN patterns replaced by 0
  (a non-negative float orders like its bits), exactly ``nan_ignoring_abs(x).amax()``;
* ``e8m0_round_up``, ``e8m0_inverse`` and ``e2m1_codes`` are the integer forms of ``bits.py``, line for
  line; the e4m3 cast is round-to-nearest-even on the bits, with ``bits.e4m3_satfinite``'s clamp to
  +-448 and NaN -> 0x7F; equal to it for every bf16 input times every E8M0 inverse scale and for random
  fp32 bit patterns (``tests/unit/test_speed_native.py``);
* the MXFP8 loops over blocks of 32 run on ``torch.get_num_threads()`` threads (OpenMP, sharing torch's runtime;
  called from the main thread) for tensors of 4096 blocks or more: each block's bytes depend on that block alone,
  so the slices write what one thread writes; a compiler without OpenMP builds them single-threaded.

``runtime.native: false`` (or ``MILES_LP_NATIVE=0``) turns the kernels off (the codecs then run their eager torch path); so does a
missing or failing compiler (one warning, then the eager path).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from miles_lp.config import switch

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* bits.e4m3_satfinite: clamp to +-448, NaN -> 0x7F, round to nearest even (subnormals: m * 2^-9). */
static inline uint8_t e4m3(float y) {
    uint32_t b = f2u(y);
    uint32_t a = b & 0x7FFFFFFFu;
    uint32_t sign = (b >> 24) & 0x80u;
    uint32_t nrm = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;  /* rebias 127 -> 7, 3 mantissa bits */
    uint32_t sub = f2u(u2f(a) * 512.0f + 12582912.0f) - 0x4B400000u;  /* RNE(|y| * 2^9), |y| < 2^-6 */
    uint32_t c = a >= 0x3C800000u ? nrm : sub;                         /* 2^-6: smallest normal e4m3 */
    c = a >= 0x43E00000u ? 0x7Eu : c;                                   /* |y| >= 448 (and inf): 448 */
    c |= sign;
    return (uint8_t)(a > 0x7F800000u ? 0x7Fu : c);
}

/* bits.e8m0_round_up for v >= 0 (never NaN here: the amax ignores NaN). */
static inline uint32_t e8m0_up(float v) {
    int32_t b = (int32_t)f2u(v);
    int32_t e = (b + 0x7FFFFF) >> 23;
    if (e > 0xFE) e = 0xFE;
    if (b <= 0x400000) e = 0;
    return (uint32_t)e;
}

/* bits.e8m0_inverse: 2^(127 - e); e = 254 -> 2^-127 (subnormal). */
static inline float e8m0_inv(uint32_t e) {
    return u2f(e == 254u ? 0x00400000u : (254u - e) << 23);
}

/* bits.e2m1_codes, integer form. */
static inline uint8_t e2m1(float y) {
    int32_t yi = (int32_t)f2u(y);
    int32_t a = yi & 0x7FFFFFFF;
    int32_t sign = ((((a - 0x7F800001) >> 31) & yi) >> 31) & 0x8;
    if (a > 0x40C00000) a = 0x40C00000;
    int32_t c = a < 0x3F800000 ? 0x3F800000 : a;
    c &= 0x7F800000;
    c += 22 << 23;
    int32_t k = (int32_t)f2u(u2f((uint32_t)a) + u2f((uint32_t)c));
    k -= c;
    c -= 0x4A800000;
    c >>= 22;
    k += c;
    k |= sign;
    return (uint8_t)k;
}

#define INV448_F u2f(0x3B124925u) /* fp32(1/448) */

/* Blocks are independent (each block's bytes depend on that block alone), so a loop over them may run on the
   caller's nthreads (torch.get_num_threads()) in static slices: the same bytes as one thread. Built with -fopenmp
   the library shares torch's OpenMP runtime (libgomp.so.1 is already loaded): torch's own worker threads run the
   slices; without OpenMP the pragma is empty. Small tensors stay on the calling thread. */
#define MIN_PARALLEL_BLOCKS 4096
#ifdef _OPENMP
#define PARALLEL_BLOCKS _Pragma("omp parallel for schedule(static) num_threads(nthreads) if(nthreads > 1 && nblocks >= MIN_PARALLEL_BLOCKS)")
#else
#define PARALLEL_BLOCKS (void)nthreads;
#endif

/* |x| bits with NaN -> 0, for the two input types */
static inline uint32_t absbits_bf16(uint16_t v) { uint32_t a = v & 0x7FFFu; return a > 0x7F80u ? 0u : a; }
static inline uint32_t absbits_f32(uint32_t v) { uint32_t a = v & 0x7FFFFFFFu; return a > 0x7F800000u ? 0u : a; }
static inline float val_bf16(uint16_t v) { return u2f((uint32_t)v << 16); }
static inline float val_f32(uint32_t v) { return u2f(v); }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1
/* 16 fp32 lanes -> e4m3 bytes: e4m3() above, lane by lane */
static inline __m128i e4m3_x16(__m512 y) {
    const __m512i b = _mm512_castps_si512(y);
    const __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
    __m512i nrm = _mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF));
    nrm = _mm512_add_epi32(nrm, _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1)));
    nrm = _mm512_sub_epi32(_mm512_srli_epi32(nrm, 20), _mm512_set1_epi32(960));
    __m512 t = _mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f));
    t = _mm512_add_ps(t, _mm512_set1_ps(12582912.0f));
    __m512i c = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_set1_epi32(0x4B400000));
    c = _mm512_mask_mov_epi32(c, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(0x3C800000)), nrm);
    c = _mm512_mask_mov_epi32(c, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(0x43E00000)), _mm512_set1_epi32(0x7E));
    c = _mm512_or_si512(c, sign);
    c = _mm512_mask_mov_epi32(c, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0x7F));
    return _mm512_cvtepi32_epi8(c);
}
/* 16 fp32 lanes -> E2M1 codes in int32 lanes: e2m1() above, lane by lane */
static inline __m512i e2m1_x16(__m512 y) {
    const __m512i yi = _mm512_castps_si512(y);
    __m512i a = _mm512_and_si512(yi, _mm512_set1_epi32(0x7FFFFFFF));
    __m512i sign = _mm512_sub_epi32(a, _mm512_set1_epi32(0x7F800001));
    sign = _mm512_srai_epi32(sign, 31);
    sign = _mm512_and_si512(sign, yi);
    sign = _mm512_srai_epi32(sign, 31);
    sign = _mm512_and_si512(sign, _mm512_set1_epi32(0x8));
    a = _mm512_min_epi32(a, _mm512_set1_epi32(0x40C00000));
    __m512i c = _mm512_max_epi32(a, _mm512_set1_epi32(0x3F800000));
    c = _mm512_and_si512(c, _mm512_set1_epi32(0x7F800000));
    c = _mm512_add_epi32(c, _mm512_set1_epi32(22 << 23));
    __m512i k = _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(c)));
    k = _mm512_sub_epi32(k, c);
    c = _mm512_sub_epi32(c, _mm512_set1_epi32(0x4A800000));
    c = _mm512_srai_epi32(c, 22);
    k = _mm512_add_epi32(k, c);
    return _mm512_or_si512(k, sign);
}
/* max of 16 u16 lanes */
static inline uint32_t hmax_epu16_128(__m128i v) {
    return 0xFFFFu - (uint32_t)_mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(v, _mm_set1_epi16(-1))), 0);
}
static inline __m256i absnan_bf16_x16(__m256i v) {  /* |x| bits, NaN -> 0 */
    __m256i a = _mm256_and_si256(v, _mm256_set1_epi16(0x7FFF));
    return _mm256_maskz_mov_epi16(_mm256_cmple_epi16_mask(a, _mm256_set1_epi16(0x7F80)), a);
}
static inline __m512i absnan_f32_x16(__m512i v) {
    __m512i a = _mm512_and_si512(v, _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_maskz_mov_epi32(_mm512_cmple_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), a);
}
static inline __m512 bf16_to_f32_x16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

void mxfp8_rowwise_bf16(const uint16_t *x, int64_t nblocks, uint8_t *q, uint8_t *scale, int nthreads) {
    PARALLEL_BLOCKS
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        const uint16_t *xb = x + blk * 32;
        uint8_t *qb = q + blk * 32;
#ifdef HAVE_AVX512
        __m256i v0 = _mm256_loadu_si256((const __m256i *)xb), v1 = _mm256_loadu_si256((const __m256i *)(xb + 16));
        __m256i m = _mm256_max_epu16(absnan_bf16_x16(v0), absnan_bf16_x16(v1));
        uint32_t mx = hmax_epu16_128(_mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));
        uint32_t e = e8m0_up(u2f(mx << 16) * INV448_F);
        __m512 inv = _mm512_set1_ps(e8m0_inv(e));
        _mm_storeu_si128((__m128i *)qb, e4m3_x16(_mm512_mul_ps(bf16_to_f32_x16(v0), inv)));
        _mm_storeu_si128((__m128i *)(qb + 16), e4m3_x16(_mm512_mul_ps(bf16_to_f32_x16(v1), inv)));
#else
        uint32_t mx = 0;
        for (int i = 0; i < 32; ++i) { uint32_t a = absbits_bf16(xb[i]); mx = a > mx ? a : mx; }
        uint32_t e = e8m0_up(u2f(mx << 16) * INV448_F);
        float inv = e8m0_inv(e);
        for (int i = 0; i < 32; ++i) qb[i] = e4m3(val_bf16(xb[i]) * inv);
#endif
        scale[blk] = (uint8_t)e;
    }
}

void mxfp8_rowwise_f32(const uint32_t *x, int64_t nblocks, uint8_t *q, uint8_t *scale, int nthreads) {
    PARALLEL_BLOCKS
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        const uint32_t *xb = x + blk * 32;
        uint8_t *qb = q + blk * 32;
#ifdef HAVE_AVX512
        __m512i v0 = _mm512_loadu_si512(xb), v1 = _mm512_loadu_si512(xb + 16);
        uint32_t mx = (uint32_t)_mm512_reduce_max_epi32(_mm512_max_epi32(absnan_f32_x16(v0), absnan_f32_x16(v1)));
        uint32_t e = e8m0_up(u2f(mx) * INV448_F);
        __m512 inv = _mm512_set1_ps(e8m0_inv(e));
        _mm_storeu_si128((__m128i *)qb, e4m3_x16(_mm512_mul_ps(_mm512_castsi512_ps(v0), inv)));
        _mm_storeu_si128((__m128i *)(qb + 16), e4m3_x16(_mm512_mul_ps(_mm512_castsi512_ps(v1), inv)));
#else
        uint32_t mx = 0;
        for (int i = 0; i < 32; ++i) { uint32_t a = absbits_f32(xb[i]); mx = a > mx ? a : mx; }
        uint32_t e = e8m0_up(u2f(mx) * INV448_F);
        float inv = e8m0_inv(e);
        for (int i = 0; i < 32; ++i) qb[i] = e4m3(val_f32(xb[i]) * inv);
#endif
        scale[blk] = (uint8_t)e;
    }
}

/* NaN-ignoring amax of each row of x [rows, k] (fp32 out) */
void row_amax_bf16(const uint16_t *x, int64_t rows, int64_t k, float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *xr = x + r * k;
        uint32_t m = 0;
        int64_t i = 0;
#ifdef HAVE_AVX512
        __m256i acc = _mm256_setzero_si256();
        for (; i + 16 <= k; i += 16) acc = _mm256_max_epu16(acc, absnan_bf16_x16(_mm256_loadu_si256((const __m256i *)(xr + i))));
        m = hmax_epu16_128(_mm_max_epu16(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1)));
#endif
        for (; i < k; ++i) { uint32_t a = absbits_bf16(xr[i]); m = a > m ? a : m; }
        out[r] = u2f(m << 16);
    }
}

void row_amax_f32(const uint32_t *x, int64_t rows, int64_t k, float *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const uint32_t *xr = x + r * k;
        uint32_t m = 0;
        int64_t i = 0;
#ifdef HAVE_AVX512
        __m512i acc = _mm512_setzero_si512();
        for (; i + 16 <= k; i += 16) acc = _mm512_max_epi32(acc, absnan_f32_x16(_mm512_loadu_si512(xr + i)));
        m = (uint32_t)_mm512_reduce_max_epi32(acc);
#endif
        for (; i < k; ++i) { uint32_t a = absbits_f32(xr[i]); m = a > m ? a : m; }
        out[r] = u2f(m);
    }
}

/* NaN-ignoring amax of each 1x16 block: x [n16 * 16] -> out [n16] */
void block_amax16_bf16(const uint16_t *x, int64_t n16, float *out) {
    for (int64_t b = 0; b < n16; ++b) {
        const uint16_t *xb = x + b * 16;
#ifdef HAVE_AVX512
        __m256i a = absnan_bf16_x16(_mm256_loadu_si256((const __m256i *)xb));
        uint32_t m = hmax_epu16_128(_mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
#else
        uint32_t m = 0;
        for (int i = 0; i < 16; ++i) { uint32_t a = absbits_bf16(xb[i]); m = a > m ? a : m; }
#endif
        out[b] = u2f(m << 16);
    }
}

void block_amax16_f32(const uint32_t *x, int64_t n16, float *out) {
    for (int64_t b = 0; b < n16; ++b) {
        const uint32_t *xb = x + b * 16;
        uint32_t m = 0;
        for (int i = 0; i < 16; ++i) { uint32_t a = absbits_f32(xb[i]); m = a > m ? a : m; }
        out[b] = u2f(m);
    }
}

/* NVFP4 encode of rows x [rows, k]: per row r the scales s_dec[r] and sf_scale[r] (= S_enc * fp32(1/6));
   amax_b [rows, k/16] or NULL (then computed here, 1x16 blocks). data [rows, k/2], sf [rows, k/16].
   Per block: sf = e4m3(amax_b * sf_scale); enc = fminf(1 / (float(sf) * s_dec), FLT_MAX); q = e2m1(x * enc). */
static inline float nv_enc(float am, float ss, float sd, const float *e4m3_table, uint8_t *sfb) {
    uint8_t s = e4m3(am * ss);
    float enc = 1.0f / (e4m3_table[s] * sd);
    *sfb = s;
    return enc > u2f(0x7F7FFFFFu) ? u2f(0x7F7FFFFFu) : enc;
}

void nvfp4_encode_bf16(const uint16_t *x, int64_t rows, int64_t k, const float *amax_b, const float *s_dec,
                       const float *sf_scale, const float *e4m3_table, uint8_t *data, uint8_t *sf) {
    const int64_t nb = k / 16;
    for (int64_t r = 0; r < rows; ++r) {
        const float sd = s_dec[r], ss = sf_scale[r];
        for (int64_t b = 0; b < nb; ++b) {
            const uint16_t *xb = x + r * k + b * 16;
            uint8_t *db = data + r * (k / 2) + b * 8;
#ifdef HAVE_AVX512
            __m256i v = _mm256_loadu_si256((const __m256i *)xb);
            float am;
            if (amax_b) am = amax_b[r * nb + b];
            else {
                __m256i a = absnan_bf16_x16(v);
                am = u2f(hmax_epu16_128(_mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1))) << 16);
            }
            float enc = nv_enc(am, ss, sd, e4m3_table, sf + r * nb + b);
            __m512i c = e2m1_x16(_mm512_mul_ps(bf16_to_f32_x16(v), _mm512_set1_ps(enc)));
            c = _mm512_or_si512(c, _mm512_srli_epi64(c, 28));  /* code[2j+1] (bit 32) -> bits 4..7 */
            _mm_storel_epi64((__m128i *)db, _mm512_cvtepi64_epi8(c));
#else
            float am;
            if (amax_b) am = amax_b[r * nb + b];
            else {
                uint32_t m = 0;
                for (int i = 0; i < 16; ++i) { uint32_t a = absbits_bf16(xb[i]); m = a > m ? a : m; }
                am = u2f(m << 16);
            }
            float enc = nv_enc(am, ss, sd, e4m3_table, sf + r * nb + b);
            for (int i = 0; i < 8; ++i)
                db[i] = (uint8_t)(e2m1(val_bf16(xb[2 * i]) * enc) | (e2m1(val_bf16(xb[2 * i + 1]) * enc) << 4));
#endif
        }
    }
}

void nvfp4_encode_f32(const uint32_t *x, int64_t rows, int64_t k, const float *amax_b, const float *s_dec,
                      const float *sf_scale, const float *e4m3_table, uint8_t *data, uint8_t *sf) {
    const int64_t nb = k / 16;
    for (int64_t r = 0; r < rows; ++r) {
        const float sd = s_dec[r], ss = sf_scale[r];
        for (int64_t b = 0; b < nb; ++b) {
            const uint32_t *xb = x + r * k + b * 16;
            uint8_t *db = data + r * (k / 2) + b * 8;
            float am;
            if (amax_b) am = amax_b[r * nb + b];
            else {
                uint32_t m = 0;
                for (int i = 0; i < 16; ++i) { uint32_t a = absbits_f32(xb[i]); m = a > m ? a : m; }
                am = u2f(m);
            }
            float enc = nv_enc(am, ss, sd, e4m3_table, sf + r * nb + b);
            for (int i = 0; i < 8; ++i)
                db[i] = (uint8_t)(e2m1(val_f32(xb[2 * i]) * enc) | (e2m1(val_f32(xb[2 * i + 1]) * enc) << 4));
        }
    }
}

/* MXFP8 decode (MXFP8Tensor.dequantize): fp32(e4m3_value(q) * 2^(e-127)), exact (an E4M3 value times a power of
   two, at worst an fp32 subnormal), then for bf16 output rounded to nearest even as torch rounds fp32 -> bf16.
   NaN as torch computes it: an E4M3 NaN code is fp32 0x7FF00000 | sign (torch's e4m3 -> fp32), scale byte 255
   is 0x7FFFFFFF (bits.e8m0_value); the reference's product keeps the scale's NaN when both are NaN (measured on
   every code x every scale byte, tests/unit/test_speed_native_decode.py); every NaN becomes 0xFFFF in bf16 (torch's
   vectorized fp32 -> bf16). */
static inline uint32_t e8m0_bits(uint32_t e) { return e == 0u ? 0x00400000u : (e == 255u ? 0x7FFFFFFFu : e << 23); }

static inline uint32_t e4m3_f32bits(uint32_t b) {
    uint32_t sign = (b & 0x80u) << 24, em = b & 0x7Fu;
    if (em == 0x7Fu) return sign | 0x7FF00000u;
    if (em < 8u) return sign | f2u((float)em * 0.001953125f);  /* subnormal: m * 2^-9 (exact) */
    return sign | ((em << 20) + (120u << 23));
}

static inline uint32_t mx_decode1(uint32_t b, uint32_t sbits) {
    uint32_t v = e4m3_f32bits(b);
    if (sbits == 0x7FFFFFFFu) return sbits;
    if ((v & 0x7FFFFFFFu) > 0x7F800000u) return v;
    return f2u(u2f(v) * u2f(sbits));
}

static inline uint16_t bf16_rne(uint32_t u) {
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef HAVE_AVX512
/* 16 E4M3 bytes times one scale (fp32 bits) -> 16 fp32 lanes: mx_decode1 lane by lane */
static inline __m512i mx_decode_x16(__m128i bytes, uint32_t sbits) {
    const __m512i b = _mm512_cvtepu8_epi32(bytes);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    __m512i v = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0.001953125f));
    v = _mm512_mask_mov_epi32(v, _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), _mm512_castps_si512(sub));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F));
    v = _mm512_or_si512(_mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(0x7FF00000)), sign);
    if (sbits == 0x7FFFFFFFu) return _mm512_set1_epi32(0x7FFFFFFF);
    __m512i p = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(v), _mm512_castsi512_ps(_mm512_set1_epi32((int)sbits))));
    return _mm512_mask_mov_epi32(p, nan, v);
}
/* 16 fp32 lanes (bits) -> 16 bf16: bf16_rne lane by lane */
static inline __m256i bf16_rne_x16(__m512i u) {
    __m512i r = _mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF));
    r = _mm512_add_epi32(r, _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    r = _mm512_srli_epi32(r, 16);
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)), _mm512_set1_epi32(0xFFFF));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* rowwise decode of nblocks blocks of 32: q [nblocks * 32] e4m3, scale [nblocks] E8M0 */
void mxfp8_decode_rowwise_bf16(const uint8_t *q, const uint8_t *scale, int64_t nblocks, uint16_t *out, int nthreads) {
    PARALLEL_BLOCKS
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        const uint32_t sb = e8m0_bits(scale[blk]);
        const uint8_t *qb = q + blk * 32;
        uint16_t *ob = out + blk * 32;
#ifdef HAVE_AVX512
        _mm256_storeu_si256((__m256i *)ob, bf16_rne_x16(mx_decode_x16(_mm_loadu_si128((const __m128i *)qb), sb)));
        _mm256_storeu_si256((__m256i *)(ob + 16), bf16_rne_x16(mx_decode_x16(_mm_loadu_si128((const __m128i *)(qb + 16)), sb)));
#else
        for (int i = 0; i < 32; ++i) ob[i] = bf16_rne(mx_decode1(qb[i], sb));
#endif
    }
}

void mxfp8_decode_rowwise_f32(const uint8_t *q, const uint8_t *scale, int64_t nblocks, uint32_t *out, int nthreads) {
    PARALLEL_BLOCKS
    for (int64_t blk = 0; blk < nblocks; ++blk) {
        const uint32_t sb = e8m0_bits(scale[blk]);
        const uint8_t *qb = q + blk * 32;
        uint32_t *ob = out + blk * 32;
#ifdef HAVE_AVX512
        _mm512_storeu_si512(ob, mx_decode_x16(_mm_loadu_si128((const __m128i *)qb), sb));
        _mm512_storeu_si512(ob + 16, mx_decode_x16(_mm_loadu_si128((const __m128i *)(qb + 16)), sb));
#else
        for (int i = 0; i < 32; ++i) ob[i] = mx_decode1(qb[i], sb);
#endif
    }
}

/* element-level entry points for the tests */
void e4m3_cast(const float *y, int64_t n, uint8_t *out) { for (int64_t i = 0; i < n; ++i) out[i] = e4m3(y[i]); }
void e2m1_cast(const float *y, int64_t n, uint8_t *out) { for (int64_t i = 0; i < n; ++i) out[i] = e2m1(y[i]); }
float inv448(void) { return INV448_F; }
#ifdef _OPENMP
int threaded(void) { return 1; }
#else
int threaded(void) { return 0; }
#endif
"""

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c99"]
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_disabled = 0  # > 0 inside ``disabled()``


def _cache_root() -> Path:
    root = os.environ.get("MILES_LP_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "miles-lp"


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` depends on them: a cache shared between machines)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build(cc: str, source: str = SOURCE, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared library for ``source``: from the cache, or compiled into it (temporary name, then renamed)."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    flags = [*_FLAGS, *extra_flags]
    key = hashlib.sha256("\0".join([source, " ".join(flags), cc, version, _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:20]
    lib = _cache_root() / "native" / f"codecs-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src = Path(tmp) / "codecs.c"
        src.write_text(source)
        out = Path(tmp) / "codecs.so"
        res = subprocess.run([cc, *flags, str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
        if res.returncode:
            raise RuntimeError(f"{cc} failed ({res.returncode}): {res.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: concurrent builders each rename a complete file
    return lib


def load(source: str = SOURCE, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or find in the cache) and load ``source``; raises ``RuntimeError`` when that fails.
    ``library()`` is the cached, checked instance of ``SOURCE``; tests load mutated sources and the portable
    (``extra_flags=("-mno-avx512f",)``) build with this."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set $CC or install cc)")
    try:  # OpenMP (the block loops on torch's threads), else one thread per call: the same bytes either way
        path = _build(cc, source, (*extra_flags, "-fopenmp"))
    except RuntimeError:
        path = _build(cc, source, extra_flags)
    lib = ctypes.CDLL(str(path))
    _declare(lib)
    from miles_lp.formats import bits

    if bits.f32_bits(lib.inv448()) != bits.FP32_INV_448_BITS:
        raise RuntimeError("the compiled fp32(1/448) constant has the wrong bits")
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for t in ("bf16", "f32"):
        getattr(lib, f"mxfp8_rowwise_{t}").argtypes = [p, i64, p, p, ctypes.c_int]
        getattr(lib, f"row_amax_{t}").argtypes = [p, i64, i64, p]
        getattr(lib, f"block_amax16_{t}").argtypes = [p, i64, p]
        getattr(lib, f"nvfp4_encode_{t}").argtypes = [p, i64, i64, p, p, p, p, p, p]
        getattr(lib, f"mxfp8_decode_rowwise_{t}").argtypes = [p, p, i64, p, ctypes.c_int]
    lib.e4m3_cast.argtypes = [p, i64, p]
    lib.e2m1_cast.argtypes = [p, i64, p]
    lib.inv448.restype = ctypes.c_float
    lib.threaded.restype = ctypes.c_int


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (turned off, no compiler, or the build failed: warned once)."""
    global _lib, _failed
    if _disabled or not switch("native") or sys.byteorder != "little":
        return None
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = load()
            except Exception as exc:  # noqa: BLE001 - any failure means: use the eager path
                _failed = str(exc)
                warnings.warn(f"miles_lp: fused CPU codecs unavailable ({exc}); using the eager torch codecs "
                              "(same bytes, slower)", RuntimeWarning, stacklevel=3)
    return _lib


@contextmanager
def disabled():
    """Run the eager torch codecs inside this block (tests compare them with the kernels)."""
    global _disabled
    with _lock:
        _disabled += 1
    try:
        yield
    finally:
        with _lock:
            _disabled -= 1


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: CPU, bf16 or fp32, and enabled (built lazily here)."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and library() is not None


def decodes(data: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``mxfp8_decode_rowwise`` takes ``data`` (e4m3 on the CPU) decoded to ``dtype`` (bf16 or fp32), enabled."""
    return (data.device.type == "cpu" and data.dtype == torch.float8_e4m3fn and dtype in _DTYPES
            and library() is not None)


def _threads() -> int:
    """Threads for one call: torch's intra-op count on the main thread; one on any other (a pipeline's worker
    threads already run calls side by side)."""
    return torch.get_num_threads() if threading.current_thread() is threading.main_thread() else 1


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def mxfp8_rowwise(x: torch.Tensor, data: torch.Tensor | None = None, scale: torch.Tensor | None = None, *,
                  lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``mxfp8_core(x, -1)`` for a contiguous CPU bf16/fp32 ``x`` [..., K], K % 32 == 0 (checked by the caller).
    ``data`` / ``scale``: output tensors to fill (e4m3 of ``x``'s shape, uint8 [..., K/32]); ``lib``: tests."""
    lib = lib or library()
    if data is None:
        data = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    if scale is None:
        scale = torch.empty((*x.shape[:-1], x.shape[-1] // 32), dtype=torch.uint8)
    getattr(lib, f"mxfp8_rowwise_{_DTYPES[x.dtype]}")(_ptr(x), x.numel() // 32, _ptr(data), _ptr(scale),
                                                      _threads())
    return data, scale


def mxfp8_decode_rowwise(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                         lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``MXFP8Tensor(data, scale, -1).dequantize(dtype)`` for contiguous CPU ``data`` (e4m3 [..., K], K % 32 == 0)
    and ``scale`` (uint8 [..., K/32]), ``dtype`` bf16 or fp32 (checked by the caller): the same bits, NaN included."""
    out = torch.empty(data.shape, dtype=dtype)
    getattr(lib or library(), f"mxfp8_decode_rowwise_{_DTYPES[dtype]}")(_ptr(data), _ptr(scale), data.numel() // 32,
                                                                      _ptr(out), _threads())
    return out


def row_amax(x2: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """NaN-ignoring ``|x|`` max of each row of a contiguous [R, K] CPU tensor: fp32 [R]."""
    out = torch.empty(x2.shape[0], dtype=torch.float32)
    getattr(lib or library(), f"row_amax_{_DTYPES[x2.dtype]}")(_ptr(x2), x2.shape[0], x2.shape[1], _ptr(out))
    return out


def block_amax16(x2: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """NaN-ignoring amax of each 1x16 block of a contiguous [R, K] CPU tensor: fp32 [R, K/16]."""
    out = torch.empty((x2.shape[0], x2.shape[1] // 16), dtype=torch.float32)
    getattr(lib or library(), f"block_amax16_{_DTYPES[x2.dtype]}")(_ptr(x2), x2.numel() // 16, _ptr(out))
    return out


_E4M3_TABLE: torch.Tensor | None = None


def _e4m3_table() -> torch.Tensor:
    global _E4M3_TABLE
    if _E4M3_TABLE is None:
        _E4M3_TABLE = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return _E4M3_TABLE


def nvfp4_encode(x2: torch.Tensor, s_dec_r: torch.Tensor, sf_scale_r: torch.Tensor,
                 amax_b: torch.Tensor | None = None, *, lib: ctypes.CDLL | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The NVFP4 scales and codes of a contiguous [R, K] CPU tensor, K % 16 == 0, given per-row fp32
    ``s_dec_r`` and ``sf_scale_r`` [R] (``nvfp4._scales`` of the row's global amax) and optionally the
    block amax [R, K/16] (1x16 computed here when None). Returns (data uint8 [R, K/2], sf e4m3 [R, K/16])."""
    r, k = x2.shape
    data = torch.empty((r, k // 2), dtype=torch.uint8)
    sf = torch.empty((r, k // 16), dtype=torch.uint8)
    s_dec_r = s_dec_r.reshape(-1).to(torch.float32).contiguous()
    sf_scale_r = sf_scale_r.reshape(-1).to(torch.float32).contiguous()
    ab = 0 if amax_b is None else _ptr(amax_b := amax_b.to(torch.float32).contiguous())
    table = _e4m3_table()
    getattr(lib or library(), f"nvfp4_encode_{_DTYPES[x2.dtype]}")(_ptr(x2), r, k, ab or None, _ptr(s_dec_r),
                                                           _ptr(sf_scale_r), _ptr(table), _ptr(data), _ptr(sf))
    return data, sf.view(torch.float8_e4m3fn)


def e4m3_cast(y: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The kernels' fp32 -> e4m3 byte conversion on its own (tests)."""
    y = y.to(torch.float32).contiguous()
    out = torch.empty(y.shape, dtype=torch.uint8)
    (lib or library()).e4m3_cast(_ptr(y), y.numel(), _ptr(out))
    return out


def e2m1_cast(y: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The kernels' fp32 -> E2M1 code conversion on its own (tests)."""
    y = y.to(torch.float32).contiguous()
    out = torch.empty(y.shape, dtype=torch.uint8)
    (lib or library()).e2m1_cast(_ptr(y), y.numel(), _ptr(out))
    return out
