"""``WeightSync``: the learner's own quantized weights into a live engine after every optimizer step.

    sync = WeightSync(engine, plan, "sglang", config)      # records the engine's tensors and pointers (load)
    report = sync.initial_sync(learner)                    # full byte compare
    ...
    report = sync.sync(learner)                            # after each optimizer step
    metrics.update(report.metrics)                         # perf/sync_seconds, sync/check/<name>, ...

The order real stacks use (Miles, slime): export -> pre-checks -> pause -> flush -> begin -> buckets ->
finish (derived state rebuilt) -> post-checks -> resume. The weight version increments once per sync and is
checked against what the engine reports.

Checks (CONTRACT 5; each ``warn | raise | off``, ``SyncConfig``):

* before any byte is written: C1 ``layer_audit`` (learner executed vs engine live vs plan) and the C5
  update validation (names, dtypes, shapes, BF16 vs low precision). An update that does not fit the engine
  is refused whole in every mode but ``off``: the previous weights keep serving.
* after ``finish``: ``version``; C5 ``completeness`` (the receiver's ledger; 0xFF-filled staging); C2 ``grid``
  (digest of every tensor, or a full byte compare; NVFP4 gate/up share one global scale); C3
  ``self_check`` (the serving kernel vs the dequantized synced weights); C4 ``storage`` (data pointers as
  recorded at load); C6 ``sentinel`` (the RL loop's per-step sentinel, or a short probe generation).

In ``raise`` mode a failed post-check raises ``SyncCheckError`` after all checks ran, with the engine left
paused (it would serve a policy the learner does not compute). An engine or transport failure mid-sync
raises ``SyncAbortedError`` in every mode: the engine may hold a partial update; restart it and call
``initial_sync``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from miles_lp.config import switch
from miles_lp.errors import BackendUnavailable, ConfigError
from miles_lp.multitensor.digest import (
    fingerprints,
    group_fingerprints,
    group_head,
    group_plan,
    group_strings,
    member_weight,
    slot_values,
)
from miles_lp.rollout.engine import (
    Capability,
    EngineError,
    WeightUpdateError,
    engine_capabilities,
    tensor_digest,
)
from miles_lp.sync import checks
from miles_lp.sync.buckets import Bucket, Ledger, make_buckets
from miles_lp.sync.config import CHECKS, ENV_ALL, SyncConfig, env_name
from miles_lp.sync.items import Item, engine_items, group_items
from miles_lp.sync.remote import Receipt
from miles_lp.sync.sentinel import Sentinel, rollout_kl
from miles_lp.sync.transport import BroadcastTransport, InProcessTransport, Transport, make_transport
from miles_lp.sync.verdict import (
    SyncAbortedError,
    SyncCheckError,
    Verdict,
    VerdictsReport,
    failed,
    ok,
    skipped,
)

logger = logging.getLogger("miles_lp.sync")

PRE_CHECKS = ("layer_audit", "completeness")


def _barrier() -> None:
    """Wait for queued GPU work, so the stage timings (``perf/sync_*_seconds``) are not launch times."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclasses.dataclass
class SyncReport(VerdictsReport):
    weight_version: int
    verdicts: tuple[Verdict, ...]
    metrics: dict[str, float]
    seconds: float
    check_seconds: float
    bytes: int
    buckets: int
    full_compare: bool
    log_line: str = ""
    stage: str = "done"  # how far the sync got: "pre-checks" | "transfer" | "apply" | "finish" | "done"


def _combine(name: str, parts: list[Verdict]) -> Verdict:
    """One verdict from several sub-checks of one check: the first failure, else ok with all reasons."""
    parts = [p for p in parts if p is not None]
    for p in parts:
        if p.failed:
            return p
    done = [p for p in parts if p.ok]
    if not done:
        return skipped(name, "; ".join(p.reason for p in parts) or "nothing to check")
    return dataclasses.replace(done[0], reason="; ".join(p.reason for p in done))


