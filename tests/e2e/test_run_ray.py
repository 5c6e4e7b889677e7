"""The same recipe under Ray on a local cluster: learner and engine actors in a placement group, the rollout
actor killed between steps (the next step's generate finds it dead): restart, full resync, step re-run."""

from __future__ import annotations

import pytest

from miles_lp.launch.recipe import load_recipe
from miles_lp.launch.run_dir import RunDir
from tests.e2e.test_run import RECIPE

pytestmark = pytest.mark.slow


def test_ray_local_cluster_with_engine_restart(tmp_path):
    import ray

    from miles_lp.launch.ray_launcher import run_with_ray

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    recipe = load_recipe(p, ["ray.enabled=true", "ray.num_cpus=2", "ray.placement=split", "steps=3"])
    killed = []

    def on_step(run, m):
        if run.step == 1:  # after step 0: kill the rollout actor; step 1's generate finds it dead
            ray.kill(run.engine_actor)
            killed.append(True)

    out = run_with_ray(recipe, run_name="ray", progress=False, on_step=on_step)
    assert killed and out["engine_restarts"] == 1 and out["steps"] == 3
    rows = RunDir(tmp_path / "runs" / "ray").read_metrics()
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["sync/check/grid"] == 1.0 for r in rows)  # the resynced engine holds the learner's grid
    assert [r["rollout/weight_version"] for r in rows] == [1.0, 2.0, 3.0]  # the run's count survives the restart
    assert not ray.is_initialized()  # the cluster this run started is gone


def test_ctrl_c_stops_cleanly(tmp_path):
    """KeyboardInterrupt mid-run: the actors are killed and the cluster this run started is shut down."""
    import ray

    from miles_lp.launch.ray_launcher import run_with_ray

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    recipe = load_recipe(p, ["ray.enabled=true", "ray.num_cpus=2", "ray.placement=colocate", "steps=3"])

    def on_step(run, m):
        raise KeyboardInterrupt

    from miles_lp.launch.runner import RunInterrupted, interrupted_note

    with pytest.raises(RunInterrupted) as ei:  # a KeyboardInterrupt naming the folder and the step
        run_with_ray(recipe, run_name="ctrlc", progress=False, on_step=on_step)
    assert not ray.is_initialized()
    rd = RunDir(tmp_path / "runs" / "ctrlc")
    assert [r["step"] for r in rd.read_metrics()] == [0]
    assert ei.value.step == 1 and ei.value.run_dir.path == rd.path
    assert "interrupted at step 1; no checkpoint yet (checkpoint_every: 2" in interrupted_note(rd, 1)


def _ray_run(tmp_path, name, overrides, on_step=None):
    from miles_lp.launch.ray_launcher import run_with_ray

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    recipe = load_recipe(p, ["ray.enabled=true", "ray.num_cpus=2", "ray.placement=split", *overrides])
    out = run_with_ray(recipe, run_name=name, progress=False, on_step=on_step)
    return out, RunDir(tmp_path / "runs" / name).read_metrics()


def test_gloo_broadcast_sync_matches_the_object_store_path(tmp_path):
    """sync.transport gloo: the sync runs in the learner actor and the buckets go straight to the engine actor
    over torch.distributed (as NCCL would between GPUs). Same recipe, same seeds: every deterministic metric
    equals the driver-relayed run's, every check passes in raise mode, and an engine killed between steps is
    rejoined to a new group and resynced."""
    import ray

    from miles_lp.launch.runner import deterministic_metrics

    kl = "rl.kl_coef=0.01"  # the frozen reference in the learner actor, too
    _, relayed = _ray_run(tmp_path, "relayed", ["steps=3", "sync.transport=ray", kl])
    killed = []

    def on_step(run, m):
        if run.step == 1:
            ray.kill(run.engine_actor)
            killed.append(True)

    out, direct = _ray_run(tmp_path, "direct", ["steps=3", "sync.transport=gloo", kl], on_step=on_step)
    assert killed and out["engine_restarts"] == 1
    assert [r["rollout/engine_restarts"] for r in direct] == [0.0, 1.0, 1.0]
    drop = ("rollout/engine_restarts",)
    same = [{k: v for k, v in r.items() if k not in drop} for r in deterministic_metrics(direct)]
    want = [{k: v for k, v in r.items() if k not in drop} for r in deterministic_metrics(relayed)]
    assert same == want
    for r in direct:
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            assert r[f"sync/check/{c}"] == 1.0, (c, r["step"])
    assert [r["rollout/weight_version"] for r in direct] == [1.0, 2.0, 3.0]
    assert all("actor/kl_loss" in r for r in direct), sorted(direct[0])



