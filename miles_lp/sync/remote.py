"""``WeightSync`` across processes over ``torch.distributed``: the engine in its own rank, every check on the
learner's side, the bytes through the broadcast transport (NCCL on GPU, as SGLang's
``update_weights_from_distributed``; gloo on CPU, which the tests use).

    # engine rank (the process that holds the engine)
    BroadcastReceiver(src=learner_rank, device=engine.device).serve(engine, rank=engine_rank)

    # learner rank
    engine = RemoteEngine(engine_rank=1, learner_rank=0)
    sync = WeightSync(engine, plan, target, config,
                      transport=BroadcastTransport(src=0, device=learner_device, receipts=True, reply_from=1))
    sync.initial_sync(learner); ...; engine.close()

One ``torch.distributed`` group carries three kinds of message, in the same order on both ranks (collectives):
a *call* (``("call", method, args, kwargs)``, broadcast by the learner; the engine rank runs it on its engine and
broadcasts ``("ok", value)`` or ``("error", type name, message)`` back), a *bucket* (``("bucket", index, slots,
nbytes)`` then the bytes; the engine rank receives them into its 0xFF-filled staging buffer, calls
``engine.update_weights`` at once and broadcasts a ``Receipt``: the names written and the 0xFF byte count of each
scale as received, C5's ledger input, or the update's error) and *end* (the engine rank stops serving). So the
same ``WeightSync`` runs pause -> begin -> buckets -> finish and every check (C1 from the remote
``quantized_params``, C2 from its group digests, C3 its self-check, C4 its pointers, C5 from the receipts) whatever
the process boundary. The messages are ``broadcast_object_list`` pickles between the ranks of one job (as
torch.distributed's own object collectives and SGLang's weight-update path use); never open such a group to a
process you do not run.

With NCCL each rank must have called ``torch.cuda.set_device`` first (object collectives stage on the current
device), the learner's transport ``device`` and the receiver's are the two ranks' GPUs. Not run on two GPUs
here (the 2-GPU machine is not lent): the CPU test runs the same code over gloo.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from miles_lp.errors import BackendUnavailable
from miles_lp.rollout.engine import EngineBusy, EngineError, WeightUpdateError

_ERRORS: dict[str, type[Exception]] = {"WeightUpdateError": WeightUpdateError, "EngineBusy": EngineBusy,
                                       "EngineError": EngineError, "BackendUnavailable": BackendUnavailable,
                                       "NotImplementedError": NotImplementedError}

@dataclasses.dataclass(frozen=True)
class Receipt:
    """What the engine rank received and applied for one bucket (C5's ledger input, across processes)."""

    index: int
    names: tuple[str, ...]  # every tensor delivered, in slot order
    ff: dict[str, int]  # 0xFF bytes per scale tensor as received (more than the sender's: a missed write)
    error: str | None = None  # the engine refused the bucket (update_weights raised): type name and message


def pack(value: Any) -> Any:
    """``value`` with every tensor as ``("__tensor__", dtype, shape, raw bytes)`` (host copy): results travel as
    plain bytes, not as pickled tensors (torch's tensor unpickling is not what an object collective should
    run, and it fails here for float8 storages)."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return ("__tensor__", str(t.dtype).removeprefix("torch."), tuple(t.shape),
                t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(value, dict):
        return {k: pack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(pack(v) for v in value)
    return value


def unpack(value: Any) -> Any:
    import torch

    if isinstance(value, tuple) and len(value) == 4 and value[0] == "__tensor__":
        _, dtype, shape, raw = value
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    if isinstance(value, dict):
        return {k: unpack(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(unpack(v) for v in value)
    return value


def raise_remote(kind: str, message: str, rank: int) -> None:
    cls = _ERRORS.get(kind, EngineError)
    raise cls(f"(engine rank {rank}) {kind}: {message}" if cls is EngineError and kind != "EngineError"
              else f"(engine rank {rank}) {message}")


class RemoteEngine:
    """The learner's handle of an engine that ``BroadcastReceiver.serve`` runs in rank ``engine_rank``: every
    method the engine has (asked once: ``surface``) is a call over the group; attributes such as
    ``weight_version`` are read remotely. ``update_weights`` is not: the bytes go through the broadcast
    transport, which the engine rank applies on arrival (``Receipt``)."""

    def __init__(self, group: Any = None, engine_rank: int = 1, learner_rank: int = 0):
        self.group, self.engine_rank, self.learner_rank = group, engine_rank, learner_rank
        self._closed = False
        methods, attrs = self._request(("surface",))
        self._methods, self._attrs = set(methods) - {"update_weights"}, set(attrs)

    def _request(self, msg: tuple) -> Any:
        import torch.distributed as dist

        if self._closed:
            raise EngineError("the remote engine was closed")
        dist.broadcast_object_list([pack(msg)], src=self.learner_rank, group=self.group)
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.engine_rank, group=self.group)
        status, *rest = box[0]
        if status == "error":
            raise_remote(rest[0], rest[1], self.engine_rank)
        return unpack(rest[0])

    @property
    def weight_version(self) -> int:
        return int(self._request(("getattr", "weight_version")))

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self.__dict__.get("_attrs", ()):
            return self._request(("getattr", name))
        if name not in self.__dict__.get("_methods", ()):  # hasattr(engine, "weight_group_fingerprints") is honest
            raise AttributeError(f"the remote engine has no method {name!r}")
        return lambda *args, **kwargs: self._request(("call", name, args, kwargs))

    def close(self) -> None:
        """Stop the engine rank's serving loop (the engine itself stays with its process)."""
        import torch.distributed as dist

        if not self._closed:
            dist.broadcast_object_list([("end",)], src=self.learner_rank, group=self.group)
            self._closed = True


def surface(engine: Any) -> tuple[list[str], list[str]]:
    """The public methods and plain attributes an engine rank offers."""
    methods, attrs = [], []
    for name in dir(engine):
        if name.startswith("_"):
            continue
        try:
            value = getattr(engine, name)
        except Exception:  # a property that cannot be read now: not offered
            continue
        if callable(value):
            methods.append(name)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            attrs.append(name)
    return methods, attrs


def answer(engine: Any, msg: tuple) -> tuple:
    """The engine rank's reply to a call (never raises: an error travels back to the learner)."""
    try:
        if msg[0] == "surface":
            return ("ok", surface(engine))
        if msg[0] == "getattr":
            return ("ok", pack(getattr(engine, msg[1])))
        _, name, args, kwargs = unpack(msg)
        if name.startswith("_") or name == "update_weights":
            raise EngineError(f"'{name}' cannot be called remotely")
        return ("ok", pack(getattr(engine, name)(*args, **kwargs)))
    except Exception as exc:  # noqa: BLE001 - every failure is reported to the caller, by type name
        return ("error", type(exc).__name__, str(exc))
