#!/usr/bin/env bash
# The embedded default, end to end on CPU: build a tiny Qwen3-MoE checkpoint locally, explain the
# MXFP8 + NVFP4-experts recipe on it, convert it for SGLang, and verify the result against the source.
set -euo pipefail
work="${MILES_LP_WORK:-$(mktemp -d -t miles-lp-quickstart.XXXXXX)}"
echo "== working in $work"
miles-lp make-tiny-model --arch qwen3_moe --out "$work/tiny" --overwrite
miles-lp explain recipes/qwen3_moe_mxfp8_nvfp4_experts.yaml --model "$work/tiny"
miles-lp convert --hf-checkpoint "$work/tiny" --output "$work/tiny-lp" \
    --recipe recipes/qwen3_moe_mxfp8_nvfp4_experts.yaml --target sglang --overwrite
miles-lp verify "$work/tiny-lp" --source "$work/tiny"
echo "== done: converted checkpoint in $work/tiny-lp"
