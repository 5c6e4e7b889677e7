"""``sync.transport: nccl | gloo`` under Ray: the weight sync runs inside the learner actor, the bytes go
straight to the engine actor over ``torch.distributed``.

The default Ray path (``inprocess`` / ``ray``) runs ``WeightSync`` in the driver and relays every bucket
through the object store. A broadcast transport is what slime and Miles do (SGLang's
``update_weights_from_distributed``): learner and engine form a process group of two ranks (learner 0, engine 1;
NCCL between GPUs, gloo on CPU) and the learner broadcasts each bucket. Here that is:

* the learner actor runs the *same* ``WeightSync`` on a ``miles_lp.sync.remote.RemoteEngine`` with a
  ``BroadcastTransport(receipts=True)``: export, buckets, every check (C1-C5 and C7 over the group), no byte
  through the driver;
* the engine actor runs ``BroadcastReceiver.serve(engine)`` in a background thread for the whole run, so the
  driver's ``generate`` calls reach the same engine through Ray as before (grpo_step never generates during a
  sync);
* the driver keeps the sentinel (C6): ``grpo_step`` feeds it the step's rollouts, and it travels to the
  learner actor with each sync and back (it is a few counters and the last verdict).

An engine that dies breaks the group: ``reconnect`` builds a new one with the new engine actor (a new port) and
gives the learner's ``WeightSync`` the new remote engine and transport; the caller then runs ``initial_sync``
(full resync), as for the other transports. A collective waits at most ``TIMEOUT_S`` for a dead peer.

The group is the sync's own (``miles_lp.sync.group.SyncGroup``: a store and a gloo / NCCL process group built
directly, never torch's default group), so the Megatron learner's world in the learner actor (its TP / EP / DP
groups) is untouched, as SGLang's ``init_weights_update_group`` keeps the weight-update group apart.

Several engines (``rollout.engines: N``, ``ActorFleetSync``): ONE update group of 1 + N ranks, the learner's and
every engine actor's (slime's single update group; SGLang's ``init_weights_update_group`` with world 1 + N), the
``miles_lp.sync.group.SharedUpdateGroup``: each bucket is broadcast once and reaches every engine, each engine
replies with its own receipt, and every check runs on each engine (``sync/check/<name>/engine<i>``). An engine
that dies breaks the group for all: the group is rebuilt with every engine actor (the replacement included) and
the replacement is resynced in full; an engine whose update was cut off by the death gets it again (the fleet
sync's retry). Tensor-parallel ranks inside one engine are the engine's own affair (SGLang's ``--tp-size``). NCCL
needs the actors on different GPUs (``ray.placement: split``); on one GPU use ``cuda_ipc``. The NCCL variant has
not run here (no machine with two GPUs was used); gloo runs in the tests, the same code with the backend named.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

from miles_lp.errors import ConfigError
from miles_lp.rl.step import RunError

BROADCAST = ("nccl", "gloo")


class EngineDied(RunError):
    """A rollout actor died during a call (``method``): the run restarts it (``ray_launcher``)."""

    def __init__(self, message: str, method: str):
        super().__init__(message)
        self.method = method
TIMEOUT_S = 300
LEARNER_RANK, ENGINE_RANK = 0, 1


class ActorSyncError(RuntimeError):
    """A ``SyncError`` raised in the learner actor, as it crosses to the driver: the sync's exceptions take more
    than a message to build, which Ray's exception pickling cannot do (the driver would get an
    ``UnserializableException``). ``rebuild()`` gives the driver the sync's own exception back."""

    def __init__(self, message: str, kind: str = "SyncError", stage: str | None = None, bucket: int | None = None,
                 verdicts: tuple = (), report: Any = None, engine_index: int | None = None):
        super().__init__(message)
        self.kind, self.stage, self.bucket, self.verdicts = kind, stage, bucket, tuple(verdicts)
        self.report, self.engine_index = report, engine_index

    def __reduce__(self):
        return (type(self), (str(self), self.kind, self.stage, self.bucket, self.verdicts, self.report,
                             self.engine_index))

    @classmethod
    def of(cls, exc: BaseException) -> ActorSyncError:
        return cls(str(exc), type(exc).__name__, getattr(exc, "stage", None), getattr(exc, "bucket", None),
                   getattr(exc, "verdicts", ()), getattr(exc, "report", None), getattr(exc, "engine_index", None))

    def rebuild(self) -> Exception:
        from miles_lp.sync.verdict import SyncAbortedError, SyncCheckError, SyncError

        if self.kind == "SyncCheckError":
            err: Exception = SyncCheckError(str(self), self.verdicts, self.report)
        elif self.kind == "SyncAbortedError":
            err = SyncAbortedError(str(self), self.stage or "transfer", self.bucket, self.report)
        else:
            err = SyncError(str(self), self.report)
        if self.engine_index is not None:
            err.engine_index = self.engine_index
        return err


