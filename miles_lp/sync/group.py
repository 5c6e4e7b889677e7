"""``SyncGroup``: the weight sync's own process group, apart from any ``torch.distributed`` world.

The learner's process may already be a rank of a world of its own (Megatron's: ``init_process_group`` with its
TP / PP / EP / DP groups). The sync must not replace it, nor join the engines into it. As SGLang's
``init_weights_update_group`` and vLLM's stateless process group do, the sync's group is built from a store of
its own and never registered as torch's default group:

    store = group_store(host, port, rank, size, timeout)          # rank 0 hosts it, on host only
    group = SyncGroup.create("gloo", store, rank, size)            # ProcessGroupGloo / ProcessGroupNCCL
    group.broadcast(tensor, src=0)
    group.broadcast_object_list(box, src=0)

``BroadcastTransport`` / ``BroadcastReceiver`` (``sync/transport.py``) and ``GroupRemoteEngine`` take it as their
``group``: the same messages, buckets and receipts as over a ``torch.distributed`` group. gloo on CPU (the tests),
NCCL between GPUs (each rank's ``torch.cuda.set_device`` first; not run here: no two-GPU machine was used).

For a fleet of N engines, ONE group of 1 + N ranks (slime's single update group; SGLang's
``init_weights_update_group`` with world 1 + N): ``SharedUpdateGroup`` (the learner's rank 0), ``SharedReceiver``
(engine i's rank i + 1), ``FanoutRemoteEngine`` / ``FanoutTransport`` (engine i's handle and transport for its
``WeightSync``); each bucket is broadcast once and reaches every engine, each engine replies with its own receipt.

Objects travel as a length then the bytes of their pickle, as ``torch.distributed.broadcast_object_list`` sends
them: between the ranks of one job only; never open such a group to a process you do not run.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch

from miles_lp.sync.remote import RemoteEngine, raise_remote, unpack
from miles_lp.sync.remote import pack as pack_value


class SyncGroup:
    """One process group (``rank`` of ``size``) outside torch's world: broadcasts of tensors and objects."""

    def __init__(self, pg: Any, rank: int, size: int, device: torch.device | str = "cpu", backend: str = "gloo"):
        self.pg, self.rank, self.size, self.backend = pg, int(rank), int(size), backend
        self.device = torch.device(device)

    @classmethod
    def create(cls, backend: str, store: Any, rank: int, size: int, device: torch.device | str = "cpu",
               timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> SyncGroup:
        import torch.distributed as dist

        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        elif backend == "nccl":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("sync.transport: nccl needs a CUDA build of torch (ProcessGroupNCCL)")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            raise ValueError(f"SyncGroup backend must be gloo or nccl, got {backend!r}")
        return cls(pg, rank, size, device, backend)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = int(src), 0
        self.pg.broadcast([tensor], opts).wait()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Point to point (a reply, a receipt, one engine's bucket), beside the broadcasts."""
        self.pg.send([tensor], int(dst), int(tag)).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.pg.recv([tensor], int(src), int(tag)).wait()

    def broadcast_object_list(self, objs: list[Any], src: int) -> None:
        """``objs`` of rank ``src`` into every rank's ``objs`` (in place, same length), as torch's object collective."""
        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        if self.rank == src:
            raw = pickle.dumps(list(objs), protocol=pickle.HIGHEST_PROTOCOL)
            n = torch.tensor([len(raw)], dtype=torch.int64, device=dev)
            self.broadcast(n, src)
            self.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev), src)
            return
        n = torch.zeros(1, dtype=torch.int64, device=dev)
        self.broadcast(n, src)
        buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
        self.broadcast(buf, src)
        got = pickle.loads(buf.cpu().numpy().tobytes())  # noqa: S301 - a rank of this job (module docstring)
        objs[:] = got

    def close(self) -> None:
        self.pg = None


