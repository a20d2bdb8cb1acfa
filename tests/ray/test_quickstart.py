"""End to end with plora's engine: ``plora sweep sweeps/quickstart.yaml`` on the test cluster."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


#: A hang guard, not a speed check (plora's speed is benchmarked, not tested): the quickstart
#: sweep takes minutes on 2 cores, about twice that beside a CPU-bound process.
SWEEP_TIMEOUT_S = 840


def plora(*args: str, timeout: float = SWEEP_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "plora"), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.timeout(SWEEP_TIMEOUT_S + 60)
def test_quickstart_sweep_trains_every_config_and_adapters_reload(ray_cluster, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from plora.analysis.plan_check import plan_check
    from plora.config import SweepConfig
    from plora.tune.space import expand

    address = ray_cluster.get_runtime_context().gcs_address
    out = tmp_path / "qs"
    proc = plora("sweep", "sweeps/quickstart.yaml", "--out", str(out), "--address", address)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # what the user reads is plora's: no page of torchao's CUDA-extension and torch.compile
    # warnings (transformers imports torchao, installed by the dev extra, in the tokenizer check)
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr
    from plora.sweepdir.lock import lock_path

    assert not lock_path(out).exists()  # the sweep's lock is released when it ends
    configs = expand(SweepConfig.from_yaml(ROOT / "sweeps/quickstart.yaml"))
    res = pd.read_parquet(out / "results.parquet").set_index("config_id")
    assert sorted(res.index) == sorted(c.config_id for c in configs)
    assert (res["status"] == "done").all()
    assert res["eval_metric"].notna().all() and res["eval_loss"].notna().all()
    assert ((res["eval_metric"] >= 0) & (res["eval_metric"] <= 1)).all()
    for c in configs:
        row = res.loc[c.config_id]
        assert row["steps"] == c.max_steps and row["rank"] == c.rank and row["lr"] == c.lr
    # the tables are what plora.sweepdir.schema says: columns in order, dtypes
    from plora.sweepdir import schema

    for name, dtypes in schema.TABLES.items():
        table = pd.read_parquet(out / name)
        assert dict(table.dtypes.astype(str)) == dtypes, name
    m = pd.read_parquet(out / "metrics.parquet")
    assert m.groupby("config_id")["step"].max().to_dict() == {
        c.config_id: c.max_steps for c in configs
    }
    assert (m["attempt"] == 0).all() and not m.duplicated(["config_id", "step"]).any()
    data = json.loads((out / "data.json").read_text())  # what tokenizing did to each split
    assert data["train"]["rows"] == 2000 and data["eval"]["rows"] == 200
    assert data["train"]["dropped"] == data["eval"]["dropped"] == 0
    # the quickstart grid holds a deliberately bad lr (3e-2): training at the good lr (1e-3)
    # must reduce the loss (mean of the last 10 steps vs the first 10) for every such config
    losses = m.sort_values("step").groupby("config_id")["loss"]
    first, last = (
        losses.apply(lambda s: s.iloc[:10].mean()),
        losses.apply(lambda s: s.iloc[-10:].mean()),
    )
    good = res.index[res["lr"] == res["lr"].min()]
    assert len(good) >= 2 and (last[good] < first[good]).all()
    # and hyperparameters matter: the best config beats the worst clearly on the eval metric
    assert res["eval_metric"].max() - res["eval_metric"].min() >= 0.1

    # live curves by default: `tensorboard --logdir out` finds a run per config, named by its
    # id and the hyperparameters the space varies, with every tag at every step
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(out))
    mux.Reload()
    runs = {run.split("/")[-1].split("_")[0]: run for run in mux.Runs()}
    assert set(runs) == {c.config_id for c in configs}
    tags = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss",
            "eval/exact_match"}  # fmt: skip
    for c in configs:
        run = runs[c.config_id]
        assert run.startswith("tensorboard/") and f"rank={c.rank}" in run and "lr=" in run
        assert set(mux.GetAccumulator(run).Tags()["scalars"]) == tags
        assert [e.step for e in mux.Scalars(run, "train/loss")] == list(range(1, c.max_steps + 1))
        (ev,) = mux.Scalars(run, "eval/exact_match")
        assert ev.value == pytest.approx(res.loc[c.config_id, "eval_metric"])
        assert "_hparams_/session_start_info" in mux.PluginRunToTagToContent("hparams")[run]

    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ref = base(ids).logits
    for c in configs:  # every adapter reloads with PEFT on the saved base model
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(out / "base_model"), out / "adapters" / c.config_id
        )
        with torch.no_grad():
            assert not torch.allclose(model(ids).logits, ref)  # the trained adapter changes outputs

    # the plan tells the truth (issue 10: within 25 %) once it plans from this host's own
    # measurements (DESIGN decision 3): the second sweep plans from what the first one stored in
    # the profile store. Its makespan (worker start, model load, steps and evaluation timed at
    # the width the data's rows pad to, export, checkpoints; Ray's own start is before the sweep
    # clock and in neither) against the sweep's time from the plan to sweep_done. The first
    # sweep plans from the CPU defaults, measured on another 2-core box (plora.cost.overheads):
    # there 1.07-1.13 of the measured 4.9-5.9 s, but on the box of 2026-11-26 (Intel Xeon,
    # AVX512) 0.38-0.59 of 8.0-9.4 s in this test -- a default holds only for the host it was
    # measured on, so the first plan's accuracy is a benchmark, not asserted here.
    first = plan_check(out)
    assert first.planned_s > 0 and first.measured_s > 0
    assert f"taken from it ({first.ratio:.2f}x)" in proc.stdout  # the sweep's last lines say it
    # On a 2-core host the same sweep's phases vary from run to run: the same 100 steps took
    # 3.6-5.3 s (the fastest step of a sweep 0.032-0.044 s: the whole sweep runs slower, not a
    # few steps), evaluation 0.6-1.3 s, the workers were ready 0.8-2.8 s after the plan
    # (2026-11-27, this test's cluster, benchmarks/quickstart_plan.py), while one process
    # alone repeats a fixed workload within 5 %. A plan from the store is the last sweep's
    # draw (plora.cost.recency: the newest sweep decides against one or two before it), so
    # one plan against one sweep measures the host twice: a CI run saw 1.37x, then 0.69x. Two
    # sweeps planned from the store are set against their two measured times together (the
    # host's draws in them largely cancel); a plan that is wrong misses both. Within 25 %, or
    # within the spread of the three sweeps' measured times when the host varies more (each
    # plan is an earlier sweep's draw): beside a CPU burner (2026-11-28) the workers were ready
    # 10.8 s after the first sweep's plan and 4.1 s after the next one's, and the plans from
    # them 2.06x and 0.87x. A steady host that plans wrong still fails.
    checks = []
    for name in ("qs2", "qs3"):
        again = plora("sweep", "sweeps/quickstart.yaml", "--out", str(tmp_path / name),
                      "--address", address)  # fmt: skip
        assert again.returncode == 0, again.stderr[-2000:]
        checks.append(plan_check(tmp_path / name))
    planned, measured = sum(c.planned_s for c in checks), sum(c.measured_s for c in checks)
    draws = [first.measured_s, *(c.measured_s for c in checks)]
    tol = max(0.25, (max(draws) - min(draws)) / min(draws))
    assert abs(planned - measured) <= tol * measured, ([c.describe() for c in checks], draws)

    status = plora("status", str(out))
    assert (
        status.returncode == 0
        and "done 8" in status.stdout
        and "best by eval_metric" in status.stdout
        and f"first plan vs the run: {first.describe()}" in status.stdout
    )


def test_engine_job_survives_a_killed_worker(ray_cluster, tmp_path) -> None:
    """ray.kill the worker of a real packed job mid-training: the job restarts from its
    train-state checkpoint (no step 1 again) and every config completes."""
    import threading

    import ray

    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model
    from plora.runtime.driver import RunOptions, run_sweep
    from plora.runtime.records import StaticSource
    from plora.sweepdir.store import SweepStore
    from plora.tune.space import expand

    sweep = SweepConfig.from_yaml(ROOT / "sweeps/quickstart.yaml")
    configs = [c for c in expand(sweep) if c.rank == 4][:3]
    out = tmp_path / "kill"
    killed: dict[str, str] = {}

    def killer() -> None:
        deadline = time.time() + 180
        while time.time() < deadline:
            if list(out.glob("checkpoints/*/state-*/train_state.pt")):
                for a in ray.util.list_named_actors(all_namespaces=True):
                    if a["name"].startswith("plora-quickstart-") and a["name"].endswith("-w1-r0"):
                        ray.kill(
                            ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True
                        )
                        killed["name"] = a["name"]
                        return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    summary = run_sweep(
        sweep, out, cost=build_cost_model(sweep, use_profile=False), source=StaticSource(configs),
        options=RunOptions(checkpoint_every=10),
    )  # fmt: skip
    t.join(5)
    assert killed and summary.ok and summary.counts["done"] == 3
    store = SweepStore(out)
    jobs = store.read_jobs().sort_values("start")
    assert list(jobs["status"]) == ["died", "done"] and list(jobs["attempt"]) == [0, 1]
    m = store.read_metrics()
    second = m[m["time"] >= jobs.iloc[1]["start"]]
    assert second.groupby("config_id")["step"].min().min() > 10  # resumed, not from step 1
    res = store.read_results().set_index("config_id")
    assert (res["status"] == "done").all() and (res["steps"] == 100).all()
    assert res["eval_metric"].notna().all()
    for c in configs:
        assert (out / "adapters" / c.config_id / "adapter_model.safetensors").is_file()
    assert not list((out / "checkpoints").glob("*"))  # a finished job's train-state is dropped


def test_24_configs_run_concurrently_within_8_gpus(ray_cluster, tmp_path) -> None:
    """24 configs of the tiny model on 8 logical GPUs: several jobs at once, never more than 8
    GPUs, every config trained exactly once to its step count (read back from the sweep dir)."""
    import dataclasses

    from test_runtime import overlap_max

    from plora.config import SweepConfig
    from plora.cost.build import build_cost_model
    from plora.runtime.driver import RunOptions, run_sweep
    from plora.runtime.records import StaticSource
    from plora.sweepdir.store import SweepStore
    from plora.tune.space import expand

    sweep = SweepConfig.from_yaml(ROOT / "sweeps/quickstart.yaml")
    sweep = dataclasses.replace(sweep, hardware=dataclasses.replace(sweep.hardware, num_gpus=8))
    cs = [
        dataclasses.replace(c, config_id=f"{c.config_id}-s{s}", seed=s, max_steps=20 + 5 * s)
        for s in range(3)
        for c in expand(sweep)
    ]
    out = tmp_path / "sweep"
    summary = run_sweep(
        sweep, out, cost=build_cost_model(sweep, use_profile=False), source=StaticSource(cs),
        options=RunOptions(checkpoint_every=None),
    )  # fmt: skip
    assert summary.ok and summary.counts["done"] == 24
    store = SweepStore(out)
    jobs = store.read_jobs()
    assert (jobs["status"] == "done").all() and jobs["node"].notna().all()
    # export: the seconds spent (snapshots + background writes) and the part the job waited for
    assert (jobs["export_s"] > 0).all() and (jobs["export_critical_s"] > 0).all()
    assert (jobs["export_critical_s"] <= jobs["export_s"] + 0.1).all()
    n_at_once, gpus_at_once = overlap_max(jobs)
    assert n_at_once >= 2 and gpus_at_once <= 8
    for _, j in jobs.iterrows():  # booked GPU ids are distinct among overlapping jobs
        over = jobs[(jobs["start"] < j["end"]) & (jobs["end"] > j["start"])]
        ids = [g for gl in over["gpu_ids"] for g in gl]
        assert len(ids) == len(set(ids)) and all(0 <= g < 8 for g in ids)
    assert sorted(c for cl in jobs["config_ids"] for c in cl) == sorted(c.config_id for c in cs)
    res = store.read_results().set_index("config_id")
    assert len(res) == 24 and (res["status"] == "done").all() and res["eval_metric"].notna().all()
    for c in cs:
        assert res.loc[c.config_id, "steps"] == c.max_steps
        assert (out / "adapters" / c.config_id / "adapter_model.safetensors").is_file()
    m = store.read_metrics()
    assert m.groupby("config_id")["step"].max().to_dict() == {c.config_id: c.max_steps for c in cs}
    assert not m.duplicated(["config_id", "step"]).any() and len(m) == sum(c.max_steps for c in cs)
    decisions = store.read_decisions()
    kinds = [d["kind"] for d in decisions]
    assert kinds.count("start_job") == len(jobs) and kinds[-2:] == ["sweep_done", "timeline"]
    # a calibration a few steps into the first job, then every finished job refits the cost model
    triggers = [d["inputs"]["trigger"] for d in decisions if d["kind"] == "refit"]
    assert triggers == ["calibration"] + ["job done"] * len(jobs)
    assert kinds.count("start_workers") == kinds.count("workers_ready") <= 8
    for ready in (d["inputs"] for d in decisions if d["kind"] == "workers_ready"):
        parts = ready["load_parts"]  # the engine's load by part, each within it
        assert set(parts) == {"import", "model", "kernels", "data"}
        assert all(v >= 0 for v in parts.values())
        assert sum(parts.values()) <= ready["load_s"] + ready["build_s"] + 1e-3
    assert store.plan_json.is_file() and (out / "base_model" / "config.json").is_file()
    assert not list(tmp_path.glob(".sweep.tmp-*"))


def test_each_data_line_once_on_the_console(ray_cluster, tmp_path) -> None:
    """Issue 29: a 2-worker sweep whose rows are cut to ``max_seq_len`` says so once (it was
    logged as the data loaded and printed again as the sweep ended)."""
    import yaml

    sweep = yaml.safe_load((ROOT / "sweeps" / "quickstart.yaml").read_text())
    sweep["dataset"] = {"path": str(ROOT / "plora" / "data" / "reverse_200.jsonl"),
                        "max_seq_len": 20}  # fmt: skip
    sweep["space"].update(max_steps=3, warmup_steps=0, lr=[1e-3], rank=[4, 8])
    sweep["hardware"]["num_gpus"] = 2
    path = tmp_path / "cut.yaml"
    path.write_text(yaml.safe_dump(sweep))
    address = ray_cluster.get_runtime_context().gcs_address
    proc = plora("sweep", str(path), "--out", str(tmp_path / "cut"), "--address", address)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith("data: ")]
    assert lines and len(lines) == len(set(lines)), proc.stdout + proc.stderr
    assert any("cut to dataset.max_seq_len=20" in x for x in lines), lines
