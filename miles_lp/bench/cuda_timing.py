"""One CUDA timing for the device scripts: events around one call, the median over calls."""

from __future__ import annotations

import statistics


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
