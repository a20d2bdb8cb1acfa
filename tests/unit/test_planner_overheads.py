"""The planner with overheads: start-up once per worker group, job starts, baselines, the guard."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plora.config import LoRAConfig
from plora.cost import Strategy
from plora.cost.model import SweepCostModel
from plora.cost.overheads import Overheads
from plora.model_spec import ModelSpec
from plora.planner import (
    Baseline,
    Job,
    Plan,
    PlanChoiceKind,
    baseline_plan,
    choose_plan,
    continue_plan,
    plan_sweep,
    replan,
)
from plora.planner.bounds import water_fill
from plora.planner.groups import Groups
from plora.planner.synthetic import AffineCostModel
from plora.planner.types import call_strategy

GIB = float(1 << 30)


def cfg(i: int, *, steps: int = 100, rank: int = 8, batch: int = 1) -> LoRAConfig:
    return LoRAConfig(config_id=f"c{i:03d}", rank=rank, alpha=2.0 * rank, lr=1e-4,
                      batch_size=batch, max_steps=steps)  # fmt: skip


#: Twelve configs of different lengths: with no per-job cost, single-config jobs balance best.
UNEVEN = [cfg(i, steps=s) for i, s in enumerate([100, 90, 80, 70, 60, 50, 40, 30, 20, 10, 100, 50])]


def warm_by_history(plan: Plan, resident=()) -> dict[str, bool]:
    """Independent rule: a job is warm iff the previous job on each of its GPUs (or the
    initial groups) had exactly its GPU ids."""
    group = {g: tuple(sorted(ids)) for ids in resident for g in ids}
    out = {}
    for job in sorted(plan.jobs, key=lambda j: (j.start_s, j.job_id)):
        ids = tuple(sorted(job.gpu_ids))
        out[job.job_id] = all(group.get(g) == ids for g in ids)
        for g in ids:
            group[g] = ids
    return out


# ------------------------------------------------------------------------- start-up
@st.composite
def cold_sweeps(draw):
    n = draw(st.integers(1, 16))
    configs = [
        cfg(i, steps=draw(st.sampled_from([20, 50, 100])), rank=draw(st.sampled_from([8, 64])),
            batch=draw(st.sampled_from([1, 8, 32])))
        for i in range(n)
    ]  # fmt: skip
    cost = AffineCostModel(
        capacity_bytes=draw(st.sampled_from([40.0, 80.0])) * GIB,
        job_start_s=draw(st.sampled_from([0.0, 5.0])),
        startup_s=draw(st.sampled_from([10.0, 300.0])),
        allowed=draw(st.sampled_from([(), (Strategy.TP,)])),
    )
    return configs, cost, draw(st.sampled_from([1, 2, 4]))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(cold_sweeps())
def test_startup_is_paid_exactly_when_a_group_is_started(sweep) -> None:
    configs, cost, gpus = sweep
    plan = plan_sweep(configs, cost, gpus)
    warm = warm_by_history(plan)
    for job in plan.jobs:
        assert job.startup_s == (0.0 if warm[job.job_id] else cost.startup_s), job
    assert min(j.start_s + j.startup_s for j in plan.jobs) >= cost.startup_s  # all cold at 0
    assert plan.lower_bound_s >= cost.startup_s
    assert plan.lower_bound_s <= plan.makespan_s * (1 + 1e-9)
    if not cost.allowed:  # one d: every GPU starts its group once, with its first job
        for g in range(gpus):
            mine = sorted((j for j in plan.jobs if g in j.gpu_ids), key=lambda j: j.start_s)
            assert [j.startup_s > 0 for j in mine] == [True] + [False] * (len(mine) - 1)


def test_fresh_plan_pays_startup_and_warm_replan_does_not() -> None:
    configs = [cfg(i) for i in range(8)]
    cost = AffineCostModel(allowed=(), startup_s=40.0)
    cold = plan_sweep(configs, cost, 2)
    free = plan_sweep(configs, cost, 2, resident=None)  # start-up not charged
    assert cold.makespan_s == pytest.approx(free.makespan_s + 40.0)
    assert cold.lower_bound_s == pytest.approx(free.lower_bound_s + 40.0)
    assert sum(j.startup_s > 0 for j in cold.jobs) == 2  # once per GPU
    warm = replan(configs, 2, (), 0.0, cost, 2, resident=[(0,), (1,)])
    assert all(j.startup_s == 0.0 for j in warm.jobs)
    assert warm.makespan_s == pytest.approx(free.makespan_s)
    half = replan(configs, 2, (), 0.0, cost, 2, resident=[(1,)])
    assert [j.gpu_ids for j in half.jobs if j.startup_s > 0] in ([(0,)], [])
    assert free.makespan_s <= half.makespan_s <= cold.makespan_s
    assert half.lower_bound_s <= half.makespan_s * (1 + 1e-9)


def test_running_jobs_leave_their_groups_warm() -> None:
    cost = AffineCostModel(allowed=(Strategy.TP,), startup_s=50.0)
    running = [Job(job_id="r", config_ids=("x",), gpus=2, strategy=Strategy.TP, start_s=0.0,
                   end_s=30.0, memory_gib_per_gpu=10.0, gpu_ids=(0, 1))]  # fmt: skip
    plan = replan([cfg(0, batch=32)], 0, running, 5.0, cost, 2, resident=[])
    (job,) = plan.jobs
    assert job.start_s == pytest.approx(30.0)
    assert job.startup_s == (0.0 if job.gpu_ids == (0, 1) else 50.0)
    assert plan.lower_bound_s <= plan.makespan_s * (1 + 1e-9)


def test_a_group_rebuilt_at_another_degree_pays_again() -> None:
    groups = Groups(4, {1: 10.0, 2: 12.0, 4: 20.0}, resident=[(0,), (1,), (2, 3)])
    assert groups.cost((0,)) == 0.0 and groups.cost((2, 3)) == 0.0
    assert groups.cost((2,)) == 10.0 and groups.cost((0, 1)) == 12.0
    free = [0, 1, 2, 3]
    assert groups.allocate(free, 2) == (2, 3)  # the resident pair
    assert groups.allocate(free, 1) == (0,)
    assert groups.occupy((0, 1)) == 12.0  # tears down (0,) and (1,)
    assert groups.cost((0, 1)) == 0.0 and groups.cost((1,)) == 10.0
    assert groups.occupy((2,)) == 10.0 and groups.cold_gpus(range(4)) == [3]
    assert Groups(4, {1: 10.0}, None).cost((0,)) == 0.0  # not tracked: never charged
    with pytest.raises(ValueError, match="overlap"):
        Groups(4, {1: 10.0}, resident=[(0, 1), (1,)])
    with pytest.raises(ValueError, match="distinct"):
        Groups(4, {1: 10.0}, resident=[(4,)])
    never = Groups.never(4, {1: 10.0})
    assert never.occupy((0,)) == 10.0 and never.occupy((0,)) == 10.0


# ------------------------------------------------------------------------- job start
def test_a_job_start_cost_makes_the_planner_pack_more() -> None:
    """With 0 per-job cost single-config jobs balance best; with a 20 s job start the planner
    packs fewer, larger jobs, and beats its own job-start-blind plan re-timed under the cost."""
    blind = AffineCostModel(allowed=(), step_overhead_s=0.0)
    costly = AffineCostModel(allowed=(), step_overhead_s=0.0, job_start_s=20.0)
    unaware = plan_sweep(UNEVEN, blind, 4, resident=None)
    aware = plan_sweep(UNEVEN, costly, 4, resident=None)
    assert len(unaware.jobs) == len(UNEVEN) and len(aware.jobs) <= 4
    assert max(len(j.config_ids) for j in aware.jobs) > 1
    as_run = continue_plan(unaware.jobs, UNEVEN, costly, 4)
    assert as_run.makespan_s > aware.makespan_s + 20.0
    assert all(j.duration_s >= 20.0 for j in aware.jobs)


# ------------------------------------------------------------------------- baselines
def real_cost(**kw) -> SweepCostModel:
    over = Overheads(worker_start_s=30.0, model_load_s=8.0, job_start_s=3.0,
                     eval_s_per_row=0.01, generate_s_per_row=0.05, export_s=0.3,
                     checkpoint_s=0.5, source="given")  # fmt: skip
    from plora.config import HardwareConfig

    return SweepCostModel(ModelSpec.from_hf_config("Qwen/Qwen2.5-1.5B"), 512, 1000,
                          HardwareConfig(gpu_type="H100", num_gpus=2), overheads=over,
                          eval_rows=200, eval_metric="exact_match", checkpoint_every=50,
                          strategies=(Strategy.TP,), **kw)  # fmt: skip


@pytest.mark.parametrize("kind", [Baseline.MIN_GPU, Baseline.MAX_GPU, Baseline.TUNE])
def test_baselines_pay_every_per_job_overhead(kind) -> None:
    cost = real_cost()
    configs = [cfg(i, steps=60 + 10 * i, rank=8 * (1 + i % 3)) for i in range(6)]
    by_id = {c.config_id: c for c in configs}
    base = baseline_plan(configs, cost, 2, kind)
    assert all(len(j.config_ids) == 1 for j in base.jobs)
    for job in base.jobs:
        (k,) = (by_id[c] for c in job.config_ids)
        s = call_strategy(job.gpus, job.strategy)
        terms = cost.job_terms([k], job.gpus, s)
        assert terms.job_start_s == 3.0 and terms.eval_s == pytest.approx(200 * 0.06)
        # the export's fixed part; its write overlaps the 12 s of evaluation
        assert terms.export_s == pytest.approx(0.3) and terms.checkpoint_s >= 0.5 * 2
        assert job.duration_s == pytest.approx(job.startup_s + terms.total_s)
    starts = [j.startup_s > 0 for j in base.jobs]
    if kind is Baseline.TUNE:  # a new process per trial
        assert all(starts) and all(j.startup_s == 38.0 for j in base.jobs)
        min_gpu = baseline_plan(configs, cost, 2, Baseline.MIN_GPU)
        assert base.makespan_s >= min_gpu.makespan_s + 38.0
    else:  # resident workers: once per group
        assert sum(starts) == len({j.gpu_ids for j in base.jobs})
    plan = plan_sweep(configs, cost, 2)
    assert plan.makespan_s <= base.makespan_s * (1 + 1e-9)
    assert base.lower_bound_s == pytest.approx(plan.lower_bound_s)
    assert base.lower_bound_s <= base.makespan_s


# ------------------------------------------------------------------------- bounds
@pytest.mark.parametrize(
    ("available", "work", "want"),
    [
        ([0, 0], 10, 5),
        ([0, 10], 4, 4),  # the second GPU is not needed
        ([0, 10], 30, 20),
        ([5, 5, 5], 3, 6),
        ([], 3, 0),
        ([7], 0, 0),
    ],
)
def test_water_fill(available, work, want) -> None:
    assert water_fill(available, work) == pytest.approx(want)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(cold_sweeps(), st.integers(0, 4))
def test_lower_bound_holds_with_some_groups_resident(sweep, warm) -> None:
    configs, cost, gpus = sweep
    resident = [(g,) for g in range(min(warm, gpus))]
    plan = replan(configs, gpus, (), 0.0, cost, gpus, resident=resident)
    assert plan.lower_bound_s <= plan.makespan_s * (1 + 1e-9)
    w = warm_by_history(plan, resident)
    assert all(j.startup_s == (0.0 if w[j.job_id] else cost.startup_s) for j in plan.jobs)


# ------------------------------------------------------------------------- the guard
def _plan(makespan: float, ids: tuple[str, ...]) -> Plan:
    jobs = (Job(job_id="j", config_ids=ids, gpus=1, strategy=None, start_s=0.0,
                end_s=makespan, memory_gib_per_gpu=1.0, gpu_ids=(0,)),)  # fmt: skip
    return Plan(jobs=jobs, num_configs=len(ids), num_gpus=1, makespan_s=makespan,
                lower_bound_s=0.0, ratio_bound=1.0)  # fmt: skip


@settings(max_examples=200, derandomize=True)
@given(st.floats(0.0, 1e6), st.floats(0.0, 1e6))
def test_choose_plan_never_picks_the_slower(cur, cand) -> None:
    current, candidate = _plan(cur, ("a", "b")), _plan(cand, ("b", "a"))
    chosen, choice = choose_plan(current, candidate)
    other = candidate if chosen is current else current
    assert chosen.makespan_s <= other.makespan_s
    assert (choice.current_makespan_s, choice.candidate_makespan_s) == (cur, cand)
    assert choice.kind is (
        PlanChoiceKind.CURRENT if chosen is current else PlanChoiceKind.CANDIDATE
    )
    assert choice.reason and choice.to_dict()["kind"] == str(choice.kind)


def test_choose_plan_edge_cases() -> None:
    cand = _plan(10.0, ("a",))
    assert choose_plan(None, cand)[1].kind is PlanChoiceKind.CANDIDATE
    chosen, choice = choose_plan(_plan(5.0, ("b",)), cand)  # other configs: cannot continue
    assert chosen is cand and "cannot be continued" in choice.reason
    chosen, choice = choose_plan(_plan(10.0, ("a",)), cand)  # a tie keeps the plan in force
    assert choice.kind is PlanChoiceKind.CURRENT
    chosen, choice = choose_plan(_plan(10.0, ("a",)), _plan(9.5, ("a",)), min_gain=0.1)
    assert choice.kind is PlanChoiceKind.CURRENT and "10%" in choice.reason
    with pytest.raises(ValueError, match="min_gain"):
        choose_plan(None, cand, min_gain=1.0)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(cold_sweeps(), st.floats(0.2, 5.0))
def test_guarded_replan_after_a_refit(sweep, slower) -> None:
    """Mid-sweep: re-time what is left of the first plan under a refit model and compare with a
    re-plan; the guard's choice is never predicted slower than the alternative."""
    configs, cost, gpus = sweep
    first = plan_sweep(configs, cost, gpus)
    now = min(j.end_s for j in first.jobs) / 2
    running = [j for j in first.jobs if j.start_s <= now < j.end_s]
    pending = [j for j in first.jobs if j.start_s > now]
    left = [c for c in configs if any(c.config_id in j.config_ids for j in pending)]
    refit = AffineCostModel(**{**cost.__dict__, "sec_per_token": cost.sec_per_token * slower})
    resident = [j.gpu_ids for j in first.jobs if j.start_s <= now]
    current = continue_plan(pending, left, refit, gpus, now=now, running=running,
                            resident=resident)  # fmt: skip
    by_id = {c.config_id: c for c in left}
    for job in current.jobs:
        pack = [by_id[c] for c in job.config_ids]
        t = refit.job_time(pack, job.gpus, call_strategy(job.gpus, job.strategy))
        assert job.duration_s == pytest.approx(job.startup_s + t)
        assert job.start_s >= now
    if not left:
        return
    free = gpus - sum(j.gpus for j in running)
    candidate = replan(left, free, running, now, refit, gpus, resident=resident)
    chosen, choice = choose_plan(current, candidate)
    assert chosen.makespan_s <= min(current.makespan_s, candidate.makespan_s)
    assert current.lower_bound_s <= current.makespan_s * (1 + 1e-9)
    assert math.isfinite(choice.candidate_makespan_s)
