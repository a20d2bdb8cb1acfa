"""``benchmarks/multigpu.py --smoke`` (gloo, tiny shape): a strategy that fails on the layout
(pp = 4 stages for 2 layers, here after fsdp) is a row with its error, the others keep theirs,
and the run's meta (device, peak) stays in the JSON the failure is written to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_failing_strategy_leaves_the_others_their_rows(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "multigpu.py"), "--smoke", "--gpus", "4",
         "--strategies", "fsdp", "pp", "--no-min-gpu", "--out", str(tmp_path)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 of 2 case groups failed" in proc.stderr
    doc = json.loads((tmp_path / "multigpu.json").read_text())
    assert doc["device"] == "cpu" and doc["gpus"] == 4  # the parent's write keeps the ranks' meta
    rows = doc["rows"]
    failed = [r for r in rows if "error" in r]
    assert [r["strategy"] for r in failed] == ["pp"]
    assert "stage_layers: stage" in failed[0]["error"]  # the cause, not a traceback
    fsdp = [r for r in rows if r["strategy"] == "fsdp"]
    assert [r["adapters"] for r in fsdp] == [2, 4]
    assert all(r["tokens_per_s"] > 0 and "peak_gib" in r for r in fsdp)
