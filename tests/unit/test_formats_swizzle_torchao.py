"""The cuBLAS 128x4 scale swizzle (CONTRACT 3) against an external implementation: torchao's ``to_blocked``
(``torchao.prototype.mx_formats.utils``), on random shapes including padding in both dims, and the offset
formula against the same bytes (a formula changed consistently in offset, swizzle and unswizzle
must fail here)."""

from __future__ import annotations

import warnings

import pytest
import torch

from miles_lp.formats import swizzle_scales, swizzled_offset, unswizzle_scales

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.utils import to_blocked

_G = torch.Generator().manual_seed(17)
SHAPES = [(128, 4), (1, 1), (127, 3), (129, 5), (256, 8), (300, 17)] + [
    (int(r), int(c)) for r, c in zip(torch.randint(1, 700, (12,), generator=_G),
                                     torch.randint(1, 70, (12,), generator=_G), strict=True)]


@pytest.mark.parametrize("rows,cols", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_swizzle_equals_torchao_to_blocked(rows, cols):
    s = torch.randint(1, 256, (rows, cols), dtype=torch.uint8, generator=_G)  # no zeros: padding is visible
    ours = swizzle_scales(s)
    theirs = to_blocked(s)
    assert torch.equal(ours.flatten(), theirs.flatten())
    assert torch.equal(unswizzle_scales(theirs, rows, cols), s)  # our inverse undoes THEIR layout
    flat = theirs.flatten()
    for r, c in [(0, 0), (rows - 1, cols - 1), (rows // 2, cols // 2), (min(rows - 1, 33), min(cols - 1, 5))]:
        assert flat[swizzled_offset(r, c, cols)] == s[r, c]


def test_swizzle_of_e4m3_and_expert_stacks_equals_torchao_per_matrix():
    s = torch.randint(0, 0x7F, (3, 130, 9), dtype=torch.uint8, generator=_G).view(torch.float8_e4m3fn)
    ours = swizzle_scales(s)
    for e in range(3):
        assert torch.equal(ours[e].view(torch.uint8).flatten(), to_blocked(s[e].view(torch.uint8)).flatten())
