"""The Ray runtime: run a sweep's packed jobs, watch them, re-plan as they end.

:func:`run_sweep` (:mod:`.driver`) is what ``plora sweep`` calls; :class:`Coordinator`
(:mod:`.coordinator`) is its Ray-free brain. ARCHITECTURE.md lists the modules by role and
follows one job through them ("A job's life"). Submodules load lazily: ``import plora.runtime``
does not import Ray.
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
