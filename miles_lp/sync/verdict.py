"""What each check reports (C7: every check emits a verdict, or the reason it could not run), and the errors.

A ``Verdict`` is plain data: the check's name, the condition it tests, ``ok | failed | skipped``, one
number that says how far from healthy the engine is (``figure``: disagreeing parameters, differing
tensors, the worst self-check relative error, ...), a one-line reason and a few example names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

from miles_lp.errors import MilesLPError
from miles_lp.sync.config import CHECKS

Status = Literal["ok", "failed", "skipped"]

#: the numeric value of ``sync/check/<name>``: 1 ok, 0 failed, -1 skipped (a dashboard can alert on 0)
STATUS_VALUE = {"ok": 1.0, "failed": 0.0, "skipped": -1.0}


@dataclasses.dataclass(frozen=True)
class Verdict:
    name: str
    status: Status
    figure: float | None = None
    reason: str = ""
    examples: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def condition(self) -> str:
        return CHECKS.get(self.name, "?")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def metrics(self) -> dict[str, float]:
        """``sync/check/<name>`` (``STATUS_VALUE``) and, with a figure, ``sync/check/<name>/figure``."""
        m = {f"sync/check/{self.name}": STATUS_VALUE[self.status]}
        if self.figure is not None:
            m[f"sync/check/{self.name}/figure"] = float(self.figure)
        return m

    def short(self) -> str:
        fig = "" if self.figure is None else f"({_fmt(self.figure)})"
        return f"{self.name}={self.status}{fig}"

    def describe(self) -> str:
        ex = f"; e.g. {', '.join(self.examples[:5])}" if self.examples else ""
        return f"{self.condition} {self.name}: {self.status}" + (f" [{_fmt(self.figure)}]" if self.figure is not
                                                                  None else "") + f": {self.reason}{ex}"


def ok(name: str, figure: float | None = None, reason: str = "") -> Verdict:
    return Verdict(name, "ok", figure, reason)


def failed(name: str, figure: float | None, reason: str, examples: Sequence[str] = ()) -> Verdict:
    return Verdict(name, "failed", figure, reason, tuple(examples))


def skipped(name: str, reason: str) -> Verdict:
    return Verdict(name, "skipped", None, reason)


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if x == int(x) and abs(x) < 1e12:
        return str(int(x))
    return f"{x:.4g}"


class SyncError(MilesLPError, RuntimeError):
    """The weight sync could not complete or was refused. ``report`` holds what is known (may be partial)."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class SyncCheckError(SyncError):
    """A check in ``raise`` mode failed. ``verdicts``: the failing verdicts; ``report``: the sync so far.

    Raised before any byte is written when a pre-send check fails (layer audit, update validation); after
    the update otherwise, with the engine left paused: the caller restarts it or resyncs."""

    def __init__(self, message: str, verdicts: Sequence[Verdict], report=None):
        super().__init__(message, report)
        self.verdicts = tuple(verdicts)


class SyncAbortedError(SyncError):
    """The engine or the transport failed in the middle of a sync (``stage``, ``bucket``): the engine may
    hold a partial update. Restart it and run a full resync (``WeightSync.initial_sync``)."""

    def __init__(self, message: str, stage: str, bucket: int | None = None, report=None):
        super().__init__(message, report)
        self.stage = stage
        self.bucket = bucket


class VerdictsReport:
    """The verdict accessors a sync's report offers the run (``WeightSync``'s and the fleet's): a mixin over a
    ``verdicts`` tuple."""

    verdicts: tuple[Verdict, ...]

    @property
    def ok(self) -> bool:
        return not any(v.failed for v in self.verdicts)

    @property
    def failed(self) -> tuple[Verdict, ...]:
        return tuple(v for v in self.verdicts if v.failed)

    def verdict(self, name: str) -> Verdict:
        for v in self.verdicts:
            if v.name == name:
                return v
        raise KeyError(name)
