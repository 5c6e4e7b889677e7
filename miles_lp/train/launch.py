"""Bound kernel calls for QuantLinear's hot path: the Triton codec kernels launched with per-shape plans.

QuantLinear at 2048x4096x4096 is host-bound on the H200 (docs/gpu.md, "QuantLinear's per-call overhead"): each
codec call through ``miles_lp.formats.kernels``' entry points costs its checks, plan-key build and hash, output
allocations plus dtype views, a result dataclass and Triton's Python launcher wrapper. Here each call site keeps
one ``_Bound`` per input shape / dtype / device / 16-byte alignment: the output shapes and dtypes and the launch
arguments are fixed once; a repeat call allocates the outputs in their final dtypes (bf16, float8_e4m3fn: no
views) and calls the compiled kernel's C launcher directly with its metadata pre-bound.

Same kernels, same bytes: the first call of a plan goes through the kernels' own entry point (its checks, its
messages, its launch); the launcher that launch compiled (``kernels._SITES``) is then bound here, after a check
that the kernel's parameter names are the ones the arguments below are built for (a kernel whose signature
changed keeps using the entry point: slower, never wrong). A pointer is a pointer to the C launcher: a bf16
tensor passed where the kernel was specialised on its int16 view has the same address and alignment.
Placeholders for outputs a launch does not write are passed as the address 0 (the entry point's 0-element
tensor has that address). Not bound (the entry point every call): CPU tensors (the interpreter), a Triton
launch hook (profilers must see every launch), ``MILES_LP_KERNELS_FAST_LAUNCH=0``, ``MILES_LP_LINEAR_BIND=0``.

Launch shapes come from ``kernels.CONFIG`` when a plan is made; ``clear()`` drops the plans (the kernels give
the same bytes under every launch shape, ``selfcheck --config``, so a stale plan is slower at worst).
"""

from __future__ import annotations

import os

import torch

from miles_lp.formats.mxfp8 import MXFP8Tensor
from miles_lp.formats.nvfp4 import NVFP4Tensor

_E4M3 = torch.float8_e4m3fn
_U8 = torch.uint8
_BIND = os.environ.get("MILES_LP_LINEAR_BIND", "1") != "0"
_MAX = 1024  # plans per call site (token counts vary per micro-batch): cleared when full

_K: list = []


def _kernels():
    if not _K:
        from miles_lp.formats import kernels

        _K.append(kernels)
    return _K[0]


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)

_MX: dict[tuple, object] = {}
_MXDQ: dict[tuple, object] = {}
_NV: dict[tuple, object] = {}
_NVDQ: dict[tuple, object] = {}


def clear() -> None:
    """Drop every bound plan (after changing ``kernels.CONFIG``)."""
    for d in (_MX, _MXDQ, _NV, _NVDQ):
        d.clear()


class _Bound:
    """A compiled kernel's C launcher with everything but the per-call tensors pre-bound."""

    __slots__ = ("launch", "g0", "g1", "g2", "dev", "pre", "consts")

    def __init__(self, ent, grid, dev_index: int):
        ck, consts = ent
        run = ck.run  # (a property: initialises the handles once)
        g = (*grid, 1, 1)
        self.g0, self.g1, self.g2 = g[0], g[1], g[2]
        self.dev = dev_index
        self.consts = tuple(consts)
        raw = getattr(run, "launch", None)
        if (raw is not None and getattr(run, "global_scratch_size", 1) == 0
                and getattr(run, "profile_scratch_size", 1) == 0 and hasattr(run, "launch_pdl")):
            # Triton's CudaLauncher.__call__ minus its scratch allocation (none here) and Python frame
            self.launch = raw
            self.pre = (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None, ck.packed_metadata,
                        None, None, None)
        else:
            self.launch = run
            self.pre = (ck.function, ck.packed_metadata, None, None, None)

    def __call__(self, *args) -> None:
        self.launch(self.g0, self.g1, self.g2, _RAW_STREAM(self.dev), *self.pre, *args, *self.consts)


# Tests and the CPU host bench: ``FAKE_BIND(mod, name, grid, consts)`` -> a launch callable taking the same
# arguments as a bound one (CPU tensors: the interpreter or a no-op), so the bound path runs without a GPU.
FAKE_BIND = None


