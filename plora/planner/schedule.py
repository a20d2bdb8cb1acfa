"""The job planner (Alg. 2): simulate completion events into a :class:`Plan`.

Alg. 2: while configs are left, whenever GPUs are free run DTM (Alg. 1) on them, start its
jobs, then jump to the next predicted completion and free its GPUs. Jobs get concrete GPU
ids (a free resident worker group of size d when there is one, else the free block aligned
to d that tears down the fewest warm groups, so a d-GPU job sits on neighbouring devices),
and never more than G GPUs are busy.

Start-up (resident workers, our extension; :mod:`plora.planner.groups`): a job whose GPUs do
not already form a worker group of its size first waits ``cost.startup_time(d)`` (worker
start + model load), recorded as its ``Job.startup_s``; ``end = start + startup + T``. A fresh
plan (:func:`plan_sweep`) starts with every GPU cold, so its makespan includes one start-up
per group; a re-plan is told which groups are resident (``resident``) and running jobs' GPUs
stay warm. DTM chooses packs as before (a start-up shifts a job, it does not change T); the
deadline search and the Min GPU safety net compare makespans with the start-ups included.

Deadline search (our extension, documented in benchmarks/RESULTS.md): greedy throughput
maximization packs each job as full as memory allows, which can leave GPUs idle at the end
(the tail effect Thm 6.1 bounds) -- e.g. 120 small configs that fit in three jobs on eight
GPUs. We therefore also run Alg. 2 with a *deadline* ``t*``: a job started at ``now`` may only
take packs with ``T <= t* - now`` (a second knapsack constraint; the ILP stays exact), and a
config that fits no job before the deadline is packed without it. ``t*`` is searched over
multiples of the lower bound and the plan of least makespan kept; ``t* = inf`` is the paper's
Alg. 2, which is always among the candidates, so the result is never worse than it. A deadline
no earlier than the end of Alg. 2's last job binds none of its packs (``T <= t* - start`` held
for each): in a plan of many jobs (:data:`SKIP_UNBOUND_JOBS`) such runs are skipped.

Tail repair (:func:`plora.planner.timeline.rebalance`, also ours): after each simulation,
configs move out of the job that ends last while that lowers the makespan.

Pack cap (``planner.max_pack_size``, ``max_pack_size`` here): no pack of the plan holds more
configs -- the knapsacks carry it as a row and every pack is priced through
:func:`plora.planner.ilp.make_pack`, which refuses a larger one, so DTM's spreading and the
tail repair keep to it too; with 1 the plan is Min GPU's one config per job, run on plora's
resident workers.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from plora.config import LoRAConfig
from plora.cost import CostModel
from plora.planner.baselines import min_gpu_starts
from plora.planner.bounds import lower_bound, ratio_bound
from plora.planner.dtm import DTM
from plora.planner.groups import Groups
from plora.planner.ilp import ClassTable, build_classes
from plora.planner.micro import consolidated
from plora.planner.offload import offload_note
from plora.planner.solver import KnapsackSolver
from plora.planner.timeline import Start, check_feasible, rebalance, to_jobs
from plora.planner.types import Job, Objective, Plan

#: Deadlines tried, as multiples of the lower bound (``inf``: the paper's Alg. 2).
DEADLINE_FACTORS = (math.inf, 1.0, 1.02, 1.05, 1.1, 1.2, 1.35, 1.6, 2.0)

#: Alg. 2's run starting at least this many jobs skips the deadlines that bind none of them.
#: Such a run differs from Alg. 2's only by its capped knapsacks' heuristic (25 nodes): on 400
#: random sweeps of up to 40 configs that chance gave a plan up to 12 % shorter 29 times, but
#: on every benchmark instance of 1,000 to 10,000 configs the plans were the same (2026-11-29),
#: and at 100,000 configs on 1,024 GPUs each run costs a second (six of the nine runs).
SKIP_UNBOUND_JOBS = 1_000


def simulate(
    table: ClassTable,
    dtm: DTM,
    num_gpus: int,
    *,
    counts: Sequence[int],
    now: float = 0.0,
    busy: Sequence[tuple[float, tuple[int, ...]]] = (),
    deadline: float = math.inf,
    groups: Groups | None = None,
) -> list[Start]:
    """Alg. 2 from ``now``: jobs started until every config is placed.

    Args:
        table: config classes and costs.
        dtm: Alg. 1 (its memos are reused across calls).
        num_gpus: G.
        counts: configs left per class, shape (C,).
        now: current time.
        busy: ``(end time, gpu ids)`` of running jobs.
        deadline: jobs started at t take packs with ``T <= deadline - t`` when any fits (less
            the start-up when every free GPU is cold).
        groups: resident worker groups now (not modified); None: start-up not charged.
    """
    groups = groups.copy() if groups is not None else Groups(num_gpus, {}, None)
    held = {i for _, ids in busy for i in ids}
    free = [i for i in range(num_gpus) if i not in held]
    events = [(end, ids) for end, ids in busy]
    heapq.heapify(events)
    left = tuple(counts)
    started: list[Start] = []
    while any(left):
        if free:
            lag = groups.min_startup() if len(groups.cold_gpus(free)) == len(free) else 0.0
            policy = dtm.solve(len(free), left, time_cap=deadline - now - lag)
            if not policy.packs and math.isfinite(deadline):
                policy = dtm.solve(len(free), left)
            for pack in policy.packs:
                ids = groups.allocate(free, pack.option.d)
                wait = groups.occupy(ids)
                started.append(Start(pack, now, ids, wait))
                heapq.heappush(events, (now + wait + pack.time, ids))
                left = tuple(c - t for c, t in zip(left, pack.take, strict=True))
        if not any(left):
            break
        if not events:  # pragma: no cover - check_feasible rules this out
            raise RuntimeError("planner: configs left but no job can start")
        now, ids = heapq.heappop(events)
        free.extend(ids)
        while events and events[0][0] <= now:
            free.extend(heapq.heappop(events)[1])
        free.sort()
    return started


def _search(
    table: ClassTable,
    solver: KnapsackSolver,
    num_gpus: int,
    counts: Sequence[int],
    *,
    now: float,
    busy: Sequence[tuple[float, tuple[int, ...]]],
    lb: float,
    node_budget: int,
    groups: Groups,
) -> tuple[list[Start], list[str]]:
    """Alg. 2 for every deadline in :data:`DEADLINE_FACTORS`; the least makespan wins."""
    dtm = DTM(table, solver, node_budget=node_budget)
    best: tuple[float, float, list[Start]] | None = None
    paper = math.inf
    unbound = math.inf  # deadlines from here on bind no job of Alg. 2's run
    for factor in DEADLINE_FACTORS:
        deadline = now + factor * (lb - now) if math.isfinite(factor) else math.inf
        if math.isfinite(deadline) and deadline >= unbound:  # the factors grow: so do the rest
            break
        started = simulate(
            table, dtm, num_gpus, counts=counts, now=now, busy=busy, deadline=deadline,
            groups=groups,
        )  # fmt: skip
        if not math.isfinite(factor) and len(started) >= SKIP_UNBOUND_JOBS:
            unbound = max((s.end for s in started), default=now)  # each job ends by it
        started = rebalance(table, started, num_gpus, now=now, busy=busy, groups=groups)
        span = max((s.end for s in started), default=now)
        if not math.isfinite(factor):
            paper = span
        if best is None or span < best[0] * (1 - 1e-9):
            best = (span, factor, started)
    assert best is not None
    notes = []
    if math.isfinite(best[1]):
        notes.append(
            f"deadline {best[1]:g} x lower bound: makespan {best[0]:.6g} s "
            f"vs {paper:.6g} s for Alg. 2 without deadline"
        )
    for alt in consolidated(table):  # one micro-batched job instead of several (d = 1)
        alt_dtm = DTM(alt, solver, node_budget=node_budget)
        started = simulate(alt, alt_dtm, num_gpus, counts=counts, now=now, busy=busy, groups=groups)
        started = rebalance(alt, started, num_gpus, now=now, busy=busy, groups=groups)
        span = max((s.end for s in started), default=now)
        m = max((s.pack.micro_batches for s in started), default=1)
        if m > 1 and span < best[0] * (1 - 1e-9):
            notes.append(
                f"micro-batched packs (up to {m} forwards per step): makespan {span:.6g} s "
                f"vs {best[0]:.6g} s with every row live"
            )
            best = (span, best[1], started)
        dtm.budget_hit |= alt_dtm.budget_hit
    if dtm.budget_hit:
        notes.append(f"DTM passed {node_budget} nodes per call; followed greedy chains beyond")
    return best[2], notes


def plan_sweep(
    configs: Sequence[LoRAConfig],
    cost: CostModel,
    num_gpus: int,
    *,
    solver: str = "auto",
    objective: Objective = Objective.WORK,
    node_budget: int = 100,
    resident: Sequence[Sequence[int]] | None = (),
    max_pack_size: int | None = None,
) -> Plan:
    """Plan every config of a sweep on ``num_gpus`` GPUs (Alg. 2 over DTM over F(d, K)).

    Args:
        configs: the sweep's configs (unique ``config_id``).
        cost: the cost model.
        num_gpus: G >= 1.
        solver: knapsack backend: ``auto`` | ``bnb`` | ``highs`` | ``cvxpy`` | ``gurobi``.
        objective: the value ``v_k`` in the throughput (default: FLOPs as work seconds).
        node_budget: DTM search nodes per call before following greedy chains.
        resident: worker groups already started (GPU id tuples); default none: every GPU is
            cold and the makespan includes each group's ``cost.startup_time(d)``. ``None``:
            start-up is not charged.
        max_pack_size: most configs per job (``planner.max_pack_size``); None: as many as fit.

    Raises:
        NoFeasibleJobError: a config fits no allowed GPU count.
    """
    return replan(
        configs, num_gpus, (), 0.0, cost, num_gpus,
        solver=solver, objective=objective, node_budget=node_budget, resident=resident,
        max_pack_size=max_pack_size,
    )  # fmt: skip


def replan(
    remaining: Sequence[LoRAConfig],
    free_gpus: int,
    running: Sequence[Job],
    now: float,
    cost: CostModel,
    num_gpus: int,
    *,
    solver: str = "auto",
    objective: Objective = Objective.WORK,
    node_budget: int = 100,
    resident: Sequence[Sequence[int]] | None = None,
    max_pack_size: int | None = None,
) -> Plan:
    """Re-plan the configs left while ``running`` jobs hold their GPUs until their ``end_s``.

    Returns the new jobs only: those with ``start_s == now`` are to be launched now, the rest
    is the projected timeline. ``makespan_s`` includes the running jobs' ends.

    Args:
        remaining: configs not yet started.
        free_gpus: GPUs free now; GPUs beyond the running jobs' ``gpu_ids`` and this count are
            treated as unavailable (e.g. failed) until a running job ends.
        running: jobs still running (their ``gpu_ids`` and predicted ``end_s``).
        now: current time on the plan's clock.
        cost: the cost model (possibly refitted).
        num_gpus: G.
        resident: the worker groups resident now (GPU id tuples, running jobs' GPUs count as
            their groups anyway); a free GPU in none is cold and waits
            ``cost.startup_time(d)`` before its first job. ``None`` (default): start-up is not
            charged (every GPU warm at every d).
        max_pack_size: most configs per job (``planner.max_pack_size``); None: as many as fit.
    """
    if num_gpus < 1 or not 0 <= free_gpus <= num_gpus:
        raise ValueError(f"planner: free_gpus={free_gpus} must be in [0, num_gpus={num_gpus}]")
    knap = KnapsackSolver(solver)
    table = build_classes(remaining, cost, num_gpus, objective=objective, max_pack=max_pack_size)
    check_feasible(table, num_gpus)
    busy = _busy(running, free_gpus, now, num_gpus)
    groups = Groups(num_gpus, table.startup, resident)
    if groups.track:
        for _, ids in busy[: len(running)]:
            groups.set(ids)
    lb = _lower_bound(table, num_gpus, now, busy, groups)
    started, notes = _search(
        table, knap, num_gpus, table.counts, now=now, busy=busy, lb=lb, node_budget=node_budget,
        groups=groups,
    )  # fmt: skip
    if not busy and started:
        # Safety net: packing is predicted to help, but never plan worse than Min GPU.
        alone = min_gpu_starts(table, num_gpus, groups)
        span = max(s.end for s in started)
        alone_span = max(s.end for s in alone)
        if alone_span < span * (1 - 1e-9):
            notes.append(
                f"one config per job (Min GPU) is predicted faster ({alone_span:.6g} s vs "
                f"{span:.6g} s packed): planned that"
            )
            started = [Start(s.pack, s.start + now, s.gpu_ids, s.startup) for s in alone]
    jobs = to_jobs(table, started)
    if (note := offload_note(jobs)) is not None:
        notes.append(note)
    if max_pack_size is not None:
        notes.append(f"every job holds at most {max_pack_size} config(s) (planner.max_pack_size)")
    makespan = max([j.end_s for j in jobs] + [end for end, _ in busy] + [now])
    return Plan(
        jobs=jobs,
        num_configs=len(remaining),
        num_gpus=num_gpus,
        makespan_s=makespan,
        lower_bound_s=lb,
        ratio_bound=ratio_bound(jobs, num_gpus, origin=now) if jobs else 1.0,
        solver=knap.name,
        notes=tuple(notes + knap.notes),
    )


def _lower_bound(
    table: ClassTable,
    num_gpus: int,
    now: float,
    busy: Sequence[tuple[float, tuple[int, ...]]],
    groups: Groups,
) -> float:
    """:func:`lower_bound` with the held GPUs and the free cold GPUs of ``groups``."""
    held = {g for _, ids in busy for g in ids}
    cold = groups.cold_gpus([g for g in range(num_gpus) if g not in held])
    return lower_bound(
        table, num_gpus, now=now, busy=[(end - now, len(ids)) for end, ids in busy],
        cold=len(cold), startup=groups.min_startup(),
    )  # fmt: skip


def _busy(
    running: Sequence[Job], free_gpus: int, now: float, num_gpus: int
) -> list[tuple[float, tuple[int, ...]]]:
    """``(end, gpu ids)`` held now: running jobs, plus unavailable GPUs until the first end."""
    busy: list[tuple[float, tuple[int, ...]]] = []
    held: set[int] = set()
    for job in running:
        ids = tuple(job.gpu_ids)
        if len(ids) != job.gpus or held & set(ids) or any(not 0 <= i < num_gpus for i in ids):
            spare = [i for i in range(num_gpus) if i not in held]
            ids = tuple(spare[: job.gpus])
        held |= set(ids)
        busy.append((max(job.end_s, now), ids))
    spare = [i for i in range(num_gpus) if i not in held]
    extra = len(spare) - free_gpus
    if extra > 0:
        first_end = min((end for end, _ in busy), default=now)
        busy.append((first_end, tuple(spare[-extra:])))
    return busy


__all__ = ["check_feasible", "plan_sweep", "replan", "simulate", "to_jobs"]
