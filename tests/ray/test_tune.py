"""The Ray Tune integration: proxy trials, ``PLoRAScheduler`` over ASHA, ``ResultGrid``, restore.

Trials train with ``packfn.PackFnEngine`` (tests/ray/packfn.py: a small real engine with
PackSession's interface) so a 16-trial Tuner runs in seconds; the fp32 equivalence with
``plora sweep`` uses plora's engine on the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from packfn import PackFnEngine

from plora.config import SweepConfig
from plora.runtime.driver import RunOptions
from plora.runtime.records import StaticSource
from plora.sweepdir.store import SweepStore

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MAX_STEPS = 60
LRS = [2e-4, 5e-4, 1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3]


def tune_sweep(name: str = "tunetest", num_gpus: int = 2) -> SweepConfig:
    """A sweep whose cost model packs three configs per job (1.14 GiB per logical GPU)."""
    return SweepConfig.from_dict(
        {
            "name": name,
            "model": "tiny-qwen2",
            "dataset": {"builtin": "arithmetic", "num_examples": 200, "max_seq_len": 32},
            "space": {"lr": LRS, "rank": [4, 8], "alpha": 16, "batch_size": 32,
                      "max_steps": MAX_STEPS},
            "hardware": {"gpu_type": "cpu", "num_gpus": num_gpus, "gpu_memory_gib": 1.14},
        }
    )  # fmt: skip


def cost_of(sweep: SweepConfig):
    from plora.cost.build import build_cost_model

    return build_cost_model(sweep, use_profile=False)


def asha_tuner(storage: Path, name: str, trainable, *, lrs: list[float] = LRS):
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from plora.tune.scheduler import PLoRAScheduler

    asha = ASHAScheduler(time_attr="adapter_step", max_t=MAX_STEPS, grace_period=10,
                         reduction_factor=2)  # fmt: skip
    return tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(lrs), "rank": tune.grid_search([4, 8])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=PLoRAScheduler(asha)),
        run_config=tune.RunConfig(storage_path=str(storage), name=name, verbose=0),
    )


def searched_tuner(storage: Path, name: str, trainable, search_alg):
    """Four trials of lr (log-uniform) x rank drawn by ``search_alg``, two at a time."""
    from ray import tune

    return tune.Tuner(
        trainable,
        param_space={"lr": tune.loguniform(2e-4, 6e-3), "rank": tune.choice([4, 8])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", num_samples=4,
                                    max_concurrent_trials=2, search_alg=search_alg),
        run_config=tune.RunConfig(storage_path=str(storage), name=name, verbose=0),
    )  # fmt: skip


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
    _every_freed_slot_refilled_while_queued(decisions)
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


def _notebook_tune_table(sweep_dir: Path):
    """Run the Tune cell of notebooks/sweep_report.ipynb on ``sweep_dir``; its ``tune_table``."""
    import nbformat

    from plora import analysis

    nb = nbformat.read(ROOT / "notebooks" / "sweep_report.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if "tune" in c.metadata.get("tags", [])]
    scope = {"os": os, "res": analysis.load(sweep_dir), "display": lambda *a: None}
    exec(cell.source, scope)
    return scope["tune_table"]


def _every_freed_slot_refilled_while_queued(decisions: list[dict]) -> None:
    """Every adapter stopped while configs were queued had its slot refilled (a ``refill`` of
    its job) before that job ended, unless the queue emptied first; a job whose adapters all
    stopped ends at once and its GPU takes a queued config next (``start_job`` on the warm
    worker) before anything else happens."""
    queued: set[str] = set()
    job_of: dict[str, str] = {}
    owed: dict[str, int] = {}  # job -> slots freed by a stop and not refilled yet
    restart = None  # a job that ended with owed slots: the next launch must take queued configs
    for d in decisions:
        kind, ids, job = d["kind"], set(d["config_ids"]), d["job_id"]
        if restart and kind in ("refill", "stop_config", "job_done"):
            raise AssertionError(f"{restart} ended with freed slots and no queued config started")
        if kind == "ask":
            queued |= ids
        elif kind in ("start_job", "refill"):
            restart = None
            queued -= ids
            job_of.update(dict.fromkeys(ids, job))
            if kind == "refill":
                owed[job] = max(0, owed.get(job, 0) - 1)
            if not queued:
                owed.clear()  # nothing left to refill with
        elif kind == "stop_config" and d["inputs"]["was"] == "running" and queued:
            (cid,) = ids
            owed[job_of[cid]] = owed.get(job_of[cid], 0) + 1
        elif kind == "stop_config":
            queued -= ids
        elif kind == "job_done" and owed.pop(job, 0):
            restart = job
    assert not restart and not queued, f"configs never started: {sorted(queued)}"


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
        _every_freed_slot_refilled_while_queued([*log[:4], log[2], log[4]])
    _every_freed_slot_refilled_while_queued(log)  # the job ended, c started on its GPU next
    refilled = [*log[:3], {"kind": "refill", "config_ids": ["c"], "job_id": "j1", "inputs": {}},
                log[3]]  # fmt: skip
    _every_freed_slot_refilled_while_queued(refilled)


DRIVER = """
import os
import sys
os.environ["TUNE_GLOBAL_CHECKPOINT_S"] = "0.5"  # Tune syncs its state (and the scheduler's) often
import ray
ray.init(address={address!r}, runtime_env={{"env_vars": {{"PYTHONPATH": {here!r}, "PACKFN_STEP_S": "0.08"}}}})
sys.path.insert(0, {here!r})
from pathlib import Path
from packfn import PackFnEngine
from test_tune import LRS, asha_tuner, trainable_for
asha_tuner(Path({storage!r}), "restore", trainable_for("restoretest"), lrs=LRS[::2]).fit()
"""


def trainable_for(name: str):
    """The packfn-backed trainable of the restore test (the killed driver and the restore)."""
    from plora.tune.trainable import plora_trainable

    sweep = tune_sweep(name)
    options = RunOptions(engine=PackFnEngine, calibration_steps=0, checkpoint_every=5)
    return plora_trainable(sweep, options=options, cost=cost_of(sweep), settle_s=1.0,
                           linger_s=5.0)  # fmt: skip


def _rungs(path: Path | dict) -> dict[tuple[float, str], float]:
    """ASHA's recorded values by (milestone, trial) in a scheduler state (file or parsed)."""
    state = (path if isinstance(path, dict) else json.loads(path.read_text()))["inner"]
    return {(m, t): v for bracket in state["rungs"] for m, rec in bracket for t, v in rec.items()}


