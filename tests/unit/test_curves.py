"""Live curves (``plora.curves``): each sink gets one run per config with the same tags, read
back with the sink's own reader (TensorBoard's event multiplexer, MLflow's client on a local
file store, W&B's ``wandb leet inspect`` of offline runs); a sink that cannot start is one line.

The rows are the sweep directory's (``plora.runtime.coordinator.ledger``'s metric and result rows of the
quickstart's 8 configs); a whole sweep through them is tests/ray/test_curves_sweep.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plora.config import ConfigError, SweepConfig
from plora.curves import open_curves, open_sinks
from plora.runtime.coordinator.ledger import result_row
from plora.sweepdir.schema import ConfigStatus
from plora.tune.space import expand

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s"}
EVAL_TAGS = {"eval/loss", "eval/exact_match"}


def quickstart(**logging) -> SweepConfig:
    sweep = SweepConfig.from_yaml(ROOT / "sweeps" / "quickstart.yaml")
    data = sweep.to_dict()
    data["logging"] = logging
    return SweepConfig.from_dict(data, source=str(ROOT / "sweeps" / "quickstart.yaml"))


def feed(sweep: SweepConfig, out: Path, *, failed: str | None = None) -> dict:
    """Open the sweep's sinks on ``out`` and feed them 5 steps and a result per config."""
    configs = {c.config_id: c for c in expand(sweep)}
    curves = open_curves(open_sinks(sweep, out), sweep, configs=configs, metric_name="exact_match")
    for step in range(1, STEPS + 1):
        curves.add_metrics(
            {"config_id": cid, "job_id": "j0001", "attempt": 0, "step": step, "loss": i + 1 / step,
             "lr": configs[cid].lr, "tokens": 100 + i, "grad_norm": 0.5, "step_time_s": 0.25,
             "time": float(step)}
            for i, cid in enumerate(configs)
        )  # fmt: skip
    rows = [
        result_row(c, status=ConfigStatus.FAILED if cid == failed else ConfigStatus.DONE,
                   metric_name="exact_match", eval_loss=0.5 + i, eval_metric=i / 10, steps=STEPS)
        for i, (cid, c) in enumerate(configs.items())
    ]  # fmt: skip
    curves.add_results(rows)
    curves.add_results(rows)  # the store passes every row each time: each run ends once
    curves.close()
    return configs


def test_tensorboard_one_run_per_config_with_every_tag_and_its_hparams(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    sweep = quickstart()
    configs = feed(sweep, tmp_path, failed="c0003-ab5f62")
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path / "tensorboard"))
    mux.Reload()
    runs = {run.split("_")[0]: run for run in mux.Runs()}
    assert set(runs) == set(configs)
    # named by config id and the hyperparameters the quickstart varies: lr, rank, target modules
    assert runs["c0003-ab5f62"] == "c0003-ab5f62_lr=0.001,rank=16,target_modules=all"
    assert runs["c0004-3be3dc"] == "c0004-3be3dc_lr=0.03,rank=4,target_modules=q_proj+v_proj"
    hparams = mux.PluginRunToTagToContent("hparams")
    for i, (cid, config) in enumerate(configs.items()):
        run = runs[cid]
        assert set(mux.GetAccumulator(run).Tags()["scalars"]) == TAGS | EVAL_TAGS
        loss = mux.Scalars(run, "train/loss")
        assert [e.step for e in loss] == list(range(1, STEPS + 1))
        assert [e.value for e in loss] == pytest.approx([i + 1 / s for s in range(1, STEPS + 1)])
        assert mux.Scalars(run, "train/tokens_per_s")[0].value == pytest.approx((100 + i) / 0.25)
        assert mux.Scalars(run, "train/lr")[-1].value == pytest.approx(config.lr)
        (ev,) = mux.Scalars(run, "eval/exact_match")
        assert (ev.step, ev.value) == (STEPS, pytest.approx(i / 10))
        start = plugin_data_pb2.HParamsPluginData.FromString(
            hparams[run]["_hparams_/session_start_info"]
        ).session_start_info
        assert start.hparams["config_id"].string_value == cid
        assert start.hparams["rank"].number_value == config.rank
        assert start.hparams["lr"].number_value == pytest.approx(config.lr)
        end = plugin_data_pb2.HParamsPluginData.FromString(
            hparams[run]["_hparams_/session_end_info"]
        ).session_end_info
        status = "STATUS_FAILURE" if cid == "c0003-ab5f62" else "STATUS_SUCCESS"
        assert end.status == api_pb2.Status.Value(status)
        experiment = plugin_data_pb2.HParamsPluginData.FromString(
            hparams[run]["_hparams_/experiment"]
        ).experiment
        assert [m.name.tag for m in experiment.metric_infos] == [
            "eval/loss", "eval/exact_match", "train/loss",
        ]  # fmt: skip


