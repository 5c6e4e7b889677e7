"""``FleetSync``: one weight sync into every engine of a fleet, every check run on each.

    fleet = FleetSync([WeightSync(e, plan, target, config, ...) for e in engines])
    fleet.initial_sync(learner)       # every engine, full compare
    report = fleet.sync(learner)      # after each optimizer step: one export, every engine updated and checked
    report.metrics["sync/check/grid/engine1"]

The learner exports once per sync (``ExportOnce``): each engine's ``WeightSync`` reads the same tensors, so the
bytes checked on engine 1 are the bytes sent to engine 0. Each engine keeps its own recorded state (its update
spec, its C4 pointers, its C3 rotation, its weight-version count): an engine restarted mid-run is recorded again
and resynced in full (``resync``) while the others keep theirs.

Verdicts: per engine ``sync/check/<name>/engine<i>`` (1 ok, 0 failed, -1 skipped), and ``sync/check/<name>`` the
fleet's (the first failure, else ok when one engine proved it, else skipped). Versions: the fleet counts its
syncs (``expected_version``, the run's count); an engine's own count restarts with the engine, and
``version_of(i, v)`` maps its count to the fleet's. In raise mode every engine is synced and checked before the
first failure is raised, so one engine's failure does not leave the others a version behind.

With ``fanout`` (a ``miles_lp.sync.group.SharedUpdateGroup``: one update group holding every engine's rank) the
engines' syncs run at the same time, one thread each, and each bucket goes out once for all of them (one
broadcast); every check still runs per engine. The learner is then shared by the threads: its calls are made
one at a time (``ExportOnce``'s lock). An engine that dies inside such a sync breaks the group for every engine:
the sync raises ``SyncAbortedError`` and the engines whose sync did not complete get the update on the next
``sync`` call, whatever its ``only`` says (the group delivers a bucket to all of them at once, so none of them is
known to hold it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from miles_lp.sync.config import CHECKS
from miles_lp.sync.verdict import STATUS_VALUE, SyncCheckError, SyncError, Verdict, VerdictsReport, skipped


class ExportOnce:
    """The learner as every engine's sync sees it during one fleet sync: ``export_weights`` computed once and
    replayed; every other attribute is the learner's. Its methods run one call at a time (the engines' syncs may
    run in threads; a learner with ranks of its own runs collectives in its calls)."""

    def __init__(self, learner: Any):
        self._learner = learner
        self._export: list | None = None
        self._lock = threading.RLock()

    def export_weights(self) -> Iterator:
        with self._lock:
            if self._export is None:
                self._export = list(self._learner.export_weights())
        return iter(self._export)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._learner, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return value(*args, **kwargs)
        return call


def combine(name: str, verdicts: Sequence[Verdict]) -> Verdict:
    """The fleet's verdict for one check: the first failure (its reason naming the engine), else the first ok
    (every engine proved it, or skipped it), else the first skip."""
    for i, v in enumerate(verdicts):
        if v.failed:
            return dataclasses.replace(v, reason=f"engine {i}: {v.reason}")
    done = [v for v in verdicts if v.ok]
    if done:
        return dataclasses.replace(done[0], seconds=sum(v.seconds for v in verdicts),
                                   reason=done[0].reason + (f" (on each of {len(verdicts)} engines)"
                                                            if len(done) == len(verdicts) else
                                                            f" ({len(done)} of {len(verdicts)} engines)"))
    return verdicts[0] if verdicts else skipped(name, "no engine")


@dataclasses.dataclass
class FleetReport(VerdictsReport):
    """What ``WeightSync``'s report offers the run (``weight_version``, ``metrics``, ``verdicts``, ``ok``), for the
    fleet; ``engines`` holds each engine's own report."""

    weight_version: int
    verdicts: tuple[Verdict, ...]
    metrics: dict[str, float]
    engines: tuple[Any, ...]
    seconds: float
    full_compare: bool
    stage: str = "done"
    #: over one update group (``fanout``): the buckets this sync sent as (broadcasts reaching every engine of the
    #: group, sends to one engine); None without a fanout
    sends: tuple[int, int] | None = None


