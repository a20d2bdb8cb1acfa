"""The planner's fast paths against their references (issue 44, item 1).

At 100,000 configs on 1,024 GPUs three steps grew faster than the plan: a worker group's
warmth was checked by comparing its tuple on each of its GPUs (O(d^2): the Max GPU baseline
spent 208 s of its 40,000 x 1,024 run there), Min GPU's list scheduling rescanned and copied the
whole waiting list at every completion (O(n^2)), and DTM's search past its node budget let every
node still open start one more greedy chain of up to g jobs, each chain node re-pricing its
policy's packs. Each fast path is checked here against the slow code it replaced, on random
instances; the search's size is checked by counting nodes (no timed test).
"""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testlib import check_plan

from plora.config import LoRAConfig
from plora.planner import plan_sweep, replan
from plora.planner.baselines import min_gpu_starts
from plora.planner.dtm import DTM
from plora.planner.groups import Groups
from plora.planner.ilp import build_classes
from plora.planner.solver import KnapsackSolver
from plora.planner.synthetic import AffineCostModel
from plora.planner.timeline import Start


class ReferenceGroups(Groups):
    """:class:`Groups` with the O(d^2) checks it had before (the reference)."""

    def set(self, ids: tuple[int, ...]) -> None:
        ids = tuple(sorted(ids))
        for g in ids:
            for h in self.of[g] or ():
                self.of[h] = None
        for g in ids:
            self.of[g] = ids

    def warm(self, ids) -> bool:
        ids = tuple(sorted(ids))
        return not self.track or (not self.never_warm and all(self.of[g] == ids for g in ids))

    def allocate(self, free: list[int], d: int) -> tuple[int, ...]:
        have = set(free)
        block, rank = None, (True, 0)
        for s in free:
            b = tuple(range(s, s + d))
            if s % d or not all(g in have for g in b):
                continue
            r = (not self.warm(b), len({h for g in b for h in (self.of[g] or ())}))
            if block is None or r < rank:
                block, rank = b, r
            if not r[0] or r == (True, 0):
                break
        if block is None:
            block = tuple(free[:d])
        for g in block:
            free.remove(g)
        return block


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), log_g=st.integers(0, 6))
def test_groups_fast_checks_match_the_reference(seed: int, log_g: int) -> None:
    """Random group starts and allocations: warmth, the blocks chosen and the groups held are
    those of the O(d^2) reference."""
    rng = random.Random(seed)
    g = 1 << log_g
    startup = {1 << k: 10.0 * (k + 1) for k in range(log_g + 1)}
    fast, ref = Groups(g, startup), ReferenceGroups(g, startup)
    for _ in range(40):
        d = 1 << rng.randint(0, log_g)
        free = sorted(rng.sample(range(g), rng.randint(d, g)))
        if rng.random() < 0.5:
            block = fast.allocate(list(free), d)
            assert block == ref.allocate(list(free), d)
        else:
            block = tuple(sorted(rng.sample(range(g), d)))
        for ids in (block, tuple(rng.sample(range(g), d))):
            assert fast.warm(ids) == ref.warm(ids)
            assert fast.cost(ids) == ref.cost(ids)
        assert fast.occupy(block) == ref.occupy(block)
        assert fast.of == ref.of


def reference_min_gpu_starts(table, num_gpus: int, groups: Groups) -> list[Start]:
    """Min GPU as it was: scan the whole waiting list at every completion (O(n^2))."""
    groups = groups.copy()
    fast = min_gpu_starts(table, num_gpus, Groups(num_gpus, {}, None))
    # the packs it schedules (one per config, per class) are the same: take them in its order
    jobs = []
    for c, members in enumerate(table.members):
        pack = next(s.pack for s in fast if s.pack.take[c])
        jobs.extend([pack] * len(members))
    waiting = sorted(jobs, key=lambda p: -p.time)
    free, events, now, started = list(range(num_gpus)), [], 0.0, []
    while waiting:
        for pack in list(waiting):
            if pack.option.d <= len(free):
                ids = groups.allocate(free, pack.option.d)
                wait = groups.occupy(ids)
                started.append(Start(pack, now, ids, wait))
                heapq.heappush(events, (now + wait + pack.time, ids))
                waiting.remove(pack)
        if waiting:
            events.sort()
            now, ids = events.pop(0)
            free.extend(ids)
            while events and events[0][0] <= now:
                free.extend(events.pop(0)[1])
            free.sort()
    return started