def test_engine_dying_inside_the_sync_checkpoints_the_updated_learner(tmp_path):
    """The rollout actor killed in step 1's sync (after the optimizer step): the sync reports it wrapped
    (SyncAbortedError), the run asks the actor, writes a checkpoint of the updated learner at step 2 and stops
    naming it; resuming from it finishes the run."""
    import ray

    from miles_lp.launch.ray_launcher import run_with_ray
    from miles_lp.rl.step import RunError

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    recipe = load_recipe(p, ["ray.enabled=true", "ray.num_cpus=2", "ray.placement=split", "steps=3"])

    def on_step(run, m):
        if run.step == 1:
            send = run.sync.transport.send

            def dying_send(bucket):  # the engine dies just before the first bucket of the next sync
                ray.kill(run.engine_actor)
                run.sync.transport.send = send
                return send(bucket)
            run.sync.transport.send = dying_send

    with pytest.raises(RunError, match=r"step 1: the rollout actor died .* the last checkpoint is .*step_000002 \(it resumes at step 2\): miles-lp run .*recipe.yaml --resume "):
        run_with_ray(recipe, run_name="dies", progress=False, on_step=on_step)
    rd = RunDir(tmp_path / "runs" / "dies")
    assert rd.latest() is not None and rd.latest().name == "step_000002"
    out = run_with_ray(recipe, resume=str(rd.path), progress=False)
    assert out["steps"] == 3
    # step 1 updated the learner but never finished (its sync died): no metrics row for it, as in-process
    assert [r["step"] for r in rd.read_metrics()] == [0, 2]


def test_c3_rotation_continues_across_engine_restart_and_resume(tmp_path, monkeypatch):
    """C3's rotating layer is picked by the engine's weight version + its ``c3_rotation_base``; a restarted or
    resumed rollout actor's engine counts its versions from its own start, so the launcher sets the actor's base
    to the run's sync count (as the in-process runner does). Straight 3 steps, the engine killed after step 0,
    and 2 steps + resume: every step's sync probes the same rotating layer with the same figure, the actor's
    engine holds the base the run's count says, and every deterministic metric equals the straight run's."""
    import ray

    from miles_lp.launch.ray_launcher import run_with_ray, start_local_ray
    from miles_lp.launch.runner import deterministic_metrics
    from miles_lp.sync import checks

    probed: list[tuple[str, float] | None] = []  # the rotating layer of every C3 the driver's WeightSync judged
    judge = checks.self_check

    def spy(result, tolerance):
        rot = [(n, float(v["rel_err"])) for n, v in ((result or {}).get("layers") or {}).items()
               if isinstance(v, dict) and v.get("kind") == "rotating"]
        probed.append(rot[0] if rot else None)
        return judge(result, tolerance)
    monkeypatch.setattr(checks, "self_check", spy)

    def run(name, steps, kill_after=None, resume=None):
        seen = []

        def on_step(r, m):  # r.step: the next step; probed[-1]: the sync of the step just finished
            seen.append((r.step - 1, probed[-1], r.engine.c3_rotation_base,
                         r.engine.weight_version + r.engine.c3_rotation_base))
            if kill_after is not None and r.step == kill_after + 1:
                ray.kill(r.engine_actor)
        p = tmp_path / f"{name}.yaml"
        p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
        recipe = load_recipe(p, ["ray.enabled=true", "ray.placement=split", f"steps={steps}"])
        out = run_with_ray(recipe, run_name=name, resume=resume, progress=False, on_step=on_step)
        return out, seen

    start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)  # one cluster for the four runs
    try:
        _, straight = run("straight", 3)
        out, restarted = run("restarted", 3, kill_after=0)
        run("two", 2)
        _, resumed = run("two", 3, resume=str(tmp_path / "runs" / "two"))
    finally:
        ray.shutdown()
    assert out["engine_restarts"] == 1 and [s for s, *_ in restarted] == [0, 1, 2] and [s for s, *_ in resumed] == [2]
    layers = [p for _, p, _, _ in straight]
    assert all(layers) and len({n for n, _ in layers}) == 3, layers  # the rotation moves: a shift would show
    by_step = {s: (p, v) for s, p, _, v in straight}
    assert {s: (p, v) for s, p, _, v in restarted} == by_step
    assert {s: (p, v) for s, p, _, v in resumed} == {2: by_step[2]}
    assert [b for _, _, b, _ in straight] == [0, 0, 0]
    assert [b for _, _, b, _ in restarted] == [0, 1, 1]  # the restarted engine's own count starts after 1 sync
    assert [b for _, _, b, _ in resumed] == [2]  # resumed at step 2: 2 syncs before this engine
    rows = {n: deterministic_metrics(RunDir(tmp_path / "runs" / n).read_metrics()) for n in ("straight", "two")}
    assert rows["two"] == rows["straight"]
    assert all(r["sync/check/self_check"] == 1.0 for r in rows["straight"])


