"""Buckets of a configurable size that never split an atomic group, and the C5 write ledger.

A bucket is a byte layout (``Slot``: name, dtype, shape, offset) plus the payload tensors. Transports copy
the payload into the receiver's staging buffer, which is pre-filled with 0xFF first: 0xFF is a NaN in
every dtype a sync sends (E8M0 scale 0xFF, E4M3 0xFF, BF16 0xFFFF, FP32 0xFFFFFFFF), so a byte that a
transport failed to write reads as NaN, never as plausible old data (verl pre-fills expert scale staging
the same way; ``torch.empty`` staging let a partial sync pass). Offsets are 64-byte aligned so that a slot
can be viewed as its dtype in place.

``Ledger`` is the receiver's record of what arrived: every expected tensor exactly once, none unexpected,
and the count of 0xFF bytes per scale tensor against what the sender sent (C5).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from miles_lp.multitensor import kernels as _kernels
from miles_lp.sync.items import Item

ALIGN = 64
NAN_FILL = 0xFF


@dataclasses.dataclass(frozen=True)
class Slot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    is_scale: bool = False


@dataclasses.dataclass
class Bucket:
    index: int
    slots: tuple[Slot, ...]
    payload: dict[str, torch.Tensor]  # name -> the sender's tensor (a transport writes these into slots)
    nbytes: int  # size of the staging buffer (aligned)
    groups: tuple[str, ...]
    last: bool = False
    # optional: ({name: (output slot, multiplier)}, int64 out tensor): a transport that reads the payload anyway
    # may add each tensor's C2 fingerprint term there (``transport.fill_slots``) and then sets ``digested``
    digest: tuple | None = None
    digested: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.slots)

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _make(index: int, groups: Sequence[Sequence[Item]]) -> Bucket:
    slots, payload, off = [], {}, 0
    for group in groups:
        for it in group:
            slots.append(Slot(it.name, it.tensor.dtype, tuple(it.tensor.shape), off, it.nbytes, it.is_scale))
            payload[it.name] = it.tensor
            off = _align(off + it.nbytes)
    return Bucket(index, tuple(slots), payload, off, tuple(g[0].group for g in groups))


def make_buckets(groups: Iterable[Sequence[Item]], bucket_bytes: int) -> list[Bucket]:
    """Greedy, order-preserving buckets of at most ``bucket_bytes`` (aligned size). A group larger than the
    budget gets a bucket of its own (never split); the last bucket is marked ``last``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    out: list[Bucket] = []
    cur: list[Sequence[Item]] = []
    cur_bytes = 0
    for group in groups:
        if not group:
            continue
        size = sum(_align(it.nbytes) for it in group)
        if cur and cur_bytes + size > bucket_bytes:
            out.append(_make(len(out), cur))
            cur, cur_bytes = [], 0
        cur.append(group)
        cur_bytes += size
    if cur:
        out.append(_make(len(out), cur))
    if out:
        out[-1].last = True
    return out


