#!/usr/bin/env python
"""What MXFP8 adds to one SmolLM2-135M decoder layer's linears on this CPU, by codec path, side by side in one run.

The seven linears of a layer (q/k/v 576 -> 576/192/192, o 576 -> 576, gate/up 576 -> 1536, down 1536 -> 576; bf16,
random weights) on about the tokens of one ``bench rl-step`` update (2,750), as ``nn.Linear`` (BF16) and as
``QuantLinear`` under MXFP8 ``dequantized`` backward with q/k/v and gate/up sharing their input grid (as the embedded
learner wires them), run alternately; the best of ``--repeats`` for a no-grad forward (``old_log_prob``) and a forward
+ backward (``update_actor``). The MXFP8 variants: the eager torch decode (``formats.native.decodes`` off, the code
before the C decode), the C decode on one thread, the C codec on torch's threads (the default). Multiply the
differences by 30 layers for a step's forward. Prints a markdown table.

    PYTHONPATH=. python scripts/smollm2_mxfp8_layer_cost.py [--tokens 2750] [--threads 2] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2750)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()

    import torch
    import torch.nn.functional as F

    from miles_lp.formats import native
    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe, QuantLinear, share_input_caches

    torch.set_num_threads(a.threads)
    hidden, inter, kv = 576, 1536, 192
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}

    class Layer(torch.nn.Module):
        def __init__(self, quantized: bool):
            super().__init__()
            for name, (n, k) in shapes.items():
                lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
                with torch.no_grad():
                    lin.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
                if quantized:
                    lin = QuantLinear.from_linear(lin, LinearRecipe(Format.MXFP8, BackwardMode.DEQUANTIZED), name)
                setattr(self, name, lin)
            share_input_caches(self)

        def forward(self, x):
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            h = self.o_proj(q * 0.5 + 0.1) + x  # (attention left out: the same in both)
            return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + (k.sum() + v.sum()) * 0

    bf16, mx = Layer(False), Layer(True)
    x = torch.randn(a.tokens, hidden, dtype=torch.bfloat16, generator=g)
    decodes, threads = native.decodes, native._threads
    variants = (("BF16 nn.Linear", bf16, decodes, threads),
                ("MXFP8, eager torch decode", mx, lambda d, t: False, lambda: 1),
                ("MXFP8, C decode, 1 thread", mx, decodes, lambda: 1),
                ("MXFP8, C decode + codec on torch's threads", mx, decodes, threads))
    best: dict[tuple[str, str], float] = {}
    loads = [os.getloadavg()[0]]
    try:
        for _ in range(a.repeats):
            for name, layer, dec, thr in variants:
                native.decodes, native._threads = dec, thr
                t0 = time.perf_counter()
                with torch.no_grad():
                    layer(x)
                t1 = time.perf_counter()
                layer(x.clone().requires_grad_(True)).float().sum().backward()
                t2 = time.perf_counter()
                for key, v in ((("fwd", name), t1 - t0), (("fb", name), t2 - t1)):
                    best[key] = min(best.get(key, float("inf")), v)
    finally:
        native.decodes, native._threads = decodes, threads
    loads.append(os.getloadavg()[0])
    base = variants[0][0]
    print(f"one layer's linears, {a.tokens} tokens, {a.threads} threads, best of {a.repeats}, "
          f"load {min(loads):.1f}-{max(loads):.1f}\n")
    print("| variant | forward (no grad) ms | vs BF16 | forward + backward ms | vs BF16 |\n| --- | --- | --- | --- | --- |")
    for name, *_ in variants:
        f, fb = best[("fwd", name)] * 1e3, best[("fb", name)] * 1e3
        print(f"| {name} | {f:.1f} | {f / (best[('fwd', base)] * 1e3):.2f}x | {fb:.1f} | "
              f"{fb / (best[('fb', base)] * 1e3):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
