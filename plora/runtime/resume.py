"""The coordinator's saved state: what ``state.json`` holds for ``--resume``, and restoring it.

:func:`saved_state` is written with every persisted change; :func:`restore_state` rebuilds a
fresh coordinator from it: finished configs stay finished, interrupted jobs are relaunched from
their checkpoints as their next attempt, and an edited sweep (``--allow-changed``) or
``--retry-failed`` changes what is queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from plora.config import LoRAConfig
from plora.config.diff import changes_space
from plora.runtime import pause
from plora.runtime.coordinator_state import FINISHED, CoordinatorState
from plora.runtime.ledger import spec_state
from plora.runtime.records import (
    ConfigStatus,
    Decision,
    JobSpec,
    JobStatus,
    StaticSource,
    decode_state,
    encode_state,
)

_LEFT = (*FINISHED, ConfigStatus.PAUSED)
"""Statuses whose configs an interrupted job does not relaunch (a paused one waits to resume)."""


def saved_state(coord: CoordinatorState) -> dict[str, Any]:
    """JSON-able state of ``coord`` for ``--resume`` (:func:`restore_state` restores it)."""
    # a running job's configs as they are now: refilled ones are in its checkpoint too
    running = [
        dataclasses.replace(r.spec, configs=tuple(coord.configs[c] for c in r.config_ids))
        for r in coord.running.values()
    ]
    return {
        "version": 1,
        "elapsed_s": coord.now(),
        "next_job": coord._next_job,
        "plans": coord._plans,
        "configs": [c.to_dict() for c in coord.configs.values()],
        "status": {c: str(s) for c, s in coord.status.items()},
        "progress": coord.progress,
        "results": coord.results,
        "stop_requests": sorted(coord._stop_requests),
        "interrupted": [spec_state(s) for s in [*running, *coord.forced]],
        "measurements": coord.measure.get_state(),
        "job_rows": coord.job_rows,
        "source": encode_state(coord.source.get_state()),
        "aliases": coord._aliases,
        "early_stop": None if coord.early_stop is None else coord.early_stop.get_state(),
    }


def restore_state(
    coord: CoordinatorState,
    state: Mapping[str, Any],
    *,
    retry_failed: bool = False,
    changed: Sequence[str] = (),
) -> None:
    """Restore ``coord`` from :func:`saved_state`; interrupted jobs are relaunched from checkpoints as
    their next attempt (so metric rows tell the runs apart).

    Args:
        state: What :meth:`get_state` returned.
        retry_failed: Queue the configs that failed for another attempt (their failure row
            is replaced by the new result; an adaptive searcher keeps what it was told).
        changed: What differs in the sweep being resumed (``plora.config.diff``); when it
            touches the space (:func:`~plora.config.diff.changes_space`) this coordinator's
            source is the edited sweep's and starts afresh (its configs already known by
            their hyperparameters are not trained again), and queued configs a fixed
            (grid/random) source no longer lists are stopped (those of interrupted jobs
            finish); other changes (hardware, planner) keep the source's state.
    """
    coord._offset = float(state["elapsed_s"])
    coord._t0 = coord._clock()
    coord._next_job = int(state["next_job"])
    coord._plans = int(state["plans"])
    coord.configs = {d["config_id"]: LoRAConfig.from_dict(d) for d in state["configs"]}
    coord.status = {c: ConfigStatus(s) for c, s in state["status"].items()}
    coord.progress = {c: int(v) for c, v in state["progress"].items()}
    coord.results = dict(state["results"])
    coord._stop_requests = set(state["stop_requests"])
    coord.measure.set_state(state["measurements"])
    coord.job_rows = [
        {
            **r,
            "status": str(JobStatus.INTERRUPTED),
            "end": r["end"] if r["end"] is not None else coord._offset,
        }
        if r["status"] == JobStatus.RUNNING
        else r
        for r in state["job_rows"]
    ]
    coord._by_hparams = {c.fingerprint(): cid for cid, c in coord.configs.items()}
    coord._aliases = {k: list(v) for k, v in state.get("aliases", {}).items()}
    new_space = changes_space(list(changed))
    if not new_space:
        coord.source.set_state(decode_state(state["source"]))
    if coord.early_stop is not None and state.get("early_stop") is not None:
        coord.early_stop.set_state(state["early_stop"])
    coord.forced = []
    pause.on_restore(coord, [s["config_ids"] for s in state["interrupted"]])
    for s in state["interrupted"]:
        live = [c for c in s["config_ids"] if coord.status.get(c) not in _LEFT]
        if live:
            coord.forced.append(
                JobSpec(
                    job_id=s["job_id"],
                    configs=tuple(coord.configs[c] for c in live),
                    gpus=s["gpus"],
                    strategy=s["strategy"],
                    attempt=int(s["attempt"]) + 1,
                    resume=True,
                    max_rows=s.get("max_rows"),
                )
            )
    retried = []
    for c, s in coord.status.items():
        if s is ConfigStatus.RUNNING:
            coord.status[c] = ConfigStatus.QUEUED
        elif s is ConfigStatus.FAILED and retry_failed:
            coord.status[c] = ConfigStatus.QUEUED
            coord.results.pop(c, None)
            retried.append(c)
    dropped = []
    if new_space and isinstance(coord.source, StaticSource):
        kept = {c.fingerprint() for c in coord.source.configs}
        started = {c for f in coord.forced for c in f.config_ids}  # resumed, not dropped
        for c, s in coord.status.items():
            gone = coord.configs[c].fingerprint() not in kept
            if s is ConfigStatus.QUEUED and c not in started and gone:
                coord.status[c] = ConfigStatus.STOPPED
                coord.results[c] = coord._result_row(
                    c, status=ConfigStatus.STOPPED, error="not in the edited sweep file"
                )
                dropped.append(c)
    coord.running = {}
    coord.free_gpus = set(range(coord.num_gpus))
    coord._need_plan = True
    coord._decide(
        Decision.RESUME,
        config_ids=[c for c, s in coord.status.items() if s is ConfigStatus.QUEUED],
        jobs=[s.job_id for s in coord.forced],
        done=sum(s in FINISHED for s in coord.status.values()),
        retried_failed=retried,
        changed=list(changed),
        dropped_by_edit=dropped,
    )


__all__ = ["restore_state", "saved_state"]
