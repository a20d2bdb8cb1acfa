#!/usr/bin/env bash
# The GPU tier on a fresh lent machine, whole: `pytest -m gpu tests/gpu` (single- and two-GPU
# files; the two-GPU ones run where there are 2 GPUs), then the packed multi-GPU step of
# benchmarks/multigpu.py (14B shape, tp/fsdp/pp, K = 16, Liger) when there are 2 GPUs.
#
#   device run, kind nvidia-h100-x2, carry [".device"]:  bash scripts/gpu_tier.sh
#
# Writes $OUT/env.txt, $OUT/gpu-tier.log, $OUT/gpu-tier.xml (junit), $OUT/multigpu.json and
# $OUT/multigpu.log. Exit status: pytest's (the benchmark's failures are rows of its JSON).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# tests run from a copy of tests/ (and the pytest settings) outside the repository: pytest
# would otherwise put the repository root, and its kernels/, on sys.path
rm -rf /tmp/plora-tests && mkdir -p /tmp/plora-tests
cp -r tests pyproject.toml /tmp/plora-tests/
(cd /tmp/plora-tests && timeout "${TIER_TIMEOUT_S:-420}" python3 -m pytest -q -m gpu tests/gpu \
   -p no:cacheprovider --junitxml="$OUT/gpu-tier.xml" ${PYTEST_ARGS:-}) 2>&1 | tee "$OUT/gpu-tier.log"
status=${PIPESTATUS[0]}
ls -la ~/.cache/plora/tiny 2>&1 | tail -8 >> "$OUT/gpu-tier.log"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ] && [ -z "${SKIP_MULTIGPU:-}" ]; then
  timeout "${BENCH_TIMEOUT_S:-300}" python3 benchmarks/multigpu.py --gpus 2 \
    --models Qwen/Qwen2.5-14B --strategies pp tp fsdp --packs ${PACKS:-16} --liger --steps 3 \
    --no-min-gpu --out "$OUT" 2>&1 | tee "$OUT/multigpu.log" | grep -v "^W1\|Warning\|warn"
fi
exit "$status"
