#!/usr/bin/env bash
# The cost fit t = F + c*T per RL stage on one H200, sized so that T matters: scripts/h200_rl_05b.sh (a random
# ~0.63B Qwen3 of Qwen2.5-0.5B's widths, embedded learner and reference engine on the GPU, ray off, checks in raise
# mode) for the arms bf16, fp8_block, mxfp8 (train.param_dtype=bf16) at rollout.max_response_len 256 and 32 with 4
# prompts x 8 samples per step. A random policy never samples EOS, so every response fills its cap: 8,192 and 1,024
# generated tokens per step, 256 and 32 decode steps (the decode is latency-bound: its cost is per decode step, and
# here the decode steps grow with T) and trained sequences of ~260-380 and ~35-150 tokens. train.micro_batch_tokens
# =16384 keeps every pass of either size in one micro-batch (32 sequences of at most 376 tokens: <= 12,032), so the
# micro-batch count does not change with T and lands in F, not in c.
# Against the warm-up and order effects of the first attempt (../h200-rl-cost-2026-12-02/): a discarded 2-step bf16
# run first, the runs in a Latin order (bf16-l256, fp8_block-l32, mxfp8-l256, then fp8_block-l256, mxfp8-l32,
# bf16-l32: no arm always starts with one size), and the first SKIP=2 steps of every run dropped before
# `miles-lp experiment cost --pool 2 --skip 2` pools each arm's two runs (4 steps each, 8 per arm).
# Run from the repository root with $OUT set (no carry: no megatron here):
#   OUT=<dir> MILES_LP_COMMIT=<sha> bash docs/results/h200-rl-cost-2026-12-02b/run.sh
# Time (estimates from ../h200-rl-cost-2026-12-02/rl.log: 54-61 s per warm 4-step run at 64 tokens, 82 s for the
# call's first; ~45 s start-up, ~8-12 s for the last step's checkpoint, which every run writes): the warm-up ~75 s
# (cold caches), a 6-step run ~60 s at 32 tokens and ~70 s at 256: ~470 s in all, under BUDGET=560 (a run starts only
# with its estimate left). Three lengths (LENS="256 32 128", ~610 s estimated) do not fit one 600 s call.
# Writes to $OUT: rl.log and out.tgz (PACK=1: ARM-lN/{metrics.jsonl,recipe.yaml}, stages.txt, cost/ with cost.json,
# cost_fit.png and pooled-ARM/).
# CPU smoke (minutes): MODEL=tiny DEVICE=cpu LENS="4 16" STEPS=3 SKIP=1 BUDGET=0 OUT=/tmp/x bash <this file>
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export LENS=${LENS:-256 32} PROMPTS=${PROMPTS:-4} ARMS=${ARMS:-bf16 fp8_block mxfp8} SKIP=${SKIP:-2}
pack=1; [ "${DEVICE:-cuda}" = cpu ] && pack=0   # the CPU smoke leaves its files unpacked
export WARM=${WARM:-bf16} BUDGET=${BUDGET:-560} PACK=${PACK:-$pack}
exec bash "$here/../../../scripts/h200_rl_05b.sh" "${STEPS:-6}" --set train.param_dtype=bf16 \
  --set train.micro_batch_tokens=16384 "$@"
