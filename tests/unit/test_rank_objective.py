"""``plora status``, ``plora report`` and the notebooks' loader rank by the sweep's own metric and
mode, so they all name the same best adapter (the three configs below are each best by one)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from plora import analysis
from plora.analysis.report import write_report
from plora.runtime.progress import status_text

ROWS = {  # config: (eval_metric, eval_loss, final_train_loss)
    "ca": (0.9, 2.0, 0.5),
    "cb": (0.1, 0.5, 1.5),
    "cc": (0.5, 1.0, 0.1),
}


def _sweep_dir(path: Path, metric: str, mode: str | None) -> Path:
    path.mkdir()
    rows = [
        {"config_id": c, "rank": 8, "alpha": 16.0, "lr": 1e-3, "batch_size": 4, "status": "done",
         "eval_metric": m, "eval_loss": e, "final_train_loss": t, "steps": 10,
         "adapter_path": f"adapters/{c}"}
        for c, (m, e, t) in ROWS.items()
    ]  # fmt: skip
    pd.DataFrame(rows).to_parquet(path / "results.parquet")
    (path / "state.json").write_text(
        json.dumps({"status": dict.fromkeys(ROWS, "done"), "elapsed_s": 3.0})
    )
    mode_line = f"mode: {mode}\n" if mode else ""
    (path / "sweep.yaml").write_text(f"name: s\nmetric: {metric}\n{mode_line}")
    return path


def _reference_best(column: str, mode: str) -> str:
    i = {"eval_metric": 0, "eval_loss": 1, "final_train_loss": 2}[column]
    pick = max if mode == "max" else min
    return pick(ROWS, key=lambda c: ROWS[c][i])


@pytest.mark.parametrize(
    ("metric", "mode", "column", "want_mode"),
    [
        ("eval_metric", None, "eval_metric", "max"),
        ("eval_metric", "min", "eval_metric", "min"),
        ("eval_loss", None, "eval_loss", "min"),
        ("train_loss", None, "final_train_loss", "min"),
    ],
)
def test_status_report_and_loader_agree_on_the_best(tmp_path, metric, mode, column, want_mode):
    root = _sweep_dir(tmp_path / "s", metric, mode)
    want = _reference_best(column, want_mode)
    lines = status_text(str(root)).splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("best by"))
    assert lines[head] == f"best by {column} ({want_mode}):"
    assert lines[head + 1].split()[0] == want
    res = analysis.load(root)
    assert (res.metric, res.mode) == (column, want_mode)
    assert res.best().iloc[0]["config_id"] == want
    report = write_report(root, tmp_path / "r.md", k=3).read_text()
    table = report[report.index(f"Best configs by {column} ({want_mode})") :]
    assert table.index(want) < min(table.index(c) for c in ROWS if c != want)
