"""The sweep directory's schema: its files, the columns of its tables and their dtypes.

A sweep directory is the interface between a run and everything that reads it (DESIGN
decision 9): the runtime writes it (:mod:`plora.sweepdir.store`), ``plora status`` / ``plora
report``, the notebooks and :mod:`plora.analysis` read it (:mod:`plora.sweepdir.reader`). This
module is the one place that says what is in it. Layout (``DIR`` is ``plora sweep --out DIR``)::

    DIR/sweep.yaml          the resolved sweep config
    DIR/base_model/         built-in tiny base model saved as a HF dir (adapters reload on it)
    DIR/base_model.json     the base-model reference ({"name_or_path", "dtype", "quantization", "local_dir"})
    DIR/plan.json           the latest plan; DIR/plans/plan-NNN.json every plan in order
                            (:func:`plan_file` names one)
    DIR/decisions.jsonl     one JSON line per coordinator decision (append-only); a ``plan`` or
                            ``replan`` decision names its plan file (``plan_file``) and counts
                            its configs and jobs; only the first plan's lists them too
                            (:mod:`plora.sweepdir.decisions` reads both)
    DIR/jobs.parquet        one row per job attempt (:data:`JOB_COLUMNS`)
    DIR/metrics.parquet/    one row per (config, step) (:data:`METRIC_COLUMNS`): a directory of
                            parts, appended without rewriting (:mod:`plora.sweepdir.parts`;
                            ``pandas.read_parquet`` reads it as one table)
    DIR/results.parquet     one row per config (:data:`RESULT_COLUMNS`)
    DIR/adapters/<id>/      PEFT adapters; DIR/checkpoints/<job_id>/ train-state checkpoints
    DIR/state.json          coordinator state for ``--resume`` (holds :data:`SCHEMA_VERSION`);
                            its growing sections live in DIR/state.parts/*.jsonl, append-only
                            logs it names (:mod:`plora.sweepdir.state_parts`)
    DIR/data.json           rows per split: read, cut to max_seq_len, left out (no target left)
    DIR/tensorboard/<run>/  TensorBoard event files, one run per config (append-only, as it trains;
                            ``tensorboard --logdir DIR``; :mod:`plora.curves`)
    PARENT/.DIR.lock        beside DIR: the running writer's lock (:mod:`plora.sweepdir.lock`)

Paths to files inside ``DIR`` (``results.parquet``'s ``adapter_path``, the same in
``state.json``'s results) are stored relative to ``DIR`` (:func:`stored_path`) and resolved
against the directory they are read from (:func:`resolved_path`): a copied sweep directory
names its own adapters.

Dtypes are pandas' names as ``DataFrame.dtypes`` shows them after a round trip through
Parquet (``str`` columns may hold None; ``object`` columns hold lists, or values that may be
None throughout).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any


class ConfigStatus(StrEnum):
    """Where one config is in the sweep (``results.parquet``'s ``status``)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"
    FAILED = "failed"
    PAUSED = "paused"
    """Left its pack with its train-state (a Tune scheduler's PAUSE); queued again on resume,
    stopped at its pause step if the sweep ends first."""


class JobStatus(StrEnum):
    """Where one job attempt is (``jobs.parquet``'s ``status``)."""

    RUNNING = "running"
    DONE = "done"
    DIED = "died"
    OOM = "oom"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


#: Version of this layout; bump it when a file or column changes meaning. 2: ``metrics.parquet``
#: is a directory of parts (1: one file; read as it is, and made a directory on ``--resume``).
#: 3: ``state.json``'s growing sections are logs in ``state.parts/`` (2 and 1: read as they are).
#: 4: one log holds every section, the configs' status and progress and the early stopper's too,
#: whose ASHA rungs are saved as one record per (bracket, rung, config) (3 and before: read as
#: they are).
#: 5: a ``replan`` decision of ``decisions.jsonl`` names its plan file (``plan_file``, the
#: ``plans/plan-NNN.json`` that holds its jobs) and counts its queued configs and jobs
#: (``num_configs``, ``num_jobs``) instead of listing them (its ``config_ids`` is empty):
#: listed, they made the log quadratic in re-plans x queue (103 of 110 MB at 10,000 configs).
#: The first ``plan`` decision lists them still. 4 and before: read as they are
#: (:func:`plora.sweepdir.decisions.decision_jobs` reads either).
SCHEMA_VERSION = 5

SWEEP_YAML = "sweep.yaml"
BASE_MODEL_DIR = "base_model"
BASE_MODEL_JSON = "base_model.json"
PLAN_JSON = "plan.json"
PLANS_DIR = "plans"
DECISIONS_JSONL = "decisions.jsonl"
JOBS_PARQUET = "jobs.parquet"
METRICS_PARQUET = "metrics.parquet"
RESULTS_PARQUET = "results.parquet"
ADAPTERS_DIR = "adapters"
CHECKPOINTS_DIR = "checkpoints"
STATE_JSON = "state.json"
DATA_JSON = "data.json"
TENSORBOARD_DIR = "tensorboard"
LOG_FILE = "plora.log"  # the driver's log (plora.sweepdir.logfile)


def plan_file(index: int) -> str:
    """The plan of index ``index`` (0: the sweep's first), relative to the sweep directory:
    ``plans/plan-NNN.json``."""
    return f"{PLANS_DIR}/plan-{index:03d}.json"


#: Hyperparameter columns of ``results.parquet`` (``LoRAConfig.hparams()``), in the order
#: tables and plots show them.
HPARAM_DTYPES: dict[str, str] = {
    "rank": "int64",
    "alpha": "float64",
    "lr": "float64",
    "batch_size": "int64",
    "target_modules": "str",  # comma-joined projection names
    "dropout": "float64",
    "max_steps": "int64",
    "epochs": "object",  # float or None
    "warmup_steps": "int64",
    "schedule": "str",
    "weight_decay": "float64",
    "max_grad_norm": "float64",
    "use_rslora": "bool",
    "seed": "int64",
}

#: ``results.parquet``: one row per config, its hyperparameters and how its training ended.
RESULT_DTYPES: dict[str, str] = {
    "config_id": "str",
    **HPARAM_DTYPES,
    "status": "str",  # ConfigStatus
    "final_train_loss": "float64",
    "eval_loss": "float64",
    "eval_metric": "float64",
    "metric_name": "str",
    "steps": "int64",
    "tokens": "int64",
    "gpu_seconds": "float64",
    "job_id": "str",
    "adapter_path": "str",
    "error": "object",  # str or None
}

#: ``metrics.parquet``: one row per (config, optimizer step). A step trained again (a job
#: resumed from a checkpoint older than its last metrics, a retried config) keeps the row of the
#: attempt that counts, the latest (``attempt`` names it); ``decisions.jsonl`` records the redone
#: range (``redo_steps``). Its parts may still hold an earlier attempt's row until they are
#: merged (as sweep directories written before held a row per attempt):
#: ``plora.sweepdir.reader.read_metrics`` keeps the latest.
METRIC_DTYPES: dict[str, str] = {
    "config_id": "str",
    "job_id": "str",
    "attempt": "int64",  # the job attempt that trained this step (jobs.parquet's ``attempt``)
    "step": "int64",
    "loss": "float64",
    "lr": "float64",
    "tokens": "int64",
    "grad_norm": "float64",
    "step_time_s": "float64",
    "time": "float64",  # seconds since the sweep started
}

#: The per-phase seconds of a job on its workers (``plora.engine.api.JobTimings``).
JOB_TIMINGS: tuple[str, ...] = (
    "load_s",
    "start_s",
    "first_step_s",  # from the job's start to its first step's end (compilation, capture in it)
    "train_s",
    "eval_s",
    "export_s",
    "export_critical_s",  # the part of export_s the job waited for (writes run in background)
    "checkpoint_s",
)

#: ``jobs.parquet``: one row per attempt of a job.
JOB_DTYPES: dict[str, str] = {
    "job_id": "str",
    "config_ids": "object",  # list of config ids
    "gpus": "int64",
    "gpu_ids": "object",  # list of GPU ids
    "node": "str",
    "start": "float64",
    "end": "float64",
    "status": "str",  # JobStatus
    "attempt": "int64",
    "strategy": "object",  # str or None (d = 1)
    "micro_batches": "int64",  # forwards per step at launch: ⌈rows / max_rows⌉ (1: all live)
    **dict.fromkeys(JOB_TIMINGS, "float64"),
    "model_loads": "int64",
}

#: Fields of a result row that hold a path inside the sweep directory.
PATH_FIELDS: tuple[str, ...] = ("adapter_path",)


def stored_path(root: str | os.PathLike[str], path: Any) -> Any:
    """``path`` as the sweep directory ``root`` stores it: relative to ``root`` when inside it
    (``adapters/<id>``), else unchanged (None, a path elsewhere)."""
    if not isinstance(path, str | os.PathLike) or not str(path):
        return path
    p, base = Path(path).absolute(), Path(root).absolute()
    return p.relative_to(base).as_posix() if p.is_relative_to(base) else str(path)


def resolved_path(root: str | os.PathLike[str], stored: Any) -> Any:
    """A stored path read from the sweep directory ``root``: a relative one joined to ``root``
    (as the reader named it), an absolute one (a directory written before paths were stored
    relative) unchanged."""
    if not isinstance(stored, str) or not stored or Path(stored).is_absolute():
        return stored
    return str(Path(root) / stored)


def resolve_paths(frame: Any, root: str | os.PathLike[str]) -> Any:
    """A ``results.parquet`` frame (pandas) with its :data:`PATH_FIELDS` resolved against
    ``root``, in place; returned for chaining."""
    for col in PATH_FIELDS:
        if col in frame.columns:
            frame[col] = frame[col].map(lambda p: resolved_path(root, p))
    return frame


def with_paths(row: Mapping[str, Any], convert: Callable[[Any], Any]) -> dict[str, Any]:
    """``row`` with its :data:`PATH_FIELDS` passed through ``convert``."""
    return {k: convert(v) if k in PATH_FIELDS else v for k, v in row.items()}


HPARAM_COLUMNS: tuple[str, ...] = tuple(HPARAM_DTYPES)
RESULT_COLUMNS: tuple[str, ...] = tuple(RESULT_DTYPES)
METRIC_COLUMNS: tuple[str, ...] = tuple(METRIC_DTYPES)
JOB_COLUMNS: tuple[str, ...] = tuple(JOB_DTYPES)

#: The tables, by file name.
TABLES: dict[str, dict[str, str]] = {
    RESULTS_PARQUET: RESULT_DTYPES,
    METRICS_PARQUET: METRIC_DTYPES,
    JOBS_PARQUET: JOB_DTYPES,
}

__all__ = [
    "ADAPTERS_DIR",
    "BASE_MODEL_DIR",
    "BASE_MODEL_JSON",
    "CHECKPOINTS_DIR",
    "DATA_JSON",
    "DECISIONS_JSONL",
    "HPARAM_COLUMNS",
    "HPARAM_DTYPES",
    "JOBS_PARQUET",
    "JOB_COLUMNS",
    "JOB_DTYPES",
    "JOB_TIMINGS",
    "LOG_FILE",
    "METRICS_PARQUET",
    "METRIC_COLUMNS",
    "METRIC_DTYPES",
    "PATH_FIELDS",
    "PLANS_DIR",
    "PLAN_JSON",
    "RESULTS_PARQUET",
    "RESULT_COLUMNS",
    "RESULT_DTYPES",
    "SCHEMA_VERSION",
    "STATE_JSON",
    "SWEEP_YAML",
    "TABLES",
    "TENSORBOARD_DIR",
    "ConfigStatus",
    "JobStatus",
    "plan_file",
    "resolve_paths",
    "resolved_path",
    "stored_path",
    "with_paths",
]