def _portable(fn):
    """A learner-actor method whose ``SyncError`` reaches the driver whole (``ActorSyncError``)."""
    import functools

    @functools.wraps(fn)
    def call(*args, **kwargs):
        from miles_lp.sync.verdict import SyncError

        try:
            return fn(*args, **kwargs)
        except SyncError as exc:
            raise ActorSyncError.of(exc) from None
    return call


def _sync_error(exc: BaseException) -> BaseException | None:
    """The sync's own exception inside a Ray task error from the learner actor, else None."""
    cause = getattr(exc, "cause", None)
    return cause.rebuild() if isinstance(cause, ActorSyncError) else None


def check_broadcast(recipe: Any) -> None:
    """Refuse a broadcast transport the placement or devices cannot run, naming the recipe keys."""
    name = recipe.sync.transport
    if name not in BROADCAST:
        return
    if not recipe.ray.enabled:
        raise ConfigError(f"sync.transport: {name} broadcasts between the learner and engine processes; set "
                          "ray.enabled: true (or use inprocess in one process)")
    devices = (str(recipe.train.device), str(getattr(recipe.rollout, "device", "auto")))
    if name == "nccl":
        if "cpu" in devices:
            raise ConfigError(f"sync.transport: nccl needs CUDA devices for the learner and the engine (train.device "
                              f"{devices[0]!r}, rollout.device {devices[1]!r}); on CPU use gloo")
        if recipe.ray.placement != "split":
            raise ConfigError("sync.transport: nccl needs the learner and the engine on different GPUs (NCCL refuses "
                              "two ranks on one device): set ray.placement: split, or use cuda_ipc when colocated")


def _family(host: str) -> int:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_address() -> tuple[str, int]:
    """This node's address (127.0.0.1 in the local cluster ``start_local_ray`` starts) and a free TCP port on it for
    the group's store (rank 0 hosts it)."""
    import socket

    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return host, port


def group_store(host: str, port: int, rank: int, timeout: datetime.timedelta, size: int = 2) -> Any:
    """The group's rendezvous store (``sync.group.group_store``): rank 0 hosts it listening on ``host`` only (torch's
    ``TCPStore`` server alone listens on every interface, ``::``, measured with torch 2.13, which would undo the
    local cluster's loopback-only binding)."""
    from miles_lp.sync.group import group_store as store

    return store(host, port, rank, size, timeout)


def join_group(backend: str, host: str, port: int, rank: int, device: str, size: int = 2) -> Any:
    """The sync's own group (``SyncGroup``; two ranks, or 1 + N for a fleet): a store and a process group of its
    own, never torch's default group, so a Megatron learner's world in the same process stays as it is."""
    import torch

    from miles_lp.sync.group import SyncGroup

    if backend == "nccl":  # object broadcasts stage on the current device
        torch.cuda.set_device(torch.device(device))
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    return SyncGroup.create(backend, group_store(host, port, rank, timeout, size), rank, size, device=device,
                            timeout=timeout)