def iter_received(bucket_slots: Sequence[Slot], staging: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The named tensors of a received bucket: views of ``staging`` (uint8) in place, no copy."""
    for s in bucket_slots:
        raw = staging[s.offset:s.offset + s.nbytes]
        yield s.name, raw.view(s.dtype).reshape(s.shape)


def ff_counts(ts: list[torch.Tensor]) -> torch.Tensor:
    """Bytes equal to the 0xFF fill in each tensor of ``ts`` (all on one device), as an int64 ``[len(ts)]``
    tensor there: one concatenation, one running count and one difference at the tensors' boundaries, not
    kernels per tensor (and no scatter-add: an ``index_add_`` of every byte into a few slots serialises on its
    atomics, ~6 ms per bucket on the H200). An unwritten byte of the staging buffer is 0xFF, so a received
    tensor with more 0xFF bytes than the sender's had a missed write (in any dtype: E8M0, E4M3, FP32)."""
    if not ts:
        return torch.zeros(0, dtype=torch.int64)
    if _kernels.enabled(ts[0].device, "ff"):
        return _kernels.ff_counts(ts)  # in place, one or two launches (the same counts; kernels.selfcheck)
    return ff_counts_torch(ts)


def ff_counts_torch(ts: list[torch.Tensor]) -> torch.Tensor:
    """``ff_counts`` in torch ops (the CPU path and the kernel's oracle)."""
    if not ts:
        return torch.zeros(0, dtype=torch.int64)
    raws = [t.detach().reshape(-1).view(torch.uint8) for t in ts]
    flat = torch.cat(raws) if len(raws) > 1 else raws[0]
    dev = flat.device
    run = torch.zeros(flat.numel() + 1, dtype=torch.int64, device=dev)  # run[i]: 0xFF bytes before byte i
    torch.cumsum(flat == NAN_FILL, 0, dtype=torch.int64, out=run[1:])
    ends, end = [], 0
    for r in raws:
        end += r.numel()
        ends.append(end)
    bounds = torch.tensor([0, *ends], dtype=torch.int64).to(dev)  # built where the bytes are: no device sync
    at = run[bounds]
    return at[1:] - at[:-1]


def ff_count(t: torch.Tensor) -> int:
    return int(ff_counts([t])[0])


@dataclasses.dataclass
class Ledger:
    """C5 on the receiving side: writes per tensor; 0xFF bytes of each scale tensor received vs sent."""

    expected: frozenset[str]
    writes: dict[str, int] = dataclasses.field(default_factory=dict)
    last_bucket: dict[str, int] = dataclasses.field(default_factory=dict)
    buckets_received: int = 0
    _sent: list[tuple[list[str], torch.Tensor]] = dataclasses.field(default_factory=list)  # counts stay on device
    _received: list[tuple[list[str], torch.Tensor]] = dataclasses.field(default_factory=list)

    def sent(self, bucket: Bucket) -> None:
        names = [s.name for s in bucket.slots if s.is_scale and s.name in bucket.payload]
        by_dev: dict[torch.device, list[str]] = {}
        for n in names:
            by_dev.setdefault(bucket.payload[n].device, []).append(n)
        for group in by_dev.values():
            self._sent.append((group, ff_counts([bucket.payload[n] for n in group])))

    def received(self, index: int, named: Iterable[tuple[str, torch.Tensor]], scales: Mapping[str, bool]) -> None:
        named = list(named)
        if not named:  # an empty delivery is a bucket that did not arrive
            return
        self.buckets_received += 1
        names = [n for n, _ in named]
        self._count(names, index)
        got = [(n, t) for n, t in named if scales.get(n)]
        if got:
            self._received.append(([n for n, _ in got], ff_counts([t for _, t in got])))

    def _count(self, names: list[str], index: int) -> None:
        """One write of each of ``names`` in bucket ``index`` (C-level dict updates: ~1,200 names per sync)."""
        w = self.writes
        once = dict.fromkeys(names, 1)
        if len(once) == len(names) and w.keys().isdisjoint(once):  # the healthy case: each name new, once
            w.update(once)
        else:
            for n, c in collections.Counter(names).items():
                w[n] = w.get(n, 0) + c
        self.last_bucket.update(dict.fromkeys(names, index))

    def receipt(self, index: int, names: Iterable[str], ff: Mapping[str, int]) -> None:
        """A bucket received and applied in another process (``miles_lp.sync.remote.Receipt``): its names and
        the 0xFF byte counts of its scales as that process counted them."""
        names = list(names)
        if not names:
            return
        self.buckets_received += 1
        self._count(names, index)
        if ff:
            self._received.append((list(ff), torch.tensor(list(ff.values()), dtype=torch.int64)))

    @staticmethod
    def _host(parts: list[tuple[list[str], torch.Tensor]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for names, counts in parts:  # one transfer per bucket
            out.update(zip(names, counts.cpu().tolist(), strict=True))
        return out

    def _host_both(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(_host(self._received), _host(self._sent))`` with one device->host transfer per device (the counts
        of every bucket, both sides, concatenated there) instead of one per bucket and side."""
        parts = [(0, names, c) for names, c in self._received] + [(1, names, c) for names, c in self._sent]
        by_dev: dict[torch.device, list[tuple[int, list[str], torch.Tensor]]] = {}
        for p in parts:
            by_dev.setdefault(p[2].device, []).append(p)
        out: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for ps in by_dev.values():
            flat = (torch.cat([c.reshape(-1) for _, _, c in ps]) if len(ps) > 1 else ps[0][2].reshape(-1)).tolist()
            i = 0
            for side, names, c in ps:
                n = c.numel()
                out[side].update(zip(names, flat[i:i + n], strict=True))
                i += n
        return out

    def problems(self) -> dict[str, list[str]]:
        """``missing`` (never written), ``repeated`` (written more than once), ``unexpected`` (not an engine
        tensor), ``unwritten_scale_bytes`` (more 0xFF bytes arrived than were sent: a missed write)."""
        w = self.writes
        keys = w.keys()
        # C-level fast paths of the healthy case, same answers: every count is >= 1, so no name is repeated iff
        # the counts sum to the number of names; equal 0xFF counts leave no name with more received than sent;
        # the written names equal to the expected set leave none missing or unexpected
        once = sum(w.values()) == len(w)
        exact = keys == self.expected
        if self._same_counts():
            unwritten: list[str] = []
        else:
            received, sent = self._host_both()
            unwritten = [] if received == sent else sorted(n for n, c in received.items() if c > sent.get(n, 0))
        return {
            "missing": [] if exact else sorted(self.expected - keys),
            "repeated": [] if once else sorted(n for n, c in w.items() if c > 1),
            "unexpected": [] if exact else sorted(keys - self.expected),
            "unwritten_scale_bytes": unwritten,
        }

    def _same_counts(self) -> bool:
        """Whether the 0xFF counts received equal those sent, name by name, decided on the device when both sides
        list the same names in the same order on one device (the in-process sync: one comparison, one transfer);
        False when that shortcut does not apply (the caller then compares by name)."""
        rn = [n for names, _ in self._received for n in names]
        sn = [n for names, _ in self._sent for n in names]
        if rn != sn or not rn:
            return not rn and not sn
        rc = [c.reshape(-1) for _, c in self._received]
        sc = [c.reshape(-1) for _, c in self._sent]
        if len({c.device for c in (*rc, *sc)}) != 1:
            return False
        a = torch.cat(rc) if len(rc) > 1 else rc[0]
        b = torch.cat(sc) if len(sc) > 1 else sc[0]
        return a.shape == b.shape and bool(torch.equal(a, b))
