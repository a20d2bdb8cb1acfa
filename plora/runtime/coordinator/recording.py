"""The coordinator's writes to the sweep directory, and its decision log.

Functions of the coordinator's state (:class:`~plora.runtime.coordinator.state.CoordinatorState`,
whose :class:`~plora.runtime.coordinator.state.Journal` keeps the records); the rows they write are :mod:`plora.runtime.coordinator.ledger`'s, the files
:class:`plora.sweepdir.store.SweepStore`'s. Without a store they only keep the records in
memory (``decisions``, ``job_rows``).

* :meth:`CoordinatorState.decide <plora.runtime.coordinator.state.CoordinatorState.decide>`
  appends a :class:`~plora.runtime.records.DecisionRecord` to ``decisions`` and
  ``decisions.jsonl``;
* :func:`record_metrics` buffers ``metrics.parquet`` rows and flushes them -- with a fresh
  ``state.json``, and ``results.parquet`` if its write is due -- at most every
  ``metrics_flush_s``; :func:`flush_metrics` flushes now;
* :func:`note_redone` logs the steps an attempt trains again (their rows replace the earlier
  attempt's in ``metrics.parquet``);
* :func:`record_job` replaces or adds a job attempt's ``jobs.parquet`` row;
* :func:`persist` writes everything: metrics, jobs, results, state -- once, when the events of
  a :func:`batched` block are handled (``results.parquet`` amortized, whole when the sweep is
  done: :meth:`~plora.sweepdir.store.SweepStore.write_results`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from plora.runtime.coordinator.ledger import job_row
from plora.runtime.coordinator.state import CoordinatorState, RunningJob
from plora.runtime.records import Decision, JobStatus


def record_metrics(state: CoordinatorState, rows: list[dict[str, Any]], *, now: float) -> None:
    """Buffer ``metrics.parquet`` rows; flush them and write ``state.json`` (a fresh clock and
    progress for ``--resume``) when the last flush is ``metrics_flush_s`` old."""
    journal = state.journal
    if journal.store is None:
        return
    journal.store.append_metrics(rows)
    if now - journal.last_flush >= journal.flush_s:
        journal.store.flush_metrics()
        journal.store.write_state(state.get_state(live=True))
        journal.store.flush_results(force=False)  # results and jobs tables: when due
        journal.last_flush = now


def note_redone(state: CoordinatorState, job_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
    """Log a :attr:`Decision.REDO_STEPS` for the configs whose rows in ``rows`` (new
    ``metrics.parquet`` rows, before ``progress`` counts them) come from another job attempt
    than their last ones and start at a step already reported: ``steps`` = ``[first, last]``
    redone step per config."""
    redone: dict[str, list[int]] = {}
    attempt = 0
    reporter = state.journal.reporter
    for r in rows:
        cid, step, attempt = r["config_id"], int(r["step"]), int(r["attempt"])
        if reporter.get(cid) == (job_id, attempt):
            continue
        reporter[cid] = (job_id, attempt)
        last = state.configs.progress.get(cid, 0)
        if step <= last:
            redone[cid] = [step, last]
    if redone:
        state.decide(Decision.REDO_STEPS, job_id=job_id, config_ids=sorted(redone),
                     attempt=attempt, steps=redone)  # fmt: skip


def flush_metrics(state: CoordinatorState) -> None:
    """Make every metric row received so far durable."""
    if state.journal.store is not None:
        state.journal.store.flush_metrics()
        state.journal.last_flush = state.now()


def record_job(
    state: CoordinatorState,
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
    state.journal.job_rows.upsert(row)


def persist(state: CoordinatorState) -> None:
    """Write the sweep directory's tables and ``state.json`` as they stand now (inside
    :func:`batched`: when the block ends)."""
    journal, results = state.journal, state.configs.results
    if journal.store is None:
        return
    if journal.write_batch:
        journal.unwritten = True
        return
    journal.store.flush_decisions()
    journal.store.flush_metrics()
    journal.last_flush = state.now()
    done = state.is_done()  # the whole tables at the end
    journal.store.write_jobs(journal.job_rows, flush=done)
    journal.store.write_results(results, order=state.configs.by_id, flush=done)
    journal.store.write_state(state.get_state(live=True))


@contextlib.contextmanager
def batched(state: CoordinatorState) -> Iterator[None]:
    """Handle several events, then :func:`persist` once if any of them changed the state.

    Each write of results, jobs and ``state.json`` costs time linear in the configs; one per
    event (a stop, a refill, a job's end) made a sweep's writes quadratic in its configs
    (``benchmarks/control_plane.py``). The driver wraps each turn of its loop in this block and
    posts control to the workers and launches jobs after it, so whatever a worker obeys or runs
    is on disk first, as when each event wrote at once. Its decisions are made durable at its
    end too (one ``fsync``).
    """
    journal = state.journal
    journal.write_batch += 1
    try:
        yield
    finally:
        journal.write_batch -= 1
        if not journal.write_batch and journal.unwritten:
            journal.unwritten = False
            persist(state)
        elif not journal.write_batch and journal.store is not None:
            journal.store.flush_decisions()  # the batch's decisions, one fsync


__all__ = ["batched", "flush_metrics", "note_redone", "persist", "record_job", "record_metrics"]
