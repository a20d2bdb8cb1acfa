"""Plans from the job planner, re-planning and baselines: invariants on random instances."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testlib import GIB, check_plan

from plora.config import ConfigError, LoRAConfig
from plora.cost import Strategy
from plora.planner import Baseline, Job, NoFeasibleJobError, Plan, baseline_plan, plan_sweep, replan
from plora.planner.bounds import ratio_bound
from plora.planner.dtm import DTM
from plora.planner.ilp import build_classes
from plora.planner.solver import KnapsackSolver
from plora.planner.synthetic import AffineCostModel
from plora.planner.types import call_strategy

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def sweeps(draw, max_configs: int = 24):
    """Random Table-1-like configs on the synthetic 7B model, with or without multi-GPU."""
    n = draw(st.integers(1, max_configs))
    configs = [
        LoRAConfig(
            config_id=f"k{i:03d}",
            rank=draw(st.sampled_from([8, 16, 32, 64, 128])),
            alpha=16.0,
            lr=1e-4,
            batch_size=draw(st.sampled_from([1, 2, 4, 8, 16, 32])),
            max_steps=draw(st.sampled_from([20, 50, 100])),
            target_modules=draw(st.sampled_from([("q_proj", "v_proj"), "all"])),
        )
        for i in range(n)
    ]
    allowed = draw(st.sampled_from([(), (Strategy.TP,), (Strategy.TP, Strategy.FSDP)]))
    cost = AffineCostModel(
        capacity_bytes=draw(st.sampled_from([40.0, 80.0, 127.0])) * GIB,
        step_overhead_s=draw(st.floats(0.0, 0.2)),
        job_start_s=draw(st.sampled_from([0.0, 3.0, 60.0])),
        startup_s=draw(st.sampled_from([0.0, 40.0, 400.0])),
        allowed=allowed,
    )
    gpus = draw(st.sampled_from([1, 2, 3, 4, 8]))
    return configs, cost, gpus


@settings(max_examples=40, deadline=None, derandomize=True)
@given(sweeps())
def test_plan_invariants_and_baselines(sweep):
    configs, cost, gpus = sweep
    plan = plan_sweep(configs, cost, gpus)
    check_plan(plan, configs, cost, gpus)
    for kind in Baseline:
        try:
            base = baseline_plan(configs, cost, gpus, kind)
        except ConfigError:
            assert kind is not Baseline.MIN_GPU and gpus > 1 and not cost.allowed
            continue
        check_plan(base, configs, cost, gpus)
        assert base.lower_bound_s == pytest.approx(plan.lower_bound_s)
        if kind is Baseline.MIN_GPU:
            assert all(len(j.config_ids) == 1 for j in base.jobs)
            assert plan.makespan_s <= base.makespan_s * (1 + 1e-9)  # the planner's safety net
        elif kind is Baseline.TUNE:  # Min GPU's jobs, each a new process
            assert all(len(j.config_ids) == 1 for j in base.jobs)
            assert all(j.startup_s == cost.startup_s for j in base.jobs)
        else:  # one job at a time on all GPUs
            assert all(j.gpus == 1 << (gpus.bit_length() - 1) for j in base.jobs)
            ends = [j.end_s for j in base.jobs]
            assert all(
                b.start_s == pytest.approx(a) for a, b in zip(ends, base.jobs[1:], strict=False)
            )


def first_round_throughput(plan: Plan, configs, cost) -> float:
    """Σ v / T of the jobs a plan starts at time 0 (v = config_work)."""
    by_id = {c.config_id: c for c in configs}
    total = 0.0
    for job in plan.jobs:
        if job.start_s == 0.0:
            pack = [by_id[c] for c in job.config_ids]
            total += sum(cost.config_work(k) for k in pack) / job.duration_s
    return total


@settings(max_examples=30, deadline=None, derandomize=True)
@given(sweeps())
def test_dtm_throughput_beats_baselines(sweep):
    configs, cost, gpus = sweep
    table = build_classes(configs, cost, gpus)
    policy = DTM(table, KnapsackSolver()).solve(gpus, table.counts)
    assert policy.gpus <= gpus
    # The policy's throughput is what its packs say, recomputed from the cost model.
    recomputed = 0.0
    for pack in policy.packs:
        members = [cfg for c, t in enumerate(pack.take) for cfg in table.members[c][:t]]
        s = call_strategy(pack.option.d, pack.option.strategy)
        recomputed += sum(cost.config_work(k) for k in members) / cost.job_time(
            members, pack.option.d, s
        )
    assert policy.throughput == pytest.approx(recomputed, rel=1e-9)
    # Max GPU's and Sequential's first job are single jobs on all GPUs, inside Alg. 1's search
    # space, so DTM's throughput is at least theirs. (Min GPU's first round is not: Alg. 1 packs
    # the best configs into one job first, so e.g. 3 configs on 2 GPUs can lose to 2 singles.
    # The makespan comparison with Min GPU is benchmarked, not promised.)
    for kind in (Baseline.MAX_GPU, Baseline.SEQUENTIAL):
        try:
            base = baseline_plan(configs, cost, gpus, kind)
        except ConfigError:
            continue
        assert policy.throughput >= first_round_throughput(base, configs, cost) * (1 - 1e-9)


def test_replan_respects_running_jobs():
    configs = [
        LoRAConfig(config_id=f"r{i}", rank=8 * (1 + i % 4), alpha=8, lr=1e-4, batch_size=4 + 4 * (i % 3), max_steps=100 + 50 * (i % 2))
        for i in range(60)
    ]  # fmt: skip
    cost = AffineCostModel(allowed=(Strategy.TP,))
    first = plan_sweep(configs, cost, 4)
    now = min(j.end_s for j in first.jobs) / 2
    assert any(j.start_s > now for j in first.jobs), "the instance must leave configs to re-plan"
    running = [j for j in first.jobs if j.start_s <= now < j.end_s]
    started = {c for j in first.jobs if j.start_s <= now for c in j.config_ids}
    remaining = [c for c in configs if c.config_id not in started]
    busy_gpus = sum(j.gpus for j in running)
    plan = replan(remaining, 4 - busy_gpus, running, now, cost, 4)
    assert all(j.start_s >= now for j in plan.jobs)
    assert sum(j.gpus for j in plan.jobs if j.start_s == now) <= 4 - busy_gpus
    check_plan(plan, remaining, cost, 4, busy=running)
    assert plan.makespan_s >= max(j.end_s for j in running)
    assert plan.lower_bound_s >= now


def test_replan_with_no_free_gpus_waits_for_the_first_end():
    configs = [
        LoRAConfig(config_id=f"w{i}", rank=16, alpha=16, lr=1e-4, batch_size=2, max_steps=50)
        for i in range(6)
    ]
    cost = AffineCostModel(allowed=())
    running = [
        Job(job_id="a", config_ids=("x",), gpus=1, strategy=None, start_s=0.0, end_s=50.0,
            memory_gib_per_gpu=20.0, gpu_ids=(0,)),
        Job(job_id="b", config_ids=("y",), gpus=1, strategy=None, start_s=0.0, end_s=80.0,
            memory_gib_per_gpu=20.0, gpu_ids=(1,)),
    ]  # fmt: skip
    plan = replan(configs, 0, running, 10.0, cost, 2)
    assert min(j.start_s for j in plan.jobs) == pytest.approx(50.0)
    check_plan(plan, configs, cost, 2, busy=running)


def test_infeasible_config_names_itself_and_the_fix():
    big = LoRAConfig(config_id="huge", rank=8, alpha=8, lr=1e-4, batch_size=1, max_steps=10)
    cost = AffineCostModel(per_config={"huge": (500 * GIB, 1.0)}, allowed=())
    with pytest.raises(NoFeasibleJobError) as err:
        plan_sweep([big], cost, 8)
    msg = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in msg
    assert "huge" in msg and "GiB" in msg and "strategies" in msg
    # With TP allowed it fits on 8 GPUs (500/8 + 15.2/8 + 2 < 126.9 GiB).
    plan = plan_sweep([big], AffineCostModel(per_config={"huge": (500 * GIB, 1.0)}), 8)
    assert plan.jobs[0].gpus == 8


def test_empty_sweep_gives_an_empty_plan():
    plan = plan_sweep([], AffineCostModel(), 4)
    assert plan.jobs == () and plan.makespan_s == 0.0 and plan.to_json_dict()["jobs"] == []


def test_max_gpu_without_strategies_is_refused():
    cfg = LoRAConfig(config_id="a", rank=8, alpha=8, lr=1e-4, batch_size=1, max_steps=10)
    with pytest.raises(ConfigError, match="multi-GPU strategy"):
        baseline_plan([cfg], AffineCostModel(allowed=()), 4, "max_gpu")
    assert baseline_plan([cfg], AffineCostModel(allowed=()), 1, "max_gpu").jobs[0].gpus == 1


def test_plan_json_keys():
    configs = [
        LoRAConfig(config_id=f"j{i}", rank=8, alpha=8, lr=1e-4, batch_size=1, max_steps=10)
        for i in range(3)
    ]
    data = json.loads(json.dumps(plan_sweep(configs, AffineCostModel(), 2).to_json_dict()))
    assert {"num_configs", "num_gpus", "makespan_s", "lower_bound_s", "ratio_bound", "jobs"} <= set(
        data
    )
    assert data["num_configs"] == 3 and data["num_gpus"] == 2
    job_keys = {
        "job_id",
        "config_ids",
        "gpus",
        "strategy",
        "start_s",
        "end_s",
        "memory_gib_per_gpu",
    }
    assert all(job_keys <= set(job) for job in data["jobs"])


def test_ratio_bound_formula():
    jobs = [
        Job(job_id="a", config_ids=("1",), gpus=4, strategy=Strategy.TP, start_s=0, end_s=10,
            memory_gib_per_gpu=1, gpu_ids=(0, 1, 2, 3)),
        Job(job_id="b", config_ids=("2",), gpus=2, strategy=Strategy.TP, start_s=10, end_s=16,
            memory_gib_per_gpu=1, gpu_ids=(0, 1)),
    ]  # fmt: skip
    # F = 16, T_last = 6, D = 2, G = 4: 16 / (16 - 6 * 2 / 4) = 16 / 13.
    assert ratio_bound(jobs, 4) == pytest.approx(16 / 13)


def test_identical_configs_spread_evenly_over_gpus():
    configs = [
        LoRAConfig(config_id=f"t{i}", rank=8, alpha=8, lr=1e-4, batch_size=1, max_steps=100)
        for i in range(40)
    ]
    cost = AffineCostModel(allowed=())
    plan = plan_sweep(configs, cost, 8)
    # Alg. 2 alone packs the 40 configs into a few memory-full jobs; with the deadline search
    # and tail repair the plan is the optimum: 5 configs per GPU in one job each.
    optimum = cost.job_time(configs[:5], 1, Strategy.TP)
    assert plan.makespan_s == pytest.approx(optimum, rel=1e-9)
    assert sorted(len(j.config_ids) for j in plan.jobs) == [5] * 8


def test_paper_table1_sweep_with_the_real_cost_model():
    path = ROOT / "sweeps" / "paper-table1.yaml"
    if not path.exists():
        pytest.skip("sweeps/paper-table1.yaml not shipped")
    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model
    from plora.tune.space import expand

    sweep = SweepConfig.from_yaml(path)
    cost = build_cost_model(sweep, use_profile=False)
    configs = expand(sweep)
    plan = plan_sweep(configs, cost, sweep.hardware.num_gpus)
    check_plan(plan, configs, cost, sweep.hardware.num_gpus)
    assert plan.lb_ratio < 1.2
    for kind in Baseline:
        assert baseline_plan(configs, cost, 8, kind).makespan_s >= plan.makespan_s * 0.999
    assert math.isfinite(plan.ratio_bound)


def test_plan_json_round_trip() -> None:
    """``plan.json`` -> ``Plan`` -> ``plan.json`` is the identity (what notebooks and plots read)."""
    from plora.cost import Strategy
    from plora.planner.types import Job, Plan

    plan = Plan(
        jobs=(
            Job(job_id="j0000", config_ids=("a", "b"), gpus=2, strategy=Strategy.TP, start_s=0.0,
                end_s=5.5, memory_gib_per_gpu=30.0, gpu_ids=(0, 1)),
            Job(job_id="j0001", config_ids=("c",), gpus=1, strategy=None, start_s=1.0, end_s=2.0,
                memory_gib_per_gpu=12.5, gpu_ids=(2,)),
        ),
        num_configs=3, num_gpus=4, makespan_s=5.5, lower_bound_s=4.0, ratio_bound=1.2,
        solver="highs", notes=("n",),
    )  # fmt: skip
    assert Plan.from_json_dict(plan.to_json_dict()) == plan


@pytest.mark.parametrize("skip_from", [1, 10_000])
def test_deadlines_that_bind_no_job_of_alg2_are_skipped_in_large_plans(monkeypatch, skip_from):
    """A plan of many jobs skips the deadlines at or after Alg. 2's last end (they bind none
    of its packs); a smaller plan tries every deadline (there they pay off by chance)."""
    import plora.planner.schedule as sch

    configs = [LoRAConfig(config_id=f"k{i:03d}", rank=8 * (1 + i % 4), alpha=16.0, lr=1e-4,
                          batch_size=1 + i % 8, max_steps=20 + 30 * (i % 3)) for i in range(40)]  # fmt: skip
    cost = AffineCostModel(capacity_bytes=40 * GIB, job_start_s=3.0, startup_s=40.0)
    ran: list[tuple[float, float]] = []  # (deadline, the run's last end)

    def simulate(*args, **kwargs):
        started = real(*args, **kwargs)
        ran.append((kwargs.get("deadline", math.inf), max(s.end for s in started)))
        return started

    real = sch.simulate
    monkeypatch.setattr(sch, "SKIP_UNBOUND_JOBS", skip_from)
    monkeypatch.setattr(sch, "simulate", simulate)
    plan = plan_sweep(configs, cost, 4)
    check_plan(plan, configs, cost, 4)
    tried = [d for d, _ in ran if math.isfinite(d)]
    last_end = ran[0][1]
    if skip_from > len(plan.jobs):
        assert len(tried) == len(sch.DEADLINE_FACTORS) - 1
    else:
        assert tried and all(d < last_end for d in tried)
        assert len(tried) < len(sch.DEADLINE_FACTORS) - 1
