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

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SUMMARY = ROOT / "scripts" / "graphs_summary.py"


def _run(script: str, *args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(BENCH)}
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", *args], cwd=cwd, env=env,
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def _summary(kind: str, path: Path) -> str:
    """``scripts/graphs_summary.py``'s line (what ``scripts/gpu_graphs.sh`` puts in its summary)."""
    proc = subprocess.run([sys.executable, str(SUMMARY), kind, str(path)], capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    return lines[0]


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
    # the graphed rows ran the static-buffer step (on the CPU: eagerly, nothing captured)
    for r in rows:
        stats = r["graph_stats"]
        if r["graphs"]:
            assert stats["disabled"] is None and stats["captures"] == stats["replays"] == 0
            assert stats["eager_steps"] == r["warmup"] + 2  # --smoke times 2 steps
        else:
            assert stats is None
    line = _summary("throughput", tmp_path / "engine_throughput.json")
    assert line.startswith("throughput (cpu): packed-1 ") and "packed-4+graphs" in line
    assert line.count("x eager") == 2


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
    assert eager["graph_stats"] is None and graphed["graph_stats"]["eager_steps"] == 3 + 2 + 2
    for v in (eager, graphed):
        assert v["wall_ms"] > 0 and v["host_ms"] > 0
        assert v["gpu_kernel_ms"] is None and v["gpu_idle"] is None  # no GPU kernels on a CPU
        assert v["top_host_ops"] and all(op["self_ms"] >= 0 for op in v["top_host_ops"])
    line = _summary("profile", tmp_path / "engine_profile.json")
    assert (
        line.startswith("profile (cpu, smoke x4): packed-4 wall ") and "| packed-4+graphs" in line
    )


def test_summary_of_an_e2e_report_and_of_a_missing_file(tmp_path) -> None:
    rep = {
        "gpu": "NVIDIA H100", "cuda_graphs": {"setting": "on"}, "configs": [{}, {}],
        "speedups": {"tune-frac": 2.5}, "agreement": {"ok": True},
        "systems": {
            "plora": {"wall_s": 100.0, "eval_loss": {"a": 1.0, "b": 1.1},
                      "measured_over_predicted": 1.04},
            "tune-frac": {"wall_s": 250.0, "eval_loss": {"a": 1.0, "b": None}},
        },
    }  # fmt: skip
    (tmp_path / "e2e-on.json").write_text(json.dumps(rep))
    assert _summary("e2e", tmp_path / "e2e-on.json") == (
        "e2e graphs=on (NVIDIA H100): plora 100.0 s (2/2 configs, measured/plan 1.04) | "
        "tune-frac 250.0 s (1/2 configs, plora 2.50x faster); ok"
    )
    assert _summary("e2e", tmp_path / "none.json").startswith("e2e: no result (none.json: ")


def test_step_table_books_every_cell_it_times(tmp_path) -> None:
    """``benchmarks/step_table.py`` (issue 42's table): PEFT and packs of every batch, GSM8K-like
    and fixed-length rows, each timed cell with the cost model's booking of its own widths."""
    _run("step_table.py", "--out", str(tmp_path), cwd=tmp_path)
    out = json.loads((tmp_path / "step_table.json").read_text())
    timed = [r for r in out["rows"] if "step_s" in r]
    assert {(r["system"], r["adapters"], r["batch"], r["lengths"]) for r in timed} == {
        (s, k, b, n) for s, k in (("peft", 1), ("plora", 1), ("plora", 4)) for b in (1, 4)
        for n in ("gsm8k", "64")
    }  # fmt: skip
    for r in timed:
        assert r["steps"] >= 3 and len(r["times"]) == r["steps"] == len(r["widths"])
        assert r["booked_s"] > 0
        assert r["booked_error"] == pytest.approx(r["booked_s"] / r["step_s"] - 1)
        assert 0 < r["tokens_per_s"] <= r["padded_tokens_per_s"]
