"""The planner at cluster scale: no recursion whose depth grows with the GPUs or the configs.

DTM's search nests one sub-problem per job of a policy, so a policy of ``n`` one-GPU jobs is
``n`` levels deep; on 1,024 GPUs that passed Python's recursion limit (``RecursionError`` in
``planner/dtm.py``, 5,000 configs x 1,024 GPUs, 2026-11-28). The search now keeps its
sub-problems on an explicit stack (:meth:`plora.planner.dtm.DTM._solve`).
"""

from __future__ import annotations

import dataclasses
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_testlib import check_plan

from plora.config import LoRAConfig
from plora.planner import plan_sweep
from plora.planner.synthetic import AffineCostModel


def _one_per_gpu(n: int) -> tuple[list[LoRAConfig], AffineCostModel]:
    """``n`` alike configs on a cost model whose GPU holds the base and one of them, not two:
    every policy is one one-GPU job per config, as deep as it has GPUs."""
    cost = AffineCostModel(dataset_size=2000)
    configs = [LoRAConfig(config_id=f"c{i}", rank=16, alpha=16, lr=1e-4, batch_size=4,
                          max_steps=50) for i in range(n)]  # fmt: skip
    adapter = cost.config_memory(configs[0], 1, None)
    cost = dataclasses.replace(cost, capacity_bytes=cost.base_memory(1, None) + 1.5 * adapter)
    return configs, cost


def test_a_policy_deeper_than_the_recursion_limit_is_planned() -> None:
    """160 one-GPU jobs at once under a recursion limit of 120 frames (the recursive search
    failed here exactly as it did at Python's default limit on 1,024 GPUs)."""
    configs, cost = _one_per_gpu(160)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(120)
    try:
        plan = plan_sweep(configs, cost, 160)
    finally:
        sys.setrecursionlimit(limit)
    assert len(plan.jobs) == 160 and all(len(j.config_ids) == 1 for j in plan.jobs)
    assert {j.start_s for j in plan.jobs} == {0.0}  # all 160 run at once, one per GPU
    check_plan(plan, configs, cost, 160)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpus=st.integers(1, 4096), n=st.integers(1, 24), seed=st.integers(0, 10**6))
def test_plans_hold_their_invariants_up_to_4096_gpus(gpus: int, n: int, seed: int) -> None:
    """Any GPU count up to 4,096 with a few mixed configs: every invariant of a plan holds."""
    import random

    rng = random.Random(seed)
    configs = [
        LoRAConfig(config_id=f"c{i}", rank=rng.choice([8, 16, 64]), alpha=16,
                   lr=rng.choice([1e-4, 3e-4]), batch_size=rng.choice([1, 4, 16]), max_steps=50)
        for i in range(n)
    ]  # fmt: skip
    cost = AffineCostModel(dataset_size=2000)
    check_plan(plan_sweep(configs, cost, gpus), configs, cost, gpus)
