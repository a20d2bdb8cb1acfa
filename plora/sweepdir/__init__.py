"""The sweep directory, the interface between a run and its readers (DESIGN decision 9).

* :mod:`plora.sweepdir.schema` -- files, table columns and dtypes, the layout version;
* :mod:`plora.sweepdir.store` -- :class:`SweepStore`, the atomic writer (and ``--resume``'s reader);
* :mod:`plora.sweepdir.reader` -- tolerant readers into DataFrames (:mod:`plora.analysis` uses them).
"""

from plora.sweepdir.reader import (
    SUCCESS_STATUSES,
    SWEEP_FILES,
    check_sweep_dir,
    read_decisions,
    read_jobs,
    read_metrics,
    read_plan,
    read_results,
    read_sweep,
)
from plora.sweepdir.schema import SCHEMA_VERSION
from plora.sweepdir.store import SweepStore, check_out_dir, create_sweep_dir

__all__ = [
    "SCHEMA_VERSION",
    "SUCCESS_STATUSES",
    "SWEEP_FILES",
    "SweepStore",
    "check_out_dir",
    "check_sweep_dir",
    "create_sweep_dir",
    "read_decisions",
    "read_jobs",
    "read_metrics",
    "read_plan",
    "read_results",
    "read_sweep",
]
