#!/usr/bin/env bash
# The lead's closing device call (session 6): every GPU test of the kernels, QuantLinear, the rollout engine's C3
# graphs and the sync, the sync's selftest on CUDA and `bench sync` at 1e9 parameters, in one call; logs under $OUT.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_session6.sh
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup session.log
step pytest_gpu 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_formats_kernels_gpu.py \
  tests/unit/test_formats_kernels_bind.py tests/unit/test_train_quant_linear.py tests/unit/test_train_lean.py \
  $(grep -l "mark.gpu" tests/unit/test_rollout_*.py tests/unit/test_sync_*.py tests/e2e/test_*sync*.py 2>/dev/null) \
  --deselect tests/unit/test_formats_kernels_gpu.py::test_every_kernel_on_every_case_and_the_encoders
step selftest_cuda 120 python3 -m miles_lp.cli selftest sync --arch qwen3_moe --device cuda --json "$out/selftest_cuda.json"
step bench_sync 200 bash -c "python3 -m miles_lp.cli bench sync --device cuda --params 1e9 --iters 15 --json \
  > '$out/bench_sync.txt' 2>&1; rc=\$?; grep -v '^  sync v' '$out/bench_sync.txt' | sed -n '/^format/,/^targets/p'; exit \$rc"
h200_finish
