"""Where a run's parts live: one build path (``runner.Run``) over two placements.

``prepare`` is what every run does before it places anything: the refusals (transport, devices, fleet, checks an
engine can never answer), the model folder, the plan, the task, the engine's checkpoint. A placement then builds
the parts where they run:

* ``LocalPlacement``: the learner (and a Megatron learner's spawned ranks), the frozen reference and every
  engine in this process;
* ``ray_launcher.RayPlacement``: the learner in a Ray actor, each engine in an actor of its own, in one placement
  group.

The run (``runner.Run``) calls the same methods on either: ``learner``, ``engine(i)``, ``sync_for(engine)`` (or
``fleet_sync(engines)`` for several), ``dead(engine, exc)`` and ``checkpoint``; ``close`` at the end. What the loop then does is the same code for both
(``launch/loop.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Protocol

from miles_lp.launch.recipe import Recipe


@dataclasses.dataclass
class Prepared:
    """What ``prepare`` found or made: the same for every placement."""

    model_dir: Path
    plan: Any
    task: Any
    engine_ckpt: Path
    engine_plan: Any
    view: Any  # a comparison arm's sampler view factory, or None (shared grid)
    sync_env: dict[str, str]


def check_start(recipe: Recipe, env: dict[str, str]) -> None:
    """Every refusal made before anything is built, in recipe keys (the CLI, ``--dry-run`` and both placements)."""
    from miles_lp.launch.actor_sync import check_broadcast
    from miles_lp.launch.engines import check_fleet
    from miles_lp.launch.runner import check_answerable, check_devices, check_transport

    check_broadcast(recipe)  # nccl / gloo: the learner and engine in actors of their own (ray.enabled)
    check_transport(recipe)
    check_fleet(recipe)
    if not recipe.ray.enabled:  # under Ray the devices are the workers' (checked where each part is built)
        check_devices(recipe)
    check_answerable(recipe, env)


def prepare(recipe: Recipe, run_dir: Any) -> Prepared:
    """The refusals, then the model folder, plan, task and engine checkpoint (``RUN_DIR/engine_init``)."""
    from miles_lp.launch.model import prepare_model, vocab_size
    from miles_lp.launch.runner import check_task_fits, engine_side, plan_for, read_model_config, sync_env
    from miles_lp.rl.tasks import make_task

    env = sync_env()  # read once, here: the refusal and the sync see the same variables
    check_start(recipe, env)
    model_dir = prepare_model(recipe.model, run_dir.path / "model")
    plan = plan_for(recipe, model_dir)
    task = make_task(recipe.task, vocab_size(model_dir), model_dir)
    check_task_fits(recipe, task, read_model_config(model_dir))
    ckpt, engine_plan, view = engine_side(recipe, model_dir, plan, run_dir.path / "engine_init")
    return Prepared(model_dir, plan, task, ckpt, engine_plan, view, env)


class Placement(Protocol):
    """Where the parts of a run are built (``LocalPlacement``, ``ray_launcher.RayPlacement``)."""

    def learner(self, run: Any, learner_state: Any) -> tuple[Any, Any]:
        """(the learner, the frozen reference or None), the learner loaded from ``learner_state`` if given."""
        ...

    def engine(self, run: Any, index: int) -> Any:
        """A fresh engine ``index`` serving ``run.prep.engine_ckpt`` (again after a restart)."""
        ...

    def sync_for(self, run: Any, engine: Any) -> Any:
        """The weight sync of the learner into ``engine`` (a ``WeightSync`` or what stands for one)."""
        ...

    def fleet_sync(self, run: Any, engines: list[Any]) -> Any:
        """The sync of the learner into several engines (a ``FleetSync`` or what stands for one)."""
        ...

    def dead(self, engine: Any, exc: BaseException | None) -> bool:
        """Whether ``engine`` is gone (its process or actor), so a fresh one may replace it."""
        ...

    def checkpoint(self, run: Any, loop: dict[str, Any]) -> Path:
        """The learner's state and ``loop`` saved under ``run.dir`` at ``run.step``."""
        ...

    def close(self, run: Any) -> None: ...

    engine_name: str


class LocalPlacement:
    """Everything in this process (a Megatron learner's ranks are processes it spawns)."""

    engine_name = "the engine process"  # what a run's error calls an engine that died

    def __init__(self, build_engine: Any = None):
        self.build_engine = build_engine  # tests: an engine factory standing for make_engine

    def learner(self, run: Any, learner_state: Any) -> tuple[Any, Any]:
        from miles_lp.launch.runner import make_learner

        learner = make_learner(run.recipe, run.model_dir, run.plan)
        run.learner = learner  # closed by the run if what follows fails
        if learner_state is not None:
            learner.load_state_dict(learner_state)
        reference = None
        if run.recipe.rl.kl_coef > 0:
            from miles_lp.train.embedded import EmbeddedTrainer

            reference = EmbeddedTrainer(run.model_dir, None, run.recipe.train)  # frozen: never stepped
        return learner, reference

    def engine(self, run: Any, index: int) -> Any:
        from miles_lp.launch.runner import make_engine

        if self.build_engine is not None:
            return self.build_engine()
        return make_engine(run.recipe, run.prep.engine_ckpt, run_dir=run.dir.path, index=index)

    def sync_for(self, run: Any, engine: Any) -> Any:
        from miles_lp.launch.runner import sync_log, target_of
        from miles_lp.sync import WeightSync

        sync = WeightSync(engine, run.prep.engine_plan, target_of(run.recipe), run.recipe.sync, env=run.sync_env,
                          log=sync_log)
        if run.prep.view is not None:  # a comparison arm: the sampler gets its own re-quantization of the master
            from miles_lp.launch.sampler import SyncVia

            sync = SyncVia(sync, run.prep.view(run.learner))
        return sync

    def fleet_sync(self, run: Any, engines: list[Any]) -> Any:
        from miles_lp.launch.runner import sync_log
        from miles_lp.sync.fleet import FleetSync

        return FleetSync([self.sync_for(run, e) for e in engines], log=sync_log)

    def dead(self, engine: Any, exc: BaseException | None) -> bool:
        """The engine's process is gone (only engines with a process of their own report ``dead``)."""
        try:
            return str(engine.health().get("status")) == "dead"
        except Exception:  # noqa: BLE001 - cannot tell (an HTTP server that stopped answering): not restartable
            return False

    def checkpoint(self, run: Any, loop: dict[str, Any]) -> Path:
        return run.dir.save_checkpoint(run.step, run.learner.state_dict(), loop)

    def close(self, run: Any) -> None:
        # the engines' threads / processes, the Megatron learner's process group (also for a half-built run)
        for part in (getattr(run, "engine", None), getattr(run, "learner", None)):
            close = getattr(part, "close", None)
            if close is not None:
                close()
