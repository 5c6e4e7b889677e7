"""``miles-lp bench linear --host-cpu``: the per-call host cost of a QuantLinear fwd+bwd, on CPU, no GPU.

The kernel path (``kernel="compiled"``) runs with its Triton launches replaced by a no-op and the kernel
entry points told the tensors are eligible, on tiny CPU tensors, so what is timed is the Python, autograd
and tensor-op work of one call (what makes the small-shape step host-bound on the H200), not the kernels'
device work. Reported per mode: best-of-8 mean host µs per call (fresh grid and cached grid), the Triton
launches and the aten ops one call makes, against bf16 F.linear and an empty custom autograd Function
(the floor of any Python-autograd design). The numbers are this machine's; use them to compare changes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def _stubbed():
    """Kernel launches as no-ops, CPU tensors accepted by the kernel entry points, bf16 GEMM operands as on
    CUDA, fp8_block on its native path (operand kernels and cuBLAS's block-scaled GEMM as counted no-ops);
    everything restored afterwards."""
    import torch

    from miles_lp.formats import kernels
    from miles_lp.formats.kernels import fp8_block, runtime
    from miles_lp.train import fp8_block_gemm, gemm
    from miles_lp.train import launch as bound

    saved = (runtime.launch, kernels.enabled, runtime.module_for, gemm.gemm_operand_dtype, bound.FAKE_BIND)
    saved_fp8 = (fp8_block._launch, fp8_block._module, fp8_block_gemm._mm, gemm._fp8_native)
    calls = {"n": 0}

    def launch(*a, **k):
        calls["n"] += 1

    def scaled_mm(a, scale_a, b, scale_b, recipe_b, out_dtype=torch.bfloat16):  # cuBLAS's call, as a launch
        calls["n"] += 1
        return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)

    runtime.launch = launch
    # fp8_block: the native path (operand kernels and cuBLAS's block-scaled GEMMs), as on an sm_90 GPU
    fp8_block._launch, fp8_block._module, fp8_block_gemm._mm = launch, (lambda x: None), scaled_mm
    gemm._fp8_native = lambda x, weight, grid: grid.scheme.native_gemm and grid.kernel != "reference"
    kernels.enabled = lambda x: True
    runtime.module_for = lambda x: None
    # the bound launches (miles_lp.train.launch) as on CUDA, their C launcher a counting no-op
    bound.FAKE_BIND = lambda mod, name, grid, consts: launch
    bound.clear()
    gemm.gemm_operand_dtype = lambda x: torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
    try:
        yield calls
    finally:
        runtime.launch, kernels.enabled, runtime.module_for, gemm.gemm_operand_dtype, bound.FAKE_BIND = saved
        fp8_block._launch, fp8_block._module, fp8_block_gemm._mm, gemm._fp8_native = saved_fp8
        runtime.PLANS.clear()
        bound.clear()


def _best_us(fn, reps: int = 400) -> float:
    for _ in range(30):
        fn()
    best = float("inf")
    for _ in range(8):
        t = time.process_time()
        for _ in range(reps // 8):
            fn()
        best = min(best, (time.process_time() - t) / (reps // 8))
    return best * 1e6


def _aten_ops(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    n = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            n[0] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return n[0]


def host_rows(modes, size: int = 32, dtype: str = "bf16") -> list[dict]:
    """``dtype`` "bf16" (the CUDA case: bf16 GEMMs, ~25 us each of CPU compute at 32^3 on a 2-core machine)
    or "fp32" (fp32 GEMMs, ~2 us each: what is left is nearly all host overhead; the same Python path)."""
    import torch
    import torch.nn.functional as F

    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe, QuantLinear

    torch.set_num_threads(1)
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x = torch.randn(size, size).to(dt).requires_grad_()
    lin = torch.nn.Linear(size, size, bias=False, dtype=dt)
    dy = torch.randn(size, size).to(dt)

    def bf16():
        x.grad = lin.weight.grad = None
        F.linear(x, lin.weight).backward(dy)

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            ctx.save_for_backward(a, w)
            return F.linear(a, w)

        @staticmethod
        def backward(ctx, g):
            a, w = ctx.saved_tensors
            return torch.mm(g, w), torch.mm(g.t(), a)

    def floor():
        x.grad = lin.weight.grad = None
        Floor.apply(x, lin.weight).backward(dy)

    rows = [dict(mode="bf16 F.linear", fresh_us=_best_us(bf16), cached_us=None, launches=0, aten_ops=_aten_ops(bf16)),
            dict(mode="empty autograd.Function", fresh_us=_best_us(floor), cached_us=None, launches=0,
                 aten_ops=_aten_ops(floor))]
    with _stubbed() as calls:
        for fmt, bw in modes:
            recipe = LinearRecipe(Format(fmt), BackwardMode(bw), "token" if fmt == "nvfp4" else None)
            ql = QuantLinear.from_linear(lin, recipe, canonical="bench", kernel="compiled")

            def fresh(ql=ql):
                ql.grid.invalidate()
                x.grad = lin.weight.grad = None
                ql(x).backward(dy)

            def cached(ql=ql):
                x.grad = lin.weight.grad = None
                ql(x).backward(dy)

            calls["n"] = 0
            fresh()
            launches = calls["n"]
            rows.append(dict(mode=f"{fmt}/{bw}", fresh_us=_best_us(fresh), cached_us=_best_us(cached),
                             launches=launches, aten_ops=_aten_ops(fresh)))
    return rows


def format_rows(rows, size: int, dtype: str = "bf16") -> str:
    out = [f"host time per fwd+bwd on CPU, {size}x{size}x{size} {dtype}, Triton launches stubbed (no device work)",
           f"{'mode':26s} {'fresh us':>9s} {'cached us':>9s} {'launches':>8s} {'aten ops':>8s}"]
    for r in rows:
        cached = f"{r['cached_us']:9.1f}" if r["cached_us"] is not None else f"{'':9s}"
        out.append(f"{r['mode']:26s} {r['fresh_us']:9.1f} {cached} {r['launches']:8d} {r['aten_ops']:8d}")
    return "\n".join(out)
