"""``rollout.engines: N``: several rollout engines serving one run, as one ``Engine`` to the RL step.

    fleet = EngineFleet([make(0), make(1)], rebuild=make, dead=is_dead)
    fleet.attach(FleetSync([...one WeightSync per engine...]), learner)
    gens = fleet.generate(inputs, sampling)        # what grpo_step calls

Spreading: the prompts of one call are cut into *units*, each a run of identical consecutive prompts (one
prompt's GRPO group, so the engine's prefix cache holds the prompt once), and each unit goes to the engine with
the least work queued (prompt + response tokens), ties to the lowest index. Each unit is generated with its own
seed, ``unit_seed(sampling.seed, unit index)``: the samples depend on the call's prompts and seed only, not on how
many engines there are or which engine took which unit (an engine samples a unit alone, so no other unit shares
its batch). One engine (``rollout.engines: 1``) does not go through the fleet: it samples the whole call as one
batch under the call's seed, as before.

An engine that dies (``dead(engine, exc)``: its process is gone) is replaced while the others keep serving:
``rebuild(i)`` starts a fresh one, the fleet sync records it and resyncs it in full (every tensor, full byte
compare) to the learner's current weights, and the units it had not returned are generated again on it. Their
seeds are fixed, so the step's samples are the ones an undisturbed run draws: none lost, none twice. An engine
that dies inside a weight sync is replaced the same way (``FleetSync`` raises ``SyncAbortedError`` with
``engine_index``; ``sync`` here restarts that engine and resyncs it): the learner's update is already in the
learner, so the fresh engine gets it in full. ``MAX_RESTARTS`` per engine over the run, then the error stands.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from miles_lp.rollout.engine import Generation, SamplingParams

#: fresh engines per engine slot over a run before its death is an error
MAX_RESTARTS = 3


def unit_seed(seed: int | None, unit: int) -> int | None:
    """The sampling seed of the ``unit``-th unit of a call seeded ``seed`` (None: unseeded)."""
    if seed is None:
        return None
    return (int(seed) * 1_000_003 + unit * 7919 + 17) % (2**31 - 1)


def units_of(inputs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of ``inputs`` cut into runs of identical consecutive prompts (a GRPO group each)."""
    out: list[list[int]] = []
    for i, p in enumerate(inputs):
        if out and list(inputs[out[-1][0]]) == list(p):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def spread(loads: Sequence[float], costs: Sequence[float]) -> list[int]:
    """Least-loaded assignment: unit ``u`` (in order) to the engine with the least queued work, ties to the lowest
    index; ``loads``: each engine's work queued before this call."""
    load = list(loads)
    out = []
    for c in costs:
        i = min(range(len(load)), key=lambda k: (load[k], k))
        out.append(i)
        load[i] += c
    return out


