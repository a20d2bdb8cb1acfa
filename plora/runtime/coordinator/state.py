"""The coordinator's state: a few small typed objects, each with the methods that keep it.

* :class:`SweepClock` -- seconds since the sweep started (continued across ``--resume``);
* :class:`ConfigBook` -- every config, where it stands, its progress and result, the stops
  asked, and the ids a searcher suggested again for a known config (aliases);
* :class:`JobBook` -- the plan's jobs not started, the forced ones (retries, OOM halves,
  resumed jobs), the running ones (:class:`RunningJob`) and the free GPUs;
* :class:`PlanState` -- how many plans were made, the last one's trigger, whether one is due;
* :class:`Journal` -- the decision log and the rows written to the sweep directory;
* :class:`CoordinatorState` -- all of them, with the sweep's settings, the cost model and the
  planner: what the handlers (:mod:`.intake`, :mod:`.scheduling`, :mod:`.endings`,
  :mod:`.pause`, :mod:`.recording`, :mod:`.resume`, :mod:`.view`) receive.

* :class:`PauseBook` -- the pauses asked and not yet delivered or written
  (:mod:`.pause` handles them).

Resident worker groups (:class:`~plora.runtime.coordinator.residency.Residency`) and
measurements (:class:`~plora.runtime.coordinator.measure.Measurements`) keep their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from plora.config import LoRAConfig
from plora.cost import CostModel
from plora.planner.types import Job, Plan
from plora.runtime.coordinator.ledger import JobRows, result_row, spec_state
from plora.runtime.coordinator.measure import Measurements
from plora.runtime.coordinator.residency import Residency
from plora.runtime.coordinator.status_index import StatusIndex
from plora.runtime.records import (
    ConfigSource,
    ConfigStatus,
    Decision,
    DecisionRecord,
    JobSpec,
    encode_state,
)
from plora.sweepdir.store import SweepStore
from plora.sweepdir.tracked import MappedView, TrackedDict, TrackedList


def _text(_config_id: str, status: ConfigStatus) -> str:
    return str(status)


#: Statuses a config ends in.
FINISHED = (ConfigStatus.DONE, ConfigStatus.STOPPED, ConfigStatus.FAILED)


class SweepClock:
    """Seconds since the sweep started, from ``clock`` (continues across ``--resume``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.t0 = clock()
        self.offset = 0.0
        """Seconds the sweep had run before this process (``--resume``)."""

    def now(self) -> float:
        """Seconds since the sweep started."""
        return self.offset + self.clock() - self.t0

    def restart(self, elapsed_s: float) -> None:
        """Continue a sweep that had run ``elapsed_s`` seconds (``--resume``)."""
        self.offset = float(elapsed_s)
        self.t0 = self.clock()


@dataclasses.dataclass(kw_only=True, slots=True)
class RunningJob:
    """A running job attempt (mutable coordinator bookkeeping)."""

    spec: JobSpec
    plan_job: Job | None
    """The planner's Job (``dataclasses.replace``-d as the pack changes) for ``replan``."""
    config_ids: list[str]
    started_s: float
    node: str | None = None
    peak_pack: int = 0
    stop_sent: set[str] = dataclasses.field(default_factory=set)
    add_pending: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(kw_only=True, slots=True)
class ConfigBook:
    """Every config the source gave, where it stands and how it ended."""

    by_id: dict[str, LoRAConfig] = dataclasses.field(default_factory=dict)
    status: TrackedDict[str, ConfigStatus] = dataclasses.field(default_factory=TrackedDict)
    progress: TrackedDict[str, int] = dataclasses.field(default_factory=TrackedDict)
    """Config id -> its last reported step."""
    results: TrackedDict[str, dict[str, Any]] = dataclasses.field(default_factory=TrackedDict)
    """Config id -> its ``results.parquet`` row (a row is replaced, never changed in place)."""
    rows: TrackedList[dict[str, Any]] = dataclasses.field(default_factory=TrackedList)
    """Each config of :attr:`by_id` as ``state.json`` holds it (``LoRAConfig.to_dict``), in
    the same order: made once, when the config comes. The books above are tracked
    (:mod:`plora.sweepdir.tracked`): a write of ``state.json`` reads only what changed."""
    stop_requests: set[str] = dataclasses.field(default_factory=set)
    """Running configs asked to stop (their job stops them at its next poll)."""
    by_hparams: dict[str, str] = dataclasses.field(default_factory=dict)
    """Hyperparameter fingerprint -> the config id first given with it."""
    aliases: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """Config id -> later suggestions of the same hyperparameters, not told yet."""
    index: StatusIndex = dataclasses.field(default_factory=StatusIndex, repr=False)
    """Each status's configs, kept from :attr:`status`'s changes."""

    def ids_in(self, status: ConfigStatus) -> list[str]:
        """Configs in ``status``, in arrival order (cost: the configs that changed status since
        the last call, and the list returned)."""
        return self.index.ids(self.status, status)

    def queued_ids(self) -> list[str]:
        """Configs waiting for a job, in arrival order."""
        return self.ids_in(ConfigStatus.QUEUED)

    def count(self, status: ConfigStatus) -> int:
        """How many configs are in ``status``."""
        return self.index.count(self.status, status)

    def all_finished(self) -> bool:
        """Every config is done, stopped or failed."""
        return all(not self.count(s) for s in ConfigStatus if s not in FINISHED)

    def is_finished(self, config_id: str) -> bool:
        """The config is known and done, stopped or failed."""
        return self.status.get(config_id) in FINISHED

    def admit(self, config: LoRAConfig) -> str | None:
        """Take a new config, queued; or, when a known config has its hyperparameters, record it
        as an alias of that one and return the known id."""
        first = self.by_hparams.get(config.fingerprint())
        if first is not None and first != config.config_id:
            self.aliases.setdefault(first, []).append(config.config_id)
            return first
        self.by_hparams[config.fingerprint()] = config.config_id
        self.by_id[config.config_id] = config
        self.rows.append(config.to_dict())
        self.status[config.config_id] = ConfigStatus.QUEUED
        return None

    def pop_aliases(self, config_id: str) -> list[str]:
        """The ids ``config_id`` was suggested again under, forgotten once returned (told)."""
        return self.aliases.pop(config_id, [])

    def restore(
        self,
        *,
        configs: Iterable[LoRAConfig],
        status: dict[str, ConfigStatus],
        progress: dict[str, int],
        results: dict[str, dict[str, Any]],
        stop_requests: Iterable[str],
        aliases: dict[str, list[str]],
    ) -> None:
        """Replace everything with a saved sweep's books (``--resume``)."""
        self.by_id = {c.config_id: c for c in configs}
        self.rows = TrackedList(c.to_dict() for c in self.by_id.values())
        self.status, self.progress = TrackedDict(status), TrackedDict(progress)
        self.results = TrackedDict(results)
        self.stop_requests = set(stop_requests)
        self.by_hparams = {c.fingerprint(): cid for cid, c in self.by_id.items()}
        self.aliases = aliases


@dataclasses.dataclass(kw_only=True, slots=True)
class JobBook:
    """The jobs: planned, forced, running; and the GPUs none of them holds."""

    pending: list[Job] = dataclasses.field(default_factory=list)
    """The plan's jobs not started yet, in plan order."""
    forced: list[JobSpec] = dataclasses.field(default_factory=list)
    """Retries, OOM halves, resumed jobs: launched before the plan's jobs."""
    running: dict[str, RunningJob] = dataclasses.field(default_factory=dict)
    free_gpus: set[int] = dataclasses.field(default_factory=set)
    next_job: int = 0
    """The number in the last job id given out."""
    attempts: dict[str, int] = dataclasses.field(default_factory=dict)
    """Job id -> its latest attempt (the ``attempt`` of its metric rows)."""

    def new_job_id(self) -> str:
        """A job id not given out before (``j0001``, ``j0002``, ...)."""
        self.next_job += 1
        return f"j{self.next_job:04d}"

    def forced_config_ids(self) -> set[str]:
        """The configs of the forced jobs (they are not planned again)."""
        return {c for s in self.forced for c in s.config_ids}

    def busy_gpus(self) -> set[int]:
        """GPUs a running job holds."""
        return {g for r in self.running.values() for g in r.spec.gpu_ids}

    def drop_config(self, config_id: str) -> None:
        """Take ``config_id`` out of the planned jobs (a job left empty goes)."""
        self.pending = [
            dataclasses.replace(j, config_ids=tuple(c for c in j.config_ids if c != config_id))
            if config_id in j.config_ids
            else j
            for j in self.pending
        ]
        self.pending = [j for j in self.pending if j.config_ids]

    def job_of(self, config_id: str) -> str | None:
        """The running job that trains ``config_id``, if any."""
        return next((j for j, r in self.running.items() if config_id in r.config_ids), None)


PACED_FROM_S = 1.0
"""Slow work of the driver (a re-plan, a refit) that took at least this long is paced
(:meth:`Pace.waits`); shorter work runs at every event that asks for it."""

PACE_SPACING = 4.0
"""Paced work waits until this many times its last seconds have passed since it ended: it takes
at most a fifth of the driver's time."""


@dataclasses.dataclass(slots=True)
class Pace:
    """How long one kind of the driver's slow work took last, and when it ended
    (``time.monotonic``: the driver's own time, not the sweep's clock). At 10,000 queued configs
    on 256 GPUs a re-plan takes about 10 s and a job ends every second or two: re-planning and
    refitting at each job end kept the driver busy with them (12 s a job end, 45 configs
    finished in the first 390 s: ``benchmarks/control_plane.py``, RESULTS.md)."""

    spent_s: float = 0.0
    ended_at: float = 0.0

    def waits(self) -> bool:
        """Whether the work should wait: it took :data:`PACED_FROM_S` or more, and ended less
        than :data:`PACE_SPACING` times that ago."""
        return (
            self.spent_s >= PACED_FROM_S
            and time.monotonic() - self.ended_at < PACE_SPACING * self.spent_s
        )

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time the work of the ``with`` block."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.ended_at = time.monotonic()
            self.spent_s = self.ended_at - started


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanState:
    """The plans made so far."""

    count: int = 0
    """Plans made (the next plan's index in the sweep directory)."""
    trigger: str = ""
    """What caused the last plan."""
    due: bool = False
    """Something changed (configs came, GPUs were freed, the cost model was refit): plan again."""
    pace: Pace = dataclasses.field(default_factory=Pace)
    """The last plan's seconds (:func:`.scheduling.plan_held`)."""
    held: str = ""
    """The trigger of a due plan held back (:func:`.scheduling.plan_held`); "" when none is."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Journal:
    """The decision log and the rows the sweep directory gets (kept in memory without a store).

    ``metrics.parquet`` rows are flushed at most every ``flush_s`` seconds (:attr:`last_flush`:
    the last time); :attr:`reporter` is each config's last reporting (job, attempt), so a step
    trained again by another attempt is logged as redone.
    """

    store: SweepStore | None = None
    decisions: list[DecisionRecord] = dataclasses.field(default_factory=list)
    job_rows: JobRows = dataclasses.field(default_factory=JobRows)
    flush_s: float = 5.0
    last_flush: float = -1e9
    reporter: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    done_logged: bool = False
    """The sweep's end was logged (once)."""
    write_batch: int = 0
    """Open :func:`~.recording.batched` blocks (the tables are written when the last ends)."""
    unwritten: bool = False
    """The state changed inside such a block and is not written yet."""

    def decide(
        self,
        kind: Decision,
        *,
        time_s: float,
        job_id: str | None = None,
        config_ids: Sequence[str] = (),
        **inputs: Any,
    ) -> DecisionRecord:
        """Log one decision with its inputs at ``time_s`` (to ``decisions.jsonl`` too)."""
        rec = DecisionRecord(
            kind=kind, time_s=time_s, job_id=job_id, config_ids=tuple(config_ids), inputs=inputs
        )
        self.decisions.append(rec)
        if self.store is not None:  # inside a batch: durable when the batch ends
            self.store.append_decision(rec.to_json_dict(), flush=not self.write_batch)
        return rec


@dataclasses.dataclass(kw_only=True, slots=True)
class PauseBook:
    """The coordinator's pauses in flight.

    A pause is *asked* (not yet delivered to the config's job), then *leaving* (delivered: the
    config is ``paused`` for the coordinator, but its worker writes its train-state at its next
    step boundary). A resume that comes while the state is not on disk yet *waits* for it, so
    the next pack never starts the config afresh.
    """

    asked: set[str] = dataclasses.field(default_factory=set)
    leaving: dict[str, str] = dataclasses.field(default_factory=dict)
    """Config id -> the job it is leaving."""
    waiting: set[str] = dataclasses.field(default_factory=set)
    """Resumes waiting for the config's train-state to be written."""
    stop_when_left: dict[str, str] = dataclasses.field(default_factory=dict)
    """Stops of leaving configs (config id -> reason), done once their row came."""
    since: dict[str, int] = dataclasses.field(default_factory=dict)
    """Config id -> its step as its pause was delivered: a train-state written for this
    pause is at least that far (one left by an earlier pause of the config is not)."""


class Planner(Protocol):
    """What the coordinator asks of the planner (``plora.planner`` itself, or a test's fake)."""

    def plan_sweep(
        self,
        configs: Sequence[LoRAConfig],
        cost: CostModel,
        num_gpus: int,
        *,
        resident: Sequence[Sequence[int]] | None = (),
    ) -> Plan: ...

    def replan(
        self,
        remaining: Sequence[LoRAConfig],
        free_gpus: int,
        running: Sequence[Job],
        now: float,
        cost: CostModel,
        num_gpus: int,
        *,
        resident: Sequence[Sequence[int]] | None = None,
    ) -> Plan: ...


class StepStopper(Protocol):
    """Early stopping inside packs (:class:`plora.tune.adapter_stopper.AdapterEarlyStopper`)."""

    def on_step(self, config_id: str, step: int, loss: float) -> bool:
        """Told a config's streamed step; True: stop the config now."""
        ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: Mapping[str, Any]) -> None: ...


