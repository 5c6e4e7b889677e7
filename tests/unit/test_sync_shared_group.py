"""One update group for a fleet (``SharedUpdateGroup``): the learner's rank and every engine's rank in one gloo
group, each bucket broadcast once and reaching every engine, a receipt per engine, every check run on each engine
(per-engine verdicts). An engine process that dies inside a sync breaks the group; the group is rebuilt with the
survivor and a fresh engine, the fresh one resynced in full (its bytes sent to it alone), the survivor given the
update its aborted sync lacked: every engine ends byte-equal to the learner, no update applied twice.

The learner rank runs in the test's process; each engine rank is a spawned process driven through a queue."""

from __future__ import annotations

import datetime
import os
import socket
import threading

import pytest
import torch
import torch.multiprocessing as mp

SLOW = pytest.mark.slow  # spawned engine processes (~15 s each on 2 cores)

TIMEOUT = datetime.timedelta(seconds=60)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_process(cmd: mp.Queue, out: mp.Queue, rebind: bool) -> None:
    """An engine rank: ``("join", port, rank, size)`` joins a group and serves it in a thread (after the previous
    group's loop ended); ``("die_at", k)`` exits the process at the k-th bucket applied from now;
    ``("state",)`` reports the engine's digests, version and finished updates; ``("stop",)``."""
    from miles_lp.rollout.engine import tensor_digest
    from miles_lp.sync.group import SharedReceiver, SyncGroup, group_store
    from tests.unit.test_sync_weight_sync import StubEngine

    torch.set_num_threads(1)

    class Engine(StubEngine):
        die_at: int | None = None
        applied = 0
        finished = 0

        def update_weights(self, named):
            self.applied += 1
            if self.die_at is not None and self.applied >= self.die_at:
                os._exit(3)  # the process dies mid-update, as a killed engine does
            super().update_weights(named)

        def finish_weight_update(self):
            super().finish_weight_update()
            self.finished += 1

    engine = Engine(rebind=rebind)
    serving: threading.Thread | None = None
    errors: list[str] = []
    while True:
        msg = cmd.get()
        if msg[0] == "join":
            _, port, rank, size = msg
            if serving is not None:
                serving.join(timeout=60)
                assert not serving.is_alive(), "the previous group's loop did not end"
            group = SyncGroup.create("gloo", group_store("127.0.0.1", port, rank, size, TIMEOUT), rank, size,
                                     timeout=TIMEOUT)

            def loop(group=group, rank=rank):
                try:
                    SharedReceiver(group, rank).serve(engine)
                except Exception as exc:  # noqa: BLE001 - reported with the state
                    errors.append(f"{type(exc).__name__}")

            serving = threading.Thread(target=loop, daemon=True)
            serving.start()
        elif msg[0] == "die_at":
            engine.die_at, engine.applied = msg[1], 0
        elif msg[0] == "state":
            out.put(({n: tensor_digest(t) for n, t in engine.t.items()}, engine.weight_version, engine.finished,
                     list(errors)))
        elif msg[0] == "stop":
            return


class Rank:
    def __init__(self, ctx, rebind=False):
        self.cmd, self.out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_engine_process, args=(self.cmd, self.out, rebind), daemon=True)
        self.proc.start()

    def state(self):
        self.cmd.put(("state",))
        return self.out.get(timeout=60)

    def stop(self):
        if self.proc.is_alive():
            self.cmd.put(("stop",))
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


def _group(ranks):
    """A new update group: rank 0 here, engine i (``ranks[i]``) rank i + 1."""
    from miles_lp.sync.group import SharedUpdateGroup, SyncGroup, group_store

    port, size = _port(), len(ranks) + 1
    for i, r in enumerate(ranks):
        r.cmd.put(("join", port, i + 1, size))
    group = SyncGroup.create("gloo", group_store("127.0.0.1", port, 0, size, TIMEOUT), 0, size, timeout=TIMEOUT)
    return SharedUpdateGroup(group, len(ranks))


