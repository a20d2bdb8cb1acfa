"""The coordinator as a state machine: feed events, check decisions (no Ray)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_fakes import AffineCost, GreedyPlanner, lora, outcome, report

from plora.runtime.coordinator import Coordinator
from plora.runtime.costs import describe_cost
from plora.runtime.records import ConfigStatus, Decision, FailureKind, JobSpec
from plora.sweepdir.store import SweepStore


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(configs, *, gpus=2, cost=None, store=None, **kw):
    clock = Clock()
    coord = Coordinator(
        cost=cost or AffineCost(),
        num_gpus=gpus,
        configs=configs,
        planner=GreedyPlanner(),
        store=store,
        clock=clock,
        metrics_flush_s=0.0,
        **kw,
    )
    return coord, clock


def finish(
    coord: Coordinator,
    spec: JobSpec,
    *,
    step_time: float = 0.05,
    status="done",
    steps: dict[str, int] | None = None,
) -> list[JobSpec]:
    results = {
        c.config_id: {
            "config_id": c.config_id,
            "status": status,
            # a config asked to stop stopped early (after its first step) unless told otherwise
            "steps": (steps or {}).get(
                c.config_id, 1 if c.config_id in coord._stop_requests else c.max_steps
            ),
            "tokens": 100 * c.batch_size,
            "final_train_loss": 1.0,
            "eval_loss": 1.5 - c.rank / 100,
            "eval_metric": c.rank / 100,
            "adapter_path": f"adapters/{c.config_id}",
        }
        for c in spec.configs
    }
    launched = [report(*({"config_id": c, "step": 1} for c in spec.config_ids), time_s=step_time)]
    coord.on_reports(spec.job_id, launched * 3)
    return coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))


def run_to_end(coord: Coordinator, clock: Clock, launches: list[JobSpec], **kw) -> list[JobSpec]:
    """Finish jobs in launch order until the sweep is done; return every launch."""
    every = list(launches)
    queue = list(launches)
    while queue:
        spec = queue.pop(0)
        clock.t += 1.0
        new = finish(coord, spec, **kw)
        every += new
        queue += new
    return every


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
    assert coord.poll(spec.job_id).stop == {running}
    assert coord.poll(spec.job_id).stop == set()  # delivered once
    nxt = finish(coord, spec)
    assert coord.status[running] is ConfigStatus.STOPPED
    assert [s.config_ids for s in nxt] == [(queued[1],)]


def test_refill_adds_queued_config_into_freed_slot() -> None:
    # capacity 4 with base 1 -> 30 rank units: long (rank 10, 100 steps) + short (rank 10, 5 steps)
    # + rank 10 fill a job; a queued rank-10 config of 20 steps fits once the short one ends.
    long_ = lora(0, rank=10, steps=100)
    short = lora(1, rank=10, steps=5)
    mid = lora(2, rank=10, steps=100)
    late = lora(3, rank=10, steps=20)
    coord, _clock = make([long_, short, mid, late], gpus=1)
    (spec,) = coord.start()
    assert set(spec.config_ids) == {"c00", "c01", "c02"}
    assert coord.poll(spec.job_id).add == ()  # no slot free yet
    coord.on_reports(spec.job_id, [report({"config_id": "c01", "step": 5, "loss": 1.0})])
    coord.on_reports(spec.job_id, [report({"config_id": "c00", "step": 5, "loss": 1.0})])
    ctl = coord.poll(spec.job_id)
    assert [c.config_id for c in ctl.add] == ["c03"]
    assert coord.status["c03"] is ConfigStatus.RUNNING
    rec = next(d for d in coord.decisions if d.kind is Decision.REFILL)
    assert rec.inputs["memory_bytes"] <= rec.inputs["capacity_bytes"]
    assert rec.inputs["steps"] <= rec.inputs["steps_left_in_job"]
    assert coord.poll(spec.job_id).add == ()
    spec_now = JobSpec(job_id=spec.job_id, configs=(long_, short, mid, late), gpus=1)
    assert finish(coord, spec_now) == []
    assert coord.is_done()


def test_refill_runs_a_job_on_rather_than_leave_a_slot_free() -> None:
    """No GPU is idle: a queued config that needs more steps than the job has left still takes
    the freed slot (on the resident worker the job runs on for it) instead of waiting for a job
    of its own; the decision says so and the job's predicted end moves."""
    a, b, c = lora(0, rank=10, steps=10), lora(1, rank=10, steps=5), lora(2, rank=10, steps=10)
    late = lora(3, rank=10, steps=50)
    coord, _ = make([a, b, c, late], gpus=1)
    (spec,) = coord.start()
    end_before = coord.running[spec.job_id].plan_job.end_s
    coord.on_reports(
        spec.job_id, [report({"config_id": "c01", "step": 5}, {"config_id": "c00", "step": 6})]
    )
    assert [k.config_id for k in coord.poll(spec.job_id).add] == ["c03"]  # 50 steps > 4 left
    rec = next(d for d in coord.decisions if d.kind is Decision.REFILL)
    assert (
        rec.inputs["extends_job"] is True and rec.inputs["steps"] > rec.inputs["steps_left_in_job"]
    )
    assert coord.running[spec.job_id].plan_job.end_s > end_before


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
    coord._persist()
    state = json.loads(store.state_json.read_text())

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
    state = json.loads(store.state_json.read_text())

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


