"""Two engine actors in one update group with the learner actor (``sync.transport: gloo``): one broadcast per
bucket reaches both engines, and an engine actor that dies inside a weight sync (found there, not by a generate)
breaks the group; the group is rebuilt with its replacement, which is resynced in full, the other engine gets the
update its cut-off sync lacked, and the run's metrics equal an undisturbed in-process run with three engines (the
samples do not depend on the engines, the kill, or the retry): nothing lost, nothing applied twice."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # a Ray cluster, three actors, two runs (~2 min on 2 cores)


def test_an_engine_actor_dying_inside_the_sync_rebuilds_the_update_group(tmp_path):
    import ray
    import torch

    from miles_lp.launch.runner import Run
    from tests.e2e.test_run_engines import _comparable, _recipe
    from tests.e2e.test_run_ray import _ray_run

    seen = {}

    def on_step(run, m):
        fleet_sync = run.engine.sync
        if run.step == 1:  # step 1's sync (after its optimizer step) finds engine 1's actor dead
            real = fleet_sync.sync

            def dying_sync(*args, **kwargs):
                fleet_sync.sync = real
                ray.kill(run.engine.engines[1].actor)
                return real(*args, **kwargs)
            fleet_sync.sync = dying_sync
        seen[run.step] = fleet_sync.sends()

    out, rows = _ray_run(tmp_path, "two", ["rollout.engines=2", "ray.num_cpus=3", "checkpoint_every=0",
                                           "sync.transport=gloo"], on_step=on_step)
    assert out["engine_restarts"] == 1
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows:
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            assert r[f"sync/check/{c}/engine0"] == 1.0 and r[f"sync/check/{c}/engine1"] == 1.0, (c, r["step"])
    # bucket sends, counted per group by the learner actor: the first group broadcast each bucket once for both
    # engines (the initial sync and step 0's); the rebuilt group sent the fresh engine's resync and the survivor's
    # retried update to one engine each, then broadcast step 2's update once
    buckets = seen[1][0] // 2
    assert buckets >= 1 and seen[1] == (2 * buckets, 0)
    assert seen[2] == (0, 2 * buckets) and seen[3] == (buckets, 2 * buckets)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each actor runs: the same CPU sums
    try:
        local = Run.start(_recipe(tmp_path, "rollout.engines=3"), "three-local")
        try:
            local.train(progress=False)
        finally:
            local.close()
    finally:
        torch.set_num_threads(threads)
    assert _comparable(rows) == _comparable(local.dir.read_metrics())
