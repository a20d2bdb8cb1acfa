"""A job as a Ray actor group: a placement group of d GPU bundles, one worker per GPU.

``launch_job`` reserves ``d`` bundles ``{"GPU": 1, "CPU": c}`` with ``STRICT_PACK`` (all on one
node), starts one :class:`~plora.runtime.worker.PackWorker` per bundle and calls ``run`` on every
rank; rank 0's result is the job's. ``d > 1`` jobs need a model-parallel engine (``tp``, ``fsdp``,
``pp``): until ``plora.parallel`` provides one they are refused with a clear error rather than
replicated silently (the cost model lists no strategies, so the planner only makes d = 1 jobs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from plora.config import ConfigError
from plora.runtime.records import JobSpec
from plora.runtime.worker import PackWorker

#: Strategies a job's workers can run for d > 1 (none until plora.parallel's engine lands).
RUNTIME_STRATEGIES: frozenset[str] = frozenset()


class UnsupportedJobError(RuntimeError):
    """A job asks for something the engine cannot run yet (d > 1 without a parallel strategy)."""


def check_strategies(strategies: Any) -> None:
    """ConfigError, before anything starts, when the plan may use d > 1 strategies the runtime
    cannot run (``planner.strategies`` set, or ``plora.parallel`` listing more than the runtime)."""
    bad = sorted(str(s) for s in strategies if str(s) not in RUNTIME_STRATEGIES)
    if bad:
        raise ConfigError(
            f"planner.strategies: {', '.join(bad)} cannot run yet: plora's runtime trains only "
            "d = 1 jobs (one GPU each); remove planner.strategies from the sweep"
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class JobHandle:
    """A launched job attempt: its placement group, workers and the result ref of rank 0."""

    spec: JobSpec
    pg: Any
    workers: list[Any]
    refs: list[Any]
    names: list[str]
    node_ref: Any = None
    """Rank 0's ``node_info`` (resolved by the driver when ready, for jobs.parquet)."""
    node: str | None = None

    @property
    def result_ref(self) -> Any:
        return self.refs[0]


def launch_job(
    spec: JobSpec,
    *,
    relay: Any,
    run_args: dict[str, Any],
    cpus_per_worker: float = 1.0,
    name_prefix: str = "plora",
    parallel_strategies: frozenset[str] = RUNTIME_STRATEGIES,
) -> JobHandle:
    """Start ``spec`` on ``spec.gpus`` workers; returns at once (results arrive on ``refs``).

    Args:
        spec: What to run (configs, d, strategy, attempt, resume).
        relay: The coordinator relay actor handle the workers stream to.
        run_args: ``model``, ``dataset``, ``out_dir``, ``checkpoint_dir`` (a per-job directory
            is made from it), ``checkpoint_every``, ``poll_every_s``.
        cpus_per_worker: CPU reservation per GPU bundle.
        name_prefix: Worker actors are named ``{prefix}-{job_id}-a{attempt}-r{rank}``.
        parallel_strategies: Strategies the engine supports for d > 1 (none yet).

    Raises:
        UnsupportedJobError: ``spec.gpus > 1`` and its strategy is not supported.
    """
    d = spec.gpus
    if d > 1 and (spec.strategy is None or spec.strategy not in parallel_strategies):
        raise UnsupportedJobError(
            f"job {spec.job_id}: d={d} GPUs with strategy {spec.strategy!r}, but plora's engine "
            "runs only d = 1 jobs until tp/fsdp/pp land in plora.parallel; plan with "
            "planner.strategies: [] (the default) so every job is d = 1"
        )
    pg = placement_group(
        [{"GPU": 1, "CPU": cpus_per_worker} for _ in range(d)],
        strategy="STRICT_PACK",
        name=f"{name_prefix}-{spec.job_id}-a{spec.attempt}",
    )
    worker_cls = _worker_cls()
    names = [f"{name_prefix}-{spec.job_id}-a{spec.attempt}-r{r}" for r in range(d)]
    workers = [
        worker_cls.options(
            name=names[r],
            num_gpus=1,
            num_cpus=cpus_per_worker,
            max_restarts=0,
            max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=r
            ),
        ).remote(rank=r, world_size=d, job_id=spec.job_id, relay=relay)
        for r in range(d)
    ]
    if d > 1:
        port = ray.get(workers[0].free_port.remote())
        addr = ray.get(workers[0].node_info.remote())["ip"]
        ray.get([w.init_group.remote(addr, port) for w in workers])
    job = {
        **run_args,
        "configs": [c.to_dict() for c in spec.configs],
        "checkpoint_dir": f"{run_args['checkpoint_dir']}/{spec.job_id}",
        "resume": True,
    }
    node_ref = workers[0].node_info.remote()
    refs = [w.run.remote(job) for w in workers]
    return JobHandle(spec=spec, pg=pg, workers=workers, refs=refs, names=names, node_ref=node_ref)


@functools.cache
def _worker_cls() -> Any:
    return ray.remote(PackWorker)


def stop_job(handle: JobHandle) -> None:
    """Kill the job's workers and free its placement group (idempotent)."""
    for w in handle.workers:
        with contextlib.suppress(Exception):  # already dead
            ray.kill(w, no_restart=True)
    with contextlib.suppress(Exception):  # already removed
        remove_placement_group(handle.pg)


__all__ = [
    "RUNTIME_STRATEGIES",
    "JobHandle",
    "UnsupportedJobError",
    "check_strategies",
    "launch_job",
    "stop_job",
]
