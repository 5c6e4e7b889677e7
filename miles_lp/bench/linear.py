"""``miles-lp bench linear``: QuantLinear forward+backward per format and backward mode vs bf16 F.linear.

Per shape (tokens M, out N, in K), mode and kernel: median forward+backward time (CUDA events, after
warm-up), the ratio to ``torch.nn.functional.linear`` in bf16, and the peak memory the step allocates beyond
its inputs. Two QuantLinear timings: ``fresh`` re-quantizes the weight every call (one micro-batch per
optimizer step), ``cached`` reuses the step's weight grid (later micro-batches of a step).

Kernels (``QuantLinear(kernel=...)``, the same bytes): ``reference`` = the codecs in eager PyTorch, then a
bf16 GEMM; ``compiled`` = ``miles_lp.train.fused`` (one ``torch.compile``'d quantize->dequantize pass per
operand; the step's dequantized weight cached with its grid), what ``kernel="auto"`` runs on CUDA. The first
warm-up call of a compiled row includes the compilation. Target for MXFP8 ``dequantized``: 1.10x bf16 at 8192^3.
FP8 blockwise (``fp8_block``): ``reference`` = the codecs and an fp32 GEMM on the decoded operands (the
emulation); ``native`` (what ``compiled`` / ``auto`` run for it on an sm_90 GPU) = the operand kernels of
``miles_lp.formats.kernels.fp8_block`` and FP8 tensor-core GEMMs (``miles_lp.train.fp8_block_gemm``): the forward
in every mode, dgrad and wgrad in ``quantized``. Targets (``quantized``): 0.70x bf16 at 8192^3, 0.90x at
2048x4096x4096, fresh and cached.

``--json FILE`` saves the rows; ``--plot PNG`` draws them; ``--from-json FILE --plot PNG`` draws a saved run
on a machine without a GPU. ``parse_table(text)`` reads a printed table back into rows.
"""

from __future__ import annotations

import re

from miles_lp import devices as cli_args

HELP = "time QuantLinear forward+backward per backward mode against bf16 F.linear (CUDA)"
DESCRIPTION = HELP + (
    "\n\nShapes: 'large' = 8192x8192x8192, 'small' = 2048x4096x4096 (tokens x out x in), 'tiny' = 256x512x512, "
    "or MxNxK. --device cpu runs a smoke test (wall-clock timer, no peak memory).")

SHAPES = {"large": (8192, 8192, 8192), "small": (2048, 4096, 4096), "tiny": (256, 512, 512)}
MODES = [("mxfp8", "high_precision"), ("mxfp8", "dequantized"), ("mxfp8", "quantized"),
         ("nvfp4", "high_precision"), ("nvfp4", "dequantized"),
         ("fp8_block", "high_precision"), ("fp8_block", "dequantized"), ("fp8_block", "quantized")]


