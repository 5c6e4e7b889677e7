"""Where a run's parts live: one build path (``runner.Run``) over two placements.

``runner.prepare`` is what every run does before it places anything: the refusals (transport, devices, fleet, checks an
engine can never answer), the model folder, the plan, the task, the engine's checkpoint. A placement then builds
the parts where they run:

* ``runner.LocalPlacement``: the learner (and a Megatron learner's spawned ranks), the frozen reference and every
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
