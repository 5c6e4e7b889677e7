"""``miles-lp bench fp8-decode``: the fp8_block decode GEMM against cuBLAS's block-scaled GEMM and BF16, side by side.

At the decode GEMMs of one model (``--model``; N x K) and ``--m`` tokens:

* ``0.5b`` (default): Qwen2.5-0.5B's widths, q/k/v 1152 x 896, o 896 x 896, gate/up 9728 x 896, down 896 x 4864
  (0.8-9 MB of BF16 weight per GEMM: latency-bound on an H200);
* ``8b``: Qwen3-8B's widths, q/k/v 6144 x 4096, o 4096 x 4096, gate/up 24576 x 4096, down 4096 x 12288
  (34-201 MB: bandwidth-bound, where FP8's half the weight bytes can win);

 each path is timed as one CUDA graph of ``--calls`` back-to-back calls, replayed ``--replays``
times (device time per call from CUDA events; no host in the loop):

* ``bf16``: ``F.linear`` on the BF16 weight (the anchor);
* ``triton``: ``formats.kernels.fp8_block_decode.decode_mm`` from the bf16 input (its quantization included), its
  dot on FP8 tensor cores (``--dots``: also on the E4M3 values widened to bf16);
* ``scaled_mm``: the static decode's other path, the 1x128 operand kernel (tokens padded to 128) then
  ``torch._scaled_mm_v2`` with BlockWise1x128 x BlockWise128x128 scales; ``scaled_mm gemm`` the GEMM alone.

Each row: microseconds per call, the ratio to BF16 (> 1: faster than BF16), the weight's E4M3 bytes per second, the
launch plan (M tile x N tile x split-K; ``CONFIG["stages"]`` deep), and the Triton result's relative error against the emulated GEMM (bf16 output: ``REL_TOL``; the JSON
also has the fp32 output's, ``FP32_REL_TOL``). ``--sweep`` also times
the Triton kernel at pipeline depths 3 / 4 / 6, N tiles of 32 / 64 / 128 and split-K 1..16 and reports the fastest
(the inputs of ``plan`` and ``CONFIG``).
"""

from __future__ import annotations

import json

HELP = "fp8_block decode GEMM (Triton) vs cuBLAS block-scaled scaled_mm vs BF16 at 0.5B / 8B decode shapes (CUDA)"
#: ``--model`` -> the decode GEMMs' (N, K) (fused q/k/v and gate/up, as the reference engine runs them)
MODEL_SHAPES = {
    "0.5b": {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)},
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
}
SHAPES = MODEL_SHAPES["0.5b"]


def add_arguments(p) -> None:
    p.add_argument("--model", default="0.5b", choices=tuple(MODEL_SHAPES),
                   help="whose decode GEMM shapes: 0.5b (Qwen2.5-0.5B, default) or 8b (Qwen3-8B)")
    p.add_argument("--m", default="1,8,32,64", help="token counts, comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"GEMMs, comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--pow2", action="store_true", help="power-of-two activation scales")
    p.add_argument("--dots", default="fp8,bf16", help="the Triton kernel's dot operands, comma-separated: fp8 "
                   "(FP8 tensor cores), bf16 (the E4M3 values widened, exact); the first is the 'triton' column")
    p.add_argument("--calls", type=int, default=50, help="calls captured in one CUDA graph")
    p.add_argument("--replays", type=int, default=10, help="timed replays of the graph")
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernel's pipeline depths, N tiles and "
                   "split-K")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows to this JSON file")


def _graph_time(fn, calls: int, replays: int) -> float:
    """Microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph, best of ``replays`` replays."""
    from miles_lp.bench.cuda_timing import graph_us

    return graph_us(fn, calls, replays, "best")


