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

:class:`~plora.runtime.coordinator.state.PauseBook` is the coordinator's bookkeeping (the
pauses asked, not yet delivered); the functions here are its handlers, given the coordinator's
state (:class:`~plora.runtime.coordinator.state.CoordinatorState`). A relay request reaches them
through :meth:`Coordinator.on_request <plora.runtime.coordinator.machine.Coordinator.on_request>`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

from plora.runtime.coordinator import recording
from plora.runtime.coordinator.ledger import tell_metrics
from plora.runtime.coordinator.state import CoordinatorState, RunningJob
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


def deliver(state: CoordinatorState, run: RunningJob) -> frozenset[str]:
    """The pauses to send to ``run``'s job now (each once); they are ``paused`` from here, and
    waiting resumes whose state is now written are queued."""
    if state.pauses.asked:  # stopped before its pause came: a stop (the asked are few; the
        stops = state.configs.stop_requests  # stops grow with the sweep: not iterated per poll)
        state.pauses.asked = {c for c in state.pauses.asked if c not in stops}
    out = frozenset(state.pauses.asked.intersection(run.config_ids))
    state.pauses.asked -= out
    for cid in out:
        state.configs.status[cid] = ConfigStatus.PAUSED
        state.pauses.leaving[cid] = run.spec.job_id
        state.pauses.since[cid] = int(state.configs.progress.get(cid, 0))
    for cid in sorted(state.pauses.waiting):
        if _state_written(state, cid):
            state.pauses.waiting.discard(cid)
            _requeue(state, cid, reason="resumed (its train-state is written)")
    return out


def pause_config(state: CoordinatorState, config_id: str, *, reason: str) -> None:
    """Ask ``config_id`` to pause (queued: now; running: at its job's next poll)."""
    status = state.configs.status.get(config_id)
    if status not in (ConfigStatus.QUEUED, ConfigStatus.RUNNING):
        return
    job = state.jobs.job_of(config_id)
    deferred = job is not None and state.jobs.running[job].spec.gpus > 1
    state.decide(Decision.PAUSE_CONFIG, job_id=job, config_ids=[config_id], reason=reason,
                 was=str(status), step=state.configs.progress.get(config_id, 0),
                 deferred=deferred)  # fmt: skip
    if status is ConfigStatus.QUEUED:
        state.jobs.drop_config(config_id)
        state.configs.status[config_id] = ConfigStatus.PAUSED
        recording.persist(state)
    elif not deferred:
        state.pauses.asked.add(config_id)


def resume_config(state: CoordinatorState, config_id: str, *, reason: str) -> None:
    """Queue a paused config again (a pause not yet delivered is simply withdrawn; one whose
    train-state is still being written waits for it)."""
    if config_id in state.pauses.asked:
        state.pauses.asked.discard(config_id)
        return
    if state.configs.status.get(config_id) is not ConfigStatus.PAUSED:
        return
    if config_id in state.pauses.leaving and not _state_written(state, config_id):
        state.pauses.waiting.add(config_id)
        return
    _requeue(state, config_id, reason=reason)


def _requeue(state: CoordinatorState, config_id: str, *, reason: str) -> None:
    """Queue a paused config; the job it left (still running) no longer counts it."""
    left = state.pauses.leaving.pop(config_id, None)
    run = state.jobs.running.get(left) if left is not None else None
    if run is not None and config_id in run.config_ids:
        run.config_ids.remove(config_id)
    state.configs.status[config_id] = ConfigStatus.QUEUED
    state.plans.due = True
    state.decide(Decision.RESUME_CONFIG, config_ids=[config_id], reason=reason,
                 step=state.configs.progress.get(config_id, 0))  # fmt: skip
    recording.persist(state)


