"""Raw rows of a dataset file: JSONL or a ``datasets.save_to_disk`` directory, and the split.

Rows stay plain dicts tagged with their file and 1-based line (or row index) so that every
error in :mod:`plora.engine.data` can name where the bad value is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plora.config import ConfigError


@dataclass(frozen=True, slots=True)
class Row:
    """One raw row and where it came from (for error messages)."""

    data: dict[str, Any]
    file: str
    line: int  # 1-based JSONL line, or 1-based row index of a save_to_disk dataset


def split_rows(rows: list[Row], n_eval: int, seed: int) -> tuple[list[Row], list[Row]]:
    """Seeded split: a permutation's first ``n_eval`` rows are eval; both keep file order."""
    order = np.random.default_rng([seed, 0x5EED]).permutation(len(rows))
    held = set(order[:n_eval].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [
        r for i, r in enumerate(rows) if i in held
    ]


def read_path(path: str, fmt: str) -> tuple[list[Row], list[Row] | None]:
    p = Path(path).expanduser()
    if p.is_dir():
        return read_disk(p)
    if fmt == "disk":
        raise ConfigError(
            "format disk needs a directory written by datasets.save_to_disk",
            key="dataset.path",
            value=path,
            fix="point path to that directory or use format: auto",
        )
    return read_rows(path, fmt), None


def read_rows(path: str, fmt: str) -> list[Row]:
    """Rows of a JSONL file (or a save_to_disk dir's train split)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return read_disk(p)[0]
    if not p.is_file():
        raise ConfigError(
            "dataset file not found",
            key="dataset.path",
            value=path,
            fix="create it or fix the path (relative paths are relative to the sweep file)",
        )
    rows: list[Row] = []
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"invalid JSON ({err.msg} at column {err.colno})",
                    file=path,
                    line=n,
                    fix="write one JSON object per line",
                ) from None
            if not isinstance(data, dict):
                raise ConfigError(
                    f"row is a {type(data).__name__}, not a JSON object",
                    file=path,
                    line=n,
                    fix='write rows like {"prompt": "...", "completion": "..."}',
                )
            rows.append(Row(data, str(path), n))
    if not rows:
        raise ConfigError(
            "dataset is empty",
            key="dataset.path",
            value=path,
            fix="add JSON lines with text, prompt+completion or messages",
        )
    return rows


def read_disk(p: Path) -> tuple[list[Row], list[Row] | None]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(
            f"not a datasets.save_to_disk directory ({err})",
            key="dataset.path",
            value=str(p),
            fix="save it with Dataset.save_to_disk or give a .jsonl file",
        ) from None
    evals = None
    if isinstance(ds, datasets.DatasetDict):
        train_name = "train" if "train" in ds else next(iter(ds))
        eval_name = next((s for s in ("validation", "test", "eval") if s in ds), None)
        if eval_name is not None:
            evals = [Row(dict(r), f"{p}[{eval_name}]", i + 1) for i, r in enumerate(ds[eval_name])]
        ds = ds[train_name]
    rows = [Row(dict(r), str(p), i + 1) for i, r in enumerate(ds)]
    if not rows:
        raise ConfigError(
            "dataset is empty",
            key="dataset.path",
            value=str(p),
            fix="save a dataset with at least one row",
        )
    return rows, evals


__all__ = ["Row", "read_disk", "read_path", "read_rows", "split_rows"]
