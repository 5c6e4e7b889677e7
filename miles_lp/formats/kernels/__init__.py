"""Triton kernels for the MXFP8 / NVFP4 codecs on CUDA, byte-identical to the reference (``miles_lp.formats``).

The reference codecs stay the CPU path and the oracle; these kernels are what the codecs
(``quantize_mxfp8`` / ``quantize_nvfp4``) and ``miles_lp.train.fused`` select for CUDA tensors when Triton
imports (``enabled(x)``). Calling a kernel entry point directly where it cannot run raises
``BackendUnavailable`` naming what is missing. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors
through Triton's interpreter (slow; the CPU tests use it).

Entry points (inputs validated with the codecs' own messages; no host synchronisation on the hot paths,
so they can be captured in a CUDA graph, except where a caller passes a Python/CPU ``amax``):

* ``mxfp8_quantize(x, rowwise=True, colwise=False, dequant_dtype=None, swizzle=False)`` -> ``MXFP8Result``:
  both grids from ONE read of ``x`` (one launch), optionally their dequantized copies (the emulated GEMM
  operands) and the cuBLAS 128x4 swizzled scales;
* ``mxfp8_dequantize(q, dtype)``; ``quantize_mxfp8(x, axis)`` (the codec hook);
* ``nvfp4_quantize(x, scope, amax=None, block_2d=False, dequant_dtype=None)`` -> ``(NVFP4Tensor, deq)``:
  scope "tensor" = an amax pass + a quantize pass (two launches and a memset; one launch when ``amax`` is
  given), scope "row" = one launch (each program takes whole rows: amax, then quantize from cache);
  ``block_2d`` = 16x16 tiles (weights);
* ``nvfp4_dequantize(q, dtype)``, ``nvfp4_amax(x)``; ``quantize_nvfp4(...)`` (the codec hook).

Bound launches (``kernels.bound``, for hot paths that repeat one call per input shape: QuantLinear's
``miles_lp.train.launch``): after an entry-point call, ``bind_mxfp8_quantize`` / ``bind_mxfp8_dequantize`` /
``bind_nvfp4_quantize`` / ``bind_nvfp4_dequantize`` with the same arguments return a ``Binding`` whose
``launch(*args)`` calls the compiled kernel's C launcher directly (same kernel, same bytes), or None where that
is not possible (CPU, a launch hook, ``MILES_LP_KERNELS_FAST_LAUNCH=0``, a changed kernel signature, ...).

``MILES_LP_KERNELS=reference`` turns the automatic selection off (the codecs then run their torch code on
CUDA too), e.g. to time or compare the reference there.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import dataclass

import torch

from miles_lp.errors import BackendUnavailable
from miles_lp.formats._checks import check_input, check_multiple
from miles_lp.formats.kernels.tuning import CONFIG  # the launch shapes, one dict (tuned in place by --sweep)
from miles_lp.formats.mxfp8 import MXFP8Tensor
from miles_lp.formats.nvfp4 import NVFP4Tensor
from miles_lp.formats.spec import MXFP8_BLOCK, NVFP4_BLOCK

__all__ = [
    "MXFP8Result", "enabled", "unavailable_reason", "mxfp8_quantize", "mxfp8_dequantize", "quantize_mxfp8",
    "nvfp4_quantize", "nvfp4_dequantize", "nvfp4_amax", "matrix_amax", "quantize_nvfp4", "CONFIG",
    "launch_hooks_set", "Binding", "BoundLaunch", "bind_mxfp8_quantize", "bind_mxfp8_dequantize",
    "bind_nvfp4_quantize", "bind_nvfp4_dequantize",
]

_OUT_KIND = {None: 0, torch.float32: 1, torch.bfloat16: 2}
# Launch path: after a kernel's first launch for a specialization (dtypes, 16-byte alignment of pointers,
# ints equal to 1 / multiples of 16: what Triton specializes on, plus every constexpr and num_warps), later
# launches call the compiled kernel's launcher directly and skip Triton's per-call binding, cache-key and
# option formatting (host time per launch: bench quantize "small shape"). MILES_LP_KERNELS_FAST_LAUNCH=0
# keeps Triton's JIT dispatch on every call (for A/B timing); so does a Triton launch hook (profilers).
_FAST_LAUNCH = os.environ.get("MILES_LP_KERNELS_FAST_LAUNCH", "1") != "0"
_LAUNCHERS: dict[tuple, object] = {}
_MODULES: dict[bool, object] = {}
_LOCK = threading.Lock()
_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_triton.py")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_TRITON: list[str | None] = []  # [reason or None], filled on first use


def _triton_missing() -> str | None:
    if not _TRITON:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            return f"Triton is not importable ({exc}); install triton (pip install triton) or use the reference codecs"
        _TRITON.append(None)
    return _TRITON[0]


def unavailable_reason(x: torch.Tensor) -> str | None:
    """Why the kernels cannot run on ``x`` here (None: they can)."""
    missing = _triton_missing()
    if missing:
        return missing
    if x.is_cuda:
        return None
    if x.device.type == "cpu" and _interpreting():
        return None
    return (f"the Triton kernels run on CUDA tensors; this one is on {x.device} (no CUDA device is used here). "
            "Use the reference codecs (miles_lp.formats.quantize_mxfp8 / quantize_nvfp4) on CPU, or set "
            "TRITON_INTERPRET=1 to run the kernels in Triton's (slow) interpreter")


def enabled(x: torch.Tensor) -> bool:
    """Whether the codecs should hand ``x`` to these kernels: a CUDA tensor, Triton importable, and
    ``MILES_LP_KERNELS`` not set to ``reference``."""
    if not x.is_cuda or os.environ.get("MILES_LP_KERNELS", "auto") == "reference":
        return False
    return _triton_missing() is None


def _module(x: torch.Tensor):
    reason = unavailable_reason(x)
    if reason:
        raise BackendUnavailable(f"miles_lp.formats.kernels: {reason}")
    interp = not x.is_cuda
    mod = _MODULES.get(interp)
    if mod is None:
        with _LOCK:
            mod = _MODULES.get(interp)
            if mod is None:
                mod = _load(interp)
                _MODULES[interp] = mod
    return mod


def _load(interpret: bool):
    """Import ``_triton.py`` with @triton.jit in the requested mode (Triton decides at decoration time)."""
    return load_jit_module(_PATH, "miles_lp.formats.kernels._triton", interpret)


def load_jit_module(path, name: str, interpret: bool):
    """Import the Triton source file ``path`` as module ``name`` (``_interpreted`` appended under the
    interpreter), its @triton.jit kernels compiled (``interpret=False``) or interpreted, whatever
    ``TRITON_INTERPRET`` says now: Triton reads that variable when a kernel is decorated, so each mode is its own
    module. Shared with ``miles_lp.sync.kernels``."""
    name = name + ("_interpreted" if interpret else "")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


def _spec(args: tuple) -> tuple:
    """What Triton specializes the runtime arguments on (so one cached launcher never serves another variant):
    a tensor's dtype and whether its pointer is 16-byte aligned; an int's being 1, a multiple of 16, 64-bit.
    One flat tuple, built without a per-argument function call (this is on every launch's path)."""
    return tuple((a.dtype, not a.data_ptr() & 15) if type(a) is torch.Tensor
                 else (a == 1, not a & 15, -2147483648 <= a < 2147483648) if type(a) is int
                 else (type(a).__name__, a) for a in args)


_SITES: dict[tuple, tuple] = {}  # plan key -> (compiled kernel, constexpr values): skips _spec on the hot path


def _launch(mod, name: str, grid: tuple, args: tuple, num_warps: int, site: tuple | None = None,
            maxnreg: int = 0, **consts) -> None:
    """``mod.<name>[grid](*args, **consts, num_warps=num_warps)``, through the cached launcher when it can.

    ``args`` are the kernel's runtime parameters in signature order and ``consts`` its constexprs (which
    follow them in every kernel of ``_triton.py``). ``site``: a key the caller guarantees to determine the
    launch's whole specialization (a plan key: shapes, dtypes, pointer alignment of every argument not
    freshly allocated); then the launcher is looked up by it directly, without ``_spec(args)``.
    ``maxnreg`` > 0: ptxas' register cap per thread (more programs resident per SM; CUDA only).
    """
    if site is not None and _FAST_LAUNCH:
        ent = _SITES.get(site)
        if ent is not None and not launch_hooks_set():
            ck, const_vals = ent
            g = (*grid, 1, 1)
            ck.run(g[0], g[1], g[2], _stream(args[0].device.index), ck.function, ck.packed_metadata, None, None,
                   None, *args, *const_vals)
            return
    fn = getattr(mod, name)
    opts = {"num_warps": num_warps}
    if maxnreg and args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
        opts["maxnreg"] = maxnreg
    if not _FAST_LAUNCH or not args or not isinstance(args[0], torch.Tensor) or not args[0].is_cuda:
        fn[grid](*args, **consts, **opts)
        return
    if launch_hooks_set():
        fn[grid](*args, **consts, **opts)
        return
    dev = args[0].device.index
    key = (name, dev, num_warps, maxnreg, tuple(consts.items()), _spec(args))
    ent = _LAUNCHERS.get(key)
    if ent is not None and site is not None:
        _SITES[site] = ent
    if ent is None:
        ck = fn[grid](*args, **consts, **opts)  # compiles (first time) and launches
        if hasattr(ck, "result"):
            ck = ck.result()
        rest = fn.arg_names[len(args):]
        if len(fn.arg_names) != len(args) + len(consts) or set(rest) != set(consts) or not hasattr(ck, "run"):
            return  # not the layout this path assumes: this key stays on the JIT path (no entry cached)
        _LAUNCHERS[key] = (ck, tuple(consts[n] for n in rest))
        if site is not None:
            _SITES[site] = _LAUNCHERS[key]
        return
    ck, const_vals = ent
    g = (*grid, 1, 1)
    ck.run(g[0], g[1], g[2], _stream(dev), ck.function, ck.packed_metadata, None, None, None, *args, *const_vals)


_KNOBS: list = []


def launch_hooks_set() -> bool:
    """Whether a Triton launch hook is installed (a profiler's): then every launch goes through the JIT,
    which calls it (and a ``Binding``'s holder takes the entry point instead). Triton 3.6 keeps the hooks as
    (possibly empty) ``HookChain``s, older ones None or a function."""
    if not _KNOBS:
        from triton import knobs

        _KNOBS.append(knobs.runtime)
    rt = _KNOBS[0]
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        calls = getattr(h, "calls", None)
        if (bool(calls) if calls is not None else h is not None):
            return True
    return False


def _stream(dev: int) -> int:
    """The current CUDA stream's handle (what Triton's own launch passes; a graph capture's stream too)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(dev) if raw is not None else torch.cuda.current_stream(dev).cuda_stream


def _input(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor the kernel reads, IN_KIND): bf16 as its int16 bits, fp32 / fp16 as they are."""
    if not x.is_contiguous():  # (the check is cheaper than a contiguous() call on the hot path)
        x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return (x.detach() if x.requires_grad else x).view(torch.int16), 1
    return x, 0  # the launch reads only its data pointer


_PLANS: dict[tuple, object] = {}  # entry point + everything its launch depends on -> the validated plan


_MAX_PLANS = 4096  # token counts vary per micro-batch: bound the per-shape caches (cleared when full)


def _plan_key(x: torch.Tensor, *flags) -> tuple:
    """What an entry point's validation, output shapes and launch depend on: the input's shape, dtype,
    device, 16-byte alignment, contiguity and the call's flags (the launch shapes in CONFIG among them)."""
    if len(_PLANS) > _MAX_PLANS:
        _PLANS.clear()
        _SITES.clear()
    return (x.shape, x.dtype, x.device, x.data_ptr() & 15, x.is_contiguous(), *flags)


_EMPTY: dict[torch.device, torch.Tensor] = {}


def _none(dev: torch.device) -> torch.Tensor:
    """The placeholder for an output a launch does not write (one 0-element tensor per device, reused)."""
    t = _EMPTY.get(dev)
    if t is None:
        t = _EMPTY[dev] = torch.empty(0, dtype=torch.uint8, device=dev)
    return t


def _out_kind(dtype: torch.dtype | None, what: str) -> int:
    if dtype not in _OUT_KIND:
        raise BackendUnavailable(f"miles_lp.formats.kernels: {what} in {dtype} is not a kernel output; the "
                                 "kernels write float32 or bfloat16 (use .dequantize(dtype) for others)")
    return _OUT_KIND[dtype]


def _out(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.int16 if dtype == torch.bfloat16 else dtype, device=device)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.view(dtype) if t.dtype != dtype else t


def _ru(n: int, m: int) -> int:
    return (n + m - 1) // m * m


# ---------------------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class MXFP8Result:
    """What one ``mxfp8_quantize`` pass wrote (None where not asked for).

    ``row`` / ``col``: the rowwise (axis -1) / columnwise (axis -2) ``MXFP8Tensor``; ``row_deq`` /
    ``col_deq``: their dequantization in ``dequant_dtype``; ``row_swizzled``: the rowwise scale in the cuBLAS
    128x4 layout, ``[..., ru(M,128), ru(K/32,4)]`` (= ``swizzle_scales(row.scale)``); ``col_swizzled``: the
    columnwise scale of the transposed operand, ``[..., ru(K,128), ru(M/32,4)]``
    (= ``swizzle_scales(col.scale.transpose(-1, -2))``).
    """

    row: MXFP8Tensor | None = None
    col: MXFP8Tensor | None = None
    row_deq: torch.Tensor | None = None
    col_deq: torch.Tensor | None = None
    row_swizzled: torch.Tensor | None = None
    col_swizzled: torch.Tensor | None = None


def mxfp8_quantize(x: torch.Tensor, *, rowwise: bool = True, colwise: bool = False,
                   dequant_dtype: torch.dtype | None = None, dequant: tuple[str, ...] = ("row", "col"),
                   swizzle: bool = False, name: str | None = None, store_q: bool = True) -> MXFP8Result:
    """MXFP8 (TE's rule, CONTRACT 1) of ``x`` [..., M, K]: the rowwise and/or columnwise grids in one launch.

    ``dequant_dtype`` (fp32 / bf16): also write the decode of the grids named in ``dequant``.
    ``store_q=False``: write only the decodes (and the swizzled scales if asked), not the E4M3 data and compact
    scales (``row`` / ``col`` are then None): for callers that use only the decoded operand (no allocation,
    1.03 bytes per element and grid fewer written). The plan key's tag is then ``"mx-dq"``.
    Same checks and messages as ``quantize_mxfp8`` (K a multiple of 32; M too for ``colwise``).
    The checks, output shapes and launch parameters are worked out once per input shape / dtype / flags
    (``_PLANS``); a repeat call allocates its outputs and launches (QuantLinear's per-call host time).
    """
    cfg = CONFIG["mxfp8_both" if (rowwise and colwise) else "mxfp8" if rowwise else "mxfp8_col"]
    if not isinstance(x, torch.Tensor):
        check_input(x, "MXFP8", min_dim=1, name=name)
    key = _plan_key(x, "mx" if store_q else "mx-dq", rowwise, colwise, dequant_dtype, dequant, swizzle, *cfg.items())
    plan = _PLANS.get(key)
    if plan is None:
        plan = _mxfp8_plan(x, rowwise, colwise, dequant_dtype, dequant, swizzle, name, cfg, store_q)
        _PLANS[key] = plan
    mod = _module(x)
    xi, _ = _input(x)
    dev = x.device
    empty = _none(dev)
    (qr_s, sr_s, qc_s, sc_s, dr_s, dc_s, wr_s, wc_s), out_dt = plan["shapes"], plan["out_dtype"]
    u8 = torch.uint8
    qr = torch.empty(qr_s, dtype=u8, device=dev) if qr_s else empty
    sr = torch.empty(sr_s, dtype=u8, device=dev) if sr_s else empty
    qc = torch.empty(qc_s, dtype=u8, device=dev) if qc_s else empty
    sc = torch.empty(sc_s, dtype=u8, device=dev) if sc_s else empty
    dr = torch.empty(dr_s, dtype=out_dt, device=dev) if dr_s else empty
    dc = torch.empty(dc_s, dtype=out_dt, device=dev) if dc_s else empty
    wr = torch.zeros(wr_s, dtype=u8, device=dev) if wr_s else empty
    wc = torch.zeros(wc_s, dtype=u8, device=dev) if wc_s else empty
    r, k, m = plan["rkm"]
    _launch(mod, "mxfp8_quantize_kernel", plan["grid"], (xi, r, k, m, qr, sr, dr, wr, qc, sc, dc, wc),
            plan["warps"], site=key, maxnreg=plan["maxnreg"], **plan["consts"])
    e4m3 = torch.float8_e4m3fn
    return MXFP8Result(
        row=MXFP8Tensor(data=qr.view(e4m3), scale=sr, axis=-1) if qr_s else None,
        col=MXFP8Tensor(data=qc.view(e4m3), scale=sc, axis=-2) if qc_s else None,
        row_deq=_as(dr, dequant_dtype) if dr_s else None,
        col_deq=_as(dc, dequant_dtype) if dc_s else None,
        row_swizzled=wr if wr_s else None,
        col_swizzled=wc if wc_s else None,
    )


def _mxfp8_plan(x, rowwise: bool, colwise: bool, dequant_dtype, dequant, swizzle: bool, name, cfg,
                store_q: bool = True) -> dict:
    """``mxfp8_quantize``'s checks (same messages as the codec) and everything its launch needs."""
    check_input(x, "MXFP8", min_dim=2 if colwise else 1, name=name)
    if not (rowwise or colwise):
        raise BackendUnavailable("mxfp8_quantize: ask for rowwise and/or colwise")
    if not store_q and (dequant_dtype is None or not any(
            (g == "row" and rowwise) or (g == "col" and colwise) for g in dequant)):
        raise BackendUnavailable("mxfp8_quantize(store_q=False) writes only decodes: give dequant_dtype and name "
                                 "an asked-for grid in dequant (or keep store_q=True)")
    check_multiple(x, "MXFP8", -1, MXFP8_BLOCK, name=name, axis_label="axis=-1 (rowwise 32-blocks)")
    if colwise:
        check_multiple(x, "MXFP8", -2, MXFP8_BLOCK, name=name, axis_label="axis=-2 (columnwise 32-blocks)")
    _module(x)  # the availability refusal, before any allocation
    out_kind = _out_kind(dequant_dtype, "the dequantized operand")
    in_kind = 1 if x.dtype == torch.bfloat16 else 0
    shape = tuple(x.shape)
    k = shape[-1]
    r = x.numel() // k
    m = shape[-2] if x.dim() >= 2 else 1
    lead = shape[:-2]
    mats = r // m
    dq_row, dq_col = rowwise and out_kind > 0 and "row" in dequant, colwise and out_kind > 0 and "col" in dequant
    qrow, qcol = rowwise and store_q, colwise and store_q
    shapes = (shape if qrow else None, (*shape[:-1], k // MXFP8_BLOCK) if qrow else None,
              shape if qcol else None, (*lead, m // MXFP8_BLOCK, k) if qcol else None,
              shape if dq_row else None, shape if dq_col else None,
              (*lead, _ru(m, 128), _ru(k // MXFP8_BLOCK, 4)) if swizzle and rowwise else None,
              (*lead, _ru(k, 128), _ru(m // MXFP8_BLOCK, 4)) if swizzle and colwise else None)
    bmb, nb = cfg["BMB"], cfg["NB"]
    if colwise and m % (32 * bmb):
        bmb = 1  # a tile must not straddle two matrices' column blocks (M is a multiple of 32)
    return {"shapes": shapes, "out_dtype": torch.int16 if dequant_dtype == torch.bfloat16 else dequant_dtype,
            "rkm": (r, k, m), "grid": (triton_cdiv(r, 32 * bmb), triton_cdiv(k, 32 * nb)), "warps": cfg["num_warps"],
            # the register cap only without the decode outputs (those forms hold ~255 registers: a cap spills)
            # and without swizzled scales (that form keeps the 12-01c launch, below)
            "maxnreg": 0 if (dq_row or dq_col or swizzle) else cfg.get("maxnreg", 0),
            "consts": dict(IN_KIND=in_kind, ROW=rowwise, COL=colwise, OUT_KIND=out_kind, DQ_ROW=dq_row,
                           DQ_COL=dq_col, SWZ=bool(swizzle) and mats >= 1, BMB=bmb, NB=nb,
                           # swizzled scales: the 12-01c launch (STV 0, masks) unless STV_swz / FULL_swz say
                           # otherwise: row + col + swizzle with STV 16 measured 0.189 ms against 0.172 (12-01d run 1
                           # vs 12-01c run 3)
                           EVICT=cfg.get("EVICT", 0), STV=cfg.get("STV_swz", 0) if swizzle else cfg.get("STV", 0),
                           STQ=int(store_q),
                           # no masks where the tiles cover x exactly (R, K multiples of the tile)
                           FULL=int(bool(cfg.get("FULL_swz", 0) if swizzle else cfg.get("FULL", 1))
                                    and r % (32 * bmb) == 0 and k % (32 * nb) == 0))}


def quantize_mxfp8(x: torch.Tensor, axis: int = -1, name: str | None = None) -> MXFP8Tensor:
    """The codec hook: ``quantize_mxfp8(x, axis=axis)`` through the kernel (axis already normalised)."""
    res = mxfp8_quantize(x, rowwise=axis == -1, colwise=axis == -2, name=name)
    return res.row if axis == -1 else res.col


def mxfp8_dequantize(q: MXFP8Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q.dequantize(dtype)`` in one launch (fp32 / bf16)."""
    data, scale = q.data, q.scale
    cfg = CONFIG["mxfp8_dq"]
    key = (*_plan_key(data, "mxdq", q.axis, dtype, *cfg.values()), scale.shape, scale.data_ptr() & 15,
           scale.is_contiguous())
    plan = _PLANS.get(key)
    if plan is None:
        _module(data)
        out_kind = _out_kind(dtype, "MXFP8 dequantize")
        k = data.shape[-1]
        r = data.numel() // k
        plan = _PLANS[key] = {"rk": (r, k), "grid": (triton_cdiv(r, 32 * cfg["BMB"]), triton_cdiv(k, 32 * cfg["NB"])),
                              "consts": dict(COLWISE=q.axis == -2, OUT_KIND=out_kind, BMB=cfg["BMB"], NB=cfg["NB"])}
    mod = _module(data)
    if not data.is_contiguous():
        data = data.contiguous()
    if not scale.is_contiguous():
        scale = scale.contiguous()
    out = _out(data.shape, dtype, data.device)
    r, k = plan["rk"]
    _launch(mod, "mxfp8_dequantize_kernel", plan["grid"], (data.view(torch.uint8), scale, out, r, k),
            cfg["num_warps"], site=key, **plan["consts"])
    return _as(out, dtype)


# ---------------------------------------------------------------------------------------------------------
# NVFP4
# ---------------------------------------------------------------------------------------------------------
def _amax_launch(mod, xi, in_kind: int, mats: int, m: int, k: int, per_row: bool, site: tuple | None = None
                 ) -> torch.Tensor:
    cfg = CONFIG["amax"]
    if per_row:
        out = torch.empty(mats * m, dtype=torch.float32, device=xi.device)
    else:
        out = _zeros_i32(mats, xi.device)  # fp32 bits; atomic max from 0
    grid = (triton_cdiv(m, cfg["BM"]), mats)
    _launch(mod, "amax_kernel", grid, (xi, m, k, out), cfg["num_warps"], site=site and ("amax", *site),
            PER_ROW=per_row, IN_KIND=in_kind,
            BM=cfg["BM"], BK=cfg["BK"], K_ITERS=triton_cdiv(k, cfg["BK"]))
    return out if per_row else out.view(torch.float32)


_ZERO_POOLS: dict[tuple, list] = {}  # (device, stream) -> [int32 zeros, next free offset]
_ZERO_POOLS_LOCK = threading.Lock()
_POOL_INTS = 1 << 16


def _zeros_i32(n: int, dev: torch.device) -> torch.Tensor:
    """``n`` int32 zeros (the per-matrix amax's atomic-max start) as a slice of a pool zeroed once per 65536
    ints, instead of a ``torch.zeros`` per call (an allocation and a fill launch: 33-54 us of host on the
    H200 host of 12-01d). Each slice is handed out once (the caller keeps it as the amax); a full pool is
    replaced, the old one freed when its last slice is. Pools are per stream (the fill is ordered before
    every use on the stream it ran on); during CUDA-graph capture ``torch.zeros`` is used, so that each replay
    zeroes its accumulator again."""
    if n > _POOL_INTS // 16 or (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.zeros(n, dtype=torch.int32, device=dev)
    key = (dev, _stream(dev.index) if dev.type == "cuda" else None)
    with _ZERO_POOLS_LOCK:  # two threads on one stream must not be handed the same slice
        ent = _ZERO_POOLS.get(key)
        if ent is None or ent[1] + n > _POOL_INTS:
            ent = _ZERO_POOLS[key] = [torch.zeros(_POOL_INTS, dtype=torch.int32, device=dev), 0]
        off = ent[1]
        ent[1] = off + n
        pool = ent[0]
    return pool[off:off + n]


def matrix_amax(x: torch.Tensor) -> torch.Tensor:
    """NaN-ignoring amax per 2-D matrix of ``x`` [..., M, K]: fp32 ``[..., 1, 1]`` (one launch and a memset)."""
    check_input(x, "NVFP4", min_dim=2)
    mod = _module(x)
    xi, in_kind = _input(x)
    m, k = x.shape[-2], x.shape[-1]
    return _amax_launch(mod, xi, in_kind, x.numel() // (m * k), m, k, per_row=False).view(*x.shape[:-2], 1, 1)


def nvfp4_amax(x: torch.Tensor) -> torch.Tensor:
    """``matrix_amax`` shaped like ``nvfp4_global_amax``: 0-d for 2-D ``x``, ``[..., 1, 1]`` for stacks."""
    a = matrix_amax(x)
    return a.reshape(()) if x.dim() == 2 else a


def nvfp4_quantize(x: torch.Tensor, scope: str = "tensor", *, amax: torch.Tensor | None = None,
                   block_2d: bool = False, dequant_dtype: torch.dtype | None = None,
                   name: str | None = None) -> tuple[NVFP4Tensor, torch.Tensor | None]:
    """NVFP4 (TE's rule, CONTRACT 2) of ``x`` [..., M, K] and optionally its dequantization.

    ``amax``: None (computed, NaN ignored) or an fp32 tensor already of the global-scale shape
    (``nvfp4.broadcast_nvfp4_amax``: ``[..., 1, 1]`` for "tensor", ``[..., M, 1]`` for "row"; this function
    does not read its values, so it stays free of host syncs). Checks and launch parameters are worked out
    once per input shape / dtype / flags (``_PLANS``), as in ``mxfp8_quantize``.
    """
    from miles_lp.formats.nvfp4 import _check_nvfp4

    if not isinstance(x, torch.Tensor):
        _check_nvfp4(x, scope, block_2d, name)
    given = amax is not None
    cfgs = (CONFIG["nvfp4_pairs"], CONFIG["nvfp4_rows"], CONFIG["nvfp4_rows_reg"], CONFIG["nvfp4_2d"],
            CONFIG["nvfp4"], CONFIG["amax"], CONFIG["nvfp4_persist"])
    key = _plan_key(x, "nv", scope, given, block_2d, dequant_dtype, *(tuple(c.items()) for c in cfgs))
    plan = _PLANS.get(key)
    if plan is None:
        _check_nvfp4(x, scope, block_2d, name)
        plan = _PLANS[key] = _nvfp4_plan(x, scope, given, block_2d, dequant_dtype)
    mod = _module(x)
    xi, in_kind = _input(x)
    dev = x.device
    out_kind = plan["out_kind"]
    q = torch.empty(plan["q"], dtype=torch.uint8, device=dev)
    s = torch.empty(plan["s"], dtype=torch.uint8, device=dev)
    gs = torch.empty(plan["gs"], dtype=torch.float32, device=dev)
    d = _out(plan["shape"], dequant_dtype, dev) if out_kind else _none(dev)
    m, k, mats = plan["mkm"]
    path = plan["path"]
    if path == "tile":
        if given:
            amax_flat = amax.to(device=dev, dtype=torch.float32).contiguous().reshape(-1)
            site = None  # the caller's amax: its alignment is not in the plan key
        else:
            amax_flat = _amax_launch(mod, xi, in_kind, mats, m, k, per_row=False, site=key)
            site = key
        _launch(mod, "nvfp4_quantize_kernel", plan["grid"], (xi, m, k, amax_flat, q, s, gs, d), plan["warps"],
                site=site, **plan["consts"])
    else:
        amax_flat = torch.empty(mats * m, dtype=torch.float32, device=dev)
        if path == "pairs":
            d32 = d.view(torch.int32) if out_kind else d
            args = (xi.view(torch.int32), m, k // 2, amax_flat, q, s, gs, d32)
            if "persist" in plan:
                nprog = plan["grid"][0]
                args = (xi.view(torch.int32), mats * m, k // 2, nprog, triton_cdiv(mats * m, nprog), *args[3:])
            _launch(mod, plan.get("persist", "nvfp4_rows_pairs_kernel"), plan["grid"], args, plan["warps"],
                    site=key, maxnreg=plan["maxnreg"], **plan["consts"],
                    **({"ITERS_C": args[4]} if "persist" in plan and not x.is_cuda else {}))
        else:
            _launch(mod, "nvfp4_quantize_rows_kernel", plan["grid"], (xi, m, k, amax_flat, q, s, gs, d),
                    plan["warps"], site=key, **plan["consts"])
    gshape = plan["gshape"]
    qt = NVFP4Tensor(data=q, scale=s.view(torch.float8_e4m3fn), global_scale=gs.view(gshape),
                     amax=amax_flat.view(gshape), logical_shape=plan["shape"], scale_scope=scope, block_2d=block_2d)
    return qt, (_as(d, dequant_dtype) if out_kind else None)


def _has_bf16x2_max(dev: torch.device) -> bool:
    """``max.xorsign.abs.bf16x2`` (the ENC 1 amax tree) needs sm_86+ (PTX ISA); older GPUs (A100: sm_80) get the
    ENC 0 form, the same bytes. True for the interpreter's CPU tensors."""
    return dev.type != "cuda" or torch.cuda.get_device_capability(dev) >= (8, 6)


def _sm_count(dev: torch.device) -> int:
    """Streaming multiprocessors of ``dev`` (a persistent grid's unit); 4 for the interpreter's CPU tensors."""
    if dev.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _nvfp4_plan(x, scope: str, given: bool, block_2d: bool, dequant_dtype) -> dict:
    """``nvfp4_quantize``'s kernel choice and launch parameters for one input shape / dtype / flags.

    Per-token bf16 rows (no amax given, no decode or a bf16 one, a row that fits the registers, 4-byte
    aligned: read as int32 pairs) take ``nvfp4_rows_pairs_kernel``; other per-token calls the general
    one-pass kernel; per-tensor scope (and a given amax) the tile kernel, after an amax pass if needed."""
    _module(x)  # the availability refusal
    out_kind = _out_kind(dequant_dtype, "the dequantized operand")
    in_kind = 1 if x.dtype == torch.bfloat16 else 0
    shape = tuple(x.shape)
    m, k = shape[-2], shape[-1]
    lead = shape[:-2]
    mats = x.numel() // (m * k)
    per_row = scope == "row"
    plan = {"shape": shape, "q": (*shape[:-1], k // 2), "s": (*shape[:-1], k // NVFP4_BLOCK),
            "gs": mats * m if per_row else mats, "out_kind": out_kind, "mkm": (m, k, mats),
            "gshape": (*shape[:-1], 1) if per_row else (() if x.dim() == 2 else (*lead, 1, 1))}
    reg = CONFIG["nvfp4_rows_reg"]
    pairs = CONFIG["nvfp4_pairs"]
    aligned4 = not x.data_ptr() & 3 or not x.is_contiguous()  # (a contiguous() copy is aligned)
    if (per_row and not given and in_kind == 1 and out_kind in (0, 2) and k <= reg["max_k"] and pairs["enabled"]
            and aligned4):
        nb = triton_next_pow2(k // NVFP4_BLOCK)
        ept, rs = (pairs["el_per_thread_dq"], pairs["RS_dq"]) if out_kind else (pairs["el_per_thread"], pairs["RS"])
        plan.update(path="pairs", grid=(triton_cdiv(m, rs), mats),
                    warps=max(1, min(16, nb * NVFP4_BLOCK // (32 * ept))),
                    consts=dict(DQ=bool(out_kind), NB=nb, RS=rs, EVICT=pairs.get("EVICT", 0),
                                ENC=pairs.get("ENC_dq" if out_kind else "ENC", 0) if _has_bf16x2_max(x.device) else 0,
                                FULL=int(rs == 1 and k == nb * NVFP4_BLOCK and pairs.get("FULL", 1))),
                    maxnreg=pairs.get("maxnreg_dq" if out_kind else "maxnreg", 0))
        per = CONFIG["nvfp4_persist"]
        sfx = "_dq" if out_kind else ""
        pps = per.get("pps" + sfx, 0)
        if pps:  # a persistent grid over the flat rows (per-token: no matrix boundary inside a row)
            nprog = max(1, min(mats * m, _sm_count(x.device) * pps))
            plan.update(persist="nvfp4_rows_persist_kernel", grid=(nprog,),
                        maxnreg=per.get("maxnreg" + sfx, plan["maxnreg"]),
                        consts=dict(DQ=bool(out_kind), NB=nb, STAGES=per.get("STAGES" + sfx, 2),
                                    PF=per.get("PF" + sfx, 0), EVICT=pairs.get("EVICT", 0)))
    elif per_row and not given:
        cfg = CONFIG["nvfp4_rows"]
        rows, nb, warps = cfg["ROWS"], cfg["NB"], cfg["num_warps"]
        if k <= reg["max_k"]:  # a whole row in registers: one read (K_ITERS == 1)
            rows, nb = 1, triton_next_pow2(k // NVFP4_BLOCK)
            ept = reg.get("el_per_thread_dq", reg["el_per_thread"]) if out_kind else reg["el_per_thread"]
            warps = max(1, min(16, nb * NVFP4_BLOCK // (32 * ept)))
        plan.update(path="rows", grid=(triton_cdiv(m, rows), mats), warps=warps,
                    consts=dict(IN_KIND=in_kind, OUT_KIND=out_kind, ROWS=rows, NB=nb, K_ITERS=triton_cdiv(k, 16 * nb)))
    else:
        cfg = CONFIG["nvfp4_2d" if block_2d else "nvfp4"]
        tb = 16 if block_2d else 1
        plan.update(path="tile", grid=(triton_cdiv(m, cfg["TA"] * tb), triton_cdiv(k, 16 * cfg["NB"]), mats),
                    warps=cfg["num_warps"], consts=dict(IN_KIND=in_kind, SCOPE=1 if per_row else 0,
                                                        OUT_KIND=out_kind, TA=cfg["TA"], TB=tb, NB=cfg["NB"]))
    return plan


def quantize_nvfp4(x: torch.Tensor, scale_scope: str = "tensor", amax: torch.Tensor | None = None,
                   block_2d: bool = False, name: str | None = None) -> NVFP4Tensor:
    """The codec hook: ``quantize_nvfp4(...)`` through the kernels (``amax`` already broadcast)."""
    return nvfp4_quantize(x, scale_scope, amax=amax, block_2d=block_2d, name=name)[0]


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q.dequantize(dtype)`` in one launch (fp32 / bf16)."""
    mod = _module(q.data)
    out_kind = _out_kind(dtype, "NVFP4 dequantize")
    shape = tuple(q.shape)
    m, k = shape[-2], shape[-1]
    mats = q.data.numel() * 2 // (m * k)
    gs = q.global_scale
    if gs.dtype != torch.float32 or not gs.is_contiguous():
        gs = gs.to(torch.float32).contiguous()
    gs = gs.reshape(-1)
    per_row = gs.numel() == mats * m and q.scale_scope == "row"
    if not per_row and gs.numel() != mats:
        gs = q.global_scale.to(torch.float32).expand(*shape[:-2], 1, 1).contiguous().reshape(-1)
    out = _out(shape, dtype, q.data.device)
    cfg = CONFIG["nvfp4_dq"]
    grid = (triton_cdiv(m, cfg["BM"]), triton_cdiv(k, 16 * cfg["NB"]), mats)
    _launch(mod, "nvfp4_dequantize_kernel", grid,
            (_contig(q.data), _contig(q.scale).view(torch.uint8), gs, out, m, k), cfg["num_warps"],
            GS_PER_ROW=per_row, OUT_KIND=out_kind, BM=cfg["BM"], NB=cfg["NB"])
    return _as(out, dtype)


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# the public binding API (imported last: it reads this module's plans and launchers)
from miles_lp.formats.kernels.bound import (  # noqa: E402
    Binding,
    BoundLaunch,
    bind_mxfp8_dequantize,
    bind_mxfp8_quantize,
    bind_nvfp4_dequantize,
    bind_nvfp4_quantize,
)
