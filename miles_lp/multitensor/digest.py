"""C2 digests: the exact host digest both sides share, and a device-side fingerprint for every sync.

``miles_lp.rollout.engine.tensor_digest`` (blake2b of the bytes, on the host) is the reference: exact, but
about 1 s per GB, so on a GPU it would dominate a sync of a few tens of milliseconds. ``fingerprints`` is a
position-sensitive checksum computed where the tensors live. A tensor's value:

* its bytes, zero-padded to whole rows of 1024 little-endian int32 words: ``words [R, 1024]``;
* ``rows = sum_c words[r, c] * wcol[c]`` (int32 wrap-around products and sums), ``wcol`` fixed odd numbers;
* ``sum_r rows[r] * wrow(r)`` (int64 wrap-around) with ``wrow`` an odd hash of the row's index within the
  tensor, so a tensor's value does not depend on its neighbours.

``group_fingerprints`` gives one value per group (the sync's atomic groups: all experts of a layer, q/k/v, ...):
``sum_k member_weight(k) * value(member k)``, so the per-sync C2 comparison and its host work scale with the
number of groups, not tensors; per-tensor fingerprints are computed only to name the tensors of a group that
differs.

On CUDA both are ONE Triton launch over all the tensors of a device, each read once in place
(``miles_lp.multitensor.kernels``); the torch code here (the tensors concatenated into a padded buffer, chunks of at
most ``CHUNK_BYTES``) is the CPU path and the oracle the kernel is tested against bit for bit.

Changing any word changes the sum (odd weights); moving a word to another row or column changes its weight.
It detects corruption and staleness, not adversaries; the full byte compare (``sync.full_compare``) is exact.
"""

from __future__ import annotations

import zlib

import torch

from miles_lp.multitensor import kernels as _kernels

ROW = 1024  # int32 words per row
ROW_BYTES = 4 * ROW
CHUNK_BYTES = 256 << 20
_WCOL: dict[str, torch.Tensor] = {}
MASK64 = (1 << 64) - 1


def row_weights(device: torch.device) -> torch.Tensor:
    """The ``ROW`` odd int32 weights of a row's words (fixed seed: the same in every process), on ``device``."""
    key = str(device)
    w = _WCOL.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = (torch.randint(0, 2**30, (ROW,), generator=g, dtype=torch.int32) * 2 + 1).to(device)
        _WCOL[key] = w
    return w


