"""The sweep driver: validate, create the sweep dir, then launch / watch / re-plan until done.

``run_sweep`` is what ``plora sweep`` calls. The :class:`~plora.runtime.coordinator.Coordinator`
lives here in the driver, next to the sweep directory it writes. Jobs run on resident worker
groups (:mod:`plora.runtime.group`): a group is started on a GPU the first time a job is booked
there, loads the base model once, and serves every later job on that GPU; its workers reach the
coordinator through the relay actor (:mod:`plora.runtime.relay`).

Order of work (nothing is created on disk until every input has been checked)::

    check --out, dataset files, tokenizer + dataset (empty?), cost model, searcher
    connect to Ray (ConfigError when unreachable), check the GPU pool
    build DIR in a hidden temp dir: sweep.yaml, base_model/, first plan, state.json -> rename
    loop: wait for a job result (or tick) -> drain step reports -> finished/failed -> launch on
          the GPUs' resident groups (start one where none is) -> control

The driver holds the sweep directory's lock (:mod:`plora.sweepdir.lock`) from its first check to
its return, so a second ``plora sweep`` (or ``--resume``) on the same ``--out`` is refused with one
line naming the running one.

``--resume`` reads ``state.json``: finished configs stay finished, interrupted jobs restart from
their checkpoints, the rest is re-planned.

On a multi-node cluster (``--address``, or ``ray job submit`` which sets ``RAY_ADDRESS``) workers
write adapters and checkpoints straight into the sweep directory, so ``--out`` must be an
absolute path on storage every node mounts (NFS, a shared volume), as for Ray Tune's
``storage_path``; everything else in the directory is written by the driver.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ray

from plora.config import ConfigError, SweepConfig
from plora.config.diff import sweep_changes
from plora.cost.jobterms import DEFAULT_CHECKPOINT_EVERY
from plora.engine.api import CheckpointPolicy, EngineSpec, OutcomeStatus, PackEngine, PackRequest
from plora.models.hub import check_hub_model
from plora.runtime.cluster import (
    check_address,
    check_gpus,
    check_job_out,
    connect,
    worker_resources,
)
from plora.runtime.cluster import shutdown as shutdown_cluster
from plora.runtime.coordinator import Coordinator
from plora.runtime.costs import record_profile
from plora.runtime.group import WorkerGroup, start_group, stop_group
from plora.runtime.pause import apply_request
from plora.runtime.prepare import config_source, fits_one_gpu, prepare
from plora.runtime.records import ConfigSource, FailureKind, JobSpec
from plora.runtime.relay import start_relay
from plora.sweepdir.lock import SweepLock
from plora.sweepdir.store import (
    SweepStore,
    check_out_dir,
    create_sweep_dir,
    write_base_model,
    write_sweep_yaml,
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How the runtime runs a sweep (not part of the sweep's definition)."""

    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY
    """Train-state checkpoint every N optimizer steps (None: only at the end)."""
    checkpoint_every_s: float | None = None
    """Also checkpoint when this many seconds passed since a job's last checkpoint."""
    record_profile: bool = True
    """Save the measured steps to the (model, GPU type) profile store for later sweeps."""
    max_retries: int = 2
    """Restarts of a job whose worker died before its configs fail."""
    refill: bool = True
    """Let queued configs join running jobs in slots that finished configs left."""
    tick_s: float = 0.25
    """How often the driver drains metrics and posts control when no job ends."""
    poll_every_s: float = 0.0
    """How often a worker asks for control (0: every step)."""
    ask_batch: int | None = None
    """Most configs asked from the config source at a time (default: all it gives)."""
    engine: type[PackEngine] | None = None
    """The engine class resident workers build (default ``plora.engine.PackSession``)."""
    calibration_steps: int = 3
    """Refit and re-plan once this many steps of the first job are measured (0: never)."""
    force_unlock: bool = False
    """Take over a sweep directory lock held from another host (``--force-unlock``); a lock whose
    owner is alive on this host is never broken, a dead one is always taken over."""
    retry_failed: bool = False
    """With ``--resume``: give the configs that failed another attempt (``--retry-failed``). Off
    by default, as ``Tuner.restore(resume_errored=False)``: a resume finishes what was left and
    does not pay again for a failure (out of memory alone, a bad config) unless asked."""
    allow_changed: bool = False
    """With ``--resume`` and a sweep whose definition differs from the saved ``sweep.yaml``: run
    the given one (``--allow-changed``) instead of refusing. Finished configs keep their results
    (a config is matched by its hyperparameters), configs the edit adds are trained, queued ones
    the edit removed from a grid/random space are stopped."""
    prestart: bool = True
    """Start a one-GPU worker group on every GPU right after Ray is up, so the workers import,
    initialise CUDA and load the base model while the driver reads the dataset and plans (not
    when the base model alone fills a GPU, nor when ``planner.strategies`` allows multi-GPU
    jobs: the plan may want several GPUs per job)."""
    actor_prefix: str | None = None
    """Name prefix of this sweep's Ray actors (the relay is ``<prefix>-coordinator``); default
    ``plora-<sweep name>-<random>``. The Tune integration names it to find the relay."""
    follow_configs: bool = False
    """Keep each config's step metrics in the relay until read (Tune proxy trials read them)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SweepSummary:
    """What ``run_sweep`` returns."""

    out: Path
    counts: dict[str, int]
    wall_s: float
    """From ``run_sweep``'s call to its return."""
    setup_s: float = 0.0
    """Before the sweep clock: dataset check, Ray start, sweep directory."""
    ray_start_s: float = 0.0
    """Of ``setup_s``: from the call until Ray was connected (or started), the input checks
    before it included."""
    inputs_wait_s: float = 0.0
    """Of ``setup_s``: waiting, after Ray was up, for the dataset check and cost model."""
    teardown_s: float = 0.0
    """After the sweep's last event: workers stopped, profile recorded, Ray shut down."""
    data_lines: tuple[str, ...] = ()
    """What loading the dataset cut or left out, one line per split (also ``data.json``)."""

    @property
    def ok(self) -> bool:
        return self.counts.get("failed", 0) == 0


