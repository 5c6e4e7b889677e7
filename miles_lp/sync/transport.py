"""Transports: move a bucket's bytes from the learner into the receiver's 0xFF-filled staging buffer.

One interface (``Transport.send(bucket) -> [(name, tensor)]``: the received tensors, views of the staging
buffer in the receiver's memory), four implementations:

* ``InProcessTransport``: the payload is copied straight into the staging buffer on the engine's device
  (one copy; across devices it is the host<->device copy).
* ``RayTransport``: the bucket is flattened on the host, ``ray.put`` into the object store, and the
  receiver ``ray.get``s it (zero-copy read-only view) into its staging buffer. CPU, any process of the
  Ray cluster; ``ray_receive`` is the receiver's half for an engine running as a Ray actor.
* ``CudaIpcTransport``: the bucket is flattened on the learner's GPU and shared through a CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor``, SGLang's same-host tensor path); the receiving process
  rebuilds the tensor from the handle and copies it into its staging buffer (``cuda_ipc_receive``).
* ``BroadcastTransport``: a broadcast of the layout (an object broadcast) then of the flat buffer from the
  learner's rank; ``BroadcastReceiver`` is the engine ranks' half (NCCL on GPU, the
  ``update_weights_from_distributed`` path; gloo on CPU, which the tests use). The group is the sync's own
  (``sync/group.py`` ``SyncGroup``, apart from a Megatron learner's world) or a ``torch.distributed`` group.

A staging buffer is reused bucket to bucket and refilled with 0xFF before every bucket (``Staging``), so a
byte a transport did not write is a NaN in whatever dtype it belongs to (C5). Engines copy a bucket before
``update_weights`` returns (the Engine protocol's update semantics), so reuse is safe.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import torch

from miles_lp.errors import BackendUnavailable, ConfigError
from miles_lp.multitensor import kernels as _kernels
from miles_lp.multitensor.strided import batched_copy
from miles_lp.sync.buckets import NAN_FILL, Bucket, Slot, iter_received

Received = list[tuple[str, torch.Tensor]]


class Staging:
    """The receiver's reusable uint8 staging buffer on ``device``, refilled with 0xFF for every bucket."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None

    def take(self, nbytes: int, fill: bool = True) -> torch.Tensor:
        """``nbytes`` of staging, refilled with 0xFF (``fill=False`` only for a writer that writes every byte,
        payload or 0xFF: ``fill_slots``)."""
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        buf = self._buf[:nbytes]
        if fill:
            buf.fill_(NAN_FILL)
        return buf

    def release(self) -> None:
        self._buf = None


@runtime_checkable
class Transport(Protocol):
    name: str

    def send(self, bucket: Bucket) -> Received:
        """Deliver ``bucket`` into the receiver's staging buffer; the received tensors (views of it)."""
        ...

    def close(self) -> None: ...


_FILL: dict[str, torch.Tensor] = {}


def _fill(n: int, device: torch.device) -> torch.Tensor:
    """``n`` bytes of the 0xFF fill on ``device`` (slices of one cached buffer)."""
    key = str(device)
    f = _FILL.get(key)
    if f is None or f.numel() < n:
        f = torch.full((max(n, 1 << 16),), NAN_FILL, dtype=torch.uint8, device=device)
        _FILL[key] = f
    return f[:n]


def received_views(buf: torch.Tensor, slots: tuple[Slot, ...], cache: dict | None = None) -> Received:
    """``iter_received(slots, buf)`` as a list; with ``cache`` (a transport's), the views made for the same
    buffer and the same ``slots`` object last time (a repeated layout: ``WeightSync`` reuses its buckets'
    slots), not ~1,200 new views per sync. A fresh list each call (the views are shared)."""
    if cache is None:
        return list(iter_received(slots, buf))
    key = (buf.data_ptr(), buf.numel(), buf.device, id(slots))
    hit = cache.get(key)
    if hit is None or hit[0] is not slots:
        if len(cache) >= 16 or any(k[0] != key[0] for k in cache):  # another staging buffer: drop the old views
            cache.clear()
        hit = cache[key] = (slots, list(iter_received(slots, buf)))
    return list(hit[1])


