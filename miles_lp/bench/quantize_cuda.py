"""``miles-lp bench quantize --device cuda``: the Triton kernels' bandwidth next to torchao and a device copy.

GB/s = (bytes the operation must read + bytes it must write) / median time (``triton.testing.do_bench``,
CUDA events). Counted bytes are the minimum (each input read once, each output written once); where a
kernel moves more (NVFP4 per tensor reads the input twice: amax pass, then quantize), the table says so in
``moved`` and the fraction of copy is still computed on the counted bytes, so it is comparable.
The copy (``y.copy_(x)``, read + write) is the ceiling; each MXFP8 / NVFP4 row is also divided by the
torchao anchor of the same output (compiled ``to_mx(..., RCEIL)`` / compiled ``nvfp4_quantize`` with a
per-tensor scale), measured in the same run on the same input.
"""

from __future__ import annotations

import json
import os
import warnings

from miles_lp.config import runtime_override


def _sweep(kernels, x, amax_t, log) -> None:
    """Try a few launch shapes per kernel on ``x``; keep the fastest in ``kernels.CONFIG``
    (``MILES_LP_SWEEP=key,key``: only those CONFIG keys)."""
    import torch
    from triton.testing import do_bench

    only = [k for k in os.environ.get("MILES_LP_SWEEP", "").split(",") if k]  # e.g. "nvfp4_pairs": sweep just those

    def best(key, variants, fn, show=3, tag=None):  # tag: the MILES_LP_SWEEP name (default: the CONFIG key)
        if only and (tag or key) not in only:
            return
        results = []
        for v in variants:
            kernels.CONFIG[key] = v
            try:
                fn()
                torch.cuda.synchronize()
                results.append((do_bench(fn, warmup=10, rep=50, return_mode="median"), v))
            except Exception as exc:  # a shape that does not compile (registers, shared memory): skip it
                log(f"  sweep {key} {v}: {type(exc).__name__}: {str(exc)[:120]}")
        results.sort(key=lambda r: r[0])
        kernels.CONFIG[key] = results[0][1]
        log(f"  sweep {key}: best {results[0][1]} {results[0][0] * 1e3:.1f} us; "
            + "; ".join(f"{v} {t * 1e3:.1f}" for t, v in results[1:1 + show]))

    mx = [{"BMB": b, "NB": n, "num_warps": w} for b in (1, 2) for n in (2, 4, 8) for w in (1, 2, 4, 8)
          if b * n <= 8 and b * n * 8 >= w]
    best("mxfp8", mx, lambda: kernels.mxfp8_quantize(x))
    mx_both = mx + [{"BMB": b, "NB": n, "num_warps": w} for b, n in ((4, 2), (4, 4), (2, 8), (1, 16))
                    for w in (2, 4, 8)]
    best("mxfp8_both", mx_both, lambda: kernels.mxfp8_quantize(x, rowwise=True, colwise=True))
    b = kernels.CONFIG["mxfp8_both"]  # the best tile again with evict-first loads / streaming stores
    best("mxfp8_both", [b, {**b, "EVICT": 1}], lambda: kernels.mxfp8_quantize(x, rowwise=True, colwise=True))
    # the E4M3 tiles stored from the load's layout (STV 8: no shared-memory re-layout, more registers), at the
    # default tile and the neighbours whose register count leaves more programs per SM; STV 0 in the same list
    b = kernels.CONFIG["mxfp8_both"]
    tiles = [b] + [{"BMB": bb, "NB": n, "num_warps": w} for bb, n, w in ((1, 8, 4), (1, 4, 1), (1, 4, 2), (2, 8, 4))
                   if (bb, n, w) != (b["BMB"], b["NB"], b["num_warps"])]
    best("mxfp8_both", [{**t, "STV": v} for t in tiles for v in (0, 8)],
         lambda: kernels.mxfp8_quantize(x, rowwise=True, colwise=True), show=9, tag="mxfp8_stv")
    # 12-01d: the E4M3 tiles stored as 16-byte runs straight from registers (STV 16: the load takes 16 elements per
    # thread to match, no shared-memory re-layout), 1- and 2-warp tiles, ptxas register caps, and FULL (no
    # masks where the tiles cover x); the 12-01c default (STV 0, FULL 0) first, in the same list
    b = kernels.CONFIG["mxfp8_both"]
    base = {k: v for k, v in b.items() if k not in ("STV", "maxnreg", "FULL", "EVICT")}
    t28 = {**base, "BMB": 1, "NB": 8, "num_warps": 2}
    t14 = {**base, "BMB": 1, "NB": 4, "num_warps": 1}
    t12 = {**base, "BMB": 1, "NB": 2, "num_warps": 1}
    mxv = [{**t28, "STV": 0, "FULL": 0}, {**t28, "STV": 0, "FULL": 1},
           {**t28, "STV": 16, "maxnreg": 168, "FULL": 0}, {**t28, "STV": 16, "maxnreg": 168, "FULL": 1},
           {**t28, "STV": 16, "FULL": 1},
           {**t14, "STV": 16, "maxnreg": 168, "FULL": 0}, {**t14, "STV": 16, "maxnreg": 168, "FULL": 1},
           {**t14, "STV": 16, "maxnreg": 192, "FULL": 1}, {**t14, "STV": 16, "FULL": 1},
           {**t12, "STV": 16, "FULL": 1}, {**t12, "STV": 16, "FULL": 1, "EVICT": 1}]
    best("mxfp8_both", mxv, lambda: kernels.mxfp8_quantize(x, rowwise=True, colwise=True), show=len(mxv),
         tag="mxfp8_stv16")
    b = kernels.CONFIG["mxfp8"]
    base = {k: v for k, v in b.items() if k not in ("STV", "maxnreg", "FULL")}
    mxr = [{**base, "BMB": 1, "NB": 8, "num_warps": 2, "STV": 0, "FULL": 0},
           {**base, "BMB": 1, "NB": 8, "num_warps": 2, "STV": 0, "FULL": 1},
           {**base, "BMB": 1, "NB": 8, "num_warps": 2, "STV": 16, "FULL": 1},
           {**base, "BMB": 1, "NB": 4, "num_warps": 1, "STV": 16, "FULL": 1}]
    best("mxfp8", mxr, lambda: kernels.mxfp8_quantize(x), show=len(mxr), tag="mxfp8_stv16")
    b = kernels.CONFIG["mxfp8"]
    best("mxfp8", [b, {**b, "EVICT": 1}], lambda: kernels.mxfp8_quantize(x))
    b = kernels.CONFIG["mxfp8"]
    best("mxfp8", [b, {**b, "STV": 8}], lambda: kernels.mxfp8_quantize(x), tag="mxfp8_stv")
    best("mxfp8_dq", [{"BMB": b, "NB": n, "num_warps": w} for b in (1, 2) for n in (4, 8) for w in (4, 8)],
         lambda: kernels.mxfp8_dequantize(kernels.mxfp8_quantize(x).row, torch.bfloat16))
    best("nvfp4", [{"TA": a, "NB": n, "num_warps": w} for a in (8, 16, 32) for n in (8, 16) for w in (1, 2, 4)
                   if a * n <= 256],
         lambda: kernels.nvfp4_quantize(x, "tensor", amax=amax_t))
    best("nvfp4_2d", [{"TA": a, "NB": n, "num_warps": w} for a in (1, 2) for n in (8, 16) for w in (1, 2, 4)],
         lambda: kernels.nvfp4_quantize(x, "tensor", amax=amax_t, block_2d=True))
    # (elements/thread, rows/program, ptxas register cap): the cap trades spills for programs per SM
    shapes = [(64, 1, 0), (64, 1, 80), (64, 1, 72), (32, 1, 0), (32, 2, 0), (32, 2, 80), (128, 1, 0)]
    if x.dtype == torch.bfloat16:  # the bf16 per-token kernel: quantize only, then with the bf16 decode
        ev = kernels.CONFIG["nvfp4_pairs"].get("EVICT", 1)
        pairs = [{**kernels.CONFIG["nvfp4_pairs"], "el_per_thread": e, "RS": r, "maxnreg": c, "EVICT": v}
                 for e, r, c in shapes for v in {ev, 1 - ev}]
        best("nvfp4_pairs", pairs, lambda: kernels.nvfp4_quantize(x, "row"))
        q_cfg = kernels.CONFIG["nvfp4_pairs"]
        best("nvfp4_pairs", [{**q_cfg, "el_per_thread_dq": e, "RS_dq": r, "maxnreg_dq": c} for e, r, c in shapes],
             lambda: kernels.nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16))
        # 12-01d: the encode with one clamp fewer, the bf16x2 amax tree and rcp.rn (ENC 1) and the unmasked
        # full-row form (FULL 1) against the 12-01c kernel (ENC 0, FULL 0, cap 80), at the register caps that fit
        # (offline SASS per element: 18.1 -> 15.7 at 64 el/thread, 80 registers, no spill); then the qdq form
        p = kernels.CONFIG["nvfp4_pairs"]
        nve = [{**p, "ENC": e, "FULL": f, "el_per_thread": t, "maxnreg": c}
               for e, f, t, c in ((0, 0, 64, 80), (0, 1, 64, 80), (1, 0, 64, 80), (1, 1, 64, 80), (1, 1, 64, 0),
                                  (1, 1, 64, 72), (1, 1, 128, 0), (1, 1, 32, 0))]
        best("nvfp4_pairs", nve, lambda: kernels.nvfp4_quantize(x, "row"), show=len(nve), tag="nvfp4_enc")
        p = kernels.CONFIG["nvfp4_pairs"]
        nvd = [{**p, "ENC_dq": e, "FULL": p["FULL"] if f is None else f, "el_per_thread_dq": t}
               for e, f, t in ((0, 0, 32), (1, 0, 32), (1, None, 32), (1, None, 64))]
        best("nvfp4_pairs", nvd, lambda: kernels.nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16),
             show=len(nvd), tag="nvfp4_enc")
        # the persistent grid (pps programs per SM looping over rows; pps 0 = the kernel just swept, in the same
        # list so the two are timed side by side); maxnreg overrides nvfp4_pairs' cap for it
        per = kernels.CONFIG["nvfp4_persist"]
        cap = kernels.CONFIG["nvfp4_pairs"].get("maxnreg", 0)
        pv = [{**per, "pps": 0}] + [{**per, "pps": p, "STAGES": st, "PF": 0, "maxnreg": c}
                                    for p in (4, 6, 8) for st in (2, 3) for c in (0, 80)]
        pv += [{**per, "pps": p, "STAGES": 1, "PF": f, "maxnreg": cap} for p in (4, 8) for f in (0, 1)]
        best("nvfp4_persist", pv, lambda: kernels.nvfp4_quantize(x, "row"), show=len(pv))
        per = kernels.CONFIG["nvfp4_persist"]
        pv = [{**per, "pps_dq": 0}] + [{**per, "pps_dq": p, "STAGES_dq": st, "PF_dq": 0}
                                       for p in (4, 8) for st in (1, 2)] + [{**per, "pps_dq": 4, "STAGES_dq": 1, "PF_dq": 1}]
        best("nvfp4_persist", pv, lambda: kernels.nvfp4_quantize(x, "row", dequant_dtype=torch.bfloat16), show=len(pv))
    old = kernels.CONFIG["nvfp4_pairs"]["enabled"]
    kernels.CONFIG["nvfp4_pairs"]["enabled"] = False
    try:
        best("nvfp4_rows", [{"ROWS": r, "NB": n, "num_warps": w} for r in (1, 2, 4, 8) for n in (16, 32)
                            for w in (1, 2, 4) if r * n <= 128],
             lambda: kernels.nvfp4_quantize(x, "row"))
    finally:
        kernels.CONFIG["nvfp4_pairs"]["enabled"] = old


