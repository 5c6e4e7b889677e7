"""Offline SASS counts of the codec kernels for sm_90 (``miles_lp.formats.kernels.sass``): no GPU, Triton's
own compiler and ptxas. They pin what the per-element instruction budget is (docs/gpu.md): a change that
puts the per-token NVFP4 kernel back above ~21 instructions per element fails here, before a device run."""

from __future__ import annotations

import io

import pytest

pytest.importorskip("triton")

from miles_lp.formats.kernels import sass  # noqa: E402


@pytest.fixture(scope="module")
def counts():
    try:
        return sass.report(["nvfp4_pairs", "nvfp4_rows", "mxfp8_row", "mxfp8_both"], out=io.StringIO())
    except (FileNotFoundError, ImportError, RuntimeError) as exc:  # no CUDA backend / ptxas in this Triton
        pytest.skip(f"offline sm_90 compile unavailable: {exc}")


def test_pairs_kernel_is_within_its_instruction_budget(counts):
    pairs, general = counts["nvfp4_pairs"], counts["nvfp4_rows"]
    # 12-01d (ENC 1, FULL 1): 18.1 per element, 15.7 without the division slow path; 12-01c: 19.8 / 18.1
    assert 12 < pairs["per_element"] < 19, pairs["per_element"]
    assert pairs["body_per_element"] < 16.5, pairs["body_per_element"]
    assert pairs["per_element"] < general["per_element"] - 6
    assert pairs["stack"] == 0 and pairs["registers"] <= 80  # 6 programs per SM, no spill
    assert counts["mxfp8_row"]["per_element"] < 11


def test_row_and_col_kernel_stores_from_registers(counts):
    """The one-pass MXFP8 row + col default (STV 16, 168-register cap): 12.9 per element offline against 13.8
    with the E4M3 tiles re-laid out through shared memory (12-01c), no spill at the cap."""
    both = counts["mxfp8_both"]
    assert 10 < both["per_element"] < 13.3, both["per_element"]  # (a lower bound too: an empty kernel passes none)
    assert both["registers"] <= 168 and both["stack"] == 0
    hist = both["histogram"]
    assert hist.get("STS", 0) <= 32 and hist.get("BAR", 0) <= 12
    # 2 x 8 E4M3 16-byte stores per thread plus the scale bytes; 16 16-byte loads
    assert hist.get("STG", 0) >= 16 and hist.get("LDG", 0) == 16 and hist.get("F2FP", 0) >= 64


def test_the_counter_sees_instructions(counts):
    """The histogram parser must count real SASS lines (a regex that matched nothing would pass the test above
    vacuously): every count is positive and FMNMX (the amax) is among them."""
    name, sig, consts, warps, _, cap = sass.cases()["nvfp4_pairs"]
    lines = sass.sass_lines(sass.compile_kernel(name, sig, consts, warps, cap))
    hist = sass.histogram(lines)
    assert len(lines) > 500 and hist["FMNMX"] > 100 and hist["LDG"] >= 1 and hist["STG"] >= 1
