"""The Ray Tune integration: proxy trials, ``PLoRAScheduler`` over ASHA, ``ResultGrid``, searchers.

Trials train with ``packfn.PackFnEngine`` (tests/ray/packfn.py: a small real engine with
PackSession's interface) so a 16-trial Tuner runs in seconds. Restore after a killed driver is
tests/ray/test_tune_restore.py; Tune against ``plora sweep`` is tests/ray/test_tune_sweep.py.
"""

from __future__ import annotations

import os
from pathlib import Path

from packfn import PackFnEngine
from tune_helpers import (
    MAX_STEPS,
    ROOT,
    asha_tuner,
    cost_of,
    every_freed_slot_refilled_while_queued,
    searched_tuner,
    tune_sweep,
)

from plora.runtime.driver import RunOptions
from plora.sweepdir.store import SweepStore


def test_tuner_asha_over_16_configs_stops_adapters_inside_packs(ray_cluster, tmp_path) -> None:
    from ray.tune import ExperimentAnalysis

    from plora.tune.trainable import plora_trainable

    sweep = tune_sweep()
    trainable = plora_trainable(
        sweep, options=RunOptions(engine=PackFnEngine, calibration_steps=0), cost=cost_of(sweep),
        settle_s=1.0, linger_s=0.5,
    )  # fmt: skip
    results = asha_tuner(tmp_path, "asha16", trainable).fit()
    df = results.get_dataframe()
    assert len(results) == 16 and not results.errors
    assert df["config_id"].nunique() == 16
    early = df[df["early_stopped"]]
    # ASHA's stops take effect only when they reach the pack before the adapter's last step
    # (60 steps of 0.02 s here): how many do depends on the host's load (3 of 16 in one CI run on
    # 2 cores); each one that did must have left early, evaluated, through the coordinator
    assert len(early) >= 2, df[["config_id", "status", "steps"]]
    assert (early["steps"] < MAX_STEPS).all()
    assert early["eval_loss"].notna().all()  # stopped adapters are evaluated as they leave
    # the best adapter is a checkpoint of its PEFT directory (packfn's adapter file)
    best = results.get_best_result(metric="loss", mode="min", scope="last")
    assert best.checkpoint is not None
    with best.checkpoint.as_directory() as d:
        assert (Path(d) / "adapter.json").is_file()
    # the sweep below: fewer jobs than trials, stops through the coordinator, freed slots refilled
    store = SweepStore(tmp_path / "asha16" / "plora")
    res = store.read_results()
    assert len(res) == 16 and res["steps"].sum() < 16 * MAX_STEPS
    assert set(res[res["status"] == "stopped"]["config_id"]) == set(early["config_id"])
    assert res[res["status"] == "stopped"]["eval_loss"].notna().all()
    jobs = store.read_jobs()
    assert len(jobs) < 16
    decisions = store.read_decisions()
    stops = [d for d in decisions if d["kind"] == "stop_config"]
    assert {c for d in stops for c in d["config_ids"]} == set(early["config_id"])
    assert all(d["inputs"]["reason"] == "early_stop" for d in stops)
    assert any(d["kind"] == "refill" for d in decisions)
    every_freed_slot_refilled_while_queued(decisions)
    # the metric Tune saw is the metrics.parquet's, step for step
    m = store.read_metrics().set_index(["config_id", "step"])["loss"]
    for r in results:
        hist = r.metrics_dataframe
        rows = hist[hist["status"].isna()] if "status" in hist else hist
        for step, loss in zip(rows["adapter_step"], rows["loss"], strict=True):
            assert loss == m[(r.metrics["config_id"], int(step))]
    # the notebook's Tune section joins the ResultGrid to results.parquet, one row per config
    table = _notebook_tune_table(tmp_path / "asha16" / "plora")
    assert len(table) == 16 and table["early_stopped"].sum() == len(early)
    assert (table["adapter_step"] == table["steps"]).all()
    # ExperimentAnalysis on the storage path (what the steering check uses)
    analysis = ExperimentAnalysis(str(tmp_path / "asha16"))
    assert len(analysis.trials) == 16
    assert all(t.last_result.get("status") in ("done", "stopped") for t in analysis.trials)
    # the proxies' reports reach Tune's own loggers: every trial's folder in the experiment
    # holds its TensorBoard events (`tensorboard --logdir <storage>/asha16`), a point per report
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for r in results:
        assert list(Path(r.path).glob("events.out.tfevents.*")), r.path
        events = EventAccumulator(r.path)
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"ray/tune/loss", "ray/tune/tokens_per_s", "ray/tune/eval_loss"} <= tags, tags
        assert len(events.Scalars("ray/tune/loss")) == len(r.metrics_dataframe)
    # and the packed sweep below writes its own curves: a run per config
    assert len(list((tmp_path / "asha16" / "plora" / "tensorboard").iterdir())) == 16


