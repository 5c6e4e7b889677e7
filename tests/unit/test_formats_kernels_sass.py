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
        return sass.report(["nvfp4_pairs", "nvfp4_rows", "mxfp8_row"], out=io.StringIO())
    except (FileNotFoundError, ImportError, RuntimeError) as exc:  # no CUDA backend / ptxas in this Triton
        pytest.skip(f"offline sm_90 compile unavailable: {exc}")


def test_pairs_kernel_is_within_its_instruction_budget(counts):
    pairs, general = counts["nvfp4_pairs"], counts["nvfp4_rows"]
    assert pairs["per_element"] < 21, pairs["per_element"]
    assert pairs["per_element"] < general["per_element"] - 4
    assert pairs["stack"] <= 16 and pairs["registers"] <= 80  # the 80-register cap: 6 programs per SM, <= 16 B spill
    assert counts["mxfp8_row"]["per_element"] < 11


def test_the_counter_sees_instructions(counts):
    """The histogram parser must count real SASS lines (a regex that matched nothing would pass the test above
    vacuously): every count is positive and FMNMX (the amax) is among them."""
    name, sig, consts, warps, _, cap = sass.cases()["nvfp4_pairs"]
    lines = sass.sass_lines(sass.compile_kernel(name, sig, consts, warps, cap))
    hist = sass.histogram(lines)
    assert len(lines) > 500 and hist["FMNMX"] > 100 and hist["LDG"] >= 1 and hist["STG"] >= 1
