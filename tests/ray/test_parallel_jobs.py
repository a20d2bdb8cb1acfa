"""Jobs of d = 2 GPUs end to end: a sweep on 4 logical GPUs whose memory forces every job onto
two GPUs -- with tensor parallelism, then with pipeline parallelism -- runs each job as a
2-worker group (one gloo process group, plora's real engine on the built-in tiny model); one
worker of a running job is killed and the job restarts on a fresh 2-worker group from its
checkpoint; every adapter, every step's loss and gradient norm in ``metrics.parquet`` (under PP
the last stage's, reported by rank 0 on the first) and every eval loss equal training on one
process.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from plora.config import LoRAConfig, Strategy, SweepConfig
from plora.cost.memory import GIB

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "unit"))

STEPS = 80
EVERY = 10
CONFIGS = [
    LoRAConfig(config_id="p0", rank=4, alpha=8, lr=3e-3, batch_size=2, seed=1, max_steps=STEPS,
               target_modules=("q_proj", "v_proj", "o_proj")),
    LoRAConfig(config_id="p1", rank=8, alpha=16, lr=2e-3, batch_size=3, seed=2, max_steps=STEPS,
               target_modules=("gate_proj", "up_proj", "down_proj"), schedule="linear"),
]  # fmt: skip


def _sweep(gpu_memory_gib: float, strategy: Strategy, gpu_type: str = "cpu") -> SweepConfig:
    return SweepConfig.from_dict(
        {
            "name": "partest",
            "model": "tiny-qwen2",
            "dataset": {"builtin": "arithmetic", "num_examples": 64, "max_seq_len": 32},
            "space": {"lr": [1e-3], "rank": [4], "alpha": 8, "batch_size": 2, "max_steps": 5},
            "hardware": {
                "gpu_type": gpu_type,
                "num_gpus": 4 if gpu_type == "cpu" else 2,
                "gpu_memory_gib": gpu_memory_gib,
            },
            "planner": {"strategies": [str(strategy)]},
        }
    )


def _forcing_d2(strategy: Strategy, gpu_type: str = "cpu"):
    """The sweep and its cost model, with GPU memory between what one config needs on two
    GPUs with ``strategy`` and on one GPU: every job must be d = 2."""
    from plora.cost.build import build_cost_model

    probe = build_cost_model(_sweep(64.0, strategy, gpu_type), use_profile=False)
    per_gib = probe.capacity(1) / (64.0 * GIB)  # usable bytes per GiB of GPU memory
    one = min(probe.pack_memory([c], 1) for c in CONFIGS)
    two = max(probe.pack_memory([c], 2, strategy) for c in CONFIGS)
    assert two < one
    sweep = _sweep((one + two) / 2 / per_gib / GIB, strategy, gpu_type)
    cost = build_cost_model(sweep, use_profile=False)
    assert all(cost.pack_memory([c], 1) > cost.capacity(1) for c in CONFIGS)
    assert all(cost.pack_memory([c], 2, strategy) <= cost.capacity(2) for c in CONFIGS)
    return sweep, cost


def kill_rank_one(ray, out: Path, killed: dict[str, str], timeout_s: float) -> None:
    """Kill rank 1 of every running group of the ``partest`` sweep writing ``out``, once a job
    has a checkpoint (``killed``: the actors' names and namespaces)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if list(out.glob("checkpoints/*/state-*")):
            for a in ray.util.list_named_actors(all_namespaces=True):
                name = a["name"]
                if name.startswith("plora-partest-") and name.endswith("-r1"):
                    ray.kill(ray.get_actor(name, namespace=a["namespace"]), no_restart=True)
                    killed[name] = a["namespace"]
            if killed:
                return
        time.sleep(0.05)


class _Steps:
    """Hooks of the reference run: every step's metrics."""

    def __init__(self) -> None:
        self.metrics: dict[tuple[str, int], tuple[float, float]] = {}

    def on_step(self, report) -> None:
        for m in report.metrics:
            self.metrics[(m.config_id, m.step)] = (m.loss, m.grad_norm)

    def poll(self) -> None:
        return None


def _reference(sweep: SweepConfig, out: Path):
    """Each config trained by plora's engine in this process (one thread, as the workers):
    the adapters under ``out``, every step's ``(loss, grad norm)`` and each config's result."""
    import torch

    from plora.engine.api import EngineSpec, PackRequest
    from plora.engine.session import PackSession

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hooks, results = _Steps(), {}
    try:
        session = PackSession(EngineSpec(model=sweep.model, dataset=sweep.dataset))
        for c in CONFIGS:  # as the sweep runs them: one config per job
            request = PackRequest(job_id=f"ref-{c.config_id}", configs=(c,), out_dir=str(out))
            results.update(session.run(request, hooks).results)
    finally:
        torch.set_num_threads(threads)
    return hooks.metrics, results


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    sweep, _ = _forcing_d2(Strategy.TP)  # the model and data of every strategy's sweep
    out = tmp_path_factory.mktemp("ref")
    return (out, *_reference(sweep, out))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", [Strategy.TP, Strategy.PP], ids=str)
def test_d2_jobs_run_on_two_worker_groups_and_survive_a_killed_rank(
    strategy, ray_cluster, reference, tmp_path
):
    ray = ray_cluster
    from _engine_testlib import assert_same_adapter
    from safetensors.torch import load_file

    from plora.runtime.driver import RunOptions, run_sweep
    from plora.runtime.records import StaticSource
    from plora.sweepdir.store import SweepStore

    sweep, cost = _forcing_d2(strategy)
    out = tmp_path / "sweep"
    killed: dict[str, str] = {}

    t = threading.Thread(target=kill_rank_one, args=(ray, out, killed, 240.0), daemon=True)
    t.start()
    summary = run_sweep(
        sweep, out, cost=cost, source=StaticSource(CONFIGS),
        options=RunOptions(checkpoint_every=EVERY, refill=False),
    )  # fmt: skip
    t.join(5)
    assert killed, "the test never found a rank-1 worker to kill"
    assert summary.ok and summary.counts["done"] == len(CONFIGS)
    store = SweepStore(out)
    jobs = store.read_jobs()
    assert set(jobs["gpus"]) == {2} and set(jobs["strategy"]) == {str(strategy)}
    died = jobs[jobs["status"] == "died"]
    assert len(died) >= 1
    assert "retry" in [d["kind"] for d in store.read_decisions()]
    m = store.read_metrics()
    resumed = 0
    for _, job in died.iterrows():  # each died job ran again on 2 GPUs to the end
        retry = jobs[(jobs["job_id"] == job["job_id"]) & (jobs["attempt"] == job["attempt"] + 1)]
        assert len(retry) == 1 and retry.iloc[0]["status"] == "done", retry.to_dict("records")
        again = m[(m["job_id"] == job["job_id"]) & (m["time"] >= retry.iloc[0]["start"])]
        first = again.groupby("config_id")["step"].min()
        # from its checkpoint (every EVERY steps) or, with none yet, from the start
        assert len(first) and ((first - 1) % EVERY == 0).all(), first.to_dict()
        resumed += int((first > 1).all())
    assert resumed >= 1, "no killed job resumed from its checkpoint"
    res = store.read_results().set_index("config_id")
    assert (res["status"] == "done").all() and (res["steps"] == STEPS).all()
    ref, ref_steps, ref_results = reference
    # every step's loss and gradient norm as rank 0 reported them (a step trained twice: both)
    assert len(m) >= len(ref_steps)
    assert {(r.config_id, r.step) for r in m.itertuples()} == set(ref_steps)
    for r in m.itertuples():
        loss, norm = ref_steps[(r.config_id, r.step)]
        assert r.loss == pytest.approx(loss, rel=1e-5), (r.config_id, r.step)
        assert r.grad_norm == pytest.approx(norm, rel=1e-5, abs=1e-7), (r.config_id, r.step)
    for c in CONFIGS:  # evaluation on the group (under PP: the stages in turn)
        want = ref_results[c.config_id].eval_loss
        assert want is not None and res.loc[c.config_id, "eval_loss"] == pytest.approx(
            want, rel=1e-5
        )
    # every adapter equals one-process training (the killed and resumed one included)
    for c in CONFIGS:
        got = load_file(out / "adapters" / c.config_id / "adapter_model.safetensors")
        want = load_file(ref / "adapters" / c.config_id / "adapter_model.safetensors")
        assert_same_adapter(got, want)
        assert any(float(v.abs().max()) > 1e-4 for k, v in got.items() if "lora_B" in k)
