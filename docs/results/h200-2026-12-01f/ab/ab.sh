#!/usr/bin/env bash
# A/B of the sync's host cuts in one device call: the 12-01e tree (old) and the host cuts' (new), alternating.
set -uo pipefail
cd "$(dirname "$0")"
source new/scripts/h200_common.sh
h200_setup session.log
for t in old new old new; do
  step "bench_$t" 200 bash -c "cd $t && PYTHONPATH=\$PWD:\${PYTHONPATH:-} python3 -m miles_lp.cli bench sync --device cuda --params 1e9 --iters 10 --json > '$out/bench_${t}_\$RANDOM.txt' 2>&1"
done
step profile_new 200 bash -c "cd new && PYTHONPATH=\$PWD:\${PYTHONPATH:-} python3 -m miles_lp.cli bench sync --device cuda --params 1e9 --iters 3 --profile > '$out/profile_new.txt' 2>&1"
for f in "$out"/bench_*.txt; do echo "== $f"; grep -v '^  sync v' "$f" | sed -n '/^format/,/^targets/p' | head -4; done
h200_finish
