"""The reference engine's C3 self-check (``ReferenceEngine``'s third job): its serving kernels probed with the
shared probe (``miles_lp.rollout.self_check``: inputs, figures, rotation, pass rule), and the CUDA graphs that
make it cheap enough to run every sync.

Every sync: the first quantized dense layer and the first quantized expert (the fixed pair), plus one layer more
that rotates by weight version through every quantized layer (``_c3_rotation``), so stale derived state of any
layer shows within a bounded number of syncs; on the full-compare syncs, every layer at once
(``self_check_every_layer``). On CUDA the fixed pair's ~100 kernels are one captured graph replayed while what it
reads stays put (``_c3_values``), and the rotating layer one graph per layer configuration (``rotating_graph``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from miles_lp.config import switch
from miles_lp.formats.spec import Format
from miles_lp.rollout import graph_capture
from miles_lp.rollout.layers import EngineLinear, LinearStack
from miles_lp.rollout.reference import rotating_graph
from miles_lp.rollout.reference.c3_layer import fresh_config, freshly_derived, input_key
from miles_lp.rollout.reference.introspect import live_attr
from miles_lp.rollout.self_check import (
    TOLERANCE,
    dequantize_exact,
    fresh_diff,
    interleave,
    passes,
    probe_inputs,
    rel_err,
    rotating_input,
)

PROBE_ROWS = 16  # tokens per probe
RECHECK = 64  # every this many C3 graph replays, one is also run eager and compared bit for bit


def c3_guarded(fn):
    """One self-check at a time (the server's handler threads share the probes, the stand-ins and the graphs), run
    on the engine's own CUDA device: a handler thread's current device is 0 whatever the engine's, and a capture on
    another device's stream records nothing while the ops run eagerly."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        dev = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with self._c3_lock, dev:
            return fn(self, *args, **kwargs)
    return run


class ReferenceSelfCheck:
    """``ReferenceEngine``'s C3. Reads the layer lists (``_linears``, ``_stacks``, ``_singles``), ``device``,
    ``act_dtype``, ``weight_version`` and ``c3_rotation_base``; holds its probes, private copies and graphs in
    the instance dict (``_probe_cache``, ``_fresh_cache``, ``_c3_graph``, ``_rot_graph_state``, ...) under
    ``_c3_lock``."""

    _linears: list[EngineLinear]
    _stacks: list[LinearStack]
    _singles: list[EngineLinear]
    device: torch.device
    act_dtype: torch.dtype
    weight_version: int
    c3_rotation_base: int

    @c3_guarded
    def self_check_begin(self, seed: int = 0) -> bool:
        """Start the self-check's device work now, when it is a captured graph whose key still holds (CUDA): the
        replay is queued and ``self_check(seed)`` collects it, so it runs while the caller does host work (the
        sync's C4 pointer walk). Returns whether a replay was queued. Dropped by any weight update (the
        replay must read the bytes ``self_check`` is asked about) and checked again at collection."""
        self.__dict__["_c3_pending"] = None
        rot = self.__dict__.get("_rot_graph_state")
        if rot is not None:
            rot.pending = None
        if not self._graphs_on() or (self.__dict__.get("_c3_graph") is None and rot is None):
            return False
        work, _ = self._c3_work(seed)
        queued = False
        if rot is not None:  # the rotating layer's replay, when its stand-in's graph exists
            layer = self._rotating_layer({layer for _, layer, _, _ in work})
            queued = layer is not None and rot.launch(fresh_config(layer)[1:], layer, self.weight_version)
        key = self._c3_key(work) if work else None
        g = self.__dict__.get("_c3_graph")
        if key is None or g is None or g[0] != key or self.__dict__.get("_c3_graph_off") is not None:
            return queued
        g[1].replay()
        self.__dict__["_c3_pending"] = (seed, key, g, self.weight_version)
        return True

    def _c3_work(self, seed: int) -> tuple[list[tuple], dict[str, Any]]:
        """The self-check's layers and probes: [(kind, layer, x, x64)] and the result skeleton."""
        dense = expert = None
        for layer in self._linears:  # the first quantized dense layer and the first quantized expert
            if layer.kernel_format is None or not layer.kernel_format.quantized or layer.disk_format is Format.BF16:
                continue
            if ".experts." in f".{layer.prefix}":
                expert = expert or layer
            else:
                dense = dense or layer
            if dense is not None and expert is not None:
                break
        out: dict[str, Any] = {"tolerance": TOLERANCE, "layers": {}, "skipped": []}
        probes = self._probes(seed, dense, expert)
        work = []  # (kind, layer, probe x, its float64 copy)
        for kind, layer in (("dense", dense), ("expert", expert)):
            if layer is None:
                out["skipped"].append(f"no quantized {kind} layer")
                continue
            work.append((kind, layer, *probes[kind]))
            out["layers"][f"{layer.prefix}weight"] = {"kind": kind, "format": layer.kernel_format.value}
        return work, out

    @c3_guarded
    def self_check(self, seed: int = 0) -> dict[str, Any]:
        """C3: one quantized dense layer and one quantized expert through the serving ``apply`` on random input,
        vs a float64 GEMM on the dequantized canonical weights; relative Frobenius error per layer."""
        self.__dict__["_rot_seed"] = seed  # the probes the rotating graphs are prepared with (every-layer pass)
        work, out = self._c3_work(seed)
        pending = self.__dict__.get("_c3_pending")
        self.__dict__["_c3_pending"] = None
        if work:  # one device->host transfer for both layers' figures (float64: the values float() gives)
            vals, out["graph"] = self._c3_values(work, pending if pending and pending[0] == seed else None)
            for i, v in enumerate(out["layers"].values()):
                v["rel_err"], v["fresh_diff"] = vals[2 * i], vals[2 * i + 1]
        rot = self._c3_rotating(seed, {layer for _, layer, _, _ in work})
        if rot is not None:
            layer, rel, diff, how = rot
            out["layers"][f"{layer.prefix}weight"] = {"kind": "rotating", "format": layer.kernel_format.value,
                                                      "rel_err": rel, "fresh_diff": diff, "graph": how}
        out["ok"] = passes(out["layers"].values())
        return out

    def _c3_rotation(self) -> list[EngineLinear]:
        """Every quantized layer, interleaved across projections (stacks) so that consecutive syncs probe
        different projections: each projection within a few syncs, each layer within ``len()`` syncs."""
        rot = self.__dict__.get("_c3_rotation_list")
        if rot is None:
            def quantized(m):
                return m.kernel_format is not None and m.kernel_format.quantized and m.disk_format is not Format.BF16
            groups = [[m for m in st.layers if quantized(m)] for st in self._stacks]
            groups += [[m] for m in self._singles if quantized(m)]
            rot = self.__dict__["_c3_rotation_list"] = interleave(groups)
        return rot

    @c3_guarded
    def self_check_every_layer(self) -> dict[str, dict[str, Any]]:
        """C3 over every quantized layer: the serving kernel vs the same kernel on state derived afresh from its
        canonical tensors (``fresh_diff``, exactly 0 when healthy), ``{<module>.weight: {...}}``. The cost of one
        more ``finish``: run on the full-compare syncs (the initial one, after a restart), not every step."""
        out = {}
        for layer in self._c3_rotation():
            y, y_fresh = self._serving_and_fresh(layer, self._rot_probe(0, layer.in_features))
            d = fresh_diff(y, y_fresh)
            out[f"{layer.prefix}weight"] = {"kind": "every", "format": layer.kernel_format.value, "fresh_diff": d}
        if out:
            vals = torch.stack([v["fresh_diff"] for v in out.values()]).tolist()  # one device -> host transfer
            for v, d in zip(out.values(), vals, strict=True):
                v["fresh_diff"] = d
        if self._graphs_on():  # the rotating probe's graphs, one per layer configuration, captured here once
            rot = self._rot_graphs()
            for layer in self._c3_rotation():
                x = self._rot_probe(self.__dict__.get("_rot_seed", 0), layer.in_features)
                rot.prepare(fresh_config(layer)[1:], layer, x,
                            lambda layer=layer, x=x: self._c3_rotating_eager(layer, x))
        return out

    def _rotating_scratch(self, layer: EngineLinear) -> EngineLinear:
        """A private copy of ``layer``'s configuration, one kept per configuration but prefix (the experts of a
        projection share one): no module built per sync. ``rotating_graph.serving_and_fresh`` sets its canonical
        tensors and rebuilds its derived state at each use."""
        cfg = fresh_config(layer)[1:]
        cache = self.__dict__.setdefault("_rot_scratch", {})
        fresh = cache.get(cfg)
        if fresh is None:
            fresh = cache[cfg] = layer.detached_copy()
        return fresh

    def _rot_probe(self, seed: int, width: int) -> torch.Tensor:
        """The rotating / every-layer probe input of ``width`` features: the same tensor every sync."""
        key = (seed, width, self.device, self.act_dtype)
        probes = self.__dict__.setdefault("_rot_probes", {})
        x = probes.get(key)
        if x is None:
            x = rotating_input(seed, width, PROBE_ROWS).to(self.device, self.act_dtype)
            if len(probes) > 16:
                probes.clear()
            probes[key] = x
        return x

    def _serving_and_fresh(self, layer: EngineLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s serving kernel on ``x``, and the same kernel on state derived afresh from its canonical
        tensors (equal when healthy)."""
        return rotating_graph.serving_and_fresh(layer, self._rotating_scratch(layer), x)

    def _c3_rotating(self, seed: int, fixed: set) -> tuple[EngineLinear, float, float, str] | None:
        """C3 beyond its fixed pair: one more layer per sync, the next of ``_c3_rotation`` (by weight version),
        its serving kernel vs a float64 GEMM of its dequantized canonical weights (rel_err) and vs the same kernel
        on state derived afresh from its canonical tensors (fresh_diff, exactly 0 when healthy), so stale derived
        state of any layer shows within a bounded number of syncs. On CUDA a graph per layer configuration
        (``rotating_graph``: the live tensors copied into a kept stand-in, then one replay); else eager, on a
        kept scratch copy per layer configuration. Returns (layer, rel_err, fresh_diff, how)."""
        layer = self._rotating_layer(fixed)
        if layer is None:
            return None
        x = self._rot_probe(seed, layer.in_features)
        if self._graphs_on():
            figs, how = self._rot_graphs().values(fresh_config(layer)[1:], layer, x, self.weight_version,
                                                  lambda: self._c3_rotating_eager(layer, x))
        else:
            figs, how = self._c3_rotating_eager(layer, x), "eager"
        return layer, figs[0], figs[1], how

    def _rotating_layer(self, fixed: set) -> EngineLinear | None:
        rot = self._c3_rotation()
        if not rot:
            return None
        layer = rot[(self.weight_version + self.c3_rotation_base) % len(rot)]
        return None if layer in fixed else layer

    def _graphs_on(self) -> bool:
        return self.device.type == "cuda" and switch("sync_graphs")

    def _rot_graphs(self):
        g = self.__dict__.get("_rot_graph_state")
        if g is None:
            g = self.__dict__["_rot_graph_state"] = rotating_graph.RotatingGraphs()
        return g

    def _c3_rotating_eager(self, layer: EngineLinear, x: torch.Tensor) -> list[float]:
        return rotating_graph.figures(layer, self._rotating_scratch(layer), x, x.double()).tolist()

    def _c3_figures(self, work: list[tuple]) -> torch.Tensor:
        """Per layer of ``work``: rel_err and fresh_diff (float64, stacked, on the engine's device; no host
        synchronisation, so the whole of it can be captured in a CUDA graph)."""
        figures: list[torch.Tensor] = []
        for _, layer, x, x64 in work:
            with torch.no_grad():
                # layer.apply(x) for this 2-D x, without the siblings' input cache (a memo of the same
                # function: a probe held there across syncs could be taken for a serving input)
                xq = self._probe_input(layer, x)
                y = layer.gemm(xq, x.dtype).double()
                w = dequantize_exact(layer.decoded(), torch.float64)
                ref = x64 @ w.T
                fresh = self._freshly_derived(layer)
                # the fresh copy quantizes the input exactly as the layer does when its grid key is the same
                # (its canonical tensors, the input scale among them, are copies of the layer's)
                fq = xq if input_key(fresh) == input_key(layer) else fresh.quantize_input_uncached(x)
                y_fresh = fresh.gemm(fq, x.dtype).double()
                # rel_err alone cannot see derived state left from the previous weights after a small (RL-sized)
                # step: it stays at the healthy quantization error. The same kernel on state derived afresh from
                # the canonical tensors is exactly equal when healthy (the derivation is deterministic).
                figures.append(rel_err(y, ref))
                figures.append(fresh_diff(y, y_fresh))
        return torch.stack(figures)

    def _c3_key(self, work: list[tuple]) -> tuple | None:
        """What a captured C3 graph depends on: per layer its identity, kernel format, derived set, input grid
        key, the addresses of every tensor it reads (live canonical and derived, the private fresh copy's, the
        probe and its quantized form), all read now. None while the private copy or the quantized probe do not
        exist yet for this configuration (the eager call builds them)."""
        fresh_cache = self.__dict__.get("_fresh_cache", {})
        probe_q = self.__dict__.get("_probe_q", {})
        key = []
        for _, layer, x, x64 in work:
            hit = fresh_cache.get(layer.prefix)
            q = probe_q.get((id(x), input_key(layer)))
            if hit is None or hit[0] != fresh_config(layer) or q is None or q[0] is not x:
                return None
            fresh = hit[1]
            key.append((id(layer), layer.kernel_format, tuple(sorted(layer._derived)), input_key(layer),
                        input_key(fresh), tuple(sorted(fresh._derived)), id(fresh), x.data_ptr(), x64.data_ptr(),
                        q[1].data_ptr(),
                        tuple(t.data_ptr() for t in layer.canonical().values()),
                        tuple(t.data_ptr() for t in layer.derived().values()),
                        tuple(t.data_ptr() for t in fresh.canonical().values()),
                        tuple(t.data_ptr() for t in fresh.derived().values())))
        return tuple(key)

    def _c3_values(self, work: list[tuple], pending: tuple | None = None) -> tuple[list[float], str]:
        """The self-check's figures and how they were computed. On CUDA (unless ``runtime.sync_graphs`` is off) the
        whole computation (~100 kernels: two GEMM pairs, the float64 reference, the fresh derivation) is captured
        once in a CUDA graph and replayed while everything it reads is where it was captured (``_c3_key``: the
        same tensors at the same addresses, the same formats and derived sets), so a sync pays one replay instead
        of ~100 launches of host work; the replay reads the live bytes, so stale derived state shows exactly as
        in the eager path. A graph is kept only if its first replay equals the eager figures bit for bit;
        anything else (a capture error, a mismatch) runs eager from then on, the reason in ``graph``."""
        if self.device.type != "cuda" or not switch("sync_graphs"):
            return self._c3_figures(work).tolist(), "eager"
        off = self.__dict__.get("_c3_graph_off")
        if off is not None:
            return self._c3_figures(work).tolist(), "eager (" + off + ")"
        key = self._c3_key(work)
        g = self.__dict__.get("_c3_graph")
        if g is not None and key is not None and g[0] == key:
            g[4][0] += 1
            if g[4][0] % RECHECK:
                if pending is not None and pending[1] == key and pending[2] is g and pending[3] == self.weight_version:
                    return g[2].tolist(), "graph replay (queued early)"  # self_check_begin's replay, what it read
                g[1].replay()
                return g[2].tolist(), "graph replay"
            # every RECHECK-th replay also runs eager and must agree bit for bit (a buffer the captured
            # kernels read but the key does not name, e.g. inside a kernel library, cannot drift unseen)
            g[1].replay()
            got = g[2].tolist()
            vals = self._c3_figures(work).tolist()
            if rotating_graph.same_figures(got, vals):
                return vals, "graph replay (checked against eager)"
            self.__dict__["_c3_graph"] = None
            self.__dict__["_c3_graph_off"] = f"replay {got} != eager {vals} after {g[4][0]} replays"
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        vals = self._c3_figures(work).tolist()  # eager: builds the private copy and the quantized probe
        key = self._c3_key(work)
        if key is None:
            return vals, "eager"
        self.__dict__["_c3_graph"] = None
        captures = self.__dict__["_c3_captures"] = self.__dict__.get("_c3_captures", 0) + 1
        if captures > 8:  # what it reads keeps moving: a capture per sync would cost more than it saves
            self.__dict__["_c3_graph_off"] = f"captured {captures - 1} times, the tensors it reads keep moving"
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        try:
            # one capture at a time in the process; thread_local: another thread's CUDA call (a parked
            # generation) is not an error of this capture (graph_capture)
            with graph_capture.CAPTURE_LOCK:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with graph_capture.capturing(graph):
                    static = self._c3_figures(work)
            # figures are >= 0 (or NaN): a graph that recorded nothing cannot pass the first-replay check with
            # values left from the capture
            static.fill_(-1.0)
            graph.replay()
            got = static.tolist()
        except Exception as exc:  # noqa: BLE001 (any capture failure: the eager path stays exact)
            self.__dict__["_c3_graph_off"] = f"capture failed: {type(exc).__name__}: {str(exc)[:160]}"
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        same = rotating_graph.same_figures(got, vals)
        if not same or self._c3_key(work) != key:
            self.__dict__["_c3_graph_off"] = (f"first replay {got} != eager {vals}" if not same else
                                              "capture moved a tensor it reads")
            return vals, "eager (" + self.__dict__["_c3_graph_off"] + ")"
        # the graph's entry holds every tensor of ``work`` (the probes), so nothing it reads is freed under it
        self.__dict__["_c3_graph"] = (key, graph, static, work, [0])
        return vals, "eager, graph captured"

    def _probes(self, seed: int, dense, expert) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The self-check's random inputs (and their float64 copies), drawn from ``seed`` in the order dense,
        expert, as before; cached per (seed, layers' widths, device, dtype): they are the same every sync."""
        key = (seed, None if dense is None else dense.in_features, None if expert is None else expert.in_features,
               self.device, self.act_dtype)
        cache = self.__dict__.setdefault("_probe_cache", {})
        hit = cache.get(key)
        if hit is None:
            present = [(kind, layer) for kind, layer in (("dense", dense), ("expert", expert)) if layer is not None]
            xs = probe_inputs(seed, [layer.in_features for _, layer in present], PROBE_ROWS)
            hit = {}
            for (kind, _), x in zip(present, xs, strict=True):
                x = x.to(self.device, self.act_dtype)
                hit[kind] = (x, x.double())
            if len(cache) > 16:
                cache.clear()
            cache[key] = hit
        return hit

    def _probe_input(self, layer: EngineLinear, x: torch.Tensor) -> torch.Tensor:
        """``layer.quantize_input_uncached(x)`` of a probe ``x`` (held by ``_probes``: the same tensor every sync), kept
        per grid key when it depends on ``x`` and that key alone (``activation_mode`` ``plan``: the quantizer
        reads no layer state); a static-scale mode (``vllm``: the layer's ``input_scale``) is quantized each call."""
        if layer.activation_mode != "plan":
            return layer.quantize_input_uncached(x)
        cache = self.__dict__.setdefault("_probe_q", {})
        key = (id(x), input_key(layer))
        hit = cache.get(key)
        if hit is None or hit[0] is not x:
            if len(cache) > 16:
                cache.clear()
            hit = cache[key] = (x, layer.quantize_input_uncached(x))  # holds x: its id cannot be reused meanwhile
        return hit[1]

    def _freshly_derived(self, layer: EngineLinear) -> EngineLinear:
        """``freshly_derived(layer)`` with the private copy kept per layer and configuration: its canonical
        tensors are copied from the live layer now and its derived state rebuilt from them (own storage, never a
        view of a stack or a sibling's cached input), as a new copy would be, without building a module per sync."""
        cfg = fresh_config(layer)
        cache = self.__dict__.setdefault("_fresh_cache", {})
        hit = cache.get(layer.prefix)
        if hit is None or hit[0] != cfg:
            fresh = freshly_derived(layer)
            cache[layer.prefix] = (cfg, fresh)
            return fresh
        fresh = hit[1]
        with torch.no_grad():
            for suffix, t in layer.canonical().items():
                live_attr(fresh, suffix).copy_(t)
        fresh.process_weights_after_loading()
        return fresh
