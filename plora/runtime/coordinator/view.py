"""What the coordinator shows of a running sweep: configs per status, and the snapshot the
progress display (:mod:`plora.runtime.progress`) and the relay's readers get.

Functions of the coordinator's state (:class:`~plora.runtime.coordinator.state.CoordinatorState`);
they read it and change nothing. The ETA is the latest predicted end of the plan in
force: the pending jobs' and the running jobs' (re-timed as the cost model is refit and steps
are done, :func:`plora.runtime.coordinator.scheduling.retime_running`), less the sweep clock.
"""

from __future__ import annotations

from typing import Any

from plora.runtime.coordinator.state import CoordinatorState
from plora.runtime.records import ConfigStatus


def counts(state: CoordinatorState) -> dict[str, int]:
    """Number of configs per :class:`ConfigStatus`, plus running jobs and busy GPUs."""
    out = {str(s): state.configs.count(s) for s in ConfigStatus}
    out["jobs_running"] = len(state.jobs.running)
    out["gpus_busy"] = state.num_gpus - len(state.jobs.free_gpus)
    return out


def snapshot(state: CoordinatorState) -> dict[str, Any]:
    """A small JSON-able view for the progress display: counts, running jobs (planned and
    actual start, planned end), the ETA, the plan in force and the failed configs' errors."""
    running = {
        j: {"config_ids": list(r.config_ids), "gpus": r.spec.gpus, "started_s": r.started_s,
            "planned_start_s": getattr(r.plan_job, "start_s", None),
            "planned_end_s": getattr(r.plan_job, "end_s", None)}
        for j, r in state.jobs.running.items()
    }  # fmt: skip
    eta = None
    plan_end = [getattr(j, "end_s", 0.0) for j in state.jobs.pending]
    pending_end = max(plan_end) if plan_end else None
    plan_end += [getattr(r.plan_job, "end_s", 0.0) for r in state.jobs.running.values()]
    if plan_end:
        eta = max(0.0, max(plan_end) - state.now())
    return {
        "now_s": state.now(),
        "num_gpus": state.num_gpus,
        "counts": counts(state),
        "running": running,
        "eta_s": eta,
        "pending_end_s": pending_end,
        "plan_index": state.plans.count,
        "plan_trigger": state.plans.trigger,
        "done": state.is_done(),
        "failed": {
            c: state.configs.results.get(c, {}).get("error")
            for c in state.configs.ids_in(ConfigStatus.FAILED)
        },
    }


__all__ = ["counts", "snapshot"]