def group_store(host: str, port: int, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """The group's rendezvous store; rank 0 hosts it listening on ``host`` only (torch's ``TCPStore`` server alone
    listens on every interface; a socket bound to ``(host, port)`` is handed to it instead)."""
    import socket

    import torch.distributed as dist

    if rank != 0:
        return dist.TCPStore(host, port, size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, size, True, timeout, master_listen_fd=sock.detach())


class GroupRemoteEngine(RemoteEngine):
    """``RemoteEngine`` over a ``SyncGroup`` (its calls and replies as the group's object broadcasts)."""

    def _request(self, msg: tuple) -> Any:
        from miles_lp.rollout.engine import EngineError

        if self._closed:
            raise EngineError("the remote engine was closed")
        self.group.broadcast_object_list([pack_value(msg)], src=self.learner_rank)
        box: list[Any] = [None]
        self.group.broadcast_object_list(box, src=self.engine_rank)
        status, *rest = box[0]
        if status == "error":
            raise_remote(rest[0], rest[1], self.engine_rank)
        return unpack(rest[0])

    def close(self) -> None:
        if not self._closed:
            self.group.broadcast_object_list([("end",)], src=self.learner_rank)
            self._closed = True


# ---- one update group for a fleet: the learner's rank and every engine's ---------------------------------------
#
# slime's single update group / SGLang's ``init_weights_update_group(world_size=1 + N)``: the learner is rank 0,
# engine i is rank i + 1. Messages, in the same order on every rank:
#
#   learner -> all (object broadcast)  ("to", rank, call)                    one engine's call; that rank answers
#                                                                            by a point-to-point send (TAG_REPLY)
#   learner -> all (object broadcast)  ("bucket", index, slots, nbytes, targets, how)
#       how "broadcast": the bytes by one broadcast from rank 0; every engine rank takes part, the targets apply
#       them, the others drop them; how "p2p": the bytes sent to the one target (a restarted engine's full
#       resync); each target replies with a Receipt (TAG_RECEIPT)
#   learner -> all (object broadcast)  ("end",)                              every engine rank stops serving
#
# A bucket is sent once for every engine of the sync: each engine's ``WeightSync`` runs in a thread of its own
# (``FleetSync(fanout=...)``) and hands its bucket to ``SharedUpdateGroup.send``, which waits until every engine
# of the sync has handed in the same bucket (same index, size and slots), sends it once and returns each its own
# receipt. Every check still runs per engine over that engine's calls.

TAG_REPLY, TAG_RECEIPT, TAG_BYTES = 1, 2, 3
_GROUP_END = ("end",)


def _send_object(group: SyncGroup, obj: Any, dst: int, tag: int) -> None:
    dev = group.device if group.backend == "nccl" else torch.device("cpu")
    raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    group.send(torch.tensor([len(raw)], dtype=torch.int64, device=dev), dst, tag)
    group.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev), dst, tag)


def _recv_object(group: SyncGroup, src: int, tag: int) -> Any:
    dev = group.device if group.backend == "nccl" else torch.device("cpu")
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    group.recv(n, src, tag)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    group.recv(buf, src, tag)
    return pickle.loads(buf.cpu().numpy().tobytes())  # noqa: S301 - a rank of this job (module docstring)



