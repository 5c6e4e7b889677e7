#!/usr/bin/env bash
# The Megatron learner on two GPUs (nvidia-h200-x2): TP 2 / EP 2 on NCCL, rank r
# on cuda:r, the same cases the CPU suite runs on 2 gloo ranks (tests/unit/test_train_megatron_group.py with
# MILES_LP_MEGATRON_DEVICE=cuda: logprobs vs TP 1, one optimizer step, gathered masters, export after the step
# = codecs of the masters = convert of them, the NVFP4 activation-partition mismatch, resume, a failing rank),
# then the routing-replay tests (CPU learners; the TP-2 one on gloo). Logs under $OUT, one verdict per step,
# non-zero exit if any failed. Not run yet: no two-GPU machine has been available.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_megatron.sh   (carry megatron-core in .whl/, as h200_rollout.sh)
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup megatron.log
# NVLink multicast stays off (KINDS.md): set here too, for the spawned ranks inherit this environment
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
n=$(nvidia-smi -L | wc -l)
if [ "$n" -lt 2 ]; then
  echo "=== megatron_group_nccl: SKIPPED (needs 2 GPUs, this machine has $n)"; failed+=(megatron_group_nccl)
else
  step megatron_group_nccl 480 env MILES_LP_MEGATRON_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider \
    -m "slow or not slow" --durations=20 tests/unit/test_train_megatron_group.py
fi
step megatron_replay 200 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
  tests/unit/test_train_megatron_replay.py
h200_finish