def test_store_files_follow_decisions(tmp_path) -> None:
    store = SweepStore(tmp_path)
    configs = [lora(i, rank=r) for i, r in enumerate([8, 32, 64, 16])]
    coord, clock = make(configs, gpus=2, store=store)
    launches = coord.start()
    for s in launches:
        coord.on_reports(
            s.job_id,
            [report(*({"config_id": c, "step": 1, "loss": 2.0} for c in s.config_ids), time_s=0.1)],
        )
    run_to_end(coord, clock, launches)
    lines = store.decisions_jsonl.read_text().splitlines()
    assert [json.loads(x)["kind"] for x in lines] == [str(d.kind) for d in coord.decisions]
    results = store.read_results()
    assert sorted(results["config_id"]) == sorted(c.config_id for c in configs)
    assert set(results["status"]) == {"done"}
    assert results.set_index("config_id").loc["c02", "rank"] == 64
    metrics = store.read_metrics()
    assert len(metrics) >= len(launches) and set(metrics["step"]) == {1}
    plans = sorted(store.plans_dir.glob("plan-*.json"))
    assert len(plans) >= 2 and json.loads(store.plan_json.read_text()) == json.loads(
        plans[-1].read_text()
    )
    jobs = store.read_jobs()
    assert set(jobs["status"]) == {"done"} and (jobs["end"] >= jobs["start"]).all()


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


class LimitedSource:
    """An adaptive-searcher stand-in: at most ``limit`` configs outstanding (ConcurrencyLimiter)."""

    def __init__(self, configs, limit: int = 2) -> None:
        self.configs, self.limit, self.told, self.given = list(configs), limit, {}, 0

    def ask(self, n: int):
        room = self.limit - (self.given - len(self.told))
        out = self.configs[self.given : self.given + max(0, min(n, room))]
        self.given += len(out)
        return out

    def tell(self, config_id, metrics) -> None:
        assert config_id not in self.told
        self.told[config_id] = metrics

    def is_finished(self) -> bool:
        return self.given == len(self.configs) and len(self.told) == self.given

    def get_state(self):
        return {"given": self.given, "told": self.told}

    def set_state(self, state) -> None:
        self.given, self.told = state["given"], dict(state["told"])


def test_searcher_is_told_every_ending_and_asked_again() -> None:
    configs = [lora(i, rank=30) for i in range(5)]
    source = LimitedSource(configs, limit=2)
    clock = Clock()
    coord = Coordinator(
        cost=AffineCost(), num_gpus=4, source=source, planner=GreedyPlanner(), clock=clock
    )
    launches = coord.start()
    assert sum(len(s.configs) for s in launches) == 2  # only what the searcher gave
    coord.stop_config(launches[0].config_ids[0])
    every = run_to_end(coord, clock, launches)
    assert coord.is_done() and source.is_finished()
    assert sorted(source.told) == sorted(c.config_id for c in configs)
    assert source.told[launches[0].config_ids[0]]["status"] == "stopped"
    done = [m for m in source.told.values() if m["status"] == "done"]
    assert len(done) == 4 and all(m["eval_metric"] == pytest.approx(0.3) for m in done)
    assert len({c for s in every for c in s.config_ids}) == 5


