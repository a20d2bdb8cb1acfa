"""The sweep driver: validate, create the sweep dir, then launch / watch / re-plan until done.

``run_sweep`` is what ``plora sweep`` calls. The :class:`~plora.runtime.coordinator.Coordinator`
lives here in the driver, next to the sweep directory it writes; jobs are Ray actor groups
(:mod:`plora.runtime.job`) that reach it through the relay actor (:mod:`plora.runtime.monitor`).

Order of work (nothing is created on disk until every input has been checked)::

    check --out, dataset files, tokenizer + dataset (empty?), cost model, searcher
    connect to Ray (ConfigError when unreachable), check the GPU pool
    build DIR in a hidden temp dir: sweep.yaml, base_model/, first plan, state.json -> rename
    loop: wait for a job result (or tick) -> drain metrics -> finished/failed -> launch -> control

``--resume`` reads ``state.json``: finished configs stay finished, interrupted jobs restart from
their checkpoints, the rest is re-planned.

On a multi-node cluster (``--address``, or ``ray job submit`` which sets ``RAY_ADDRESS``) workers
write adapters and checkpoints straight into the sweep directory, so ``--out`` must be an
absolute path on storage every node mounts (NFS, a shared volume), as for Ray Tune's
``storage_path``; everything else in the directory is written by the driver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from plora.config import ConfigError, SweepConfig
from plora.runtime.coordinator import Coordinator
from plora.runtime.costview import record_profile
from plora.runtime.job import JobHandle, check_strategies, launch_job, stop_job
from plora.runtime.monitor import check_address, check_gpus, connect, cpus_per_worker, start_relay
from plora.runtime.records import ConfigSource, FailureKind, JobSpec
from plora.runtime.store import (
    SweepStore,
    check_out_dir,
    create_sweep_dir,
    write_base_model,
    write_sweep_yaml,
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunOptions:
    """How the runtime runs a sweep (not part of the sweep's definition)."""

    checkpoint_every: int | None = 50
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
    """Configs asked from the searcher at a time (default ``max(16, 4 G)``)."""
    entry: str = "plora.engine:run_pack"
    """The function workers train a pack with (``module:function``, run_pack's signature)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SweepSummary:
    """What ``run_sweep`` returns."""

    out: Path
    counts: dict[str, int]
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.counts.get("failed", 0) == 0


def prepare(
    sweep: SweepConfig, *, source: ConfigSource | None = None
) -> tuple[Any, ConfigSource, str]:
    """Check the sweep's inputs and build its cost model and config source (no Ray, no disk).

    Returns:
        ``(cost, source, metric_name)``.

    Raises:
        ConfigError: missing dataset files, an empty dataset, configs that fit no GPU, ...
    """
    from plora.cost.model import build_cost_model
    from plora.engine.data import load_dataset

    sweep.check_trainable()
    tokenizer = _load_tokenizer(sweep.model)
    data = load_dataset(sweep.dataset, tokenizer)
    if not data.train:
        raise ConfigError(
            f"{sweep.source or 'sweep'}: dataset has no training examples; "
            "point dataset.path at a non-empty file or raise dataset.num_examples"
        )
    cost = build_cost_model(sweep, dataset_size=len(data.train))
    check_strategies(cost.strategies())
    if source is None:
        source = config_source(sweep)
    return cost, source, data.metric


def config_source(sweep: SweepConfig) -> ConfigSource:
    """The sweep's config source: grid/random expansion or a Ray Tune searcher in ask/tell
    mode (:func:`plora.tune.search.make_config_source`)."""
    from plora.tune.search import make_config_source

    return make_config_source(sweep)


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
        sweep: The sweep; ignored with ``resume`` (the saved ``sweep.yaml`` is used).
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
    # absolute: workers write adapters and checkpoints from their own working directory
    out = check_out_dir(out, resume=resume).absolute()
    check_address(address)
    store: SweepStore | None = None
    if resume:
        store = SweepStore(out)
        state = store.read_state()
        sweep = SweepConfig.from_yaml(store.sweep_yaml)
    elif sweep is None:
        raise ValueError("run_sweep needs a sweep unless resume=True")
    if cost is not None and source is not None:
        metric_name = sweep.dataset.metric
    else:
        cost, source, metric_name = prepare(sweep, source=source)
    started_ray = connect(address, num_gpus=sweep.hardware.num_gpus)
    try:
        check_gpus(sweep.hardware.num_gpus)

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
            )

        if resume:
            coord = make(store)
            coord.set_state(state)
            launches = coord.start()
        else:
            with create_sweep_dir(out) as store:
                write_sweep_yaml(store, sweep.to_yaml())
                write_base_model(store, sweep.model)
                coord = make(store)
                launches = coord.start()
        driver = _Driver(
            sweep=sweep, coord=coord, store=store, options=options, on_update=on_update
        )
        driver.run(launches)
        if options.record_profile:
            record_profile(sweep, coord.cost, coord.measurements, coord.configs)
    finally:
        if started_ray:
            ray.shutdown()
    return SweepSummary(out=Path(out), counts=coord.counts(), wall_s=time.monotonic() - t0)


class _Driver:
    """Carries out the coordinator's decisions on Ray and feeds it the events."""

    def __init__(
        self,
        *,
        sweep: SweepConfig,
        coord: Coordinator,
        store: SweepStore,
        options: RunOptions,
        on_update: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.sweep = sweep
        self.coord = coord
        self.store = store
        self.options = options
        self.on_update = on_update
        tag = uuid.uuid4().hex[:6]
        self.prefix = f"plora-{sweep.name}-{tag}"
        self.relay = start_relay(f"{self.prefix}-coordinator")
        self.cpus = cpus_per_worker()
        self.handles: dict[str, JobHandle] = {}
        self.posted: set[str] = set()
        self.run_args = {
            "model": sweep.model,
            "dataset": sweep.dataset,
            "out_dir": str(store.root),  # run_pack writes out_dir/adapters/<config_id>/
            "checkpoint_dir": str(store.checkpoints_dir),
            "checkpoint_every": options.checkpoint_every,
            "checkpoint_every_s": options.checkpoint_every_s,
            "poll_every_s": options.poll_every_s,
            "entry": options.entry,
            "gradient_checkpointing": bool(
                getattr(getattr(sweep, "training", None), "gradient_checkpointing", False)
            ),
        }

    def run(self, launches: list[JobSpec]) -> None:
        try:
            self._launch(launches)
            while not self.coord.is_done():
                self._step()
        finally:
            for h in list(self.handles.values()):
                stop_job(h)
            self.store.flush_metrics()
            with contextlib.suppress(Exception):  # cluster already gone
                ray.kill(self.relay)

    def _step(self) -> None:
        refs = {h.result_ref: jid for jid, h in self.handles.items()}
        ready: list[Any] = []
        if refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=self.options.tick_s)
        else:
            time.sleep(self.options.tick_s)
        self._drain()
        launches: list[JobSpec] = []
        for ref in ready:
            launches += self._finish(refs[ref])
        if not refs and not ready:
            launches += self.coord.tick()  # a waiting searcher may have configs now
            if not launches and not self.coord.running and not self.coord.is_done():
                raise RuntimeError(
                    "the searcher gives no more configs but the sweep is not finished; "
                    f"counts: {self.coord.counts()}"
                )
        self._launch(launches)
        self._resolve_nodes()
        for jid in list(self.handles):
            ctl = self.coord.poll(jid)
            if ctl["stop"] or ctl["add"]:
                self.relay.post_control.remote(jid, ctl)
        self._update()

    def _resolve_nodes(self) -> None:
        waiting = {h.node_ref: h for h in self.handles.values() if h.node is None}
        if not waiting:
            return
        ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            h = waiting[ref]
            try:
                info = ray.get(ref)
            except ray.exceptions.RayError:
                info = {"host": "?", "node_id": ""}
            h.node = f"{info['host']}:{info['node_id'][:8]}"
            self.coord.on_job_started(h.spec.job_id, node=h.node)

    def _drain(self) -> None:
        got = ray.get(self.relay.drain.remote())
        for jid, rows in got["metrics"].items():
            self.coord.on_metrics(jid, rows)
        for cid in got["stops"]:
            self.coord.stop_config(cid, reason="relay request")

    def _finish(self, job_id: str) -> list[JobSpec]:
        self._resolve_nodes()  # a short job may end before its node was recorded
        handle = self.handles.pop(job_id)
        try:
            result = ray.get(handle.result_ref)
        except (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as e:  # fmt: skip
            kind, msg, result = FailureKind.DIED, _first_line(e), None
        except ray.exceptions.RayTaskError as e:
            kind, msg, result = FailureKind.ERROR, _first_line(e.cause or e), None
        except ray.exceptions.RayError as e:  # lost objects, runtime-env setup, ...
            kind, msg, result = FailureKind.ERROR, _first_line(e), None
        stop_job(handle)
        self.relay.forget.remote(job_id)
        self._drain()  # the worker flushed its last metrics before returning
        if result is not None and result.get("status") == "oom":
            kind, msg, result = FailureKind.OOM, result.get("error", ""), None
        if result is None:
            return self.coord.on_job_failed(job_id, kind, msg)
        launches = self.coord.on_job_finished(job_id, result)  # state.json now has its results
        shutil.rmtree(self.store.checkpoints_dir / job_id, ignore_errors=True)
        return launches

    def _launch(self, launches: list[JobSpec]) -> None:
        for spec in launches:
            handle = launch_job(
                spec,
                relay=self.relay,
                run_args=self.run_args,
                cpus_per_worker=self.cpus,
                name_prefix=self.prefix,
            )
            self.handles[spec.job_id] = handle
        if launches:
            self._update()

    def _update(self) -> None:
        snap = self.coord.snapshot()
        self.relay.set_snapshot.remote(snap)
        ended = {c: r for c, r in self.coord.results.items() if c not in self.posted}
        if ended:
            self.relay.post_results.remote(ended)
            self.posted.update(ended)
        if self.on_update is not None:
            self.on_update(snap)


def _load_tokenizer(ref: Any) -> Any:
    """The base model's tokenizer alone (no weights): built-ins resolve to their local dir."""
    from transformers import AutoTokenizer

    from plora.models import resolve_model_path

    return AutoTokenizer.from_pretrained(
        resolve_model_path(ref), trust_remote_code=ref.trust_remote_code
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


__all__ = ["RunOptions", "SweepSummary", "config_source", "prepare", "run_sweep"]
