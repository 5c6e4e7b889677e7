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
NCCL between GPUs (each rank's ``torch.cuda.set_device`` first; not run here: no two-GPU machine was lent).

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
