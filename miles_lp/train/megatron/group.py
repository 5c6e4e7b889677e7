"""The Megatron learner on several ranks (tensor / expert parallel), driven from one process as one ``Learner``.

    learner = MegatronGroup("/tmp/tiny", plan, TrainConfig(backend="megatron", megatron=MegatronSection(tp=2)))
    lp, ent = learner.logprobs(seqs)           # rank 0's result (every rank computed the same)
    learner.train_step(samples, loss_fn)       # the same samples on every rank; Megatron's gradient reductions
    dict(learner.export_weights())             # the shards all-gathered: the whole model under HF names
    learner.close()                            # workers stopped, process group destroyed

The caller's process is rank 0: it joins a ``torch.distributed`` group of ``world`` ranks (gloo on CPU, NCCL
when the config's device is CUDA and there are ``world`` GPUs: rank r on ``cuda:r``) and holds a
``MegatronLearner`` over its shards; ranks 1..world-1 are spawned processes (``torch.multiprocessing`` spawn
context) that build the same learner over theirs. Every ``Learner`` call is sent first to the workers (a pipe per
worker, cloudpickled: loss functions may be closures), then run on rank 0; all ranks run it together (the
collectives inside pair up), and each worker replies ``ok`` (or its result where the call returns per-rank data:
``state_dict``) or its traceback. A worker that fails exits, so rank 0's next collective fails at once instead of
waiting; the error names the rank and carries its traceback. ``world`` is ``parallel.ParallelSizes.world``
(``lcm(tp, ep * etp)``).

So the runner uses it unchanged: ``plan``, ``step``, ``logprobs``, ``train_step``, ``export_weights``,
``executed_quantized``, ``state_dict`` / ``load_state_dict`` (the state holds every rank's shards:
``{"kind": "megatron", "group": {...}, "ranks": [state of rank 0, ...]}``) and ``close``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_lp.errors import ConfigError, MilesLPError
from miles_lp.train.config import TrainConfig

KIND = "megatron"
#: calls whose per-rank results come back from the workers (the others reply ``ok``)
_RETURNS = frozenset({"state_dict"})


class GroupError(MilesLPError, RuntimeError):
    """A rank of the Megatron group failed (the message names the rank and carries its traceback)."""


def _dumps(obj: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(obj)


def _loads(data: bytes) -> Any:
    import pickle

    return pickle.loads(data)  # our own workers' messages over a private pipe (never data from a file or network)


def free_loopback_port() -> int:
    """A free TCP port on 127.0.0.1 for a single-host process group's store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(config: TrainConfig) -> str:
    return "nccl" if str(config.device).startswith("cuda") else "gloo"


def _rank_config(config: TrainConfig, rank: int) -> TrainConfig:
    if _backend(config) == "nccl":
        return dataclasses.replace(config, device=f"cuda:{rank}")
    return config


