"""Megatron-Core on a CPU learner: the CUDA names it calls, answered for the CPU in the learner's thread only.

megatron-core 0.16.1 asks ``torch.cuda.current_device()`` for the device of tensors it makes or moves during a
forward (RoPE's ``inv_freq`` in ``RotaryEmbedding.get_emb`` and ``YarnRotaryEmbedding.get_emb``, the MoE router's
weight, tensor-parallel gather buffers), calls ``torch.cuda.synchronize()`` after the pipeline's shape exchange and
forks the CUDA RNG tracker around attention dropout (0 here). A learner with ``train.device: cpu`` must see "cpu",
a no-op and a tracker that does not fork, on a CPU-only host AND on a host with CUDA: there, unredirected, the
RoPE tables land on ``cuda:0`` next to CPU activations ("Expected all tensors to be on the same device, cuda:0 and
cpu", seen on an H200 with the learner's ranks on CPU).

Per thread, not per process: rank 0 runs in the driver process, where the rollout engines may run CUDA work
(decode steps, CUDA graph capture) in their own threads, and those must keep the real functions. So the three names
are replaced, while at least one thread is inside ``cpu_megatron``, by wrappers that answer for the CPU only in
threads inside it and call the saved originals everywhere else; the originals are put back when the last thread
leaves (no patch left behind).

Per caller, too: only Megatron's own code is answered for the CPU. torch itself asks the same names, and must get
the real ones: megatron-core wraps its fused functions (the MoE router's ``_apply_expert_bias``, activations) in
``torch.compile``, and dynamo, checking Triton on a host with CUDA, indexes the CUDA device properties by
``torch.cuda.current_device()`` ("list indices must be integers or slices, not str", seen on an H200 with the MoE
and DeepSeek-shaped learners on CPU).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_HERE = threading.local()  # .depth: how many cpu_megatron blocks this thread is inside
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"users": 0, "saved": None}


class _NoFork:
    def fork(self, *a, **k):
        return contextlib.nullcontext()


def inside() -> bool:
    """Whether this thread is inside ``cpu_megatron`` (its CUDA names answered for the CPU)."""
    return getattr(_HERE, "depth", 0) > 0


def _called_from_megatron() -> bool:
    """Whether the function that called the redirected name (two frames up) belongs to megatron-core."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == "megatron" or caller.startswith("megatron.")


def _per_thread(original: Callable, here: Callable) -> Callable:
    def redirected(*a, **k):
        return here(*a, **k) if inside() and _called_from_megatron() else original(*a, **k)

    redirected.__wrapped__ = original  # type: ignore[attr-defined]
    return redirected


def _install() -> None:
    import megatron.core.tensor_parallel as tp

    with _LOCK:
        if _STATE["users"] == 0:
            saved = (torch.cuda.current_device, torch.cuda.synchronize, tp.get_cuda_rng_tracker)
            _STATE["saved"] = saved
            torch.cuda.current_device = _per_thread(saved[0], lambda: "cpu")
            torch.cuda.synchronize = _per_thread(saved[1], lambda *a, **k: None)
            tp.get_cuda_rng_tracker = _per_thread(saved[2], lambda *a, **k: _NoFork())
        _STATE["users"] += 1


def _uninstall() -> None:
    import megatron.core.tensor_parallel as tp

    with _LOCK:
        _STATE["users"] -= 1
        if _STATE["users"] == 0:
            torch.cuda.current_device, torch.cuda.synchronize, tp.get_cuda_rng_tracker = _STATE["saved"]
            _STATE["saved"] = None


@contextlib.contextmanager
def cpu_megatron(device: torch.device) -> Iterator[None]:
    """While a CPU learner builds or runs its Megatron model (nests; no-op for a CUDA learner): in this thread,
    to megatron-core's callers, ``torch.cuda.current_device`` -> "cpu", ``torch.cuda.synchronize`` does nothing,
    the CUDA RNG tracker's ``fork()`` does nothing; other threads and other callers keep the real functions."""
    if torch.device(device).type != "cpu":
        yield
        return
    _install()
    _HERE.depth = getattr(_HERE, "depth", 0) + 1
    try:
        yield
    finally:
        _HERE.depth -= 1
        _uninstall()
