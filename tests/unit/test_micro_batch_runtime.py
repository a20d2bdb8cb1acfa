"""A planned job's micro-batches reach the engine: plan job -> JobSpec -> PackRequest ->
the trainer (and the kernel warm-up), and jobs.parquet / state.json / the decision log keep it."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from runtime_fakes import GreedyPlanner, lora, make

from plora.config import ConfigError, DatasetSpec, LoRAConfig, ModelRef
from plora.engine.api import EngineSpec, PackRequest
from plora.runtime.records import Decision, FailureKind
from plora.sweepdir.store import SweepStore


class MicroPlanner(GreedyPlanner):
    """GreedyPlanner whose packs of two or more configs run in 2 micro-batches."""

    def _schedule(self, packs, cost, gpu_free_at):
        plan = super()._schedule(packs, cost, gpu_free_at)
        jobs = []
        for j, p in zip(plan.jobs, packs, strict=True):
            if len(p) > 1:
                rows = sum(c.batch_size for c in p)
                j = dataclasses.replace(j, micro_batches=2, max_rows=-(-rows // 2))
            jobs.append(j)
        return dataclasses.replace(plan, jobs=tuple(jobs))


def _micro_coordinator(configs, store=None, gpus=1):
    coord, clock = make(configs, gpus=gpus, store=store)
    coord.planner = MicroPlanner()
    return coord, clock


def test_the_plan_jobs_rows_per_forward_reach_the_job_spec_and_the_records(tmp_path):
    store = SweepStore(tmp_path)
    configs = [lora(i, rank=8, batch=3) for i in range(3)]  # 9 rows: ⌈9/2⌉ = 5 per forward
    coord, _ = _micro_coordinator(configs, store=store)
    (spec,) = coord.start()
    assert len(spec.configs) == 3 and spec.max_rows == 5 and spec.micro_batches == 2
    plans = [d for d in coord.decisions if d.kind in (Decision.PLAN, Decision.REPLAN)]
    assert plans[-1].inputs["jobs"][0]["micro_batches"] == 2  # the decision log shows it
    assert plans[-1].inputs["jobs"][0]["max_rows"] == 5
    row = next(r for r in coord.job_rows if r["job_id"] == spec.job_id)
    assert row["micro_batches"] == 2
    coord.persist()
    import pandas as pd

    assert pd.read_parquet(store.jobs_parquet)["micro_batches"].tolist() == [2]
    # --resume relaunches the interrupted job with its rows per forward
    state = store.read_state()
    assert state["interrupted"][0]["max_rows"] == 5
    coord2, _ = _micro_coordinator(configs, store=store)
    coord2.set_state(state)
    (resumed,) = coord2.start()
    assert resumed.resume and resumed.job_id == spec.job_id and resumed.max_rows == 5


def test_a_retried_or_split_job_keeps_its_rows_per_forward():
    configs = [lora(i, rank=8, batch=2) for i in range(3)]
    coord, _ = _micro_coordinator(configs)
    (spec,) = coord.start()
    assert len(spec.configs) == 3 and spec.max_rows == 3
    (retry,) = coord.on_job_failed(spec.job_id, FailureKind.DIED, "worker died")
    assert retry.resume and retry.max_rows == 3
    assert coord.running[retry.job_id].plan_job.micro_batches == 2  # its ETA's forwards
    (half, *_) = coord.on_job_failed(retry.job_id, FailureKind.OOM, "out of memory")
    assert half.max_rows == 3 and len(half.configs) < 3


def test_the_dispatcher_puts_the_jobs_rows_per_forward_in_its_request(tmp_path):
    from plora.runtime.actors.dispatch import Dispatcher
    from plora.runtime.records import JobSpec

    fake = SimpleNamespace(
        store=SimpleNamespace(root=tmp_path, checkpoints_dir=tmp_path / "checkpoints"),
        options=SimpleNamespace(checkpoint_every=None, checkpoint_every_s=None, poll_every_s=0.0),
    )
    spec = JobSpec(job_id="j1", configs=(lora(0), lora(1)), gpus=1, max_rows=3)
    request = Dispatcher._request(fake, spec)  # type: ignore[arg-type]
    assert request.max_rows == 3
    assert Dispatcher._request(fake, dataclasses.replace(spec, max_rows=None)).max_rows is None


def test_request_rows_limit_and_validation(tmp_path):
    cfg = (lora(0),)
    assert PackRequest(job_id="j", configs=cfg, out_dir=".", max_rows=4).rows_limit(None) == 4
    assert PackRequest(job_id="j", configs=cfg, out_dir=".", max_rows=4).rows_limit(2) == 2
    assert PackRequest(job_id="j", configs=cfg, out_dir=".").rows_limit(6) == 6
    assert PackRequest(job_id="j", configs=cfg, out_dir=".").rows_limit(None) is None
    with pytest.raises(ConfigError, match="max_rows"):
        PackRequest(job_id="j", configs=cfg, out_dir=".", max_rows=0)


DATA = DatasetSpec(builtin="arithmetic", num_examples=48, max_seq_len=48, eval_fraction=0.1)


def _cfg(cid: str, **kw) -> LoRAConfig:
    base = dict(rank=4, alpha=8, lr=5e-3, batch_size=2, max_steps=3, seed=len(cid))
    return LoRAConfig(config_id=cid, **{**base, **kw})


class _Profiles:
    def __init__(self) -> None:
        self.reports = []

    def on_step(self, report) -> None:
        self.reports.append(report)

    def poll(self):
        from plora.engine import Control

        return Control()


@pytest.mark.usefixtures("one_thread")
def test_a_requests_max_rows_runs_that_job_in_micro_batches_on_a_resident_session(tmp_path):
    """The same resident session runs one job in micro-batches of the request's max_rows and
    the next job with every row live; the micro-batched job trains the same losses."""
    from plora.engine import PackSession

    session = PackSession(EngineSpec(model=ModelRef(name_or_path="tiny-qwen2"), dataset=DATA))
    pack = (_cfg("a"), _cfg("bb", rank=8))  # 4 rows per step
    micro, whole = _Profiles(), _Profiles()
    session.run(PackRequest(job_id="j1", configs=pack, out_dir=str(tmp_path / "m"), max_rows=1,
                            evaluate=False), micro)  # fmt: skip
    session.run(PackRequest(job_id="j2", configs=pack, out_dir=str(tmp_path / "w"),
                            evaluate=False), whole)  # fmt: skip
    assert [r.profile.micro_batches for r in micro.reports] == [4, 4, 4]
    assert [r.profile.micro_batches for r in whole.reports] == [1, 1, 1]
    assert all(r.profile.rows == 4 for r in micro.reports + whole.reports)
    got = [m.loss for r in micro.reports for m in r.metrics]
    want = [m.loss for r in whole.reports for m in r.metrics]
    assert got == pytest.approx(want, rel=1e-4)


def test_the_warm_up_child_gets_the_jobs_rows_per_forward(monkeypatch):
    import plora.engine.warmup as warmup

    jobs = []
    monkeypatch.setattr(warmup.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(warmup, "spawn_warmup", lambda job: jobs.append(job) or "proc")
    spec = EngineSpec(model=ModelRef(name_or_path="tiny-qwen2"), dataset=DATA, device="cuda")
    request = PackRequest(job_id="j", configs=(_cfg("a"),), out_dir=".", max_rows=3)
    assert warmup.start_warmup(spec, request) == "proc"
    assert warmup.start_warmup(dataclasses.replace(spec, max_rows=2), request) == "proc"
    no_limit = dataclasses.replace(request, max_rows=None)
    assert warmup.start_warmup(spec, no_limit) == "proc"
    assert [j["max_rows"] for j in jobs] == [3, 2, None]
