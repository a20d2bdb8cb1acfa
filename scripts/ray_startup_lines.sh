#!/usr/bin/env bash
# The start-up of local Ray sessions, as their logs time it (for scripts/gpu_graphs.sh): for each
# session under /tmp/ray newer than the file $1 (default: the latest session alone), the first
# lines of the GCS, the raylet and its agents, and the plora workers' lines about their engine
# load and kernel warm-ups. Prints to stdout.
if [ -n "${1:-}" ]; then
  sessions=$(find /tmp/ray -maxdepth 1 -name 'session_2*' -newer "$1" 2>/dev/null | sort)
else
  sessions=/tmp/ray/session_latest
fi
[ -n "$sessions" ] || { echo "no Ray session under /tmp/ray"; exit 0; }
for s in $sessions; do
  logs=$s/logs
  echo "#### $(basename "$(realpath "$s")")"
  for f in gcs_server.out raylet.out dashboard_agent.log runtime_env_agent.log; do
    [ -f "$logs/$f" ] || continue
    echo "== $f"
    head -2 "$logs/$f" | cut -c1-240
    grep -m 4 -iE "register|listening|started" "$logs/$f" | cut -c1-240
  done
  echo "== plora workers"
  grep -h -E "engine loaded|warm-up" "$logs"/worker-*.out "$logs"/worker-*.err 2>/dev/null | cut -c1-400
done
