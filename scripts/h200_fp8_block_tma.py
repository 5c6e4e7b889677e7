"""The Gluon TMA operand kernels of fp8_block (``fp8_block.TMA_VARIANTS``) on one H200: bytes, speed, QuantLinear.

    python3 scripts/h200_fp8_block_tma.py --out DIR [--linear]

1. every TMA variant through ``fp8_block``'s selfcheck inputs (byte-identical to the codec: activations both grids
   and columnwise alone, weights; a large input whose tiles outnumber the programs), and the configured kernels;
2. each timed as a CUDA graph of 10 calls (median of 20 replays; ``h200_fp8_block_act.timed``) beside a device
   copy and the configured Triton kernels, at x 8192x8192 / 2048x4096 and w 8192x8192 / 4096x4096 bf16, plus the
   host time per eager call; the fastest byte-identical variant per use -> DIR/tma.json ``pick``;
3. ``--linear``: ``bench linear`` (fp8_block quantized, large and small shapes, graphed) with ``fp8_block.CONFIG``'s
   defaults and with the pick, each in its own process (a kernel choice switched inside one process has twice broken CUDA
   graph capture), twice, alternating -> DIR/linear.json (a list of runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from miles_lp.bench.cuda_timing import host_us  # noqa: E402
from miles_lp.formats.kernels import fp8_block as k8  # noqa: E402


def probe(out: str) -> dict:
    import h200_fp8_block_act as A

    t0 = time.time()
    saved = dict(k8.CONFIG)
    bad = k8._selfcheck("cuda", 0, None, False)
    for name in k8.TMA_VARIANTS:
        k8.CONFIG.update(act_both=name, act_cols=name, weight=name, tma_min_tiles=0)
        try:
            bad += k8._selfcheck("cuda", 0, name, False)
        except Exception as exc:
            bad.append(f"error {type(exc).__name__}: {str(exc)[:300]} [{name}]")
        k8.CONFIG.update(saved)
    print(f"selfcheck ({time.time() - t0:.0f} s): " + ("byte-identical" if not bad else f"{len(bad)} FAILURES"),
          flush=True)
    for b in bad:
        print("  FAIL", b)
    broken = {v for v in k8.TMA_VARIANTS if any(b.endswith(f"[{v}]") for b in bad)}
    res = {"selfcheck_failures": bad, "config": saved, "variants": k8.TMA_VARIANTS, "shapes": {}}

    def run(cfg, fn):
        def f():
            k8.CONFIG.update(cfg)
            fn()
        return f

    for m, k in ((8192, 8192), (2048, 4096), (4096, 4096)):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = torch.empty_like(x)
        n = m * k
        cases = {"copy": ({}, lambda x=x, y=y: y.copy_(x), 4 * n)}
        tri = {**k8._TRITON, "weight": "tile"}  # the Triton kernels, whatever CONFIG's defaults are
        for v in ("triton", *k8.TMA_VARIANTS):
            cfg = tri if v == "triton" else {"act_both": v, "act_cols": v, "weight": v, "tma_min_tiles": 0}
            cases[f"both {v}"] = (cfg, lambda x=x: k8.quantize_act(x, False, rows=True, cols=True, grids=False), 4 * n)
            cases[f"cols {v}"] = (cfg, lambda x=x: k8.quantize_act(x, False, rows=False, cols=True, grids=False), 3 * n)
            cases[f"weight {v}"] = (cfg, lambda x=x: k8.quantize_weight(x, False), 4 * n)
        rows = {}
        print(f"\n{m}x{k} bf16: us per call (CUDA graph), GB/s, of the copy's GB/s, host us per eager call", flush=True)
        for name, (cfg, fn, nbytes) in cases.items():
            try:
                us = A.timed(run(cfg, fn), 20)
                host = host_us(run(cfg, fn))
            except Exception as exc:
                print(f"  {name:24s} FAILED {exc!r}"[:300], flush=True)
                rows[name] = {"error": repr(exc)[:300]}
                continue
            finally:
                k8.CONFIG.update(saved)
            rows[name] = {"us": us, "GBps": nbytes / us / 1e3, "host_us": host}
        copy = rows["copy"]["GBps"]
        for name, r in rows.items():
            if "us" in r:
                r["of_copy"] = r["GBps"] / copy
                flag = "  (NOT byte-identical)" if name.split(" ")[-1] in broken else ""
                print(f"  {name:24s} {r['us']:8.1f} us {r['GBps']:6.0f} GB/s {r['of_copy']:.2f}  host "
                      f"{r['host_us']:6.1f} us{flag}", flush=True)
        res["shapes"][f"{m}x{k}"] = rows
    ok = [v for v in k8.TMA_VARIANTS if v not in broken]
    big, w4 = res["shapes"]["8192x8192"], res["shapes"]["4096x4096"]

    def best(use, table):
        cands = [(table.get(f"{use} {v}", {}).get("us", float("inf")), v) for v in ok]
        us, v = min(cands) if cands else (float("inf"), None)
        return v if us < table.get(f"{use} triton", {}).get("us", float("inf")) else None

    pick = {"act_both": best("both", big), "act_cols": best("cols", big), "weight": best("weight", w4)}
    pick = {key: v for key, v in pick.items() if v}
    res["pick"] = pick
    res["seconds"] = time.time() - t0
    print(f"\npick (faster than the Triton kernels at 8192x8192 / the 4096^2 weight, byte-identical): {pick}")
    with open(os.path.join(out, "tma.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def linear_one(name: str, cfg: dict, path: str) -> None:
    from miles_lp.bench import linear as BL

    k8.CONFIG.update(cfg)
    shapes = [BL._parse_shape(s) for s in ("large", "small")]
    rows = BL.bench(shapes, modes=[("fp8_block", "quantized")], kernels=["compiled"], graph=True, warmup=5,
                    iters=20)
    print(f"--- bench linear with fp8_block.CONFIG {k8.CONFIG}", flush=True)
    print(BL.format_table(rows), flush=True)
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)
    runs.append({"name": name, "config": dict(k8.CONFIG), "rows": rows})
    with open(path, "w") as f:
        json.dump(runs, f, indent=1, default=str)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--linear", action="store_true")
    ap.add_argument("--pick", default=None, help="JSON: skip the probe, bench this choice")
    ap.add_argument("--linear-one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.linear_one:
        name, cfg = json.loads(a.linear_one)
        linear_one(name, cfg, os.path.join(a.out, "linear.json"))
        return 0
    print(f"device {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    pick = json.loads(a.pick) if a.pick else probe(a.out)["pick"]
    if not a.linear or not pick:
        return 0
    for rnd in (1, 2):
        for name, cfg in (("default", {}), ("tma", pick)):
            arg = json.dumps([f"{name}_{rnd}", cfg])
            rc = subprocess.call([sys.executable, os.path.abspath(__file__), "--out", a.out, "--linear-one", arg],
                                 timeout=240)
            print(f"(bench linear {name} round {rnd}: rc {rc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
