"""FP8 blockwise operand kernels (Triton, and Gluon TMA kernels on sm_90): what the native GEMMs read, byte-identical
to the codec.

``quantize_act(x, pow2, rows=, cols=)``: the 1x128 rowwise grid of ``x [M, K]`` (``quantize_fp8_blockwise(x,
(1, 128))``) and/or its 128x1 grid (``(128, 1)``: the 1x128 tiles of ``x.T``), from one read of ``x``.
``quantize_weight(w, pow2, transposed=)``: the 128x128 grid of ``w [N, K]`` and its data transposed.

The results are ``FP8BlockTensor`` s whose tensors are views of storage laid out for
``torch.nn.functional.scaled_mm``: rows padded to a multiple of 128 (zeros, scale 1); the rowwise scale stored
``[K/128, M]`` and viewed ``[M, K/128]`` (M-major, what BlockWise1x128 reads); the columnwise data stored
``[K, M]`` and viewed ``[M, K]``. ``padded(q)`` returns that storage. Equality with the codec is element by
element on the views (``selfcheck``; ``tests/unit/test_fp8_block_kernels.py`` under ``TRITON_INTERPRET=1``).

Which kernel runs is ``CONFIG``'s choice: on CUDA for bf16 / fp16 inputs of at least ``tma_min_tiles`` tiles, the
Gluon kernels of ``_fp8_block_gluon.py`` (persistent, TMA loads and stores; compiled only on CUDA: the interpreter
and every other input take the Triton kernels of ``_fp8_block_triton.py``).
"""

from __future__ import annotations

import math
import os

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.fp8 import FP8BlockTensor
from miles_lp.formats.kernels.runtime import cached_jit_module, interpreting
from miles_lp.formats.kernels.runtime import launch as _launch
from miles_lp.formats.kernels.runtime import launch_tma as _launch_tma

BLOCK = 128
#: launch shape (warps per 128x128 tile program), the fastest measured on the H200 (8192^2 bf16: act rows 56 / 72 /
#: 55 us and cols 87 / 88 / 120 us at 8 / 4 / 16 warps; weight + transpose 155 / 135 / 98 us)
#: act_both: how both grids are written: "tile" (two launches: the rowwise grid by ``act_tile_kernel``, the
#: columnwise one as act_cols says) or a name of ACT_VARIANTS (one launch of ``act_slab_kernel``); act_cols: the
#: columnwise grid alone: "tile" (``act_tile_kernel``) or an ACT_VARIANTS name. The defaults are the fastest on the
#: H200 (8192^2 bf16: both grids 110.4 us in one launch against 137.1 for two tile launches, copy 64.8; the
#: columnwise grid 80.7 against 84.5; 2048x4096: 13.7 against 17.7; docs/results/h200-fp8-block-act-2026-12-02).
#: scripts/h200_fp8_block_act.py times them all side by side and prints the fastest.
#: weight: "tile" (``weight_tile_kernel``) or a TMA_VARIANTS name.
#: tma_min_tiles: the TMA kernels run only on inputs of at least this many 128x128 tiles. The defaults: the Gluon
#: TMA kernels, the fastest on the H200 (8192^2 bf16, CUDA graphs: both grids 85.0 us against 108.4 for the slab
#: kernel, copy 64.1; the columnwise grid 60.2 against 79.9; the weight 74.7 against 95.1; at 2048x4096 the
#: activations 10.9 / 8.0 against 13.4 / 11.7, the weight 11.0 against 10.5; docs/results/h200-fp8-block-tma-2026-12-02).
CONFIG = {"act_warps": 8, "weight_warps": 16, "act_both": "tma_s2o1_w8_x2", "act_cols": "tma_s2o1_w8_x2",
          "weight": "tma_s2o1_w8", "tma_min_tiles": 512}