def _site(key, mod, name: str, n_args: int, names: tuple[str, ...], grid, dev_index: int, consts=None,
          ent=None):
    """The bound launcher for ``key`` (the kernels' plan key of the call just made), or None."""
    K = _kernels()
    fn = getattr(mod, name, None)
    if fn is not None and tuple(fn.arg_names[:n_args]) != names:
        return None  # the kernel's parameters changed: the arguments built here would not fit
    if FAKE_BIND is not None:
        return FAKE_BIND(mod, name, grid, consts)
    if not (_BIND and K._FAST_LAUNCH) or K._hooks_set():
        return None
    if ent is None:
        ent = K._SITES.get(key)
    if ent is None or fn is None:
        return None
    try:
        return _Bound(ent, grid, dev_index)
    except Exception:  # noqa: BLE001 (an unexpected Triton layout: keep the entry point)
        return None


def _find(prefix: tuple, suffix: tuple = ()):
    """(key, plan) of the newest entry-point plan whose key starts with ``prefix`` (the input's shape, dtype,
    device, alignment, contiguity and the call's flags, as ``kernels._plan_key`` lays them out) and ends with
    ``suffix``; the launch-shape part between them is the entry point's business (it reads ``CONFIG``)."""
    plans = _kernels()._PLANS
    n, m = len(prefix), len(suffix)
    for key in reversed(list(plans)):
        if key[:n] == prefix and (not m or key[-m:] == suffix):
            return key, plans[key]
    return None, None


def _bindable(x: torch.Tensor) -> bool:
    """A launch on ``x`` can be bound: CUDA (or a test's FAKE_BIND), contiguous (the entry point would copy)."""
    return (x.is_cuda or FAKE_BIND is not None) and x.is_contiguous()


def _key(x: torch.Tensor, *flags) -> tuple:
    return (x.shape, x.dtype, x.get_device(), x.data_ptr() & 15, x.is_contiguous(), *flags)


def _unbound(cache: dict, key: tuple) -> None:
    """Remember that ``key``'s launch is not bound (another kernel path, a changed signature, no cached
    launcher), so later calls go straight to the entry point without trying again; not while a launch hook
    is set (that reason passes)."""
    if not _kernels()._hooks_set():
        _store(cache, key, False)


def _store(cache: dict, key: tuple, value) -> None:
    if len(cache) >= _MAX:
        cache.clear()
    cache[key] = value


# ---------------------------------------------------------------------------------------------------------
# MXFP8
# ---------------------------------------------------------------------------------------------------------
_MX_NAMES = ("x_ptr", "R", "K", "M", "qr_ptr", "sr_ptr", "dr_ptr", "wr_ptr", "qc_ptr", "sc_ptr", "dc_ptr", "wc_ptr")


class _MXPlan:
    __slots__ = ("bound", "dev", "r", "k", "m", "row", "col", "dq_row", "dq_col", "shape", "sr", "sc", "out")

    def __init__(self, bound, x, rowwise, colwise, plan, dtype):
        self.bound, self.dev = bound, x.device
        self.r, self.k, self.m = plan["rkm"]
        qr_s, sr_s, qc_s, sc_s, dr_s, dc_s = plan["shapes"][:6]
        self.row, self.col = qr_s is not None, qc_s is not None  # (grids stored: not with store_q=False)
        self.dq_row, self.dq_col = dr_s is not None, dc_s is not None
        self.shape, self.sr, self.sc, self.out = tuple(x.shape), sr_s, sc_s, dtype


