"""C2 digests: the exact host digest both sides share, and a device-side fingerprint for every sync.

``miles_lp.rollout.engine.tensor_digest`` (blake2b of the bytes, on the host) is the reference: exact, but
about 1 s per GB, so on a GPU it would dominate a sync of a few tens of milliseconds. ``fingerprint`` is a
position-sensitive checksum computed where the tensor lives: the bytes as int32 words in rows of 1024,
reduced once along rows and once along columns, each weighted by a fixed pseudo-random int64 vector
(wrap-around arithmetic). Any change to one word changes a row and a column sum; swapping two words
changes at least one of the two reductions. It detects corruption and staleness, not adversaries; the full
byte compare (``sync.full_compare``) is the exact check.
"""

from __future__ import annotations

import torch

ROW = 1024
_WEIGHTS: dict[tuple[str, int], torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    key = (str(device), n)
    w = _WEIGHTS.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED + n)
        w = torch.randint(1, 2**31 - 1, (n,), generator=g, dtype=torch.int64).mul_(2).add_(1).to(device)
        _WEIGHTS[key] = w
    return w


def _sums(t: torch.Tensor) -> torch.Tensor:
    """The two weighted sums of ``t``'s bytes as an int64 ``[2]`` tensor on its device."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % (4 * ROW)
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    elif raw.storage_offset() % 4:  # a byte view into a larger tensor: int32 needs 4-byte alignment
        raw = raw.clone()
    words = raw.view(torch.int32).reshape(-1, ROW)  # [R, 1024]
    rows = words.sum(dim=1, dtype=torch.int64)  # [R]
    cols = words.sum(dim=0, dtype=torch.int64)  # [1024]
    return torch.stack([(rows * _weights(rows.numel(), rows.device)).sum(),
                        (cols * _weights(ROW, cols.device)).sum()])


def _format(t: torch.Tensor, a: int, b: int) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:{a & (2**64 - 1):016x}{b & (2**64 - 1):016x}"


def fingerprint(t: torch.Tensor) -> str:
    """``dtype[shape]:<rows><cols>``; equal bytes give equal strings on any device."""
    a, b = _sums(t).tolist()
    return _format(t, a, b)


def fingerprints(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """``fingerprint`` of many tensors with one device->host transfer per device (no sync per tensor)."""
    out: dict[str, str] = {}
    by_dev: dict[torch.device, list[str]] = {}
    for n, t in named.items():
        by_dev.setdefault(t.device, []).append(n)
    for names in by_dev.values():
        sums = torch.stack([_sums(named[n]) for n in names]).cpu().tolist()
        out.update({n: _format(named[n], a, b) for n, (a, b) in zip(names, sums, strict=True)})
    return out
