"""Every Triton kernel against the reference codecs on CPU, byte for byte, over named inputs.

Used by ``tests/unit/test_formats_kernels*.py`` (the interpreter on CPU, the compiled kernels on CUDA) and
``scripts/check_formats_cuda.py --kernels``. The reference always runs on the CPU copy of the input.
The inputs are ``miles_lp.formats.crosscheck.cases`` (random, boundary, zeros, NaN/inf, subnormal,
expert stacks, fp16) plus ``extra_cases``: odd shapes for masks and swizzle padding, and a block holding
inf beside huge finite values (its inverse scale 2^-127 is an fp32 subnormal: a kernel that flushed
subnormals would write zeros there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from miles_lp.errors import FormatError
from miles_lp.formats import crosscheck
from miles_lp.formats.crosscheck import Row
from miles_lp.formats.mxfp8 import quantize_mxfp8
from miles_lp.formats.nvfp4 import broadcast_nvfp4_amax, nvfp4_global_amax, quantize_nvfp4
from miles_lp.formats.swizzle import swizzle_scales


def extra_cases(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    out: dict[str, torch.Tensor] = {}
    huge = torch.randn(64, 128, generator=g) * 2.0**118  # finite, near fp32's top
    huge[0, 1] = math.inf  # this block's scale becomes 0xFE: inverse 2^-127 (subnormal)
    huge[3, 70] = -math.inf
    huge[:32, 5] = math.inf  # a columnwise block with inf too
    out["inf_huge(64,128)"] = huge
    out["odd_rows(33,96)"] = torch.randn(33, 96, generator=g).bfloat16()
    out["experts_pad(3,160,224)"] = torch.randn(3, 160, 224, generator=g).bfloat16()  # M % 128, K/32 % 4
    out["tiny_blocks(64,64)"] = torch.randn(64, 64, generator=g) * 1e-38  # scale bytes near 0
    # bf16 bit patterns made here (a bf16 cast would make every NaN +0x7FC0): NaN of both signs and payloads
    # (the E2M1 encode gives +6 for all), +-inf, -0.0, subnormals, bf16 max, E2M1 ties after scaling; a row
    # of only NaN, a row of -0.0 and a row with one -NaN among zeros
    v = (torch.randn(32, 64, generator=g) * 3).bfloat16().view(torch.int16)
    specials = [0x7FC0, -64, 0x7F81, -127, 0x7F80, -128, -32768, 0x0001, -32767, 0x7F7F, -129, 0x3E80, -16768]
    for i, b in enumerate(specials):  # -64 = 0xFFC0, -127 = 0xFF81, -128 = 0xFF80 (-inf), -32768 = -0.0
        v[(5 * i) % 29, (11 * i) % 64] = b
    v[29] = -64
    v[30] = -32768
    v[31] = 0
    v[31, 17] = -63
    out["specials_bf16(32,64)"] = v.view(torch.bfloat16)
    return out


def all_cases(seed: int = 0, small: bool = False) -> dict[str, torch.Tensor]:
    """``crosscheck.cases`` + ``extra_cases``; ``small``: only those of at most 16K elements (interpreter)."""
    cases = {**crosscheck.cases(seed), **extra_cases(seed)}
    if small:
        cases = {k: v for k, v in cases.items() if v.numel() <= 16384}
    return cases


def _mx_both(x, dtype=torch.bfloat16):
    from miles_lp.formats import kernels

    r = kernels.mxfp8_quantize(x, rowwise=True, colwise=True, dequant_dtype=dtype, swizzle=True)
    return {"row.data": r.row.data, "row.scale": r.row.scale, "col.data": r.col.data, "col.scale": r.col.scale,
            "row.deq": r.row_deq, "col.deq": r.col_deq, "row.swz": r.row_swizzled, "col.swz": r.col_swizzled}


def _mx_both_ref(x, dtype=torch.bfloat16):
    a, c = quantize_mxfp8(x), quantize_mxfp8(x, axis=-2)
    return {"row.data": a.data, "row.scale": a.scale, "col.data": c.data, "col.scale": c.scale,
            "row.deq": a.dequantize(dtype), "col.deq": c.dequantize(dtype), "row.swz": swizzle_scales(a.scale),
            "col.swz": swizzle_scales(c.scale.transpose(-1, -2))}


def _mx_both_deq(x):
    """Both grids and their bf16 decodes, no swizzled scales (QuantLinear's mxfp8_qdq_both form)."""
    from miles_lp.formats import kernels

    r = kernels.mxfp8_quantize(x, rowwise=True, colwise=True, dequant_dtype=torch.bfloat16)
    return {"row.data": r.row.data, "row.scale": r.row.scale, "col.data": r.col.data, "col.scale": r.col.scale,
            "row.deq": r.row_deq, "col.deq": r.col_deq}


def _mx_both_deq_ref(x):
    return {k: v for k, v in _mx_both_ref(x).items() if not k.endswith(".swz")}


def _mx_both_q(x):
    """Both grids without decodes (the form the register cap applies to) and the swizzled scales."""
    from miles_lp.formats import kernels

    r = kernels.mxfp8_quantize(x, rowwise=True, colwise=True, swizzle=True)
    return {"row.data": r.row.data, "row.scale": r.row.scale, "col.data": r.col.data, "col.scale": r.col.scale,
            "row.swz": r.row_swizzled, "col.swz": r.col_swizzled}


def _mx_both_q_ref(x):
    return {k: v for k, v in _mx_both_ref(x).items() if not k.endswith(".deq")}


def _nv(q, deq=None):
    out = {"data": q.data, "scale": q.scale, "global_scale": q.global_scale, "amax": q.amax}
    if deq is not None:
        out["deq"] = deq
    return out


def kernel_pairs() -> list[tuple[str, Callable, Callable]]:
    """(name, kernel fn, reference fn): each maps an input tensor to named outputs."""
    from miles_lp.formats import kernels as k

    def mx_row(x):
        r = k.mxfp8_quantize(x, rowwise=True, dequant_dtype=torch.float32)
        return {"data": r.row.data, "scale": r.row.scale, "deq": r.row_deq}

    def mx_row_ref(x):
        a = quantize_mxfp8(x)
        return {"data": a.data, "scale": a.scale, "deq": a.dequantize(torch.float32)}

    def mx_dq(x, axis, dtype):
        q = quantize_mxfp8(x.cpu(), axis=axis)  # the reference grid, decoded by the kernel
        dev = type(q)(data=q.data.to(x.device), scale=q.scale.to(x.device), axis=axis)
        return {"deq": k.mxfp8_dequantize(dev, dtype)}

    def nv_dq(x, scope, dtype):
        q = quantize_nvfp4(x.cpu(), scale_scope=scope)
        dev = type(q)(data=q.data.to(x.device), scale=q.scale.to(x.device),
                      global_scale=q.global_scale.to(x.device), amax=q.amax.to(x.device),
                      logical_shape=q.logical_shape, scale_scope=scope)
        return {"deq": k.nvfp4_dequantize(dev, dtype)}

    def nv_pair(x):
        amax = nvfp4_global_amax(x.cpu(), x.cpu() * 0.5).to(x.device)
        a = broadcast_nvfp4_amax(amax, x, "tensor")
        return _nv(*k.nvfp4_quantize(x, "tensor", amax=a, dequant_dtype=torch.bfloat16))

    def nv_pair_ref(x):
        amax = nvfp4_global_amax(x, x * 0.5)
        q = quantize_nvfp4(x, amax=amax)
        return _nv(q, q.dequantize(torch.bfloat16))

    def nv_row_given(x):
        amax = x.cpu().float().abs().nan_to_num(nan=0.0, posinf=math.inf).amax(dim=-1, keepdim=True) * 2
        return _nv(*k.nvfp4_quantize(x, "row", amax=amax.to(x.device)))

    def nv_row_given_ref(x):
        amax = x.float().abs().nan_to_num(nan=0.0, posinf=math.inf).amax(dim=-1, keepdim=True) * 2
        return _nv(quantize_nvfp4(x, scale_scope="row", amax=amax))

    def mx_deq_only(x):
        r = k.mxfp8_quantize(x, rowwise=True, colwise=True, dequant_dtype=torch.bfloat16, swizzle=True, store_q=False)
        if r.row is not None or r.col is not None:
            raise AssertionError("mxfp8_quantize(store_q=False) returned E4M3 grids")
        return {"row.deq": r.row_deq, "col.deq": r.col_deq, "row.swz": r.row_swizzled, "col.swz": r.col_swizzled}

    def mx_deq_only_ref(x):
        return {n: v for n, v in _mx_both_ref(x).items() if n.endswith((".deq", ".swz"))}

    def mx_col_deq_only(x):
        r = k.mxfp8_quantize(x, rowwise=True, colwise=True, dequant_dtype=torch.bfloat16, dequant=("col",))
        if r.row_deq is not None:
            raise AssertionError("mxfp8_quantize wrote a rowwise decode that was not asked for")
        return {"row.data": r.row.data, "col.data": r.col.data, "col.deq": r.col_deq}

    def mx_col_deq_only_ref(x):
        a, c = quantize_mxfp8(x), quantize_mxfp8(x, axis=-2)
        return {"row.data": a.data, "col.data": c.data, "col.deq": c.dequantize(torch.bfloat16)}

    def nv_row_loops(x):  # rows longer than the register bound: the two-loop form of the per-token kernel
        reg = k.CONFIG["nvfp4_rows_reg"]
        old, reg["max_k"] = reg["max_k"], 0
        try:
            return _nv(*k.nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16))
        finally:
            reg["max_k"] = old

    def nv_row_forced(config: str, dequant, **cfg):  # the per-token kernel with CONFIG[config] entries forced
        def run(x):
            entry = k.CONFIG[config]
            old = dict(entry)
            entry.update(cfg)
            try:
                return _nv(*k.nvfp4_quantize(x, "row", dequant_dtype=dequant))
            finally:
                entry.clear()
                entry.update(old)
        return run

    def nv_row_cfg(dequant, **cfg):  # the pairs kernel's launch settings / kernel choice
        return nv_row_forced("nvfp4_pairs", dequant, **cfg)

    def nv_row_persist(dequant, **cfg):  # the persistent-grid per-token kernel (nvfp4_rows_persist_kernel)
        return nv_row_forced("nvfp4_persist", dequant, **cfg)

    def nv_row_ref(dequant):
        def ref(x):
            if x.dtype != torch.bfloat16:  # the pairs kernel reads bf16 only (others: "nvfp4 row (one pass)")
                raise FormatError("not a bf16 input")
            q = quantize_nvfp4(x, scale_scope="row")
            return _nv(q, None if dequant is None else q.dequantize(dequant))
        return ref

    def mx_stv(key, fn, **cfg_over):  # a launch option of the MXFP8 kernel forced (the sweep may pick it)
        def run(x):
            cfg = k.CONFIG[key]
            old = dict(cfg)
            cfg.update(cfg_over)
            try:
                return fn(x)
            finally:
                cfg.clear()
                cfg.update(old)
        return run

    def mx_evict(x):  # evict-first loads / streaming stores (a launch-shape option the sweep may pick)
        cfg = k.CONFIG["mxfp8_both"]
        old = dict(cfg)
        cfg["EVICT"] = 1
        try:
            return _mx_both(x)
        finally:
            cfg.clear()
            cfg.update(old)

    bf16 = torch.bfloat16
    return [
        # bf16 rows take nvfp4_rows_pairs_kernel (other dtypes the kernel below it): both, and RS = 2 (two rows
        # per program, the second one's load early; odd row counts exercise its masks)
        ("nvfp4 row pairs", nv_row_cfg(None), nv_row_ref(None)),
        ("nvfp4 row pairs +bf16 deq", nv_row_cfg(bf16), nv_row_ref(bf16)),
        ("nvfp4 row pairs RS=2 +bf16 deq", nv_row_cfg(bf16, RS_dq=2, el_per_thread_dq=32), nv_row_ref(bf16)),
        ("nvfp4 row pairs RS=2", nv_row_cfg(None, RS=2, el_per_thread=16), nv_row_ref(None)),
        ("nvfp4 row pairs off +bf16 deq", nv_row_cfg(bf16, enabled=False), nv_row_ref(bf16)),
        ("nvfp4 row pairs EVICT=0 +bf16 deq", nv_row_cfg(bf16, EVICT=0), nv_row_ref(bf16)),
        ("nvfp4 row pairs maxnreg=72 (spills)", nv_row_cfg(None, maxnreg=72), nv_row_ref(None)),
        # the encode forms side by side (ENC 0: two clamps, fp32 amax, div.rn; ENC 1: one clamp, bf16x2 amax
        # tree, rcp.rn), whichever is the default; ENC 1 at the other thread counts the sweep tries
        ("nvfp4 row pairs ENC=0", nv_row_cfg(None, ENC=0), nv_row_ref(None)),
        ("nvfp4 row pairs ENC=0 +bf16 deq", nv_row_cfg(bf16, ENC_dq=0), nv_row_ref(bf16)),
        ("nvfp4 row pairs ENC=1", nv_row_cfg(None, ENC=1), nv_row_ref(None)),
        ("nvfp4 row pairs ENC=1 +bf16 deq", nv_row_cfg(bf16, ENC_dq=1), nv_row_ref(bf16)),
        ("nvfp4 row pairs ENC=1 FULL=0", nv_row_cfg(None, ENC=1, FULL=0), nv_row_ref(None)),
        ("nvfp4 row pairs ENC=1 FULL=0 +bf16 deq", nv_row_cfg(bf16, ENC_dq=1, FULL=0), nv_row_ref(bf16)),
        ("nvfp4 row pairs ENC=1 128 el/thread", nv_row_cfg(None, ENC=1, el_per_thread=128, maxnreg=0),
         nv_row_ref(None)),
        ("nvfp4 row pairs ENC=1 64 el/thread +bf16 deq", nv_row_cfg(bf16, ENC_dq=1, el_per_thread_dq=64),
         nv_row_ref(bf16)),
        # the persistent grid (a few programs per SM looping over the rows; 4 "SMs" in the interpreter, so
        # odd row counts leave programs with one row fewer): pipelined loads, register prefetch, the qdq form
        ("nvfp4 row persist STAGES=2", nv_row_persist(None, pps=1, STAGES=2, PF=0), nv_row_ref(None)),
        ("nvfp4 row persist PF=1", nv_row_persist(None, pps=2, STAGES=1, PF=1), nv_row_ref(None)),
        ("nvfp4 row persist STAGES=3 +bf16 deq", nv_row_persist(bf16, pps_dq=1, STAGES_dq=3, PF_dq=0),
         nv_row_ref(bf16)),
        ("mxfp8 row+col+deq+swizzle EVICT", mx_evict, _mx_both_ref),
        # E4M3 tiles stored from the load's layout (STV 8), with and without streaming stores; rowwise alone
        ("mxfp8 row+col+deq STV=8", mx_stv("mxfp8_both", _mx_both_deq, STV=8), _mx_both_deq_ref),
        ("mxfp8 row+col STV=8 EVICT 1x4/1w", mx_stv("mxfp8_both", _mx_both_deq, STV=8, EVICT=1, NB=4, num_warps=1),
         _mx_both_deq_ref),
        ("mxfp8 rowwise STV=8", mx_stv("mxfp8", mx_row, STV=8), mx_row_ref),
        # 16-byte runs from registers (STV 16), whichever is the default; the tiles and caps the sweep tries
        # (the swizzled-scale form keeps the 12-01c launch unless STV_swz / FULL_swz are set: the decode rows
        # without swizzle are the ones that take STV / FULL)
        ("mxfp8 row+col+deq", _mx_both_deq, _mx_both_deq_ref),
        ("mxfp8 row+col+deq STV=0", mx_stv("mxfp8_both", _mx_both_deq, STV=0), _mx_both_deq_ref),
        ("mxfp8 row+col+deq+swizzle STV_swz=16 FULL_swz=1", mx_stv("mxfp8_both", _mx_both, STV_swz=16, FULL_swz=1),
         _mx_both_ref),
        ("mxfp8 row+col STV=16 1x4/1w maxnreg=168",
         mx_stv("mxfp8_both", lambda x: _mx_both_q(x), STV=16, NB=4, num_warps=1, maxnreg=168), _mx_both_q_ref),
        ("mxfp8 row+col STV=16 1x2/1w EVICT",
         mx_stv("mxfp8_both", lambda x: _mx_both_q(x), STV=16, NB=2, num_warps=1, EVICT=1), _mx_both_q_ref),
        ("mxfp8 row+col+deq FULL=1", mx_stv("mxfp8_both", _mx_both_deq, FULL=1), _mx_both_deq_ref),
        ("mxfp8 row+col+deq STV=0 FULL=1", mx_stv("mxfp8_both", _mx_both_deq, STV=0, FULL=1), _mx_both_deq_ref),
        ("mxfp8 row+col (no decodes: the register cap)", _mx_both_q, _mx_both_q_ref),
        # decode-only launches (store_q=False: no E4M3 data / compact scales written)
        ("mxfp8 decodes only row+col+swizzle", mx_deq_only, mx_deq_only_ref),
        ("mxfp8 decode only rowwise fp32",
         lambda x: {"deq": k.mxfp8_quantize(x, dequant_dtype=torch.float32, store_q=False).row_deq},
         lambda x: {"deq": quantize_mxfp8(x).dequantize(torch.float32)}),
        ("mxfp8 rowwise FULL=0", mx_stv("mxfp8", mx_row, FULL=0), mx_row_ref),
        ("mxfp8 rowwise STV=0 FULL=0 (12-01c)", mx_stv("mxfp8", mx_row, STV=0, FULL=0), mx_row_ref),
        ("mxfp8 rowwise STV=16", mx_stv("mxfp8", mx_row, STV=16), mx_row_ref),
        ("mxfp8 rowwise STV=16 1x4/1w", mx_stv("mxfp8", mx_row, STV=16, NB=4, num_warps=1), mx_row_ref),
        ("mxfp8 row+col+deq+swizzle", _mx_both, _mx_both_ref),
        ("mxfp8 row+col, col deq only", mx_col_deq_only, mx_col_deq_only_ref),
        ("mxfp8 row+col fp32 deq", lambda x: _mx_both(x, torch.float32), lambda x: _mx_both_ref(x, torch.float32)),
        ("mxfp8 rowwise", mx_row, mx_row_ref),
        ("mxfp8 codec hook row", lambda x: _comp(k.quantize_mxfp8(x, -1)), lambda x: _comp(quantize_mxfp8(x))),
        ("mxfp8 codec hook col", lambda x: _comp(k.quantize_mxfp8(x, -2)),
         lambda x: _comp(quantize_mxfp8(x, axis=-2))),
        ("mxfp8 columnwise STV=16 FULL=1", mx_stv("mxfp8_col", lambda x: _comp(k.quantize_mxfp8(x, -2)), STV=16, FULL=1),
         lambda x: _comp(quantize_mxfp8(x, axis=-2))),
        ("mxfp8 dequant row bf16", lambda x: mx_dq(x, -1, torch.bfloat16),
         lambda x: {"deq": quantize_mxfp8(x).dequantize(torch.bfloat16)}),
        ("mxfp8 dequant col fp32", lambda x: mx_dq(x, -2, torch.float32),
         lambda x: {"deq": quantize_mxfp8(x, axis=-2).dequantize(torch.float32)}),
        ("nvfp4 tensor +deq", lambda x: _nv(*k.nvfp4_quantize(x, "tensor", dequant_dtype=torch.bfloat16)),
         lambda x: (lambda q: _nv(q, q.dequantize(torch.bfloat16)))(quantize_nvfp4(x))),
        ("nvfp4 row (one pass) +deq", lambda x: _nv(*k.nvfp4_quantize(x, "row", dequant_dtype=torch.float32)),
         lambda x: (lambda q: _nv(q, q.dequantize(torch.float32)))(quantize_nvfp4(x, scale_scope="row"))),
        ("nvfp4 row (two loops) +deq", nv_row_loops,
         lambda x: (lambda q: _nv(q, q.dequantize(torch.bfloat16)))(quantize_nvfp4(x, scale_scope="row"))),
        ("nvfp4 2d +deq", lambda x: _nv(*k.nvfp4_quantize(x, "tensor", block_2d=True, dequant_dtype=torch.float32)),
         lambda x: (lambda q: _nv(q, q.dequantize(torch.float32)))(quantize_nvfp4(x, block_2d=True))),
        ("nvfp4 pair amax", nv_pair, nv_pair_ref),
        ("nvfp4 row given amax", nv_row_given, nv_row_given_ref),
        ("nvfp4 amax", lambda x: {"amax": k.nvfp4_amax(x)}, lambda x: {"amax": nvfp4_global_amax(x)}),
        ("nvfp4 dequant tensor bf16", lambda x: nv_dq(x, "tensor", torch.bfloat16),
         lambda x: {"deq": quantize_nvfp4(x).dequantize(torch.bfloat16)}),
        ("nvfp4 dequant row fp32", lambda x: nv_dq(x, "row", torch.float32),
         lambda x: {"deq": quantize_nvfp4(x, scale_scope="row").dequantize(torch.float32)}),
    ]


