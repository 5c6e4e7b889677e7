"""``ray.enabled: true``: the same run, with the learner and the engine in Ray actors.

Orchestration only: the actors wrap the very objects the in-process run builds (``EmbeddedTrainer``,
``ReferenceEngine``); the driver runs the same ``grpo_step`` and the same ``WeightSync`` on proxies that
forward each call to its actor (``ray.get``). Tensors travel through Ray's object store (the driver relays the
sync's buckets from the learner's export to the engine: a CPU path; a GPU deployment would use the sync's
``cuda_ipc`` / ``nccl`` transports instead).

Placement (``ray.placement``), as Miles does: ``colocate`` = one bundle holding both roles' resources (learner
and sampler share the node / GPU); ``split`` = one bundle per role, spread over the cluster where it can be.
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

import dataclasses
import sys
from pathlib import Path
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.launch.actor_sync import (
    BROADCAST,
    ActorSync,
    EngineSyncSide,
    LearnerSyncSide,
    actor_alive,
    check_broadcast,
)
from miles_lp.launch.recipe import Recipe
from miles_lp.launch.wire import pack, unpack
from miles_lp.rl.step import RunError


class EngineDied(RunError):
    def __init__(self, message: str, method: str):
        super().__init__(message)
        self.method = method


# ---------------------------------------------------------------------------------------------------------
# actors: thin wrappers around the in-process objects
# ---------------------------------------------------------------------------------------------------------
class LearnerWorker(LearnerSyncSide):
    def __init__(self, recipe_yaml: str, source: str, model_dir: str, plan_json: str | None, threads: int,
                 learner_state_dir: str | None, with_reference: bool = False):
        import torch

        from miles_lp.config import load_yaml_text
        from miles_lp.launch.recipe import parse_recipe
        from miles_lp.launch.runner import make_learner

        torch.set_num_threads(max(1, threads))
        recipe = parse_recipe(load_yaml_text(recipe_yaml, source))
        plan = None
        if plan_json is not None:
            from miles_lp.launch.runner import plan_for

            plan = plan_for(recipe, Path(model_dir))
        self.recipe, self.plan = recipe, plan
        self.learner = make_learner(recipe, Path(model_dir), plan)
        if learner_state_dir is not None:
            from miles_lp.train.state_io import load_learner_state

            self.learner.load_state_dict(load_learner_state(learner_state_dir))
        self.reference = None
        if with_reference:  # as the in-process run builds it: a frozen BF16 EmbeddedTrainer on the learner's device
            from miles_lp.train.embedded import EmbeddedTrainer

            self.reference = EmbeddedTrainer(Path(model_dir), None, recipe.train)

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
    def __init__(self, checkpoint: str, recipe_yaml: str, source: str, threads: int):
        import torch

        from miles_lp.config import load_yaml_text
        from miles_lp.launch.recipe import parse_recipe
        from miles_lp.launch.runner import make_engine

        torch.set_num_threads(max(1, threads))
        self.recipe = parse_recipe(load_yaml_text(recipe_yaml, source))
        self.engine = make_engine(self.recipe, Path(checkpoint))

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
    servers bind 127.0.0.1 by default; review-6 L7). Returns the node's IP (127.0.0.1).

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


def _bundles(recipe: Recipe) -> list[dict[str, float]]:
    lr, ro = recipe.ray.learner, recipe.ray.rollout

    def b(cpu, gpu):
        return {"CPU": cpu, **({"GPU": gpu} if gpu else {})}
    if recipe.ray.placement == "colocate":
        return [b(lr.num_cpus + ro.num_cpus, max(lr.num_gpus, ro.num_gpus))]
    return [b(lr.num_cpus, lr.num_gpus), b(ro.num_cpus, ro.num_gpus)]


class RayRun:
    """The in-process ``Run`` with its learner and engine moved into actors."""

    def __init__(self, recipe: Recipe, run_dir, *, resume: bool, start_step: int, loop_state: dict,
                 learner_state_dir: str | None):
        try:
            self._build(recipe, run_dir, start_step, loop_state, learner_state_dir)
        except BaseException:  # no actor or placement group outlives a run that failed to start
            self.close()
            raise

    def _build(self, recipe: Recipe, run_dir, start_step: int, loop_state: dict, learner_state_dir: str | None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from miles_lp.launch.model import prepare_model, vocab_size
        from miles_lp.launch.runner import (
            _rotation_base,
            _target,
            check_answerable,
            check_task_fits,
            check_transport,
            engine_side,
            note_skipped_checks,
            plan_for,
            read_model_config,
            sampling_for,
            sync_env,
            sync_log,
            sync_overrides,
        )
        from miles_lp.rl.step import StepParts
        from miles_lp.rl.tasks import make_task
        from miles_lp.sync import WeightSync
        from miles_lp.sync.sentinel import Sentinel

        check_broadcast(recipe)
        check_transport(recipe)  # the refusal the CLI and --dry-run share, for an API caller too
        self.sync_env = sync_env()  # read once, here: the refusal below and the sync see the same variables
        check_answerable(recipe, self.sync_env)
        self.recipe, self.dir = recipe, run_dir
        self.model_dir = prepare_model(recipe.model, run_dir.path / "model")
        self.plan = plan_for(recipe, self.model_dir)
        self.task = make_task(recipe.task, vocab_size(self.model_dir), self.model_dir)
        check_task_fits(recipe, self.task, read_model_config(self.model_dir))
        self.engine_ckpt, _, _ = engine_side(recipe, self.model_dir, self.plan, run_dir.path / "engine_init")
        bundles = _bundles(recipe)
        strategy = "PACK" if len(bundles) == 1 else "SPREAD"
        self.pg = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(f"ray: the placement group {bundles} ({recipe.ray.placement}) was not granted in 120 s; "
                              f"the cluster has {ray.available_resources()} free: lower ray.learner / ray.rollout "
                              "num_cpus / num_gpus or add nodes") from None
        self._rollout_bundle = 0 if len(bundles) == 1 else 1

        def opts(res, bundle):
            return {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, bundle)}
        self._yaml, self._source = recipe.to_yaml(), recipe.source
        self._engine_opts = opts(recipe.ray.rollout, self._rollout_bundle)
        threads = int(max(1, recipe.ray.learner.num_cpus))
        self.learner_actor = ray.remote(LearnerWorker).options(**opts(recipe.ray.learner, 0)).remote(
            self._yaml, self._source, str(self.model_dir), None if self.plan is None else self.plan.to_json(),
            threads, learner_state_dir, recipe.rl.kl_coef > 0)
        self.learner = LearnerProxy(self.learner_actor, self.plan)
        self.reference = ReferenceProxy(self.learner_actor) if recipe.rl.kl_coef > 0 else None
        self.engine_actor = self._start_engine()
        self.engine = EngineProxy(self.engine_actor)
        self.sync_overrides = sync_overrides(recipe, self.sync_env)
        note_skipped_checks(recipe, self.sync_env)
        if recipe.sync.transport in BROADCAST:  # the sync runs in the learner actor, bytes straight to the engine's
            sentinel = Sentinel(recipe.sync.sentinel)
            self.sync = ActorSync(self.learner_actor, self.engine_actor, _target(recipe), sentinel, self.sync_env,
                                  config=recipe.sync, log=sync_log)
        else:  # the sync runs here, buckets relayed through the object store
            self.sync = WeightSync(self.engine, self.plan, _target(recipe), recipe.sync, env=self.sync_env,
                                   log=sync_log)
        self.sync.sentinel.load_state_dict(loop_state.get("sentinel") or {})
        self.initial = self.sync.initial_sync(self.learner)
        self.version_offset = int(loop_state.get("engine_weight_version", 0))
        _rotation_base(self.engine, self.version_offset)  # in the actor's engine, before the first step's sync
        self.restarts = 0
        self.step = start_step
        self.parts = StepParts(learner=self.learner, engine=self.engine, sync=self.sync, task=self.task,
                               sampling=sampling_for(recipe, self.task), rl=recipe.rl, seed=recipe.seed,
                               reference=self.reference)

    def _start_engine(self):
        import ray

        threads = int(max(1, self.recipe.ray.rollout.num_cpus))
        actor = ray.remote(EngineWorker).options(**self._engine_opts).remote(str(self.engine_ckpt), self._yaml,
                                                                             self._source, threads)
        ray.get(actor.pid.remote())  # started (or raises)
        return actor

    def restart_engine(self) -> None:
        """A fresh rollout actor in the same bundle, recorded anew by the sync, then a full resync; its engine's
        ``c3_rotation_base`` set to the run's sync count (as ``Run.restart_engine`` does in process)."""
        import ray

        from miles_lp.launch.runner import _rotation_base

        try:
            ray.kill(self.engine_actor)
        except Exception:  # already gone
            pass
        self.restarts += 1
        old_version_base = self.initial.weight_version
        served = self.sync.expected_version - old_version_base  # syncs since the last (re)start
        self.engine_actor = self._start_engine()
        self.engine.actor = self.engine_actor
        self.engine._learn_surface()
        if isinstance(self.sync, ActorSync):  # a new group with the new engine rank
            self.sync.connect(self.engine_actor)
        self.initial = self.sync.initial_sync(self.learner)
        self.version_offset += served
        _rotation_base(self.engine, self.version_offset)  # the fresh actor's engine counts from its own start

    def checkpoint(self) -> Path:
        import ray

        sent = self.sync.sentinel
        loop = {"data_position": self.step,
                "engine_weight_version": int(self.sync.expected_version) - int(self.initial.weight_version)
                + self.version_offset,
                "sentinel": sent.state_dict()}
        return Path(ray.get(self.learner_actor.save_state.remote(str(self.dir.path), self.step, loop)))

    def step_once(self) -> dict[str, float]:
        from miles_lp.launch.runner import step_with_restarts

        # the sync wraps an engine's failure (SyncAbortedError): ask the actor, not only the exception type
        return step_with_restarts(
            self, engine_dead=lambda exc: isinstance(exc, EngineDied) or not actor_alive(self.engine_actor),
            learner_steps=lambda: int(self.learner.step), what="the rollout actor")

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if isinstance(getattr(self, "sync", None), ActorSync):
            self.sync.close()
        for a in (getattr(self, "engine_actor", None), getattr(self, "learner_actor", None)):
            if a is not None:
                try:
                    ray.kill(a)
                except Exception:
                    pass
        try:
            remove_placement_group(self.pg)
        except Exception:  # never created (a start that failed earlier) or already removed
            pass


