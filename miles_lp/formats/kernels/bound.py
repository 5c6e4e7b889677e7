"""Bound launches: an entry point's compiled launch, re-callable with the least host work (public API).

For callers that run one kernel call many times per input shape and want none of the entry point's per-call
work (checks, plan-key build and hash, result objects, Triton's Python launcher wrapper): QuantLinear's hot
path, ``miles_lp.train.launch``. After an entry-point call (``mxfp8_quantize``, ``mxfp8_dequantize``,
``nvfp4_quantize``, ``nvfp4_dequantize``), the matching ``bind_*`` with the same arguments returns a
``Binding``: ``launch(*args)`` calls the compiled kernel's C launcher that call used, with its grid, constexprs
and metadata pre-bound, on the current CUDA stream of the input's device. The caller passes the kernel's
runtime parameters ``params`` in order: the input tensor(s), the ints ``ints`` gives, and fresh outputs of the
shapes and dtypes ``outputs`` names (a tensor of another dtype with the same address and 16-byte alignment is
the same pointer to the C launcher); a pointer parameter ``outputs`` leaves out is not written: pass 0 (the
entry point's placeholder is a 0-element tensor, address 0). Same kernel, same compiled code, so the same bytes
as the entry point (``tests/unit/test_train_lean.py`` runs the bound argument tuples in Triton's interpreter
and on the H200 against the reference codecs).

A ``bind_*`` returns None, and the caller keeps the entry point, where binding is not possible: a CPU tensor
(the interpreter), a non-contiguous input (the entry point copies it), no entry-point call of these arguments
seen yet (or its plan dropped: the caches are bounded), a path with no bound form (swizzled scales; NVFP4
other than the per-token bf16 int32-pairs kernel), ``runtime.kernels_fast_launch: false``, a Triton launch hook
installed (``launch_hooks_set()``: profilers must see every launch; a caller holding a ``Binding`` checks it
before each bound call), no compiled launcher of the layout this code calls, or a kernel whose parameters are
no longer ``params`` (a changed signature: slower, never wrong). The launch shapes are ``CONFIG``'s at bind time;
the kernels give the same bytes under every launch shape (``selfcheck --config``), so a binding held across a
``CONFIG`` change is slower at worst.

``fake`` (tests and ``miles-lp bench linear --host-cpu`` only): ``fake(mod, name, grid, consts)`` returns the
callable used in place of the C launcher; CPU tensors then bind, and the switch / hook refusals are skipped
(the signature check is not), so the bound path's argument tuples run in the interpreter or as a no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles_lp.config import switch
from miles_lp.formats.kernels import runtime as rt
from miles_lp.formats.kernels.tuning import CONFIG

__all__ = ["Binding", "BoundLaunch", "PARAMS", "bind_mxfp8_quantize", "bind_mxfp8_dequantize",
           "bind_nvfp4_quantize", "bind_nvfp4_dequantize"]

# The runtime parameters each bound kernel takes, in order (its constexprs follow and are pre-bound).
PARAMS = {
    "mxfp8_quantize_kernel": ("x_ptr", "R", "K", "M", "qr_ptr", "sr_ptr", "dr_ptr", "wr_ptr", "qc_ptr", "sc_ptr",
                              "dc_ptr", "wc_ptr"),
    "mxfp8_dequantize_kernel": ("q_ptr", "s_ptr", "out_ptr", "R", "K"),
    "nvfp4_rows_pairs_kernel": ("x_ptr", "M", "K2", "amax_ptr", "q_ptr", "s_ptr", "gs_ptr", "d_ptr"),
    "nvfp4_dequantize_kernel": ("q_ptr", "s_ptr", "gs_ptr", "out_ptr", "M", "K"),
}

_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_E4M3 = torch.float8_e4m3fn
_U8 = torch.uint8
_F32 = torch.float32


@dataclass(frozen=True, eq=False)
class Binding:
    """One bound launch (module docstring): ``launch(*args)`` with ``args`` the kernel's ``params`` in order.

    ``ints``: the value of each int parameter; ``outputs``: ``(shape, dtype)`` of each output pointer parameter
    the launch writes (allocate it fresh per call); any other pointer parameter not an input gets 0."""

    kernel: str
    params: tuple[str, ...]
    launch: Callable[..., None]
    ints: dict[str, int]
    outputs: dict[str, tuple[tuple[int, ...], torch.dtype]]


class BoundLaunch:
    """A compiled kernel's C launcher with everything but the per-call arguments pre-bound (grid, metadata,
    constexprs); each call launches on the device's current CUDA stream (a graph capture's too)."""

    __slots__ = ("launch", "g0", "g1", "g2", "dev", "pre", "consts")

    def __init__(self, ent, grid, dev_index: int):
        if _RAW_STREAM is None:
            raise RuntimeError("this torch has no raw CUDA stream accessor")
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


def _launcher(x: torch.Tensor, name: str, grid, consts: dict, site, fake, ent=None):
    """The launch callable for kernel ``name`` as the entry point's call on ``x`` launched it, or None."""
    mod = rt.module_for(x)
    fn = getattr(mod, name, None)
    params = PARAMS[name]
    if fn is not None and tuple(fn.arg_names[:len(params)]) != params:
        return None  # the kernel's parameters changed: arguments built to PARAMS would not fit
    if fake is not None:
        return fake(mod, name, grid, consts)
    if not switch("kernels_fast_launch") or rt.launch_hooks_set() or fn is None:
        return None
    if ent is None:
        ent = rt.SITES.get(site)
    if ent is None:
        return None
    try:
        return BoundLaunch(ent, grid, x.get_device())
    except Exception:  # noqa: BLE001 (an unexpected Triton layout: keep the entry point)
        return None


