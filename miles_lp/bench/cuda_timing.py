"""CUDA timings for the benches and device scripts: events around one call (the median over calls), a call
captured many times in one CUDA graph (device time alone), and the host's time per call issued back to back."""

from __future__ import annotations

import statistics
import time


def median_us(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median microseconds of ``fn()`` on the current CUDA stream (``warmup`` calls first; each timed call between
    two events, waited for before the next). Host gaps inside one call count: for device time alone replay a CUDA
    graph (``bench fp8-decode``)."""
    import torch

    for _ in range(warmup):
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


def graph_us(fn, calls: int, replays: int, stat: str = "best") -> float:
    """Microseconds per call of ``fn`` captured ``calls`` times in one CUDA graph: the best (``stat="best"``) or the
    median (``"median"``) of ``replays`` replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return min(times) if stat == "best" else statistics.median(times)


def host_us(fn, calls: int = 50) -> float:
    """Host microseconds per call of ``fn`` issued back to back after one warm-up call (the launch path only: the GPU
    runs behind and is waited for after the clock stops)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return dt
