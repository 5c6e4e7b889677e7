#!/usr/bin/env bash
# The Triton codec kernels on the H200 in one device call: byte identity (pytest -m gpu, selfcheck), then
# `miles-lp bench quantize` (kernels vs torchao vs a device copy) and `miles-lp bench linear`.
# Logs under $OUT (or ./h200_logs); the device tool brings back 8 files at most, so pick the options to fit:
#   session.log (everything), pytest_gpu.txt, selfcheck.jsonl (default launch shapes), selfcheck_int.jsonl
#   (MILES_LP_KERNELS_HW=0: the integer encoders on CUDA), selfcheck_swept.jsonl (the shapes the bench
#   sweep chose), bench_quantize.txt, bench_quantize.json, bench_linear.txt, bench_linear.json,
#   profile_linear.txt (--profile). The full run (no --quick) with --profile writes 10: drop one of them.
# 2026-12-01b: `--quick --linear --graph --profile` (8 files) per round, results in
#   docs/results/h200-2026-12-01b/kernels/; 2026-12-01c: `--quick --sweep --linear --graph --profile`
#   (docs/results/h200-2026-12-01c/kernels/).
# Usage (from a clean export of one commit, so the table names the tree it ran on):
#   MILES_LP_COMMIT=<sha> bash scripts/h200_kernels.sh [--no-sweep] [--no-linear] [--tests-only] [--quick]
#     [--no-tests] [--linear] [--profile] [--graph]
# --quick: the kernels' own GPU tests, one selfcheck, bench quantize without sweep or torch.compile rows.
# --no-tests: skip pytest -m gpu (selfcheck still runs); --linear: bench linear even with --quick;
# --sweep: with --quick, still sweep the launch shapes (no torch.compile rows) and selfcheck the chosen ones
#   (that log in session.log only, to stay within 8 files);
# --profile: also `bench linear --profile` (host vs device time, kernels per call) -> profile_linear.txt
#   (shapes: $PROFILE_SHAPES, default small,large); --graph: bench linear also replays each mode as CUDA graphs.
# PYTEST_FILES="a.py b.py" replaces the pytest -m gpu file list (node ids work too).
# NCU=1: last, `ncu` (--clock-control none) on the MXFP8 row+col and per-token NVFP4 kernels, the defaults and
#   the 12-01c forms (bench.ncu_targets) -> ncu.txt: occupancy, warp stall reasons, DRAM bytes and throughput.
# 2026-12-01d: `--quick --sweep`, MILES_LP_SWEEP=mxfp8_stv16,nvfp4_enc, NCU=1 (docs/results/h200-2026-12-01d/kernels/).
# Carry torchao as a wheel in .whl/ (README of the device tool); without it the torchao anchor is skipped.
set -uo pipefail
out="${OUT:-h200_logs}"; mkdir -p "$out"
exec > >(tee "$out/session.log") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
sweep=--sweep; linear=1; bench=1; quick=0; tests=1; prof=0; force_linear=0; graph=; force_sweep=0
for a in "$@"; do
  case $a in
    --no-sweep) sweep= ;; --no-linear) linear=0 ;; --tests-only) bench=0; linear=0 ;;
    --quick) quick=1; sweep=--no-compile; linear=0 ;;
    --no-tests) tests=0 ;; --linear) force_linear=1 ;; --profile) prof=1 ;; --graph) graph=--graph ;;
    --sweep) force_sweep=1 ;;
    *) echo "unknown option $a"; exit 2 ;;
  esac
done
whl="${WHL_DIR:-.whl}"
if ls "$whl"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$whl"/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
echo "commit ${MILES_LP_COMMIT:-unknown}"; date -u; nvidia-smi -L
nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -c 'import torchao; print("torchao", torchao.__version__)' 2>&1 | tail -1
failed=()
step() {  # step NAME LOGFILE CMD...: run (at most $STEP_TIMEOUT s), tee to $out/LOGFILE, remember failures
  local name=$1 log=$2; shift 2
  echo "=== $name: $*"; local t0=$SECONDS
  local dest="$out/$log"; [ "$log" = /dev/null ] && dest=/dev/null
  timeout "${STEP_TIMEOUT:-300}" "$@" 2>&1 | tee "$dest"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc ($((SECONDS - t0)) s)"
  [ "$rc" -eq 0 ] || failed+=("$name")
}
[ "$force_linear" = 1 ] && linear=1
[ "$force_sweep" = 1 ] && sweep="--sweep --no-compile"
files=(tests/unit/test_formats_kernels_gpu.py)
[ "$quick" = 1 ] || files+=(tests/unit/test_formats_gpu.py tests/unit/test_formats_nvfp4.py tests/unit/test_train_quant_linear.py)
[ -n "${PYTEST_FILES:-}" ] && read -r -a files <<< "$PYTEST_FILES"
[ "$tests" = 1 ] && step pytest_gpu pytest_gpu.txt python3 -m pytest -q -p no:cacheprovider -m gpu "${files[@]}"
step selfcheck selfcheck.jsonl python3 -m miles_lp.formats.kernels.selfcheck --device cuda --repeat 2
[ "$quick" = 1 ] || step selfcheck_int selfcheck_int.jsonl env MILES_LP_KERNELS_HW=0 \
  python3 -m miles_lp.formats.kernels.selfcheck --device cuda
if [ "$bench" = 1 ]; then
  step bench_quantize bench_quantize.txt python3 -m miles_lp.cli bench quantize --device cuda --rows 16384 \
    --cols 8192 $sweep --json "$out/bench_quantize.json"
  # the byte identity of the launch shapes the sweep chose (its log lands in session.log only with --quick)
  [ "$quick" = 1 ] && [ "$force_sweep" = 0 ] || step selfcheck_swept \
    "$([ "$quick" = 1 ] && echo /dev/null || echo selfcheck_swept.jsonl)" python3 -m miles_lp.formats.kernels.selfcheck \
    --device cuda --config "$out/bench_quantize.json" --no-encoders
fi
if [ "$linear" = 1 ]; then
  step bench_linear bench_linear.txt python3 -m miles_lp.cli bench linear --shapes large,small \
    --kernels compiled $graph --json "$out/bench_linear.json"
fi
if [ "$prof" = 1 ]; then
  step profile_linear /dev/null python3 -m miles_lp.cli bench linear --shapes "${PROFILE_SHAPES:-small,large}" --profile \
    "$out/profile_linear.txt"
fi
if [ "${NCU:-0}" = 1 ]; then  # hardware counters of the two near-miss kernels, new and 12-01c forms (Firecracker)
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  step ncu ncu.txt timeout 150 "${ncu_bin:-ncu}" --clock-control none --target-processes all \
    -k 'regex:mxfp8_quantize_kernel|nvfp4_rows_pairs_kernel' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats \
    python3 -c 'from miles_lp.bench.quantize_cuda import ncu_targets; ncu_targets()'
fi
echo "failed steps: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