def mxfp8(x: torch.Tensor, rowwise: bool, colwise: bool, dtype: torch.dtype | None,
          dequant: tuple[str, ...] = ("row", "col"), store_q: bool = True):
    """``(row, row_deq, col, col_deq)`` of ``kernels.mxfp8_quantize(x, rowwise=, colwise=, dequant_dtype=dtype,
    dequant=dequant, store_q=store_q)`` (None where not asked for or not stored). ``x`` on CUDA (or the
    interpreter), checks as the entry's."""
    key = _key(x, rowwise, colwise, dtype, dequant, store_q)
    p = _MX.get(key)
    if p and not _kernels()._hooks_set():
        dev, shape = p.dev, p.shape
        qr = torch.empty(shape, dtype=_E4M3, device=dev) if p.row else 0
        sr = torch.empty(p.sr, dtype=_U8, device=dev) if p.row else 0
        dr = torch.empty(shape, dtype=p.out, device=dev) if p.dq_row else 0
        qc = torch.empty(shape, dtype=_E4M3, device=dev) if p.col else 0
        sc = torch.empty(p.sc, dtype=_U8, device=dev) if p.col else 0
        dc = torch.empty(shape, dtype=p.out, device=dev) if p.dq_col else 0
        p.bound(x, p.r, p.k, p.m, qr, sr, dr, 0, qc, sc, dc, 0)
        return (MXFP8Tensor(qr, sr, -1) if p.row else None, dr if p.dq_row else None,
                MXFP8Tensor(qc, sc, -2) if p.col else None, dc if p.dq_col else None)
    K = _kernels()
    if store_q:  # (the entry point's default: callable on a kernels module without the store_q flag)
        res = K.mxfp8_quantize(x, rowwise=rowwise, colwise=colwise, dequant_dtype=dtype, dequant=dequant)
    else:
        res = K.mxfp8_quantize(x, rowwise=rowwise, colwise=colwise, dequant_dtype=dtype, dequant=dequant,
                               store_q=False)
    if p is None and _bindable(x):
        kkey, plan = _find((x.shape, x.dtype, x.device, x.data_ptr() & 15, True, "mx" if store_q else "mx-dq",
                            rowwise, colwise, dtype, dequant, False))
        bound = plan and _site(kkey, K._module(x), "mxfp8_quantize_kernel", 12, _MX_NAMES, plan["grid"],
                               x.get_device(), plan["consts"])
        if bound is not None and not any(plan["shapes"][6:]):
            _store(_MX, key, _MXPlan(bound, x, rowwise, colwise, plan, dtype))
        else:
            _unbound(_MX, key)
    return res.row, res.row_deq, res.col, res.col_deq


class _DQPlan:
    __slots__ = ("bound", "dev", "shape", "r", "k", "out")


_MXDQ_NAMES = ("q_ptr", "s_ptr", "out_ptr", "R", "K")


