#!/usr/bin/env bash
# An RL run on one CUDA device on a ~0.5B model, three arms from one call: BF16, MXFP8 and fp8_block (learner and
# reference engine colocated on the GPU, ray off, checks C1-C5 in raise mode). The model: a random Qwen3 of
# Qwen2.5-0.5B's widths (24 layers, hidden 896, intermediate 4864, 14 / 2 heads of 64, vocab 151936; lm_head
# untied: ~0.63B parameters), built locally; the task: JSONL prompts of bimodal length (2-12 or 40-120 tokens) so
# tokens per step vary for the cost fit. Writes each arm's metrics.jsonl and recipe, a stage-time summary
# (stages.txt) and `miles-lp experiment cost` (cost/) under $OUT.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_rl_05b.sh [STEPS] [--set KEY=VALUE ...]   (extra --set for every
# arm, e.g. --set train.param_dtype=bf16: BF16 compute copies of the FP32 masters, so the engine serves in bf16)
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup rl.log
steps=${1:-8}
shift || true
extra=("$@")
r=$(mktemp -d)
model=(--set model.num_layers=24 --set model.overrides.hidden_size=896 --set model.overrides.intermediate_size=4864
       --set model.overrides.num_attention_heads=14 --set model.overrides.num_key_value_heads=2
       --set model.overrides.head_dim=64 --set model.overrides.vocab_size=151936
       --set model.overrides.max_position_embeddings=4096)
common=(--set steps="$steps" --set train.device=cuda --set rollout.device=cuda --set task.name=jsonl
        --set task.path=docs/results/experiments-cpu-2026-12-01/varlen.jsonl --set rl.prompts_per_step=4
        --set rl.group_size=8 --set rollout.max_response_len=64 --set checkpoint_every=0
        --set sync.checks.self_check=raise --set logging.output_dir="$r")
names=()
for arm in bf16:tiny-bf16 mxfp8:tiny-mxfp8 fp8_block:tiny-fp8-blockwise-e2e; do
  name=${arm%%:*}; recipe=${arm#*:}
  step "rl_$name" 175 python3 -m miles_lp.cli run "recipes/$recipe.yaml" "${model[@]}" "${common[@]}" \
    "${extra[@]}" --set logging.run_name="h200-$name"
  mkdir -p "$out/$name"
  cp "$r/h200-$name"/metrics.jsonl "$r/h200-$name"/recipe.yaml "$out/$name/" 2>/dev/null
  names+=("$r/h200-$name")
done
python3 - "$out" <<'PY' | tee "$out/stages.txt"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'arm':<10} {'steps':>5} {'step s':>8} {'generate':>9} {'train':>8} {'sync':>8} {'checks':>8} {'other':>8}"
      f" {'kl (median)':>12}   (medians over steps 2..; train = old_log_prob + ref + update_actor)")
for arm in ("bf16", "mxfp8", "fp8_block"):
    f = out / arm / "metrics.jsonl"
    if not f.is_file():
        print(f"{arm:<10} no metrics"); continue
    rows = [json.loads(l) for l in f.read_text().splitlines() if l.strip()][1:]
    if not rows:
        print(f"{arm:<10} one step only"); continue
    med = lambda fn: statistics.median([fn(r) for r in rows])
    t = lambda r, *ss: sum(r.get(f"timing_s/{s}", 0.0) for s in ss)
    total = lambda r: r.get("timing_s/step") or sum(v for k, v in r.items() if k.startswith("timing_s/"))
    train = ("old_log_prob", "ref", "update_actor")
    print(f"{arm:<10} {len(rows):>5} {med(total):>8.3f} {med(lambda r: t(r, 'generate')):>9.3f}"
          f" {med(lambda r: t(r, *train)):>8.3f} {med(lambda r: t(r, 'sync')):>8.3f} {med(lambda r: t(r, 'checks')):>8.3f}"
          f" {med(lambda r: total(r) - t(r, 'generate', 'sync', 'checks', *train)):>8.3f}"
          f" {med(lambda r: r.get('rollout_corr/kl', float('nan'))):>12.3g}")
    print(f"{'':<10} timing keys: {sorted(k for k in rows[0] if k.startswith('timing_s/'))}")
PY
step cost 60 python3 -m miles_lp.cli experiment cost "${names[@]}" --names bf16 mxfp8 fp8_block --out "$out/cost"
h200_finish
