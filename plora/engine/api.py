"""The typed boundary between the engine and the runtime: what a worker is asked, what it returns.

A resident worker holds one :class:`PackEngine` for the whole sweep: built once from an
:class:`EngineSpec` (the base model is loaded onto its GPU then), it serves successive
:class:`PackRequest` s -- one per job -- and answers each with a :class:`PackOutcome`. Between
steps the engine calls its :class:`PackHooks`: per-adapter :class:`StepMetrics` out, a
:class:`Control` (stop some adapters, add queued configs to free slots, abort) in.

Every type here is a frozen dataclass (or an enum) and crosses Ray as it is: no dicts, no
entry-point strings. This module imports neither torch nor Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from plora.config import ConfigError, CudaGraphs, DatasetSpec, LoRAConfig, ModelRef
from plora.config.fused import FusedKernels
from plora.engine.reports import AdapterStatus, Control, PackProfile, StepMetrics, StepProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class ConfigResult:
    """The outcome of one config of a pack."""

    config_id: str
    status: AdapterStatus
    """completed, stopped or aborted."""
    steps: int
    tokens: int
    final_train_loss: float | None
    eval_loss: float | None = None
    eval_metric: float | None = None
    adapter_path: str | None = None
    eval_s: float = 0.0
    """Wall seconds of this adapter's share of the (packed) evaluation."""
    export_s: float = 0.0
    """Wall seconds of its PEFT export: the device->host snapshot and the file write (the
    write overlaps the job's evaluation; ``JobTimings.export_critical_s`` is what it cost)."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": str(self.status)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ConfigResult:
        return cls(**{**data, "status": AdapterStatus(data["status"])})


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """What a resident worker loads once: the base model and the dataset."""

    model: ModelRef
    dataset: DatasetSpec
    gradient_checkpointing: bool = False
    """Recompute the frozen base's activations in backward."""
    device: str | None = None
    """``"cuda"`` / ``"cpu"``; None: CUDA when available."""
    max_rows: int | None = None
    """Most sequences per forward (gradient accumulation beyond)."""
    fused_kernels: FusedKernels = FusedKernels.AUTO
    """Liger-Kernel's fused RMSNorm/SwiGLU/RoPE on the base: auto | on | off
    (``training.fused_kernels``, :func:`plora.engine.liger.apply_fused_kernels`)."""
    cuda_graphs: CudaGraphs = CudaGraphs.AUTO
    """Replay the steady packed step as CUDA graphs: auto | on | off (``training.cuda_graphs``,
    :class:`~plora.engine.trainer.PackedTrainer`'s ``cuda_graphs``; one-GPU jobs only)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointPolicy:
    """Where and how often a job writes its train-state."""

    dir: str | None = None
    """The job's checkpoint directory (None: no checkpoints, no resume)."""
    every_steps: int | None = None
    """Every this many packed steps (None: only at the end)."""
    every_s: float | None = None
    """Also when this many seconds passed since the last one (None: never by time)."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ConfigError(
                "must be >= 1 or null", key="checkpoint_every", value=self.every_steps
            )
        if self.every_s is not None and not self.every_s >= 0:
            raise ConfigError(
                "must be >= 0 seconds or null", key="checkpoint_every_s", value=self.every_s
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class PackRequest:
    """One job for a resident engine: train ``configs`` packed until each ends."""

    job_id: str
    configs: tuple[LoRAConfig, ...]
    out_dir: str
    """Adapters go to ``out_dir/adapters/<config_id>/`` (PEFT format)."""
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    resume: bool = True
    """Continue from ``checkpoint.dir`` when it holds a train-state."""
    evaluate: bool = True
    """Evaluate every completed adapter on the eval split."""
    poll_every_s: float = 0.0
    """How often the worker asks for control (0: before every step)."""
    max_rows: int | None = None
    """Most rows per forward for this job (the plan's micro-batches: ``⌈rows/m⌉``); the
    engine runs the job with the smaller of this and ``EngineSpec.max_rows``. None: the
    engine's own limit (every row live when that is None too)."""

    def __post_init__(self) -> None:
        ids = [c.config_id for c in self.configs]
        if len(set(ids)) != len(ids):
            raise ConfigError("duplicate config ids in one pack", key="configs", value=ids)
        if self.max_rows is not None and (
            isinstance(self.max_rows, bool)
            or not isinstance(self.max_rows, int)
            or self.max_rows < 1
        ):
            raise ConfigError(
                "must be an integer >= 1 or null", key="max_rows", value=self.max_rows
            )

    def rows_limit(self, engine_max_rows: int | None) -> int | None:
        """The rows per forward this job runs with: the smaller of the request's and the
        engine's limits (None when neither sets one)."""
        limits = [r for r in (self.max_rows, engine_max_rows) if r is not None]
        return min(limits) if limits else None


class OutcomeStatus(StrEnum):
    """How a job ended on its worker."""

    OK = "ok"
    OOM = "oom"
    """``torch.OutOfMemoryError``: the worker stays up (its cache emptied); split the pack."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobTimings:
    """Where a job's wall seconds went on its worker (``jobs.parquet``, the cost model)."""

    load_s: float = 0.0
    """Base model load charged to this job (0 on a warm worker that already held it)."""
    start_s: float = 0.0
    """Set-up of the pack on the resident model (trainer, resume)."""
    train_s: float = 0.0
    """Packed steps."""
    eval_s: float = 0.0
    export_s: float = 0.0
    """Seconds spent exporting adapters: their device->host snapshots plus their file writes
    (the writes run on a background thread, overlapping evaluation and training)."""
    export_critical_s: float = 0.0
    """The part of the export on the job's critical path: the snapshots plus the seconds the job
    waited for writes still running (before a checkpoint, at its end). What the cost model
    charges for exports."""
    exports: int = 0
    """Adapters exported by this job."""
    checkpoint_s: float = 0.0
    checkpoints: int = 0
    model_loads: int = 0
    """Base-model loads this worker has done so far (1 for a resident worker, ever)."""
    started_at: float = 0.0
    """Wall-clock time (epoch seconds) the job began on its worker (0: not measured); the
    offsets below are from it, measured with a monotonic clock (the sweep's timeline:
    :mod:`plora.runtime.timeline`)."""
    first_step_s: float | None = None
    """Seconds from the job's start to the end of its first packed step: its set-up, the
    step, and kernels' compilation or graph capture where they happen (None: no step)."""
    last_step_s: float | None = None
    """Seconds from the job's start to the end of its last packed step (None: no step)."""
    eval_end_s: float | None = None
    """Seconds from the job's start to the end of its last evaluation (None: none ran)."""
    export_end_s: float | None = None
    """Seconds from the job's start until its last export was written (None: none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackOutcome:
    """A job's answer: every config's result, the measured profile and the timings."""

    job_id: str
    status: OutcomeStatus = OutcomeStatus.OK
    results: Mapping[str, ConfigResult] = field(default_factory=dict)
    profile: PackProfile | None = None
    timings: JobTimings = field(default_factory=JobTimings)
    error: str | None = None
    notes: tuple[str, ...] = ()
    """What happened that the sweep should record (e.g. a damaged checkpoint was skipped)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepReport:
    """One packed step as the runtime sees it: every active adapter's metrics and the step's
    measurements (the coordinator refits its cost model from these while the job runs)."""

    metrics: tuple[StepMetrics, ...]
    profile: StepProfile
    device: str = "cpu"
    """Where the step ran (``"cuda:0"``, ``"cpu"``)."""

    @property
    def config_ids(self) -> tuple[str, ...]:
        return tuple(m.config_id for m in self.metrics)


@runtime_checkable
class PackHooks(Protocol):
    """Callbacks of a running pack (the runtime relays them to the coordinator)."""

    def on_step(self, report: StepReport) -> None: ...

    def poll(self) -> Control: ...


@runtime_checkable
class SyncHooks(PackHooks, Protocol):
    """Hooks that can make every report so far durable; the engine calls ``sync`` before each
    checkpoint, so the metrics of the steps a checkpoint covers are never lost with a crash."""

    def sync(self) -> None: ...


@runtime_checkable
class PackEngine(Protocol):
    """A resident engine: ``cls(spec)`` loads the base model once; ``run`` trains one pack."""

    def __init__(self, spec: EngineSpec) -> None: ...

    def run(self, request: PackRequest, hooks: PackHooks | None = None) -> PackOutcome: ...


__all__ = [
    "AdapterStatus",
    "CheckpointPolicy",
    "ConfigResult",
    "Control",
    "EngineSpec",
    "JobTimings",
    "OutcomeStatus",
    "PackEngine",
    "PackHooks",
    "PackOutcome",
    "PackRequest",
    "StepMetrics",
    "StepReport",
    "SyncHooks",
]