class LearnerSyncSide:
    """Mixed into the learner actor: rank 0 of the sync group with one engine (``join_group`` / ``attach_engine``),
    or of the fleet's update group holding every engine's rank (``join_shared`` / ``attach_shared``); the
    ``WeightSync`` of each engine and, for several, the ``FleetSync`` over them (one export per sync, each bucket
    broadcast once, every engine checked)."""

    learner: Any
    recipe: Any
    plan: Any
    _slots: dict[int, list[Any]] | None = None  # index -> [SyncGroup, WeightSync or None]
    _fleet: Any = None
    _resynced: dict[int, Any] | None = None

    @property
    def weight_sync(self) -> Any:
        """Engine 0's ``WeightSync`` (the one-engine run's)."""
        return (self._slots or {}).get(0, [None, None])[1]

    def group_address(self) -> tuple[str, int]:
        return free_address()

    def join_group(self, host: str, port: int, index: int = 0) -> None:
        slots = self._slots if self._slots is not None else {}
        self._slots = slots
        slot = slots.setdefault(index, [None, None])
        if slot[0] is not None:  # the group of a previous engine (before a restart)
            slot[0].close()
        slot[0] = join_group(self.recipe.sync.transport, host, port, LEARNER_RANK, str(self.learner.device))

    def attach_engine(self, target: str, env: dict[str, str] | None = None, index: int = 0) -> None:
        """A ``RemoteEngine`` on engine ``index``'s group (its engine rank must be serving): a new ``WeightSync`` the
        first time, afterwards (an engine restart) the same one with the new engine and transport."""
        from miles_lp.sync import WeightSync
        from miles_lp.sync.group import GroupRemoteEngine
        from miles_lp.sync.transport import BroadcastTransport

        slot = self._slots[index]
        engine = GroupRemoteEngine(slot[0], engine_rank=ENGINE_RANK, learner_rank=LEARNER_RANK)
        transport = BroadcastTransport(group=slot[0], src=LEARNER_RANK, device=self.learner.device,
                                       name=self.recipe.sync.transport, receipts=True, reply_from=ENGINE_RANK)
        if slot[1] is None:
            # the driver's MILES_LP_SYNC_CHECK* variables (printed and recorded there), not this actor's
            slot[1] = WeightSync(engine, self.plan, target, self.recipe.sync, transport=transport, log=print,
                                 env=env or {})
        else:
            slot[1].engine, slot[1].transport = engine, transport

    # ---- a fleet: one update group holding every engine's rank (SharedUpdateGroup) ---------------------------
    _shared: Any = None

    def leave_shared(self, graceful: bool = True) -> None:
        """End the fleet's update group: its engine ranks stop serving it (``graceful``: told so; otherwise, before
        a rebuild after an engine died, the group is dropped, which ends their waits)."""
        if self._shared is not None:
            self._shared.close(graceful)
            self._shared = None

    def join_shared(self, host: str, port: int, engines: int) -> None:
        """Rank 0 of a new update group with ``engines`` engine ranks (engine i: rank i + 1)."""
        from miles_lp.sync.group import SharedUpdateGroup

        self.leave_shared(graceful=False)
        group = join_group(self.recipe.sync.transport, host, port, LEARNER_RANK, str(self.learner.device),
                           size=engines + 1)
        self._shared = SharedUpdateGroup(group, engines, device=self.learner.device)

    def attach_shared(self, target: str, env: dict[str, str] | None = None) -> None:
        """Every engine's ``RemoteEngine`` and transport on the current update group (their ranks serving): a new
        ``WeightSync`` per engine the first time, afterwards (the group rebuilt) the same ones, each with its
        engine and transport anew; the ``FleetSync`` over them sends through the group."""
        from miles_lp.sync import WeightSync
        from miles_lp.sync.fleet import FleetSync
        from miles_lp.sync.group import FanoutRemoteEngine, FanoutTransport

        slots = self._slots if self._slots is not None else {}
        self._slots = slots
        for i in range(self._shared.engines):
            slot = slots.setdefault(i, [None, None])
            engine = FanoutRemoteEngine(self._shared, i)
            transport = FanoutTransport(self._shared, i, name=self.recipe.sync.transport)
            if slot[1] is None:
                # the driver's MILES_LP_SYNC_CHECK* variables (printed and recorded there), not this actor's
                slot[1] = WeightSync(engine, self.plan, target, self.recipe.sync, transport=transport, log=print,
                                     env=env or {})
            else:
                slot[1].engine, slot[1].transport = engine, transport
        if self._fleet is None:
            self._fleet = FleetSync([slots[i][1] for i in sorted(slots)], log=print, fanout=self._shared)
        self._fleet.fanout = self._shared

    def shared_sends(self) -> tuple[int, int]:
        """Buckets sent over the fleet's update group so far: (broadcasts to every engine, sends to one)."""
        s = self._shared
        return (0, 0) if s is None else (s.broadcasts, s.p2p)

    @_portable
    def run_sync(self, sentinel: Any, initial: bool) -> tuple[Any, Any, int]:
        """One sync (``initial``: after recording the engine anew, full compare); returns the report, the
        sentinel as the sync left it, and the version the engine should now report."""
        ws = self.weight_sync
        ws.sentinel = sentinel
        report = ws.initial_sync(self.learner) if initial else ws.sync(self.learner)
        return report, ws.sentinel, int(ws.expected_version)

    def _fleet_sync(self, sentinel: Any) -> Any:
        from miles_lp.sync.fleet import FleetSync

        if self._fleet is None:
            self._fleet = FleetSync([self._slots[i][1] for i in sorted(self._slots)], log=print)
        self._fleet.sentinel = sentinel
        for ws in self._fleet.syncs:
            ws.sentinel = sentinel
        return self._fleet

    @_portable
    def run_fleet_sync(self, sentinel: Any, initial: bool, only: list[int] | None = None,
                       resynced: tuple[int, ...] = ()) -> tuple[Any, Any, int, list[int]]:
        """One sync of every engine (``FleetSync``; ``only``: these engines, ``resynced``: engines that already
        hold this update from their full resync, whose reports count in this one). Returns the report, the
        sentinel, the fleet's version and each engine's offset to it."""
        fleet = self._fleet_sync(sentinel)
        done = {i: (self._resynced or {}).pop(i) for i in resynced}
        if initial:
            report = fleet.initial_sync(self.learner)
        else:
            report = fleet.sync(self.learner, only=only, done=done)
        return report, fleet.sentinel, int(fleet.expected_version), list(fleet._offset)

    @_portable
    def run_fleet_resync(self, sentinel: Any, index: int) -> tuple[Any, Any, int, list[int]]:
        """Engine ``index`` (attached anew after its restart) recorded and synced in full to the fleet's version."""
        fleet = self._fleet_sync(sentinel)
        ws = self._slots[index][1]
        fleet.syncs[index] = ws
        report = fleet.resync(index, ws.engine, self.learner)
        self._resynced = {**(self._resynced or {}), index: report}
        return report, fleet.sentinel, int(fleet.expected_version), list(fleet._offset)

    def leave_group(self) -> None:
        self.leave_shared()
        for slot in (self._slots or {}).values():
            if slot[1] is not None:
                try:
                    slot[1].engine.close()  # the engine rank's serving loop returns
                except Exception:  # noqa: BLE001 - a dead engine rank: nothing to end
                    pass
            if slot[0] is not None:
                slot[0].close()
        self._slots = None


