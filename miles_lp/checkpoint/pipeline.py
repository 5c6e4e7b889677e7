"""Overlap reading, quantizing and writing a checkpoint: a reader thread, worker threads, a writer thread.

    reader thread:   load(job) in order (positioned reads; the sha256 of each file on its own thread)
    worker threads:  work(job, loaded) -> outputs, any order (the codecs release the GIL: both cores)
    writer thread:   sink(job, outputs) in job order (the shard writer: same shards, same bytes)

``run`` keeps the jobs' order wherever it matters: ``load`` and ``sink`` see the jobs in the order given,
so the output shards (which tensor goes to which shard, and each shard's bytes) are exactly those of a
sequential loop. Only ``work`` runs out of order; it must not depend on the other jobs.

Memory is bounded: the reader stops while more than ``max_inflight_bytes`` of loaded input is waiting for
its job to be written (a job larger than that runs alone). Errors: the first exception raised by any stage
stops the others and is re-raised by ``run`` in the caller's thread, unchanged (a ``CheckpointError``
keeps its message). ``workers=0`` runs the three stages in the caller's thread, one job at a time
(``MILES_LP_PIPELINE=0`` forces it: a reference for the tests and for profiling).

``Clock`` records, per stage, the busy seconds (wall time inside the stage, summed over threads: the stages
overlap, so they add up to more than the run's wall time) and the CPU seconds (``time.thread_time``: what
the stage costs, whatever else runs on the machine) for ``miles-lp bench convert``; ``last_clock()`` is the
most recent run's.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from miles_lp.config import switch

STAGES = ("read", "hash", "quantize", "write")
DEFAULT_WORKERS = 2  # this machine has 2 cores; the reader, hasher and writer mostly wait on the kernel


@dataclasses.dataclass
class Clock:
    """Busy and CPU seconds per stage (thread-safe ``add``), the run's wall time and its worker count."""

    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    cpu: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    wall: float = 0.0
    workers: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, stage: str, seconds: float, cpu: float = 0.0) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self.cpu[stage] = self.cpu.get(stage, 0.0) + cpu

    def timed(self, stage: str, fn: Callable, *args):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args)
        finally:
            self.add(stage, time.perf_counter() - t0, time.thread_time() - c0)

    def as_dict(self) -> dict:
        return {"wall": round(self.wall, 4), "workers": self.workers,
                "busy": {k: round(v, 4) for k, v in self.seconds.items()},
                "cpu": {k: round(v, 4) for k, v in self.cpu.items()}}


_LAST: Clock | None = None


def last_clock() -> Clock | None:
    """The ``Clock`` of the most recent ``run`` in this process (None before the first)."""
    return _LAST


def default_workers() -> int:
    """``runtime.pipeline_workers`` (0 = sequential, N = N workers; debugging override ``MILES_LP_PIPELINE``), else
    ``DEFAULT_WORKERS``, at most the CPUs."""
    workers = switch("pipeline_workers")
    if workers is not None:
        return workers
    return max(1, min(DEFAULT_WORKERS, os.cpu_count() or 1))


class _Stop(Exception):
    """Raised inside a stage when another stage failed (never escapes ``run``)."""


def run(jobs: Sequence, load: Callable[[Any], Any], work: Callable[[Any, Any], Any],
        sink: Callable[[Any, Any], None], *, nbytes: Callable[[Any], int] = lambda job: 0,
        workers: int | None = None, max_inflight_bytes: int = 1 << 30, clock: Clock | None = None) -> Clock:
    """Run ``sink(job, work(job, load(job)))`` for every job: ``load`` and ``sink`` in order, each on its own
    thread, ``work`` on ``workers`` threads. ``nbytes(job)``: the input bytes a job holds from its load to its
    sink (the memory bound). Returns the ``Clock`` (read / quantize / write busy seconds; ``hash`` is added
    by a ``HashingReader`` given the same clock)."""
    global _LAST
    clock = clock or Clock()
    workers = default_workers() if workers is None else workers
    clock.workers = workers
    _LAST = clock
    t0 = time.perf_counter()
    try:
        if workers <= 0:
            for job in jobs:
                loaded = clock.timed("read", load, job)
                out = clock.timed("quantize", work, job, loaded)
                del loaded
                clock.timed("write", sink, job, out)
        else:
            _Threads(jobs, load, work, sink, nbytes, workers, max_inflight_bytes, clock).run()
    finally:
        clock.wall = time.perf_counter() - t0
    return clock


