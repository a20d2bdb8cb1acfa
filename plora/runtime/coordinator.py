"""The coordinator: config queue, plan, free GPUs, running jobs, decisions (paper Fig. 3).

:class:`Coordinator` is a plain, event-driven state machine: the driver (or a test) feeds it
events -- :meth:`~Coordinator.start`, :meth:`~Coordinator.on_reports`,
:meth:`~Coordinator.on_job_finished`, :meth:`~Coordinator.on_job_failed`,
:meth:`~Coordinator.stop_config` -- and each returns the :class:`JobSpec` s to launch now.
:meth:`~Coordinator.poll` gives a running job its control (stop one adapter, refill a free
slot). It does no Ray calls: it runs in the driver (:mod:`plora.runtime.driver`), next to the sweep
directory it writes, and workers reach it through the named relay actor
:class:`plora.runtime.relay.CoordinatorActor` (metrics in, control out).

Resident workers. The driver keeps one worker group per GPU that loaded the base model once
(:meth:`~Coordinator.on_group_started` / :meth:`~Coordinator.on_group_ready`); jobs are entries
of the plan run on them. While configs are queued and no GPU is idle, a config that ends frees
its slot for the next queued config in plan order (:func:`plora.runtime.refill.choose_refills`),
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

Modules. This one holds the state and handles the events; the rest are functions of the
coordinator, typed by :class:`~plora.runtime.coordinator_state.CoordinatorState`:
:mod:`~plora.runtime.intake` (configs from the searcher, endings told back),
:mod:`~plora.runtime.scheduling` (plan / re-plan, launch, refill, refit),
:mod:`~plora.runtime.endings` (a job finished or failed: results, retry, OOM split),
:mod:`~plora.runtime.pause` (pause and resume), :mod:`~plora.runtime.recording` (the decision
log and the sweep directory's tables), :mod:`~plora.runtime.view` (counts, snapshot, ETA) and
:mod:`~plora.runtime.resume` (the saved state for ``--resume``).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from plora.config import LoRAConfig
from plora.engine.api import Control, PackOutcome, StepReport
from plora.runtime import endings, intake, pause, recording, resume, scheduling, view
from plora.runtime.coordinator_state import FINISHED, RunningJob
from plora.runtime.ledger import metric_rows, result_row, tell_metrics
from plora.runtime.measure import Measurements
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
from plora.runtime.residency import Residency
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
        ask_batch: Most configs requested from the source at a time (default: all it gives, so
            the planner sees every config before it packs; adaptive searchers bound themselves).
        metric_name: The dataset's metric name, added to what the searcher is told.
        calibration_steps: Measured steps (after each job's first) of the first job after which
            the cost model is refit and the remaining configs re-planned (0: only at job ends).
        early_stop: Early stopping (``early_stop:``; :class:`plora.tune.early_stop.AdapterEarlyStopper`):
            told every streamed step, it names configs to stop inside their packs.
    """

    def __init__(
        self,
        *,
        cost: Any,
        num_gpus: int,
        source: ConfigSource | None = None,
        configs: Sequence[LoRAConfig] | None = None,
        planner: Any = None,
        store: SweepStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_retries: int = 2,
        refill: bool = True,
        ask_batch: int | None = None,
        metric_name: str | None = None,
        metrics_flush_s: float = 5.0,
        calibration_steps: int = 3,
        early_stop: Any = None,
    ) -> None:
        if (source is None) == (configs is None):
            raise ValueError("pass exactly one of source and configs")
        if num_gpus < 1:
            raise ValueError(f"num_gpus={num_gpus} must be >= 1")
        self.cost = cost
        self.num_gpus = num_gpus
        self.source: ConfigSource = source if source is not None else StaticSource(configs or ())
        self.planner = planner if planner is not None else importlib.import_module("plora.planner")
        self.store = store
        self._clock = clock
        self._t0 = clock()
        self._offset = 0.0
        self.max_retries = max_retries
        self.refill = refill
        self.ask_batch = ask_batch or (1 << 30)
        self.metric_name = metric_name
        self._flush_s = metrics_flush_s
        self._last_flush = -1e9
        self._write_batch = 0  # open batched_writes() blocks
        self._unwritten = False  # state changed inside one, not yet written

        self.configs: dict[str, LoRAConfig] = {}
        self.status: dict[str, ConfigStatus] = {}
        self.progress: dict[str, int] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.pending: list[Any] = []  # planner Jobs not started yet, in plan order
        self.forced: list[JobSpec] = []  # retries, OOM halves, resumed jobs: launched first
        self.running: dict[str, RunningJob] = {}
        self.free_gpus: set[int] = set(range(num_gpus))
        self.measure = Measurements(calibration_steps=calibration_steps)
        self.residency = Residency()
        """Resident worker groups (warm GPUs) and groups still starting."""
        self.job_rows: list[dict[str, Any]] = []
        self.decisions: list[DecisionRecord] = []
        self._next_job = 0
        self._plans = 0
        self._plan_trigger = ""
        self._need_plan = False
        self._stop_requests: set[str] = set()
        self._done_logged = False
        self._attempts: dict[str, int] = {}  # job id -> its latest attempt (metric rows)
        self._reporter: dict[str, tuple[str, int]] = {}  # config -> (job, attempt) of its last rows
        self._by_hparams: dict[str, str] = {}  # hyperparameter fingerprint -> config id
        self._aliases: dict[str, list[str]] = {}  # config id -> later suggestions of it, untold
        self.early_stop = early_stop
        self.pauses = pause.PauseBook()
        """Pauses in flight (:mod:`plora.runtime.pause`: a Tune scheduler's PAUSE and resume)."""

    # -- clock and logging ----------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the sweep started (continues across ``--resume``)."""
        return self._offset + self._clock() - self._t0

    def _decide(
        self,
        kind: Decision,
        *,
        job_id: str | None = None,
        config_ids: Sequence[str] = (),
        **inputs: Any,
    ) -> DecisionRecord:
        return recording.decide(self, kind, job_id=job_id, config_ids=config_ids, **inputs)

    # -- queries ----------------------------------------------------------------------------
    def queued_ids(self) -> list[str]:
        """Configs waiting for a job, in arrival order."""
        return [c for c, s in self.status.items() if s is ConfigStatus.QUEUED]

    def is_done(self) -> bool:
        """True when the searcher is finished and every config is done, stopped or failed."""
        return (
            self.source.is_finished()
            and not self.running
            and not self.forced
            and all(s in FINISHED for s in self.status.values())
        )

    def counts(self) -> dict[str, int]:
        """Number of configs per :class:`ConfigStatus`, plus running jobs and busy GPUs."""
        return view.counts(self)

    def snapshot(self) -> dict[str, Any]:
        """A small JSON-able view for the progress display (:func:`plora.runtime.view.snapshot`)."""
        return view.snapshot(self)

    # -- events -----------------------------------------------------------------------------
    def start(self) -> list[JobSpec]:
        """First event: ask the searcher, plan, and return the jobs to launch."""
        return self._schedule(trigger="start")

    def tick(self) -> list[JobSpec]:
        """Nothing ended, nothing runs: ask a waiting searcher again and launch what it gives."""
        return self._schedule(trigger="tick")

    def on_job_started(self, job_id: str, *, node: str | None = None) -> None:
        """The driver placed the job's workers (``node``: where, for jobs.parquet)."""
        run = self.running.get(job_id)
        if run is not None:
            run.node = node
            self._job_row(run, status=JobStatus.RUNNING, end=None)

    def on_reports(self, job_id: str, reports: Sequence[StepReport]) -> list[JobSpec]:
        """Step reports streamed from a running job's worker: per-adapter metrics (to
        ``metrics.parquet``, progress) and the step's measurements. Once enough steps are
        measured the cost model is refit and the queue re-planned (calibration); returns the
        jobs that re-plan launches (usually none: the GPUs are busy)."""
        now = self.now()
        attempt = self._attempts.get(job_id, 0)
        out = [row for r in reports for row in metric_rows(job_id, r, now, attempt=attempt)]
        recording.note_redone(self, job_id, out)
        for r in out:
            self.progress[r["config_id"]] = max(self.progress.get(r["config_id"], 0), r["step"])
        if self.early_stop is not None:
            for r in out:
                if r["loss"] is not None and self.early_stop.on_step(
                    r["config_id"], r["step"], r["loss"]
                ):
                    self.stop_config(r["config_id"], reason="early_stop", step=r["step"])
        recording.record_metrics(self, out, now=now)
        run = self.running.get(job_id)
        if run is None or not reports:
            return []
        if self.measure.add_reports(
            job_id, reports, gpus=run.spec.gpus, strategy=run.spec.strategy
        ):
            scheduling.refit(self, job_id=job_id, trigger="calibration")
            if self._need_plan:
                return self._schedule(trigger=f"calibrated on {job_id}")
        return []

    def flush_records(self) -> None:
        """Make every metric row received so far durable: the driver calls it when a worker is
        about to checkpoint, so no checkpoint runs ahead of the metrics of its steps."""
        recording.flush_metrics(self)

    def poll(self, job_id: str) -> Control:
        """Control for a running job, asked by its worker between steps (each stop and add is
        delivered once; ``abort`` for a job the coordinator no longer runs)."""
        run = self.running.get(job_id)
        if run is None:
            return Control(abort=True)
        stop = set(run.config_ids) & self._stop_requests - run.stop_sent
        run.stop_sent.update(stop)
        if stop:  # the job's predicted end (the ETA, the next re-plan) without the stopped
            self._retime_running()
        paused = pause.deliver(self, run) if run.spec.gpus == 1 else frozenset()
        if self.refill:
            scheduling.refill(self, run)
        add = tuple(self.configs[c] for c in run.add_pending)
        run.add_pending.clear()
        return Control(stop=frozenset(stop), add=add, pause=paused)

    def on_group_started(self, gpu_ids: Sequence[int], *, elapsed_s: float = 0.0) -> None:
        """The driver asked for a worker group on ``gpu_ids`` ``elapsed_s`` ago (a group
        started before the sweep's first plan, while the driver read the dataset); until it is
        ready the plan treats its GPUs as busy until ``cost.startup_time(d)`` after the request."""
        key = tuple(sorted(gpu_ids))
        startup = getattr(self.cost, "startup_time", None)
        left = float(startup(len(key))) - elapsed_s if startup is not None else 0.0
        ready_at = self.now() + max(left, 0.0)
        self.residency.start(key, ready_at=ready_at)
        self._decide(Decision.START_WORKERS, gpu_ids=list(key), elapsed_s=elapsed_s,
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
        self.residency.ready(gpu_ids)
        if self.running:  # running jobs' predicted ends had the start-up left in them
            self._retime_running()
        self.measure.add_group_ready(ready_s=max(0.0, ready_s - build_s), load_s=load_s)
        self._decide(Decision.WORKERS_READY, gpu_ids=list(gpu_ids), ready_s=ready_s,
                     load_s=load_s, build_s=build_s, node=node,
                     load_parts={k: round(v, 3) for k, v in (load_parts or {}).items()})  # fmt: skip

    def on_group_lost(self, gpu_ids: Sequence[int]) -> None:
        """A worker group was torn down (a worker died, or its GPUs are needed at another d)."""
        self.residency.drop(gpu_ids)

    @property
    def warm_gpus(self) -> set[int]:
        """GPUs of a resident worker group."""
        return self.residency.warm_gpus

    def _ready_at(self, gpu_ids: Sequence[int]) -> float:
        startup = getattr(self.cost, "startup_time", None)
        return self.residency.ready_at(gpu_ids, now=self.now(), startup_time=startup)

    def _starting_idle(self) -> list[Any]:
        busy = {g for r in self.running.values() for g in r.spec.gpu_ids}
        return self.residency.idle_starting(busy=busy, now=self.now())

    def stop_config(
        self, config_id: str, *, reason: str = "requested", step: int | None = None
    ) -> None:
        """Stop one config: dropped from the queue, or from its running job at the next poll
        (``step``: the step its stop was decided at, for the decision record)."""
        status = self.status.get(config_id)
        if status is None or status in FINISHED:
            return
        if status is ConfigStatus.PAUSED:
            return pause.stop_paused(self, config_id, reason=reason)
        if status is ConfigStatus.RUNNING and config_id in self._stop_requests:
            return  # asked again (a restored Tune scheduler re-decides): its job stops it once
        self._decide(Decision.STOP_CONFIG, config_ids=[config_id], reason=reason, was=str(status),
                     step=step if step is not None else self.progress.get(config_id, 0))  # fmt: skip
        if status is ConfigStatus.QUEUED:
            self._drop_from_plan(config_id)
            self.status[config_id] = ConfigStatus.STOPPED
            self._tell(config_id, tell_metrics({}, self.metric_name, status=ConfigStatus.STOPPED))
            self.results[config_id] = self._result_row(config_id, status=ConfigStatus.STOPPED)
        else:
            self._stop_requests.add(config_id)
        self._persist()  # durable at once: a driver killed now resumes with the stop

    def on_job_finished(self, job_id: str, outcome: PackOutcome) -> list[JobSpec]:
        """A job returned: every config's result and where its seconds went
        (:func:`plora.runtime.endings.job_finished`); the freed GPUs are re-planned."""
        endings.job_finished(self, job_id, outcome)
        return self._schedule(trigger=f"job {job_id} done")

    def on_job_failed(self, job_id: str, kind: FailureKind, message: str = "") -> list[JobSpec]:
        """A job ended without a result: retry (DIED), split (OOM) or fail (ERROR)
        (:func:`plora.runtime.endings.job_failed`); the freed GPUs are re-planned."""
        endings.job_failed(self, job_id, kind, message)
        return self._schedule(trigger=f"job {job_id} {kind}")

    # -- scheduling -------------------------------------------------------------------------
    def _schedule(self, *, trigger: str) -> list[JobSpec]:
        intake.ask(self)
        pause.settle(self)
        if self._need_plan:
            scheduling.plan(self, trigger)
        launches = scheduling.dispatch(self)
        if self.is_done() and not self._done_logged:
            self._done_logged = True
            self._decide(Decision.SWEEP_DONE, counts=self.counts())
        self._persist()
        return launches

    def _tell(self, config_id: str, metrics: dict[str, Any]) -> None:
        intake.tell(self, config_id, metrics)

    # -- plan, dispatch, refill, refit (plora.runtime.scheduling) ---------------------------
    def _drop_from_plan(self, config_id: str) -> None:
        scheduling.drop_from_plan(self, config_id)

    def _retime_running(self) -> None:
        scheduling.retime_running(self)

    # -- records ----------------------------------------------------------------------------
    def _new_job_id(self) -> str:
        self._next_job += 1
        return f"j{self._next_job:04d}"

    def _result_row(self, cid: str, *, status: ConfigStatus, **r: Any) -> dict[str, Any]:
        return result_row(
            self.configs[cid],
            status=status,
            metric_name=self.metric_name,
            steps_seen=self.progress.get(cid, 0),
            **r,
        )

    def _job_row(
        self,
        run: RunningJob,
        *,
        status: JobStatus,
        end: float | None,
        timings: Mapping[str, Any] | None = None,
    ) -> None:
        recording.record_job(self, run, status=status, end=end, timings=timings)

    def _persist(self) -> None:
        recording.persist(self)

    def batched_writes(self) -> contextlib.AbstractContextManager[None]:
        """A block of events whose sweep-directory writes happen once, at its end
        (:func:`plora.runtime.recording.batched`)."""
        return recording.batched(self)

    # -- resume (plora.runtime.resume) ------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """JSON-able state for ``--resume`` (:meth:`set_state` restores it)."""
        return resume.saved_state(self)

    def set_state(
        self,
        state: Mapping[str, Any],
        *,
        retry_failed: bool = False,
        changed: Sequence[str] = (),
    ) -> None:
        """Restore from :meth:`get_state` (:func:`plora.runtime.resume.restore_state`)."""
        resume.restore_state(self, state, retry_failed=retry_failed, changed=changed)


__all__ = ["Coordinator"]
