"""Resident worker groups: a placement group of d GPU bundles, one worker per GPU, kept for the
sweep.

A group is started on the GPUs the coordinator booked for a job, loads the base model once
(:meth:`PackWorker.load`) and then serves every later job booked on the same GPUs: a job is a
call of ``run`` on the group's workers, not a process. The driver tears a group down only when its
GPUs are wanted by a job of another shape, when a worker died, or at the end of the sweep.

A ``d > 1`` group is one job's ``d`` ranks: its workers join one torch.distributed group (NCCL
on GPU, gloo on CPU) before they load, and each builds a
:class:`~plora.parallel.session.ParallelPackSession` for the group's strategy (``tp``,
``fsdp``, ``fsdp_offload`` or ``pp``, :data:`RUNTIME_STRATEGIES`); rank 0 carries the job's metrics, control and
outcome. A strategy the runtime cannot run is refused with a clear error rather than replicated silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from plora.config import JOB_STRATEGIES, ConfigError
from plora.engine.api import EngineSpec, PackEngine, PackRequest
from plora.runtime.actors.worker import PackWorker, WorkerInfo

#: Strategies a group's workers can run for d > 1 (:data:`plora.config.JOB_STRATEGIES`).
RUNTIME_STRATEGIES: frozenset[str] = frozenset(str(s) for s in JOB_STRATEGIES)


class UnsupportedJobError(RuntimeError):
    """A job asks for something the engine cannot run (d > 1 without a runtime strategy)."""


def check_strategies(strategies: Any) -> None:
    """ConfigError, before anything starts, when the plan may use d > 1 strategies the runtime
    cannot run (``planner.strategies`` set, or ``plora.parallel`` listing more than the runtime)."""
    bad = sorted(str(s) for s in strategies if str(s) not in RUNTIME_STRATEGIES)
    if bad:
        runs = ", ".join(sorted(RUNTIME_STRATEGIES)) or "none"
        raise ConfigError(
            f"planner.strategies: {', '.join(bad)} cannot run yet: plora's runtime runs d > 1 "
            f"jobs with {runs}; remove {', '.join(bad)} from planner.strategies"
        )


@dataclasses.dataclass(kw_only=True, slots=True)
class WorkerGroup:
    """A started group: its GPUs (the coordinator's logical ids), placement group and workers."""

    gpu_ids: tuple[int, ...]
    strategy: str | None
    name: str
    pg: Any
    workers: list[Any]
    load_refs: list[Any]
    """``PackWorker.load`` of every rank (resolves to :class:`WorkerInfo`)."""
    started_at: float
    """``time.monotonic()`` when the group was asked for."""
    info: WorkerInfo | None = None
    """Rank 0's, once loaded."""
    ready_s: float | None = None
    """Seconds from the request to the loaded model (worker start + model load)."""
    jobs: int = 0
    """Jobs this group was given."""

    @property
    def node(self) -> str | None:
        return None if self.info is None else f"{self.info.host}:{self.info.node_id[:8]}"

    def submit(self, request: PackRequest) -> list[Any]:
        """Start ``request`` on every rank; rank 0's ref carries the outcome."""
        self.jobs += 1
        return [w.run_job.remote(request) for w in self.workers]


def start_group(
    gpu_ids: tuple[int, ...],
    *,
    strategy: str | None,
    relay: Any,
    engine: type[PackEngine] | None,
    spec: EngineSpec,
    name: str,
    cpus_per_worker: float = 1.0,
    gpus_per_worker: int = 1,
    parallel_strategies: frozenset[str] = RUNTIME_STRATEGIES,
) -> WorkerGroup:
    """Reserve ``len(gpu_ids)`` GPU bundles (STRICT_PACK, one node), start a worker on each and
    ask them to load the engine; returns at once (loading resolves on ``load_refs``).

    Raises:
        UnsupportedJobError: more than one GPU and the strategy is not supported.
    """
    d = len(gpu_ids)
    if d > 1 and (strategy is None or strategy not in parallel_strategies):
        runs = ", ".join(sorted(parallel_strategies)) or "none"
        raise UnsupportedJobError(
            f"{name}: d={d} GPUs with strategy {strategy!r}; the runtime runs d > 1 jobs with "
            f"{runs}; plan with planner.strategies among those"
        )
    started = time.monotonic()
    bundle = {"CPU": cpus_per_worker, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    pg = placement_group([dict(bundle) for _ in range(d)], strategy="STRICT_PACK", name=name)
    workers = [
        _worker_cls()
        .options(
            name=f"{name}-r{r}",
            num_gpus=gpus_per_worker,
            num_cpus=cpus_per_worker,
            max_restarts=0,
            max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=r
            ),
        )
        .remote(rank=r, world_size=d, relay=relay, engine=engine, spec=spec, strategy=strategy)
        for r in range(d)
    ]
    # d > 1: each rank joins the process group inside its load, at rank 0's address once rank 0
    # is up (an ObjectRef argument): the driver never waits for a group's processes, so the
    # groups of a plan start side by side
    master = (workers[0].rendezvous.remote(),) if d > 1 else ()
    return WorkerGroup(
        gpu_ids=tuple(gpu_ids),
        strategy=strategy,
        name=name,
        pg=pg,
        workers=workers,
        load_refs=[w.load.remote(*master) for w in workers],
        started_at=started,
    )


@functools.cache
def _worker_cls() -> Any:
    return ray.remote(PackWorker)


def stop_group(group: WorkerGroup) -> None:
    """Kill the group's workers and free its placement group (idempotent)."""
    for w in group.workers:
        with contextlib.suppress(Exception):  # already dead
            ray.kill(w, no_restart=True)
    with contextlib.suppress(Exception):  # already removed
        remove_placement_group(group.pg)


__all__ = [
    "RUNTIME_STRATEGIES",
    "UnsupportedJobError",
    "WorkerGroup",
    "check_strategies",
    "start_group",
    "stop_group",
]