def run_sweep(
    sweep: SweepConfig | None,
    out: str | os.PathLike[str],
    *,
    address: str | None = None,
    resume: bool = False,
    options: RunOptions | None = None,
    source: ConfigSource | None = None,
    cost: Any = None,
    on_update: Callable[[dict[str, Any]], None] | None = None,
) -> SweepSummary:
    """Run (or ``resume``) a sweep into ``out``; returns when every config is done or failed.

    Args:
        sweep: The sweep; with ``resume`` None (the saved ``sweep.yaml`` is used) or the sweep
            to compare with it: a different one is refused with the keys that changed unless
            ``options.allow_changed`` (then it replaces the saved one).
        out: The sweep directory (must not exist unless ``resume``).
        address: Ray address (``auto``, ``host:port``); None: ``RAY_ADDRESS`` or a local Ray.
        resume: Continue the sweep in ``out``.
        options: Runtime knobs (:class:`RunOptions`).
        source: Override the config source (default: the sweep's searcher).
        cost: Override the cost model; with ``source`` it skips loading the dataset (tests, the
            Tune integration that already holds both).
        on_update: Called with the coordinator's snapshot after every event (progress view).
    """
    options = options or RunOptions()
    t0 = time.monotonic()
    check_job_out(out)  # under `ray job submit` a relative --out would vanish with Ray's temp dir
    # absolute: workers write adapters and checkpoints from their own working directory
    out = check_out_dir(out, resume=resume, force_unlock=options.force_unlock).absolute()
    check_address(address)
    # one writer per sweep directory, from here to the last record (released on every exit)
    with SweepLock.acquire(out, force=options.force_unlock) as lock:
        if lock.note:
            logging.getLogger(__name__).warning("note: %s", lock.note)
        check_out_dir(out, resume=resume, lock=lock)  # again: a sweep may have ended meanwhile
        return _run(
            sweep, out, t0=t0, address=address, resume=resume, options=options, source=source,
            cost=cost, on_update=on_update,
        )  # fmt: skip