def fill_slots(buf: torch.Tensor, bucket: Bucket, views: dict | None = None) -> Received:
    """Copy the bucket's payload into its slots of the uint8 buffer ``buf``; the slots as typed views of it.

    The bucket is written with ONE ``torch.cat(..., out=buf)`` of the payload's bytes in slot order, the
    alignment gaps and any slot without a payload filled from a 0xFF buffer (as the staging fill: an unwritten
    byte stays a NaN code): a few batched kernels for the whole bucket instead of one copy per tensor. A payload
    on another device than ``buf`` goes through ``batched_copy`` (strided copies per stacked projection)."""
    received = received_views(buf, bucket.slots, views)
    dev = buf.device
    payload = bucket.payload
    if buf.is_contiguous() and _kernels.enabled(dev, "copy") and all(t.device == dev for t in payload.values()):
        # one or two Triton launches reading every payload tensor in place (miles_lp.multitensor.kernels.copy_into):
        # per slot only its address and size on the host; the gaps and any slot without a payload from the
        # 0xFF buffer, as below
        srcs, offs, sizes = [], [], []
        # the C2 fingerprint of the payload in the same pass: only for a complete payload (every slot's tensor:
        # then the value is the export's, as ``digest.group_fingerprints`` computes it), mult 0 for the gaps
        where = bucket.digest[0] if bucket.digest is not None and len(payload) == len(bucket.slots) else None
        dslots: list[int] = []
        dmults: list[int] = []
        off = 0
        for s in bucket.slots:
            t = payload.get(s.name)
            if s.offset > off:
                offs.append(off)
                sizes.append(s.offset - off)
                srcs.append(None)
                if where is not None:
                    dslots.append(0)
                    dmults.append(0)
            if t is None:
                offs.append(s.offset)
                sizes.append(s.nbytes)
                srcs.append(None)
            else:
                if t.nbytes != s.nbytes:
                    raise ValueError(f"bucket payload '{s.name}' has {t.nbytes} bytes, its slot {s.nbytes}")
                offs.append(s.offset)
                sizes.append(s.nbytes)
                srcs.append(t)
                if where is not None:
                    slot, mult = where[s.name]
                    dslots.append(slot)
                    dmults.append(mult)
            off = s.offset + s.nbytes
        if off < buf.numel():
            offs.append(off)
            sizes.append(buf.numel() - off)
            srcs.append(None)
            if where is not None:
                dslots.append(0)
                dmults.append(0)
        gaps = [n for t, n in zip(srcs, sizes, strict=True) if t is None]
        if gaps:
            ff = _fill(max(gaps), dev)
            srcs = [ff if t is None else t for t in srcs]
        digest = None
        if where is not None:
            from miles_lp.multitensor.digest import row_weights

            digest = (dslots, dmults, bucket.digest[1], row_weights(dev))
        with torch.no_grad():
            _kernels.copy_into(buf, srcs, offs, sizes, digest=digest)
        bucket.digested = digest is not None
        return received
    if all(t.device == dev for t in payload.values()):
        parts: list[torch.Tensor] = []
        off = 0
        aligned8 = not (buf.numel() & 7 or buf.data_ptr() & 7)
        for s in bucket.slots:
            if s.offset > off:
                parts.append(_fill(s.offset - off, dev))  # the fill buffer is 8-byte aligned; gaps may not be
                aligned8 = aligned8 and not ((s.offset - off) & 7)
            t = payload.get(s.name)
            if t is None:
                r = _fill(s.nbytes, dev)
            else:  # host work per slot kept to a few torch calls (each ~1 us, per tensor, per sync)
                r = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
                aligned8 = aligned8 and not (r.data_ptr() & 7)
            aligned8 = aligned8 and not (s.nbytes & 7)
            parts.append(r)
            off = s.offset + s.nbytes
        if off < buf.numel():
            parts.append(_fill(buf.numel() - off, dev))
            aligned8 = aligned8 and not ((buf.numel() - off) & 7)
        if parts:
            with torch.no_grad():
                if aligned8:  # the same bytes as 8-byte words: an eighth of the elements to copy
                    parts, out = [p.view(torch.int64) for p in parts], buf.view(torch.int64)
                else:
                    out = buf
                torch.cat(parts, out=out) if len(parts) > 1 else out.copy_(parts[0])
        return received
    pairs = [(v, payload[n].detach()) for n, v in received if n in payload]
    batched_copy(pairs)
    return received


def flatten(bucket: Bucket, device: torch.device | str = "cpu") -> torch.Tensor:
    """The bucket as one uint8 buffer on ``device`` (0xFF where no payload byte was written)."""
    buf = torch.full((max(bucket.nbytes, 1),), NAN_FILL, dtype=torch.uint8, device=device)[:bucket.nbytes]
    fill_slots(buf, bucket)
    return buf