def run(args) -> int:
    import torch
    import torch.nn.functional as F

    from miles_lp.formats.fp8 import quantize_fp8_blockwise
    from miles_lp.formats.kernels import fp8_block as fk
    from miles_lp.formats.kernels import fp8_block_decode as fd
    from miles_lp.train import fp8_block_gemm as G

    if not torch.cuda.is_available():
        raise SystemExit("bench fp8-decode: needs a CUDA device (sm_90 for the FP8 paths)")
    ms = [int(v) for v in args.m.split(",") if v.strip()]
    dots = [v.strip() for v in args.dots.split(",") if v.strip()]
    if not dots or set(dots) - {"fp8", "bf16"}:
        raise SystemExit(f"bench fp8-decode: --dots {args.dots!r}: a comma list of fp8, bf16")
    shapes = MODEL_SHAPES[args.model]
    names = [v.strip() for v in args.shapes.split(",") if v.strip()]
    bad = [n for n in names if n not in shapes]
    if bad:
        raise SystemExit(f"bench fp8-decode: --shapes {bad[0]!r}: choose from {', '.join(shapes)}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    native = None
    rows = []
    g = torch.Generator().manual_seed(0)
    print(f"bench fp8-decode: {args.model} shapes, {torch.cuda.get_device_name(0)}, {sms} SMs, pow2 {args.pow2}, "
          f"{args.calls} calls per graph, best of {args.replays} replays")
    print(f"  {'gemm':<8} {'M':>3} {'N':>5} {'K':>5} {'bf16 us':>8} {'triton us':>9} {'x bf16':>7} {'GB/s':>6} "
          f"{'scaled_mm us':>12} {'x bf16':>7} {'gemm alone':>10} {'plan':>12} {'rel err':>8}")
    for name in names:
        n, k = shapes[name]
        w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).cuda()
        wq = quantize_fp8_blockwise(w, (128, 128), False)
        wd, ws = wq.data.contiguous(), wq.scale_inv.contiguous()
        for m in ms:
            x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16).cuda()
            row = {"gemm": name, "m": m, "n": n, "k": k, "plan": list(fd.plan(m, n, k, sms))}
            row["bf16_us"] = _graph_time(lambda x=x, w=w: F.linear(x, w), args.calls, args.replays)
            for dot in dots:
                row[f"triton_{dot}_dot_us"] = _graph_time(
                    lambda x=x, wd=wd, ws=ws, dot=dot: fd.decode_mm(x, wd, ws, args.pow2, dot=dot), args.calls,
                    args.replays)
            row["triton_us"] = row[f"triton_{dots[0]}_dot_us"]
            ref = fd.emulated_mm(x, wd, ws, args.pow2)
            row["rel_err"] = fd.rel_err(fd.decode_mm(x, wd, ws, args.pow2), ref)
            row["rel_err_fp32_out"] = fd.rel_err(fd.decode_mm(x, wd, ws, args.pow2, out_dtype=torch.float32), ref)
            if native is None:
                native = G.unavailable_reason(x, wd) is None
            if native:
                wo = G.WeightOperands(wq, wd.t())

                def path(x=x, wo=wo):
                    _, _, (xs, _) = fk.quantize_act(x, args.pow2, rows=True, grids=False)
                    return G.forward_mm(xs, wo)

                _, _, (xs0, _) = fk.quantize_act(x, args.pow2, rows=True, grids=False)
                row["scaled_mm_us"] = _graph_time(path, args.calls, args.replays)
                row["scaled_mm_gemm_us"] = _graph_time(lambda xs0=xs0, wo=wo: G.forward_mm(xs0, wo), args.calls,
                                                       args.replays)
            row["triton_x_bf16"] = row["bf16_us"] / row["triton_us"]
            row["weight_gb_s"] = n * k / row["triton_us"] / 1e3
            if "scaled_mm_us" in row:
                row["scaled_mm_x_bf16"] = row["bf16_us"] / row["scaled_mm_us"]
            if args.sweep:
                kb = -(-k // 128)
                best = None
                for stages in (3, 4, 6):
                    for bn in (32, 64, 128):
                        for sp in sorted({s for s in (1, 2, 4, 8, 16) if s <= kb}):
                            t = _graph_time(lambda x=x, wd=wd, ws=ws, bn=bn, sp=sp, st=stages: fd.decode_mm(
                                x, wd, ws, args.pow2, block_n=bn, split=sp, dot=dots[0], stages=st), args.calls, 3)
                            print(f"    sweep {name} M={m}: stages {stages}, N tile {bn}, split {sp}: {t:.2f} us",
                                  flush=True)
                            row.setdefault("sweep", []).append([stages, bn, sp, t])
                            if best is None or t < best[3]:
                                best = [stages, bn, sp, t]
                row["sweep_best"] = best
            rows.append(row)
            sm = (f"{row['scaled_mm_us']:>12.2f} {row['scaled_mm_x_bf16']:>6.2f}x {row['scaled_mm_gemm_us']:>10.2f}"
                  if "scaled_mm_us" in row else f"{'n/a':>12} {'':>7} {'':>10}")
            plan = "x".join(map(str, row["plan"]))
            other = "".join(f"  triton {d}-dot {row[f'triton_{d}_dot_us']:.2f} us" for d in dots[1:])
            print(f"  {name:<8} {m:>3} {n:>5} {k:>5} {row['bf16_us']:>8.2f} {row['triton_us']:>9.2f} "
                  f"{row['triton_x_bf16']:>6.2f}x {row['weight_gb_s']:>6.0f} {sm} {plan:>12} {row['rel_err']:>8.1e}"
                  + other
                  + (f"  sweep best: stages {row['sweep_best'][0]}, N tile {row['sweep_best'][1]}, split "
                     f"{row['sweep_best'][2]}, {row['sweep_best'][3]:.2f} us" if args.sweep else ""), flush=True)
    for m in ms:  # a decode step's four GEMMs at this M
        sel = [r for r in rows if r["m"] == m]
        tot = {p: sum(r.get(f"{p}_us", float("nan")) for r in sel) for p in ("bf16", "triton", "scaled_mm")}
        print(f"  M={m}: sum over {len(sel)} GEMMs: bf16 {tot['bf16']:.2f} us, triton {tot['triton']:.2f} us "
              f"({tot['bf16'] / tot['triton']:.2f}x bf16), scaled_mm {tot['scaled_mm']:.2f} us "
              f"({tot['bf16'] / tot['scaled_mm']:.2f}x bf16)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                       "device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1, default=str)
    return 0
