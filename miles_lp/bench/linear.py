"""``miles-lp bench linear``: QuantLinear forward+backward per format and backward mode vs bf16 F.linear.

Per shape (tokens M, out N, in K), mode and kernel: median forward+backward time (CUDA events, after
warm-up), the ratio to ``torch.nn.functional.linear`` in bf16, and the peak memory the step allocates beyond
its inputs. Two QuantLinear timings: ``fresh`` re-quantizes the weight every call (one micro-batch per
optimizer step), ``cached`` reuses the step's weight grid (later micro-batches of a step).

Kernels (``QuantLinear(kernel=...)``, the same bytes): ``reference`` = the codecs in eager PyTorch, then a
bf16 GEMM; ``compiled`` = ``miles_lp.train.fused`` (one ``torch.compile``'d quantize->dequantize pass per
operand; the step's dequantized weight cached with its grid), what ``kernel="auto"`` runs on CUDA. The first
warm-up call of a compiled row includes the compilation. Target for MXFP8 ``dequantized``: 1.10x bf16 at 8192^3.
"""

from __future__ import annotations

HELP = "time QuantLinear forward+backward per backward mode against bf16 F.linear (CUDA)"
DESCRIPTION = HELP + (
    "\n\nShapes: 'large' = 8192x8192x8192, 'small' = 2048x4096x4096 (tokens x out x in), 'tiny' = 256x512x512, "
    "or MxNxK. --device cpu runs a smoke test (wall-clock timer, no peak memory).")

SHAPES = {"large": (8192, 8192, 8192), "small": (2048, 4096, 4096), "tiny": (256, 512, 512)}
MODES = [("mxfp8", "high_precision"), ("mxfp8", "dequantized"), ("mxfp8", "quantized"),
         ("nvfp4", "high_precision"), ("nvfp4", "dequantized")]


def add_arguments(p) -> None:
    p.add_argument("--shapes", default="large,small", help="comma list of large|small|tiny|MxNxK (default: %(default)s)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--modes", default="all", help="comma list of fmt/backward, e.g. mxfp8/dequantized (default: all)")
    p.add_argument("--kernels", default="reference,compiled",
                   help="comma list of QuantLinear kernels: reference, compiled (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def _parse_shape(text: str) -> tuple[int, int, int]:
    from miles_lp.errors import ConfigError

    if text in SHAPES:
        return SHAPES[text]
    try:
        m, n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--shapes: '{text}' is not large, small, tiny or MxNxK") from None
    return m, n, k


def _timer(device):
    import time

    import torch

    if device.type == "cuda":
        def run(fn, warmup, iters):
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            return sorted(times)[len(times) // 2]
    else:
        def run(fn, warmup, iters):
            for _ in range(warmup):
                fn()
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            return sorted(times)[len(times) // 2]
    return run


def _peak_mib(device, fn) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _bench_shape(m: int, n: int, k: int, dev, timer, warmup: int, iters: int, modes, kernels,
                 on_row=None) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe, QuantLinear

    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dev, dtype).requires_grad_()
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g).to(dev, dtype) * 0.02)
    dy = torch.randn(m, n, generator=g).to(dev, dtype)

    def step(module) -> None:
        x.grad = lin.weight.grad = None
        module(x).backward(dy)

    def step_bf16() -> None:
        x.grad = lin.weight.grad = None
        F.linear(x, lin.weight).backward(dy)

    shape = f"{m}x{n}x{k}"
    base_ms = timer(step_bf16, warmup, iters)
    rows = [dict(shape=shape, mode="bf16 F.linear", kernel="-", ms_fresh=base_ms, ms_cached=base_ms,
                 ratio_fresh=1.0, ratio_cached=1.0, peak_mib=_peak_mib(dev, step_bf16))]
    if on_row:
        on_row(rows[-1])
    for fmt, bw in modes or MODES:
        recipe = LinearRecipe(Format(fmt), BackwardMode(bw), "token" if fmt == "nvfp4" else None)
        for kernel in kernels:
            ql = QuantLinear.from_linear(lin, recipe, canonical="bench", kernel=kernel)

            def fresh(ql=ql) -> None:
                ql.grid.invalidate()
                step(ql)

            ms_fresh = timer(fresh, warmup, iters)
            ms_cached = timer(lambda ql=ql: step(ql), warmup, iters)
            rows.append(dict(shape=shape, mode=f"{fmt}/{bw}", kernel=kernel, ms_fresh=ms_fresh,
                             ms_cached=ms_cached, ratio_fresh=ms_fresh / base_ms,
                             ratio_cached=ms_cached / base_ms, peak_mib=_peak_mib(dev, fresh)))
            if on_row:
                on_row(rows[-1])
            del ql
    return rows


def bench(shapes, device: str = "cuda", warmup: int = 3, iters: int = 10, modes=None,
          kernels=("reference", "compiled"), on_row=None) -> list[dict]:
    """Rows of timings (see the module docstring); ``on_row(row)`` is called as each row is measured."""
    import torch

    from miles_lp.errors import BackendUnavailable

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("bench linear needs a CUDA device (none is visible); for a smoke run on this "
                                 "machine use --device cpu --shapes tiny")
    timer = _timer(dev)
    rows: list[dict] = []
    for m, n, k in shapes:
        rows += _bench_shape(m, n, k, dev, timer, warmup, iters, modes, kernels, on_row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


_HEAD = (f"{'shape (MxNxK)':>16} {'mode':>22} {'kernel':>9} {'fwd+bwd ms':>11} {'x bf16':>7} {'cached ms':>10} "
         f"{'x bf16':>7} {'peak MiB':>9}")


def format_row(r) -> str:
    mem = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
    return (f"{r['shape']:>16} {r['mode']:>22} {r['kernel']:>9} {r['ms_fresh']:>11.3f} "
            f"{r['ratio_fresh']:>6.2f}x {r['ms_cached']:>10.3f} {r['ratio_cached']:>6.2f}x {mem:>9}")


def format_table(rows) -> str:
    return "\n".join([_HEAD, "-" * len(_HEAD), *(format_row(r) for r in rows)])


def run(args) -> int:
    import json

    import torch

    shapes = [_parse_shape(s.strip()) for s in args.shapes.split(",") if s.strip()]
    modes = None if args.modes == "all" else [tuple(m.split("/")) for m in args.modes.split(",")]
    kernels = [kn.strip() for kn in args.kernels.split(",") if kn.strip()]
    bad = [kn for kn in kernels if kn not in ("reference", "compiled")]
    if bad or not kernels:
        from miles_lp.errors import ConfigError

        raise ConfigError(f"--kernels: {bad or args.kernels!r} not in reference, compiled")
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    print(f"bench linear: torch {torch.__version__}, {dev}, bf16 activations and weights; 'x bf16' = time / "
          "bf16 F.linear fwd+bwd of the same shape; fresh = weight re-quantized each call, cached = the step's "
          "grid reused; kernel reference = eager codecs, compiled = torch.compile'd fused quantize->dequantize "
          "(same bytes)")
    print(_HEAD)
    print("-" * len(_HEAD), flush=True)
    rows = bench(shapes, args.device, args.warmup, args.iters, modes, kernels,
                 on_row=lambda r: print(format_row(r), flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":  # python -m miles_lp.bench.linear (until `miles-lp bench` dispatches here)
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="miles-lp bench linear", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
