"""The Megatron learner on several ranks (tensor / pipeline / data / expert parallel), driven from one process as one
``Learner``.

    learner = MegatronGroup("/tmp/tiny", plan, TrainConfig(backend="megatron", megatron=MegatronSection(tp=2)))
    lp, ent = learner.logprobs(seqs)           # the whole batch (each data-parallel replica computed its share)
    learner.train_step(samples, loss_fn)       # every rank gets the samples; each replica trains its share
    dict(learner.export_weights())             # shards and stages gathered: the whole model under HF names
    learner.run_on_ranks(fn, *args)            # fn(rank's MegatronLearner, *args) on every rank: per-rank results
    learner.close()                            # ranks stopped, process group destroyed

The caller's process is rank 0: it joins a ``torch.distributed`` group of ``world`` ranks (gloo on CPU, NCCL
when the config's device is CUDA) and holds a ``MegatronLearner`` over its shards; ranks 1..world-1 run where the
``placement`` puts them (``ranks.ProcessPlacement``: spawned processes on this host, rank r on ``cuda:r``;
``ray_ranks.RayPlacement``: one Ray actor per rank, one GPU each, in a placement group that may span nodes) and
build the same learner over theirs. Every ``Learner`` call is sent first to the other ranks (cloudpickled: loss
functions may be closures), then run on rank 0; all ranks run it together (the collectives inside pair up), and
each rank replies ``ok`` (or its result where the call returns per-rank data: ``state_dict``, ``run_on_ranks``)
or its traceback. A rank that fails ends its process, so rank 0's next collective fails at once instead of
waiting; the error names the rank and carries its traceback. ``world`` is ``parallel.ParallelSizes.world``
(``tp x pp x dp``).

So the runner uses it unchanged: ``plan``, ``step``, ``logprobs``, ``train_step``, ``export_weights``,
``executed_quantized``, ``state_dict`` / ``load_state_dict`` (the state holds every rank's shards:
``{"kind": "megatron", "group": {...}, "ranks": [state of rank 0, ...]}``) and ``close``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from miles_lp.config import configured_runtime
from miles_lp.errors import ConfigError, MilesLPError
from miles_lp.train.config import TrainConfig
from miles_lp.train.megatron.ranks import (
    ProcessPlacement,
    RankSpec,
    backend_for,
    dumps,
    free_port,
    init_process_group,
    loads,
)

KIND = "megatron"


class GroupError(MilesLPError, RuntimeError):
    """A rank of the Megatron group failed (the message names the rank and carries its traceback)."""


def free_loopback_port() -> int:
    """A free TCP port on 127.0.0.1 for a single-host process group's store."""
    return free_port("127.0.0.1")


