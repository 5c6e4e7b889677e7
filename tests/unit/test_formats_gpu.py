"""Every codec on CUDA and on CPU gives the same bytes (run on the H200 with: pytest -m gpu)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rows():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from miles_lp.formats.crosscheck import compare_devices

    return list(compare_devices("cpu", "cuda"))


def test_cpu_and_cuda_bytes_are_identical(rows):
    assert rows, "no comparison ran"
    bad = [r for r in rows if r.mismatches]
    assert not bad, "\n".join(f"{r.format} / {r.case}: {r.mismatches} of {r.bytes_compared} bytes" for r in bad)


def test_compiled_mxfp8_on_cuda_is_byte_identical():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from miles_lp.formats import quantize_mxfp8

    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    x[0, 0, 3] = float("nan")
    x[1, 2, 7] = float("inf")
    for axis in (-1, -2):
        c, e = quantize_mxfp8(x, axis=axis, compile=True), quantize_mxfp8(x.cpu(), axis=axis)
        assert torch.equal(c.data.view(torch.uint8).cpu(), e.data.view(torch.uint8))
        assert torch.equal(c.scale.cpu(), e.scale)
