"""Tensors across Ray actor boundaries as raw bytes.

Ray's pickling of torch storages fails for some dtypes (``float8_e4m3fn`` payloads of MXFP8 / NVFP4 tensors:
"UntypedStorage has no attribute dtype" on deserialization), so every tensor crossing an actor boundary is
sent as ``(dtype, shape, bytes)`` and rebuilt on the far side, bit for bit. ``pack`` / ``unpack`` walk dicts,
lists, tuples and dataclasses (``Generation``, ``MXFP8Tensor``, ...).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class WireTensor:
    dtype: str
    shape: tuple[int, ...]
    data: bytes


def pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return WireTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [pack(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(pack(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, WireTensor):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, pack(getattr(obj, f.name)))
        return out
    return obj


def unpack(obj: Any) -> Any:
    if isinstance(obj, WireTensor):
        dtype = getattr(torch, obj.dtype)
        if not obj.data:
            return torch.empty(obj.shape, dtype=dtype)
        return torch.frombuffer(bytearray(obj.data), dtype=torch.uint8).view(dtype).reshape(obj.shape)
    if isinstance(obj, dict):
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(unpack(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(out, f.name, unpack(getattr(obj, f.name)))
        return out
    return obj