def on_paused(state: CoordinatorState, config_id: str, row: dict[str, Any], *, job_id: str) -> None:
    """A config left job ``job_id`` paused (``row``: its result row at the pause step); a resume
    that waited for its train-state queues it now. One resumed meanwhile and taken back by that
    same job as a refill, which ended before training it again (its row is still the pause's),
    is queued again: no running job will bring its result."""
    state.pauses.leaving.pop(config_id, None)
    state.decide(Decision.CONFIG_PAUSED, job_id=job_id, config_ids=[config_id],
                 steps=row.get("steps"), eval_loss=row.get("eval_loss"))  # fmt: skip
    if state.configs.status.get(config_id) is not ConfigStatus.PAUSED:
        if not any(config_id in run.config_ids for run in state.jobs.running.values()):
            state.configs.status[config_id] = ConfigStatus.QUEUED
            state.configs.results[config_id] = row
        return  # resumed meanwhile and packed again: that run's result will come
    state.configs.results[config_id] = row
    if config_id in state.pauses.stop_when_left:
        stop_paused(state, config_id, reason=state.pauses.stop_when_left.pop(config_id))
    elif config_id in state.pauses.waiting:
        state.pauses.waiting.discard(config_id)
        _requeue(state, config_id, reason="resumed (its train-state is written)")


def on_job_failed(state: CoordinatorState, job_id: str) -> None:
    """A job died: configs that were leaving it paused without their train-state written go
    back to running (the job's retry resumes them from its checkpoint)."""
    for cid, job in list(state.pauses.leaving.items()):
        if job == job_id and not _state_written(state, cid):
            del state.pauses.leaving[cid]
            state.pauses.waiting.discard(cid)
            state.configs.status[cid] = ConfigStatus.RUNNING


def on_restore(state: CoordinatorState, interrupted: Iterable[Iterable[str]]) -> None:
    """After ``--resume`` / ``Tuner.restore``: a config that was leaving an interrupted job
    paused but whose train-state was not written yet is running again (its job's checkpoint
    has it); paused configs with their state stay paused."""
    in_jobs = {c for ids in interrupted for c in ids}
    for cid, status in state.configs.status.items():
        if status is ConfigStatus.PAUSED and cid in in_jobs and not _state_written(state, cid):
            state.configs.status[cid] = ConfigStatus.RUNNING


def _state_written(state: CoordinatorState, config_id: str) -> bool:
    """Whether the train-state of the config's latest pause is on disk (not one of an earlier
    pause: a resume must not start the next pack from it)."""
    from plora.engine.pause import paused_step

    if state.journal.store is None:
        return True
    step = paused_step(state.journal.store.root, config_id)
    return step is not None and step >= state.pauses.since.get(config_id, 0)


def stop_paused(state: CoordinatorState, config_id: str, *, reason: str) -> None:
    """End a paused config as ``stopped`` at its pause step (its adapter and eval loss are
    those it left its pack with)."""
    from plora.engine.pause import forget

    if config_id in state.pauses.leaving:  # its row comes with its job's outcome
        state.pauses.stop_when_left[config_id] = reason
        return
    row = dict(state.configs.results.get(config_id) or {})
    fields = {k: v for k, v in row.items() if k in _RESULT_FIELDS}
    state.configs.status[config_id] = ConfigStatus.STOPPED
    state.configs.results[config_id] = state.result_row(
        config_id, status=ConfigStatus.STOPPED, **fields
    )
    state.decide(Decision.STOP_CONFIG, config_ids=[config_id], reason=reason,
                 was=str(ConfigStatus.PAUSED), step=state.configs.progress.get(config_id, 0))  # fmt: skip
    state.tell(config_id, tell_metrics(row, state.metric_name, status=ConfigStatus.STOPPED))
    if state.journal.store is not None:
        forget(state.journal.store.root, config_id)


def settle(state: CoordinatorState) -> None:
    """When nothing runs or waits and no trial will come again (the source is finished, or
    closing: the Tune experiment ended), paused configs end stopped -- nobody is left to resume
    them -- so that the sweep can end."""
    paused = state.configs.ids_in(ConfigStatus.PAUSED)
    if not paused or state.jobs.running or state.jobs.forced or state.configs.queued_ids():
        return
    if not (getattr(state.source, "closing", False) or state.source.is_finished()):
        return
    for cid in paused:
        stop_paused(state, cid, reason="sweep ended while paused")


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
    "RequestKind",
    "deliver",
    "on_job_failed",
    "on_paused",
    "on_restore",
    "pause_config",
    "resume_config",
    "settle",
    "stop_paused",
]
