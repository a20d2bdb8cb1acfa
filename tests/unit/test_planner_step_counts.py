"""A sweep whose configs each have their own step count (issue 44, item 2).

Every config is then its own cost class, so F(d, K) had one step-count threshold per config and
its knapsacks held hundreds of near-equal classes of a few memory sizes: 200 configs on 6 GPUs
took 85-207 s (111,580 knapsacks) and 1,000 on 32 did not finish in 10 minutes. Now the
thresholds are bucketed past :data:`plora.planner.ilp.STEP_THRESHOLDS` and branch and bound
takes each group of equal weights best-first. Checked here against brute force and by counting
work (no timed test).
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testlib import brute_knapsack, check_plan

from plora.config import LoRAConfig
from plora.planner import knapsack as kn
from plora.planner import plan_sweep
from plora.planner.ilp import STEP_BUCKET, STEP_THRESHOLDS, step_thresholds
from plora.planner.synthetic import AffineCostModel


@settings(max_examples=80, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.floats(0.1, 5),
            st.sampled_from([0.5, 1.25, 2.0]),
            st.sampled_from([0.7, 1.5]),
            st.integers(0, 2),
        ),
        min_size=1,
        max_size=8,
    ),
    st.floats(0.0, 8.0),
    st.one_of(st.just(float("inf")), st.floats(0.0, 8.0)),
)
def test_bnb_with_shared_weights_equals_brute_force(items, cap_a, cap_b) -> None:
    """Few distinct weights shared by many classes (the groups the search takes best-first):
    the optimum is brute force's, with and without a deadline."""
    p, a, b, n = (list(col) for col in zip(*items, strict=True))
    x, val, proven = kn.solve_bnb(p, a, b, n, cap_a, cap_b)
    assert proven
    assert val == pytest.approx(brute_knapsack(p, a, b, n, cap_a, cap_b), rel=1e-9, abs=1e-12)
    assert val == pytest.approx(float(np.dot(x, p)), rel=1e-12)
    assert np.dot(x, a) <= cap_a * (1 + 1e-9) and np.dot(x, b) <= cap_b * (1 + 1e-9)


def test_near_equal_classes_of_few_sizes_are_proven_in_few_nodes() -> None:
    """300 classes of one config each, three memory sizes, profits within 1 % of each other,
    room for about 40: proven within 2,000 nodes (subsets of near-equal classes are no longer
    searched one by one)."""
    rng = random.Random(0)
    m = 300
    p = [1.0 + 0.01 * rng.random() for _ in range(m)]
    a = [rng.choice([1.0, 1.5, 2.5]) for _ in range(m)]
    _, val, proven = kn.solve_bnb(p, a, [1.0] * m, [1] * m, 61.3, node_limit=2_000)
    assert proven
    by_size: dict[float, list[float]] = {}
    for pi, ai in zip(p, a, strict=True):
        by_size.setdefault(ai, []).append(pi)
    # the optimum takes the best of each size: check against a search over counts per size
    tops = {s: np.cumsum([0.0, *sorted(v, reverse=True)]) for s, v in by_size.items()}
    sizes = sorted(tops)
    ref = max(
        sum(tops[s][k] for s, k in zip(sizes, ks, strict=True))
        for ks in itertools.product(*(range(len(tops[s])) for s in sizes))
        if sum(s * k for s, k in zip(sizes, ks, strict=True)) <= 61.3
    )
    assert val == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize(
    ("steps", "want"),
    [
        ([100] * 5 + [50, 200], [200, 100, 50]),  # few counts: every one, exact
        (list(range(10, 10 + STEP_THRESHOLDS)), list(range(9 + STEP_THRESHOLDS, 9, -1))),
    ],
)
def test_few_step_counts_keep_every_threshold(steps, want) -> None:
    assert step_thresholds(steps) == want


@given(st.lists(st.integers(1, 10_000), min_size=STEP_THRESHOLDS + 1, max_size=400, unique=True))
def test_many_step_counts_are_bucketed_geometrically(steps) -> None:
    """Past the limit: each count has a threshold at most 10 % above it, the thresholds are
    counts of the sweep, longest first, and number at most log(max/min)/log(1.1) + 1."""
    tops = step_thresholds(steps)
    assert tops == sorted(set(tops), reverse=True) and set(tops) <= set(steps)
    for s in steps:
        theta = min(t for t in tops if t >= s)
        assert theta <= s * STEP_BUCKET
    assert len(tops) <= np.log(max(steps) / min(steps)) / np.log(STEP_BUCKET) + 1


def own_steps(n: int, seed: int = 0) -> list[LoRAConfig]:
    """``n`` configs, ``max_steps`` drawn per config from U(0.2, 1.8) x 100."""
    rng = random.Random(seed)
    return [
        LoRAConfig(config_id=f"c{i:03d}", rank=rng.choice([8, 16, 32, 64]), alpha=16, lr=1e-4,
                   batch_size=rng.choice([1, 2, 4, 8]),
                   max_steps=max(2, round(100 * rng.uniform(0.2, 1.8))))
        for i in range(n)
    ]  # fmt: skip


def test_a_sweep_of_own_step_counts_plans_with_bounded_knapsacks(monkeypatch) -> None:
    """80 configs of their own step counts on 4 GPUs: a valid plan with no HiGHS fallback, in
    at most 800 knapsacks (443 when written; 1,158 with every step count a threshold)."""
    calls = []
    solve = kn.solve_bnb
    monkeypatch.setattr(kn, "solve_bnb", lambda *a, **k: calls.append(1) or solve(*a, **k))
    configs = own_steps(80)
    cost = AffineCostModel(dataset_size=2000, capacity_bytes=40 * 2**30, job_start_s=30.0)
    plan = plan_sweep(configs, cost, 4)
    check_plan(plan, configs, cost, 4)
    assert len(calls) <= 800
    assert plan.solver == "bnb" and not any("HiGHS" in n for n in plan.notes)
