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


def test_tune_baseline_is_charged_as_peft_min_gpu_as_plora() -> None:
    from plora.cost.build import build_cost_model
    from plora.planner import Baseline, baseline_plan

    sweep = api.load_sweep(QUICKSTART, gpus=2)
    report = api.plan(sweep)
    with sweep.located():
        cost = build_cost_model(sweep)
    configs, g = list(report.configs), 2
    min_gpu = baseline_plan(configs, cost, g, Baseline.MIN_GPU)
    tune = baseline_plan(configs, cost.for_peft(), g, Baseline.TUNE)
    assert report.baselines["min_gpu"].makespan_s == pytest.approx(min_gpu.makespan_s, rel=1e-12)
    assert report.baselines["tune"].makespan_s == pytest.approx(tune.makespan_s, rel=1e-12)
    plora_tune = baseline_plan(configs, cost, g, Baseline.TUNE)
    assert report.baselines["tune"].makespan_s != pytest.approx(plora_tune.makespan_s)


def test_tune_that_fits_no_gpu_with_peft_memory_is_skipped_not_fatal(tmp_path: Path) -> None:
    """8,192-token rows of a 7B model fit a 40 GB GPU with plora's fused loss, not with HF's
    (every logit kept): the Tune row is n/a, the plan and Min GPU stand."""
    text = (REPO / "sweeps" / "paper-table1.yaml").read_text()
    text = text.replace("max_seq_len: 1024 ", "max_seq_len: 8192 ").replace("strategies: [tp]", "")
    path = tmp_path / "long.yaml"
    path.write_text(text.replace("batch_size: [1, 4, 16, 32]", "batch_size: [1]"))
    report = api.plan(api.load_sweep(path, gpus=1))
    assert "fits no GPU with PEFT's memory" in report.skipped["tune"]
    assert report.plan.makespan_s <= report.baselines["min_gpu"].makespan_s


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
