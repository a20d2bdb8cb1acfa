"""``planner.max_pack_size``: no pack of a plan, a re-plan or a refill holds more configs.

The knapsack backends under the size row agree with brute force; plans on random Table-1-like
sweeps keep every invariant of :func:`check_plan` with every job at most the cap (and a cap of
one is never slower than the Min-GPU baseline, which it is); the coordinator's refill never
grows a job beyond the cap, even when the pack it started with was larger.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testlib import GIB, check_plan
from runtime_fakes import AffineCost, finish, lora, make, report

from plora.config import ConfigError, LoRAConfig, PlannerOptions
from plora.cost import Strategy
from plora.planner import Baseline, baseline_plan, plan_sweep, replan
from plora.planner import knapsack as kn
from plora.planner import knapsack_milp as milp
from plora.planner.options import SweepPlanner
from plora.planner.solver import KnapsackSolver
from plora.planner.synthetic import AffineCostModel
from plora.runtime.coordinator import Coordinator
from plora.runtime.records import Decision


def brute_force(p, a, b, n, cap_a, cap_b, size_cap):
    """The knapsack's optimum by enumeration (the independent reference)."""
    best = 0.0
    for x in itertools.product(*(range(k + 1) for k in n)):
        if sum(x) > size_cap:
            continue
        if sum(xi * ai for xi, ai in zip(x, a, strict=True)) > cap_a * (1 + 1e-12):
            continue
        if sum(xi * bi for xi, bi in zip(x, b, strict=True)) > cap_b * (1 + 1e-12):
            continue
        best = max(best, sum(xi * pi for xi, pi in zip(x, p, strict=True)))
    return best


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.floats(0.1, 10.0), st.floats(0.0, 5.0), st.floats(0.0, 5.0), st.integers(0, 3)
        ),
        min_size=1,
        max_size=5,
    ),
    st.floats(1.0, 12.0),
    st.sampled_from([float("inf"), 4.0, 9.0]),
    st.integers(1, 4),
)
def test_backends_keep_the_size_row_and_are_optimal(items, cap_a, cap_b, size_cap) -> None:
    p, a, b, n = (list(v) for v in zip(*items, strict=True))
    want = brute_force(p, a, b, n, cap_a, cap_b, size_cap)
    x, val, proven = kn.solve_bnb(p, a, b, n, cap_a, cap_b, size_cap=size_cap)
    assert proven and sum(x) <= size_cap and all(0 <= xi <= ni for xi, ni in zip(x, n, strict=True))
    assert val == pytest.approx(want, rel=1e-9, abs=1e-12)
    x_h, val_h = milp.solve_highs(p, a, b, n, cap_a, cap_b, size_cap=size_cap)
    assert sum(x_h) <= size_cap and val_h == pytest.approx(want, rel=1e-7, abs=1e-9)
    x_s, _ = KnapsackSolver("highs")(p, a, b, n, cap_a, cap_b, size_cap=size_cap)
    assert sum(x_s) <= size_cap


def _small_configs(n: int) -> list[LoRAConfig]:
    """``n`` small configs that one 80 GB GPU packs together (no cap: one or two jobs)."""
    return [
        LoRAConfig(config_id=f"k{i:02d}", rank=8 * (1 + i % 3), alpha=16.0, lr=1e-4,
                   batch_size=1 + i % 2, max_steps=50 + 10 * (i % 4), target_modules="all")
        for i in range(n)
    ]  # fmt: skip


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_a_capped_plan_never_packs_more(cap: int) -> None:
    configs = _small_configs(12)
    cost = AffineCostModel(capacity_bytes=80 * GIB, step_overhead_s=0.1, job_start_s=3.0,
                           startup_s=40.0)  # fmt: skip
    free = plan_sweep(configs, cost, 2)
    assert max(len(j.config_ids) for j in free.jobs) > cap  # the cap binds here
    plan = plan_sweep(configs, cost, 2, max_pack_size=cap)
    check_plan(plan, configs, cost, 2)
    assert max(len(j.config_ids) for j in plan.jobs) <= cap
    assert any("planner.max_pack_size" in note for note in plan.notes)
    assert plan.makespan_s >= free.makespan_s * (1 - 1e-9) or cap > 1
    if cap == 1:  # Min GPU run for real: never slower than its baseline (the safety net)
        base = baseline_plan(configs, cost, 2, Baseline.MIN_GPU)
        assert plan.makespan_s <= base.makespan_s * (1 + 1e-9)
        assert len(plan.jobs) == len(configs)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    n=st.integers(1, 14),
    gpus=st.sampled_from([1, 2, 4]),
    allowed=st.sampled_from([(), (Strategy.TP,)]),
    cap=st.integers(1, 3),
    seed=st.integers(0, 3),
)
def test_capped_plans_and_replans_keep_every_invariant(n, gpus, allowed, cap, seed) -> None:
    configs = [
        LoRAConfig(config_id=f"k{i:03d}", rank=[8, 32, 128][(i + seed) % 3], alpha=16.0,
                   lr=1e-4, batch_size=[1, 4, 16][(i * 7 + seed) % 3],
                   max_steps=[20, 50, 100][(i + 2 * seed) % 3], target_modules="all")
        for i in range(n)
    ]  # fmt: skip
    cost = AffineCostModel(capacity_bytes=80 * GIB, step_overhead_s=0.05, startup_s=40.0,
                           allowed=allowed)  # fmt: skip
    plan = plan_sweep(configs, cost, gpus, max_pack_size=cap)
    check_plan(plan, configs, cost, gpus)
    assert all(len(j.config_ids) <= cap for j in plan.jobs)
    # re-plan the configs of the jobs not started first, beside those running
    first = [j for j in plan.jobs if j.start_s == 0.0]
    rest = [c for c in configs if c.config_id not in {i for j in first for i in j.config_ids}]
    if rest:
        now = min(j.end_s for j in first) / 2
        free = gpus - sum(j.gpus for j in first)
        again = replan(rest, free, first, now, cost, gpus, max_pack_size=cap)
        check_plan(again, rest, cost, gpus, busy=first)
        assert all(len(j.config_ids) <= cap for j in again.jobs)


