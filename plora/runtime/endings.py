"""What a job's end does to its configs: :func:`job_finished` and :func:`job_failed`.

Functions of a :class:`~plora.runtime.coordinator_state.CoordinatorState` (the coordinator
itself), called from its ``on_job_finished`` / ``on_job_failed`` events before it schedules
again. Both free the job's GPUs and ask for a re-plan.

* A finished job: each config's result row (its share of the job's GPU seconds by its
  tokens), its status (a stop that came after its last step stopped nothing: it is done), the
  searcher told; a config the job never trained goes back to the queue and a paused one to
  :mod:`plora.runtime.pause`. The job's timings are measured and the cost model refit.
* A failed job (:class:`~plora.runtime.records.FailureKind`): a dead worker is retried from
  its checkpoint up to ``max_retries`` times, an out-of-memory pack is split in halves
  (:func:`plora.runtime.refill.split_halves`), anything else -- or a config out of memory
  alone -- fails its configs.
"""

from __future__ import annotations

import dataclasses

from plora.cost.overheads import EvalMetric
from plora.engine.api import PackOutcome
from plora.runtime import pause, scheduling
from plora.runtime.coordinator_state import CoordinatorState
from plora.runtime.ledger import config_status, tell_metrics
from plora.runtime.records import ConfigStatus, Decision, FailureKind, JobSpec, JobStatus
from plora.runtime.refill import split_halves


def job_finished(coord: CoordinatorState, job_id: str, outcome: PackOutcome) -> None:
    """A job returned: every config's result and where its seconds went."""
    run = coord.running.pop(job_id)
    coord.free_gpus.update(run.spec.gpu_ids)
    end = coord.now()
    per_config = {c: r.to_dict() for c, r in outcome.results.items()}
    wall = max(end - run.started_s, 1e-9)
    tokens = {c: float(per_config.get(c, {}).get("tokens") or 0) for c in run.config_ids}
    total_tokens = sum(tokens.values())
    for cid in run.config_ids:
        r = per_config.get(cid)
        if r is None:  # never trained (e.g. added after the job stopped): back to the queue
            coord.status[cid] = ConfigStatus.QUEUED
            continue
        # a stop that came after the adapter's last step stopped nothing: it is done
        late = int(r.get("steps") or 0) >= coord.cost.steps(coord.configs[cid])
        status = config_status(r.get("status"), stopped=cid in coord._stop_requests and not late)
        share = tokens[cid] / total_tokens if total_tokens > 0 else 1 / len(run.config_ids)
        fields = {k: v for k, v in r.items() if k not in ("status", "config_id", "job_id")}
        row = coord._result_row(
            cid, status=status, job_id=job_id, gpu_seconds=wall * run.spec.gpus * share,
            **fields,
        )  # fmt: skip
        if status is ConfigStatus.PAUSED:  # not ended: the searcher is not told
            pause.on_paused(coord, cid, row, job_id=job_id)
            continue
        coord.status[cid] = status
        coord.results[cid] = row
        coord._decide(
            Decision.CONFIG_DONE if status is not ConfigStatus.FAILED else Decision.CONFIG_FAILED,
            job_id=job_id,
            config_ids=[cid],
            eval_loss=r.get("eval_loss"),
            eval_metric=r.get("eval_metric"),
            steps=r.get("steps"),
        )
        coord._tell(cid, tell_metrics(r, coord.metric_name, status=status))
    timings = dataclasses.asdict(outcome.timings)
    coord._decide(
        Decision.JOB_DONE, job_id=job_id, config_ids=run.config_ids, wall_s=wall,
        notes=list(outcome.notes), **timings,
    )  # fmt: skip
    coord._job_row(run, status=JobStatus.DONE, end=end, timings=timings)
    overheads = getattr(coord.cost, "overheads", None)
    coord.measure.add_outcome(
        outcome,
        eval_rows=int(getattr(coord.cost, "eval_rows", 0) or 0),
        metric=getattr(coord.cost, "eval_metric", EvalMetric.NONE),
        eval_s_per_row=float(getattr(overheads, "eval_s_per_row", 0.0)),
    )
    scheduling.refit(coord, job_id=job_id, trigger="job done")
    coord._need_plan = True  # GPUs were freed: re-plan the remaining configs


def job_failed(coord: CoordinatorState, job_id: str, kind: FailureKind, message: str) -> None:
    """A job ended without a result: retry (DIED), split (OOM) or fail (ERROR)."""
    run = coord.running.pop(job_id)
    coord.free_gpus.update(run.spec.gpu_ids)
    kind = FailureKind(kind)
    pause.on_job_failed(coord, job_id)
    live = [c for c in run.config_ids if coord.status.get(c) is ConfigStatus.RUNNING]
    status = {FailureKind.DIED: JobStatus.DIED, FailureKind.OOM: JobStatus.OOM}.get(
        kind, JobStatus.FAILED
    )
    coord._job_row(run, status=status, end=coord.now())
    spec = run.spec
    died = sum(r["job_id"] == job_id and r["status"] == JobStatus.DIED for r in coord.job_rows)
    if kind is FailureKind.DIED and died <= coord.max_retries:
        retry = dataclasses.replace(
            spec,
            configs=tuple(coord.configs[c] for c in live),
            attempt=spec.attempt + 1,
            gpu_ids=(),
            resume=True,
        )
        coord._decide(
            Decision.RETRY,
            job_id=job_id,
            config_ids=live,
            attempt=retry.attempt,
            max_retries=coord.max_retries,
            error=message,
        )
        coord.forced.append(retry)
        for c in live:
            coord.status[c] = ConfigStatus.QUEUED
    elif kind is FailureKind.OOM and len(live) > 1:
        parts = split_halves(live)
        new_ids = []
        for part in parts:
            jid = coord._new_job_id()
            new_ids.append(jid)
            coord.forced.append(
                JobSpec(
                    job_id=jid,
                    configs=tuple(coord.configs[c] for c in part),
                    gpus=spec.gpus,
                    strategy=spec.strategy,
                    max_rows=spec.max_rows,
                )
            )
        for c in live:
            coord.status[c] = ConfigStatus.QUEUED
        coord._decide(
            Decision.SPLIT_OOM,
            job_id=job_id,
            config_ids=live,
            into={j: p for j, p in zip(new_ids, parts, strict=True)},
            error=message,
        )
    else:
        reason = {
            FailureKind.DIED: f"worker died {died} times",
            FailureKind.OOM: "out of memory even alone",
        }.get(kind, "error")
        coord._decide(
            Decision.JOB_FAILED, job_id=job_id, config_ids=live, reason=reason, error=message
        )
        for c in live:
            coord.status[c] = ConfigStatus.FAILED
            coord._tell(c, tell_metrics({}, coord.metric_name, status=ConfigStatus.FAILED))
            coord.results[c] = coord._result_row(
                c, status=ConfigStatus.FAILED, job_id=job_id, error=f"{reason}: {message}"[:500]
            )
            coord._decide(Decision.CONFIG_FAILED, job_id=job_id, config_ids=[c], reason=reason)
    coord._need_plan = True


__all__ = ["job_failed", "job_finished"]