def _comp(q):
    return q.components()


def compare(device: str, cases: dict[str, torch.Tensor] | None = None,
            kernels: list[str] | None = None, repeat: int = 1) -> Iterator[Row]:
    """One Row per (kernel, case): kernel on ``device`` vs the reference on CPU, all outputs' bytes.

    ``repeat`` > 1 runs each kernel call that many times and compares every result (the first launch of a
    specialization goes through Triton's JIT, later ones through the cached launcher: both are checked)."""
    cases = all_cases() if cases is None else cases
    for name, fn, ref in kernel_pairs():
        if kernels is not None and name not in kernels:
            continue
        for case, x in cases.items():
            try:
                want = ref(x)
            except FormatError:  # not applicable (rows not a multiple of 32 / 16, a 1-D input, ...)
                continue
            xd = x.to(device)
            compared = mismatched = 0
            for _ in range(repeat):
                got = fn(xd)
                for key, a in want.items():
                    ba, bb = crosscheck.as_bytes(a), crosscheck.as_bytes(got[key])
                    if ba.shape != bb.shape:
                        compared, mismatched = compared + ba.numel(), mismatched + ba.numel()
                        continue
                    compared += ba.numel()
                    mismatched += int((ba != bb).sum())
            yield Row(name, case, compared, mismatched)


