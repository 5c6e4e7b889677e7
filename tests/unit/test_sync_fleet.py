"""Several engines as one: one export synced into each and every check run on each (per-engine verdicts); an
engine that fails a check is named; one that dies inside a sync or while generating is replaced and resynced
in full while the others keep theirs; the spreading keeps a prompt's group on one engine, least-loaded first."""

import pytest
import torch

from miles_lp.launch.engines import EngineFleet, spread, unit_seed, units_of
from miles_lp.rollout.engine import EngineError, Generation, SamplingParams
from miles_lp.sync import SyncCheckError, SyncConfig, WeightSync
from miles_lp.sync.faults import DyingEngine, RegridEngine
from miles_lp.sync.fleet import FleetSync
from tests.unit.test_sync_weight_sync import Learner, StubEngine, _plan


class Engine(StubEngine):
    """A stub engine that also generates: one token per prompt, the seed it was asked with, and its version."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def generate(self, prompts, sampling):
        self.calls.append((len(prompts), sampling.seed))
        return [Generation([sampling.seed % 97], torch.zeros(1), "length", self.weight_version) for _ in prompts]

    def health(self):
        return {"status": "ok"}

    def close(self):
        pass


class Dies(DyingEngine):
    """Dies at bucket ``at`` of a sync, or at its first generate (``at=None``): later calls fail; health says dead."""

    def __init__(self, inner, at=None):
        super().__init__(inner, at=10**9 if at is None else at)
        self.on_generate = at is None

    def generate(self, prompts, sampling):
        if self.on_generate or self.dead:
            self.dead = True
            raise EngineError("engine process exited")
        return self.inner.generate(prompts, sampling)

    def health(self):
        return {"status": "dead" if self.dead else "ok"}

    def close(self):
        pass


def _ws(engine):
    return WeightSync(engine, _plan(), "sglang", SyncConfig(bucket_mb=0.004).with_modes(all="raise"), env={},
                      log=lambda line: None)


def _fleet(engines, fresh=Engine):
    made = []

    def rebuild(i):
        made.append(i)
        return fresh()
    fleet = EngineFleet(engines, rebuild=rebuild, dead=lambda e, exc: e.health()["status"] == "dead")
    learner = Learner()
    fleet.attach(FleetSync([_ws(e) for e in engines], log=lambda line: None), learner)
    return fleet, learner, made


def test_units_keep_a_group_together_and_spread_least_loaded():
    inputs = [[1, 2]] * 4 + [[3]] * 4 + [[4, 5, 6]] * 4
    assert units_of(inputs) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert spread([0, 0], [10, 6, 7]) == [0, 1, 1]
    assert spread([100, 0, 0], [5, 5, 5]) == [1, 2, 1]
    assert unit_seed(None, 3) is None and unit_seed(5, 0) != unit_seed(5, 1)


def test_every_engine_is_synced_and_checked_from_one_export():
    engines = [Engine(), Engine()]
    fleet, learner, _ = _fleet(engines)
    calls = []
    real = learner.export_weights
    learner.export_weights = lambda: (calls.append(1), real())[1]
    r0 = fleet.sync.initial_sync(learner)
    assert r0.ok and r0.weight_version == 1 and len(calls) == 1
    r = fleet.sync_weights(learner)
    assert r.ok and r.weight_version == 2 and len(calls) == 2
    for name in ("grid", "layer_audit", "storage", "version", "self_check", "completeness"):
        assert r.metrics[f"sync/check/{name}"] == 1.0
        assert r.metrics[f"sync/check/{name}/engine0"] == 1.0 and r.metrics[f"sync/check/{name}/engine1"] == 1.0
    assert r.metrics["sync/engines"] == 2.0 and all(e.weight_version == 2 for e in engines)


def test_a_check_failing_on_one_engine_is_named_and_the_others_still_get_the_version():
    good = Engine()
    bad = RegridEngine(Engine(), "floor")
    fleet, learner, _ = _fleet([good, bad])
    with pytest.raises(SyncCheckError, match="engine 1") as e:
        fleet.sync.sync(learner, full_compare=False)
    m = e.value.report.metrics
    assert m["sync/check/grid/engine0"] == 1.0 and m["sync/check/grid/engine1"] == 0.0 and m["sync/check/grid"] == 0.0
    assert good.weight_version == 1


def test_an_engine_dying_inside_a_sync_is_replaced_and_resynced_in_full():
    e0, e1, e2 = Engine(), Dies(Engine(), at=10**9), Engine()
    fleet, learner, made = _fleet([e0, e1, e2])
    fleet.sync.initial_sync(learner)
    e1.at = e1.calls + 1  # the next sync's second bucket kills engine 1
    r = fleet.sync_weights(learner)
    assert made == [1] and fleet.restarts == [0, 1, 0] and r.ok and r.weight_version == 2
    fresh = fleet.engines[1]
    assert (e0.weight_version, fresh.weight_version, e2.weight_version) == (2, 1, 2)  # each its own count
    assert fleet.sync.version_of(1, fresh.weight_version) == 2  # the fleet's
    assert r.metrics["sync/check/grid/engine1"] == 1.0 and r.metrics["sync/check/grid/engine2"] == 1.0
    assert all(torch.equal(fresh.t[n], e0.t[n]) for n in e0.t)
    r = fleet.sync_weights(learner)  # the next sync: every engine, once
    assert r.weight_version == 3 and (e0.weight_version, fresh.weight_version, e2.weight_version) == (3, 2, 3)
    assert e0.writes == e2.writes  # the engines that did not die received each update exactly once


def test_an_engine_dying_while_generating_is_replaced_and_its_units_generated_again():
    e0, e1 = Engine(), Dies(Engine())
    fleet, learner, made = _fleet([e0, e1])
    fleet.sync.initial_sync(learner)
    fleet.sync_weights(learner)  # version 2 everywhere
    inputs = [[1]] * 2 + [[2]] * 2 + [[3]] * 2 + [[4]] * 2
    gens = fleet.generate(inputs, SamplingParams(seed=7))
    assert made == [1] and fleet.restarts == [0, 1]
    assert len(gens) == 8 and [g.output_ids[0] for g in gens] == [unit_seed(7, u) % 97 for u in range(4) for _ in
                                                                  range(2)]
    assert {g.weight_version for g in gens} == {2}  # the fresh engine's own count (1) reported as the fleet's
    fresh = fleet.engines[1]
    assert fresh.weight_version == 1 and fresh.t.keys() == e0.t.keys()
    assert all(torch.equal(fresh.t[n], e0.t[n]) for n in e0.t)  # resynced in full: the learner's bytes
