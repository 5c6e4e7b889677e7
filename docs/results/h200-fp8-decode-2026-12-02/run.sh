#!/usr/bin/env bash
# The fp8_block decode GEMM (formats/kernels/fp8_block_decode.py) on one H200, in ONE device call of < 150 s.
# Run from the repository root with $OUT set:
#   OUT=<dir> MILES_LP_COMMIT=<sha> bash docs/results/h200-fp8-decode-2026-12-02/run.sh
# Steps (each capped so the whole stays under BUDGET seconds; a step cut short reports rc=124 and the rest go on):
#   kernel_tests   pytest -m gpu tests/unit/test_fp8_block_decode_gpu.py (selfcheck both dots, 0.5B decode shapes
#                  vs emulation and scaled_mm, CUDA-graph capture)
#   engine_tests   pytest -m gpu tests/unit/test_rollout_cuda_decode_gpu.py, the fp8_block cases (graph == static,
#                  scores, weight update through the captured graph, auto vs scaled_mm decode GEMM)
#                  (the two test steps run side by side: mostly Triton compiles, on the CPU cores; no timing)
#   bench_gemm     miles-lp bench fp8-decode (M 1/8/32/64 x q/k/v, o, gate/up, down: Triton vs scaled_mm vs BF16)
#   bench_rollout  miles-lp bench rollout, 0.5B random Qwen3, batch 32, 64 new tokens: bf16, fp8_block with the
#                  Triton decode GEMM (auto) and with scaled_mm, side by side
#   sweep          (only with time left) the Triton kernel's N tile / split-K at M = 32, q/k/v and down
set -uo pipefail
source scripts/h200_common.sh
h200_setup fp8_decode.log
BUDGET=${BUDGET:-140}
cap() { local left=$((BUDGET - SECONDS)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
cli="python3 -m miles_lp.cli"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
t=$(cap 60)
( step kernel_tests "$t" python3 -m pytest -v -p no:cacheprovider -m gpu tests/unit/test_fp8_block_decode_gpu.py
  h200_finish ) > "$out/kernel_tests.log" 2>&1 &
p1=$!
( step engine_tests "$t" python3 -m pytest -v -p no:cacheprovider -m gpu tests/unit/test_rollout_cuda_decode_gpu.py \
    -k "fp8_block or update or choices"
  h200_finish ) > "$out/engine_tests.log" 2>&1 &
p2=$!
wait $p1 || failed+=(kernel_tests)
wait $p2 || failed+=(engine_tests)
cat "$out/kernel_tests.log" "$out/engine_tests.log"
step bench_gemm "$(cap 25)" $cli bench fp8-decode --dots fp8 --json "$out/bench_fp8_decode.json"
step bench_rollout "$(cap 45)" $cli bench rollout --model 0.5b --device cuda --new-tokens 64 --repeats 2 --vllm off \
  --precisions bf16,fp8_block --fp8-decode-gemm auto,scaled_mm --decode auto --json "$out/bench_rollout.json"
if [ $((BUDGET - SECONDS)) -ge 15 ]; then
  step sweep "$(cap 60)" $cli bench fp8-decode --m 32 --shapes qkv,down --dots fp8 --sweep --calls 20 --replays 3 \
    --json "$out/bench_fp8_decode_sweep.json"
fi
echo "total ${SECONDS} s"
h200_finish