@dataclasses.dataclass
class InProcessTransport:
    device: torch.device | str = "cpu"
    name: str = "inprocess"

    def __post_init__(self):
        self.staging = Staging(self.device)
        self._views: dict = {}  # received views per staging buffer and slots (a repeated layout)

    def send(self, bucket: Bucket) -> Received:
        buf = self.staging.take(bucket.nbytes, fill=False)
        if not all(t.device == buf.device for t in bucket.payload.values()):
            buf.fill_(NAN_FILL)  # fill_slots writes every byte (payload or 0xFF) only from buf's own device
        return fill_slots(buf, bucket, self._views)

    def close(self) -> None:
        self.staging.release()
        self._views.clear()


def ray_receive(ref: Any, slots: tuple[Slot, ...], staging: Staging) -> Received:
    """The receiver's half of ``RayTransport``: fetch a flattened bucket into ``staging``."""
    import warnings

    import ray

    arr = ray.get(ref)  # a read-only zero-copy view of the object store
    with warnings.catch_warnings():  # torch warns on wrapping a read-only buffer; it is only read, at once
        warnings.simplefilter("ignore", UserWarning)
        src = torch.from_numpy(arr)
    buf = staging.take(src.numel())
    buf.copy_(src)
    return list(iter_received(slots, buf))


@dataclasses.dataclass
class RayTransport:
    """Through Ray's object store (CPU). ``ray.init`` must have run (the launcher does it)."""

    device: torch.device | str = "cpu"
    name: str = "ray"

    def __post_init__(self):
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - ray is a dependency here
            raise BackendUnavailable("sync.transport: ray is not importable; pip install ray") from exc
        if not ray.is_initialized():
            raise BackendUnavailable("sync.transport 'ray': ray is not initialized in this process; call "
                                     "ray.init() first (the RL launcher does) or use transport: inprocess")
        self.staging = Staging(self.device)

    def send(self, bucket: Bucket) -> Received:
        import ray

        ref = ray.put(flatten(bucket, "cpu").numpy())
        return ray_receive(ref, bucket.slots, self.staging)

    def close(self) -> None:
        self.staging.release()


def cuda_ipc_share(flat: torch.Tensor) -> tuple[Any, tuple]:
    """A picklable handle for a CUDA tensor: torch's own reduction (what ``torch.multiprocessing`` pickles a
    CUDA tensor as; SGLang's same-host tensor path). Keep ``flat`` alive until the receiver has copied it."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(flat)


def cuda_ipc_receive(handle: tuple[Any, tuple], slots: tuple[Slot, ...], staging: Staging) -> Received:
    """The receiving process's half of ``CudaIpcTransport``: open the handle, copy into ``staging``."""
    rebuild, args = handle
    shared = rebuild(*args)
    buf = staging.take(shared.numel())
    buf.copy_(shared)
    torch.cuda.current_stream(buf.device).synchronize()  # the sender may reuse its buffer after this
    return list(iter_received(slots, buf))


@dataclasses.dataclass
class CudaIpcTransport:
    """Same-host GPU processes: the bucket is flattened on the learner's GPU and shared by IPC handle
    (``handles`` receives ``(bucket index, slots, handle)`` for a receiver in another process, which calls
    ``cuda_ipc_receive``). CUDA does not open a process's own IPC handle, so when the engine is in this process
    ``send`` copies the flattened bucket into the staging buffer directly."""

    device: torch.device | str = "cuda"
    name: str = "cuda_ipc"
    handles: Any = None  # a callable taking (index, slots, handle): the channel to a receiving process

    def __post_init__(self):
        if not torch.cuda.is_available():
            raise BackendUnavailable("sync.transport 'cuda_ipc' needs CUDA; use inprocess or ray on CPU")
        self.staging = Staging(self.device)

    def send(self, bucket: Bucket) -> Received:
        src_device = next((t.device for t in bucket.payload.values() if t.is_cuda), torch.device(self.device))
        flat = flatten(bucket, src_device)
        if self.handles is not None:
            self._inflight = flat  # alive until the next bucket (torch's IPC ref counting also guards it)
            self.handles(bucket.index, bucket.slots, cuda_ipc_share(flat))
            return []
        buf = self.staging.take(bucket.nbytes)
        buf.copy_(flat)
        return list(iter_received(bucket.slots, buf))

    def close(self) -> None:
        self.staging.release()
        self._inflight = None


_END = ("end",)


def _broadcast(tensor: torch.Tensor, src: int, group: Any) -> None:
    """Over a ``torch.distributed`` group (None: the default one), or the sync's own ``SyncGroup``."""
    if hasattr(group, "broadcast_object_list"):  # a SyncGroup (sync/group.py): not a member of torch's world
        group.broadcast(tensor, src)
        return
    import torch.distributed as dist

    dist.broadcast(tensor, src=src, group=group)


