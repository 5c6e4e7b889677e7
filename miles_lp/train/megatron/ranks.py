"""Where the ranks 1..world-1 of a Megatron group run, and the one protocol rank 0 drives them with.

    placement = ProcessPlacement()                      # spawned processes on this host (the default)
    placement = miles_lp.train.megatron.ray_ranks.RayPlacement(nodes=2, gpus_per_node=8)   # one Ray actor per rank
    handles = placement.launch(world, RankSpec(...))    # rank r -> handles[r - 1]

Every rank > 0 holds a ``RankServer``: one method, ``handle(message) -> reply``, both cloudpickled bytes. The
messages, in order: ``hello`` (imports done, plan unpickled: rank 0 may now wait in the rendezvous), ``start``
(join the ``torch.distributed`` group, build the ``MegatronLearner``), then ``(method, args)`` calls, then
``close``. A reply is ``(status, value)``: ``ok`` / ``ready`` / ``hello`` / ``closed``, or ``error`` with the
traceback. After an error the server's process must end (``RankServer.failed``), so that rank 0's next collective
fails at once instead of waiting for the timeout.

A placement only moves those bytes: ``ProcessPlacement`` over a pipe to a ``torch.multiprocessing`` spawn child,
``ray_ranks.RayPlacement`` through actor method calls. What a rank computes is the same either way.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import traceback
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from miles_lp.config import RuntimeConfig, use_runtime
from miles_lp.ports import free_port  # noqa: F401  (the group's store port; group.py imports it from here)
from miles_lp.train.config import TrainConfig

#: calls whose per-rank results come back from the workers (the others reply ``ok``)
RETURNS = frozenset({"state_dict", "run"})


def dumps(obj: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(obj)


def loads(data: bytes) -> Any:
    import pickle

    return pickle.loads(data)  # our own ranks' messages over a private channel (never data from a file or network)


def backend_for(config: TrainConfig) -> str:
    return "nccl" if str(config.device).startswith("cuda") else "gloo"


def init_process_group(rank: int, world: int, host: str, port: int, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its learner (the plan cloudpickled: its layout holds lambdas)."""

    world: int
    host: str  # rank 0's address, where the process group's store listens
    port: int
    source: str  # the HF checkpoint folder every rank loads
    plan_bytes: bytes
    config: TrainConfig
    engine: dict
    timeout_s: float
    threads: int
    # rank 0's configured run-time switches (``miles_lp.config.configured_runtime``), made this rank's at its start
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)


class RankServer:
    """Rank ``rank`` of the group: builds the learner on ``start`` and runs the calls rank 0 sends."""

    def __init__(self, rank: int, spec: RankSpec, device: str | None = None):
        use_runtime(spec.runtime)  # this rank's switches are rank 0's (the run's recipe), before anything loads
        self.rank, self.spec, self.device = rank, spec, device
        self.learner = None
        self.plan = None
        self.failed = False
        self.closed = False

    def handle(self, message: bytes) -> bytes:
        try:
            kind, payload = loads(message)
            return dumps(self._handle(kind, payload))
        except BaseException:  # noqa: BLE001 - reported to rank 0; the process then ends (``failed``)
            self.failed = True
            return dumps(("error", traceback.format_exc()))

    def _handle(self, kind: str, payload: Any) -> tuple[str, Any]:
        if kind == "hello":
            import warnings

            warnings.filterwarnings("ignore")
            torch.set_num_threads(self.spec.threads)
            self.plan = loads(self.spec.plan_bytes)
            return ("hello", None)
        if kind == "start":
            s = self.spec
            config = s.config if self.device is None else dataclasses.replace(s.config, device=self.device)
            init_process_group(self.rank, s.world, s.host, s.port, backend_for(config), s.timeout_s)
            from miles_lp.train.megatron.learner import MegatronLearner

            self.learner = MegatronLearner(s.source, self.plan, config, **s.engine)
            return ("ready", None)
        if kind == "close":
            self.close()
            return ("closed", None)
        method, args = payload
        if method == "run":  # a function of the learner, run on every rank (``MegatronGroup.run_on_ranks``)
            fn, fargs = args
            result = fn(self.learner, *fargs)
        else:
            result = getattr(self.learner, method)(*args)
        if isinstance(result, Iterator):
            result = list(result)
        return ("ok", result if method in RETURNS else None)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.learner is not None:
            self.learner.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class RankHandle(Protocol):
    """Rank 0's end of one rank > 0."""

    def post(self, message: bytes) -> None: ...
    def wait(self, timeout_s: float) -> bool: ...  # a reply is ready
    def take(self) -> bytes: ...  # the reply (EOFError: the rank is gone)
    def alive(self) -> bool: ...
    def gone(self) -> str: ...  # how it ended, for messages
    def stop(self, grace_s: float) -> None: ...  # end it (after close, or to clean up after a failure)


class Placement(Protocol):
    def host(self) -> str: ...  # where the other ranks reach rank 0
    def device(self, rank: int, config: TrainConfig) -> str | None: ...  # rank r's device (None: the config's)
    def check(self, world: int, config: TrainConfig) -> None: ...
    def launch(self, spec: RankSpec) -> list[RankHandle]: ...  # ranks 1..world-1
    def release(self) -> None: ...  # after the ranks stopped: what the placement reserved


# ---------------------------------------------------------------------------------------------------------
# Spawned processes on this host
# ---------------------------------------------------------------------------------------------------------


def _serve(rank: int, spec: RankSpec, device: str | None, conn) -> None:
    """A spawned rank: answer rank 0's messages until ``close``; end the process after an error."""
    server = RankServer(rank, spec, device)
    while not server.closed:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)  # rank 0 is gone
        conn.send_bytes(server.handle(message))
        if server.failed:
            os._exit(1)


class _ProcessRank:
    def __init__(self, ctx, rank: int, spec: RankSpec, device: str | None):
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(rank, spec, device, theirs), daemon=True)
        self.proc.start()
        theirs.close()

    def post(self, message: bytes) -> None:
        self.conn.send_bytes(message)

    def wait(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def take(self) -> bytes:
        return self.conn.recv_bytes()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def gone(self) -> str:
        return f"exited (code {self.proc.exitcode})"

    def stop(self, grace_s: float) -> None:
        self.proc.join(grace_s)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


class ProcessPlacement:
    """Ranks 1..world-1 as ``torch.multiprocessing`` spawn children of this process, on 127.0.0.1; under NCCL
    rank r on ``cuda:r`` (one host with ``world`` GPUs)."""

    def host(self) -> str:
        return "127.0.0.1"

    def device(self, rank: int, config: TrainConfig) -> str | None:
        return f"cuda:{rank}" if backend_for(config) == "nccl" else None

    def check(self, world: int, config: TrainConfig) -> None:
        from miles_lp.errors import ConfigError

        if backend_for(config) == "nccl" and torch.cuda.device_count() < world:
            raise ConfigError(f"the Megatron group needs {world} GPUs (one rank each) on this host; it has "
                              f"{torch.cuda.device_count()} (place the ranks with Ray across nodes instead)")

    def launch(self, spec: RankSpec) -> list[RankHandle]:
        ctx = torch.multiprocessing.get_context("spawn")
        return [_ProcessRank(ctx, r, spec, self.device(r, spec.config)) for r in range(1, spec.world)]

    def release(self) -> None:
        """Nothing reserved (the processes are joined by their handles)."""