class SharedUpdateGroup:
    """The learner's side (rank 0) of one update group holding every engine's rank (engine i: rank i + 1).

    ``call(i, msg)``: engine i's call, answered by it alone. ``begin(indexes)`` names the engines of a fleet sync;
    ``send(i, bucket)`` (engine i's ``WeightSync``, through ``FanoutTransport``) waits for the other engines of the
    sync to hand in the same bucket, then the bucket goes out once; ``leave(i)`` when engine i's sync ends (done,
    refused or failed), so the others do not wait for it. One exchange at a time on the group (a lock): NCCL
    allows one thread per communicator, and the order of collectives is then the same on every rank.

    A failed exchange (a rank died) marks the group broken: every later call or bucket fails at once (an
    ``EngineError``) instead of waiting for a dead peer; the owner builds a new group with every engine
    (``close`` this one first: dropping the process group ends the other ranks' waits)."""

    def __init__(self, group: SyncGroup, engines: int, device: torch.device | str = "cpu"):
        import threading

        if group.size != engines + 1:
            raise ValueError(f"an update group for {engines} engines has {engines + 1} ranks, got {group.size}")
        self.group, self.engines, self.device = group, int(engines), torch.device(device)
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.members: set[int] = set()
        self.pending: dict[int, Any] = {}
        self.results: dict[int, Any] = {}
        self.broken: str | None = None
        self.broadcasts = 0  # buckets sent by one broadcast to every engine rank
        self.p2p = 0  # buckets sent to one engine rank

    @staticmethod
    def rank_of(index: int) -> int:
        return int(index) + 1

    def _fail(self, what: str, exc: BaseException) -> Exception:
        from miles_lp.rollout.engine import EngineError

        self.broken = self.broken or f"{what}: {type(exc).__name__}: {exc}"
        return EngineError(f"the weight-update group failed ({self.broken}); a rank died or left: rebuild the "
                           "group with every engine and resync")

    def _check(self) -> None:
        from miles_lp.rollout.engine import EngineError

        if self.broken is not None:
            raise EngineError(f"the weight-update group is broken ({self.broken}); rebuild it with every engine "
                              "and resync")
        if self.group.pg is None:
            raise EngineError("the weight-update group was closed")

    def call(self, index: int, msg: tuple) -> Any:
        """Engine ``index``'s reply to ``msg`` (a ``miles_lp.sync.remote`` call, packed)."""
        rank = self.rank_of(index)
        with self.lock:
            self._check()
            try:
                self.group.broadcast_object_list([("to", rank, msg)], src=0)
                return _recv_object(self.group, rank, TAG_REPLY)
            except Exception as exc:
                raise self._fail(f"a call to engine {index}", exc) from exc

    def begin(self, indexes: list[int] | range) -> None:
        with self.cond:
            self.members = set(int(i) for i in indexes)
            self.pending.clear()
            self.results.clear()

    def leave(self, index: int) -> None:
        with self.cond:
            self.members.discard(int(index))
            self.pending.pop(int(index), None)
            self._fire_if_ready()
            self.cond.notify_all()

    def send(self, index: int, bucket: Any) -> Any:
        """Engine ``index``'s bucket: sent once with the other engines' same bucket; returns this engine's
        ``Receipt`` (or raises what the exchange raised)."""
        index = int(index)
        with self.cond:
            if index not in self.members:
                raise RuntimeError(f"engine {index} sends a bucket outside a fleet sync (SharedUpdateGroup.begin)")
            self.pending[index] = bucket
            self._fire_if_ready()
            self.cond.notify_all()
            self.cond.wait_for(lambda: index in self.results)
            got = self.results.pop(index)
        if isinstance(got, BaseException):
            raise got
        return got

    def _fire_if_ready(self) -> None:
        """Under ``cond``: when every member has handed in its bucket, send it once and file each receipt."""
        if not self.pending or not self.members <= set(self.pending):
            return
        order = sorted(self.pending)
        buckets = [self.pending.pop(i) for i in order]
        first = buckets[0]
        for i, b in zip(order[1:], buckets[1:], strict=True):
            if b.index != first.index or b.nbytes != first.nbytes or (b.slots is not first.slots
                                                                      and b.slots != first.slots):
                err = ValueError(f"engines {order[0]} and {i} send different buckets ({first.index} of "
                                 f"{first.nbytes} bytes, {b.index} of {b.nbytes} bytes): one broadcast cannot "
                                 "serve engines whose updates differ (different targets or specs)")
                self.results.update({k: err for k in order})
                return
        try:
            self.results.update(zip(order, self._transfer(first, order), strict=True))
        except Exception as exc:  # noqa: BLE001 - every engine of the sync learns it through its own send
            err = self._fail(f"bucket {first.index + 1}", exc)
            self.results.update({k: err for k in order})

    def _transfer(self, bucket: Any, order: list[int]) -> list[Any]:
        from miles_lp.sync.transport import flatten

        targets = tuple(self.rank_of(i) for i in order)
        how = "p2p" if len(targets) == 1 and self.engines > 1 else "broadcast"
        with self.lock:
            self._check()
            self.group.broadcast_object_list([("bucket", bucket.index, bucket.slots, bucket.nbytes, targets, how)],
                                             src=0)
            flat = flatten(bucket, self.device)
            if how == "broadcast":
                self.group.broadcast(flat, 0)
                self.broadcasts += 1
            else:
                self.group.send(flat, targets[0], TAG_BYTES)
                self.p2p += 1
            return [_recv_object(self.group, r, TAG_RECEIPT) for r in targets]

    def close(self, graceful: bool = True) -> None:
        """End every engine rank's serving loop (``graceful`` and the group still works: an end message), then drop
        the process group: a rank still waiting on it fails at once and leaves (gloo; under NCCL a rank waiting in
        a collective waits for the group's timeout). Not graceful when the group is rebuilt after a rank died: a
        collective with a dead rank is not tried."""
        if graceful and self.group.pg is not None and self.broken is None:
            try:
                with self.lock:
                    self.group.broadcast_object_list([_GROUP_END], src=0)
            except Exception:  # noqa: BLE001 - a dead rank: the drop below ends the others' waits
                pass
        self.group.close()


