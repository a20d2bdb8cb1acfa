"""Ray Tune schedulers that pause trials (synchronous HyperBand), and HyperOptSearch, through
``tune.Tuner`` with plora's proxy trainable.

Trials train with ``packfn.PackFnEngine`` (a 4-dim regression per config, deterministic): a
config paused out of its pack and resumed later must end with exactly the weights of the same
config trained without a pause (the engine's own test, tests/unit/test_pause.py, checks the
same on plora's LoRA engine).
"""

from __future__ import annotations

import json
from pathlib import Path

from packfn import PackFnEngine, RefillingEngine
from tune_helpers import LRS, cost_of, searched_tuner, tune_sweep

from plora.config import SweepConfig
from plora.engine.api import EngineSpec, PackRequest
from plora.runtime.driver import RunOptions
from plora.sweepdir.store import SweepStore

STEPS = 64


def _sweep(name: str) -> SweepConfig:
    raw = tune_sweep(name).to_dict()
    return SweepConfig.from_dict({**raw, "space": {**raw["space"], "max_steps": STEPS}})


def _uninterrupted_w(sweep: SweepConfig, config, tmp: Path) -> list[float]:
    engine = PackFnEngine(EngineSpec(model=sweep.model, dataset=sweep.dataset))
    out = engine.run(PackRequest(job_id="ref", configs=(config,), out_dir=str(tmp)))
    assert out.results[config.config_id].steps == STEPS
    return json.loads((tmp / config.config_id / "adapter.json").read_text())["w"]


