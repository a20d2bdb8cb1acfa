"""Restoring the coordinator's saved state (``state.json``) for ``--resume``.

:meth:`CoordinatorState.get_state <plora.runtime.coordinator.state.CoordinatorState.get_state>`
is written with every persisted change; :func:`restore_state` rebuilds a fresh coordinator's
state from it: finished configs stay finished, interrupted jobs are relaunched from their
checkpoints as their next attempt, and an edited sweep (``--allow-changed``) or
``--retry-failed`` changes what is queued.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from plora.config import LoRAConfig
from plora.config.diff import changes_space
from plora.runtime.coordinator import pause
from plora.runtime.coordinator.ledger import JobRows
from plora.runtime.coordinator.state import FINISHED, CoordinatorState
from plora.runtime.records import (
    ConfigStatus,
    Decision,
    JobSpec,
    JobStatus,
    StaticSource,
    decode_state,
)

_LEFT = (*FINISHED, ConfigStatus.PAUSED)
"""Statuses whose configs an interrupted job does not relaunch (a paused one waits to resume)."""


def restore_state(
    state: CoordinatorState,
    saved: Mapping[str, Any],
    *,
    retry_failed: bool = False,
    changed: Sequence[str] = (),
) -> None:
    """Restore ``state`` from :meth:`~.state.CoordinatorState.get_state`; interrupted jobs are
    relaunched from checkpoints as their next attempt (so metric rows tell the runs apart).

    Args:
        saved: What :meth:`get_state` returned.
        retry_failed: Queue the configs that failed for another attempt (their failure row
            is replaced by the new result; an adaptive searcher keeps what it was told).
        changed: What differs in the sweep being resumed (``plora.config.diff``); when it
            touches the space (:func:`~plora.config.diff.changes_space`) this coordinator's
            source is the edited sweep's and starts afresh (its configs already known by
            their hyperparameters are not trained again), and queued configs a fixed
            (grid/random) source no longer lists are stopped (those of interrupted jobs
            finish); other changes (hardware, planner) keep the source's state.
    """
    state.clock.restart(float(saved["elapsed_s"]))
    state.jobs.next_job = int(saved["next_job"])
    state.plans.count = int(saved["plans"])
    book = state.configs
    book.restore(
        configs=[LoRAConfig.from_dict(d) for d in saved["configs"]],
        status={c: ConfigStatus(s) for c, s in saved["status"].items()},
        progress={c: int(v) for c, v in saved["progress"].items()},
        results=dict(saved["results"]),
        stop_requests=saved["stop_requests"],
        aliases={k: list(v) for k, v in saved.get("aliases", {}).items()},
    )
    state.measure.set_state(saved["measurements"])
    state.journal.job_rows = JobRows(
        {
            **r,
            "status": str(JobStatus.INTERRUPTED),
            "end": r["end"] if r["end"] is not None else state.clock.offset,
        }
        if r["status"] == JobStatus.RUNNING
        else r
        for r in saved["job_rows"]
    )
    new_space = changes_space(list(changed))
    if not new_space:
        state.source.set_state(decode_state(saved["source"]))
    if state.early_stop is not None and saved.get("early_stop") is not None:
        state.early_stop.set_state(saved["early_stop"])
    state.jobs.forced = []
    pause.on_restore(state, [s["config_ids"] for s in saved["interrupted"]])
    for s in saved["interrupted"]:
        live = [c for c in s["config_ids"] if book.status.get(c) not in _LEFT]
        if live:
            state.jobs.forced.append(
                JobSpec(
                    job_id=s["job_id"],
                    configs=tuple(book.by_id[c] for c in live),
                    gpus=s["gpus"],
                    strategy=s["strategy"],
                    attempt=int(s["attempt"]) + 1,
                    resume=True,
                    max_rows=s.get("max_rows"),
                )
            )
    retried = []
    for c, s in book.status.items():
        if s is ConfigStatus.RUNNING:
            book.status[c] = ConfigStatus.QUEUED
        elif s is ConfigStatus.FAILED and retry_failed:
            book.status[c] = ConfigStatus.QUEUED
            book.results.pop(c, None)
            retried.append(c)
    dropped = _drop_edited_out(state) if new_space else []
    state.jobs.running = {}
    state.jobs.free_gpus = set(range(state.num_gpus))
    state.plans.due = True
    state.decide(
        Decision.RESUME,
        config_ids=book.queued_ids(),
        jobs=[s.job_id for s in state.jobs.forced],
        done=sum(s in FINISHED for s in book.status.values()),
        retried_failed=retried,
        changed=list(changed),
        dropped_by_edit=dropped,
    )


def _drop_edited_out(state: CoordinatorState) -> list[str]:
    """Stop the queued configs a fixed (grid/random) source of an edited sweep no longer lists
    (those of interrupted jobs finish); returns their ids."""
    if not isinstance(state.source, StaticSource):
        return []
    book = state.configs
    kept = {c.fingerprint() for c in state.source.configs}
    started = state.jobs.forced_config_ids()  # resumed, not dropped
    dropped = []
    for c, s in book.status.items():
        gone = book.by_id[c].fingerprint() not in kept
        if s is ConfigStatus.QUEUED and c not in started and gone:
            book.status[c] = ConfigStatus.STOPPED
            book.results[c] = state.result_row(
                c, status=ConfigStatus.STOPPED, error="not in the edited sweep file"
            )
            dropped.append(c)
    return dropped


__all__ = ["restore_state"]
