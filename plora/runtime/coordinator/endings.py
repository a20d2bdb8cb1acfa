"""What a job's end does to its configs: :func:`job_finished` and :func:`job_failed`.

Functions of the coordinator's state (:class:`~plora.runtime.coordinator.state.CoordinatorState`),
called from its ``on_job_finished`` / ``on_job_failed`` events before it schedules
again. Both free the job's GPUs and ask for a re-plan.

* A finished job: each config's result row (its share of the job's GPU seconds by its
  tokens), its status (a stop that came after its last step stopped nothing: it is done), the
  searcher told; a config the job never trained goes back to the queue and a paused one to
  :mod:`plora.runtime.coordinator.pause`. The job's timings are measured and the cost model refit.
* A failed job (:class:`~plora.runtime.records.FailureKind`): a dead worker is retried from
  its checkpoint up to ``max_retries`` times, an out-of-memory pack is split in halves
  (:func:`plora.runtime.coordinator.refill.split_halves`), anything else -- or a config out of memory
  alone -- fails its configs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from plora.cost.overheads import EvalMetric
from plora.engine.api import PackOutcome
from plora.runtime.coordinator import pause, recording, scheduling
from plora.runtime.coordinator.ledger import config_status, tell_metrics
from plora.runtime.coordinator.refill import split_halves
from plora.runtime.coordinator.state import CoordinatorState, RunningJob
from plora.runtime.records import ConfigStatus, Decision, FailureKind, JobSpec, JobStatus


def job_finished(state: CoordinatorState, job_id: str, outcome: PackOutcome) -> None:
    """A job returned: every config's result and where its seconds went; the job's timings
    are measured and the cost model refit."""
    run = state.jobs.running.pop(job_id)
    state.jobs.free_gpus.update(run.spec.gpu_ids)
    end = state.now()
    per_config = {c: r.to_dict() for c, r in outcome.results.items()}
    wall = max(end - run.started_s, 1e-9)
    tokens = {c: float(per_config.get(c, {}).get("tokens") or 0) for c in run.config_ids}
    total_tokens = sum(tokens.values())
    for cid in run.config_ids:
        r = per_config.get(cid)
        if r is None:  # never trained (e.g. added after the job stopped): back to the queue
            state.configs.status[cid] = ConfigStatus.QUEUED
            continue
        share = tokens[cid] / total_tokens if total_tokens > 0 else 1 / len(run.config_ids)
        _config_ended(state, run, cid, r, gpu_seconds=wall * run.spec.gpus * share)
    timings = dataclasses.asdict(outcome.timings)
    state.decide(
        Decision.JOB_DONE, job_id=job_id, config_ids=run.config_ids, wall_s=wall,
        notes=list(outcome.notes), **timings,
    )  # fmt: skip
    recording.record_job(state, run, status=JobStatus.DONE, end=end, timings=timings)
    overheads = getattr(state.cost, "overheads", None)
    state.measure.add_outcome(
        outcome,
        eval_rows=int(getattr(state.cost, "eval_rows", 0) or 0),
        metric=getattr(state.cost, "eval_metric", EvalMetric.NONE),
        eval_s_per_row=float(getattr(overheads, "eval_s_per_row", 0.0)),
    )
    scheduling.refit(state, job_id=job_id, trigger="job done", paced=True)
    state.plans.due = True  # GPUs were freed: re-plan the remaining configs


def _config_ended(
    state: CoordinatorState,
    run: RunningJob,
    cid: str,
    r: dict[str, Any],
    *,
    gpu_seconds: float,
) -> None:
    """Config ``cid`` of the finished job ``run`` came back as ``r``: its result row and
    status, the searcher told (a paused config is not ended: :func:`.pause.on_paused`)."""
    book, job_id = state.configs, run.spec.job_id
    # a stop that came after the adapter's last step stopped nothing: it is done
    late = int(r.get("steps") or 0) >= state.cost.steps(book.by_id[cid])
    status = config_status(r.get("status"), stopped=cid in book.stop_requests and not late)
    fields = {k: v for k, v in r.items() if k not in ("status", "config_id", "job_id")}
    row = state.result_row(cid, status=status, job_id=job_id, gpu_seconds=gpu_seconds, **fields)
    if status is ConfigStatus.PAUSED:  # not ended: the searcher is not told
        pause.on_paused(state, cid, row, job_id=job_id)
        return
    book.status[cid] = status
    book.results[cid] = row
    state.decide(
        Decision.CONFIG_DONE if status is not ConfigStatus.FAILED else Decision.CONFIG_FAILED,
        job_id=job_id,
        config_ids=[cid],
        eval_loss=r.get("eval_loss"),
        eval_metric=r.get("eval_metric"),
        steps=r.get("steps"),
    )
    state.tell(cid, tell_metrics(r, state.metric_name, status=status))


def job_failed(state: CoordinatorState, job_id: str, kind: FailureKind, message: str) -> None:
    """A job ended without a result: retry (DIED), split (OOM) or fail (ERROR)."""
    run = state.jobs.running.pop(job_id)
    state.jobs.free_gpus.update(run.spec.gpu_ids)
    kind = FailureKind(kind)
    pause.on_job_failed(state, job_id)
    book = state.configs
    live = [c for c in run.config_ids if book.status.get(c) is ConfigStatus.RUNNING]
    status = {FailureKind.DIED: JobStatus.DIED, FailureKind.OOM: JobStatus.OOM}.get(
        kind, JobStatus.FAILED
    )
    recording.record_job(state, run, status=status, end=state.now())
    rows = state.journal.job_rows
    died = sum(r["job_id"] == job_id and r["status"] == JobStatus.DIED for r in rows)
    if kind is FailureKind.DIED and died <= state.max_retries:
        _retry(state, run.spec, live, message)
    elif kind is FailureKind.OOM and len(live) > 1:
        _split(state, run.spec, live, message)
    else:
        reason = {
            FailureKind.DIED: f"worker died {died} times",
            FailureKind.OOM: "out of memory even alone",
        }.get(kind, "error")
        state.decide(
            Decision.JOB_FAILED, job_id=job_id, config_ids=live, reason=reason, error=message
        )
        for c in live:
            book.status[c] = ConfigStatus.FAILED
            state.tell(c, tell_metrics({}, state.metric_name, status=ConfigStatus.FAILED))
            book.results[c] = state.result_row(
                c, status=ConfigStatus.FAILED, job_id=job_id, error=f"{reason}: {message}"[:500]
            )
            state.decide(Decision.CONFIG_FAILED, job_id=job_id, config_ids=[c], reason=reason)
    state.plans.due = True


def _retry(state: CoordinatorState, spec: JobSpec, live: list[str], message: str) -> None:
    """The job's worker died: its next attempt, from its checkpoint, is forced."""
    retry = dataclasses.replace(
        spec,
        configs=tuple(state.configs.by_id[c] for c in live),
        attempt=spec.attempt + 1,
        gpu_ids=(),
        resume=True,
    )
    state.decide(
        Decision.RETRY,
        job_id=spec.job_id,
        config_ids=live,
        attempt=retry.attempt,
        max_retries=state.max_retries,
        error=message,
    )
    state.jobs.forced.append(retry)
    for c in live:
        state.configs.status[c] = ConfigStatus.QUEUED


def _split(state: CoordinatorState, spec: JobSpec, live: list[str], message: str) -> None:
    """The job ran out of memory: its pack's halves are forced as two new jobs."""
    parts = split_halves(live)
    new_ids = []
    for part in parts:
        jid = state.jobs.new_job_id()
        new_ids.append(jid)
        state.jobs.forced.append(
            JobSpec(
                job_id=jid,
                configs=tuple(state.configs.by_id[c] for c in part),
                gpus=spec.gpus,
                strategy=spec.strategy,
                max_rows=spec.max_rows,
            )
        )
    for c in live:
        state.configs.status[c] = ConfigStatus.QUEUED
    state.decide(
        Decision.SPLIT_OOM,
        job_id=spec.job_id,
        config_ids=live,
        into={j: p for j, p in zip(new_ids, parts, strict=True)},
        error=message,
    )


__all__ = ["job_failed", "job_finished"]
