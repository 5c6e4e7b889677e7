"""Atomic groups of engine tensors: the units a weight sync puts in one bucket (CONTRACT 5).

Engines fuse some checkpoint tensors into one parameter and derive state from the whole at load time, so
a group is sent complete or not at all:

* q/k/v of one attention (``qkv_proj``; their biases too) and DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa``
  (``fused_qkv_a_proj_with_mqa``);
* gate + up of one MLP or shared expert (``gate_up_proj``; NVFP4: their one shared global scale);
* all experts of one MoE layer (one FusedMoE module: shuffled / interleaved layouts are derived per layer);
* everything else: one tensor (with its scales) per group.

The grouping comes from ``ModelLayout.describe(name).engine_module`` (the module SGLang / vLLM build for the
tensor), so it is the same for every target; the members a group must hold come from the plan's entries
(which cover every checkpoint tensor). A stream that ends with a group incomplete is refused (C5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from miles_lp.errors import CheckpointError
from miles_lp.export.tensors import encode_weight


@dataclasses.dataclass(frozen=True)
class ExportGroup:
    """One atomic unit: ``tensors`` = ``{engine on-disk name: tensor}``, ``sources`` = canonical names."""

    key: str  # the engine module (``model.layers.3.self_attn.qkv_proj``) or the tensor's own name
    tensors: dict[str, torch.Tensor]
    sources: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def group_key(name: str, layout) -> str:
    """The engine module holding ``name`` (a bias goes with its weight), else ``name`` itself."""
    probe = name[: -len("bias")] + "weight" if name.endswith(".bias") else name
    module = layout.describe(probe).engine_module if layout is not None else None
    return module or name


def expected_members(plan) -> dict[str, tuple[str, ...]]:
    """``{group key: canonical names}`` for the groups of more than one tensor the plan implies."""
    by_key: dict[str, list[str]] = {}
    for name in plan.entries:
        by_key.setdefault(group_key(name, plan.layout), []).append(name)
    return {k: tuple(v) for k, v in by_key.items() if len(v) > 1}


def export_groups(named_weights: Iterable[tuple[str, Any]], plan, target: str) -> Iterator[ExportGroup]:
    """``(canonical name, tensor)`` (``Learner.export_weights()``) -> complete ``ExportGroup``s, in the order
    each group completes. Members are buffered until their group is whole; a tensor outside the plan is a
    group of its own. Raises ``CheckpointError`` for a name seen twice or groups left incomplete."""
    if plan is None or plan.layout is None:
        raise CheckpointError("export_groups needs a compiled plan with its layout (compile_plan attaches it)")
    members = expected_members(plan)
    pending: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # key -> canonical -> encoded tensors
    seen: set[str] = set()
    for name, value in named_weights:
        if name in seen:
            raise CheckpointError(f"'{name}' exported twice; every tensor must be exported once")
        seen.add(name)
        encoded = encode_weight(name, value, plan, target)
        key = group_key(name, plan.layout) if name in plan.entries else name
        want = members.get(key)
        if want is None:
            yield ExportGroup(key, encoded, (name,))
            continue
        got = pending.setdefault(key, {})
        got[name] = encoded
        if len(got) == len(want):
            del pending[key]
            tensors: dict[str, torch.Tensor] = {}
            for part in got.values():
                tensors.update(part)
            yield ExportGroup(key, tensors, tuple(got))
    if pending:
        key, got = next(iter(pending.items()))
        missing = sorted(set(members[key]) - set(got))
        raise CheckpointError(f"{len(pending)} export group(s) incomplete at the end of the export, e.g. '{key}' "
                              f"lacks {missing[:4]}; an engine fuses these tensors and must receive all of them (C5)")
