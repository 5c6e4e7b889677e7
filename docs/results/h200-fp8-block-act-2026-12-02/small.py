"""QuantLinear fp8_block at 2048x4096x4096 with more iterations (4 rounds of bench linear, 10 warm-up, 100 timed),
then the backward GEMMs and the operand kernels alone at both shapes (CUDA events, median of 50).
Run from the repository root: PYTHONPATH=$PWD python3 docs/results/h200-fp8-block-act-2026-12-02/small.py"""
import statistics

import torch

from miles_lp.bench import linear as BL
from miles_lp.formats.kernels import fp8_block as k8
from miles_lp.train import fp8_block_gemm as G

print("config", k8.CONFIG, flush=True)
for r in range(4):
    rows = BL.bench([BL._parse_shape("small")], modes=[("fp8_block", "quantized"), ("fp8_block+pow2", "quantized")],
                    kernels=["compiled"], graph=True, warmup=10, iters=100)
    print(f"round {r + 1}")
    print(BL.format_table(rows), flush=True)


def timed(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def gemms(m: int, n: int, k: int) -> None:
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    _, _, (gs, gcs) = k8.quantize_act(dy, False, rows=True, cols=True, grids=False)
    _, _, (xs, xcs) = k8.quantize_act(x, False, rows=True, cols=True, grids=False)
    wq, wt = k8.quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), False)
    w = G.WeightOperands(wq, wt)
    res = {"bf16 mm (wgrad)": timed(lambda: torch.mm(dy.t(), x)),
           "fwd": timed(lambda: G.forward_mm(xs, w)), "dgrad": timed(lambda: G.dgrad_mm(gs, w)),
           "wgrad bf16 out": timed(lambda: G.wgrad_mm(gcs, xcs)),
           "wgrad fp32 out": timed(lambda: G.wgrad_mm(gcs, xcs, out_dtype=torch.float32)),
           "act both grids x": timed(lambda: k8.quantize_act(x, False, rows=True, cols=True, grids=False)),
           "act both grids dy": timed(lambda: k8.quantize_act(dy, False, rows=True, cols=True, grids=False))}
    for name, us in res.items():
        print(f"{m}x{n}x{k} {name:>18}: {us:8.1f} us", flush=True)


for shape in ((8192, 8192, 8192), (2048, 4096, 4096)):
    gemms(*shape)
