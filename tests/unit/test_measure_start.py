"""A worker group's start-up sample includes its first job's first-step compile time."""

from __future__ import annotations

import pytest

from plora.cost.overheads import OverheadKind
from plora.engine.api import JobTimings, PackOutcome, StepReport
from plora.engine.reports import StepMetrics, StepProfile
from plora.runtime.coordinator.measure import Measurements


def _report(step: int, time_s: float) -> StepReport:
    metric = StepMetrics(config_id="c0", step=step, loss=1.0, lr=1e-3, tokens=8, grad_norm=1.0,
                         time_s=time_s)  # fmt: skip
    profile = StepProfile(step=step, time_s=time_s, adapters=1, rows=1, seq_len=8, tokens=8,
                          padded_tokens=8, micro_batches=1, peak_memory_bytes=0)  # fmt: skip
    return StepReport(metrics=(metric,), profile=profile)


def _starts(m: Measurements) -> list[float]:
    return [o.seconds for o in m.overheads if o.kind is OverheadKind.WORKER_START]


def test_cold_group_start_counts_first_step_excess_warm_jobs_do_not():
    m = Measurements()
    m.add_group_ready(ready_s=17.0, load_s=10.0)
    assert _starts(m) == []  # waits for the group's first job
    m.add_reports("j1", [_report(1, 8.5), _report(2, 0.9), _report(3, 1.1)], gpus=1, strategy=None)
    m.add_outcome(PackOutcome(job_id="j1", timings=JobTimings(load_s=10.0, start_s=2.0)),
                  eval_rows=0)  # fmt: skip
    assert _starts(m) == pytest.approx([7.0 + 7.6])
    # a second job on the now warm group: load not charged, no new start sample
    m.add_reports("j2", [_report(1, 1.5), _report(2, 0.9)], gpus=1, strategy=None)
    m.add_outcome(PackOutcome(job_id="j2", timings=JobTimings(start_s=2.0)), eval_rows=0)
    assert _starts(m) == pytest.approx([7.0 + 7.6])
    # state round trip keeps a start that has not met its first job yet
    m.add_group_ready(ready_s=9.0, load_s=4.0)
    again = Measurements()
    again.set_state(m.get_state())
    again.add_reports("j3", [_report(1, 3.0)], gpus=1, strategy=None)  # one step only
    again.add_outcome(PackOutcome(job_id="j3", timings=JobTimings(load_s=4.0)), eval_rows=0)
    assert _starts(again) == pytest.approx([7.0 + 7.6, 5.0])


def test_a_built_in_models_first_build_is_no_start_up_sample():
    """A worker that first built the tiny base model (or waited for the driver building it)
    reports those seconds apart: the start-up the profile store keeps is the rest, and the
    decision record shows both."""
    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model
    from plora.runtime.coordinator import Coordinator
    from plora.tune.space import expand

    sweep = SweepConfig.from_dict({
        "name": "build", "model": "tiny-qwen2",
        "dataset": {"builtin": "arithmetic", "num_examples": 50, "max_seq_len": 32},
        "space": {"lr": [1e-3], "rank": 4, "alpha": 8, "batch_size": 4, "max_steps": 5},
        "hardware": {"gpu_type": "cpu", "num_gpus": 1},
    })  # fmt: skip
    coord = Coordinator(cost=build_cost_model(sweep, use_profile=False), num_gpus=1,
                        configs=expand(sweep), clock=lambda: 0.0, calibration_steps=0)  # fmt: skip
    coord.on_group_started([0], elapsed_s=0.0)
    coord.on_group_ready([0], ready_s=15.0, load_s=3.0, build_s=10.0, node=None)
    ready = next(d for d in coord.decisions if d.kind.value == "workers_ready")
    assert ready.inputs["ready_s"] == 15.0 and ready.inputs["build_s"] == 10.0
    coord.measure.add_reports("j1", [_report(1, 3.0)], gpus=1, strategy=None)
    coord.measure.add_outcome(PackOutcome(job_id="j1", timings=JobTimings(load_s=3.0)),
                              eval_rows=0)  # fmt: skip
    assert _starts(coord.measure) == pytest.approx([2.0])  # 15 - 10 built - 3 loaded
