#!/usr/bin/env bash
# Short RL runs of miles-lp on one CUDA device in one device call (learner and reference engine colocated on
# the GPU, ray off, every check in raise mode but the sentinel, which the recipes keep at warn): routing replay (Miles R3) on the embedded and the Megatron
# learner, MXFP8 and NVFP4 experts, and train.param_dtype bf16. Each run's metrics.jsonl comes back under $OUT
# (at most 8 files: the device tool's limit). Exits non-zero if any run failed.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_runs.sh   (carry megatron-core in .whl/ for the Megatron runs)
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup session.log
r=$(mktemp -d)
run() {  # run NAME RECIPE --set ...
  local name=$1 recipe=$2; shift 2
  echo "=== $name: $recipe $*"; local t0=$SECONDS
  timeout 100 python3 -m miles_lp.cli run "recipes/$recipe.yaml" --set steps=8 --set train.device=cuda \
    --set rollout.device=cuda --set sync.checks.self_check=raise \
    --set logging.output_dir="$r/$name" "$@"
  local rc=$?
  echo "=== $name: rc=$rc ($((SECONDS - t0)) s)"
  [ "$rc" -eq 0 ] || failed+=("$name")
  cp "$r/$name"/*/metrics.jsonl "$out/$name.jsonl" 2>/dev/null
}
run replay_mxfp8_embedded tiny-mxfp8-moe-replay --set train.backend=embedded
run replay_mxfp8_megatron tiny-mxfp8-moe-replay --set train.backend=megatron
run replay_nvfp4_embedded tiny-nvfp4-experts --set rl.routing_replay=true --set train.backend=embedded
run replay_nvfp4_megatron tiny-nvfp4-experts --set rl.routing_replay=true --set train.backend=megatron
run bf16params_mxfp8 tiny-mxfp8 --set train.param_dtype=bf16 --set rollout.dtype=bf16
run noreplay_mxfp8_embedded tiny-mxfp8-moe-replay --set rl.routing_replay=false
h200_finish