def _plan(x: torch.Tensor, *flags):
    """(key, plan) of the entry point's plan for ``x`` and ``flags`` (``_plan_key``'s layout, without its
    clearing of a full cache), or (key, None)."""
    key = (x.shape, x.dtype, x.device, x.data_ptr() & 15, x.is_contiguous(), *flags)
    return key, rt.PLANS.get(key)


def _eligible(x: torch.Tensor, fake) -> bool:
    return (x.is_cuda or fake is not None) and x.is_contiguous()


def bind_mxfp8_quantize(x: torch.Tensor, *, rowwise: bool, colwise: bool, dequant_dtype: torch.dtype | None,
                        dequant: tuple[str, ...] = ("row", "col"), store_q: bool = True,
                        fake=None) -> Binding | None:
    """The launch of ``mxfp8_quantize(x, rowwise=, colwise=, dequant_dtype=, dequant=, store_q=)`` (no swizzled
    scales), after that call: ``mxfp8_quantize_kernel`` with ``ints`` R, K, M; ``outputs`` among qr_ptr /
    qc_ptr (``x``'s shape, float8_e4m3fn), sr_ptr / sc_ptr (the compact scales, uint8), dr_ptr / dc_ptr (the
    decodes, ``dequant_dtype``); wr_ptr / wc_ptr always 0. Result tensors: ``MXFP8Tensor(qr, sr, -1)``,
    ``MXFP8Tensor(qc, sc, -2)``, the decodes as they are. None: module docstring."""
    if not _eligible(x, fake):
        return None
    cfg = CONFIG["mxfp8_both" if (rowwise and colwise) else "mxfp8" if rowwise else "mxfp8_col"]
    # (mxfp8_quantize's plan key)
    key, plan = _plan(x, "mx" if store_q else "mx-dq", rowwise, colwise, dequant_dtype, dequant, False, *cfg.items())
    if plan is None or any(plan["shapes"][6:]):
        return None
    launch = _launcher(x, "mxfp8_quantize_kernel", plan["grid"], plan["consts"], key, fake)
    if launch is None:
        return None
    qr, sr, qc, sc, dr, dc = plan["shapes"][:6]
    outs = {n: (tuple(s), dt) for n, s, dt in (("qr_ptr", qr, _E4M3), ("sr_ptr", sr, _U8), ("dr_ptr", dr, dequant_dtype),
                                                ("qc_ptr", qc, _E4M3), ("sc_ptr", sc, _U8), ("dc_ptr", dc, dequant_dtype))
            if s is not None}
    r, k, m = plan["rkm"]
    return Binding("mxfp8_quantize_kernel", PARAMS["mxfp8_quantize_kernel"], launch, {"R": r, "K": k, "M": m}, outs)


def bind_mxfp8_dequantize(q, dtype: torch.dtype, *, fake=None) -> Binding | None:
    """The launch of ``mxfp8_dequantize(q, dtype)``, after that call: ``mxfp8_dequantize_kernel`` (q_ptr, s_ptr =
    ``q.data``, ``q.scale``), ``ints`` R, K, ``outputs`` out_ptr (``q``'s shape, ``dtype``). None: module
    docstring (``q.scale`` must be contiguous too)."""
    data, scale = q.data, q.scale
    if not (_eligible(data, fake) and scale.is_contiguous()):
        return None
    key, _ = _plan(data, "mxdq", q.axis, dtype, *CONFIG["mxfp8_dq"].values())
    key = (*key, scale.shape, scale.data_ptr() & 15, True)  # (mxfp8_dequantize's plan key)
    plan = rt.PLANS.get(key)
    if plan is None:
        return None
    launch = _launcher(data, "mxfp8_dequantize_kernel", plan["grid"], plan["consts"], key, fake)
    if launch is None:
        return None
    r, k = plan["rk"]
    return Binding("mxfp8_dequantize_kernel", PARAMS["mxfp8_dequantize_kernel"], launch, {"R": r, "K": k},
                   {"out_ptr": (tuple(data.shape), dtype)})


