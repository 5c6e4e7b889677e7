"""What a kernel costs at the least inside a CUDA graph on this GPU, beside the 0.5B decode's BF16 GEMMs.

    python3 scripts/h200_graph_floor.py --out DIR

Why: ``bench rollout``'s target (fp8_block >= 1.2x our BF16 at 0.5B, batch 32) needs the FP8 decode to save a sixth
of BF16's step time in its GEMMs. With the step time T (from ``bench rollout`` in the same call) and the BF16 GEMMs
G per layer, the four FP8 GEMMs of a layer (with their activation quantization) must take at most
G - T / (6 * layers). This script measures the smallest time a kernel node takes back to back in a graph (an empty
Triton kernel of one program, a one-element torch op) and G: ``F.linear`` at M = 32 on the four 0.5B weights, each
replayed over 24 distinct copies so that the weights come from DRAM as in a decode step (the H200's L2 holds 50 MB).
Writes DIR/graph_floor.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from miles_lp.bench.cuda_timing import graph_us  # noqa: E402

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}  # (N, K), 0.5B
LAYERS = 24


@triton.jit
def _empty(p):
    """Does nothing on purpose: what a kernel node costs at the least."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name()}
    one = torch.zeros(1, device=dev)
    res["empty_triton_us"] = graph_us(lambda: _empty[(1,)](one), 500, 20, "median")
    res["torch_add_1_elem_us"] = graph_us(lambda: one.add_(1), 500, 20, "median")
    x = torch.randn(32, 4864, device=dev, dtype=torch.bfloat16)
    gemm = {}
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
        xi = x[:, :k].contiguous()
        out = torch.empty(32, n, device=dev, dtype=torch.bfloat16)
        turn = itertools.count()  # each captured call takes the next of the 24 copies
        gemm[name] = graph_us(lambda ws=ws, xi=xi, out=out, turn=turn: torch.matmul(
            xi, ws[next(turn) % LAYERS].t(), out=out), 4 * LAYERS, 20, "median")
    res["bf16_gemm_m32_us"] = gemm
    res["bf16_gemms_per_layer_us"] = sum(gemm.values())
    for key, v in res.items():
        print(f"{key}: {v}", flush=True)
    with open(os.path.join(a.out, "graph_floor.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
