"""Masked reductions over padded ``[B, T]`` tensors (``mask`` 1 = a response token that counts).

Every RL numeric in this package works on padded batches plus a mask, as verl's ``torch_functional``
helpers do, so the formulas read like theirs and the tests can be written by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked entries; 0 where nothing is masked in (never NaN: 0/0 is treated as empty)."""
    m = mask.to(x.dtype)
    n = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, mask, dim) / n.clamp_min(1.0)


def pad(rows: Sequence[torch.Tensor], value: float = 0.0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors into ``[B, T]``; returns (padded, mask) with mask 1 on the real entries."""
    width = max((int(r.numel()) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        n = int(r.numel())
        out[i, :n] = r.to(dtype)
        mask[i, :n] = 1.0
    return out, mask