class FanoutRemoteEngine(RemoteEngine):
    """``RemoteEngine`` for engine ``index`` of a ``SharedUpdateGroup``: its calls answered by that rank alone."""

    def __init__(self, shared: SharedUpdateGroup, index: int):
        self.shared, self.index = shared, int(index)
        super().__init__(shared.group, engine_rank=shared.rank_of(index), learner_rank=0)

    def _request(self, msg: tuple) -> Any:
        from miles_lp.rollout.engine import EngineError

        if self._closed:
            raise EngineError("the remote engine was closed")
        status, *rest = self.shared.call(self.index, pack_value(msg))
        if status == "error":
            raise_remote(rest[0], rest[1], self.engine_rank)
        return unpack(rest[0])

    def close(self) -> None:
        self._closed = True  # the group's end (SharedUpdateGroup.close) stops every engine rank at once


class FanoutTransport:
    """Engine ``index``'s transport in a ``SharedUpdateGroup``: its buckets go out with the other engines'."""

    def __init__(self, shared: SharedUpdateGroup, index: int, name: str = "gloo"):
        self.shared, self.index, self.name = shared, int(index), name

    def send(self, bucket: Any) -> Any:
        return self.shared.send(self.index, bucket)

    def close(self) -> None:
        """Nothing of its own to release: the process group belongs to the ``SharedUpdateGroup``, closed once for all
        engines by its owner (one engine's transport closing must not end the others' group)."""


class SharedReceiver:
    """An engine rank's half of a ``SharedUpdateGroup``: answers the calls addressed to it, applies the buckets
    it is a target of (``engine.update_weights`` on arrival, a ``Receipt`` back), takes part in the broadcasts of
    the others' buckets and drops their bytes. A group that fails under it (the learner dropped it, a rank died)
    ends the loop with the error, after dropping an update it had open (``abort_weight_update``: the previous
    weights where nothing was written, else the engine refuses generation until a full update)."""

    def __init__(self, group: SyncGroup, rank: int, device: torch.device | str = "cpu"):
        from miles_lp.sync.transport import Staging

        self.group, self.rank = group, int(rank)
        self.staging = Staging(device)

    def serve(self, engine: Any) -> int:
        from miles_lp.sync.remote import answer

        applied, open_update = 0, False
        try:
            while True:
                box: list[Any] = [None]
                self.group.broadcast_object_list(box, src=0)
                msg = box[0]
                if msg == _GROUP_END:
                    return applied
                if msg[0] == "to":
                    if msg[1] != self.rank:
                        continue
                    reply = answer(engine, msg[2])
                    name = msg[2][1] if msg[2][0] == "call" else None
                    if reply[0] == "ok" and name == "begin_weight_update":
                        open_update = True
                    elif name in ("finish_weight_update", "abort_weight_update"):
                        open_update = False
                    _send_object(self.group, reply, 0, TAG_REPLY)
                    continue
                _, index, slots, nbytes, targets, how = msg
                if self.rank not in targets:
                    if how == "broadcast":  # a collective: every rank takes part
                        self.group.broadcast(self.staging.take(nbytes, fill=False), 0)
                    continue
                buf = self.staging.take(nbytes)
                if how == "broadcast":
                    self.group.broadcast(buf, 0)
                else:
                    self.group.recv(buf, 0, TAG_BYTES)
                receipt = apply_bucket(engine, index, slots, buf)
                applied += receipt.error is None
                _send_object(self.group, receipt, 0, TAG_RECEIPT)
        except BaseException:
            if open_update and hasattr(engine, "abort_weight_update"):
                try:
                    engine.abort_weight_update()
                except Exception:  # noqa: BLE001 - written already: the engine refuses generation itself
                    pass
            raise


def apply_bucket(engine: Any, index: int, slots: Any, buf: torch.Tensor) -> Any:
    """``engine.update_weights`` on a received bucket; its ``Receipt`` (names, 0xFF count per scale, error)."""
    from miles_lp.sync.buckets import ff_counts, iter_received
    from miles_lp.sync.remote import Receipt

    received = list(iter_received(slots, buf))
    error = None
    try:
        engine.update_weights(received)
    except Exception as exc:  # noqa: BLE001 - the learner's sync reports it (SyncAbortedError)
        error = f"{type(exc).__name__}: {exc}"
    scales = [(n, t) for (n, t), s in zip(received, slots, strict=True) if s.is_scale]
    ff = dict(zip([n for n, _ in scales], ff_counts([t for _, t in scales]).tolist(), strict=True))
    return Receipt(index, tuple(n for n, _ in received), ff, error)