def _attach(shared, syncs=None, mode="raise"):
    """A WeightSync per engine over the group (new ones, or the given ones with their engine and transport anew)."""
    from miles_lp.sync import SyncConfig, WeightSync
    from miles_lp.sync.group import FanoutRemoteEngine, FanoutTransport
    from tests.unit.test_sync_weight_sync import _plan

    out = []
    for i in range(shared.engines):
        engine, transport = FanoutRemoteEngine(shared, i), FanoutTransport(shared, i)
        if syncs is None:
            out.append(WeightSync(engine, _plan(), "sglang", SyncConfig(bucket_mb=0.004).with_modes(all=mode),
                                  transport=transport, env={}, log=lambda line: None))
        else:
            syncs[i].engine, syncs[i].transport = engine, transport
    return out or syncs


def _learner_digests(learner):
    from miles_lp.rollout.engine import tensor_digest
    from miles_lp.sync.items import engine_items

    return {it.name: tensor_digest(it.tensor) for it in engine_items(learner.export_weights(), "sglang")}


def _step(learner, k):
    """An optimizer step's worth of change to the learner's masters."""
    for t in learner.w.values():
        t.add_(0.01 * (k + 1))


@SLOW
def test_one_broadcast_per_bucket_reaches_every_engine_and_each_is_checked():
    from miles_lp.sync.fleet import FleetSync
    from tests.unit.test_sync_weight_sync import Learner

    ctx = mp.get_context("spawn")
    ranks = [Rank(ctx), Rank(ctx, rebind=True)]  # engine 1 re-binds its served tensor: C4 must fail there only
    try:
        shared = _group(ranks)
        fleet = FleetSync(_attach(shared, mode="warn"), log=lambda line: None, fanout=shared)
        learner = Learner(seed=2)
        first = fleet.initial_sync(learner)
        buckets = first.engines[0].buckets
        assert buckets > 1 and first.sends == (buckets, 0)
        _step(learner, 0)
        second = fleet.sync(learner)
        m = second.metrics
        assert second.sends == (buckets, 0) and shared.broadcasts == 2 * buckets  # once per bucket, not per engine
        for c in ("layer_audit", "completeness", "grid", "self_check", "version"):
            assert m[f"sync/check/{c}/engine0"] == 1.0 and m[f"sync/check/{c}/engine1"] == 1.0, c
        assert m["sync/check/storage/engine0"] == 1.0 and m["sync/check/storage/engine1"] == 0.0
        assert m["sync/check/storage"] == 0.0 and "engine 1" in second.verdict("storage").reason
        want = _learner_digests(learner)
        for r in ranks:
            digests, version, finished, errors = r.state()
            assert {n: digests[n] for n in want} == want and version == finished == 2 and not errors
        shared.close()
    finally:
        for r in ranks:
            r.stop()


@SLOW
def test_an_engine_dying_inside_a_sync_rebuilds_the_group_and_resyncs():
    from miles_lp.sync import SyncAbortedError
    from miles_lp.sync.fleet import FleetSync
    from tests.unit.test_sync_weight_sync import Learner

    ctx = mp.get_context("spawn")
    ranks = [Rank(ctx), Rank(ctx)]
    fresh = None
    try:
        shared = _group(ranks)
        syncs = _attach(shared)
        fleet = FleetSync(syncs, log=lambda line: None, fanout=shared)
        learner = Learner(seed=2)
        buckets = fleet.initial_sync(learner).engines[0].buckets
        _step(learner, 0)
        ranks[1].cmd.put(("die_at", 2))  # engine 1's process exits at the second bucket of the next sync
        with pytest.raises(SyncAbortedError):
            fleet.sync(learner)
        ranks[1].proc.join(timeout=60)
        assert ranks[1].proc.exitcode == 3 and shared.broken
        assert fleet.expected_version == 1  # the aborted sync counted for no engine

        # the group rebuilt with the survivor and a fresh engine; the old one dropped first (its loop ends)
        shared.close()
        fresh = Rank(ctx)
        ranks = [ranks[0], fresh]
        shared = _group(ranks)
        _attach(shared, syncs)
        fleet.fanout = shared
        resynced = fleet.resync(1, syncs[1].engine, learner)
        assert resynced.ok and resynced.full_compare
        assert (shared.broadcasts, shared.p2p) == (0, buckets)  # the resync's bytes to the fresh engine alone
        # the retry: engine 0 lacks this update (its sync was cut off); engine 1 holds it from its resync
        report = fleet.sync(learner, only=[], done={1: resynced})
        assert report.ok and fleet.expected_version == 2
        assert report.sends == (0, buckets)
        _step(learner, 1)
        report = fleet.sync(learner)
        assert report.ok and fleet.expected_version == 3 and report.sends == (buckets, 0)
        want = _learner_digests(learner)
        survivor, new = ranks[0].state(), fresh.state()
        for digests, *_ in (survivor, new):
            assert {n: digests[n] for n in want} == want
        # updates finished: the survivor's initial + retried + last (the cut-off one never finished), the fresh
        # engine's resync + last; each maps to the fleet's count
        assert survivor[2] == 3 and new[2] == 2
        assert fleet.version_of(0, survivor[1]) == fleet.version_of(1, new[1]) == 3
        assert len(survivor[3]) == 1  # its loop on the broken group ended with the group's error, then it rejoined
        shared.close()
    finally:
        for r in ranks:
            r.stop()


