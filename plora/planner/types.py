"""Planner data types: :class:`Job`, :class:`Plan`, :class:`Baseline`, :class:`Objective`.

Pure dataclasses; ``Plan.to_json_dict()`` is what the CLI writes to ``plan.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from plora.config import ConfigError
from plora.cost import MEM_RTOL, Strategy

GIB = float(1 << 30)


class Baseline(StrEnum):
    """The comparison schedules of the paper (§7) built by :func:`plora.planner.baseline_plan`."""

    MIN_GPU = "min_gpu"
    """One config per job on the fewest GPUs it fits on, as many jobs in parallel as fit."""
    MAX_GPU = "max_gpu"
    """One config per job on all GPUs (largest power of two), one job after another."""
    TUNE = "tune"
    """Ray Tune with one trial per config: Min GPU's jobs, but every trial is a new process
    that starts its workers and loads the model (each job pays ``cost.startup_time(d)``);
    Min GPU and Max GPU run on plora's resident workers (start-up once per group)."""
    SEQUENTIAL = "sequential"
    """Packed jobs (the planner's F(G, K) packs) run one at a time on all GPUs."""


class Objective(StrEnum):
    """The per-config value ``v_k`` in the throughput ``Σ v_k H_k / T(H, d)`` (Eq. 13/18)."""

    WORK = "work"
    """``cost.config_work(k)``: single-GPU seconds of the config, i.e. its FLOPs (Eq. 12)."""
    RANK = "rank"
    """``k.rank``: the paper's proxy for LoRA FLOPs (exact only when all configs share steps)."""


class NoFeasibleJobError(ConfigError):
    """A config fits no allowed ``(d, strategy)``: even alone it exceeds GPU memory."""


