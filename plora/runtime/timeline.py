"""The timeline of a sweep: seconds from the process start to each of its phases.

``plora sweep`` marks, on one clock whose zero is the start of its process (the interpreter's,
imports included: ``psutil``'s create time), when each phase of the sweep was reached:

=============  ===========================================================================
phase          reached when
=============  ===========================================================================
``ray``        Ray is connected (a local one started)
``inputs``     the first plan is made: dataset checked and tokenized, cost model built, the
               sweep directory (base model files) written, the planner run
``workers``    the first worker group holds the base model (its process started, the engine
               imported, the model and dataset loaded, kernels patched)
``first_step`` the first packed step of any job ended (kernels' compilation, graph capture
               and the job's set-up before it)
``last_step``  the last packed step of any job ended
``eval``       the last evaluation of finished adapters ended
``export``     the last adapter export was written (its job waited for it)
``exit``       the sweep is over: workers stopped, Ray shut down, its records written
=============  ===========================================================================

``ray`` <= ``inputs`` and ``ray`` <= ``workers``; ``inputs`` and ``workers`` overlap (workers
load while the driver prepares and plans); from ``first_step`` on the phases are in order.
The driver's own marks read :func:`time.monotonic`; a worker's (another process, maybe another
host) arrive as wall-clock times over the existing report paths (``WorkerInfo.loaded_at``,
``JobTimings.started_at`` plus offsets measured with a monotonic clock on the worker) and are
placed on the same axis through the process start's wall-clock time.

The timeline goes to ``decisions.jsonl`` (a ``timeline`` record), ``SweepSummary.timeline``
and the last line of ``plora sweep`` (:func:`timeline_line`). Pure: no Ray, no torch.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class Phase(StrEnum):
    """A phase of a sweep, in the order :func:`timeline_line` shows them."""

    RAY = "ray"
    INPUTS = "inputs"
    WORKERS = "workers"
    FIRST_STEP = "first_step"
    LAST_STEP = "last_step"
    EVAL = "eval"
    EXPORT = "export"
    EXIT = "exit"


#: Phases whose earliest mark counts (the rest keep their latest).
EARLIEST: frozenset[Phase] = frozenset({Phase.RAY, Phase.INPUTS, Phase.WORKERS, Phase.FIRST_STEP})

#: Notes: finer marks beside the phases (seconds from the process start).
NOTE_DRIVER = "driver"
"""``run_sweep`` was called: the CLI's imports and the sweep file's checks before it."""
NOTE_PREPARED = "prepared"
"""The input checks ended on their thread (tokenizer, dataset, cost model, fits), beside Ray."""


def process_start_wall() -> float:
    """Wall-clock time (epoch seconds) this process started, to ~10 ms (``psutil``); the
    import of this module where ``psutil`` cannot tell."""
    try:
        import psutil

        return float(psutil.Process(os.getpid()).create_time())
    except Exception:  # psutil unavailable or no /proc: the module's import is the next best
        return _IMPORTED_WALL


_IMPORTED_WALL = time.time()


@dataclasses.dataclass(kw_only=True, slots=True)
class Timeline:
    """Marks of a sweep's phases, in seconds from :attr:`start_wall` (the process start)."""

    start_wall: float
    """Epoch seconds of the process start."""
    start_mono: float
    """:func:`time.monotonic` at the process start (the driver's marks use it)."""
    at: dict[Phase, float] = dataclasses.field(default_factory=dict)
    """Seconds from the process start to each phase reached so far."""
    notes: dict[str, float] = dataclasses.field(default_factory=dict)
    """Finer marks (:data:`NOTE_DRIVER`, :data:`NOTE_PREPARED`), seconds from the start."""

    @classmethod
    def from_process_start(cls, start_wall: float | None = None) -> Timeline:
        """A timeline whose zero is this process's start (or ``start_wall``, epoch seconds)."""
        wall, mono = time.time(), time.monotonic()
        start = process_start_wall() if start_wall is None else float(start_wall)
        return cls(start_wall=start, start_mono=mono - (wall - start))

    def now(self) -> float:
        """Seconds from the process start to now."""
        return time.monotonic() - self.start_mono

    def mark(self, phase: Phase, at_s: float | None = None) -> None:
        """``phase`` reached at ``at_s`` seconds from the start (default now): the earliest
        mark counts for the :data:`EARLIEST` phases, the latest for the rest."""
        t = self.now() if at_s is None else float(at_s)
        old = self.at.get(phase)
        if old is None or (t < old if phase in EARLIEST else t > old):
            self.at[phase] = t

    def mark_wall(self, phase: Phase, wall: float) -> None:
        """``phase`` reached at the wall-clock time ``wall`` (epoch seconds: a worker's)."""
        self.mark(phase, wall - self.start_wall)

    def note(self, name: str, at_s: float | None = None) -> None:
        """A finer mark ``name`` at ``at_s`` (default now); the first one counts."""
        self.notes.setdefault(name, self.now() if at_s is None else float(at_s))

    def mark_job(self, timings: Any) -> None:
        """A finished job's steps, evaluation and export (a
        :class:`~plora.engine.api.JobTimings`: ``started_at`` on the worker's wall clock,
        the rest offsets from it; a job without ``started_at`` marks nothing)."""
        started = getattr(timings, "started_at", None)
        if not started:
            return
        for phase, name in (
            (Phase.FIRST_STEP, "first_step_s"),
            (Phase.LAST_STEP, "last_step_s"),
            (Phase.EVAL, "eval_end_s"),
            (Phase.EXPORT, "export_end_s"),
        ):
            offset = getattr(timings, name, None)
            if offset is not None:
                self.mark_wall(phase, started + offset)

    def to_dict(self) -> dict[str, float]:
        """``{phase: seconds}`` in :class:`Phase` order (phases not reached left out)."""
        return {str(p): round(self.at[p], 3) for p in Phase if p in self.at}


def timeline_line(phases: Mapping[str, float]) -> str:
    """One line for the end of ``plora sweep``: ``timeline: ray 3.1s · inputs 5.0s · ...``
    (seconds from the process start; phases not reached left out)."""
    shown = [f"{str(p).replace('_', ' ')} {phases[str(p)]:.1f}s" for p in Phase if str(p) in phases]
    return "timeline: " + (" · ".join(shown) if shown else "no phase reached")


__all__ = [
    "EARLIEST",
    "NOTE_DRIVER",
    "NOTE_PREPARED",
    "Phase",
    "Timeline",
    "process_start_wall",
    "timeline_line",
]