def mixed_configs(n: int, seed: int, *, big: bool = True) -> list[LoRAConfig]:
    rng = random.Random(seed)
    ranks = [8, 64, 256] if big else [8, 16, 64]
    return [
        LoRAConfig(config_id=f"c{i}", rank=rng.choice(ranks), alpha=16,
                   lr=rng.choice([1e-4, 3e-4]), batch_size=rng.choice([1, 4, 16, 32]),
                   max_steps=rng.choice([20, 50, 80]))
        for i in range(n)
    ]  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 60), log_g=st.integers(0, 5))
def test_min_gpu_starts_match_the_list_scan(seed: int, n: int, log_g: int) -> None:
    """Min GPU's per-width queues start the same jobs at the same times on the same GPUs as
    the scan of the whole waiting list; configs too big for one GPU make jobs of several."""
    g = 1 << log_g
    cost = AffineCostModel(dataset_size=2000, capacity_bytes=24 * 2**30, startup_s=30.0)
    table = build_classes(mixed_configs(n, seed), cost, g)
    if not all(
        any(o.fits[c] and o.d <= g for o in table.options) for c in range(len(table.members))
    ):
        return  # a config fits no allowed width: check_feasible's case, not this one's
    groups = Groups(g, table.startup)
    got = min_gpu_starts(table, g, groups)
    want = reference_min_gpu_starts(table, g, groups)
    assert [(s.pack.take, s.pack.option.d, s.start, s.gpu_ids, s.startup) for s in got] == [
        (s.pack.take, s.pack.option.d, s.start, s.gpu_ids, s.startup) for s in want
    ]


@pytest.mark.parametrize(("n", "gpus", "seed"), [(40, 8, 0), (90, 32, 1), (200, 64, 2)])
def test_spread_memo_plans_as_the_reference(
    n: int, gpus: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DTM's memo of priced packs in its idle-GPU search changes no plan: the same jobs as
    with every pack priced afresh (``MADE_CACHE = 0``), on a fresh plan and a re-plan."""
    cost = AffineCostModel(dataset_size=2000)
    configs = mixed_configs(n, seed, big=False)

    def plans():
        plan = plan_sweep(configs, cost, gpus)
        running = [j for j in plan.jobs if j.start_s == 0.0]
        busy = {c for j in running for c in j.config_ids}
        left = [c for c in configs if c.config_id not in busy]
        now = min(j.end_s for j in running) / 2
        return plan, replan(
            left, 0, running, now, cost, gpus, resident=[j.gpu_ids for j in running]
        )

    fast = plans()
    monkeypatch.setattr(DTM, "MADE_CACHE", 0)
    slow = plans()
    for a, b in zip(fast, slow, strict=True):
        assert a.jobs == b.jobs and a.makespan_s == b.makespan_s
    check_plan(fast[0], configs, cost, gpus)


def test_search_nodes_stay_linear_in_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """One DTM call on 1,024 GPUs with many small configs visits at most
    ``NODE_CAP_FACTOR * node_budget`` nodes plus one greedy chain (a node per job, so at most
    one per GPU); before the cap every node open at the budget started its own chain."""
    nodes = []
    upper = DTM.upper_ratios  # called once per search node
    monkeypatch.setattr(DTM, "upper_ratios", lambda self, *a: nodes.append(1) or upper(self, *a))
    cost = AffineCostModel(dataset_size=2000)
    table = build_classes(mixed_configs(3000, 3, big=False), cost, 1024)
    dtm = DTM(table, KnapsackSolver(), node_budget=20)
    policy = dtm.solve(1024, table.counts)
    assert policy.gpus <= 1024 and dtm.budget_hit
    assert len(nodes) <= DTM.NODE_CAP_FACTOR * 20 + 1024