def test_hyperband_pauses_adapters_out_of_their_packs_and_resumed_ones_continue_exactly(
    ray_cluster, tmp_path
) -> None:
    from ray import tune
    from ray.tune.schedulers import HyperBandScheduler

    from plora.tune.scheduler import PLoRAScheduler
    from plora.tune.space import config_from_tune
    from plora.tune.trainable import plora_trainable

    sweep = _sweep("hyperband")
    # The first plan must see all 8 trials (two jobs of 3, two configs queued), so a pause frees
    # a slot while configs wait. A quiet time cannot promise it: fresh-clone CI runs planned 2 of
    # 8 after 1 s of quiet (2026-11-27) and 6 of 8 after 5 s (2026-11-28), the rest starting
    # later. PLoRAScheduler announces each trial Tune adds, and the sweep plans once every
    # announced trial registered (asserted below), however slow their start.
    # A pause reaches a pack only after Tune saw its trial's result, and a pack of 64 short steps
    # could end first (a loaded CI run, 2026-11-28, paused nothing while configs were queued, so
    # nothing was refilled): RefillingEngine's packs wait at step 16, the first milestone, until
    # a queued config joins (or no refill can come).
    trainable = plora_trainable(
        sweep, options=RunOptions(engine=RefillingEngine, calibration_steps=0),
        cost=cost_of(sweep), settle_s=0.5, linger_s=0.5,
    )  # fmt: skip
    # Tune's HyperBand (Ray 2.x) at max_t 64, factor 4 fills a bracket of 4 trials that run to
    # 64 unstopped, then one of up to 8 (here the other 4) with milestones at adapter steps 16
    # and 64: those pause at 16 until all four reached it, then some stop and the others resume
    hyperband = HyperBandScheduler(time_attr="adapter_step", max_t=STEPS, reduction_factor=4)
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(LRS), "rank": 4},
        tune_config=tune.TuneConfig(metric="loss", mode="min",
                                    scheduler=PLoRAScheduler(hyperband)),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="hb", verbose=0),
    ).fit()  # fmt: skip
    assert len(results) == len(LRS) and not results.errors
    store = SweepStore(tmp_path / "hb" / "plora")
    res = store.read_results().set_index("config_id")
    assert len(res) == len(LRS) and set(res["status"]) <= {"done", "stopped"}
    decisions = store.read_decisions()
    first_plan = next(d for d in decisions if d["kind"] == "plan")
    assert sorted(first_plan["config_ids"]) == sorted(res.index)  # every trial, none later
    asked = {c for d in decisions if d["kind"] == "pause_config" for c in d["config_ids"]}
    resumed = {c for d in decisions if d["kind"] == "resume_config" for c in d["config_ids"]}
    # a config left its pack paused: its job came back with it paused ("config_paused"), or it
    # was packed again (a refill, a new job) after a pause asked while it ran -- its job may
    # outlive its resume, as a job that took refills does, and then never reports the pause
    paused = {c for d in decisions if d["kind"] == "config_paused" for c in d["config_ids"]}
    running_asked: set[str] = set()
    for d in decisions:
        if d["kind"] == "pause_config" and d["inputs"]["was"] == "running":
            running_asked.update(d["config_ids"])
        elif d["kind"] in ("refill", "start_job"):
            paused.update(running_asked.intersection(d["config_ids"]))
    # a config HyperBand pauses while it is still queued is paused without leaving a pack
    assert paused and resumed <= asked and resumed, "HyperBand paused and resumed adapters"
    # HyperBand's losers: stopped while paused (or by its STOP inside a bracket), each at the
    # step it left its pack with, evaluated as it left (like every adapter)
    stopped = res[res["status"] == "stopped"]
    assert len(stopped) >= 1 and (stopped["steps"] < STEPS).all()
    assert stopped["eval_loss"].notna().all()
    stops = [d for d in decisions if d["kind"] == "stop_config"]
    assert {c for d in stops for c in d["config_ids"]} == set(stopped.index)
    asked = {c for d in decisions if d["kind"] == "pause_config" for c in d["config_ids"]}
    for d in stops:  # a trial stopped while paused: its adapter had left, or was about to
        if d["inputs"]["reason"] == "stopped_while_paused":
            assert d["inputs"]["was"] in ("paused", "running") and d["config_ids"][0] in asked
    assert res["steps"].sum() < len(LRS) * STEPS
    # a paused adapter's slot was refilled from the queue (its job went on with another). The
    # coordinator refills only a job that still trains a config: a first pack whose configs all
    # paused at once (all of HyperBand's second bracket: which trials share a pack follows
    # their registration order) ends instead, and the queue starts a job of its own
    started = [d for d in decisions if d["kind"] == "start_job" and d["config_ids"]][:2]
    left = {(d["job_id"], c) for d in decisions if d["kind"] == "config_paused"
            for c in d["config_ids"]}  # fmt: skip
    mixed = [d["job_id"] for d in started
             if 0 < sum((d["job_id"], c) in left for c in d["config_ids"]) < len(d["config_ids"])]  # fmt: skip
    assert not mixed or any(d["kind"] == "refill" and d["job_id"] in mixed for d in decisions)
    # a config paused and resumed ends exactly as if trained without a pause
    done_after_pause = [
        c for c in res.index if c in resumed & paused and res.loc[c, "status"] == "done"
    ]
    assert done_after_pause, res[["status", "steps"]]
    by_id = {r.metrics["config_id"]: r for r in results}
    for cid in done_after_pause:
        config = config_from_tune(by_id[cid].config, sweep, config_id=cid)
        w = json.loads((Path(res.loc[cid, "adapter_path"]) / "adapter.json").read_text())["w"]
        assert w == _uninterrupted_w(sweep, config, tmp_path / "ref" / cid)
        assert res.loc[cid, "steps"] == STEPS
    # what Tune saw of every trial moves forward only, and its last result says how it ended
    for r in results:
        hist = r.metrics_dataframe
        assert hist["adapter_step"].is_monotonic_increasing
    assert not (tmp_path / "hb" / "plora" / "paused").exists() or not any(
        (tmp_path / "hb" / "plora" / "paused").iterdir()
    )  # no train-state is left behind once every config ended