#: ``act_slab_kernel`` launch shapes: RSLAB rows per slab in the amax (+ rowwise) pass, CSLAB in the columnwise
#: pass, PREFETCH each slab loaded one iteration ahead, warps per 128x128 tile program.
ACT_VARIANTS = {
    "r32c32ta_w8": {"RSLAB": 32, "CSLAB": 32, "PREFETCH": 0, "warps": 8},
    "r32c32tpa_w8": {"RSLAB": 32, "CSLAB": 32, "PREFETCH": 1, "warps": 8},
    "r32c64tpa_w8": {"RSLAB": 32, "CSLAB": 64, "PREFETCH": 1, "warps": 8},
    "r16c32tpa_w4": {"RSLAB": 16, "CSLAB": 32, "PREFETCH": 1, "warps": 4},
}
#: the Gluon kernels of ``_fp8_block_gluon.py`` (sm_90, TMA in and out, persistent over tiles; bf16 / fp16 inputs
#: whose rows are 16-byte multiples, else the Triton kernels run): STAGES tiles loaded ahead, OUT tiles' stores in
#: flight, warps per program, programs per SM (x2: two, in 96 KiB of shared memory and 113 registers each; x3: three,
#: in 64 KiB and at most 80 registers, each half of a tile read twice from shared memory: LEAN; c: LC16, the
#: columnwise grid read from shared memory without bank conflicts). 16 warps spill, and ran slowest on the H200 before
#: they did.
TMA_VARIANTS = {
    "tma_s3o2_w8": {"STAGES": 3, "OUT": 2, "warps": 8, "per_sm": 1, "LEAN": 0, "maxnreg": 0, "LC16": 0},
    "tma_s4o2_w8": {"STAGES": 4, "OUT": 2, "warps": 8, "per_sm": 1, "LEAN": 0, "maxnreg": 0, "LC16": 0},
    "tma_s2o1_w8": {"STAGES": 2, "OUT": 1, "warps": 8, "per_sm": 1, "LEAN": 0, "maxnreg": 0, "LC16": 0},
    "tma_s2o1_w8_x2": {"STAGES": 2, "OUT": 1, "warps": 8, "per_sm": 2, "LEAN": 0, "maxnreg": 0, "LC16": 0},
    "tma_s2o1_w8_x2c": {"STAGES": 2, "OUT": 1, "warps": 8, "per_sm": 2, "LEAN": 0, "maxnreg": 0, "LC16": 1},
    "tma_s1o1_w8_x3": {"STAGES": 1, "OUT": 1, "warps": 8, "per_sm": 3, "LEAN": 1, "maxnreg": 80, "LC16": 0},
    "tma_s1o1_w8_x3c": {"STAGES": 1, "OUT": 1, "warps": 8, "per_sm": 3, "LEAN": 1, "maxnreg": 80, "LC16": 1},
}
#: what runs where a TMA variant is configured but the input is not one the TMA kernels take
_TRITON = {"act_both": "r16c32tpa_w4", "act_cols": "r32c32tpa_w8"}
_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fp8_block_triton.py")


def _module(x: torch.Tensor):
    interp = not x.is_cuda
    if interp and not interpreting():
        raise FormatError("miles_lp.formats.kernels.fp8_block: the kernels run on CUDA tensors (or on CPU under "
                          "TRITON_INTERPRET=1); use miles_lp.formats.quantize_fp8_blockwise here")
    return cached_jit_module(_PATH, "miles_lp.formats.kernels._fp8_block_triton", interp)


def _gluon():
    from miles_lp.formats.kernels import (
        _fp8_block_gluon,  # Triton's Gluon: imported only where a TMA kernel runs
    )

    return _fp8_block_gluon


_SMS: dict[int, int] = {}


