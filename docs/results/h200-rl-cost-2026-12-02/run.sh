#!/usr/bin/env bash
# The cost fit t = F + c*T per RL stage on one H200, generate included: scripts/h200_rl_05b.sh (a random ~0.63B
# Qwen3 of Qwen2.5-0.5B's widths, embedded learner and reference engine on the GPU, ray off) run once per arm and
# per rl.prompts_per_step, so the generate stage's tokens per step vary between runs (a random model never samples
# EOS: within one run every response fills its 64-token cap), then `miles-lp experiment cost --pool` on each arm's
# runs (each run's first step dropped, the rest pooled). Arms bf16, fp8_block, mxfp8 with train.param_dtype=bf16.
# Run from the repository root with $OUT set (no carry: no megatron here):
#   OUT=<dir> MILES_LP_COMMIT=<sha> bash docs/results/h200-rl-cost-2026-12-02/run.sh
# Time per run, from docs/results/h200-rl-0.5b-2026-12-02/run2-bf16-compute/rl.log (63-71 s for 5 steps at 4
# prompts): ~45 s before the first step (imports, CUDA, model build, conversion, first sync), ~12 s after the last
# (its checkpoint: FP32 masters + Adam), steps ~1.0-1.6 s at 4 prompts (scaling with the batch: ~0.7 s at 2, ~2.5 s at
# 8; the first step 2-5 s). So a run of STEPS=4 takes ~60 s at 2 prompts and ~70 s at 8.
#   default (BUDGET=300, PROMPTS="2 8"):  bf16 p2, p8, fp8_block p2, p8: ~260 s; mxfp8 starts only with RUN_EST
#                                         (60 s) left, so at 300 s it is skipped and left out of the pooled fit
#   all three arms, three sizes:          BUDGET=590 PROMPTS="2 8 4" (9 runs, ~570 s; one device call is 600 s)
#   or in two calls (pool later on the dev machine, below): ARMS="bf16 fp8_block", then ARMS=mxfp8
# Writes to $OUT: rl.log and out.tgz (PACK=1: ARM-pN/{metrics.jsonl,recipe.yaml} per run, stages.txt, cost/ with
# cost.json, cost_fit.png and pooled-ARM/ per arm). On the dev machine, after unpacking:
#   miles-lp experiment cost OUT/bf16-p2 OUT/bf16-p8 OUT/fp8_block-p2 OUT/fp8_block-p8 --pool 2 --names bf16 fp8_block
#   miles-lp experiment cost OUT/cost/pooled-bf16 OUT/cost/pooled-fp8_block --skip 0      (the pooled folders again)
# CPU smoke (minutes): MODEL=tiny DEVICE=cpu MAX_LEN=8 STEPS=3 BUDGET=0 bash docs/results/h200-rl-cost-2026-12-02/run.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export PROMPTS=${PROMPTS:-2 8} ARMS=${ARMS:-bf16 fp8_block mxfp8} BUDGET=${BUDGET:-300} PACK=${PACK:-1}
exec bash "$here/../../../scripts/h200_rl_05b.sh" "${STEPS:-4}" --set train.param_dtype=bf16 "$@"
