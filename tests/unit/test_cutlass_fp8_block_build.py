"""``scripts/cutlass_fp8_block/build.sh`` builds CUTLASS's blockwise-scaled FP8 GEMMs for sm_90a on a machine without a
GPU and exports the C functions ``scripts/h200_cutlass_fp8_block.py`` loads (slow: ~90 s of nvcc on 2 cores; needs
nvcc and ``CUTLASS`` pointing at CUTLASS's source tree, e.g. the nvidia-cutlass wheel's ``cutlass_library/source``).
What the kernels compute is checked on the H200 by that probe (docs/results/h200-fp8-block-cutlass-2026-12-02)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cutlass_gemms_build_for_sm90a(tmp_path):
    cutlass = os.environ.get("CUTLASS")
    if not shutil.which("nvcc") or not cutlass or not Path(cutlass, "include", "cutlass", "cutlass.h").exists():
        pytest.skip("needs nvcc and CUTLASS=<CUTLASS source tree>")
    subprocess.run(["bash", str(ROOT / "scripts" / "cutlass_fp8_block" / "build.sh"), str(tmp_path)], check=True,
                   env={**os.environ, "CUTLASS": cutlass}, timeout=1800)
    syms = subprocess.run(["nm", "-D", str(tmp_path / "libmlp_cutlass_fp8.so")], capture_output=True, text=True,
                          check=True).stdout
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("probe", ROOT / "scripts" / "h200_cutlass_fp8_block.py")
    probe = module_from_spec(spec)
    spec.loader.exec_module(probe)
    for form in (*probe.FWD, *probe.WGRAD):  # every kernel the probe calls is exported
        assert f" T mlp_fp8_block_gemm_{form}\n" in syms and f" T mlp_fp8_block_ws_{form}\n" in syms, form