def _programs(dev: torch.device, tiles: int, per_sm: int) -> int:
    n = _SMS.get(dev.index)
    if n is None:
        n = _SMS[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
    return min(tiles, n * per_sm)


def _tma_ok(x: torch.Tensor, variant: str, tiles: int, *widths: int) -> bool:
    """A TMA kernel serves this input: asked for, on CUDA, 16-bit, every row a multiple of 16 bytes, at least
    ``CONFIG["tma_min_tiles"]`` 128x128 tiles (below that the pipeline never fills: 2048x4096 ran slower)."""
    return (variant in TMA_VARIANTS and x.is_cuda and tiles >= CONFIG["tma_min_tiles"]
            and x.dtype in (torch.bfloat16, torch.float16) and not x.data_ptr() & 15
            and all(w % 16 == 0 for w in widths))


def _tma_act(variant: str, x, rq, rs, cq, cs, k: int, mp: int, rows: bool, vinf: float, pow2: bool) -> None:
    v = TMA_VARIANTS[variant]
    tiles_k = math.ceil(k / BLOCK)
    tiles = (mp // BLOCK) * tiles_k
    cq8 = cq.view(torch.float8_e4m3fn)
    rq8 = rq.view(torch.float8_e4m3fn) if rows else cq8  # (ROWS=0: a descriptor of the right type, unused)
    descs = ((x, (128, 64)), (rq8, (128, 64)), (cq8, (64, 128)))
    _launch_tma(_gluon().act_tma_kernel, _programs(x.device, tiles, v["per_sm"]), descs,
                (rs if rows else cs, cs, mp, k, tiles_k, tiles), v["warps"], maxnreg=v["maxnreg"], ROWS=rows,
                VALUE_FOR_INF=vinf, POW2=bool(pow2), STAGES=v["STAGES"], OUT=v["OUT"], LEAN=v["LEAN"], LC16=v["LC16"])


def _value_for_inf(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)  # TE: the input type's max finite value (the codec's rule)


def _source(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(what the kernel reads, BF16_BITS): bf16 as int16 bits under the interpreter (its bf16 cast is inexact)."""
    if x.dtype == torch.bfloat16 and not x.is_cuda:
        return x.view(torch.int16), True
    return x, False


def _check(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or x.numel() == 0:
        raise FormatError(f"fp8_block kernels: {what} must be a non-empty 2-D bf16/fp16/fp32 tensor, got "
                          f"{x.dtype} {tuple(x.shape)}")


class NativeOperand:
    """The storage of one quantized operand as the GEMM reads it (``data`` row-major, padded rows)."""

    __slots__ = ("data", "scale_inv", "rows")

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, rows: int):
        self.data, self.scale_inv, self.rows = data, scale_inv, rows


_DUMMY: dict[torch.device, torch.Tensor] = {}
_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _scratch(dev: torch.device, n: int) -> torch.Tensor:
    """fp32 storage of at least n elements that nobody reads (a kernel's optional output, not asked for)."""
    t = _SCRATCH.get(dev)
    if t is None or t.numel() < n:
        t = _SCRATCH[dev] = torch.empty(max(n, 1024), dtype=torch.float32, device=dev)
    return t


def quantize_act(x: torch.Tensor, pow2: bool, *, rows: bool = True, cols: bool = False, grids: bool = True):
    """(rowwise grid or None, columnwise grid or None, (row storage, col storage)) of ``x [M, K]``.

    Row storage: data ``[MP, K]`` and scale_inv ``[MP, K/128]`` M-major. Col storage: data ``[K, MP]`` (the
    transpose, row-major) and scale_inv ``[K, MP/128]`` K-major (the view ``scaled_mm`` reads for the wgrad
    operands). ``CONFIG["act_both"]`` / ``["act_cols"]`` pick the kernel: a ``TMA_VARIANTS`` shape of the Gluon
    kernel (the default; where it does not apply, the default slab shape runs), an ``ACT_VARIANTS`` shape of the
    Triton slab kernel (one launch, one read of each tile from DRAM) or "tile", one launch of the tile kernel per
    grid (faster than one tile launch writing both, 56 + 87 us against 169 us at 8192^2 bf16: the joint tile's
    registers).
    ``grids=False``: only the storages (the GEMMs' operands; the two grids are returned as None)."""
    _check(x, "input")
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    m, k = x.shape
    mp = math.ceil(m / BLOCK) * BLOCK
    kb = math.ceil(k / BLOCK)
    dev = x.device
    dummy = _DUMMY.get(dev)
    if dummy is None:
        dummy = _DUMMY[dev] = torch.empty(1, dtype=torch.uint8, device=dev)
    rq = torch.empty((mp, k), dtype=torch.uint8, device=dev) if rows else dummy
    rs = torch.empty((kb, mp), dtype=torch.float32, device=dev) if rows else dummy
    cq = torch.empty((k, mp), dtype=torch.uint8, device=dev) if cols else dummy
    cs = torch.empty((mp // BLOCK, k), dtype=torch.float32, device=dev) if cols else dummy
    src, bits = _source(x)
    mod = _module(x)
    vinf = _value_for_inf(x.dtype)
    args = (src, rq, rs, cq, cs, m, k, mp)
    both = CONFIG["act_both"] if rows and cols else "tile"
    tma = both if rows and cols else CONFIG["act_cols"] if cols else ""
    if _tma_ok(x, tma, (mp // BLOCK) * kb, k):
        _tma_act(tma, x, rq, rs, cq, cs, k, mp, rows, vinf, pow2)
    elif both in TMA_VARIANTS:  # (an input the TMA kernels do not take: the default Triton kernel)
        _slab(mod, _TRITON["act_both"], (mp // BLOCK, kb), args, True, vinf, pow2, bits)
    elif both == "tile":  # the rowwise grid by the tile kernel, the columnwise one as act_cols says
        if rows:
            _launch(mod, "act_tile_kernel", (mp // BLOCK, kb), args, CONFIG["act_warps"], ROWS=True, COLS=False,
                    VALUE_FOR_INF=vinf, POW2=bool(pow2), BLOCK=BLOCK, BF16_BITS=bits)
        if cols and CONFIG["act_cols"] == "tile":
            _launch(mod, "act_tile_kernel", (mp // BLOCK, kb), args, CONFIG["act_warps"], ROWS=False, COLS=True,
                    VALUE_FOR_INF=vinf, POW2=bool(pow2), BLOCK=BLOCK, BF16_BITS=bits)
        elif cols:
            cfg = CONFIG["act_cols"]
            _slab(mod, _TRITON["act_cols"] if cfg in TMA_VARIANTS else cfg, (mp // BLOCK, kb), args, False, vinf,
                  pow2, bits)
    else:
        _slab(mod, both, (mp // BLOCK, kb), args, True, vinf, pow2, bits)
    row = col = None
    store_row = store_col = None
    if rows:
        data = rq.view(torch.float8_e4m3fn)
        store_row = NativeOperand(data, rs.t(), m)
        if grids:
            row = FP8BlockTensor(data=data[:m], scale_inv=store_row.scale_inv[:m], block=(1, BLOCK))
    if cols:
        data_t = cq.view(torch.float8_e4m3fn)
        store_col = NativeOperand(data_t, cs.t(), m)
        if grids:
            col = FP8BlockTensor(data=data_t.t()[:m], scale_inv=cs[:math.ceil(m / BLOCK)], block=(BLOCK, 1))
    return row, col, (store_row, store_col)


def _slab(mod, variant: str, grid: tuple, args: tuple, rows: bool, vinf: float, pow2: bool, bits: bool) -> None:
    v = ACT_VARIANTS.get(variant)
    if v is None:
        raise FormatError(f"miles_lp.formats.kernels.fp8_block: CONFIG act_both / act_cols {variant!r} is not "
                          f"'tile' or one of ACT_VARIANTS ({', '.join(ACT_VARIANTS)})")
    _launch(mod, "act_slab_kernel", grid, args, v["warps"], ROWS=rows, VALUE_FOR_INF=vinf, POW2=bool(pow2),
            BLOCK=BLOCK, BF16_BITS=bits, RSLAB=v["RSLAB"], CSLAB=v["CSLAB"], PREFETCH=v["PREFETCH"])


def quantize_weight(w: torch.Tensor, pow2: bool, *, transposed: bool = True, scale_t: bool = False):
    """(128x128 grid of ``w [N, K]``, its data transposed ``[K, N]`` or None), and with ``scale_t`` a third item:
    the scales transposed, stored ``[KB, round_up(ceil(N/128), 4)]`` (the dgrad GEMM's scale_b storage; the
    padding columns are not written), so that no separate copy kernel makes it.

    The kernel writes the transpose for bf16 / fp16 weights; for fp32 weights its transposed store was wrong on the
    H200 (Triton 3.6; the data and scales right), so the transpose of an fp32 weight is a torch copy (``selfcheck``
    covers both)."""
    _check(w, "weight")
    w = w.detach()
    if not w.is_contiguous():
        w = w.contiguous()
    n, k = w.shape
    nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    q = torch.empty((n, k), dtype=torch.uint8, device=w.device)
    in_kernel = transposed and (w.dtype != torch.float32 or not w.is_cuda)
    qt = torch.empty((k, n), dtype=torch.uint8, device=w.device) if in_kernel else q
    s = torch.empty((nb, kb), dtype=torch.float32, device=w.device)
    lt = -(-nb // 4) * 4
    st = torch.empty((kb, lt), dtype=torch.float32, device=w.device) if scale_t else s
    if in_kernel and _tma_ok(w, CONFIG["weight"], nb * kb, k, n):
        v = TMA_VARIANTS[CONFIG["weight"]]
        q8, qt8 = q.view(torch.float8_e4m3fn), qt.view(torch.float8_e4m3fn)
        descs = ((w, (128, 64)), (q8, (128, 64)), (qt8, (64, 128)))
        _launch_tma(_gluon().weight_tma_kernel, _programs(w.device, nb * kb, v["per_sm"]), descs,
                    (s, st if scale_t else _scratch(w.device, kb * lt), k, kb, lt, kb, nb * kb), v["warps"],
                    maxnreg=v["maxnreg"], VALUE_FOR_INF=_value_for_inf(w.dtype), POW2=bool(pow2), STAGES=v["STAGES"],
                    OUT=v["OUT"], LEAN=v["LEAN"], LC16=v["LC16"])
        grid = FP8BlockTensor(data=q8, scale_inv=s, block=(BLOCK, BLOCK))
        return (grid, qt8, st) if scale_t else (grid, qt8)
    src, bits = _source(w)
    _launch(_module(w), "weight_tile_kernel", (nb, kb), (src, q, qt, s, st, n, k, kb, lt), CONFIG["weight_warps"],
            TRANSPOSED=in_kernel, SCALE_T=scale_t,
            VALUE_FOR_INF=_value_for_inf(w.dtype), POW2=bool(pow2), BLOCK=BLOCK, BF16_BITS=bits)
    if transposed and not in_kernel:
        qt = q.t().contiguous()
    grid = FP8BlockTensor(data=q.view(torch.float8_e4m3fn), scale_inv=s, block=(BLOCK, BLOCK))
    qt8 = qt.view(torch.float8_e4m3fn) if transposed else None
    return (grid, qt8, st) if scale_t else (grid, qt8)


def selfcheck(device: str = "cuda", seed: int = 0, variants: bool = True, quick_variants: bool = False) -> list[str]:
    """Every kernel against the codec on random, partial-tile, zero, NaN/inf, tiny and huge inputs, both scale
    rules; returns the failures (empty: byte-identical). ``variants``: also the tile kernel and every
    ``ACT_VARIANTS`` shape, both grids and the columnwise grid alone; ``quick_variants``: those on three of the inputs only (``_QUICK``)
    (fewer compiles: the GPU probe's budget); the kernels as ``CONFIG`` says on every input (weights too)."""
    saved = dict(CONFIG)
    try:
        bad = _selfcheck(device, seed, None, False)  # as configured
        names = ("tile", *ACT_VARIANTS, *(TMA_VARIANTS if device != "cpu" else ())) if variants else ()
        for name in names:
            CONFIG["act_both"] = CONFIG["act_cols"] = name
            CONFIG["weight"] = name if name in TMA_VARIANTS else "tile"
            CONFIG["tma_min_tiles"] = 0  # (the test inputs are small)
            try:
                bad += _selfcheck(device, seed, name, quick_variants)
            except Exception as exc:  # (a launch shape that does not compile here: reported, the others still run)
                bad.append(f"act error {type(exc).__name__}: {str(exc)[:200]} [{name}]")
    finally:
        CONFIG.clear()
        CONFIG.update(saved)
    return bad


# quick_variants: five inputs (a specialization each: 16-divisible shapes / not, bf16 / fp32, both scale rules; on
# CUDA a large one whose tiles outnumber the TMA kernels' programs)
_QUICK = {("special", torch.bfloat16, False), ("special", torch.float32, True), ("randn 130x200", torch.bfloat16, True),
          ("randn 4112x2048", torch.bfloat16, True), ("randn 129x640", torch.bfloat16, False)}


def _selfcheck(device: str, seed: int, variant: str | None, quick: bool) -> list[str]:
    from miles_lp.formats.fp8 import quantize_fp8_blockwise

    g = torch.Generator(device="cpu").manual_seed(seed)
    bad: list[str] = []

    def same(a, b) -> bool:
        return (torch.equal(a.data.view(torch.uint8).cpu(), b.data.view(torch.uint8).cpu())
                and torch.equal(a.scale_inv.cpu().view(torch.int32), b.scale_inv.cpu().view(torch.int32)))

    cases = []
    for m, k in ((256, 384), (200, 256), (1, 128), (129, 640), (130, 200)):
        cases.append((f"randn {m}x{k}", torch.randn(m, k, generator=g) * 3))
    if device != "cpu":  # more tiles than programs: the TMA kernels' stage ring wraps, a partial last row tile
        cases.append(("randn 4112x2048", torch.randn(4112, 2048, generator=g)))
    special = torch.randn(256, 256, generator=g)
    special[0, 5] = float("nan")
    special[3, :] = 0.0
    special[7, 9] = float("inf")
    special[9, 1] = float("-inf")
    special[130:, 128:] = 1e-40
    special[10, 200] = 1e30
    cases.append(("special", special))
    tag = f" [{variant}]" if variant else ""
    for name, x32 in cases:
        for dtype in (torch.bfloat16, torch.float32):
            x = x32.to(dtype).to(device)
            for pow2 in (False, True):
                if quick and (name, dtype, pow2) not in _QUICK:
                    continue
                row, col, (sr, sc) = quantize_act(x, pow2, rows=True, cols=True)
                m = x.shape[0]
                if sr.data[m:].view(torch.uint8).any() or sc.data[:, m:].view(torch.uint8).any() or not bool(
                        (sr.scale_inv[m:] == 1).all()):
                    bad.append(f"act padding rows {name} {dtype} pow2={pow2}{tag}")
                ref_col = quantize_fp8_blockwise(x, (BLOCK, 1), pow2)
                if not same(row, quantize_fp8_blockwise(x, (1, BLOCK), pow2)):
                    bad.append(f"act rows {name} {dtype} pow2={pow2}{tag}")
                if not same(col, ref_col):
                    bad.append(f"act cols {name} {dtype} pow2={pow2}{tag}")
                _, col_only, (_, st) = quantize_act(x, pow2, rows=False, cols=True)
                if not same(col_only, ref_col) or st.data[:, m:].view(torch.uint8).any():
                    bad.append(f"act cols only {name} {dtype} pow2={pow2}{tag}")
                if variant is not None and variant not in TMA_VARIANTS:
                    continue  # the Triton weight kernel has no variants
                wq, wt, st = quantize_weight(x, pow2, scale_t=True)
                ref = quantize_fp8_blockwise(x, (BLOCK, BLOCK), pow2)
                nb = ref.scale_inv.shape[0]
                if not same(wq, ref) or not torch.equal(wt.view(torch.uint8).cpu(),
                                                         ref.data.view(torch.uint8).t().cpu()):
                    bad.append(f"weight {name} {dtype} pow2={pow2}{tag}")
                if not torch.equal(st[:, :nb].cpu().view(torch.int32), ref.scale_inv.t().cpu().view(torch.int32)):
                    bad.append(f"weight scale_t {name} {dtype} pow2={pow2}{tag}")
    return bad
