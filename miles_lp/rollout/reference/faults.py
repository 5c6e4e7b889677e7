"""Deliberate faults of the reference engine: the known silent failures of CONTRACT 5 reproduced on purpose, so
that the sync's checks can be shown to catch them (the fault-injection selftest, `miles-lp selftest sync`). With
the default ``EngineFaults()`` none is on."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class EngineFaults:
    """Deliberate faults (all off by default). Patterns are ``fnmatch`` patterns; ``"*"`` matches everything.

    ``skip_rebuild``: layers (module prefix, e.g. ``"*.experts.*"``) whose derived state ``finish_weight_update``
    does not rebuild: the kernel keeps serving the old operand and swizzled scales (stale layout, C3).
    ``rebind``: canonical tensor names that ``begin_weight_update`` re-binds: the module gets a fresh copy while
    the update still writes into the tensor captured at load (re-bound parameter, C4).
    ``drop_updates``: names ``update_weights`` accepts but does not write (a loader that skips names, C2/C5).
    ``quantize_lm_head``: the sampler serves ``lm_head`` in MXFP8 although the checkpoint holds it BF16 (C1).
    """

    skip_rebuild: tuple[str, ...] = ()
    rebind: tuple[str, ...] = ()
    drop_updates: tuple[str, ...] = ()
    quantize_lm_head: bool = False

    def active(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name)}


def matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)