def _run(
    sweep: SweepConfig | None,
    out: Path,
    *,
    t0: float,
    address: str | None,
    resume: bool,
    options: RunOptions,
    source: ConfigSource | None,
    cost: Any,
    on_update: Callable[[dict[str, Any]], None] | None,
) -> SweepSummary:
    """:func:`run_sweep` once ``out`` is checked and its lock is held."""
    store: SweepStore | None = None
    changed: list[str] = []
    if resume:
        store = SweepStore(out)
        state = store.read_state()
        sweep, changed = _resumed_sweep(store, sweep, allow_changed=options.allow_changed)
    elif sweep is None:
        raise ValueError("run_sweep needs a sweep unless resume=True")
    sweep.check_trainable()
    check_hub_model(sweep.model, file=sweep.source)  # seconds, before Ray: never a minute's retries
    # The dataset check and cost model (imports, tokenizing) run beside Ray's start and the
    # workers' start, not before them.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plora-prepare")
    prepared = None
    if cost is None or source is None:
        prepared = pool.submit(
            prepare, sweep, source=source, checkpoint_every=options.checkpoint_every
        )
    pool.shutdown(wait=False)
    started_ray = False
    driver: _Driver | None = None
    try:
        hw = sweep.hardware
        started_ray = connect(address, num_gpus=hw.num_gpus, cpu=hw.is_cpu)
        ray_start_s = time.monotonic() - t0
        check_gpus(hw.num_gpus, cpu=hw.is_cpu)
        driver = _Driver(sweep=sweep, options=options, on_update=on_update)
        if options.prestart and fits_one_gpu(sweep) and not sweep.planner.strategies:
            driver.prestart(range(sweep.hardware.num_gpus))
        t_wait = time.monotonic()
        data_report = None
        if prepared is None:
            metric_name = sweep.dataset.metric
        else:
            cost, source, metric_name, data_report = prepared.result()
        inputs_wait_s = time.monotonic() - t_wait
        data_lines = tuple(data_report.lines()) if data_report is not None else ()
        for line in data_lines:  # never silently: the user sees what the data lost
            logging.getLogger(__name__).warning("%s", line)

        def make(store: SweepStore) -> Coordinator:
            return Coordinator(
                cost=cost,
                num_gpus=sweep.hardware.num_gpus,
                source=source,
                store=store,
                max_retries=options.max_retries,
                refill=options.refill,
                ask_batch=options.ask_batch,
                metric_name=metric_name,
                calibration_steps=options.calibration_steps,
                early_stop=_early_stopper(sweep),
            )

        if resume:
            assert store is not None
            coord = make(store)
            coord.set_state(state, retry_failed=options.retry_failed, changed=changed)
            if changed:
                write_sweep_yaml(store, sweep.to_yaml())
            if data_report is not None:
                store.write_data_report(data_report.to_dict())
        else:
            with create_sweep_dir(out) as store:
                write_sweep_yaml(store, sweep.to_yaml())
                from plora.models import save_base_model  # lazy: torch

                write_base_model(store, sweep.model, save_builtin=save_base_model)
                if data_report is not None:
                    store.write_data_report(data_report.to_dict())
                coord = make(store)
        setup_s = time.monotonic() - t0
        driver.attach(coord, store)
        driver.run(coord.start())
        ended = time.monotonic()
        if options.record_profile:
            record_profile(
                sweep, coord.cost, coord.measure.steps, coord.configs, coord.measure.overheads
            )
    finally:
        if prepared is not None:
            concurrent.futures.wait([prepared])  # never leave it running into a shut-down Ray
        if driver is not None:
            driver.close()
        shutdown_cluster(started=started_ray)
    done = time.monotonic()
    return SweepSummary(out=Path(out), counts=coord.counts(), wall_s=done - t0, setup_s=setup_s,
                        ray_start_s=ray_start_s, inputs_wait_s=inputs_wait_s,
                        teardown_s=done - ended, data_lines=data_lines)  # fmt: skip


