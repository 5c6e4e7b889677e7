"""The broadcast transport's logic between 2 CPU processes (gloo; NCCL on GPU runs the same code)."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp


def _items(seed):
    from miles_lp.formats import quantize_mxfp8
    from miles_lp.sync.items import engine_items

    g = torch.Generator().manual_seed(seed)
    q = quantize_mxfp8(torch.randn(64, 64, generator=g))
    return engine_items([("model.layers.0.mlp.down_proj.weight", q),
                         ("model.norm.weight", torch.randn(64, generator=g).to(torch.bfloat16))], "sglang")


def _worker(rank, port, out):
    import torch.distributed as dist

    from miles_lp.sync.buckets import Ledger, make_buckets
    from miles_lp.sync.items import group_items
    from miles_lp.sync.transport import BroadcastReceiver, BroadcastTransport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        items = _items(0)
        buckets = make_buckets(group_items(items), 256)  # several buckets
        if rank == 0:
            tx = BroadcastTransport(src=0)
            for b in buckets:
                assert tx.send(b) == []
            tx.close()
        else:
            ledger = Ledger(frozenset(it.name for it in items))
            got = {}
            for index, slots, received in BroadcastReceiver(src=0).receive():
                ledger.received(index, received, {s.name: s.is_scale for s in slots})
                got.update({n: t.clone() for n, t in received})
            same = all(torch.equal(got[it.name].reshape(-1).view(torch.uint8), it.tensor.reshape(-1).view(torch.uint8))
                       for it in items)
            out.put((len(buckets), ledger.buckets_received, ledger.problems(), same))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes: ~10 s on 2 cores
def test_gloo_broadcast_delivers_every_bucket_byte_identical():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    sent, received, problems, same = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sent > 1 and received == sent
    assert problems == {"missing": [], "repeated": [], "unexpected": [], "unwritten_scale_bytes": []}
    assert same