def _notebook_tune_table(sweep_dir: Path):
    """Run the Tune cell of notebooks/sweep_report.ipynb on ``sweep_dir``; its ``tune_table``."""
    import nbformat

    from plora import analysis

    nb = nbformat.read(ROOT / "notebooks" / "sweep_report.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if "tune" in c.metadata.get("tags", [])]
    scope = {"os": os, "res": analysis.load(sweep_dir), "display": lambda *a: None}
    exec(cell.source, scope)
    return scope["tune_table"]


def test_refill_check_catches_a_slot_left_empty() -> None:
    """The decisions-log check above fails on a log where a stop's slot was not refilled."""
    import pytest

    log = [
        {"kind": "ask", "config_ids": ["a", "b", "c"], "job_id": None, "inputs": {}},
        {"kind": "start_job", "config_ids": ["a", "b"], "job_id": "j1", "inputs": {}},
        {"kind": "stop_config", "config_ids": ["a"], "job_id": None, "inputs": {"was": "running"}},
        {"kind": "job_done", "config_ids": ["a", "b"], "job_id": "j1", "inputs": {}},
        {"kind": "start_job", "config_ids": ["c"], "job_id": "j2", "inputs": {}},
    ]
    with pytest.raises(AssertionError, match="no queued config started"):
        every_freed_slot_refilled_while_queued([*log[:4], log[2], log[4]])
    every_freed_slot_refilled_while_queued(log)  # the job ended, c started on its GPU next
    refilled = [*log[:3], {"kind": "refill", "config_ids": ["c"], "job_id": "j1", "inputs": {}},
                log[3]]  # fmt: skip
    every_freed_slot_refilled_while_queued(refilled)


def test_optuna_search_in_waves_gives_one_row_per_config(ray_cluster, tmp_path) -> None:
    """OptunaSearch with 2 trials at a time: later trials register while (or after) earlier
    packs run; every trial gets its row, its adapter and its final metrics."""
    from ray.tune.search.optuna import OptunaSearch

    from plora.tune.trainable import plora_trainable

    sweep = tune_sweep("optunatest")
    trainable = plora_trainable(  # lingers between waves: one set of worker groups throughout
        sweep, options=RunOptions(engine=PackFnEngine, calibration_steps=0), cost=cost_of(sweep),
        settle_s=0.5, linger_s=5.0,
    )  # fmt: skip
    results = searched_tuner(tmp_path, "optuna", trainable, OptunaSearch(seed=1)).fit()
    assert len(results) == 4 and not results.errors
    df = results.get_dataframe()
    assert set(df["status"]) == {"done"} and (df["adapter_step"] == MAX_STEPS).all()
    res = SweepStore(tmp_path / "optuna" / "plora").read_results().set_index("config_id")
    assert sorted(res.index) == sorted(df["config_id"])
    for _, row in df.iterrows():  # Tune's lr is the config's lr
        assert res.loc[row["config_id"], "lr"] == row["config/lr"]
    assert results.get_best_result().checkpoint is not None
    decisions = SweepStore(tmp_path / "optuna" / "plora").read_decisions()
    assert sum(d["kind"] == "ask" for d in decisions) >= 2  # configs came in waves
