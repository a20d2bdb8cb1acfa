#!/usr/bin/env bash
# Run a plora sweep on a Ray cluster described by ray_cluster.yaml and fetch its results.
#
# Steps: start the cluster (`ray up`), forward the dashboard/job port, plan the sweep locally,
# submit `plora sweep ... --address auto` as a Ray job, follow it, show `plora status`, copy the
# sweep directory back (`ray rsync-down`) and write the HTML report. The sweep directory must be
# on storage every node mounts (ray_cluster.yaml mounts it under /mnt/shared).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: examples/cluster_submit.sh [options] SWEEP.yaml

Run SWEEP.yaml on the Ray cluster of a cluster config and fetch the results.

options:
  -c, --cluster FILE   cluster config for `ray up` (default: ray_cluster.yaml)
  -r, --remote DIR     sweep directory on the cluster's shared storage
                       (default: /mnt/shared/runs/<sweep file name>)
  -l, --local DIR      where to copy the sweep directory back (default: runs/<sweep file name>)
  -p, --port PORT      local port for the forwarded Ray dashboard / job API (default: 8265)
      --resume         continue the sweep already in --remote (after a driver failure)
      --no-wait        submit and return; fetch later with `ray rsync-down`
      --down           tear the cluster down (`ray down`) after fetching the results
  -h, --help           show this help

example:
  examples/cluster_submit.sh sweeps/paper-table1.yaml
EOF
}

die() {
    echo "cluster_submit.sh: $*" >&2
    exit 2
}

cluster=ray_cluster.yaml
remote=""
local_dir=""
port=8265
resume=()
wait_for_job=1
down=0
sweep=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -c | --cluster) cluster="${2:?--cluster needs a file}"; shift 2 ;;
        -r | --remote) remote="${2:?--remote needs a directory}"; shift 2 ;;
        -l | --local) local_dir="${2:?--local needs a directory}"; shift 2 ;;
        -p | --port) port="${2:?--port needs a number}"; shift 2 ;;
        --resume) resume=(--resume); shift ;;
        --no-wait) wait_for_job=0; shift ;;
        --down) down=1; shift ;;
        -h | --help) usage; exit 0 ;;
        -*) usage >&2; die "unknown option $1" ;;
        *)
            [[ -z "$sweep" ]] || die "one sweep file only (got $sweep and $1)"
            sweep="$1"; shift ;;
    esac
done
[[ -n "$sweep" ]] || { usage >&2; die "missing SWEEP.yaml"; }
[[ -f "$sweep" ]] || die "sweep file $sweep not found"
[[ -f "$cluster" ]] || die "cluster config $cluster not found (see ray_cluster.yaml)"
[[ "$port" =~ ^[0-9]+$ ]] || die "--port $port is not a number"
for tool in ray plora; do
    command -v "$tool" >/dev/null || die "$tool not on PATH; pip install 'ray[default]' and plora"
done

name="$(basename "${sweep%.*}")"
remote="${remote:-/mnt/shared/runs/$name}"
local_dir="${local_dir:-runs/$name}"
address="http://127.0.0.1:$port"

# 1. the plan, locally and offline: catches a bad sweep file or configs that fit no GPU before
#    any cloud instance starts
plora plan "$sweep"

# 2. Ray's token authentication (Ray >= 2.52, on by default from 2.61): one token, made here
#    and copied to every node by the cluster config; clients (ray job submit) send it
if [[ -z "${RAY_AUTH_TOKEN:-}" && ! -s "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]]; then
    ray get-auth-token --generate >/dev/null
fi
export RAY_AUTH_MODE=token

# 3. the cluster's head node (workers are added by the autoscaler as jobs ask for GPUs)
ray up -y "$cluster"

# 4. forward the dashboard / job submission port; stopped when this script exits (the health
#    check is one of the dashboard's public endpoints: it answers before any token is sent)
ray dashboard -p "$port" "$cluster" >/dev/null 2>&1 &
dashboard_pid=$!
trap 'kill "$dashboard_pid" 2>/dev/null || true' EXIT
for _ in $(seq 60); do
    curl -fsS "$address/api/gcs_healthz" >/dev/null 2>&1 && break
    sleep 1
done
curl -fsS "$address/api/gcs_healthz" >/dev/null 2>&1 || die "the Ray dashboard at $address did not come up"

# 5. the sweep as a Ray job: the driver runs on the head node, joins the cluster (--address
#    auto) and places each packed job on d GPUs of one worker node
submit=(ray job submit --address "$address" --working-dir .)
[[ $wait_for_job -eq 1 ]] || submit+=(--no-wait)
"${submit[@]}" -- plora sweep "$sweep" --address auto --out "$remote" "${resume[@]}"

if [[ $wait_for_job -eq 0 ]]; then
    echo "submitted; follow it with: ray job list --address $address"
    echo "then: ray exec $cluster \"plora status $remote\" && ray rsync-down $cluster $remote $local_dir"
    exit 0
fi

# 6. progress and results: status on the cluster, then the sweep directory back here
ray exec "$cluster" "plora status $remote"
mkdir -p "$(dirname "$local_dir")"
ray rsync-down "$cluster" "$remote/" "$local_dir"
plora status "$local_dir"
plora report "$local_dir" --out "$local_dir/report.html"
echo "sweep directory: $local_dir (open notebooks/sweep_report.ipynb with PLORA_SWEEP_DIR=$local_dir)"

if [[ $down -eq 1 ]]; then
    ray down -y "$cluster"
fi
