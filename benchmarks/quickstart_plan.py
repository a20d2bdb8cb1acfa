"""How close the quickstart's plan comes to its measured sweep, sweep after sweep, on this host.

Runs ``plora sweep sweeps/quickstart.yaml`` (CPU; embedded local Ray, or the cluster at
``--address``, as ``tests/ray/test_quickstart.py`` does) ``--sweeps`` times in a row with one
fresh profile store: the first sweep plans from the CPU defaults
(:data:`plora.cost.overheads.CPU` and the step prior), every later one from what the earlier
sweeps stored. For each sweep it prints the first plan's makespan, the time measured from that
plan to ``sweep_done`` (the coordinator's clock: Ray's start and the imports before it are in
neither), their ratio, and where the time went (:func:`plora.analysis.plan_check.plan_check`:
when the worker group was planned to be ready and was, the first jobs' train / eval /
checkpoint seconds as planned and as measured).

Usage::

    python benchmarks/quickstart_plan.py --sweeps 3 --work /tmp/qsplan
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from plora.analysis.plan_check import plan_check
from plora.sweepdir.store import SweepStore

ROOT = Path(__file__).resolve().parents[1]


def sweep_row(out: Path) -> dict:
    """The first plan against the measured sweep, and the phases, of one sweep directory."""
    check = plan_check(out)
    decisions = SweepStore(out).read_decisions()
    first = {d["kind"]: d for d in reversed(decisions)}  # the earliest decision of each kind
    start = first.get("start_workers", {"inputs": {}})["inputs"]
    ready = first.get("workers_ready", {"inputs": {}})["inputs"]
    row = {
        "planned_s": round(check.planned_s, 2),
        "measured_s": round(check.measured_s, 2),
        "ratio": round(check.ratio, 3),
        "driver_before_plan_s": round(start.get("elapsed_s", 0.0), 2),
        "worker_ready_s": round(ready.get("ready_s", 0.0), 2),
        "planned_ready_at_s": round(check.planned_ready_s or 0.0, 2),
        "workers_ready_at_s": round(check.ready_s or 0.0, 2),
    }
    for term, (planned, measured) in check.terms.items():
        row[f"planned_{term}"], row[term] = round(planned, 2), round(measured, 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", type=int, default=3)
    ap.add_argument(
        "--work", type=Path, default=None, help="where the sweeps go (default: a temp dir)"
    )
    ap.add_argument("--address", default=None, help="a running Ray cluster (default: embedded)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="qsplan-"))
    env = {**os.environ, "PLORA_PROFILE_DIR": str(work / "profiles"),
           "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    plora = str(Path(sys.executable).parent / "plora")
    address = ["--address", args.address] if args.address else []
    for i in range(args.sweeps):
        out = work / f"sweep{i}"
        proc = subprocess.run([plora, "sweep", "sweeps/quickstart.yaml", "--out", str(out), *address],
                              cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            sys.exit(f"sweep {i} failed: {proc.stderr.strip().splitlines()[-1:]}")
        print(json.dumps({"sweep": i, **sweep_row(out)}), flush=True)


if __name__ == "__main__":
    main()