def _broadcast_objects(objs: list[Any], src: int, group: Any) -> None:
    if hasattr(group, "broadcast_object_list"):
        group.broadcast_object_list(objs, src)
        return
    import torch.distributed as dist

    dist.broadcast_object_list(objs, src=src, group=group)


@dataclasses.dataclass
class BroadcastTransport:
    """The learner's half of a ``torch.distributed`` broadcast (NCCL on GPU, gloo on CPU) to engine ranks.

    ``send`` broadcasts the layout (``("bucket", index, slots, nbytes)``) then the bytes. Without ``receipts`` it
    returns ``[]`` (the receivers hold the tensors: ``BroadcastReceiver.receive``). With ``receipts`` (an engine
    rank running ``BroadcastReceiver.serve``, driven by ``WeightSync`` through ``miles_lp.sync.remote.
    RemoteEngine``) it waits for the ``Receipt`` that rank ``reply_from`` broadcasts once its engine applied the
    bucket, and returns it. ``close`` tells the receivers to stop."""

    group: Any = None
    src: int = 0
    device: torch.device | str = "cpu"
    name: str = "nccl"
    receipts: bool = False
    reply_from: int = 1

    def send(self, bucket: Bucket):
        _broadcast_objects([("bucket", bucket.index, bucket.slots, bucket.nbytes)], self.src, self.group)
        flat = flatten(bucket, self.device)
        _broadcast(flat, self.src, self.group)
        if not self.receipts:
            return []
        box: list[Any] = [None]
        _broadcast_objects(box, self.reply_from, self.group)
        return box[0]

    def close(self) -> None:
        _broadcast_objects([_END], self.src, self.group)


@dataclasses.dataclass
class BroadcastReceiver:
    """An engine rank's half of ``BroadcastTransport``; the bytes land in a 0xFF-filled staging buffer.

    ``receive()`` yields ``(index, slots, received)`` per bucket until the sender closes (a receiver that applies
    the tensors itself). ``serve(engine, rank)`` is the engine process's loop for a ``WeightSync`` on the
    learner's rank: it answers the learner's calls (``miles_lp.sync.remote``) and applies each bucket with
    ``engine.update_weights`` on arrival, replying with a ``Receipt``, until the learner ends it."""

    group: Any = None
    src: int = 0
    device: torch.device | str = "cpu"

    def __post_init__(self):
        self.staging = Staging(self.device)

    def _next(self) -> Any:
        box: list[Any] = [None]
        _broadcast_objects(box, self.src, self.group)
        return box[0]

    def _bucket(self, msg) -> tuple[int, tuple[Slot, ...], Received]:
        _, index, slots, nbytes = msg
        buf = self.staging.take(nbytes)
        _broadcast(buf, self.src, self.group)
        return index, slots, list(iter_received(slots, buf))

    def receive(self):
        while True:
            msg = self._next()
            if msg == _END:
                return
            yield self._bucket(msg)

    def serve(self, engine: Any, rank: int) -> int:
        """Serve ``engine`` to the learner until it ends the loop; returns the buckets applied. ``rank``: this
        process's rank in the group (the one the learner's ``reply_from`` / ``RemoteEngine(engine_rank=)``)."""
        from miles_lp.sync.buckets import ff_counts
        from miles_lp.sync.remote import Receipt, answer

        applied = 0
        while True:
            msg = self._next()
            if msg == _END:
                return applied
            if msg[0] == "bucket":
                index, slots, received = self._bucket(msg)
                error = None
                try:
                    engine.update_weights(received)
                    applied += 1
                except Exception as exc:  # noqa: BLE001 - the learner's sync reports it (SyncAbortedError)
                    error = f"{type(exc).__name__}: {exc}"
                scales = [(n, t) for (n, t), s in zip(received, slots, strict=True) if s.is_scale]
                ff = dict(zip([n for n, _ in scales], ff_counts([t for _, t in scales]).tolist(), strict=True))
                reply: Any = Receipt(index, tuple(n for n, _ in received), ff, error)
            else:
                reply = answer(engine, msg)
            _broadcast_objects([reply], rank, self.group)


def make_transport(name: str, device: torch.device | str = "cpu", **kw) -> Transport:
    """The transport a recipe names (``sync.transport``); ``device``: where the receiver stages bytes."""
    if name == "inprocess":
        return InProcessTransport(device)
    if name == "ray":
        return RayTransport(device)
    if name == "cuda_ipc":
        return CudaIpcTransport(device)
    if name in ("nccl", "gloo"):  # the torch.distributed backend of the default group decides; the name documents it
        return BroadcastTransport(device=device, name=name, **kw)
    raise ConfigError(f"sync.transport: unknown transport '{name}'; known: inprocess, ray, cuda_ipc, nccl, gloo")
