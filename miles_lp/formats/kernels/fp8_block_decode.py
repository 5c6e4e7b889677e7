"""The FP8 blockwise GEMM for few tokens (decode): one Triton launch reading the bf16 input and the E4M3 weight.

``decode_mm(x, w_data, w_scale_inv, pow2)`` = ``deq(quantize_fp8_blockwise(x, (1, 128), pow2)) @ deq(w).T``: the
input's 1x128 grid computed in the GEMM's prologue (byte-identical to the codec: ``selfcheck``), the weight
``[N, K]`` E4M3 with its 128x128 decode multipliers ``[ceil(N/128), ceil(K/128)]`` as served. Rows are padded only
to the kernel's M tile (16, 32 or 64), not to 128 as cuBLAS's block-scaled GEMM needs, and each weight byte is read
once per M tile, so at decode batch sizes the GEMM costs the weight's bytes (half BF16's). Split-K (``plan``) keeps
every SM busy when N is small; the partials are added in a fixed order (no atomics: the result is deterministic).
No host synchronisation and shapes fixed per call: CUDA-graph capturable.

Numerics: each 128-long K block is one FP8 dot from zero (fp32 accumulation), scaled by ``sa * sw`` in fp32 and
added; the emulation dequantizes in fp32 and runs one fp32 GEMM. With ``out_dtype=torch.float32`` they differ by the
order of the sums (on sm_90 at 64-row tiles the FP8 tensor cores accumulate 32 products at a time in reduced
precision, DeepSeek-V3 measured ~14 retained bits, before each partial sum is added in fp32): ``FP32_REL_TOL``
(relative Frobenius error).
The bf16 result is that fp32 result rounded once (RNE; ``selfcheck`` checks bit equality with ``.to(bfloat16)``),
so it is within ``REL_TOL`` = bf16's unit roundoff 2^-8 (a bound per element, hence on the Frobenius norm) plus
``FP32_REL_TOL`` (normal range). For comparison, cuBLAS's block-scaled GEMM (bf16 output) measured 1.7e-3 against
the emulation on the H200 (``train.fp8_block_gemm.REL_TOL`` 2e-3: a measured figure, not a bound).
"""

from __future__ import annotations

import math
import os

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.kernels import runtime as rt

BLOCK = 128
#: ``runtime.fp8_decode_gemm: auto`` takes this kernel for at most this many tokens, cuBLAS's block-scaled GEMM
#: above. Measured on the H200 (docs/results/h200-fp8-decode-2026-12-02, the 0.5B layer's 4 GEMMs summed): this
#: kernel 36.1 us vs scaled_mm 43.1 us at M = 8, 42.4 vs 43.0 at M = 1, but 47.5 vs 42.8 at 32 and 62.2 vs 42.3 at
#: 64 (M 9-16 run the same 16-row tile as M = 8 but were not measured). Neither beats BF16 at these shapes.
MAX_M = 8
#: the kernel's fp32 result against the fp32 emulation on the same operands (relative Frobenius error): the
#: summation order and the tensor cores' accumulation inside each 128-long block
FP32_REL_TOL = 2.5e-4
#: the bf16 result (the fp32 one rounded once): bf16's unit roundoff 2^-8 per element, plus FP32_REL_TOL
REL_TOL = 2.0 ** -8 + FP32_REL_TOL
#: the dot's operands on CUDA: ``fp8`` (``tl.dot`` on float8e4nv: FP8 tensor cores) or ``bf16`` (the E4M3 values
#: widened to bf16, exact: bf16 tensor cores, fp32 accumulation throughout); the bytes read are the same
#: ``stages``: tiles of x and w in flight per program (the loop's software pipeline; at decode sizes the GEMM waits on
#: memory, so deeper is more bytes in flight per SM)
CONFIG = {"dot": "fp8", "stages": 4}
_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fp8_block_gemm_triton.py")
MODULE = "miles_lp.formats.kernels._fp8_block_gemm_triton"
_SMS: dict[int, int] = {}


def _module(x: torch.Tensor):
    interp = not x.is_cuda
    if interp and not rt.interpreting():
        raise FormatError("miles_lp.formats.kernels.fp8_block_decode: the kernel runs on CUDA tensors (or on CPU "
                          "under TRITON_INTERPRET=1); use the emulated GEMM (dequantize, then matmul) here")
    return rt.cached_jit_module(_PATH, MODULE, interp)


def load_module(interpret: bool):
    return rt.load_jit_module(_PATH, MODULE, interpret)