class EngineSyncSide:
    """Mixed into the engine actor: an engine rank of the sync's group (rank 1 of two; rank i + 1 of a fleet's
    update group), serving weight updates in a background thread."""

    engine: Any
    recipe: Any
    sync_group: Any = None
    _serving: threading.Thread | None = None
    _serve_error: BaseException | None = None
    _rank: int = ENGINE_RANK

    def join_group(self, host: str, port: int, rank: int = ENGINE_RANK, size: int = 2) -> None:
        """Join a (new) group; the loop serving a previous one (a fleet's group rebuilt after another engine
        died) must have ended first: the learner dropped that group, which ends the wait it was in."""
        old = self._serving
        if old is not None and old.is_alive():
            old.join(timeout=60)
            if old.is_alive():
                raise RuntimeError("the engine still serves its previous weight-update group; the learner must "
                                   "close it (leave_shared) before a new one is built")
        self._serving, self._serve_error = None, None
        self._rank = int(rank)
        self.sync_group = join_group(self.recipe.sync.transport, host, port, self._rank,
                                     str(getattr(self.engine, "device", None) or "cpu"), size=size)

    def serve_weights(self) -> None:
        """Start answering the learner's calls and buckets (returns at once; the loop ends when the learner
        closes its ``RemoteEngine``, or ends the fleet's group)."""
        from miles_lp.sync.group import SharedReceiver
        from miles_lp.sync.transport import BroadcastReceiver

        device = getattr(self.engine, "device", None) or "cpu"
        group = self.sync_group
        if group.size > 2:
            shared = SharedReceiver(group, self._rank, device)
            serve = lambda: shared.serve(self.engine)  # noqa: E731
        else:
            receiver = BroadcastReceiver(group=group, src=LEARNER_RANK, device=device)
            serve = lambda: receiver.serve(self.engine, rank=ENGINE_RANK)  # noqa: E731

        def loop() -> None:
            try:
                serve()
            except BaseException as exc:  # reported by serving_error(); the learner's collective fails
                if self.sync_group is group:  # not a group already replaced
                    self._serve_error = exc

        self._serving = threading.Thread(target=loop, name="miles-lp-weight-receiver", daemon=True)
        self._serving.start()

    def serving_error(self) -> str | None:
        e = self._serve_error
        return None if e is None else f"{type(e).__name__}: {e}"


