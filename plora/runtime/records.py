"""Typed records the runtime passes around: decisions, job specs, statuses, config sources.

Small and Ray-free so the coordinator's logic can be tested by feeding it events.
"""

from __future__ import annotations

import base64
import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from plora.config import LoRAConfig
from plora.sweepdir.schema import ConfigStatus, JobStatus
from plora.tune.source import ConfigSource, StaticSource


class Decision(StrEnum):
    """What the coordinator decided; every one is logged to ``decisions.jsonl`` with its inputs."""

    ASK = "ask"
    """New configs came from the searcher."""
    PLAN = "plan"
    """The first plan of the sweep. Its inputs name its plan file (``plan_file``:
    ``plans/plan-NNN.json``), count its queued configs and jobs (``num_configs``, ``num_jobs``)
    and list them too (``config_ids``, ``jobs``: the plan check reads them)."""
    REPLAN = "replan"
    """A re-plan of the remaining configs (after a job ended or configs arrived). Its inputs
    name its plan file and count its configs and jobs, as :attr:`PLAN`'s; they list them only
    without a sweep directory (:func:`plora.sweepdir.decisions.decision_jobs` reads them from
    either)."""
    REFIT = "refit"
    """The cost model was refit from measured steps, memory and overheads (old vs new inside);
    the first one, a few steps into the first job, is the calibration."""
    START_JOB = "start_job"
    """A job is launched on free GPUs (on their resident worker group)."""
    START_WORKERS = "start_workers"
    """A resident worker group is started on GPUs that had none (it loads the base model)."""
    WORKERS_READY = "workers_ready"
    """A worker group holds the base model; its start-up seconds were measured."""
    REFILL = "refill"
    """A queued config joins a running job in a slot a finished config left."""
    STOP_CONFIG = "stop_config"
    """One config is stopped (early stopping / user request)."""
    PAUSE_CONFIG = "pause_config"
    """One config is asked to pause (a Tune scheduler's PAUSE): it leaves its pack at the next
    step with its train-state (``plora.runtime.coordinator.pause``); ``deferred`` when its job cannot."""
    CONFIG_PAUSED = "config_paused"
    """A config left its pack paused (evaluated, exported, its train-state saved)."""
    RESUME_CONFIG = "resume_config"
    """A paused config is queued again: the next pack it joins continues it exactly."""
    CONFIG_DONE = "config_done"
    """A config finished training and was evaluated."""
    CONFIG_FAILED = "config_failed"
    """A config could not be trained (retries exhausted, OOM alone, error)."""
    JOB_DONE = "job_done"
    """A job ended normally; its GPUs are free."""
    RETRY = "retry"
    """A job's worker died; the job restarts from its last checkpoint."""
    REDO_STEPS = "redo_steps"
    """A job attempt trains again steps an earlier attempt had reported (it resumed from a
    checkpoint older than its last metrics, or a failed config is retried): ``steps`` maps each
    config to ``[first, last]`` redone step and ``attempt`` names the attempt that counts;
    ``metrics.parquet`` keeps that attempt's rows only."""
    SPLIT_OOM = "split_oom"
    """A job ran out of memory; its pack is split in halves."""
    JOB_FAILED = "job_failed"
    """A job failed for good (error, or retries exhausted)."""
    RESUME = "resume"
    """The driver restarted from the sweep dir; interrupted jobs resume from checkpoints."""
    SWEEP_DONE = "sweep_done"
    """Every config is done, stopped or failed and the searcher is finished."""
    TIMELINE = "timeline"
    """The run is over: seconds from the process start to each phase (Ray ready, inputs,
    workers, first and last step, evaluation, export, exit; :mod:`plora.runtime.timeline`),
    the driver's last record, after ``sweep_done``."""


class FailureKind(StrEnum):
    """Why a job ended without a result."""

    DIED = "died"
    """A worker actor (or its node) died: restart from the checkpoint."""
    OOM = "oom"
    """``torch.OutOfMemoryError`` in a worker: split the pack."""
    ERROR = "error"
    """Any other exception: the job's configs fail."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionRecord:
    """One logged decision."""

    kind: Decision
    time_s: float
    """Seconds since the sweep started (sweep clock, continues across ``--resume``)."""
    job_id: str | None = None
    config_ids: tuple[str, ...] = ()
    inputs: Mapping[str, Any] = field(default_factory=dict)
    """What the decision was based on (e.g. old vs new cost coefficients, free GPUs)."""

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "time_s": round(self.time_s, 6),
            "job_id": self.job_id,
            "config_ids": list(self.config_ids),
            "inputs": dict(self.inputs),
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """Everything the driver needs to launch one job attempt (small: goes through Ray)."""

    job_id: str
    configs: tuple[LoRAConfig, ...]
    gpus: int
    strategy: str | None = None
    attempt: int = 0
    gpu_ids: tuple[int, ...] = ()
    """The logical GPU slots the coordinator booked for it (for jobs.parquet / the Gantt chart)."""
    resume: bool = False
    """True when a checkpoint from an earlier attempt should be loaded."""
    max_rows: int | None = None
    """Rows per forward the engine runs the job with (the plan's micro-batches); None: all."""

    @property
    def config_ids(self) -> tuple[str, ...]:
        return tuple(c.config_id for c in self.configs)

    @property
    def micro_batches(self) -> int:
        """Forwards per step the job starts with: ``⌈rows / max_rows⌉`` (1: every row live)."""
        rows = sum(c.batch_size for c in self.configs)
        return 1 if self.max_rows is None else max(1, -(-rows // self.max_rows))


def encode_state(obj: Any) -> Any:
    """``obj`` itself when JSON-able, else ``{"__pickle__": base64}`` (searcher states)."""
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return {"__pickle__": base64.b64encode(pickle.dumps(obj)).decode()}


def decode_state(obj: Any) -> Any:
    """Inverse of :func:`encode_state`."""
    if isinstance(obj, dict) and set(obj) == {"__pickle__"}:
        return pickle.loads(base64.b64decode(obj["__pickle__"]))
    return obj


__all__ = [
    "ConfigSource",
    "ConfigStatus",
    "Decision",
    "DecisionRecord",
    "FailureKind",
    "JobSpec",
    "JobStatus",
    "StaticSource",
    "decode_state",
    "encode_state",
]
