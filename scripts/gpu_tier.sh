#!/usr/bin/env bash
# The GPU tier on a fresh lent machine, whole: every test of `pytest -m gpu tests/gpu`, inside
# one device call. With MULTIGPU=1, then the packed multi-GPU step of benchmarks/multigpu.py
# (14B shape, tp/fsdp/pp, K = 16, Liger) when there are 2 GPUs.
#
#   device run, kind nvidia-h200-x2, carry [".device"]:  bash scripts/gpu_tier.sh
#
# On two GPUs the tier runs in three phases (measured on 2 x H200, 2026-11-28: one pytest process
# took ~540 s before the warm-up tests and ~166 s for them):
#   0. the timed tests (the cost model's refit from measured steps) alone on the machine: run
#      beside phase 1's compiles, their host-bound steps ran up to 19 % slow and the fit missed
#      (2026-11-28, 2 x H200);
#   1. side by side: the warm-up tests (three fresh processes compiling Triton kernels into
#      cold caches: CPU-bound) on GPU 1, and every other one-GPU test on GPU 0;
#   2. the two-GPU tests (NCCL equivalence, resident d = 2 sessions, the killed rank under Ray).
# On one GPU, one process runs them all (the two-GPU ones skip with their reason).
#
# Writes $OUT/env.txt; per part $OUT/gpu-tier-PART.log (the passing tests' output too: measured
# spreads and fits; the slowest tests) and $OUT/gpu-tier-PART.xml (junit); $OUT/gpu-tier.txt
# (scripts/junit_summary.py over every part: the counts, each skip's reason, each failure; then
# the wall time): 10 files, what a device call brings back. With MULTIGPU=1 also
# $OUT/multigpu.json and $OUT/multigpu.log. Exit status: 0 when every part passed (the
# benchmark's failures are rows of its JSON).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
ROOT=$(pwd)
# tests run from a copy of tests/ (and the pytest settings) outside the repository: pytest
# would otherwise put the repository root, and its kernels/, on sys.path
rm -rf /tmp/plora-tests && mkdir -p /tmp/plora-tests
cp -r tests pyproject.toml /tmp/plora-tests/
TWO_GPU=(tests/gpu/test_parallel_gpu.py tests/gpu/test_parallel_jobs_gpu.py
         tests/gpu/test_parallel_session_gpu.py)
SIDE=(tests/gpu/test_warmup_gpu.py)
TIMED=(tests/gpu/test_cost_gpu.py)
deadline=$(( $(date +%s) + ${TIER_TIMEOUT_S:-540} ))

part() {  # part NAME GPUS FILES...: one pytest process, its log and junit under $OUT
  local name=$1 gpus=$2; shift 2
  local left=$(( deadline - $(date +%s) ))
  (cd /tmp/plora-tests && CUDA_VISIBLE_DEVICES=$gpus timeout "$left" python3 -m pytest -q -m gpu \
     "$@" -p no:cacheprovider -rP --durations=15 --junitxml="$OUT/gpu-tier-$name.xml" \
     ${PYTEST_ARGS:-}) > "$OUT/gpu-tier-$name.log" 2>&1
  local status=$?
  echo "part $name (GPUs $gpus): pytest exit $status at $(( $(date +%s) - start )) s"
  return $status
}

start=$(date +%s)
gpus=${TIER_GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}  # TIER_GPUS: a dry run of the phases
status=0
parts=(all)
if [ "$gpus" -ge 2 ]; then
  parts=(timed side one two)
  ignore=()
  for f in "${TWO_GPU[@]}" "${SIDE[@]}" "${TIMED[@]}"; do ignore+=(--ignore="$f"); done
  part timed 0 "${TIMED[@]}" || status=1
  part side 1 "${SIDE[@]}" & side=$!
  part one 0 tests/gpu "${ignore[@]}" || status=1
  wait $side || status=1
  part two 0,1 "${TWO_GPU[@]}" || status=1
else
  part all 0 tests/gpu || status=1
fi
xmls=()
for p in "${parts[@]}"; do xmls+=("$OUT/gpu-tier-$p.xml"); done
{
  python3 "$ROOT/scripts/junit_summary.py" "${xmls[@]}"
  echo "tier wall: $(( $(date +%s) - start )) s ($gpus GPUs, parts: ${parts[*]})"
} | tee "$OUT/gpu-tier.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "$gpus" -ge 2 ] && [ -n "${MULTIGPU:-}" ]; then
  timeout "${BENCH_TIMEOUT_S:-300}" python3 benchmarks/multigpu.py --gpus 2 \
    --models Qwen/Qwen2.5-14B --strategies pp tp fsdp --packs ${PACKS:-16} --liger --steps 3 \
    --no-min-gpu --out "$OUT" 2>&1 | tee "$OUT/multigpu.log" | grep -v "^W1\|Warning\|warn"
fi
exit "$status"