def run_with_ray(recipe: Recipe, *, resume: str | None = None, run_name: str | None = None,
                 progress: bool = True, on_step=None) -> dict[str, Any]:
    """Run ``recipe`` under Ray; returns a summary. ``on_step(run, metrics)`` is called after each step."""
    import json
    import time

    from miles_lp.launch.run_dir import RunDir
    from miles_lp.launch.runner import resumed_recipe, summary

    saved = resumed_recipe(RunDir(resume), recipe) if resume else None  # refused before a cluster starts
    started = _init_ray(recipe)
    run = None
    try:
        if resume:
            rd = RunDir(resume)
            latest = rd.latest()
            if latest is None:
                raise RunError(f"{rd.path}: no checkpoint to resume from")
            loop = json.loads((latest / "loop.json").read_text())
            rd.truncate_metrics(int(loop["step"]))
            run = RayRun(saved, rd, resume=True, start_step=int(loop["step"]), loop_state=loop,
                         learner_state_dir=str(latest / "learner"))
            rd.record_resume(run.step, {"sync_check_overrides": run.sync_overrides})
        else:
            name = run_name or recipe.logging.run_name or (
                f"{Path(recipe.source).stem}-ray-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
            rd = RunDir.create(recipe.logging.output_dir, name)
            try:
                run = RayRun(recipe, rd, resume=False, start_step=0, loop_state={}, learner_state_dir=None)
            except BaseException:  # failed or interrupted while starting: no half-made run folder
                rd.discard_unstarted()
                raise
            rd.write_header(recipe.to_yaml(), None if run.plan is None else run.plan.to_json(),
                            {"plan_hash": None if run.plan is None else run.plan.hash, "model_dir": str(Path(run.model_dir).resolve()),
                             "recipe_source": recipe.source, "created": time.time(), "steps": recipe.steps,
                             "ray": dataclasses.asdict(recipe.ray), "sync_check_overrides": run.sync_overrides})
        rows = []
        bar = None
        if progress and recipe.logging.progress:
            from tqdm import tqdm

            bar = tqdm(total=recipe.steps, initial=run.step, desc=rd.path.name, file=sys.stderr)
        try:
            while run.step < run.recipe.steps:
                step = run.step
                try:
                    m = run.step_once()
                except RunError:
                    raise
                except Exception as exc:
                    from miles_lp.launch.runner import sync_failed
                    from miles_lp.sync import SyncError

                    if isinstance(exc, SyncError):  # as the in-process run: the failure, then how to resume
                        raise sync_failed(rd, step, run.recipe.steps, exc) from exc
                    raise
                rows.append(m)
                if on_step is not None:
                    on_step(run, m)
                if bar is not None:
                    bar.set_postfix_str(f"reward={m['reward/mean']:.3g} kl={m.get('rollout_corr/kl', 0):.3g}")
                    bar.update(1)
        except KeyboardInterrupt:
            from miles_lp.launch.runner import RunInterrupted

            raise RunInterrupted(rd, run.step, run.recipe.steps) from None  # noted by the CLI after the actors stop (below)
        finally:
            if bar is not None:
                bar.close()
        return {"run_dir": str(rd.path), "steps": run.step, "engine_restarts": run.restarts, **summary(rows)}
    finally:  # Ctrl-C included: no actor, placement group or cluster left behind
        if run is not None:
            run.close()
        if started:
            import ray

            ray.shutdown()
