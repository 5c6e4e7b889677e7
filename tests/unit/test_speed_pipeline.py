"""checkpoint.pipeline: order kept where it matters, memory bounded, errors surfaced, digests right."""

from __future__ import annotations

import hashlib
import random
import threading
import time

import pytest
import torch

from miles_lp.checkpoint import pipeline
from miles_lp.errors import CheckpointError
from miles_lp.io.safetensors_io import ShardWriter, open_checkpoint


def _jobs(n: int = 40):
    return [(f"t{i}",) for i in range(n)]


@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_load_and_sink_in_order_work_in_any(workers):
    loaded, sunk, worked_on = [], [], set()
    rng = random.Random(0)

    def load(job):
        loaded.append(job)
        return job[0].upper()

    def work(job, x):
        time.sleep(rng.random() * 0.002)  # finish out of order
        worked_on.add(threading.current_thread().name)
        return x + "!"

    def sink(job, out):
        assert out == job[0].upper() + "!"
        sunk.append(job)

    clock = pipeline.run(_jobs(), load, work, sink, workers=workers)
    assert loaded == _jobs() and sunk == _jobs()
    assert clock.workers == workers and pipeline.last_clock() is clock
    assert clock.wall > 0 and clock.seconds["quantize"] > 0 and set(clock.cpu) >= set(pipeline.STAGES)
    if workers >= 2:
        assert len(worked_on) >= 2  # the work really ran on several threads


def test_inflight_bytes_stay_under_the_budget():
    sizes = {f"t{i}": (i % 5 + 1) * 10 for i in range(60)}
    sizes["t30"] = 500  # larger than the budget: runs alone
    state = {"inflight": 0, "peak": 0, "alone": None}
    lock = threading.Lock()

    def load(job):
        with lock:
            state["inflight"] += sizes[job[0]]
            state["peak"] = max(state["peak"], state["inflight"]) if job[0] != "t30" else state["peak"]
            if job[0] == "t30":
                state["alone"] = state["inflight"] == 500
        return job

    def sink(job, out):
        time.sleep(0.001)
        with lock:
            state["inflight"] -= sizes[job[0]]

    pipeline.run([(n,) for n in sizes], load, lambda j, x: x, sink, nbytes=lambda j: sizes[j[0]], workers=2,
                 max_inflight_bytes=100)
    assert state["peak"] <= 100 and state["alone"] is True and state["inflight"] == 0


@pytest.mark.parametrize("stage", ["load", "work", "sink"])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_first_error_of_any_stage_is_raised_unchanged(stage, workers):
    sunk = []

    def maybe_fail(where, job):
        if where == stage and job == ("t7",):
            raise CheckpointError("tensor 't7' is broken")

    def load(job):
        maybe_fail("load", job)
        return job

    def work(job, x):
        maybe_fail("work", job)
        return x

    def sink(job, out):
        maybe_fail("sink", job)
        sunk.append(job)

    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="tensor 't7' is broken"):
        pipeline.run(_jobs(2000), load, work, sink, workers=workers)
    assert time.perf_counter() - t0 < 30  # stopped, not run to the end / hung
    assert ("t7",) not in sunk and sunk == _jobs(len(sunk))  # nothing after a gap was written
    assert not [t for t in threading.enumerate() if t.name.startswith("miles-lp-") and t.is_alive()]


def test_env_switch_makes_it_sequential(monkeypatch):
    monkeypatch.setenv("MILES_LP_PIPELINE", "0")
    threads = set()
    pipeline.run(_jobs(5), lambda j: j, lambda j, x: threads.add(threading.current_thread().name), lambda j, o: None)
    assert threads == {threading.current_thread().name} and pipeline.last_clock().workers == 0
    monkeypatch.setenv("MILES_LP_PIPELINE", "3")
    assert pipeline.default_workers() == 3


def test_jobs_group_consecutive_members_and_refuse_others():
    g = ("a.gate", "a.up")
    assert pipeline.jobs_in_storage_order(["x", "a.gate", "a.up", "y"], {n: g for n in g}) == [
        ("x",), ("a.gate", "a.up"), ("y",)]
    with pytest.raises(CheckpointError, match=r"\['a.gate'\] are not consecutive"):
        pipeline.jobs_in_storage_order(["x", "a.gate"], {n: g for n in g})


def _checkpoint(tmp_path, n: int = 30, shard: int = 20_000):
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(tmp_path, shard)
    for i in range(n):
        w.add(f"w{i:02d}", torch.randn(7 + i, 33, generator=g).to(torch.bfloat16))
    w.finish()
    return open_checkpoint(tmp_path)


def test_hashing_reader_digests_equal_sha256_and_fall_back_when_out_of_order(tmp_path):
    ck = _checkpoint(tmp_path)
    assert len(ck.files) >= 3
    want = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in ck.files}
    clock = pipeline.Clock()
    reader = pipeline.HashingReader(clock, max_backlog=10_000)  # a small backlog: the reader waits for the hasher
    headers = list(ck.tensors.values())
    first_file = [h for h in headers if h.file == ck.files[0]]
    order = [first_file[1], first_file[0]] + [h for h in headers if h.file != ck.files[0]]  # file 0 out of order
    for h in order:
        x = reader.read(h)
        assert torch.equal(x, torch.frombuffer(bytearray(h.file.read_bytes()[h.begin:h.end]),
                                               dtype=torch.bfloat16).view(h.shape))
    reader.close()
    assert ck.files[0] not in reader.digests  # out of order: the caller hashes that file itself
    assert {p: d for p, d in reader.digests.items()} == {p: want[p] for p in ck.files[1:]}
    assert clock.seconds["hash"] > 0


def test_hashing_reader_detects_a_tampered_file(tmp_path):
    ck = _checkpoint(tmp_path)
    reader = pipeline.HashingReader()
    for h in ck.tensors.values():
        reader.read(h)
    reader.close()
    before = dict(reader.digests)
    p = ck.files[1]
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    reader = pipeline.HashingReader()
    for h in ck.tensors.values():
        reader.read(h)
    reader.close()
    assert [f for f in ck.files if reader.digests[f] != before[f]] == [p]
