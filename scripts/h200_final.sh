#!/usr/bin/env bash
# The lead's closing device call (session 4): every GPU test of the kernels, the quantized linear and the sync,
# the kernels' byte identity, the sync's selftest on CUDA, and the three benchmarks, in one call; logs under $OUT.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_final.sh
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup session.log
step pytest_gpu 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_formats_kernels_gpu.py \
  tests/unit/test_train_quant_linear.py tests/unit/test_train_lean.py \
  $(grep -l "mark.gpu" tests/unit/test_rollout_*.py tests/unit/test_sync_*.py tests/e2e/test_*sync*.py 2>/dev/null)
step selfcheck 150 bash -c "python3 -m miles_lp.formats.kernels.selfcheck --device cuda > '$out/selfcheck.jsonl'; \
  rc=\$?; grep -c '\"mismatches\": 0' '$out/selfcheck.jsonl'; grep -v '\"mismatches\": 0' '$out/selfcheck.jsonl' | head -5; exit \$rc"
step selftest_sync_cuda 120 python3 -m miles_lp.cli selftest sync --arch qwen3_moe --device cuda --json "$out/selftest_cuda.json"
step bench_sync 150 bash -c "python3 -m miles_lp.cli bench sync --device cuda --params 1e9 --iters 3 --json \
  > '$out/bench_sync.txt' 2>&1; rc=\$?; grep -v '^  sync v' '$out/bench_sync.txt' | sed -n '/^format/,/^targets/p'; exit \$rc"
step bench_quantize 90 python3 -m miles_lp.cli bench quantize --device cuda --rows 16384 --cols 8192 \
  --json "$out/bench_quantize.json"
step bench_linear 120 python3 -m miles_lp.cli bench linear --kernels compiled --iters 30 --shapes small,large --graph \
  --json "$out/bench_linear.json"
h200_finish