def test_a_soft_median_rule_pauses_lagging_adapters_and_tune_resumes_them(
    ray_cluster, tmp_path
) -> None:
    """``MedianStoppingRule(hard_stop=False)``: a lagging trial is paused (its adapter leaves its
    pack), Tune runs it again as soon as it can (a proxy needs no GPU), and the adapter rejoins a
    pack and trains to the end, ending as it would have without the pause.

    The rule judges a trial at step t only against trials that already reported t, so which trial
    lags must not hang on which job happens to run ahead (a CI run on 2026-11-27 paused none: the
    worst trial's job ran ahead of the other). Here Tune runs three trials at a time and the worst
    lr comes last: it starts once one of the others ended, they are all past its steps, and its
    first judged result (step 8) is worse than theirs."""
    from ray import tune
    from ray.tune.schedulers import MedianStoppingRule

    from plora.tune.scheduler import PLoRAScheduler
    from plora.tune.space import config_from_tune
    from plora.tune.trainable import plora_trainable

    sweep = _sweep("softmedian")
    # linger 10 s: the last trial registers after others ended, and the source must still take it
    trainable = plora_trainable(
        sweep, options=RunOptions(engine=PackFnEngine, calibration_steps=0), cost=cost_of(sweep),
        settle_s=1.0, linger_s=10.0,
    )  # fmt: skip
    rule = MedianStoppingRule(time_attr="adapter_step", grace_period=8, min_samples_required=2,
                              hard_stop=False)  # fmt: skip
    lrs = LRS[:4][::-1]  # trial 3, the last to start, has the smallest lr: it lags
    results = tune.Tuner(
        trainable,
        param_space={"lr": tune.grid_search(lrs), "rank": 4},
        tune_config=tune.TuneConfig(metric="loss", mode="min", scheduler=PLoRAScheduler(rule),
                                    max_concurrent_trials=3),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="msr", verbose=0),
    ).fit()  # fmt: skip
    assert len(results) == len(lrs) and not results.errors
    store = SweepStore(tmp_path / "msr" / "plora")
    res = store.read_results().set_index("config_id")
    assert set(res["status"]) == {"done"} and (res["steps"] == STEPS).all()  # nothing stopped
    decisions = store.read_decisions()
    # the rule's pauses: of an adapter inside a pack (it leaves with its train-state) or, when
    # the pause came first, of a config still queued; Tune resumes every one of them
    asked = {c for d in decisions if d["kind"] == "pause_config" for c in d["config_ids"]}
    resumed = {c for d in decisions if d["kind"] == "resume_config" for c in d["config_ids"]}
    assert asked and asked == resumed, (asked, resumed)
    by_id = {r.metrics["config_id"]: r for r in results}
    last = next(cid for cid, r in by_id.items() if r.config["lr"] == min(lrs))
    assert last in asked, (last, asked)
    for cid in asked:
        config = config_from_tune(by_id[cid].config, sweep, config_id=cid)
        w = json.loads((Path(res.loc[cid, "adapter_path"]) / "adapter.json").read_text())["w"]
        assert w == _uninterrupted_w(sweep, config, tmp_path / "ref" / cid)


def test_hyperopt_search_through_tuner_gives_one_row_per_config(ray_cluster, tmp_path) -> None:
    """``HyperOptSearch`` proposes configs (two at a time) that register as proxy trials; each
    gets its row in the ResultGrid and in results.parquet with the lr Tune gave it."""
    from ray.tune.search.hyperopt import HyperOptSearch

    from plora.tune.trainable import plora_trainable

    sweep = tune_sweep("hyperopttest")
    trainable = plora_trainable(
        sweep, options=RunOptions(engine=PackFnEngine, calibration_steps=0), cost=cost_of(sweep),
        settle_s=0.5, linger_s=5.0,
    )  # fmt: skip
    search = HyperOptSearch(random_state_seed=1)
    results = searched_tuner(tmp_path, "hyperopt", trainable, search).fit()
    assert len(results) == 4 and not results.errors
    df = results.get_dataframe()
    assert set(df["status"]) == {"done"} and df["config_id"].nunique() == 4
    res = SweepStore(tmp_path / "hyperopt" / "plora").read_results().set_index("config_id")
    assert sorted(res.index) == sorted(df["config_id"])
    for _, row in df.iterrows():
        assert res.loc[row["config_id"], "lr"] == row["config/lr"]
        assert res.loc[row["config_id"], "rank"] == row["config/rank"]
    assert len(set(df["config/lr"])) == 4  # the searcher's own proposals, not one repeated
    best = results.get_best_result()
    assert best.checkpoint is not None and best.metrics["loss"] == df["loss"].min()
