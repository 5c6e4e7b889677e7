"""Input validation shared by the codecs: every refusal is a ``FormatError`` naming shape, rule and fix."""

from __future__ import annotations

import torch

from miles_lp.errors import FormatError

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)
KEEP_BF16 = "keep this tensor BF16 with a policy rule"


def what(name: str | None, x: torch.Tensor) -> str:
    """'tensor <name> of shape (a, b)' or 'tensor of shape (a, b)'."""
    shape = tuple(x.shape)
    return f"tensor {name!r} of shape {shape}" if name else f"tensor of shape {shape}"


def check_input(x: object, fmt: str, *, min_dim: int, name: str | None = None) -> torch.Tensor:
    """Refuse non-tensors, non-float dtypes (ints, float8, ...), empty tensors and too few dims."""
    if not isinstance(x, torch.Tensor):
        raise FormatError(f"{fmt}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUTS:
        raise FormatError(
            f"{fmt}: {what(name, x)} has dtype {x.dtype}; the codecs quantize float32, bfloat16 or float16 "
            "input only (quantize from the full-precision tensor, never from an already quantized one)"
        )
    if x.numel() == 0:
        raise FormatError(f"{fmt}: {what(name, x)} is empty; there is nothing to quantize ({KEEP_BF16})")
    if x.dim() < min_dim:
        need = "a 2-D [rows, K] matrix (or a stack [..., rows, K])" if min_dim == 2 else f"{min_dim} dims"
        raise FormatError(f"{fmt}: {what(name, x)} has {x.dim()} dim(s); the format needs {need}")
    return x


def check_multiple(x: torch.Tensor, fmt: str, dim: int, block: int, *, name: str | None = None,
                   axis_label: str | None = None) -> None:
    """Refuse a reduction dim that is not a multiple of the block (we refuse rather than pad)."""
    n = x.shape[dim]
    if n % block:
        label = axis_label or f"axis={dim}"
        raise FormatError(
            f"{fmt}: {what(name, x)} cannot be block-scaled along {label}: dim {dim} has {n} elements, "
            f"not a multiple of the block of {block}; {KEEP_BF16} (the codecs refuse rather than pad)"
        )