@dataclasses.dataclass(kw_only=True, slots=True)
class _Job:
    """A job running on a worker group: rank 0's ref carries its outcome."""

    spec: JobSpec
    group: WorkerGroup
    refs: list[Any]
    peers: set[Any] = dataclasses.field(default_factory=set)
    """The refs of ranks 1..d-1 not yet returned: one that fails (a dead worker) fails the job,
    since rank 0 waits on it in the job's collectives."""


class _Driver:
    """Carries out the coordinator's decisions on Ray and feeds it the events."""

    def __init__(
        self,
        *,
        sweep: SweepConfig,
        options: RunOptions,
        on_update: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.sweep = sweep
        self.coord: Coordinator = None  # type: ignore[assignment]  # set by attach()
        self.store: SweepStore = None  # type: ignore[assignment]
        self.options = options
        self.on_update = on_update
        tag = uuid.uuid4().hex[:6]
        self.prefix = options.actor_prefix or f"plora-{sweep.name}-{tag}"
        self.relay = start_relay(f"{self.prefix}-coordinator", keep_history=options.follow_configs)
        # CPU sweeps (gpu_type: cpu) ask Ray for CPUs only: they run on CPU nodes without GPUs
        self.cpus, self.gpus = worker_resources(
            cpu=sweep.hardware.is_cpu, num_slots=sweep.hardware.num_gpus
        )
        self.groups: dict[tuple[int, ...], WorkerGroup] = {}
        self.jobs: dict[str, _Job] = {}
        self.posted: dict[str, Any] = {}
        self.engine = options.engine  # None: PackSession, imported by the workers
        self.engine_spec = EngineSpec(
            model=sweep.model,
            dataset=sweep.dataset,
            gradient_checkpointing=bool(
                getattr(getattr(sweep, "training", None), "gradient_checkpointing", False)
            ),
            fused_kernels=sweep.training.fused_kernels,
        )
        self._groups_started = 0

    def prestart(self, gpu_ids: Iterable[int]) -> None:
        """A one-GPU group on each of ``gpu_ids``, loading before the coordinator exists."""
        for g in gpu_ids:
            self._start_group((g,), strategy=None)

    def attach(self, coord: Coordinator, store: SweepStore) -> None:
        """Hand the driver its coordinator and sweep directory; groups already starting are
        reported with the seconds they have been starting."""
        self.coord, self.store = coord, store
        now = time.monotonic()
        for key, group in self.groups.items():
            coord.on_group_started(key, elapsed_s=now - group.started_at)

    def run(self, launches: list[JobSpec]) -> None:
        try:
            self._launch(launches)
            while not self.coord.is_done():
                self._step()
        finally:
            self.store.flush_metrics()

    def close(self) -> None:
        """Stop every worker group and the relay (also when the sweep failed before running)."""
        for g in list(self.groups.values()):
            stop_group(g)
        self.groups.clear()
        with contextlib.suppress(Exception):  # cluster already gone
            ray.kill(self.relay)

    def _step(self) -> None:
        refs = {job.refs[0]: jid for jid, job in self.jobs.items()}
        peers = {r: jid for jid, job in self.jobs.items() for r in job.peers}
        ready: list[Any] = []
        if refs:
            ready, _ = ray.wait([*refs, *peers], num_returns=1, timeout=self.options.tick_s)
        else:
            time.sleep(self.options.tick_s)
        launches = self._drain()
        for ref in ready:
            if ref in peers:
                self._peer_returned(peers[ref], ref)
                continue
            launches += self._finish(refs[ref])
        # configs registered from outside (Tune proxy trials) are asked while jobs run, too
        outside = getattr(self.coord.source, "has_waiting", None)
        if (not refs and not ready) or (callable(outside) and outside()):
            launches += self.coord.tick()  # a waiting searcher may have configs now
            if (not launches and not self.coord.running and not self.coord.is_done()
                    and not callable(outside)):  # fmt: skip
                raise RuntimeError(
                    "the searcher gives no more configs but the sweep is not finished; "
                    f"counts: {self.coord.counts()}"
                )
        self._launch(launches)
        self._resolve_groups()
        for jid in list(self.jobs):
            ctl = self.coord.poll(jid)
            if ctl.stop or ctl.add or ctl.pause:
                self.relay.post_control.remote(jid, ctl)
        self._update()

    def _resolve_groups(self) -> None:
        """Record the groups that finished loading (node, measured start-up) with the coordinator."""
        waiting = {g.load_refs[0]: g for g in self.groups.values() if g.info is None}
        if not waiting:
            return
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            group = waiting[ref]
            try:
                group.info = ray.get(ref)
            except ray.exceptions.RayError:  # the load failed: its job reports why
                continue
            group.ready_s = time.monotonic() - group.started_at
            self.coord.on_group_ready(
                group.gpu_ids, ready_s=group.ready_s, load_s=group.info.load_s, node=group.node
            )
            for job in self.jobs.values():
                if job.group is group:
                    self.coord.on_job_started(job.spec.job_id, node=group.node)

    def _drain(self) -> list[JobSpec]:
        reports, stops, syncs = ray.get(self.relay.drain.remote())
        launches: list[JobSpec] = []
        for jid, rows in reports.items():
            launches += self.coord.on_reports(jid, rows)
        if syncs:  # workers wait to checkpoint until the metrics of their steps are on disk
            self.coord.flush_records()
            self.relay.ack_sync.remote(syncs)
        for request in stops:  # stop / pause / resume one config
            apply_request(self.coord, request)
        return launches

    def _peer_returned(self, job_id: str, ref: Any) -> None:
        """Rank k > 0 of a job returned: fine when it ended with rank 0; when it failed (its
        worker died), rank 0 cannot finish the job's collectives, so the group is stopped and
        rank 0's ref fails too (:meth:`_finish` sees a dead worker)."""
        job = self.jobs[job_id]
        job.peers.discard(ref)
        try:
            ray.get(ref)
        except ray.exceptions.RayError:
            stop_group(job.group)

    def _finish(self, job_id: str) -> list[JobSpec]:
        job = self.jobs.pop(job_id)
        self._resolve_groups()  # a short first job may end before its group was recorded
        try:
            outcome = ray.get(job.refs[0])
        except _DIED as e:
            kind, msg, outcome = FailureKind.DIED, _first_line(e), None
        except ray.exceptions.RayTaskError as e:
            kind, msg, outcome = FailureKind.ERROR, _first_line(e.cause or e), None
        except ray.exceptions.RayError as e:  # lost objects, runtime-env setup, ...
            kind, msg, outcome = FailureKind.ERROR, _first_line(e), None
        if outcome is None and kind is FailureKind.ERROR and len(job.refs) > 1:
            # rank 0's collective failed because another rank's worker died: a dead worker
            died = _dead_peer(job.refs[1:])
            if died is not None:
                kind, msg = FailureKind.DIED, died
        if outcome is None or (len(job.refs) > 1 and outcome.status is not OutcomeStatus.OK):
            # A dead worker, or an error that may have left the model half-changed: the group
            # goes; a later job on these GPUs starts a fresh one.
            self._drop_group(job.group)
        self.relay.forget.remote(job_id)
        launches = self._drain()  # the worker flushed its last reports before returning
        if outcome is not None and outcome.status is OutcomeStatus.OOM:
            kind, msg, outcome = FailureKind.OOM, outcome.error or "out of memory", None
        if outcome is None:
            return launches + self.coord.on_job_failed(job_id, kind, msg)
        launches += self.coord.on_job_finished(job_id, outcome)  # state.json has its results
        shutil.rmtree(self.store.checkpoints_dir / job_id, ignore_errors=True)
        return launches

    def _drop_group(self, group: WorkerGroup) -> None:
        stop_group(group)
        if self.groups.get(group.gpu_ids) is group:
            del self.groups[group.gpu_ids]
        self.coord.on_group_lost(group.gpu_ids)

    def _group_for(self, spec: JobSpec) -> WorkerGroup:
        """The resident group on the job's GPUs; one is started (and groups overlapping those
        GPUs torn down) when there is none of that shape."""
        key = tuple(spec.gpu_ids)
        group = self.groups.get(key)
        if group is not None and group.strategy == spec.strategy:
            return group
        for other in [g for k, g in self.groups.items() if set(k) & set(key)]:
            self._drop_group(other)
        group = self._start_group(key, strategy=spec.strategy)
        self.coord.on_group_started(key)
        return group

    def _start_group(self, key: tuple[int, ...], *, strategy: str | None) -> WorkerGroup:
        self._groups_started += 1
        group = start_group(
            key,
            strategy=strategy,
            relay=self.relay,
            engine=self.engine,
            spec=self.engine_spec,
            name=f"{self.prefix}-w{self._groups_started}",
            cpus_per_worker=self.cpus,
            gpus_per_worker=self.gpus,
        )
        self.groups[key] = group
        return group

    def _request(self, spec: JobSpec) -> PackRequest:
        return PackRequest(
            job_id=spec.job_id,
            configs=spec.configs,
            out_dir=str(self.store.root),  # adapters go to out_dir/adapters/<config_id>/
            checkpoint=CheckpointPolicy(
                dir=str(self.store.checkpoints_dir / spec.job_id),
                every_steps=self.options.checkpoint_every,
                every_s=self.options.checkpoint_every_s,
            ),
            resume=True,
            poll_every_s=self.options.poll_every_s,
        )

    def _launch(self, launches: list[JobSpec]) -> None:
        for spec in launches:
            group = self._group_for(spec)
            refs = group.run(self._request(spec))
            self.jobs[spec.job_id] = _Job(spec=spec, group=group, refs=refs, peers=set(refs[1:]))
            if group.info is not None:
                self.coord.on_job_started(spec.job_id, node=group.node)
        if launches:
            self._update()

    def _update(self) -> None:
        snap = self.coord.snapshot()
        self.relay.set_snapshot.remote(snap)
        ended = {
            c: r for c, r in self.coord.results.items() if self.posted.get(c) != r.get("status")
        }  # a paused config's row, and its row again once it ended
        if ended:
            self.relay.post_results.remote(ended)
            self.posted.update({c: r.get("status") for c, r in ended.items()})
        if self.on_update is not None:
            self.on_update(snap)


def _resumed_sweep(
    store: SweepStore, given: SweepConfig | None, *, allow_changed: bool
) -> tuple[SweepConfig, list[str]]:
    """The sweep a ``--resume`` runs and what differs from the saved one (empty: unchanged)."""
    saved = SweepConfig.from_yaml(store.sweep_yaml)
    if given is None:
        return saved, []
    changed = sweep_changes(saved, given)
    if not changed:
        return saved, []
    if not allow_changed:
        shown = "; ".join(changed[:4]) + (
            f"; and {len(changed) - 4} more" if len(changed) > 4 else ""
        )
        raise ConfigError(
            f"--resume {store.root}: {given.source or 'the sweep'} differs from the sweep this "
            f"directory ran ({shown}); pass --allow-changed to continue with the edited file, "
            f"or resume with the saved one ({store.sweep_yaml})"
        )
    return given, changed


_DIED = (
    ray.exceptions.ActorDiedError,
    ray.exceptions.ActorUnavailableError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
)


def _dead_peer(refs: list[Any], timeout_s: float = 10.0) -> str | None:
    """Why one of ``refs`` (ranks 1..d-1 of a job whose rank 0 failed) died, if one did: they
    fail within seconds of rank 0 when a worker was lost."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except _DIED as e:
            return _first_line(e)
        except ray.exceptions.RayError:
            continue
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _early_stopper(sweep: SweepConfig) -> Any:
    """The sweep's ``early_stop:`` stopper, or None; Ray Tune (1-2 s to import) only with one."""
    if sweep.early_stop is None:
        return None
    from plora.tune.early_stop import make_early_stopper

    return make_early_stopper(sweep.early_stop)


__all__ = ["RunOptions", "SweepSummary", "config_source", "prepare", "run_sweep"]