def _sms(x: torch.Tensor) -> int:
    if not x.is_cuda:
        return 4
    i = x.device.index if x.device.index is not None else torch.cuda.current_device()
    n = _SMS.get(i)
    if n is None:
        n = _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return n


def plan(m: int, n: int, k: int, sms: int, block_n: int | None = None, split: int | None = None
         ) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, SPLIT) for ``[m, k] @ [n, k].T`` on ``sms`` SMs: the M tile the smallest of 16 / 32 / 64
    holding ``m``; N tiles of 64; split-K only where the tiles leave SMs idle and K is long (at least 8 blocks):
    about one program per SM, each split at least 4 K blocks, all the same length but the last. A split costs a
    second launch (the fixed-order sum of the partials), ~1-2 us in a CUDA graph, so the short-K GEMMs of a decode
    step (q/k/v, o, gate/up of a 0.5B model) run unsplit and its long-K one (down) split. ``block_n`` / ``split``:
    given values win (benchmarks)."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = block_n or 64
    kb = -(-k // BLOCK)
    if split is None:
        tiles = -(-n // bn) * -(-m // bm)
        split = 1
        if tiles < sms and kb >= 8:
            split = min(kb // 4, -(-sms // tiles))
            per = -(-kb // split)
            split = -(-kb // per)
    if bn not in (16, 32, 64, 128, 256) or not 1 <= split <= kb:
        raise FormatError(f"fp8_block decode GEMM: block_n {bn} (16..256, a power of two) / split {split} "
                          f"(1..{kb} K blocks) out of range")
    return bm, bn, split


def _check(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.numel() == 0:
        raise FormatError(f"fp8_block decode GEMM: the input must be a non-empty 2-D bf16/fp16/fp32 tensor, got "
                          f"{x.dtype} {tuple(x.shape)}")
    n, k = w_data.shape if w_data.dim() == 2 else (-1, -1)
    if k != x.shape[1] or w_data.dtype not in (torch.uint8, torch.float8_e4m3fn) or not w_data.is_contiguous():
        raise FormatError(f"fp8_block decode GEMM: the weight must be contiguous E4M3 [N, {x.shape[1]}] (uint8 or "
                          f"float8_e4m3fn), got {w_data.dtype} {tuple(w_data.shape)}")
    want = (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    if (tuple(w_scale_inv.shape) != want or w_scale_inv.dtype != torch.float32
            or not w_scale_inv.is_contiguous()):
        raise FormatError(f"fp8_block decode GEMM: the weight's scale_inv must be contiguous fp32 {list(want)} "
                          f"(one per 128x128 block), got {w_scale_inv.dtype} {tuple(w_scale_inv.shape)}")
    if w_data.device != x.device or w_scale_inv.device != x.device:
        raise FormatError(f"fp8_block decode GEMM: input on {x.device}, weight on {w_data.device}, scales on "
                          f"{w_scale_inv.device}; put them on one device")


def decode_mm(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, pow2: bool, *,
              out_dtype: torch.dtype = torch.bfloat16, block_n: int | None = None, split: int | None = None,
              store_act: bool = False, dot: str | None = None, stages: int | None = None):
    """y ``[M, N]`` (``out_dtype`` bf16 or fp32) = the 1x128 grid of ``x [M, K]`` (``pow2``: power-of-two scales)
    times the 128x128-grid weight ``w_data [N, K]`` / ``w_scale_inv``, transposed.

    ``store_act``: return ``(y, (q [M, K] uint8, scale_inv [M, ceil(K/128)]))``, the prologue's quantization (the
    codec's ``quantize_fp8_blockwise(x, (1, 128), pow2)`` bytes; for the tests). ``dot``: ``CONFIG["dot"]`` unless
    given; ``block_n`` / ``split``: ``plan``'s unless given; ``stages``: ``CONFIG["stages"]`` unless given."""
    _check(x, w_data, w_scale_inv)
    dot = dot or CONFIG["dot"]
    if dot not in ("fp8", "bf16"):
        raise FormatError(f"fp8_block decode GEMM: dot must be fp8 or bf16, got {dot!r}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise FormatError(f"fp8_block decode GEMM: out_dtype must be bfloat16 or float32, got {out_dtype}")
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    n = w_data.shape[0]
    kb = math.ceil(k / BLOCK)
    bm, bn, sp = plan(m, n, k, _sms(x), block_n, split)
    dev = x.device
    bf16_out = out_dtype == torch.bfloat16
    y = rt.out_tensor((m, n), out_dtype, dev)
    part = torch.empty((sp, m, n), dtype=torch.float32, device=dev) if sp > 1 else y
    if store_act:
        aq = torch.empty((m, k), dtype=torch.uint8, device=dev)
        asc = torch.empty((m, kb), dtype=torch.float32, device=dev)
    else:
        aq = asc = rt.none_tensor(dev)
    bits = x.dtype == torch.bfloat16 and not x.is_cuda  # the interpreter's bf16 loads are not trusted
    src = x.view(torch.int16) if bits else x
    mod = _module(x)
    rt.launch(mod, "decode_gemm_kernel", (-(-n // bn), sp, -(-m // bm)),
              (src, w_data.view(torch.uint8), w_scale_inv, part, aq, asc, m, n, k, kb), 4,
              VALUE_FOR_INF=float(torch.finfo(x.dtype).max), POW2=bool(pow2), BF16_BITS=bits, BLOCK_M=bm,
              BLOCK_N=bn, SPLIT=sp, ITERS=-(-kb // sp), OUT_BF16=bf16_out, STORE_ACT=bool(store_act),
              DOT_BF16=dot == "bf16", STAGES=stages or CONFIG["stages"])
    if sp > 1:
        rt.launch(mod, "split_sum_kernel", (-(-(m * n) // 1024),), (part, y, m * n), 4, SPLIT=sp,
                  OUT_BF16=bf16_out, BLOCK=1024)
    y = rt.as_dtype(y, out_dtype)
    return (y, (aq, asc)) if store_act else y


def emulated_mm(x: torch.Tensor, w_data: torch.Tensor, w_scale_inv: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The reference: the codec's 1x128 grid of ``x`` and the weight, both dequantized in fp32, one fp32 GEMM."""
    from miles_lp.formats.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise

    a = quantize_fp8_blockwise(x, (1, BLOCK), pow2).dequantize(torch.float32)
    w = dequantize_fp8_blockwise(w_data.view(torch.float8_e4m3fn), w_scale_inv, block=(BLOCK, BLOCK),
                                 dtype=torch.float32)
    return a @ w.t()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``y`` against ``ref`` (in fp32)."""
    y, ref = y.float(), ref.float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def selfcheck(device: str = "cuda", seed: int = 0, shapes=None, dot: str | None = None) -> list[str]:
    """The kernel against the emulation (``FP32_REL_TOL`` in fp32; in bf16 the fp32 result rounded once, bit for bit,
    and ``REL_TOL``), with and without split-K, and its prologue against the codec (bytes and scales), both scale
    rules; returns the failures (empty: pass)."""
    from miles_lp.formats.fp8 import quantize_fp8_blockwise

    g = torch.Generator(device="cpu").manual_seed(seed)
    bad: list[str] = []
    for m, n, k in shapes or ((1, 128, 128), (5, 256, 384), (32, 128, 384), (32, 256, 128)):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        if m > 2:
            x[1, :] = 0.0  # a zero row (scale 1)
            x[2, 5] = 1e4  # an outlier: the other elements of its block go subnormal or zero
        w = torch.randn(n, k, generator=g) * 0.05
        wq = quantize_fp8_blockwise(w, (BLOCK, BLOCK), False)
        xd, wd, sd = x.to(device), wq.data.to(device), wq.scale_inv.to(device)
        for pow2 in (False, True):
            ref = emulated_mm(x, wq.data, wq.scale_inv, pow2)
            codec = quantize_fp8_blockwise(x, (1, BLOCK), pow2)
            kb = -(-k // BLOCK)
            for split in sorted({1, kb}):
                tag = f"{m}x{n}x{k} pow2={pow2} split={split}"
                y, (aq, asc) = decode_mm(xd, wd, sd, pow2, split=split, store_act=True, dot=dot)
                if not (torch.equal(aq.cpu(), codec.data.view(torch.uint8))
                        and torch.equal(asc.cpu().view(torch.int32), codec.scale_inv.view(torch.int32))):
                    bad.append(f"prologue bytes {tag}")
                y32 = decode_mm(xd, wd, sd, pow2, split=split, out_dtype=torch.float32, dot=dot)
                e = rel_err(y32.cpu(), ref)
                if not e <= FP32_REL_TOL:
                    bad.append(f"fp32 result {tag}: rel err {e:.2e} > {FP32_REL_TOL}")
                if y.dtype != torch.bfloat16 or not torch.equal(y.view(torch.int16), y32.to(torch.bfloat16).view(
                        torch.int16)):
                    bad.append(f"bf16 result {tag}: not the fp32 result rounded once")
                e = rel_err(y.cpu(), ref)
                if not e <= REL_TOL:
                    bad.append(f"bf16 result {tag}: rel err {e:.2e} > {REL_TOL}")
    return bad
