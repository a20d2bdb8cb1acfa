"""Pause and resume configs of a running sweep: the coordinator's side of a scheduler's PAUSE.

A Tune scheduler that pauses trials to resume them later (synchronous ``HyperBandScheduler``,
``MedianStoppingRule(hard_stop=False)``) pauses a config through the relay
(:class:`ConfigRequest` of kind :attr:`RequestKind.PAUSE`); the coordinator then

* **pauses** it: a queued config leaves the plan; a running one leaves its pack at the next step
  boundary (``Control.pause``), where the engine saves its whole train-state, evaluates and
  exports it (:mod:`plora.engine.pause`) -- its slot is refilled like any freed slot. It is
  ``paused`` (``results.parquet`` holds its row at the pause step) and the searcher is not told:
  it has not ended. A config in a job of ``d > 1`` GPUs keeps training (the pause is
  ``deferred``: its sharded state does not leave a pack yet).
* **resumes** it (:attr:`RequestKind.RESUME`, the proxy trial restarted by Tune): it is queued
  again, so the planner packs it -- or a running job takes it as a refill -- and the engine
  continues it from its train-state, exactly.
* **stops** it when it is stopped while paused, or when the sweep's configs all ended but it
  (nobody will resume it): it ends ``stopped`` at its pause step with the adapter and eval loss
  of that step.

:class:`PauseBook` is the coordinator's bookkeeping (the pauses asked, not yet delivered); the
functions here are the coordinator's handlers, called from one-line hooks in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from plora.runtime.records import ConfigStatus, Decision


class RequestKind(StrEnum):
    """What a relay request asks of one config."""

    STOP = "stop"
    PAUSE = "pause"
    RESUME = "resume"


@dataclasses.dataclass(frozen=True, slots=True)
class ConfigRequest:
    """One request from outside the driver (a Tune scheduler, a proxy trial, a user)."""

    config_id: str
    reason: str
    kind: RequestKind = RequestKind.STOP


class PauseBook:
    """The coordinator's pauses in flight.

    A pause is *asked* (not yet delivered to the config's job), then *leaving* (delivered: the
    config is ``paused`` for the coordinator, but its worker writes its train-state at its next
    step boundary). A resume that comes while the state is not on disk yet *waits* for it, so
    the next pack never starts the config afresh.
    """

    def __init__(self) -> None:
        self.asked: set[str] = set()
        self.leaving: dict[str, str] = {}
        """Config id -> the job it is leaving."""
        self.waiting: set[str] = set()
        """Resumes waiting for the config's train-state to be written."""
        self.stop_when_left: dict[str, str] = {}
        """Stops of leaving configs (config id -> reason), done once their row came."""
        self.since: dict[str, int] = {}
        """Config id -> its step as its pause was delivered: a train-state written for this
        pause is at least that far (one left by an earlier pause of the config is not)."""


def deliver(coord: Any, run: Any) -> frozenset[str]:
    """The pauses to send to ``run``'s job now (each once); they are ``paused`` from here, and
    waiting resumes whose state is now written are queued."""
    coord.pauses.asked -= coord._stop_requests  # stopped before its pause came: a stop
    out = frozenset(coord.pauses.asked.intersection(run.config_ids))
    coord.pauses.asked -= out
    for cid in out:
        coord.status[cid] = ConfigStatus.PAUSED
        coord.pauses.leaving[cid] = run.spec.job_id
        coord.pauses.since[cid] = int(coord.progress.get(cid, 0))
    for cid in sorted(coord.pauses.waiting):
        if _state_written(coord, cid):
            coord.pauses.waiting.discard(cid)
            _requeue(coord, cid, reason="resumed (its train-state is written)")
    return out


def apply_request(coord: Any, request: ConfigRequest) -> None:
    """Route one relay request to the coordinator."""
    if request.kind is RequestKind.PAUSE:
        pause_config(coord, request.config_id, reason=request.reason)
    elif request.kind is RequestKind.RESUME:
        resume_config(coord, request.config_id, reason=request.reason)
    else:
        coord.stop_config(request.config_id, reason=request.reason)


def pause_config(coord: Any, config_id: str, *, reason: str) -> None:
    """Ask ``config_id`` to pause (queued: now; running: at its job's next poll)."""
    status = coord.status.get(config_id)
    if status not in (ConfigStatus.QUEUED, ConfigStatus.RUNNING):
        return
    job = next((j for j, r in coord.running.items() if config_id in r.config_ids), None)
    deferred = job is not None and coord.running[job].spec.gpus > 1
    coord._decide(Decision.PAUSE_CONFIG, job_id=job, config_ids=[config_id], reason=reason,
                  was=str(status), step=coord.progress.get(config_id, 0),
                  deferred=deferred)  # fmt: skip
    if status is ConfigStatus.QUEUED:
        coord._drop_from_plan(config_id)
        coord.status[config_id] = ConfigStatus.PAUSED
        coord._persist()
    elif not deferred:
        coord.pauses.asked.add(config_id)


def resume_config(coord: Any, config_id: str, *, reason: str) -> None:
    """Queue a paused config again (a pause not yet delivered is simply withdrawn; one whose
    train-state is still being written waits for it)."""
    if config_id in coord.pauses.asked:
        coord.pauses.asked.discard(config_id)
        return
    if coord.status.get(config_id) is not ConfigStatus.PAUSED:
        return
    if config_id in coord.pauses.leaving and not _state_written(coord, config_id):
        coord.pauses.waiting.add(config_id)
        return
    _requeue(coord, config_id, reason=reason)


