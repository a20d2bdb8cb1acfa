"""Read a sweep directory into pandas DataFrames.

A sweep directory is the interface between a run and its analysis (DESIGN decision 9). This
module reads it and nothing else: no Ray, no torch. Files it understands:

=====================  ==================================================================
file                   columns / content
=====================  ==================================================================
``results.parquet``    one row per config: ``config_id``, its hyperparameters (flat columns,
                       or one ``hyperparameters`` column of dicts / JSON strings), ``status``,
                       ``final_train_loss``, ``eval_loss``, ``eval_metric``, ``steps``,
                       ``tokens``, ``gpu_seconds``, ``job_id``, ``adapter_path``
``metrics.parquet``    one row per (config, step): ``config_id``, ``step``, ``loss``, ``lr``,
                       ``tokens``, ``time``
``jobs.parquet``       one row per executed job: ``job_id``, ``config_ids``, ``gpus`` (a count
                       or a list of GPU ids), ``node``, ``start``, ``end``, ``status``
                       (optionally ``gpu_ids``, ``strategy``)
``plan.json``          the planner's plan (``Plan.to_json_dict()``)
``decisions.parquet``  coordinator decisions (or ``decisions.jsonl``), optional
``sweep.yaml``         the sweep definition, optional (gives the metric and mode)
=====================  ==================================================================

Missing optional files give empty frames; a directory with none of the files is an error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from plora.config import ConfigError

#: Hyperparameter columns in the order tables and plots show them.
HPARAM_COLUMNS: tuple[str, ...] = (
    "rank",
    "alpha",
    "lr",
    "batch_size",
    "target_modules",
    "dropout",
    "max_steps",
    "epochs",
    "warmup_steps",
    "schedule",
    "weight_decay",
    "max_grad_norm",
    "use_rslora",
    "seed",
)

RESULT_COLUMNS: tuple[str, ...] = (
    "config_id",
    "status",
    "final_train_loss",
    "eval_loss",
    "eval_metric",
    "steps",
    "tokens",
    "gpu_seconds",
    "job_id",
    "adapter_path",
)
METRIC_COLUMNS: tuple[str, ...] = ("config_id", "step", "loss", "lr", "tokens", "time")
JOB_COLUMNS: tuple[str, ...] = (
    "job_id",
    "config_ids",
    "gpus",
    "node",
    "start",
    "end",
    "status",
)

_SWEEP_FILES = ("results.parquet", "metrics.parquet", "jobs.parquet", "plan.json")


@dataclass(frozen=True, kw_only=True)
class SweepResults:
    """Everything a sweep directory holds, as DataFrames.

    Attributes are never ``None``: a file that is absent gives an empty frame with the
    documented columns, so notebooks need no special cases.
    """

    path: Path
    """The sweep directory."""
    results: pd.DataFrame
    """One row per config (index: position); hyperparameters as flat columns."""
    metrics: pd.DataFrame
    """Per-step training metrics, sorted by (config_id, step)."""
    jobs: pd.DataFrame
    """Executed jobs; ``start``/``end`` in seconds since the first job started."""
    plan: dict[str, Any] = field(default_factory=dict)
    """The plan as written by the planner (``{}`` when absent)."""
    decisions: pd.DataFrame = field(default_factory=pd.DataFrame)
    """Coordinator decisions, one row each (empty when absent)."""
    sweep: dict[str, Any] = field(default_factory=dict)
    """The sweep definition from ``sweep.yaml`` (``{}`` when absent)."""

    @property
    def metric(self) -> str:
        """The sweep's objective column (``sweep.yaml``'s ``metric``, default ``eval_loss``)."""
        return _objective_column(str(self.sweep.get("metric") or "eval_loss"))

    @property
    def mode(self) -> str:
        """``"min"`` or ``"max"`` (``sweep.yaml``'s ``mode``; default from the metric)."""
        mode = self.sweep.get("mode")
        if mode in ("min", "max"):
            return str(mode)
        return "min" if "loss" in self.metric else "max"

    @property
    def hparam_columns(self) -> list[str]:
        """Hyperparameter columns present in :attr:`results`, in display order."""
        return [c for c in HPARAM_COLUMNS if c in self.results.columns]

    def best(self, metric: str | None = None, mode: str | None = None, k: int = 1) -> pd.DataFrame:
        """The ``k`` best finished configs; see :func:`best`."""
        return best(self.results, metric or self.metric, mode or self.mode, k=k)


def _objective_column(metric: str) -> str:
    """Map a sweep metric name onto a results column (``eval/loss`` -> ``eval_loss``)."""
    return metric.replace("/", "_")


def load(path: str | Path) -> SweepResults:
    """Load a sweep directory.

    Args:
        path: the sweep directory (``<out>/<sweep name>``).

    Returns:
        A :class:`SweepResults`.

    Raises:
        ConfigError: ``path`` is not a directory or holds none of the sweep files.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"sweep dir {str(path)!r}: not a directory; pass the sweep's output dir")
    if not any((path / f).exists() for f in _SWEEP_FILES):
        raise ConfigError(
            f"sweep dir {str(path)!r}: none of {', '.join(_SWEEP_FILES)} found; "
            "pass the directory `plora sweep` wrote"
        )
    plan = _read_json(path / "plan.json")
    return SweepResults(
        path=path,
        results=_normalize_results(_read_parquet(path / "results.parquet", RESULT_COLUMNS)),
        metrics=_normalize_metrics(_read_parquet(path / "metrics.parquet", METRIC_COLUMNS)),
        jobs=_normalize_jobs(_read_parquet(path / "jobs.parquet", JOB_COLUMNS)),
        plan=plan,
        decisions=_read_decisions(path),
        sweep=_read_sweep(path / "sweep.yaml"),
    )


def best(results: pd.DataFrame, metric: str, mode: str = "min", k: int = 1) -> pd.DataFrame:
    """The ``k`` best configs of ``results`` by ``metric``.

    Rows whose metric is missing/NaN or whose ``status`` is not a success are ignored; ties keep
    the input order.

    Args:
        results: a results frame (``SweepResults.results``).
        metric: column to rank by, e.g. ``"eval_loss"``.
        mode: ``"min"`` or ``"max"``.
        k: how many rows to return (fewer if fewer qualify).

    Raises:
        ConfigError: unknown metric column or mode.
    """
    metric = _objective_column(metric)
    if mode not in ("min", "max"):
        raise ConfigError(f"best: mode={mode!r} must be 'min' or 'max'")
    if metric not in results.columns:
        choices = [c for c in results.columns if pd.api.types.is_numeric_dtype(results[c])]
        raise ConfigError(f"best: metric {metric!r} is not a results column; choose from {choices}")
    ok = results[metric].notna()
    if "status" in results.columns:
        ok &= results["status"].astype(str).str.lower().isin(_SUCCESS)
    ranked = results[ok].sort_values(metric, ascending=mode == "min", kind="stable")
    return ranked.head(k).reset_index(drop=True)


_SUCCESS = frozenset({"finished", "completed", "complete", "done", "succeeded", "success", "ok"})


def _read_parquet(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    if not path.exists():
        return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise ConfigError(
            f"{path}: cannot read parquet ({type(exc).__name__}: {exc}); re-run or remove the file"
        ) from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON ({exc}); re-run the planner") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_sweep(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML ({exc})") from None
    return data if isinstance(data, dict) else {}


def _read_decisions(path: Path) -> pd.DataFrame:
    if (path / "decisions.parquet").exists():
        return pd.read_parquet(path / "decisions.parquet")
    jl = path / "decisions.jsonl"
    if jl.exists():
        rows = [json.loads(line) for line in jl.read_text().splitlines() if line.strip()]
        return pd.DataFrame(rows)
    return pd.DataFrame()


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        data = json.loads(value)
        return data if isinstance(data, dict) else {}
    return {}


def _normalize_results(df: pd.DataFrame) -> pd.DataFrame:
    """Flatten a ``hyperparameters`` column and make list-valued cells hashable strings."""
    df = df.copy()
    if "hyperparameters" in df.columns:
        hp = pd.DataFrame([_as_dict(v) for v in df["hyperparameters"]], index=df.index)
        df = df.drop(columns="hyperparameters")
        for col in hp.columns:
            if col not in df.columns:
                df[col] = hp[col]
    if "target_modules" in df.columns:
        df["target_modules"] = df["target_modules"].map(_modules_str)
    for col in ("final_train_loss", "eval_loss", "eval_metric", "gpu_seconds"):
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    return df.reset_index(drop=True)


def _modules_str(value: Any) -> Any:
    if isinstance(value, str) or value is None:
        return value
    if isinstance(value, float) and math.isnan(value):
        return None
    return ",".join(str(v) for v in value)


def _normalize_metrics(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty:
        return df
    df = df.copy()
    for col in ("step", "loss", "lr", "tokens", "time"):
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    keys = [c for c in ("config_id", "step") if c in df.columns]
    return df.sort_values(keys, kind="stable").reset_index(drop=True) if keys else df


def _to_seconds(col: pd.Series) -> pd.Series:
    if pd.api.types.is_datetime64_any_dtype(col):
        return (col - col.min()).dt.total_seconds()
    return pd.to_numeric(col, errors="coerce")


def _normalize_jobs(df: pd.DataFrame) -> pd.DataFrame:
    """Times to seconds since the first start; ``config_ids`` to lists; add ``num_gpus``."""
    if df.empty:
        return df.assign(num_gpus=pd.Series(dtype="int64"))
    df = df.copy()
    start, end = _to_seconds(df["start"]), _to_seconds(df["end"])
    if pd.api.types.is_datetime64_any_dtype(df["start"]):
        origin = df["start"].min()
        end = (df["end"] - origin).dt.total_seconds()
    t0 = start.min()
    df["start"], df["end"] = start - t0, end - t0
    df["config_ids"] = df["config_ids"].map(_as_list)
    gpus = df["gpus"]
    df["num_gpus"] = [len(_as_list(g)) if _is_listlike(g) else int(g) for g in gpus]
    if "gpu_ids" not in df.columns:
        df["gpu_ids"] = [[int(i) for i in _as_list(g)] if _is_listlike(g) else None for g in gpus]
    return df.sort_values("start", kind="stable").reset_index(drop=True)


def _is_listlike(value: Any) -> bool:
    return not isinstance(value, str | bytes | int | float) and hasattr(value, "__len__")


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return [v for v in value.split(",") if v]
        return list(parsed) if isinstance(parsed, list) else [parsed]
    if value is None:
        return []
    return list(value)


__all__ = ["HPARAM_COLUMNS", "SweepResults", "best", "load"]
