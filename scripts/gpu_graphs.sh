#!/usr/bin/env bash
# The CUDA-graphed packed step on one lent GPU, A/B against the eager step:
#   PART=step (default), in one call (~5 min):
#     1. tests: pytest -x tests/gpu/test_graphs_gpu.py tests/gpu/test_engine_gpu.py
#     2. throughput: benchmarks/engine_throughput.py, 3B shape, 16 adapters, eager then graphed
#     3. profile: benchmarks/engine_profile.py, 3B x16 rank 16, eager then graphed (wall, host
#        and GPU kernel ms per step, GPU idle)
#   PART=e2e: benchmarks/e2e.py's default case (1.5B, 16 configs), longer than one call: the first
#     call starts two runs in a session of their own, every call (the same command) waits
#     until $WAIT_S seconds into the call (default 540) for them and copies what is there:
#       e2e-off: --systems plora           --plora-graphs off
#       e2e-on:  --systems plora,tune-frac --plora-graphs on   (its speedup: graphed plora's)
#     both --fresh-profile (each plans from the priors: the same plan, run eager or graphed; set
#     FRESH_PROFILE=0 to plan from measurements); E2E_ARGS adds flags to both. Each run compiles
#     into a cold Triton cache of its own, and e2e-{off,on}-ray.txt keep its Ray sessions'
#     start-up lines and the workers' load / warm-up lines (scripts/ray_startup_lines.sh).
#   PART=all: step, then e2e started, waiting until 540 s into the call ($WAIT_S to change).
#   WAIT_S is a deadline from the call's start, not a wait after the step: keep it under the
#   call's timeout_s. A call killed at its limit (SIGTERM) still copies what it has to $OUT.
#   Knobs: TESTS (test files of step), THROUGHPUT=0 (skip engine_throughput), PROFILE_ARGS (more
#   engine_profile flags, e.g. "--graphs on --loss-kernel both --rounds 2"), BASELINE_PKG (the
#   e2e baseline is an older package copy run with graphs auto instead of plora eager),
#   NEW_GRAPHS (the new run's --plora-graphs, default on).
#
#   device run, kind nvidia-h100-x1, carry [".device"], timeout_s 600:
#     bash scripts/gpu_graphs.sh                      # PART=step
#     PART=e2e bash scripts/gpu_graphs.sh             # again, same command, until "e2e: done"
#
# Every step appends one line to summary.txt and is time-boxed (T_TESTS 200, T_THROUGHPUT 180,
# T_PROFILE 150 seconds; E2E_TIMEOUT_S 1500 per e2e run, SYSTEM_TIMEOUT_S 900 per system).
# $OUT gets (8 files at most): env.txt, summary.txt, graphs.tar.gz (every log and JSON), the
# JSONs of engine_throughput, engine_profile, e2e-off and e2e-on, and e2e-runs.tar.gz (plora's
# plans and tables of the e2e runs).
set -uo pipefail
PART=${PART:-step}
RUN=/tmp/graphs-run          # kept between calls on a warm machine (the e2e runs write here)
WORK=/tmp/graphs-e2e-work
SUMMARY=$RUN/summary.txt
case "$PART" in
  step|e2e|all) ;;
  *) echo "gpu_graphs.sh: PART=$PART: use step, e2e or all" >&2; exit 2 ;;
esac
mkdir -p "$RUN"
say() { echo "$*" | tee -a "$SUMMARY"; }
summary() { python3 scripts/graphs_summary.py "$@" | tee -a "$SUMMARY"; }

e2e_started() { [ -e "$RUN/e2e.started" ]; }
if ! e2e_started; then
  # copies plora to /tmp/plora-pkg: never while the e2e runs started by an earlier call import it
  source "$(dirname "$0")/gpu_env.sh"
  cp "$OUT/env.txt" "$RUN/env.txt"
