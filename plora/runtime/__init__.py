"""The Ray runtime: run a sweep's packed jobs, watch them, re-plan as they end.

* :func:`run_sweep` (:mod:`.driver`) -- what ``plora sweep`` calls: validate, create the sweep
  dir, run jobs on resident worker groups, feed the coordinator, ``--resume``.
* :class:`Coordinator` (:mod:`.coordinator`) -- the event-driven brain (no Ray): config queue,
  plan, free GPUs, refits, re-plans, refills, retries, OOM splits; every decision logged.
* :mod:`.group` / :mod:`.worker` -- a resident worker group = placement group of d GPU bundles,
  one :class:`~.worker.PackWorker` per GPU holding the base model (``plora.engine.PackSession``)
  for every job booked on those GPUs.
* :mod:`.measure` -- streamed step times and overhead seconds the cost model is refit from.
* :mod:`.cluster` -- Ray connection and GPU pool checks; :mod:`.relay` -- the relay actor between
  workers and the coordinator.
* :mod:`.refill` -- which queued configs refill a running job, how an OOM pack is split;
  :mod:`.costs` -- the coordinator's questions to the cost model (estimates, refits, profiles);
  :mod:`.ledger` -- the rows it writes; :mod:`.records` -- its typed decisions and job specs.
* The sweep directory it writes is :mod:`plora.sweepdir` (:class:`~plora.sweepdir.SweepStore`).

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
    "RunOptions": "plora.runtime.options",
    "SweepSummary": "plora.runtime.driver",
    "run_sweep": "plora.runtime.driver",
    "SweepStore": "plora.sweepdir.store",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'plora.runtime' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
