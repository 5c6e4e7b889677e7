"""Triton kernels of the sync: the C2 fingerprint over many tensors in one launch, read in place.

``segment_values(tensors, slots, mults, nslots)`` is ``miles_lp.multitensor.digest``'s fingerprint arithmetic on a
device: per tensor the position-sensitive sum of ``digest._segment_sums`` over its bytes (1024-word rows, int32
column-weighted row sums, int64 row weights; zero padding to whole rows), times ``mults[i]``, added into output
slot ``slots[i]`` (int64, wrapping). ``digest`` calls it for CUDA tensors when Triton imports (``enabled``); the
torch code there stays the CPU path and the oracle, and the tests compare the two bit for bit (on CPU through
Triton's interpreter, ``TRITON_INTERPRET=1`` or ``interpret=True``; on the H200 in ``pytest -m gpu``).

One launch per call and alignment class (tensors whose address and size are multiples of 16 bytes take the
vector-load variant, the others a byte-assembling one): a sync's ~1,200 tensors are read once each, in place,
instead of being concatenated into a padded buffer first (the torch path moves ~5x the bytes). The launch's
tables (byte offsets from a base pointer, sizes, slots, multipliers, and the program -> (tensor, first row)
map) are built on the host with numpy and cached by the tensors' addresses and sizes (the layout repeats every
sync), so a repeated call costs a tuple of ``data_ptr()`` per tensor, one ``torch.zeros`` and one launch.
``runtime.sync_kernels: reference`` (debugging: ``MILES_LP_SYNC_KERNELS=reference``) turns the kernel off (the
torch path then runs on CUDA too).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch

from miles_lp.config import switch

ROW_BYTES = 4096
ROWS = 8  # rows of 1024 words per program: 32 KiB read per program
NUM_WARPS = 4
_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_digest_triton.py")
_LOADED: dict[bool, object] = {}  # interpreted -> the kernels' module (a launch's fast path)
_TABLES: OrderedDict = OrderedDict()  # layout key -> (meta tensor, [(start, ntensors, nblocks, aligned, base index)])
_TABLES_MAX = 32
_TRITON: list[str | None] = []


def _triton_missing() -> str | None:
    if not _TRITON:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            _TRITON.append(f"Triton is not importable ({exc})")
        else:
            _TRITON.append(None)
    return _TRITON[0]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def enabled(device: torch.device, kind: str = "digest") -> bool:
    """Whether the sync should use kernel ``kind`` (``digest``: C2 fingerprints, ``copy``: the bucket fill,
    ``ff``: C5's 0xFF counts) for tensors on ``device``: CUDA (or CPU under ``TRITON_INTERPRET=1``), Triton
    importable, and the switch ``runtime.sync_kernels`` (debugging override ``MILES_LP_SYNC_KERNELS``) ``auto``
    (default: all), or a comma list of the kinds to use (``digest,ff``), or ``reference`` (none: the torch paths)."""
    chosen = switch("sync_kernels")
    if chosen != "auto" and kind not in chosen.split(","):
        return False
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        return False
    return _triton_missing() is None


def _module(interpret: bool):
    mod = _LOADED.get(interpret)
    if mod is None:  # first use in this mode (cached_jit_module imports it once, whichever thread gets here)
        try:  # imported lazily by the interpreter's first launch, where it fails unless imported first
            import triton.experimental.gluon  # noqa: F401
        except Exception:  # noqa: BLE001 (an older Triton without it needs nothing)
            pass
        from miles_lp.formats.kernels import cached_jit_module

        mod = _LOADED[interpret] = cached_jit_module(_PATH, "miles_lp.multitensor._digest_triton", interpret)
    return mod


def _cached(key: tuple):
    """A launch table from the LRU cache (marked most recent), or None."""
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
    return hit


def _remember(key: tuple, hit: tuple) -> tuple:
    """Store a launch table in the LRU cache (at most ``_TABLES_MAX``); returns it."""
    _TABLES[key] = hit
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return hit


def _tables(ptrs: tuple[int, ...], sizes: tuple[int, ...], slots: Sequence[int], mults: Sequence[int],
            device: torch.device):
    """The launch tables for tensors at these addresses and sizes (cached by them, the slots and multipliers):
    ``(meta, [(start word, ntensors, nblocks, aligned, base tensor index)])``. As ``_copy_tables``: a second
    cache keyed by all but the addresses (and which tensors are 16-byte aligned) keeps the per-layout arrays, so
    tensors that are new every sync (the learner's export, counted for C5) cost a subtraction, not a rebuild."""
    import numpy as np

    key = (str(device), ptrs, sizes, tuple(slots), tuple(mults))
    hit = _cached(key)
    if hit is not None:
        return hit
    p = np.array(ptrs, dtype=np.uint64)
    n = np.array(sizes, dtype=np.int64)
    aligned = ((p & np.uint64(15)) == 0) & ((n & 15) == 0)
    lkey = ("layout", key[0], sizes, key[3], key[4], aligned.tobytes())
    lay = _cached(lkey)
    if lay is None:
        classes = []
        for cls in (True, False):
            idx = np.nonzero(aligned == cls)[0]
            if not idx.size:
                continue
            nonempty = idx[n[idx] > 0]
            base = int(nonempty[0] if nonempty.size else idx[0])  # offsets are from this tensor's address
            rows = np.maximum(1, -(-n[idx] // ROW_BYTES))
            nblk = -(-rows // ROWS)
            tens = np.repeat(np.arange(idx.size, dtype=np.int64), nblk)
            first = np.cumsum(nblk) - nblk
            r0 = (np.arange(tens.size, dtype=np.int64) - first[tens]) * ROWS
            ent = np.stack([np.zeros(idx.size, dtype=np.int64), n[idx], np.asarray(slots, dtype=np.int64)[idx],
                            np.asarray(mults, dtype=np.int64)[idx]], axis=1)
            classes.append((cls, idx, base, ent, np.stack([tens, r0], axis=1).reshape(-1)))
        lay = _remember(lkey, classes)
    metas, launches, words = [], [], 0
    for cls, idx, base, ent, blocks in lay:
        e = ent.copy()
        e[:, 0] = (p[idx] - p[base]).astype(np.int64)  # wraps to the signed difference
        metas.append(np.concatenate([e.reshape(-1), blocks]))
        launches.append((words, int(idx.size), int(blocks.size // 2), cls, base))
        words += metas[-1].size
    meta = torch.from_numpy(np.concatenate(metas)).to(device)
    return _remember(key, (meta, launches))


def segment_values(tensors: Sequence[torch.Tensor], slots: Sequence[int], mults: Sequence[int], nslots: int,
                   wcol: torch.Tensor, *, interpret: bool | None = None) -> torch.Tensor:
    """``out[slots[i]] += mults[i] * value(tensors[i])`` (int64, wrapping) for tensors on one device, where
    ``value`` is ``digest._segment_sums([[t]])`` of the tensor's bytes; ``out`` is int64 ``[nslots]`` on that
    device, computed without a host synchronisation. ``wcol``: the digest's int32 column weights there.

    Host work per tensor: its address, size and contiguity (a non-contiguous tensor is copied first); the
    tables come from the cache when the layout repeats."""
    if not tensors:
        return torch.zeros(nslots, dtype=torch.int64, device=wcol.device)
    ts = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    dev = ts[0].device
    if interpret is None:
        interpret = dev.type != "cuda"
    mod = _module(interpret)
    ptrs = tuple([t.data_ptr() for t in ts])
    sizes = tuple([t.nbytes for t in ts])
    meta, launches = _tables(ptrs, sizes, slots, mults, dev)
    out = torch.zeros(nslots, dtype=torch.int64, device=dev)
    for start, nt, nblocks, aligned, base in launches:
        b = ts[base].reshape(-1).view(torch.uint8)  # the kernel's byte pointer (offsets are from its address)
        mod.fingerprint_kernel[(nblocks,)](b, meta[start:], nt, wcol, out, ROWS=ROWS, ALIGNED=aligned,
                                           SUM64=interpret, num_warps=NUM_WARPS)
    return out


class PreparedValues:
    """``segment_values`` for one fixed list of contiguous tensors (their addresses and sizes now), slots and
    multipliers: the launch tables and arguments built once, so ``run()`` is one ``torch.zeros`` and one launch
    per alignment class, with no per-tensor host work. The caller proves the tensors are still these (the same
    objects at the same addresses: ``ReferenceEngine.check_state``); the object holds them, so their storage
    cannot be freed and its addresses reused by another tensor while it lives."""

    __slots__ = ("tensors", "nslots", "wcol", "_mod", "_calls", "_interpret")

    def __init__(self, tensors: Sequence[torch.Tensor], slots: Sequence[int], mults: Sequence[int], nslots: int,
                 wcol: torch.Tensor, *, interpret: bool | None = None):
        if not tensors or not all(t.is_contiguous() for t in tensors):
            raise ValueError("PreparedValues needs a non-empty list of contiguous tensors")
        self.tensors = tuple(tensors)
        dev = self.tensors[0].device
        self._interpret = dev.type != "cuda" if interpret is None else interpret
        self._mod = _module(self._interpret)
        meta, launches = _tables(tuple([t.data_ptr() for t in self.tensors]),
                                 tuple([t.nbytes for t in self.tensors]), slots, mults, dev)
        self._calls = [(nblocks, self.tensors[base].reshape(-1).view(torch.uint8), meta[start:], nt, aligned)
                       for start, nt, nblocks, aligned, base in launches]
        self.nslots, self.wcol = nslots, wcol

    def run(self) -> torch.Tensor:
        """``segment_values(tensors, slots, mults, nslots, wcol)`` of the tensors' bytes now (int64, on their
        device, no host synchronisation)."""
        out = torch.zeros(self.nslots, dtype=torch.int64, device=self.wcol.device)
        kern = self._mod.fingerprint_kernel
        for nblocks, b, meta, nt, aligned in self._calls:
            kern[(nblocks,)](b, meta, nt, self.wcol, out, ROWS=ROWS, ALIGNED=aligned, SUM64=self._interpret,
                             num_warps=NUM_WARPS)
        return out


def ff_counts(tensors: Sequence[torch.Tensor], *, interpret: bool | None = None) -> torch.Tensor:
    """Bytes equal to 0xFF in each tensor (int64 ``[len(tensors)]`` on their device, no host synchronisation):
    ``buckets.ff_counts`` (C5's unwritten-byte count) in one or two launches reading each tensor in place."""
    ts = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    dev = ts[0].device
    if interpret is None:
        interpret = dev.type != "cuda"
    mod = _module(interpret)
    n = len(ts)
    meta, launches = _tables(tuple([t.data_ptr() for t in ts]), tuple([t.nbytes for t in ts]), range(n),
                             (1,) * n, dev)
    out = torch.zeros(n, dtype=torch.int64, device=dev)
    for start, nt, nblocks, _, base in launches:
        mod.ff_count_kernel[(nblocks,)](ts[base].reshape(-1).view(torch.uint8), meta[start:], nt, out, ROWS=ROWS,
                                        num_warps=NUM_WARPS)
    return out


def _copy_tables(sptrs: tuple[int, ...], sizes: tuple[int, ...], dsts: tuple[int, ...], dst_ptr: int,
                 slots: tuple[int, ...], mults: tuple[int, ...], device: torch.device):
    """``copy_into``'s tables (cached by source addresses, sizes, destination offsets, buffer address, slots and
    multipliers): ``(meta, [(start word, ntensors, nblocks, aligned, source base index)])``.

    The sources are new tensors every sync (the learner's export), so their addresses rarely repeat; everything
    else does. A second cache keyed by all but the addresses (and by which sources are 16-byte aligned: that
    decides the launch classes) keeps the per-layout arrays, so a new set of addresses costs one subtraction
    and one concatenation, not the whole table build."""
    import numpy as np

    key = ("copy", str(device), sptrs, sizes, dsts, dst_ptr, slots, mults)
    hit = _cached(key)
    if hit is not None:
        return hit
    p = np.array(sptrs, dtype=np.uint64)
    src_aligned = (p & np.uint64(15)) == 0
    lkey = ("copy-layout", str(device), sizes, dsts, dst_ptr, slots, mults, src_aligned.tobytes())
    lay = _cached(lkey)
    if lay is None:
        n = np.array(sizes, dtype=np.int64)
        d = np.array(dsts, dtype=np.int64)
        aligned = src_aligned & ((n & 15) == 0) & (((d + dst_ptr) & 15) == 0)
        classes = []
        for cls in (True, False):
            idx = np.nonzero(aligned & (n > 0) if cls else ~aligned & (n > 0))[0]
            if not idx.size:
                continue
            rows = -(-n[idx] // ROW_BYTES)
            nblk = -(-rows // ROWS)
            tens = np.repeat(np.arange(idx.size, dtype=np.int64), nblk)
            first = np.cumsum(nblk) - nblk
            r0 = (np.arange(tens.size, dtype=np.int64) - first[tens]) * ROWS
            ent = np.stack([np.zeros(idx.size, dtype=np.int64), n[idx], d[idx],
                            np.asarray(slots, dtype=np.int64)[idx], np.asarray(mults, dtype=np.int64)[idx]], axis=1)
            classes.append((cls, idx, ent, np.stack([tens, r0], axis=1).reshape(-1)))
        lay = _remember(lkey, classes)
    metas, launches, words = [], [], 0
    for cls, idx, ent, blocks in lay:
        base = int(idx[0])
        e = ent.copy()
        e[:, 0] = (p[idx] - p[base]).astype(np.int64)  # source offsets from the base source (wraps: signed)
        metas.append(np.concatenate([e.reshape(-1), blocks]))
        launches.append((words, int(idx.size), int(blocks.size // 2), cls, base))
        words += metas[-1].size
    meta = torch.from_numpy(np.concatenate(metas) if metas else np.zeros(1, dtype=np.int64)).to(device)
    return _remember(key, (meta, launches))


def copy_into(buf: torch.Tensor, sources: Sequence[torch.Tensor], offsets: Sequence[int],
              sizes: Sequence[int] | None = None, *, digest: tuple | None = None,
              interpret: bool | None = None) -> None:
    """``buf[offsets[i]:offsets[i] + sizes[i]] = the first sizes[i] bytes of sources[i]`` (default: all of
    them) for every i, in at most two launches (16-byte aligned pieces as int32 vectors, the rest bytewise),
    each source read in place: the bucket fill without ~4 torch calls per tensor (views, the concatenation).
    ``buf``: uint8, contiguous, on the sources' device; the caller keeps the ranges disjoint and inside ``buf``.

    ``digest=(slots, mults, out, wcol)``: also ``out[slots[i]] += mults[i] * value(piece i)`` (int64; ``value``
    as ``segment_values``, of the bytes copied), in the same pass (mult 0 for a piece that is not digested)."""
    ts = [t if t.is_contiguous() else t.contiguous() for t in sources]
    if not ts:
        return
    dev = buf.device
    if interpret is None:
        interpret = dev.type != "cuda"
    mod = _module(interpret)
    slots, mults, out, wcol = digest if digest is not None else ((0,) * len(ts), (0,) * len(ts), buf, buf)
    meta, launches = _copy_tables(tuple([t.data_ptr() for t in ts]),
                                  tuple([t.nbytes for t in ts] if sizes is None else sizes),
                                  tuple(offsets), buf.data_ptr(), tuple(slots), tuple(mults), dev)
    for start, nt, nblocks, aligned, base in launches:
        src = ts[base].reshape(-1).view(torch.uint8)
        mod.copy_kernel[(nblocks,)](src, buf, meta[start:], nt, wcol, out, ROWS=ROWS, ALIGNED=aligned,
                                    DIGEST=digest is not None, SUM64=interpret, num_warps=NUM_WARPS)
