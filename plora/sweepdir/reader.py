"""Read a sweep directory into pandas DataFrames and dicts: no Ray, no torch.

The reader of what :mod:`plora.sweepdir.store` writes (files and columns:
:mod:`plora.sweepdir.schema`), used by :mod:`plora.analysis` (hence notebooks and ``plora
report``). It is tolerant: a missing optional file gives an empty frame with the schema's
columns, ``results.parquet`` may hold its hyperparameters as one ``hyperparameters`` column of
dicts / JSON strings, ``jobs.parquet`` times may be datetimes and its ``gpus`` a list of GPU ids.
``decisions.parquet`` is read in place of ``decisions.jsonl`` when present.

An interrupted or partial sweep directory is read as far as it goes: each ``read_*`` takes a
``missing`` dict and, when given one, records there a file that is absent or damaged (with why,
:func:`missing_note` words it) and returns an empty frame instead of raising.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plora.config import ConfigError
from plora.sweepdir import schema
from plora.sweepdir.decisions import read_records
from plora.sweepdir.parts import read_table
from plora.sweepdir.state_parts import assemble_live

if TYPE_CHECKING:  # pandas (and pyarrow) load where a frame is built: the driver never waits
    import pandas as pd

#: Files of which a sweep directory holds at least one.
SWEEP_FILES: tuple[str, ...] = (
    schema.RESULTS_PARQUET,
    schema.METRICS_PARQUET,
    schema.JOBS_PARQUET,
    schema.PLAN_JSON,
    schema.STATE_JSON,
)


#: What each file of a sweep directory holds: the words of :func:`missing_note`.
FILE_ROLES: dict[str, str] = {
    schema.SWEEP_YAML: "the sweep definition",
    schema.STATE_JSON: "the driver's state",
    schema.PLAN_JSON: "the plan",
    schema.JOBS_PARQUET: "the job attempts",
    schema.METRICS_PARQUET: "the loss curves",
    schema.RESULTS_PARQUET: "the per-config results",
    schema.DECISIONS_JSONL: "the coordinator's decisions",
}
#: Why a file is absent: nothing of that kind was written yet (the sweep was interrupted early
#: or is still starting).
NOT_WRITTEN = "not written yet (the sweep is starting or stopped before)"


def missing_note(missing: dict[str, str]) -> str:
    """One line naming what a partial sweep directory lacks: ``missing: results.parquet (the
    per-config results: not written yet ...); ...`` (``""`` when nothing is missing)."""
    if not missing:
        return ""
    by_why: dict[str, list[str]] = {}
    for name, why in missing.items():
        by_why.setdefault(why, []).append(f"{name} ({FILE_ROLES.get(name, name)})")
    return "missing: " + "; ".join(f"{', '.join(names)}: {why}" for why, names in by_why.items())


def check_sweep_dir(path: str | Path) -> Path:
    """``path`` as a :class:`Path`; :class:`ConfigError` unless it holds a sweep."""
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"sweep dir {str(path)!r}: not a directory; pass the sweep's output dir")
    if not any((path / f).exists() for f in SWEEP_FILES):
        raise ConfigError(
            f"sweep dir {str(path)!r}: not a plora sweep directory (none of {', '.join(SWEEP_FILES)}); "
            "pass the directory `plora sweep` wrote"
        )
    return path


Missing = dict[str, str] | None


def read_results(path: Path, missing: Missing = None) -> pd.DataFrame:
    """``results.parquet``: one row per config, hyperparameters as flat columns, adapter paths
    under ``path``."""
    df = _read_parquet(path / schema.RESULTS_PARQUET, schema.RESULT_COLUMNS, missing)
    return schema.resolve_paths(_normalize_results(df), path)  # this copy's paths


def read_metrics(
    path: Path, missing: Missing = None, *, all_attempts: bool = False
) -> pd.DataFrame:
    """``metrics.parquet``, sorted by (config_id, step).

    A step trained more than once (a job resumed from a checkpoint older than its last
    metrics, a retried config) keeps only its latest row (by ``time``), so a loss curve is the
    one the final adapter followed; ``all_attempts`` keeps every row (``attempt`` tells them
    apart).
    """
    df = _read_parquet(path / schema.METRICS_PARQUET, schema.METRIC_COLUMNS, missing)
    df = _normalize_metrics(df)
    if all_attempts or df.empty or not {"config_id", "step", "time"} <= set(df.columns):
        return df
    latest = df.sort_values("time", kind="stable").drop_duplicates(
        ["config_id", "step"], keep="last"
    )
    return latest.sort_values(["config_id", "step"], kind="stable").reset_index(drop=True)


def read_jobs(path: Path, missing: Missing = None) -> pd.DataFrame:
    """``jobs.parquet``; ``start``/``end`` in seconds since the first start, plus ``num_gpus``."""
    return _normalize_jobs(_read_parquet(path / schema.JOBS_PARQUET, schema.JOB_COLUMNS, missing))


def read_plan(path: Path, missing: Missing = None) -> dict[str, Any]:
    """``plan.json`` (``{}`` when absent)."""
    return _read_json(path / schema.PLAN_JSON, missing)


def read_state(
    path: Path, missing: Missing = None, *, sections: Collection[str] | None = None
) -> dict[str, Any]:
    """``state.json`` with the section logs it names (:mod:`.state_parts`), the driver's
    state (``{}`` when absent); ``sections``: only these logged sections (e.g. ``("status",)``;
    the others are left out and their lines not decoded)."""
    head = _read_json(path / schema.STATE_JSON, missing)
    try:
        return assemble_live(
            path,
            head,
            lambda: _read_json(path / schema.STATE_JSON, missing),
            sections=sections,
        )
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        _damaged(path / schema.STATE_JSON, exc, missing, "the sweep dir is damaged")
        return {}


def read_sweep(path: Path, missing: Missing = None) -> dict[str, Any]:
    """``sweep.yaml`` as a plain dict (``{}`` when absent)."""
    return _read_sweep(path / schema.SWEEP_YAML, missing)


def read_data_report(path: Path, missing: Missing = None) -> dict[str, Any] | None:
    """``data.json``: rows cut or left out per split (None when the sweep wrote none)."""
    if not (path / schema.DATA_JSON).exists():  # optional: absent is not missing
        return None
    return _read_json(path / schema.DATA_JSON, missing) or None


def read_decisions(path: Path, missing: Missing = None) -> pd.DataFrame:
    """Coordinator decisions, one row each (empty when absent); a torn line is skipped.

    A ``replan`` row names its plan file instead of listing its jobs (layout version 5):
    :func:`plora.sweepdir.decisions.decision_jobs` gives them."""
    return _read_decisions(path, missing)


def read_decision_records(path: Path, missing: Missing = None) -> list[dict[str, Any]]:
    """``decisions.jsonl``'s records as dicts, in order (``[]`` when absent); a torn line is
    skipped. Parsed once per version of the file in a process
    (:func:`plora.sweepdir.decisions.read_records`: shared dicts, do not change them).
    ``decisions.parquet`` is read in its place when present."""
    if (path / "decisions.parquet").exists():
        return _read_parquet(path / "decisions.parquet", (), missing).to_dict("records")
    jl = path / schema.DECISIONS_JSONL
    if _absent(jl, missing):
        return []
    try:
        return read_records(jl)
    except OSError as exc:
        _damaged(jl, exc, missing, "the sweep dir is damaged")
        return []


#: Sweep metrics (``SweepConfig.metric``) whose ``results.parquet`` column has another name.
METRIC_COLUMN = {"train_loss": "final_train_loss"}


def objective(sweep: dict[str, Any]) -> tuple[str, str]:
    """``(results column, mode)`` a sweep ranks its configs by: its ``metric`` and ``mode``
    (``sweep.yaml``; mode defaults as ``SweepConfig`` does: max for ``eval_metric``, else min;
    ``eval_loss`` / min for a sweep without ``sweep.yaml``). ``plora status``, ``plora report``
    and the notebooks all rank by it, so they name the same best adapter."""
    metric = str(sweep.get("metric") or "eval_loss").replace("/", "_")
    mode = sweep.get("mode")
    if mode not in ("min", "max"):
        mode = "max" if metric == "eval_metric" else "min"
    return METRIC_COLUMN.get(metric, metric), str(mode)


#: Statuses that mean a config finished (plora writes ``done``; other tools' words too).
SUCCESS_STATUSES = frozenset(
    {
        str(schema.ConfigStatus.DONE),
        "finished",
        "completed",
        "complete",
        "succeeded",
        "success",
        "ok",
    }
)


def _absent(path: Path, missing: Missing) -> bool:
    if path.exists():
        return False
    if missing is not None:
        missing[path.name] = NOT_WRITTEN
    return True


def _damaged(path: Path, exc: BaseException, missing: Missing, fix: str) -> None:
    """Record ``path`` as damaged in ``missing``, or raise the one-line error without it."""
    first = " ".join(str(exc).split())[:160]
    why = f"unreadable ({type(exc).__name__}: {first})"
    if missing is None:
        raise ConfigError(f"{path}: {why}; {fix}") from None
    missing[path.name] = why


def _read_parquet(path: Path, columns: tuple[str, ...], missing: Missing = None) -> pd.DataFrame:
    import pandas as pd

    empty = pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
    if _absent(path, missing):
        return empty
    try:
        return read_table(path, columns)  # a file, or a directory of parts (metrics.parquet/)
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        _damaged(path, exc, missing, "re-run or remove the file")
    return empty


def _read_json(path: Path, missing: Missing = None) -> dict[str, Any]:
    if _absent(path, missing):
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        _damaged(path, exc, missing, "the sweep dir is damaged; re-run the sweep or remove it")
        return {}
    if not isinstance(data, dict):
        err = ValueError(f"expected a JSON object, got {type(data).__name__}")
        _damaged(path, err, missing, "the sweep dir is damaged")
        return {}
    return data


def _read_sweep(path: Path, missing: Missing = None) -> dict[str, Any]:
    if _absent(path, missing):
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        _damaged(path, exc, missing, "the sweep dir is damaged")
        return {}
    return data if isinstance(data, dict) else {}


def _read_decisions(path: Path, missing: Missing = None) -> pd.DataFrame:
    import pandas as pd

    if (path / "decisions.parquet").exists():
        return _read_parquet(path / "decisions.parquet", (), missing)
    return pd.DataFrame(read_decision_records(path, missing))


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        data = json.loads(value)
        return data if isinstance(data, dict) else {}
    return {}


def _normalize_results(df: pd.DataFrame) -> pd.DataFrame:
    """Flatten a ``hyperparameters`` column and make list-valued cells hashable strings."""
    import pandas as pd

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
    import pandas as pd

    if df.empty:
        return df
    df = df.copy()
    for col in ("step", "loss", "lr", "tokens", "time"):
        if col in df.columns:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    keys = [c for c in ("config_id", "step") if c in df.columns]
    return df.sort_values(keys, kind="stable").reset_index(drop=True) if keys else df


def _to_seconds(col: pd.Series) -> pd.Series:
    import pandas as pd

    if pd.api.types.is_datetime64_any_dtype(col):
        return (col - col.min()).dt.total_seconds()
    return pd.to_numeric(col, errors="coerce")


def _normalize_jobs(df: pd.DataFrame) -> pd.DataFrame:
    """Times to seconds since the first start; ``config_ids`` to lists; add ``num_gpus``."""
    import pandas as pd

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


__all__ = [
    "FILE_ROLES",
    "NOT_WRITTEN",
    "SUCCESS_STATUSES",
    "SWEEP_FILES",
    "check_sweep_dir",
    "missing_note",
    "objective",
    "read_data_report",
    "read_decision_records",
    "read_decisions",
    "read_jobs",
    "read_metrics",
    "read_plan",
    "read_results",
    "read_state",
    "read_sweep",
]
