#!/usr/bin/env bash
# An RL run on one CUDA device on a ~0.5B model, three arms from one call: BF16, MXFP8 and fp8_block (learner and
# reference engine colocated on the GPU, ray off, checks C1-C5 in raise mode). The model: a random Qwen3 of
# Qwen2.5-0.5B's widths (24 layers, hidden 896, intermediate 4864, 14 / 2 heads of 64, vocab 151936; lm_head
# untied: ~0.63B parameters), built locally; the task: JSONL prompts of bimodal length (2-12 or 40-120 tokens) so
# tokens per step vary for the cost fit. Writes each run's metrics.jsonl and recipe (ARM/, ARM-pN/ or ARM-lN/), a stage-time
# summary (stages.txt) and `miles-lp experiment cost` (cost/) under $OUT.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_rl_05b.sh [STEPS] [--set KEY=VALUE ...]   (extra --set for every
# arm, e.g. --set train.param_dtype=bf16: BF16 compute copies of the FP32 masters, so the engine serves in bf16)
# Environment (defaults: the single-size run above):
#   PROMPTS="2 8 4"  rl.prompts_per_step per run (default 4): each arm runs once per value (ARM-pN), so the
#                    generate stage's tokens per step vary between runs even when every response hits its cap; the
#                    cost step pools each arm's runs (`experiment cost --pool`, each run's first SKIP steps dropped)
#   LENS="32 256"    instead of several PROMPTS: rollout.max_response_len per run (ARM-lN), prompts fixed at PROMPTS
#                    (one value). A random policy never samples EOS, so every response fills its cap: generated
#                    tokens per step = PROMPTS*8*LEN, the decode steps grow with LEN (a latency-bound decode costs
#                    per decode step, so the generate time grows with T) and so do the trained sequences. Runs go in
#                    a Latin order (round r: arm j at LENS[(r+j) % n], the arms' order rotated each round), so no arm
#                    and no size is always first
#   WARM=bf16        an arm run first for WARM_STEPS (default 2) steps and discarded (compile caches, clocks, the
#                    allocator); default: the first of ARMS with LENS, none otherwise; WARM=none for none
#   SKIP=2           steps dropped from the start of each run before the fit and in stages.txt (default 2 with
#                    LENS, else 1)
#   ARMS="bf16 fp8_block mxfp8"   arms (default bf16 mxfp8 fp8_block)
#   BUDGET=300       seconds for the whole script (default 0: none): a run starts only with its estimate left,
#                    each run is capped at RUN_LIMIT (default 175) or what is left. The estimate: RUN_EST if set,
#                    else 53 s (start-up ~45 s: imports, CUDA, model build, conversion, first sync; the last step's
#                    checkpoint ~8-12 s; a run always writes one) + STEPS x (0.8 + 0.007 x LEN) s per step
#   MODEL=tiny DEVICE=cpu MAX_LEN=8   a CPU smoke: the recipes' own tiny model (its num_layers: LAYERS, default
#                    2), learner and engine on the CPU, responses capped at MAX_LEN (default 64; LENS overrides it)
#   PACK=1           at the end, everything under $OUT but the log into $OUT/out.tgz (few files back from a call)
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup rl.log
steps=${1:-8}
shift || true
extra=("$@")
read -ra prompts <<< "${PROMPTS:-4}"
read -ra lens <<< "${LENS:-}"
read -ra arms <<< "${ARMS:-bf16 mxfp8 fp8_block}"
budget=${BUDGET:-0}
device=${DEVICE:-cuda}
if [ ${#lens[@]} -gt 0 ]; then
  [ ${#prompts[@]} -eq 1 ] || { echo "LENS and several PROMPTS: vary one of them (PROMPTS=4 LENS=\"32 256\")"; exit 2; }
  sizes=("${lens[@]}"); tag=l
else
  sizes=("${prompts[@]}"); tag=p
fi
nsize=${#sizes[@]}
if [ "$tag" = l ]; then skip=${SKIP:-2}; warm=${WARM:-${arms[0]}}; else skip=${SKIP:-1}; warm=${WARM:-none}; fi
[ "$skip" -lt "$steps" ] || { echo "SKIP=$skip drops every one of the $steps steps: raise STEPS"; exit 2; }
r=$(mktemp -d)
if [ "${MODEL:-0.5b}" = tiny ]; then
  model=(--set model.num_layers="${LAYERS:-2}")
else
  model=(--set model.num_layers=24 --set model.overrides.hidden_size=896 --set model.overrides.intermediate_size=4864
         --set model.overrides.num_attention_heads=14 --set model.overrides.num_key_value_heads=2
         --set model.overrides.head_dim=64 --set model.overrides.vocab_size=151936
         --set model.overrides.max_position_embeddings=4096)
fi
common=(--set train.device="$device" --set rollout.device="$device" --set task.name=jsonl
        --set task.path=docs/results/experiments-cpu-2026-12-01/varlen.jsonl --set rl.group_size=8
        --set checkpoint_every=0 --set sync.checks.self_check=raise --set logging.output_dir="$r")
declare -A recipe_of=([bf16]=tiny-bf16 [mxfp8]=tiny-mxfp8 [fp8_block]=tiny-fp8-blockwise-e2e)
for name in "${arms[@]}"; do
  : "${recipe_of[$name]:?"ARMS: unknown arm $name (bf16, mxfp8, fp8_block)"}"
done
# size_args SIZE -> the --set of one run's size; est STEPS LEN -> the seconds a run is expected to take
size_args() {
  if [ "$tag" = l ]; then sz=(--set rl.prompts_per_step="${prompts[0]}" --set rollout.max_response_len="$1")
  else sz=(--set rl.prompts_per_step="$1" --set rollout.max_response_len="${MAX_LEN:-64}"); fi
}
est() { echo "${RUN_EST:-$((53 + $1 * (800 + 7 * $2) / 1000))}"; }
# the plan: one arm per size in a Latin order (several sizes), else each arm in turn
plan=()   # "ARM SIZE"
if [ "$nsize" -gt 1 ]; then
  na=${#arms[@]}
  for ((rd = 0; rd < nsize; rd++)); do
    for ((k = 0; k < na; k++)); do
      j=$(((rd + k) % na)); plan+=("${arms[$j]} ${sizes[$(((rd + j) % nsize))]}")
    done
  done
else
  for name in "${arms[@]}"; do plan+=("$name ${sizes[0]}"); done
fi
len_of() { if [ "$tag" = l ]; then echo "$1"; else echo "${MAX_LEN:-64}"; fi; }
total=0
[ "$warm" != none ] && total=$(est "${WARM_STEPS:-2}" "$(len_of "${sizes[0]}")")
for e in "${plan[@]}"; do read -r _ z <<< "$e"; total=$((total + $(est "$steps" "$(len_of "$z")"))); done
shown=(); for e in "${plan[@]}"; do read -r a z <<< "$e"; shown+=("$a-$tag$z"); done
echo "plan (SKIP=$skip, estimated ${total} s$([ "$budget" -gt 0 ] && echo " of BUDGET=$budget")):" \
  "$([ "$warm" != none ] && echo "warm-up $warm x ${WARM_STEPS:-2} steps, then") ${shown[*]}"
[ "$budget" -gt 0 ] && [ "$total" -gt "$budget" ] && echo "plan: the estimate exceeds BUDGET; the last runs may be skipped"

launch() {   # launch RUN ARM SIZE STEPS LIMIT
  local run=$1 name=$2 size=$3 n=$4 limit=$5
  size_args "$size"
  step "rl_$run" "$limit" python3 -m miles_lp.cli run "recipes/${recipe_of[$name]}.yaml" "${model[@]}" "${common[@]}" \
    --set steps="$n" "${sz[@]}" "${extra[@]}" --set logging.run_name="h200-$run"
}
[ "$warm" = none ] || : "${recipe_of[$warm]:?"WARM: unknown arm $warm (bf16, mxfp8, fp8_block, none)"}"
if [ "$warm" != none ] && [ "$budget" -gt 0 ] && \
   [ $((budget - SECONDS)) -lt "$(est "${WARM_STEPS:-2}" "$(len_of "${sizes[0]}")")" ]; then
  echo "=== rl_warm-$warm: skipped ($((budget - SECONDS)) s left of BUDGET=$budget)"; warm=none
fi
if [ "$warm" != none ]; then   # discarded: it only warms the caches and the GPU
  nfail=${#failed[@]}
  launch "warm-$warm" "$warm" "${sizes[0]}" "${WARM_STEPS:-2}" "${RUN_LIMIT:-175}"
  failed=("${failed[@]:0:$nfail}")   # a failed warm-up is reported above but is no failed measurement
  rm -rf "${r:?}/h200-warm-$warm"
fi
names=()        # the runs that finished, in order
declare -A done_of=()
for e in "${plan[@]}"; do
  read -r name z <<< "$e"
  run=$name; [ "$nsize" -gt 1 ] && run="$name-$tag$z"
  limit=${RUN_LIMIT:-175}
  if [ "$budget" -gt 0 ]; then
    left=$((budget - SECONDS)); need=$(est "$steps" "$(len_of "$z")")
    if [ "$left" -lt "$need" ]; then
      echo "=== rl_$run: skipped ($left s left of BUDGET=$budget; this run needs ~$need s)"; continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  nfail=${#failed[@]}
  launch "$run" "$name" "$z" "$steps" "$limit"
  if [ -f "$r/h200-$run/metrics.jsonl" ]; then
    mkdir -p "$out/$run"
    cp "$r/h200-$run"/metrics.jsonl "$r/h200-$run"/recipe.yaml "$out/$run/"
    names+=("$run")
    [ ${#failed[@]} -gt "$nfail" ] || done_of[$name]=$((${done_of[$name]:-0} + 1))
  fi
  rm -rf "${r:?}/h200-$run"   # its checkpoint (GBs): only the metrics are kept
done
python3 - "$out" "$skip" "${names[@]}" <<'PY' | tee "$out/stages.txt"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':<14} {'steps':>5} {'step s':>8} {'generate':>9} {'train':>8} {'sync':>8} {'checks':>8} {'other':>8}"
      f" {'gen tok':>8} {'kl (median)':>12}   (medians over steps {int(sys.argv[2]) + 1}..; train = old_log_prob + ref + update_actor)")
for arm in sys.argv[3:]:
    rows = [json.loads(l) for l in (out / arm / "metrics.jsonl").read_text().splitlines() if l.strip()][int(sys.argv[2]):]
    if not rows:
        print(f"{arm:<14} no step after the first {sys.argv[2]}"); continue
    med = lambda fn: statistics.median([fn(r) for r in rows])
    t = lambda r, *ss: sum(r.get(f"timing_s/{s}", 0.0) for s in ss)
    total = lambda r: r.get("timing_s/step") or sum(v for k, v in r.items() if k.startswith("timing_s/"))
    train = ("old_log_prob", "ref", "update_actor")
    print(f"{arm:<14} {len(rows):>5} {med(total):>8.3f} {med(lambda r: t(r, 'generate')):>9.3f}"
          f" {med(lambda r: t(r, *train)):>8.3f} {med(lambda r: t(r, 'sync')):>8.3f} {med(lambda r: t(r, 'checks')):>8.3f}"
          f" {med(lambda r: total(r) - t(r, 'generate', 'sync', 'checks', *train)):>8.3f}"
          f" {med(lambda r: r.get('tokens/generate', float('nan'))):>8.0f}"
          f" {med(lambda r: r.get('rollout_corr/kl', float('nan'))):>12.3g}")
PY
if [ "$nsize" -gt 1 ]; then   # pool each arm's runs (every size finished) into one fit
  dirs=(); keep=()
  for name in "${arms[@]}"; do
    if [ "${done_of[$name]:-0}" -eq "$nsize" ]; then
      keep+=("$name"); for z in "${sizes[@]}"; do dirs+=("$out/$name-$tag$z"); done
    else
      echo "cost: $name left out (${done_of[$name]:-0} of $nsize sizes finished)"
    fi
  done
  if [ ${#keep[@]} -gt 0 ]; then
    step cost 60 python3 -m miles_lp.cli experiment cost "${dirs[@]}" --pool "$nsize" --skip "$skip" \
      --names "${keep[@]}" --out "$out/cost"
  fi
else
  dirs=(); for n in "${names[@]}"; do dirs+=("$out/$n"); done
  step cost 60 python3 -m miles_lp.cli experiment cost "${dirs[@]}" --skip "$skip" --names "${names[@]}" \
    --out "$out/cost"
fi
rm -rf "$r"
echo "total ${SECONDS} s"
if [ "${PACK:-0}" = 1 ]; then
  tgz=$(mktemp --suffix .tgz)   # written outside $OUT: tar must not read its own archive
  if tar czf "$tgz" -C "$out" --exclude ./rl.log .; then
    chmod 644 "$tgz"; find "$out" -mindepth 1 -maxdepth 1 ! -name rl.log -exec rm -rf {} + && mv "$tgz" "$out/out.tgz"
    echo "packed into $out/out.tgz: $(tar tzf "$out/out.tgz" | grep -c -v /$) files"
  else
    echo "PACK: tar failed; the files stay unpacked under $out"; rm -f "$tgz"
  fi
fi
h200_finish
