"""cuBLAS 128x4 scale layout (CONTRACT 3): hand-checked offsets, round trip with padding, leading dims."""

from __future__ import annotations

import pytest
import torch

from miles_lp.errors import FormatError
from miles_lp.formats import quantize_mxfp8, swizzle_scales, swizzled_offset, unswizzle_scales


def test_offsets_by_hand():
    # cols = 6 -> Cp = 8 (two 4-column tiles per 128-row band), tiles are 512 bytes
    assert swizzled_offset(0, 0, 6) == 0
    assert swizzled_offset(0, 3, 6) == 3  # c % 4
    assert swizzled_offset(0, 4, 6) == 512  # next column tile
    assert swizzled_offset(1, 0, 6) == 16  # (r % 32) * 16
    assert swizzled_offset(32, 0, 6) == 4  # ((r % 128) // 32) * 4
    assert swizzled_offset(33, 1, 6) == 16 + 4 + 1
    assert swizzled_offset(127, 5, 6) == 512 + 31 * 16 + 3 * 4 + 1
    assert swizzled_offset(128, 0, 6) == 2 * 512  # next row band: (r // 128) * (Cp // 4) tiles
    assert swizzled_offset(200, 7, 6) == (2 + 1) * 512 + (200 % 32) * 16 + 2 * 4 + 3


def test_every_offset_and_the_zero_padding():
    rows, cols = 130, 5
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
    w = swizzle_scales(s)
    assert w.shape == (256, 8)
    flat = w.flatten()
    seen = torch.zeros(flat.numel(), dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            off = swizzled_offset(r, c, cols)
            assert flat[off].item() == s[r, c].item()
            seen[off] = True
    assert (flat[~seen] == 0).all()  # padding is zeros


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (129, 3), (300, 17), (4, 256, 8), (2, 3, 40, 6)])
def test_round_trip_with_leading_dims(shape):
    s = torch.randint(0, 256, shape, dtype=torch.uint8)
    w = swizzle_scales(s)
    assert torch.equal(unswizzle_scales(w, shape[-2], shape[-1]), s)
    assert torch.equal(unswizzle_scales(w.flatten(-2), shape[-2], shape[-1]), s)
    for e in range(shape[0]) if len(shape) == 3 else []:  # per expert equals the 2-D swizzle
        assert torch.equal(w[e], swizzle_scales(s[e]))


def test_float8_scales_and_real_mxfp8_scales():
    e4 = torch.randn(130, 9).to(torch.float8_e4m3fn)
    w = swizzle_scales(e4)
    assert w.dtype == torch.float8_e4m3fn
    assert torch.equal(unswizzle_scales(w, 130, 9).view(torch.uint8), e4.view(torch.uint8))
    q = quantize_mxfp8(torch.randn(256, 512))
    assert torch.equal(unswizzle_scales(swizzle_scales(q.scale), 256, 16), q.scale)


def test_refusals():
    with pytest.raises(FormatError, match="1-byte"):
        swizzle_scales(torch.ones(4, 4))
    with pytest.raises(FormatError, match=r"shape \(10,\) does not hold a 130x9"):
        unswizzle_scales(torch.zeros(10, dtype=torch.uint8), 130, 9)
