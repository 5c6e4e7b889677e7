"""C3's rotating layer as a replayed CUDA graph (the checks' share of a sync).

The rotating probe (``ReferenceSelfCheck._c3_rotating``) reaches a different layer every sync, so a graph captured on
the layer itself would be captured anew every sync. Instead, one graph is kept per layer *configuration* (the
experts of a projection share one) and reads a private stand-in: before each replay the live layer's canonical
tensors and the derived tensors its kernel reads are copied into the stand-in (one ``_foreach_copy_``: a few
launches, whatever the layer), then the graph runs the serving GEMM on the stand-in, derives the state afresh
from the copied canonical bytes, runs the same GEMM on that, and the float64 reference GEMM. The figures are the
eager ones (rel_err against the float64 GEMM, fresh_diff against the fresh derivation), because the serving
kernel is a pure function of exactly those copied tensors and the layer's kernel configuration, which the
stand-in must share (checked at every replay: kernel format, derived names, shapes and dtypes; anything else is
answered eager). A graph is kept only if its first replay equals the eager figures bit for bit, and every
``RECHECK``-th replay is compared with eager again; a mismatch turns the graph off for that configuration.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from miles_lp.rollout import graph_capture
from miles_lp.rollout.reference.c3_layer import input_key
from miles_lp.rollout.self_check import dequantize_exact, fresh_diff, rel_err

RECHECK = 64
# a configuration whose float64 reference weight is larger is answered eager: its graph's pool would keep that
# much device memory (and ~2 layer copies) for good, where the eager path frees it after each probe
MAX_REFERENCE_BYTES = 512 << 20


@dataclasses.dataclass
class _Entry:
    serve: Any  # EngineLinear stand-in: its canonical and derived tensors receive the live layer's
    fresh: Any  # EngineLinear whose derived state the graph rebuilds from the stand-in's canonical tensors
    x: torch.Tensor  # the probe the graph reads (the engine's cached rotating probe)
    x64: torch.Tensor  # its float64 copy (read by the graph: held here)
    grid: tuple | None  # the probe on the activation grids, when computed outside the graph (held here)
    dsts: list[torch.Tensor]  # stand-in canonical (canonical_specs order), then derived (sorted names)
    sig: tuple  # (kernel format, derived names, ((shape, dtype) per destination))
    graph: Any
    out: torch.Tensor  # [rel_err, fresh_diff], float64, written by each replay
    replays: int = 0


def _sources(layer) -> tuple[list[torch.Tensor], tuple]:
    """The live tensors the rotating probe reads, in the stand-in's order, and their signature."""
    names = sorted(layer._derived)
    srcs = list(layer.canonical().values()) + [getattr(layer, n) for n in names]
    return srcs, (layer.kernel_format, tuple(names),
                  tuple((tuple(t.shape), t.dtype, t.device, t.stride()) for t in srcs))


