"""The timeline of a sweep (plora.runtime.timeline): marks on one axis from the process start,
the workers' wall-clock marks placed on it, the record the coordinator logs, the final line."""

from __future__ import annotations

import json
import time

import pytest
from runtime_fakes import lora, make, run_to_end

from plora.engine.api import JobTimings
from plora.runtime.progress import status_text
from plora.runtime.timeline import Phase, Timeline, process_start_wall, timeline_line
from plora.sweepdir.store import SweepStore


def test_process_start_is_before_now_and_the_axis_starts_there() -> None:
    start = process_start_wall()
    assert 0 < start <= time.time()
    tl = Timeline.from_process_start()
    assert tl.start_wall == start
    before = time.time() - start
    now = tl.now()  # on the process's axis: between two wall-clock readings of it
    after = time.time() - start
    assert now > 0 and before - 1e-3 <= now <= after + 1e-3


@pytest.mark.parametrize(
    ("phase", "marks", "kept"),
    [
        (Phase.RAY, [3.0, 2.0, 4.0], 2.0),  # the earliest: when it was first reached
        (Phase.WORKERS, [5.0, 4.0], 4.0),  # the first group ready
        (Phase.FIRST_STEP, [9.0, 7.0, 8.0], 7.0),
        (Phase.LAST_STEP, [9.0, 12.0, 10.0], 12.0),  # the latest: when the last job got there
        (Phase.EVAL, [13.0, 11.0], 13.0),
        (Phase.EXPORT, [13.5, 14.0], 14.0),
    ],
)
def test_a_phase_keeps_its_earliest_or_latest_mark(phase, marks, kept) -> None:
    tl = Timeline(start_wall=1000.0, start_mono=0.0)
    for m in marks:
        tl.mark(phase, m)
    assert tl.at == {phase: kept}


def test_worker_marks_are_wall_clock_times_placed_from_the_process_start() -> None:
    tl = Timeline(start_wall=1000.0, start_mono=0.0)
    tl.mark_wall(Phase.WORKERS, 1006.5)
    # a job that began on its worker at 1008 (wall), offsets measured on the worker
    tl.mark_job(JobTimings(started_at=1008.0, first_step_s=1.5, last_step_s=4.0,
                           eval_end_s=4.5, export_end_s=4.75))  # fmt: skip
    tl.mark_job(JobTimings(started_at=1009.0, first_step_s=0.5, last_step_s=2.0))  # no eval
    tl.mark_job(JobTimings())  # an engine that measures nothing marks nothing
    assert tl.to_dict() == {"workers": 6.5, "first_step": 9.5, "last_step": 12.0,
                            "eval": 12.5, "export": 12.75}  # fmt: skip


def test_to_dict_is_in_phase_order_and_the_line_shows_the_phases_reached() -> None:
    tl = Timeline(start_wall=0.0, start_mono=0.0)
    for phase, at in [(Phase.EXIT, 45.04), (Phase.RAY, 3.1), (Phase.FIRST_STEP, 11.0),
                      (Phase.INPUTS, 5.0), (Phase.WORKERS, 8.25)]:  # fmt: skip
        tl.mark(phase, at)
    assert list(tl.to_dict()) == ["ray", "inputs", "workers", "first_step", "exit"]
    assert timeline_line(tl.to_dict()) == (
        "timeline: ray 3.1s · inputs 5.0s · workers 8.2s · first step 11.0s · exit 45.0s"
    )
    assert timeline_line({}) == "timeline: no phase reached"


def test_the_timeline_is_the_last_record_and_the_sweep_still_reads_finished(tmp_path) -> None:
    store = SweepStore(tmp_path)
    coord, clock = make([lora(i) for i in range(3)], gpus=2, store=store)
    run_to_end(coord, clock, coord.start())
    phases = {"ray": 1.0, "inputs": 2.0, "workers": 2.5, "first_step": 3.0, "exit": 9.0}
    coord.on_timeline(phases, notes={"driver": 0.5})
    lines = [json.loads(x) for x in store.decisions_jsonl.read_text().splitlines()]
    assert [d["kind"] for d in lines[-2:]] == ["sweep_done", "timeline"]
    assert lines[-1]["inputs"] == {"phases": phases, "notes": {"driver": 0.5}}
    assert "finished" in status_text(str(tmp_path)).splitlines()[0]
    assert "not finished" not in status_text(str(tmp_path)).splitlines()[0]