def bind_nvfp4_quantize(x: torch.Tensor, scope: str, *, block_2d: bool = False,
                        dequant_dtype: torch.dtype | None = None, fake=None) -> Binding | None:
    """The launch of ``nvfp4_quantize(x, scope, block_2d=, dequant_dtype=)`` (no ``amax``), after that call,
    where it ran ``nvfp4_rows_pairs_kernel`` (per-token bf16 rows: module docstring of ``kernels``; x_ptr is
    ``x`` itself): ``ints`` M, K2 (= K / 2); ``outputs`` q_ptr (uint8), s_ptr (float8_e4m3fn), gs_ptr and
    amax_ptr (float32, the global-scale shape ``[..., M, 1]``), d_ptr (``dequant_dtype``) where a decode is
    asked for. Result: ``NVFP4Tensor(q, s, gs, amax, x.shape, scope, block_2d)``. None: module docstring."""
    if not _eligible(x, fake):
        return None
    cfgs = (CONFIG["nvfp4_pairs"], CONFIG["nvfp4_rows"], CONFIG["nvfp4_rows_reg"], CONFIG["nvfp4_2d"],
            CONFIG["nvfp4"], CONFIG["amax"], CONFIG["nvfp4_persist"])
    # (nvfp4_quantize's plan key, amax not given)
    key, plan = _plan(x, "nv", scope, False, block_2d, dequant_dtype, *(tuple(c.items()) for c in cfgs))
    if plan is None or plan.get("path") != "pairs" or "persist" in plan:
        return None
    name = "nvfp4_rows_pairs_kernel"
    launch = _launcher(x, name, plan["grid"], plan["consts"], key, fake)
    if launch is None:
        return None
    m, k, _ = plan["mkm"]
    gshape = tuple(plan["gshape"])
    outs = {"q_ptr": (tuple(plan["q"]), _U8), "s_ptr": (tuple(plan["s"]), _E4M3), "gs_ptr": (gshape, _F32),
            "amax_ptr": (gshape, _F32)}
    if plan["out_kind"]:
        outs["d_ptr"] = (tuple(plan["shape"]), dequant_dtype)
    return Binding(name, PARAMS[name], launch, {"M": m, "K2": k // 2}, outs)


def bind_nvfp4_dequantize(q, dtype: torch.dtype, *, fake=None) -> Binding | None:
    """The launch of ``nvfp4_dequantize(q, dtype)``, after that call, where it passed ``q``'s own tensors
    unchanged (data, scale contiguous; the global scale fp32, contiguous, of the size the kernel reads):
    ``nvfp4_dequantize_kernel`` (q_ptr, s_ptr, gs_ptr = ``q.data``, ``q.scale``, ``q.global_scale``),
    ``ints`` M, K, ``outputs`` out_ptr (``q``'s logical shape, ``dtype``). None: module docstring."""
    data, gs = q.data, q.global_scale
    if not (_eligible(data, fake) and q.scale.is_contiguous() and gs.dtype == _F32 and gs.is_contiguous()):
        return None
    if dtype not in rt.OUT_KIND:
        return None
    shape = tuple(q.logical_shape)
    m, k = shape[-2], shape[-1]
    mats = data.numel() * 2 // (m * k)
    per_row = gs.numel() == mats * m and q.scale_scope == "row"
    if not per_row and gs.numel() != mats:
        return None
    cfg = CONFIG["nvfp4_dq"]
    consts = dict(GS_PER_ROW=per_row, OUT_KIND=rt.OUT_KIND[dtype], BM=cfg["BM"], NB=cfg["NB"])
    grid = (rt.triton_cdiv(m, cfg["BM"]), rt.triton_cdiv(k, 16 * cfg["NB"]), mats)
    ent = None
    if data.is_cuda:  # (no plan cache in this entry point: its launcher by the launch's own key)
        args = (data, q.scale.view(torch.uint8), gs.reshape(-1), rt.out_tensor(shape, dtype, data.device), m, k)
        ent = rt.LAUNCHERS.get(("nvfp4_dequantize_kernel", data.get_device(), cfg["num_warps"], 0,
                                 tuple(consts.items()), rt.spec_key(args)))
        if ent is None:
            return None
    name = "nvfp4_dequantize_kernel"
    launch = _launcher(data, name, grid, consts, None, fake, ent)
    if launch is None:
        return None
    return Binding(name, PARAMS[name], launch, {"M": m, "K": k}, {"out_ptr": (shape, dtype)})
