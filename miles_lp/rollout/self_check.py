"""C3, the self-check, as every engine measures it: one probe for the reference engine, vLLM and SGLang.

An engine answers C3 by running a quantized layer's serving kernel on a random probe and comparing:

* ``rel_err``: against a float64 GEMM of the layer's canonical (on-disk) weights decoded afresh, the relative
  Frobenius error; healthy ~0.03 (dense) / ~0.05 (expert) for MXFP8, ~1 for a layout left stale;
* ``fresh_diff`` (where the engine can re-derive its serving state): against the same kernel on state derived
  afresh from the canonical tensors, the largest absolute difference; exactly 0 when healthy, because the
  derivation is deterministic, so it sees stale derived state after an RL-sized step that ``rel_err`` cannot.

What differs per engine is only how it reaches its kernel and its canonical bytes (the reference engine: its own
``EngineLinear``; vLLM: the bytes captured before ``process_weights_after_loading``; SGLang: the fused
parameters' row blocks). The probe inputs, the figures, the decodes to float64, the order in which the layers
rotate through the syncs and the pass rule are here, once. Everything here is torch only (the vLLM and SGLang
processes import it with their own torch); the figures stay on the device without host synchronisation, so the
reference engine captures them in a CUDA graph.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch

#: CONTRACT 5: the largest ``rel_err`` a healthy layer shows (~0.03 dense / ~0.05 expert for MXFP8; stale ~1);
#: ``SyncConfig.self_check_tolerance`` decides in the sync
TOLERANCE = 0.25
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

T = TypeVar("T")


# ---- the probe inputs -----------------------------------------------------------------------------------------
def probe_inputs(seed: int, widths: Sequence[int], rows: int) -> list[torch.Tensor]:
    """One float32 CPU probe ``[rows, width]`` per width, drawn in order from one generator seeded ``seed`` (the
    engines cast and move them: the same probe whatever the device)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(rows, w, generator=g) for w in widths]


def rotating_input(seed: int, width: int, rows: int) -> torch.Tensor:
    """The rotating / every-layer probe: drawn from ``seed + 1`` (independent of the fixed layers' draws) and the
    same for a layer at every sync."""
    return probe_inputs(seed + 1, [width], rows)[0]


# ---- the figures ------------------------------------------------------------------------------------------------
def rel_err(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``||y - ref|| / ||ref||`` in float64 (0-d, on the tensors' device: no host synchronisation)."""
    return (y.double() - ref).norm() / ref.norm().clamp_min(1e-30)


def fresh_diff(y: torch.Tensor, y_fresh: torch.Tensor) -> torch.Tensor:
    """``max |y - y_fresh|`` in float64 (0-d, on the tensors' device): exactly 0 when the serving state is current."""
    return (y.double() - y_fresh.double()).abs().max()


def reference_gemm(x: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """The float64 reference ``x @ W^T`` on a float64 weight (the probe converted exactly)."""
    return x.to(w64.device, torch.float64) @ w64.T


def passes(layers: Iterable[Mapping[str, Any]], tolerance: float = TOLERANCE) -> bool:
    """C3's rule on one engine's answer: at least one layer probed, every layer's ``rel_err`` present, finite and
    within ``tolerance``, and every ``fresh_diff`` (where the engine measured one) exactly 0."""
    layers = list(layers)
    return bool(layers) and all(_layer_passes(v, tolerance) for v in layers)


def _layer_passes(entry: Mapping[str, Any], tolerance: float) -> bool:
    e = float(entry.get("rel_err", math.inf))
    return math.isfinite(e) and e <= tolerance and float(entry.get("fresh_diff", 0.0)) == 0.0


# ---- which layer each sync probes ------------------------------------------------------------------------------
def interleave(groups: Iterable[Sequence[T]]) -> list[T]:
    """The first of each group, then the second of each, ...: consecutive syncs probe different projections, each
    group within ``#groups`` syncs and each item within ``len()`` syncs."""
    gs = [g for g in groups if len(g)]
    return [g[i] for i in range(max(map(len, gs), default=0)) for g in gs if i < len(g)]


def family(module: str) -> str:
    """A module's projection family: its name with the layer / expert indices wildcarded
    (``model.layers.3.self_attn.qkv_proj`` -> ``model.layers.*.self_attn.qkv_proj``)."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", module)


def rotation_order(items: Sequence[T], key: Callable[[T], str]) -> list[T]:
    """Every item once, interleaved across the families ``key`` names (``interleave`` of the groups, in order of
    first appearance)."""
    groups: dict[str, list[T]] = {}
    for it in items:
        groups.setdefault(key(it), []).append(it)
    return interleave(groups.values())


# ---- the canonical weights, decoded to float64 ----------------------------------------------------------------
def decode_mxfp8_f64(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 ``[N, K]`` with E8M0 ``[N, K/32]`` -> float64 (CONTRACT 1's decode, written from the bit rules; exact)."""
    s = torch.pow(2.0, scale.to(torch.float64) - 127.0)
    return w.to(torch.float32).to(torch.float64) * s.repeat_interleave(32, dim=1)[:, : w.shape[1]]


def decode_nvfp4_f64(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 ``[N, K/2]`` (even element in the low nibble), E4M3 ``[N, K/16]``, FP32 decode scale -> float64."""
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)
    table = torch.tensor(E2M1, dtype=torch.float64, device=p.device)
    v = table[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0).to(torch.float64)
    s = scale.to(torch.float32).to(torch.float64).repeat_interleave(16, dim=1)[:, : v.shape[1]]
    return v * s * float(scale_2.reshape(-1)[0])


def dequantize_exact(q: Any, dtype: torch.dtype) -> torch.Tensor:
    """``q.dequantize(dtype)`` of a codec tensor in its scheme's graph-safe form: the same ops in the same order
    (the same bytes), with no host->device copy a CUDA graph capture would refuse (NVFP4's E2M1 table is kept per
    device). ``tests/unit/test_rollout_self_check_graph.py`` compares both on random codes."""
    from miles_lp.formats.schemes import scheme_for

    return scheme_for(q.format).dequantize_graph_safe(q, dtype)
