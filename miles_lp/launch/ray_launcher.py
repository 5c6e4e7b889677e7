"""``ray.enabled: true``: the same run, with the learner and the engine in Ray actors.

Orchestration only: the actors wrap the very objects the in-process run builds (``EmbeddedTrainer``,
``ReferenceEngine``); the driver runs the same ``grpo_step`` and the same ``WeightSync`` on proxies that
forward each call to its actor (``ray.get``). Tensors travel through Ray's object store (the driver relays the
sync's buckets from the learner's export to the engine: a CPU path; a GPU deployment would use the sync's
``cuda_ipc`` / ``nccl`` transports instead).

Placement (``ray.placement``), as Miles does: ``colocate`` = one bundle holding both roles' resources (learner
and sampler share the node / GPU); ``split`` = one bundle per role, spread over the cluster where it can be. A
Megatron learner of several ranks runs one actor per rank: the learner actor is rank 0, ranks 1..world-1 take
bundles 1..world-1 of the same group, one GPU each on GPU machines (``ray.learner: {nodes, gpus_per_node}``,
``launch/ray_layout.py``), and the group is packed (``PACK``) so a node fills before the next.
``ray.address`` unset starts a local cluster listening on loopback only (``start_local_ray``; shut down at the
end); set, it connects (``ray.init(address=)``) and an unreachable address is an error naming it. Actor output is streamed to the driver (``log_to_driver``).
Ctrl-C kills the actors, removes the placement group, and shuts Ray down if this process started it.

Engine failure: if the rollout actor dies while generating, the run starts a new one in the same bundle,
does a full resync (``WeightSync.initial_sync``: every tensor, full byte compare) and re-runs the step (no
update happened yet, so nothing is lost and nothing is applied twice). If it dies after the update (in the
sync), the run writes a checkpoint of the updated learner and stops with an error naming it: resume from it.
At start, resume and every restart the actor's engine gets ``c3_rotation_base`` = the run's syncs before it
started (``runner._rotation_base`` through the proxy, which sets the attribute in the actor), so C3's rotating
layer is the one a straight run probes at that sync, as in process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.launch.actor_sync import (
    BROADCAST,
    ActorFleetSync,
    ActorSync,
    EngineDied,
    EngineSyncSide,
    LearnerSyncSide,
    actor_alive,
)
from miles_lp.launch.recipe import Recipe
from miles_lp.launch.runner import Run
from miles_lp.launch.wire import pack, unpack
from miles_lp.rl.step import RunError


# ---------------------------------------------------------------------------------------------------------
# actors: thin wrappers around the in-process objects
# ---------------------------------------------------------------------------------------------------------
def _switches() -> dict:
    import dataclasses

    from miles_lp.config import runtime

    return dataclasses.asdict(runtime())


class LearnerWorker(LearnerSyncSide):
    """The learner actor (rank 0 of a Megatron learner of several ranks). ``ranks``: where ranks 1..world-1 go,
    ``{"layout": LearnerLayout, "placement_group": pg, "bundles": [...]}`` (``RayPlacement._rank_actors``), or None
    for a learner of one rank."""

    def __init__(self, recipe_yaml: str, source: str, model_dir: str, plan_json: str | None, threads: int,
                 learner_state_dir: str | None, with_reference: bool = False, ranks: dict | None = None):
        import torch

        from miles_lp.config import load_yaml_text, use_runtime
        from miles_lp.launch.recipe import parse_recipe
        from miles_lp.launch.runner import make_learner

        torch.set_num_threads(max(1, threads))
        recipe = parse_recipe(load_yaml_text(recipe_yaml, source))
        use_runtime(recipe.runtime)  # this actor's switches are the recipe's, as the driver's (before anything loads)
        plan = None
        if plan_json is not None:
            from miles_lp.launch.runner import plan_for

            plan = plan_for(recipe, Path(model_dir))
        self.recipe, self.plan = recipe, plan
        placement = None
        if ranks is not None:
            from miles_lp.train.megatron.ray_ranks import RayPlacement as RankActors

            layout = ranks["layout"]
            placement = RankActors(nodes=layout.nodes, gpus_per_node=layout.gpus_per_node,
                                   cpus_per_rank=layout.cpus_per_rank, placement_group=ranks["placement_group"],
                                   bundles=list(ranks["bundles"]))
        self.learner = make_learner(recipe, Path(model_dir), plan, placement=placement)
        if learner_state_dir is not None:
            from miles_lp.train.state_io import load_learner_state

            self.learner.load_state_dict(load_learner_state(learner_state_dir))
        self.reference = None
        if with_reference:  # as the in-process run builds it: a frozen BF16 EmbeddedTrainer on the learner's device
            from miles_lp.train.embedded import EmbeddedTrainer

            self.reference = EmbeddedTrainer(Path(model_dir), None, recipe.train)

    def switches(self) -> dict:
        """The run-time switches this actor runs under (``miles_lp.config.runtime()``: the recipe's section with
        any debugging variable this process has applied)."""
        return _switches()

    def reference_logprobs(self, batch):
        return pack(self.reference.logprobs(unpack(batch)))

    def call(self, name: str, *args, **kwargs):
        return pack(getattr(self.learner, name)(*unpack(args), **unpack(kwargs)))

    def get(self, name: str):
        return pack(getattr(self.learner, name))

    def export_list(self):
        return pack(list(self.learner.export_weights()))

    def routing_stats(self) -> dict:
        return pack(dict(getattr(self.learner, "routing_stats", None) or {}))

    def train_step(self, samples, loss_fn):
        stats = self.learner.train_step(unpack(samples), loss_fn)
        return pack((stats, dict(loss_fn.stats), dict(loss_fn.recorded)))

    def save_state(self, run_dir: str, step: int, loop: dict) -> str:
        from miles_lp.launch.run_dir import RunDir

        return str(RunDir(run_dir).save_checkpoint(step, self.learner.state_dict(), loop))


class EngineWorker(EngineSyncSide):
    def __init__(self, checkpoint: str, recipe_yaml: str, source: str, threads: int, index: int = 0):
        import torch

        from miles_lp.config import load_yaml_text, use_runtime
        from miles_lp.launch.recipe import parse_recipe
        from miles_lp.launch.runner import make_engine

        torch.set_num_threads(max(1, threads))
        self.recipe = parse_recipe(load_yaml_text(recipe_yaml, source))
        use_runtime(self.recipe.runtime)  # the recipe's switches, in this actor and the engine process it starts
        self.engine = make_engine(self.recipe, Path(checkpoint), index=index)

    def call(self, name: str, *args, **kwargs):
        out = getattr(self.engine, name)(*unpack(args), **unpack(kwargs))
        if hasattr(out, "items") and not isinstance(out, dict):
            out = dict(out)
        return pack(out)

    def get(self, name: str):
        return pack(getattr(self.engine, name))

    def set(self, name: str, value) -> None:
        """Set one of the engine's own plain attributes (``c3_rotation_base``: the driver's run count); a name the
        engine does not have is refused, so a typo cannot add state the engine never reads."""
        if name.startswith("_") or not hasattr(self.engine, name) or callable(getattr(self.engine, name)):
            raise AttributeError(f"the engine ({type(self.engine).__name__}) has no attribute {name!r} to set")
        setattr(self.engine, name, unpack(value))

    def pid(self) -> int:
        import os

        return os.getpid()

    def switches(self) -> dict:
        """The run-time switches this actor runs under (as ``LearnerWorker.switches``)."""
        return _switches()

    def surface(self) -> tuple[list[str], list[str]]:
        """The engine's public methods and plain attributes (what ``getattr`` on the proxy may reach)."""
        methods, attrs = [], []
        for name in dir(self.engine):
            if name.startswith("_"):
                continue
            try:
                v = getattr(self.engine, name)
            except Exception:
                continue
            (methods if callable(v) else attrs).append(name)
        return methods, attrs


