"""The learner's export under the engine's names: one ``Item`` per engine tensor, with its atomic group.

``Learner.export_weights()`` yields ``(canonical HF name, MXFP8Tensor | NVFP4Tensor | torch.Tensor)``;
``miles_lp.export.naming.encode`` maps a quantized weight to the target's on-disk tensors (SGLang MXFP8:
``<m>.weight`` e4m3 + ``<m>.weight_scale_inv`` u8), so a live update writes exactly what a fresh load from
disk reads (CONTRACT 5). Nothing is copied here: items hold the export's own tensors; BF16 travels as BF16.

Atomic groups: tensors an engine loader must see together. The weight and the scales of one
module; gate and up of one MLP (one fused GEMM, one NVFP4 global scale); q/k/v of one attention (fused
QKV); every expert of one MoE layer (engines fuse all experts of a layer into one tensor). A bucket never
splits a group.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from miles_lp.errors import MilesLPError
from miles_lp.export import naming
from miles_lp.formats.spec import Format

_EXPERTS = re.compile(r"^(.*\.experts)\.\d+\.")
_QKV = re.compile(r"^(.*)\.(?:q_proj|k_proj|v_proj)\.")
_GATE_UP = re.compile(r"^(.*)\.(?:gate_proj|up_proj|w1|w3)\.")


def group_key(name: str, layout: Any = None) -> str:
    """The atomic group of engine tensor ``name``: with a model layout, the engine module that holds it
    (``ModelLayout.describe(name).engine_module``: ``...self_attn.qkv_proj``, ``...mlp.gate_up_proj``,
    ``...mlp.experts``; the grouping ``miles_lp.export`` uses); otherwise by name (see the module docstring)."""
    if layout is not None:
        weight = name.rpartition(".")[0] + ".weight"  # a scale or a bias goes with its module's weight
        try:
            module = layout.describe(weight).engine_module
        except MilesLPError:
            module = None
        if module:
            return module
    if m := _EXPERTS.match(name):
        return m.group(1)
    if m := _QKV.match(name):
        return m.group(1) + ".qkv"
    if m := _GATE_UP.match(name):
        return m.group(1) + ".gate_up"
    module, _, _ = name.rpartition(".")
    return module or name


@dataclasses.dataclass(slots=True, eq=False)  # not frozen: a frozen init costs ~5x (~2 us per item, ~1,200 per sync)
class Item:
    """One engine tensor of a sync (never mutated once built)."""

    name: str  # the engine's on-disk tensor name
    tensor: torch.Tensor
    source: str  # the canonical learner name it came from
    fmt: Format  # Format.BF16 for a high-precision tensor
    component: str | None  # "data" | "scale" | "scale_inv" | "global_scale" | "const" | None (high precision)
    group: str

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def is_scale(self) -> bool:
        return self.component in ("scale", "scale_inv", "global_scale")  # scale_inv: FP8 blockwise (fp32, decode)


def is_quantized(obj: Any) -> bool:
    return hasattr(obj, "components") and hasattr(obj, "format")


def engine_items(export: Iterable[tuple[str, Any]], target: str, layout: Any = None) -> list[Item]:
    """Every engine tensor of one sync, in export order. Raises ``SyncInputError`` for a name exported twice
    or an object that is neither a tensor nor a quantized tensor."""
    naming.check_target(target)
    items: list[Item] = []
    append = items.append
    seen: dict[str, str] = {}
    consts: dict[tuple, torch.Tensor] = {}  # one tensor per constant value and device, for every module
    keys = _group_keys(layout)
    components: dict[Format, list[str]] = {}  # per format: each part's component ("const" for a constant part)
    for source, obj in export:  # host work per tensor kept small: ~1,200 tensors every sync
        if is_quantized(obj):
            fmt = obj.format if type(obj.format) is Format else Format(obj.format)
            comps = components.get(fmt)
            if comps is None:
                comps = components[fmt] = [p.component or "const" for p in naming.parts(target, fmt)]
            # a constant part (the static input_scale) is one tensor on the data's device for every module: one
            # transfer source, not a new host tensor each
            encoded = naming.encode(target, fmt, source, obj, constants=consts)
            if len(encoded) != len(comps):
                raise SyncInputError(f"'{source}': {len(encoded)} engine tensors encoded for {len(comps)} parts")
            for (name, t), comp in zip(encoded.items(), comps, strict=True):
                group = keys.get(name)
                if group is None:
                    group = keys[name] = group_key(name, layout)
                if name in seen:
                    raise SyncInputError(f"learner export wrote engine tensor '{name}' twice (from "
                                         f"'{seen[name]}' and '{source}'); every tensor must be exported once")
                seen[name] = source
                append(Item(name, t, source, fmt, comp, group))
        elif isinstance(obj, torch.Tensor):
            group = keys.get(source)
            if group is None:
                group = keys[source] = group_key(source, layout)
            if source in seen:
                raise SyncInputError(f"learner export wrote engine tensor '{source}' twice (from "
                                     f"'{seen[source]}' and '{source}'); every tensor must be exported once")
            seen[source] = source
            append(Item(source, obj.detach(), source, Format.BF16, None, group))
        else:
            raise SyncInputError(f"learner export yielded '{source}' as {type(obj).__name__}; expected a "
                                 "torch.Tensor or a quantized tensor from miles_lp.formats")
    return items


_KEYS: dict[int, tuple[Any, dict[str, str]]] = {}


def _group_keys(layout: Any) -> dict[str, str]:
    """A cache of ``group_key(name, layout)`` per layout object (the names repeat every sync; describing each
    through the layout costs more than the rest of the export's host work)."""
    hit = _KEYS.get(id(layout))
    if hit is None or hit[0] is not layout:  # an id reused by another object: start over
        hit = _KEYS[id(layout)] = (layout, {})
        if len(_KEYS) > 64:
            _KEYS.pop(next(iter(_KEYS)))
    return hit[1]


def group_items(items: Sequence[Item]) -> Iterator[list[Item]]:
    """Items grouped by atomic group, groups in order of first appearance (members keep export order)."""
    groups: dict[str, list[Item]] = {}
    for it in items:
        groups.setdefault(it.group, []).append(it)
    yield from groups.values()


class SyncInputError(MilesLPError, ValueError):
    """The learner's export or the update does not fit the engine (unknown name, shape, dtype, format)."""
