#!/usr/bin/env bash
# The embedded default, end to end on CPU (no download, no GPU):
#   1. the main job: GRPO on a tiny Qwen3 with MXFP8 end to end (shared-grid sync + checks), a few minutes;
#   2. the checkpoint side: build a tiny Qwen3-MoE, explain the MXFP8 + NVFP4-experts recipe on it, convert
#      it for SGLang and verify the result against the source.
set -euo pipefail
work="${MILES_LP_WORK:-$(mktemp -d -t miles-lp-quickstart.XXXXXX)}"
echo "== working in $work"

echo "== 1. miles-lp run recipes/tiny-mxfp8.yaml"
miles-lp run recipes/tiny-mxfp8.yaml --set logging.output_dir="$work/runs" --run-name tiny-mxfp8 \
    | tee "$work/run-summary.json"
echo "== metrics: $work/runs/tiny-mxfp8/metrics.jsonl; checkpoints: $work/runs/tiny-mxfp8/checkpoints"

echo "== 2. convert -> explain -> verify"
miles-lp make-tiny-model --arch qwen3_moe --out "$work/tiny" --overwrite
miles-lp explain recipes/policies/qwen3-moe-mxfp8-nvfp4-experts.yaml --model "$work/tiny"
miles-lp convert --hf-checkpoint "$work/tiny" --output "$work/tiny-lp" \
    --recipe recipes/policies/qwen3-moe-mxfp8-nvfp4-experts.yaml --target sglang --overwrite
miles-lp verify "$work/tiny-lp" --source "$work/tiny"
echo "== done: run in $work/runs/tiny-mxfp8, converted checkpoint in $work/tiny-lp"
