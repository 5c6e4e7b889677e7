"""Bound kernel calls for QuantLinear's hot path: the Triton codec kernels launched with per-shape plans.

QuantLinear at 2048x4096x4096 is host-bound on the H200 (docs/gpu.md, "QuantLinear's per-call overhead"): each
codec call through ``miles_lp.formats.kernels``' entry points costs its checks, plan-key build and hash, output
allocations plus dtype views, a result dataclass and Triton's Python launcher wrapper. Here each call site keeps
one plan per input shape / dtype / device / 16-byte alignment: the output shapes and dtypes and the launch
arguments are fixed once; a repeat call allocates the outputs in their final dtypes (bf16, float8_e4m3fn: no
views) and calls the compiled kernel's C launcher directly with its metadata pre-bound.

Same kernels, same bytes: the first call of a plan goes through the kernels' own entry point (its checks, its
messages, its launch); then the kernels' public binding API (``kernels.bind_mxfp8_quantize`` and siblings,
``miles_lp/formats/kernels/bound.py``) returns that launch as a ``Binding``: the C launcher with grid, metadata
and constexprs pre-bound, the int arguments and the output shapes / dtypes. This module uses only that API
(``tests/unit/test_train_launch_api.py`` checks it reads no private name of the kernels). A binding is used
only if its parameter names are the ones the arguments below are built for (a kernel whose signature changed
keeps using the entry point: slower, never wrong). A pointer is a pointer to the C launcher: a bf16 tensor
passed where the kernel was specialised on its int16 view has the same address and alignment. Placeholders for
outputs a launch does not write are passed as the address 0 (the entry point's 0-element tensor has that
address). Not bound (the entry point every call): where the kernels refuse to bind (CPU tensors / the
interpreter, a Triton launch hook: profilers must see every launch, ``runtime.kernels_fast_launch: false``, paths
with no bound form) and under ``runtime.linear_bind: false`` (this module's switch, read at each call: a plan made
while it was on is not used while it is off).

Launch shapes come from ``kernels.CONFIG`` when a plan is made; ``clear()`` drops the plans (the kernels give
the same bytes under every launch shape, ``selfcheck --config``, so a stale plan is slower at worst).
"""

from __future__ import annotations

import torch

from miles_lp.config import switch
from miles_lp.formats.mxfp8 import MXFP8Tensor
from miles_lp.formats.nvfp4 import NVFP4Tensor

_E4M3 = torch.float8_e4m3fn
_U8 = torch.uint8
_MAX = 1024  # plans per call site (token counts vary per micro-batch): cleared when full

_K: list = []


def _kernels():
    if not _K:
        from miles_lp.formats import kernels

        _K.append(kernels)
    return _K[0]


_MX: dict[tuple, object] = {}
_MXDQ: dict[tuple, object] = {}
_NV: dict[tuple, object] = {}
_NVDQ: dict[tuple, object] = {}


def clear() -> None:
    """Drop every bound plan (after changing ``kernels.CONFIG``)."""
    for d in (_MX, _MXDQ, _NV, _NVDQ):
        d.clear()


# Tests and the CPU host bench: ``FAKE_BIND(mod, name, grid, consts)`` -> a launch callable taking the same
# arguments as a bound one (CPU tensors: the interpreter or a no-op), so the bound path runs without a GPU
# (passed to the kernels' ``bind_*`` as ``fake``).
FAKE_BIND = None


def _bind(bind, params: tuple[str, ...], *args, **kw):
    """``bind(*args, **kw, fake=FAKE_BIND)`` (one of the kernels' ``bind_*``), or None: ``runtime.linear_bind`` off
    (unless a fake launcher is set), no binding, or a kernel whose parameters are not the ``params`` the
    arguments here are built for."""
    if FAKE_BIND is None and not switch("linear_bind"):
        return None
    b = bind(*args, **kw, fake=FAKE_BIND)
    return b if b is not None and b.params == params else None


def _key(x: torch.Tensor, *flags) -> tuple:
    return (x.shape, x.dtype, x.get_device(), x.data_ptr() & 15, x.is_contiguous(), *flags)


def _unbound(cache: dict, key: tuple) -> None:
    """Remember that ``key``'s launch is not bound (another kernel path, a changed signature, no cached
    launcher), so later calls go straight to the entry point without trying again; not while a launch hook
    is set (that reason passes)."""
    if not _kernels().launch_hooks_set():
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

    def __init__(self, b, x, dtype):
        self.bound, self.dev = b.launch, x.device
        self.r, self.k, self.m = b.ints["R"], b.ints["K"], b.ints["M"]
        outs = b.outputs
        self.row, self.col = "qr_ptr" in outs, "qc_ptr" in outs  # (grids stored: not with store_q=False)
        self.dq_row, self.dq_col = "dr_ptr" in outs, "dc_ptr" in outs
        self.sr = outs["sr_ptr"][0] if self.row else None
        self.sc = outs["sc_ptr"][0] if self.col else None
        self.shape, self.out = tuple(x.shape), dtype