def mxfp8_dequantize(q: MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.mxfp8_dequantize(q, dtype)``."""
    return mxfp8_decode(q.data, q.scale, q.axis, dtype)


def mxfp8_decode(data: torch.Tensor, scale: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.mxfp8_dequantize(MXFP8Tensor(data, scale, axis), dtype)`` (the tensor built only when the
    entry point runs)."""
    key = (*_key(data, axis, dtype), scale.shape, scale.data_ptr() & 15, scale.is_contiguous())
    p = _MXDQ.get(key)
    if p and not _kernels()._hooks_set():
        out = torch.empty(p.shape, dtype=p.out, device=p.dev)
        p.bound(data, scale, out, p.r, p.k)
        return out
    K = _kernels()
    q = MXFP8Tensor(data, scale, axis)
    out = K.mxfp8_dequantize(q, dtype)
    if p is None and _bindable(data) and scale.is_contiguous():
        kkey, plan = _find((data.shape, data.dtype, data.device, data.data_ptr() & 15, True, "mxdq", axis, dtype),
                           (scale.shape, scale.data_ptr() & 15, True))
        bound = plan and _site(kkey, K._module(data), "mxfp8_dequantize_kernel", 5, _MXDQ_NAMES, plan["grid"],
                               data.get_device(), plan["consts"])
        if bound is not None:
            p = _DQPlan()
            p.bound, p.dev, p.shape, p.out = bound, data.device, tuple(data.shape), dtype
            p.r, p.k = plan["rk"]
            _store(_MXDQ, key, p)
        else:
            _unbound(_MXDQ, key)
    return out


# ---------------------------------------------------------------------------------------------------------
# NVFP4: the per-token bf16 rows (pairs kernel) and the decode; other paths take the entry point every call
# ---------------------------------------------------------------------------------------------------------
_PAIRS_NAMES = ("x_ptr", "M", "K2", "amax_ptr", "q_ptr", "s_ptr", "gs_ptr", "d_ptr")


class _NVPlan:
    __slots__ = ("bound", "dev", "m", "k2", "q", "s", "gshape", "shape", "out", "dq")


def nvfp4(x: torch.Tensor, scope: str, dtype: torch.dtype | None, amax: torch.Tensor | None = None,
          block_2d: bool = False):
    """``kernels.nvfp4_quantize(x, scope, amax=amax, block_2d=block_2d, dequant_dtype=dtype)``."""
    if amax is None and scope == "row":
        key = _key(x, dtype, block_2d)
        p = _NV.get(key)
        if p and not _kernels()._hooks_set():
            dev = p.dev
            q = torch.empty(p.q, dtype=_U8, device=dev)
            s = torch.empty(p.s, dtype=_E4M3, device=dev)
            gs = torch.empty(p.gshape, dtype=torch.float32, device=dev)  # (the flat buffers the kernel writes,
            a = torch.empty(p.gshape, dtype=torch.float32, device=dev)   # allocated in their final shape)
            d = torch.empty(p.shape, dtype=p.out, device=dev) if p.dq else 0
            p.bound(x, p.m, p.k2, a, q, s, gs, d)
            qt = NVFP4Tensor(q, s, gs, a, p.shape, scope, block_2d)
            return qt, (d if p.dq else None)
    else:
        p = key = None
    K = _kernels()
    qt, d = K.nvfp4_quantize(x, scope, amax=amax, block_2d=block_2d, dequant_dtype=dtype)
    if key is not None and p is None and _bindable(x):
        kkey, plan = _find((x.shape, x.dtype, x.device, x.data_ptr() & 15, True, "nv", scope, False, block_2d, dtype))
        if plan is not None and plan.get("path") == "pairs" and "persist" not in plan:
            bound = _site(kkey, K._module(x), "nvfp4_rows_pairs_kernel", 8, _PAIRS_NAMES, plan["grid"],
                          x.get_device(), plan["consts"])
            if bound is not None:
                p = _NVPlan()
                m, k, mats = plan["mkm"]
                p.bound, p.dev, p.m, p.k2 = bound, x.device, m, k // 2
                p.q, p.s, p.gshape, p.shape = plan["q"], plan["s"], plan["gshape"], plan["shape"]
                p.out, p.dq = dtype, bool(plan["out_kind"])
                _store(_NV, key, p)
        if p is None:
            _unbound(_NV, key)
    return qt, d


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.nvfp4_dequantize(q, dtype)`` (no plan cache in the entry point: bound here when the global
    scale is already fp32, contiguous and of the size the kernel reads)."""
    gs = q.global_scale
    key = (*_key(q.data, dtype, q.scale_scope), tuple(q.logical_shape), q.scale.data_ptr() & 15,
           q.scale.is_contiguous(), gs.shape, gs.dtype, gs.is_contiguous())
    p = _NVDQ.get(key)
    if p and not _kernels()._hooks_set():
        out = torch.empty(p.shape, dtype=p.out, device=p.dev)
        p.bound(q.data, q.scale, gs, out, p.r, p.k)
        return out
    K = _kernels()
    out = K.nvfp4_dequantize(q, dtype)
    if p is None and _bindable(q.data):
        p = _bind_nvfp4_dequantize(K, q, dtype, gs)
        if p is not None:
            _store(_NVDQ, key, p)
        else:
            _unbound(_NVDQ, key)
    return out


_NVDQ_NAMES = ("q_ptr", "s_ptr", "gs_ptr", "out_ptr", "M", "K")


def _bind_nvfp4_dequantize(K, q, dtype, gs):
    """The entry point's launch (grid, constexprs) for ``q`` when it passes ``q``'s own tensors unchanged."""
    shape = tuple(q.logical_shape)
    m, k = shape[-2], shape[-1]
    mats = q.data.numel() * 2 // (m * k)
    if not (q.data.is_contiguous() and q.scale.is_contiguous() and gs.dtype == torch.float32
            and gs.is_contiguous()):
        return None
    per_row = gs.numel() == mats * m and q.scale_scope == "row"
    if not per_row and gs.numel() != mats:
        return None
    cfg = K.CONFIG["nvfp4_dq"]
    consts = dict(GS_PER_ROW=per_row, OUT_KIND=K._OUT_KIND[dtype], BM=cfg["BM"], NB=cfg["NB"])
    grid = (K.triton_cdiv(m, cfg["BM"]), K.triton_cdiv(k, 16 * cfg["NB"]), mats)
    ent = None
    if q.data.is_cuda:
        args = (q.data, q.scale.view(torch.uint8), gs.reshape(-1), K._out(shape, dtype, q.data.device), m, k)
        ent = K._LAUNCHERS.get(("nvfp4_dequantize_kernel", q.data.get_device(), cfg["num_warps"], 0,
                                tuple(consts.items()), K._spec(args)))
        if ent is None:
            return None
    bound = _site(None, K._module(q.data), "nvfp4_dequantize_kernel", 6, _NVDQ_NAMES, grid, q.data.get_device(),
                  consts, ent)
    if bound is None:
        return None
    p = _DQPlan()
    p.bound, p.dev, p.shape, p.out, p.r, p.k = bound, q.data.device, shape, dtype, m, k
    return p
