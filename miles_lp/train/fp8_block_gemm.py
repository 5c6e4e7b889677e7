"""FP8 blockwise GEMMs on Hopper's FP8 tensor cores: ``torch.nn.functional.scaled_mm`` with block scales.

The three GEMMs of a linear, each on E4M3 operands whose bytes are the codec's (``miles_lp.formats.fp8``;
computed by ``miles_lp.formats.kernels.fp8_block``) and fp32 scales applied per 128-long slice of the reduction:

==========  ===========================  =====================  ======================================
GEMM         A (1x128 tiles, M-major)     B                      reduction
==========  ===========================  =====================  ======================================
forward      x rowwise ``[M, K]``         w 128x128 ``[N, K]``   K
dgrad        dy rowwise ``[M, N]``        w 128x128, ``[K, N]``  N (the weight's transposed data, same
                                          (transposed data)      scales: TE's square tiles)
wgrad        dy 128x1, as ``[N, M]``      x 128x1, as ``[K, M]`` M (tokens; padded to 128 with zeros)
==========  ===========================  =====================  ======================================

Scale layouts (torch 2.11's checks, confirmed against the emulation on the H200): BlockWise1x128 reads
``[rows, red/128]`` stored rows-fastest (strides ``(1, rows)``); BlockWise128x128 reads ``[L4, out/128]`` with
``L4 = round_up(red/128, 4)`` stored red-fastest (strides ``(1, L4)``; the padding is never read). A
BlockWise128x128 scale stored out-fastest is accepted by some torch versions and gives wrong results without an
error (``tests/unit/test_fp8_block_gemm_gpu.py`` checks that the check catches it). cuBLAS refuses M = 1: the
operand kernels pad tokens to a multiple of 128. The emulated GEMM
(``miles_lp.train.gemm``: dequantize in fp32, then one GEMM) is the reference and the CPU path; the native result
differs from it by the order of accumulation and where the scales are applied (per 128-slice, in fp32), within
``REL_TOL`` (relative Frobenius error, tested on the device).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from miles_lp.config import switch
from miles_lp.errors import FormatError
from miles_lp.formats.kernels import fp8_block as kernels
from miles_lp.formats.kernels import fp8_block_mm as block_mm

BLOCK = kernels.BLOCK
#: native vs emulated GEMM on the same operands (relative Frobenius norm of the difference)
REL_TOL = 2e-3


@lru_cache(maxsize=8)
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def _api():
    f = getattr(torch.nn.functional, "scaled_mm", None)
    st = getattr(torch.nn.functional, "ScalingType", None)
    return (f, st) if f is not None and st is not None else (None, None)


@lru_cache(maxsize=4)
def _recipe_ids(recipe_b: str) -> tuple[list[int], list[int]] | None:
    """``scaled_mm``'s own call of ``torch._scaled_mm_v2`` takes the recipes as int lists; building them (and the
    list wrapping of every argument) costs more host time than the launch on the hot path, so it is done once."""
    f, st = _api()
    if f is None or not hasattr(torch, "_scaled_mm_v2"):
        return None
    return [int(st.BlockWise1x128.value)], [int(getattr(st, recipe_b).value)]


def unavailable_reason(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the native path cannot run this GEMM (None: it can)."""
    if switch("fp8_gemm") == "emulated":
        return "runtime.fp8_gemm: emulated"
    if not x.is_cuda:
        return f"input on {x.device}"
    if not _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return "not an sm_90 (Hopper) GPU: torch's blockwise FP8 scaled_mm runs on sm_90 only"
    if _api()[0] is None:
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with block scaling"
    if x.dtype != torch.bfloat16:
        return f"input dtype {x.dtype} (native FP8 GEMMs take bf16 activations)"
    n, k = weight.shape[-2], weight.shape[-1]
    if weight.dim() != 2 or k % BLOCK or n % BLOCK:
        return f"weight {tuple(weight.shape)}: N and K must be multiples of {BLOCK}"
    return None


_NO_SWIZZLE: list[int] = []


