"""An Optuna sweep end to end: configs proposed in waves, results told back, all trained."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_quickstart import plora

pytestmark = pytest.mark.ray


def test_optuna_sweep_with_8_samples_runs_end_to_end(ray_cluster, tmp_path) -> None:
    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "opt"
    proc = plora("sweep", "sweeps/optuna-tiny.yaml", "--out", str(out), "--address", address)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = pd.read_parquet(out / "results.parquet")
    assert len(res) == 8 and res["config_id"].is_unique
    assert (res["status"] == "done").all() and res["eval_loss"].notna().all()
    assert res["lr"].between(3e-4, 1e-2).all() and res["rank"].isin([4, 8, 16]).all()
    assert res["lr"].nunique() == 8  # sampled by the searcher, not a grid
    # the searcher held back configs until results came back: more than one start decision
    decisions = [json.loads(line) for line in (out / "decisions.jsonl").read_text().splitlines()]
    started = [d for d in decisions if d.get("kind") in ("start_job", "refill")]
    assert len(started) >= 2
    for cid in res["config_id"]:
        assert (out / "adapters" / cid / "adapter_config.json").is_file()