class _FakeGroup:
    """A SyncGroup stand-in recording what rank 0 sends; the engine ranks' replies come from ``reply``."""

    def __init__(self, size):
        self.size, self.rank, self.pg, self.backend, self.device = size, 0, object(), "gloo", torch.device("cpu")
        self.sent = []

    def broadcast_object_list(self, objs, src):
        self.sent.append(("object", objs[0][0]))

    def broadcast(self, tensor, src):
        self.sent.append(("bytes", "all", tensor.numel()))

    def send(self, tensor, dst, tag=0):
        self.sent.append(("bytes", dst, tensor.numel()))

    def close(self):
        self.pg = None


@pytest.mark.parametrize("engines", [1, 3])
def test_the_fanout_sends_each_bucket_once_for_every_engine_of_the_sync(monkeypatch, engines):
    """Without processes (CI): engines' threads hand in the same bucket; it goes out once (a broadcast), each thread
    gets its own receipt; an engine that leaves is not waited for; one engine alone gets point-to-point bytes;
    different buckets are refused."""
    from miles_lp.sync import group as sg
    from miles_lp.sync.buckets import make_buckets
    from miles_lp.sync.group import SharedUpdateGroup
    from miles_lp.sync.items import engine_items, group_items
    from miles_lp.sync.remote import Receipt
    from tests.unit.test_sync_weight_sync import Learner

    monkeypatch.setattr(sg, "_recv_object", lambda group, src, tag: Receipt(src, (), {}, None))
    buckets = make_buckets(group_items(engine_items(Learner().export_weights(), "sglang")), 4096)
    shared = SharedUpdateGroup(_FakeGroup(engines + 1), engines)
    got = {}

    def run(i, leave_after=None):
        for k, b in enumerate(buckets):
            if leave_after is not None and k == leave_after:
                break
            got.setdefault(i, []).append(shared.send(i, b))
        shared.leave(i)

    shared.begin(range(engines))
    threads = [threading.Thread(target=run, args=(i, 1 if i == 2 else None)) for i in range(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(not t.is_alive() for t in threads)
    sends = [s for s in shared.group.sent if s[0] == "bytes"]
    assert len(sends) == len(buckets) > 1 and all(s[1] == "all" for s in sends)  # one broadcast per bucket
    assert shared.broadcasts == len(buckets) and shared.p2p == 0
    for i in range(engines):  # each engine its own receipts (engine 2 left after its first bucket)
        assert [r.index for r in got[i]] == [i + 1] * (1 if i == 2 else len(buckets))

    shared.group.sent.clear()
    shared.begin([0])  # one engine alone (a restarted engine's resync): its bytes to its rank only
    assert shared.send(0, buckets[0]).index == 1
    shared.leave(0)
    assert [s for s in shared.group.sent if s[0] == "bytes"] == [("bytes", "all" if engines == 1 else 1,
                                                                   buckets[0].nbytes)]
    if engines > 1:  # two engines handing in different buckets: refused, for both
        shared.begin([0, 1])
        errors = []

        def bad(i, b):
            try:
                shared.send(i, b)
            except ValueError as exc:
                errors.append(str(exc))
            finally:
                shared.leave(i)
        ts = [threading.Thread(target=bad, args=(0, buckets[0])), threading.Thread(target=bad, args=(1, buckets[1]))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
        assert len(errors) == 2 and "different buckets" in errors[0]