def _mm(a, scale_a, b, scale_b, recipe_b, out_dtype=torch.bfloat16):
    ids = _recipe_ids(recipe_b)
    if ids is None:
        f, st = _api()
        return f(a, b, scale_a, st.BlockWise1x128, scale_b, getattr(st, recipe_b), output_dtype=out_dtype)
    # (use_fast_accum: torch 2.11 refuses it with block scales, "scaled_gemm doesn't support fast accum")
    return torch._scaled_mm_v2(a, b, [scale_a], ids[0], _NO_SWIZZLE, [scale_b], ids[1], _NO_SWIZZLE, None, out_dtype,
                               _NO_SWIZZLE, False)


def block_scale_b(s_out_red: torch.Tensor) -> torch.Tensor:
    """The BlockWise128x128 ``scale_b`` of a weight whose block scales are ``[out/128, red/128]``: the view
    ``[L4, out/128]``, strides ``(1, L4)`` (a copy only when ``red/128`` is not a multiple of 4 or the values are
    not stored red-fastest)."""
    out_b, red_b = s_out_red.shape
    l4 = -(-red_b // 4) * 4
    if l4 == red_b and s_out_red.is_contiguous():
        return s_out_red.t()
    buf = torch.ones((out_b, l4), dtype=torch.float32, device=s_out_red.device)
    buf[:, :red_b] = s_out_red
    return buf.t()


class WeightOperands:
    """The weight's native operands for one step: the 128x128 grid, its data transposed, both GEMMs' scale_b.
    ``scale_t``: the scales already stored transposed ``[K/128, L4]`` (``kernels.quantize_weight(...,
    scale_t=True)``), else the dgrad's scale_b is a copy."""

    __slots__ = ("q", "t", "scale_fwd", "scale_dgrad")

    def __init__(self, q, t: torch.Tensor, scale_t: torch.Tensor | None = None):
        self.q, self.t = q, t
        self.scale_fwd = block_scale_b(q.scale_inv)
        self.scale_dgrad = block_scale_b(q.scale_inv.t()) if scale_t is None else scale_t.t()


def forward_mm(xs: kernels.NativeOperand, w: WeightOperands) -> torch.Tensor:
    """y ``[M, N]`` = x ``[M, K]`` @ w ``[N, K]``.T on the forward operands (x rowwise storage, w 128x128)."""
    y = _mm(xs.data, xs.scale_inv, w.q.data.t(), w.scale_fwd, "BlockWise128x128")
    return y[:xs.rows] if y.shape[0] != xs.rows else y


def dgrad_mm(gs: kernels.NativeOperand, w: WeightOperands) -> torch.Tensor:
    """dx ``[M, K]`` = dy ``[M, N]`` @ w ``[N, K]`` (dy rowwise storage; the weight's transposed data)."""
    y = _mm(gs.data, gs.scale_inv, w.t.t(), w.scale_dgrad, "BlockWise128x128")
    return y[:gs.rows] if y.shape[0] != gs.rows else y


def wgrad_gemm() -> str:
    """``triton`` or ``scaled_mm``: the wgrad GEMM ``runtime.fp8_wgrad_gemm`` picks (``auto``:
    ``fp8_block_mm.WGRAD_AUTO``, cuBLAS, the faster on the H200 at every shape measured)."""
    choice = switch("fp8_wgrad_gemm")
    if choice not in ("auto", "triton", "scaled_mm"):
        raise FormatError(f"runtime.fp8_wgrad_gemm (MILES_LP_FP8_WGRAD_GEMM) must be one of auto, triton, scaled_mm, "
                          f"got {choice!r}")
    return block_mm.WGRAD_AUTO if choice == "auto" else choice


def wgrad_mm(gc: kernels.NativeOperand, xc: kernels.NativeOperand, out_dtype=torch.bfloat16) -> torch.Tensor:
    """dw ``[N, K]`` = dy.T ``[N, M]`` @ x ``[M, K]`` (both columnwise storages, tokens padded alike): cuBLAS's
    block-scaled GEMM or the Triton one (``wgrad_gemm``)."""
    if wgrad_gemm() == "triton":
        return block_mm.block_mm(gc.data, gc.scale_inv, xc.data, xc.scale_inv, 1, out_dtype=out_dtype)
    return _mm(gc.data, gc.scale_inv, xc.data.t(), xc.scale_inv, "BlockWise1x128", out_dtype)


def emulated_mm(a, b) -> torch.Tensor:
    """The reference for ``*_mm``: ``deq(a) @ deq(b).T`` in fp32 (``a``/``b``: codec grids, logical shapes)."""
    return a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()