class ActorSync:
    """The driver's ``sync`` for grpo_step and the run: what ``WeightSync`` offers there (``sync``,
    ``initial_sync``, ``sentinel``, ``expected_version``), carried out in the learner actor."""

    def __init__(self, learner_actor: Any, engine_actor: Any, target: str, sentinel: Any,
                 env: dict[str, str] | None = None, config: Any = None, log: Any = None):
        self.learner_actor, self.target, self.sentinel = learner_actor, target, sentinel
        self.env = dict(env or {})
        # ``mode`` / ``log`` as WeightSync's: the RL step reports a step without a sync through them (C6)
        self.config = None if config is None else config.with_env(self.env)
        self.log = log if log is not None else (lambda line: None)
        self.expected_version = 0
        self.connect(engine_actor)

    def connect(self, engine_actor: Any) -> None:
        """Form the group with ``engine_actor`` (again after a restart) and attach the learner's sync to it."""
        import ray

        self.engine_actor = engine_actor
        host, port = ray.get(self.learner_actor.group_address.remote())
        ray.get([self.learner_actor.join_group.remote(host, port), engine_actor.join_group.remote(host, port)])
        ray.get(engine_actor.serve_weights.remote())
        ray.get(self.learner_actor.attach_engine.remote(self.target, self.env))

    def _run(self, initial: bool):
        import ray

        try:
            report, self.sentinel, self.expected_version = ray.get(
                self.learner_actor.run_sync.remote(self.sentinel, initial))
        except ray.exceptions.RayTaskError as exc:
            if not actor_alive(self.engine_actor):  # the engine died under the sync: the run decides (checkpoint, stop)
                raise EngineDied(f"the rollout actor died during the weight sync ({exc.cause})", "sync") from exc
            own = _sync_error(exc)
            if own is not None:
                raise own from exc
            raise
        return report

    def mode(self, name: str) -> str:
        """The effective mode of check ``name`` (the recipe's, the environment applied), as ``WeightSync.mode``."""
        return "warn" if self.config is None else self.config.mode(name)

    def sync(self, learner: Any = None) -> Any:
        return self._run(initial=False)

    def initial_sync(self, learner: Any = None) -> Any:
        return self._run(initial=True)

    def close(self) -> None:
        import ray

        try:
            ray.get(self.learner_actor.leave_group.remote(), timeout=30)
        except Exception:  # an actor already gone: nothing left to close
            pass