class EngineFleet:
    """N engines as one: ``generate`` spread over them, ``weight_version`` the fleet's sync count; pause /
    resume / flush / close to every engine. The weight sync goes through ``FleetSync`` (``attach``)."""

    def __init__(self, engines: Sequence[Any], *, rebuild: Callable[[int], Any],
                 dead: Callable[[Any, BaseException], bool], on_restart: Callable[[int, Any], None] | None = None):
        if len(engines) < 2:
            raise ValueError("EngineFleet is for two or more engines; one engine is used as it is")
        self.engines = list(engines)
        self.rebuild, self.dead, self.on_restart = rebuild, dead, on_restart
        self.restarts = [0] * len(self.engines)
        self.sync: Any = None
        self.learner: Any = None
        self._load = [0.0] * len(self.engines)
        self._lock = threading.Lock()
        self._slot_locks = [threading.Lock() for _ in self.engines]

    def attach(self, sync: Any, learner: Any) -> None:
        """The fleet's ``FleetSync`` and the learner a fresh engine is resynced from."""
        self.sync, self.learner = sync, learner

    # ---- the Engine protocol, as the RL step and the run use it --------------------------------------------
    @property
    def weight_version(self) -> int:
        return int(self.sync.expected_version) if self.sync is not None else int(self.engines[0].weight_version)

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Generation]:
        units = units_of(input_ids)
        costs = [len(u) * (len(input_ids[u[0]]) + sampling.max_new_tokens) for u in units]
        with self._lock:
            where = spread(self._load, costs)
            for i, c in zip(where, costs, strict=True):
                self._load[i] += c
        out: list[Generation | None] = [None] * len(input_ids)
        errors: list[BaseException] = []

        def serve(i: int, mine: list[int]) -> None:
            try:
                for u in mine:
                    gens = self._generate_unit(i, [list(input_ids[k]) for k in units[u]],
                                               dataclasses.replace(sampling, seed=unit_seed(sampling.seed, u)))
                    for k, g in zip(units[u], gens, strict=True):
                        out[k] = g
                    with self._lock:
                        self._load[i] -= costs[u]
            except BaseException as exc:  # reported after every engine's thread is done
                errors.append(exc)

        by_engine = {i: [u for u, e in enumerate(where) if e == i] for i in range(len(self.engines))}
        threads = [threading.Thread(target=serve, args=(i, mine), name=f"miles-lp-engine{i}", daemon=True)
                   for i, mine in by_engine.items() if mine]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._lock:  # a failed call's queued work is not queued any more
            for i, u in zip(where, range(len(units)), strict=True):
                if any(out[k] is None for k in units[u]):
                    self._load[i] = max(0.0, self._load[i] - costs[u])
        if errors:
            raise errors[0]
        return [g for g in out if g is not None]

    def _generate_unit(self, i: int, prompts: list[list[int]], sampling: SamplingParams) -> list[Generation]:
        while True:
            engine = self.engines[i]
            try:
                gens = engine.generate(prompts, sampling)
            except Exception as exc:
                if not self._restartable(i, engine, exc):
                    raise
                self.restart(i, exc)
                continue
            return [dataclasses.replace(g, weight_version=self._version(i, g.weight_version)) for g in gens]

    def _version(self, i: int, v: int) -> int:
        return self.sync.version_of(i, v) if self.sync is not None else int(v)

    def _restartable(self, i: int, engine: Any, exc: BaseException) -> bool:
        return self.sync is not None and self.dead(engine, exc) and self.restarts[i] < MAX_RESTARTS

    def restart(self, i: int, why: BaseException | None = None) -> Any:
        """Engine ``i`` replaced by ``rebuild(i)`` and resynced in full; the other engines are not touched (one
        replacement at a time per slot). Returns the resync's report."""
        with self._slot_locks[i]:
            old = self.engines[i]
            try:
                old.close()
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.restarts[i] += 1
            print(f"miles-lp run: rollout engine {i} died ({why}); starting a fresh one and resyncing every tensor "
                  f"(restart {self.restarts[i]} of {MAX_RESTARTS} for this engine; the others keep serving)",
                  file=sys.stderr, flush=True)
            fresh = self.rebuild(i)
            self.engines[i] = fresh
            report = self.sync.resync(i, fresh, self.learner)
            if self.on_restart is not None:
                self.on_restart(i, fresh)
            return report

    def sync_weights(self, learner: Any) -> Any:
        """``FleetSync.sync``, with an engine that died inside it replaced and resynced in full (the update is in
        the learner already; nothing is applied twice: the fresh engine loads it once, from the learner)."""
        from miles_lp.sync.verdict import SyncAbortedError

        try:
            return self.sync.sync(learner)
        except SyncAbortedError as exc:
            i = getattr(exc, "engine_index", None)
            if i is None or not self._restartable(i, self.engines[i], exc):
                raise
            resynced = self.restart(i, exc)
            # the engines before ``i`` hold this update, ``i`` got it in full from the learner: the rest get it now
            return self.sync.sync(learner, only=range(i + 1, len(self.engines)), done={i: resynced})

    def total_restarts(self) -> int:
        return sum(self.restarts)

    def pause(self) -> None:
        for e in self.engines:
            e.pause()

    def resume(self) -> None:
        for e in self.engines:
            e.resume()

    def flush_cache(self) -> None:
        for e in self.engines:
            e.flush_cache()

    def health(self) -> dict[str, Any]:
        per = []
        for e in self.engines:
            try:
                per.append(dict(e.health()))
            except Exception as exc:  # noqa: BLE001 - reported, not raised: health is a question
                per.append({"status": "unreachable", "error": str(exc)})
        status = "ok" if all(str(p.get("status", "ok")) == "ok" for p in per) else "degraded"
        return {"status": status, "engines": per, "restarts": list(self.restarts)}

    def close(self) -> None:
        for e in self.engines:
            try:
                e.close()
            except Exception:  # noqa: BLE001 - closing the rest matters more
                pass


class FleetSyncForStep:
    """What ``grpo_step`` calls as ``p.sync`` for a fleet: ``FleetSync`` with an engine's death inside the sync
    handled by the fleet (``EngineFleet.sync_weights``)."""

    def __init__(self, fleet: EngineFleet):
        self.fleet = fleet

    @property
    def inner(self) -> Any:
        return self.fleet.sync

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fleet.sync, name)

    def sync(self, learner: Any) -> Any:
        return self.fleet.sync_weights(learner)

    def initial_sync(self, learner: Any) -> Any:
        return self.fleet.sync.initial_sync(learner)


def check_fleet(recipe: Any) -> None:
    """``rollout.engines`` / ``rollout.urls`` against the backend and the transport, naming the keys."""
    from miles_lp.errors import ConfigError

    n = engines_of(recipe)
    if n == 1:
        return
    if recipe.sampler_precision is not None:
        raise ConfigError(f"rollout.engines: {n} with sampler_precision (a comparison arm) is not built; use one "
                          "engine for comparison arms")


def engines_of(recipe: Any) -> int:
    """The number of rollout engines the recipe asks for (``rollout.engines``, or one per ``rollout.urls``)."""
    fleet = getattr(recipe, "fleet", None)
    return 1 if fleet is None else fleet.count
