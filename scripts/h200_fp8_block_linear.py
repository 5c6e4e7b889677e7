"""QuantLinear fp8_block on one H200 with the activation kernel the device picks, in one process:

  python3 scripts/h200_fp8_block_linear.py --out DIR

1. ``scripts/h200_fp8_block_act.py`` (selfcheck of every activation-kernel shape, their timings, the fastest
   byte-identical ``fp8_block.CONFIG`` choice) into DIR;
2. that choice applied in this process, then ``bench linear`` (large and small shapes, fp8_block quantized and
   fp8_block + pow2 quantized, eager fresh / cached and graphed, each against bf16 beside it), once with the
   default (two tile launches) and once with the choice, alternating, so the two are measured side by side;
3. cuBLAS's wgrad GEMM with a bf16 and an fp32 output, and the dgrad GEMM, timed alone (context for docs/gpu.md).
Writes DIR/linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from miles_lp.bench.cuda_timing import median_us

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--pick", default=None, help="a JSON fp8_block.CONFIG choice: skip step 1 and use it")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import h200_fp8_block_act

    from miles_lp.bench import linear as BL
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.train import fp8_block_gemm as G

    if args.pick:
        rc, act, pick = 0, {}, json.loads(args.pick)
    else:
        rc = h200_fp8_block_act.main(["--out", str(out)])
        act = json.loads((out / "act.json").read_text())
        pick = act.get("fastest") or {}
    res: dict = {"act_rc": rc, "pick": pick, "runs": []}
    default = {"act_both": "tile", "act_cols": "tile"}
    choices = [("default", default)]
    base_failed = [b for b in act.get("selfcheck_failures", []) if not b.endswith("]")]  # "[variant]": that one only
    if pick and pick != default and not base_failed:
        choices.append(("picked", pick))
    shapes = [BL._parse_shape(s) for s in ("large", "small")]
    for rep in range(2):
        for name, cfg in choices:
            k8.CONFIG.update(cfg)
            rows = BL.bench(shapes, modes=[("fp8_block", "quantized"), ("fp8_block+pow2", "quantized")], kernels=["compiled"],
                            graph=True, warmup=3, iters=10)
            print(f"--- bench linear, activation kernels {name} {cfg} (round {rep + 1})", flush=True)
            print(BL.format_table(rows), flush=True)
            res["runs"].append({"name": name, "config": cfg, "round": rep + 1, "rows": rows})
            (out / "linear.json").write_text(json.dumps(res, indent=1, default=str))
    k8.CONFIG.update(default)
    m = n = k = 8192
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _, _, (gs, gcs) = k8.quantize_act(dy, False, rows=True, cols=True, grids=False)
    _, _, (_, xcs) = k8.quantize_act(x, False, rows=False, cols=True, grids=False)
    wq, wt = k8.quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), False)
    w = G.WeightOperands(wq, wt)
    gemms = {"bf16 mm": lambda: torch.mm(dy, x), "wgrad bf16 out": lambda: G.wgrad_mm(gcs, xcs),
             "wgrad fp32 out": lambda: G.wgrad_mm(gcs, xcs, out_dtype=torch.float32),
             "dgrad": lambda: G.dgrad_mm(gs, w)}
    res["gemms_8192"] = {name: median_us(fn) for name, fn in gemms.items()}
    for name, us in res["gemms_8192"].items():
        print(f"8192^3 {name:>16}: {us:8.1f} us", flush=True)
    (out / "linear.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
