"""``benchmarks/engine_throughput.py`` and ``engine_profile.py`` run at toy sizes on the CPU with
``--graphs both``: each pack measured with the eager step, then on a fresh trainer with
``cuda_graphs=True`` (on the CPU the graph's static-buffer step, run eagerly). The GPU numbers
come from ``scripts/gpu_graphs.sh``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _run(script: str, *args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_throughput_measures_each_pack_eager_then_graphed(tmp_path) -> None:
    _run("engine_throughput.py", "--graphs", "both", "--out", str(tmp_path), cwd=tmp_path)
    out = json.loads((tmp_path / "engine_throughput.json").read_text())
    rows = out["rows"]
    assert out["graphs"] == "both"
    assert [(r["case"], r["graphs"]) for r in rows] == [
        ("peft", False), ("packed-1", False), ("packed-1+graphs", True),
        ("packed-4", False), ("packed-4+graphs", True),
    ]  # fmt: skip
    # --smoke warms up 1 step; a graphed row at least 3 (eager, capture, then replays)
    assert [r["warmup"] for r in rows] == [1, 1, 3, 1, 3]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert all(r["host_ms"] > 0 for r in rows if r["case"] != "peft")


def test_throughput_graphs_on_measures_the_graphed_rows_only(tmp_path) -> None:
    _run("engine_throughput.py", "--graphs", "on", "--out", str(tmp_path), cwd=tmp_path)
    rows = json.loads((tmp_path / "engine_throughput.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["peft", "packed-1+graphs", "packed-4+graphs"]


def test_profile_records_wall_host_and_gpu_time_per_variant(tmp_path) -> None:
    _run("engine_profile.py", "--graphs", "both", "--out", str(tmp_path), cwd=tmp_path)
    out = json.loads((tmp_path / "engine_profile.json").read_text())
    assert (out["device"], out["graphs"], out["adapters"]) == ("cpu", "both", 4)
    eager, graphed = out["variants"]
    assert (eager["label"], eager["graphs"], eager["warmup"]) == ("packed-4", False, 1)
    assert (graphed["label"], graphed["graphs"], graphed["warmup"]) == ("packed-4+graphs", True, 3)
    for v in (eager, graphed):
        assert v["wall_ms"] > 0 and v["host_ms"] > 0
        assert v["gpu_kernel_ms"] is None and v["gpu_idle"] is None  # no GPU kernels on a CPU
        assert v["top_host_ops"] and all(op["self_ms"] >= 0 for op in v["top_host_ops"])
