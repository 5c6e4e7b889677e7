#!/usr/bin/env bash
# The reference engine's CUDA-graph decode on one CUDA device, in one device call; logs under $OUT.
#   pytest -m gpu (graph == static step, scores, update served by the captured graph; fp8_block kernels and
#   native GEMMs); bench rollout (0.5B random Qwen3, batch 32, 128 new tokens: transformers generate, our BF16,
#   fp8_block, fp8_block+pow2, MXFP8); where a decode step's device time goes (scripts/h200_decode_profile.py).
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_decode.sh [--no-tests] [--no-profile]
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup decode.log
tests=1; prof=1
for a in "$@"; do
  case "$a" in --no-tests) tests=0 ;; --no-profile) prof=0 ;; esac
done
cli="python3 -m miles_lp.cli"
if [ "$tests" = 1 ]; then
  step pytest_gpu 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_rollout_cuda_decode_gpu.py \
    tests/unit/test_fp8_block_gemm_gpu.py
fi
step bench_rollout 240 $cli bench rollout --model 0.5b --device cuda --new-tokens 128 --vllm off \
  --precisions bf16,fp8_block,fp8_block+pow2,mxfp8 --decode auto --json "$out/bench_rollout.json"
if [ "$prof" = 1 ]; then
  step profile 180 python3 scripts/h200_decode_profile.py --json "$out/decode_profile.json"
fi
h200_finish