# ---------------------------------------------------------------------------------------------------------
# proxies: what grpo_step and WeightSync see
# ---------------------------------------------------------------------------------------------------------
class LearnerProxy:
    def __init__(self, actor, plan):
        self.actor, self.plan = actor, plan

    def _call(self, name, *args, **kwargs):
        import ray

        return unpack(ray.get(self.actor.call.remote(name, *pack(args), **pack(kwargs))))

    @property
    def step(self) -> int:
        import ray

        return ray.get(self.actor.get.remote("step"))

    @property
    def routing_stats(self) -> dict[str, float]:
        """The learner's routing agreement after its last ``logprobs`` / ``train_step`` (routing replay), as
        in-process: ``grpo_step`` reads it right after the old-log-prob pass."""
        import ray

        return unpack(ray.get(self.actor.routing_stats.remote()))

    def logprobs(self, batch):
        return self._call("logprobs", batch)

    def train_step(self, samples, loss_fn):
        import ray

        stats, loss_stats, recorded = unpack(ray.get(self.actor.train_step.remote(pack(list(samples)), loss_fn)))
        for k, v in loss_stats.items():  # the loss function ran in the actor: bring its figures back
            loss_fn.stats[k] = v
        loss_fn.recorded.update(recorded)
        return stats

    def export_weights(self):
        import ray

        return iter(unpack(ray.get(self.actor.export_list.remote())))

    def executed_quantized(self):
        return self._call("executed_quantized")

    def state_dict(self):
        return self._call("state_dict")

    def load_state_dict(self, state):
        return self._call("load_state_dict", state)


