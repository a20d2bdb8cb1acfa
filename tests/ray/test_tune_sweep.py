"""Ray Tune against ``plora sweep``: one fp32 config through ``tune.Tuner`` equals the same
config of ``run_sweep`` (plora's engine on the tiny model), and a sweep's ``early_stop:``
section stops and refills without Tune's Tuner (``packfn.PackFnEngine``)."""

from __future__ import annotations

from pathlib import Path

from packfn import PackFnEngine
from tune_helpers import MAX_STEPS, cost_of, every_freed_slot_refilled_while_queued, tune_sweep

from plora.config import SweepConfig
from plora.runtime.driver import RunOptions
from plora.runtime.records import StaticSource
from plora.sweepdir.store import SweepStore


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

    trainable = plora_trainable(sweep, options=options, settle_s=0.2, linger_s=0.2,
                                name="plora-tune-fp32-first")  # fmt: skip
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
    # the Tuner is done: once its sweep ended, the next trainable lets its service go (a
    # notebook's Tuners leave one idle service, not one each), and release_services the rest
    import ray

    from plora.tune.trainable import release_services

    assert wait_until(lambda: ray.get(ray.get_actor("plora-tune-fp32-first").ended.remote()))
    plora_trainable(sweep, options=options, name="plora-tune-fp32-second")
    assert wait_until(lambda: not actor_exists("plora-tune-fp32-first"))
    assert actor_exists("plora-tune-fp32-second")
    release_services()
    assert wait_until(lambda: not actor_exists("plora-tune-fp32-second"))


def actor_exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    """Whether ``condition()`` became true within ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


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
    every_freed_slot_refilled_while_queued(decisions)