fi
OUT=${OUT:-/tmp/plora-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/plora-pkg:/tmp/plora-site PATH=/tmp/plora-site/bin:$PATH

step() {
  if e2e_started && [ ! -e "$RUN/e2e.done" ]; then
    say "step: not run: the e2e runs hold the GPU (PART=e2e waits for them)"; return
  fi
  rm -f "$RUN"/engine_throughput.json "$RUN"/engine_profile.json   # no stale numbers
  say "== step $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  # 1. tests, from a copy of tests/ outside the repository (its root's kernels/ must not be on
  #    sys.path: see gpu_tier.sh)
  rm -rf /tmp/plora-tests && mkdir -p /tmp/plora-tests && cp -r tests pyproject.toml /tmp/plora-tests/
  local files=() f
  for f in ${TESTS:-tests/gpu/test_graphs_gpu.py tests/gpu/test_engine_gpu.py}; do
    if [ -f "$f" ]; then files+=("$f"); else say "tests: $f missing, not run"; fi
  done
  local rc=0
  if [ ${#files[@]} -gt 0 ]; then
    (cd /tmp/plora-tests && timeout "${T_TESTS:-200}" python3 -m pytest -q -x "${files[@]}" \
       -p no:cacheprovider --junitxml="$RUN/tests.xml") > "$RUN/tests.log" 2>&1
    rc=$?
    say "tests: exit $rc: $(grep -E '(passed|failed|error|no tests ran)' "$RUN/tests.log" | tail -1)"
  fi
  # 2. throughput, Liger on the base (the sweep's path) when the carried site has it
  local liger=on
  if ! python3 -c 'import liger_kernel' 2>/dev/null; then
    liger=off; say "throughput: liger_kernel not installed: --liger off"
  fi
  if [ "${THROUGHPUT:-1}" = 1 ]; then
    timeout "${T_THROUGHPUT:-180}" python3 benchmarks/engine_throughput.py \
      --models Qwen/Qwen2.5-3B --packs 16 --steps 6 --graphs both --liger "$liger" \
      --out "$RUN" > "$RUN/throughput.log" 2>&1
    rc=$?; [ $rc -eq 0 ] || say "throughput: exit $rc (see throughput.log)"
    summary throughput "$RUN/engine_throughput.json"
  fi
  # 3. profile
  timeout "${T_PROFILE:-150}" python3 benchmarks/engine_profile.py --model Qwen/Qwen2.5-3B \
    --adapters 16 --rank 16 --graphs both --liger "$liger" ${PROFILE_ARGS:-} --out "$RUN" \
    > "$RUN/profile.log" 2>&1
  rc=$?; [ $rc -eq 0 ] || say "profile: exit $rc (see profile.log)"
  summary profile "$RUN/engine_profile.json"
}

e2e_start() {
  local fresh=--fresh-profile
  [ "${FRESH_PROFILE:-1}" = 0 ] && fresh=
  local common="--work $WORK --timeout-s ${SYSTEM_TIMEOUT_S:-900} $fresh ${E2E_ARGS:-}"
  # the baseline run: plora eager, or ($BASELINE_PKG: a copy of an older plora package's parent
  # directory, e.g. .device/old with .device/old/plora) that code as a sweep runs it by default
  local base_env="" base_graphs="--plora-graphs off"
  if [ -n "${BASELINE_PKG:-}" ]; then
    base_env="PYTHONPATH=$(realpath "$BASELINE_PKG"):/tmp/plora-site"; base_graphs="--plora-graphs auto"
    say "e2e: baseline = the package in $BASELINE_PKG, graphs auto; the new run graphs ${NEW_GRAPHS:-on}"
  fi
  touch "$RUN/e2e.started"
  # each run compiles into a Triton cache of its own (cold, as on a fresh machine: the second run
  # must not find the first one's kernels), and keeps its Ray start-up and worker log lines
  setsid bash -c "
    touch $RUN/ray-mark-off
    TRITON_CACHE_DIR=$RUN/triton-off $base_env timeout ${E2E_TIMEOUT_S:-1500} python3 benchmarks/e2e.py \
      --systems plora $base_graphs --out $RUN/e2e-off.json $common > $RUN/e2e-off.log 2>&1
    echo \"e2e-off exit \$?\" >> $RUN/e2e.status
    bash scripts/ray_startup_lines.sh $RUN/ray-mark-off > $RUN/e2e-off-ray.txt 2>&1
    touch $RUN/ray-mark-on
    TRITON_CACHE_DIR=$RUN/triton-on timeout ${E2E_TIMEOUT_S:-1500} python3 benchmarks/e2e.py \
      --systems plora,tune-frac --plora-graphs ${NEW_GRAPHS:-on} --out $RUN/e2e-on.json $common \
      > $RUN/e2e-on.log 2>&1
    echo \"e2e-on exit \$?\" >> $RUN/e2e.status
    bash scripts/ray_startup_lines.sh $RUN/ray-mark-on > $RUN/e2e-on-ray.txt 2>&1
    touch $RUN/e2e.done" < /dev/null > /dev/null 2>&1 &
  say "e2e: started $(date -u +%FT%TZ)"
  sleep 5
}

e2e_wait() {
  local deadline=${1:-540}   # seconds into the call
  while [ ! -e "$RUN/e2e.done" ] && [ $SECONDS -lt $deadline ]; do sleep 10; done
  if [ -e "$RUN/e2e.done" ] && [ ! -e "$RUN/e2e.summarised" ]; then
    local run
    for run in off on; do
      summary e2e "$RUN/e2e-$run.json"
    done
    cat "$RUN/e2e.status" >> "$SUMMARY"
    touch "$RUN/e2e.summarised"
  fi
  if [ -e "$RUN/e2e.done" ]; then
    echo "e2e: done"
  else
    echo "e2e: still running (ended so far: $(tr '\n' ' ' < "$RUN/e2e.status" 2>/dev/null || echo none))"
  fi
}

# few files come back from a call: the summary, the JSONs, and the rest in one archive
collect() {
  cp "$SUMMARY" "$RUN/env.txt" "$OUT/" 2>/dev/null
  local f
  for f in engine_throughput.json engine_profile.json e2e-off.json e2e-on.json; do
    [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"
  done
  (cd "$RUN" && tar -czf "$OUT/graphs.tar.gz" --exclude='*.started' --exclude='*.done' \
     --exclude='*.summarised' --exclude='triton-*' --exclude='ray-mark-*' ./* 2>/dev/null)
  if [ -d "$WORK" ]; then   # plora's plans and job tables of the e2e runs, not the data or weights
    (cd "$WORK" && tar -czf "$OUT/e2e-runs.tar.gz" --exclude='*/data' --exclude='*/plora/adapters' \
       --exclude='*/plora/checkpoints' --exclude='*/tune_storage' --exclude='*/profiles' \
       run-* 2>/dev/null)
  fi
}
trap 'collect; exit 143' TERM   # killed at the call's limit: what is there still comes back

case "$PART" in
  step) step ;;
  e2e) e2e_started || e2e_start; e2e_wait "${WAIT_S:-540}" ;;
  all) step; e2e_started || e2e_start; e2e_wait "${WAIT_S:-540}" ;;
esac
collect
[ "$PART" = step ] || cat "$SUMMARY"   # step's lines were printed as they came
