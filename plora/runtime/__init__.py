"""The Ray runtime: run a sweep's packed jobs, watch them, re-plan as they end.

* :func:`run_sweep` (:mod:`.sweep`) -- what ``plora sweep`` calls: validate, create the sweep
  dir, run jobs on resident worker groups, feed the coordinator, ``--resume``.
* :class:`Coordinator` (:mod:`.coordinator`) -- the event-driven brain (no Ray): config queue,
  plan, free GPUs, refits, re-plans, refills, retries, OOM splits; every decision logged.
* :mod:`.group` / :mod:`.worker` -- a resident worker group = placement group of d GPU bundles,
  one :class:`~.worker.PackWorker` per GPU holding the base model (``plora.engine.PackSession``)
  for every job booked on those GPUs.
* :mod:`.measure` -- streamed step times and overhead seconds the cost model is refit from.
* :mod:`.monitor` -- Ray connection, GPU pool checks, the relay actor between workers and the
  coordinator.
* :class:`SweepStore` (:mod:`.store`) -- the sweep directory (Parquet/JSON, atomic writes).

Submodules load lazily: ``import plora.runtime`` does not import Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Coordinator": "plora.runtime.coordinator",
    "ConfigStatus": "plora.runtime.records",
    "Decision": "plora.runtime.records",
    "FailureKind": "plora.runtime.records",
    "JobSpec": "plora.runtime.records",
    "JobStatus": "plora.runtime.records",
    "StaticSource": "plora.runtime.records",
    "RunOptions": "plora.runtime.sweep",
    "SweepSummary": "plora.runtime.sweep",
    "run_sweep": "plora.runtime.sweep",
    "SweepStore": "plora.sweepdir.store",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'plora.runtime' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
