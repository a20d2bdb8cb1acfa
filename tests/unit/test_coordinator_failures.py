"""The coordinator when jobs fail, configs are stopped, or the sweep resumes from its state:
retry a dead worker from its checkpoint, split an out-of-memory pack, stop queued and running
configs, resume without retraining (no Ray)."""

from __future__ import annotations

import pytest
from runtime_fakes import finish, lora, make, report, run_to_end

from plora.runtime.records import ConfigStatus, Decision, FailureKind
from plora.sweepdir.reader import read_metrics
from plora.sweepdir.store import SweepStore


def test_dead_worker_retries_from_checkpoint_then_fails() -> None:
    coord, clock = make([lora(0, rank=30), lora(1, rank=30)], gpus=1, max_retries=1)
    (spec,) = coord.start()
    (retry,) = coord.on_job_failed(spec.job_id, FailureKind.DIED, "actor died")
    assert retry.job_id == spec.job_id and retry.attempt == 1 and retry.resume
    assert retry.config_ids == spec.config_ids
    assert coord.decisions[-1].kind is Decision.START_JOB
    assert any(d.kind is Decision.RETRY for d in coord.decisions)
    nxt = coord.on_job_failed(spec.job_id, FailureKind.DIED, "actor died again")
    assert coord.status[spec.config_ids[0]] is ConfigStatus.FAILED
    assert "died 2 times" in coord.results[spec.config_ids[0]]["error"]
    assert [s.config_ids for s in nxt] == [
        (c,) for c in coord.queued_ids()
    ] or nxt  # other config goes on
    run_to_end(coord, clock, nxt)
    assert coord.is_done()


def test_oom_splits_pack_in_halves_and_single_oom_fails() -> None:
    configs = [lora(i, rank=4) for i in range(5)]  # all fit one job by the model
    coord, _clock = make(configs, gpus=1)
    (spec,) = coord.start()
    assert len(spec.configs) == 5
    (first,) = coord.on_job_failed(spec.job_id, FailureKind.OOM, "CUDA out of memory")
    split = next(d for d in coord.decisions if d.kind is Decision.SPLIT_OOM)
    halves = list(split.inputs["into"].values())
    assert sorted(len(h) for h in halves) == [2, 3]
    assert sorted(c for h in halves for c in h) == sorted(spec.config_ids)
    assert first.config_ids == tuple(halves[0])
    # the 3-config half OOMs again -> 2 + 1; then a single config OOMs -> it fails alone
    (a,) = coord.on_job_failed(first.job_id, FailureKind.OOM, "oom")
    single = [s for s in [a] if len(s.configs) == 1]
    while not single:
        (a,) = coord.on_job_failed(a.job_id, FailureKind.OOM, "oom")
        single = [s for s in [a] if len(s.configs) == 1]
    cid = single[0].config_ids[0]
    coord.on_job_failed(single[0].job_id, FailureKind.OOM, "oom")
    assert coord.status[cid] is ConfigStatus.FAILED
    assert "out of memory even alone" in coord.results[cid]["error"]


def test_stop_config_queued_and_running() -> None:
    coord, _clock = make([lora(i, rank=64) for i in range(3)], gpus=1)
    (spec,) = coord.start()
    queued = coord.queued_ids()
    coord.stop_config(queued[0])
    assert coord.status[queued[0]] is ConfigStatus.STOPPED
    running = spec.config_ids[0]
    coord.stop_config(running)
    coord.stop_config(running, reason="asked again")  # e.g. by a restored Tune scheduler
    assert [d.config_ids for d in coord.decisions if d.kind is Decision.STOP_CONFIG] == [
        (queued[0],),
        (running,),
    ]  # one decision per stop
    assert coord.poll(spec.job_id).stop == {running}
    assert coord.poll(spec.job_id).stop == set()  # delivered once
    nxt = finish(coord, spec)
    assert coord.status[running] is ConfigStatus.STOPPED
    assert [s.config_ids for s in nxt] == [(queued[1],)]


