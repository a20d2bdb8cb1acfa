"""The sweep driver: validate, create the sweep dir, then launch / watch / re-plan until done.

``run_sweep`` is what ``plora sweep`` calls. The :class:`~plora.runtime.coordinator.Coordinator`
lives here in the driver, next to the sweep directory it writes. Jobs run on resident worker
groups (:mod:`plora.runtime.actors.group`): a group is started on a GPU the first time a job is booked
there, loads the base model once, and serves every later job on that GPU; its workers reach the
coordinator through the relay actor (:mod:`plora.runtime.actors.relay`). The Ray side of the loop below
is :class:`~plora.runtime.actors.dispatch.Dispatcher`; the knobs are :class:`~plora.runtime.options.RunOptions`.

Order of work (nothing is created on disk until every input has been checked)::

    check --out, dataset files, this machine's GPUs (for a local Ray)
    beside Ray's start: tokenizer + dataset (empty?), cost model, every config fits a job, searcher
    connect to Ray (ConfigError when unreachable), check the GPU pool (and a node for the widest job)
    build DIR in a hidden temp dir: sweep.yaml, base_model/, first plan, state.json -> rename
    loop: wait for a job result (or tick) -> drain step reports -> finished/failed -> launch on
          the GPUs' resident groups (start one where none is) -> control
    end: stop the workers, shut Ray down, log the run's timeline (:mod:`plora.runtime.timeline`:
         seconds from the process start to Ray, inputs, workers, first/last step, eval, export, exit)

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plora.config import ConfigError, SweepConfig
from plora.config.diff import sweep_changes
from plora.curves import open_curves, open_sinks
from plora.models.hub import check_hub_model
from plora.planner import NoFeasibleJobError
from plora.planner.fits import no_fit_error, widest_degree
from plora.planner.options import SweepPlanner
from plora.runtime.actors.cluster import (
    check_address,
    check_gpus,
    check_job_out,
    check_local_gpus,
    connect,
)
from plora.runtime.actors.cluster import shutdown as shutdown_cluster
from plora.runtime.actors.dispatch import Dispatcher
from plora.runtime.coordinator import Coordinator
from plora.runtime.coordinator.costs import record_profile
from plora.runtime.options import RunOptions
from plora.runtime.prepare import config_source, fits_one_gpu, prepare
from plora.runtime.progress import samples_line
from plora.runtime.records import ConfigSource
from plora.runtime.timeline import NOTE_DRIVER, NOTE_PREPARED, Phase, Timeline
from plora.sweepdir.lock import SweepLock
from plora.sweepdir.logfile import SweepLog, sweep_log
from plora.sweepdir.store import (
    SweepStore,
    check_out_dir,
    create_sweep_dir,
    write_base_model,
    write_sweep_yaml,
)


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
    samples_line: str | None = None
    """Fewer distinct configs than the sweep asked for: how many and why
    (:func:`plora.runtime.progress.samples_line`)."""
    timeline: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds from the process start to each phase reached (:mod:`plora.runtime.timeline`;
    also the ``timeline`` record of ``decisions.jsonl``)."""

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
    timeline = Timeline.from_process_start()
    timeline.note(NOTE_DRIVER)
    check_job_out(out)  # under `ray job submit` a relative --out would vanish with Ray's temp dir
    # absolute: workers write adapters and checkpoints from their own working directory
    out = check_out_dir(out, resume=resume, force_unlock=options.force_unlock).absolute()
    check_address(address)
    # one writer per sweep directory, from here to the last record (released on every exit)
    # ... and the driver's logging: plora's warnings on the console, everything in plora.log
    with SweepLock.acquire(out, force=options.force_unlock) as lock, sweep_log() as log:
        if lock.note:
            logging.getLogger(__name__).warning("note: %s", lock.note)
        check_out_dir(out, resume=resume, lock=lock)  # again: a sweep may have ended meanwhile
        return _drive(
            sweep, out, t0=t0, address=address, resume=resume, options=options, source=source,
            cost=cost, on_update=on_update, log=log, timeline=timeline,
        )  # fmt: skip


