"""Live curves of a whole sweep: ``run_sweep`` with ``logging: {mlflow, wandb}`` beside the default
TensorBoard gives one run per config in each, while it trains (``packfn.PackFnEngine``). The
quickstart's event files (plora's engine) are checked in test_quickstart.py, a Tune experiment's
per-trial event files in test_tune.py."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from packfn import PackFnEngine
from test_runtime import configs, cost_of, tiny_sweep

from plora.config import LoggingOptions, MlflowOptions, WandbOptions
from plora.runtime.driver import RunOptions, run_sweep
from plora.runtime.records import StaticSource

STEP_TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"}


def test_a_sweep_logs_one_run_per_config_to_tensorboard_mlflow_and_wandb(
    ray_cluster, tmp_path, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store off
    uri = (tmp_path / "mlruns").as_uri()
    logging = LoggingOptions(
        mlflow=MlflowOptions(tracking_uri=uri), wandb=WandbOptions(mode="offline")
    )
    sweep = dataclasses.replace(tiny_sweep(num_gpus=2, name="curves"), logging=logging)
    cs = configs(4, steps=8)
    out = tmp_path / "sweep"
    summary = run_sweep(
        sweep, out, address=ray_cluster.get_runtime_context().gcs_address, cost=cost_of(sweep),
        source=StaticSource(cs), options=RunOptions(engine=PackFnEngine),
    )  # fmt: skip
    assert summary.ok
    ids = {c.config_id for c in cs}
    steps = {c.config_id: c.max_steps for c in cs}
    # TensorBoard, under the sweep directory: a run per config, every step of it
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(out / "tensorboard"))
    mux.Reload()
    assert set(mux.Runs()) == ids  # the space varies nothing: runs are named by config id
    for cid in ids:
        assert set(mux.GetAccumulator(cid).Tags()["scalars"]) >= STEP_TAGS | {"eval/loss"}
        assert [e.step for e in mux.Scalars(cid, "train/loss")] == list(range(1, steps[cid] + 1))
    # MLflow: a child run per config under the sweep's run, in the experiment named by the sweep
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("curves").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["plora.config_id"]: r for r in runs if r is not parent}
    assert parent.info.run_name == "sweep" and set(children) == ids
    for cid, run in children.items():
        assert run.info.status == "FINISHED" and "eval/loss" in run.data.metrics
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert len(history) == steps[cid]
    # W&B, offline under the sweep directory: a run per config in the sweep's group
    wandb = Path(sys.executable).parent / "wandb"
    names = set()
    for d in (out / "wandb").glob("offline-run-*"):
        info = json.loads(subprocess.run(
            [str(wandb), "leet", "inspect", "--summary", "--json", str(d)],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout)  # fmt: skip
        assert info["project"] == "curves" and info["step"] == steps[info["name"]]
        names.add(info["name"])
    assert names == ids