def encoder_inputs() -> torch.Tensor:
    """fp32 edge values: every E4M3 value and midpoint, E2M1 ties, saturation points, inf, NaN, subnormals,
    each with its two fp32 neighbours, both signs."""
    from miles_lp.formats import bits

    grid = [bits.e4m3_value(c) for c in range(0x7F)]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]
    extra = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 447.9, 460.0, 464.0, 1e6, math.inf, math.nan, 1e-45,
             2.0**-10, 2.0**-9 * 1.5, 3.0e38]
    vals = torch.tensor(grid + mids + extra, dtype=torch.float32)
    vals = torch.cat([vals, torch.nextafter(vals, vals * 2), torch.nextafter(vals, vals * 0)])
    return torch.cat([vals, -vals])


def check_encoders(device: str) -> list[str]:
    """The kernels' element encoders/decoders on ``device`` vs the exact oracles; returns the mismatches."""
    from miles_lp.formats import bits
    from miles_lp.formats import kernels as k

    x = encoder_inputs()
    n = x.numel()
    codes = torch.arange(n, dtype=torch.int32) % 256
    xd, cd = x.to(device), codes.to(device)
    e4, e2, bf, e2p, bfp, e2a = (torch.empty(n, dtype=torch.int32, device=device) for _ in range(6))
    v4, v2, r2p, r2a = (torch.empty(n, dtype=torch.float32, device=device) for _ in range(4))
    mod = k.runtime.module_for(xd)
    block = 1024
    mod.encoders_kernel[(-(-n // block),)](xd, cd, e4, e2, bf, v4, v2, e2p, r2p, bfp, e2a, r2a, n, 1.0, BLOCK=block)
    e4, e2, bf, v4, v2, e2p, r2p, bfp, e2a, r2a = (t.cpu() for t in (e4, e2, bf, v4, v2, e2p, r2p, bfp, e2a, r2a))
    bad = []
    for v, ca, ra in zip(x.tolist(), e2a.tolist(), r2a.tolist(), strict=True):  # the one-clamp encoder (ENC 1)
        w2 = bits.e2m1_encode_exact(v)
        wv = bits.E2M1_VALUES[w2]
        if ca != w2 or not (ra == wv and math.copysign(1, ra) == math.copysign(1, wv)):
            bad.append(f"e2m1 abs-clamp code/value({v!r}) = {ca:#x}/{ra!r}, want {w2:#x}/{wv!r}")

    def bf16_bad(v: float, b: int) -> bool:
        want = torch.tensor([v]).bfloat16().view(torch.int16).item() & 0xFFFF
        return (b != want) if not math.isnan(v) else ((b & 0x7FFF) <= 0x7F80)

    for v, c4, c2, b, cp, rp, bp in zip(x.tolist(), e4.tolist(), e2.tolist(), bf.tolist(), e2p.tolist(),
                                        r2p.tolist(), bfp.tolist(), strict=True):
        if c4 != bits.e4m3_encode_exact(v):
            bad.append(f"e4m3({v!r}) = {c4:#x}, want {bits.e4m3_encode_exact(v):#x}")
        w2 = bits.e2m1_encode_exact(v)
        if c2 != w2:
            bad.append(f"e2m1({v!r}) = {c2:#x}, want {w2:#x}")
        if cp != w2:
            bad.append(f"e2m1 pair code({v!r}) = {cp:#x}, want {w2:#x}")
        wv = bits.E2M1_VALUES[w2]
        if not (rp == wv and math.copysign(1, rp) == math.copysign(1, wv)):
            bad.append(f"e2m1 pair value({v!r}) = {rp!r}, want {wv!r}")
        if bf16_bad(v, b):
            bad.append(f"bf16({v!r}) = {b:#06x}")
        if bf16_bad(v, bp & 0xFFFF) or bf16_bad(-v, (bp >> 16) & 0xFFFF):
            bad.append(f"bf16x2({v!r}, {-v!r}) = {bp & 0xFFFFFFFF:#010x}")
    for c, a4, a2 in zip(codes.tolist(), v4.tolist(), v2.tolist(), strict=True):
        w4 = bits.e4m3_value(c)
        same4 = (math.isnan(w4) and math.isnan(a4)) or (a4 == w4 and math.copysign(1, a4) == math.copysign(1, w4))
        if not same4:
            bad.append(f"e4m3_value({c:#x}) = {a4!r}, want {w4!r}")
        w2 = bits.E2M1_VALUES[c & 15]
        if not (a2 == w2 and math.copysign(1, a2) == math.copysign(1, w2)):
            bad.append(f"e2m1_value({c & 15:#x}) = {a2!r}, want {w2!r}")
    return bad


def main(argv: list[str] | None = None) -> int:
    """``python -m miles_lp.formats.kernels.selfcheck``: the comparison as JSON lines (one per row), then the
    encoder check; exit 1 on any mismatch. ``--inject-fault`` flips one byte of each kernel's first
    output (the comparison must then report one mismatch per row: proof that it can fail)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m miles_lp.formats.kernels.selfcheck", description=main.__doc__)
    p.add_argument("--device", default="cuda", help="cuda, or cpu with TRITON_INTERPRET=1")
    p.add_argument("--cases", default="all", help="'all', 'small' (<= 16K elements) or names joined by ';'")
    p.add_argument("--kernels", default=None, help="kernel names joined by ';' (default: all)")
    p.add_argument("--inject-fault", action="store_true")
    p.add_argument("--no-encoders", action="store_true")
    p.add_argument("--repeat", type=int, default=1,
                   help="calls per (kernel, case), each compared (2: the JIT launch and the cached launcher)")
    p.add_argument("--config", default=None,
                   help="a bench quantize --json file: check with its launch shapes (kernels.CONFIG)")
    args = p.parse_args(argv)
    if args.config:
        from miles_lp.formats import kernels as k

        with open(args.config) as f:
            k.CONFIG.update(json.load(f)["config"])
        print(json.dumps({"config": k.CONFIG}))
    cases = all_cases(small=args.cases == "small")
    if args.cases not in ("all", "small"):
        names = args.cases.split(";")
        missing = [n for n in names if n not in cases]
        if missing:
            p.error(f"unknown cases {missing}; known: {sorted(cases)}")
        cases = {n: cases[n] for n in names}
    if args.inject_fault:
        pairs = kernel_pairs()

        def flipped():
            def bad(fn):
                def run(x):
                    got = fn(x)
                    key = next(iter(got))
                    t = got[key].clone()
                    t.reshape(-1).view(torch.uint8)[7] ^= 0x01
                    return {**got, key: t}
                return run
            return [(name, bad(fn), ref) for name, fn, ref in pairs]

        globals()["kernel_pairs"] = flipped
    failed = False
    for row in compare(args.device, cases, args.kernels.split(";") if args.kernels else None, args.repeat):
        print(json.dumps(row.__dict__), flush=True)
        failed |= row.mismatches > 0
    if not args.no_encoders:
        bad = check_encoders(args.device)
        print(json.dumps({"encoders_checked": encoder_inputs().numel(), "encoder_mismatches": bad[:20],
                          "encoder_mismatch_count": len(bad)}))
        failed |= bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
