"""Measure what autograd keeps for backward (``torch.autograd.graph.saved_tensors_hooks``).

    with SavedTensors() as saved:
        y = layer(x)
    saved.bytes                     # every distinct tensor handed to save_for_backward, in bytes
    saved.bytes_excluding(params)   # ... not counting tensors that share storage with ``params``

Tensors are de-duplicated by (data pointer, shape, stride, dtype): the same tensor saved twice counts once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedTensors:
    """Context manager recording the tensors saved for backward inside it."""

    def __init__(self):
        self.records: dict[tuple, torch.Tensor] = {}
        self._ctx = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
        self.records.setdefault(key, t)
        return t

    def __enter__(self) -> SavedTensors:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @property
    def bytes(self) -> int:
        return sum(self._nbytes(t) for t in self.records.values())

    def bytes_excluding(self, tensors: Iterable[torch.Tensor]) -> int:
        """Saved bytes that do not alias the storage of ``tensors`` (e.g. the parameters)."""
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        return sum(self._nbytes(t) for t in self.records.values()
                   if t.untyped_storage().data_ptr() not in ptrs)

    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.records.values():
            out[str(t.dtype).replace("torch.", "")] = out.get(str(t.dtype).replace("torch.", ""), 0) + self._nbytes(t)
        return out
