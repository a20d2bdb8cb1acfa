"""A d = 2 job on two GPUs (NCCL, bf16) through the runtime, one rank killed mid-job.

The sweep of ``tests/ray/test_parallel_jobs.py`` (two configs on the built-in tiny model, GPU
memory set between what a config needs on one GPU and on two, so every job is d = 2) runs on a
local Ray cluster of the machine's two real GPUs: one resident 2-worker group, one NCCL process
group. Once a job has written a checkpoint, rank 1 is killed; the job must run again on a fresh
group from that checkpoint, no config lost, and every adapter must equal the same config
trained on one GPU (bf16: within the tolerance of the other NCCL tests). Needs two GPUs.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "ray"))
sys.path.insert(0, str(HERE.parent / "unit"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]
WEIGHT_RTOL = 5e-2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["tp", "pp"])
def test_a_killed_rank_of_a_d2_job_resumes_from_its_checkpoint(strategy, tmp_path) -> None:
    ray = pytest.importorskip("ray")
    from _engine_testlib import adapter_rel_err
    from safetensors.torch import load_file
    from test_parallel_jobs import CONFIGS, EVERY, STEPS, _forcing_d2, _reference, kill_rank_one

    from plora.config import Strategy
    from plora.runtime.driver import RunOptions, run_sweep
    from plora.runtime.records import StaticSource
    from plora.sweepdir.store import SweepStore

    sweep, cost = _forcing_d2(Strategy(strategy), "H100")
    ref_dir = tmp_path / "ref"
    _, ref_results = _reference(sweep, ref_dir)  # one GPU, bf16 autocast
    torch.cuda.empty_cache()
    out = tmp_path / "sweep"
    killed: dict[str, str] = {}
    ray.init(num_gpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})  # fmt: skip
    try:
        t = threading.Thread(target=kill_rank_one, args=(ray, out, killed, 400.0), daemon=True)
        t.start()
        summary = run_sweep(
            sweep, out, cost=cost, source=StaticSource(CONFIGS),
            options=RunOptions(checkpoint_every=EVERY, refill=False),
        )  # fmt: skip
        t.join(5)
    finally:
        ray.shutdown()
    assert killed, "the test never found a rank-1 worker to kill"
    assert summary.ok and summary.counts["done"] == len(CONFIGS)
    store = SweepStore(out)
    jobs = store.read_jobs()
    assert set(jobs["gpus"]) == {2} and set(jobs["strategy"]) == {strategy}
    died = jobs[jobs["status"] == "died"]
    assert len(died) >= 1
    m = store.read_metrics()
    for _, job in died.iterrows():  # each died job ran again to the end, from its checkpoint
        retry = jobs[(jobs["job_id"] == job["job_id"]) & (jobs["attempt"] == job["attempt"] + 1)]
        assert len(retry) == 1 and retry.iloc[0]["status"] == "done", retry.to_dict("records")
        again = m[(m["job_id"] == job["job_id"]) & (m["time"] >= retry.iloc[0]["start"])]
        first = again.groupby("config_id")["step"].min()
        assert len(first) and ((first - 1) % EVERY == 0).all(), first.to_dict()
    res = store.read_results().set_index("config_id")
    assert (res["status"] == "done").all() and (res["steps"] == STEPS).all()
    for c in CONFIGS:
        got = load_file(out / "adapters" / c.config_id / "adapter_model.safetensors")
        want = load_file(ref_dir / "adapters" / c.config_id / "adapter_model.safetensors")
        assert adapter_rel_err(got, want) < WEIGHT_RTOL, c.config_id
        loss = ref_results[c.config_id].eval_loss
        assert res.loc[c.config_id, "eval_loss"] == pytest.approx(loss, rel=2e-2)
