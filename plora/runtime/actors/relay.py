"""The relay actor between workers and the coordinator.

The :class:`~plora.runtime.coordinator.Coordinator` runs in the driver (next to the sweep dir);
workers reach it through :class:`CoordinatorActor`, a thin named actor that buffers per-adapter
step reports from workers and hands each job the control (stop / add) the coordinator posted for it.
The driver drains and posts a few times per second.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import ray

from plora.engine.api import Control, StepMetrics, StepReport
from plora.runtime.coordinator.pause import ConfigRequest, RequestKind


class CoordinatorActor:
    """Relay between workers and the driver's coordinator (one per sweep, named).

    Worker side: :meth:`push_reports`, :meth:`poll`, :meth:`request_sync` / :meth:`synced`
    (before a checkpoint). Driver side: :meth:`drain`, :meth:`ack_sync`,
    :meth:`post_control`, :meth:`post_results`, :meth:`forget`, :meth:`set_snapshot`. Others
    (a Tune proxy trial following one config, a scheduler, a user) may call :meth:`stop_config`,
    :meth:`pause_config`, :meth:`resume_config`,
    :meth:`config_view`, :meth:`history` and :meth:`snapshot`.
    """

    def __init__(self, *, keep_history: bool = False) -> None:
        self._keep_history = keep_history
        self._reports: dict[str, list[StepReport]] = defaultdict(list)
        self._control: dict[str, Control] = {}
        self._aborted: set[str] = set()
        self._stops: list[ConfigRequest] = []
        self._snapshot: dict[str, Any] = {}
        self._last: dict[str, StepMetrics] = {}
        self._results: dict[str, dict[str, Any]] = {}
        self._sync_asked: dict[str, int] = {}
        self._sync_done: dict[str, int] = {}
        self._sync_seq = 0
        self._history: dict[str, list[StepMetrics]] = defaultdict(list)
        self._delivered: dict[str, int] = {}

    def push_reports(self, job_id: str, reports: list[StepReport]) -> None:
        self._reports[job_id].extend(reports)
        for report in reports:
            for m in report.metrics:
                self._last[m.config_id] = m
                if self._keep_history:
                    self._history[m.config_id].append(m)

    def request_sync(self, job_id: str) -> int:
        """A worker is about to checkpoint: the reports it pushed before this call must become
        durable first. Returns a ticket; :meth:`synced` reaches it once the driver wrote them."""
        self._sync_seq += 1
        self._sync_asked[job_id] = self._sync_seq
        return self._sync_seq

    def synced(self, job_id: str) -> int:
        """The latest ticket of ``job_id`` whose reports the driver made durable (0: none)."""
        return self._sync_done.get(job_id, 0)

    def post_results(self, results: dict[str, dict[str, Any]]) -> None:
        """Result rows (``results.parquet`` shape) of configs that ended."""
        self._results.update(results)

    def config_view(self, config_id: str) -> dict[str, Any]:
        """One config as seen now: its latest step metrics and, once it ended, its result."""
        last = self._last.get(config_id)
        return {
            "last": None if last is None else dataclasses.asdict(last),
            "result": self._results.get(config_id),
        }

    def history(
        self, config_id: str, after_step: int = 0
    ) -> tuple[list[StepMetrics], dict[str, Any] | None]:
        """One config's step metrics with ``step > after_step`` (in step order, as streamed
        in this driver's run; kept only with ``keep_history``) and, once it ended, its result row
        (``results.parquet`` shape). Results are posted after the job's last reports, so a
        follower that gets the result has had every step. Rows up to ``after_step`` are dropped
        (the one follower of a config has read them): memory holds only unread steps."""
        rows = [m for m in self._history.get(config_id, ()) if m.step > after_step]
        if config_id in self._history:
            self._history[config_id] = rows
        if rows:
            self._delivered[config_id] = max(self._delivered.get(config_id, 0), rows[-1].step)
        return list(rows), self._results.get(config_id)

    def poll(self, job_id: str) -> Control:
        ctl = self._control.pop(job_id, None) or Control()
        if job_id in self._aborted:
            ctl = dataclasses.replace(ctl, abort=True)
        return ctl

    def drain(self) -> tuple[dict[str, list[StepReport]], list[ConfigRequest], dict[str, int]]:
        """``({job_id: step reports}, [stop / pause / resume requests], {job_id: sync ticket})``
        since the last drain; the driver acknowledges the tickets (:meth:`ack_sync`) once the
        reports drained with them are on disk."""
        out, self._reports = dict(self._reports), defaultdict(list)
        stops, self._stops = self._stops, []
        syncs, self._sync_asked = self._sync_asked, {}
        return out, stops, syncs

    def ack_sync(self, tickets: dict[str, int]) -> None:
        """The reports drained with these tickets are durable (driver side)."""
        for job_id, ticket in tickets.items():
            self._sync_done[job_id] = max(ticket, self._sync_done.get(job_id, 0))

    def post_control(self, job_id: str, control: Control) -> None:
        cur = self._control.get(job_id) or Control()
        self._control[job_id] = Control(
            stop=cur.stop | control.stop,
            add=cur.add + control.add,
            abort=cur.abort or control.abort,
            pause=cur.pause | control.pause,
        )

    def abort(self, job_id: str) -> None:
        self._aborted.add(job_id)

    def forget(self, job_id: str) -> None:
        self._control.pop(job_id, None)
        self._aborted.discard(job_id)
        self._sync_done.pop(job_id, None)

    def stop_config(self, config_id: str, reason: str = "relay request") -> None:
        """Ask the coordinator to stop one config (e.g. a Tune scheduler's STOP); ``reason``
        lands in its ``stop_config`` decision."""
        self._stops.append(ConfigRequest(config_id, reason))

    def pause_config(self, config_id: str, reason: str = "relay request") -> None:
        """Ask the coordinator to pause one config (a Tune scheduler's PAUSE): it leaves its
        pack with its train-state at the next step (:mod:`plora.runtime.coordinator.pause`)."""
        self._stops.append(ConfigRequest(config_id, reason, RequestKind.PAUSE))

    def resume_config(self, config_id: str, reason: str = "relay request") -> int:
        """Ask the coordinator to queue a paused config again (its trial runs again); its
        paused result row is no longer its result. Returns the last step :meth:`history`
        handed out for it (a restarted follower goes on after it: its predecessor reported
        them)."""
        row = self._results.get(config_id)
        if row is not None and row.get("status") == "paused":
            del self._results[config_id]
        self._stops.append(ConfigRequest(config_id, reason, RequestKind.RESUME))
        return self._delivered.get(config_id, 0)

    def set_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._snapshot = snapshot

    def snapshot(self) -> dict[str, Any]:
        return self._snapshot


def start_relay(name: str, *, keep_history: bool = False) -> Any:
    """Create the named relay actor on the driver's node (0 CPUs, so it never blocks jobs);
    ``keep_history``: keep every config's step metrics until read (:meth:`~CoordinatorActor.history`)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(CoordinatorActor)
        .options(
            name=name,
            num_cpus=0,
            max_concurrency=1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=True),
        )
        .remote(keep_history=keep_history)
    )


__all__ = ["CoordinatorActor", "start_relay"]
