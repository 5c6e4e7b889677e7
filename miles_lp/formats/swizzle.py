"""cuBLAS 128x4 block-scale layout (CONTRACT 3), used by TE, FlashInfer and torchao for MXFP8 / NVFP4.

A compact scale matrix [rows, cols] is zero-padded to [Rp, Cp] = [ru(rows, 128), ru(cols, 4)] and
element (r, c) is stored at flat offset::

    off(r, c) = ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

i.e. 128x4 tiles in row-major tile order, each tile laid out as [r % 32][(r % 128) // 32][c % 4].
We return the swizzled bytes as a [..., Rp, Cp] tensor whose row-major flattening is that order.
"""

from __future__ import annotations

import torch

from miles_lp.errors import FormatError


def _ru(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _swap_1_3(ndim: int) -> list[int]:
    """Permutation swapping dims 1 and 3 of the trailing five (its own inverse)."""
    n = ndim - 5
    return [*range(n), n, n + 3, n + 2, n + 1, n + 4]


def swizzled_offset(r: int, c: int, cols: int) -> int:
    """The flat offset of compact scale (r, c) in the swizzled layout of a matrix with ``cols`` columns."""
    cp = _ru(cols, 4)
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def swizzle_scales(s: torch.Tensor) -> torch.Tensor:
    """Compact [..., rows, cols] scales (uint8 E8M0 or float8 E4M3) -> swizzled [..., Rp, Cp]."""
    if not isinstance(s, torch.Tensor) or s.dim() < 2:
        raise FormatError(f"swizzle_scales: expected a [..., rows, cols] tensor, got shape {getattr(s, 'shape', s)}")
    if s.element_size() != 1:
        raise FormatError(f"swizzle_scales: block scales are 1-byte types (E8M0 / E4M3), got {s.dtype}")
    dtype = s.dtype
    u = s.contiguous().view(torch.uint8)
    rows, cols = u.shape[-2], u.shape[-1]
    rp, cp = _ru(rows, 128), _ru(cols, 4)
    u = torch.nn.functional.pad(u, (0, cp - cols, 0, rp - rows))  # zeros
    t = u.reshape(*u.shape[:-2], rp // 128, 4, 32, cp // 4, 4)  # [..., rb, r4, r32, cb, c4]
    t = t.permute(*_swap_1_3(t.dim()))  # [..., rb, cb, r32, r4, c4]
    return t.reshape(*u.shape[:-2], rp, cp).contiguous().view(dtype)


def unswizzle_scales(s: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Swizzled [..., Rp, Cp] (or flat [..., Rp*Cp]) -> compact [..., rows, cols]."""
    rp, cp = _ru(rows, 128), _ru(cols, 4)
    if not isinstance(s, torch.Tensor) or s.element_size() != 1:
        raise FormatError("unswizzle_scales: expected a 1-byte scale tensor (E8M0 / E4M3)")
    dtype = s.dtype
    u = s.contiguous().view(torch.uint8)
    if s.dim() >= 2 and tuple(s.shape[-2:]) == (rp, cp):
        lead = tuple(s.shape[:-2])
    elif s.dim() >= 1 and s.shape[-1] == rp * cp:
        lead = tuple(s.shape[:-1])
    else:
        raise FormatError(
            f"unswizzle_scales: a swizzled tensor of shape {tuple(s.shape)} does not hold a {rows}x{cols} scale "
            f"matrix; expected [..., {rp}, {cp}] or [..., {rp * cp}] (padded to multiples of 128 x 4)"
        )
    t = u.reshape(*lead, rp // 128, cp // 4, 32, 4, 4)  # [..., rb, cb, r32, r4, c4]
    t = t.permute(*_swap_1_3(t.dim()))  # [..., rb, r4, r32, cb, c4]
    return t.reshape(*lead, rp, cp)[..., :rows, :cols].contiguous().view(dtype)
