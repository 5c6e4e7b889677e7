#!/usr/bin/env bash
# The rollout / sync / RL checks of miles-lp on one CUDA device, in one device call; logs under $OUT.
#   pytest -m gpu for the reference engine and the sync; bench sync (1B random Qwen3-MoE, MXFP8 and
#   MXFP8 + NVFP4 experts, vs a device copy of the same bytes); bench rollout (0.5B random Qwen3, reference
#   engine vs transformers generate); short RL runs on the GPU (learner and engine colocated, ray off, checks
#   in raise mode). Each step reports its own verdict; the script exits non-zero if any failed.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_rollout.sh [--skip-bench]   (carry megatron-core in .whl/ for
# the Megatron learner runs)
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup session.log
bench=1; [ "${1:-}" = --skip-bench ] && bench=0
cli="python3 -m miles_lp.cli"
step pytest_gpu 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_rollout_gpu.py \
  $(grep -l "mark.gpu" tests/unit/test_sync_*.py tests/e2e/test_*sync*.py 2>/dev/null)
if [ "$bench" = 1 ]; then
  step bench_sync 200 $cli bench sync --device cuda --params 1e9 --iters 3 --json
  step bench_rollout 100 $cli bench rollout --model 0.5b --device cuda --new-tokens 128 --json "$out/bench_rollout.json"
fi
r=$(mktemp -d)
for backend in embedded megatron; do
  for recipe in tiny-mxfp8 tiny-nvfp4-experts; do
    name="run_${recipe}_$backend"
    step "$name" 90 $cli run "recipes/$recipe.yaml" --set steps=8 --set train.device=cuda \
      --set train.backend=$backend --set rollout.device=cuda --set sync.checks.self_check=raise \
      --set logging.output_dir="$r/$name"
    [ "$bench" = 1 ] && [ "$backend" = megatron ] && continue  # 8 files come back at most
    cp "$r/$name"/*/metrics.jsonl "$out/$name.jsonl" 2>/dev/null
  done
done
h200_finish
