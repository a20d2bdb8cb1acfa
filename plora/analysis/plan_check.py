"""How well a sweep's first plan foretold the sweep, phase by phase, from its directory.

The sweep's clock starts at its first plan (``decisions.jsonl``; Ray's start and the driver's
set-up before it are in neither number) and stops at ``sweep_done``. The plan's makespan is
set against that time, and so are its parts that the records name: when the worker group was
planned to be ready (``start_workers``) against when it was (``workers_ready``), and each
first-plan job's cost-model terms (``start_job``'s ``planned_terms``) against what
``jobs.parquet`` measured. A miss then says where it came from::

    from plora.analysis.plan_check import plan_check
    print(plan_check("runs/quickstart").describe())
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from plora.sweepdir.decisions import decision_jobs
from plora.sweepdir.store import SweepStore

#: Job terms compared (``plora.cost.jobterms.JobTimeTerms`` and ``jobs.parquet`` columns).
TERMS = ("train_s", "eval_s", "checkpoint_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanCheck:
    """A sweep's first plan against the sweep as it ran (seconds on the coordinator's clock)."""

    planned_s: float
    """The first plan's makespan."""
    measured_s: float
    """From the first plan to ``sweep_done``."""
    planned_ready_s: float | None = None
    """When the first worker group was planned to be ready, after the plan (None: none was
    starting)."""
    ready_s: float | None = None
    """When it was."""
    terms: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per job term, summed over the jobs the first plan started: (planned, measured)."""

    @property
    def ratio(self) -> float:
        """Planned over measured (1: the plan was right)."""
        return self.planned_s / self.measured_s if self.measured_s > 0 else float("inf")

    def describe(self) -> str:
        """One line: the makespan, then each part as planned / measured."""
        parts = [f"plan {self.planned_s:.2f} s / measured {self.measured_s:.2f} s "
                 f"({self.ratio:.2f}x)"]  # fmt: skip
        if self.planned_ready_s is not None and self.ready_s is not None:
            parts.append(f"workers ready {self.planned_ready_s:.2f} / {self.ready_s:.2f} s")
        parts += [f"{k.removesuffix('_s')} {p:.2f} / {m:.2f} s" for k, (p, m) in self.terms.items()]
        return "; ".join(parts)


def plan_check(out: str | os.PathLike[str]) -> PlanCheck:
    """The first plan of the sweep in ``out`` against the sweep's measured time and phases.

    A resumed sweep is judged by its first run, which must have finished (a later run plans
    from where the interrupted one stopped, on its own clock).

    Raises:
        ValueError: the first run has no plan or did not finish (no ``sweep_done`` decision).
    """
    store = SweepStore(out)
    decisions = store.read_decisions()  # parsed once per version: ``plora status`` read it too
    resumed = next((i for i, d in enumerate(decisions) if d["kind"] == "resume"), None)
    decisions = decisions[:resumed]  # the first run's (a resumed run has a clock of its own)
    plan = next((d for d in decisions if d["kind"] == "plan"), None)
    done = next((d for d in decisions if d["kind"] == "sweep_done"), None)
    if plan is None or done is None:
        missing = "plan" if plan is None else "sweep_done"
        ended = "" if resumed is None else " before it was resumed"
        raise ValueError(
            f"{store.root}: the sweep's first run has no {missing} decision{ended}; check a "
            "sweep that ran to its end in one go"
        )
    t0 = plan["time_s"]
    first_jobs = {job["job_id"] for job in decision_jobs(store.root, plan)}
    starting = next((d for d in decisions if d["kind"] == "start_workers"), None)
    ready = next((d for d in decisions if d["kind"] == "workers_ready"), None)
    planned_ready = (
        max(0.0, starting["inputs"]["ready_at_s"] - t0)
        if starting is not None and "ready_at_s" in starting["inputs"]
        else None
    )
    planned = {k: 0.0 for k in TERMS}
    started = set()
    for d in decisions:
        terms = d["inputs"].get("planned_terms") if d["kind"] == "start_job" else None
        if terms and d.get("job_id") in first_jobs and d.get("job_id") not in started:
            started.add(d["job_id"])  # its first attempt
            for k in TERMS:
                planned[k] += float(terms.get(k, 0.0))
    measured = {k: 0.0 for k in TERMS}
    if started:
        jobs = store.read_jobs()
        for k in TERMS:
            measured[k] = float(jobs.loc[jobs["job_id"].isin(started), k].sum())
    return PlanCheck(
        planned_s=float(plan["inputs"]["makespan_s"]),
        measured_s=float(done["time_s"] - t0),
        planned_ready_s=planned_ready,
        ready_s=None if ready is None else float(ready["time_s"] - t0),
        terms={k: (planned[k], measured[k]) for k in TERMS} if started else {},
    )


__all__ = ["PlanCheck", "plan_check"]
