"""Settings that cannot take effect give one ``warning:`` line each (the sweep stays valid)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from plora.cli import app
from plora.config import SweepConfig
from plora.config.advice import sweep_warnings

ROOT = Path(__file__).resolve().parents[2]


def _sweep(tmp_path: Path, space=None, **top) -> Path:
    data = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    data["space"].update(space or {})
    for key, value in top.items():
        section, _, field = key.partition("__")
        if field:
            data[section][field] = value
        else:
            data[section] = value
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("space", "top", "needle"),
    [
        (
            {"warmup_steps": [10, 100]},
            {},
            "space.warmup_steps=[10, 100] reaches space.max_steps=100",
        ),
        ({"warmup_steps": 150}, {}, "space.warmup_steps=150 reaches"),
        ({}, {"dataset__eval_fraction": 0.0}, "metric=eval_metric with dataset.eval_fraction=0"),
        ({}, {"dataset__metric": "none"}, "metric=eval_metric with dataset.metric=none"),
        (
            {},
            {"search": "random", "num_samples": 20},
            "num_samples=20 but the space has 8 distinct",
        ),
        (
            {},
            {"planner": {"strategies": ["tp"]}},
            "planner.strategies=['tp'] with hardware.num_gpus=1: a multi-GPU job needs 2",
        ),
    ],
)
def test_each_setting_without_effect_is_one_warning(tmp_path, space, top, needle) -> None:
    warnings = sweep_warnings(SweepConfig.from_yaml(_sweep(tmp_path, space, **top)))
    assert len(warnings) == 1 and needle in warnings[0], warnings


@pytest.mark.parametrize(
    ("space", "top"),
    [
        ({}, {}),
        ({"warmup_steps": 99}, {}),
        ({}, {"search": "random", "num_samples": 8}),
        ({"lr": {"loguniform": [1e-4, 1e-2]}}, {"search": "random", "num_samples": 50}),
        ({}, {"planner": {"strategies": ["fsdp"]}, "hardware__num_gpus": 2}),
    ],
)
def test_settings_that_take_effect_give_none(tmp_path, space, top) -> None:
    assert sweep_warnings(SweepConfig.from_yaml(_sweep(tmp_path, space, **top))) == []


def test_validate_prints_the_warning_and_still_passes(tmp_path) -> None:
    path = _sweep(tmp_path, {"warmup_steps": 200})
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    warned = [x for x in result.output.splitlines() if x.startswith("warning: ")]
    assert len(warned) == 1 and str(path) in warned[0] and "warmup_steps=200" in warned[0]