class FleetSync:
    """``sync`` / ``initial_sync`` / ``sentinel`` / ``mode`` / ``log`` / ``expected_version`` as ``WeightSync``
    offers them, over one ``WeightSync`` per engine. The sentinel (C6) is one, shared: the RL step feeds it once
    per step, each engine's sync reads it."""

    def __init__(self, syncs: Sequence[Any], log: Callable[[str], None] | None = None, fanout: Any = None):
        if not syncs:
            raise ValueError("FleetSync needs at least one engine's WeightSync")
        self.syncs = list(syncs)
        self.sentinel = self.syncs[0].sentinel
        for ws in self.syncs:
            ws.sentinel = self.sentinel
        self.config = self.syncs[0].config
        self.log = log or self.syncs[0].log
        self.expected_version = int(self.syncs[0].expected_version)
        self._offset = [self.expected_version - int(ws.expected_version) for ws in self.syncs]
        self.fanout = fanout  # one update group for every engine: the syncs run together, each bucket sent once
        self._held: dict[int, Any] = {}  # engines whose sync completed in an attempt that aborted (fanout)

    @property
    def engines(self) -> list[Any]:
        return [ws.engine for ws in self.syncs]

    def mode(self, name: str) -> str:
        return self.config.mode(name)

    def version_of(self, index: int, engine_version: int) -> int:
        """Engine ``index``'s own weight-version count as the fleet's."""
        return int(engine_version) + self._offset[index]

    def initial_sync(self, learner: Any) -> FleetReport:
        return self._all(learner, full=True)

    def sync(self, learner: Any, *, full_compare: bool | None = None, only: Sequence[int] | None = None,
             done: dict[int, Any] | None = None) -> FleetReport:
        """One sync of every engine (``only``: these engines; ``done``: reports of engines already holding this
        update, a restarted one's full resync, counted in the fleet's verdicts)."""
        return self._all(learner, full=False, full_compare=full_compare, only=only, done=done)

    def resync(self, index: int, engine: Any, learner: Any) -> Any:
        """Engine ``index`` replaced by ``engine`` (a fresh one): recorded anew and synced in full (every tensor,
        full byte compare) to the fleet's current version; the others are not touched. Returns its report."""
        ws = self.syncs[index]
        ws.engine = engine
        if self.fanout is not None:
            self.fanout.begin([index])
        try:
            report = ws.initial_sync(learner)
        finally:
            if self.fanout is not None:
                self.fanout.leave(index)
        self._offset[index] = self.expected_version - int(ws.expected_version)
        return report

    def _all(self, learner: Any, full: bool, full_compare: bool | None = None, only: Sequence[int] | None = None,
             done: dict[int, Any] | None = None) -> FleetReport:
        t0 = time.perf_counter()
        once = ExportOnce(learner)
        reports: dict[int, Any] = dict(done or {})
        first_error: tuple[int, SyncCheckError] | None = None
        if self.fanout is not None:
            if only is not None or done:  # a retry: every engine that does not hold this update yet
                reports.update(self._held)
                only = None
            self._held = {}
            todo = [i for i in range(len(self.syncs)) if (only is None or i in only) and i not in reports]
            first_error = self._together(todo, once, full, full_compare, reports)
        for i, ws in enumerate(self.syncs):
            if self.fanout is not None or (only is not None and i not in only):
                continue
            try:
                reports[i] = ws.initial_sync(once) if full else ws.sync(once, full_compare=full_compare)
            except SyncCheckError as exc:  # checked and failed: the others still get this version
                reports[i] = exc.report
                first_error = first_error or (i, exc)
            except SyncError as exc:  # aborted: the engine's state is unknown; the caller decides (restart it)
                exc.engine_index = i
                raise
        if full:
            self.expected_version = max(int(ws.expected_version) for ws in self.syncs)
        else:
            self.expected_version += 1
        self._offset = [self.expected_version - int(ws.expected_version) for ws in self.syncs]
        report = self._report([reports[i] for i in sorted(reports)], sorted(reports), t0, full)
        if first_error is not None:
            i, exc = first_error
            raise SyncCheckError(f"fleet sync v{self.expected_version}: engine {i}: {exc}", report.failed, report)
        return report

    def _together(self, todo: list[int], once: ExportOnce, full: bool, full_compare: bool | None,
                  reports: dict[int, Any]) -> tuple[int, SyncCheckError] | None:
        """The syncs of engines ``todo`` at the same time over the fanout (a thread each, buckets sent once);
        their reports into ``reports``. Raises the first abort (``engine_index`` set) after every thread ended,
        keeping the completed engines' reports for the retry; returns the first check failure."""
        out: dict[int, Any] = {}

        def one(i: int) -> None:
            ws = self.syncs[i]
            try:
                out[i] = ws.initial_sync(once) if full else ws.sync(once, full_compare=full_compare)
            except BaseException as exc:  # noqa: BLE001 - sorted out below, after every engine's thread ended
                out[i] = exc
            finally:
                self.fanout.leave(i)

        self.fanout.begin(todo)
        sent = (self.fanout.broadcasts, self.fanout.p2p)
        threads = [threading.Thread(target=one, args=(i,), name=f"miles-lp-sync-engine{i}", daemon=True)
                   for i in todo]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._sent = (self.fanout.broadcasts - sent[0], self.fanout.p2p - sent[1])
        aborted = [(i, e) for i, e in sorted(out.items()) if isinstance(e, BaseException)
                   and not isinstance(e, SyncCheckError)]
        if aborted:
            self._held = {i: r for i, r in out.items() if not isinstance(r, BaseException)}
            i, exc = aborted[0]
            if isinstance(exc, SyncError):
                exc.engine_index = i
            raise exc
        first_error = None
        for i, r in sorted(out.items()):
            if isinstance(r, SyncCheckError):
                reports[i] = r.report
                first_error = first_error or (i, r)
            else:
                reports[i] = r
        return first_error

    def _report(self, reports: list[Any], index: list[int], t0: float, full: bool) -> FleetReport:
        verdicts = tuple(combine(n, [r.verdict(n) for r in reports]) for n in CHECKS)
        m: dict[str, float] = {k: v for k, v in reports[0].metrics.items() if not k.startswith("sync/check/")}
        for v in verdicts:
            m.update(v.metrics())
        for i, r in zip(index, reports, strict=True):
            for v in r.verdicts:
                m[f"sync/check/{v.name}/engine{i}"] = STATUS_VALUE[v.status]
        m["perf/sync_seconds"] = time.perf_counter() - t0
        m["perf/sync_check_seconds"] = sum(r.check_seconds for r in reports)
        m["sync/weight_version"] = float(self.expected_version)
        m["sync/engines"] = float(len(reports))
        sends, self._sent = getattr(self, "_sent", None), None
        stage = next((r.stage for r in reports if r.stage != "done"), "done")
        self.log(f"fleet sync v{self.expected_version}: {len(reports)} engines; "
                 + " ".join(v.short() for v in verdicts))
        return FleetReport(self.expected_version, verdicts, m, tuple(reports), m["perf/sync_seconds"], full, stage,
                           sends)
