"""A sweep's measured steps go to the profile store, and the next sweep's cost model uses them."""

from __future__ import annotations

from pathlib import Path

from plora.config import SweepConfig
from plora.cost import Strategy
from plora.cost.build import build_cost_model
from plora.cost.profile import ProfileStore
from plora.runtime.coordinator.costs import record_profile
from plora.tune.space import expand

SWEEPS = Path(__file__).resolve().parents[2] / "sweeps"


def test_recorded_steps_are_planned_from_next_time(tmp_path) -> None:
    sweep = SweepConfig.from_yaml(SWEEPS / "quickstart.yaml")
    configs = {c.config_id: c for c in expand(sweep)}
    cost = build_cost_model(sweep, profile_dir=tmp_path)
    pack = list(configs)[:4]
    prior = cost.job_time([configs[c] for c in pack], 1, Strategy.TP)
    # measured: every step 10x slower than the prior predicts for this pack
    per_step = prior / max(cost.steps(configs[c]) for c in pack)
    steps = [{"time_s": 10 * per_step, "seq_len": sweep.seq_len, "peak_memory_bytes": 2**30}] * 12
    measurements = [{"job_id": "j1", "config_ids": pack, "gpus": 1, "strategy": None,
                     "device": "cpu", "steps": steps}]  # fmt: skip
    assert record_profile(sweep, cost, [], configs, profile_dir=tmp_path) == 0
    assert (
        not ProfileStore(tmp_path).path(sweep.model.name_or_path, sweep.hardware.gpu_type).exists()
    )
    n = record_profile(sweep, cost, measurements, configs, profile_dir=tmp_path)
    assert n > 0
    stored = ProfileStore(tmp_path).load(sweep.model.name_or_path, sweep.hardware.gpu_type)
    assert len(stored.to_dict()["samples"]) == n
    again = build_cost_model(sweep, profile_dir=tmp_path)
    after = again.job_time([configs[c] for c in pack], 1, Strategy.TP)
    assert after > 3 * prior  # planned from the measurements, not the defaults


def test_recorded_overheads_are_planned_from_next_time(tmp_path) -> None:
    """A sweep's measured worker start, model load and evaluation seconds are what the next
    sweep on the same model and GPU type charges (its cold start included)."""
    from plora.cost.overheads import OverheadKind, OverheadSample

    sweep = SweepConfig.from_yaml(SWEEPS / "quickstart.yaml")
    configs = {c.config_id: c for c in expand(sweep)}
    before = build_cost_model(sweep, profile_dir=tmp_path)
    samples = [
        OverheadSample(kind=OverheadKind.WORKER_START, seconds=7.0),
        OverheadSample(kind=OverheadKind.MODEL_LOAD, seconds=2.5),
        OverheadSample(kind=OverheadKind.EVAL, seconds=3.0, count=300),
    ]
    assert record_profile(sweep, before, [], configs, samples, profile_dir=tmp_path) == 3
    after = build_cost_model(sweep, profile_dir=tmp_path)
    assert after.startup_time(1) == 9.5 != before.startup_time(1)
    assert after.overheads.eval_s_per_row == 0.01
    assert after.overheads.export_s == before.overheads.export_s  # not measured: the prior
