"""``rollout.engines: N`` end to end (tiny model, CPU, reference engines): every sync updates and checks every
engine; an engine killed while generating is replaced and resynced while the other serves, and the run's
samples are those of an undisturbed run with another number of engines (per-unit seeds): none lost, none twice."""

from __future__ import annotations

import pytest

from miles_lp.launch.recipe import load_recipe
from miles_lp.launch.runner import LocalPlacement, Run, deterministic_metrics
from miles_lp.rollout.engine import EngineError
from tests.e2e.test_run import RECIPE


class KillOne(LocalPlacement):
    """Engine ``victim``'s first instance dies at its ``at``-th generate call (its process gone: health says dead)."""

    def __init__(self, victim: int = 1, at: int = 3):
        super().__init__()
        self.victim, self.at, self.killed = victim, at, 0

    def engine(self, run, index):
        eng = super().engine(run, index)
        if index != self.victim or self.killed:
            return eng
        placement, real_generate, calls = self, eng.generate, [0]

        def generate(prompts, sampling):
            calls[0] += 1
            if calls[0] >= placement.at:
                placement.killed += 1
                eng.health = lambda: {"status": "dead"}
                raise EngineError("engine process exited (killed)")
            return real_generate(prompts, sampling)
        eng.generate = generate
        return eng


def _recipe(tmp_path, *sets):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    return load_recipe(p, ["checkpoint_every=0", *sets])


def _comparable(rows):
    return [{k: v for k, v in r.items() if "/engine" not in k and k not in ("rollout/engine_restarts",
                                                                             "sync/engines")}
            for r in deterministic_metrics(rows)]


def test_two_engines_one_killed_mid_run(tmp_path):
    """CI: two engines, engine 1 killed in step 1's generate; the run completes, both engines checked each sync."""
    placement = KillOne(victim=1, at=2)
    run = Run.start(_recipe(tmp_path, "rollout.engines=2", "steps=2"), "two", placement=placement)
    try:
        run.train(progress=False)
    finally:
        run.close()
    rows = run.dir.read_metrics()
    assert placement.killed == 1 and [r["step"] for r in rows] == [0, 1]
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0]
    for r in rows:
        assert r["rl/samples_trained"] == 8.0 and r["tokens/generate"] > 0  # 2 prompts x 4: none lost, none twice
        for name in ("grid", "layer_audit", "storage", "version", "self_check"):
            assert r[f"sync/check/{name}"] == 1.0
            assert r[f"sync/check/{name}/engine0"] == 1.0 and r[f"sync/check/{name}/engine1"] == 1.0
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0]  # the run's count survives the restart


@pytest.mark.slow
def test_the_samples_do_not_depend_on_the_engine_count_or_a_kill(tmp_path):
    """Two engines with one killed mid-run, and three undisturbed: the same metrics, step for step (CPU,
    deterministic): the same samples, each trained on once."""
    a = Run.start(_recipe(tmp_path, "rollout.engines=2"), "two-killed", placement=KillOne(victim=1, at=2))
    b = Run.start(_recipe(tmp_path, "rollout.engines=3"), "three")
    try:
        ra, rb = a.train(progress=False), b.train(progress=False)
    finally:
        a.close()
        b.close()
    assert ra[-1]["rollout/engine_restarts"] == 1.0 and rb[-1]["rollout/engine_restarts"] == 0.0
    assert _comparable(ra) == _comparable(rb)
