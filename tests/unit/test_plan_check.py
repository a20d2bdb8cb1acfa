"""plan_check: a sweep's first plan against its measured time and phases, from the directory."""

from __future__ import annotations

import pytest

from plora.analysis.plan_check import plan_check
from plora.sweepdir.store import SweepStore


def _decision(kind: str, time_s: float, job_id: str | None = None, **inputs) -> dict:
    return {"kind": kind, "time_s": time_s, "job_id": job_id, "config_ids": [], "inputs": inputs}


def _sweep(tmp_path, *, done: bool = True) -> SweepStore:
    tmp_path.mkdir(exist_ok=True)
    store = SweepStore(tmp_path)
    terms = {"job_start_s": 0.1, "train_s": 4.0, "eval_s": 1.0, "export_s": 0.0,
             "checkpoint_s": 0.5}  # fmt: skip
    for d in [
        _decision("start_workers", 10.0, elapsed_s=2.0, ready_at_s=13.0),
        _decision("plan", 10.5, jobs=[{"job_id": "j0001"}], makespan_s=8.0),
        _decision("start_job", 10.5, "j0001", planned_terms=terms),
        _decision("workers_ready", 14.5, ready_s=6.5),
        _decision("start_job", 15.0, "j0002", planned_terms=terms),  # a later plan's job
        *([_decision("sweep_done", 20.5)] if done else []),
    ]:
        store.append_decision(d)
    rows = [{"job_id": "j0001", "train_s": 5.0, "eval_s": 0.5, "checkpoint_s": 0.25},
            {"job_id": "j0002", "train_s": 9.0, "eval_s": 9.0, "checkpoint_s": 9.0}]  # fmt: skip
    store.write_jobs(rows)
    return store


def test_plan_check_sets_the_first_plan_and_its_jobs_against_the_sweep(tmp_path) -> None:
    check = plan_check(_sweep(tmp_path).root)
    assert check.planned_s == 8.0 and check.measured_s == 10.0 and check.ratio == 0.8
    assert check.planned_ready_s == 2.5 and check.ready_s == 4.0
    # only j0001 (the first plan's job) counts: j0002 came from a later plan
    assert check.terms == {"train_s": (4.0, 5.0), "eval_s": (1.0, 0.5), "checkpoint_s": (0.5, 0.25)}
    line = check.describe()
    assert "plan 8.00 s / measured 10.00 s (0.80x)" in line and "train 4.00 / 5.00 s" in line
    assert "workers ready 2.50 / 4.00 s" in line


def test_plan_check_of_an_unfinished_sweep_says_what_is_missing(tmp_path) -> None:
    with pytest.raises(ValueError, match="no sweep_done decision;"):
        plan_check(_sweep(tmp_path, done=False).root)


def test_plan_check_of_a_resumed_sweep_judges_its_first_run(tmp_path) -> None:
    store = _sweep(tmp_path / "finished")  # then resumed (e.g. with --retry-failed)
    for d in [_decision("resume", 0.0), _decision("plan", 0.1, makespan_s=1.0),
              _decision("sweep_done", 5.0)]:  # fmt: skip
        store.append_decision(d)
    assert plan_check(store.root).planned_s == 8.0
    killed = _sweep(tmp_path / "killed", done=False)  # its first run never ended
    for d in [_decision("resume", 0.0), _decision("sweep_done", 5.0)]:
        killed.append_decision(d)
    with pytest.raises(ValueError, match="no sweep_done decision before it was resumed"):
        plan_check(killed.root)
