"""How close the quickstart's plan comes to its measured sweep, sweep after sweep, on this host.

Runs ``plora sweep sweeps/quickstart.yaml`` (CPU, embedded local Ray) ``--sweeps`` times in a
row with one fresh profile store: the first sweep plans from the CPU defaults
(:data:`plora.cost.overheads.CPU` and the step prior), every later one from what the earlier
sweeps stored. For each sweep it prints the first plan's makespan, the time measured from that
plan to ``sweep_done`` (the coordinator's clock: Ray's start and the imports before it are in
neither), their ratio, and where the time went (the worker group's start and load, the job's
train / eval / checkpoint seconds from ``jobs.parquet``).

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

import pandas as pd

from plora.sweepdir.store import SweepStore

ROOT = Path(__file__).resolve().parents[1]


def sweep_row(out: Path) -> dict:
    """The first plan against the measured sweep, and the phases, of one sweep directory."""
    decisions = SweepStore(out).read_decisions()
    first = {d["kind"]: d for d in reversed(decisions)}  # the earliest decision of each kind
    plan, done = first["plan"], first["sweep_done"]
    ready = first.get("workers_ready", {"time_s": 0.0, "inputs": {}})
    job = pd.read_parquet(out / "jobs.parquet").iloc[0]
    predicted, measured = plan["inputs"]["makespan_s"], done["time_s"] - plan["time_s"]
    return {
        "planned_s": round(predicted, 2),
        "measured_s": round(measured, 2),
        "ratio": round(predicted / measured, 3),
        "workers_ready_at_s": round(ready["time_s"] - plan["time_s"], 2),
        "worker_ready_s": round(ready["inputs"].get("ready_s", 0.0), 2),
        "train_s": round(float(job["train_s"]), 2),
        "eval_s": round(float(job["eval_s"]), 2),
        "checkpoint_s": round(float(job["checkpoint_s"]), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", type=int, default=3)
    ap.add_argument(
        "--work", type=Path, default=None, help="where the sweeps go (default: a temp dir)"
    )
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="qsplan-"))
    env = {**os.environ, "PLORA_PROFILE_DIR": str(work / "profiles"),
           "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    plora = str(Path(sys.executable).parent / "plora")
    for i in range(args.sweeps):
        out = work / f"sweep{i}"
        proc = subprocess.run([plora, "sweep", "sweeps/quickstart.yaml", "--out", str(out)],
                              cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
        if proc.returncode != 0:
            sys.exit(f"sweep {i} failed: {proc.stderr.strip().splitlines()[-1:]}")
        print(json.dumps({"sweep": i, **sweep_row(out)}), flush=True)


if __name__ == "__main__":
    main()
