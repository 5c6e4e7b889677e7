"""CUTLASS's sm90 blockwise-scaled FP8 GEMM beside cuBLAS's, on the learner's fp8_block operands, on one H200.

    python3 scripts/h200_cutlass_fp8_block.py --lib build/cutlass/libmlp_cutlass_fp8.so --out DIR

Why: the fp8_block targets are set by the three GEMMs (cuBLAS's block-scaled kernels: the forward form 1x128 x
128x128 at ~0.59x bf16's time, the wgrad 1x128 x 1x128 at ~0.8x). Three kernels of our own were slower than cuBLAS.
``scripts/cutlass_fp8_block/gemm.cu`` instantiates CUTLASS's kernel for both forms (built with nvcc for sm_90a on
the development machine, loaded here with ctypes). For each form and shape: the result against cuBLAS's and against
the emulation (fp32 dequantize, one GEMM), then both timed two ways -> DIR/cutlass.json: CUDA events around one
call from an idle GPU (median of 20 after 3; the host launch included) and ``graph_us`` (10 calls in one CUDA
graph; the device time alone).
Each shape runs in a subprocess with a time limit, so that a faulting kernel leaves the rest.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(8192, 8192, 8192), (2048, 4096, 4096), (4096, 4096, 4096)]
#: the kernels gemm.cu exports: cooperative 128x128x128 tiles, cluster 1x2 (no suffix); _p pingpong 64x128x128;
#: _w 128x256 tiles; _c cluster 2x1
FWD = ("1d2d", "1d2d_p")
WGRAD = ("1d1d", "1d1d_p", "1d1d_w", "1d1d_c")


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def one(lib_path: str, m: int, n: int, k: int) -> dict:
    import torch

    from miles_lp.bench.cuda_timing import graph_us, median_us
    from miles_lp.formats.fp8 import dequantize_fp8_blockwise
    from miles_lp.formats.kernels import fp8_block as k8
    from miles_lp.train import fp8_block_gemm as G

    lib = ctypes.CDLL(lib_path)
    for form in (*FWD, *WGRAD):
        f = getattr(lib, f"mlp_fp8_block_ws_{form}")
        f.restype, f.argtypes = ctypes.c_size_t, [ctypes.c_int] * 3
        f = getattr(lib, f"mlp_fp8_block_gemm_{form}")
        f.restype, f.argtypes = ctypes.c_int, [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    _, _, (xr, xc) = k8.quantize_act(x, False, rows=True, cols=True, grids=False)
    _, _, (gr, gc) = k8.quantize_act(dy, False, rows=True, cols=True, grids=False)
    wq, wt, st = k8.quantize_weight(w, False, scale_t=True)
    ops = G.WeightOperands(wq, wt, st)
    res: dict = {"shape": f"{m}x{n}x{k}"}

    def graphed(fn) -> float:  # device time without the host: 10 calls in one graph, median of 10 replays
        return graph_us(fn, calls=10, replays=10, stat="median")

    def call(form, a, sa, b, sb, gm, gn, gk):
        ws = torch.empty(max(1, getattr(lib, f"mlp_fp8_block_ws_{form}")(gm, gn, gk)), dtype=torch.uint8, device=dev)
        d = torch.empty(gm, gn, dtype=torch.bfloat16, device=dev)

        def run():  # the stream read at each call: under graph capture it is the capturing one
            rc = getattr(lib, f"mlp_fp8_block_gemm_{form}")(a.data_ptr(), b.data_ptr(), sa.data_ptr(), sb.data_ptr(),
                                                           d.data_ptr(), gm, gn, gk, ws.data_ptr(),
                                                           torch.cuda.current_stream().cuda_stream)
            if rc:
                raise RuntimeError(f"CUTLASS {form} returned {rc}")
        return d, run

    # forward form: y [MP, N] = x rows [MP, K] (scales [K/128, MP]) x w [N, K] (scales [N/128, K/128])
    mp = xr.data.shape[0]
    y_b = G.forward_mm(xr, ops)
    xdq = (xr.data.float().view(mp, k // 128, 128) * xr.scale_inv.float().reshape(mp, k // 128, 1)).view(mp, k)
    wdq = dequantize_fp8_blockwise(wq.data, wq.scale_inv, (128, 128), torch.float32)
    y_ref = xdq[:m] @ wdq.t()
    res["fwd"] = {"rel_cublas_vs_emulation": _rel(y_b, y_ref), "cublas_us": median_us(lambda: G.forward_mm(xr, ops)),
                  "cublas_graph_us": graphed(lambda: G.forward_mm(xr, ops))}
    for form in FWD:
        y_c, run_f = call(form, xr.data, xr.scale_inv.t(), wq.data, wq.scale_inv.contiguous(), mp, n, k)
        run_f()
        torch.cuda.synchronize()
        res["fwd"][form] = {"rel_vs_emulation": _rel(y_c[:m], y_ref), "us": median_us(run_f),
                            "graph_us": graphed(run_f)}
    # wgrad form: dw [N, K] = dy cols [N, MP] (scales [MP/128, N]) x x cols [K, MP] (scales [MP/128, K])
    gcs, xcs = gc.scale_inv.t(), xc.scale_inv.t()  # the stored [MP/128, N] / [MP/128, K]
    d_b = G.wgrad_mm(gc, xc)
    gdq = (gc.data.float().view(n, mp // 128, 128) * gcs.float().t().reshape(n, mp // 128, 1)).view(n, mp)
    xcdq = (xc.data.float().view(k, mp // 128, 128) * xcs.float().t().reshape(k, mp // 128, 1)).view(k, mp)
    d_ref = gdq @ xcdq.t()
    res["wgrad"] = {"rel_cublas_vs_emulation": _rel(d_b, d_ref), "cublas_us": median_us(lambda: G.wgrad_mm(gc, xc)),
                    "cublas_graph_us": graphed(lambda: G.wgrad_mm(gc, xc))}
    for form in WGRAD:
        d_c, run_w = call(form, gc.data, gcs, xc.data, xcs, n, k, mp)
        run_w()
        torch.cuda.synchronize()
        res["wgrad"][form] = {"rel_vs_emulation": _rel(d_c, d_ref), "us": median_us(run_w),
                              "graph_us": graphed(run_w)}
    res["bf16_us"] = median_us(lambda: x @ w.t())
    res["bf16_graph_us"] = graphed(lambda: x @ w.t())
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.one:
        m, n, k = (int(v) for v in a.one.split("x"))
        print("RESULT" + json.dumps(one(os.path.abspath(a.lib), m, n, k)), flush=True)
        return 0
    results = []
    for m, n, k in SHAPES:
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--lib", a.lib, "--out", a.out, "--one",
                                f"{m}x{n}x{k}"], capture_output=True, text=True, timeout=120)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")), None)
            r = json.loads(line[6:]) if line else {"shape": f"{m}x{n}x{k}", "rc": p.returncode,
                                                    "stderr": p.stderr[-1500:]}
        except subprocess.TimeoutExpired:
            r = {"shape": f"{m}x{n}x{k}", "error": "timed out (120 s)"}
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
    with open(os.path.join(a.out, "cutlass.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
