"""``bench linear --host-cpu``: the stubbed CPU harness counts what one QuantLinear fwd+bwd launches and
dispatches, and puts the kernel module back as it was (no timing asserted: the numbers are the machine's)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_host_rows_count_launches_and_restore_the_kernels():
    from miles_lp.bench import linear_host
    from miles_lp.formats import kernels
    from miles_lp.formats.kernels import runtime

    before = (runtime.launch, kernels.enabled, runtime.module_for)
    rows = {r["mode"]: r for r in linear_host.host_rows([("mxfp8", "dequantized"), ("nvfp4", "high_precision")])}
    assert (runtime.launch, kernels.enabled, runtime.module_for) == before
    assert rows["mxfp8/dequantized"]["launches"] == 3  # w qdq, x qdq, x decode (test_train_kernel_launches pins it)
    assert rows["nvfp4/high_precision"]["launches"] == 3  # w amax + quantize, x per-token
    assert rows["bf16 F.linear"]["aten_ops"] < rows["mxfp8/dequantized"]["aten_ops"]
    assert all(r["fresh_us"] > 0 for r in rows.values())
    text = linear_host.format_rows(list(rows.values()), 32)
    assert "mxfp8/dequantized" in text and "launches" in text


def test_host_rows_drive_fp8_block_on_its_native_path():
    """fp8_block takes the native path under the stubs (operand kernels and cuBLAS's GEMMs counted as launches),
    not the emulation CPU tensors would otherwise take, and every patched function is put back."""
    from miles_lp.bench import linear_host
    from miles_lp.formats.kernels import fp8_block
    from miles_lp.train import fp8_block_gemm, gemm

    before = (fp8_block._launch, fp8_block._module, fp8_block_gemm._mm, gemm._fp8_native)
    rows = {r["mode"]: r for r in linear_host.host_rows([("fp8_block", "quantized")])}
    assert (fp8_block._launch, fp8_block._module, fp8_block_gemm._mm, gemm._fp8_native) == before
    # fresh weight: its 128x128 grid, x's two grids (one launch), dy's two grids (one launch), three GEMMs
    assert rows["fp8_block/quantized"]["launches"] == 6
