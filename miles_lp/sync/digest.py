"""C2 digests: the exact host digest both sides share, and a device-side fingerprint for every sync.

``miles_lp.rollout.engine.tensor_digest`` (blake2b of the bytes, on the host) is the reference: exact, but
about 1 s per GB, so on a GPU it would dominate a sync of a few tens of milliseconds. ``fingerprints`` is a
position-sensitive checksum computed where the tensors live, for many tensors in a handful of kernels (the
per-tensor launch cost, not the bytes, dominates a sync of ~1000 small tensors):

* each tensor's bytes, zero-padded to whole rows of 1024 int32 words, are concatenated (chunks of at most
  ``CHUNK_BYTES``) into ``words [R, 1024]``;
* ``rows = sum_c words[r, c] * wcol[c]`` (int32 wrap-around products and sums), ``wcol`` fixed odd numbers;
* per tensor, ``sum_r rows[r] * wrow(r)`` (int64 wrap-around) with ``wrow`` an odd hash of the row's index
  *within its tensor*, so a tensor's fingerprint does not depend on its neighbours.

Changing any word changes the sum (odd weights); moving a word to another row or column changes its weight.
It detects corruption and staleness, not adversaries; the full byte compare (``sync.full_compare``) is exact.
"""

from __future__ import annotations

import torch

ROW = 1024  # int32 words per row
ROW_BYTES = 4 * ROW
CHUNK_BYTES = 256 << 20
_WCOL: dict[str, torch.Tensor] = {}
_MASK = (1 << 64) - 1


def _wcol(device: torch.device) -> torch.Tensor:
    key = str(device)
    w = _WCOL.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = (torch.randint(0, 2**30, (ROW,), generator=g, dtype=torch.int32) * 2 + 1).to(device)
        _WCOL[key] = w
    return w


def _chunk_sums(ts: list[torch.Tensor]) -> torch.Tensor:
    """One int64 fingerprint value per tensor of ``ts`` (all on one device), in a few kernels."""
    raws = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in ts]
    rows_of = [max(1, -(-r.numel() // ROW_BYTES)) for r in raws]  # whole rows, at least one
    flat = torch.empty(sum(rows_of) * ROW_BYTES, dtype=torch.uint8, device=raws[0].device)
    off = 0
    for r, n in zip(raws, rows_of, strict=True):  # one copy per tensor into its zero-padded rows
        flat[off:off + r.numel()].copy_(r)
        if r.numel() < n * ROW_BYTES:
            flat[off + r.numel():off + n * ROW_BYTES].zero_()
        off += n * ROW_BYTES
    words = flat.view(torch.int32).reshape(-1, ROW)  # [R, 1024]
    # int32 products and row sums, both wrapping mod 2^32 (vectorized; an int64 accumulation is ~10x slower on
    # CPU); the per-tensor combination below is int64
    rows = (words * _wcol(words.device)).sum(dim=1, dtype=torch.int32).to(torch.int64)  # [R]
    dev = words.device
    counts = torch.tensor(rows_of, dtype=torch.int64).to(dev)
    seg = torch.repeat_interleave(torch.arange(len(ts), device=dev), counts, output_size=rows.numel())  # row -> tensor
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(rows.numel(), device=words.device, dtype=torch.int64) - starts[seg]  # row within tensor
    wrow = pos * -7046029254386353131 + 0x7F4A7C15  # an odd-ish int64 hash of the index (wraps)
    wrow = wrow | 1
    out = torch.zeros(len(ts), dtype=torch.int64, device=words.device)
    return out.index_add_(0, seg, rows * wrow)


def _format(t: torch.Tensor, v: int) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{v & _MASK:016x}"


def fingerprints(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """``dtype[shape]:<64-bit hex>`` per tensor; equal bytes give equal strings on any device. One
    device->host transfer per device; memory bounded by chunks of ``CHUNK_BYTES``."""
    out: dict[str, str] = {}
    by_dev: dict[torch.device, list[str]] = {}
    for n, t in named.items():
        by_dev.setdefault(t.device, []).append(n)
    for names in by_dev.values():
        chunks: list[list[str]] = [[]]
        size = 0
        for n in names:
            nb = named[n].numel() * named[n].element_size()
            if chunks[-1] and size + nb > CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(n)
            size += nb
        sums = torch.cat([_chunk_sums([named[n] for n in c]) for c in chunks]).cpu().tolist()
        flat_names = [n for c in chunks for n in c]
        out.update({n: _format(named[n], v) for n, v in zip(flat_names, sums, strict=True)})
    return out


def fingerprint(t: torch.Tensor) -> str:
    """The fingerprint of one tensor (``fingerprints`` gives the same string for it in any batch)."""
    return fingerprints({"t": t})["t"]
