#!/usr/bin/env bash
# QuantLinear's host path on the H200 in one device call (gpu-linear, 2026-12-01 session d): the GPU tests
# of QuantLinear and its bound launches, `bench linear` (small + large, eager fresh / cached and CUDA-graphed),
# the small shape again without the bound launches (MILES_LP_LINEAR_BIND=0: A/B in the same process
# environment), `bench linear --profile` (host vs device time per call), and `--host-cpu` on that host's CPU.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_linear.sh   (logs under $OUT, else ./h200_logs; <= 8 files)
set -uo pipefail
out="${OUT:-h200_logs}"; mkdir -p "$out"
exec > >(tee "$out/session.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
echo "commit ${MILES_LP_COMMIT:-unknown}"; date -u; nvidia-smi -L
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
nproc; grep -m1 "model name" /proc/cpuinfo
step() {  # step NAME LOGFILE SECONDS CMD...
  local name=$1 log=$2 limit=$3; shift 3
  echo "=== $name: $*"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$out/$log"
  echo "=== $name: rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)"
}
bl="python3 -m miles_lp.cli bench linear --kernels compiled --iters ${ITERS:-30}"
step pytest_gpu pytest_gpu.txt 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/unit/test_train_quant_linear.py tests/unit/test_train_lean.py
step bench_linear bench_linear.txt 150 $bl --shapes small,large --graph --json "$out/bench_linear.json"
step bench_nobind bench_linear_nobind.txt 60 env MILES_LP_LINEAR_BIND=0 $bl --shapes small
step bench_small2 bench_linear_small2.txt 60 $bl --shapes small
step profile profile_linear.txt 90 python3 -m miles_lp.cli bench linear --shapes small --profile /tmp/profile_linear_full.txt
step host_cpu host_cpu.txt 60 python3 -m miles_lp.cli bench linear --host-cpu
