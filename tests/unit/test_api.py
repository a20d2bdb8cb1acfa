"""plora.api: the library calls behind the CLI (plan here; run and load in tests/ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plora import api
from plora.cli import app
from plora.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "sweeps" / "quickstart.yaml"


def test_plan_is_what_the_cli_writes(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["plan", str(QUICKSTART), "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = api.plan(api.load_sweep(QUICKSTART))
    written = json.loads(out.read_text())
    assert written["configs"] == [c.to_dict() for c in report.configs]
    assert [j["config_ids"] for j in written["jobs"]] == [
        list(j.config_ids) for j in report.plan.jobs
    ]
    assert set(report.baselines) | set(report.skipped) == {"min_gpu", "max_gpu", "tune"}
    assert api.plan is api.make_plan


def test_load_sweep_overrides_are_validated() -> None:
    assert api.load_sweep(QUICKSTART, gpus=3).hardware.num_gpus == 3
    with pytest.raises(ConfigError, match="--gpus=0"):
        api.load_sweep(QUICKSTART, gpus=0)
    # a new GPU type brings its own memory (not the file's GPU's), unless it is given too
    hw = api.load_sweep(QUICKSTART, gpu_type="A100-40GB").hardware
    assert (hw.gpu_type, hw.gpu_memory_gib) == ("A100-40GB", 40.0)
    hw = api.load_sweep(QUICKSTART, gpu_type="H100", gpu_memory_gib=64).hardware
    assert (hw.gpu_type, hw.gpu_memory_gib) == ("H100", 64.0)
    with pytest.raises(ConfigError, match="--gpu-type='nope': unknown gpu_type"):
        api.load_sweep(QUICKSTART, gpu_type="nope")