class ReferenceProxy:
    """The frozen reference that lives in the learner actor (its devices, built as the in-process run builds it)."""

    def __init__(self, actor):
        self.actor = actor

    def logprobs(self, batch):
        import ray

        return unpack(ray.get(self.actor.reference_logprobs.remote(pack(batch))))


class EngineProxy:
    """Every ``Engine`` method forwarded to the rollout actor; a dead actor raises ``EngineDied``. The engine's
    plain attributes are read from the actor and set in it (``proxy.c3_rotation_base = n`` sets the actor's
    engine's, as ``runner._rotation_base`` does in process); the proxy's own (``actor``, ...) stay here."""

    _OWN = frozenset({"actor", "_methods", "_attrs"})

    def __init__(self, actor):
        self.actor = actor
        self._learn_surface()

    def __setattr__(self, name, value):
        if name in EngineProxy._OWN or name not in self.__dict__.get("_attrs", ()):
            object.__setattr__(self, name, value)
            return
        import ray

        try:
            ray.get(self.actor.set.remote(name, pack(value)))
        except ray.exceptions.RayActorError as exc:
            raise EngineDied(f"the rollout actor died while setting {name} ({type(exc).__name__})", name) from exc

    def _learn_surface(self) -> None:
        import ray

        methods, attrs = ray.get(self.actor.surface.remote())
        self._methods, self._attrs = set(methods), set(attrs)

    @property
    def weight_version(self) -> int:
        return self._get("weight_version")

    def _get(self, name):
        import ray

        try:
            return unpack(ray.get(self.actor.get.remote(name)))
        except ray.exceptions.RayActorError as exc:
            raise EngineDied(f"the rollout actor died ({type(exc).__name__})", name) from exc

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._attrs:
            return self._get(name)
        if name not in self._methods:  # hasattr(engine, "weight_fingerprints") must see what the engine has
            raise AttributeError(f"the engine has no attribute {name!r}")

        def method(*args, **kwargs):
            import ray

            try:
                return unpack(ray.get(self.actor.call.remote(name, *pack(args), **pack(kwargs))))
            except ray.exceptions.RayActorError as exc:
                raise EngineDied(f"the rollout actor died during {name}() ({type(exc).__name__})", name) from exc
        return method