def _init(rank: int, world: int, port: int, backend: str, timeout_s: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker(rank: int, world: int, port: int, source: str, plan_bytes: bytes, config: TrainConfig, engine: dict,
            conn, timeout_s: float, threads: int) -> None:
    """One rank > 0: build the learner, then run the commands rank 0 sends until ``close``. (The plan comes
    cloudpickled: its layout holds lambdas, which the spawn pickler refuses.)"""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    learner = None
    try:
        plan = _loads(plan_bytes)
        conn.send_bytes(_dumps(("hello", None)))  # imported and unpickled: rank 0 may now wait in the rendezvous
        _init(rank, world, port, _backend(config), timeout_s)
        from miles_lp.train.megatron.learner import MegatronLearner

        learner = MegatronLearner(source, plan, _rank_config(config, rank), **engine)
        conn.send_bytes(_dumps(("ready", None)))
        while True:
            method, args = _loads(conn.recv_bytes())
            if method == "close":
                break
            result = getattr(learner, method)(*args)
            if isinstance(result, Iterator):
                result = list(result)
            conn.send_bytes(_dumps(("ok", result if method in _RETURNS else None)))
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this rank exits
        try:
            conn.send_bytes(_dumps(("error", traceback.format_exc())))
        finally:
            os._exit(1)
    if learner is not None:
        learner.close()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    conn.send_bytes(_dumps(("closed", None)))


class MegatronGroup:
    """``Learner`` over a tensor / expert parallel Megatron model on ``world`` ranks (module docstring)."""

    def __init__(self, hf_folder: str | Path, plan=None, config: TrainConfig | None = None, *, engine_tp: int = 1,
                 engine_etp: int | None = None, timeout_s: float = 600.0, worker_threads: int = 1):
        """``hf_folder``: the HF checkpoint folder every rank loads; ``plan``: a compiled ``PrecisionPlan`` or
        ``None``; ``config.megatron`` gives tp / ep / etp; ``engine_tp`` / ``engine_etp``: the engine's sizes for the
        NVFP4 activation-partition rule (``parallel.check_activation_partition``); ``timeout_s``: the process
        group's collective timeout; ``worker_threads``: torch threads per spawned rank."""
        import transformers

        from miles_lp.train.megatron import megatron_available
        from miles_lp.train.megatron.parallel import check_activation_partition, resolve_parallel

        reason = megatron_available()
        if reason is not None:
            from miles_lp.errors import BackendUnavailable

            raise BackendUnavailable(f"train.backend: megatron: {reason}")
        if not isinstance(hf_folder, str | Path) or not Path(hf_folder).is_dir():
            raise ConfigError(f"MegatronGroup loads the model on every rank from an HF checkpoint folder; got "
                              f"{hf_folder!r}")
        config = config or TrainConfig(backend="megatron")
        hf_config = transformers.AutoConfig.from_pretrained(str(hf_folder))
        self.parallel = sizes = resolve_parallel(config.megatron, hf_config)
        check_activation_partition(plan, tp=sizes.tp, etp=sizes.etp, engine_tp=engine_tp, engine_etp=engine_etp)
        self.world = sizes.world
        if self.world == 1:
            raise ConfigError("MegatronGroup is for tp * ep > 1; at tp = ep = 1 use MegatronLearner (one process)")
        backend = _backend(config)
        if backend == "nccl" and torch.cuda.device_count() < self.world:
            raise ConfigError(f"train.megatron tp={sizes.tp} ep={sizes.ep} etp={sizes.etp} needs {self.world} GPUs "
                              f"(one rank each); this machine has {torch.cuda.device_count()}")
        import torch.distributed as dist

        if dist.is_initialized():
            raise ConfigError("MegatronGroup makes this process rank 0 of a new torch.distributed group, but one is "
                              "already initialised here (close the other Megatron learner first)")
        self.plan = plan
        self.config = config
        self._broken: str | None = None
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        port = free_loopback_port()
        ctx = torch.multiprocessing.get_context("spawn")
        engine = {"engine_tp": engine_tp, "engine_etp": engine_etp}
        for rank in range(1, self.world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, self.world, port, str(hf_folder), _dumps(plan), config, engine,
                                                  theirs, timeout_s, worker_threads), daemon=True)
            p.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(p)
        self.learner = None
        try:
            self._hello(timeout_s)
            _init(0, self.world, port, backend, timeout_s)
            from miles_lp.train.megatron.learner import MegatronLearner

            self.learner = MegatronLearner(hf_folder, plan, _rank_config(config, 0), engine_tp=engine_tp,
                                           engine_etp=engine_etp)
            self._replies("start")
        except BaseException as exc:
            self._fail(exc, "start")

    # ---- plumbing -------------------------------------------------------------------------------------
    def _hello(self, timeout_s: float) -> None:
        """Wait for every worker to have started (imports done, plan unpickled) before the rendezvous, so a worker
        that dies on the way is reported at once instead of after the rendezvous timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        for rank, (conn, p) in enumerate(zip(self._conns, self._procs, strict=True), start=1):
            while not conn.poll(0.5):
                if not p.is_alive():
                    raise GroupError(f"Megatron rank {rank} exited (code {p.exitcode}) before it started")
                if time.monotonic() > deadline:
                    raise GroupError(f"Megatron rank {rank} did not start within {timeout_s:.0f} s")
            status, value = _loads(conn.recv_bytes())
            if status == "error":
                raise GroupError(f"Megatron rank {rank} failed while starting:\n{value}")

    def _replies(self, what: str) -> list[Any]:
        out = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                status, value = _loads(conn.recv_bytes())
            except EOFError:
                raise GroupError(f"Megatron rank {rank} died during {what} without a report") from None
            if status == "error":
                raise GroupError(f"Megatron rank {rank} failed during {what}:\n{value}")
            out.append(value)
        return out

    def _fail(self, exc: BaseException, what: str):
        """Rank 0 failed (often because a worker did): collect a worker's report if there is one, stop all."""
        report = None
        for rank, conn in enumerate(self._conns, start=1):
            try:
                if conn.poll(5.0):
                    status, value = _loads(conn.recv_bytes())
                    if status == "error":
                        report = f"Megatron rank {rank} failed during {what}:\n{value}"
                        break
            except (EOFError, OSError):
                continue
        self._broken = report or f"rank 0 failed during {what}: {exc!r}"
        self._stop()
        if isinstance(exc, GroupError):
            raise exc
        if report is not None:
            raise GroupError(report) from exc
        raise exc

    def _stop(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(10)
        if self.learner is not None:
            try:
                self.learner.close()
            except Exception:  # noqa: BLE001 - tearing down after a failure: the state may be half-built
                pass
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _call(self, method: str, *args, per_rank: Sequence[tuple] | None = None) -> tuple[Any, list[Any]]:
        if self._broken is not None:
            raise GroupError(f"the Megatron group is stopped ({self._broken.splitlines()[0]}); build a new one")
        for rank, conn in enumerate(self._conns, start=1):
            conn.send_bytes(_dumps((method, per_rank[rank] if per_rank is not None else args)))
        try:
            result = getattr(self.learner, method)(*(per_rank[0] if per_rank is not None else args))
            if isinstance(result, Iterator):
                result = list(result)
            return result, self._replies(method)
        except BaseException as exc:
            self._fail(exc, method)

    # ---- Learner --------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.learner.step

    @property
    def device(self) -> torch.device:
        return self.learner.device

    @property
    def model(self) -> torch.nn.Module:
        """Rank 0's shards (read-only use; training goes through ``train_step``)."""
        return self.learner.model

    @property
    def routing_stats(self) -> dict[str, float]:
        """Routing-replay agreement of the last ``logprobs`` / ``train_step`` (rank 0's counter, which sees every
        position: under sequence parallelism the flags are all-gathered)."""
        return self.learner.routing_stats

    def logprobs(self, batch):
        return self._call("logprobs", batch)[0]

    def train_step(self, samples, loss_fn=None) -> dict[str, Any]:
        return self._call("train_step", samples, loss_fn)[0]

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        yield from self._call("export_weights")[0]

    def gathered_masters(self) -> dict[str, torch.Tensor]:
        return self._call("gathered_masters")[0]

    def executed_quantized(self) -> dict[str, str]:
        return self._call("executed_quantized")[0]

    def state_dict(self) -> dict[str, Any]:
        mine, theirs = self._call("state_dict")
        p = self.parallel
        return {"kind": KIND, "plan_hash": mine["plan_hash"], "step": mine["step"],
                "group": {"world": self.world, "tp": p.tp, "ep": p.ep, "etp": p.etp}, "ranks": [mine, *theirs]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        p = self.parallel
        want = {"world": self.world, "tp": p.tp, "ep": p.ep, "etp": p.etp}
        if state.get("kind") != KIND or state.get("group") != want or len(state.get("ranks", ())) != self.world:
            raise ConfigError(f"learner state of kind {state.get('kind')!r} group {state.get('group')} cannot be "
                              f"loaded into a Megatron group {want}; resume with the train.megatron sizes the run "
                              "saved with")
        self._call("load_state_dict", per_rank=[(s,) for s in state["ranks"]])

    def close(self) -> None:
        """Stop the workers and destroy the process group (idempotent)."""
        if self._broken is not None:
            return
        self._broken = "closed"
        for conn in self._conns:
            try:
                conn.send_bytes(_dumps(("close", ())))
            except (BrokenPipeError, OSError):
                pass
        if self.learner is not None:
            self.learner.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
                p.join(5)


def make_megatron_learner(hf_folder: str | Path, plan, config: TrainConfig, **kwargs):
    """``MegatronLearner`` at tp = ep = 1 (one process), ``MegatronGroup`` otherwise (what the runner calls)."""
    import transformers

    from miles_lp.train.megatron.parallel import resolve_parallel

    sizes = resolve_parallel(config.megatron, transformers.AutoConfig.from_pretrained(str(hf_folder)))
    if sizes.world == 1:
        from miles_lp.train.megatron.learner import MegatronLearner

        return MegatronLearner(hf_folder, plan, config, **kwargs)
    return MegatronGroup(hf_folder, plan, config, **kwargs)