class _Threads:
    def __init__(self, jobs, load, work, sink, nbytes, workers, budget, clock) -> None:
        self.jobs, self.load, self.work, self.sink, self.nbytes = list(jobs), load, work, sink, nbytes
        self.workers, self.budget, self.clock = workers, budget, clock
        self.todo: queue.Queue = queue.Queue(maxsize=max(2, 2 * workers))  # (index, job, loaded) | None
        self.done: dict[int, Any] = {}
        self.cv = threading.Condition()
        self.inflight = 0  # input bytes loaded and not yet sunk
        self.error: BaseException | None = None

    def _fail(self, exc: BaseException) -> None:
        with self.cv:
            if self.error is None:
                self.error = exc
            self.cv.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise _Stop

    def _reader(self) -> None:
        try:
            for i, job in enumerate(self.jobs):
                n = self.nbytes(job)
                with self.cv:  # wait for room (a job larger than the budget waits until nothing is in flight)
                    self.cv.wait_for(lambda n=n: self.error is not None or self.inflight == 0
                                     or self.inflight + n <= self.budget)
                    self._check()
                    self.inflight += n
                loaded = self.clock.timed("read", self.load, job)
                while True:  # a bounded put that notices a failure elsewhere
                    self._check()
                    try:
                        self.todo.put((i, job, loaded), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                del loaded
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._fail(exc)
        finally:
            for _ in range(self.workers):
                self._put_final()

    def _put_final(self) -> None:
        while True:
            try:
                self.todo.put(None, timeout=0.1)
                return
            except queue.Full:
                if self.error is not None:  # nobody may be draining: drop work to make room
                    try:
                        self.todo.get_nowait()
                    except queue.Empty:
                        pass

    def _worker(self) -> None:
        try:
            while True:
                item = self.todo.get()
                if item is None:
                    return
                self._check()
                i, job, loaded = item
                out = self.clock.timed("quantize", self.work, job, loaded)
                del item, loaded
                with self.cv:
                    self.done[i] = out
                    self.cv.notify_all()
                del out
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)

    def _writer(self) -> None:
        try:
            for i, job in enumerate(self.jobs):
                with self.cv:
                    self.cv.wait_for(lambda i=i: self.error is not None or i in self.done)
                    self._check()
                    out = self.done.pop(i)
                self.clock.timed("write", self.sink, job, out)
                del out
                with self.cv:
                    self.inflight -= self.nbytes(job)
                    self.cv.notify_all()
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)

    def run(self) -> None:
        threads = [threading.Thread(target=self._reader, name="miles-lp-read", daemon=True),
                   threading.Thread(target=self._writer, name="miles-lp-write", daemon=True)]
        threads += [threading.Thread(target=self._worker, name=f"miles-lp-quantize-{k}", daemon=True)
                    for k in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self.error is not None:
            raise self.error


class HashingReader:
    """Reads tensors in storage order and computes each source file's sha256 in the same pass.

    The tensors of a file are read in ascending offset; the gaps (header, padding) are read and hashed too,
    so each file is read once. A tensor read out of order makes that file be hashed separately at the end
    (``digests`` then lacks it: the caller hashes it, e.g. ``io.safetensors_io.sha256_file``). Hashing runs on one
    background thread, in submission order (``hashlib`` releases the GIL), at most ``max_backlog`` bytes
    behind; its busy time goes to ``clock`` as "hash". A returned tensor must not be modified in place
    before ``close()`` (it may still be waiting to be hashed). One thread calls ``read`` (the reader).
    """

    def __init__(self, clock: Clock | None = None, max_backlog: int = 1 << 27) -> None:
        self.clock = clock or Clock()
        self.digests: dict[Path, str] = {}
        self._f = None
        self._path: Path | None = None
        self._pos = 0
        self._h = None
        self._pool = None
        self._backlog: collections.deque = collections.deque()  # (future, nbytes), oldest first
        self._backlog_bytes = 0
        self._max_backlog = max_backlog

    def _hash(self, h, data) -> None:
        self.clock.timed("hash", h.update, data)

    def _submit(self, fn, *args, nbytes: int = 0) -> None:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="miles-lp-sha256")
        self._backlog.append((self._pool.submit(fn, *args), nbytes))
        self._backlog_bytes += nbytes
        while self._backlog and (self._backlog[0][0].done() or self._backlog_bytes > self._max_backlog):
            fut, n = self._backlog.popleft()
            fut.result()  # waits if over the backlog; re-raises a hashing error here
            self._backlog_bytes -= n

    def read(self, h):
        import torch

        from miles_lp.io.safetensors_io import read_tensor

        if self._path != h.file:
            self._finish()
            self._f = open(h.file, "rb", buffering=0)
            self._path, self._pos, self._h = h.file, 0, hashlib.sha256()
        if self._h is not None and h.begin >= self._pos:
            if h.begin > self._pos:
                self._f.seek(self._pos)
                self._submit(self._hash, self._h, self._f.read(h.begin - self._pos))
            t = read_tensor(h, self._f)
            self._submit(self._hash, self._h, memoryview(t.reshape(-1).view(torch.uint8).numpy()), nbytes=h.nbytes)
            self._pos = h.end
            return t
        self._h = None  # out of order: this file is hashed separately
        return read_tensor(h, self._f)

    def _finish(self) -> None:
        if self._f is None:
            return
        if self._h is not None:
            self._f.seek(self._pos)
            while chunk := self._f.read(1 << 24):
                self._submit(self._hash, self._h, chunk, nbytes=len(chunk))
            self._submit(self._store_digest, self._path, self._h)  # after the file's last update
        self._f.close()
        self._f, self._path, self._h = None, None, None

    def _store_digest(self, path: Path, h) -> None:
        self.digests[path] = h.hexdigest()

    def close(self) -> None:
        """Finish the open file and wait for every digest (re-raises a hashing error)."""
        try:
            self._finish()
        finally:
            if self._pool is not None:
                try:
                    while self._backlog:
                        self._backlog.popleft()[0].result()
                finally:
                    self._backlog_bytes = 0
                    self._pool.shutdown(wait=True)
                    self._pool = None


def jobs_in_storage_order(names: Iterable[str], groups: dict[str, tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Jobs for ``run``: one per tensor, in ``names``' order, except that the members of a group in
    ``groups`` (``{member: group}``, e.g. convert's inline gate/up groups, consecutive in storage order)
    form one job, placed where its last member is."""
    jobs: list[tuple[str, ...]] = []
    held: list[str] = []
    for name in names:
        group = groups.get(name)
        if group is None:
            jobs.append((name,))
            continue
        held.append(name)
        if len(held) == len(group):
            jobs.append(tuple(held))
            held = []
    if held:
        from miles_lp.errors import CheckpointError

        raise CheckpointError(f"internal: joint-scale group members {held} are not consecutive in storage order")
    return jobs