def _requeue(coord: Any, config_id: str, *, reason: str) -> None:
    """Queue a paused config; the job it left (still running) no longer counts it."""
    left = coord.pauses.leaving.pop(config_id, None)
    run = coord.running.get(left) if left is not None else None
    if run is not None and config_id in run.config_ids:
        run.config_ids.remove(config_id)
    coord.status[config_id] = ConfigStatus.QUEUED
    coord._need_plan = True
    coord._decide(Decision.RESUME_CONFIG, config_ids=[config_id], reason=reason,
                  step=coord.progress.get(config_id, 0))  # fmt: skip
    coord._persist()


def on_paused(coord: Any, config_id: str, row: dict[str, Any], *, job_id: str) -> None:
    """A config left job ``job_id`` paused (``row``: its result row at the pause step); a resume
    that waited for its train-state queues it now. One resumed meanwhile and taken back by that
    same job as a refill, which ended before training it again (its row is still the pause's),
    is queued again: no running job will bring its result."""
    coord.pauses.leaving.pop(config_id, None)
    coord._decide(Decision.CONFIG_PAUSED, job_id=job_id, config_ids=[config_id],
                  steps=row.get("steps"), eval_loss=row.get("eval_loss"))  # fmt: skip
    if coord.status.get(config_id) is not ConfigStatus.PAUSED:
        if not any(config_id in run.config_ids for run in coord.running.values()):
            coord.status[config_id] = ConfigStatus.QUEUED
            coord.results[config_id] = row
        return  # resumed meanwhile and packed again: that run's result will come
    coord.results[config_id] = row
    if config_id in coord.pauses.stop_when_left:
        stop_paused(coord, config_id, reason=coord.pauses.stop_when_left.pop(config_id))
    elif config_id in coord.pauses.waiting:
        coord.pauses.waiting.discard(config_id)
        _requeue(coord, config_id, reason="resumed (its train-state is written)")


def on_job_failed(coord: Any, job_id: str) -> None:
    """A job died: configs that were leaving it paused without their train-state written go
    back to running (the job's retry resumes them from its checkpoint)."""
    for cid, job in list(coord.pauses.leaving.items()):
        if job == job_id and not _state_written(coord, cid):
            del coord.pauses.leaving[cid]
            coord.pauses.waiting.discard(cid)
            coord.status[cid] = ConfigStatus.RUNNING


def on_restore(coord: Any, interrupted: Iterable[Iterable[str]]) -> None:
    """After ``--resume`` / ``Tuner.restore``: a config that was leaving an interrupted job
    paused but whose train-state was not written yet is running again (its job's checkpoint
    has it); paused configs with their state stay paused."""
    in_jobs = {c for ids in interrupted for c in ids}
    for cid, status in coord.status.items():
        if status is ConfigStatus.PAUSED and cid in in_jobs and not _state_written(coord, cid):
            coord.status[cid] = ConfigStatus.RUNNING


def _state_written(coord: Any, config_id: str) -> bool:
    """Whether the train-state of the config's latest pause is on disk (not one of an earlier
    pause: a resume must not start the next pack from it)."""
    from plora.engine.pause import paused_step

    if coord.store is None:
        return True
    step = paused_step(coord.store.root, config_id)
    return step is not None and step >= coord.pauses.since.get(config_id, 0)


def stop_paused(coord: Any, config_id: str, *, reason: str) -> None:
    """End a paused config as ``stopped`` at its pause step (its adapter and eval loss are
    those it left its pack with)."""
    from plora.engine.pause import forget
    from plora.runtime.ledger import tell_metrics

    if config_id in coord.pauses.leaving:  # its row comes with its job's outcome
        coord.pauses.stop_when_left[config_id] = reason
        return
    row = dict(coord.results.get(config_id) or {})
    fields = {k: v for k, v in row.items() if k in _RESULT_FIELDS}
    coord.status[config_id] = ConfigStatus.STOPPED
    coord.results[config_id] = coord._result_row(config_id, status=ConfigStatus.STOPPED, **fields)
    coord._decide(Decision.STOP_CONFIG, config_ids=[config_id], reason=reason,
                  was=str(ConfigStatus.PAUSED), step=coord.progress.get(config_id, 0))  # fmt: skip
    coord._tell(config_id, tell_metrics(row, coord.metric_name, status=ConfigStatus.STOPPED))
    if coord.store is not None:
        forget(coord.store.root, config_id)


def settle(coord: Any) -> None:
    """When nothing runs or waits and no trial will come again (the source is finished, or
    closing: the Tune experiment ended), paused configs end stopped -- nobody is left to resume
    them -- so that the sweep can end."""
    paused = [c for c, s in coord.status.items() if s is ConfigStatus.PAUSED]
    if not paused or coord.running or coord.forced or coord.queued_ids():
        return
    if not (getattr(coord.source, "closing", False) or coord.source.is_finished()):
        return
    for cid in paused:
        stop_paused(coord, cid, reason="sweep ended while paused")


_RESULT_FIELDS = (
    "job_id",
    "steps",
    "tokens",
    "final_train_loss",
    "eval_loss",
    "eval_metric",
    "adapter_path",
    "gpu_seconds",
)
"""A paused row's fields that its stopped row keeps."""


__all__ = [
    "ConfigRequest",
    "PauseBook",
    "RequestKind",
    "apply_request",
    "deliver",
    "on_job_failed",
    "on_paused",
    "on_restore",
    "pause_config",
    "resume_config",
    "settle",
    "stop_paused",
]
