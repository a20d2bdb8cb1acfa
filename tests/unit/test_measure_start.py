"""A worker group's start-up sample includes its first job's first-step compile time."""

from __future__ import annotations

import pytest

from plora.cost.overheads import OverheadKind
from plora.engine.api import JobTimings, PackOutcome, StepReport
from plora.engine.reports import StepMetrics, StepProfile
from plora.runtime.measure import Measurements


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