@dataclasses.dataclass(kw_only=True, slots=True)
class CoordinatorState:
    """Everything the coordinator knows of its sweep (the ``Coordinator`` arguments are
    documented on :class:`~plora.runtime.coordinator.machine.Coordinator`)."""

    cost: CostModel
    planner: Planner
    source: ConfigSource
    num_gpus: int
    clock: SweepClock
    early_stop: StepStopper | None = None
    max_retries: int = 2
    refill: bool = True
    max_pack_size: int | None = None
    ask_batch: int = 1 << 30
    metric_name: str | None = None
    configs: ConfigBook = dataclasses.field(default_factory=ConfigBook)
    jobs: JobBook = dataclasses.field(default_factory=JobBook)
    plans: PlanState = dataclasses.field(default_factory=PlanState)
    journal: Journal = dataclasses.field(default_factory=Journal)
    measure: Measurements = dataclasses.field(default_factory=Measurements)
    residency: Residency = dataclasses.field(default_factory=Residency)
    """Resident worker groups (warm GPUs) and groups still starting."""
    pauses: PauseBook = dataclasses.field(default_factory=PauseBook)
    """Pauses in flight (:mod:`plora.runtime.coordinator.pause`)."""
    refit_pace: Pace = dataclasses.field(default_factory=Pace)
    """The last refit's seconds: a slow refit at a job end waits its turn
    (:func:`.scheduling.refit`)."""

    def now(self) -> float:
        """Seconds since the sweep started (continues across ``--resume``)."""
        return self.clock.now()

    def get_state(self, *, live: bool = False) -> dict[str, Any]:
        """JSON-able state for ``--resume`` (:func:`.resume.restore_state` restores it).

        Args:
            live: The sections that grow with the sweep as the tracked books themselves (or
                views of them: :mod:`plora.sweepdir.tracked`), not copies -- for
                :meth:`SweepStore.write_state <plora.sweepdir.store.SweepStore.write_state>`,
                which then reads only what changed since its last write. Building every
                section again at each write was linear in the sweep (the early stopper's
                records alone: 7.8 s of 50 at 4,000 configs, ``benchmarks/state_writes.py``).
        """
        # a running job's configs as they are now: refilled ones are in its checkpoint too
        by_id, book = self.configs.by_id, self.configs
        running = [
            dataclasses.replace(r.spec, configs=tuple(by_id[c] for c in r.config_ids))
            for r in self.jobs.running.values()
        ]
        early_stop = None
        if self.early_stop is not None:
            live_state = getattr(self.early_stop, "live_state", None) if live else None
            early_stop = live_state() if live_state is not None else self.early_stop.get_state()
        return {
            "version": 1,
            "elapsed_s": self.now(),
            "next_job": self.jobs.next_job,
            "plans": self.plans.count,
            "configs": book.rows if live else list(book.rows),
            "status": MappedView(book.status, _text)
            if live
            else {c: str(s) for c, s in book.status.items()},
            "progress": book.progress if live else dict(book.progress),
            "results": book.results if live else dict(book.results),
            "stop_requests": sorted(book.stop_requests),
            "interrupted": [spec_state(s) for s in [*running, *self.jobs.forced]],
            "measurements": self.measure.get_state(live=live),
            "job_rows": self.journal.job_rows if live else list(self.journal.job_rows),
            "source": encode_state(self.source.get_state()),
            "aliases": book.aliases,
            "early_stop": early_stop,
        }

    def decide(
        self,
        kind: Decision,
        *,
        job_id: str | None = None,
        config_ids: Sequence[str] = (),
        **inputs: Any,
    ) -> DecisionRecord:
        """Log one decision with its inputs, now."""
        return self.journal.decide(
            kind, time_s=self.now(), job_id=job_id, config_ids=config_ids, **inputs
        )

    def is_done(self) -> bool:
        """True when the searcher is finished and every config is done, stopped or failed."""
        return (
            self.source.is_finished()
            and not self.jobs.running
            and not self.jobs.forced
            and self.configs.all_finished()
        )

    def result_row(self, config_id: str, *, status: ConfigStatus, **r: Any) -> dict[str, Any]:
        """The config's ``results.parquet`` row (:func:`~.ledger.result_row`)."""
        return result_row(
            self.configs.by_id[config_id],
            status=status,
            metric_name=self.metric_name,
            steps_seen=self.configs.progress.get(config_id, 0),
            **r,
        )

    def tell(self, config_id: str, metrics: dict[str, Any]) -> None:
        """Tell the source how ``config_id`` ended, and under each id it was suggested again."""
        self.source.tell(config_id, metrics)
        for alias in self.configs.pop_aliases(config_id):
            self.source.tell(alias, metrics)

    def startup_time(self, d: int) -> float:
        """``cost.startup_time(d)``: seconds a cold group of d GPUs needs (0 for a cost model
        that does not price it)."""
        startup = getattr(self.cost, "startup_time", None)
        return float(startup(d)) if startup is not None else 0.0

    def ready_at(self, gpu_ids: Sequence[int]) -> float:
        """When a worker group on exactly ``gpu_ids`` is predicted ready
        (:meth:`~.residency.Residency.ready_at`)."""
        startup = getattr(self.cost, "startup_time", None)
        return self.residency.ready_at(gpu_ids, now=self.now(), startup_time=startup)

    def starting_idle(self) -> list[Job]:
        """Groups still starting that no job runs on, as placeholder planner jobs."""
        return self.residency.idle_starting(busy=self.jobs.busy_gpus(), now=self.now())


__all__ = [
    "FINISHED",
    "PACED_FROM_S",
    "PACE_SPACING",
    "ConfigBook",
    "CoordinatorState",
    "JobBook",
    "Journal",
    "Pace",
    "PauseBook",
    "PlanState",
    "Planner",
    "RunningJob",
    "StepStopper",
    "SweepClock",
]