# ---------------------------------------------------------------------------------------------------------
# the launcher
# ---------------------------------------------------------------------------------------------------------
def _init_ray(recipe: Recipe) -> bool:
    """Start or join a cluster; True when this process started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    rc = recipe.ray
    if rc.address is None:
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if rc.num_cpus is not None:
            kw["num_cpus"] = rc.num_cpus
        start_local_ray(**kw)
        return True
    _check_reachable(rc.address)
    try:
        ray.init(address=rc.address, log_to_driver=True)
    except Exception as exc:  # ConnectionError, TimeoutError, ray's own: all mean "not reachable"
        raise ConfigError(f"ray.address {rc.address!r}: cannot connect to a Ray cluster there ({type(exc).__name__}: "
                          f"{exc}); start one (ray start --head) or remove ray.address for a local cluster") from None
    return False


#: Ray's switch for clusters of more than this machine (``ray_constants.ENABLE_RAY_CLUSTER``, read from this
#: variable when ray is imported); off, Ray takes the loopback address as the node's IP
MULTI_NODE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_local_ray(**kw: Any) -> str:
    """``ray.init(**kw)`` of a cluster on this machine whose servers listen on loopback only (the project's rule:
    servers bind 127.0.0.1 by default). Returns the node's IP (127.0.0.1).

    Ray binds its servers (GCS, raylet and object manager, every core worker, the runtime-env agent) to the node's
    IP. Left alone it takes the machine's outward address, and the servers listen on every interface (``::``);
    ``_node_ip_address="127.0.0.1"`` does not help: ``ray.init`` turns a loopback address into the outward one
    (``services.resolve_ip_for_localhost``) unless Ray's multi-node switch is off. So, during ``ray.init`` only, the
    switch is off in this process (``ray_constants.ENABLE_RAY_CLUSTER``, which Ray reads at import) and in the
    environment the cluster's processes inherit (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); both are restored after.
    Measured with Ray 2.60 (tests/e2e/test_run_ray_loopback.py, slow): every listening socket of the cluster's
    processes on 127.0.0.1 (``::ffff:127.0.0.1``), none on 0.0.0.0 / ::. If a Ray version takes another address
    anyway, the run says so on stderr. Connecting to a cluster (``ray.address``) is unchanged."""
    import ipaddress
    import os

    import ray
    from ray._private import ray_constants

    var = getattr(ray_constants, "ENABLE_RAY_CLUSTERS_ENV_VAR", MULTI_NODE_VAR)
    had_env = os.environ.get(var)
    had_switch = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[var] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(**kw)
    finally:
        if had_env is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = had_env
        if had_switch is None:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = had_switch
    ip = ray.util.get_node_ip_address()
    try:
        loopback = ipaddress.ip_address(ip).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        print(f"miles-lp run: the local Ray cluster took {ip} as its address (this Ray version ignored the loopback "
              f"setting, {var}=0): its servers may be reachable from the network; see docs/rl.md (Ray)",
              file=sys.stderr, flush=True)
    return ip


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """``ray.init`` retries an unreachable GCS for minutes: test the TCP port first and name the address."""
    import socket

    if address == "auto":
        return  # ray resolves it from this machine's running cluster (and says so if there is none)
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"ray.address {address!r}: expected host:port (or ray://host:port, or auto)")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"ray.address {address!r}: nothing answers at {host}:{port} ({exc.strerror or exc}); "
                          "start a cluster there (ray start --head --port PORT) or remove ray.address to run a "
                          "local one") from None


def _bundles(recipe: Recipe, layout: Any = None) -> list[dict[str, float]]:
    """The placement group: ``colocate`` one bundle holding the learner and every engine (they share the node /
    GPU); ``split`` one bundle for the learner and one per engine (``rollout.engines``), spread where they can.
    A learner of several ranks (``layout``, ``ray_layout.LearnerLayout``): rank 0's bundle (the learner actor's,
    holding the engines under ``colocate``) is bundle 0, ranks 1..world-1 follow in rank order
    (``rank_bundles``), then the engines' under ``split``."""
    from miles_lp.launch.engines import engines_of

    lr, ro = recipe.ray.learner, recipe.ray.rollout
    n = engines_of(recipe)

    def b(cpu, gpu):
        return {"CPU": cpu, **({"GPU": gpu} if gpu else {})}
    if layout is None:
        first, ranks = b(lr.num_cpus, lr.num_gpus), []
    else:
        first, ranks = layout.rank_bundle(), [layout.rank_bundle() for _ in range(layout.world - 1)]
    if recipe.ray.placement == "colocate":
        return [b(first["CPU"] + n * ro.num_cpus, max(first.get("GPU", 0.0), n * ro.num_gpus)), *ranks]
    return [first, *ranks] + [b(ro.num_cpus, ro.num_gpus) for _ in range(n)]


def rank_bundles(layout: Any) -> list[int]:
    """The bundle of each rank 1..world-1 in ``_bundles``' group (rank r in bundle r)."""
    return [] if layout is None else list(range(1, layout.world))


