"""Where a Megatron learner's ranks go under Ray: ``ray.learner`` against the learner's world, in recipe keys.

    layout = learner_layout(recipe, hf_config)      # None: one learner actor (a world of one)
    layout.rank_bundle()                            # {"CPU": 4.0, "GPU": 1.0}: one bundle per rank

A learner of ``world = tp x pp x dp`` ranks runs one Ray actor per rank (rank 0 is the learner actor, ranks
1..world-1 are ``train.megatron.ray_ranks`` actors). ``ray.learner`` says the layout: ``nodes`` x
``gpus_per_node`` GPUs, one rank on each (``gpus_per_node: null`` reads ``num_gpus``, which the full-scale
recipes give per node; ``nodes: null`` = world / gpus_per_node); ``num_cpus`` is per node, shared by its ranks.
On CPU (``gpus_per_node: 0``) ``nodes`` (default 1) must divide the world. A layout that does not hold the world
is refused naming the sizes. ``train.device: auto`` becomes ``cuda`` on a GPU layout and ``cpu`` otherwise
(``device``), so the ranks' backend (NCCL / gloo) follows the layout, not the driver's host.

Pure: no Ray here, the launcher and ``--dry-run`` read the same answer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_lp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LearnerLayout:
    world: int
    nodes: int
    gpus_per_node: int  # 0: CPU ranks (gloo)
    cpus_per_rank: float

    @property
    def gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def device(self) -> str:
        return "cuda" if self.gpu else "cpu"

    def rank_bundle(self) -> dict[str, float]:
        return {"CPU": float(self.cpus_per_rank), **({"GPU": 1.0} if self.gpu else {})}

    def describe(self) -> dict[str, Any]:
        return {"ranks": self.world, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "cpus_per_rank": self.cpus_per_rank, "actor_per_rank": True}


def learner_world(recipe: Any, hf_config: Any) -> int:
    """The learner's ranks: ``tp x pp x dp`` of ``train.megatron`` for the Megatron backend, else one."""
    if recipe.train.backend != "megatron":
        return 1
    from miles_lp.train.megatron.parallel import resolve_parallel

    section = recipe.train.megatron
    if getattr(section, "impl", "local") != "local":  # the ranks do not depend on the path (refused on its own)
        section = dataclasses.replace(section, impl="local")
    return resolve_parallel(section, hf_config).world


def learner_layout(recipe: Any, hf_config: Any) -> LearnerLayout | None:
    """The rank actors' layout, or None for a learner of one rank (one actor with ``ray.learner``'s resources).
    ``ConfigError`` naming the keys and sizes when ``ray.learner`` cannot hold the world."""
    lr = recipe.ray.learner
    world = learner_world(recipe, hf_config)
    key = "ray.learner"
    if world == 1:
        if lr.nodes not in (None, 1):
            raise ConfigError(f"{key}.nodes={lr.nodes}: the learner has one rank (train.megatron tp x pp x dp = 1); "
                              "remove nodes or raise the parallel sizes")
        return None
    gpn = lr.gpus_per_node
    if gpn is None:
        if lr.num_gpus != int(lr.num_gpus):
            raise ConfigError(f"{key}.num_gpus={lr.num_gpus}: a learner of {world} ranks takes one whole GPU per rank; "
                              "give whole GPUs per node (or gpus_per_node)")
        gpn = int(lr.num_gpus)
    elif lr.num_gpus and lr.num_gpus != gpn:
        raise ConfigError(f"{key}.num_gpus={lr.num_gpus} and {key}.gpus_per_node={gpn} disagree (both are the GPUs of "
                          "one learner node, one rank each); keep one of them")
    dev = str(recipe.train.device)
    if gpn and dev == "cpu":
        raise ConfigError(f"{key}.gpus_per_node={gpn} with train.device: cpu; set train.device: cuda (or auto), or "
                          f"{key}.num_gpus / gpus_per_node: 0 for CPU ranks")
    if not gpn and dev.startswith("cuda"):
        raise ConfigError(f"train.device: {dev} needs one GPU per learner rank, but {key} gives none "
                          f"(gpus_per_node / num_gpus 0); set {key}.gpus_per_node")
    sizes = _sizes(recipe, world)
    if gpn:
        nodes = lr.nodes if lr.nodes is not None else max(1, world // gpn)  # fewer ranks than one node's GPUs: 1
        if nodes * gpn != world:
            raise ConfigError(f"{key}: nodes={nodes} x gpus_per_node={gpn} = {nodes * gpn} GPUs, but the learner has "
                              f"{sizes} = {world} ranks (one GPU each): make them equal")
        return LearnerLayout(world, nodes, gpn, float(lr.num_cpus) / gpn)
    nodes = lr.nodes if lr.nodes is not None else 1
    if world % nodes:
        raise ConfigError(f"{key}.nodes={nodes} does not divide the learner's {sizes} = {world} ranks (CPU ranks, "
                          "the same number on each node)")
    return LearnerLayout(world, nodes, 0, float(lr.num_cpus) * nodes / world)


def _sizes(recipe: Any, world: int) -> str:
    m = recipe.train.megatron
    dp = getattr(m, "dp", None)
    return f"train.megatron tp={m.tp} x pp={m.pp} x dp={'auto' if dp is None else dp}"
