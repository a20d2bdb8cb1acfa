"""The coordinator's writes to the sweep directory, and its decision log.

Functions of a :class:`~plora.runtime.coordinator_state.CoordinatorState` (the coordinator
itself); the rows they write are :mod:`plora.runtime.ledger`'s, the files
:class:`plora.sweepdir.store.SweepStore`'s. Without a store they only keep the records in
memory (``decisions``, ``job_rows``).

* :func:`decide` appends a :class:`~plora.runtime.records.DecisionRecord` to ``decisions`` and
  ``decisions.jsonl``;
* :func:`record_metrics` buffers ``metrics.parquet`` rows and flushes them -- with a fresh
  ``state.json`` -- at most every ``metrics_flush_s``; :func:`flush_metrics` flushes now;
* :func:`note_redone` logs the steps an attempt trains again (their rows replace the earlier
  attempt's in ``metrics.parquet``);
* :func:`record_job` replaces or adds a job attempt's ``jobs.parquet`` row;
* :func:`persist` writes everything: metrics, jobs, results, state -- once, when the events of
  a :func:`batched` block are handled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from plora.runtime.coordinator_state import CoordinatorState, RunningJob
from plora.runtime.ledger import job_row, upsert_job_row
from plora.runtime.records import Decision, DecisionRecord, JobStatus


def decide(
    coord: CoordinatorState,
    kind: Decision,
    *,
    job_id: str | None = None,
    config_ids: Sequence[str] = (),
    **inputs: Any,
) -> DecisionRecord:
    """Log one decision with its inputs, at the sweep clock's now."""
    rec = DecisionRecord(
        kind=kind, time_s=coord.now(), job_id=job_id, config_ids=tuple(config_ids), inputs=inputs
    )
    coord.decisions.append(rec)
    if coord.store is not None:
        coord.store.append_decision(rec.to_json_dict())
    return rec


def record_metrics(coord: CoordinatorState, rows: list[dict[str, Any]], *, now: float) -> None:
    """Buffer ``metrics.parquet`` rows; flush them and write ``state.json`` (a fresh clock and
    progress for ``--resume``) when the last flush is ``metrics_flush_s`` old."""
    if coord.store is None:
        return
    coord.store.append_metrics(rows)
    if now - coord._last_flush >= coord._flush_s:
        coord.store.flush_metrics()
        coord.store.write_state(coord.get_state())
        coord._last_flush = now


def note_redone(coord: CoordinatorState, job_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Log a :attr:`Decision.REDO_STEPS` for the configs whose rows in ``rows`` (new
    ``metrics.parquet`` rows, before ``progress`` counts them) come from another job attempt
    than their last ones and start at a step already reported: ``steps`` = ``[first, last]``
    redone step per config."""
    redone: dict[str, list[int]] = {}
    attempt = 0
    for r in rows:
        cid, step, attempt = r["config_id"], int(r["step"]), int(r["attempt"])
        if coord._reporter.get(cid) == (job_id, attempt):
            continue
        coord._reporter[cid] = (job_id, attempt)
        last = coord.progress.get(cid, 0)
        if step <= last:
            redone[cid] = [step, last]
    if redone:
        coord._decide(Decision.REDO_STEPS, job_id=job_id, config_ids=sorted(redone),
                      attempt=attempt, steps=redone)  # fmt: skip


def flush_metrics(coord: CoordinatorState) -> None:
    """Make every metric row received so far durable."""
    if coord.store is not None:
        coord.store.flush_metrics()
        coord._last_flush = coord.now()


def record_job(
    coord: CoordinatorState,
    run: RunningJob,
    *,
    status: JobStatus,
    end: float | None,
    timings: Mapping[str, Any] | None = None,
) -> None:
    """The ``jobs.parquet`` row of ``run``'s attempt, as it stands (kept in ``job_rows``)."""
    row = job_row(
        run.spec,
        config_ids=run.config_ids,
        node=run.node,
        start=run.started_s,
        end=end,
        status=status,
        timings=timings,
    )
    upsert_job_row(coord.job_rows, row)


def persist(coord: CoordinatorState) -> None:
    """Write the sweep directory's tables and ``state.json`` as they stand now (inside
    :func:`batched`: when the block ends)."""
    if coord.store is None:
        return
    if coord._write_batch:
        coord._unwritten = True
        return
    coord.store.flush_metrics()
    coord._last_flush = coord.now()
    coord.store.write_jobs(coord.job_rows)
    coord.store.write_results([coord.results[c] for c in coord.configs if c in coord.results])
    coord.store.write_state(coord.get_state())


@contextlib.contextmanager
def batched(coord: CoordinatorState) -> Iterator[None]:
    """Handle several events, then :func:`persist` once if any of them changed the state.

    Each write of results, jobs and ``state.json`` costs time linear in the configs; one per
    event (a stop, a refill, a job's end) made a sweep's writes quadratic in its configs
    (``benchmarks/control_plane.py``). The driver wraps each turn of its loop in this block and
    posts control to the workers and launches jobs after it, so whatever a worker obeys or runs
    is on disk first, as when each event wrote at once.
    """
    coord._write_batch += 1
    try:
        yield
    finally:
        coord._write_batch -= 1
        if not coord._write_batch and coord._unwritten:
            coord._unwritten = False
            persist(coord)


__all__ = [
    "batched",
    "decide",
    "flush_metrics",
    "note_redone",
    "persist",
    "record_job",
    "record_metrics",
]
