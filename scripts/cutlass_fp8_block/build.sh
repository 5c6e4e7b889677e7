#!/usr/bin/env bash
# Build libmlp_cutlass_fp8.so for sm_90a on a machine with nvcc (no GPU needed):
#   CUTLASS=<dir holding include/ and tools/util/include/> bash scripts/cutlass_fp8_block/build.sh OUTDIR
# CUTLASS: the nvidia-cutlass wheel's cutlass_library/source (pip download nvidia-cutlass==4.2.0.0; unzip).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?output directory}
mkdir -p "$out"
nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG \
  -I"$CUTLASS/include" -I"$CUTLASS/tools/util/include" -Xcompiler -fPIC -shared \
  -o "$out/libmlp_cutlass_fp8.so" "$here/gemm.cu"
