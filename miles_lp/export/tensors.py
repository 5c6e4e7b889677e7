"""``(canonical name, tensor)`` from a learner -> the target's on-disk tensors (CONTRACT 4).

The one place where a learner's export meets engine naming: a quantized tensor (``MXFP8Tensor`` /
``NVFP4Tensor``) goes through ``naming.encode`` under the plan's format; every other tensor passes through
under its own name. The plan is checked, not trusted to agree: a quantized tensor for a weight the plan keeps
BF16, one in another format, or a plain tensor for a weight the plan quantizes is refused (C1/C2: the
engine would serve a different layer set or grid than the learner runs; verl refuses a BF16 tensor sent to an
FP8 parameter for the same reason).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from miles_lp.errors import CheckpointError
from miles_lp.export import naming
from miles_lp.formats.spec import Format


def is_quantized(value: Any) -> bool:
    """A codec tensor (``MXFP8Tensor`` / ``NVFP4Tensor``: ``.format`` and ``.components()``), not a torch.Tensor."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "components", None))


def planned_format(plan, name: str) -> Format:
    """The plan's format for ``name`` (BF16 for a name the plan does not list, e.g. a buffer)."""
    entry = plan.entries.get(name) if plan is not None else None
    return Format.BF16 if entry is None else Format(entry.format)


def encode_weight(name: str, value: Any, plan, target: str) -> dict[str, torch.Tensor]:
    """``{on-disk name: tensor}`` for one exported tensor (1 entry for a plain tensor, 2-4 for a quantized one)."""
    fmt = planned_format(plan, name)
    if is_quantized(value):
        got = Format(value.format)
        if got is not fmt:
            raise CheckpointError(f"'{name}': the learner exported a {got.value} tensor but the plan says "
                                  f"{fmt.value}; the learner and the plan disagree on the layer set (C1)")
        return naming.encode(target, fmt, name, value)
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"'{name}': exported value is a {type(value).__name__}, not a tensor")
    if fmt.quantized:
        raise CheckpointError(f"'{name}': the plan quantizes it {fmt.value} but the learner exported a plain "
                              f"{value.dtype} tensor; an engine would serve a different grid than the learner "
                              "runs (C2). Export the learner's forward grid (Learner.export_weights)")
    return {name: value}


def engine_tensors(named_weights: Iterable[tuple[str, Any]], plan, target: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The target's on-disk tensors for a stream of ``(canonical name, tensor)``, in stream order."""
    naming.check_target(target)
    for name, value in named_weights:
        yield from encode_weight(name, value, plan, target).items()
