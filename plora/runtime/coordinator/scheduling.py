"""The coordinator's planning and launching decisions: plan / re-plan, dispatch, refill, refit.

Functions of the coordinator's state (:class:`~plora.runtime.coordinator.state.CoordinatorState`),
called from its event handlers:

* :func:`plan` packs the queued configs: ``plan_sweep`` for the first plan, then ``replan`` on
  the free GPUs and the resident groups, adopted only when the refit cost model predicts it
  faster than continuing the plan in force (:func:`plora.planner.guard.choose_plan`);
* :func:`dispatch` / :func:`launch` start forced jobs (retries, OOM halves, resumed jobs) and
  the plan's jobs whose GPUs are free;
* :func:`refill` gives a running job's free slots to queued configs that fit
  (:func:`plora.runtime.coordinator.refill.choose_refills`);
* :func:`refit` refits the cost model from every measurement; :func:`retime_running` re-predicts
  the running jobs' ends.

Each decision is logged as a :class:`~plora.runtime.records.DecisionRecord`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from plora.config import LoRAConfig
from plora.planner.guard import PlanChoice, PlanChoiceKind, choose_plan, continue_plan
from plora.planner.types import Job, Plan
from plora.runtime.coordinator import recording
from plora.runtime.coordinator.costs import (
    cost_strategy,
    describe_cost,
    job_memory,
    micro_kwargs,
    refit_cost,
    remaining_job_time,
)
from plora.runtime.coordinator.refill import choose_refills
from plora.runtime.coordinator.state import CoordinatorState, RunningJob
from plora.runtime.records import ConfigStatus, Decision, JobSpec, JobStatus
from plora.sweepdir import schema


def plan_held(state: CoordinatorState) -> bool:
    """Whether a due re-plan waits (:meth:`~.state.Pace.waits`) while the plan in force still
    has jobs to start on the GPUs that free up meanwhile."""
    return state.plans.count > 0 and bool(state.jobs.pending) and state.plans.pace.waits()


def plan(state: CoordinatorState, trigger: str) -> None:
    """Plan the queued configs (those of no forced job) and make that plan the one in force.

    The sweep's first plan is ``plan_sweep`` from now; every later one is ``replan`` on the free
    GPUs beside the running jobs and the groups still starting, adopted only when it beats the
    plan in force re-timed under the current cost model (a kept plan keeps its job ids). The
    plan goes to the sweep directory and the decision log with its trigger."""
    with state.plans.pace.timed():
        _plan(state, trigger)


def _plan(state: CoordinatorState, trigger: str) -> None:
    state.plans.due = False
    book, jobs = state.configs, state.jobs
    in_forced = jobs.forced_config_ids()
    remaining = [book.by_id[c] for c in book.queued_ids() if c not in in_forced]
    if not remaining:
        jobs.pending = []
        return
    now = state.now()
    starting = state.starting_idle()
    resident = sorted(state.residency.groups | {j.gpu_ids for j in starting})
    choice: PlanChoice | None = None
    if state.plans.count == 0 and not jobs.running and not starting:
        chosen = state.planner.plan_sweep(remaining, state.cost, state.num_gpus, resident=resident)
        kind = Decision.PLAN
        offset = now  # plan_sweep's timeline starts at 0
    else:
        running = [r.plan_job for r in jobs.running.values() if r.plan_job is not None]
        running += starting
        free = len(jobs.free_gpus) - sum(j.gpus for j in starting)
        candidate = state.planner.replan(
            remaining, free, running, now, state.cost, state.num_gpus, resident=resident
        )
        current = None
        if jobs.pending:  # the plan in force, re-timed under the current cost model
            current = continue_plan(jobs.pending, remaining, state.cost, state.num_gpus,
                                    now=now, running=running, free_gpus=free,
                                    resident=resident)  # fmt: skip
        chosen, choice = choose_plan(current, candidate)
        kind = Decision.PLAN if state.plans.count == 0 else Decision.REPLAN
        offset = 0.0
    kept = choice is not None and choice.kind is PlanChoiceKind.CURRENT
    jobs.pending = [
        j
        if kept
        else dataclasses.replace(
            j, job_id=jobs.new_job_id(), start_s=j.start_s + offset, end_s=j.end_s + offset
        )
        for j in sorted(chosen.jobs, key=lambda j: (j.start_s, j.job_id))
    ]
    index, plan_file = _write_plan(state, chosen, kind=kind, trigger=trigger, now=now)
    state.plans.count += 1
    state.plans.trigger = trigger
    config_ids, listed = _listed(kind, remaining, jobs.pending, named=plan_file is not None)
    state.decide(
        kind,
        config_ids=config_ids,
        trigger=trigger,
        plan_index=index,
        plan_file=plan_file,
        num_configs=len(remaining),
        num_jobs=len(jobs.pending),
        free_gpus=len(jobs.free_gpus),
        running_jobs=sorted(jobs.running),
        **listed,
        makespan_s=chosen.makespan_s,
        lower_bound_s=chosen.lower_bound_s,
        predicted_end_s=chosen.makespan_s + offset,
        resident_groups=[list(g) for g in resident],
        choice=choice.to_dict() if choice is not None else None,
        cost=describe_cost(state.cost),
    )


def _write_plan(
    state: CoordinatorState, chosen: Plan, *, kind: Decision, trigger: str, now: float
) -> tuple[int, str | None]:
    """Write the plan in force (its jobs as :attr:`JobBook.pending` holds them: ids and times on
    the sweep clock) to the sweep directory; returns its index there and its file, relative to
    the directory (None: no sweep directory)."""
    plan_dict = chosen.to_json_dict()
    plan_dict["jobs"] = [
        {**jd, "job_id": j.job_id, "start_s": j.start_s, "end_s": j.end_s}
        for jd, j in zip(
            sorted(plan_dict["jobs"], key=lambda d: (d["start_s"], d["job_id"])),
            state.jobs.pending,
            strict=True,
        )
    ]
    plan_dict.update(time_s=now, trigger=trigger, kind=str(kind))
    store = state.journal.store
    if store is None:
        return state.plans.count, None
    index = store.write_plan(plan_dict)
    return index, schema.plan_file(index)


def _listed(
    kind: Decision, remaining: list[LoRAConfig], pending: list[Job], *, named: bool
) -> tuple[list[str], dict[str, Any]]:
    """What a plan decision lists: the first plan's queued configs and jobs (the plan check
    reads them), a re-plan's only when no plan file holds them (no sweep directory). Listed at
    every re-plan they made ``decisions.jsonl`` quadratic in re-plans x queue: 103 of its
    110 MB at 10,000 configs, where they repeated ``plans/plan-NNN.json``."""
    if kind is Decision.REPLAN and named:
        return [], {}
    return [c.config_id for c in remaining], {"jobs": [_job_entry(j) for j in pending]}


def _job_entry(job: Job) -> dict[str, Any]:
    """A planned job as the decision log shows it (its micro-batches when it has some)."""
    return {"job_id": job.job_id, "config_ids": list(job.config_ids), "gpus": job.gpus,
            "micro_batches": job.micro_batches, "max_rows": job.max_rows}  # fmt: skip


def dispatch(state: CoordinatorState) -> list[JobSpec]:
    """Launch what the free GPUs take now: forced jobs first, then the plan's jobs in order
    (a planned job whose configs all left the queue is dropped)."""
    jobs, book = state.jobs, state.configs
    launches: list[JobSpec] = []
    for spec in list(jobs.forced):
        if spec.gpus <= len(jobs.free_gpus):
            jobs.forced.remove(spec)
            launches.append(launch(state, spec, plan_job=None))
    for job in list(jobs.pending):
        if job.gpus > len(jobs.free_gpus):
            continue
        live = [c for c in job.config_ids if book.status.get(c) is ConfigStatus.QUEUED]
        jobs.pending.remove(job)
        if not live:
            continue
        spec = JobSpec(
            job_id=job.job_id,
            configs=tuple(book.by_id[c] for c in live),
            gpus=job.gpus,
            strategy=str(job.strategy) if job.strategy is not None else None,
            max_rows=job.max_rows,
        )
        launches.append(launch(state, spec, plan_job=job))
    return launches


def launch(state: CoordinatorState, spec: JobSpec, *, plan_job: Job | None) -> JobSpec:
    """Give ``spec`` the lowest free GPUs and make it a running job; returns it with them.

    ``plan_job`` is the planner's job it came from; a forced job (None) gets one predicted by
    the cost model from now, so the re-plan and the ETA see it too."""
    jobs = state.jobs
    gpu_ids = tuple(sorted(jobs.free_gpus)[: spec.gpus])
    jobs.free_gpus.difference_update(gpu_ids)
    spec = dataclasses.replace(spec, gpu_ids=gpu_ids)
    now = state.now()
    if plan_job is None:
        s = cost_strategy(spec.gpus, spec.strategy)
        micro = micro_kwargs(state.cost, spec.micro_batches)  # a retried micro-batched job
        memory, _ = job_memory(state.cost, spec.configs, spec.gpus, spec.strategy, **micro)
        cost: Any = state.cost  # job_time takes micro_batches when the model prices them
        plan_job = Job(
            job_id=spec.job_id,
            config_ids=spec.config_ids,
            gpus=spec.gpus,
            strategy=None if spec.gpus == 1 else s,
            start_s=now,
            end_s=now + float(cost.job_time(list(spec.configs), spec.gpus, s, **micro)),
            memory_gib_per_gpu=memory / 2**30,
            gpu_ids=gpu_ids,
            micro_batches=spec.micro_batches,
            max_rows=spec.max_rows,
        )
    else:  # on a group still starting, the job begins when the group is ready
        begin = max(now, state.ready_at(gpu_ids))
        plan_job = dataclasses.replace(
            plan_job,
            config_ids=spec.config_ids,
            start_s=now,
            end_s=begin + max(plan_job.end_s - plan_job.start_s - plan_job.startup_s, 0.0),
            gpu_ids=gpu_ids,
        )
    for c in spec.config_ids:
        state.configs.status[c] = ConfigStatus.RUNNING
    jobs.attempts[spec.job_id] = spec.attempt
    run = RunningJob(
        spec=spec,
        plan_job=plan_job,
        config_ids=list(spec.config_ids),
        started_s=now,
        peak_pack=len(spec.configs),
    )
    jobs.running[spec.job_id] = run
    recording.record_job(state, run, status=JobStatus.RUNNING, end=None)
    state.decide(
        Decision.START_JOB,
        job_id=spec.job_id,
        config_ids=spec.config_ids,
        gpus=spec.gpus,
        gpu_ids=list(gpu_ids),
        attempt=spec.attempt,
        resume=spec.resume,
        free_gpus_after=len(jobs.free_gpus),
        planned_start_s=plan_job.start_s,
        planned_terms=planned_terms(state, spec),
    )
    return spec


def planned_terms(state: CoordinatorState, spec: JobSpec) -> dict[str, float]:
    """The cost model's seconds for ``spec`` on a warm group, by kind (``job_start_s``,
    ``train_s``, ``eval_s``, ``export_s``, ``checkpoint_s``): the start decision records them
    beside what ``jobs.parquet`` measures (none for a cost model without terms)."""
    job_terms = getattr(state.cost, "job_terms", None)
    if job_terms is None:
        return {}
    s = cost_strategy(spec.gpus, spec.strategy)
    micro = micro_kwargs(state.cost, spec.micro_batches)
    terms = job_terms(list(spec.configs), spec.gpus, s, **micro)
    return {f.name: round(float(getattr(terms, f.name)), 4) for f in dataclasses.fields(terms)}


@dataclasses.dataclass(slots=True)
class RefillQueue:
    """The queued configs of no forced job in the order refills take them: the plan's pending
    jobs' configs first, then the rest in arrival order.

    Built once for a round of polls (:meth:`Coordinator.poll_all`): building it is linear in the
    configs, and at 10,000 queued configs polled by 256 jobs each turn, building it at each poll
    with a free slot cost ~1.7 ms a poll (``benchmarks/control_plane.py`` on the H200 host,
    RESULTS.md). During the round configs only leave the queue (refills take them), so
    :meth:`configs` skips the ones no longer queued.

    Configs are grouped by the cost model's ``price_key`` (configs of a key fit a pack alike):
    :meth:`configs` merges the groups' heads in queue order and drops a group once its key is
    rejected, so a pack that most of the queue does not fit reads one config per key, not the
    whole queue (a linear scan per poll was 20 ms at 10,000 queued configs)."""

    groups: list[list[str]]
    """Config ids by key, each in queue order (a config of no key is a group of its own)."""
    keys: list[Hashable]
    position: dict[str, int]
    forced: set[str]
    heads: list[int]

    @classmethod
    def build(cls, state: CoordinatorState) -> RefillQueue:
        book, jobs = state.configs, state.jobs
        forced = jobs.forced_config_ids()
        waiting = [c for c in book.queued_ids() if c not in forced]  # in arrival order
        queued = set(waiting)
        planned = [c for job in jobs.pending for c in job.config_ids if c in queued]
        seen = set(planned)
        order = planned + [c for c in waiting if c not in seen]
        price_key = getattr(state.cost, "price_key", None)
        by_key: dict[Hashable, list[str]] = {}
        for c in order:
            key = price_key(book.by_id[c]) if price_key is not None else None
            by_key.setdefault(key if key is not None else ("config", c), []).append(c)
        position: dict[str, int] = {}
        for i, c in enumerate(order):
            position.setdefault(c, i)
        return cls(groups=list(by_key.values()), keys=list(by_key), position=position,
                   forced=forced, heads=[0] * len(by_key))  # fmt: skip

    def configs(
        self, state: CoordinatorState, rejected: set[Hashable] | None = None
    ) -> Iterator[LoRAConfig]:
        """The configs still queued, in order, lazily (a refill takes the first that fit),
        without those of a key in ``rejected`` (filled by the reader as it goes)."""
        book, position = state.configs, self.position
        rejected = set() if rejected is None else rejected

        def waiting(c: str) -> bool:
            return book.status.get(c) is ConfigStatus.QUEUED and c not in self.forced

        def next_waiting(ids: list[str], i: int) -> int:
            """The index of the first config of ``ids`` from ``i`` on still queued."""
            while i < len(ids) and not waiting(ids[i]):
                i += 1
            return i

        heap = []
        for g, ids in enumerate(self.groups):
            # configs only leave the queue in a round: the ones skipped are skipped for good
            self.heads[g] = i = next_waiting(ids, self.heads[g])
            if i < len(ids):
                heap.append((position[ids[i]], g, i))
        heapq.heapify(heap)
        while heap:
            _, g, i = heapq.heappop(heap)
            if self.keys[g] in rejected:
                continue
            ids = self.groups[g]
            if waiting(ids[i]):  # not taken since it was pushed
                yield book.by_id[ids[i]]
            if (j := next_waiting(ids, i + 1)) < len(ids):
                heapq.heappush(heap, (position[ids[j]], g, j))


def refill(
    state: CoordinatorState, run: RunningJob, queue: Callable[[], RefillQueue] | None = None
) -> None:
    """Fill slots finished configs left with queued configs that fit and end no later; a job
    never holds more than the pack it started with, nor more than ``planner.max_pack_size``.

    Asked at every poll of every running job: a full pack returns before the queue is looked
    at; ``queue`` gives the round's :class:`RefillQueue` (built here when None)."""
    book, jobs = state.configs, state.jobs
    active = [
        book.by_id[c]
        for c in run.config_ids
        if c not in book.stop_requests
        and book.status.get(c) is not ConfigStatus.PAUSED
        and book.progress.get(c, 0) < state.cost.steps(book.by_id[c])
    ]
    slots = (
        run.peak_pack if state.max_pack_size is None else min(run.peak_pack, state.max_pack_size)
    )
    if not active or len(active) >= slots:  # no free slot (choose_refills' own test)
        return
    order = queue() if queue is not None else RefillQueue.build(state)
    rejected: set[Hashable] = set()  # keys choose_refills found not to fit: the queue skips them
    picks = choose_refills(
        active=active,
        queued=order.configs(state, rejected),  # in the plan's order
        rejected_keys=rejected,
        slots=slots,
        progress=book.progress,
        cost=state.cost,
        gpus=run.spec.gpus,
        strategy=run.spec.strategy,
        may_extend=not jobs.free_gpus,
    )
    for pick in picks:
        cid = pick.config_id
        jobs.drop_config(cid)
        book.status[cid] = ConfigStatus.RUNNING
        if cid not in run.config_ids:  # a paused config may rejoin the job it left
            run.config_ids.append(cid)
        run.add_pending.append(cid)
        if run.plan_job is not None:
            run.plan_job = dataclasses.replace(run.plan_job, config_ids=tuple(run.config_ids))
        state.decide(
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
            more = float(state.cost.job_time([book.by_id[cid]], run.spec.gpus, strategy))
            end = max(run.plan_job.end_s, state.now() + more)
            run.plan_job = dataclasses.replace(run.plan_job, end_s=end)
    if picks:
        recording.persist(state)


def refit(state: CoordinatorState, *, job_id: str, trigger: str, paced: bool = False) -> None:
    """Refit the cost model from every measurement so far (steps, then overheads); ``paced``
    (a job end): not while the last refit's pace says wait (:class:`~.state.Pace`) -- it reads
    every measurement, so it grows with the jobs done, and a later job end refits from them
    all."""
    if paced and state.refit_pace.waits():
        return
    before = describe_cost(state.cost)
    with state.refit_pace.timed():
        new, report = refit_cost(state.cost, state.measure.steps, state.configs.by_id)
        refit_overheads = getattr(new if new is not None else state.cost, "refit_overheads", None)
        if callable(refit_overheads) and state.measure.overheads:
            new = refit_overheads(state.measure.overheads)
    if new is None:
        return
    state.cost = new
    retime_running(state)
    state.decide(
        Decision.REFIT,
        job_id=job_id,
        trigger=trigger,
        measured_jobs=len({m["job_id"] for m in state.measure.steps}),  # ids: O(jobs) a refit
        report=report,
        cost_before=before,
        cost_after=describe_cost(state.cost),
    )
    state.plans.due = True


def retime_running(state: CoordinatorState, runs: Iterable[RunningJob] | None = None) -> None:
    """Predicted ends of the running jobs (``runs``: only these, whose end alone changed) from
    the current cost model and their progress (what the re-plan and the ETA build on)."""
    now = state.now()
    book = state.configs
    for run in state.jobs.running.values() if runs is None else runs:
        if run.plan_job is None:
            continue
        live = [
            book.by_id[c]
            for c in run.config_ids
            if book.status.get(c) is ConfigStatus.RUNNING and c not in run.stop_sent
        ]
        left = remaining_job_time(
            state.cost, live, book.progress, run.spec.gpus, run.spec.strategy,
            micro_batches=run.spec.micro_batches,
        )  # fmt: skip
        begin = max(now, state.ready_at(run.spec.gpu_ids))
        run.plan_job = dataclasses.replace(run.plan_job, end_s=begin + left)


__all__ = [
    "RefillQueue",
    "dispatch",
    "launch",
    "plan",
    "plan_held",
    "planned_terms",
    "refill",
    "refit",
    "retime_running",
]
