"""The coordinator: config queue, plan, free GPUs, running jobs, decisions (paper Fig. 3).

:class:`Coordinator` is a plain, event-driven state machine: the driver (or a test) feeds it
events -- :meth:`~Coordinator.start`, :meth:`~Coordinator.on_reports`,
:meth:`~Coordinator.on_job_finished`, :meth:`~Coordinator.on_job_failed`,
:meth:`~Coordinator.stop_config` -- and each returns the :class:`JobSpec` s to launch now.
:meth:`~Coordinator.poll` gives a running job its control (stop one adapter, refill a free
slot). It does no Ray calls: it runs in the driver (:mod:`plora.runtime.driver`), next to the sweep
directory it writes, and workers reach it through the named relay actor
:class:`plora.runtime.actors.relay.CoordinatorActor` (metrics in, control out).

Resident workers. The driver keeps one worker group per GPU that loaded the base model once
(:meth:`~Coordinator.on_group_started` / :meth:`~Coordinator.on_group_ready`); jobs are entries
of the plan run on them. While configs are queued and no GPU is idle, a config that ends frees
its slot for the next queued config in plan order (:func:`plora.runtime.coordinator.refill.choose_refills`),
even if that makes the job run on: on a resident worker that is a next job without the wait.

Online re-planning. A few steps into the first job (calibration) and whenever GPUs are freed (a
job ended, died or ran out of memory) the cost model is refit from every measurement so far
(streamed step times and peak memory; worker start, model load, evaluation and export seconds)
and the remaining configs are re-planned with ``plora.planner.replan`` on the free GPUs and
the resident groups. The re-plan is adopted only when the refit model predicts it faster than
continuing the plan in force (:func:`plora.planner.guard.choose_plan`); the ``replan`` record
holds both predictions. Every
decision is a :class:`DecisionRecord` with its inputs -- e.g. a ``refit`` record holds the cost
model's coefficients before and after -- appended to ``decisions.jsonl``.

State. The state is one :class:`~plora.runtime.coordinator.state.CoordinatorState` (a few
typed books: configs, jobs, plans, the journal, measurements, resident groups, pauses); the
handlers of this package receive it. ARCHITECTURE.md ("A job's life") says which holds what.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from plora.config import LoRAConfig
from plora.cost import CostModel
from plora.engine.api import Control, PackOutcome, StepReport
from plora.runtime.coordinator import (
    endings,
    intake,
    pause,
    recording,
    resume,
    scheduling,
    view,
)
from plora.runtime.coordinator.ledger import metric_rows, tell_metrics
from plora.runtime.coordinator.measure import Measurements
from plora.runtime.coordinator.pause import ConfigRequest, RequestKind
from plora.runtime.coordinator.state import (
    FINISHED,
    CoordinatorState,
    JobBook,
    Journal,
    Planner,
    RunningJob,
    StepStopper,
    SweepClock,
)
from plora.runtime.records import (
    ConfigSource,
    ConfigStatus,
    Decision,
    DecisionRecord,
    FailureKind,
    JobSpec,
    JobStatus,
    StaticSource,
)
from plora.sweepdir.store import SweepStore


class Coordinator:
    """Plans, launches, watches and re-plans the jobs of one sweep.

    Args:
        cost: A :class:`plora.cost.CostModel` (with ``refit(measurements)`` for online refits).
        num_gpus: G, the GPUs the sweep may use at once.
        source: Where configs come from (the searcher bridge); or pass ``configs``.
        configs: A fixed list of configs (wrapped in :class:`StaticSource`).
        planner: A namespace with ``plan_sweep`` and ``replan`` (default ``plora.planner``).
        store: The sweep directory to log decisions/plans/jobs/results/metrics/state into.
        clock: Seconds since an arbitrary origin (default ``time.monotonic``).
        max_retries: Restarts of a job whose worker died, before its configs fail.
        refill: Let queued configs join running jobs in slots finished configs left.
        max_pack_size: Most configs a job may train at once (``planner.max_pack_size``; None:
            the pack size the planner chose): a refill never grows a job beyond it. Pass the
            same cap to the planner (:class:`plora.planner.options.SweepPlanner`).
        ask_batch: Most configs requested from the source at a time (default: all it gives, so
            the planner sees every config before it packs; adaptive searchers bound themselves).
        metric_name: The dataset's metric name, added to what the searcher is told.
        calibration_steps: Measured steps (after each job's first) of the first job after which
            the cost model is refit and the remaining configs re-planned (0: only at job ends).
        early_stop: Early stopping (``early_stop:``; :class:`plora.tune.adapter_stopper.AdapterEarlyStopper`):
            told every streamed step, it names configs to stop inside their packs.
    """

    def __init__(
        self,
        *,
        cost: CostModel,
        num_gpus: int,
        source: ConfigSource | None = None,
        configs: Sequence[LoRAConfig] | None = None,
        planner: Planner | None = None,
        store: SweepStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_retries: int = 2,
        refill: bool = True,
        max_pack_size: int | None = None,
        ask_batch: int | None = None,
        metric_name: str | None = None,
        metrics_flush_s: float = 5.0,
        calibration_steps: int = 3,
        early_stop: StepStopper | None = None,
    ) -> None:
        if (source is None) == (configs is None):
            raise ValueError("pass exactly one of source and configs")
        if num_gpus < 1:
            raise ValueError(f"num_gpus={num_gpus} must be >= 1")
        self.state = CoordinatorState(
            cost=cost,
            planner=planner or cast(Planner, importlib.import_module("plora.planner")),
            source=source if source is not None else StaticSource(configs or ()),
            num_gpus=num_gpus,
            clock=SweepClock(clock),
            early_stop=early_stop,
            max_retries=max_retries,
            refill=refill,
            max_pack_size=max_pack_size,
            ask_batch=ask_batch or (1 << 30),
            metric_name=metric_name,
            jobs=JobBook(free_gpus=set(range(num_gpus))),
            journal=Journal(store=store, flush_s=metrics_flush_s),
            measure=Measurements(calibration_steps=calibration_steps),
        )
        """Everything the coordinator knows (:class:`~.state.CoordinatorState`)."""

    # -- the state, as drivers, displays and tests read it ----------------------------------
    @property
    def cost(self) -> CostModel:
        """The cost model in force (replaced by each refit)."""
        return self.state.cost

    @cost.setter
    def cost(self, value: CostModel) -> None:
        self.state.cost = value

    @property
    def planner(self) -> Planner:
        return self.state.planner

    @planner.setter
    def planner(self, value: Planner) -> None:
        self.state.planner = value

    @property
    def source(self) -> ConfigSource:
        return self.state.source

    @property
    def configs(self) -> dict[str, LoRAConfig]:
        return self.state.configs.by_id

    @property
    def status(self) -> dict[str, ConfigStatus]:
        return self.state.configs.status

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return self.state.configs.results

    @property
    def running(self) -> dict[str, RunningJob]:
        return self.state.jobs.running

    @property
    def decisions(self) -> list[DecisionRecord]:
        return self.state.journal.decisions

    @property
    def job_rows(self) -> list[dict[str, Any]]:
        return self.state.journal.job_rows

    @property
    def measure(self) -> Measurements:
        return self.state.measure

    # -- queries ----------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the sweep started (continues across ``--resume``)."""
        return self.state.now()

    def queued_ids(self) -> list[str]:
        """Configs waiting for a job, in arrival order."""
        return self.state.configs.queued_ids()

    def is_done(self) -> bool:
        """True when the searcher is finished and every config is done, stopped or failed."""
        return self.state.is_done()

    def counts(self) -> dict[str, int]:
        """Number of configs per :class:`ConfigStatus`, plus running jobs and busy GPUs."""
        return view.counts(self.state)

    def snapshot(self) -> dict[str, Any]:
        """A small JSON-able view for the progress display (:func:`.view.snapshot`)."""
        return view.snapshot(self.state)

    # -- events -----------------------------------------------------------------------------
    def start(self) -> list[JobSpec]:
        """First event: ask the searcher, plan, and return the jobs to launch."""
        return self._schedule(trigger="start")

    def tick(self) -> list[JobSpec]:
        """Nothing ended, nothing runs (or a re-plan was held back): ask a waiting searcher
        again, plan if due, and launch what comes of it."""
        return self._schedule(trigger="tick")

    def plan_held(self) -> bool:
        """Whether a due re-plan is held back (:func:`.scheduling.plan_held`): the driver calls
        :meth:`tick` while jobs run, and it plans once the wait is over."""
        return bool(self.state.plans.held)

    def on_job_started(self, job_id: str, *, node: str | None = None) -> None:
        """The driver placed the job's workers (``node``: where, for jobs.parquet)."""
        run = self.state.jobs.running.get(job_id)
        if run is not None:
            run.node = node
            recording.record_job(self.state, run, status=JobStatus.RUNNING, end=None)

    def on_reports(self, job_id: str, reports: Sequence[StepReport]) -> list[JobSpec]:
        """Step reports streamed from a running job's worker: per-adapter metrics (to
        ``metrics.parquet``, progress) and the step's measurements. Once enough steps are
        measured the cost model is refit and the queue re-planned (calibration); returns the
        jobs that re-plan launches (usually none: the GPUs are busy)."""
        st = self.state
        now = st.now()
        attempt = st.jobs.attempts.get(job_id, 0)
        out = [row for r in reports for row in metric_rows(job_id, r, now, attempt=attempt)]
        recording.note_redone(st, job_id, out)
        progress = st.configs.progress
        for r in out:
            progress[r["config_id"]] = max(progress.get(r["config_id"], 0), r["step"])
        if st.early_stop is not None:
            for r in out:
                if r["loss"] is not None and st.early_stop.on_step(
                    r["config_id"], r["step"], r["loss"]
                ):
                    self.stop_config(r["config_id"], reason="early_stop", step=r["step"])
        recording.record_metrics(st, out, now=now)
        run = st.jobs.running.get(job_id)
        if run is None or not reports:
            return []
        if st.measure.add_reports(job_id, reports, gpus=run.spec.gpus, strategy=run.spec.strategy):
            scheduling.refit(st, job_id=job_id, trigger="calibration")
            if st.plans.due:
                return self._schedule(trigger=f"calibrated on {job_id}")
        return []

    def flush_records(self) -> None:
        """Make every metric row received so far durable: the driver calls it when a worker is
        about to checkpoint, so no checkpoint runs ahead of the metrics of its steps."""
        recording.flush_metrics(self.state)

    def poll(self, job_id: str) -> Control:
        """Control for a running job, asked by its worker between steps (each stop and add is
        delivered once; ``abort`` for a job the coordinator no longer runs)."""
        return self._poll(job_id, None)

    def poll_all(self, job_ids: Sequence[str]) -> list[tuple[str, Control]]:
        """:meth:`poll` for each of ``job_ids`` in turn (the driver's round over its running
        jobs), with the refill queue's order built once for the round."""
        queue: list[scheduling.RefillQueue] = []

        def shared() -> scheduling.RefillQueue:
            if not queue:
                queue.append(scheduling.RefillQueue.build(self.state))
            return queue[0]

        return [(jid, self._poll(jid, shared)) for jid in job_ids]

    def _poll(self, job_id: str, queue: Callable[[], scheduling.RefillQueue] | None) -> Control:
        st = self.state
        run = st.jobs.running.get(job_id)
        if run is None:
            return Control(abort=True)
        stop = set(run.config_ids) & st.configs.stop_requests - run.stop_sent
        run.stop_sent.update(stop)
        if stop:  # the job's predicted end (the ETA, the next re-plan) without the stopped
            scheduling.retime_running(st, [run])
        paused = pause.deliver(st, run) if run.spec.gpus == 1 else frozenset()
        if st.refill:
            scheduling.refill(st, run, queue)
        add = tuple(st.configs.by_id[c] for c in run.add_pending)
        run.add_pending.clear()
        return Control(stop=frozenset(stop), add=add, pause=paused)

    def on_group_started(self, gpu_ids: Sequence[int], *, elapsed_s: float = 0.0) -> None:
        """The driver asked for a worker group on ``gpu_ids`` ``elapsed_s`` ago (a group
        started before the sweep's first plan, while the driver read the dataset); until it is
        ready the plan treats its GPUs as busy until ``cost.startup_time(d)`` after the request."""
        key = tuple(sorted(gpu_ids))
        ready_at = self.now() + max(self.state.startup_time(len(key)) - elapsed_s, 0.0)
        self.state.residency.start(key, ready_at=ready_at)
        self.state.decide(Decision.START_WORKERS, gpu_ids=list(key), elapsed_s=elapsed_s,
                          ready_at_s=ready_at)  # fmt: skip

    def on_group_ready(
        self,
        gpu_ids: Sequence[int],
        *,
        ready_s: float,
        load_s: float,
        node: str | None,
        build_s: float = 0.0,
        load_parts: dict[str, float] | None = None,
    ) -> None:
        """A worker group loaded the base model: its GPUs are warm; start-up was measured
        (``ready_s`` from the request, ``load_s`` of it in the engine's load, by part in
        ``load_parts``; ``build_s`` of it went to a built-in model's one-time build and is no
        start-up sample)."""
        self.state.residency.ready(gpu_ids)
        on_group = [
            r for r in self.state.jobs.running.values() if set(r.spec.gpu_ids) & set(gpu_ids)
        ]
        if on_group:  # their predicted ends had the group's start-up left in them
            scheduling.retime_running(self.state, on_group)
        self.state.measure.add_group_ready(ready_s=max(0.0, ready_s - build_s), load_s=load_s)
        self.state.decide(Decision.WORKERS_READY, gpu_ids=list(gpu_ids), ready_s=ready_s,
                          load_s=load_s, build_s=build_s, node=node,
                          load_parts={k: round(v, 3) for k, v in (load_parts or {}).items()})  # fmt: skip

    def on_group_lost(self, gpu_ids: Sequence[int]) -> None:
        """A worker group was torn down (a worker died, or its GPUs are needed at another d)."""
        self.state.residency.drop(gpu_ids)

    def on_request(self, request: ConfigRequest) -> None:
        """One request from outside the driver (a Tune scheduler, a proxy trial, a user):
        stop, pause or resume one config."""
        if request.kind is RequestKind.PAUSE:
            pause.pause_config(self.state, request.config_id, reason=request.reason)
        elif request.kind is RequestKind.RESUME:
            pause.resume_config(self.state, request.config_id, reason=request.reason)
        else:
            self.stop_config(request.config_id, reason=request.reason)

    def stop_config(
        self, config_id: str, *, reason: str = "requested", step: int | None = None
    ) -> None:
        """Stop one config: dropped from the queue, or from its running job at the next poll
        (``step``: the step its stop was decided at, for the decision record)."""
        st = self.state
        status = st.configs.status.get(config_id)
        if status is None or status in FINISHED:
            return
        if status is ConfigStatus.PAUSED:
            return pause.stop_paused(st, config_id, reason=reason)
        if status is ConfigStatus.RUNNING and config_id in st.configs.stop_requests:
            return  # asked again (a restored Tune scheduler re-decides): its job stops it once
        st.decide(Decision.STOP_CONFIG, config_ids=[config_id], reason=reason, was=str(status),
                  step=step if step is not None else st.configs.progress.get(config_id, 0))  # fmt: skip
        if status is ConfigStatus.QUEUED:
            st.jobs.drop_config(config_id)
            st.configs.status[config_id] = ConfigStatus.STOPPED
            st.tell(config_id, tell_metrics({}, st.metric_name, status=ConfigStatus.STOPPED))
            st.configs.results[config_id] = st.result_row(config_id, status=ConfigStatus.STOPPED)
        else:
            st.configs.stop_requests.add(config_id)
        recording.persist(st)  # durable at once: a driver killed now resumes with the stop

    def on_job_finished(self, job_id: str, outcome: PackOutcome) -> list[JobSpec]:
        """A job returned: every config's result and where its seconds went
        (:func:`.endings.job_finished`); the freed GPUs are re-planned."""
        endings.job_finished(self.state, job_id, outcome)
        return self._schedule(trigger=f"job {job_id} done")

    def on_job_failed(self, job_id: str, kind: FailureKind, message: str = "") -> list[JobSpec]:
        """A job ended without a result: retry (DIED), split (OOM) or fail (ERROR)
        (:func:`.endings.job_failed`); the freed GPUs are re-planned."""
        endings.job_failed(self.state, job_id, kind, message)
        return self._schedule(trigger=f"job {job_id} {kind}")

    def _schedule(self, *, trigger: str) -> list[JobSpec]:
        st = self.state
        intake.ask(st)
        pause.settle(st)
        if st.plans.due and scheduling.plan_held(st):
            st.plans.held = st.plans.held or trigger
        elif st.plans.due:
            scheduling.plan(st, st.plans.held or trigger)
            st.plans.held = ""
        launches = scheduling.dispatch(st)
        if st.is_done() and not st.journal.done_logged:
            st.journal.done_logged = True
            st.decide(Decision.SWEEP_DONE, counts=self.counts())
        recording.persist(st)
        return launches

    def on_timeline(
        self, phases: Mapping[str, float], *, notes: Mapping[str, float] | None = None
    ) -> None:
        """The driver's timeline of this run (seconds from its process start to each phase,
        :mod:`plora.runtime.timeline`), measured by the driver and logged as it is."""
        self.state.decide(Decision.TIMELINE, phases=dict(phases), notes=dict(notes or {}))

    # -- records and re-timing, on demand ---------------------------------------------------
    def persist(self) -> None:
        """Write the sweep directory's tables and ``state.json`` as they stand now."""
        recording.persist(self.state)

    def batched_writes(self) -> contextlib.AbstractContextManager[None]:
        """A block of events whose sweep-directory writes happen once, at its end
        (:func:`.recording.batched`)."""
        return recording.batched(self.state)

    def retime_running(self) -> None:
        """Re-predict the running jobs' ends (:func:`.scheduling.retime_running`)."""
        scheduling.retime_running(self.state)

    # -- resume (plora.runtime.coordinator.resume) ------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """JSON-able state for ``--resume`` (:meth:`set_state` restores it)."""
        return self.state.get_state()

    def set_state(
        self,
        state: Mapping[str, Any],
        *,
        retry_failed: bool = False,
        changed: Sequence[str] = (),
    ) -> None:
        """Restore from :meth:`get_state` (:func:`.resume.restore_state`)."""
        resume.restore_state(self.state, state, retry_failed=retry_failed, changed=changed)


def apply_request(coord: Coordinator, request: ConfigRequest) -> None:
    """Route one relay request to the coordinator (:meth:`Coordinator.on_request`)."""
    coord.on_request(request)


__all__ = ["Coordinator", "apply_request"]
