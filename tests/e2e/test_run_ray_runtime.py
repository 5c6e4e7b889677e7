"""A Ray run's actors run under the recipe's ``runtime:`` section: the learner actor (rank 0 of a two-rank Megatron
learner), its rank-1 actor and both engine actors each report the switches the recipe sets (the pieces without a
cluster: tests/unit/test_runtime_child_processes.py)."""

from __future__ import annotations

import dataclasses

import pytest

from miles_lp.config import RuntimeConfig

pytestmark = pytest.mark.slow


def test_every_actor_of_a_ray_run_reports_the_recipe_switches(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    import ray

    from miles_lp.config import RUNTIME_ENV
    from miles_lp.launch.wire import unpack
    from tests.e2e.test_run_ray import _ray_run

    for var in RUNTIME_ENV.values():  # the actors inherit this process's environment: no debugging variable
        monkeypatch.delenv(var, raising=False)
    want = dataclasses.asdict(RuntimeConfig(sync_graphs=False, pipeline_workers=1))

    def switches(learner):  # cloudpickled by value to every rank
        import dataclasses

        from miles_lp.config import runtime

        return dataclasses.asdict(runtime())

    seen = {}

    def on_step(run, m):
        seen["learner"] = ray.get(run.learner_actor.switches.remote())
        seen["engines"] = [ray.get(e.actor.switches.remote()) for e in run.engine.engines]
        seen["ranks"] = unpack(ray.get(run.learner_actor.call.remote("run_on_ranks", switches)))

    out, rows = _ray_run(tmp_path, "runtime", [
        "train.backend=megatron", "train.megatron.dp=2", "rollout.engines=2", "ray.num_cpus=3", "steps=1",
        "checkpoint_every=0", "runtime.sync_graphs=false", "runtime.pipeline_workers=1"], on_step=on_step)
    assert out["steps"] == 1 and len(rows) == 1
    assert seen == {"learner": want, "engines": [want, want], "ranks": [want, want]}
