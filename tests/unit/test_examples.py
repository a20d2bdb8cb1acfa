"""The runnable examples: the cluster script parses and validates its arguments; the
programmatic example plans, runs (a local Ray, CPU) and reports a shortened quickstart sweep."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "cluster_submit.sh"


def bash(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False
    )


def test_cluster_script_syntax_and_strict_mode() -> None:
    proc = bash("-n", str(SCRIPT))
    assert proc.returncode == 0, proc.stderr
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text
    # the documented flow (README "Run on a cluster")
    for step in ("ray up", "ray job submit", "plora sweep", "--address auto", "plora status",
                 "ray rsync-down"):  # fmt: skip
        assert step in text, step


def test_cluster_script_usage_and_bad_arguments(tmp_path: Path) -> None:
    help_ = bash(str(SCRIPT), "--help")
    assert help_.returncode == 0 and help_.stdout.startswith("usage: examples/cluster_submit.sh")
    missing = bash(str(SCRIPT))
    assert missing.returncode == 2 and "missing SWEEP.yaml" in missing.stderr
    unknown = bash(str(SCRIPT), "--bogus", "sweeps/quickstart.yaml")
    assert unknown.returncode == 2 and "unknown option --bogus" in unknown.stderr
    absent = bash(str(SCRIPT), "no/such.yaml")
    assert absent.returncode == 2 and "sweep file no/such.yaml not found" in absent.stderr
    nocluster = bash(str(SCRIPT), "-c", str(tmp_path / "x.yaml"), "sweeps/quickstart.yaml")
    assert nocluster.returncode == 2 and "cluster config" in nocluster.stderr
    badport = bash(str(SCRIPT), "-p", "80a", "sweeps/quickstart.yaml")
    assert badport.returncode == 2 and "--port 80a is not a number" in badport.stderr


@pytest.mark.timeout(240)
def test_programmatic_example_runs_a_short_sweep(tmp_path: Path) -> None:
    out = tmp_path / "prog"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "programmatic.py"), "--out", str(out),
         "--max-steps", "5", "--num-examples", "200"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = pd.read_parquet(out / "results.parquet")
    assert len(res) == 8 and (res["status"] == "done").all() and (res["steps"] == 5).all()
    # the plan lists every config once
    planned = re.findall(r"\bc\d{4}-[0-9a-f]{6}\b", proc.stdout.split("planned makespan")[0])
    assert sorted(planned) == sorted(res["config_id"])
    # the printed best config is the best by eval_metric (max), ranked here from the parquet
    ranked = res.sort_values("eval_metric", ascending=False, kind="stable")
    best = ranked.iloc[0]
    line = f"best by eval_metric (max): {best['config_id']} eval_metric={best['eval_metric']:.4g}"
    assert line in proc.stdout, proc.stdout
    assert best["adapter_path"] == f"adapters/{best['config_id']}"  # stored relative to `out`
    assert f"adapter: {out / best['adapter_path']}" in proc.stdout
    assert (out / best["adapter_path"] / "adapter_config.json").exists()

    # a second run into the same directory is refused with a one-line error
    again = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "programmatic.py"), "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert again.returncode == 2 and again.stderr.startswith("error: ")
