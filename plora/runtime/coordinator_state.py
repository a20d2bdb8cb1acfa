"""What the coordinator's helpers see of it: :class:`CoordinatorState`, and its running jobs.

:class:`~plora.runtime.coordinator.Coordinator` handles the events; its helpers -- the searcher
side (:mod:`plora.runtime.intake`), the planning and launching decisions
(:mod:`plora.runtime.scheduling`), job ends (:mod:`plora.runtime.endings`), the records
(:mod:`plora.runtime.recording`), the status view (:mod:`plora.runtime.view`) and its saved
state (:mod:`plora.runtime.resume`) -- are functions of the coordinator typed against this
protocol, so they import no coordinator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from plora.config import LoRAConfig
from plora.runtime.measure import Measurements
from plora.runtime.records import (
    ConfigSource,
    ConfigStatus,
    Decision,
    DecisionRecord,
    JobSpec,
    JobStatus,
)
from plora.runtime.residency import Residency
from plora.sweepdir.store import SweepStore

#: Statuses a config ends in.
FINISHED = (ConfigStatus.DONE, ConfigStatus.STOPPED, ConfigStatus.FAILED)


@dataclasses.dataclass(kw_only=True, slots=True)
class RunningJob:
    """A running job attempt (mutable coordinator bookkeeping)."""

    spec: JobSpec
    plan_job: Any
    """The planner's Job (``dataclasses.replace``-d as the pack changes) for ``replan``."""
    config_ids: list[str]
    started_s: float
    node: str | None = None
    peak_pack: int = 0
    stop_sent: set[str] = dataclasses.field(default_factory=set)
    add_pending: list[str] = dataclasses.field(default_factory=list)


class CoordinatorState(Protocol):
    """The coordinator's state and the few methods its helpers call (see its ``__init__``)."""

    cost: Any
    num_gpus: int
    source: ConfigSource
    planner: Any
    store: SweepStore | None
    early_stop: Any
    max_retries: int
    ask_batch: int
    metric_name: str | None
    configs: dict[str, LoRAConfig]
    status: dict[str, ConfigStatus]
    progress: dict[str, int]
    results: dict[str, dict[str, Any]]
    pending: list[Any]
    forced: list[JobSpec]
    running: dict[str, RunningJob]
    free_gpus: set[int]
    measure: Measurements
    residency: Residency
    job_rows: list[dict[str, Any]]
    decisions: list[DecisionRecord]
    _clock: Callable[[], float]
    _t0: float
    _offset: float
    _flush_s: float
    _last_flush: float
    _write_batch: int
    _unwritten: bool
    _next_job: int
    _plans: int
    _plan_trigger: str
    _need_plan: bool
    _stop_requests: set[str]
    _attempts: dict[str, int]
    _reporter: dict[str, tuple[str, int]]
    _by_hparams: dict[str, str]
    _aliases: dict[str, list[str]]

    def now(self) -> float: ...

    def queued_ids(self) -> list[str]: ...

    def is_done(self) -> bool: ...

    def get_state(self) -> dict[str, Any]: ...

    def _decide(
        self,
        kind: Decision,
        *,
        job_id: str | None = None,
        config_ids: Sequence[str] = (),
        **inputs: Any,
    ) -> DecisionRecord: ...

    def _starting_idle(self) -> list[Any]: ...

    def _ready_at(self, gpu_ids: Sequence[int]) -> float: ...

    def _new_job_id(self) -> str: ...

    def _job_row(
        self,
        run: RunningJob,
        *,
        status: JobStatus,
        end: float | None,
        timings: Mapping[str, Any] | None = None,
    ) -> None: ...

    def _persist(self) -> None: ...

    def _result_row(self, cid: str, *, status: ConfigStatus, **r: Any) -> dict[str, Any]: ...

    def _tell(self, config_id: str, metrics: dict[str, Any]) -> None: ...


__all__ = ["FINISHED", "CoordinatorState", "RunningJob"]
