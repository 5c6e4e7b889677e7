"""The fp8_block wgrad GEMM on one H200: miles-lp's Triton GEMM (launch plans swept) against cuBLAS's block-scaled
GEMM and BF16, then QuantLinear fp8_block fwd+bwd with each wgrad GEMM, all in one process.

  python3 scripts/h200_fp8_block_mm.py --out DIR [--budget SECONDS]

1. ``fp8_block_mm.selfcheck`` on the device (default plan);
2. per shape (tokens x N x K: 8192^3 and 2048x4096x4096) the wgrad GEMM dw = dy.T @ x on the operand kernels'
   columnwise storages: bf16 ``torch.mm``, cuBLAS (``fp8_block_gemm`` scaled_mm path) and the Triton GEMM at each
   plan of ``PLANS`` (CUDA events, median of 20 after 3 warm-up calls; plans that fail to compile are reported);
   each Triton result against cuBLAS's (relative Frobenius difference); the forward's 1x128 x 128x128 GEMM likewise
   at the fastest plans;
3. the fastest plan per shape byte-checked again (selfcheck with that plan), then ``bench linear``'s rows
   (fp8_block/quantized, eager and graphed) with ``fp8_wgrad_gemm`` scaled_mm and triton at that plan.
Writes DIR/fp8_block_mm.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from miles_lp.bench.cuda_timing import median_us
from miles_lp.config import runtime_override
from miles_lp.formats.kernels import fp8_block as k8
from miles_lp.formats.kernels import fp8_block_mm as bm
from miles_lp.train import fp8_block_gemm as G

# (bm, bn, warps, stages, group)
PLANS = [
    (64, 128, 4, 4, 8), (64, 128, 4, 3, 8), (64, 128, 4, 5, 8), (128, 128, 8, 3, 8), (128, 128, 8, 4, 8),
    (128, 64, 4, 4, 8), (64, 128, 4, 4, 16), (64, 256, 8, 3, 8),
]
SHAPES = [(8192, 8192, 8192), (2048, 4096, 4096)]


def plan_dict(p) -> dict:
    return dict(zip(("bm", "bn", "warps", "stages", "group"), p, strict=True)) | {"imprecise": 128}


def shape_rows(m: int, n: int, k: int, res: dict, best: dict, t0: float, budget: float) -> None:
    """Step 2 at one shape: rows into res["rows"], the fastest plan into best."""
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _, _, (gs, gcs) = k8.quantize_act(dy, False, rows=True, cols=True, grids=False)
    _, _, (xs, xcs) = k8.quantize_act(x, False, rows=True, cols=True, grids=False)
    tag = f"{m}x{n}x{k}"
    t_bf16 = median_us(lambda: torch.mm(dy.t(), x))
    with runtime_override(fp8_wgrad_gemm="scaled_mm"):
        ref = G.wgrad_mm(gcs, xcs)
        t_cub = median_us(lambda: G.wgrad_mm(gcs, xcs))
    print(f"{tag} wgrad: bf16 {t_bf16:8.1f} us   cuBLAS 1x128x1x128 {t_cub:8.1f} us ({t_cub / t_bf16:.3f}x bf16)",
          flush=True)
    res["rows"].append({"shape": tag, "gemm": "wgrad", "kernel": "bf16", "us": t_bf16})
    res["rows"].append({"shape": tag, "gemm": "wgrad", "kernel": "scaled_mm", "us": t_cub})
    timings = []
    for p in PLANS:
        if time.time() - t0 > budget * 0.6:
            print("  (plans cut: budget)", flush=True)
            break
        cfg = plan_dict(p)
        try:
            y = bm.block_mm(gcs.data, gcs.scale_inv, xcs.data, xcs.scale_inv, 1, config=cfg)
            torch.cuda.synchronize()
            diff = bm.rel_err(y, ref)
            t = median_us(lambda cfg=cfg: bm.block_mm(gcs.data, gcs.scale_inv, xcs.data, xcs.scale_inv, 1, config=cfg))
        except Exception as e:  # a plan that does not compile or launch is a result, not a stop
            print(f"  plan {p}: ERR {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            res["rows"].append({"shape": tag, "gemm": "wgrad", "kernel": "triton", "plan": p, "error": str(e)[:400]})
            continue
        timings.append((t, p))
        print(f"  plan {p}: {t:8.1f} us ({t / t_bf16:.3f}x bf16, {t / t_cub:.3f}x cuBLAS) diff vs cuBLAS {diff:.2e}",
              flush=True)
        res["rows"].append({"shape": tag, "gemm": "wgrad", "kernel": "triton", "plan": p, "us": t,
                            "diff_vs_scaled_mm": diff})
    if timings:
        tb, pb = min(timings)
        best[tag] = (tb, pb, t_cub, t_bf16)
        print(f"{tag} wgrad best Triton plan {pb}: {tb:.1f} us = {tb / t_cub:.3f}x cuBLAS", flush=True)
        # the forward's 1x128 x 128x128 GEMM at the three fastest plans, for comparison
        wq, wt = k8.quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), False)
        w = G.WeightOperands(wq, wt)
        t_fwd = median_us(lambda: G.forward_mm(xs, w)) if n == k else None
        if t_fwd is not None:
            yref = G.forward_mm(xs, w)
            print(f"{tag} fwd: cuBLAS 1x128x128x128 {t_fwd:8.1f} us", flush=True)
            res["rows"].append({"shape": tag, "gemm": "fwd", "kernel": "scaled_mm", "us": t_fwd})
            for _, p in sorted(timings)[:3]:
                cfg = plan_dict(p)
                fn = lambda cfg=cfg: bm.block_mm(xs.data, xs.scale_inv, wq.data, wq.scale_inv, 128, config=cfg)  # noqa: E731
                try:
                    diff = bm.rel_err(fn()[:m], yref)
                    t = median_us(fn)
                except Exception as e:
                    print(f"  fwd plan {p}: ERR {str(e).splitlines()[0][:160]}", flush=True)
                    continue
                print(f"  fwd plan {p}: {t:8.1f} us ({t / t_fwd:.3f}x cuBLAS) diff {diff:.2e}", flush=True)
                res["rows"].append({"shape": tag, "gemm": "fwd", "kernel": "triton", "plan": p, "us": t,
                                    "diff_vs_scaled_mm": diff})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=420.0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    bad = bm.selfcheck("cuda")
    print("selfcheck (default plan):", bad or "pass", flush=True)
    res["selfcheck_default"] = bad
    torch.manual_seed(0)
    best: dict = {}
    for m, n, k in SHAPES:
        shape_rows(m, n, k, res, best, t0, args.budget)
        torch.cuda.empty_cache()
    res["best"] = {s: {"us": v[0], "plan": v[1], "scaled_mm_us": v[2], "bf16_us": v[3]} for s, v in best.items()}
    (out / "fp8_block_mm.json").write_text(json.dumps(res, indent=1))
    if not best:
        return 1
    # QuantLinear with each wgrad GEMM (the plan fastest at 8192^3, else the first measured)
    tag0 = next(iter(best))
    cfg = plan_dict(best[tag0][1])
    bad = bm.selfcheck("cuda", config=cfg)
    print(f"selfcheck (plan {best[tag0][1]}):", bad or "pass", flush=True)
    res["selfcheck_best"] = bad
    from miles_lp.bench import linear as BL

    old = dict(bm.CONFIG["1d1d"])
    bm.CONFIG["1d1d"].update(cfg)
    shapes = [BL._parse_shape(s) for s in ("large", "small")]
    for choice in ("scaled_mm", "triton"):
        if time.time() - t0 > args.budget:
            print(f"bench linear {choice}: skipped (budget)", flush=True)
            continue
        with runtime_override(fp8_wgrad_gemm=choice):
            rows = BL.bench(shapes, modes=["fp8_block/quantized"], kernels=["compiled"], graph=True, warmup=3,
                            iters=10)
        print(f"--- bench linear, fp8_wgrad_gemm={choice}", flush=True)
        print(BL.format_table(rows), flush=True)
        res[f"linear_{choice}"] = rows
        (out / "fp8_block_mm.json").write_text(json.dumps(res, indent=1, default=str))
    bm.CONFIG["1d1d"] = old
    print(f"total {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
