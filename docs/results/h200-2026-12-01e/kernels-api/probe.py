"""Device probe (kernels-api, 12-01e): QuantLinear at 2048x4096x4096 bf16, three steps per mode (step 1 fresh
plans, step 2 a fresh weight grid, step 3 the cached grid), once with the bound launches (MILES_LP_LINEAR_BIND on)
and once without (every call through the kernels' entry points). Prints per mode: outputs and gradients of every
step bit-equal between the two, the kernel entry-point calls per step (bound: step 3 should make none), the
bound plans per call site and the type of their launcher (BoundLaunch = the compiled kernel's C launcher).
Usage (CUDA): python3 docs/results/h200-2026-12-01e/kernels-api/probe.py"""

import json

import torch

from miles_lp.formats import kernels
from miles_lp.formats.spec import BackwardMode, Format
from miles_lp.train import launch
from miles_lp.train.gemm import quantized_linear
from miles_lp.train.grid import WeightGrid
from miles_lp.train.recipe import LinearRecipe

entry = []
for name in ("mxfp8_quantize", "mxfp8_dequantize", "nvfp4_quantize", "nvfp4_dequantize"):
    real = getattr(kernels, name)
    setattr(kernels, name, lambda *a, _r=real, _n=name, **k: (entry.append(_n), _r(*a, **k))[1])


def steps(recipe, bind: bool, m=2048, k=4096, n=4096):
    launch._BIND = bind
    launch.clear()
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).bfloat16().cuda().requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16().cuda().requires_grad_()
    dy = torch.randn(m, n, generator=g).bfloat16().cuda()
    grid = WeightGrid(recipe, kernel="compiled")
    out = []
    for i in range(3):
        if i < 2:
            grid.invalidate()
        x.grad = w.grad = None
        entry.clear()
        y = quantized_linear(x, w, recipe, grid=grid)
        y.backward(dy)
        torch.cuda.synchronize()
        out.append(([t.detach().clone() for t in (y, x.grad, w.grad)], list(entry)))
    sites = {"mxfp8": launch._MX, "mxfp8_decode": launch._MXDQ, "nvfp4": launch._NV, "nvfp4_dequantize": launch._NVDQ}
    plans = {s: sorted({type(p.bound).__name__ for p in c.values() if p is not False}) for s, c in sites.items()}
    return out, {s: v for s, v in plans.items() if v}


for fmt, bw in [("mxfp8", "high_precision"), ("mxfp8", "dequantized"), ("mxfp8", "quantized"),
                ("nvfp4", "high_precision"), ("nvfp4", "dequantized")]:
    recipe = LinearRecipe(Format(fmt), BackwardMode(bw), "token" if fmt == "nvfp4" else None)
    on, plans_on = steps(recipe, True)
    off, plans_off = steps(recipe, False)
    same = [all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(s[0], t[0], strict=True))
            for s, t in zip(on, off, strict=True)]
    print(json.dumps({"case": f"{fmt}/{bw}", "bytes_equal_bound_vs_entry": same,
                      "entry_calls_bound": [s[1] for s in on], "entry_calls_unbound": [len(s[1]) for s in off],
                      "bound_plans": plans_on, "bound_plans_unbound": plans_off}), flush=True)
