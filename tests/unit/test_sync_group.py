"""The sync's own process group (``SyncGroup``): two processes that each already hold a torch.distributed world of
their own (as a Megatron learner's actor does) form a separate two-rank group and run a full ``WeightSync`` over
it (every check in raise mode, byte-identical); their own worlds are untouched afterwards."""

import os
import queue
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, own_port, sync_port, out):
    import datetime

    import torch.distributed as dist

    from miles_lp.sync.group import GroupRemoteEngine, SyncGroup, group_store
    from miles_lp.sync.transport import BroadcastReceiver, BroadcastTransport
    from tests.unit.test_sync_weight_sync import Learner, StubEngine, _plan

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(own_port))
    dist.init_process_group("gloo", rank=0, world_size=1)  # this process's own world (Megatron's, in a learner)
    try:
        timeout = datetime.timedelta(seconds=60)
        sg = SyncGroup.create("gloo", group_store("127.0.0.1", sync_port, rank, 2, timeout), rank, 2, timeout=timeout)
        if rank == 1:
            engine = StubEngine()
            applied = BroadcastReceiver(group=sg, src=0).serve(engine, rank=1)
            digests = engine.weight_digests()
        else:
            from miles_lp.rollout.engine import tensor_digest
            from miles_lp.sync import SyncConfig, WeightSync
            from miles_lp.sync.items import engine_items

            engine = GroupRemoteEngine(sg, engine_rank=1, learner_rank=0)
            ws = WeightSync(engine, _plan(), "sglang", SyncConfig(bucket_mb=0.004).with_modes(all="raise"),
                            transport=BroadcastTransport(group=sg, src=0, receipts=True, reply_from=1), env={},
                            log=lambda s: None)
            learner = Learner(seed=2)
            first, second = ws.initial_sync(learner), ws.sync(learner)
            engine.close()
            applied = (first.ok, second.ok, first.buckets, second.weight_version,
                       [v.name for v in second.verdicts if v.status != "ok"])
            digests = {it.name: tensor_digest(it.tensor) for it in engine_items(learner.export_weights(), "sglang")}
        x = torch.ones(1)
        dist.all_reduce(x)  # the process's own world still works, and is still its own
        out.put((rank, applied, digests, dist.get_world_size(), float(x)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes (~15 s on 2 cores)
def test_a_weight_sync_over_its_own_group_beside_each_process_world():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    sync_port = _port()
    procs = [ctx.Process(target=_worker, args=(r, _port(), sync_port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got, t0 = {}, time.monotonic()
    while len(got) < 2 and time.monotonic() - t0 < 120:
        try:
            m = out.get(timeout=2)
            got[m[0]] = m[1:]
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank exited with {dead}"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (first_ok, second_ok, buckets, version, not_ok), learner_digests, lw, lx = got[0]
    applied, engine_digests, ew, ex = got[1]
    assert first_ok and second_ok and buckets > 1 and version == 2
    assert not_ok == ["sentinel"]  # skipped: no RL step fed it (every other check ran and passed)
    assert applied == 2 * buckets and engine_digests == learner_digests  # the learner's bytes, every tensor
    assert (lw, ew, lx, ex) == (1, 1, 1.0, 1.0)  # each process's own world: size 1, untouched