def _drive(
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
    log: SweepLog,
    timeline: Timeline,
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
    hw = sweep.hardware
    with sweep.located():  # a local Ray would find fewer GPUs than the sweep wants: say so first
        check_local_gpus(hw.num_gpus, cpu=hw.is_cpu, address=address)
    sinks = open_sinks(sweep, out)  # MLflow / W&B that cannot start: one line, before Ray
    # The dataset check and cost model (imports, tokenizing) run beside Ray's start and the
    # workers' start, not before them.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plora-prepare")
    prepared = None
    if cost is None or source is None:
        prepared = pool.submit(
            prepare, sweep, source=source, checkpoint_every=options.checkpoint_every
        )
        prepared.add_done_callback(lambda _: timeline.note(NOTE_PREPARED))
    pool.shutdown(wait=False)
    started_ray = False
    dispatcher: Dispatcher | None = None
    try:
        started_ray = connect(address, num_gpus=hw.num_gpus, cpu=hw.is_cpu)
        ray_start_s = time.monotonic() - t0
        timeline.mark(Phase.RAY)
        with sweep.located():
            check_gpus(hw.num_gpus, cpu=hw.is_cpu, max_degree=_widest_job(sweep))
        dispatcher = Dispatcher(
            sweep=sweep, options=options, on_update=on_update, timeline=timeline
        )
        if options.prestart and fits_one_gpu(sweep) and not sweep.planner.strategies:
            dispatcher.prestart(range(sweep.hardware.num_gpus))
        t_wait = time.monotonic()
        data_report = None
        if prepared is None:
            metric_name = sweep.dataset.metric
        else:
            cost, source, metric_name, data_report = prepared.result()
        inputs_wait_s = time.monotonic() - t_wait
        data_lines = tuple(data_report.lines()) if data_report is not None else ()
        for line in data_lines:  # never silently: SweepSummary.data_lines, which plora sweep
            logging.getLogger(__name__).info("%s", line)  # prints once, as the sweep ends

        def make(store: SweepStore) -> Coordinator:
            return Coordinator(
                cost=cost,
                num_gpus=sweep.hardware.num_gpus,
                source=source,
                store=store,
                max_retries=options.max_retries,
                refill=options.refill,
                planner=SweepPlanner.from_options(sweep.planner),
                max_pack_size=sweep.planner.max_pack_size,
                ask_batch=options.ask_batch,
                metric_name=metric_name,
                calibration_steps=options.calibration_steps,
                early_stop=_early_stopper(sweep),
            )

        if resume:
            assert store is not None
            log.attach(out)  # every check passed: a refused resume leaves DIR as it was
            coord = make(store)
            coord.set_state(state, retry_failed=options.retry_failed, changed=changed)
            if changed:
                write_sweep_yaml(store, sweep.to_yaml())
            if data_report is not None:
                store.write_data_report(data_report.to_dict())
            dispatcher.attach(coord, store)
            first = coord.start()
        else:
            with create_sweep_dir(out) as store:
                write_sweep_yaml(store, sweep.to_yaml())
                from plora.models import save_base_model  # lazy: torch

                write_base_model(store, sweep.model, save_builtin=save_base_model)
                if data_report is not None:
                    store.write_data_report(data_report.to_dict())
                coord = make(store)
                dispatcher.attach(coord, store)  # the first plan knows the groups already starting
                # ... and is made before DIR is in place: a config it cannot place (one a
                # searcher proposed, beyond the sample prepare checked) leaves no directory
                try:
                    first = coord.start()
                except NoFeasibleJobError as err:
                    spec, strategies = getattr(cost, "spec", None), cost.strategies()
                    raise no_fit_error(sweep, err, spec=spec, strategies=strategies) from None
            log.attach(out)  # published: the set-up's records, then the rest
        timeline.mark(Phase.INPUTS)  # the first plan is made
        store.curves = open_curves(sinks, sweep, configs=coord.configs, metric_name=metric_name,
                                   finished=list(coord.results))  # fmt: skip
        setup_s = time.monotonic() - t0
        dispatcher.loop(first)
        ended = time.monotonic()
        if options.record_profile:
            record_profile(
                sweep, coord.cost, coord.measure.steps, coord.configs, coord.measure.overheads
            )
    finally:
        if prepared is not None:
            concurrent.futures.wait([prepared])  # never leave it running into a shut-down Ray
        if dispatcher is not None:
            dispatcher.close()
        if store is not None:  # results and jobs tables are written amortized: whole on the way out
            with contextlib.suppress(OSError):  # (state.json holds the rows: --resume has them)
                store.flush_results()
        _close_curves(store, sinks)
        shutdown_cluster(started=started_ray)
    done = time.monotonic()
    timeline.mark(Phase.EXIT)
    coord.on_timeline(timeline.to_dict(), notes={k: round(v, 3) for k, v in timeline.notes.items()})
    return SweepSummary(out=Path(out), counts=coord.counts(), wall_s=done - t0, setup_s=setup_s,
                        ray_start_s=ray_start_s, inputs_wait_s=inputs_wait_s,
                        teardown_s=done - ended, data_lines=data_lines,
                        samples_line=samples_line(
                            store.read_decisions(), search=str(sweep.search),
                            asked=sweep.num_configs, finished=coord.is_done()),
                        timeline=timeline.to_dict())  # fmt: skip


def _close_curves(store: SweepStore | None, sinks: list[Any]) -> None:
    """Write the queued curves and close the sinks (also those a failed start left unfed)."""
    if store is not None and store.curves is not None:
        store.close_curves()
        return
    for sink in sinks:
        with contextlib.suppress(Exception):  # nothing was logged to it
            sink.close()


def _resumed_sweep(
    store: SweepStore, given: SweepConfig | None, *, allow_changed: bool
) -> tuple[SweepConfig, list[str]]:
    """The sweep a ``--resume`` runs and what differs from the saved one (empty: unchanged)."""
    saved = SweepConfig.from_yaml(store.sweep_yaml)
    if given is None:
        return saved, []
    saved = dataclasses.replace(saved, logging=given.logging)  # the curves go where told now
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


def _widest_job(sweep: SweepConfig) -> int:
    """The most GPUs one job of the sweep may span (:func:`plora.planner.fits.widest_degree`:
    1 without ``planner.strategies``, else the largest d <= num_gpus the model can be split
    over with one of them)."""
    from plora.model_spec import ModelSpec

    strategies = sweep.planner.strategies
    if not strategies:
        return 1
    try:
        spec = ModelSpec.from_hf_config(sweep.model.name_or_path)
    except ConfigError:  # the dataset check reports a model it cannot read
        spec = None
    return widest_degree(spec, strategies, sweep.hardware.num_gpus)


def _early_stopper(sweep: SweepConfig) -> Any:
    """The sweep's ``early_stop:`` stopper, or None; Ray Tune (1-2 s to import) only with one."""
    if sweep.early_stop is None:
        return None
    from plora.tune.adapter_stopper import make_early_stopper

    return make_early_stopper(sweep.early_stop)


__all__ = ["RunOptions", "SweepSummary", "config_source", "prepare", "run_sweep"]
