"""Rows the coordinator writes to the sweep directory (pure functions, and the job rows' list).

One row shape per table: ``metrics.parquet`` (:func:`metric_row`), ``results.parquet``
(:func:`result_row`), ``jobs.parquet`` (:func:`job_row`, kept in :class:`JobRows`); plus the
mapping from the engine's per-config status to :class:`ConfigStatus` and what the searcher is
told about a config.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from plora.config import LoRAConfig
from plora.engine.api import StepReport
from plora.runtime.records import ConfigStatus, JobSpec, JobStatus
from plora.sweepdir.schema import JOB_TIMINGS
from plora.sweepdir.tracked import TrackedList


def metric_rows(
    job_id: str, report: StepReport, now: float, *, attempt: int = 0
) -> list[dict[str, Any]]:
    """One step's report -> a ``metrics.parquet`` row per adapter; ``time`` = sweep clock,
    ``attempt`` = the job attempt that trained it."""
    return [
        {
            "config_id": m.config_id,
            "job_id": job_id,
            "attempt": int(attempt),
            "step": int(m.step),
            "loss": _f(m.loss),
            "lr": _f(m.lr),
            "tokens": int(m.tokens),
            "grad_norm": _f(m.grad_norm),
            "step_time_s": _f(m.time_s),
            "time": now,
        }
        for m in report.metrics
    ]


def result_row(
    config: LoRAConfig,
    *,
    status: ConfigStatus,
    metric_name: str | None,
    steps_seen: int = 0,
    **r: Any,
) -> dict[str, Any]:
    """A ``results.parquet`` row: the config's hyperparameters and how its training ended.

    Args:
        config: The config.
        status: Where it ended.
        metric_name: The dataset's metric (``exact_match``, ``accuracy``, ...) behind
            ``eval_metric``.
        steps_seen: Steps seen in the metric stream (used when ``r`` has no ``steps``).
        **r: ``ConfigResult`` fields plus ``job_id``, ``gpu_seconds``, ``error``.
    """
    hp = config.hparams()
    hp["target_modules"] = ",".join(hp["target_modules"])
    row: dict[str, Any] = {"config_id": config.config_id, **hp, "status": str(status)}
    for key in ("final_train_loss", "eval_loss", "eval_metric"):
        row[key] = _f(r.get(key))
    row["metric_name"] = metric_name
    row["steps"] = int(r.get("steps") or steps_seen)
    row["tokens"] = int(r.get("tokens") or 0)
    row["gpu_seconds"] = _f(r.get("gpu_seconds"))
    row["job_id"] = r.get("job_id")
    row["adapter_path"] = r.get("adapter_path")
    row["error"] = r.get("error")
    return row


def job_row(
    spec: JobSpec,
    *,
    config_ids: list[str],
    node: str | None,
    start: float,
    end: float | None,
    status: JobStatus,
    timings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``jobs.parquet`` row: one attempt of one job, with where its seconds went on the worker
    (``load_s``, ``start_s``, ``first_step_s``, ``train_s``, ``eval_s``, ``export_s``,
    ``checkpoint_s``; the worker's ``model_loads`` so far) once it ended."""
    t = timings or {}
    return {
        "job_id": spec.job_id,
        "config_ids": list(config_ids),
        "gpus": spec.gpus,
        "gpu_ids": list(spec.gpu_ids),
        "node": node,
        "start": start,
        "end": end,
        "status": str(status),
        "attempt": spec.attempt,
        "strategy": spec.strategy,
        "micro_batches": spec.micro_batches,
        **{k: _f(t.get(k)) for k in JOB_TIMINGS},
        "model_loads": None if "model_loads" not in t else int(t["model_loads"]),
    }


class JobRows(TrackedList[dict[str, Any]]):
    """``jobs.parquet``'s rows, one per job attempt, with each attempt's place: an upsert found
    its row by scanning every row (quadratic over a sweep). Tracked
    (:mod:`plora.sweepdir.tracked`): the writers read only the rows changed."""

    def __init__(self, rows: Iterable[dict[str, Any]] = ()) -> None:
        super().__init__(rows)
        self._at = {_attempt(r): i for i, r in enumerate(self)}

    def upsert(self, row: dict[str, Any]) -> None:
        """Replace the row of the same attempt (job id, attempt, start) or append ``row``."""
        key = _attempt(row)
        i = self._at.get(key)
        if i is None or i >= len(self) or _attempt(self[i]) != key:  # moved: find it again
            self._at = {_attempt(r): i for i, r in enumerate(self)}
            i = self._at.get(key)
        if i is None:
            self._at[key] = len(self)
            self.append(row)
        else:
            self[i] = row


def _attempt(row: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return (row["job_id"], row["attempt"], row["start"])


def config_status(value: Any, *, stopped: bool) -> ConfigStatus:
    """The engine's per-config status (``completed`` / ``stopped`` / ``aborted``) as ours."""
    text = str(value).lower()
    try:
        status = ConfigStatus(text)
    except ValueError:
        status = (
            ConfigStatus.DONE if text in ("completed", "finished", "ok") else ConfigStatus.FAILED
        )
    if stopped and status is ConfigStatus.DONE:
        return ConfigStatus.STOPPED
    return status


def tell_metrics(
    r: Mapping[str, Any], metric_name: str | None, *, status: ConfigStatus
) -> dict[str, Any]:
    """What the searcher is told when a config ends: its losses and metric (the sweep's
    ``metric`` is a key) and ``status`` (done / stopped / failed; metrics None when failed)."""
    out = {
        "status": str(status),
        "eval_loss": r.get("eval_loss"),
        "eval_metric": r.get("eval_metric"),
        "train_loss": r.get("final_train_loss"),
        "final_train_loss": r.get("final_train_loss"),
    }
    if metric_name and metric_name not in out:
        out[metric_name] = r.get("eval_metric")
    return out


def spec_state(spec: JobSpec) -> dict[str, Any]:
    """A job attempt as saved in ``state.json`` (configs by id)."""
    return {
        "job_id": spec.job_id,
        "config_ids": list(spec.config_ids),
        "gpus": spec.gpus,
        "strategy": spec.strategy,
        "attempt": spec.attempt,
        "max_rows": spec.max_rows,
    }


def _f(x: Any) -> float | None:
    return None if x is None else float(x)


__all__ = [
    "JobRows",
    "config_status",
    "job_row",
    "metric_rows",
    "result_row",
    "spec_state",
    "tell_metrics",
]
