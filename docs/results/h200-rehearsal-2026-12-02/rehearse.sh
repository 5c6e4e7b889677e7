#!/usr/bin/env bash
# The rehearsal recipes (recipes/rehearsal-*.yaml) on one H200, as far as one GPU and this image allow:
# * Ray is not in the device image and its 2.60 wheel (79.3 MB) is over what one call carries (64 MiB): the runs
#   have ray.enabled false, the learner's ranks spawned processes (train.megatron's sizes unchanged);
# * NCCL refuses two ranks on one GPU: the learner's ranks run on CPU with gloo (train.device cpu, as written);
# * the two reference engines share the GPU (rollout.device cuda), synced in process (sync.transport inprocess);
# * C1-C5 in raise mode, as written; 3 RL steps each.
# megatron-core 0.16.1 is carried as a wheel (.whl). Usage there: OUT=... bash rehearse.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.txt" 2>&1 || { echo "wheel install failed" >> "$OUT/summary.txt"; exit 1; }
export PYTHONPATH=/tmp/site:.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi -L; nproc; python3 -c "import torch, megatron.core, transformers; print('torch', torch.__version__, \
'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; \
  git log -1 --format=%H 2>/dev/null; } > "$OUT/device.txt" 2>&1
for r in rehearsal-deepseek-pp2 rehearsal-dense-tp2-dp2 rehearsal-moe-ep2-dp2; do
  start=$(date +%s)
  timeout 110 python3 -m miles_lp.cli run "recipes/$r.yaml" --set ray.enabled=false --set sync.transport=inprocess \
    --set rollout.device=cuda --set logging.output_dir="$OUT/runs" --set logging.progress=false --run-name "$r" \
    > "$OUT/$r.log" 2>&1
  rc=$?
  echo "$r rc=$rc wall_s=$(( $(date +%s) - start ))" >> "$OUT/summary.txt"
  rm -rf "$OUT/runs/$r/model" "$OUT/runs/$r/engine_init" "$OUT/runs/$r/checkpoints"
done
