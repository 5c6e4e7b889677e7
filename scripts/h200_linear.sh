#!/usr/bin/env bash
# QuantLinear's host path on the H200 in one device call: the GPU tests
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
  local dest="$out/$log"; [ "$log" = /dev/stdout ] && dest=/dev/null
  timeout "$limit" "$@" 2>&1 | tee "$dest"
  echo "=== $name: rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)"
}
bl="python3 -m miles_lp.cli bench linear --kernels compiled --iters ${ITERS:-30}"
# SHORT=1 (run 2): only the lean GPU test, one bench, the profile, and the A/B against OLD_TREE
tests="tests/unit/test_train_quant_linear.py tests/unit/test_train_lean.py"
[ "${SHORT:-0}" = 1 ] && tests="tests/unit/test_train_lean.py"
step pytest_gpu pytest_gpu.txt 240 python3 -m pytest -q -p no:cacheprovider -m gpu $tests
step bench_linear bench_linear.txt 150 $bl --shapes small,large --graph --json "$out/bench_linear.json"
if [ "${SHORT:-0}" != 1 ]; then
  # the small shape twice more, alternating with the unbound path (the host's speed drifts: read the spread)
  step bench_small2 bench_linear_small2.txt 60 $bl --shapes small
  step bench_nobind bench_linear_nobind.txt 60 env MILES_LP_LINEAR_BIND=0 $bl --shapes small
  step bench_small3 /dev/stdout 60 $bl --shapes small
fi
step profile profile_linear.txt 90 python3 -m miles_lp.cli bench linear --shapes small --profile /tmp/profile_linear_full.txt
[ "${SHORT:-0}" != 1 ] && step host_cpu host_cpu.txt 60 python3 -m miles_lp.cli bench linear --host-cpu
# OLD_TREE (optional): a copy of the package before this work (its own kernels) carried in an ignored folder
# with /tmp/gl/ab.py (the host harness, runnable on either tree); the same bench on it alternating with this
# tree: an A/B on one machine in one call
if [ -n "${OLD_TREE:-}" ] && [ -d "$OLD_TREE/miles_lp" ]; then
  cp "$OLD_TREE/ab.py" /tmp/ab_new.py  # (run from /tmp: the script's folder comes first on sys.path)
  for i in 1 2; do
    step "old_small_$i" ab_small.txt 60 bash -c "cd '$OLD_TREE' && PYTHONPATH=\$PWD exec $bl --shapes small"
    cat "$out/ab_small.txt" >> "$out/ab.txt"
    step "new_small_$i" ab_small.txt 60 $bl --shapes small
    cat "$out/ab_small.txt" >> "$out/ab.txt"
  done
  rm -f "$out/ab_small.txt"
  for d in fp32 bf16; do
    step "ab_cpu_old_$d" /dev/stdout 60 bash -c "cd '$OLD_TREE' && PYTHONPATH=\$PWD exec python3 ab.py $d"
    step "ab_cpu_new_$d" /dev/stdout 60 python3 /tmp/ab_new.py $d
  done
fi
