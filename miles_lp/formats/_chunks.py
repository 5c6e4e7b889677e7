"""Row slices for the eager CPU codecs: temporaries stay cache-sized, the bytes equal one whole-tensor call.

Every codec here computes each scale block from elements of one row (or of ``multiple`` consecutive rows:
MXFP8 columnwise 32x1 blocks, NVFP4 16x16 tiles), so running it on slices of whole rows, aligned to
``multiple``, gives the same bytes as one call on the whole tensor. On a 2-core CPU this is what makes the
eager codecs several times faster: ~1M-element slices keep each intermediate in L2/L3 instead of writing
and re-reading full-size fp32 temporaries. On CUDA there is one slice (the kernels are not cache bound).
"""

from __future__ import annotations

import torch

CHUNK_ELEMS = 1 << 20  # elements per slice on CPU (~4 MB per fp32 temporary)


def row_slices(rows: int, row_elems: int, device: torch.device, *, multiple: int = 1,
               chunk_elems: int = CHUNK_ELEMS) -> list[slice]:
    """Slices of ``range(rows)`` holding about ``chunk_elems`` elements each, starts aligned to ``multiple``."""
    if device.type != "cpu" or rows * row_elems <= chunk_elems:
        return [slice(0, rows)]
    step = max(multiple, (chunk_elems // max(row_elems, 1)) // multiple * multiple)
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]
