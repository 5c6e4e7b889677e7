"""Where a decode step's device time goes (the H200): per precision, the graph-replayed step time and, for the same
step run without graphs under the torch profiler, the kernels per step and their device time by kind.

    PYTHONPATH=. python3 scripts/h200_decode_profile.py [--precisions bf16,fp8_block,mxfp8] [--layers 24]
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
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


def gemm_probe() -> list[str]:
    """The decode step's GEMM shapes alone (M = 32 tokens): bf16 F.linear against the FP8 blockwise path
    (quantize + scaled_mm, tokens padded to 128 as the operand kernel does; and unpadded M = 32 where cuBLAS takes
    it), each replayed 200 times in a CUDA graph, median of 5 replays of the graph."""
    from miles_lp.formats.kernels import fp8_block as fk
    from miles_lp.train import fp8_block_gemm as g

    lines = []
    for n, k in ((1152, 896), (896, 896), (9728, 896), (896, 4864)):
        x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
        # 24 weights in rotation (a layer stack: more bytes than the 50 MB L2 for the large shapes)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(24)]
        wqs = [fk.quantize_weight(w, False, transposed=False)[0] for w in ws]
        kb = -(-k // 128)
        bufs = []
        for wq in wqs:
            buf = torch.ones((n // 128, -(-kb // 4) * 4), device="cuda")
            buf[:, :kb] = wq.scale_inv
            bufs.append(buf)
        it = [0]

        def nxt():
            it[0] = (it[0] + 1) % len(ws)
            return it[0]

        def bf16():
            return torch.nn.functional.linear(x, ws[nxt()])

        def fp8():
            i = nxt()
            _, _, (xs, _) = fk.quantize_act(x, False, rows=True, grids=False)
            return g._mm(xs.data, xs.scale_inv, wqs[i].data.t(), bufs[i].t(), "BlockWise128x128")

        xs32 = None
        try:
            q32 = torch.zeros(32, k, device="cuda").to(torch.float8_e4m3fn)
            s32 = torch.ones(kb, 32, device="cuda").t()
            g._mm(q32, s32, wqs[0].data.t(), bufs[0].t(), "BlockWise128x128")
            xs32 = (q32, s32)
        except Exception as e:  # noqa: BLE001
            lines.append(f"  M=32 unpadded refused for {n}x{k}: {str(e)[:120]}")

        def fp8_m32():
            i = nxt()
            return g._mm(xs32[0], xs32[1], wqs[i].data.t(), bufs[i].t(), "BlockWise128x128")

        _, _, (xs_pad, _) = fk.quantize_act(x, False, rows=True, grids=False)

        def fp8_mm():
            i = nxt()
            return g._mm(xs_pad.data, xs_pad.scale_inv, wqs[i].data.t(), bufs[i].t(), "BlockWise128x128")

        row = [f"N={n} K={k}"]
        for name, fn in (("bf16", bf16), ("fp8 q+mm", fp8), ("fp8 mm (M padded to 128)", fp8_mm),
                         ("fp8 mm M=32", fp8_m32 if xs32 else None)):
            if fn is None:
                continue
            for _ in range(3):
                fn()
            gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr):
                for _ in range(192):
                    fn()
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                gr.replay()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3 / 192)
            row.append(f"{name} {sorted(ts)[2]:.2f} us")
        lines.append("  " + ", ".join(row))
    return lines


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
    print("== GEMMs of a decode step alone (M = 32), per call in a CUDA graph:")
    probe = gemm_probe()
    print("\n".join(probe))
    out["gemm_probe"] = probe
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
