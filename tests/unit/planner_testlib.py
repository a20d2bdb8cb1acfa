"""Plan invariants shared by the planner's tests: :func:`check_plan` checks a plan against the
cost model directly (every config once, memory per GPU, spans, no double-booked GPU, bounds)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from plora.cost import within_capacity
from plora.planner import Plan
from plora.planner.types import call_strategy

GIB = float(1 << 30)


def check_plan(plan: Plan, configs, cost, num_gpus: int, *, busy=()) -> None:
    """Every invariant a plan promises, checked against the cost model directly."""
    by_id = {c.config_id: c for c in configs}
    placed = [cid for job in plan.jobs for cid in job.config_ids]
    assert sorted(placed) == sorted(by_id), "every config in exactly one job"
    for job in plan.jobs:
        assert job.gpus >= 1 and job.gpus & (job.gpus - 1) == 0, "d is a power of two"
        assert len(job.gpu_ids) == job.gpus == len(set(job.gpu_ids))
        assert all(0 <= g < num_gpus for g in job.gpu_ids)
        assert (job.strategy is None) == (job.gpus == 1)
        s = call_strategy(job.gpus, job.strategy)
        pack = [by_id[c] for c in job.config_ids]
        # a micro-batched job (m forwards per step) fits with m, and not with fewer
        micro = {"micro_batches": job.micro_batches} if job.micro_batches > 1 else {}
        if micro:
            mem = cost.pack_memory(pack, job.gpus, s, **micro)
            assert cost.micro_batches_to_fit(pack, job.gpus, s) == job.micro_batches
            assert job.max_rows == -(-sum(k.batch_size for k in pack) // job.micro_batches)
        else:
            mem = cost.base_memory(job.gpus, s) + sum(
                cost.config_memory(k, job.gpus, s) for k in pack
            )
            assert job.max_rows is None
        assert within_capacity(mem, cost.capacity(job.gpus)), "memory fits per GPU"
        assert job.memory_gib_per_gpu == pytest.approx(mem / GIB, rel=1e-9)
        # a job's span is its group's start-up (0 when warm) and then its job_time
        assert job.startup_s in (0.0, pytest.approx(cost.startup_time(job.gpus)))
        want = job.startup_s + cost.job_time(pack, job.gpus, s, **micro)
        assert job.duration_s == pytest.approx(want, rel=1e-9)
    # No GPU runs two jobs at once (so never more than G busy), running jobs included.
    intervals = [(j.start_s, j.end_s, g) for j in plan.jobs for g in j.gpu_ids]
    intervals += [(b.start_s, b.end_s, g) for b in busy for g in b.gpu_ids]
    for g in range(num_gpus):
        mine = sorted((s, e) for s, e, h in intervals if h == g)
        for (_, e1), (s2, _) in itertools.pairwise(mine):
            assert s2 >= e1 - 1e-6 * max(1.0, e1), f"GPU {g} double-booked"
    events = sorted({t for j in plan.jobs for t in (j.start_s, j.end_s)})
    for t in events:
        in_use = sum(j.gpus for j in plan.jobs if j.start_s <= t < j.end_s)
        assert in_use <= num_gpus
    ends = [j.end_s for j in plan.jobs] + [b.end_s for b in busy]
    assert plan.makespan_s == pytest.approx(max(ends), rel=1e-12)
    assert plan.lower_bound_s <= plan.makespan_s * (1 + 1e-9)
    assert plan.ratio_bound >= 1.0


def brute_knapsack(p, a, b, n, cap_a, cap_b) -> float:
    """The best profit of the two-constraint bounded knapsack, by enumeration (the reference)."""
    best = 0.0
    for x in itertools.product(*[range(k + 1) for k in n]):
        if np.dot(x, a) <= cap_a * (1 + 1e-12) and np.dot(x, b) <= cap_b * (1 + 1e-12):
            best = max(best, float(np.dot(x, p)))
    return best
