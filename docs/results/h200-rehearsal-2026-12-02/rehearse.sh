#!/usr/bin/env bash
# The rehearsal recipes (recipes/rehearsal-*.yaml) on one H200, as far as one GPU and this image allow:
# * no Ray: Ray is not in the device image and its 2.60 wheel (79.3 MB) is over what one call carries (64 MiB), so
#   the runs have ray.enabled false and the learner's ranks are spawned processes on this host (train.megatron's
#   sizes unchanged: tp 2 x dp 2 and ep 2 x expert-dp 2 on 4 ranks, pp 2 on 2);
# * NCCL refuses two ranks on one GPU: the learner's ranks run on CPU with gloo (train.device cpu, as written);
# * the two reference engines share the GPU (rollout.device cuda), synced in process (sync.transport inprocess:
#   the recipes' gloo update group runs between Ray actors);
# * C1-C5 in raise mode, as written; 3 RL steps each.
# Carry: .whl/ with the megatron-core 0.16.1 wheel (and any other wheel the image lacks, e.g. cloudpickle, which the
# spawned ranks import); they are installed with --no-deps into /tmp/site.
# Usage, from the repository root:  OUT=$OUT bash docs/results/h200-rehearsal-2026-12-02/rehearse.sh
# RUNS: the recipes to run (names under recipes/, space-separated; default all three).
# EXTRA: more --set flags for every run (word-split), e.g. EXTRA="--set runtime.decode=eager" (no CUDA graphs).
# Time: BUDGET_S (default 260 s) from the start, the wheel install included; each run gets what is left divided by
# the runs still to go (a run cut off reports rc=124). What comes back (8 files, none below $OUT): summary.txt,
# device.txt, and per recipe RECIPE.log (its stdout / stderr) and RECIPE.metrics.jsonl (one line per step).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../../.." || exit 1  # the repository root (recipes/, miles_lp/, .whl/)
start_all=$SECONDS
budget=${BUDGET_S:-260}
{
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "wheel install failed"
  else
    echo "no .whl/*.whl carried"
  fi
  nvidia-smi -L; nproc
  PYTHONPATH=/tmp/site:. python3 -c "import torch, megatron.core, transformers, cloudpickle; print('torch', \
torch.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())"
  git log -1 --format=%H 2> /dev/null || echo "commit: ${MILES_LP_COMMIT:-unknown (no .git here)}"
} > "$OUT/device.txt" 2>&1
export PYTHONPATH=/tmp/site:.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
read -r -a runs <<< "${RUNS:-rehearsal-dense-tp2-dp2 rehearsal-moe-ep2-dp2 rehearsal-deepseek-pp2}"
left=${#runs[@]}
for r in "${runs[@]}"; do
  limit=$(( (budget - (SECONDS - start_all)) / left ))
  left=$((left - 1))
  if [ "$limit" -lt 20 ]; then
    echo "$r skipped: ${limit} s left of BUDGET_S=$budget" >> "$OUT/summary.txt"
    continue
  fi
  t0=$SECONDS
  timeout -k 10 "$limit" python3 -m miles_lp.cli run "recipes/$r.yaml" --set ray.enabled=false \
    --set sync.transport=inprocess --set rollout.device=cuda --set logging.output_dir=/tmp/rehearsal-runs \
    --set logging.progress=false ${EXTRA:-} --run-name "$r" > "$OUT/$r.log" 2>&1
  rc=$?
  cp "/tmp/rehearsal-runs/$r/metrics.jsonl" "$OUT/$r.metrics.jsonl" 2> /dev/null
  steps=$( (wc -l < "$OUT/$r.metrics.jsonl") 2> /dev/null || echo 0)
  echo "$r rc=$rc wall_s=$((SECONDS - t0)) limit_s=$limit steps=$steps" >> "$OUT/summary.txt"
done
echo "total_s=$((SECONDS - start_all))" >> "$OUT/summary.txt"
