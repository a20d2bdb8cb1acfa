#!/usr/bin/env bash
# Packed d = 2 steps before and after a change, side by side in one device call, with profiles.
#
#   device run, kind nvidia-h200-x2, carry [".device"]:  bash scripts/gpu_multigpu_compare.sh
#
# "before" is the package in .device/before/ (made here with
#   mkdir -p .device/before && git archive REV plora kernels | tar -x -C .device/before),
# run by this tree's benchmarks/multigpu.py; "after" is this tree. Cases (14B shape, K batch-1
# rank-16 adapters, seq 1,024, Liger): pp K = 16 (before and after, profiled); tp and fsdp
# K = 1, 8, 16 (profiled) and fsdp K = 16 with activation checkpointing; pp K = 1, 8; the
# pipeline's micro-batch count swept (--pp-micro; the default is the trainer's 2·pp). Each group
# has its own time limit (CASE_TIMEOUT_S, default 150 s), so one that runs long costs only
# itself. Writes under $OUT: before/ and after*/ (multigpu.json, profile-*.json, the ranks
# traces) and compare.log.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
T=${CASE_TIMEOUT_S:-150}
bench() {  # bench DIR PYTHONPATH ARGS...: one benchmark invocation into $OUT/DIR
  local dir=$1 path=$2; shift 2
  echo "== $dir: $* ($(date -u +%T))"
  PYTHONPATH=$path timeout "$T" python3 benchmarks/multigpu.py --gpus 2 \
    --models Qwen/Qwen2.5-14B --liger --steps 3 --no-min-gpu --out "$OUT/$dir" "$@" 2>&1 \
    | grep -v "Warning\|warn\|^W1\|USDT\|profiler_st"
}
{
  if [ -d .device/before/plora ]; then
    rm -rf /tmp/plora-before && mkdir -p /tmp/plora-before
    cp -r .device/before/plora /tmp/plora-before/plora
    cp -r .device/before/kernels /tmp/plora-before/plora/kernels
    bench before /tmp/plora-before:/tmp/plora-site --strategies pp --packs 16 --profile
  fi
  bench after "$PYTHONPATH" --strategies pp --packs 16 --profile
  bench after-tp "$PYTHONPATH" --strategies tp --packs 1 8 16 --checkpointing off --profile
  bench after-fsdp "$PYTHONPATH" --strategies fsdp --packs 1 8 16 --checkpointing off --profile
  bench after-fsdp-ckpt "$PYTHONPATH" --strategies fsdp --packs 16 --checkpointing on
  bench after-pp-packs "$PYTHONPATH" --strategies pp --packs 1 8
  bench after-pp-micro "$PYTHONPATH" --strategies pp --packs 16 --pp-micro 8 16
  echo "== done $(date -u +%T)"
} 2>&1 | tee "$OUT/compare.log"
