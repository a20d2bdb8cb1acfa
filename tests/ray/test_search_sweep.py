"""An Optuna sweep end to end: configs proposed in waves, results told back, all trained."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_quickstart import ROOT, plora

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


def test_fewer_distinct_configs_than_asked_are_reported(ray_cluster, tmp_path) -> None:
    """Issue 29: ``search: hyperopt`` with ``num_samples: 5`` over a space of two points trains
    two configs (a repeated suggestion is trained once) and says so in one line, at the end of
    ``plora sweep`` and in ``plora status``; Ray's own warnings stay off the console."""
    import yaml

    address = ray_cluster.get_runtime_context().gcs_address
    sweep = yaml.safe_load((ROOT / "sweeps" / "optuna-tiny.yaml").read_text())
    sweep.update(name="hyperopt-two", search="hyperopt", num_samples=5)
    sweep["dataset"]["num_examples"] = 200
    sweep["space"].update(lr=1e-3, rank={"choice": [4, 8]}, alpha_ratio=2.0, max_steps=4,
                          warmup_steps=0)  # fmt: skip
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(sweep))
    out = tmp_path / "two"
    proc = plora("sweep", str(path), "--out", str(out), "--address", address)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = pd.read_parquet(out / "results.parquet")
    assert sorted(res["rank"]) == [4, 8]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("search: ")]
    assert line.startswith("search: 2 distinct configs of the 5 asked of hyperopt; 3 repeated")
    status = plora("status", str(out))
    assert status.returncode == 0 and line in status.stdout, status.stdout
    assert "HyperOptSearch" not in proc.stdout + proc.stderr  # Ray's warnings: the log's
