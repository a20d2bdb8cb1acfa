"""Job actor groups: the torch.distributed group of a job's workers, d > 1 refusal, and
control through the coordinator relay (stop one adapter of a running job)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from packfn import PackFnEngine
from test_runtime import configs, cost_of, tiny_sweep

from plora.runtime.actors.group import UnsupportedJobError, _worker_cls, start_group
from plora.runtime.driver import RunOptions, run_sweep
from plora.runtime.records import StaticSource
from plora.sweepdir.store import SweepStore


def test_workers_form_a_gloo_group(ray_cluster) -> None:
    ray = ray_cluster
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"GPU": 1, "CPU": 0.25}] * 2, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    workers = [
        _worker_cls()
        .options(
            num_gpus=1, num_cpus=0.25,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=r),
        )
        .remote(rank=r, world_size=2, relay=None)
        for r in range(2)
    ]  # fmt: skip
    try:
        info = ray.get(workers[0].node_info.remote())
        port = ray.get(workers[0].free_port.remote())
        assert ray.get([w.init_group.remote(info.ip, port) for w in workers]) == ["gloo"] * 2
        assert ray.get(
            [w.all_reduce_check.remote(float(r + 1)) for r, w in enumerate(workers)]
        ) == [3.0, 3.0]
        gpu_ids = [ray.get(w.node_info.remote()).gpu_ids for w in workers]
        assert len({g[0] for g in gpu_ids}) == 2  # one logical GPU each
    finally:
        for w in workers:
            ray.kill(w)
        remove_placement_group(pg)


def test_multi_gpu_groups_are_refused_loudly() -> None:
    from plora.engine.api import EngineSpec

    spec = EngineSpec(model=tiny_sweep().model, dataset=tiny_sweep().dataset)
    for strategy in (None, "zero3"):  # none, or one the runtime does not run (tp, fsdp, pp)
        with pytest.raises(
            UnsupportedJobError, match=r"d=2 GPUs.*runs d > 1 jobs with fsdp, fsdp_offload, pp, tp"
        ):
            start_group(
                (0, 1), strategy=strategy, relay=None, engine=PackFnEngine, spec=spec, name="g"
            )


def test_stop_one_adapter_of_a_running_job(ray_cluster, tmp_path) -> None:
    ray = ray_cluster
    sweep = tiny_sweep(num_gpus=1, name="stoptest")
    cs = configs(2, steps=60)
    out = tmp_path / "sweep"
    sent: dict[str, int] = {}

    def stopper() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            ck = list(out.glob("checkpoints/*/state.json"))
            if ck and json.loads(ck[0].read_text())["k00"]["step"] >= 5:
                for a in ray.util.list_named_actors(all_namespaces=True):
                    if a["name"].startswith("plora-stoptest-") and a["name"].endswith(
                        "-coordinator"
                    ):
                        relay = ray.get_actor(a["name"], namespace=a["namespace"])
                        view = ray.get(relay.config_view.remote("k00"))
                        ray.get(relay.stop_config.remote("k00"))
                        sent["k00"] = view["last"]["step"] if view["last"] else 0
                        return
            time.sleep(0.05)

    t = threading.Thread(target=stopper, daemon=True)
    t.start()
    summary = run_sweep(
        sweep, out, cost=cost_of(sweep), source=StaticSource(cs),
        options=RunOptions(engine=PackFnEngine, checkpoint_every=5),
    )  # fmt: skip
    t.join(5)
    assert sent and sent["k00"] >= 1  # the relay's view of a config follows its steps
    res = SweepStore(out).read_results().set_index("config_id")
    assert res.loc["k00", "status"] == "stopped" and 5 <= res.loc["k00", "steps"] < 60
    assert res.loc["k01", "status"] == "done" and res.loc["k01", "steps"] == cs[1].max_steps
    assert summary.counts["stopped"] == 1 and summary.counts["done"] == 1
    kinds = [d["kind"] for d in SweepStore(out).read_decisions()]
    assert "stop_config" in kinds


def test_oom_pack_is_split_in_halves_and_completes(ray_cluster, tmp_path) -> None:
    import dataclasses

    sweep = tiny_sweep(num_gpus=1, name="oomtest")
    cs = [dataclasses.replace(c, config_id=f"oom{i}") for i, c in enumerate(configs(4, steps=10))]
    out = tmp_path / "sweep"
    summary = run_sweep(
        sweep, out, cost=cost_of(sweep), source=StaticSource(cs),
        options=RunOptions(engine=PackFnEngine, refill=False),
    )  # fmt: skip
    assert summary.ok and summary.counts["done"] == 4
    store = SweepStore(out)
    split = [d for d in store.read_decisions() if d["kind"] == "split_oom"]
    assert len(split) == 1 and sorted(len(p) for p in split[0]["inputs"]["into"].values()) == [2, 2]
    jobs = store.read_jobs().sort_values("start")
    assert list(jobs["status"]) == ["oom", "done", "done"]
    assert sorted(len(c) for c in jobs["config_ids"]) == [2, 2, 4]


def test_resident_worker_serves_successive_jobs_with_one_model_load(ray_cluster, tmp_path) -> None:
    """One GPU, packs that cannot share a job (refill off): every job after the first runs on
    the same resident worker -- one model load for the sweep, charged to the first job."""
    sweep = tiny_sweep(num_gpus=1, name="residenttest")
    cs = configs(6, steps=6)
    out = tmp_path / "sweep"
    summary = run_sweep(
        sweep, out, cost=cost_of(sweep), source=StaticSource(cs),
        options=RunOptions(engine=PackFnEngine, refill=False, ask_batch=2),
    )  # fmt: skip
    assert summary.ok and summary.counts["done"] == 6
    store = SweepStore(out)
    jobs = store.read_jobs().sort_values("start")
    assert len(jobs) >= 3  # ask_batch 2: at least three successive jobs
    assert set(jobs["model_loads"]) == {1}
    assert jobs.iloc[0]["load_s"] > 0 and (jobs.iloc[1:]["load_s"] == 0).all()
    assert (jobs["train_s"] > 0).all() and jobs["node"].notna().all()
    kinds = [d["kind"] for d in store.read_decisions()]
    assert kinds.count("start_workers") == 1 and kinds.count("workers_ready") == 1
