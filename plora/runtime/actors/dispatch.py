"""The dispatcher: carries out the coordinator's decisions on Ray and feeds it the events.

:class:`Dispatcher` is the Ray side of a running sweep (:func:`plora.runtime.driver.run_sweep`
builds it): it starts resident worker groups (:mod:`plora.runtime.actors.group`) on the GPUs the
coordinator books, runs each job on its group, waits on the jobs' results and the relay's step
reports (:mod:`plora.runtime.actors.relay`), and hands each event to the
:class:`~plora.runtime.coordinator.Coordinator`, which decides what runs next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import ray

from plora.config import SweepConfig
from plora.engine.api import CheckpointPolicy, EngineSpec, OutcomeStatus, PackRequest
from plora.runtime.actors.cluster import worker_resources
from plora.runtime.actors.group import WorkerGroup, start_group, stop_group
from plora.runtime.actors.relay import start_relay
from plora.runtime.coordinator import Coordinator
from plora.runtime.options import RunOptions
from plora.runtime.records import FailureKind, JobSpec
from plora.runtime.timeline import Phase, Timeline
from plora.sweepdir.store import SweepStore


@dataclasses.dataclass(kw_only=True, slots=True)
class _Job:
    """A job running on a worker group: rank 0's ref carries its outcome."""

    spec: JobSpec
    group: WorkerGroup
    refs: list[Any]
    peers: set[Any] = dataclasses.field(default_factory=set)
    """The refs of ranks 1..d-1 not yet returned: one that fails (a dead worker) fails the job,
    since rank 0 waits on it in the job's collectives."""


class Dispatcher:
    """Carries out the coordinator's decisions on Ray and feeds it the events."""

    def __init__(
        self,
        *,
        sweep: SweepConfig,
        options: RunOptions,
        on_update: Callable[[dict[str, Any]], None] | None,
        timeline: Timeline | None = None,
    ) -> None:
        self.sweep = sweep
        self.timeline = timeline if timeline is not None else Timeline.from_process_start()
        """Where the workers' phases are marked (groups ready; jobs' steps, eval, export)."""
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
            cuda_graphs=sweep.training.cuda_graphs,
        )
        self._groups_started = 0
        self._ended: list[str] = []
        """Jobs finished in this turn of the loop: their checkpoints go after its writes."""

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

    def loop(self, launches: list[JobSpec]) -> None:
        """Launch ``launches``, then turn until the coordinator is done: each turn waits for a
        job to end (or ``tick_s``), relays the workers' reports and requests to the
        coordinator, hands it the ended jobs and launches what it returns."""
        try:
            self._launch(launches)
            while not self.coord.is_done():
                self._turn()
        finally:
            self.store.flush_decisions()
            self.store.flush_metrics()

    def close(self) -> None:
        """Stop every worker group and the relay (also when the sweep failed before running)."""
        for g in list(self.groups.values()):
            stop_group(g)
        self.groups.clear()
        with contextlib.suppress(Exception):  # cluster already gone
            ray.kill(self.relay)

    def _turn(self) -> None:
        """One turn of the loop: the events since the last (step reports, stop requests, jobs
        that ended), then the launches, then each running job's control. The sweep directory
        is written once per batch of events (:meth:`Coordinator.batched_writes`), before the
        jobs it launches run and before the control it posts reaches a worker."""
        refs = {job.refs[0]: jid for jid, job in self.jobs.items()}
        peers = {r: jid for jid, job in self.jobs.items() for r in job.peers}
        ready: list[Any] = []
        if refs:
            ready, _ = ray.wait([*refs, *peers], num_returns=1, timeout=self.options.tick_s)
        else:
            time.sleep(self.options.tick_s)
        with self.coord.batched_writes():
            launches = self._drain()
            for ref in ready:
                if ref in peers:
                    self._peer_returned(peers[ref], ref)
                    continue
                launches += self._finish(refs[ref])
            # configs registered from outside (Tune proxy trials) are asked while jobs run, too
            outside = getattr(self.coord.source, "has_waiting", None)
            if (
                (not refs and not ready)
                or (callable(outside) and outside())
                or self.coord.plan_held()  # a paced re-plan: due once its wait is over
            ):
                launches += self.coord.tick()  # a waiting searcher may have configs now
                if (not launches and not self.coord.running and not self.coord.is_done()
                        and not callable(outside)):  # fmt: skip
                    raise RuntimeError(
                        "the searcher gives no more configs but the sweep is not finished; "
                        f"counts: {self.coord.counts()}"
                    )
        for job_id in self._ended:  # state.json has their results now
            shutil.rmtree(self.store.checkpoints_dir / job_id, ignore_errors=True)
        self._ended.clear()
        self._launch(launches)
        self._resolve_groups()
        with self.coord.batched_writes():
            controls = self.coord.poll_all(list(self.jobs))
        for jid, ctl in controls:
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
            if group.info.loaded_at:
                self.timeline.mark_wall(Phase.WORKERS, group.info.loaded_at)
            else:  # an engine that does not say: seen now
                self.timeline.mark(Phase.WORKERS)
            self.coord.on_group_ready(
                group.gpu_ids, ready_s=group.ready_s, load_s=group.info.load_s,
                build_s=group.info.build_s, node=group.node, load_parts=group.info.load_parts,
            )  # fmt: skip
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
            self.coord.on_request(request)
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
        self.timeline.mark_job(outcome.timings)
        launches += self.coord.on_job_finished(job_id, outcome)
        self._ended.append(job_id)  # its checkpoint goes once state.json has its results
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
            max_rows=spec.max_rows,
        )

    def _launch(self, launches: list[JobSpec]) -> None:
        for spec in launches:
            group = self._group_for(spec)
            refs = group.submit(self._request(spec))
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


__all__ = ["Dispatcher"]
