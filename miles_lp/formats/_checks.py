"""Input validation shared by the codecs: every refusal is a ``FormatError`` naming shape, rule and fix."""

from __future__ import annotations

import torch

from miles_lp.errors import FormatError
from miles_lp.formats.spec import NVFP4_BLOCK

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


NVFP4_SCOPES = ("tensor", "row")


def check_nvfp4(x: object, scope: str, block_2d: bool, name: str | None) -> None:
    """NVFP4's refusals (the codec and the kernels): the input, the scope, K a multiple of 16 and, for 2-D
    tiles, the rows a multiple of 16 with scope 'tensor'."""
    check_input(x, "NVFP4", min_dim=2, name=name)
    if scope not in NVFP4_SCOPES:
        raise FormatError(f"NVFP4: scale_scope={scope!r} is not one of {NVFP4_SCOPES} ({what(name, x)})")
    check_multiple(x, "NVFP4", -1, NVFP4_BLOCK, name=name, axis_label="K (axis=-1, 16-blocks)")
    if block_2d:
        if scope == "row":
            raise FormatError(
                f"NVFP4: {what(name, x)}: block_2d=True cannot be combined with scale_scope='row' "
                "(TE refuses row-scaled 2D quantization); 2D tiles are for weights, use scope 'tensor'"
            )
        check_multiple(x, "NVFP4 block_2d", -2, NVFP4_BLOCK, name=name,
                       axis_label="rows (axis=-2, 16x16 tiles)")
