"""The FP8 blockwise GEMM as a warp-specialized Gluon kernel for sm_90 (Hopper): ``fp8_block_mm.block_mm``'s contract.

``block_mm(a, sa, b, sb, b_block)`` = ``sum_kb (a[:, kb] @ b[:, kb].T) * sa[:, kb] * sb[., kb]`` on E4M3 operands
(K-major) with fp32 scales, K a multiple of 128; checks, numerics and tolerances are ``fp8_block_mm``'s (one FP8
dot per 128-long K block from zero, scaled in fp32 and added; the bf16 result is the fp32 one rounded once).

Why a second kernel: the Triton one (``fp8_block_mm``) is slower than cuBLAS on the H200 because the scaling of
each block's product waits for that block's wgmma, so the tensor cores idle while it runs. Here (Gluon, Triton's
explicit-layout dialect; DeepGEMM's scheme) one loader warp feeds a ring of ``STAGES`` TMA tiles and two math
warpgroups each own half of the output tile's rows with a wgmma stream of their own: while one scales its
product the other's MMA runs. A one-partition Gluon kernel that instead scaled block kb - 1 while block kb's
wgmma ran (``wgmma.wait_group 1``) was serialized by ptxas (note C7514: an in-flight accumulator read), which
``sass.ptxas_notes`` shows and ``tests/unit/test_fp8_block_ws.py`` checks does not happen here.

sm_90 only (wgmma, TMA, ``setmaxnreg``); CUDA-graph capturable (no host synchronisation; the TMA descriptors are
kernel parameters). ``runtime.fp8_wgrad_gemm: gluon`` selects it for the learner's wgrad.
"""

from __future__ import annotations

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.kernels import fp8_block_mm as mm

BLOCK = mm.BLOCK
#: BLOCK_M (two math warpgroups of BLOCK_M / 2 rows), BLOCK_N, STAGES (TMA ring depth), MATH_REGS (registers per
#: thread of the worker math warpgroup; the loader warp keeps 24)
CONFIG = {"bm": 128, "bn": 128, "stages": 6, "math_regs": 232, "group": 8}
#: registers per thread for the whole CTA at launch: 12 warps (two math warpgroups and the loader's) x 32 x 168
#: fit the 64K register file; ``setmaxnreg`` then moves them from the loader to the math warpgroups
MAXNREG = 168
_K: list = []


def _kernel():
    if not _K:
        from miles_lp.formats.kernels import _fp8_block_ws_gluon

        _K.append(_fp8_block_ws_gluon.block_mm_ws_kernel)
    return _K[0]


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can)."""
    if device.type != "cuda":
        return f"tensors on {device}: the warp-specialized FP8 GEMM runs on sm_90 GPUs only"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "not an sm_90 (Hopper) GPU: the kernel uses wgmma, TMA and setmaxnreg"
    try:
        _kernel()
    except ImportError as e:
        return f"Triton's Gluon dialect is not importable ({e})"
    return None


def _layout(rows: int):
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK], gl.float8e4nv)


def _desc(t: torch.Tensor, rows: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, BLOCK], _layout(rows))


def block_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_block: int, *,
             out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """c ``[M, N]`` (bf16 or fp32) = ``a [M, K]`` (scales ``sa [M, K/128]``) times ``b [N, K]`` transposed (``sb``
    ``[N, K/128]`` when ``b_block`` is 1, ``[ceil(N/128), K/128]`` when 128), as ``fp8_block_mm.block_mm``.
    ``config``: ``CONFIG`` entries to override."""
    a8, b8 = mm.check_operands(a, sa, b, sb, b_block, out_dtype)
    why = unavailable_reason(a.device)
    if why is not None:
        raise FormatError(f"fp8_block warp-specialized GEMM: {why}; use fp8_block_mm.block_mm or cuBLAS")
    if a8.data_ptr() % 16 or b8.data_ptr() % 16 or a8.stride(0) % 16 or b8.stride(0) % 16:
        raise FormatError("fp8_block warp-specialized GEMM: a and b need 16-byte aligned rows (TMA); got strides "
                          f"{a8.stride(0)} / {b8.stride(0)}")
    cfg = dict(CONFIG)
    cfg.update(config or {})
    bm, bn = int(cfg["bm"]), int(cfg["bn"])
    if b_block == BLOCK and BLOCK % bn:
        raise FormatError(f"fp8_block warp-specialized GEMM: bn {bn} must divide {BLOCK} with 128x128 scales")
    m, k = a8.shape
    n = b8.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    grid = (-(-m // bm) * -(-n // bn),)
    _kernel()[grid](_desc(a8, bm // 2), _desc(b8, bn), sa, sb, c, m, n, k, sa.stride(0), sa.stride(1), sb.stride(0),
                    sb.stride(1), c.stride(0), B_DIV=b_block, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=int(cfg["group"]),
                    STAGES=int(cfg["stages"]), MATH_REGS=int(cfg["math_regs"]), num_warps=4, maxnreg=MAXNREG)
    return c


def compile_sm90(config: dict | None = None, b_block: int = 1, out: str = "bf16"):
    """Triton's CompiledKernel for sm_90 at ``config`` (``CONFIG`` entries to override), compiled here without a
    GPU (Triton's compiler and ptxas): what the tests read (PTX, register budgets, ptxas notes)."""
    from triton import compiler
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = dict(CONFIG)
    cfg.update(config or {})
    bm, bn = int(cfg["bm"]), int(cfg["bn"])
    sig = {"a_desc": f"tensordesc<fp8e4nv[{bm // 2}, {BLOCK}],{_layout(bm // 2)!r}>",
           "b_desc": f"tensordesc<fp8e4nv[{bn}, {BLOCK}],{_layout(bn)!r}>", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
           "c_ptr": f"*{out}"}
    sig.update(dict.fromkeys(("M", "N", "K", "s_sam", "s_sak", "s_sbn", "s_sbk", "s_cm"), "i32"))
    consts = dict(B_DIV=b_block, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=int(cfg["group"]), STAGES=int(cfg["stages"]),
                  MATH_REGS=int(cfg["math_regs"]), num_warps=4)
    sig.update(dict.fromkeys(consts, "constexpr"))
    return compiler.compile(GluonASTSource(_kernel(), sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": MAXNREG})


def selfcheck(device: str = "cuda", seed: int = 0, shapes=None, config: dict | None = None) -> list[str]:
    """``fp8_block_mm.selfcheck`` run on this kernel: the emulation's result within the tolerances, the bf16
    result the fp32 one rounded once; returns the failures (empty: pass)."""
    return mm.selfcheck(device, seed, shapes, config, gemm=block_mm)
