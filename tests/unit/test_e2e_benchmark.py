"""``benchmarks/e2e.py``: its eval-loss checks, and a CPU dry run of all three systems.

The dry run trains 2 configs of the built-in tiny-qwen2 for 3 steps with ``plora sweep``, Ray
Tune + PEFT one trial per (logical) GPU, and Tune with 0.25 GPU per trial, each in its own
process with its own cold ``ray.init`` (about 2 minutes on 2 busy cores).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from e2e_report import compare  # noqa: E402

KEYS = ["lr=0.001,r=8", "lr=0.003,r=8"]
BASE = 8.0


def _systems(**losses: list[float | None]) -> dict[str, dict]:
    return {s: {"eval_loss": dict(zip(KEYS, v, strict=True))} for s, v in losses.items()}


@pytest.mark.parametrize(
    ("losses", "ok", "failure"),
    [
        ({"plora": [7.90, 7.50], "tune": [7.92, 7.55]}, True, None),
        # an adapter that did not train (or whose eval saw the base model) stays at the base loss
        ({"plora": [7.90, 7.50], "tune": [BASE, 7.55]}, False, "not_trained"),
        # a system that lost a config
        ({"plora": [7.90, None], "tune": [7.92, 7.55]}, False, "missing"),
        # trains at a fifth of the other's pace (a wrong scale or lr): within rtol, small drop
        ({"plora": [7.90, 7.70], "tune": [7.92, 7.94]}, False, "drop"),
        # trains far more than the other (e.g. alpha applied twice): within rtol, small drop
        ({"plora": [7.90, 7.45], "tune": [7.92, 7.80]}, False, "drop"),
        # both train well, but the losses disagree beyond rtol
        ({"plora": [7.90, 6.50], "tune": [7.92, 6.00]}, False, "rtol"),
    ],
    ids=["agree", "untrained", "missing", "slow-pace", "fast-pace", "disagree"],
)
def test_compare_fails_when_one_system_is_broken(losses, ok, failure):
    got = compare(_systems(**losses), KEYS, BASE, rtol=0.05, min_drop_ratio=0.5)
    assert got["ok"] is ok, got
    if failure == "not_trained":
        assert got["not_trained"] == ["tune:lr=0.001,r=8"]
    elif failure == "missing":
        assert got["missing"] == ["plora:lr=0.003,r=8"]
    elif failure == "drop":
        assert got["worst"]["rel_diff"] <= 0.05, got  # only the drop check catches these
        assert got["worst_drop"]["ratio"] < 0.5 and got["worst_drop"]["config"] == KEYS[1]
    elif failure == "rtol":
        assert got["worst_drop"]["ratio"] >= 0.5, got  # only the agreement check catches this
        assert got["worst"]["rel_diff"] > 0.05 and got["worst"]["pair"] == ["tune", "plora"]


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_cpu_dry_run_of_all_three_systems(tmp_path):
    out = tmp_path / "e2e.json"
    cmd = [
        sys.executable,
        str(BENCH / "e2e.py"),
        "--model",
        "tiny-qwen2",
        "--out",
        str(out),
        "--work",
        str(tmp_path / "work"),
        "--lrs",
        "1e-3,3e-3",
        "--ranks",
        "8",
        "--steps",
        "3",
        "--warmup-steps",
        "1",
        "--tokens",
        "48",
        "--train-rows",
        "64",
        "--eval-rows",
        "16",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads(out.read_text())

    for field in (
        "benchmark",
        "date",
        "command",
        "gpu",
        "gpu_type",
        "num_gpus",
        "software",
        "model",
        "data",
        "training",
        "configs",
        "base_eval_loss",
        "systems",
        "speedups",
        "agreement",
        "markdown",
    ):
        assert field in rep, field
    assert rep["complete"] is True and rep["gpu"] == "cpu" and rep["gpu_type"] == "cpu"
    assert [c["key"] for c in rep["configs"]] == KEYS
    systems = rep["systems"]
    assert list(systems) == ["plora", "tune", "tune-frac"]
    for name, row in systems.items():
        assert row["returncode"] == 0, name
        assert row["wall_s"] > 0 and "gpu_busy" in row and row["gpu_busy"] is None  # no nvidia-smi
    plora = systems["plora"]
    assert (
        plora["predicted_makespan_s"] > 0
        and plora["predicted_makespan_includes_ray_start"] is False
    )
    assert plora["measured_makespan_s"] > 0 and plora["jobs"]
    assert sum(j["configs"] for j in plora["jobs"]) == len(KEYS)
    assert systems["tune"]["gpu_per_trial"] == 1.0 and systems["tune-frac"]["gpu_per_trial"] == 0.25
    assert all(t["error"] is None for s in ("tune", "tune-frac") for t in systems[s]["trials"])
    assert set(rep["speedups"]) == {"tune", "tune-frac"}
    assert rep["speedups"]["tune"] == pytest.approx(systems["tune"]["wall_s"] / plora["wall_s"])

    # every system finished every config, and trained it: independent of the script's verdict
    base = rep["base_eval_loss"]
    assert math.isfinite(base)
    losses = {s: [row["eval_loss"][k] for k in KEYS] for s, row in systems.items()}
    for s, values in losses.items():
        assert all(v is not None and v < base for v in values), (s, values, base)
    for p, t in zip(losses["plora"], losses["tune"], strict=True):
        assert abs(p - t) / t < 0.05  # different LoRA A init: same data order, loose agreement
        assert 0.5 < (base - p) / (base - t) < 2.0
    # one trial per GPU and fractional trials run the same code from the same seed: equal
    assert losses["tune-frac"] == pytest.approx(losses["tune"], rel=1e-4)
    assert rep["agreement"]["ok"] and rep["agreement"]["worst"]["rel_diff"] < 0.05
    assert "| plora sweep |" in rep["markdown"] and "| lr=0.003,r=8 |" in rep["markdown"]
