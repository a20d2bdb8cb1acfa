#!/usr/bin/env bash
# The two-GPU files of the GPU tier, then the 14B packed-step rows of benchmarks/multigpu.py for
# the strategies in $STRATEGIES (default: tp fsdp): a shorter call than scripts/gpu_tier.sh.
#
#   device run, kind nvidia-h100-x2, carry [".device"]:  bash scripts/gpu_multigpu_check.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
rm -rf /tmp/plora-tests && mkdir -p /tmp/plora-tests && cp -r tests pyproject.toml /tmp/plora-tests/
(cd /tmp/plora-tests && timeout "${TIER_TIMEOUT_S:-300}" python3 -m pytest -q -m gpu \
   tests/gpu/test_parallel_session_gpu.py tests/gpu/test_parallel_gpu.py \
   tests/gpu/test_parallel_jobs_gpu.py -p no:cacheprovider --junitxml="$OUT/gpu-2gpu.xml") 2>&1 \
   | tee "$OUT/gpu-2gpu.log" | grep -E "passed|failed|FAILED|Error" | tail -30
timeout "${BENCH_TIMEOUT_S:-170}" python3 benchmarks/multigpu.py --gpus 2 \
  --models Qwen/Qwen2.5-14B --strategies ${STRATEGIES:-tp fsdp} --packs ${PACKS:-16} --liger \
  --steps 3 --no-min-gpu --out "$OUT" 2>&1 | tee "$OUT/multigpu.log" | grep -E "tok/s|ERROR|FAILED"