def test_killed_driver_then_tuner_restore_keeps_finished_and_asha_rungs(
    ray_cluster, tmp_path
) -> None:
    import ray
    from ray import tune

    from plora.tune.scheduler import STATE_FILE

    exp = tmp_path / "restore"
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}"}
    code = DRIVER.format(here=str(HERE), storage=str(tmp_path), address=address)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    state_json = exp / "plora" / "state.json"
    try:
        deadline = time.time() + 150
        while time.time() < deadline:
            if state_json.is_file() and (exp / STATE_FILE).is_file():
                status = set(json.loads(state_json.read_text())["status"].values())
                ended, unended = status & {"done", "stopped"}, status & {"running", "queued"}
                try:  # Tune's sync copies the file in place: it may be half-written right now
                    sched = json.loads((exp / STATE_FILE).read_text())
                except json.JSONDecodeError:
                    time.sleep(0.05)
                    continue
                if ended and unended and sched["stopped"] and _rungs(sched):
                    break  # a job ended, another runs, ASHA stopped some: kill the driver now
            assert proc.poll() is None, "driver exited before it could be killed"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    state = json.loads(state_json.read_text())
    ended = {c for c, s in state["status"].items() if s in ("done", "stopped")}
    killed_at = state["elapsed_s"]
    rungs_before = _rungs(exp / STATE_FILE)
    stopped_before = json.loads((exp / STATE_FILE).read_text())["stopped"]
    assert ended and rungs_before and stopped_before
    time.sleep(1.0)  # let Ray reap the dead driver's actors and placement groups

    results = tune.Tuner.restore(
        str(exp), trainable=trainable_for("restoretest"), resume_unfinished=True
    ).fit()
    assert len(results) == 8 and not results.errors
    store = SweepStore(exp / "plora")
    m = store.read_metrics()
    again = m[(m["time"] >= killed_at) & m["config_id"].isin(ended)]
    assert again.empty, f"finished configs were retrained: {sorted(set(again['config_id']))}"
    res = store.read_results().set_index("config_id")
    assert len(res) == 8 and set(res["status"]) <= {"done", "stopped"}
    assert "resume" in [d["kind"] for d in store.read_decisions()]
    # ASHA's rungs survived the restore: every value recorded before the kill is still there
    rungs_after = _rungs(exp / STATE_FILE)
    assert {k: rungs_after.get(k) for k in rungs_before} == rungs_before
    # and who it stopped; the scheduler that wrote it started from the saved state (a fresh one,
    # re-fed the replayed trials, could write the same rungs for those: restores says which)
    after = json.loads((exp / STATE_FILE).read_text())
    assert {t: after["stopped"].get(t) for t in stopped_before} == stopped_before
    assert after["restores"] == 1
    stops = [
        c for d in store.read_decisions() if d["kind"] == "stop_config" for c in d["config_ids"]
    ]
    assert len(stops) == len(set(stops))  # no adapter stopped twice
    df = results.get_dataframe()
    assert df["early_stopped"].sum() == (res["status"] == "stopped").sum()