def mxfp8(x: torch.Tensor, rowwise: bool, colwise: bool, dtype: torch.dtype | None,
          dequant: tuple[str, ...] = ("row", "col"), store_q: bool = True):
    """``(row, row_deq, col, col_deq)`` of ``kernels.mxfp8_quantize(x, rowwise=, colwise=, dequant_dtype=dtype,
    dequant=dequant, store_q=store_q)`` (None where not asked for or not stored). ``x`` on CUDA (or the
    interpreter), checks as the entry's."""
    key = _key(x, rowwise, colwise, dtype, dequant, store_q)
    p = _MX.get(key)
    if p and (FAKE_BIND is not None or switch("linear_bind")) and not _kernels().launch_hooks_set():
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
    if p is None:
        b = _bind(K.bind_mxfp8_quantize, _MX_NAMES, x, rowwise=rowwise, colwise=colwise, dequant_dtype=dtype,
                  dequant=dequant, store_q=store_q)
        if b is not None:
            _store(_MX, key, _MXPlan(b, x, dtype))
        else:
            _unbound(_MX, key)
    return res.row, res.row_deq, res.col, res.col_deq


class _DQPlan:
    __slots__ = ("bound", "dev", "shape", "r", "k", "out")

    def __init__(self, b, r: str, dev):
        self.bound, self.dev = b.launch, dev
        self.shape, self.out = b.outputs["out_ptr"]
        self.r, self.k = b.ints[r], b.ints["K"]


_MXDQ_NAMES = ("q_ptr", "s_ptr", "out_ptr", "R", "K")


def mxfp8_dequantize(q: MXFP8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.mxfp8_dequantize(q, dtype)``."""
    return mxfp8_decode(q.data, q.scale, q.axis, dtype)


def mxfp8_decode(data: torch.Tensor, scale: torch.Tensor, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.mxfp8_dequantize(MXFP8Tensor(data, scale, axis), dtype)`` (the tensor built only when the
    entry point runs)."""
    key = (*_key(data, axis, dtype), scale.shape, scale.data_ptr() & 15, scale.is_contiguous())
    p = _MXDQ.get(key)
    if p and (FAKE_BIND is not None or switch("linear_bind")) and not _kernels().launch_hooks_set():
        out = torch.empty(p.shape, dtype=p.out, device=p.dev)
        p.bound(data, scale, out, p.r, p.k)
        return out
    K = _kernels()
    q = MXFP8Tensor(data, scale, axis)
    out = K.mxfp8_dequantize(q, dtype)
    if p is None:
        b = _bind(K.bind_mxfp8_dequantize, _MXDQ_NAMES, q, dtype)
        if b is not None:
            _store(_MXDQ, key, _DQPlan(b, "R", data.device))
        else:
            _unbound(_MXDQ, key)
    return out


# ---------------------------------------------------------------------------------------------------------
# NVFP4: the per-token bf16 rows (pairs kernel) and the decode; other paths take the entry point every call
# ---------------------------------------------------------------------------------------------------------
_PAIRS_NAMES = ("x_ptr", "M", "K2", "amax_ptr", "q_ptr", "s_ptr", "gs_ptr", "d_ptr")


class _NVPlan:
    __slots__ = ("bound", "dev", "m", "k2", "q", "s", "gshape", "shape", "out", "dq")

    def __init__(self, b, x, dtype):
        outs = b.outputs
        self.bound, self.dev, self.m, self.k2 = b.launch, x.device, b.ints["M"], b.ints["K2"]
        self.q, self.s, self.gshape = outs["q_ptr"][0], outs["s_ptr"][0], outs["gs_ptr"][0]
        self.shape, self.out, self.dq = tuple(x.shape), dtype, "d_ptr" in outs


def nvfp4(x: torch.Tensor, scope: str, dtype: torch.dtype | None, amax: torch.Tensor | None = None,
          block_2d: bool = False):
    """``kernels.nvfp4_quantize(x, scope, amax=amax, block_2d=block_2d, dequant_dtype=dtype)``."""
    if amax is None and scope == "row":
        key = _key(x, dtype, block_2d)
        p = _NV.get(key)
        if p and (FAKE_BIND is not None or switch("linear_bind")) and not _kernels().launch_hooks_set():
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
    if key is not None and p is None:
        b = _bind(K.bind_nvfp4_quantize, _PAIRS_NAMES, x, scope, block_2d=block_2d, dequant_dtype=dtype)
        if b is not None:
            _store(_NV, key, _NVPlan(b, x, dtype))
        else:
            _unbound(_NV, key)
    return qt, d


_NVDQ_NAMES = ("q_ptr", "s_ptr", "gs_ptr", "out_ptr", "M", "K")


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.nvfp4_dequantize(q, dtype)`` (bound when the global scale is already fp32, contiguous and of
    the size the kernel reads: ``kernels.bind_nvfp4_dequantize``)."""
    gs = q.global_scale
    key = (*_key(q.data, dtype, q.scale_scope), tuple(q.logical_shape), q.scale.data_ptr() & 15,
           q.scale.is_contiguous(), gs.shape, gs.dtype, gs.is_contiguous())
    p = _NVDQ.get(key)
    if p and (FAKE_BIND is not None or switch("linear_bind")) and not _kernels().launch_hooks_set():
        out = torch.empty(p.shape, dtype=p.out, device=p.dev)
        p.bound(q.data, q.scale, gs, out, p.r, p.k)
        return out
    K = _kernels()
    out = K.nvfp4_dequantize(q, dtype)
    if p is None:
        b = _bind(K.bind_nvfp4_dequantize, _NVDQ_NAMES, q, dtype)
        if b is not None:
            _store(_NVDQ, key, _DQPlan(b, "M", q.data.device))
        else:
            _unbound(_NVDQ, key)
    return out
