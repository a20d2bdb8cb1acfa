"""The sweep directory, the interface between a run and its readers (DESIGN decision 9).

* :mod:`plora.sweepdir.schema` -- files, table columns and dtypes, statuses, the layout version;
* :mod:`plora.sweepdir.store` -- :class:`SweepStore`, the atomic writer (and ``--resume``'s reader);
* :mod:`plora.sweepdir.lock` -- one writer per sweep directory (the lock ``plora sweep`` holds);
* :mod:`plora.sweepdir.reader` -- tolerant readers into DataFrames (:mod:`plora.analysis` uses them);
* :mod:`plora.sweepdir.decisions` -- ``decisions.jsonl`` parsed once per version, a plan
  decision's jobs (listed, or in the plan file it names).

The schema imports nothing heavy; the reader and the store (pandas) load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from plora.sweepdir.schema import SCHEMA_VERSION, ConfigStatus, JobStatus

_LAZY = {
    "SUCCESS_STATUSES": "plora.sweepdir.reader",
    "SWEEP_FILES": "plora.sweepdir.reader",
    "check_sweep_dir": "plora.sweepdir.reader",
    "read_decision_records": "plora.sweepdir.reader",
    "read_decisions": "plora.sweepdir.reader",
    "decision_jobs": "plora.sweepdir.decisions",
    "read_jobs": "plora.sweepdir.reader",
    "read_metrics": "plora.sweepdir.reader",
    "read_plan": "plora.sweepdir.reader",
    "read_results": "plora.sweepdir.reader",
    "read_sweep": "plora.sweepdir.reader",
    "SweepStore": "plora.sweepdir.store",
    "check_out_dir": "plora.sweepdir.store",
    "create_sweep_dir": "plora.sweepdir.store",
    "SweepLock": "plora.sweepdir.lock",
    "SweepLockedError": "plora.sweepdir.lock",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'plora.sweepdir' has no attribute {name!r}")


__all__ = ["SCHEMA_VERSION", "ConfigStatus", "JobStatus", *sorted(_LAZY)]
