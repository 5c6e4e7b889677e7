"""WeightSync across two processes (gloo; NCCL on GPU runs the same code): the learner in rank 0 drives an engine
served in rank 1 through ``RemoteEngine`` + ``BroadcastTransport(receipts=True)`` + ``BroadcastReceiver.serve``;
every check in raise mode: a healthy sync is clean and byte-identical, an injected engine fault is caught by
its intended check on the learner's side."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

RECIPE = "policies/qwen3-moe-mxfp8-nvfp4-experts.yaml"
DROPPED = "*.experts.*.down_proj.weight"  # the engine's loader skips these: C2 must name them


def _worker(rank, port, hf, ckpt, out, backend="gloo"):
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = "cpu"
    if backend == "nccl":  # rank r on GPU r (one GPU: both on 0, which NCCL may refuse: the test then says so)
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        if backend == "nccl":  # NCCL builds its communicator at the first collective: fail here, not mid-sync
            try:
                dist.all_reduce(torch.ones(1, device=device))
            except Exception as exc:  # noqa: BLE001 (reported to the test, which skips or fails on it)
                out.put(("nccl_error", f"{type(exc).__name__}: {exc}"))
                return
        if rank == 1:
            from miles_lp.rollout.reference import EngineFaults, ReferenceEngine
            from miles_lp.sync.transport import BroadcastReceiver

            rx = BroadcastReceiver(src=0, device=device)
            healthy = ReferenceEngine(ckpt, device=device)
            applied = rx.serve(healthy, rank=1)
            digests = healthy.weight_digests()
            faulty = ReferenceEngine(ckpt, device=device, faults=EngineFaults(drop_updates=(DROPPED,)))
            rx.serve(faulty, rank=1)
            out.put(("engine", applied, digests))
            return
        from miles_lp.rollout.testing import policy_for
        from miles_lp.sync import SyncCheckError, SyncConfig, WeightSync
        from miles_lp.sync.items import engine_items
        from miles_lp.sync.remote import RemoteEngine
        from miles_lp.sync.transport import BroadcastTransport
        from miles_lp.train.config import TrainConfig
        from miles_lp.train.embedded import EmbeddedTrainer, plan_for_model

        plan = plan_for_model(policy_for(RECIPE), hf)
        learner = EmbeddedTrainer(hf, plan, TrainConfig(device=device, lr=5e-3))
        g = torch.Generator().manual_seed(0)
        learner.train_step([{"tokens": torch.randint(0, 100, (16,), generator=g)} for _ in range(2)])
        cfg = SyncConfig(bucket_mb=0.25).with_modes(all="raise")

        def sync(**kw):
            engine = RemoteEngine(engine_rank=1, learner_rank=0)
            tx = BroadcastTransport(src=0, device=device, receipts=True, reply_from=1)
            return engine, WeightSync(engine, plan, "sglang", cfg, transport=tx, env={}, log=lambda s: None, **kw)

        engine, ws = sync()
        first = ws.initial_sync(learner)  # full byte compare over the wire
        second = ws.sync(learner)  # the per-sync group digest
        expected = {it.name: it.tensor for it in engine_items(learner.export_weights(), "sglang", plan.layout)}
        engine.close()
        engine, ws = sync()
        caught = []
        for full in (True, False):
            try:
                ws.sync(learner, full_compare=full)
            except SyncCheckError as exc:
                caught.append(([v.name for v in exc.verdicts], exc.report.verdict("grid").examples))
        engine.close()
        from miles_lp.rollout.engine import tensor_digest

        out.put(("learner", first.ok, first.buckets, second.ok, second.verdict("grid").reason,
                 {n: tensor_digest(t) for n, t in expected.items()}, caught))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", [
    pytest.param("gloo", marks=pytest.mark.slow),  # two spawned processes, a learner and two engines: ~25 s of CPU
    pytest.param("nccl", marks=pytest.mark.gpu),  # the same over NCCL, rank r on GPU r
])
def test_weight_sync_drives_an_engine_in_another_process_with_every_check(backend):
    from miles_lp.rollout.testing import tiny_checkpoint, tiny_hf

    if backend == "nccl" and not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        pytest.skip("NCCL needs CUDA")
    hf, ckpt = tiny_hf("qwen3_moe"), tiny_checkpoint("qwen3_moe", RECIPE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, str(hf), str(ckpt), out, backend)) for r in range(2)]
    for p in procs:
        p.start()
    import queue
    import time

    got, t0 = {}, time.monotonic()
    while len(got) < 2 and time.monotonic() - t0 < 240:
        try:
            m = out.get(timeout=2)
            if m[0] == "nccl_error":
                for p in procs:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
                if "Duplicate GPU" in m[1] or "invalid usage" in m[1].lower():
                    pytest.skip(f"NCCL refuses two ranks on one GPU ({torch.cuda.device_count()} here): {m[1][:300]}")
                pytest.fail(f"NCCL did not start: {m[1]}")
            got[m[0]] = m[1:]
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank exited with {dead}"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    applied, engine_digests = got["engine"]
    first_ok, buckets, second_ok, grid_reason, expected, caught = got["learner"]
    assert first_ok and second_ok and buckets > 1 and applied == 2 * buckets
    assert "group digest" in grid_reason
    assert engine_digests == expected  # every tensor in the engine's process is the learner's export
    assert len(caught) == 2  # the faulty engine: caught by the full compare and by the per-sync digest
    for names, examples in caught:
        assert "grid" in names
        assert examples and all(".experts." in e and e.split(" ")[0].endswith("down_proj.weight") for e in examples)