def test_a_failed_check_under_ray_names_the_resume_command(tmp_path):
    """Under Ray (which printed no advice at all): the C6 sentinel in raise mode fails at step 1's
    sync (every response hits the length cap); the error is the in-process run's: the checkpoint at step 1, the
    exact resume command, and that the check is expected to fail again there."""
    import shlex

    import ray

    from miles_lp.launch.ray_launcher import run_with_ray
    from miles_lp.rl.step import RunError

    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.replace("OUT", str(tmp_path / "runs")))
    recipe = load_recipe(p, ["ray.enabled=true", "ray.num_cpus=2", "steps=3", "sync.checks.sentinel=raise",
                             "checkpoint_every=1"])
    with pytest.raises(RunError) as info:
        run_with_ray(recipe, run_name="sent", progress=False)
    rd = RunDir(tmp_path / "runs" / "sent")
    cmd = f"miles-lp run {shlex.quote(str(rd.recipe_path))} --resume {shlex.quote(str(rd.path))}"
    text = str(info.value)
    assert text.startswith("step 1: weight sync v3 failed 1 check(s)") and "C6 sentinel: failed" in text, text
    assert f"the last checkpoint is {rd.checkpoints / 'step_000001'} (it resumes at step 1): {cmd}. " in text, text
    assert "put MILES_LP_SYNC_CHECK_SENTINEL=warn before that command" in text
    assert not ray.is_initialized()


def test_megatron_learner_syncs_over_its_own_group(tmp_path):
    """train.backend megatron with sync.transport gloo: the learner actor holds Megatron's torch.distributed world
    and the sync's own group beside it (``SyncGroup``); every check passes in raise mode, and the metrics equal the
    driver-relayed run's (same seeds)."""
    pytest.importorskip("megatron.core")
    from miles_lp.launch.runner import deterministic_metrics

    meg = ["steps=2", "train.backend=megatron"]
    _, relayed = _ray_run(tmp_path, "meg-relayed", [*meg, "sync.transport=ray"])
    _, direct = _ray_run(tmp_path, "meg-gloo", [*meg, "sync.transport=gloo"])
    assert deterministic_metrics(direct) == deterministic_metrics(relayed)
    for r in direct:
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            assert r[f"sync/check/{c}"] == 1.0, (c, r["step"])


@pytest.mark.parametrize("transport", ["ray", "gloo"])
def test_two_engine_actors_one_killed(tmp_path, transport):
    """rollout.engines 2 under Ray: an actor per engine; engine 1's actor killed between steps is replaced by the
    fleet (the other keeps serving) and resynced; the metrics equal an undisturbed in-process run's with three
    engines (the samples do not depend on the engines or on the kill). ``ray``: the sync in the driver, buckets
    through the object store; ``gloo``: the sync in the learner actor, a group of its own with each engine."""
    import ray

    from tests.e2e.test_run_engines import _comparable, _recipe

    killed = []

    def on_step(run, m):
        if run.step == 1:
            ray.kill(run.engine.engines[1].actor)
            killed.append(True)

    out, rows = _ray_run(tmp_path, "two", ["rollout.engines=2", "ray.num_cpus=3", "checkpoint_every=0",
                                           f"sync.transport={transport}"], on_step=on_step)
    assert killed and out["engine_restarts"] == 1
    assert [r["rollout/engine_restarts"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["sync/check/grid/engine1"] == 1.0 and r["sync/check/grid/engine0"] == 1.0 for r in rows)
    import torch

    from miles_lp.launch.runner import Run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each actor runs (ray.learner / ray.rollout num_cpus 1): the same CPU sums
    try:
        local = Run.start(_recipe(tmp_path, "rollout.engines=3"), "three-local")
        try:
            local.train(progress=False)
        finally:
            local.close()
    finally:
        torch.set_num_threads(threads)
    assert _comparable(rows) == _comparable(local.dir.read_metrics())


@pytest.mark.parametrize("arch, parallel, kl0", [
    # the dense recipes' shape: a tensor-parallel learner (dp lands with the learner); the engine's log-probs equal
    # the learner's exactly at step 0
    ("qwen3", ["train.megatron.tp=2"], 0.0),
    # the MoE recipes' shape: an expert-parallel learner; the experts' outputs are combined across the two ranks in
    # another fp32 order than the engine's single pass (measured 2.9e-5 here), the grid itself is byte-equal
    ("qwen3_moe", ["train.megatron.ep=2"], 1e-4),
])
def test_rehearsal_multi_rank_learner_two_engines_own_group(tmp_path, arch, parallel, kl0):
    """A tiny rehearsal of the full-scale shape on CPU: a two-rank Megatron learner (rank 0 the learner actor, rank 1
    a rank actor in the run's placement group; its export gathered on rank 0), two engine actors, the sync over its
    own gloo group per engine, every check in raise mode on each engine, the engine serving the learner's own grid at
    the start. The four-rank shapes: tests/e2e/test_run_ray_rehearsals.py."""
    pytest.importorskip("megatron.core")
    sets = ["train.backend=megatron", *parallel, "rollout.engines=2", "ray.num_cpus=3", "sync.transport=gloo",
            "steps=2", "checkpoint_every=0", f"model.path=tiny:{arch}"]
    out, rows = _ray_run(tmp_path, f"rehearse-{arch}", sets)
    assert out["steps"] == 2 and [r["step"] for r in rows] == [0, 1]
    assert abs(rows[0]["rollout_corr/kl"]) <= kl0
    for r in rows:
        for c in ("layer_audit", "grid", "self_check", "storage", "completeness", "version"):
            assert r[f"sync/check/{c}/engine0"] == 1.0 and r[f"sync/check/{c}/engine1"] == 1.0, (c, r["step"])
