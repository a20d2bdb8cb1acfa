"""The coordinator's planning and launching decisions: plan / re-plan, dispatch, refill, refit.

Functions of a :class:`~plora.runtime.coordinator_state.CoordinatorState` (the coordinator
itself), called from its event handlers:

* :func:`plan` packs the queued configs: ``plan_sweep`` for the first plan, then ``replan`` on
  the free GPUs and the resident groups, adopted only when the refit cost model predicts it
  faster than continuing the plan in force (:func:`plora.planner.guard.choose_plan`);
* :func:`dispatch` / :func:`launch` start forced jobs (retries, OOM halves, resumed jobs) and
  the plan's jobs whose GPUs are free;
* :func:`refill` gives a running job's free slots to queued configs that fit
  (:func:`plora.runtime.refill.choose_refills`);
* :func:`refit` refits the cost model from every measurement; :func:`retime_running` re-predicts
  the running jobs' ends.

Each decision is logged as a :class:`~plora.runtime.records.DecisionRecord`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from plora.planner.guard import PlanChoiceKind, choose_plan, continue_plan
from plora.runtime.coordinator_state import CoordinatorState, RunningJob
from plora.runtime.costs import (
    cost_strategy,
    describe_cost,
    job_memory,
    micro_kwargs,
    refit_cost,
    remaining_job_time,
)
from plora.runtime.records import ConfigStatus, Decision, JobSpec, JobStatus
from plora.runtime.refill import choose_refills


def plan(coord: CoordinatorState, trigger: str) -> None:
    coord._need_plan = False
    in_forced = {c for s in coord.forced for c in s.config_ids}
    remaining = [coord.configs[c] for c in coord.queued_ids() if c not in in_forced]
    if not remaining:
        coord.pending = []
        return
    now = coord.now()
    starting = coord._starting_idle()
    resident = sorted(coord.residency.groups | {j.gpu_ids for j in starting})
    choice = None
    if coord._plans == 0 and not coord.running and not starting:
        plan = coord.planner.plan_sweep(remaining, coord.cost, coord.num_gpus, resident=resident)
        kind = Decision.PLAN
        offset = now  # plan_sweep's timeline starts at 0
    else:
        running = [r.plan_job for r in coord.running.values() if r.plan_job is not None]
        running += starting
        free = len(coord.free_gpus) - sum(j.gpus for j in starting)
        candidate = coord.planner.replan(
            remaining, free, running, now, coord.cost, coord.num_gpus, resident=resident
        )
        current = None
        if coord.pending:  # the plan in force, re-timed under the current cost model
            current = continue_plan(coord.pending, remaining, coord.cost, coord.num_gpus,
                                    now=now, running=running, free_gpus=free,
                                    resident=resident)  # fmt: skip
        plan, choice = choose_plan(current, candidate)
        kind = Decision.PLAN if coord._plans == 0 else Decision.REPLAN
        offset = 0.0
    kept = choice is not None and choice.kind is PlanChoiceKind.CURRENT
    jobs = [
        j
        if kept
        else dataclasses.replace(
            j, job_id=coord._new_job_id(), start_s=j.start_s + offset, end_s=j.end_s + offset
        )
        for j in sorted(plan.jobs, key=lambda j: (j.start_s, j.job_id))
    ]
    coord.pending = jobs
    plan_dict = plan.to_json_dict()
    plan_dict["jobs"] = [
        {**jd, "job_id": j.job_id, "start_s": j.start_s, "end_s": j.end_s}
        for jd, j in zip(
            sorted(plan_dict["jobs"], key=lambda d: (d["start_s"], d["job_id"])),
            jobs,
            strict=True,
        )
    ]
    plan_dict.update(time_s=now, trigger=trigger, kind=str(kind))
    index = coord.store.write_plan(plan_dict) if coord.store is not None else coord._plans
    coord._plans += 1
    coord._plan_trigger = trigger
    coord._decide(
        kind,
        config_ids=[c.config_id for c in remaining],
        trigger=trigger,
        plan_index=index,
        free_gpus=len(coord.free_gpus),
        running_jobs=sorted(coord.running),
        jobs=[_job_entry(j) for j in jobs],
        makespan_s=plan.makespan_s,
        lower_bound_s=plan.lower_bound_s,
        predicted_end_s=plan.makespan_s + offset,
        resident_groups=[list(g) for g in resident],
        choice=choice.to_dict() if choice is not None else None,
        cost=describe_cost(coord.cost),
    )


def _job_entry(job: Any) -> dict[str, Any]:
    """A planned job as the decision log shows it (its micro-batches when it has some)."""
    return {"job_id": job.job_id, "config_ids": list(job.config_ids), "gpus": job.gpus,
            "micro_batches": job.micro_batches, "max_rows": job.max_rows}  # fmt: skip


def dispatch(coord: CoordinatorState) -> list[JobSpec]:
    launches: list[JobSpec] = []
    for spec in list(coord.forced):
        if spec.gpus <= len(coord.free_gpus):
            coord.forced.remove(spec)
            launches.append(launch(coord, spec, plan_job=None))
    for job in list(coord.pending):
        if job.gpus > len(coord.free_gpus):
            continue
        live = [c for c in job.config_ids if coord.status.get(c) is ConfigStatus.QUEUED]
        coord.pending.remove(job)
        if not live:
            continue
        strategy = getattr(job, "strategy", None)
        spec = JobSpec(
            job_id=job.job_id,
            configs=tuple(coord.configs[c] for c in live),
            gpus=job.gpus,
            strategy=str(strategy) if strategy is not None else None,
            max_rows=getattr(job, "max_rows", None),
        )
        launches.append(launch(coord, spec, plan_job=job))
    return launches


def launch(coord: CoordinatorState, spec: JobSpec, *, plan_job: Any) -> JobSpec:
    gpu_ids = tuple(sorted(coord.free_gpus)[: spec.gpus])
    coord.free_gpus.difference_update(gpu_ids)
    spec = dataclasses.replace(spec, gpu_ids=gpu_ids)
    now = coord.now()
    if plan_job is None:
        from plora.planner import Job

        s = cost_strategy(spec.gpus, spec.strategy)
        micro = micro_kwargs(coord.cost, spec.micro_batches)  # a retried micro-batched job
        memory, _ = job_memory(coord.cost, spec.configs, spec.gpus, spec.strategy, **micro)
        plan_job = Job(
            job_id=spec.job_id,
            config_ids=spec.config_ids,
            gpus=spec.gpus,
            strategy=None if spec.gpus == 1 else s,
            start_s=now,
            end_s=now + float(coord.cost.job_time(list(spec.configs), spec.gpus, s, **micro)),
            memory_gib_per_gpu=memory / 2**30,
            gpu_ids=gpu_ids,
            micro_batches=spec.micro_batches,
            max_rows=spec.max_rows,
        )
    else:  # on a group still starting, the job begins when the group is ready
        begin = max(now, coord._ready_at(gpu_ids))
        plan_job = dataclasses.replace(
            plan_job,
            config_ids=spec.config_ids,
            start_s=now,
            end_s=begin + max(plan_job.end_s - plan_job.start_s - plan_job.startup_s, 0.0),
            gpu_ids=gpu_ids,
        )
    for c in spec.config_ids:
        coord.status[c] = ConfigStatus.RUNNING
    coord._attempts[spec.job_id] = spec.attempt
    coord.running[spec.job_id] = RunningJob(
        spec=spec,
        plan_job=plan_job,
        config_ids=list(spec.config_ids),
        started_s=now,
        peak_pack=len(spec.configs),
    )
    coord._job_row(coord.running[spec.job_id], status=JobStatus.RUNNING, end=None)
    coord._decide(
        Decision.START_JOB,
        job_id=spec.job_id,
        config_ids=spec.config_ids,
        gpus=spec.gpus,
        gpu_ids=list(gpu_ids),
        attempt=spec.attempt,
        resume=spec.resume,
        free_gpus_after=len(coord.free_gpus),
        planned_start_s=getattr(plan_job, "start_s", None),
        planned_terms=planned_terms(coord, spec),
    )
    return spec


def planned_terms(coord: CoordinatorState, spec: JobSpec) -> dict[str, float]:
    """The cost model's seconds for ``spec`` on a warm group, by kind (``job_start_s``,
    ``train_s``, ``eval_s``, ``export_s``, ``checkpoint_s``): the start decision records them
    beside what ``jobs.parquet`` measures (none for a cost model without terms)."""
    if not hasattr(coord.cost, "job_terms"):
        return {}
    s = cost_strategy(spec.gpus, spec.strategy)
    micro = micro_kwargs(coord.cost, spec.micro_batches)
    terms = coord.cost.job_terms(list(spec.configs), spec.gpus, s, **micro)
    return {f.name: round(float(getattr(terms, f.name)), 4) for f in dataclasses.fields(terms)}


def refill(coord: CoordinatorState, run: RunningJob) -> None:
    """Fill slots finished configs left with queued configs that fit and end no later.

    Asked at every poll of every running job: a full pack returns before the queue is looked
    at, and the queue's order is built in time linear in the configs (a sweep of 10,000 queued
    configs polled by 256 jobs, ``benchmarks/control_plane.py``)."""
    active = [
        coord.configs[c]
        for c in run.config_ids
        if c not in coord._stop_requests
        and coord.status.get(c) is not ConfigStatus.PAUSED
        and coord.progress.get(c, 0) < coord.cost.steps(coord.configs[c])
    ]
    if not active or len(active) >= run.peak_pack:  # no free slot (choose_refills' own test)
        return
    in_forced = {c for s in coord.forced for c in s.config_ids}
    queued_ids = coord.queued_ids()
    queued = set(queued_ids) - in_forced
    planned = [c for job in coord.pending for c in job.config_ids if c in queued]
    seen = set(planned)
    order = planned + [c for c in queued_ids if c in queued and c not in seen]
    picks = choose_refills(
        active=active,
        queued=[coord.configs[c] for c in order],  # in the plan's order
        slots=run.peak_pack,
        progress=coord.progress,
        cost=coord.cost,
        gpus=run.spec.gpus,
        strategy=run.spec.strategy,
        may_extend=not coord.free_gpus,
    )
    for pick in picks:
        cid = pick.config_id
        drop_from_plan(coord, cid)
        coord.status[cid] = ConfigStatus.RUNNING
        if cid not in run.config_ids:  # a paused config may rejoin the job it left
            run.config_ids.append(cid)
        run.add_pending.append(cid)
        if run.plan_job is not None:
            run.plan_job = dataclasses.replace(run.plan_job, config_ids=tuple(run.config_ids))
        coord._decide(
            Decision.REFILL,
            job_id=run.spec.job_id,
            config_ids=[cid],
            memory_bytes=pick.memory_bytes,
            capacity_bytes=pick.capacity_bytes,
            steps=pick.steps,
            steps_left_in_job=pick.steps_left,
            extends_job=pick.extends_job,
            pack=[c.config_id for c in active] + [p.config_id for p in picks],
        )
        if pick.extends_job and run.plan_job is not None:
            strategy = cost_strategy(run.spec.gpus, run.spec.strategy)
            more = float(coord.cost.job_time([coord.configs[cid]], run.spec.gpus, strategy))
            end = max(run.plan_job.end_s, coord.now() + more)
            run.plan_job = dataclasses.replace(run.plan_job, end_s=end)
    if picks:
        coord._persist()


def drop_from_plan(coord: CoordinatorState, config_id: str) -> None:
    for i, job in enumerate(coord.pending):
        if config_id in job.config_ids:
            rest = tuple(c for c in job.config_ids if c != config_id)
            coord.pending[i] = dataclasses.replace(job, config_ids=rest)
    coord.pending = [j for j in coord.pending if j.config_ids]


def refit(coord: CoordinatorState, *, job_id: str, trigger: str) -> None:
    """Refit the cost model from every measurement so far (steps, then overheads)."""
    before = describe_cost(coord.cost)
    new, report = refit_cost(coord.cost, coord.measure.steps, coord.configs)
    refit_overheads = getattr(new if new is not None else coord.cost, "refit_overheads", None)
    if callable(refit_overheads) and coord.measure.overheads:
        new = refit_overheads(coord.measure.overheads)
    if new is None:
        return
    coord.cost = new
    retime_running(coord)
    coord._decide(
        Decision.REFIT,
        job_id=job_id,
        trigger=trigger,
        measured_jobs=sorted({m["job_id"] for m in coord.measure.steps}),
        report=report,
        cost_before=before,
        cost_after=describe_cost(coord.cost),
    )
    coord._need_plan = True


def retime_running(coord: CoordinatorState) -> None:
    """Predicted ends of the running jobs from the current cost model and their progress
    (what the re-plan and the ETA build on)."""
    now = coord.now()
    for run in coord.running.values():
        if run.plan_job is None:
            continue
        live = [
            coord.configs[c]
            for c in run.config_ids
            if coord.status.get(c) is ConfigStatus.RUNNING and c not in run.stop_sent
        ]
        left = remaining_job_time(
            coord.cost, live, coord.progress, run.spec.gpus, run.spec.strategy,
            micro_batches=run.spec.micro_batches,
        )  # fmt: skip
        begin = max(now, coord._ready_at(run.spec.gpu_ids))
        run.plan_job = dataclasses.replace(run.plan_job, end_s=begin + left)


__all__ = [
    "dispatch",
    "drop_from_plan",
    "launch",
    "plan",
    "refill",
    "refit",
    "retime_running",
]