def _groups_of(items: list[Item]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for it in items:
        groups.setdefault(it.group, []).append(it.name)
    return groups


class _Layout:
    """What a sync derives from the export's layout alone (``WeightSync._layout``): built on the first sync of
    a layout, reused while it repeats. Only the payload tensors are new each sync."""

    def __init__(self, key: tuple, spec: Mapping, engine_q: dict, items: list[Item]):
        self.key, self.spec, self.engine_q = key, spec, engine_q
        self.scales = {it.name: it.is_scale for it in items}
        self.groups = _groups_of(items)
        # the fused C2 digest (transport.fill_slots): each tensor's group slot and member weight, and each group's
        # head (count, bytes, dtype/shape signature), as digest.group_fingerprints computes them
        slot_of = {g: i for i, g in enumerate(self.groups)}
        member = {n: k for ns in self.groups.values() for k, n in enumerate(ns)}
        self.digest_where = {it.name: (slot_of[it.group], member_weight(member[it.name])) for it in items}
        by_name = {it.name: it.tensor for it in items}
        self.heads = [group_head([by_name[n] for n in ns]) for ns in self.groups.values()]
        self.index = {it.name: i for i, it in enumerate(items)}  # name -> position in this layout's export
        self.validation: Verdict | None = None  # validate_update's ok verdict for this layout (seconds 0)
        self._buckets: list[tuple[Bucket, list[int]]] | None = None
        self._bucket_bytes = None
        self._learner_plan: tuple | None = None  # learner_values' item order and group plan, built on first use

    def buckets_for(self, items: list[Item], bucket_bytes: int) -> list[Bucket]:
        """``make_buckets(group_items(items), bucket_bytes)``: the same slots (the same objects, so a transport
        can reuse its received views), with this sync's tensors as payload."""
        if self._buckets is None or self._bucket_bytes != bucket_bytes:
            made = make_buckets(group_items(items), bucket_bytes)
            index = {it.name: i for i, it in enumerate(items)}
            self._buckets = [(b, [index[s.name] for s in b.slots]) for b in made]
            self._bucket_bytes = bucket_bytes
            return made
        return [Bucket(b.index, b.slots, {items[i].name: items[i].tensor for i in idx}, b.nbytes, b.groups, b.last)
                for b, idx in self._buckets]

    def learner_values(self, items: list[Item]) -> tuple[list[str], list[int]]:
        """The learner side of the per-sync group digest, ``(heads, int64 sums)`` as ``group_fingerprints`` of the
        export computes them, read from the export's own tensors (not from the transfer's copy) with
        this layout's group order, slots and member weights: no per-tensor work but the list of tensors."""
        if self._learner_plan is None:
            index = {it.name: i for i, it in enumerate(items)}
            order = [index[n] for ns in self.groups.values() for n in ns]
            self._learner_plan = (order, group_plan([len(ns) for ns in self.groups.values()]))
        order, (slots, mults) = self._learner_plan
        ts = [items[i].tensor for i in order]
        return self.heads, slot_values(ts, slots, mults, len(self.groups)).cpu().tolist()


class WeightSync:
    def __init__(self, engine: Any, plan: Any, target: str = "sglang", config: SyncConfig | None = None, *,
                 transport: Transport | None = None, sentinel: Sentinel | None = None,
                 env: Mapping[str, str] | None = None, device: torch.device | str | None = None,
                 log: Callable[[str], None] | None = None, probe_prompts: list[list[int]] | None = None):
        self.engine = engine
        self.plan = plan
        self.target = target
        env = os.environ if env is None else env
        base = config or SyncConfig()
        self.config = base.with_env(env)
        # check -> why it is off when the environment, not the recipe, turned it off (its skip reason says so)
        self._env_off: dict[str, str] = {}
        for c in CHECKS:
            if base.mode(c) != "off" and self.config.mode(c) == "off":
                var = env_name(c) if env_name(c) in env else ENV_ALL
                self._env_off[c] = f"{var}={env.get(var)}; the recipe says sync.checks.{c}: {base.mode(c)}"
        if transport is None:
            if self.config.transport in ("nccl", "gloo"):
                raise ConfigError(f"sync.transport '{self.config.transport}' needs the process group and ranks "
                                  "(ray.enabled: true runs it between the learner and engine actors); here, pass "
                                  "transport=BroadcastTransport(src=<learner rank>, receipts=True, reply_from=<engine "
                                  "rank>) and engine=miles_lp.sync.remote.RemoteEngine(...), with "
                                  "BroadcastReceiver(src=<learner rank>).serve(engine, rank) in the engine's process")
            # stage where the engine computes (its ``device`` attribute, if it has one): one hop, not two
            device = device or getattr(engine, "device", None) or "cpu"
            transport = make_transport(self.config.transport, device)
        if isinstance(transport, BroadcastTransport) and not transport.receipts:
            raise ConfigError("WeightSync cannot check an engine on the far side of a broadcast that sends no "
                              "receipts: use BroadcastTransport(receipts=True) with BroadcastReceiver.serve(engine) "
                              "in the engine's process and a miles_lp.sync.remote.RemoteEngine here")
        self.transport = transport
        self.sentinel = sentinel or Sentinel(self.config.sentinel)
        self._sentinel_steps = self.sentinel.steps  # the steps it had seen at the last probe (a fresh step's verdict)
        self._skips_said: set[str] = set()  # raise-mode checks whose "cannot answer" skip was printed once
        self.log = log or logger.info
        self.probe_prompts = probe_prompts or [[1, 2, 3, 4]]
        self.fused_digest = False  # whether the last sync's C2 took the learner side from the transport's copy
        self.expected_version = int(engine.weight_version)
        self.syncs = 0
        self.record_engine()

    @property
    def engine(self) -> Any:
        return self._engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        """The engine the sync updates (set again after an engine restart); its optional capabilities read once."""
        self._engine = engine
        self.caps = engine_capabilities(engine)

    # ---- state recorded at load ------------------------------------------------------------------------
    def record_engine(self) -> None:
        """What the engine serves right after a load: its tensor names, dtypes, shapes (the update's target
        spec) and the data pointers its kernels read (the C4 baseline). Call again after an engine restart."""
        if Capability.PARAM_SPECS in self.caps:  # {name: (dtype, shape)} without hashing every tensor
            self.spec = {n: (str(d).removeprefix("torch."), tuple(s)) for n, (d, s) in self.engine.param_specs().items()}
        else:
            self.spec = {n: checks.parse_digest(d) for n, d in self.engine.weight_digests().items()}
        self._spec_names = frozenset(self.spec)
        self._layout_cache: _Layout | None = None
        # an engine with ``check_state`` (the reference engine) answers C4 and C2's engine side in one read of
        # its live tensors; the pointers then come as two aligned tuples, compared as one tuple per sync
        # (``runtime.sync_shared: false``: the two separate calls, storage_pointers and weight_group_fingerprints,
        # for an A/B of the same engine)
        self._shared = Capability.CHECK_STATE in self.caps and switch("sync_shared")
        self._ptr_names: tuple[str, ...] | None = None
        self._ptr_base: tuple[int, ...] | None = None
        try:
            if self._shared:
                st = self.engine.check_state(None)
                self._ptr_names, self._ptr_base = st["names"], st["pointers"]
                self.pointers: dict[str, int] | None = dict(zip(self._ptr_names, self._ptr_base, strict=True))
            else:
                self.pointers = dict(self.engine.storage_pointers())
        except (NotImplementedError, BackendUnavailable):
            self.pointers = None
        self.expected_version = int(self.engine.weight_version)

    def _layout(self, items: list[Item], engine_q: Mapping[str, Any]) -> tuple[_Layout, bool]:
        """The per-layout host work of a sync (buckets' slots, the scale map, C2's groups, the C5 validation
        verdict), reused when this export has the previous one's names, dtypes, shapes, formats, components,
        sources and groups, the engine the same spec and live formats: the layout of an RL run repeats every
        step. Returns (layout, reused)."""
        key = tuple([(it.name, it.tensor.dtype, it.tensor.shape, it.fmt, it.component, it.source, it.group)
                     for it in items])
        lay = self._layout_cache
        if lay is not None and lay.spec is self.spec and lay.key == key and lay.engine_q == engine_q:
            return lay, True
        lay = self._layout_cache = _Layout(key, self.spec, dict(engine_q), items)
        return lay, False

    def mode(self, name: str) -> str:
        return self.config.mode(name)

    # ---- the sync ------------------------------------------------------------------------------------
    def initial_sync(self, learner: Any) -> SyncReport:
        """A full sync with a full byte compare (C2), after recording the freshly loaded engine again."""
        self.record_engine()
        return self.sync(learner, full_compare=self.config.full_compare != "off")

    def sync(self, learner: Any, *, full_compare: bool | None = None) -> SyncReport:
        # No cyclic-garbage collection inside a sync: a sync allocates ~10 small objects per tensor (views, slots,
        # names), enough to trigger a full collection of the trainer's heap (a 0.22 s stall seen on CPU; likely
        # the outliers of earlier H200 runs). The engine is paused meanwhile; the collection runs after, as it
        # would.
        gc_was = gc.isenabled()
        gc.disable()
        try:
            return self._sync(learner, full_compare)
        finally:
            if gc_was:
                gc.enable()

    def _sync(self, learner: Any, full_compare: bool | None) -> SyncReport:
        t0 = time.perf_counter()
        if full_compare is None:
            full_compare = self.config.full_compare == "always" or (
                self.config.full_compare == "initial" and self.syncs == 0)
        times: dict[str, float] = {}
        verdicts: dict[str, Verdict] = {}

        def timed(name: str, fn: Callable[[], Verdict]) -> Verdict:
            if self.mode(name) == "off":
                why = self._env_off.get(name)
                v = skipped(name, f"check turned off by the environment ({why})" if why else
                            "check turned off (sync.checks." + name + ": off)")
            else:
                s = time.perf_counter()
                try:
                    v = fn()
                except EngineError as exc:  # the engine could not answer: the condition is not proven
                    v = failed(name, None, f"could not run: the engine failed ({type(exc).__name__}: {exc})")
                except (BackendUnavailable, NotImplementedError) as exc:  # this backend cannot answer (C7)
                    v = skipped(name, f"the engine cannot answer this check: {exc}")
                v = dataclasses.replace(v, seconds=v.seconds + time.perf_counter() - s)
            verdicts[name] = v
            return v

        # 1. export (the learner's own grid; nothing re-quantized) under the engine's names
        s = time.perf_counter()
        executed = learner.executed_quantized() if hasattr(learner, "executed_quantized") else None
        items = engine_items(learner.export_weights(), self.target, getattr(self.plan, "layout", None))
        _barrier()
        times["export"] = time.perf_counter() - s

        # 2. pre-checks: nothing written yet
        plan_q = {n: e.format for n, e in self.plan.quantized().items()} if self.plan is not None else {}
        live_q: str | None = None  # why the engine's live formats are unknown (then C1 is skipped, not guessed)
        try:
            engine_q = dict(self.engine.quantized_params())
        except (BackendUnavailable, NotImplementedError) as exc:  # a backend that cannot report them (stock SGLang)
            live_q = f"the engine cannot report its live quantized parameters ({type(exc).__name__}: {exc})"
            engine_q = dict(plan_q)  # the update is still validated, against the plan's formats
        except Exception as exc:
            report = self._report(verdicts, times, t0, 0, 0, full_compare, "pre-checks")
            raise SyncAbortedError(f"weight sync aborted before any byte was written: the engine did not answer "
                                   f"quantized_params() ({type(exc).__name__}: {exc}); check it is alive, restart it "
                                   "and resync", "pre-checks", None, report) from exc
        if live_q is None:
            timed("layer_audit", lambda: self._layer_audit(executed, engine_q, plan_q))
        else:
            timed("layer_audit", lambda: skipped("layer_audit", live_q + "; C1 not proven for this sync"))
        layout, same = self._layout(items, engine_q)
        if same and layout.validation is not None:  # the verdict of these very inputs (names, dtypes, shapes, ...)
            timed("completeness", lambda: layout.validation)
        else:
            v = timed("completeness", lambda: checks.validate_update(items, self.spec, engine_q))
            layout.validation = dataclasses.replace(v, seconds=0.0) if v.ok else None
        pre_fail = [verdicts[n] for n in PRE_CHECKS
                    if verdicts[n].failed and (self.mode(n) == "raise" or n == "completeness")]
        if pre_fail:
            report = self._report(verdicts, times, t0, 0, 0, full_compare, "pre-checks")
            raise SyncCheckError("weight sync refused before any byte was written: "
                                 + " | ".join(v.describe() for v in pre_fail), pre_fail, report)

        # 3. pause -> flush -> begin -> buckets -> finish
        buckets = layout.buckets_for(items, self.config.bucket_bytes)
        fused = None  # the learner side of C2 computed by the transport while it reads the payload
        if (self.config.c2_learner_side == "fused" and isinstance(self.transport, InProcessTransport)
                and not full_compare and self.mode("grid") != "off" and Capability.GROUP_FINGERPRINTS in self.caps):
            fused = torch.zeros(len(layout.groups), dtype=torch.int64, device=self.transport.staging.device)
            for b in buckets:
                b.digest = (layout.digest_where, fused)
        ledger = Ledger(self._spec_names)
        scales = layout.scales
        nbytes = sum(b.payload_bytes for b in buckets)
        stage, index = "pause", None
        try:
            self.engine.pause()
            self.engine.flush_cache()
            stage = "begin"
            self.engine.begin_weight_update()
            t_transfer = t_apply = 0.0
            for b in buckets:
                index = b.index
                ledger.sent(b)
                stage = "transfer"
                s = time.perf_counter()
                received = self.transport.send(b)
                _barrier()
                t_transfer += time.perf_counter() - s
                if isinstance(received, Receipt):  # applied in the engine's process on arrival (its time: transfer)
                    stage = "apply"
                    if received.error:
                        raise EngineError(f"the engine rank refused bucket {b.index + 1}: {received.error}")
                    ledger.receipt(b.index, received.names, received.ff)
                    continue
                ledger.received(b.index, received, scales)
                stage = "apply"
                s = time.perf_counter()
                if received:
                    self.engine.update_weights(received)
                _barrier()
                t_apply += time.perf_counter() - s
            stage, index = "finish", None
            s = time.perf_counter()
            self.engine.finish_weight_update()
            _barrier()
            times["finish"] = time.perf_counter() - s
            times["transfer"], times["apply"] = t_transfer, t_apply
        except Exception as exc:
            report = self._report(verdicts, times, t0, nbytes, len(buckets), full_compare, stage)
            where = f" at bucket {index + 1} of {len(buckets)}" if index is not None else ""
            kept = self._abort(stage, exc)
            advice = ("the update was dropped before any byte was written and the engine serves its previous "
                      "weights again; fix the cause and sync again" if kept else
                      "the engine may hold a partial update: restart it (or check it is alive) and run a full "
                      "resync (WeightSync.initial_sync)")
            raise SyncAbortedError(f"weight sync aborted in '{stage}'{where}: {type(exc).__name__}: {exc}. "
                                   f"{advice}", stage, index, report) from exc
        self.expected_version += 1
        self.syncs += 1

        # 4. post-checks
        timed("version", lambda: checks.version(self.expected_version, int(self.engine.weight_version)))
        pre = verdicts["completeness"]
        timed("completeness", lambda: _combine("completeness", [pre, checks.completeness(ledger, len(buckets))]))
        self.fused_digest = fused is not None and bool(buckets) and all(b.digested for b in buckets)

        state: dict[str, Any] = {}  # the engine's check_state answer, shared by grid (C2) and storage (C4)

        def grid() -> Verdict:
            mine = None
            if self.fused_digest:  # read back here, so the check's timer holds it: (heads, int64 sums)
                mine = (layout.heads, fused.cpu().tolist())
            elif not full_compare and Capability.GROUP_FINGERPRINTS in self.caps:
                mine = layout.learner_values(items)  # the export's own tensors (sync.c2_learner_side: export)
            return self._grid(items, full_compare, engine_q, layout.groups, mine, layout, state)

        # C3's device work queued first (a captured graph's replay, where the engine offers it): it then runs
        # while grid and storage walk the served tensors on the host; its launch time is self_check's, and any
        # of its device time not hidden by that walk is waited for by grid's read-back
        begun = 0.0
        if self.mode("self_check") != "off" and Capability.SELF_CHECK_BEGIN in self.caps:
            s = time.perf_counter()
            try:
                self.engine.self_check_begin(self.config.self_check_seed)
            except Exception:  # noqa: BLE001 (an optimisation only: self_check itself runs and reports below)
                pass
            begun = time.perf_counter() - s
        timed("grid", grid)
        timed("self_check", lambda: checks.self_check(self._self_check(full_compare),
                                                      self.config.self_check_tolerance))
        if begun:
            verdicts["self_check"] = dataclasses.replace(verdicts["self_check"],
                                                         seconds=verdicts["self_check"].seconds + begun)
        timed("storage", lambda: self._storage(state))
        if "pointer_seconds" in state and "pointers_from_grid" in state:
            # one engine call read the pointers for C4 inside grid's timer: that share is storage's time
            ps = state["pointer_seconds"]
            verdicts["grid"] = dataclasses.replace(verdicts["grid"], seconds=max(0.0, verdicts["grid"].seconds - ps))
            verdicts["storage"] = dataclasses.replace(verdicts["storage"], seconds=verdicts["storage"].seconds + ps)
        raising = [v for n, v in verdicts.items() if v.failed and self.mode(n) == "raise"]
        if not raising:
            self.engine.resume()
            # C6 last: a probe generation needs a serving engine; a raise-mode failure pauses it again
            if timed("sentinel", lambda: self._sentinel(learner)).failed and self.mode("sentinel") == "raise":
                self.engine.pause()
                raising = [verdicts["sentinel"]]

        # a raise-mode check that ran and came back skipped guards nothing: said once per check, on the console
        # (the sentinel is skipped until the RL loop's first step, by design)
        skip_notes = [v for n, v in verdicts.items() if v.status == "skipped" and n != "sentinel"
                      and self.mode(n) == "raise" and n not in self._skips_said]
        self._skips_said.update(v.name for v in skip_notes)
        report = self._report(verdicts, times, t0, nbytes, len(buckets), full_compare, "done", skip_notes)
        if raising:
            raise SyncCheckError(f"weight sync v{self.expected_version} failed {len(raising)} check(s); the engine "
                                 "is left paused: " + " | ".join(v.describe() for v in raising), raising, report)
        return report

    # ---- check helpers ---------------------------------------------------------------------------------
    def _layer_audit(self, executed: Mapping[str, Any] | None, engine_q: Mapping[str, Any],
                     plan_q: Mapping[str, Any]) -> Verdict:
        """C1 (``checks.layer_audit``); an ok verdict reused while the three sides are equal (dict comparisons,
        read every sync) to those it was computed from: the same inputs give the same verdict."""
        hit = getattr(self, "_audit_cache", None)
        if hit is not None and hit[0] == executed and hit[1] == engine_q and hit[2] == plan_q:
            return hit[3]
        v = checks.layer_audit(executed, engine_q, plan_q)
        self._audit_cache = ((dict(executed) if executed is not None else None), dict(engine_q), dict(plan_q),
                             v) if v.ok else None
        return v

    def _storage(self, state: dict[str, Any]) -> Verdict:
        """C4. With ``check_state``: the pointers read by grid's engine call (or read here), compared with those
        recorded at load as one tuple; the names of what moved only when something did."""
        if not self._shared or self._ptr_base is None:
            return checks.storage_identity(self.pointers, self.engine.storage_pointers())
        st = state if "pointers" in state else self.engine.check_state(None)
        names, ptrs = st["names"], st["pointers"]
        if (names is self._ptr_names or names == self._ptr_names) and ptrs == self._ptr_base:
            return ok("storage", 0.0, f"{len(ptrs)} served tensors keep their storage")
        return checks.storage_identity(self.pointers, dict(zip(names, ptrs, strict=True)))

    def _grid(self, items: list[Item], full: bool, engine_q: Mapping[str, Any],
              groups: Mapping[str, list[str]] | None = None,
              mine: Mapping[str, str] | tuple[list[str], list[int]] | None = None, layout: _Layout | None = None,
              state: dict[str, Any] | None = None) -> Verdict:
        expected: Mapping[str, torch.Tensor] | None = None  # {name: export tensor}, built only where needed
        if full:
            expected = {it.name: it.tensor for it in items}
            got = self.engine.read_weights(list(expected))
            main = checks.grid_full(expected, got)
        elif Capability.GROUP_FINGERPRINTS in self.caps:
            main = self._grid_groups(items, None, groups, mine, state)
        elif Capability.FINGERPRINTS in self.caps:
            expected = {it.name: it.tensor for it in items}
            main = checks.grid_digests(fingerprints(expected), self.engine.weight_fingerprints(list(expected)))
        else:
            expected = {it.name: it.tensor for it in items}
            main = checks.grid_digests({n: tensor_digest(t) for n, t in expected.items()},
                                       self.engine.weight_digests(list(expected)))
        parts = [main]
        if self.plan is not None:  # the plan's gate/up groups that the engine holds in NVFP4 (its live formats)
            groups = self._scale_groups(engine_q)
            if groups:
                names = [n for _, ns in groups for n in ns]
                index = layout.index if layout is not None else {it.name: i for i, it in enumerate(items)}
                if main.ok and all(n in index for n in names):
                    # the engine holds the export's bytes (just proven): its global scales are these, already
                    # where the learner computes; no read-back of a few hundred scalars from the engine
                    held = {n: items[index[n]].tensor for n in names}
                else:
                    held = self.engine.read_weights(names)
                parts.append(checks.joint_scales(groups, held))
        return _combine("grid", parts)

    def _scale_groups(self, engine_q: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
        """``checks.global_scale_names(target, plan.groups, engine_q)``, reused while the plan, its groups, the
        target and the engine's live formats are the ones it was computed from (every RL step)."""
        hit = getattr(self, "_scale_groups_cache", None)
        if (hit is not None and hit[0] is self.plan and hit[1] is self.plan.groups and hit[2] == self.target
                and hit[3] == engine_q):
            return hit[4]
        out = checks.global_scale_names(self.target, self.plan.groups, engine_q)
        self._scale_groups_cache = (self.plan, self.plan.groups, self.target, dict(engine_q), out)
        return out

    def _grid_groups(self, items: list[Item], expected: Mapping[str, torch.Tensor] | None,
                     groups: Mapping[str, list[str]] | None = None,
                     mine: Mapping[str, str] | tuple[list[str], list[int]] | None = None,
                     state: dict[str, Any] | None = None) -> Verdict:
        """C2 by atomic group: one fingerprint per group (all experts of a layer, q/k/v, ...) of its tensors'
        bytes in export order, on each side; only the tensors of a group that differs are fingerprinted one by
        one, to name them. ``groups``: the layout's (``_Layout.groups``), else built from ``items``; ``mine``:
        the learner side already computed by the transport from the same bytes (the fused copy: its heads and
        int64 sums), else here. ``state``: with an engine that has ``check_state``, its answer is stored there
        for C4 (``_storage``: one read of the live tensors for both checks)."""
        if groups is None:
            groups = _groups_of(items)
        if expected is None and mine is None:
            expected = {it.name: it.tensor for it in items}
        if mine is None:
            mine = group_fingerprints({g: [expected[n] for n in ns] for g, ns in groups.items()})
        if self._shared and state is not None:  # the same engine call reads C4's pointers (``_storage``)
            st = self.engine.check_state(groups)
            state.update(st, pointers_from_grid=True)
            if isinstance(mine, tuple) and st["group_heads"] == mine[0] and st["group_values"] == mine[1]:
                differ = []  # the healthy case: two lists of ints and two of heads, equal
            else:
                theirs = group_strings(list(groups), st["group_heads"], st["group_values"])
                if isinstance(mine, tuple):
                    mine = group_strings(list(groups), *mine)
                differ = [g for g, d in mine.items() if theirs.get(g) != d]
        else:
            theirs = self.engine.weight_group_fingerprints(groups)
            if isinstance(mine, tuple):
                mine = group_strings(list(groups), *mine)
            differ = [g for g, d in mine.items() if theirs.get(g) != d]
        if not differ:
            return ok("grid", 0.0, f"{len(items)} tensors in {len(groups)} groups equal the learner's export "
                      "(group digest)")
        if expected is None:
            expected = {it.name: it.tensor for it in items}
        names = [n for g in differ for n in groups[g]]
        main = checks.grid_digests(fingerprints({n: expected[n] for n in names}),
                                   self.engine.weight_fingerprints(names))
        if main.ok:  # the groups differ but no member does: the order or the set of tensors differs
            return failed("grid", float(len(differ)), f"{len(differ)} of {len(groups)} groups differ from the "
                          "learner's export (group digest) although each tensor matches", differ)
        return dataclasses.replace(main, reason=main.reason + f" in {len(differ)} of {len(groups)} groups")

    def _self_check(self, full_compare: bool = False) -> Mapping[str, Any] | None:
        try:
            result = self.engine.self_check(self.config.self_check_seed)
            if full_compare and Capability.SELF_CHECK_EVERY_LAYER in self.caps and isinstance(result, Mapping):
                # the full-compare syncs (the initial one, after every engine restart): every quantized layer's
                # serving state against a fresh derivation, where a loader mismatch shows first
                layers = dict(result.get("layers", {}))
                layers.update((n, v) for n, v in self.engine.self_check_every_layer().items() if n not in layers)  # the probed ones keep rel_err
                result = {**result, "layers": layers}
            return result
        except (NotImplementedError, BackendUnavailable) as exc:
            return {"reason": f"the engine has no self-check ({exc})"}

    def _sentinel(self, learner: Any) -> Verdict:
        if self.config.probe_tokens <= 0:
            last = self.sentinel.last
            return dataclasses.replace(last, reason=last.reason + " (the RL loop's last step; sync.probe_tokens "
                                       "= 0: no probe generation)")
        from miles_lp.rollout.engine import SamplingParams

        gens = self.engine.generate(self.probe_prompts, SamplingParams(temperature=1.0,
                                    max_new_tokens=self.config.probe_tokens, seed=self.config.self_check_seed))
        seqs = [torch.tensor(list(p) + list(g.output_ids)) for p, g in zip(self.probe_prompts, gens, strict=True)]
        train_lp, _ = learner.logprobs(seqs)
        train = [lp[len(p) - 1:] for lp, p in zip(train_lp, self.probe_prompts, strict=True)]
        kl = rollout_kl([g.logprobs for g in gens], train)
        self.probe_kl = kl
        versions = {g.weight_version for g in gens}
        # the probe judged on its own (a fresh Sentinel: one generation is not a step of the run's streaks), then
        # combined with the RL step's verdict when a step fed the shared sentinel since the last sync: the probe
        # must not hide the step's own failure (NaN rollout log-probs reported as ok)
        probe = Sentinel(self.sentinel.config).update(rollout_logprobs=[g.logprobs for g in gens], kl=kl)
        if versions != {self.expected_version}:
            probe = failed("sentinel", kl, f"probe generations report weight version(s) {sorted(versions)}, "
                           f"expected {self.expected_version}")
        step = self.sentinel.last if self.sentinel.steps > self._sentinel_steps else None
        self._sentinel_steps = self.sentinel.steps
        if step is not None and step.failed:
            return dataclasses.replace(step, reason=f"{step.reason} (the RL step's rollouts; the probe: "
                                       f"{probe.status})")
        if probe.failed or step is None:
            return dataclasses.replace(probe, reason="probe generation: " + probe.reason)
        return dataclasses.replace(probe, reason=f"probe generation: {probe.reason}; the RL step: {step.reason}")

    # ---- reporting -------------------------------------------------------------------------------------
    def _abort(self, stage: str, exc: BaseException) -> bool:
        """After a failure before ``finish``: drop the open update where the engine can (nothing written) and
        resume it, so a refused update does not leave a server paused for its other clients. A ``finish`` refused
        whole (``WeightUpdateError``: a disk update the server declined before loading) is resumed too; an engine
        left with a partial state refuses generation itself. True when the engine serves its previous weights."""
        if stage == "pause":
            return False
        if stage == "finish":
            if not isinstance(exc, WeightUpdateError):
                return False
            try:
                self.engine.resume()
                # a disk update that failed after writing leaves the engine refusing generation (partial state):
                # resumed, but it does not serve the previous weights
                return str(self.engine.health().get("status", "ok")) == "ok"
            except Exception:  # noqa: BLE001 - a dead engine: the caller restarts it
                return False
        try:
            if stage != "begin":
                if Capability.ABORT_UPDATE not in self.caps:
                    return False
                self.engine.abort_weight_update()
            self.engine.resume()
            return True
        except Exception:  # noqa: BLE001 - a dead or partially written engine: the caller restarts it
            return False

    def _report(self, verdicts: dict[str, Verdict], times: dict[str, float], t0: float, nbytes: int,
                nbuckets: int, full: bool, stage: str, skip_notes: Sequence[Verdict] = ()) -> SyncReport:
        for name in CHECKS:  # C7: every check has a verdict, or the reason it did not run
            verdicts.setdefault(name, skipped(name, f"the sync stopped in '{stage}' before this check ran"))
        ordered = tuple(verdicts[n] for n in CHECKS)
        total = time.perf_counter() - t0
        check_s = sum(v.seconds for v in ordered)
        m: dict[str, float] = {
            "perf/sync_seconds": total,
            "perf/sync_check_seconds": check_s,
            "sync/bytes": float(nbytes),
            "sync/buckets": float(nbuckets),
            "sync/weight_version": float(self.expected_version),
        }
        for k in ("export", "transfer", "apply", "finish"):
            if k in times:
                m[f"perf/sync_{k}_seconds"] = times[k]
        for v in ordered:
            m.update(v.metrics())
        line = (f"sync v{self.expected_version} [{stage}]: {nbuckets} bucket(s), {nbytes / 1e6:.2f} MB in "
                f"{total:.3f} s (checks {check_s:.3f} s{', full compare' if full else ''}): "
                + " ".join(v.short() for v in ordered))
        bad = [v.describe() for v in ordered if v.failed]
        if bad:
            line += " | FAILED: " + " | ".join(bad)
        if skip_notes:
            line += (" | SKIPPED IN RAISE MODE (said once per check): "
                     + " | ".join(v.describe() for v in skip_notes))
        self.log(line)
        return SyncReport(self.expected_version, ordered, m, total, check_s, nbytes, nbuckets, full, line, stage)
