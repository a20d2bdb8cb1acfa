"""The coordinator: a Ray-free, event-driven state machine that plans, launches, watches and
re-plans a sweep's jobs (:class:`Coordinator`, in :mod:`.machine`).

Its state is a few typed objects (:mod:`.state`) and its handlers are grouped by what they
decide; ARCHITECTURE.md ("A job's life", "The coordinator") says which module holds what.
Nothing here imports Ray or torch (``scripts/import_graph.py`` checks it).
"""

from plora.runtime.coordinator.machine import Coordinator
from plora.runtime.coordinator.state import FINISHED, RunningJob

__all__ = ["FINISHED", "Coordinator", "RunningJob"]
