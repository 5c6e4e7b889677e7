"""Where a decode step's device time goes (the H200): per precision, the graph-replayed step time and, for the same
step run without graphs under the torch profiler, the kernels per step and their device time by kind.

    PYTHONPATH=. python3 scripts/h200_decode_profile.py [--precisions bf16,fp8_block,mxfp8] [--layers 24]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch

KINDS = (("gemm", ("gemm", "sm90", "cutlass", "cublas", "nvjet", "scaled_mm", "gemv")),
         ("quantize", ("act_tile", "mxfp8_quantize", "fp8")),
         ("attention", ("attention", "fmha", "flash", "softmax", "sdpa")),
         ("sampling", ("sort", "cumsum", "scan", "search", "argmax", "log_softmax", "topk")))


def kind(name: str) -> str:
    low = name.lower()
    for k, keys in KINDS:
        if any(s in low for s in keys):
            return k
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="bf16,fp8_block,mxfp8")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from miles_lp.bench.rollout import _convert, _model
    from miles_lp.rollout.engine import SamplingParams
    from miles_lp.rollout.reference import ReferenceEngine

    out = {}
    with tempfile.TemporaryDirectory() as root:
        src = _model("0.5b", "cuda", root, a.layers)
        prompts = torch.randint(0, 151936, (a.batch, 32), generator=torch.Generator().manual_seed(0)).tolist()
        for prec in a.precisions.split(","):
            ck = src if prec == "bf16" else _convert(src, prec, "cuda", root)
            eng = ReferenceEngine(ck, device="cuda")
            row = {}
            for n in (2, 130):  # graph: the step time from the difference of two lengths (prefill cancels)
                os.environ["MILES_LP_DECODE"] = "graph"
                eng.generate(prompts, SamplingParams(max_new_tokens=n, seed=0))
                ts = []
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    eng.generate(prompts, SamplingParams(max_new_tokens=n, seed=0))
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t0)
                row[f"graph_{n}_s"] = min(ts)
            row["graph_step_ms"] = (row["graph_130_s"] - row["graph_2_s"]) / 128 * 1e3
            os.environ["MILES_LP_DECODE"] = "static"
            sp = SamplingParams(max_new_tokens=17, seed=0)
            eng.generate(prompts, sp)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                eng.generate(prompts, sp)
                torch.cuda.synchronize()
            ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            by = collections.defaultdict(lambda: [0, 0.0])
            names = collections.defaultdict(lambda: [0, 0.0])
            for e in ev:
                k = kind(e.name)
                by[k][0] += 1
                by[k][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                names[e.name[:70]][0] += 1
                names[e.name[:70]][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            row["static_17_kernels"] = {k: {"count": c, "us": t} for k, (c, t) in by.items()}
            row["top"] = sorted(((t, c, nm) for nm, (c, t) in names.items()), reverse=True)[:14]
            out[prec] = row
            print(f"== {prec}: graph step {row['graph_step_ms']:.3f} ms ({a.batch * 1e3 / row['graph_step_ms']:.0f} "
                  f"tok/s decode); static run of 17 tokens (prefill + 16 steps), device time by kind:")
            for k, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
                print(f"   {k:<10} {c:>6} kernels {t / 1e3:>8.2f} ms  ({c / 16:.0f} / step)")
            for t, c, nm in row["top"]:
                print(f"   {t / 1e3:>8.2f} ms {c:>5}x  {nm}")
            eng.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
