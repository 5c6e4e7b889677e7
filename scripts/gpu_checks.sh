#!/usr/bin/env bash
# Every GPU check of miles-lp in one device call (H200 or any CUDA machine), logs under $OUT (or ./h200_logs).
# Carry the megatron-core wheel in .whl/ for the Megatron smoke test. Each step reports its own verdict;
# a failing step does not stop the others, and the script exits non-zero if any failed.
set -uo pipefail
out="${OUT:-h200_logs}"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
failed=()
step() {  # step NAME CMD...: run, tee to $out/NAME.txt, remember failures
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc"
  [ "$rc" -eq 0 ] || failed+=("$name")
}
nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
step formats_cuda python3 scripts/check_formats_cuda.py
if python3 -c 'import pytest' 2>/dev/null; then
  step pytest_gpu python3 -m pytest -q -p no:cacheprovider -m gpu $(grep -rl "mark.gpu" tests)
fi
t=$(mktemp -d)
step convert_cuda bash -c "python3 -m miles_lp.cli make-tiny-model --arch qwen3_moe --out $t/tiny && \
  python3 -m miles_lp.cli convert --hf-checkpoint $t/tiny --output $t/lp --device cuda \
    --recipe recipes/policies/qwen3-moe-mxfp8-nvfp4-experts.yaml --target sglang && \
  python3 -m miles_lp.cli verify $t/lp --source $t/tiny"
step bench_quantize python3 -m miles_lp.cli bench quantize --device cuda --no-torchao
step megatron python3 scripts/h200_train_check.py
step bench_linear python3 -m miles_lp.cli bench linear --shapes large,small --json "$out/bench_linear.json" --plot "$out/bench_linear.png"
echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
