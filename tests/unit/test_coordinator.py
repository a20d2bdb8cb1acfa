"""The coordinator as a state machine, planning: every config trained once within the GPUs,
refit from measurements, and a re-plan adopted only when predicted faster (no Ray).

Refill is ``test_coordinator_refill.py``; failures, stops and resume
``test_coordinator_failures.py``; the sweep directory, the searcher and the relay
``test_coordinator_records.py``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_fakes import AffineCost, Clock, finish, lora, make, outcome, report, run_to_end

from plora.runtime.coordinator import Coordinator
from plora.runtime.coordinator.costs import describe_cost
from plora.runtime.records import ConfigStatus, Decision
from plora.sweepdir.store import SweepStore


def test_every_config_trained_once_within_gpu_budget() -> None:
    configs = [lora(i, rank=r) for i, r in enumerate([8, 16, 24, 8, 16, 24, 30, 8, 16, 4, 4, 8])]
    coord, clock = make(configs, gpus=3)
    launches = coord.start()
    assert launches and sum(s.gpus for s in launches) <= 3
    busy_max = 0
    every = list(launches)
    queue = list(launches)
    while queue:
        busy_max = max(busy_max, coord.counts()["gpus_busy"])
        spec = queue.pop(0)
        clock.t += 1.0
        new = finish(coord, spec)
        every += new
        queue += new
    assert busy_max <= 3
    trained = [c for s in every for c in s.config_ids]
    assert sorted(trained) == sorted(c.config_id for c in configs)
    assert coord.is_done()
    assert all(s is ConfigStatus.DONE for s in coord.status.values())
    kinds = [d.kind for d in coord.decisions]
    assert kinds[0] is Decision.ASK and Decision.PLAN in kinds and kinds[-1] is Decision.SWEEP_DONE
    # packs respect memory (capacity 4, base 1, 0.1 per rank unit)
    for s in every:
        assert 1.0 + 0.1 * sum(c.rank for c in s.configs) <= 4.0 + 1e-9


def test_gpu_ids_never_double_booked() -> None:
    coord, clock = make([lora(i, rank=64) for i in range(7)], gpus=2)  # one config per job
    launches = coord.start()
    assert len(launches) == 2 and {s.gpu_ids for s in launches} == {(0,), (1,)}
    clock.t = 1.0
    (nxt,) = finish(coord, launches[0])
    assert nxt.gpu_ids == launches[0].gpu_ids  # the freed GPU, not the busy one


def test_refit_uses_measurements_and_replan_sees_new_cost() -> None:
    configs = [lora(i, rank=30, steps=10, batch=2) for i in range(6)]  # 1 config per job (cap 4)
    prior = AffineCost(sec_per_sample=0.01)
    coord, clock = make(configs, gpus=2, cost=prior)
    launches = coord.start()
    clock.t = 5.0
    # measured: 0.4 s per step for a 2-sample pack -> 0.2 s/sample (20x the prior)
    finish(coord, launches[0], step_time=0.4)
    refit = [d for d in coord.decisions if d.kind is Decision.REFIT]
    assert len(refit) == 1
    assert refit[0].inputs["cost_before"]["sec_per_sample"] == pytest.approx(0.01)
    assert refit[0].inputs["cost_after"]["sec_per_sample"] == pytest.approx(0.2)
    replan = [d for d in coord.decisions if d.kind is Decision.REPLAN][-1]
    assert replan.inputs["cost"]["sec_per_sample"] == pytest.approx(0.2)
    assert coord.planner.calls[-1]["cost"].sec_per_sample == pytest.approx(0.2)
    assert coord.planner.calls[-1]["now"] == pytest.approx(5.0)


def test_real_planner_and_cost_model_replan_after_refit(tmp_path) -> None:
    """With plora's planner and SweepCostModel: steps measured 20x slower than the prior predicts
    are refit into the model, and the re-plan that follows is made with the refit model."""
    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model
    from plora.cost.overheads import Overheads
    from plora.tune.space import expand

    sweep = SweepConfig.from_yaml("sweeps/quickstart.yaml")
    configs = expand(sweep)
    # steps only: the refit scales step times, not the overheads (start, eval, export)
    cost = build_cost_model(sweep, use_profile=False, overheads=Overheads.zero())
    store = SweepStore(tmp_path)
    clock = Clock()
    coord = Coordinator(
        cost=cost,
        num_gpus=1,
        configs=configs,
        store=store,
        clock=clock,
        ask_batch=4,
        calibration_steps=0,
    )  # 4 configs now, 4 more after the first job: a re-plan with the refit model
    launches = coord.start()
    assert launches and {c for s in launches for c in s.config_ids} <= {
        c.config_id for c in configs
    }
    spec = launches[0]
    s = cost.seq_len
    predicted = cost.job_time(list(spec.configs), 1, None) / max(
        cost.steps(c) for c in spec.configs
    )
    measured = 20 * predicted
    clock.t = 60.0
    results = {
        c.config_id: {"status": "done", "steps": 100, "tokens": 1000, "eval_metric": 0.5}
        for c in spec.configs
    }
    step = report(
        *({"config_id": c, "step": 1} for c in spec.config_ids), time_s=measured, seq_len=s
    )
    coord.on_reports(spec.job_id, [step] * 5)  # the first is the warm-up
    coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))
    refit = next(d for d in store.read_decisions() if d["kind"] == "refit")
    assert refit["inputs"]["cost_before"] != refit["inputs"]["cost_after"]
    assert refit["inputs"]["cost_after"] == describe_cost(coord.cost)
    after = coord.cost.job_time(list(spec.configs), 1, None) / 100
    assert after > 10 * predicted  # moved most of the way from the prior to the measurement
    replan = next(d for d in store.read_decisions() if d["kind"] == "replan")
    assert replan["time_s"] == 60.0 and replan["inputs"]["cost"] == refit["inputs"]["cost_after"]
    jobs = json.loads(store.plan_json.read_text())["jobs"]
    assert sorted(c for j in jobs for c in j["config_ids"]) == sorted(
        c.config_id for c in configs[4:]
    )
    for j in jobs:  # the re-plan's job times come from the refit model, not the prior
        pack = [coord.configs[c] for c in j["config_ids"]]
        assert j["end_s"] - j["start_s"] == pytest.approx(coord.cost.job_time(pack, 1, None))
        assert j["end_s"] - j["start_s"] > 10 * cost.job_time(pack, 1, None)


def test_remaining_job_time_takes_the_steps_done_off() -> None:
    from plora.runtime.coordinator.costs import remaining_job_time

    cost = AffineCost(t0=1.0, sec_per_sample=0.01)
    pack = [lora(0, steps=10, batch=2), lora(1, steps=20, batch=2)]
    full = remaining_job_time(cost, pack, {}, 1, None)
    assert full == pytest.approx(cost.job_time(pack, 1, None))
    half = remaining_job_time(cost, pack, {"c00": 5, "c01": 10}, 1, None)
    assert half == pytest.approx(1.0 + 0.01 * 2 * (5 + 10))
    done = remaining_job_time(cost, pack, {"c00": 10, "c01": 20}, 1, None)
    assert done == pytest.approx(1.0)  # AffineCost charges t0 per job, whatever the steps


def test_remaining_job_time_with_overheads_charges_what_is_still_to_come() -> None:
    """SweepCostModel: a job not yet stepped still needs all but its start; a job whose steps
    are all done still needs every config's evaluation and export, and the final train-state
    write."""
    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model
    from plora.runtime.coordinator.costs import remaining_job_time

    cost = build_cost_model(SweepConfig.from_yaml("sweeps/quickstart.yaml"), use_profile=False,
                            checkpoint_every=None)  # fmt: skip
    pack = [lora(0, steps=10), lora(1, steps=20)]
    start = cost.overheads.job_start_s
    assert start > 0
    assert remaining_job_time(cost, pack, {}, 1, None) == pytest.approx(
        cost.job_time(pack, 1, None) - start
    )
    done = remaining_job_time(cost, pack, {"c00": 10, "c01": 20}, 1, None)
    final_write = cost.overheads.checkpoint_s
    assert done == pytest.approx(sum(cost.config_overhead_time(c) for c in pack) + final_write)
    assert done > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.integers(1, 3),
    shape=st.lists(
        st.tuples(st.sampled_from([5, 20, 60]), st.sampled_from([4, 8, 16, 24])),
        min_size=4,
        max_size=14,
    ),
    speed=st.floats(0.3, 3.0),
    jitter=st.lists(st.floats(0.5, 1.5), min_size=16, max_size=16),
)
def test_replan_never_adopts_a_schedule_it_predicts_slower(gpus, shape, speed, jitter):
    """A fake clock, jobs that run slower or faster than predicted (the refit model moves), a
    planner whose re-plans are sometimes worse than the plan in force: at every re-plan the
    coordinator follows the faster of continuing and re-planning as its own current model
    predicts them, and the decision record holds both predictions."""
    configs = [lora(i, rank=r, steps=n) for i, (n, r) in enumerate(shape)]
    coord, clock = make(configs, gpus=gpus, calibration_steps=2)
    running = {s.job_id: s for s in coord.start()}
    trained: list[str] = []
    k = 0
    while running:
        job_id = min(running, key=lambda j: coord.running[j].plan_job.end_s)
        spec = running.pop(job_id)
        run = coord.running[job_id]
        rows = [{"config_id": c, "step": 1} for c in spec.config_ids]
        step_s = coord.cost.sec_per_sample * sum(c.batch_size for c in spec.configs)
        coord.on_reports(job_id, [report(*rows, time_s=step_s * speed)] * 3)
        span = run.plan_job.end_s - run.started_s
        clock.t = max(clock.t, run.started_s + span * jitter[k % len(jitter)])
        k += 1
        ids = list(run.config_ids)
        trained += ids
        results = {c: {"status": "done", "steps": 1, "tokens": 10} for c in ids}
        running.update(
            {s.job_id: s for s in coord.on_job_finished(job_id, outcome(job_id, results))}
        )
    assert coord.is_done() and sorted(trained) == sorted(c.config_id for c in configs)
    for d in coord.decisions:
        if d.kind is not Decision.REPLAN or d.inputs["choice"]["current_makespan_s"] is None:
            continue
        cur, cand = (
            d.inputs["choice"]["current_makespan_s"],
            d.inputs["choice"]["candidate_makespan_s"],
        )
        assert d.inputs["makespan_s"] == pytest.approx(min(cur, cand))
        assert (d.inputs["choice"]["kind"] == "candidate") == (cand < cur)
        CHOICES.add(d.inputs["choice"]["kind"])


CHOICES: set[str] = set()


def test_the_replan_guard_property_saw_both_choices() -> None:
    """The property above is not vacuous: across its examples the guard kept the plan in force
    and adopted re-plans."""
    if not CHOICES:
        test_replan_never_adopts_a_schedule_it_predicts_slower()
    assert sorted(CHOICES) == ["candidate", "current"]


def test_a_slow_replan_is_paced_and_the_plan_in_force_keeps_the_gpus_busy(monkeypatch) -> None:
    """A re-plan of PACED_FROM_S or more waits PACE_SPACING times its length after the
    last one (jobs of the plan in force start meanwhile), then runs with the trigger that made
    it due; every config is still trained once."""
    from plora.runtime.coordinator import state as coordinator_state

    mono = Clock()  # the driver's own time, which plans are paced by
    monkeypatch.setattr(coordinator_state.time, "monotonic", lambda: mono.t)
    coord, clock = make([lora(i, rank=64) for i in range(8)], gpus=2)  # one config per job
    planner = coord.state.planner
    plan_sweep, replan = planner.plan_sweep, planner.replan

    def slow(fn):
        def run(*a, **k):
            mono.t += 2.0  # each plan takes 2 s
            return fn(*a, **k)

        return run

    monkeypatch.setattr(planner, "plan_sweep", slow(plan_sweep))
    monkeypatch.setattr(planner, "replan", slow(replan))
    launches = coord.start()
    assert len(launches) == 2 and coord.state.plans.pace.spent_s == 2.0
    (nxt,) = finish(coord, launches[0])  # due, held: the plan in force starts its next job
    assert coord.plan_held() and nxt.gpu_ids == launches[0].gpu_ids
    assert not any(d.kind is Decision.REPLAN for d in coord.decisions)
    mono.t += 7.0  # 7 s after the last plan ended: less than 4 x 2 s
    assert coord.tick() == [] and coord.plan_held()
    mono.t += 1.0
    more = coord.tick()
    (replan_record,) = [d for d in coord.decisions if d.kind is Decision.REPLAN]
    assert replan_record.inputs["trigger"] == f"job {launches[0].job_id} done"
    assert not coord.plan_held()
    every = [*launches[:1], *run_to_end(coord, clock, [launches[1], nxt, *more])]
    trained = [c for s in every for c in s.config_ids]
    assert sorted(trained) == sorted(coord.configs) and coord.is_done()


def test_a_fast_replan_runs_at_every_job_end() -> None:
    coord, _ = make([lora(i, rank=64) for i in range(6)], gpus=2)
    launches = coord.start()
    finish(coord, launches[0])
    assert not coord.plan_held()
    assert sum(d.kind is Decision.REPLAN for d in coord.decisions) == 1


def test_a_slow_refit_at_a_job_end_waits_its_turn(monkeypatch) -> None:
    from plora.runtime.coordinator import scheduling
    from plora.runtime.coordinator import state as coordinator_state

    mono = Clock()
    monkeypatch.setattr(coordinator_state.time, "monotonic", lambda: mono.t)
    refit_cost = scheduling.refit_cost

    def slow(*a, **k):
        mono.t += 2.0  # each refit takes 2 s
        return refit_cost(*a, **k)

    monkeypatch.setattr(scheduling, "refit_cost", slow)
    coord, _ = make([lora(i, rank=64) for i in range(6)], gpus=3, calibration_steps=0)
    launches = coord.start()

    def refits() -> int:
        return sum(d.kind is Decision.REFIT for d in coord.decisions)

    finish(coord, launches[0])
    assert refits() == 1
    finish(coord, launches[1])  # at once: 2 s of refit ended 0 s ago
    assert refits() == 1
    mono.t += 8.0
    finish(coord, launches[2])  # every measurement so far
    assert refits() == 2
    last = [d for d in coord.decisions if d.kind is Decision.REFIT][-1]
    assert last.inputs["measured_jobs"] == 3
