"""``miles-lp bench sync``'s contract floor: the least any implementation of the sync moves, in flat copies."""

import pytest

from miles_lp.bench.sync import contract_floor, target_verdict


def test_contract_floor_mxfp8_with_bf16_rebuild_is_above_3x_and_native_serving_below():
    """1M MXFP8 elements from BF16 masters (codes 1 B + one E8M0 scale per 32): export reads 2 B and writes 1.03 B
    per element, apply is one copy, C2 reads the served bytes once, a BF16 rebuild reads the codes and writes 2 B:
    (3.03 + 2.06 + 1.03 + 3.03) / 2.06; without the rebuild just under 3x, with no room for anything else."""
    elems = 1 << 20
    qbytes = elems + elems // 32
    f = contract_floor(2 * elems + qbytes, 0, qbytes, qbytes, 2 * elems)
    assert f["apply"] == 1.0
    assert f["export"] == pytest.approx((2 + 1 + 1 / 32) / (2 * (1 + 1 / 32)))
    assert f["with_derived_state"] == pytest.approx(f["export"] + 1 + 0.5 + f["finish"])
    assert f["with_derived_state"] == pytest.approx(4.44, abs=0.01) and f["native"] == pytest.approx(2.97, abs=0.01)


def test_contract_floor_counts_bf16_tensors_as_one_copy_each_way():
    """Only BF16 tensors sent (nothing quantized): export copies them into staging, apply copies them out, C2
    reads them: 2.5x."""
    f = contract_floor(0, 1000, 1000, 0, 0)
    assert f["native"] == f["with_derived_state"] == 2.5


def test_target_verdict_says_met_or_missed_and_what_the_floor_allows():
    floor = {"contract": {"with_derived_state": 4.0, "native": 2.86}}
    line = target_verdict({"format": "mxfp8", "ratio": 41.8, "check_share": 0.11, "floor": floor})
    assert "sync 41.8x the copy (missed)" in line and "4.00x, so no implementation serving this way meets 3x" in line
    assert "checks 11.0% (missed)" in line
    ok = target_verdict({"format": "mxfp8", "ratio": 2.5, "check_share": 0.01,
                         "floor": {"contract": {"with_derived_state": 2.4, "native": 2.0}}})
    assert "(met)" in ok and "no implementation" not in ok and "checks 1.0% (met)" in ok