def call_strategy(d: int, strategy: Strategy | None) -> Strategy:
    """The strategy passed to the cost model: ``d = 1`` jobs have none, so TP (a no-op at d=1).

    Args:
        d: GPUs of the job.
        strategy: the job's strategy, ``None`` for ``d = 1``.
    """
    if strategy is None:
        if d != 1:
            raise ValueError(f"a job on d={d} GPUs needs a strategy")
        return Strategy.TP
    return strategy


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One packed job of a plan: a pack of configs on ``gpus`` GPUs over ``[start_s, end_s)``."""

    job_id: str
    """Stable id inside the plan ("j0000", ... in start order)."""
    config_ids: tuple[str, ...]
    """The configs trained together (the pack)."""
    gpus: int
    """Parallel degree d (a power of two)."""
    strategy: Strategy | None
    """How the base model is split over the d GPUs; ``None`` when d = 1."""
    start_s: float
    """Predicted start (the job takes its GPUs), seconds from the plan's time origin."""
    end_s: float
    """Predicted end: ``start_s + startup_s + T(pack, d, strategy)``."""
    memory_gib_per_gpu: float
    """Predicted peak memory per GPU: ``M_base(d) + Σ M_k(d)``, GiB."""
    gpu_ids: tuple[int, ...] = ()
    """Which of the plan's GPUs (0..G-1) run the job; for the Gantt chart."""
    startup_s: float = 0.0
    """Seconds the job first waits for its worker group to start and load the model (0 on a
    warm, resident group): ``cost.startup_time(d)`` or 0."""
    micro_batches: int = 1
    """Forwards per optimizer step: > 1 when the pack fits only with that many micro-batches
    of at most ``max_rows`` rows (:mod:`plora.planner.micro`)."""
    max_rows: int | None = None
    """Rows per forward the trainer runs the job with (``⌈rows/micro_batches⌉``); None: all."""

    def __post_init__(self) -> None:
        if self.micro_batches < 1 or (self.max_rows is not None and self.max_rows < 1):
            raise ConfigError(
                f"job {self.job_id}: micro_batches={self.micro_batches!r} must be >= 1 and "
                f"max_rows={self.max_rows!r} >= 1 or null"
            )

    @property
    def duration_s(self) -> float:
        """``end_s - start_s`` (start-up included)."""
        return self.end_s - self.start_s

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready dict with the contract keys (plus ``gpu_ids``)."""
        return {
            "job_id": self.job_id,
            "config_ids": list(self.config_ids),
            "gpus": self.gpus,
            "strategy": None if self.strategy is None else str(self.strategy),
            "start_s": self.start_s,
            "end_s": self.end_s,
            "memory_gib_per_gpu": self.memory_gib_per_gpu,
            "gpu_ids": list(self.gpu_ids),
            "startup_s": self.startup_s,
            "micro_batches": self.micro_batches,
            "max_rows": self.max_rows,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Job:
        """Inverse of :meth:`to_json_dict` (``plan.json`` -> ``Job``)."""
        strategy = data.get("strategy")
        return cls(
            job_id=str(data["job_id"]),
            config_ids=tuple(data["config_ids"]),
            gpus=int(data["gpus"]),
            strategy=None if strategy is None else Strategy(strategy),
            start_s=float(data["start_s"]),
            end_s=float(data["end_s"]),
            memory_gib_per_gpu=float(data["memory_gib_per_gpu"]),
            gpu_ids=tuple(int(g) for g in data.get("gpu_ids") or ()),
            startup_s=float(data.get("startup_s") or 0.0),
            micro_batches=int(data.get("micro_batches") or 1),
            max_rows=None if data.get("max_rows") is None else int(data["max_rows"]),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A timeline of jobs covering configs once each, with its lower bound and ratio bound."""

    jobs: tuple[Job, ...]
    """Jobs sorted by start time."""
    num_configs: int
    """Configs the plan covers."""
    num_gpus: int
    """G, the GPUs the plan may use."""
    makespan_s: float
    """Predicted end of the last job (time origin = plan start, or ``now`` for a re-plan)."""
    lower_bound_s: float
    """A makespan no schedule can beat (:func:`plora.planner.bounds.lower_bound`)."""
    ratio_bound: float
    """Thm 6.1: ``F / (F - T_last (G - D) / G)`` with F the makespan."""
    solver: str = "bnb"
    """Knapsack backend that solved the ILPs (``bnb``, ``highs``, ``cvxpy``, ``gurobi``)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Human-readable remarks: fallbacks taken, search budgets hit, the chosen deadline."""

    @property
    def lb_ratio(self) -> float:
        """``makespan / lower bound``: a proven upper bound on the plan's distance to optimal."""
        if self.lower_bound_s <= 0:
            return 1.0
        return self.makespan_s / self.lower_bound_s

    def to_json_dict(self) -> dict[str, Any]:
        """The ``plan.json`` content (contract keys plus ``solver``, ``notes``, ``lb_ratio``)."""
        return {
            "num_configs": self.num_configs,
            "num_gpus": self.num_gpus,
            "makespan_s": self.makespan_s,
            "lower_bound_s": self.lower_bound_s,
            "ratio_bound": self.ratio_bound,
            "lb_ratio": self.lb_ratio,
            "solver": self.solver,
            "notes": list(self.notes),
            "jobs": [job.to_json_dict() for job in self.jobs],
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of :meth:`to_json_dict`: a ``Plan`` from a ``plan.json`` document."""
        return cls(
            jobs=tuple(Job.from_json_dict(j) for j in data["jobs"]),
            num_configs=int(data["num_configs"]),
            num_gpus=int(data["num_gpus"]),
            makespan_s=float(data["makespan_s"]),
            lower_bound_s=float(data["lower_bound_s"]),
            ratio_bound=float(data["ratio_bound"]),
            solver=str(data.get("solver", "bnb")),
            notes=tuple(data.get("notes") or ()),
        )


__all__ = [
    "GIB",
    "MEM_RTOL",
    "Baseline",
    "Job",
    "NoFeasibleJobError",
    "Objective",
    "Plan",
    "call_strategy",
]
