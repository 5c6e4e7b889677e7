#!/usr/bin/env bash
# The weight sync on one CUDA device, in one device call; logs under $OUT.
#   pytest -m gpu for the sync and the reference engine; bench sync (1B random Qwen3-MoE: 9 layers, hidden 2048,
#   16 experts; MXFP8 and MXFP8 + NVFP4 experts; vs a flat device copy and a tensor-by-tensor copy of the same
#   bytes; with --profile: torch ops per stage and CUDA kernel count/time). Each step reports its verdict; the
#   script exits non-zero if any failed.
# Usage: MILES_LP_COMMIT=<sha> bash scripts/h200_sync.sh [--skip-tests]
set -uo pipefail
source "$(dirname "$0")/h200_common.sh"
h200_setup session.log
tests=1; [ "${1:-}" = --skip-tests ] && tests=0
if [ "$tests" = 1 ]; then
  step pytest_gpu 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
    $(grep -l "mark.gpu" tests/unit/test_rollout_*.py tests/unit/test_sync_*.py tests/e2e/test_*sync*.py 2>/dev/null)
fi
# the detection table on CUDA (bf16 engine: C2 and C4 from one engine call with the cached digest launch, C3 as a
# replayed CUDA graph): every fault must still be caught by its check, the healthy sync clean
step selftest_sync_cuda 200 python3 -m miles_lp.cli selftest sync --arch qwen3_moe --device cuda --json "$out/selftest_cuda.json"
step bench_sync 240 bash -c "python3 -m miles_lp.cli bench sync --device cuda --params 1e9 --iters 3 --json --profile \
  > '$out/bench_sync.txt' 2>&1; rc=\$?; grep -v '^  sync v' '$out/bench_sync.txt' | sed -n '/^format/,/^{/p'; exit \$rc"
if [[ " ${failed[*]:-} " == *" bench_sync "* ]]; then  # the bucket-fill / 0xFF-count kernels off, the digest kept
  tail -30 "$out/bench_sync.txt"
  step bench_sync_digest_only 240 bash -c "MILES_LP_SYNC_KERNELS=digest python3 -m miles_lp.cli bench sync --device cuda \
    --params 1e9 --iters 3 --json > '$out/bench_sync.txt' 2>&1; rc=\$?; sed -n '/^format/,/^{/p' '$out/bench_sync.txt'; exit \$rc"
fi
# the same engine paths with the checks' current designs off (two separate engine calls for C2 and C4, C3 eager),
# MXFP8 only: the per-check figures of both designs on one machine
step bench_sync_before 150 bash -c "MILES_LP_SYNC_SHARED=0 MILES_LP_SYNC_GRAPHS=0 python3 -m miles_lp.cli bench sync \
  --device cuda --params 1e9 --iters 3 --format mxfp8 > '$out/bench_sync_before.txt' 2>&1; rc=\$?; \
  grep -v '^  sync v' '$out/bench_sync_before.txt' | sed -n '/^format/,/^targets/p'; exit \$rc"
python3 - "$out/bench_sync.txt" "$out/bench_sync.json" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
start = text.find('\n{\n')
if start >= 0:
    doc = json.loads(text[start + 1:])
    json.dump(doc, open(sys.argv[2], "w"), indent=2)
    for r in doc["results"]:
        st = r["stages"]
        print(f"{r['format']}: sync {r['sync_seconds']:.4f} s = {r['ratio']:.1f}x flat copy ({r['copy_seconds']:.5f} s), "
              f"{r['ratio_tensorwise']:.1f}x tensor copy; checks {100 * r['check_share']:.1f}%; stages "
              + "/".join(f"{st[k]:.4f}" for k in ("export", "transfer", "apply", "finish")))
        print("  per check (ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in r["per_check"].items()))
        ab = r.get("checks_ab")
        if ab:
            print(f"  interleaved A/B: on {ab['on_seconds']:.4f} s, off {ab['off_seconds']:.4f} s, on - off "
                  f"{ab['on_minus_off_seconds'] * 1e3:.2f} ms; C3: {r.get('c3', '')}")
PY
h200_finish
