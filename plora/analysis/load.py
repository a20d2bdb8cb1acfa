"""A sweep directory as one :class:`SweepResults` of pandas DataFrames, and ranking configs.

A sweep directory is the interface between a run and its analysis (DESIGN decision 9); its files
and columns are :mod:`plora.sweepdir.schema`, read by :mod:`plora.sweepdir.reader` (no Ray, no
torch). A file that is absent or damaged (an interrupted sweep, a half-copied directory) gives an
empty frame and an entry in :attr:`SweepResults.missing` saying what and why; a directory with none
of the files is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from plora.config import ConfigError
from plora.sweepdir import reader
from plora.sweepdir.schema import HPARAM_COLUMNS


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
    missing: dict[str, str] = field(default_factory=dict)
    """Files of the sweep directory that are absent or damaged, with why (file name -> reason);
    empty for a finished sweep. :attr:`missing_note` words it in one line."""

    @property
    def missing_note(self) -> str:
        """``missing: results.parquet (the per-config results: not written yet ...)`` or ``""``."""
        return reader.missing_note(self.missing)

    @property
    def metric(self) -> str:
        """The sweep's objective column (``sweep.yaml``'s ``metric``, default ``eval_loss``;
        :func:`plora.sweepdir.reader.objective`)."""
        return reader.objective(self.sweep)[0]

    @property
    def mode(self) -> str:
        """``"min"`` or ``"max"`` (``sweep.yaml``'s ``mode``; default from the metric)."""
        return reader.objective(self.sweep)[1]

    @property
    def hparam_columns(self) -> list[str]:
        """Hyperparameter columns present in :attr:`results`, in display order."""
        return [c for c in HPARAM_COLUMNS if c in self.results.columns]

    def best(self, metric: str | None = None, mode: str | None = None, k: int = 1) -> pd.DataFrame:
        """The ``k`` best finished configs; see :func:`best`."""
        return best(self.results, metric or self.metric, mode or self.mode, k=k)


def _objective_column(metric: str) -> str:
    """Map a sweep metric name onto a results column (``eval/loss`` -> ``eval_loss``,
    ``train_loss`` -> ``final_train_loss``)."""
    metric = metric.replace("/", "_")
    return reader.METRIC_COLUMN.get(metric, metric)


def load(path: str | Path) -> SweepResults:
    """Load a sweep directory.

    Args:
        path: the sweep directory (``<out>/<sweep name>``).

    Returns:
        A :class:`SweepResults`.

    Raises:
        ConfigError: ``path`` is not a directory or holds none of the sweep files.
    """
    path = reader.check_sweep_dir(path)
    missing: dict[str, str] = {}
    return SweepResults(
        path=path,
        results=reader.read_results(path, missing),
        metrics=reader.read_metrics(path, missing),
        jobs=reader.read_jobs(path, missing),
        plan=reader.read_plan(path, missing),
        decisions=reader.read_decisions(path, missing),
        sweep=reader.read_sweep(path, missing),
        missing=missing,
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
        ok &= results["status"].astype(str).str.lower().isin(reader.SUCCESS_STATUSES)
    ranked = results[ok].sort_values(metric, ascending=mode == "min", kind="stable")
    return ranked.head(k).reset_index(drop=True)


__all__ = ["HPARAM_COLUMNS", "SweepResults", "best", "load"]