def test_resume_relaunches_a_refilled_config_inside_its_job(tmp_path) -> None:
    """A config refilled into a running job is in that job's checkpoint: --resume relaunches it
    with the job (not queued for a second, fresh training elsewhere)."""
    store = SweepStore(tmp_path)
    long_, short = lora(0, rank=10, steps=100), lora(1, rank=10, steps=5)
    mid, late = lora(2, rank=10, steps=100), lora(3, rank=10, steps=20)
    coord, _ = make([long_, short, mid, late], gpus=1, store=store)
    (spec,) = coord.start()
    coord.on_reports(spec.job_id, [report({"config_id": "c01", "step": 5, "loss": 1.0})])
    assert [c.config_id for c in coord.poll(spec.job_id).add] == ["c03"]
    coord.persist()
    state = store.read_state()

    coord2, _ = make([long_, short, mid, late], gpus=1, store=store)
    coord2.set_state(state)
    (resumed,) = coord2.start()
    assert resumed.job_id == spec.job_id and resumed.resume
    assert set(resumed.config_ids) == {"c00", "c01", "c02", "c03"}


def test_state_roundtrip_resumes_without_retraining(tmp_path) -> None:
    store = SweepStore(tmp_path)
    configs = [lora(i, rank=64) for i in range(4)]
    coord, clock = make(configs, gpus=2, store=store)
    first = coord.start()
    clock.t = 3.0
    finish(coord, first[0])
    done = first[0].config_ids
    interrupted = first[1]
    state = store.read_state()

    coord2, clock2 = make(configs, gpus=2, store=store)
    coord2.set_state(state)
    assert coord2.now() == pytest.approx(3.0)
    launches = coord2.start()
    resumed = [s for s in launches if s.job_id == interrupted.job_id]
    assert resumed and resumed[0].resume and resumed[0].config_ids == interrupted.config_ids
    every = run_to_end(coord2, clock2, launches)
    retrained = [c for s in every for c in s.config_ids]
    assert not set(done) & set(retrained)
    assert sorted(retrained + list(done)) == sorted(c.config_id for c in configs)
    assert coord2.is_done()
    assert any(d["kind"] == "resume" for d in store.read_decisions())
    jobs = store.read_jobs()
    assert "interrupted" in set(jobs["status"])


def _steps(coord, spec, steps, *, loss: float, clock) -> None:
    for s in steps:
        clock.t += 0.1
        coord.on_reports(spec.job_id, [report(
            *({"config_id": c, "step": s, "loss": loss + s} for c in spec.config_ids))])  # fmt: skip


@pytest.mark.parametrize("restart", ["retry", "resume"])
def test_steps_trained_again_keep_one_metric_row_and_are_logged(tmp_path, restart) -> None:
    """Issue 29: after a killed worker (``retry``) or a killed driver (``resume``) a job goes
    on from its step-3 checkpoint though steps 4-6 were reported: ``metrics.parquet`` as read
    (its parts hold every attempt's rows) has one row per (config, step) -- the new attempt's --
    and ``redo_steps`` names the redone range."""
    store = SweepStore(tmp_path)
    configs = [lora(0, rank=30, steps=8), lora(1, rank=30, steps=8)]
    coord, clock = make(configs, gpus=1, store=store)
    (spec,) = coord.start()
    _steps(coord, spec, range(1, 7), loss=0.0, clock=clock)
    if restart == "retry":
        (again,) = coord.on_job_failed(spec.job_id, FailureKind.DIED, "actor died")
    else:
        state = store.read_state()
        store = SweepStore(tmp_path)  # a new driver: the rows so far are read from disk
        coord, clock = make(configs, gpus=1, store=store)
        coord.set_state(state)
        (again,) = coord.start()
    assert again.job_id == spec.job_id and again.attempt == 1 and again.resume
    _steps(coord, again, range(4, 9), loss=100.0, clock=clock)
    coord.persist()

    rows = read_metrics(tmp_path)
    assert not rows.duplicated(["config_id", "step"]).any()
    for cid in spec.config_ids:
        mine = rows[rows["config_id"] == cid].sort_values("step")
        assert mine["step"].tolist() == list(range(1, 9))
        assert mine["attempt"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
        assert mine["loss"].tolist() == [1.0, 2.0, 3.0, *(100.0 + s for s in range(4, 9))]
    (redo,) = [d for d in store.read_decisions() if d["kind"] == Decision.REDO_STEPS]
    assert redo["job_id"] == spec.job_id and redo["inputs"]["attempt"] == 1
    assert redo["inputs"]["steps"] == {cid: [4, 6] for cid in spec.config_ids}