_ZEROS: dict[str, torch.Tensor] = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    """``n`` zero bytes on ``device`` (a slice of one cached buffer: the row padding, no kernel per tensor)."""
    key = str(device)
    z = _ZEROS.get(key)
    if z is None or z.numel() < n:
        z = torch.zeros(max(n, ROW_BYTES), dtype=torch.uint8, device=device)
        _ZEROS[key] = z
    return z[:n]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (a copy only for a non-contiguous tensor). Callers run under
    ``torch.no_grad``: no ``detach`` per tensor (each torch call costs ~1 us of host time, per tensor, per sync)."""
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)


def _segment_sums(segments: list[list[torch.Tensor]]) -> torch.Tensor:
    """One int64 fingerprint value per segment (all tensors on one device): a segment's bytes are its tensors'
    bytes concatenated, zero-padded to whole rows. A one-tensor segment is that tensor's fingerprint.

    All segments go into one padded buffer with one ``torch.cat`` (a few batched kernels whatever the number of
    tensors), then a handful of reductions: the launch count does not grow with the number of tensors."""
    raws: list[torch.Tensor] = []
    rows_of: list[int] = []
    aligned8 = True  # every part's size and address divisible by 8: concatenated as 8-byte words
    for seg in segments:
        n = 0
        dev = None
        for t in seg:
            r = _raw(t)
            k = r.numel()
            n += k
            aligned8 = aligned8 and not (k & 7 or r.data_ptr() & 7)
            raws.append(r)
            dev = r.device
        rows = max(1, -(-n // ROW_BYTES))  # whole rows, at least one
        if rows * ROW_BYTES > n:
            pad = _zeros(rows * ROW_BYTES - n, dev or torch.device("cpu"))
            aligned8 = aligned8 and not ((rows * ROW_BYTES - n) & 7 or pad.data_ptr() & 7)
            raws.append(pad)
        rows_of.append(rows)
    if aligned8:  # the same bytes, an eighth of the elements for the concatenation
        raws = [r.view(torch.int64) for r in raws]
    flat = torch.cat(raws) if len(raws) > 1 else raws[0]
    words = flat.view(torch.uint8).view(torch.int32).reshape(-1, ROW)  # [R, 1024]
    # int32 products and row sums, both wrapping mod 2^32 (vectorized; an int64 accumulation is ~10x slower on
    # CPU); the per-segment combination below is int64
    rows = (words * row_weights(words.device)).sum(dim=1, dtype=torch.int32).to(torch.int64)  # [R]
    dev = words.device
    counts = torch.tensor(rows_of, dtype=torch.int64).to(dev)
    seg = torch.repeat_interleave(torch.arange(len(segments), device=dev), counts, output_size=rows.numel())
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(rows.numel(), device=dev, dtype=torch.int64) - starts[seg]  # row within its segment
    wrow = pos * -7046029254386353131 + 0x7F4A7C15  # an odd-ish int64 hash of the index (wraps)
    wrow = wrow | 1
    out = torch.zeros(len(segments), dtype=torch.int64, device=dev)
    return out.index_add_(0, seg, rows * wrow)


def tensor_sums(ts: list[torch.Tensor]) -> torch.Tensor:
    """One int64 fingerprint value per tensor of ``ts`` (all on one device)."""
    return _segment_sums([[t] for t in ts])


def member_weight(k: int) -> int:
    """The odd int64 weight of the ``k``-th member of a group (1 for the first: a one-tensor group's value is
    its tensor's), so the same tensors in another order give another group value."""
    v = ((k * 0x9E3779B97F4A7C15) | 1) & MASK64
    return v - (1 << 64) if v >> 63 else v


def slot_values(ts: list[torch.Tensor], slots: list[int], mults: list[int], nslots: int) -> torch.Tensor:
    """``out[slots[i]] += mults[i] * value(ts[i])`` (int64, wrapping) on the tensors' device (all on one).
    CUDA (and CPU under ``TRITON_INTERPRET=1``): one Triton launch reading every tensor in place
    (``miles_lp.multitensor.kernels``); otherwise the torch reference in chunks of at most ``CHUNK_BYTES``."""
    dev = ts[0].device if ts else torch.device("cpu")
    if ts and _kernels.enabled(dev):
        return _kernels.segment_values(ts, slots, mults, nslots, row_weights(dev))
    out = torch.zeros(nslots, dtype=torch.int64, device=dev)
    for c in _chunks([t.numel() * t.element_size() for t in ts]):
        vals = tensor_sums([ts[i] for i in c])
        idx = torch.tensor([slots[i] for i in c], dtype=torch.int64).to(dev)
        w = torch.tensor([mults[i] for i in c], dtype=torch.int64).to(dev)
        out.index_add_(0, idx, vals * w)
    return out


def _chunks(sizes: list[int]) -> list[list[int]]:
    """Consecutive index chunks of at most ``CHUNK_BYTES`` (an item larger than that is a chunk of its own)."""
    chunks: list[list[int]] = [[]]
    size = 0
    for i, nb in enumerate(sizes):
        if chunks[-1] and size + nb > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += nb
    return chunks


def _format(t: torch.Tensor, v: int) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{v & MASK64:016x}"


@torch.no_grad()
def fingerprints(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """``dtype[shape]:<64-bit hex>`` per tensor; equal bytes give equal strings on any device (the kernel and
    the torch reference compute the same value). One device->host transfer per device."""
    out: dict[str, str] = {}
    by_dev: dict[torch.device, list[str]] = {}
    for n, t in named.items():
        by_dev.setdefault(t.device, []).append(n)
    for names in by_dev.values():
        ts = [named[n] for n in names]
        sums = slot_values(ts, list(range(len(ts))), [1] * len(ts), len(ts)).cpu().tolist()
        out.update({n: _format(t, v) for n, t, v in zip(names, ts, sums, strict=True)})
    return out


@torch.no_grad()
def group_fingerprints(groups: dict[str, list[torch.Tensor]]) -> dict[str, str]:
    """One fingerprint per group of tensors: ``<count>x<bytes>/<signature>:<64-bit hex>``, the hex being
    ``sum_k member_weight(k) * value(member k)`` (int64, wrapping; ``value`` as in ``fingerprints``) and the
    signature a hash of the members' dtypes and shapes, so a member of another dtype or shape, or the members
    in another order, differ too. Both sides of a C2 check compute it over the same ordered names; one value
    per group crosses to the host. A mismatch says which group, not which tensor: compare ``fingerprints`` of
    its members then (``miles_lp.sync.weight_sync``)."""
    out: dict[str, str] = {}
    by_dev: dict[torch.device, list[str]] = {}
    for g, ts in groups.items():
        dev = ts[0].device if ts else _CPU
        by_dev.setdefault(dev, []).append(g)
    for gids in by_dev.values():
        members = [groups[g] for g in gids]
        out.update(_group_values(gids, [len(ms) for ms in members], [t for ms in members for t in ms], members))
    return out


@torch.no_grad()
def group_fingerprints_flat(gids: list[str], counts: list[int], tensors: list[torch.Tensor]) -> dict[str, str]:
    """``group_fingerprints`` of the groups ``gids[i]`` = the next ``counts[i]`` of ``tensors`` (in order), without
    building the per-group lists when every tensor is on one device and no group is empty (an engine's C2 side:
    its live tensors gathered in one pass); otherwise it builds them and calls ``group_fingerprints``."""
    if tensors and all(counts) and len({t.device for t in tensors}) == 1:
        return _group_values(gids, counts, tensors, None)
    groups, i = {}, 0
    for g, k in zip(gids, counts, strict=True):
        groups[g] = tensors[i:i + k]
        i += k
    return group_fingerprints(groups)


def _group_values(gids: list[str], counts: list[int], ts: list[torch.Tensor],
                  members: list[list[torch.Tensor]] | None) -> dict[str, str]:
    """The groups' fingerprints for tensors on one device, ``ts`` the members of ``gids`` in order."""
    if members is None:
        members, i = [], 0
        for k in counts:
            members.append(ts[i:i + k])
            i += k
    heads = [group_head(ms) for ms in members]  # from the live members' dtypes and shapes, every call
    slots, mults = group_plan(counts)
    sums = slot_values(ts, slots, mults, len(gids)).cpu().tolist()
    return group_strings(gids, heads, sums)


@torch.no_grad()
def group_values(counts: list[int], ts: list[torch.Tensor]) -> list[int]:
    """The int64 sums of ``group_fingerprints`` (without heads) for groups of ``counts`` consecutive members of
    ``ts``, all on one device: one device->host transfer."""
    slots, mults = group_plan(counts)
    return slot_values(ts, slots, mults, len(counts)).cpu().tolist()


def group_plan(counts: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The output slot and member weight of each tensor of groups of ``counts`` members (in order), cached by
    the group sizes: what ``group_fingerprints`` sums."""
    key = tuple(counts)
    plan = _GROUP_PLANS.get(key)
    if plan is None:
        slots: list[int] = []
        mults: list[int] = []
        for i, k in enumerate(counts):
            slots.extend([i] * k)
            mults.extend(_WEIGHTS[:k] if k <= len(_WEIGHTS) else [member_weight(j) for j in range(k)])
        plan = (tuple(slots), tuple(mults))
        if len(_GROUP_PLANS) > 64:
            _GROUP_PLANS.clear()
        _GROUP_PLANS[key] = plan
    return plan


def group_strings(gids: list[str], heads: list[str], sums: list[int]) -> dict[str, str]:
    """``group_fingerprints``' strings from the groups' heads and int64 sums."""
    return dict(zip(gids, [f"{h}:{v & MASK64:016x}" for h, v in zip(heads, sums, strict=True)], strict=True))


_CPU = torch.device("cpu")
_GROUP_PLANS: dict[tuple, tuple] = {}  # group sizes -> (slots, member weights) of group_fingerprints


_HEADS: dict[tuple, str] = {}


def group_head(members: list[torch.Tensor]) -> str:
    """``<count>x<bytes>/<signature>`` of a group's members (their dtypes and shapes: the same text in any
    process), cached by the (dtype, shape) list: a group's layout repeats every sync."""
    key = tuple([(t.dtype, t.shape) for t in members])
    h = _HEADS.get(key)
    if h is None:
        sig = zlib.crc32(repr([(t.dtype, t.shape) for t in members]).encode())
        h = f"{len(members)}x{sum(t.nbytes for t in members)}/{sig:08x}"
        if len(_HEADS) > 100_000:
            _HEADS.clear()
        _HEADS[key] = h
    return h


_WEIGHTS = [member_weight(k) for k in range(4096)]


def fingerprint(t: torch.Tensor) -> str:
    """The fingerprint of one tensor (``fingerprints`` gives the same string for it in any batch)."""
    return fingerprints({"t": t})["t"]