def test_a_resumed_sweep_opens_no_run_for_configs_that_ended_before(tmp_path) -> None:
    sweep = quickstart()
    configs = {c.config_id: c for c in expand(sweep)}
    done, again = list(configs)[:2]
    curves = open_curves(open_sinks(sweep, tmp_path), sweep, configs=configs,
                         metric_name="exact_match", finished=[done, again])  # fmt: skip
    rows = [result_row(configs[c], status=ConfigStatus.DONE, metric_name="exact_match",
                       eval_loss=1.0, steps=3) for c in (done, again)]  # fmt: skip
    curves.add_results(rows)  # the resumed store's first write: nothing new
    curves.add_metrics([{"config_id": again, "step": 1, "loss": 1.0}])  # retried: trains again
    curves.add_results(rows)
    curves.close()
    (run,) = (tmp_path / "tensorboard").iterdir()
    assert run.name.startswith(again)


def test_mlflow_file_store_one_child_run_per_config_of_the_sweeps_run(
    tmp_path, monkeypatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store off
    uri = (tmp_path / "mlruns").as_uri()
    sweep = quickstart(tensorboard=False, mlflow={"tracking_uri": uri, "experiment": "qs"})
    configs = feed(sweep, tmp_path / "sweep", failed="c0003-ab5f62")
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("qs").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.run_name == "sweep" and parent.info.status == "FINISHED"
    children = {r.data.tags["plora.config_id"]: r for r in runs if r is not parent}
    assert set(children) == set(configs)
    for i, cid in enumerate(configs):
        run = children[cid]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.run_name.startswith(cid + "_lr=")
        assert run.data.params["rank"] == str(configs[cid].rank)
        assert set(run.data.metrics) == TAGS | EVAL_TAGS
        assert run.data.metrics["eval/loss"] == pytest.approx(0.5 + i)
        history = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
        failed = cid == "c0003-ab5f62"
        assert run.info.status == ("FAILED" if failed else "FINISHED")
        assert run.data.tags["plora.status"] == ("failed" if failed else "done")


def test_wandb_offline_one_run_per_config_grouped_by_sweep(tmp_path) -> None:
    sweep = quickstart(tensorboard=False, wandb={"mode": "offline", "project": "qs"})
    configs = feed(sweep, tmp_path / "sweep")
    run_dirs = sorted((tmp_path / "sweep" / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == len(configs)
    wandb = Path(sys.executable).parent / "wandb"
    seen = {}
    for d in run_dirs:  # W&B's own reader of a run's transaction log
        out = subprocess.run([str(wandb), "leet", "inspect", "--summary", "--json", str(d)],
                             capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        info = json.loads(out.stdout)
        seen[info["config"]["config_id"]] = info
    assert set(seen) == set(configs)
    for i, cid in enumerate(configs):
        info = seen[cid]
        assert info["name"].startswith(cid + "_lr=") and info["project"] == "qs"
        assert info["state"] == "finished" and info["step"] == STEPS
        assert info["config"]["rank"] == configs[cid].rank
        assert set(info["summary"]) >= TAGS | EVAL_TAGS
        assert info["summary"]["eval/loss"] == pytest.approx(0.5 + i)
    # grouped by the sweep (its directory's name): in each run's record
    records = subprocess.run([str(wandb), "leet", "inspect", "--json", str(run_dirs[0])],
                             capture_output=True, text=True, timeout=120, check=True).stdout  # fmt: skip
    (run_record,) = [json.loads(x) for x in records.splitlines() if '"type":"run"' in x]
    assert run_record["run"]["run_group"] == "sweep"


@pytest.mark.parametrize(
    ("sink", "module", "needle"),
    [("mlflow", "mlflow", "MLflow is not installed"),
     ("wandb", "wandb", "Weights & Biases is not installed")],
)  # fmt: skip
def test_a_sink_not_installed_is_one_located_line(tmp_path, monkeypatch, sink, module, needle):
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)  # what `import` finds for a missing package
    sweep = quickstart(**{sink: True})
    with pytest.raises(ConfigError) as err:
        open_sinks(sweep, tmp_path / "sweep")
    line = str(err.value)
    assert "\n" not in line and needle in line
    assert line.startswith(f"{ROOT / 'sweeps' / 'quickstart.yaml'}: logging.{sink}")
    assert f"plora[{sink}]" in line
    assert not (tmp_path / "sweep").exists()


def test_logging_section_round_trips_and_changes_nothing_a_resume_compares(tmp_path) -> None:
    import yaml

    from plora.config.diff import sweep_changes

    data = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    data["logging"] = {
        "tensorboard": False,
        "mlflow": True,
        "wandb": {"mode": "offline", "dir": "wb"},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(data))
    sweep = SweepConfig.from_yaml(tmp_path / "s.yaml")
    assert sweep.logging.sinks == ("mlflow", "wandb")
    assert sweep.logging.wandb.dir == str(tmp_path / "wb")  # relative to the sweep file
    assert SweepConfig.from_dict(sweep.to_dict()) == sweep
    plain = quickstart()
    assert plain.logging.sinks == ("tensorboard",)  # the default: TensorBoard only
    assert "logging" not in plain.to_dict()  # a default section is not written out
    assert sweep_changes(plain, sweep) == []  # where curves go is not what the sweep trains
    assert plain.logging.with_sinks(["wandb"]).sinks == ("tensorboard", "wandb")
    assert sweep.logging.with_sinks(["wandb"]).wandb == sweep.logging.wandb  # the file's kept
