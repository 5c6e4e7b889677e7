"""FP8 blockwise activation / gradient operand kernels on one GPU: byte identity, then time side by side.

``python3 scripts/h200_fp8_block_act.py --out DIR`` (no network needed):

1. ``fp8_block.selfcheck("cuda")``: the configured kernels on every input, every ``ACT_VARIANTS`` shape (both
   grids and the columnwise grid alone) on the partial-tile and special inputs (``--full``: on every input).
2. At x = 8192x8192 (QuantLinear's x in the forward and dy in the backward at 8192^3: the same shape) and
   2048x4096 bf16: a device copy of x (the bandwidth anchor), rows only, cols only (the tile kernel and each
   variant), both grids as two tile launches (the default) and as one slab launch (each variant). Each is a CUDA
   graph of REPEAT calls (no host time in the figure), timed with CUDA events, warm-up then the median of
   ``--iters`` replays; printed as us per call, GB/s (bytes read + written) and the fraction of the copy's GB/s.
3. The fastest byte-identical choice for ``CONFIG["act_both"]`` / ``["act_cols"]`` at 8192x8192, and DIR/act.json.

``--smoke`` (CPU, ``TRITON_INTERPRET=1``): the script's own logic at tiny shapes, no selfcheck, no figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from miles_lp.bench.cuda_timing import median_us  # noqa: E402
from miles_lp.formats.kernels import fp8_block  # noqa: E402

REPEAT = 10
SMOKE = False  # --smoke: the script's own logic on CPU under TRITON_INTERPRET=1 (tiny shapes, no figures)


def timed(fn, iters: int) -> float:
    """Median microseconds per call of ``fn`` (a CUDA graph of REPEAT calls when capture works)."""
    fn()
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(REPEAT):
                fn()

        def run():
            g.replay()
    except Exception as exc:  # (a capture failure: timed as plain launches, host time included)
        print(f"  (CUDA graph capture failed: {exc!r}; plain launches)")

        def run():
            for _ in range(REPEAT):
                fn()
    return median_us(run, iters) / REPEAT


def act(x, rows: bool, cols: bool, both: str, col: str):
    def fn():
        fp8_block.CONFIG["act_both"], fp8_block.CONFIG["act_cols"] = both, col
        fp8_block.quantize_act(x, False, rows=rows, cols=cols, grids=False)
    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--full", action="store_true", help="every variant on every selfcheck input (more compiles)")
    p.add_argument("--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1: the script's logic, tiny shapes")
    a = p.parse_args(argv)
    global SMOKE
    SMOKE = a.smoke
    dev = "cpu" if a.smoke else "cuda"
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    print(f"device {'cpu (smoke)' if a.smoke else torch.cuda.get_device_name()}; torch {torch.__version__}")
    bad = [] if a.smoke else fp8_block.selfcheck(dev, variants=True, quick_variants=not a.full)
    print(f"selfcheck ({time.time() - t0:.0f} s): " + ("byte-identical" if not bad else f"{len(bad)} FAILURES"))
    for b in bad:
        print("  FAIL", b)
    broken = {v for v in fp8_block.ACT_VARIANTS if any(b.endswith(f"[{v}]") for b in bad)}
    base_bad = [b for b in bad if not b.endswith("]")]
    res = {"selfcheck_failures": bad, "shapes": {}, "config": dict(fp8_block.CONFIG),
           "variants": fp8_block.ACT_VARIANTS}
    saved = dict(fp8_block.CONFIG)
    shapes = ((8192, 8192), (2048, 4096)) if not a.smoke else ((256, 256), (128, 384))
    for m, k in shapes:
        x = torch.randn(m, k, device=dev).to(torch.bfloat16)
        n = m * k
        sc = 4 * n / 128  # one fp32 scale per 128 elements, per grid
        y = torch.empty_like(x)
        cases = {"copy": (lambda x=x, y=y: y.copy_(x), 4 * n)}
        cases["rows"] = (act(x, True, False, "tile", "tile"), 3 * n + sc)
        for v in ("tile", *fp8_block.ACT_VARIANTS):
            cases[f"cols {v}"] = (act(x, False, True, "tile", v), 3 * n + sc)
        # both grids: two launches (rows by the tile kernel + the columnwise grid by "tile" or a variant) ...
        for v in ("tile", *fp8_block.ACT_VARIANTS):
            cases[f"both rows+cols {v}"] = (act(x, True, True, "tile", v), 4 * n + 2 * sc)
        # ... or one launch of the slab kernel
        for v in fp8_block.ACT_VARIANTS:
            cases[f"both one {v}"] = (act(x, True, True, v, "tile"), 4 * n + 2 * sc)
        print(f"\nx {m}x{k} bf16 (the figures: us per call, GB/s read + written, fraction of the copy's GB/s)")
        rows = {}
        for name, (fn, nbytes) in cases.items():
            try:
                us = timed(fn, a.iters)
            except Exception as exc:
                print(f"  {name:30s} FAILED {exc!r}"[:300])
                rows[name] = {"error": repr(exc)}
                continue
            rows[name] = {"us": us, "GBps": nbytes / us / 1e3}
        fp8_block.CONFIG.update(saved)
        copy = rows["copy"].get("GBps")
        for name, r in rows.items():
            if "us" in r:
                r["of_copy"] = r["GBps"] / copy if copy else None
                flag = "  (NOT byte-identical)" if name.split(" ")[-1] in broken else ""
                print(f"  {name:30s} {r['us']:8.1f} us {r['GBps']:7.0f} GB/s {r['of_copy']:.2f} of copy{flag}")
        res["shapes"][f"{m}x{k}"] = rows
    big = res["shapes"][f"{shapes[0][0]}x{shapes[0][1]}"]
    m0, k0 = shapes[0]
    ok = ["tile", *(v for v in fp8_block.ACT_VARIANTS if v not in broken)]

    def us(name):
        return big.get(name, {}).get("us", float("inf"))
    best_cols = min(ok, key=lambda v: us(f"cols {v}"))
    # act_both "tile" means rows by the tile kernel + act_cols; a variant name means one slab launch
    both = {("tile", best_cols): us(f"both rows+cols {best_cols}")}
    both.update({(v, best_cols): us(f"both one {v}") for v in ok if v != "tile"})
    (best_both, _), best_us = min(both.items(), key=lambda kv: kv[1])
    pick = {"act_both": best_both, "act_cols": best_cols}
    print(f"\nat {m0}x{k0}: cols alone fastest {best_cols} ({us(f'cols {best_cols}'):.1f} us; tile "
          f"{us('cols tile'):.1f} us); both grids fastest {best_both} ({best_us:.1f} us; today's two tile launches "
          f"{us('both rows+cols tile'):.1f} us; copy {us('copy'):.1f} us)")
    print(f"set fp8_block.CONFIG: {json.dumps(pick)}" + ("" if not base_bad else
                                                         "  (but the configured kernels FAILED selfcheck)"))
    res["fastest"] = pick
    res["seconds"] = time.time() - t0
    with open(os.path.join(a.out, "act.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'act.json')} ({res['seconds']:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