class MegatronGroup:
    """``Learner`` over a tensor / expert parallel Megatron model on ``world`` ranks (module docstring)."""

    def __init__(self, hf_folder: str | Path, plan=None, config: TrainConfig | None = None, *, engine_tp: int = 1,
                 engine_etp: int | None = None, timeout_s: float = 600.0, worker_threads: int = 1,
                 placement=None):
        """``hf_folder``: the HF checkpoint folder every rank loads; ``plan``: a compiled ``PrecisionPlan`` or
        ``None``; ``config.megatron`` gives tp / pp / dp / ep / etp; ``engine_tp`` / ``engine_etp``: the engine's
        sizes for the NVFP4 activation-partition rule (``parallel.check_activation_partition``); ``timeout_s``: the
        process group's collective timeout; ``worker_threads``: torch threads per rank > 0; ``placement``: where
        ranks 1..world-1 run (``ranks.ProcessPlacement()``, the default, or ``ray_ranks.RayPlacement``)."""
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
            raise ConfigError("MegatronGroup is for tp * ep > 1 or pp * dp > 1 (a world of several ranks); at "
                              "tp = pp = dp = ep = 1 use MegatronLearner (one process)")
        import torch.distributed as dist

        if dist.is_initialized():
            raise ConfigError("MegatronGroup makes this process rank 0 of a new torch.distributed group, but one is "
                              "already initialised here (close the other Megatron learner first)")
        self.placement = placement = placement or ProcessPlacement()
        placement.check(self.world, config)
        self.plan = plan
        self.config = config
        self._broken: str | None = None
        self._ranks: list[Any] = []
        self.learner = None
        host = placement.host()
        spec = RankSpec(world=self.world, host=host, port=free_port(host), source=str(hf_folder),
                        plan_bytes=dumps(plan), config=config,
                        engine={"engine_tp": engine_tp, "engine_etp": engine_etp}, timeout_s=timeout_s,
                        threads=worker_threads, runtime=configured_runtime())
        try:
            self._ranks = placement.launch(spec)
            self._post_all(("hello", None))
            self._replies("start", timeout_s)  # every rank imported and unpickled before the rendezvous
            self._post_all(("start", None))
            init_process_group(0, self.world, host, spec.port, backend_for(config), timeout_s)
            from miles_lp.train.megatron.learner import MegatronLearner

            device = placement.device(0, config)
            import dataclasses

            self.learner = MegatronLearner(hf_folder, plan, config if device is None else
                                           dataclasses.replace(config, device=device),
                                           engine_tp=engine_tp, engine_etp=engine_etp)
            self._replies("start")
        except BaseException as exc:
            self._fail(exc, "start")

    # ---- plumbing -------------------------------------------------------------------------------------
    def _post_all(self, message: tuple, per_rank: Sequence[tuple] | None = None) -> None:
        for rank, h in enumerate(self._ranks, start=1):
            h.post(dumps(message if per_rank is None else (message[0], (message[1][0], per_rank[rank]))))

    def _replies(self, what: str, timeout_s: float | None = None) -> list[Any]:
        """Every rank's reply in rank order; a rank that is gone or reports an error raises ``GroupError``.
        ``timeout_s``: also give up on a rank that stays silent that long (the start, before any collective)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        out = []
        for rank, h in enumerate(self._ranks, start=1):
            while not h.wait(0.5):
                if not h.alive():
                    raise GroupError(f"Megatron rank {rank} {h.gone()} during {what} without a report")
                if deadline is not None and time.monotonic() > deadline:
                    raise GroupError(f"Megatron rank {rank} did not answer within {timeout_s:.0f} s during {what}")
            try:
                status, value = loads(h.take())
            except (EOFError, OSError):
                raise GroupError(f"Megatron rank {rank} died during {what} without a report") from None
            if status == "error":
                when = "while starting" if what == "start" else f"during {what}"
                raise GroupError(f"Megatron rank {rank} failed {when}:\n{value}")
            out.append(value)
        return out

    def _fail(self, exc: BaseException, what: str):
        """Rank 0 failed (often because another rank did): collect a rank's report if there is one, stop all."""
        report = None
        for rank, h in enumerate(self._ranks, start=1):
            try:
                if h.wait(5.0):
                    status, value = loads(h.take())
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
        for h in self._ranks:
            h.stop(0.0)
        self.placement.release()
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
        try:
            self._post_all(("call", (method, args)), per_rank=None if per_rank is None else per_rank)
            if method == "run":
                fn, fargs = (per_rank[0] if per_rank is not None else args)
                result = fn(self.learner, *fargs)
            else:
                result = getattr(self.learner, method)(*(per_rank[0] if per_rank is not None else args))
            if isinstance(result, Iterator):
                result = list(result)
            return result, self._replies(method)
        except BaseException as exc:
            self._fail(exc, method)

    def run_on_ranks(self, fn: Callable[..., Any], *args) -> list[Any]:
        """``fn(learner, *args)`` on every rank at once (rank 0 here, the others where they run), each with its
        own ``MegatronLearner``; the results in rank order (generators are listed). ``fn`` is cloudpickled: a
        module-level function or a closure over picklable values. What a weight sync uses to read each rank's
        ``export_owned()`` where it lives; every rank must reach the same collectives."""
        mine, theirs = self._call("run", fn, args)
        return [mine, *theirs]

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
        """Rank 0's step figures. A loss function that keeps figures (``stats``, ``recorded``: ``rl.batch.GRPOLoss``)
        ran on every rank over that rank's micro-batches: each data-parallel replica's share, on the last pipeline
        stage, duplicated over tensor-parallel ranks. Its figures here are the sum of what it added on the ranks
        that compute the loss (tp rank 0 of the last stage of each replica) and every sample they recorded, as one
        rank computing every micro-batch would have them."""
        if not hasattr(loss_fn, "stats"):
            return self._call("train_step", samples, loss_fn)[0]
        before = dict(loss_fn.stats)
        results = self.run_on_ranks(_train_and_report, samples, loss_fn)
        added: dict[str, float] = {}
        for r, (_, computes, stats, recorded) in enumerate(results):
            if not computes:
                continue
            for k, v in stats.items():
                added[k] = added.get(k, 0.0) + (float(v) - float(before.get(k, 0.0)))
            if r > 0 and recorded:
                loss_fn.recorded.update(recorded)
        for k, v in added.items():
            loss_fn.stats[k] = float(before.get(k, 0.0)) + v
        return results[0][0]

    def export_weights(self) -> Iterator[tuple[str, Any]]:
        yield from self._call("export_weights")[0]

    def gathered_masters(self) -> dict[str, torch.Tensor]:
        return self._call("gathered_masters")[0]

    def executed_quantized(self) -> dict[str, str]:
        return self._call("executed_quantized")[0]

    def state_dict(self) -> dict[str, Any]:
        mine, theirs = self._call("state_dict")
        return {"kind": KIND, "plan_hash": mine["plan_hash"], "step": mine["step"],
                "group": self._group_key(), "ranks": [mine, *theirs]}

    def _group_key(self) -> dict[str, int]:
        p = self.parallel
        return {"world": self.world, "tp": p.tp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "etp": p.etp}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        want = self._group_key()
        if state.get("kind") != KIND or state.get("group") != want or len(state.get("ranks", ())) != self.world:
            raise ConfigError(f"learner state of kind {state.get('kind')!r} group {state.get('group')} cannot be "
                              f"loaded into a Megatron group {want}; resume with the train.megatron sizes the run "
                              "saved with")
        self._call("load_state_dict", per_rank=[(s,) for s in state["ranks"]])

    def close(self) -> None:
        """Stop the other ranks and destroy the process group (idempotent)."""
        if self._broken is not None:
            return
        self._broken = "closed"
        for h in self._ranks:
            try:
                h.post(dumps(("close", None)))
            except (BrokenPipeError, OSError):
                pass
        if self.learner is not None:
            self.learner.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        for h in self._ranks:
            h.stop(30.0)
        self.placement.release()


def _train_and_report(learner, samples, loss_fn):
    """On each rank: the step, whether this rank computes the loss (tp rank 0 of the last pipeline stage), and the
    loss function's figures after it (``MegatronGroup.train_step`` sums what each such rank added)."""
    from megatron.core import parallel_state as ps

    stats = learner.train_step(samples, loss_fn)
    computes = ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage(ignore_virtual=True)
    recorded = dict(getattr(loss_fn, "recorded", None) or {})
    return stats, computes, dict(loss_fn.stats), recorded


def make_megatron_learner(hf_folder: str | Path, plan, config: TrainConfig, **kwargs):
    """``MegatronLearner`` at a world of one (one process), ``MegatronGroup`` otherwise (what the runner calls;
    ``placement=`` reaches the group)."""
    import transformers

    from miles_lp.train.megatron.parallel import resolve_parallel

    sizes = resolve_parallel(config.megatron, transformers.AutoConfig.from_pretrained(str(hf_folder)))
    if sizes.world == 1:
        from miles_lp.train.megatron.learner import MegatronLearner

        kwargs.pop("placement", None)
        return MegatronLearner(hf_folder, plan, config, **kwargs)
    return MegatronGroup(hf_folder, plan, config, **kwargs)