class ActorFleetSync:
    """The driver's ``FleetSync`` for several engine actors over ``nccl`` / ``gloo``: the learner actor holds one
    sync group and one ``WeightSync`` per engine and a ``FleetSync`` over them (one export per sync, every engine
    updated and checked, ``sync/check/<name>/engine<i>``); this object offers what ``EngineFleet`` and the run call
    (``sync``, ``initial_sync``, ``resync``, ``version_of``, ``sentinel``, ``mode``, ``log``, ``expected_version``).
    One update group holds the learner's rank and every engine's (``SharedUpdateGroup``): each bucket is broadcast
    once and reaches every engine."""

    def __init__(self, learner_actor: Any, engine_actors: list[Any], target: str, sentinel: Any,
                 env: dict[str, str] | None = None, config: Any = None, log: Any = None):
        self.learner_actor, self.target, self.sentinel = learner_actor, target, sentinel
        self.env = dict(env or {})
        self.config = None if config is None else config.with_env(self.env)
        self.log = log if log is not None else (lambda line: None)
        self.expected_version = 0
        self._offset = [0] * len(engine_actors)
        self.engine_actors = list(engine_actors)
        self.connect_all()

    def connect_all(self) -> None:
        """(Re)build the update group with every engine actor: the old group ended first (its engine ranks stop
        serving it), then the learner's rank 0 and engine i's rank i + 1 join a new one and serve it."""
        import ray

        n = len(self.engine_actors)
        ray.get(self.learner_actor.leave_shared.remote(False))  # a rebuild: an engine of the old group may be dead
        host, port = ray.get(self.learner_actor.group_address.remote())
        ray.get([self.learner_actor.join_shared.remote(host, port, n),
                 *[a.join_group.remote(host, port, i + 1, n + 1) for i, a in enumerate(self.engine_actors)]])
        ray.get([a.serve_weights.remote() for a in self.engine_actors])
        ray.get(self.learner_actor.attach_shared.remote(self.target, self.env))

    def mode(self, name: str) -> str:
        return "warn" if self.config is None else self.config.mode(name)

    def version_of(self, index: int, engine_version: int) -> int:
        return int(engine_version) + self._offset[index]

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        from miles_lp.sync.verdict import SyncAbortedError

        try:
            report, self.sentinel, self.expected_version, self._offset = ray.get(
                getattr(self.learner_actor, method).remote(self.sentinel, *args))
        except ray.exceptions.RayTaskError as exc:
            dead = [i for i, a in enumerate(self.engine_actors) if not actor_alive(a)]
            if not dead:
                own = _sync_error(exc)
                if own is not None:  # a check failed in raise mode, or an engine refused: the sync's own error
                    raise own from exc
                raise
            err = SyncAbortedError(f"engine {dead[0]}'s actor died during the weight sync ({exc.cause})", "transfer")
            err.engine_index = dead[0]
            raise err from exc
        return report

    def initial_sync(self, learner: Any = None) -> Any:
        return self._call("run_fleet_sync", True)

    def sync(self, learner: Any = None, *, full_compare: bool | None = None, only: Any = None,
             done: dict[int, Any] | None = None) -> Any:
        return self._call("run_fleet_sync", False, None if only is None else list(only), tuple(done or ()))

    def resync(self, index: int, engine: Any, learner: Any = None) -> Any:
        """Engine ``index`` restarted (``engine``: its proxy): the update group rebuilt with its actor and the
        others', then its full resync (its bytes sent to it alone)."""
        self.engine_actors[index] = engine.actor
        self.connect_all()
        return self._call("run_fleet_resync", index)

    def sends(self) -> tuple[int, int]:
        """Buckets sent over the update group so far: (broadcasts reaching every engine, sends to one engine)."""
        import ray

        return tuple(ray.get(self.learner_actor.shared_sends.remote()))

    def close(self) -> None:
        import ray

        try:
            ray.get(self.learner_actor.leave_group.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - an actor already gone: nothing left to close
            pass


def actor_alive(actor: Any) -> bool:
    import ray

    try:
        ray.get(actor.pid.remote(), timeout=10)
        return True
    except Exception:
        return False
