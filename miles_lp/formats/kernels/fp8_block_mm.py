"""The FP8 blockwise GEMM on pre-quantized operands (Triton): an alternative to cuBLAS's block-scaled GEMM.

``block_mm(a, sa, b, sb, b_block)`` = ``sum_kb (a[:, kb] @ b[:, kb].T) * sa[:, kb] * sb[., kb]``: ``a [M, K]`` and
``b [N, K]`` E4M3 (K-major, as the operand kernels of ``fp8_block`` store them), ``sa`` ``[M, K/128]`` fp32,
``sb`` ``[N, K/128]`` (``b_block`` 1: 1x128 tiles) or ``[N/128, K/128]`` (``b_block`` 128: a weight's 128x128
tiles), each read through its strides (the views ``scaled_mm`` takes serve as they are). cuBLAS's block-scaled
GEMM with 1x128 tiles on both operands (the wgrad of TE's Float8BlockScaling: dy and x tiled along the tokens) ran
at 0.73-0.92x BF16's time on the H200 where its 1x128 x 128x128 form (forward, dgrad) ran at 0.59-0.69x, so this
kernel was built to replace it there (``runtime.fp8_wgrad_gemm: triton``). Measured on the H200 it is slower
(8192^3: 1538 us against cuBLAS's 1248, the best of the plans that ran correctly; docs/gpu.md), so ``auto`` keeps cuBLAS.

Numerics as the decode GEMM's (``fp8_block_decode``): each 128-long K block one FP8 dot from zero, scaled in fp32
and added; the fp32 result within ``FP32_REL_TOL`` of the fp32 emulation (dequantize, one fp32 GEMM), the bf16 result
that fp32 result rounded once (``selfcheck`` checks both, bit for bit for the rounding). K must be a multiple of
128 (the operand kernels pad tokens to 128 with zeros). No host synchronisation: CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.kernels import runtime as rt

BLOCK = 128
#: the fp32 result against the fp32 emulation on the same operands (relative Frobenius error): the sum order and the
#: tensor cores' reduced-precision accumulation inside each 128-long block (``imprecise`` 128: 4.1e-4 to 4.9e-4
#: measured on the H200, docs/results/h200-fp8-block-mm-2026-12-02; the decode GEMM, promoting every 32 products,
#: stays under 2.5e-4)
FP32_REL_TOL = 1e-3
#: the bf16 result (the fp32 one rounded once): bf16's unit roundoff 2^-8 per element, plus FP32_REL_TOL
REL_TOL = 2.0 ** -8 + FP32_REL_TOL
#: launch plan per GEMM kind: output tile ``bm`` x ``bn``, ``warps``, ``stages`` (K blocks in flight), ``group``
#: (tile rows walked together), ``imprecise`` (products the FP8 tensor cores may accumulate before an fp32 add; at
#: most one K block, 128). 1d1d: the fastest of 14 plans swept on the H200 at 8192^3
#: (docs/results/h200-fp8-block-mm-2026-12-02: 1538 us against 1707 for 128x128 at 8 warps); 1d2d (128x128 scales
#: on b) takes the same plan, not swept
CONFIG = {
    "1d1d": {"bm": 64, "bn": 128, "warps": 4, "stages": 4, "group": 8, "imprecise": 128},
    "1d2d": {"bm": 64, "bn": 128, "warps": 4, "stages": 4, "group": 8, "imprecise": 128},
}
#: ``runtime.fp8_wgrad_gemm: auto``: cuBLAS's block-scaled GEMM, faster than this kernel on the H200
#: (docs/results/h200-fp8-block-mm-2026-12-02; the 2048x4096x4096 shape was not reached there)
WGRAD_AUTO = "scaled_mm"
_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fp8_block_mm_triton.py")
MODULE = "miles_lp.formats.kernels._fp8_block_mm_triton"


def _module(a: torch.Tensor):
    interp = not a.is_cuda
    if interp and not rt.interpreting():
        raise FormatError("miles_lp.formats.kernels.fp8_block_mm: the kernel runs on CUDA tensors (or on CPU under "
                          "TRITON_INTERPRET=1); use the emulated GEMM (dequantize, then matmul) here")
    return rt.cached_jit_module(_PATH, MODULE, interp)


def load_module(interpret: bool):
    return rt.load_jit_module(_PATH, MODULE, interpret)


def _bytes(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() != 2 or t.dtype not in (torch.uint8, torch.float8_e4m3fn) or t.stride(1) != 1:
        raise FormatError(f"fp8_block GEMM: {what} must be 2-D E4M3 (uint8 or float8_e4m3fn) with K contiguous, got "
                          f"{t.dtype} {tuple(t.shape)} strides {t.stride()}")
    # float8 on CUDA: loaded straight into wgmma's operand tiles (a uint8 view would be bitcast through registers);
    # bytes in the interpreter, which decodes them with integer code
    return t.view(torch.float8_e4m3fn if t.is_cuda else torch.uint8)


def _scales(s: torch.Tensor, want: tuple[int, int], what: str) -> None:
    if tuple(s.shape) != want or s.dtype != torch.float32:
        raise FormatError(f"fp8_block GEMM: {what} must be fp32 {list(want)}, got {s.dtype} {tuple(s.shape)}")


def check_operands(a, sa, b, sb, b_block: int, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_mm``'s contract checked (a clear error naming the operand otherwise); returns a and b as the kernels
    read them (float8_e4m3fn on CUDA, bytes in the interpreter)."""
    a8, b8 = _bytes(a, "a"), _bytes(b, "b")
    m, k = a8.shape
    n = b8.shape[0]
    if b8.shape[1] != k or k % BLOCK:
        raise FormatError(f"fp8_block GEMM: a {tuple(a8.shape)} and b {tuple(b8.shape)} must share K, a multiple of "
                          f"{BLOCK}")
    if b_block not in (1, BLOCK):
        raise FormatError(f"fp8_block GEMM: b_block must be 1 or {BLOCK}, got {b_block}")
    kb = k // BLOCK
    _scales(sa, (m, kb), "sa")
    _scales(sb, (n if b_block == 1 else -(-n // BLOCK), kb), "sb")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise FormatError(f"fp8_block GEMM: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if len({a.device, b.device, sa.device, sb.device}) != 1:
        raise FormatError("fp8_block GEMM: operands and scales must be on one device")
    return a8, b8


def block_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_block: int, *,
             out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """c ``[M, N]`` (bf16 or fp32) = ``a [M, K]`` (1x128 scales ``sa [M, K/128]``) times ``b [N, K]`` transposed
    (``sb``: ``[N, K/128]`` when ``b_block`` is 1, ``[ceil(N/128), K/128]`` when 128). ``config``: the launch plan
    (``CONFIG``'s entry for the kind unless given)."""
    a8, b8 = check_operands(a, sa, b, sb, b_block, out_dtype)
    m, k = a8.shape
    n = b8.shape[0]
    kb = k // BLOCK
    cfg = dict(CONFIG["1d1d" if b_block == 1 else "1d2d"])
    cfg.update(config or {})
    bm, bn = int(cfg["bm"]), int(cfg["bn"])
    if b_block == BLOCK and BLOCK % bn and bn % BLOCK:
        raise FormatError(f"fp8_block GEMM: bn {bn} must divide or be a multiple of {BLOCK} with 128x128 scales")
    dev = a.device
    c = rt.out_tensor((m, n), out_dtype, dev)
    tiles = -(-m // bm) * -(-n // bn)
    rt.launch(_module(a), "block_mm_kernel", (tiles,),
              (a8, b8, sa, sb, c, m, n, k, a8.stride(0), b8.stride(0), sa.stride(0), sa.stride(1), sb.stride(0),
               sb.stride(1), n), int(cfg["warps"]),
              B_DIV=b_block, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=int(cfg["group"]), STAGES=int(cfg["stages"]),
              IMPRECISE=int(cfg["imprecise"]), EVEN=(m % bm == 0 and n % bn == 0),
              OUT_BF16=out_dtype == torch.bfloat16, KB_INTERP=0 if a.is_cuda else kb)
    return rt.as_dtype(c, out_dtype)


def emulated_mm(a, sa, b, sb, b_block: int) -> torch.Tensor:
    """The reference: both operands dequantized in fp32 (``fp32(q) * s`` per block), one fp32 GEMM."""
    af = a.view(torch.float8_e4m3fn).float() * sa.float().repeat_interleave(BLOCK, dim=1)
    sbf = sb.float().repeat_interleave(BLOCK, dim=1)
    if b_block == BLOCK:
        sbf = sbf.repeat_interleave(BLOCK, dim=0)[:b.shape[0]]
    bf = b.view(torch.float8_e4m3fn).float() * sbf
    return af @ bf.t()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``y`` against ``ref`` (in fp32)."""
    y, ref = y.float(), ref.float()
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


def selfcheck(device: str = "cuda", seed: int = 0, shapes=None, config: dict | None = None, gemm=None) -> list[str]:
    """The kernel against the emulation on the operand kernels' storages of random bf16 inputs (outliers and a zero
    row included), both scale layouts (1x128 on b; 128x128 on b), both scale rules, fp32 and bf16 results; returns
    the failures (empty: pass). ``gemm``: another GEMM of ``block_mm``'s signature to check the same way (the
    Gluon kernels of ``scripts/h200_fp8_block_gluon.py``)."""
    gemm = gemm or block_mm
    from miles_lp.formats.fp8 import quantize_fp8_blockwise

    g = torch.Generator(device="cpu").manual_seed(seed)
    bad: list[str] = []
    for m, n, k in shapes or ((128, 128, 256), (256, 384, 128), (200, 136, 384)):
        x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
        x[1, :] = 0.0
        x[2, 5] = 1e4
        y = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
        for pow2 in (False, True):
            xa = quantize_fp8_blockwise(x, (1, BLOCK), pow2)
            for b_block in (1, BLOCK):
                yb = quantize_fp8_blockwise(y, (b_block, BLOCK), pow2)
                # the scales as the operand kernels store them: sa M-major ([K/128, M] transposed)
                sa = xa.scale_inv.t().contiguous().t()
                ops = [t.to(device) for t in (xa.data, sa, yb.data, yb.scale_inv)]
                ref = emulated_mm(xa.data, xa.scale_inv, yb.data, yb.scale_inv, b_block)
                tag = f"{m}x{n}x{k} b_block={b_block} pow2={pow2}"
                try:
                    c32 = gemm(*ops, b_block, out_dtype=torch.float32, config=config)
                    c16 = gemm(*ops, b_block, config=config)
                except FormatError as e:
                    bad.append(f"{tag}: {e}")
                    continue
                e = rel_err(c32.cpu(), ref)
                if not e <= FP32_REL_TOL:
                    bad.append(f"fp32 result {tag}: rel err {e:.2e} > {FP32_REL_TOL}")
                if c16.dtype != torch.bfloat16 or not torch.equal(c16.cpu().view(torch.int16),
                                                                    c32.cpu().to(torch.bfloat16).view(torch.int16)):
                    bad.append(f"bf16 result {tag}: not the fp32 result rounded once")
    return bad