def _probe_grid(serve, fresh, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The probe on the stand-in's and the fresh copy's activation grids, computed once, outside the graph, where
    it depends on ``x`` and the grid key alone (``activation_mode`` ``plan``; the quantizers' host-side constants
    could not be captured); None for a static-scale mode (``vllm``: it reads the layer's copied input scale, so
    the graph quantizes it at each replay)."""
    if serve.activation_mode != "plan" or fresh.activation_mode != "plan":
        return None
    with torch.no_grad():
        xq = serve.quantize_input_uncached(x)
        return xq, (xq if input_key(fresh) == input_key(serve) else fresh.quantize_input_uncached(x))


def serving_and_fresh(serve, fresh, x: torch.Tensor,
                      grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``serve``'s kernel on ``x``, and the same kernel on ``fresh`` after its canonical tensors are set to
    ``serve``'s and its derived state is rebuilt from them (equal when ``serve``'s derived state is current). No
    host synchronisation: capturable. ``grid``: the probe already on both activation grids (``_probe_grid``)."""
    with torch.no_grad():
        for suffix, t in fresh.canonical().items():
            t.copy_(getattr(serve, suffix))
        fresh.process_weights_after_loading()
        if grid is not None:
            xq, fq = grid
        else:
            xq = serve.quantize_input_uncached(x)
            fq = xq if input_key(fresh) == input_key(serve) else fresh.quantize_input_uncached(x)
        return serve.gemm(xq, x.dtype), fresh.gemm(fq, x.dtype)


def figures(serve, fresh, x: torch.Tensor, x64: torch.Tensor,
            grid: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """C3's rotating figures, float64 ``[rel_err, fresh_diff]``: ``serve``'s kernel vs a float64 GEMM on its
    dequantized canonical weights, and vs the fresh derivation (``serving_and_fresh``). The eager path runs it on
    the live layer, the graph on the stand-in (no host synchronisation: capturable)."""
    y, y_fresh = serving_and_fresh(serve, fresh, x, grid)
    with torch.no_grad():
        y, y_fresh = y.double(), y_fresh.double()
        ref = x64 @ dequantize_exact(serve.decoded(), torch.float64).T
        return torch.stack([rel_err(y, ref), fresh_diff(y, y_fresh)])


def new_pool():
    return torch.cuda.graph_pool_handle()


def capture(fn: Callable[[], torch.Tensor], pool) -> tuple[Any, torch.Tensor]:
    """``fn``'s device work as a CUDA graph in memory pool ``pool``: (the graph, the tensor ``fn`` returned, which
    every ``graph.replay()`` rewrites). Capture errors of other threads (a parked generation) are not its own."""
    with graph_capture.CAPTURE_LOCK:  # one capture at a time in the process (graph_capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with graph_capture.capturing(graph, pool):
            out = fn()
    return graph, out


def same_figures(a: list[float], b: list[float]) -> bool:
    """Bit-for-bit equal figure lists (NaN equal to NaN: a NaN figure is a failing one on both sides)."""
    return all(p == q or (p != p and q != q) for p, q in zip(a, b, strict=True))


class RotatingGraphs:
    """Per configuration: the stand-in, its graph, and the replay count; ``off`` names why a configuration is
    answered eager. ``pending``: a replay queued by ``launch`` (``self_check_begin``), collected by ``values``."""

    def __init__(self):
        self.entries: dict[tuple, _Entry] = {}
        self.off: dict[tuple, str] = {}
        self.pool = None  # one memory pool for every configuration's graph (they are never replayed at once)
        self.pending: tuple | None = None  # (layer, weight version, entry)

    def launch(self, cfg: tuple, layer, version: int) -> bool:
        """Copy ``layer``'s live tensors into its configuration's stand-in and replay the graph (no wait)."""
        self.pending = None
        ent = self.entries.get(cfg)
        if ent is None:
            return False
        srcs, sig = _sources(layer)
        if sig != ent.sig:
            return False
        torch._foreach_copy_(ent.dsts, srcs)
        ent.graph.replay()
        self.pending = (layer, version, ent)
        return True

    def values(self, cfg: tuple, layer, x: torch.Tensor, version: int,
               eager: Callable[[], list[float]]) -> tuple[list[float], str]:
        """``[rel_err, fresh_diff]`` of ``layer`` on probe ``x`` and how they were computed; ``eager()`` gives the
        eager figures (used for a capture, every ``RECHECK``-th replay, and whatever the graph cannot answer)."""
        pending, self.pending = self.pending, None
        why = self.off.get(cfg)
        if why is not None:
            return eager(), "eager (" + why + ")"
        ent = self.entries.get(cfg)
        if ent is None:
            return self._capture(cfg, layer, x, eager)
        if ent.x is not x:  # another seed's probe: captured again on it
            del self.entries[cfg]
            return self._capture(cfg, layer, x, eager)
        srcs, sig = _sources(layer)
        if sig != ent.sig:  # the live layer's kernel configuration is not the stand-in's (a format or layout change)
            return eager(), "eager (the layer's kernel state differs from the kept stand-in's)"
        ent.replays += 1
        if not (pending is not None and pending[0] is layer and pending[1] == version and pending[2] is ent):
            torch._foreach_copy_(ent.dsts, srcs)
            ent.graph.replay()
            how = "graph replay"
        else:
            how = "graph replay (queued early)"
        got = ent.out.tolist()
        if ent.replays % RECHECK:
            return got, how
        vals = eager()
        if same_figures(got, vals):
            return vals, how + " (checked against eager)"
        self._turn_off(cfg, f"replay {got} != eager {vals} after {ent.replays} replays")
        return vals, "eager (" + self.off[cfg] + ")"

    def prepare(self, cfg: tuple, layer, x: torch.Tensor, eager: Callable[[], list[float]]) -> None:
        """Capture ``cfg``'s graph now (on ``layer``) unless it exists or is off: the engine captures every
        configuration at a full-compare sync, so that the normal syncs after it only replay."""
        if cfg not in self.entries and cfg not in self.off:
            self._capture(cfg, layer, x, eager)

    def _turn_off(self, cfg: tuple, why: str) -> None:
        self.entries.pop(cfg, None)
        self.off[cfg] = why

    def _capture(self, cfg: tuple, layer, x: torch.Tensor, eager: Callable[[], list[float]]) -> tuple[list[float], str]:
        vals = eager()
        if len(self.entries) + len(self.off) >= 32:  # configurations: a handful per model; bound the graphs kept
            return vals, "eager"
        ref_bytes = 8 * layer.in_features * layer.out_features
        if ref_bytes > MAX_REFERENCE_BYTES:
            self.off[cfg] = f"not kept as a graph: its float64 reference weight is {ref_bytes >> 20} MiB"
            return vals, "eager (" + self.off[cfg] + ")"
        try:
            serve = layer.detached_copy()
            serve.process_weights_after_loading()
            fresh = layer.detached_copy()
            fresh.process_weights_after_loading()
            srcs, sig = _sources(layer)
            dsts = list(serve.canonical().values()) + [getattr(serve, n) for n in sig[1]]
            if _sources(serve)[1] != sig:
                self.off[cfg] = "a fresh stand-in's kernel state differs from the layer's"
                return vals, "eager (" + self.off[cfg] + ")"
            x64 = x.double()
            torch._foreach_copy_(dsts, srcs)
            grid = _probe_grid(serve, fresh, x)
            figures(serve, fresh, x, x64, grid)  # warm-up outside the capture (kernel selection, lazy state)
            if self.pool is None:
                self.pool = new_pool()
            graph, out = capture(lambda: figures(serve, fresh, x, x64, grid), self.pool)
            torch._foreach_copy_(dsts, srcs)
            # figures are >= 0 (or NaN): a graph that recorded nothing cannot pass the check below with values
            # left from the capture
            out.fill_(-1.0)
            graph.replay()
            got = out.tolist()
        except Exception as exc:  # noqa: BLE001 (any capture failure: the eager path stays exact)
            self.off[cfg] = f"capture failed: {type(exc).__name__}: {str(exc)[:160]}"
            return vals, "eager (" + self.off[cfg] + ")"
        if not same_figures(got, vals):
            self.off[cfg] = f"first replay {got} != eager {vals}"
            return vals, "eager (" + self.off[cfg] + ")"
        self.entries[cfg] = _Entry(serve, fresh, x, x64, grid, dsts, sig, graph, out)
        return vals, "eager, graph captured"
