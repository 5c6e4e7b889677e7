"""CUDA graph capture in a process whose threads share a GPU: one capture at a time, other threads left alone.

Several engines can serve from one process and one GPU (``launch/engines.py`` runs each engine's ``generate`` in
its own thread; the H200 rehearsal ran two reference engines so). ``torch.cuda.graph`` synchronizes the device,
collects garbage and empties the allocator's cache on entry, then captures; in CUDA's default (global) capture
mode any potentially unsafe call from ANY thread during a capture fails ("operation not permitted when stream is
capturing", seen when a second engine entered its own capture). So every capture here:

* holds ``CAPTURE_LOCK`` (process-wide, re-entrant) for the whole capture, its warm-up and entry synchronize
  included: two captures never overlap, and no capture's entry synchronize runs during another's;
* runs in ``capture_error_mode="thread_local"``: only the capturing thread's own unsafe calls are errors, so the
  other engines keep decoding (graph replays, eager prefill, allocations, host reads) while one captures.
  Chosen over a lock around every decode step of every engine sharing the device: that would serialize all
  decoding, and would have to cover every other CUDA user of the process too (prefill, sampling reads, the
  weight sync, a CUDA learner), which a capture-only lock need not know about.

Not yet run on a GPU: the CPU tests check the serialization with a stand-in capture context.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

#: held for the whole of any CUDA graph capture in this process (warm-up and capture)
CAPTURE_LOCK = threading.RLock()


@contextlib.contextmanager
def capturing(graph, pool=None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)`` in thread_local mode, under ``CAPTURE_LOCK``."""
    with CAPTURE_LOCK, torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        yield
