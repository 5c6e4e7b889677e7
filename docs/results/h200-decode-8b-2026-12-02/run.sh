#!/usr/bin/env bash
# fp8_block decode against BF16 on an 8B-shaped model (bandwidth-bound decode GEMMs), one H200, ONE device call.
# Run from the repository root with $OUT set (no carry: no megatron here):
#   OUT=<dir> MILES_LP_COMMIT=<sha> bash docs/results/h200-decode-8b-2026-12-02/run.sh
# Steps (each capped so the whole stays under BUDGET seconds, default 250; a step cut short reports rc=124 and the
# rest go on). Times estimated from docs/results/h200-fp8-decode-2026-12-02 (0.5B: bench_gemm 9 s, bench_rollout
# 29 s for 3 rows) scaled by the weight bytes:
#   bench_gemm       ~15 s (cap 45)   miles-lp bench fp8-decode --model 8b: M 1/8/32/64 x q/k/v 6144x4096, o
#                                     4096x4096, gate/up 24576x4096, down 4096x12288; Triton vs scaled_mm vs BF16
#   bench_rollout    ~70-110 s (cap 170)  miles-lp bench rollout --model 8b --num-layers 8 (~3B parameters, 6 GB in
#                                     bf16): batch 32, 64 new tokens, bf16 and fp8_block with the decode GEMM auto /
#                                     triton / scaled_mm, 2 repeats (random weights built on the GPU, saved, converted)
#   bench_rollout_36 ~120-180 s, only with >= 150 s left (not at the default BUDGET): the full 36 layers (~8.2B,
#                                     16 GB), bf16 and fp8_block (auto), 1 repeat
# Writes to $OUT: decode_8b.log, bench_fp8_decode_8b.json, bench_rollout_8b.json (bench_rollout_8b_36.json).
set -uo pipefail
source scripts/h200_common.sh
h200_setup decode_8b.log
BUDGET=${BUDGET:-250}
cap() { local left=$((BUDGET - SECONDS)); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
cli="python3 -m miles_lp.cli"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
df -h /tmp | tail -1
step bench_gemm "$(cap 45)" $cli bench fp8-decode --model 8b --m 1,8,32,64 --dots fp8 \
  --json "$out/bench_fp8_decode_8b.json"
step bench_rollout "$(cap 170)" $cli bench rollout --model 8b --num-layers 8 --device cuda --new-tokens 64 \
  --repeats 2 --vllm off --precisions bf16,fp8_block --fp8-decode-gemm auto,triton,scaled_mm --decode auto \
  --json "$out/bench_rollout_8b.json"
if [ $((BUDGET - SECONDS)) -ge 150 ]; then
  step bench_rollout_36 "$(cap 200)" $cli bench rollout --model 8b --device cuda --new-tokens 64 --repeats 1 \
    --vllm off --precisions bf16,fp8_block --fp8-decode-gemm auto --decode auto --json "$out/bench_rollout_8b_36.json"
else
  echo "=== bench_rollout_36: skipped ($((BUDGET - SECONDS)) s left of BUDGET=$BUDGET; it needs 150)"
fi
echo "total ${SECONDS} s"
h200_finish
