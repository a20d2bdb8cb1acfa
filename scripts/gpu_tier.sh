#!/usr/bin/env bash
# The GPU tier on a fresh lent machine, whole: `pytest -m gpu tests/gpu` (single- and two-GPU
# files; the two-GPU ones run where there are 2 GPUs), inside one device call. With MULTIGPU=1,
# then the packed multi-GPU step of benchmarks/multigpu.py (14B shape, tp/fsdp/pp, K = 16,
# Liger) when there are 2 GPUs.
#
#   device run, kind nvidia-h200-x2, carry [".device"]:  bash scripts/gpu_tier.sh
#
# Writes $OUT/env.txt, $OUT/gpu-tier.log (with the slowest tests), $OUT/gpu-tier.xml (junit),
# $OUT/gpu-tier.txt (scripts/junit_summary.py: the counts, each skip's reason, each failure);
# with MULTIGPU=1 $OUT/multigpu.json and $OUT/multigpu.log. Exit status: pytest's (the
# benchmark's failures are rows of its JSON).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# tests run from a copy of tests/ (and the pytest settings) outside the repository: pytest
# would otherwise put the repository root, and its kernels/, on sys.path
rm -rf /tmp/plora-tests && mkdir -p /tmp/plora-tests
cp -r tests pyproject.toml /tmp/plora-tests/
start=$(date +%s)
(cd /tmp/plora-tests && timeout "${TIER_TIMEOUT_S:-540}" python3 -m pytest -q -m gpu tests/gpu \
   -p no:cacheprovider --durations=30 --junitxml="$OUT/gpu-tier.xml" ${PYTEST_ARGS:-}) 2>&1 \
   | tee "$OUT/gpu-tier.log"
status=${PIPESTATUS[0]}
echo "tier wall: $(( $(date +%s) - start )) s (pytest exit $status)" | tee -a "$OUT/gpu-tier.log"
[ -f "$OUT/gpu-tier.xml" ] && python3 scripts/junit_summary.py "$OUT/gpu-tier.xml" \
  | tee "$OUT/gpu-tier.txt"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ] && [ -n "${MULTIGPU:-}" ]; then
  timeout "${BENCH_TIMEOUT_S:-300}" python3 benchmarks/multigpu.py --gpus 2 \
    --models Qwen/Qwen2.5-14B --strategies pp tp fsdp --packs ${PACKS:-16} --liger --steps 3 \
    --no-min-gpu --out "$OUT" 2>&1 | tee "$OUT/multigpu.log" | grep -v "^W1\|Warning\|warn"
fi
exit "$status"