def add_arguments(p) -> None:
    p.add_argument("--shapes", default="large,small", help="comma list of large|small|tiny|MxNxK (default: %(default)s)")
    p.add_argument("--device", type=cli_args.torch_device, default="cuda", help="cuda (default) or cpu (smoke run)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--modes", default="all", help="comma list of fmt/backward, e.g. mxfp8/dequantized (default: all)")
    p.add_argument("--kernels", default="reference,compiled",
                   help="comma list of QuantLinear kernels: reference, compiled (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows to this JSON file")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="draw the time ratio vs bf16 per shape, mode and kernel into this PNG (matplotlib)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="measure nothing: read the rows of an earlier --json run (no GPU needed), print the "
                        "table and draw --plot")
    p.add_argument("--title", default=None, help="the plot's title (default: names the device)")
    p.add_argument("--graph", action="store_true",
                   help="CUDA: also replay each compiled mode's fwd+bwd (and bf16's) as CUDA graphs "
                        "(torch.cuda.make_graphed_callables), with a bit-equality check against eager")
    p.add_argument("--host-cpu", action="store_true",
                   help="no GPU: the per-call host time of each mode on CPU with the Triton launches stubbed "
                        "(miles_lp.bench.linear_host; Python, autograd and tensor ops only)")
    p.add_argument("--host-dtype", default="bf16", choices=("bf16", "fp32"),
                   help="--host-cpu: activation/weight dtype (fp32: GEMMs cost ~nothing on CPU, so the time is "
                        "the host overhead; bf16: as on CUDA)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="instead of the table: per shape and mode, host time per call, isolated vs pipelined "
                        "time, CUDA kernels per call with their device time, host syncs (torch profiler); "
                        "written to FILE")


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
    """``run(fns, warmup, iters)`` -> the median ms of each of ``fns``, measured round-robin (one call of each
    per round), so a slow drift of the clocks (the H200 heats up under back-to-back GEMMs) moves all of them
    alike instead of favouring whichever ran first. CUDA: events around one call from an idle GPU."""
    import time

    import torch

    cuda = device.type == "cuda"

    def one(fn) -> float:
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            return a.elapsed_time(b)
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def run(fns, warmup, iters):
        for _ in range(warmup):
            for fn in fns:
                fn()
        if cuda:
            torch.cuda.synchronize()
        times = [[] for _ in fns]
        for _ in range(iters):
            for t, fn in zip(times, fns, strict=True):
                t.append(one(fn))
        return [sorted(t)[len(t) // 2] for t in times]
    return run


def _graphed(module, x, dy):
    """``step()`` running ``module``'s forward and backward as two CUDA graphs
    (``torch.cuda.make_graphed_callables``), and the graphed output / grads of one step for the byte check."""
    import torch

    g = torch.cuda.make_graphed_callables(module, (x,), num_warmup_iters=3)

    def step():
        x.grad = None
        for p in module.parameters():
            p.grad = None
        y = g(x)
        y.backward(dy)
        return y
    return step


class _Fresh:
    """A QuantLinear whose weight grid is dropped before each forward: captured in a graph, the weight
    quantization is then part of every replay (one micro-batch per optimizer step, ``fresh``)."""

    def __new__(cls, ql):
        import torch

        class Fresh(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                self.inner.grid.invalidate()
                return self.inner(x)
        return Fresh(ql)


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
                 on_row=None, graph: bool = False) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe, QuantLinear

    x, lin, dy = _setup(m, n, k, dev)

    def step(module) -> None:
        x.grad = lin.weight.grad = None
        module(x).backward(dy)

    def step_bf16() -> None:
        x.grad = lin.weight.grad = None
        F.linear(x, lin.weight).backward(dy)

    shape = f"{m}x{n}x{k}"
    rows = [dict(shape=shape, mode="bf16 F.linear", kernel="-", ms_fresh=0.0, ms_cached=0.0,
                 ratio_fresh=1.0, ratio_cached=1.0, peak_mib=_peak_mib(dev, step_bf16))]
    base_all: list[float] = []
    out_rows = []
    g_bf16 = None
    if graph:
        bf16_mod = torch.nn.Linear(k, n, bias=False, device=dev, dtype=lin.weight.dtype)
        bf16_mod.weight = lin.weight
        g_bf16 = _graphed(bf16_mod, x, dy)
    for fmt_opt, bw in modes or MODES:
        fmt, _, opt = fmt_opt.partition("+")  # fp8_block+pow2: power-of-two block scales
        recipe = LinearRecipe(Format(fmt), BackwardMode(bw), "token" if fmt == "nvfp4" else None,
                              pow2_scales=opt == "pow2")
        for kernel in kernels:
            ql = QuantLinear.from_linear(lin, recipe, canonical="bench", kernel=kernel)

            def fresh(ql=ql) -> None:
                ql.grid.invalidate()
                step(ql)

            # round-robin with the bf16 step: each ratio is to the bf16 time measured beside it
            base_ms, ms_fresh, ms_cached = timer([step_bf16, fresh, lambda ql=ql: step(ql)], warmup, iters)
            base_all.append(base_ms)
            label = "native" if fmt == "fp8_block" and kernel != "reference" else kernel
            out_rows.append(dict(shape=shape, mode=f"{fmt_opt}/{bw}", kernel=label, ms_fresh=ms_fresh,
                                 ms_cached=ms_cached, ratio_fresh=ms_fresh / base_ms,
                                 ratio_cached=ms_cached / base_ms, peak_mib=_peak_mib(dev, fresh)))
            if on_row:
                on_row(out_rows[-1])
            if kernel == "compiled" and graph:
                out_rows.append(_graph_row(ql, x, dy, lin, g_bf16, timer, warmup, iters, shape, f"{fmt_opt}/{bw}"))
                if on_row:
                    on_row(out_rows[-1])
            del ql
    base = sorted(base_all)[len(base_all) // 2] if base_all else timer([step_bf16], warmup, iters)[0]
    rows[0].update(ms_fresh=base, ms_cached=base)  # the median of the bf16 times measured beside each mode
    if on_row:
        on_row(rows[0])
    return rows + out_rows


def _graph_row(ql, x, dy, lin, g_bf16, timer, warmup, iters, shape, mode) -> dict:
    """The fwd+bwd of ``ql`` replayed as CUDA graphs vs bf16 F.linear replayed the same way: ``ms_fresh`` with the
    weight quantized in every replay (``_Fresh``), ``ms_cached`` from a graph captured with the step's grid
    already built (what later micro-batches of a step replay); ``identical``: output and both gradients of each
    graph's replay bit-equal to an eager step's."""
    import torch

    def same_as_eager(g, fresh: bool) -> bool:
        y_g = g().detach().clone()
        gx, gw = x.grad.clone(), lin.weight.grad.clone()
        if fresh:
            ql.grid.invalidate()
        x.grad = lin.weight.grad = None
        y_e = ql(x)
        y_e.backward(dy)
        return (torch.equal(y_g.view(torch.int16), y_e.detach().view(torch.int16))
                and torch.equal(gx.view(torch.int16), x.grad.view(torch.int16))
                and torch.equal(gw.view(torch.int16), lin.weight.grad.view(torch.int16)))

    g = _graphed(_Fresh(ql), x, dy)
    same = same_as_eager(g, fresh=True)
    ql(x)  # the grid is valid from here on: the cached graph never captures the weight's quantization
    g_cached = _graphed(ql, x, dy)
    same = same and same_as_eager(g_cached, fresh=False)
    base_ms, ms, ms_cached = timer([g_bf16, g, g_cached], warmup, iters)
    pipe_bf16, pipe, pipe_cached = _back_to_back([g_bf16, g, g_cached])
    return dict(shape=shape, mode=mode, kernel="graphed", ms_fresh=ms, ms_cached=ms_cached,
                ratio_fresh=ms / base_ms, ratio_cached=ms_cached / base_ms, peak_mib=None, graph_bf16_ms=base_ms,
                identical=bool(same), pipelined_ms=pipe, pipelined_cached_ms=pipe_cached, pipelined_bf16_ms=pipe_bf16,
                ratio_pipelined=pipe / pipe_bf16, ratio_pipelined_cached=pipe_cached / pipe_bf16)


def _pipelined_ms(fn, calls: int) -> float:
    """Milliseconds per call of ``calls`` calls issued back to back (the host runs ahead of the GPU)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(calls):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / calls


def _back_to_back(fns, calls: int = 20, rounds: int = 3) -> list[float]:
    """Per ``fn``, the ms per call of ``calls`` calls issued back to back (the host runs ahead of the GPU, as in a
    stack of layers: what is left is the device time and the gaps between replays), the median of ``rounds``
    alternating rounds. ``bench``'s own timer starts each call from an idle GPU, so the host's latency to the
    first kernel counts there; at small shapes that is a large part of a replay."""
    import torch

    out: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(out, fns, strict=True):
            fn()
            torch.cuda.synchronize()
            t.append(_pipelined_ms(fn, calls))
    return [sorted(t)[len(t) // 2] for t in out]


def bench(shapes, device: str = "cuda", warmup: int = 3, iters: int = 10, modes=None,
          kernels=("reference", "compiled"), on_row=None, graph: bool = False) -> list[dict]:
    """Rows of timings (see the module docstring); ``on_row(row)`` is called as each row is measured.
    ``graph`` (CUDA): also a ``graphed`` row per compiled mode (``_graph_row``)."""
    import torch

    from miles_lp.errors import BackendUnavailable

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("bench linear needs a CUDA device (none is visible); for a smoke run on this "
                                 "machine use --device cpu --shapes tiny")
    timer = _timer(dev)
    rows: list[dict] = []
    for m, n, k in shapes:
        rows += _bench_shape(m, n, k, dev, timer, warmup, iters, modes, kernels, on_row, graph=graph)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


_HEAD = (f"{'shape (MxNxK)':>16} {'mode':>22} {'kernel':>9} {'fwd+bwd ms':>11} {'x bf16':>7} {'cached ms':>10} "
         f"{'x bf16':>7} {'peak MiB':>9}")


def format_row(r) -> str:
    mem = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
    line = (f"{r['shape']:>16} {r['mode']:>22} {r['kernel']:>9} {r['ms_fresh']:>11.3f} "
            f"{r['ratio_fresh']:>6.2f}x {r['ms_cached']:>10.3f} {r['ratio_cached']:>6.2f}x {mem:>9}")
    if r.get("kernel") == "graphed":
        back = ""
        if r.get("ratio_pipelined") is not None:
            back = f"; back to back {r['ratio_pipelined']:.2f}x, {r['pipelined_ms']:.3f}"
            if r.get("ratio_pipelined_cached") is not None:
                back += f" / cached {r['ratio_pipelined_cached']:.2f}x, {r['pipelined_cached_ms']:.3f}"
            back += f" vs {r['pipelined_bf16_ms']:.3f} ms"
        line += (f"   (bf16 graphed {r['graph_bf16_ms']:.3f} ms; replay bit-equal to eager: "
                 f"{r['identical']}{back})")
    return line


def format_table(rows) -> str:
    return "\n".join([_HEAD, "-" * len(_HEAD), *(format_row(r) for r in rows)])


_ROW_RE = re.compile(r"^\s*(\d+x\d+x\d+)\s+(.+?)\s+(-|reference|compiled|graphed)\s+([\d.]+)\s+([\d.]+)x"
                     r"\s+([\d.]+)\s+([\d.]+)x\s+(-|[\d.]+)(?:\s+\(bf16 graphed.*\))?\s*$")


def parse_table(text: str) -> list[dict]:
    """The rows of a printed ``bench linear`` table (``format_table`` / the run's stdout), as ``bench`` returns
    them. Lines that are not table rows (the header, the banner) are skipped; ``peak_mib`` "-" is ``None``."""
    rows = []
    for line in text.splitlines():
        m = _ROW_RE.match(line)
        if not m:
            continue
        shape, mode, kernel, msf, rf, msc, rc, peak = m.groups()
        rows.append(dict(shape=shape, mode=mode, kernel=kernel, ms_fresh=float(msf), ms_cached=float(msc),
                         ratio_fresh=float(rf), ratio_cached=float(rc),
                         peak_mib=None if peak == "-" else float(peak)))
    return rows


def load_rows(path: str) -> list[dict]:
    """Rows written by ``--json``; ``ConfigError`` naming the file if it is not such a list."""
    import json

    from miles_lp.errors import ConfigError

    try:
        with open(path) as f:
            rows = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--from-json {path}: cannot read it ({exc}); pass a file written by "
                          "`miles-lp bench linear --json FILE`") from None
    keys = {"shape", "mode", "kernel", "ratio_fresh", "ratio_cached"}
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) and keys <= set(r) for r in rows):
        raise ConfigError(f"--from-json {path}: not a list of bench linear rows (each with {sorted(keys)}); pass "
                          "a file written by `miles-lp bench linear --json FILE`")
    return rows


def plot_linear(rows, path, title: str | None = None) -> None:
    """One panel per shape: fwd+bwd time / bf16 F.linear per mode, bars per kernel (solid: fresh weight
    quantization, light: the step's cached grid). Matplotlib Agg, imported here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    kernels = [k for k in ("reference", "compiled") if any(r["kernel"] == k for r in rows)]
    colors = {"reference": "#d62728", "compiled": "#1f77b4"}
    fig, axes = plt.subplots(len(shapes), 1, figsize=(10, 3.6 * len(shapes) + 0.6), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes, strict=True):
        sub = [r for r in rows if r["shape"] == shape and r["kernel"] != "-"]
        modes = list(dict.fromkeys(r["mode"] for r in sub))
        nb = 2 * len(kernels)
        width = 0.8 / max(nb, 1)
        top = 1.0
        for ki, kern in enumerate(kernels):
            for vi, (key, alpha, label) in enumerate((("ratio_fresh", 1.0, "fresh"), ("ratio_cached", 0.45, "cached"))):
                xs, ys = [], []
                for mi, mode in enumerate(modes):
                    r = next((r for r in sub if r["mode"] == mode and r["kernel"] == kern), None)
                    if r is not None:
                        xs.append(mi - 0.4 + width * (2 * ki + vi + 0.5))
                        ys.append(r[key])
                bars = ax.bar(xs, ys, width * 0.95, color=colors.get(kern, "gray"), alpha=alpha,
                              label=f"{kern}, {label}")
                ax.bar_label(bars, labels=[f"{y:.2f}" for y in ys], fontsize=7, padding=1)
                top = max([top, *ys])
        ax.axhline(1.0, color="black", lw=1, label="bf16 F.linear = 1")
        ax.set_xticks(range(len(modes)), modes, fontsize=9)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("time / bf16 F.linear")
        bf = next((r for r in rows if r["shape"] == shape and r["kernel"] == "-"), None)
        extra = f" (bf16 fwd+bwd {bf['ms_fresh']:.3f} ms)" if bf else ""
        ax.set_title(f"{shape} (tokens x out x in){extra}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=8, ncol=len(kernels) * 2 + 1, loc="upper left")
    fig.suptitle(title or "QuantLinear forward+backward time relative to bf16 (lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _setup(m: int, n: int, k: int, dev):
    """(x, linear, dy): seeded bf16 operands for one shape (x requires grad)."""
    import torch

    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dev, dtype).requires_grad_()
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g).to(dev, dtype) * 0.02)
    dy = torch.randn(m, n, generator=g).to(dev, dtype)
    return x, lin, dy


def profile_step(fn, dev, calls: int = 20) -> dict:
    """What one call of ``fn`` (a fwd+bwd step) costs, split into host and device (METHOD.md: launches,
    host time, device time). On CUDA:

    * ``host_us``: median wall time of the call itself, no synchronisation inside (what the Python, autograd
      and launch path cost; the GPU runs behind);
    * ``isolated_ms``: events around one call from an idle GPU (what ``bench`` reports: host latency to the
      first kernel included);
    * ``pipelined_ms``: ``calls`` back-to-back calls / ``calls`` (the host runs ahead, as in a model's
      layer stack; equals the device time when the host is faster);
    * ``kernels``: CUDA kernels (and memsets / copies) per call, ``device_us`` their summed duration per call
      (torch profiler), ``top``: the kernels by device time;
    * ``syncs``: host synchronisations one call makes (``torch.cuda.set_sync_debug_mode``).
    """
    import time
    import warnings

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    host = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    iso = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        iso.append(a.elapsed_time(b))
    pipelined = _pipelined_ms(fn, calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    syncs = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    n_prof = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n_prof):
            fn()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per.setdefault(e.name, []).append(e.device_time_total if hasattr(e, "device_time_total")
                                              else e.cuda_time_total)
    n_k = sum(len(v) for v in per.values()) / n_prof
    dev_us = sum(sum(v) for v in per.values()) / n_prof
    top = sorted(((sum(v) / n_prof, len(v) / n_prof, name) for name, v in per.items()), reverse=True)[:12]
    host.sort()
    iso.sort()
    return dict(host_us=host[len(host) // 2], isolated_ms=iso[len(iso) // 2], pipelined_ms=pipelined,
                kernels=n_k, device_us=dev_us, syncs=syncs,
                top=[dict(us=us, per_call=c, name=name[:90]) for us, c, name in top], host_top=_host_top(fn))


def _host_top(fn, calls: int = 30, n: int = 10) -> list[dict]:
    """Where a call's host time goes: cProfile over ``calls`` calls, the ``n`` largest own times (us per call;
    cProfile's own overhead inflates them, the ranking is what counts)."""
    import cProfile
    import pstats

    import torch

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, nc, tt, _ct, _callers) in st.stats.items():
        rows.append((tt / calls * 1e6, nc / calls, f"{file.rsplit('/', 2)[-1]}:{line}({func})"))
    rows.sort(reverse=True)
    return [dict(us=us, per_call=c, name=name[:90]) for us, c, name in rows[:n]]


def _profile_cases(m: int, n: int, k: int, dev, modes) -> list[tuple[str, object]]:
    """(name, step) for bf16 F.linear and each QuantLinear mode at one shape, its weight grid fresh (quantized in
    every call) and cached."""
    import torch.nn.functional as F

    from miles_lp.formats.spec import BackwardMode, Format
    from miles_lp.train.quant_linear import LinearRecipe, QuantLinear

    x, lin, dy = _setup(m, n, k, dev)

    def bf16_step() -> None:
        x.grad = lin.weight.grad = None
        F.linear(x, lin.weight).backward(dy)

    cases = [("bf16 F.linear", bf16_step)]
    for fmt_opt, bw in modes or MODES:
        fmt, _, opt = fmt_opt.partition("+")  # fp8_block+pow2: power-of-two block scales
        recipe = LinearRecipe(Format(fmt), BackwardMode(bw), "token" if fmt == "nvfp4" else None,
                              pow2_scales=opt == "pow2")
        ql = QuantLinear.from_linear(lin, recipe, canonical="bench", kernel="compiled")

        def fresh(ql=ql) -> None:
            ql.grid.invalidate()
            x.grad = lin.weight.grad = None
            ql(x).backward(dy)

        def cached(ql=ql) -> None:  # the weight's grid kept from the last call (one step's micro-batches)
            x.grad = lin.weight.grad = None
            ql(x).backward(dy)

        cases += [(f"{fmt_opt}/{bw}", fresh), (f"{fmt_opt}/{bw} cached", cached)]
    return cases


def profile(shapes, device: str = "cuda", modes=None, on_line=print) -> list[dict]:
    """``profile_step`` of bf16 F.linear and each QuantLinear mode (fresh and cached weight grid) per shape."""
    import torch

    dev = torch.device(device)
    out = []
    for m, n, k in shapes:
        for name, fn in _profile_cases(m, n, k, dev, modes):
            r = dict(shape=f"{m}x{n}x{k}", mode=name, **profile_step(fn, dev))
            out.append(r)
            on_line(f"{r['shape']:>16} {name:>22}: host {r['host_us']:7.1f} us/call, isolated "
                    f"{r['isolated_ms']:.3f} ms, pipelined {r['pipelined_ms']:.3f} ms, {r['kernels']:.0f} kernels "
                    f"= {r['device_us']:.1f} us device, {r['syncs']} host syncs")
            for t in r["top"]:
                on_line(f"{'':>20} {t['us']:9.1f} us  x{t['per_call']:.0f}  {t['name']}")
            on_line(f"{'':>20} host (cProfile own time per call):")
            for t in r["host_top"]:
                on_line(f"{'':>20} {t['us']:9.1f} us  x{t['per_call']:.0f}  {t['name']}")
        torch.cuda.empty_cache()
    return out


def run(args) -> int:
    import json

    import torch

    if args.from_json:
        rows = load_rows(args.from_json)
        print(format_table(rows))
        if args.plot:
            plot_linear(rows, args.plot, title=args.title)
            print(f"plot: {args.plot}")
        return 0
    shapes = [_parse_shape(s.strip()) for s in args.shapes.split(",") if s.strip()]
    modes = None if args.modes == "all" else [tuple(m.split("/")) for m in args.modes.split(",")]
    if args.host_cpu:
        from miles_lp.bench import linear_host

        rows = linear_host.host_rows(modes or MODES, dtype=args.host_dtype)
        print(linear_host.format_rows(rows, 32, args.host_dtype))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if args.profile:
        from miles_lp.errors import BackendUnavailable

        if not (args.device.startswith("cuda") and torch.cuda.is_available()):
            raise BackendUnavailable("bench linear --profile needs a CUDA device (none is visible)")
        with open(args.profile, "w") as f:
            def line(text: str) -> None:
                print(text, flush=True)
                f.write(text + "\n")

            rows = profile(shapes, args.device, modes, on_line=line)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
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
                 on_row=lambda r: print(format_row(r), flush=True), graph=args.graph)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot_linear(rows, args.plot,
                    title=args.title or f"QuantLinear fwd+bwd time / bf16 F.linear ({dev}, lower is better)")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":  # python -m miles_lp.bench.linear (until `miles-lp bench` dispatches here)
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="miles-lp bench linear", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