def test_sweep_planner_carries_the_options() -> None:
    options = PlannerOptions(solver="highs", max_pack_size=2)
    bound = SweepPlanner.from_options(options)
    assert (bound.solver, bound.max_pack_size) == ("highs", 2)
    configs = _small_configs(6)
    cost = AffineCostModel(capacity_bytes=80 * GIB)
    plan = bound.plan_sweep(configs, cost, 1)
    assert max(len(j.config_ids) for j in plan.jobs) <= 2 and "highs" in plan.solver
    running = [plan.jobs[0]]
    rest = [c for c in configs if c.config_id not in running[0].config_ids]
    again = bound.replan(rest, 0, running, 1.0, cost, 1, resident=[(0,)])
    assert max(len(j.config_ids) for j in again.jobs) <= 2


@pytest.mark.parametrize(
    ("value", "needles"),
    [
        (0, ("max_pack_size=0", "must be >= 1")),
        (1.5, ("max_pack_size=1.5", "must be an integer")),
        ("two", ("max_pack_size='two'", "must be an integer")),
    ],
)
def test_bad_values_are_refused_with_the_key(value, needles) -> None:
    with pytest.raises(ConfigError) as err:
        PlannerOptions(max_pack_size=value)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert PlannerOptions(max_pack_size=None).max_pack_size is None


def test_refill_never_grows_a_job_beyond_the_cap() -> None:
    """A job that started with three configs (the fake planner packs what fits) gets no refill
    once one leaves while the cap is two; without the cap the same poll refills it."""
    configs = [lora(0, rank=10, steps=100), lora(1, rank=10, steps=5),
               lora(2, rank=10, steps=100), lora(3, rank=10, steps=20)]  # fmt: skip
    for cap, want in ((None, ["c03"]), (2, []), (3, ["c03"])):
        coord, _ = make(configs, gpus=1, max_pack_size=cap)
        (spec,) = coord.start()
        assert len(spec.config_ids) == 3
        coord.on_reports(spec.job_id, [report({"config_id": "c01", "step": 5})])
        assert [c.config_id for c in coord.poll(spec.job_id).add] == want, cap


def test_a_capped_sweep_runs_every_job_within_the_cap() -> None:
    """The coordinator with the real planner and ``max_pack_size: 2``: every job it launches
    and every pack after a refill holds at most two configs, to the end of the sweep."""
    configs = [lora(i, rank=4, steps=s) for i, s in enumerate([10, 3, 10, 7, 5, 10, 2, 6])]
    coord = Coordinator(cost=AffineCost(), num_gpus=1, configs=configs,
                        planner=SweepPlanner(max_pack_size=2), max_pack_size=2,
                        metrics_flush_s=0.0)  # fmt: skip
    assert max(len(j.config_ids) for j in plan_sweep(configs, AffineCost(), 1).jobs) > 2
    launched = coord.start()
    rounds = 0
    while launched and rounds < 50:
        rounds += 1
        spec = launched.pop(0)
        assert len(spec.config_ids) <= 2, spec
        launched += finish(coord, spec)
    assert coord.is_done()
    for d in coord.decisions:
        if d.kind is Decision.REFILL:
            assert len(d.inputs["pack"]) <= 2, d.inputs
        if d.kind in (Decision.PLAN, Decision.REPLAN):
            assert all(len(j["config_ids"]) <= 2 for j in d.inputs["jobs"]), d.inputs
