"""MXFP8 on CUDA: both grids of an input from one read (``mxfp8_quantize``), the decode (``mxfp8_dequantize``) and
the codec hook (``quantize_mxfp8``), byte-identical to ``miles_lp.formats.mxfp8``. Plans are worked out once per
input shape / dtype / flags (``runtime.PLANS``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_lp.errors import BackendUnavailable
from miles_lp.formats._checks import check_input, check_multiple
from miles_lp.formats.kernels import runtime as rt
from miles_lp.formats.kernels.tuning import CONFIG
from miles_lp.formats.spec import MXFP8_BLOCK
from miles_lp.formats.tensors import MXFP8Tensor


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
    (``rt.PLANS``); a repeat call allocates its outputs and launches (QuantLinear's per-call host time).
    """
    cfg = CONFIG["mxfp8_both" if (rowwise and colwise) else "mxfp8" if rowwise else "mxfp8_col"]
    if not isinstance(x, torch.Tensor):
        check_input(x, "MXFP8", min_dim=1, name=name)
    key = rt.plan_key(x, "mx" if store_q else "mx-dq", rowwise, colwise, dequant_dtype, dequant, swizzle, *cfg.items())
    plan = rt.PLANS.get(key)
    if plan is None:
        plan = _mxfp8_plan(x, rowwise, colwise, dequant_dtype, dequant, swizzle, name, cfg, store_q)
        rt.PLANS[key] = plan
    mod = rt.module_for(x)
    xi, _ = rt.input_view(x)
    dev = x.device
    empty = rt.none_tensor(dev)
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
    rt.launch(mod, "mxfp8_quantize_kernel", plan["grid"], (xi, r, k, m, qr, sr, dr, wr, qc, sc, dc, wc),
            plan["warps"], site=key, maxnreg=plan["maxnreg"], **plan["consts"])
    e4m3 = torch.float8_e4m3fn
    return MXFP8Result(
        row=MXFP8Tensor(data=qr.view(e4m3), scale=sr, axis=-1) if qr_s else None,
        col=MXFP8Tensor(data=qc.view(e4m3), scale=sc, axis=-2) if qc_s else None,
        row_deq=rt.as_dtype(dr, dequant_dtype) if dr_s else None,
        col_deq=rt.as_dtype(dc, dequant_dtype) if dc_s else None,
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
    rt.module_for(x)  # the availability refusal, before any allocation
    out_kind = rt.out_kind(dequant_dtype, "the dequantized operand")
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
              (*lead, rt.round_up(m, 128), rt.round_up(k // MXFP8_BLOCK, 4)) if swizzle and rowwise else None,
              (*lead, rt.round_up(k, 128), rt.round_up(m // MXFP8_BLOCK, 4)) if swizzle and colwise else None)
    bmb, nb = cfg["BMB"], cfg["NB"]
    if colwise and m % (32 * bmb):
        bmb = 1  # a tile must not straddle two matrices' column blocks (M is a multiple of 32)
    return {"shapes": shapes, "out_dtype": torch.int16 if dequant_dtype == torch.bfloat16 else dequant_dtype,
            "rkm": (r, k, m), "grid": (rt.triton_cdiv(r, 32 * bmb), rt.triton_cdiv(k, 32 * nb)), "warps": cfg["num_warps"],
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
    key = (*rt.plan_key(data, "mxdq", q.axis, dtype, *cfg.values()), scale.shape, scale.data_ptr() & 15,
           scale.is_contiguous())
    plan = rt.PLANS.get(key)
    if plan is None:
        rt.module_for(data)
        out_kind = rt.out_kind(dtype, "MXFP8 dequantize")
        k = data.shape[-1]
        r = data.numel() // k
        plan = rt.PLANS[key] = {"rk": (r, k), "grid": (rt.triton_cdiv(r, 32 * cfg["BMB"]), rt.triton_cdiv(k, 32 * cfg["NB"])),
                              "consts": dict(COLWISE=q.axis == -2, OUT_KIND=out_kind, BMB=cfg["BMB"], NB=cfg["NB"])}
    mod = rt.module_for(data)
    if not data.is_contiguous():
        data = data.contiguous()
    if not scale.is_contiguous():
        scale = scale.contiguous()
    out = rt.out_tensor(data.shape, dtype, data.device)
    r, k = plan["rk"]
    rt.launch(mod, "mxfp8_dequantize_kernel", plan["grid"], (data.view(torch.uint8), scale, out, r, k),
            cfg["num_warps"], site=key, **plan["consts"])
    return rt.as_dtype(out, dtype)
