"""``benchmarks/control_plane.py`` at a CPU-test size: the real driver, coordinator,
dispatcher, workers and sweep directory on a Ray ``Cluster`` of three logical-GPU nodes, a
timing-simulation engine, early stops, refills and a node killed and replaced mid-sweep.

The benchmark runs in its own process (its own Ray cluster, never this session's fixture);
the test checks that no config is lost, that every field of the report is there, and that
``metrics.parquet`` was appended to as parts, not rewritten (issue 44). Its speed is the
benchmark's business (benchmarks/RESULTS.md), not this test's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {
    "title", "configs", "gpus", "wall_s", "counts", "lost", "replan", "events", "driver",
    "writes", "killed_node", "status_s", "status_ok", "load_s", "loaded_configs",
}  # fmt: skip


def test_the_simulated_sweep_loses_no_config(tmp_path) -> None:
    report_path, out = tmp_path / "report.json", tmp_path / "sweep"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "control_plane.py"),
        "--configs", "200", "--steps", "20", "--nodes", "3", "--gpus-per-node", "2",
        "--step-ms", "10", "--kill-at", "0.3", "--out", str(out), "--json", str(report_path),
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert set(report) >= FIELDS, FIELDS - set(report)
    assert report["title"].startswith("TIMING SIMULATION")
    assert report["lost"] == 0 and report["loaded_configs"] == 200
    counts = report["counts"]
    assert counts["done"] + counts["stopped"] == 200 and counts["stopped"] > 0  # early stops
    assert report["killed_node"]["failed_jobs"] >= 1  # the kill reached running jobs
    assert report["status_ok"]
    assert report["replan"]["n"] >= 2 and report["events"]["handled"] > 0
    assert report["writes"]["metric_rows"] > 0 and report["writes"]["flush_metrics"]["calls"] > 0
    assert (out / "metrics.parquet").is_dir()  # appended as parts
