"""``batched_copy``: the bytes of the per-tensor copies in fewer strided copies; safe fallbacks; and the
transport's one-``cat`` bucket fill (every byte either payload or the 0xFF fill)."""

import pytest
import torch

from miles_lp.multitensor.strided import batched_copy
from miles_lp.sync.buckets import NAN_FILL, make_buckets
from miles_lp.sync.items import Item
from miles_lp.sync.transport import InProcessTransport, fill_slots, flatten


def _one_by_one(pairs):
    for d, s in pairs:
        d.copy_(s)


def _same(a, b):
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
               for (x, _), (y, _) in zip(a, b, strict=True))


def test_expert_slices_into_slots_are_one_copy_per_projection_and_the_same_bytes():
    g = torch.Generator().manual_seed(0)
    E, inter, k = 6, 8, 32
    grid = torch.randn(E, 2 * inter, k, generator=g).to(torch.float8_e4m3fn)  # the learner's gate_up grid
    scale = torch.randint(0, 255, (E, 2 * inter, k // 32), generator=g, dtype=torch.uint8)
    # the bucket order: e0.gate.w, e0.gate.s, e0.up.w, e0.up.s, e1.gate.w, ...
    srcs = []
    for e in range(E):
        for rows in (slice(0, inter), slice(inter, 2 * inter)):
            srcs += [grid[e, rows], scale[e, rows]]
    stride = sum(-(-t.numel() // 64) * 64 for t in srcs[:2])
    staging = torch.full((stride * len(srcs) // 2 + 64,), NAN_FILL, dtype=torch.uint8)
    dsts, off = [], 0
    for s in srcs:
        dsts.append(staging[off:off + s.numel()].view(s.dtype).reshape(s.shape))
        off = -(-(off + s.numel()) // 64) * 64
    pairs = list(zip(dsts, srcs, strict=True))
    ref = [(d.clone(), s) for d, s in pairs]
    _one_by_one(ref)
    before = staging.clone()
    n = batched_copy(pairs)
    assert n == 2  # every weight in one strided copy, every scale in another
    assert _same(pairs, ref)
    # only slot bytes changed: the alignment gaps keep the fill
    gaps = torch.ones_like(staging, dtype=torch.bool)
    for d in dsts:
        o = d.untyped_storage().data_ptr()
        start = d.data_ptr() - o
        gaps[start:start + d.numel() * d.element_size()] = False
    assert torch.equal(staging[gaps], before[gaps])


def test_two_level_pattern_gate_and_up_reading_one_global_scale():
    gs = torch.rand(5)  # per expert; gate and up of expert e both read gs[e]
    srcs = [gs[e] for e in range(5) for _ in range(2)]
    stack = torch.zeros(10)
    pairs = [(stack[i], s) for i, s in enumerate(srcs)]
    assert batched_copy(pairs) == 1
    assert torch.equal(stack, gs.repeat_interleave(2))


def test_fallbacks_give_the_per_tensor_result():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 8, 8, generator=g)
    pairs = [(torch.zeros(8, 8), base[0].t()),  # a non-contiguous source
             (torch.zeros(8, 8, dtype=torch.bfloat16), base[1]),  # a dtype conversion
             (torch.zeros(8, 8), base[2]), (torch.zeros(8, 8), base[3])]  # separate destinations
    ref = [(torch.zeros_like(d), s) for d, s in pairs]
    _one_by_one(ref)
    assert batched_copy(pairs) == 4
    assert _same(pairs, ref)
    # destinations closer than their size would overlap in one strided view: copied one by one
    flat = torch.zeros(12)
    src = torch.arange(16.0)
    pairs = [(flat[0:8], src[0:8]), (flat[4:12], src[8:16])]  # overlapping destinations: a caller's bug,
    assert batched_copy(pairs) == 2  # never merged into one racy copy
    assert torch.equal(flat[4:12], src[8:16])


def _items():
    g = torch.Generator().manual_seed(2)
    data = torch.randn(4, 16, 64, generator=g).to(torch.float8_e4m3fn)
    scale = torch.randint(0, 254, (4, 16, 2), generator=g, dtype=torch.uint8)
    items = []
    for e in range(4):
        items += [Item(f"x.experts.{e}.w.weight", data[e], "s", None, "data", "x.experts"),
                  Item(f"x.experts.{e}.w.weight_scale_inv", scale[e], "s", None, "scale", "x.experts")]
    items.append(Item("x.norm.weight", torch.randn(3, generator=g).to(torch.bfloat16), "n", None, None, "x.norm"))
    return items


def test_bucket_fill_is_one_cat_with_0xff_gaps_and_matches_slot_by_slot():
    items = _items()
    bucket = make_buckets([items[:-1], items[-1:]], 1 << 20)[0]
    got = InProcessTransport("cpu").send(bucket)
    for (name, t), it in zip(got, items, strict=True):
        assert name == it.name and torch.equal(t.reshape(-1).view(torch.uint8),
                                               it.tensor.reshape(-1).view(torch.uint8))
    flat = flatten(bucket, "cpu")  # the sender-side flattening is the same bytes
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
    fill_slots(buf, bucket)
    assert torch.equal(flat, buf)
    covered = torch.zeros(bucket.nbytes, dtype=torch.bool)
    for s in bucket.slots:
        covered[s.offset:s.offset + s.nbytes] = True
    assert bool((buf[~covered] == NAN_FILL).all()) and int((~covered).sum()) > 0
    # a slot without payload (a transport that skipped it) stays 0xFF: C5 counts it
    stripped = type(bucket)(bucket.index, bucket.slots, {n: t for n, t in bucket.payload.items()
                                                         if not n.endswith("scale_inv")}, bucket.nbytes,
                            bucket.groups, bucket.last)
    got = dict(InProcessTransport("cpu").send(stripped))
    assert all(bool((t.view(torch.uint8) == NAN_FILL).all()) for n, t in got.items() if n.endswith("scale_inv"))


@pytest.mark.gpu
def test_bucket_fill_and_batched_copy_on_cuda():
    items = [Item(it.name, it.tensor.cuda(), it.source, it.fmt, it.component, it.group) for it in _items()]
    bucket = make_buckets([items], 1 << 20)[0]
    got = InProcessTransport("cuda").send(bucket)
    for (_, t), it in zip(got, items, strict=True):
        assert torch.equal(t.reshape(-1).view(torch.uint8), it.tensor.reshape(-1).view(torch.uint8))
    stack = torch.zeros(4, 16, 64, device="cuda").to(torch.float8_e4m3fn)
    pairs = [(stack[e], t) for e, (_, t) in enumerate(got[0:8:2])]
    assert batched_copy(pairs) == 1
    assert all(torch.equal(stack[e].view(torch.uint8), items[2 * e].tensor.view(torch.uint8)) for e in range(4))
