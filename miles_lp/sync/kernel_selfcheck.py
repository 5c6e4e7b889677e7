"""The sync kernels (``miles_lp.multitensor.kernels``) against their torch paths on fresh random tensors, bit for bit:
``selfcheck`` (the C2 fingerprint and 0xFF counts), ``fill_check`` (bucket staging through ``copy_into``).
``python -m miles_lp.sync.kernel_selfcheck [--device cuda] [--large]`` prints one JSON line and exits 1 on a
mismatch. It sits above the modules it checks, so none of them imports it."""

from __future__ import annotations

import os

import torch

from miles_lp.config import runtime_override
from miles_lp.multitensor.kernels import ROW_BYTES, ROWS, enabled, ff_counts, segment_values


def selfcheck(device: str = "cpu", seed: int | None = None, large: bool = False) -> dict:
    """The kernel against the torch reference (``digest.tensor_sums``, combined in Python ints) on fresh random
    tensors of awkward sizes (0 bytes, partial words, partial rows, exactly ``ROWS`` rows, one byte more),
    addresses (views at every offset mod 16), dtypes, a non-contiguous one, and views of one stacked storage,
    per tensor and grouped with random slots and multipliers. Returns ``{"seed", "cases", "mismatches": [...]}``
    (an empty list: bit for bit equal). ``large``: one more tensor of ~300 MB (on CUDA)."""
    import random

    from miles_lp.multitensor import digest

    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    pool = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g).to(dev)
    ts: list[torch.Tensor] = []
    for n in (0, 1, 3, 4, 15, 16, 17, 4095, 4096, 4097, ROWS * ROW_BYTES, ROWS * ROW_BYTES + 1,
              9 * ROW_BYTES + 123, 40000):
        off = rng.randrange(0, 64)
        ts.append(pool[off:off + n])
    ts.append(torch.randn(33, 65, generator=g).to(torch.bfloat16).to(dev))
    ts.append(torch.randn(96, 256, generator=g).to(torch.float8_e4m3fn).to(dev))
    ts.append(torch.randn(64, 48, generator=g).to(dev).t())  # non-contiguous
    stack = torch.randint(-2**31, 2**31 - 1, (4, 3, 1024), dtype=torch.int32, generator=g).to(dev)
    ts.extend(stack[i] for i in range(4))
    ts.append(torch.randn(5, generator=g).to(torch.float64).to(dev))
    if large:
        ts.append(torch.randint(0, 256, (300_000_017,), dtype=torch.uint8, device=dev))
    rng.shuffle(ts)
    ref = [int(v) for v in digest.tensor_sums([t.cpu() for t in ts]).tolist()]
    mismatches = []
    got = segment_values(ts, list(range(len(ts))), [1] * len(ts), len(ts), digest.row_weights(dev)).cpu().tolist()
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a != b:
            t = ts[i]
            mismatches.append(f"tensor {i} ({t.dtype}, {list(t.shape)}, {t.nbytes} B, address mod 16 = "
                              f"{t.data_ptr() & 15}): kernel {b:#x}, reference {a:#x}")
    from miles_lp.sync.buckets import ff_counts_torch

    for t in ts[:6]:  # plant some 0xFF bytes
        if t.numel() and t.dtype == torch.uint8:
            t.view(-1)[: max(1, t.numel() // 3)] = 0xFF
    ref_ff = [int(c) for c in ff_counts_torch([t.cpu() for t in ts]).tolist()]
    got_ff = ff_counts(ts).cpu().tolist()
    if ref_ff != got_ff:
        mismatches.append(f"0xFF counts: kernel {got_ff}, reference {ref_ff}")
    ref = [int(v) for v in digest.tensor_sums([t.cpu() for t in ts]).tolist()]  # the planted bytes changed them
    nslots = 5
    slots = [rng.randrange(nslots) for _ in ts]
    mults = [digest.member_weight(rng.randrange(1000)) for _ in ts]
    exp = [0] * nslots
    for s, m, v in zip(slots, mults, ref, strict=True):
        exp[s] = (exp[s] + m * v) & digest.MASK64
    grouped = segment_values(ts, slots, mults, nslots, digest.row_weights(dev)).cpu().tolist()
    for s in range(nslots):
        if grouped[s] & digest.MASK64 != exp[s]:
            mismatches.append(f"group slot {s}: kernel {grouped[s] & digest.MASK64:#x}, reference {exp[s]:#x}")
    return {"seed": seed, "device": str(dev), "cases": len(ts), "mismatches": mismatches}


def fill_check(device: str = "cpu", seed: int | None = None) -> dict:
    """``transport.fill_slots`` through ``copy_into`` vs the torch path (``MILES_LP_SYNC_KERNELS=reference``) on
    a bucket of awkward tensors (sizes 1..40000 bytes, views at odd addresses, a non-contiguous one, stacked
    views, one slot without a payload): the staging buffers must be equal byte for byte, 0xFF gaps included.
    Returns ``{"seed", "slots", "mismatched_bytes"}``."""
    import random

    from miles_lp.sync.buckets import make_buckets
    from miles_lp.sync.items import Item
    from miles_lp.sync.transport import fill_slots

    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dev = torch.device(device)
    pool = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, generator=g).to(dev)  # no 0xFF byte
    ts = []
    for n in (1, 3, 16, 17, 4095, 4096, 4097, ROWS * ROW_BYTES + 5, 40000):
        off = rng.randrange(0, 64)
        ts.append(pool[off:off + n])
    ts.append(torch.randn(64, 48, generator=g).to(dev).t())
    ts.extend(torch.randn(4, 3, 256, generator=g).to(torch.bfloat16).to(dev).unbind(0))
    items = [Item(f"t{i}", t, f"t{i}", None, "scale" if i % 3 == 0 else "data", f"g{i % 4}")
             for i, t in enumerate(ts)]
    (bucket,) = make_buckets([items], 1 << 30)
    del bucket.payload["t5"]  # a slot nothing writes: stays the 0xFF fill
    bufs = []
    for mode in ("auto", "reference"):
        with runtime_override(sync_kernels=mode):
            buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=dev)
            fill_slots(buf, bucket)
            bufs.append(buf.cpu())
    bad = int((bufs[0] != bufs[1]).sum())
    return {"seed": seed, "slots": len(bucket.slots), "mismatched_bytes": bad,
            "kernel_path": enabled(dev, "copy"), "ff_bytes": int((bufs[0] == 0xFF).sum())}


if __name__ == "__main__":  # python -m miles_lp.sync.kernel_selfcheck [--device cuda] [--large]: one JSON line
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--large", action="store_true")
    a = ap.parse_args()
    res = selfcheck(a.device, a.seed, a.large)
    res["fill"] = fill_check(a.device, a.seed)
    print(json.dumps(res))
    raise SystemExit(1 if res["mismatches"] or res["fill"]["mismatched_bytes"] else 0)