class RayPlacement:
    """The learner (with the frozen reference) in one actor, each engine in an actor of its own, all in one
    placement group (``_bundles``). A Megatron learner of several ranks: that actor is rank 0 and ranks
    1..world-1 are Ray actors of their own in the same group (``ray_layout``, ``train.megatron.ray_ranks``). The driver keeps the loop, the sentinel and, for the ``inprocess`` / ``ray``
    transports, the sync (buckets relayed through the object store); ``nccl`` / ``gloo`` run the sync in the learner
    actor (``actor_sync``)."""

    engine_name = "the rollout actor"

    def __init__(self, learner_state_dir: str | None = None):
        self.learner_state_dir = learner_state_dir
        self.pg = None
        self.layout = None
        self.learner_actor = None
        self.engine_actors: dict[int, Any] = {}

    def _place(self, run: Any) -> None:
        import ray
        from ray.util.placement_group import placement_group

        from miles_lp.launch.ray_layout import learner_layout
        from miles_lp.launch.runner import read_model_config

        recipe = run.recipe
        self.layout = learner_layout(recipe, read_model_config(run.model_dir))
        bundles = _bundles(recipe, self.layout)
        # PACK with rank actors: a tensor / expert group's ranks fill a node before the next one is used
        spread = len(bundles) > 1 and self.layout is None
        self.pg = placement_group(bundles, strategy="SPREAD" if spread else "PACK")
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"ray: the placement group {bundles} ({recipe.ray.placement}) was not granted in 120 s; "
                              f"the cluster has {ray.available_resources()} free: lower ray.learner / ray.rollout "
                              "num_cpus / num_gpus, rollout.engines, or add nodes") from None
        self._colocated = recipe.ray.placement == "colocate"
        self._first_engine_bundle = 1 + len(rank_bundles(self.layout))
        if self.layout is not None and recipe.train.device == "auto":  # the ranks' device is the layout's
            import dataclasses

            recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, device=self.layout.device))
        self._yaml, self._source = recipe.to_yaml(), recipe.source

    def _opts(self, res: Any, bundle: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, bundle)}

    def learner(self, run: Any, learner_state: Any) -> tuple[Any, Any]:
        import ray

        from miles_lp.launch.recipe import RoleResources

        self._place(run)
        recipe = run.recipe
        res, ranks = recipe.ray.learner, None
        if self.layout is not None:  # rank 0 of the rank actors: one rank's share
            b = self.layout.rank_bundle()
            res = RoleResources(num_cpus=b["CPU"], num_gpus=b.get("GPU", 0.0))
            ranks = {"layout": self.layout, "placement_group": self.pg, "bundles": rank_bundles(self.layout)}
        threads = int(max(1, res.num_cpus))
        self.learner_actor = ray.remote(LearnerWorker).options(**self._opts(res, 0)).remote(
            self._yaml, self._source, str(run.model_dir), None if run.plan is None else run.plan.to_json(),
            threads, self.learner_state_dir, recipe.rl.kl_coef > 0, ranks)
        run.learner_actor = self.learner_actor
        reference = ReferenceProxy(self.learner_actor) if recipe.rl.kl_coef > 0 else None
        return LearnerProxy(self.learner_actor, run.plan), reference

    def start_engine_actor(self, run: Any, index: int) -> Any:
        import ray

        recipe = run.recipe
        threads = int(max(1, recipe.ray.rollout.num_cpus))
        bundle = 0 if self._colocated else self._first_engine_bundle + index
        actor = ray.remote(EngineWorker).options(**self._opts(recipe.ray.rollout, bundle)).remote(
            str(run.prep.engine_ckpt), self._yaml, self._source, threads, index)
        ray.get(actor.pid.remote())  # started (or raises)
        self.engine_actors[index] = actor
        if index == 0:
            run.engine_actor = actor
        return actor

    def engine(self, run: Any, index: int) -> Any:
        old = self.engine_actors.get(index)
        if old is not None:  # a restart: the dead actor is gone for good
            _kill(old)
        return EngineProxy(self.start_engine_actor(run, index))

    def sync_for(self, run: Any, engine: Any) -> Any:
        from miles_lp.launch.runner import sync_log, target_of
        from miles_lp.sync import WeightSync
        from miles_lp.sync.sentinel import Sentinel

        recipe = run.recipe
        if recipe.sync.transport in BROADCAST:  # the sync runs in the learner actor, bytes straight to the engine's
            return ActorSync(self.learner_actor, engine.actor, target_of(recipe), Sentinel(recipe.sync.sentinel),
                             run.sync_env, config=recipe.sync, log=sync_log)
        # the sync runs here, buckets relayed through the object store
        return WeightSync(engine, run.plan, target_of(recipe), recipe.sync, env=run.sync_env, log=sync_log)

    def fleet_sync(self, run: Any, engines: list[Any]) -> Any:
        from miles_lp.launch.runner import sync_log, target_of
        from miles_lp.sync.fleet import FleetSync
        from miles_lp.sync.sentinel import Sentinel

        recipe = run.recipe
        if recipe.sync.transport in BROADCAST:  # one update group: the learner actor and every engine actor
            return ActorFleetSync(self.learner_actor, [e.actor for e in engines], target_of(recipe),
                                  Sentinel(recipe.sync.sentinel), run.sync_env, config=recipe.sync, log=sync_log)
        return FleetSync([self.sync_for(run, e) for e in engines], log=sync_log)

    def dead(self, engine: Any, exc: BaseException | None) -> bool:
        # the sync wraps an engine's failure (SyncAbortedError): ask the actor, not only the exception type
        return isinstance(exc, EngineDied) or not actor_alive(engine.actor)

    def checkpoint(self, run: Any, loop: dict[str, Any]) -> Path:
        import ray

        return Path(ray.get(self.learner_actor.save_state.remote(str(run.dir.path), run.step, loop)))

    def close(self, run: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        sync = getattr(run, "sync", None)
        sync = getattr(sync, "inner", sync)  # a fleet's step-facing sync wraps its FleetSync
        if isinstance(sync, (ActorSync, ActorFleetSync)):
            sync.close()
        for a in [*self.engine_actors.values(), self.learner_actor]:
            if a is not None:
                _kill(a)
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already removed
                pass


def _kill(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - already gone
        pass


class RayRun(Run):
    """``Run`` with ``RayPlacement``: the same build and loop, the parts in actors."""

    def __init__(self, recipe: Recipe, run_dir, *, resume: bool = False, start_step: int = 0,
                 loop_state: dict | None = None, learner_state_dir: str | None = None):
        super().__init__(recipe, run_dir, start_step=start_step, loop_state=loop_state or {},
                         placement=RayPlacement(learner_state_dir))

    @classmethod
    def _checkpoint_state(cls, rd: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The learner actor loads its state from the checkpoint folder itself: the driver reads loop.json only."""
        import json

        latest = rd.latest()
        if latest is None:
            raise RunError(f"{rd.path}: no checkpoint to resume from")
        return {"learner_state_dir": str(latest / "learner")}, json.loads((latest / "loop.json").read_text())

    def _start_engine(self):
        return self.placement.start_engine_actor(self, 0)

    def restart_engine(self) -> None:
        """A fresh rollout actor in the same bundle, recorded anew by the sync, then a full resync; its engine's
        ``c3_rotation_base`` set to the run's sync count (as ``Run.restart_engine`` does in process). The proxy
        stays the run's engine object (the step's parts hold it); its actor is replaced."""
        from miles_lp.launch.runner import rotation_base

        _kill(self.engine_actor)
        self.restarts += 1
        served = self.sync.expected_version - self.initial.weight_version  # syncs since the last (re)start
        self.engine_actor = self._start_engine()
        self.engine.actor = self.engine_actor
        self.engine._learn_surface()
        if isinstance(self.sync, ActorSync):  # a new group with the new engine rank
            self.sync.connect(self.engine_actor)
        elif hasattr(self.sync, "engine"):
            self.sync.engine = self.engine  # its capabilities read again
        self.initial = self.sync.initial_sync(self.learner)
        self.version_offset += served
        rotation_base(self.engine, self.version_offset)  # the fresh actor's engine counts from its own start


def run_with_ray(recipe: Recipe, *, resume: str | None = None, run_name: str | None = None,
                 progress: bool = True, on_step=None) -> dict[str, Any]:
    """Run ``recipe`` under Ray; returns a summary. ``on_step(run, metrics)`` is called after each step."""
    import time

    from miles_lp.launch.run_dir import RunDir
    from miles_lp.launch.runner import RunInterrupted, resumed_recipe, summary

    saved = resumed_recipe(RunDir(resume), recipe) if resume else None  # refused before a cluster starts
    started = _init_ray(recipe)
    run = None
    try:
        if resume:
            run = RayRun.resume(resume, saved)
        else:
            name = run_name or recipe.logging.run_name or (
                f"{Path(recipe.source).stem}-ray-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
            run = RayRun.start(recipe, name)
        rd = run.dir
        try:
            rows = run.train(progress=progress and recipe.logging.progress, tensorboard=False, on_step=on_step)
        except KeyboardInterrupt:
            raise RunInterrupted(rd, run.step, run.recipe.steps) from None  # noted by the CLI after the actors stop
        return {"run_dir": str(rd.path), "steps": run.step, "engine_restarts": run.engine_restarts, **summary(rows)}
    finally:  # Ctrl-C included: no actor, placement group or cluster left behind
        if run is not None:
            run.close()
        if started:
            import ray

            ray.shutdown()
