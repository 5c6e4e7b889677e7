"""Megatron ranks 1..world-1 as Ray actors: one actor per rank, placed by a placement group that may span nodes.

    placement = RayPlacement(nodes=2, gpus_per_node=8)           # builds its own placement group
    placement = RayPlacement(placement_group=pg, bundles=[1, 2, 3])   # the launcher's group, rank r in bundles[r-1]
    learner = MegatronGroup(folder, plan, config, placement=placement)

Rank 0 is the process that builds the ``MegatronGroup`` (the launcher's learner actor, which holds one GPU
itself); the other ranks are ``_RankActor``s, each holding a ``ranks.RankServer`` and answering the same messages
a spawned rank answers over its pipe (``ranks`` module docstring), here as actor method calls. The process group
rendezvous on rank 0's node address (``ray.util.get_node_ip_address``). On GPU machines every actor asks for one
GPU (``num_gpus=1``): Ray sets its ``CUDA_VISIBLE_DEVICES``, so each rank runs on ``cuda`` (its only device); on
CPU (``gpus_per_node=0``) a rank takes ``cpus_per_rank`` CPUs and runs gloo.

Placement group: without one, ``nodes x gpus_per_node`` must equal the group's world (GPU) and a group of
``world - 1`` bundles (``{"GPU": 1, "CPU": cpus_per_rank}`` each) is reserved with strategy ``PACK`` (Ray fills a
node before the next, and spans nodes when one is not enough); it is removed on ``close``. With the launcher's
group, ``bundles`` names the bundle of each rank > 0 (rank 0 is the caller's own bundle).

Orchestration only: no numerics here.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.train.config import TrainConfig
from miles_lp.train.megatron.ranks import RankServer, RankSpec, backend_for


class _RankActor:
    """One Megatron rank in a Ray actor (created through ``ray.remote``)."""

    def __init__(self, rank: int, spec: RankSpec, device: str | None):
        self.server = RankServer(rank, spec, device)

    def handle(self, message: bytes) -> bytes:
        reply = self.server.handle(message)
        if self.server.failed:
            # end this process just after the reply leaves, so rank 0's next collective fails at once
            threading.Timer(1.0, os._exit, args=(1,)).start()
        return reply


class _ActorRank:
    """Rank 0's end of one ``_RankActor``."""

    def __init__(self, actor, rank: int):
        self.actor, self.rank = actor, rank
        self.pending = None
        self.dead: str | None = None

    def post(self, message: bytes) -> None:
        self.pending = self.actor.handle.remote(message)

    def wait(self, timeout_s: float) -> bool:
        import ray

        ready, _ = ray.wait([self.pending], timeout=timeout_s)
        return bool(ready)

    def take(self) -> bytes:
        import ray

        ref, self.pending = self.pending, None
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self.dead = f"(Ray actor) died: {str(exc).splitlines()[0]}"
            raise EOFError(self.dead) from exc

    def alive(self) -> bool:
        # a dead actor resolves its pending call with RayActorError: ``wait`` turns ready and ``take`` says so
        return self.dead is None

    def gone(self) -> str:
        return self.dead or "(Ray actor) is dead"

    def stop(self, grace_s: float) -> None:
        import ray

        if self.pending is not None and grace_s > 0:
            ray.wait([self.pending], timeout=grace_s)
        ray.kill(self.actor, no_restart=True)


@dataclasses.dataclass
class RayPlacement:
    """Where the Ray actors of ranks 1..world-1 go (module docstring)."""

    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_rank: float = 1.0
    placement_group: Any = None
    bundles: list[int] | None = None
    _own_group: Any = dataclasses.field(default=None, init=False, repr=False)

    def host(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def device(self, rank: int, config: TrainConfig) -> str | None:
        return "cuda" if backend_for(config) == "nccl" else None

    def check(self, world: int, config: TrainConfig) -> None:
        import ray

        where = "ray.learner"
        gpu = backend_for(config) == "nccl"
        if gpu and self.gpus_per_node < 1:
            raise ConfigError(f"{where}.gpus_per_node={self.gpus_per_node}: a CUDA learner needs one GPU per rank")
        if not gpu and self.gpus_per_node:
            raise ConfigError(f"{where}.gpus_per_node={self.gpus_per_node} with a CPU learner (train.device "
                              f"{config.device}); set gpus_per_node: 0 or a CUDA device")
        if self.placement_group is None and gpu and self.nodes * self.gpus_per_node != world:
            raise ConfigError(f"{where}: nodes={self.nodes} x gpus_per_node={self.gpus_per_node} = "
                              f"{self.nodes * self.gpus_per_node} GPUs, but the Megatron group has {world} ranks "
                              "(tp x pp x dp): make them equal")
        if self.placement_group is not None and len(self.bundles or ()) != world - 1:
            raise ConfigError(f"RayPlacement with a placement group names the bundle of each rank > 0: "
                              f"{world - 1} bundle(s), got {self.bundles}")
        if not ray.is_initialized():
            raise ConfigError("RayPlacement: Ray is not initialised in this process (ray.init first)")

    def _bundle(self) -> dict[str, float]:
        out = {"CPU": float(self.cpus_per_rank)}
        if self.gpus_per_node:
            out["GPU"] = 1.0
        return out

    def launch(self, spec: RankSpec) -> list[_ActorRank]:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg, bundles = self.placement_group, self.bundles
        if pg is None:
            pg = self._own_group = placement_group([self._bundle()] * (spec.world - 1), strategy="PACK")
            bundles = list(range(spec.world - 1))
            ready, _ = ray.wait([pg.ready()], timeout=spec.timeout_s)
            if not ready:
                ray.util.remove_placement_group(pg)
                self._own_group = None
                raise ConfigError(f"Ray could not reserve {spec.world - 1} bundle(s) of {self._bundle()} for the "
                                  f"Megatron ranks within {spec.timeout_s:.0f} s; the cluster has "
                                  f"{ray.available_resources()} free")
        cls = ray.remote(_RankActor)
        out = []
        for rank in range(1, spec.world):
            opts = {"num_cpus": self.cpus_per_rank, "num_gpus": 1 if self.gpus_per_node else 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=bundles[rank - 1]),
                    "max_restarts": 0}
            actor = cls.options(**opts).remote(rank, spec, self.device(rank, spec.config))
            out.append(_ActorRank(actor, rank))
        return out

    def release(self) -> None:
        """Remove the placement group this placement reserved (none when the launcher gave one)."""
        if self._own_group is not None:
            import ray

            ray.util.remove_placement_group(self._own_group)
            self._own_group = None
