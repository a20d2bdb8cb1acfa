"""The comparison schedules of the paper's evaluation (§7), as :class:`Plan` s.

* **Min GPU** -- one config per job on the fewest GPUs it fits on (d = 1 whenever it fits;
  the fastest allowed strategy otherwise), list-scheduled longest-first (LPT): whenever GPUs
  free up, start the longest waiting job that fits on them.
* **Max GPU** -- one config per job on all GPUs (the largest power of two d <= G the model
  can be split over, fastest strategy), one job after another. Needs a multi-GPU strategy
  when G > 1.
* **Sequential** -- the brief's reading of "Sequential PLoRA": the planner's packs (F(d, K)
  on d = the largest power of two <= G, repeated on the configs left) run one at a time on
  all GPUs. (In the paper's ablation the difference is the execution engine -- packed
  adapters computed one after another without the fused kernels -- which a cost model of
  that engine passed to :func:`plora.planner.plan_sweep` reproduces.) Needs a multi-GPU
  strategy when G > 1.
* **Tune** -- Ray Tune with one trial per config: Min GPU's jobs, list-scheduled the same way,
  but every trial is a new process that starts its workers and loads the model. As users run
  it, each trial trains one PEFT adapter: ``plora plan`` (:func:`plora.api.make_plan`) charges
  it by :meth:`plora.cost.model.SweepCostModel.for_peft` of the sweep's cost model (PEFT's
  measured step, HF's memory) while the other baselines and the planner keep plora's.

Every baseline is charged by the cost model it is given: each job its ``job_time``
(job start, steps, evaluation, export, checkpoints). Min GPU, Max GPU and Sequential run on
plora's resident workers, so a worker group pays ``cost.startup_time(d)`` once (``resident``
as in :func:`plora.planner.plan_sweep`: by default every GPU starts cold); Tune pays it for
every job.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

from plora.config import ConfigError, LoRAConfig
from plora.cost import CostModel
from plora.planner.bounds import lower_bound, ratio_bound
from plora.planner.groups import Groups
from plora.planner.ilp import (
    ClassTable,
    DegreeCosts,
    Pack,
    build_classes,
    make_pack,
    solve_pack,
)
from plora.planner.solver import KnapsackSolver
from plora.planner.timeline import Start, check_feasible, to_jobs
from plora.planner.types import Baseline, Objective, Plan


def _single(table: ClassTable, option: DegreeCosts, c: int) -> Pack:
    pack = make_pack(table, option, [int(k == c) for k in range(len(table.members))])
    assert pack is not None
    return pack


def _fastest_single(table: ClassTable, c: int, options: Sequence[DegreeCosts]) -> Pack | None:
    fits = [o for o in options if o.fits[c]]
    if not fits:
        return None
    return min((_single(table, o, c) for o in fits), key=lambda p: p.time)


def min_gpu_starts(table: ClassTable, num_gpus: int, groups: Groups | None = None) -> list[Start]:
    """Min GPU: one config per job on its fewest GPUs, list-scheduled longest first.

    ``groups``: the resident worker groups at time 0 (not modified); None: no start-up.
    """
    groups = groups.copy() if groups is not None else Groups(num_gpus, {}, None)
    jobs = []
    for c, members in enumerate(table.members):
        by_d = sorted({o.d for o in table.options if o.d <= num_gpus and o.fits[c]})
        pack = _fastest_single(table, c, [o for o in table.options if o.d == by_d[0]])
        assert pack is not None  # some option of width by_d[0] fits c
        jobs.extend([pack] * len(members))
    # The longest waiting job that fits starts first. One queue per width d, each longest
    # first (ties in class order), so a start picks among at most log2(G) + 1 queue heads:
    # the head of least rank whose d fits is the job a scan of the whole list would start.
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i].time)
    queues: dict[int, deque[int]] = {}
    for rank, i in enumerate(order):
        queues.setdefault(jobs[i].option.d, deque()).append(rank)
    free, now, started = list(range(num_gpus)), 0.0, []
    events: list[tuple[float, tuple[int, ...]]] = []
    while queues:
        while heads := [(q[0], d) for d, q in queues.items() if d <= len(free)]:
            rank, d = min(heads)
            queues[d].popleft()
            if not queues[d]:
                del queues[d]
            pack = jobs[order[rank]]
            ids = groups.allocate(free, d)
            wait = groups.occupy(ids)
            started.append(Start(pack, now, ids, wait))
            heapq.heappush(events, (now + wait + pack.time, ids))
        if queues:
            now, ids = heapq.heappop(events)
            free.extend(ids)
            while events and events[0][0] <= now:
                free.extend(heapq.heappop(events)[1])
            free.sort()
    return started


def _widest(table: ClassTable, num_gpus: int, kind: Baseline) -> list[DegreeCosts]:
    """The options of the widest job: the largest power of two d <= G on which some config
    fits (a degree the model cannot be split over -- TP 8 of 28 heads -- fits none)."""
    d = 1 << (num_gpus.bit_length() - 1)
    usable = [o.d for o in table.options if o.d <= d and bool(o.fits.any())]
    if usable and (max(usable) > 1 or d == 1):
        d = max(usable)
    options = [o for o in table.options if o.d == d]
    if not options:
        raise ConfigError(
            f"baseline {kind}: needs jobs on {d} GPUs but the cost model allows no multi-GPU "
            "strategy; allow planner.strategies (tp, fsdp or pp) or compare with min_gpu"
        )
    return options


def _one_after_another(packs: Sequence[Pack], groups: Groups) -> list[Start]:
    now, started = 0.0, []
    for pack in packs:
        ids = tuple(range(pack.option.d))
        wait = groups.occupy(ids)
        started.append(Start(pack, now, ids, wait))
        now += wait + pack.time
    return started


def baseline_plan(
    configs: Sequence[LoRAConfig],
    cost: CostModel,
    num_gpus: int,
    kind: Baseline | str,
    *,
    solver: str = "auto",
    objective: Objective = Objective.WORK,
    resident: Sequence[Sequence[int]] | None = (),
) -> Plan:
    """The ``kind`` baseline schedule of ``configs`` on ``num_gpus`` GPUs.

    ``resident``: worker groups already started (default none: every GPU cold); ``None``:
    start-up not charged (Tune charges it for every job unless ``None``).

    Raises:
        NoFeasibleJobError: a config fits no allowed GPU count.
        ConfigError: ``max_gpu``/``sequential`` with G > 1 and no multi-GPU strategy.
    """
    kind = Baseline(kind)
    table = build_classes(configs, cost, num_gpus, objective=objective)
    check_feasible(table, num_gpus)
    knap = KnapsackSolver(solver)
    groups = Groups(num_gpus, table.startup, resident)
    cold = len(groups.cold_gpus(range(num_gpus)))
    if kind is Baseline.TUNE and resident is not None:
        groups = Groups.never(num_gpus, table.startup)
    if kind in (Baseline.MIN_GPU, Baseline.TUNE):
        started = min_gpu_starts(table, num_gpus, groups)
    elif kind is Baseline.MAX_GPU:
        options = _widest(table, num_gpus, kind)
        packs = []
        for c, members in enumerate(table.members):
            pack = _fastest_single(table, c, options)
            if pack is None:
                raise ConfigError(f"baseline max_gpu: config {members[0].config_id} does not fit")
            packs.extend([pack] * len(members))
        started = _one_after_another(packs, groups)
    else:
        options = _widest(table, num_gpus, kind)
        left, packs = table.counts, []
        while any(left):
            cands = [solve_pack(table, o, left, knap) for o in options]
            pack = max((p for p in cands if p is not None), key=lambda p: p.ratio, default=None)
            if pack is None:
                raise ConfigError("baseline sequential: a config fits no job on all GPUs")
            packs.append(pack)
            left = tuple(c - t for c, t in zip(left, pack.take, strict=True))
        started = _one_after_another(packs, groups)
    jobs = to_jobs(table, started)
    return Plan(
        jobs=jobs,
        num_configs=len(configs),
        num_gpus=num_gpus,
        makespan_s=max((j.end_s for j in jobs), default=0.0),
        lower_bound_s=lower_bound(table, num_gpus, cold=cold, startup=groups.min_startup()),
        ratio_bound=ratio_bound(jobs, num_gpus),
        solver=knap.name if kind is Baseline.SEQUENTIAL else "none",
        notes=(f"baseline {kind}",),
    )


__all__ = ["baseline_plan"]
