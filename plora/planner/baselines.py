"""The comparison schedules of the paper's evaluation (§7), as :class:`Plan` s.

* **Min GPU** -- one config per job on the fewest GPUs it fits on (d = 1 whenever it fits;
  the fastest allowed strategy otherwise), list-scheduled longest-first (LPT): whenever GPUs
  free up, start the longest waiting job that fits on them.
* **Max GPU** -- one config per job on all GPUs (the largest power of two d <= G, fastest
  strategy), one job after another. Needs a multi-GPU strategy when G > 1.
* **Sequential** -- the brief's reading of "Sequential PLoRA": the planner's packs (F(d, K)
  on d = the largest power of two <= G, repeated on the configs left) run one at a time on
  all GPUs. (In the paper's ablation the difference is the execution engine -- packed
  adapters computed one after another without the fused kernels -- which a cost model of
  that engine passed to :func:`plora.planner.plan_sweep` reproduces.) Needs a multi-GPU
  strategy when G > 1.
"""

from __future__ import annotations

from collections.abc import Sequence

from plora.config import ConfigError, LoRAConfig
from plora.cost import CostModel
from plora.planner.bounds import lower_bound, ratio_bound
from plora.planner.ilp import (
    ClassTable,
    DegreeCosts,
    KnapsackSolver,
    Pack,
    build_classes,
    make_pack,
    solve_pack,
)
from plora.planner.schedule import _allocate, _Start, check_feasible, to_jobs
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


def min_gpu_starts(table: ClassTable, num_gpus: int) -> list[_Start]:
    """Min GPU: one config per job on its fewest GPUs, list-scheduled longest first."""
    jobs = []
    for c, members in enumerate(table.members):
        by_d = sorted({o.d for o in table.options if o.d <= num_gpus and o.fits[c]})
        pack = _fastest_single(table, c, [o for o in table.options if o.d == by_d[0]])
        jobs.extend([pack] * len(members))
    waiting = sorted(jobs, key=lambda p: -p.time)
    free, events, now, started = list(range(num_gpus)), [], 0.0, []
    while waiting:
        for pack in list(waiting):
            if pack.option.d <= len(free):
                ids = _allocate(free, pack.option.d)
                started.append(_Start(pack, now, ids))
                events.append((now + pack.time, ids))
                waiting.remove(pack)
        if waiting:
            events.sort()
            now, ids = events.pop(0)
            free.extend(ids)
            while events and events[0][0] <= now:
                free.extend(events.pop(0)[1])
            free.sort()
    return started


def _widest(table: ClassTable, num_gpus: int, kind: Baseline) -> list[DegreeCosts]:
    d = 1 << (num_gpus.bit_length() - 1)
    options = [o for o in table.options if o.d == d]
    if not options:
        raise ConfigError(
            f"baseline {kind}: needs jobs on {d} GPUs but the cost model allows no multi-GPU "
            "strategy; allow planner.strategies (tp or fsdp) or compare with min_gpu"
        )
    return options


def _one_after_another(packs: Sequence[Pack]) -> list[_Start]:
    now, started = 0.0, []
    for pack in packs:
        started.append(_Start(pack, now, tuple(range(pack.option.d))))
        now += pack.time
    return started


def baseline_plan(
    configs: Sequence[LoRAConfig],
    cost: CostModel,
    num_gpus: int,
    kind: Baseline | str,
    *,
    solver: str = "auto",
    objective: Objective = Objective.WORK,
) -> Plan:
    """The ``kind`` baseline schedule of ``configs`` on ``num_gpus`` GPUs.

    Raises:
        NoFeasibleJobError: a config fits no allowed GPU count.
        ConfigError: ``max_gpu``/``sequential`` with G > 1 and no multi-GPU strategy.
    """
    kind = Baseline(kind)
    table = build_classes(configs, cost, num_gpus, objective=objective)
    check_feasible(table, num_gpus)
    knap = KnapsackSolver(solver)
    if kind is Baseline.MIN_GPU:
        started = min_gpu_starts(table, num_gpus)
    elif kind is Baseline.MAX_GPU:
        options = _widest(table, num_gpus, kind)
        packs = []
        for c, members in enumerate(table.members):
            pack = _fastest_single(table, c, options)
            if pack is None:
                raise ConfigError(f"baseline max_gpu: config {members[0].config_id} does not fit")
            packs.extend([pack] * len(members))
        started = _one_after_another(packs)
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
        started = _one_after_another(packs)
    jobs = to_jobs(table, started)
    return Plan(
        jobs=jobs,
        num_configs=len(configs),
        num_gpus=num_gpus,
        makespan_s=max((j.end_s for j in jobs), default=0.0),
        lower_bound_s=lower_bound(table, num_gpus),
        ratio_bound=ratio_bound(jobs, num_gpus),
        solver=knap.name if kind is Baseline.SEQUENTIAL else "none",
        notes=(f"baseline {kind}",),
    )


__all__ = ["baseline_plan"]
