#!/usr/bin/env bash
# benchmarks/e2e.py's cases on one machine of $GPUS GPUs (default 4: issue 27's L and M; issue
# 31's T on 8; issue 42's S on 1), longer than one device call: the first call starts them in a
# session of their own, every call waits up to $WAIT_S for them and copies the JSON, the logs
# and plora's plans to $OUT.
#
#   device run, kind nvidia-h100-x4, carry [".device"]:
#     CASES="L M" bash scripts/gpu_e2e.sh start     # then, within 30 s of each return:
#     bash scripts/gpu_e2e.sh wait
#   device run, kind nvidia-h100-x8 (issue 31):
#     GPUS=8 CASES=T bash scripts/gpu_e2e.sh start  # then: bash scripts/gpu_e2e.sh wait
#   device run, kind nvidia-h200 (issue 42's Table-1 slice, four systems: ~30 min in all):
#     GPUS=1 CASES=S SYSTEM_TIMEOUT_S=1500 bash scripts/gpu_e2e.sh start  # then: ... wait
#   E2E_ARGS adds flags to every case (e.g. E2E_ARGS="--systems plora,plora-single,tune").
set -uo pipefail
RUN=/tmp/e2e-run
WORK=/tmp/e2e-work
GPUS=${GPUS:-4}
case "$GPUS" in
  1|2|4|8) ;;
  *) echo "gpu_e2e.sh: GPUS=$GPUS: use 1, 2, 4 or 8" >&2; exit 2 ;;
esac
if [ "${1:-start}" = start ]; then
  source "$(dirname "$0")/gpu_env.sh"   # copies plora once: a later call must not replace it
  mkdir -p "$RUN"
  cases=${CASES:-L M}
  setsid bash -c "for c in $cases; do
      python3 benchmarks/e2e.py --case \$c --gpus $GPUS --out $RUN/e2e-\$c.json --work $WORK \
        --timeout-s ${SYSTEM_TIMEOUT_S:-900} ${E2E_ARGS:-} > $RUN/e2e-\$c.log 2>&1
      echo \"case \$c exit \$?\" >> $RUN/status
    done; touch $RUN/done" < /dev/null > /dev/null 2>&1 &
  sleep 5
fi
OUT=${OUT:-/tmp/plora-out}
deadline=$((SECONDS + ${WAIT_S:-560}))
while [ ! -e "$RUN/done" ] && [ $SECONDS -lt $deadline ]; do sleep 10; done
nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
cat "$RUN/status" 2>/dev/null
# few files come back from a call: the JSON and logs as they are, the rest in one archive
cp "$RUN"/e2e-*.json "$RUN"/e2e-*.log "$OUT/" 2>/dev/null
(cd "$WORK" && tar -czf "$OUT/runs.tar.gz" --exclude='*/data' --exclude='*/plora/adapters' \
   --exclude='*/plora/checkpoints' --exclude='*/tune_storage' --exclude='*/profiles' run-* 2>/dev/null)
tail -5 "$RUN"/e2e-*.log 2>/dev/null
[ -e "$RUN/done" ] && echo "e2e: all cases done" || echo "e2e: still running"