@pytest.mark.parametrize(
    ("active_steps", "queued", "slots", "want"),
    [
        # (steps of the active configs, (rank, steps) of queued configs, pack slots, chosen)
        ([100], [(10, 50), (10, 60)], 3, ["c10", "c11"]),  # two free slots, both fit
        ([100], [(10, 50), (10, 60)], 2, ["c10"]),  # one free slot
        ([100], [(10, 101), (10, 90)], 3, ["c11"]),  # 101 steps would outlast the job
        ([100], [(25, 50), (10, 50)], 3, ["c11"]),  # rank 25 + 10 = 35 > 30 rank units of memory
        ([100, 100], [(1, 1)], 2, []),  # no free slot
    ],
)
def test_choose_refills_table(active_steps, queued, slots, want) -> None:
    from plora.runtime.refill import choose_refills

    cost = AffineCost()  # capacity 4 = base 1 + 0.1 per rank unit -> 30 rank units
    active = [lora(i, rank=10 // len(active_steps), steps=s) for i, s in enumerate(active_steps)]
    cands = [lora(10 + i, rank=r, steps=s) for i, (r, s) in enumerate(queued)]
    picks = choose_refills(
        active=active, queued=cands, slots=slots, progress={}, cost=cost, gpus=1, strategy=None
    )
    assert [p.config_id for p in picks] == want
    for p in picks:
        assert p.memory_bytes <= p.capacity_bytes and p.steps <= p.steps_left


def test_relay_actor_logic_without_ray() -> None:
    from plora.engine.api import Control
    from plora.runtime.pause import ConfigRequest
    from plora.runtime.relay import CoordinatorActor

    relay = CoordinatorActor(keep_history=True)
    relay.push_reports(
        "j1", [report({"config_id": "a", "step": 1}), report({"config_id": "a", "step": 2})]
    )
    relay.push_reports("j2", [report({"config_id": "b", "step": 1})])
    relay.stop_config("a", "asha")
    ticket = relay.request_sync("j1")  # j1 is about to checkpoint after step 2
    reports, stops, syncs = relay.drain()
    assert [r.metrics[0].step for r in reports["j1"]] == [1, 2] and stops == [
        ConfigRequest("a", "asha")
    ]
    assert syncs == {"j1": ticket} and relay.synced("j1") < ticket
    relay.ack_sync(syncs)  # the driver wrote what it drained with the ticket
    assert relay.synced("j1") == ticket and relay.synced("j2") == 0
    assert relay.drain() == ({}, [], {})
    assert relay.config_view("a")["last"]["step"] == 2 and relay.config_view("a")["result"] is None
    # a follower (a Tune proxy trial) reads one config's stream after a step, then its result
    assert [m.step for m in relay.history("a", 0)[0]] == [1, 2] and relay.history("a")[1] is None
    assert [m.step for m in relay.history("a", 1)[0]] == [2]  # step 1 read: dropped
    relay.post_results({"a": {"status": "stopped", "steps": 2}})
    assert relay.history("a", 2) == ([], {"status": "stopped", "steps": 2})
    assert relay.history("b", 0)[0][0].config_id == "b" and relay.history("zz") == ([], None)
    plain = CoordinatorActor()  # plora sweep: nobody follows, nothing is kept
    plain.push_reports("j1", [report({"config_id": "a", "step": 1})])
    assert plain.history("a") == ([], None) and plain.config_view("a")["last"]["step"] == 1
    relay.post_control("j1", Control(stop=frozenset({"a"}), add=(lora(7),)))
    relay.post_control("j1", Control(stop=frozenset({"x"})))
    assert relay.poll("j1") == Control(stop=frozenset({"a", "x"}), add=(lora(7),))
    assert relay.poll("j1") == Control()  # delivered once
    relay.abort("j2")
    assert relay.poll("j2").abort is True
    relay.post_results({"a": {"status": "stopped"}})
    assert relay.config_view("a")["result"] == {"status": "stopped"}


def test_config_missing_from_a_job_result_is_planned_again() -> None:
    """A refill the worker never picked up (the pack ended first) goes back to the queue and
    gets its own job, even when the job reported no profile (no refit)."""
    long_, short, mid = (
        lora(0, rank=10, steps=100),
        lora(1, rank=10, steps=5),
        lora(2, rank=10, steps=100),
    )
    late = lora(3, rank=10, steps=20)
    coord, clock = make([long_, short, mid, late], gpus=1)
    (spec,) = coord.start()
    coord.on_reports(spec.job_id, [report({"config_id": "c01", "step": 5})])
    assert [c.config_id for c in coord.poll(spec.job_id).add] == ["c03"]
    clock.t = 10.0
    results = {c.config_id: {"status": "completed", "steps": c.max_steps} for c in spec.configs}
    (again,) = coord.on_job_finished(spec.job_id, outcome(spec.job_id, results))
    assert again.config_ids == ("c03",)
    assert coord.status["c03"] is ConfigStatus.RUNNING


def test_no_config_waits_for_a_new_job_while_a_slot_is_free() -> None:
    """Mixed step counts on one GPU: the worker steps its pack, finished configs leave, and
    at every poll a queued config takes each freed slot (memory allows: the planner's pack size
    is the bound) -- the whole sweep runs as the first job, with no job of its own for anyone."""
    cs = [lora(i, rank=10, steps=s) for i, s in enumerate([4, 9, 2, 7, 3, 12, 5, 6, 8, 1])]
    coord, clock = make(cs, gpus=1)
    (spec,) = coord.start()
    slots = len(spec.configs)
    assert slots < len(cs)
    steps = {c: 0 for c in spec.config_ids}
    maxs = {c.config_id: c.max_steps for c in cs}
    while steps:
        clock.t += 0.1
        for c in steps:
            steps[c] += 1
        coord.on_reports(
            spec.job_id, [report(*({"config_id": c, "step": n} for c, n in steps.items()))]
        )
        for c in [c for c, n in steps.items() if n >= maxs[c]]:
            del steps[c]
        ctl = coord.poll(spec.job_id)
        steps.update({k.config_id: 0 for k in ctl.add})
        if coord.queued_ids():
            assert len(steps) == slots, "a slot stayed free while configs were queued"
    done = {c.config_id: {"status": "done", "steps": c.max_steps} for c in cs}
    assert coord.on_job_finished(spec.job_id, outcome(spec.job_id, done)) == []
    assert coord.is_done() and len(coord.job_rows) == 1
    refills = [d for d in coord.decisions if d.kind is Decision.REFILL]
    assert len(refills) == len(cs) - slots


def test_remaining_job_time_takes_the_steps_done_off() -> None:
    from plora.runtime.costs import remaining_job_time

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
    from plora.runtime.costs import remaining_job_time

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