def test_fp32_a_config_through_tune_equals_plora_sweep(ray_cluster, tmp_path) -> None:
    """plora's engine, fp32 CPU: one config trained through ``tune.Tuner`` ends with the adapter
    weights ``run_sweep`` gives the same config (same seed), and every loss Tune saw is the one
    in its sweep's metrics.parquet."""
    import torch
    from ray import tune
    from safetensors.torch import load_file

    from plora.runtime.driver import run_sweep
    from plora.tune.space import expand
    from plora.tune.trainable import plora_trainable

    sweep = SweepConfig.from_dict(
        {
            "name": "fp32tune",
            "model": "tiny-qwen2",
            "dataset": {"builtin": "arithmetic", "num_examples": 120, "max_seq_len": 32},
            "space": {"lr": 2e-3, "rank": 4, "alpha": 16, "batch_size": 4, "max_steps": 8,
                      "seed": 3},
            "hardware": {"gpu_type": "cpu", "num_gpus": 1, "gpu_memory_gib": 8},
        }
    )  # fmt: skip
    (config,) = expand(sweep)
    options = RunOptions(calibration_steps=0, record_profile=False, prestart=False)
    run_sweep(sweep, tmp_path / "sweep", options=options)
    reference = load_file(tmp_path / "sweep" / "adapters" / config.config_id /
                          "adapter_model.safetensors")  # fmt: skip

    trainable = plora_trainable(sweep, options=options, settle_s=0.2, linger_s=0.2)
    results = tune.Tuner(
        trainable,
        param_space={"lr": 2e-3},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="fp32", verbose=0),
    ).fit()
    (result,) = list(results)
    assert result.error is None and result.metrics["status"] == "done"
    with result.checkpoint.as_directory() as d:
        tuned = load_file(Path(d) / "adapter_model.safetensors")
    assert tuned.keys() == reference.keys()
    for key, ref in reference.items():
        torch.testing.assert_close(tuned[key], ref, rtol=1e-5, atol=1e-7)
    assert not torch.equal(reference[next(k for k in reference if "lora_B" in k)],
                           torch.zeros_like(reference[next(k for k in reference if "lora_B" in k)]))  # fmt: skip
    store = SweepStore(tmp_path / "fp32" / "plora")
    m = store.read_metrics().set_index("step")["loss"]
    hist = result.metrics_dataframe
    seen = hist[hist["status"].isna()] if "status" in hist else hist
    assert list(seen["adapter_step"]) == list(range(1, 9))
    assert list(seen["loss"]) == [m[s] for s in range(1, 9)]
    assert result.metrics["eval_loss"] == store.read_results()["eval_loss"].iloc[0]


def test_plora_sweep_early_stop_section_stops_and_refills(ray_cluster, tmp_path) -> None:
    """``early_stop:`` in the sweep YAML: ASHA on the streamed losses stops configs inside their
    packs (status stopped, fewer steps), their slots are refilled, the rest train to the end."""
    from plora.runtime.driver import run_sweep
    from plora.tune.space import expand

    raw = tune_sweep("earlystop", num_gpus=2).to_dict()
    sweep = SweepConfig.from_dict({**raw, "early_stop": {"grace_steps": 10, "reduction_factor": 2}})
    configs = expand(sweep)
    summary = run_sweep(
        sweep, tmp_path / "s", cost=cost_of(sweep),
        source=StaticSource(configs),
        options=RunOptions(engine=PackFnEngine, calibration_steps=0, record_profile=False),
    )  # fmt: skip
    assert summary.ok
    store = SweepStore(tmp_path / "s")
    res = store.read_results().set_index("config_id")
    stopped = res[res["status"] == "stopped"]
    assert len(stopped) >= 4 and (stopped["steps"] < MAX_STEPS).all()
    assert (res[res["status"] == "done"]["steps"] == MAX_STEPS).all()
    decisions = store.read_decisions()
    stops = [d for d in decisions if d["kind"] == "stop_config"]
    assert {c for d in stops for c in d["config_ids"]} == set(stopped.index)
    assert all(d["inputs"]["reason"] == "early_stop" and d["inputs"]["step"] >= 10 for d in stops)
    _every_freed_slot_refilled_while_queued(decisions)


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