class _Skip(Exception):
    """The torch.compile comparison is off (--no-compile)."""


def _host_us(fn, calls: int = 200) -> float:
    """Median host time of one call (us), the GPU idle at each start (synchronised between calls)."""
    import time

    import torch

    ts = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    ts.sort()
    return ts[len(ts) // 2]


def _small_shape(x, log, compiled: bool = True) -> list[dict]:
    """Per call of the QuantLinear operand entry points at a small shape: the GPU time (do_bench median of
    back-to-back calls), the host time of one call (``_host_us``) with the cached launcher and with Triton's
    JIT dispatch on every call (``runtime.kernels_fast_launch: false``), and the torch.compile path they replace.
    Then a cProfile of the rowwise qdq entry point (where the host time goes)."""
    import cProfile
    import io
    import pstats

    import torch
    from triton.testing import do_bench

    from miles_lp.formats import kernels
    from miles_lp.train import fused

    bf16 = torch.bfloat16
    calls = {
        "mxfp8_qdq rowwise": lambda: fused.mxfp8_qdq(x, -1, bf16),
        "mxfp8_qdq columnwise": lambda: fused.mxfp8_qdq(x, -2, bf16),
        "mxfp8_qdq_both": lambda: fused.mxfp8_qdq_both(x, bf16),
        "mxfp8 quantize rowwise (no decode)": lambda: kernels.mxfp8_quantize(x),
        "nvfp4_qdq per-token": lambda: fused.nvfp4_qdq(x, "row", bf16),
        "nvfp4_qdq per-tensor": lambda: fused.nvfp4_qdq(x, "tensor", bf16),
        "torch.empty_like (for scale)": lambda: torch.empty_like(x),
    }
    out = []
    for name, fn in calls.items():
        row: dict = {"name": name}
        try:
            fn()
            torch.cuda.synchronize()
            row["gpu_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
            row["host_us"] = _host_us(fn)
            with runtime_override(kernels_fast_launch=False):
                row["host_us_jit"] = _host_us(fn)
            if not compiled:
                raise _Skip
            with runtime_override(kernels="reference"):
                fn()
                torch.cuda.synchronize()
                row["compiled_gpu_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
                row["compiled_host_us"] = _host_us(fn, 50)
        except _Skip:
            pass
        except Exception as exc:
            log(f"  small {name}: {type(exc).__name__}: {str(exc)[:160]}")
        out.append(row)
        nan = float("nan")
        log(f"  {name:36s} GPU {row.get('gpu_ms', nan) * 1e3:7.1f} us  host {row.get('host_us', nan):6.1f} us "
            f"(JIT dispatch {row.get('host_us_jit', nan):6.1f})   torch.compile GPU "
            f"{row.get('compiled_gpu_ms', nan) * 1e3:7.1f} us host {row.get('compiled_host_us', nan):6.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        fused.mxfp8_qdq(x, -1, bf16)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    log("  cProfile, 300 calls of fused.mxfp8_qdq rowwise (tottime):")
    for ln in buf.getvalue().splitlines():
        if ln.strip() and not ln.startswith(("   Ordered", "         ")):
            log("    " + ln.strip()[:150])
    return out


def run_cuda(args) -> int:
    import torch
    from triton.testing import do_bench

    from miles_lp.formats import kernels, quantize_mxfp8

    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    x = torch.randn(args.rows, args.cols, dtype=torch.float32, device=dev).to(dtype)
    n, eb = x.numel(), x.element_size()
    rows = args.rows
    commit = os.environ.get("MILES_LP_COMMIT", "unknown")
    log(f"input [{args.rows}, {args.cols}] {args.dtype} on {torch.cuda.get_device_name(dev)}; torch "
        f"{torch.__version__}, triton {__import__('triton').__version__}; commit {commit}; median of do_bench")
    amax_t = kernels.matrix_amax(x)
    if args.sweep:
        _sweep(kernels, x, amax_t, log)
        log(f"  CONFIG after sweep: {json.dumps(kernels.CONFIG)}")

    table: list[dict] = []

    def bench(name, fn, counted, moved=None, anchor=None, note=""):
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=max(100, args.repeats), return_mode="median")
        row = {"name": name, "ms": ms, "bytes": counted, "moved": moved or counted,
               "gbs": counted / ms / 1e6, "anchor": anchor, "note": note}
        table.append(row)
        return row

    y = torch.empty_like(x)
    copy = bench("device copy (y.copy_(x))", lambda: y.copy_(x), 2 * n * eb)
    mx_bytes = n * eb + n + n // 32
    nv_bytes = n * eb + n // 2 + n // 16
    ao_mx = ao_nv = None
    if not args.no_torchao:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from torchao.prototype.mx_formats.config import ScaleCalculationMode
                from torchao.prototype.mx_formats.mx_tensor import to_mx
                from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
            to_mx_c = torch.compile(lambda t: to_mx(t, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode.RCEIL))
            ao_mx = bench("torchao to_mx RCEIL compiled (rowwise)", lambda: to_mx_c(x), mx_bytes)
            scale = per_tensor_amax_to_scale(amax_t.reshape(()))
            nv_c = torch.compile(lambda t, s: nvfp4_quantize(t, 16, s))
            ao_nv = bench("torchao nvfp4_quantize compiled (scale given)", lambda: nv_c(x, scale), nv_bytes)
            s_ao, d_ao = to_mx_c(x)
            ours = kernels.mxfp8_quantize(x).row
            same = torch.equal(ours.data.view(torch.uint8), d_ao.view(torch.uint8).reshape(x.shape)) and torch.equal(
                ours.scale, s_ao.view(torch.uint8).reshape(ours.scale.shape))
            log(f"  kernel MXFP8 bytes identical to torchao RCEIL on this input: {same}")
        except Exception as exc:  # torchao missing or broken on this torch: the anchor is skipped, said so
            log(f"  torchao anchor skipped: {type(exc).__name__}: {str(exc)[:200]}")

    a_mx = ao_mx["name"] if ao_mx else None
    a_nv = ao_nv["name"] if ao_nv else None
    k = kernels
    bf16 = torch.bfloat16
    bench("mxfp8 rowwise", lambda: k.mxfp8_quantize(x), mx_bytes, anchor=a_mx)
    bench("mxfp8 columnwise", lambda: k.mxfp8_quantize(x, rowwise=False, colwise=True), mx_bytes, anchor=a_mx)
    bench("mxfp8 rowwise + columnwise, one pass", lambda: k.mxfp8_quantize(x, colwise=True),
          n * eb + 2 * (n + n // 32), note=f"STV {kernels.CONFIG['mxfp8_both'].get('STV', 0)}")
    both = kernels.CONFIG["mxfp8_both"]
    old_both = dict(both)
    both["STV"] = 0 if both.get("STV", 0) else 8  # the other store form at the same tile, side by side
    try:
        bench(f"mxfp8 rowwise + columnwise, one pass, STV {both['STV']}", lambda: k.mxfp8_quantize(x, colwise=True),
              n * eb + 2 * (n + n // 32))
    finally:
        both.clear()
        both.update(old_both)
    bench("mxfp8 row + col + swizzled scales", lambda: k.mxfp8_quantize(x, colwise=True, swizzle=True),
          n * eb + 2 * (n + 2 * (n // 32)), note="swizzled scales zero-filled first (one memset each)")
    bench("mxfp8 qdq rowwise (+ bf16 decode)", lambda: k.mxfp8_quantize(x, dequant_dtype=bf16),
          mx_bytes + 2 * n)
    bench("mxfp8 qdq row + col (+ both decodes)",
          lambda: k.mxfp8_quantize(x, colwise=True, dequant_dtype=bf16), n * eb + 2 * (n + n // 32) + 4 * n)
    q_row = k.mxfp8_quantize(x).row
    bench("mxfp8 dequantize -> bf16", lambda: k.mxfp8_dequantize(q_row, bf16), n + n // 32 + 2 * n)
    bench("nvfp4 per-tensor (amax pass + quantize)", lambda: k.nvfp4_quantize(x, "tensor"), nv_bytes,
          moved=nv_bytes + n * eb, anchor=a_nv, note="reads x twice")
    bench("nvfp4 per-tensor, amax given", lambda: k.nvfp4_quantize(x, "tensor", amax=amax_t), nv_bytes, anchor=a_nv)
    pcfg = kernels.CONFIG["nvfp4_pairs"]
    pairs_note = (f"bf16 int32-pair kernel, {pcfg['el_per_thread']} el/thread, RS {pcfg['RS']}"
                  if x.dtype == torch.bfloat16 and pcfg["enabled"] else "")
    per = kernels.CONFIG["nvfp4_persist"]
    per_note = (f"; persistent grid {per['pps']}/SM, STAGES {per['STAGES']}, PF {per['PF']}, maxnreg "
                f"{per.get('maxnreg', pcfg.get('maxnreg', 0))}" if pairs_note and per["pps"] else "")
    bench("nvfp4 per-token, one pass", lambda: k.nvfp4_quantize(x, "row"), nv_bytes + 8 * rows, anchor=a_nv,
          note=pairs_note + per_note)
    if pairs_note:  # the other of the two bf16 per-token kernels, same bytes, side by side in this run
        old_per = dict(per)
        other = {"pps": 0} if per["pps"] else {"pps": 4, "STAGES": 2, "PF": 0}
        per.update(other)
        try:
            bench("nvfp4 per-token, " + ("one row per program" if per["pps"] == 0 else "persistent grid 4/SM STAGES 2"),
                  lambda: k.nvfp4_quantize(x, "row"), nv_bytes + 8 * rows, anchor=a_nv)
        finally:
            per.clear()
            per.update(old_per)
    reg = kernels.CONFIG["nvfp4_rows_reg"]
    default_ept = reg["el_per_thread"]
    pcfg["enabled"] = False  # the general per-token kernel (fp32 / fp16 inputs; bf16 before 12-01c)
    try:
        for ept in (32, 64):  # the register-resident per-token kernel at other thread counts (same bytes)
            reg["el_per_thread"] = ept
            bench(f"nvfp4 per-token, general kernel, {ept} el/thread", lambda: k.nvfp4_quantize(x, "row"),
                  nv_bytes + 8 * rows, anchor=a_nv)
        reg["el_per_thread"] = default_ept
        bench("nvfp4 qdq per-token, general kernel (+ bf16 decode)",
              lambda: k.nvfp4_quantize(x, "row", dequant_dtype=bf16), nv_bytes + 8 * rows + 2 * n)
    finally:
        pcfg["enabled"] = True
        reg["el_per_thread"] = default_ept
    bench("nvfp4 16x16 tiles (weights), amax given",
          lambda: k.nvfp4_quantize(x, "tensor", amax=amax_t, block_2d=True), nv_bytes, anchor=a_nv)
    bench("nvfp4 qdq per-token (+ bf16 decode)", lambda: k.nvfp4_quantize(x, "row", dequant_dtype=bf16),
          nv_bytes + 8 * rows + 2 * n, note=pairs_note and (f"bf16 int32-pair kernel, {pcfg['el_per_thread_dq']} "
                                                          f"el/thread, RS {pcfg['RS_dq']}"))
    q_nv = k.nvfp4_quantize(x, "tensor")[0]
    bench("nvfp4 dequantize -> bf16", lambda: k.nvfp4_dequantize(q_nv, bf16), n // 2 + n // 16 + 2 * n)
    bench("amax (per matrix)", lambda: k.matrix_amax(x), n * eb)
    if not args.no_compile:  # the path these kernels replace: the codec core under torch.compile
        with runtime_override(kernels="reference"):
            bench("before: mxfp8 rowwise torch.compile core", lambda: quantize_mxfp8(x, compile=True), mx_bytes,
                  anchor=a_mx)
            bench("before: mxfp8 columnwise torch.compile core", lambda: quantize_mxfp8(x, axis=-2, compile=True),
                  mx_bytes)

    by_name = {r["name"]: r for r in table}
    log(f"{'kernel':46s} {'ms':>8s} {'GB counted':>10s} {'GB/s':>8s} {'of copy':>7s} {'vs torchao':>10s}  note")
    for r in table:
        frac = r["gbs"] / copy["gbs"]
        ratio = f"{r['gbs'] / by_name[r['anchor']]['gbs']:.2f}x" if r["anchor"] else ""
        note = r["note"] + (f" (moves {r['moved'] / 1e9:.3f} GB)" if r["moved"] != r["bytes"] else "")
        r["frac_copy"] = frac
        r["ratio_torchao"] = r["gbs"] / by_name[r["anchor"]]["gbs"] if r["anchor"] else None
        log(f"{r['name']:46s} {r['ms']:8.3f} {r['bytes'] / 1e9:10.3f} {r['gbs']:8.0f} {frac:7.2f} {ratio:>10s}  {note}")
    sr, sc = getattr(args, "small_shape", (2048, 4096))
    xs = torch.randn(sr, sc, device=dev).to(dtype)
    log(f"small shape [{sr}, {sc}] {args.dtype}: per call, QuantLinear operand entry points (miles_lp.train.fused)")
    small = _small_shape(xs, log, compiled=not args.no_compile)
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"commit": commit, "shape": [args.rows, args.cols], "dtype": args.dtype,
                       "device": torch.cuda.get_device_name(dev), "config": kernels.CONFIG, "rows": table,
                       "small_shape_ms": small}, f,
                      indent=1)
        os.replace(tmp, args.json)
    return 0


def ncu_targets(rows: int = 16384, cols: int = 8192) -> None:
    """One launch of each near-miss kernel at its default and at the 12-01c form, on one [rows, cols] bf16
    input, for ``ncu`` (scripts/h200_kernels.sh with NCU=1: occupancy, warp stall reasons, bytes moved): four
    launches in all, the defaults first, each config printed before ncu's report of it."""
    import torch

    from miles_lp.formats import kernels

    x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    both, pairs = kernels.CONFIG["mxfp8_both"], kernels.CONFIG["nvfp4_pairs"]
    old_both = {**both, "STV": 0, "FULL": 0, "maxnreg": 0}
    old_pairs = {**pairs, "ENC": 0, "FULL": 0, "maxnreg": 80}
    new_both, new_pairs = dict(both), dict(pairs)
    for label, b, p in (("new", new_both, new_pairs), ("old", old_both, old_pairs)):
        kernels.CONFIG["mxfp8_both"], kernels.CONFIG["nvfp4_pairs"] = b, p
        kernels.mxfp8_quantize(x, rowwise=True, colwise=True)
        kernels.nvfp4_quantize(x, "row")
        torch.cuda.synchronize()
        print(f"ncu target {label}: mxfp8_both {b}; nvfp4_pairs {p}", flush=True)
    kernels.CONFIG["mxfp8_both"], kernels.CONFIG["nvfp4_pairs"] = new_both, new_pairs
