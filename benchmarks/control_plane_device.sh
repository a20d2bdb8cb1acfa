#!/usr/bin/env bash
# benchmarks/control_plane.py at the size (10,000 configs on 32 x 8 logical GPUs) on a
# lent machine's host, as a big CPU box, across several device calls: one call lasts at most
# 600 s and the whole sweep needs more, so the first call starts the benchmark in a process
# session of its own (setsid: it outlives the call and runs on while the machine stays warm, 30 s
# between calls) from copies outside the tree (each call re-sends the tree), and the later calls
# wait for it. Nothing runs on the GPU.
#
#   bash benchmarks/control_plane_device.sh start [control_plane.py ARGS...]   # the first call
#   bash benchmarks/control_plane_device.sh wait                               # each later call
#
# Each call waits up to WAIT_S seconds (default 540) for the report, then copies into $OUT what
# there is: report.json (or report.json.partial, the report so far), the benchmark's log tail and
# the host's load every 30 s, and
# the sweep directory's sizes once it ended. Carry .device (../shared/tools/device-site.sh highspy builds it).
set -uo pipefail
mode=${1:?usage: control_plane_device.sh start [ARGS...] | wait}
shift
OUT=${OUT:-/tmp/plora-out}
WORK=/tmp/cp-device
WAIT_S=${WAIT_S:-540}
mkdir -p "$OUT"

if [ "$mode" = start ]; then
  # shellcheck source=../scripts/gpu_env.sh
  source scripts/gpu_env.sh >/dev/null
  rm -rf "$WORK" && mkdir -p "$WORK" && cp -r benchmarks plora kernels "$WORK/"
  printf '%s\n' "PYTHONPATH=$PYTHONPATH" "args: $*" > "$WORK/env.txt"
  (cd "$WORK" && setsid nohup python3 benchmarks/control_plane.py "$@" --out "$WORK/sweep" \
    --keep --json "$WORK/report.json" > "$WORK/log.txt" 2>&1 < /dev/null &)
  (setsid nohup bash -c "while sleep 30; do echo \"\$(date -u +%T) \$(cat /proc/loadavg) \
\$(free -g | awk '/Mem/{print \$3}') GiB\"; done" > "$WORK/load.txt" 2>&1 < /dev/null &)
elif [ "$mode" != wait ]; then
  echo "usage: control_plane_device.sh start [ARGS...] | wait" >&2
  exit 2
fi

start=$SECONDS
while [ ! -f "$WORK/report.json" ] && [ $((SECONDS - start)) -lt "$WAIT_S" ]; do
  sleep 10
done
for f in report.json report.json.partial env.txt load.txt; do
  [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/$f"
done
[ -f "$WORK/report.json" ] && du -sk "$WORK/sweep"/* "$WORK/sweep"/state.parts/* > "$OUT/sizes_kb.txt" 2>&1
tail -c 200000 "$WORK/log.txt" > "$OUT/log.txt" 2>/dev/null
tail -n 5 "$OUT/log.txt"
[ -f "$WORK/report.json" ] && echo "report: done" || echo "report: not yet ($((SECONDS - start)) s waited)"
