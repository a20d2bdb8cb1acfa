"""The re-plan guard: never adopt a re-plan that the cost model predicts slower than continuing.

The runtime re-plans when GPUs free up or the cost model is refit. A re-plan is not free: it
may rebuild resident worker groups at another ``d`` or split packs into more jobs, each paying
its start. So the runtime compares, under its *current* cost model, two predictions of the
configs left:

* :func:`continue_plan` -- the pending jobs of the plan in force, re-timed: list-scheduled in
  plan order the way the coordinator dispatches them (a job starts as soon as enough GPUs are
  free, on a resident group of its size when one is free, else paying ``startup_time(d)``),
  with running jobs holding their GPUs until their predicted ends;
* the candidate from :func:`plora.planner.replan` on the same configs, running jobs and groups;

and :func:`choose_plan` keeps the one of least predicted makespan, with a :class:`PlanChoice`
that records both makespans and why. With ``min_gain = 0`` the chosen plan's makespan is never
above the other's (ties keep the current plan: no churn for nothing).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from plora.config import LoRAConfig
from plora.cost import CostModel
from plora.planner.bounds import ratio_bound
from plora.planner.groups import Groups, startup_times
from plora.planner.ilp import build_classes
from plora.planner.schedule import _busy, _lower_bound
from plora.planner.types import GIB, Job, Plan, call_strategy


class PlanChoiceKind(StrEnum):
    """Which plan :func:`choose_plan` kept."""

    CURRENT = "current"
    """Continue the plan in force."""
    CANDIDATE = "candidate"
    """Adopt the re-plan."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanChoice:
    """The guard's decision, with what it compared (for the coordinator's decision log)."""

    kind: PlanChoiceKind
    current_makespan_s: float | None
    """Predicted makespan of continuing as planned (None: no plan in force)."""
    candidate_makespan_s: float
    """Predicted makespan of the re-plan."""
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict."""
        return {
            "kind": str(self.kind),
            "current_makespan_s": self.current_makespan_s,
            "candidate_makespan_s": self.candidate_makespan_s,
            "reason": self.reason,
        }


def _covered(plan: Plan) -> list[str]:
    return sorted(c for job in plan.jobs for c in job.config_ids)


def choose_plan(
    current: Plan | None, candidate: Plan, *, min_gain: float = 0.0
) -> tuple[Plan, PlanChoice]:
    """The plan to follow: ``candidate`` only when it is predicted faster than ``current``.

    Args:
        current: the plan in force, timed under the current cost model (e.g.
            :func:`continue_plan`); None when there is none.
        candidate: the re-plan of the same configs (:func:`plora.planner.replan`).
        min_gain: adopt the candidate only if it saves at least this fraction of the current
            makespan (0: any saving).

    Returns:
        ``(plan, choice)``. When both plans cover the same configs and ``min_gain = 0``, the
        chosen plan's makespan is at most the other's. A current plan that covers other
        configs than the candidate (configs arrived or left since) cannot be continued: the
        candidate is chosen and the reason says so.
    """
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"choose_plan: min_gain={min_gain} must be in [0, 1)")
    cand = candidate.makespan_s
    if current is None:
        return candidate, PlanChoice(
            kind=PlanChoiceKind.CANDIDATE, current_makespan_s=None, candidate_makespan_s=cand,
            reason="no plan in force",
        )  # fmt: skip
    cur = current.makespan_s
    have, want = _covered(current), _covered(candidate)
    if have != want:
        missing, extra = len(set(want) - set(have)), len(set(have) - set(want))
        return candidate, PlanChoice(
            kind=PlanChoiceKind.CANDIDATE, current_makespan_s=cur, candidate_makespan_s=cand,
            reason=f"the plan in force covers other configs ({missing} missing, {extra} extra): "
            "it cannot be continued",
        )  # fmt: skip
    if cand < cur * (1.0 - min_gain):
        return candidate, PlanChoice(
            kind=PlanChoiceKind.CANDIDATE, current_makespan_s=cur, candidate_makespan_s=cand,
            reason=f"re-plan predicted faster: {cand:.6g} s vs {cur:.6g} s as planned",
        )  # fmt: skip
    return current, PlanChoice(
        kind=PlanChoiceKind.CURRENT, current_makespan_s=cur, candidate_makespan_s=cand,
        reason=f"re-plan predicted no faster: {cand:.6g} s vs {cur:.6g} s as planned"
        + (f" (needs {min_gain:.0%} less)" if min_gain else ""),
    )  # fmt: skip


def continue_plan(
    pending: Sequence[Job],
    remaining: Sequence[LoRAConfig],
    cost: CostModel,
    num_gpus: int,
    *,
    now: float = 0.0,
    running: Sequence[Job] = (),
    free_gpus: int | None = None,
    resident: Sequence[Sequence[int]] | None = None,
) -> Plan:
    """The plan in force, from ``now`` on, re-timed under ``cost``.

    Args:
        pending: the plan's jobs not started yet (their order is the dispatch order; configs
            not in ``remaining`` are dropped, and jobs left empty).
        remaining: the configs still to run (those the re-plan would plan).
        cost: the current cost model.
        num_gpus: G.
        now: current time on the plan's clock.
        running: jobs running now (their GPUs are held until ``max(end_s, now)``).
        free_gpus: GPUs free now (default: those no running job holds), as in ``replan``.
        resident: resident worker groups now, as in ``replan`` (None: no start-up charged).

    Returns:
        A :class:`Plan` of the pending jobs with predicted start, start-up and end;
        ``makespan_s`` includes the running jobs' ends.
    """
    by_id = {c.config_id: c for c in remaining}
    queue = [
        (job, tuple(c for c in job.config_ids if c in by_id))
        for job in sorted(pending, key=lambda j: (j.start_s, j.job_id))
    ]
    queue = [(job, ids) for job, ids in queue if ids]
    too_wide = next((job for job, _ in queue if job.gpus > num_gpus), None)
    if too_wide is not None:
        raise ValueError(f"job {too_wide.job_id}: {too_wide.gpus} GPUs > num_gpus={num_gpus}")
    if free_gpus is None:
        free_gpus = max(num_gpus - sum(j.gpus for j in running), 0)
    busy = _busy(running, free_gpus, now, num_gpus)
    degrees = [1] + [job.gpus for job, _ in queue]
    groups = Groups(num_gpus, startup_times(cost, degrees), resident)
    if groups.track:
        for _, held_ids in busy[: len(running)]:
            groups.set(held_ids)
    covered = [by_id[c] for _, ids in queue for c in ids]
    if covered:
        table = build_classes(covered, cost, num_gpus)
        lb = _lower_bound(table, num_gpus, now, busy, groups)
    else:
        lb = max([now] + [end for end, _ in busy])
    held = {g for _, ids in busy for g in ids}
    free = [g for g in range(num_gpus) if g not in held]
    events = list(busy)
    heapq.heapify(events)
    t, jobs = now, []
    while queue:
        for job, ids in list(queue):
            if job.gpus > len(free):
                continue
            gpu_ids = groups.allocate(free, job.gpus)
            wait = groups.occupy(gpu_ids)
            s = call_strategy(job.gpus, job.strategy)
            pack = [by_id[c] for c in ids]
            micro = {"micro_batches": job.micro_batches} if job.micro_batches > 1 else {}
            if micro:  # the job keeps its micro-batches (only a micro-batching model plans them)
                mem = float(cost.pack_memory(pack, job.gpus, s, **micro))  # type: ignore[attr-defined]
            else:
                mem = cost.base_memory(job.gpus, s) + sum(
                    cost.config_memory(k, job.gpus, s) for k in pack
                )
            end = t + wait + float(cost.job_time(pack, job.gpus, s, **micro))
            jobs.append(Job(job_id=job.job_id, config_ids=ids, gpus=job.gpus, strategy=job.strategy,
                            start_s=t, end_s=end, memory_gib_per_gpu=mem / GIB, gpu_ids=gpu_ids,
                            startup_s=wait, micro_batches=job.micro_batches,
                            max_rows=job.max_rows))  # fmt: skip
            heapq.heappush(events, (end, gpu_ids))
            queue.remove((job, ids))
        if queue:
            t, freed = heapq.heappop(events)
            free.extend(freed)
            while events and events[0][0] <= t:
                free.extend(heapq.heappop(events)[1])
            free.sort()
    makespan = max([j.end_s for j in jobs] + [end for end, _ in busy] + [now])
    return Plan(
        jobs=tuple(sorted(jobs, key=lambda j: (j.start_s, j.gpu_ids))),
        num_configs=len(covered),
        num_gpus=num_gpus,
        makespan_s=makespan,
        lower_bound_s=lb,
        ratio_bound=ratio_bound(jobs, num_gpus, origin=now) if jobs else 1.0,
        solver="none",
        notes=("the plan in force, re-timed",),
    )


__all__ = ["PlanChoice", "PlanChoiceKind", "choose_plan", "continue_plan"]
