# Sourced by the scripts/h200_*.sh device scripts (not run on its own): the shared preamble and the step runner.
#   h200_setup LOGNAME   logs everything to $OUT/LOGNAME (OUT defaults to ./h200_logs), puts the tree and the
#                        carried wheels (.whl/*.whl, e.g. megatron-core, torchao) on PYTHONPATH, prints the
#                        commit ($MILES_LP_COMMIT), the date and the GPUs
#   step NAME TIMEOUT CMD...   runs CMD under a time limit, prints its rc and seconds, remembers a failure
#   h200_finish          prints the failed steps; its status is non-zero if any failed
out="${OUT:-h200_logs}"
failed=()

h200_setup() {
  mkdir -p "$out"
  exec > >(tee "$out/$1") 2>&1
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
  echo "commit ${MILES_LP_COMMIT:-unknown}"; date -u; nvidia-smi -L
}

step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"; local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "=== $name: rc=$rc ($((SECONDS - t0)) s)"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

h200_finish() {
  echo "failed steps: ${failed[*]:-none}"
  [ ${#failed[@]} -eq 0 ]
}
