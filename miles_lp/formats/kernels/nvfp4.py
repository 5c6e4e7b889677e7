"""NVFP4 on CUDA: the per-tensor / per-token / 16x16 quantizers (``nvfp4_quantize``), the amax passes
(``nvfp4_amax``, ``matrix_amax``), the decode (``nvfp4_dequantize``) and the codec hook (``quantize_nvfp4``),
byte-identical to ``miles_lp.formats.nvfp4``."""

from __future__ import annotations

import threading

import torch

from miles_lp.formats._checks import check_input, check_nvfp4
from miles_lp.formats.kernels import runtime as rt
from miles_lp.formats.kernels.tuning import CONFIG
from miles_lp.formats.spec import NVFP4_BLOCK
from miles_lp.formats.tensors import NVFP4Tensor


def _amax_launch(mod, xi, in_kind: int, mats: int, m: int, k: int, per_row: bool, site: tuple | None = None
                 ) -> torch.Tensor:
    cfg = CONFIG["amax"]
    if per_row:
        out = torch.empty(mats * m, dtype=torch.float32, device=xi.device)
    else:
        out = _zeros_i32(mats, xi.device)  # fp32 bits; atomic max from 0
    grid = (rt.triton_cdiv(m, cfg["BM"]), mats)
    rt.launch(mod, "amax_kernel", grid, (xi, m, k, out), cfg["num_warps"], site=site and ("amax", *site),
            PER_ROW=per_row, IN_KIND=in_kind,
            BM=cfg["BM"], BK=cfg["BK"], K_ITERS=rt.triton_cdiv(k, cfg["BK"]))
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
    key = (dev, rt.stream(dev.index) if dev.type == "cuda" else None)
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
    mod = rt.module_for(x)
    xi, in_kind = rt.input_view(x)
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
    once per input shape / dtype / flags (``rt.PLANS``), as in ``mxfp8_quantize``.
    """
    if not isinstance(x, torch.Tensor):
        check_nvfp4(x, scope, block_2d, name)
    given = amax is not None
    cfgs = (CONFIG["nvfp4_pairs"], CONFIG["nvfp4_rows"], CONFIG["nvfp4_rows_reg"], CONFIG["nvfp4_2d"],
            CONFIG["nvfp4"], CONFIG["amax"], CONFIG["nvfp4_persist"])
    key = rt.plan_key(x, "nv", scope, given, block_2d, dequant_dtype, *(tuple(c.items()) for c in cfgs))
    plan = rt.PLANS.get(key)
    if plan is None:
        check_nvfp4(x, scope, block_2d, name)
        plan = rt.PLANS[key] = _nvfp4_plan(x, scope, given, block_2d, dequant_dtype)
    mod = rt.module_for(x)
    xi, in_kind = rt.input_view(x)
    dev = x.device
    out_kind = plan["out_kind"]
    q = torch.empty(plan["q"], dtype=torch.uint8, device=dev)
    s = torch.empty(plan["s"], dtype=torch.uint8, device=dev)
    gs = torch.empty(plan["gs"], dtype=torch.float32, device=dev)
    d = rt.out_tensor(plan["shape"], dequant_dtype, dev) if out_kind else rt.none_tensor(dev)
    m, k, mats = plan["mkm"]
    path = plan["path"]
    if path == "tile":
        if given:
            amax_flat = amax.to(device=dev, dtype=torch.float32).contiguous().reshape(-1)
            site = None  # the caller's amax: its alignment is not in the plan key
        else:
            amax_flat = _amax_launch(mod, xi, in_kind, mats, m, k, per_row=False, site=key)
            site = key
        rt.launch(mod, "nvfp4_quantize_kernel", plan["grid"], (xi, m, k, amax_flat, q, s, gs, d), plan["warps"],
                site=site, **plan["consts"])
    else:
        amax_flat = torch.empty(mats * m, dtype=torch.float32, device=dev)
        if path == "pairs":
            d32 = d.view(torch.int32) if out_kind else d
            args = (xi.view(torch.int32), m, k // 2, amax_flat, q, s, gs, d32)
            if "persist" in plan:
                nprog = plan["grid"][0]
                args = (xi.view(torch.int32), mats * m, k // 2, nprog, rt.triton_cdiv(mats * m, nprog), *args[3:])
            rt.launch(mod, plan.get("persist", "nvfp4_rows_pairs_kernel"), plan["grid"], args, plan["warps"],
                    site=key, maxnreg=plan["maxnreg"], **plan["consts"],
                    **({"ITERS_C": args[4]} if "persist" in plan and not x.is_cuda else {}))
        else:
            rt.launch(mod, "nvfp4_quantize_rows_kernel", plan["grid"], (xi, m, k, amax_flat, q, s, gs, d),
                    plan["warps"], site=key, **plan["consts"])
    gshape = plan["gshape"]
    qt = NVFP4Tensor(data=q, scale=s.view(torch.float8_e4m3fn), global_scale=gs.view(gshape),
                     amax=amax_flat.view(gshape), logical_shape=plan["shape"], scale_scope=scope, block_2d=block_2d)
    return qt, (rt.as_dtype(d, dequant_dtype) if out_kind else None)


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
    rt.module_for(x)  # the availability refusal
    out_kind = rt.out_kind(dequant_dtype, "the dequantized operand")
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
        nb = rt.triton_next_pow2(k // NVFP4_BLOCK)
        ept, rs = (pairs["el_per_thread_dq"], pairs["RS_dq"]) if out_kind else (pairs["el_per_thread"], pairs["RS"])
        plan.update(path="pairs", grid=(rt.triton_cdiv(m, rs), mats),
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
            rows, nb = 1, rt.triton_next_pow2(k // NVFP4_BLOCK)
            ept = reg.get("el_per_thread_dq", reg["el_per_thread"]) if out_kind else reg["el_per_thread"]
            warps = max(1, min(16, nb * NVFP4_BLOCK // (32 * ept)))
        plan.update(path="rows", grid=(rt.triton_cdiv(m, rows), mats), warps=warps,
                    consts=dict(IN_KIND=in_kind, OUT_KIND=out_kind, ROWS=rows, NB=nb, K_ITERS=rt.triton_cdiv(k, 16 * nb)))
    else:
        cfg = CONFIG["nvfp4_2d" if block_2d else "nvfp4"]
        tb = 16 if block_2d else 1
        plan.update(path="tile", grid=(rt.triton_cdiv(m, cfg["TA"] * tb), rt.triton_cdiv(k, 16 * cfg["NB"]), mats),
                    warps=cfg["num_warps"], consts=dict(IN_KIND=in_kind, SCOPE=1 if per_row else 0,
                                                        OUT_KIND=out_kind, TA=cfg["TA"], TB=tb, NB=cfg["NB"]))
    return plan


def quantize_nvfp4(x: torch.Tensor, scale_scope: str = "tensor", amax: torch.Tensor | None = None,
                   block_2d: bool = False, name: str | None = None) -> NVFP4Tensor:
    """The codec hook: ``quantize_nvfp4(...)`` through the kernels (``amax`` already broadcast)."""
    return nvfp4_quantize(x, scale_scope, amax=amax, block_2d=block_2d, name=name)[0]


def nvfp4_dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q.dequantize(dtype)`` in one launch (fp32 / bf16)."""
    mod = rt.module_for(q.data)
    out_kind = rt.out_kind(dtype, "NVFP4 dequantize")
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
    out = rt.out_tensor(shape, dtype, q.data.device)
    cfg = CONFIG["nvfp4_dq"]
    grid = (rt.triton_cdiv(m, cfg["BM"]), rt.triton_cdiv(k, 16 * cfg["NB"]), mats)
    rt.launch(mod, "nvfp4_dequantize_kernel", grid,
            (rt.contiguous(q.data), rt.contiguous(q.scale).view(torch.uint8), gs, out, m, k), cfg["num_warps"],
            GS_PER_ROW=per_row, OUT_KIND=out_kind, BM=cfg["BM"], NB=cfg["NB"])
    return rt.as_dtype(out, dtype)
