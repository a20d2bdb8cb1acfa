"""The coordinator's refill: queued configs take the slots finished configs leave in running
jobs (no Ray)."""

from __future__ import annotations

import pytest
from runtime_fakes import AffineCost, finish, lora, make, outcome, report

from plora.runtime.records import ConfigStatus, Decision, JobSpec


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
    from plora.runtime.coordinator.refill import choose_refills

    cost = AffineCost()  # capacity 4 = base 1 + 0.1 per rank unit -> 30 rank units
    active = [lora(i, rank=10 // len(active_steps), steps=s) for i, s in enumerate(active_steps)]
    cands = [lora(10 + i, rank=r, steps=s) for i, (r, s) in enumerate(queued)]
    picks = choose_refills(
        active=active, queued=cands, slots=slots, progress={}, cost=cost, gpus=1, strategy=None
    )
    assert [p.config_id for p in picks] == want
    for p in picks:
        assert p.memory_bytes <= p.capacity_bytes and p.steps <= p.steps_left


class _KeyedCost(AffineCost):
    """AffineCost with a ``price_key`` (rank and steps: all its answers read) that counts the
    configs it prices for memory."""

    def __init__(self) -> None:
        super().__init__()
        self.priced: list[str] = []

    def price_key(self, config):  # type: ignore[no-untyped-def]
        return (config.rank, self.steps(config))

    def config_memory(self, config, d, strategy):  # type: ignore[no-untyped-def]
        self.priced.append(config.config_id)
        return super().config_memory(config, d, strategy)


def test_choose_refills_prices_a_key_once_when_it_does_not_fit() -> None:
    """A pack nothing fits costs one pricing per key, not per queued config (a queue of 10,000
    read at each poll), and a fitting config behind them is still found, as without keys."""
    from plora.runtime.coordinator.refill import choose_refills

    active = [lora(0, rank=10, steps=100)]  # 10 of 30 rank units
    too_big = [lora(10 + i, rank=25, steps=50) for i in range(200)]  # 35 > 30: none fits
    fits = lora(999, rank=10, steps=50)
    picks = {}
    for cost in (_KeyedCost(), AffineCost()):
        priced_before = len(getattr(cost, "priced", []))
        got = choose_refills(active=active, queued=[*too_big, fits], slots=3, progress={},
                             cost=cost, gpus=1, strategy=None)  # fmt: skip
        picks[type(cost).__name__] = [p.config_id for p in got]
        if isinstance(cost, _KeyedCost):  # the pack's own config and one of each key
            candidates = [c for c in cost.priced[priced_before:] if c != "c00"]
            assert candidates == ["c10", "c999"], candidates
    assert picks["_KeyedCost"] == picks["AffineCost"] == ["c999"]


def test_poll_all_controls_equal_one_poll_at_a_time() -> None:
    """The driver's round (:meth:`Coordinator.poll_all`, the refill queue built once) gives each
    job the control that polling them one by one gives, refills included."""

    def run(round_: bool) -> list[tuple[str, tuple[str, ...]]]:
        configs = [lora(i, rank=10, steps=5 if i % 3 == 1 else 100) for i in range(12)]
        coord, _ = make(configs, gpus=2)
        specs = coord.start()
        out = []
        for spec in specs:
            done = [c for c in spec.config_ids if c in {"c01", "c04", "c07", "c10"}]
            coord.on_reports(spec.job_id, [report(*({"config_id": c, "step": 5} for c in done))])
        jids = list(coord.running)
        controls = coord.poll_all(jids) if round_ else [(j, coord.poll(j)) for j in jids]
        out = [(j, tuple(c.config_id for c in ctl.add)) for j, ctl in controls]
        assert sum(len(a) for _, a in out) > 0  # some refill happened
        return out

    assert run(True) == run(False)


@pytest.mark.parametrize("seed", range(6))
def test_refill_queue_by_key_picks_as_the_queue_read_in_order(seed: int) -> None:
    """The round's queue merges its keys' groups and drops a rejected key unread; the picks are
    those of reading every queued config in order, for packs of every fill (random queues of
    a few keys, some configs taken between reads, as refills in a round take them)."""
    import random

    from plora.runtime.coordinator.refill import choose_refills
    from plora.runtime.coordinator.scheduling import RefillQueue

    rng = random.Random(seed)
    queued = [lora(10 + i, rank=rng.choice([2, 5, 10, 25]), steps=rng.choice([20, 60, 120]))
              for i in range(60)]  # fmt: skip
    cost = _KeyedCost()
    coord, _ = make(queued, gpus=1, cost=cost)
    coord.start()  # one job on the one GPU; the rest wait
    st = coord.state
    queue = RefillQueue.build(st)
    assert len(queue.position) > 40
    order = [c for g in sorted(queue.groups, key=lambda g: queue.position[g[0]]) for c in g]
    order.sort(key=queue.position.__getitem__)
    picked = 0
    for _ in range(8):
        active = [lora(0, rank=rng.choice([1, 10, 20]), steps=rng.choice([50, 100]))]
        kw = dict(active=active, slots=rng.choice([2, 3, 5]), progress={}, cost=cost, gpus=1,
                  strategy=None, may_extend=rng.random() < 0.5)  # fmt: skip
        waiting = [st.configs.by_id[c] for c in order if st.configs.status[c].value == "queued"]
        want = choose_refills(queued=waiting, **kw)
        rejected: set = set()
        got = choose_refills(queued=queue.configs(st, rejected), rejected_keys=rejected, **kw)
        assert [p.config_id for p in got] == [p.config_id for p in want]
        picked += len(got)
        for p in got:  # taken, as a refill takes them
            st.configs.status[p.config_id] = ConfigStatus.RUNNING
    assert picked > 0


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
