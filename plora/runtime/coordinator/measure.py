"""What a sweep measured while it ran: packed steps and the seconds around them.

:class:`Measurements` collects, from the step reports workers stream and the outcomes of finished
jobs, the two kinds of evidence the coordinator refits its cost model from:

* **steps** -- per job and pack composition, the measured packed steps (each job's first step,
  the warm-up, is skipped): ``{"job_id", "config_ids", "gpus", "strategy", "device", "steps":
  [{"time_s", "seq_len", "peak_memory_bytes"}]}``, what :func:`plora.runtime.coordinator.costs.refit_cost`
  takes;
* **overheads** -- :class:`~plora.cost.overheads.OverheadSample` s: ``worker_start`` and
  ``model_load`` per worker group (the start counts the first job's first-step excess over its
  second step too: the packed kernels' JIT compilation, once per worker process), ``job_start`` per job, ``eval`` (the eval-loss forward) or
  ``generate`` (what a task metric adds on top of it) per config with count = eval rows,
  ``export`` per config (the seconds of it on the job's critical path,
  ``JobTimings.export_critical_s``: snapshots and waits for background writes), ``checkpoint``
  per train-state write.

Calibration: once ``calibration_steps`` steps have been measured the coordinator refits and
re-plans, so the plan a user watches is made from this machine's speed, not from defaults.
Everything here is JSON (it is saved in ``state.json`` for ``--resume``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from plora.cost.overheads import EvalMetric, OverheadKind, OverheadSample
from plora.engine.api import PackOutcome, StepReport
from plora.sweepdir.tracked import TrackedList


class Measurements:
    """Step and overhead samples of one sweep.

    Args:
        calibration_steps: Measured steps after which :meth:`add_reports` says "calibrate now"
            (once per sweep; 0 disables it).
        max_steps_per_pack: Steps kept per (job, pack composition).
    """

    def __init__(self, *, calibration_steps: int = 3, max_steps_per_pack: int = 16) -> None:
        self.calibration_steps = calibration_steps
        self.max_steps_per_pack = max_steps_per_pack
        self.steps: TrackedList[dict[str, Any]] = TrackedList()
        self.overheads: list[OverheadSample] = []
        self._overhead_rows: TrackedList[dict[str, Any]] = TrackedList()  # them, as saved
        self.calibrated = calibration_steps <= 0
        self._seen: dict[str, int] = {}
        self._index: dict[tuple[str, tuple[str, ...]], int] = {}
        self._first_steps: dict[str, list[float]] = {}
        self._pending_starts: list[float] = []

    @property
    def num_steps(self) -> int:
        return sum(len(m["steps"]) for m in self.steps)

    def add_reports(
        self, job_id: str, reports: Sequence[StepReport], *, gpus: int, strategy: str | None
    ) -> bool:
        """Record a job's streamed steps; True when the sweep should calibrate now (once)."""
        for report in reports:
            seen = self._seen.get(job_id, 0) + 1
            self._seen[job_id] = seen
            if seen <= 2:
                self._first_steps.setdefault(job_id, []).append(float(report.profile.time_s))
            if seen == 1:
                continue  # warm-up: allocations, kernel compilation, autotuning
            ids = tuple(sorted(report.config_ids))
            key = (job_id, ids)
            if key not in self._index:
                self._index[key] = len(self.steps)
                self.steps.append(
                    {
                        "job_id": job_id,
                        "config_ids": list(ids),
                        "gpus": gpus,
                        "strategy": strategy,
                        "device": report.device,
                        "steps": [],
                    }
                )
            index = self._index[key]
            entry = self.steps[index]
            if len(entry["steps"]) < self.max_steps_per_pack:
                p = report.profile
                entry["steps"].append(
                    {
                        "time_s": float(p.time_s),
                        "seq_len": int(p.seq_len),
                        "peak_memory_bytes": int(p.peak_memory_bytes),
                    }
                )
                self.steps.touch(index)  # changed in place: the state's writer is told
        if not self.calibrated and self.num_steps >= self.calibration_steps:
            self.calibrated = True
            return True
        return False

    def add_group_ready(self, *, ready_s: float, load_s: float) -> None:
        """A worker group came up: ``ready_s`` from request to loaded model, ``load_s`` of it
        in the engine's load. Its ``worker_start`` sample waits for the group's first job
        (:meth:`add_outcome`), which adds the first step's compile time to it."""
        self._pending_starts.append(max(0.0, ready_s - load_s))
        self._add(OverheadKind.MODEL_LOAD, load_s)

    def add_outcome(
        self,
        outcome: PackOutcome,
        *,
        eval_rows: int,
        metric: EvalMetric | str = EvalMetric.NONE,
        eval_s_per_row: float = 0.0,
    ) -> None:
        """A finished job's timings: its set-up, each config's evaluation, and its exports'
        critical-path seconds (one sample per job, count = adapters exported).

        A config's eval seconds cover the loss forward and the task metric together: with
        ``metric`` none they are an ``eval`` sample; otherwise the loss part the cost model
        predicts (``eval_s_per_row`` per row) is taken off and the rest is a ``generate`` sample,
        so a later sweep with another metric plans from the right parts.
        """
        t = outcome.timings
        first = self._first_steps.pop(outcome.job_id, [])  # needed by this outcome only
        if t.load_s > 0 and self._pending_starts:  # the first job of a cold worker group
            compile_s = max(0.0, first[0] - first[1]) if len(first) >= 2 else 0.0
            self._add(OverheadKind.WORKER_START, self._pending_starts.pop(0) + compile_s)
        self._add(OverheadKind.JOB_START, t.start_s)
        generates = EvalMetric(metric) is not EvalMetric.NONE
        for r in outcome.results.values():
            if r.eval_s > 0 and eval_rows > 0:
                if generates:
                    rest = max(0.0, r.eval_s - eval_rows * eval_s_per_row)
                    self._add(OverheadKind.GENERATE, rest, count=eval_rows)
                else:
                    self._add(OverheadKind.EVAL, r.eval_s, count=eval_rows)
        if t.exports:  # only what the job waited for: the writes overlap its eval and steps
            self._add(OverheadKind.EXPORT, t.export_critical_s, count=t.exports)
        if t.checkpoints:
            self._add(OverheadKind.CHECKPOINT, t.checkpoint_s, count=t.checkpoints)

    def _add(self, kind: OverheadKind, seconds: float, *, count: int = 1) -> None:
        sample = OverheadSample(kind=kind, seconds=float(seconds), count=count)
        self.overheads.append(sample)
        self._overhead_rows.append(sample.to_dict())

    def get_state(self, *, live: bool = False) -> dict[str, Any]:
        """JSON-able state; ``live``: the growing lists themselves (tracked, for the state's
        writer: :meth:`plora.runtime.coordinator.state.CoordinatorState.get_state`), else
        copies."""
        return {
            "steps": self.steps if live else list(self.steps),
            "overheads": self._overhead_rows if live else list(self._overhead_rows),
            "calibrated": self.calibrated,
            "pending_starts": list(self._pending_starts),
            "first_steps": {k: list(v) for k, v in self._first_steps.items()},
        }

    def set_state(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        if not isinstance(state, Mapping):  # sweeps saved before overheads were measured
            state = {"steps": state, "calibrated": True}
        self.steps = TrackedList(dict(m) for m in state.get("steps", ()))
        self.overheads = [OverheadSample.from_dict(o) for o in state.get("overheads", ())]
        self._overhead_rows = TrackedList(o.to_dict() for o in self.overheads)
        self.calibrated = bool(state.get("calibrated", self.calibrated))
        self._index = {(m["job_id"], tuple(m["config_ids"])): i for i, m in enumerate(self.steps)}
        self._seen = {}
        self._pending_starts = [float(v) for v in state.get("pending_starts", ())]
        self._first_steps = {
            k: [float(x) for x in v] for k, v in state.get("first_steps", {}).items()
        }


__all__ = ["Measurements"]
